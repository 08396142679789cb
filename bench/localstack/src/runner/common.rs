//! What the sections share: the clients and sizes, fresh queues and tables, the events, the report.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region, SdkConfig};

use sqs_once_cli::setup::{QueuePair, ensure_dedup_table, ensure_queue_with_dlq, ensure_table};

use crate::*;

/// The `ledger` binary (built once: [`support::binary`]).
pub(crate) fn ledger() -> std::path::PathBuf {
    support::binary("ledger")
}

pub(crate) fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into())
}

pub(crate) async fn sdk() -> SdkConfig {
    aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(endpoint())
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "bench",
        ))
        .load()
        .await
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub(crate) struct Setup {
    pub(crate) queues: QueuePair,
    pub(crate) dedup: String,
    pub(crate) ledger: String,
}

pub(crate) async fn fresh(sqs: &aws_sdk_sqs::Client, ddb: &aws_sdk_dynamodb::Client) -> Setup {
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
pub(crate) async fn drained(sqs: &aws_sdk_sqs::Client, url: &str, deadline: Duration) {
    let until = Instant::now() + deadline;
    while depth(sqs, url).await > 0 {
        assert!(Instant::now() < until, "the queue did not drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// --- the three consumers compared -------------------------------------------

/// The release `ledger` binary for `s`; its stderr is piped when `watch`
/// (read it, or the process blocks once the pipe is full), else discarded.
pub(crate) fn ledger_command(
    s: &Setup,
    extra: &[(&str, &str)],
    watch: bool,
) -> tokio::process::Command {
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

pub(crate) fn terminate(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
}

/// The benchmark report: every line is printed as it comes and kept for
/// `BENCH_REPORT`.
#[derive(Default)]
pub(crate) struct Report(pub(crate) Vec<String>);

impl Report {
    pub(crate) fn say(&mut self, line: String) {
        println!("{line}");
        self.0.push(line);
    }
}

/// What the sections share: the clients, the sizes (`BENCH_*`), and what
/// earlier sections found that later ones price.
pub(crate) struct Bench {
    pub(crate) sdk: SdkConfig,
    pub(crate) sqs: aws_sdk_sqs::Client,
    pub(crate) ddb: aws_sdk_dynamodb::Client,
    pub(crate) calls_events: usize,
    pub(crate) tp_events: usize,
    pub(crate) rounds: usize,
    pub(crate) python: Option<String>,
    pub(crate) findings: std::sync::Mutex<Findings>,
}

/// Per consumer (`fast`, `claim`, `handwritten`, `powertools`, `plain`):
/// what section 7 turns into dollars.
#[derive(Default)]
pub(crate) struct Findings {
    /// AWS calls per message, by operation (empty receives apart).
    pub(crate) calls: BTreeMap<String, BTreeMap<String, f64>>,
    /// The largest item in the consumer's dedup table, bytes (DynamoDB's
    /// item size rules).
    pub(crate) record_bytes: BTreeMap<String, usize>,
    /// The largest ledger item, bytes.
    pub(crate) ledger_bytes: usize,
    /// Mean time to handle a batch of 10 (receive answered to effects done),
    /// ms: what a Lambda invocation of the batch would bill.
    pub(crate) batch_ms: BTreeMap<String, f64>,
}
