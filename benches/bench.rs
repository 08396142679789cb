//! Side-by-side benchmarks on the same LocalStack, in one run: `bench/run`.
//!
//! Absolute times on a shared 2-core machine are noise; what is reported is
//! ratios of runs made alternately, and counts that do not depend on speed
//! (AWS calls per message, bytes). Every throughput run checks the ledger
//! sums, so a fast wrong run cannot count.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use serde_json::json;
use sqs_once::calls::CallCounter;
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::poller::PollerConfig;
use sqs_once::{DynamoStore, Processor, handler_fn};
use sqs_once_cli::setup::{QueuePair, ensure_dedup_table, ensure_queue_with_dlq, ensure_table};
use sqs_once_example_ledger::LedgerHandler;
use tokio_util::sync::CancellationToken;

#[path = "../tests/support/mod.rs"]
mod support;
use support::{depth, env_or, ledger_rows, send_all, unique};

/// The `ledger` binary (built once: [`support::binary`]).
fn ledger() -> std::path::PathBuf {
    support::binary("ledger")
}

fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into())
}

async fn sdk() -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(endpoint())
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "bench",
        ))
        .load()
        .await
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Ledger events: `n` distinct over 10 accounts (each with a distinct amount),
/// `dup_rate` of them sent twice.
/// Returns the bodies (shuffled deterministically) and the expected sums.
fn events(n: usize, dup_rate: f64) -> (Vec<String>, HashMap<String, (i64, i64)>) {
    let mut bodies = Vec::new();
    let mut expected: HashMap<String, (i64, i64)> = HashMap::new();
    let every = if dup_rate > 0.0 {
        (1.0 / dup_rate).round() as usize
    } else {
        usize::MAX
    };
    for i in 0..n {
        let account = format!("acct-{}", i % 10);
        // Every event its own amount: one lost and one doubled event of an
        // account cannot cancel out in its sum.
        let amount = i as i64 + 1;
        let e = expected.entry(account.clone()).or_default();
        e.0 += amount;
        e.1 += 1;
        let body = json!({"id": format!("evt-{i}"), "account": account, "amount_cents": amount})
            .to_string();
        if i % every == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    (bodies, expected)
}

struct Setup {
    queues: QueuePair,
    dedup: String,
    ledger: String,
}

async fn fresh(sqs: &aws_sdk_sqs::Client, ddb: &aws_sdk_dynamodb::Client) -> Setup {
    let ledger = unique("bench-ledger");
    ensure_table(ddb, &ledger).await.unwrap();
    let dedup = unique("bench-dedup");
    ensure_dedup_table(ddb, &dedup).await.unwrap();
    let queues = ensure_queue_with_dlq(sqs, &unique("bench"), false, Duration::from_secs(30), 5)
        .await
        .unwrap();
    Setup {
        queues,
        dedup,
        ledger,
    }
}

/// Waits until the queue is empty; panics past the deadline.
async fn drained(sqs: &aws_sdk_sqs::Client, url: &str, deadline: Duration) {
    let until = Instant::now() + deadline;
    while depth(sqs, url).await > 0 {
        assert!(Instant::now() < until, "the queue did not drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// --- the three consumers compared -------------------------------------------

/// sqs-once: the library poller with the ledger handler, in this process.
async fn run_sqs_once(
    sdk: &SdkConfig,
    s: &Setup,
    fast: bool,
    concurrency: usize,
    messages: usize,
) -> (f64, BTreeMap<String, u64>) {
    let calls = CallCounter::default();
    let sqs = aws_sdk_sqs::Client::from_conf(calls.sqs_config(sdk));
    let ddb = aws_sdk_dynamodb::Client::from_conf(calls.dynamodb_config(sdk));
    let mut config = ProcessorConfig::new("bench");
    config.key_source = "json:/id".parse().unwrap();
    config.fast_path = fast;
    let processor = Processor::new(
        DynamoStore::new(ddb, s.dedup.as_str()),
        LedgerHandler::new(&s.ledger),
        config,
    )
    .unwrap();
    let mut pc = PollerConfig::new(&s.queues.queue_url);
    pc.concurrency = concurrency;
    pc.wait_time = Duration::from_secs(1);
    pc.dlq_url = Some(s.queues.dlq_url.clone());
    let stop = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(sqs_once::poller::run(
        sqs.clone(),
        processor,
        pc,
        stop.clone(),
    ));
    drained(&sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
    let secs = started.elapsed().as_secs_f64();
    stop.cancel();
    let stats = task.await.unwrap();
    assert_eq!(
        stats.received as usize, messages,
        "received every message once: {stats:?}"
    );
    let mut per_op = calls.snapshot();
    if let Some(r) = per_op.get_mut("SQS.ReceiveMessage") {
        *r -= stats.empty_receives;
    }
    per_op.retain(|op, _| !op.contains(".Describe") && !op.ends_with("GetQueueAttributes"));
    (messages as f64 / secs, per_op)
}

/// A plain Rust loop: receive 10, apply (one UpdateItem each), delete in a
/// batch; no dedup. Same SDK, same concurrency.
async fn run_plain(sdk: &SdkConfig, s: &Setup, concurrency: usize, messages: usize) -> f64 {
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let started = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.div_ceil(10) {
        let (sqs, ddb, done) = (sqs.clone(), ddb.clone(), done.clone());
        let (url, table) = (s.queues.queue_url.clone(), s.ledger.clone());
        workers.spawn(async move {
            let mut idle = 0;
            while idle < 2 {
                let got = sqs
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .send()
                    .await
                    .unwrap()
                    .messages
                    .unwrap_or_default();
                if got.is_empty() {
                    idle += 1;
                    continue;
                }
                idle = 0;
                let applies = got.iter().map(|m| {
                    let e: serde_json::Value = serde_json::from_str(m.body().unwrap()).unwrap();
                    ddb.update_item()
                        .table_name(&table)
                        .key(
                            "pk",
                            AttributeValue::S(e["account"].as_str().unwrap().into()),
                        )
                        .update_expression("ADD balance_cents :a, applied_events :one")
                        .expression_attribute_values(
                            ":a",
                            AttributeValue::N(e["amount_cents"].to_string()),
                        )
                        .expression_attribute_values(":one", AttributeValue::N("1".into()))
                        .send()
                });
                for r in futures::future::join_all(applies).await {
                    r.unwrap();
                }
                let entries = got
                    .iter()
                    .enumerate()
                    .map(|(i, m)| {
                        DeleteMessageBatchRequestEntry::builder()
                            .id(format!("m{i}"))
                            .receipt_handle(m.receipt_handle().unwrap())
                            .build()
                            .unwrap()
                    })
                    .collect();
                sqs.delete_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .unwrap();
                done.fetch_add(got.len(), std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    drained(&sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
    let secs = started.elapsed().as_secs_f64();
    while workers.join_next().await.is_some() {}
    assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), messages);
    messages as f64 / secs
}

/// Powertools for AWS Lambda (Python): `idempotent_function` with its DynamoDB
/// persistence layer around the same ledger update, 10 threads.
fn run_powertools(python: &str, s: &Setup, concurrency: usize, messages: usize) -> f64 {
    let started = Instant::now();
    let out = std::process::Command::new(python)
        .arg(format!(
            "{}/bench/powertools_loop.py",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("QUEUE_URL", &s.queues.queue_url)
        .env("LEDGER_TABLE", &s.ledger)
        .env("IDEMPOTENCY_TABLE", format!("{}-pt", s.dedup))
        .env("CONCURRENCY", concurrency.to_string())
        .env("AWS_ENDPOINT_URL", endpoint())
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .stderr(Stdio::inherit())
        .output()
        .expect("run bench/powertools_loop.py");
    assert!(out.status.success(), "powertools loop failed");
    let secs = started.elapsed().as_secs_f64();
    let done: usize = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    assert_eq!(done, messages, "powertools loop handled every message");
    messages as f64 / secs
}

fn rss_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// utime + stime of a process, seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

fn descendants(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
        out.extend(descendants(c));
    }
    out
}

fn localstack_cpu() -> f64 {
    let pidfile = format!(
        "{}/localstack/.state/localstack.pid",
        env!("CARGO_MANIFEST_DIR")
    );
    let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|p| p.trim().parse().ok())
    else {
        return f64::NAN;
    };
    descendants(pid).into_iter().map(cpu_secs).sum()
}

/// The release `ledger` binary for `s`; its stderr is piped when `watch`
/// (read it, or the process blocks once the pipe is full), else discarded.
fn ledger_command(s: &Setup, extra: &[(&str, &str)], watch: bool) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(ledger());
    c.env("SQS_ONCE_QUEUE_URL", &s.queues.queue_url)
        .env("SQS_ONCE_DLQ_URL", &s.queues.dlq_url)
        .env("SQS_ONCE_TABLE", &s.dedup)
        .env("SQS_ONCE_CONSUMER", "bench")
        .env("SQS_ONCE_DEDUP_KEY", "json:/id")
        .env("SQS_ONCE_WAIT", "1s")
        .env("SQS_ONCE_METRICS_INTERVAL", "0s")
        .env("LEDGER_TABLE", &s.ledger)
        .env("AWS_ENDPOINT_URL", endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(if watch { Stdio::piped() } else { Stdio::null() })
        .kill_on_drop(true);
    for (k, v) in extra {
        c.env(k, v);
    }
    c
}

fn terminate(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
}

/// The benchmark report: every line is printed as it comes and kept for
/// `BENCH_REPORT`.
#[derive(Default)]
struct Report(Vec<String>);

impl Report {
    fn say(&mut self, line: String) {
        println!("{line}");
        self.0.push(line);
    }
}

/// What the sections share: the clients and the sizes (`BENCH_*`).
struct Bench {
    sdk: SdkConfig,
    sqs: aws_sdk_sqs::Client,
    ddb: aws_sdk_dynamodb::Client,
    calls_events: usize,
    tp_events: usize,
    rounds: usize,
    python: Option<String>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let sdk = sdk().await;
    let bench = Bench {
        sqs: aws_sdk_sqs::Client::new(&sdk),
        ddb: aws_sdk_dynamodb::Client::new(&sdk),
        sdk,
        calls_events: env_or("BENCH_CALLS_EVENTS", 2000),
        tp_events: env_or("BENCH_THROUGHPUT_EVENTS", 400),
        rounds: env_or("BENCH_ROUNDS", 3),
        python: std::env::var("BENCH_PYTHON").ok(),
    };
    let sections: String = env_or("BENCH_SECTIONS", "12345".to_owned());
    let run = |n: char| sections.contains(n);
    let mut r = Report::default();
    r.say(format!(
        "# sqs-once benchmarks, {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    ));
    if run('1') {
        calls_per_message(&bench, &mut r).await;
    }
    if run('2') {
        throughput(&bench, &mut r).await;
    }
    if run('3') {
        lambda_latency(&bench, &mut r).await;
    }
    if run('4') {
        footprint(&bench, &mut r).await;
    }
    if run('5') {
        scaling(&bench, &mut r).await;
    }
    if let Ok(path) = std::env::var("BENCH_REPORT") {
        std::fs::write(path, r.0.join("\n") + "\n").unwrap();
    }
}

/// 1. AWS calls per message.
async fn calls_per_message(bench: &Bench, r: &mut Report) {
    let Bench { sdk, sqs, ddb, .. } = bench;
    let calls_events = bench.calls_events;
    r.say(String::new());
    r.say(format!(
        "## 1. AWS calls per message ({calls_events} events, 30% sent twice, concurrency 10)"
    ));
    r.say("| path | per message | by operation |".into());
    r.say("|---|---|---|".into());
    for fast in [true, false] {
        let s = fresh(sqs, ddb).await;
        let (bodies, expected) = events(calls_events, 0.3);
        send_all(sqs, &s.queues.queue_url, &bodies).await;
        let (_, per_op) = run_sqs_once(sdk, &s, fast, 10, bodies.len()).await;
        assert_eq!(ledger_rows(ddb, &s.ledger).await, expected, "ledger sums");
        let total: u64 = per_op.values().sum();
        let detail: Vec<String> = per_op
            .iter()
            .map(|(op, n)| format!("{op} {:.3}", *n as f64 / bodies.len() as f64))
            .collect();
        r.say(format!(
            "| {} | {:.3} | {} |",
            if fast {
                "fast (one transaction)"
            } else {
                "general (claim, then complete)"
            },
            total as f64 / bodies.len() as f64,
            detail.join(", ")
        ));
    }
}

/// 2. Throughput, alternated runs on fresh resources, median of `rounds`.
async fn throughput(bench: &Bench, r: &mut Report) {
    let Bench {
        sdk,
        sqs,
        ddb,
        python,
        ..
    } = bench;
    let (tp_events, rounds) = (bench.tp_events, bench.rounds);
    r.say(String::new());
    r.say(format!(
        "## 2. Poller throughput ({tp_events} events + 30% duplicates per run, concurrency 10, median of {rounds} alternated runs)"
    ));
    let mut results: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        for kind in ["sqs-once", "plain", "powertools"] {
            if kind == "powertools" && python.is_none() {
                continue;
            }
            let s = fresh(sqs, ddb).await;
            let (bodies, expected) = events(tp_events, 0.3);
            send_all(sqs, &s.queues.queue_url, &bodies).await;
            let rate = match kind {
                "sqs-once" => run_sqs_once(sdk, &s, true, 10, bodies.len()).await.0,
                "plain" => run_plain(sdk, &s, 10, bodies.len()).await,
                _ => run_powertools(python.as_deref().unwrap(), &s, 10, bodies.len()),
            };
            let rows = ledger_rows(ddb, &s.ledger).await;
            if kind == "plain" {
                // No dedup: the duplicates are applied again; it must still
                // have applied every message exactly once.
                let applied: i64 = rows.values().map(|r| r.1).sum();
                assert_eq!(
                    applied as usize,
                    bodies.len(),
                    "plain loop: one effect per message"
                );
            } else {
                assert_eq!(rows, expected, "{kind}: ledger sums");
            }
            results.entry(kind).or_default().push(rate);
        }
    }
    let med: BTreeMap<&str, f64> = results
        .iter()
        .map(|(k, v)| (*k, median(v.clone())))
        .collect();
    r.say("| consumer | messages/s (median) | ratio to sqs-once |".into());
    r.say("|---|---|---|".into());
    for (k, v) in &med {
        r.say(format!("| {k} | {v:.1} | {:.2} |", v / med["sqs-once"]));
    }
    r.say(format!(
        "sqs-once / plain loop: {:.2}x; sqs-once / Powertools: {}",
        med["sqs-once"] / med["plain"],
        med.get("powertools")
            .map_or("not run (set BENCH_PYTHON)".into(), |p| format!(
                "{:.2}x",
                med["sqs-once"] / p
            ))
    ));
}

/// 3. Lambda batch latency: 10 records whose handler sleeps 100 ms.
async fn lambda_latency(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    r.say(String::new());
    r.say("## 3. Lambda batch latency (10 records, handler sleeps 100 ms, claims on LocalStack DynamoDB, median of 5)".into());
    let mut lat: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for _ in 0..5 {
        for concurrency in [10usize, 1] {
            let dedup = unique("bench-lambda");
            ensure_dedup_table(ddb, &dedup).await.unwrap();
            let handler = handler_fn(|_m, _c| async {
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok(None)
            });
            let p = Processor::new(
                DynamoStore::new(ddb.clone(), dedup.as_str()),
                handler,
                ProcessorConfig::new("bench"),
            )
            .unwrap();
            let adapter = LambdaAdapter::new(
                sqs.clone(),
                p,
                LambdaConfig {
                    concurrency,
                    ..Default::default()
                },
            );
            let records: Vec<_> = (0..10)
            .map(|i| json!({"messageId": format!("m{i}"), "body": "x", "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {}}))
            .collect();
            let started = Instant::now();
            let r = adapter
                .handle(
                    json!({"Records": records}),
                    SystemTime::now() + Duration::from_secs(60),
                )
                .await
                .unwrap();
            assert!(r.batch_item_failures.is_empty());
            lat.entry(concurrency)
                .or_default()
                .push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let (conc, seq) = (median(lat[&10].clone()), median(lat[&1].clone()));
    r.say(format!(
        "concurrent (10): {conc:.0} ms; sequential baseline (1): {seq:.0} ms; {:.1}x faster",
        seq / conc
    ));
}

/// 4. Footprint: binary size, start-up time, idle and peak memory.
async fn footprint(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let tp_events = bench.tp_events;
    r.say(String::new());
    r.say("## 4. Footprint (release `ledger` binary)".into());
    let size = std::fs::metadata(ledger()).map(|m| m.len()).unwrap_or(0);
    r.say(format!("binary size: {:.1} MB", size as f64 / 1e6));
    let s = fresh(sqs, ddb).await;
    let mut starts = Vec::new();
    let mut idle_rss = 0;
    for _ in 0..5 {
        let spawned = Instant::now();
        let mut child = ledger_command(&s, &[], true).spawn().unwrap();
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
            child.stderr.take().unwrap(),
        ));
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("polling") {
                break;
            }
        }
        starts.push(spawned.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        idle_rss = idle_rss.max(rss_kb(child.id().unwrap(), "VmRSS:"));
        terminate(&child);
        let _ = child.wait().await;
    }
    r.say(format!(
        "start to polling (config, table and queue checks: 3 round trips): median {:.0} ms",
        median(starts)
    ));
    r.say(format!("idle RSS: {:.1} MB", idle_rss as f64 / 1024.0));
    let (bodies, expected) = events(tp_events * 2, 0.3);
    send_all(sqs, &s.queues.queue_url, &bodies).await;
    let child = ledger_command(&s, &[("SQS_ONCE_CONCURRENCY", "20")], false)
        .spawn()
        .unwrap();
    drained(sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
    let peak = rss_kb(child.id().unwrap(), "VmHWM:");
    terminate(&child);
    assert_eq!(ledger_rows(ddb, &s.ledger).await, expected);
    r.say(format!(
        "peak RSS under load ({} messages, concurrency 20): {:.1} MB",
        bodies.len(),
        peak as f64 / 1024.0
    ));
}

/// 5. Scaling: 1, 2, 4 pollers; CPU seconds per process.
async fn scaling(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let tp_events = bench.tp_events;
    r.say(String::new());
    r.say(format!(
        "## 5. Scaling ({} events + 30% duplicates per run)",
        tp_events * 2
    ));
    r.say("| pollers | messages/s | ratio to 1 | poller CPU s (sum) | LocalStack CPU s |".into());
    r.say("|---|---|---|---|---|".into());
    let mut base = 0.0;
    for k in [1usize, 2, 4] {
        let s = fresh(sqs, ddb).await;
        let (bodies, expected) = events(tp_events * 2, 0.3);
        send_all(sqs, &s.queues.queue_url, &bodies).await;
        let ls_before = localstack_cpu();
        let started = Instant::now();
        let children: Vec<_> = (0..k)
            .map(|_| ledger_command(&s, &[], false).spawn().unwrap())
            .collect();
        drained(sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
        let rate = bodies.len() as f64 / started.elapsed().as_secs_f64();
        let poller_cpu: f64 = children.iter().map(|c| cpu_secs(c.id().unwrap())).sum();
        let ls_cpu = localstack_cpu() - ls_before;
        for c in &children {
            terminate(c);
        }
        for mut c in children {
            let _ = c.wait().await;
        }
        assert_eq!(ledger_rows(ddb, &s.ledger).await, expected);
        if k == 1 {
            base = rate;
        }
        r.say(format!(
            "| {k} | {rate:.1} | {:.2} | {poller_cpu:.1} | {ls_cpu:.1} |",
            rate / base
        ));
    }
}
