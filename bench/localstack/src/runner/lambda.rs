//! Sections 3 and 8: Lambda batch latency, and the bootstrap's size and cold-start cost.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};

use sqs_once::{DynamoStore, Processor, handler_fn};
use sqs_once_cli::local_lambda::LocalLambda;
use sqs_once_cli::setup::ensure_dedup_table;
use sqs_once_example_ledger::LedgerHandler;

use crate::*;

/// 3. Lambda batch latency: 10 records whose handler sleeps 100 ms.
pub(crate) async fn lambda_latency(bench: &Bench, r: &mut Report) {
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
            let adapter = LambdaAdapter::new(sqs.clone(), p, {
                let mut c = LambdaConfig::default();
                c.concurrency = concurrency;
                c
            });
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

/// Lambda batch time of the ledger handler through `LambdaAdapter` (10
/// records, 3 of them duplicates of earlier events), mean of 10 batches, ms.
pub(crate) async fn lambda_batch_ms(bench: &Bench, fast: bool) -> f64 {
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
    let adapter = LambdaAdapter::new(sqs.clone(), p, {
        let mut c = LambdaConfig::default();
        c.queue_url = Some(s.queues.queue_url.clone());
        c
    });
    // 77 events and 23 copies: ten batches of ten.
    let (bodies, expected) = events(77, 0.3);
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

/// Section 8, Lambda footprint: each function binary of `BENCH_LAMBDA_BINARIES`
/// (`label=path,...`; default the release `ledger`) behind the local Runtime
/// API: its size, and from process start to the first invocation handled
/// (one ledger record, fast path), against a warm invocation; median of
/// `BENCH_COLD_STARTS` (7), binaries alternated.
pub(crate) async fn lambda_footprint(bench: &Bench, r: &mut Report) {
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
