//! Section 2: the consumers side by side as processes (sqs-once, the hand-written loops, Powertools): throughput, CPU per message, calls.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use serde_json::Value;
use sqs_once::aws::calls::CallCounter;
use sqs_once::config::ProcessorConfig;
use sqs_once::poller::PollerConfig;

use sqs_once::{DynamoStore, Processor};
use sqs_once_example_ledger::LedgerHandler;
use tokio_util::sync::CancellationToken;

use crate::*;

/// The baselines' binary (`bench/localstack/src/handwritten.rs`).
pub(crate) fn handwritten() -> std::path::PathBuf {
    support::binary("handwritten")
}

/// The consumers of section 2, each its own process.
pub(crate) fn consumer_command(bench: &Bench, kind: &str, s: &Setup) -> tokio::process::Command {
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
pub(crate) async fn run_consumer(
    bench: &Bench,
    kind: &str,
    s: &Setup,
    messages: usize,
) -> (f64, f64, Value) {
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
pub(crate) fn calls_of(stats: &Value, messages: usize) -> BTreeMap<String, f64> {
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
pub(crate) async fn note_findings(
    bench: &Bench,
    kind: &str,
    s: &Setup,
    stats: &Value,
    messages: usize,
) {
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
pub(crate) async fn consumers(bench: &Bench, r: &mut Report) {
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

// --- the three consumers compared -------------------------------------------

/// sqs-once: the library poller with the ledger handler, in this process.
pub(crate) async fn run_sqs_once(
    sdk: &SdkConfig,
    s: &Setup,
    fast: bool,
    concurrency: usize,
    messages: usize,
) -> (f64, BTreeMap<String, u64>) {
    let handler = LedgerHandler::new(&s.ledger);
    run_sqs_once_with(sdk, s, fast, handler, (concurrency, messages)).await
}

/// The ledger's event as one new item (`Effects::Insert`): `pk` the
/// event's id, with its account and amount, in the ledger table.
#[derive(Debug, Clone)]
pub(crate) struct EventItem(pub(crate) String);

impl sqs_once::Handler for EventItem {
    async fn handle(
        &self,
        message: &sqs_once::Message,
        ctx: &sqs_once::Context,
    ) -> sqs_once::HandlerResult {
        use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
        let e: Value = message.json().map_err(sqs_once::HandlerError::permanent)?;
        let text = |k: &str| AttributeValue::S(e[k].as_str().unwrap_or_default().to_owned());
        let put = Put::builder()
            .table_name(&self.0)
            .item("pk", text("id"))
            .item("account", text("account"))
            .item(
                "amount_cents",
                AttributeValue::N(e["amount_cents"].to_string()),
            )
            .build()?;
        ctx.stage(TransactWriteItem::builder().put(put).build());
        Ok(None)
    }
}

/// The events' sums by account from the insert path's items (as
/// `ledger_rows` reads the ledger's balances).
pub(crate) async fn event_item_sums(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
) -> std::collections::HashMap<String, (i64, i64)> {
    let mut out: std::collections::HashMap<String, (i64, i64)> = Default::default();
    let mut pages = ddb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        let account = item["account"].as_s().unwrap().clone();
        let amount: i64 = item["amount_cents"].as_n().unwrap().parse().unwrap();
        let e = out.entry(account).or_default();
        e.0 += amount;
        e.1 += 1;
    }
    out
}

/// sqs-once: the library poller with `handler`, in this process
/// (`sizes`: concurrency, messages).
pub(crate) async fn run_sqs_once_with<H: sqs_once::Handler>(
    sdk: &SdkConfig,
    s: &Setup,
    fast: bool,
    handler: H,
    (concurrency, messages): (usize, usize),
) -> (f64, BTreeMap<String, u64>) {
    let calls = CallCounter::default();
    let sqs = aws_sdk_sqs::Client::from_conf(calls.sqs_config(sdk));
    let ddb = aws_sdk_dynamodb::Client::from_conf(calls.dynamodb_config(sdk));
    let mut config = ProcessorConfig::new("bench");
    config.key_source = "json:/id".parse().unwrap();
    config.fast_path = fast;
    let processor =
        Processor::new(DynamoStore::new(ddb, s.dedup.as_str()), handler, config).unwrap();
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
