//! Counters of what the processor did, emitted as CloudWatch Embedded Metric
//! Format (EMF) log lines: one JSON object per line whose `_aws` member tells
//! CloudWatch which fields are metrics. In Lambda the function's log stream is
//! extracted as is (one line per invocation); the poller prints one every
//! `SQS_ONCE_METRICS_INTERVAL`.
//!
//! A jump of `DuplicatesSkipped` against `Processed` is the sign of an upstream
//! producer re-sending: graph the two together.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::Outcome;

/// The CloudWatch namespace of the metrics.
pub const NAMESPACE: &str = "sqs-once";

/// EMF allows at most 100 values per metric in one line.
const MAX_VALUES: usize = 100;

/// Live counters; shared by every task of a runtime.
#[derive(Debug, Default)]
pub struct Metrics {
    processed: AtomicU64,
    duplicates: AtomicU64,
    in_flight: AtomicU64,
    retries: AtomicU64,
    permanent_failures: AtomicU64,
    lease_lost: AtomicU64,
    heartbeat_extensions: AtomicU64,
    latencies_ms: Mutex<Vec<f64>>,
}

/// The counters since the last [`Metrics::take`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Messages whose effect was recorded now.
    pub processed: u64,
    /// Duplicates of completed work, skipped.
    pub duplicates: u64,
    /// Messages another consumer held; sent back for later.
    pub in_flight: u64,
    /// Retryable failures (handler errors, panics, store unavailable, shutdown).
    pub retries: u64,
    /// Permanent failures (parked, or left to the redrive policy).
    pub permanent_failures: u64,
    /// Claims lost to another consumer while the handler ran.
    pub lease_lost: u64,
    /// Successful lease or visibility extensions.
    pub heartbeat_extensions: u64,
    /// Handler run times, milliseconds.
    pub handler_latency_ms: Vec<f64>,
}

impl Metrics {
    /// Counts a message's outcome.
    pub fn outcome(&self, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Completed { .. } => &self.processed,
            Outcome::Duplicate { .. } => &self.duplicates,
            Outcome::InFlight { .. } => &self.in_flight,
            Outcome::Retry { .. } => &self.retries,
            Outcome::Park { .. } => &self.permanent_failures,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a lease lost to another consumer.
    pub fn lease_lost(&self) {
        self.lease_lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a successful heartbeat extension.
    pub fn heartbeat_extension(&self) {
        self.heartbeat_extensions.fetch_add(1, Ordering::Relaxed);
    }

    /// Records how long a handler ran.
    pub fn handler_latency(&self, d: Duration) {
        self.latencies_ms
            .lock()
            .expect("latencies")
            .push(d.as_secs_f64() * 1000.0);
    }

    /// The counters since the last call, which resets them.
    pub fn take(&self) -> Snapshot {
        let t = |c: &AtomicU64| c.swap(0, Ordering::Relaxed);
        Snapshot {
            processed: t(&self.processed),
            duplicates: t(&self.duplicates),
            in_flight: t(&self.in_flight),
            retries: t(&self.retries),
            permanent_failures: t(&self.permanent_failures),
            lease_lost: t(&self.lease_lost),
            heartbeat_extensions: t(&self.heartbeat_extensions),
            handler_latency_ms: std::mem::take(&mut *self.latencies_ms.lock().expect("latencies")),
        }
    }
}

impl Snapshot {
    /// The EMF lines for these counters with dimension `Consumer`, timestamped
    /// `timestamp_ms`: one line with every counter and up to 100 latencies, then
    /// one line per further 100 latencies.
    pub fn emf_lines(&self, consumer: &str, timestamp_ms: i64) -> Vec<Value> {
        let counters = [
            ("Processed", self.processed),
            ("DuplicatesSkipped", self.duplicates),
            ("InFlightDuplicates", self.in_flight),
            ("Retries", self.retries),
            ("PermanentFailures", self.permanent_failures),
            ("LeaseLost", self.lease_lost),
            ("HeartbeatExtensions", self.heartbeat_extensions),
        ];
        let mut chunks = self.handler_latency_ms.chunks(MAX_VALUES);
        let first = chunks.next().unwrap_or(&[]);
        let mut lines = vec![line(
            consumer,
            timestamp_ms,
            counters
                .iter()
                .map(|(name, v)| (*name, "Count", json!(v)))
                .chain(
                    (!first.is_empty()).then(|| ("HandlerLatency", "Milliseconds", json!(first))),
                )
                .collect(),
        )];
        lines.extend(chunks.map(|c| {
            line(
                consumer,
                timestamp_ms,
                vec![("HandlerLatency", "Milliseconds", json!(c))],
            )
        }));
        lines
    }
}

fn line(consumer: &str, timestamp_ms: i64, metrics: Vec<(&str, &str, Value)>) -> Value {
    let definitions: Vec<Value> = metrics
        .iter()
        .map(|(name, unit, _)| json!({"Name": name, "Unit": unit}))
        .collect();
    let mut root = Map::new();
    root.insert(
        "_aws".into(),
        json!({
            "Timestamp": timestamp_ms,
            "CloudWatchMetrics": [{
                "Namespace": NAMESPACE,
                "Dimensions": [["Consumer"]],
                "Metrics": definitions,
            }],
        }),
    );
    root.insert("Consumer".into(), json!(consumer));
    for (name, _, value) in metrics {
        root.insert(name.into(), value);
    }
    Value::Object(root)
}

/// Prints the snapshot's EMF lines to stdout (where Lambda and the awslogs
/// driver pick them up), unless nothing happened.
pub fn print_emf(snapshot: &Snapshot, consumer: &str) {
    if *snapshot == Snapshot::default() {
        return;
    }
    let now_ms = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
    for line in snapshot.emf_lines(consumer, now_ms) {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emf_line_declares_every_metric_it_carries() {
        let m = Metrics::default();
        m.outcome(&Outcome::Completed { result: None });
        m.outcome(&Outcome::Duplicate {
            result: None,
            payload_matches: true,
        });
        m.outcome(&Outcome::Duplicate {
            result: None,
            payload_matches: true,
        });
        for i in 0..150 {
            m.handler_latency(Duration::from_millis(i));
        }
        let lines = m.take().emf_lines("ledger", 1_700_000_000_000);
        assert_eq!(lines.len(), 2, "150 latencies: 100 + 50");
        let first = &lines[0];
        assert_eq!(first["_aws"]["Timestamp"], 1_700_000_000_000_i64);
        let directive = &first["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "sqs-once");
        assert_eq!(directive["Dimensions"], json!([["Consumer"]]));
        for def in directive["Metrics"].as_array().unwrap() {
            let name = def["Name"].as_str().unwrap();
            assert!(!first[name].is_null(), "{name} declared but missing");
        }
        assert_eq!(first["Consumer"], "ledger");
        assert_eq!(first["Processed"], 1);
        assert_eq!(first["DuplicatesSkipped"], 2);
        assert_eq!(first["HandlerLatency"].as_array().unwrap().len(), 100);
        assert_eq!(lines[1]["HandlerLatency"].as_array().unwrap().len(), 50);
        assert_eq!(m.take(), Snapshot::default(), "take resets");
    }
}
