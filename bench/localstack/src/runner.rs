//! Side-by-side benchmarks on the same LocalStack, in one run: `bench/localstack/run`.
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
use serde_json::{Value, json};
use sqs_once::aws::calls::CallCounter;
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::poller::PollerConfig;

use sqs_once::{DynamoStore, MemoryStore, Processor, handler_fn, staged_only};
use sqs_once_cli::local_lambda::LocalLambda;
use sqs_once_cli::setup::{QueuePair, ensure_dedup_table, ensure_queue_with_dlq, ensure_table};
use sqs_once_example_ledger::LedgerHandler;
use tokio_util::sync::CancellationToken;

#[path = "../../../tests/support/mod.rs"]
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
    // A copy found in flight under another copy's claim goes back to the
    // queue and is received again (when the two come in different receives).
    assert_eq!(
        stats.received - stats.in_flight,
        messages as u64,
        "received every message once, besides copies sent back: {stats:?}"
    );
    let mut per_op = calls.snapshot();
    if let Some(r) = per_op.get_mut("SQS.ReceiveMessage") {
        *r -= stats.empty_receives;
    }
    per_op.retain(|op, _| !op.contains(".Describe") && !op.ends_with("GetQueueAttributes"));
    (messages as f64 / secs, per_op)
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
        "{}/../../localstack/.state/localstack.pid",
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

/// What the sections share: the clients, the sizes (`BENCH_*`), and what
/// earlier sections found that later ones price.
struct Bench {
    sdk: SdkConfig,
    sqs: aws_sdk_sqs::Client,
    ddb: aws_sdk_dynamodb::Client,
    calls_events: usize,
    tp_events: usize,
    rounds: usize,
    python: Option<String>,
    findings: std::sync::Mutex<Findings>,
}

/// Per consumer (`fast`, `claim`, `handwritten`, `powertools`, `plain`):
/// what section 7 turns into dollars.
#[derive(Default)]
struct Findings {
    /// AWS calls per message, by operation (empty receives apart).
    calls: BTreeMap<String, BTreeMap<String, f64>>,
    /// The largest item in the consumer's dedup table, bytes (DynamoDB's
    /// item size rules).
    record_bytes: BTreeMap<String, usize>,
    /// The largest ledger item, bytes.
    ledger_bytes: usize,
    /// Mean time to handle a batch of 10 (receive answered to effects done),
    /// ms: what a Lambda invocation of the batch would bill.
    batch_ms: BTreeMap<String, f64>,
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
        findings: Default::default(),
    };
    let sections: String = env_or("BENCH_SECTIONS", "12345678".to_owned());
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
        consumers(&bench, &mut r).await;
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
    if run('6') {
        slot_use(&bench, &mut r).await;
    }
    if run('7') {
        dollars(&bench, &mut r).await;
    }
    if run('8') {
        lambda_footprint(&bench, &mut r).await;
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
    r.say("| path | per message | by operation | messages/s (in-process poller) |".into());
    r.say("|---|---|---|---|".into());
    for fast in [true, false] {
        let s = fresh(sqs, ddb).await;
        let (bodies, expected) = events(calls_events, 0.3);
        send_all(sqs, &s.queues.queue_url, &bodies).await;
        let (rate, per_op) = run_sqs_once(sdk, &s, fast, 10, bodies.len()).await;
        assert_eq!(ledger_rows(ddb, &s.ledger).await, expected, "ledger sums");
        {
            let path = if fast { "fast" } else { "claim" };
            let record = largest_item(ddb, &s.dedup).await;
            let ledger = largest_item(ddb, &s.ledger).await;
            let mut f = bench.findings.lock().unwrap();
            f.calls.insert(
                path.into(),
                per_op
                    .iter()
                    .map(|(op, n)| (op.clone(), *n as f64 / bodies.len() as f64))
                    .collect(),
            );
            f.record_bytes.insert(path.into(), record);
            f.ledger_bytes = f.ledger_bytes.max(ledger);
        }
        let total: u64 = per_op.values().sum();
        let detail: Vec<String> = per_op
            .iter()
            .map(|(op, n)| format!("{op} {:.3}", *n as f64 / bodies.len() as f64))
            .collect();
        r.say(format!(
            "| {} | {:.3} | {} | {rate:.1} |",
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

// --- what transfers to AWS --------------------------------------------------

/// DynamoDB's size of an attribute value, bytes (the documented rules:
/// strings and binaries their length, numbers one byte per two significant
/// digits plus one, lists and maps 3 bytes plus one per element).
fn attr_size(v: &AttributeValue) -> usize {
    match v {
        AttributeValue::S(s) => s.len(),
        AttributeValue::N(n) => {
            let digits = n.trim_start_matches('-').replace('.', "");
            let digits = digits.trim_start_matches('0').trim_end_matches('0');
            digits.len().max(1).div_ceil(2) + 1
        }
        AttributeValue::B(b) => b.as_ref().len(),
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        AttributeValue::Ss(v) => v.iter().map(String::len).sum(),
        AttributeValue::Ns(v) => v
            .iter()
            .map(|n| attr_size(&AttributeValue::N(n.clone())))
            .sum(),
        AttributeValue::Bs(v) => v.iter().map(|b| b.as_ref().len()).sum(),
        AttributeValue::L(l) => 3 + l.iter().map(|e| 1 + attr_size(e)).sum::<usize>(),
        AttributeValue::M(m) => {
            3 + m
                .iter()
                .map(|(k, e)| 1 + k.len() + attr_size(e))
                .sum::<usize>()
        }
        _ => 0,
    }
}

/// The largest item of a table, bytes.
async fn largest_item(ddb: &aws_sdk_dynamodb::Client, table: &str) -> usize {
    let mut pages = ddb.scan().table_name(table).into_paginator().items().send();
    let mut largest = 0;
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        largest = largest.max(item.iter().map(|(k, v)| k.len() + attr_size(v)).sum());
    }
    largest
}

/// User + system CPU seconds of this process's children that have ended and
/// been waited for (`cutime` + `cstime` of /proc/self/stat).
fn children_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(13).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(14).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    ticks / 100.0
}

/// The baselines' binary (`bench/localstack/src/handwritten.rs`).
fn handwritten() -> std::path::PathBuf {
    support::binary("handwritten")
}

/// The consumers of section 2, each its own process.
fn consumer_command(bench: &Bench, kind: &str, s: &Setup) -> tokio::process::Command {
    let mut c = match kind {
        "sqs-once" => {
            // BENCH_SQS_ONCE_ENV=K=V,K=V: settings to try (e.g. RUST_LOG=warn).
            let extra = std::env::var("BENCH_SQS_ONCE_ENV").unwrap_or_default();
            let mut settings = vec![
                ("SQS_ONCE_EXIT_WHEN_IDLE", "2s"),
                ("SQS_ONCE_CONCURRENCY", "10"),
            ];
            settings.extend(extra.split(',').filter_map(|kv| kv.split_once('=')));
            ledger_command(s, &settings, false)
        }
        "handwritten" | "plain" => {
            let mut c = tokio::process::Command::new(handwritten());
            c.env(
                "BENCH_LOOP",
                if kind == "plain" {
                    "plain"
                } else {
                    "transactional"
                },
            )
            .env("DEDUP_TABLE", &s.dedup);
            c
        }
        "powertools" => {
            let mut c = tokio::process::Command::new(bench.python.as_deref().unwrap());
            c.arg(format!("{}/powertools_loop.py", env!("CARGO_MANIFEST_DIR")))
                .env("IDEMPOTENCY_TABLE", format!("{}-pt", s.dedup))
                .env("AWS_DEFAULT_REGION", "us-east-1");
            c
        }
        other => panic!("no consumer {other}"),
    };
    c.env("QUEUE_URL", &s.queues.queue_url)
        .env("LEDGER_TABLE", &s.ledger)
        .env("CONCURRENCY", "10")
        .env("CONSUMER", "bench")
        .env("AWS_ENDPOINT_URL", endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    if kind != "sqs-once" {
        c.stderr(Stdio::inherit());
    }
    c
}

/// One consumer process on a filled queue: messages/s until the queue is
/// empty, CPU seconds of the whole process (from the OS, once it has exited
/// by itself after idling), and its last JSON line on stdout.
async fn run_consumer(bench: &Bench, kind: &str, s: &Setup, messages: usize) -> (f64, f64, Value) {
    let mut cmd = consumer_command(bench, kind, s);
    let cpu_before = children_cpu();
    let started = Instant::now();
    let child = cmd.spawn().unwrap_or_else(|e| panic!("start {kind}: {e}"));
    drained(&bench.sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
    let secs = started.elapsed().as_secs_f64();
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{kind} did not exit when idle"))
        .unwrap();
    let cpu = children_cpu() - cpu_before;
    assert!(out.status.success(), "{kind} failed: {}", out.status);
    let stats: Value = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .next_back()
        .unwrap_or(Value::Null);
    let handled = if kind == "sqs-once" {
        stats["received"]
            .as_u64()
            .zip(stats["in_flight"].as_u64())
            .map(|(r, f)| r - f)
    } else {
        stats["handled"].as_u64()
    };
    assert_eq!(
        handled,
        Some(messages as u64),
        "{kind} handled every message once: {stats}"
    );
    (messages as f64 / secs, cpu, stats)
}

/// Calls per message by operation from a consumer's JSON line (sqs-once's
/// counts include its empty receives and start-up checks: taken out).
fn calls_of(stats: &Value, messages: usize) -> BTreeMap<String, f64> {
    let empty = stats["empty_receives"].as_u64().unwrap_or(0) as f64;
    let ledger = stats.get("received").is_some();
    stats["calls"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(op, _)| !op.contains(".Describe") && !op.ends_with("GetQueueAttributes"))
        .map(|(op, n)| {
            let mut n = n.as_f64().unwrap_or(0.0);
            if ledger && op == "SQS.ReceiveMessage" {
                n -= empty;
            }
            (op.clone(), n / messages as f64)
        })
        .collect()
}

/// What section 7 prices, from a baseline's run: its calls, its dedup
/// record's size, its batch time.
async fn note_findings(bench: &Bench, kind: &str, s: &Setup, stats: &Value, messages: usize) {
    let table = if kind == "powertools" {
        format!("{}-pt", s.dedup)
    } else {
        s.dedup.clone()
    };
    let record = if kind == "plain" {
        0
    } else {
        largest_item(&bench.ddb, &table).await
    };
    let mut f = bench.findings.lock().unwrap();
    f.calls.insert(kind.into(), calls_of(stats, messages));
    f.record_bytes.insert(kind.into(), record);
    if let (Some(ms), Some(n)) = (stats["batch_ms_total"].as_f64(), stats["batches"].as_f64()) {
        f.batch_ms.insert(kind.into(), ms / n.max(1.0));
    }
}

/// Section 2: four consumers, each its own process, on the same messages, alternated
/// (the order rotates every round): throughput and CPU per message.
async fn consumers(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let (tp_events, rounds) = (bench.tp_events, bench.rounds);
    let mut kinds = vec!["sqs-once", "handwritten", "plain"];
    if bench.python.is_some() {
        kinds.push("powertools");
    }
    // Built before any CPU is counted.
    let _ = (ledger(), handwritten());
    r.say(String::new());
    r.say(format!(
        "## 2. Consumers side by side ({tp_events} events + 30% duplicates per run, concurrency 10, each its own process, median of {rounds} alternated runs)"
    ));
    let mut rates: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut cpus: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..rounds {
        for i in 0..kinds.len() {
            let kind = kinds[(i + round) % kinds.len()];
            let s = fresh(sqs, ddb).await;
            let (bodies, expected) = events(tp_events, 0.3);
            send_all(sqs, &s.queues.queue_url, &bodies).await;
            let (rate, cpu, stats) = run_consumer(bench, kind, &s, bodies.len()).await;
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
            println!(
                "  round {round} {kind}: {rate:.1} msg/s, {:.2} ms CPU per message",
                cpu * 1000.0 / bodies.len() as f64
            );
            rates.entry(kind).or_default().push(rate);
            cpus.entry(kind)
                .or_default()
                .push(cpu * 1000.0 / bodies.len() as f64);
            if round == 0 && kind != "sqs-once" {
                note_findings(bench, kind, &s, &stats, bodies.len()).await;
            }
        }
    }
    let rate: BTreeMap<&str, f64> = rates.iter().map(|(k, v)| (*k, median(v.clone()))).collect();
    let cpu: BTreeMap<&str, f64> = cpus.iter().map(|(k, v)| (*k, median(v.clone()))).collect();
    r.say("| consumer | messages/s | sqs-once / it | CPU ms per message | it / hand-written | runs (messages/s) |".into());
    r.say("|---|---|---|---|---|---|".into());
    for k in &kinds {
        let runs: Vec<String> = rates[k].iter().map(|v| format!("{v:.1}")).collect();
        r.say(format!(
            "| {k} | {:.1} | {:.2} | {:.2} | {:.2} | {} |",
            rate[k],
            rate["sqs-once"] / rate[k],
            cpu[k],
            cpu[k] / cpu["handwritten"],
            runs.join(", ")
        ));
    }
    r.say(format!(
        "sqs-once / hand-written loop, throughput: {:.2}x (goal >= 0.95); CPU per message: {:.2}x (goal <= 1.2)",
        rate["sqs-once"] / rate["handwritten"],
        cpu["sqs-once"] / cpu["handwritten"]
    ));
}

/// Log-normal handler durations, from the event's number (a fixed seed):
/// median 150 ms, sigma 1, clipped to 20 ms .. 2 s.
fn uneven_duration(n: u64) -> Duration {
    // splitmix64, then Box-Muller.
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let unit = |z: u64| ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u1, u2) = (unit(mix(n * 2 + 16)), unit(mix(n * 2 + 17)));
    let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    let ms = (150f64.ln() + normal).exp().clamp(20.0, 2000.0);
    Duration::from_secs_f64(ms / 1000.0)
}

/// Section 6, slot use: concurrency 32, handlers of uneven durations (and fast
/// ones), the library poller with an in-memory dedup store on LocalStack's
/// SQS. Busy slot-seconds / (32 x the time until the last message started:
/// after that no work is left to start), and receives per message.
async fn slot_use(bench: &Bench, r: &mut Report) {
    let label = std::env::var("BENCH_RECEIVE_LABEL").unwrap_or_else(|_| "this build".into());
    let rounds: usize = env_or("BENCH_SLOT_ROUNDS", 1);
    let concurrency = 32usize;
    r.say(String::new());
    r.say(format!(
        "## 6. Slot use, receive strategy: {label} (concurrency {concurrency}, in-memory dedup store, LocalStack SQS)"
    ));
    r.say("| handlers | messages | slot use until the last start | slot use, whole run | receives per message | messages/s |".into());
    r.say("|---|---|---|---|---|---|".into());
    for (name, n, uneven) in [
        (
            "log-normal 20 ms - 2 s (median 150 ms)",
            env_or("BENCH_SLOT_MESSAGES", 1500u64),
            true,
        ),
        ("fast (5 ms)", 2000, false),
    ] {
        for _ in 0..rounds {
            let (window_use, whole_use, receives, rate) =
                slot_run(bench, n, uneven, concurrency).await;
            r.say(format!(
                "| {name} | {n} | {window_use:.3} | {whole_use:.3} | {receives:.3} | {rate:.1} |"
            ));
        }
    }
}

/// Busy handler time / (slots x time): until the last message started, and
/// over the whole run (`wall` from `t0`).
fn slot_use_of(
    spans: &[(Instant, Instant)],
    t0: Instant,
    wall: f64,
    concurrency: usize,
) -> (f64, f64) {
    let last_start = spans.iter().map(|s| s.0).max().unwrap();
    let window = last_start.duration_since(t0).as_secs_f64();
    let busy_window: f64 = spans
        .iter()
        .map(|(a, b)| {
            (*b.min(&last_start))
                .saturating_duration_since(*a)
                .as_secs_f64()
        })
        .sum();
    let busy: f64 = spans
        .iter()
        .map(|(a, b)| b.duration_since(*a).as_secs_f64())
        .sum();
    (
        busy_window / (concurrency as f64 * window),
        busy / (concurrency as f64 * wall),
    )
}

/// One slot-use run: slot use until the last start and over the whole run,
/// receives per message, messages/s.
async fn slot_run(bench: &Bench, n: u64, uneven: bool, concurrency: usize) -> (f64, f64, f64, f64) {
    let Bench { sdk, sqs, .. } = bench;
    let queues = ensure_queue_with_dlq(
        sqs,
        &unique("bench-slots"),
        false,
        Duration::from_secs(30),
        5,
    )
    .await
    .unwrap();
    let bodies: Vec<String> = (0..n)
        .map(|i| json!({"id": format!("evt-{i}"), "n": i}).to_string())
        .collect();
    send_all(sqs, &queues.queue_url, &bodies).await;
    let spans: Arc<std::sync::Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let seen = spans.clone();
    let handler = staged_only(handler_fn(move |m: sqs_once::Message, _ctx| {
        let seen = seen.clone();
        async move {
            let started = Instant::now();
            let v: Value = serde_json::from_str(m.body()).unwrap();
            tokio::time::sleep(if uneven {
                uneven_duration(v["n"].as_u64().unwrap())
            } else {
                Duration::from_millis(5)
            })
            .await;
            seen.lock().unwrap().push((started, Instant::now()));
            Ok(None)
        }
    }));
    let calls = CallCounter::default();
    let sqs_counted = aws_sdk_sqs::Client::from_conf(calls.sqs_config(sdk));
    let processor = Processor::new(
        MemoryStore::default(),
        handler,
        ProcessorConfig::new("bench"),
    )
    .unwrap();
    let mut pc = PollerConfig::new(&queues.queue_url);
    pc.concurrency = concurrency;
    pc.wait_time = Duration::from_secs(1);
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let task = tokio::spawn(sqs_once::poller::run(
        sqs_counted,
        processor,
        pc,
        stop.clone(),
    ));
    drained(sqs, &queues.queue_url, Duration::from_secs(1800)).await;
    let wall = t0.elapsed().as_secs_f64();
    stop.cancel();
    let stats = task.await.unwrap();
    let spans = spans.lock().unwrap().clone();
    assert_eq!(
        spans.len() as u64,
        n,
        "every message handled once: {stats:?}"
    );
    assert_eq!(stats.received, n, "{stats:?}");
    let (window_use, whole_use) = slot_use_of(&spans, t0, wall, concurrency);
    let receives = calls
        .snapshot()
        .get("SQS.ReceiveMessage")
        .copied()
        .unwrap_or(0)
        - stats.empty_receives;
    (
        window_use,
        whole_use,
        receives as f64 / n as f64,
        n as f64 / wall,
    )
}

/// Lambda batch time of the ledger handler through `LambdaAdapter` (10
/// records, 3 of them duplicates of earlier events), mean of 10 batches, ms.
async fn lambda_batch_ms(bench: &Bench, fast: bool) -> f64 {
    let Bench { sqs, ddb, .. } = bench;
    let s = fresh(sqs, ddb).await;
    let mut config = ProcessorConfig::new("bench");
    config.key_source = "json:/id".parse().unwrap();
    config.fast_path = fast;
    let p = Processor::new(
        DynamoStore::new(ddb.clone(), s.dedup.as_str()),
        LedgerHandler::new(&s.ledger),
        config,
    )
    .unwrap();
    let adapter = LambdaAdapter::new(
        sqs.clone(),
        p,
        LambdaConfig {
            queue_url: Some(s.queues.queue_url.clone()),
            ..Default::default()
        },
    );
    let (bodies, expected) = events(75, 0.3);
    assert_eq!(bodies.len(), 100);
    let mut total = 0.0;
    for (b, chunk) in bodies.chunks(10).take(10).enumerate() {
        let records: Vec<_> = chunk
            .iter()
            .enumerate()
            .map(|(i, body)| json!({"messageId": format!("m{b}-{i}"), "receiptHandle": format!("r{b}-{i}"), "body": body, "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {}}))
            .collect();
        let started = Instant::now();
        let out = adapter
            .handle(
                json!({"Records": records}),
                SystemTime::now() + Duration::from_secs(60),
            )
            .await
            .unwrap();
        total += started.elapsed().as_secs_f64() * 1000.0;
        assert!(out.batch_item_failures.is_empty());
    }
    assert_eq!(ledger_rows(ddb, &s.ledger).await, expected, "ledger sums");
    total / 10.0
}

/// List prices, us-east-1 (see bench/RESULTS.md for where they come from).
const SQS_PER_MILLION_REQUESTS: f64 = 0.40;
const DDB_PER_MILLION_WRU: f64 = 0.625;
const DDB_PER_MILLION_RRU: f64 = 0.125;
const LAMBDA_ARM_PER_GB_SECOND: f64 = 0.000_013_333_4;
const LAMBDA_PER_MILLION_REQUESTS: f64 = 0.20;
/// template.yaml's MemorySize.
const LAMBDA_GB: f64 = 0.256;

/// Write units of one call of `op` by `consumer`, from its item sizes: a
/// standard write is 1 unit per started KB of the item, a transaction 2 per
/// KB per item (a cancelled one counted as charged in full: an upper bound).
fn write_units(consumer: &str, op: &str, record: usize, ledger: usize) -> f64 {
    let kb = |b: usize| b.max(1).div_ceil(1024) as f64;
    match op {
        "DynamoDB.TransactWriteItems" => 2.0 * (kb(record) + kb(ledger)),
        "DynamoDB.UpdateItem" if consumer == "plain" => kb(ledger),
        "DynamoDB.UpdateItem" | "DynamoDB.PutItem" | "DynamoDB.DeleteItem" => kb(record),
        _ => 0.0,
    }
}

/// Write and read units per message of `consumer`, from its calls per
/// message and item sizes.
fn units_per_message(
    key: &str,
    calls: &BTreeMap<String, f64>,
    record: usize,
    ledger_bytes: usize,
) -> (f64, f64) {
    let mut wru = 0.0;
    let mut rru = 0.0;
    for (op, n) in calls {
        // Powertools' UpdateItem calls are, half each, the ledger update
        // and its record's completion (one of each per new message).
        if key == "powertools" && op == "DynamoDB.UpdateItem" {
            wru += n / 2.0 * write_units("plain", op, record, ledger_bytes);
            wru += n / 2.0 * write_units(key, op, record, ledger_bytes);
            continue;
        }
        wru += n * write_units(key, op, record, ledger_bytes);
        if op.ends_with("GetItem") || op.ends_with("Query") {
            rru += n * 0.5 * (record.max(1).div_ceil(4096) as f64);
        }
    }
    (wru, rru)
}

/// Section 7: dollars per million messages on list prices, from the calls counted in
/// sections 1 and 2, the item sizes found there, and Lambda batch times.
async fn dollars(bench: &Bench, r: &mut Report) {
    let fast_ms = lambda_batch_ms(bench, true).await;
    let claim_ms = lambda_batch_ms(bench, false).await;
    let f = bench.findings.lock().unwrap();
    r.say(String::new());
    r.say("## 7. Dollars per million messages (us-east-1 list prices; the mix of sections 1-2: 30% of events sent twice)".into());
    r.say(format!(
        "Item sizes (DynamoDB's rules, largest item): records {}; ledger item {} B",
        f.record_bytes
            .iter()
            .map(|(k, v)| format!("{k} {v} B"))
            .collect::<Vec<_>>()
            .join(", "),
        f.ledger_bytes
    ));
    r.say("| consumer | SQS requests / msg | DynamoDB calls / msg | write units / msg | poller: SQS $ | poller: DynamoDB $ | poller total $ | Lambda batch ms | Lambda GB-s + requests $ | Lambda total $ (with DynamoDB) |".into());
    r.say("|---|---|---|---|---|---|---|---|---|---|".into());
    for (name, key, ms) in [
        ("sqs-once fast path", "fast", Some(fast_ms)),
        ("sqs-once claim path", "claim", Some(claim_ms)),
        (
            "hand-written loop",
            "handwritten",
            f.batch_ms.get("handwritten").copied(),
        ),
        (
            "Powertools",
            "powertools",
            f.batch_ms.get("powertools").copied(),
        ),
        (
            "plain loop (no dedup)",
            "plain",
            f.batch_ms.get("plain").copied(),
        ),
    ] {
        let Some(calls) = f.calls.get(key) else {
            continue;
        };
        let record = f.record_bytes.get(key).copied().unwrap_or(0);
        let sqs_req: f64 = calls
            .iter()
            .filter(|(op, _)| op.starts_with("SQS."))
            .map(|(_, n)| n)
            .sum();
        let ddb_calls: f64 = calls
            .iter()
            .filter(|(op, _)| op.starts_with("DynamoDB."))
            .map(|(_, n)| n)
            .sum();
        let (wru, rru) = units_per_message(key, calls, record, f.ledger_bytes);
        let sqs_usd = sqs_req * SQS_PER_MILLION_REQUESTS;
        let ddb_usd = wru * DDB_PER_MILLION_WRU + rru * DDB_PER_MILLION_RRU;
        let (ms_txt, lambda_usd, lambda_total) = match ms {
            Some(ms) => {
                // One invocation per 10 messages.
                let usd = LAMBDA_GB * ms / 1000.0 / 10.0 * LAMBDA_ARM_PER_GB_SECOND * 1e6
                    + LAMBDA_PER_MILLION_REQUESTS / 10.0;
                (
                    format!("{ms:.0}"),
                    format!("{usd:.3}"),
                    format!("{:.3}", usd + ddb_usd),
                )
            }
            None => ("-".into(), "-".into(), "-".into()),
        };
        r.say(format!(
            "| {name} | {sqs_req:.3} | {ddb_calls:.3} | {wru:.2} | {sqs_usd:.3} | {ddb_usd:.3} | {:.3} | {ms_txt} | {lambda_usd} | {lambda_total} |",
            sqs_usd + ddb_usd
        ));
    }
    r.say("On Lambda the event source mapping's receives and deletes (about 0.2 SQS requests per message, the same for every consumer) come on top.".into());
}

/// Section 8, Lambda footprint: each function binary of `BENCH_LAMBDA_BINARIES`
/// (`label=path,...`; default the release `ledger`) behind the local Runtime
/// API: its size, and from process start to the first invocation handled
/// (one ledger record, fast path), against a warm invocation; median of
/// `BENCH_COLD_STARTS` (7), binaries alternated.
async fn lambda_footprint(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let binaries: Vec<(String, std::path::PathBuf)> = match std::env::var("BENCH_LAMBDA_BINARIES") {
        Ok(list) => list
            .split(',')
            .filter_map(|e| e.split_once('='))
            .map(|(l, p)| (l.to_owned(), p.into()))
            .collect(),
        Err(_) => vec![("release".into(), ledger())],
    };
    let n: usize = env_or("BENCH_COLD_STARTS", 7);
    let s = fresh(sqs, ddb).await;
    let env: Vec<(String, String)> = [
        ("SQS_ONCE_TABLE", s.dedup.as_str()),
        ("SQS_ONCE_CONSUMER", "bench"),
        ("SQS_ONCE_DEDUP_KEY", "json:/id"),
        ("SQS_ONCE_QUEUE_URL", s.queues.queue_url.as_str()),
        ("LEDGER_TABLE", s.ledger.as_str()),
        ("AWS_ENDPOINT_URL", &endpoint()),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("SQS_ONCE_METRICS_INTERVAL", "0s"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    let mut counter = 0u64;
    let mut event = || {
        counter += 1;
        let body =
            json!({"id": format!("cold-{counter}"), "account": "acct-cold", "amount_cents": 1})
                .to_string();
        json!({"Records": [{"messageId": format!("m{counter}"), "receiptHandle": format!("r{counter}"), "body": body,
            "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {},
            "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:us-east-1:000000000000:bench", "awsRegion": "us-east-1"}]})
    };
    let mut cold: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut warm: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for _ in 0..n {
        for (label, path) in &binaries {
            let (e1, e2) = (event(), event());
            let started = Instant::now();
            let lambda = LocalLambda::start(path, "bench", Duration::from_secs(30), env.clone())
                .await
                .unwrap();
            let out = lambda.invoke(&e1).await.unwrap();
            cold.entry(label.clone())
                .or_default()
                .push(started.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(out["batchItemFailures"], json!([]), "{out}");
            let started = Instant::now();
            let out = lambda.invoke(&e2).await.unwrap();
            warm.entry(label.clone())
                .or_default()
                .push(started.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(out["batchItemFailures"], json!([]), "{out}");
            lambda.shutdown().await;
        }
    }
    r.say(String::new());
    r.say(format!("## 8. Lambda footprint (local Runtime API, one-record invocation, median of {n}, binaries alternated)"));
    r.say("| binary | size | process start to first invocation handled | warm invocation | difference (the cold-start cost) |".into());
    r.say("|---|---|---|---|---|".into());
    for (label, path) in &binaries {
        let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        let (c, w) = (median(cold[label].clone()), median(warm[label].clone()));
        r.say(format!(
            "| {label} | {:.1} MB | {c:.0} ms | {w:.0} ms | {:.0} ms |",
            size as f64 / 1e6,
            c - w
        ));
    }
}
