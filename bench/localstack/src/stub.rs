//! A local stub of SQS and DynamoDB with a fixed delay per call, to measure a
//! consumer's own CPU per message with no emulator in the loop.
//!
//! `stub [--messages N] [--duplicates RATE] [--delay-ms MS] [--window A,B] [--body-bytes B] -- COMMAND [ARG ...]`
//!
//! It serves the SQS JSON protocol and DynamoDB's JSON 1.0 protocol over
//! HTTP on 127.0.0.1 (a free port) from the simulator's in-process models
//! (`sqs_once_sim::wire`: `ReceiveMessage`, `DeleteMessage(Batch)`,
//! `ChangeMessageVisibility(Batch)`, `SendMessage`, `GetQueueAttributes`;
//! `TransactWriteItems`, `UpdateItem`, `PutItem`, `GetItem`,
//! `DescribeTable`, `DescribeTimeToLive`), each answer held back by the
//! fixed delay (default 2 ms). A receive answers only the system attributes
//! it asked for, as SQS does. The queue is filled with N ledger events
//! (default 20,000 messages, `RATE` of the events sent twice, default 0.3,
//! shuffled with a fixed seed; with `--body-bytes`, each body padded with
//! spaces after the JSON to B bytes) before COMMAND starts; COMMAND gets
//! `AWS_ENDPOINT_URL`, `QUEUE_URL`/`SQS_ONCE_QUEUE_URL`,
//! `DEDUP_TABLE`/`SQS_ONCE_TABLE`, `LEDGER_TABLE` and test credentials.
//!
//! The consumer's CPU (utime + stime of /proc/PID/stat, all its threads) is
//! read when the first A of the messages are deleted and again at B (default
//! 0.1 and 0.9): start-up and the idle tail are outside the window. Once the
//! queue is empty the consumer is sent SIGTERM; then the ledger is checked
//! (each account's sum and count of events, each event applied exactly once,
//! nothing left in the queue) and one JSON line is printed. Exit status 1 if
//! the check fails.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use serde_json::{Value, json};
use sqs_once::MemoryQueue;
use sqs_once::queue::OutgoingMessage;
use sqs_once::testkit::queue::{QueueSettings, SendOptions};
use sqs_once_sim::wire::dynamodb::DynamoModel;
use sqs_once_sim::wire::expr::{Av, Item};
use sqs_once_sim::wire::sqs::SqsModel;

mod events;

const DEDUP: &str = "stub-dedup";
const LEDGER: &str = "stub-ledger";

struct Args {
    messages: usize,
    duplicates: f64,
    delay: Duration,
    window: (f64, f64),
    /// Each body padded to this many bytes (0: as the events are).
    body_bytes: usize,
    command: Vec<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        messages: 20_000,
        duplicates: 0.3,
        delay: Duration::from_millis(2),
        window: (0.1, 0.9),
        body_bytes: 0,
        command: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--" {
            a.command = it.collect();
            break;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--messages" => a.messages = v.parse().map_err(|e| bad(&e))?,
            "--duplicates" => a.duplicates = v.parse().map_err(|e| bad(&e))?,
            "--body-bytes" => a.body_bytes = v.parse().map_err(|e| bad(&e))?,
            "--delay-ms" => {
                a.delay = Duration::from_secs_f64(v.parse::<f64>().map_err(|e| bad(&e))? / 1e3)
            }
            "--window" => {
                let (x, y) = v.split_once(',').ok_or(bad(&"A,B"))?;
                a.window = (
                    x.parse().map_err(|e| bad(&e))?,
                    y.parse().map_err(|e| bad(&e))?,
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.command.is_empty() {
        return Err("no command after --".into());
    }
    Ok(a)
}

/// The services behind the HTTP front.
#[derive(Clone)]
struct Stub {
    sqs: SqsModel,
    ddb: DynamoModel,
    delay: Duration,
    /// Calls answered and request bytes received, by operation, over the
    /// whole run.
    calls: Arc<Mutex<BTreeMap<String, (u64, u64)>>>,
}

impl Stub {
    async fn answer(&self, target: &str, body: &[u8]) -> (u16, Value, Option<String>) {
        let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let op = target.rsplit_once('.').map_or(target, |(_, op)| op);
        {
            let mut calls = self.calls.lock().expect("calls lock");
            let c = calls.entry(op.to_owned()).or_default();
            c.0 += 1;
            c.1 += body.len() as u64;
        }
        tokio::time::sleep(self.delay).await;
        if let Some(op) = target.strip_prefix("AmazonSQS.") {
            let mut a = self.sqs.handle(op, &request).await;
            if op == "ReceiveMessage" {
                only_asked_for(&request, &mut a.body);
            }
            (a.status, a.body, a.query_error)
        } else {
            let op = target.rsplit_once('.').map_or(target, |(_, op)| op);
            let a = self.ddb.handle(op, &request);
            (a.status, a.body, None)
        }
    }
}

/// Keeps only the system attributes a receive asked for
/// (`MessageSystemAttributeNames`, or `All`), as SQS answers.
fn only_asked_for(request: &Value, body: &mut Value) {
    let asked: Vec<&str> = ["MessageSystemAttributeNames", "AttributeNames"]
        .iter()
        .filter_map(|k| request.get(*k).and_then(Value::as_array))
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if asked.contains(&"All") {
        return;
    }
    let messages = body.get_mut("Messages").and_then(Value::as_array_mut);
    for m in messages.into_iter().flatten() {
        if let Some(attrs) = m.get_mut("Attributes").and_then(Value::as_object_mut) {
            attrs.retain(|k, _| asked.contains(&k.as_str()));
        }
    }
}

async fn serve_one(
    stub: Stub,
    req: Request<hyper::body::Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let target = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let (status, value, query_error) = stub.answer(&target, &body).await;
    let mut r = Response::new(Full::new(Bytes::from(
        serde_json::to_vec(&value).unwrap_or_default(),
    )));
    *r.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    let h = r.headers_mut();
    h.insert(
        "content-type",
        "application/x-amz-json-1.0"
            .parse()
            .expect("a header value"),
    );
    h.insert("x-amzn-requestid", "stub".parse().expect("a header value"));
    if let Some(q) = query_error.and_then(|q| q.parse().ok()) {
        h.insert("x-amzn-query-error", q);
    }
    Ok(r)
}

async fn serve(listener: tokio::net::TcpListener, stub: Stub) {
    while let Ok((stream, _)) = listener.accept().await {
        let _ = stream.set_nodelay(true);
        let stub = stub.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| serve_one(stub.clone(), req));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The events: `messages` in all, `rate` of the distinct events sent
/// twice (see [`events::events`]).
fn events(messages: usize, rate: f64) -> (Vec<String>, HashMap<String, (i64, i64)>) {
    let n = ((messages as f64) / (1.0 + rate)).round() as usize;
    events::events(n, rate)
}

/// utime + stime of `pid` (all its threads), seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let f: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

/// Each account's (sum, count) in the ledger table.
fn ledger_sums(ddb: &DynamoModel) -> HashMap<String, (i64, i64)> {
    let num = |item: &Item, k: &str| match item.get(k) {
        Some(Av::N(n)) => n.parse().unwrap_or(0),
        _ => 0,
    };
    ddb.items(LEDGER)
        .iter()
        .filter_map(|item| match item.get("pk") {
            Some(Av::S(pk)) => Some((
                pk.clone(),
                (num(item, "balance_cents"), num(item, "applied_events")),
            )),
            _ => None,
        })
        .collect()
}

/// `body` followed by spaces up to `bytes` long (unchanged when it is that
/// long already): still the same JSON document, for a consumer whose event
/// type refuses unknown fields.
fn padded(mut body: String, bytes: usize) -> String {
    let pad = bytes.saturating_sub(body.len());
    body.extend(std::iter::repeat_n(' ', pad));
    body
}

fn fill(queue: &MemoryQueue, bodies: &[String]) -> String {
    let mut settings = QueueSettings::new("stub");
    settings.visibility_timeout = Duration::from_secs(30);
    let url = queue
        .create_queue(settings)
        .expect("the stub queue's settings are valid");
    for body in bodies {
        let m = OutgoingMessage {
            body: body.clone(),
            ..Default::default()
        };
        queue
            .send_with(&url, m, SendOptions::default())
            .expect("the stub queue takes every message");
    }
    url
}

/// Starts the consumer with the stub's endpoint and names.
fn start(args: &Args, addr: SocketAddr, url: &str) -> tokio::process::Child {
    tokio::process::Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("AWS_ENDPOINT_URL", format!("http://{addr}"))
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("QUEUE_URL", url)
        .env("SQS_ONCE_QUEUE_URL", url)
        .env("DEDUP_TABLE", DEDUP)
        .env("SQS_ONCE_TABLE", DEDUP)
        .env("LEDGER_TABLE", LEDGER)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {:?}: {e}", args.command))
}

/// The steady window: (messages, CPU seconds, wall seconds) between the
/// window's two marks; waits until the queue is empty.
async fn watch(
    queue: &MemoryQueue,
    url: &str,
    total: usize,
    pid: u32,
    window: (f64, f64),
) -> (usize, f64, f64) {
    let done = || total - queue.counts(url).map_or(0, |c| c.stored());
    let marks = [
        (total as f64 * window.0) as usize,
        (total as f64 * window.1) as usize,
    ];
    let mut at = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(1800);
    while done() < total && Instant::now() < deadline {
        if at.len() < 2 && done() >= marks[at.len()] {
            at.push((done(), cpu_secs(pid), Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    match at[..] {
        [(m0, c0, t0), (m1, c1, t1)] => (m1 - m0, c1 - c0, t1.duration_since(t0).as_secs_f64()),
        _ => (0, 0.0, 0.0),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("stub: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let queue = MemoryQueue::new();
    let (bodies, expected) = events(args.messages, args.duplicates);
    let bodies: Vec<String> = bodies
        .into_iter()
        .map(|b| padded(b, args.body_bytes))
        .collect();
    let url = fill(&queue, &bodies);
    let ddb = DynamoModel::new();
    ddb.create_table(
        DEDUP,
        sqs_once::aws::dynamodb::KEY_ATTRIBUTE,
        Some(sqs_once::aws::dynamodb::TTL_ATTRIBUTE),
    );
    ddb.create_table(LEDGER, "pk", None);
    let calls = Arc::new(Mutex::new(BTreeMap::new()));
    let stub = Stub {
        sqs: SqsModel::new(queue.clone()),
        ddb: ddb.clone(),
        delay: args.delay,
        calls: calls.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("a bound address");
    tokio::spawn(serve(listener, stub));
    let mut child = start(&args, addr, &url);
    let pid = child.id().unwrap_or(0);
    let (n, cpu, wall) = watch(&queue, &url, bodies.len(), pid, args.window).await;
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    let left = queue.counts(&url).map_or(0, |c| c.stored());
    let sums = ledger_sums(&ddb);
    let ok = left == 0 && sums == expected;
    let per_message: serde_json::Map<String, Value> = calls
        .lock()
        .expect("calls lock")
        .iter()
        .map(|(op, (n, _))| (op.clone(), json!(*n as f64 / bodies.len() as f64)))
        .collect();
    let bytes_per_call: serde_json::Map<String, Value> = calls
        .lock()
        .expect("calls lock")
        .iter()
        .map(|(op, (n, b))| (op.clone(), json!(b / n.max(&1))))
        .collect();
    println!(
        "{}",
        json!({
            "command": args.command.join(" "),
            "messages": bodies.len(),
            "delay_ms": args.delay.as_secs_f64() * 1e3,
            "window_messages": n,
            "window_cpu_s": cpu,
            "window_wall_s": wall,
            "cpu_us_per_message": cpu * 1e6 / n.max(1) as f64,
            "messages_per_s": n as f64 / wall.max(1e-9),
            "left_in_queue": left,
            "ledger_ok": ok,
            "calls_per_message": per_message,
            "request_bytes_per_call": bytes_per_call,
        })
    );
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
