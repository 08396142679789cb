//! The chaos harness: ledger events with duplicates through real `ledger`
//! pollers while faults are injected, then a check of the whole history.
//!
//! Against LocalStack on this machine it sends `CHAOS_EVENTS` events (default
//! 2,000; half to a standard queue, half to a FIFO queue) of which
//! `CHAOS_DUPLICATES` (default 0.3) are sent again, some right away and some
//! later (after every original is sent, plus `CHAOS_LATE_SECS`); runs
//! `CHAOS_POLLERS` `ledger` processes (default 4, half per queue; FIFO events in
//! `CHAOS_FIFO_GROUPS` message groups, default 5) whose AWS
//! traffic goes through a fault-injecting HTTP proxy; and on a schedule:
//! SIGKILLs and restarts a poller, SIGTERMs and restarts one, loses responses
//! after the request committed, delays responses past the SDK's 5 s attempt
//! timeout, refuses connections for 3 s, and lets handlers panic on 1% of
//! attempts. When both queues are drained it checks: every event applied exactly
//! once (its `seq` appears once in its account's `applied_seq`, balances equal the
//! sums), none lost (applied, or parked in the DLQ with a reason), FIFO order
//! kept within each group, and no record left short of `COMPLETED`. It prints one
//! line of figures and fails on any violation.
//!
//! `cargo test` runs the quick size; `scripts/chaos` runs the nightly size.
//! `CHAOS_DEDUP_KEY=message-id` (a key re-sent events do not share) must make
//! it fail with doubled events: the check of the checker.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Mutex;

#[path = "../support/mod.rs"]
mod support;
use support::{depth, env_or};

const LEDGER: &str = env!("CARGO_BIN_EXE_ledger");

/// A small deterministic generator (xorshift64*), so a run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() % 1_000_000) as f64 / 1_000_000.0 < p
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

// ---------------------------------------------------------------- the proxy

/// Faults the proxy injects, and how many it did.
#[derive(Default)]
struct Faults {
    /// Per mille of write responses lost after the write was applied.
    lose_permille: AtomicU32,
    /// Per mille of DynamoDB responses held past the client's timeout.
    slow_permille: AtomicU32,
    /// Refuse every new connection while set.
    refusing: AtomicBool,
    lost: AtomicU64,
    slowed: AtomicU64,
    refused: AtomicU64,
    rng: std::sync::Mutex<Option<Rng>>,
}

impl Faults {
    fn roll(&self, permille: &AtomicU32) -> bool {
        let p = permille.load(Ordering::Relaxed);
        p > 0
            && self
                .rng
                .lock()
                .unwrap()
                .get_or_insert(Rng(0x9E37_79B9_7F4A_7C15))
                .next()
                % 1000
                < u64::from(p)
    }
}

/// Writes whose response may be lost after they were applied.
const LOSABLE: &[&str] = &[
    "DynamoDB_20120810.UpdateItem",
    "DynamoDB_20120810.TransactWriteItems",
    "AmazonSQS.DeleteMessageBatch",
    "AmazonSQS.ChangeMessageVisibility",
    "AmazonSQS.SendMessage",
];

/// An HTTP proxy in front of LocalStack that injects [`Faults`].
async fn proxy(upstream: String, faults: Arc<Faults>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let client: HttpClient<HttpConnector, Full<Bytes>> =
        HttpClient::builder(TokioExecutor::new()).build_http();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            if faults.refusing.load(Ordering::Relaxed) {
                faults.refused.fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            }
            let (client, upstream, faults) = (client.clone(), upstream.clone(), faults.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    forward(req, client.clone(), upstream.clone(), faults.clone())
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[derive(Debug)]
struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("response dropped by the chaos proxy")
    }
}

impl std::error::Error for Dropped {}

async fn forward(
    req: hyper::Request<hyper::body::Incoming>,
    client: HttpClient<HttpConnector, Full<Bytes>>,
    upstream: String,
    faults: Arc<Faults>,
) -> Result<hyper::Response<Full<Bytes>>, Dropped> {
    let target = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
    let uri = format!(
        "{upstream}{}",
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let mut out = hyper::Request::builder().method(parts.method).uri(uri);
    for (k, v) in &parts.headers {
        if k != hyper::header::HOST {
            out = out.header(k, v);
        }
    }
    let out = out.body(Full::new(body)).map_err(|_| Dropped)?;
    let response = client.request(out).await.map_err(|_| Dropped)?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
    if LOSABLE.contains(&target.as_str()) && faults.roll(&faults.lose_permille) {
        // Applied upstream; the client sees the connection close instead.
        faults.lost.fetch_add(1, Ordering::Relaxed);
        return Err(Dropped);
    }
    if target.starts_with("DynamoDB_") && faults.roll(&faults.slow_permille) {
        faults.slowed.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_secs(6)).await;
    }
    Ok(hyper::Response::from_parts(parts, Full::new(body)))
}

// -------------------------------------------------------------- the pollers

struct Pollers {
    children: Vec<Option<tokio::process::Child>>,
    started: Vec<Instant>,
    envs: Vec<Vec<(String, String)>>,
    panics: Arc<AtomicU64>,
}

impl Pollers {
    fn spawn(&mut self, i: usize) {
        let mut c = tokio::process::Command::new(LEDGER);
        c.envs(self.envs[i].iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = c.spawn().expect("start ledger");
        let stderr = child.stderr.take().unwrap();
        let panics = self.panics.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.contains("handler panicked") {
                    panics.fetch_add(1, Ordering::Relaxed);
                } else if line.contains("ERROR") && std::env::var_os("CHAOS_VERBOSE").is_some() {
                    eprintln!("{line}");
                }
            }
        });
        self.children[i] = Some(child);
        self.started[i] = Instant::now();
    }

    async fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill().await;
        }
        self.spawn(i);
    }

    /// SIGTERM, wait for the drain, restart. False when it did not exit 0 in 30 s.
    async fn terminate(&mut self, i: usize) -> bool {
        // A signal that arrives before a process has installed any handler kills
        // it whatever the program does: give a just-(re)started poller 2 s.
        let settled = self.started[i] + Duration::from_secs(2);
        tokio::time::sleep_until(settled.into()).await;
        let mut clean = true;
        if let Some(mut c) = self.children[i].take() {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
            let exited = tokio::time::timeout(Duration::from_secs(30), c.wait()).await;
            clean = matches!(exited, Ok(Ok(s)) if s.success());
            if !clean {
                eprintln!("chaos: a poller did not exit 0 within 30 s of SIGTERM: {exited:?}");
                let _ = c.kill().await;
            }
        }
        self.spawn(i);
        clean
    }

    async fn stop_all(&mut self) {
        for c in self.children.iter_mut() {
            if let Some(c) = c.as_mut()
                && let Some(pid) = c.id()
            {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
        for c in self.children.iter_mut() {
            if let Some(mut c) = c.take() {
                let _ = tokio::time::timeout(Duration::from_secs(30), c.wait()).await;
                let _ = c.kill().await;
            }
        }
    }
}

// ------------------------------------------------------------------ the run

#[derive(Clone)]
struct Event {
    seq: u64,
    account: String,
    amount: i64,
    fifo: bool,
    body: String,
}

async fn send(sqs: &aws_sdk_sqs::Client, url: &str, fifo: bool, batch: &[&Event]) {
    for chunk in batch.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut b = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&e.body);
                if fifo {
                    // A fresh deduplication id per send: SQS must not drop the
                    // copy, so that sqs-once's own dedup is what is tested.
                    b = b
                        .message_group_id(&e.account)
                        .message_deduplication_id(uuid::Uuid::new_v4().simple().to_string());
                }
                b.build().unwrap()
            })
            .collect();
        let out = sqs
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(out.failed().is_empty(), "send failed: {:?}", out.failed());
    }
}

/// (account -> (balance, applied_events, applied_seq)) of a ledger table.
async fn ledger(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
) -> BTreeMap<String, (i64, i64, Vec<u64>)> {
    let mut out = BTreeMap::new();
    let mut pages = ddb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        let n = |k: &str| {
            item.get(k)
                .and_then(|v| v.as_n().ok())
                .map_or(0, |v| v.parse().unwrap())
        };
        let seqs = item
            .get("applied_seq")
            .and_then(|v| v.as_l().ok())
            .map(|l| {
                l.iter()
                    .map(|v| v.as_n().unwrap().parse().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        out.insert(
            item["pk"].as_s().unwrap().clone(),
            (n("balance_cents"), n("applied_events"), seqs),
        );
    }
    out
}

/// Parked messages as (seq, reason).
async fn parked(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    loop {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(300)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            return out;
        }
        for m in got {
            let body: serde_json::Value =
                serde_json::from_str(m.body().unwrap_or("{}")).unwrap_or_default();
            let reason = m
                .message_attributes()
                .and_then(|a| a.get("sqs_once_reason"))
                .and_then(|v| v.string_value())
                .unwrap_or("")
                .to_owned();
            out.push((body["seq"].as_u64().unwrap_or(u64::MAX), reason));
        }
    }
}

fn skip_for_filter() -> bool {
    // `cargo test <filter>` passes the filter to every test binary: run only
    // when no filter is given or it names this harness.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    !filters.is_empty() && !filters.iter().any(|f| "chaos".contains(f.as_str()))
}

fn main() {
    if skip_for_filter() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ok = runtime.block_on(run());
    if !ok {
        std::process::exit(1);
    }
}

async fn run() -> bool {
    let started = Instant::now();
    let events_n: usize = env_or("CHAOS_EVENTS", 2000);
    let dup_rate: f64 = env_or("CHAOS_DUPLICATES", 0.3);
    let pollers_n: usize = env_or("CHAOS_POLLERS", 4).max(2);
    let late_secs: u64 = env_or("CHAOS_LATE_SECS", 10);
    let fifo_groups: usize = env_or("CHAOS_FIFO_GROUPS", 5usize).max(1);
    // `message-id` here shows the checker catching doubles (re-sent events get
    // new message ids).
    let dedup_key: String = env_or("CHAOS_DEDUP_KEY", "json:/id".to_owned());
    let mut rng = Rng(env_or("CHAOS_SEED", 0x5EED_u64) | 1);

    let endpoint =
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(&endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "chaos",
        ))
        .load()
        .await;
    let (sqs, ddb) = (
        aws_sdk_sqs::Client::new(&sdk),
        aws_sdk_dynamodb::Client::new(&sdk),
    );
    let run_id = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dedup = format!("chaos-dedup-{run_id}");
    sqs_once::setup::ensure_dedup_table(&ddb, &dedup)
        .await
        .unwrap();
    let mut queues = HashMap::new();
    let mut ledgers = HashMap::new();
    for fifo in [false, true] {
        let name = format!("chaos-{run_id}-{}", if fifo { "fifo" } else { "std" });
        let pair =
            sqs_once::setup::ensure_queue_with_dlq(&sqs, &name, fifo, Duration::from_secs(10), 50)
                .await
                .unwrap();
        queues.insert(fifo, pair);
        let table = format!("{name}-ledger");
        sqs_once::setup::ensure_table(&ddb, &table).await.unwrap();
        ledgers.insert(fifo, table);
    }

    // Events: the first half to the standard queue (7 accounts), the second to
    // the FIFO queue (CHAOS_FIFO_GROUPS groups, default 5, one account each).
    let events: Vec<Event> = (0..events_n)
        .map(|i| {
            let fifo = i >= events_n / 2;
            let account = if fifo {
                format!("group-{}", i % fifo_groups)
            } else {
                format!("acct-{}", i % 7)
            };
            let amount = (i as i64 * 7919) % 1000 + 1;
            let body = json!({"id": format!("evt-{i}"), "account": account, "amount_cents": amount, "seq": i}).to_string();
            Event {
                seq: i as u64,
                account,
                amount,
                fifo,
                body,
            }
        })
        .collect();
    let mut first_wave: HashMap<bool, Vec<&Event>> = HashMap::new();
    let mut late_wave: HashMap<bool, Vec<&Event>> = HashMap::new();
    let (mut immediate, mut late) = (0, 0);
    for e in &events {
        first_wave.entry(e.fifo).or_default().push(e);
        if rng.chance(dup_rate) {
            if rng.chance(0.5) {
                first_wave.entry(e.fifo).or_default().push(e);
                immediate += 1;
            } else {
                late_wave.entry(e.fifo).or_default().push(e);
                late += 1;
            }
        }
    }

    let faults = Arc::new(Faults::default());
    let proxy_url = proxy(endpoint.clone(), faults.clone()).await;
    let panics = Arc::new(AtomicU64::new(0));
    let mut pollers = Pollers {
        children: Vec::new(),
        started: Vec::new(),
        envs: Vec::new(),
        panics: panics.clone(),
    };
    for i in 0..pollers_n {
        let fifo = i % 2 == 1;
        let q = &queues[&fifo];
        let env: Vec<(String, String)> = [
            ("AWS_ENDPOINT_URL", proxy_url.as_str()),
            ("AWS_REGION", "us-east-1"),
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("SQS_ONCE_QUEUE_URL", &q.queue_url),
            ("SQS_ONCE_DLQ_URL", &q.dlq_url),
            ("SQS_ONCE_TABLE", &dedup),
            (
                "SQS_ONCE_CONSUMER",
                if fifo { "chaos-fifo" } else { "chaos-std" },
            ),
            ("SQS_ONCE_DEDUP_KEY", dedup_key.as_str()),
            ("SQS_ONCE_LEASE", "10s"),
            ("SQS_ONCE_HEARTBEAT", "3s"),
            ("SQS_ONCE_BACKOFF", "1s"),
            ("SQS_ONCE_WAIT", "2s"),
            ("SQS_ONCE_DRAIN", "5s"),
            ("SQS_ONCE_BATCH_WAIT", "200ms"),
            ("SQS_ONCE_METRICS_INTERVAL", "0s"),
            ("LEDGER_TABLE", &ledgers[&fifo]),
            ("LEDGER_PANIC_PERCENT", "1"),
            ("RUST_LOG", "error"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        pollers.envs.push(env);
        pollers.children.push(None);
        pollers.started.push(Instant::now());
        pollers.spawn(i);
    }
    let pollers = Arc::new(Mutex::new(pollers));

    // Faults on a schedule until the queues drain.
    faults.lose_permille.store(20, Ordering::Relaxed);
    faults.slow_permille.store(3, Ordering::Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let (kills, terms) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let unclean_stops = Arc::new(AtomicU64::new(0));
    let scheduler = {
        let (pollers, faults, stop) = (pollers.clone(), faults.clone(), stop.clone());
        let (kills, terms, unclean) = (kills.clone(), terms.clone(), unclean_stops.clone());
        let mut rng = Rng(rng.next() | 1);
        tokio::spawn(async move {
            let mut tick = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_secs(1)).await;
                tick += 1;
                if tick.is_multiple_of(7) {
                    let i = rng.below(pollers_n);
                    pollers.lock().await.kill(i).await;
                    kills.fetch_add(1, Ordering::Relaxed);
                }
                if tick.is_multiple_of(11) {
                    let i = rng.below(pollers_n);
                    if !pollers.lock().await.terminate(i).await {
                        unclean.fetch_add(1, Ordering::Relaxed);
                    }
                    terms.fetch_add(1, Ordering::Relaxed);
                }
                if tick % 30 == 15 {
                    faults.refusing.store(true, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    faults.refusing.store(false, Ordering::Relaxed);
                }
            }
        })
    };

    for fifo in [false, true] {
        send(&sqs, &queues[&fifo].queue_url, fifo, &first_wave[&fifo]).await;
    }
    tokio::time::sleep(Duration::from_secs(late_secs)).await;
    for fifo in [false, true] {
        if let Some(batch) = late_wave.get(&fifo) {
            send(&sqs, &queues[&fifo].queue_url, fifo, batch).await;
        }
    }

    // Drained: both queues empty on three reads in a row, within the deadline.
    let deadline = Instant::now() + Duration::from_secs(300 + events_n as u64 / 5);
    let mut empty_reads = 0;
    let mut drained = false;
    while Instant::now() < deadline {
        let total = depth(&sqs, &queues[&false].queue_url).await
            + depth(&sqs, &queues[&true].queue_url).await;
        empty_reads = if total == 0 { empty_reads + 1 } else { 0 };
        if empty_reads >= 3 {
            drained = true;
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = scheduler.await;
    faults.refusing.store(false, Ordering::Relaxed);
    pollers.lock().await.stop_all().await;

    // The checker.
    let mut violations = Vec::new();
    let unclean = unclean_stops.load(Ordering::Relaxed);
    if unclean > 0 {
        violations.push(format!("{unclean} poller(s) did not exit 0 after SIGTERM"));
    }
    if !drained {
        violations.push("the queues did not drain before the deadline".to_owned());
    }
    let mut parked_seqs = HashMap::new();
    for fifo in [false, true] {
        for (seq, reason) in parked(&sqs, &queues[&fifo].dlq_url).await {
            if reason.is_empty() {
                violations.push(format!("event {seq} parked without a reason"));
            }
            parked_seqs.insert(seq, reason);
        }
    }
    let mut applied_count: HashMap<u64, u64> = HashMap::new();
    let mut order_violations = 0;
    let mut books: BTreeMap<String, (i64, i64, Vec<u64>)> = BTreeMap::new();
    for fifo in [false, true] {
        for (account, (balance, applied, seqs)) in ledger(&ddb, &ledgers[&fifo]).await {
            if fifo && seqs.windows(2).any(|w| w[0] >= w[1]) {
                order_violations += 1;
                violations.push(format!("group {account} applied out of order"));
            }
            if applied as usize != seqs.len() {
                violations.push(format!(
                    "{account}: applied_events {applied} but {} seqs",
                    seqs.len()
                ));
            }
            for s in &seqs {
                *applied_count.entry(*s).or_default() += 1;
            }
            books.insert(account, (balance, applied, seqs));
        }
    }
    let mut expected: BTreeMap<&str, i64> = BTreeMap::new();
    let (mut lost, mut doubled, mut applied_once) = (0u64, 0u64, 0u64);
    for e in &events {
        match applied_count.get(&e.seq).copied().unwrap_or(0) {
            0 if parked_seqs.contains_key(&e.seq) => {}
            0 => lost += 1,
            1 => {
                applied_once += 1;
                *expected.entry(&e.account).or_default() += e.amount;
            }
            n => {
                doubled += n - 1;
                *expected.entry(&e.account).or_default() += e.amount;
            }
        }
    }
    for (account, want) in &expected {
        let got = books.get(*account).map_or(0, |b| b.0);
        if got != *want && doubled == 0 {
            violations.push(format!("{account}: balance {got}, expected {want}"));
        }
    }
    if lost > 0 {
        violations.push(format!("{lost} event(s) lost"));
    }
    if doubled > 0 {
        violations.push(format!("{doubled} event(s) applied more than once"));
    }
    let mut not_completed = 0;
    let mut pages = ddb
        .scan()
        .table_name(&dedup)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        if item
            .get("status")
            .and_then(|v| v.as_s().ok())
            .map(String::as_str)
            != Some("COMPLETED")
        {
            not_completed += 1;
        }
    }
    // A parked event may leave a FAILED record; anything else short of
    // COMPLETED is a claim that was never finished.
    if not_completed > parked_seqs.len() {
        violations.push(format!(
            "{not_completed} dedup record(s) left short of COMPLETED"
        ));
    }

    println!(
        "chaos: {} events ({} standard, {} FIFO), {} duplicates ({immediate} immediate, {late} late), {} pollers; \
         faults: {} SIGKILL, {} SIGTERM, {} lost responses, {} slow responses, {} refused connections, {} handler panics; \
         applied {applied_once}, parked {}, lost {lost}, doubled {doubled}, FIFO order violations {order_violations}, \
         unfinished records {}; {:.0} s",
        events_n,
        events_n / 2,
        events_n - events_n / 2,
        immediate + late,
        pollers_n,
        kills.load(Ordering::Relaxed),
        terms.load(Ordering::Relaxed),
        faults.lost.load(Ordering::Relaxed),
        faults.slowed.load(Ordering::Relaxed),
        faults.refused.load(Ordering::Relaxed),
        panics.load(Ordering::Relaxed),
        parked_seqs.len(),
        not_completed.saturating_sub(parked_seqs.len()),
        started.elapsed().as_secs_f64(),
    );
    for v in &violations {
        println!("VIOLATION: {v}");
    }
    violations.is_empty()
}
