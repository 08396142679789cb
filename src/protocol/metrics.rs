//! Counters of what the processor did, emitted as CloudWatch Embedded Metric
//! Format (EMF) log lines: one JSON object per line whose `_aws` member tells
//! CloudWatch which fields are metrics. In Lambda the function's log stream is
//! extracted as is (one line per invocation); the poller prints one every
//! `SQS_ONCE_METRICS_INTERVAL`.
//!
//! A jump of `DuplicatesSkipped` against `Processed` is the sign of an upstream
//! producer re-sending: graph the two together.
//!
//! With the feature `metrics`, every count is also handed to the
//! [`metrics`](https://docs.rs/metrics) crate's facade as it happens, for
//! whatever recorder the process installs (Prometheus, OpenTelemetry, ...):
//! each EMF counter as the counter [`FACADE_NAMES`] names (`Processed` is
//! `sqs_once_processed`), labelled `consumer`, and the handler latency as the
//! histogram `sqs_once_handler_latency_seconds`. Without a recorder
//! installed these calls do nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::Outcome;

/// The CloudWatch namespace of the metrics.
pub const NAMESPACE: &str = "sqs-once";

/// The one dimension every metric carries: the consumer's name.
pub const DIMENSION: &str = "Consumer";

/// Every metric name the EMF lines can carry (the templates' alarms and
/// dashboards are checked against this list).
pub const METRIC_NAMES: &[&str] = &[
    "Processed",
    "DuplicatesSkipped",
    "InFlightDuplicates",
    "Retries",
    "PermanentFailures",
    "LeaseLost",
    "HeartbeatExtensions",
    "Takeovers",
    "UnknownOutcomesResolved",
    "StoreBusy",
    "PayloadMismatches",
    "UnverifiedAttributes",
    "OutboxDispatched",
    "OutboxRecovered",
    "OutboxDispatchFailures",
    "OutboxRefused",
    "HandlerLatency",
];

/// The `metrics` facade's name of each EMF counter (feature `metrics`):
/// `sqs_once_` and the name in snake case. The handler latency is the
/// histogram [`FACADE_LATENCY`], in seconds.
pub const FACADE_NAMES: &[(&str, &str)] = &[
    ("Processed", "sqs_once_processed"),
    ("DuplicatesSkipped", "sqs_once_duplicates_skipped"),
    ("InFlightDuplicates", "sqs_once_in_flight_duplicates"),
    ("Retries", "sqs_once_retries"),
    ("PermanentFailures", "sqs_once_permanent_failures"),
    ("LeaseLost", "sqs_once_lease_lost"),
    ("HeartbeatExtensions", "sqs_once_heartbeat_extensions"),
    ("Takeovers", "sqs_once_takeovers"),
    (
        "UnknownOutcomesResolved",
        "sqs_once_unknown_outcomes_resolved",
    ),
    ("StoreBusy", "sqs_once_store_busy"),
    ("PayloadMismatches", "sqs_once_payload_mismatches"),
    ("UnverifiedAttributes", "sqs_once_unverified_attributes"),
    ("OutboxDispatched", "sqs_once_outbox_dispatched"),
    ("OutboxRecovered", "sqs_once_outbox_recovered"),
    (
        "OutboxDispatchFailures",
        "sqs_once_outbox_dispatch_failures",
    ),
    ("OutboxRefused", "sqs_once_outbox_refused"),
];

/// The `metrics` facade's histogram of handler run times, in seconds
/// (`HandlerLatency` in EMF, in milliseconds).
pub const FACADE_LATENCY: &str = "sqs_once_handler_latency_seconds";

/// Whether two names are the same (a `const` comparison).
const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The facade's name of the EMF counter `emf` (evaluated at compile time:
/// `const { facade(..) }`).
const fn facade(emf: &str) -> &'static str {
    let mut i = 0;
    while i < FACADE_NAMES.len() {
        if same(FACADE_NAMES[i].0.as_bytes(), emf.as_bytes()) {
            return FACADE_NAMES[i].1;
        }
        i += 1;
    }
    panic!("an EMF counter without a facade name")
}

/// Live counters; shared by every task of a runtime. Memory is fixed: handler
/// latencies go into a histogram of [`LATENCY_BUCKETS`] counters, whatever the
/// number of samples and whether anyone ever reads them.
#[derive(Debug, Default)]
pub struct Metrics {
    processed: AtomicU64,
    duplicates: AtomicU64,
    in_flight: AtomicU64,
    retries: AtomicU64,
    permanent_failures: AtomicU64,
    lease_lost: AtomicU64,
    heartbeat_extensions: AtomicU64,
    takeovers: AtomicU64,
    unknown_resolved: AtomicU64,
    store_busy: AtomicU64,
    payload_mismatches: AtomicU64,
    unverified_attributes: AtomicU64,
    outbox_dispatched: AtomicU64,
    outbox_recovered: AtomicU64,
    outbox_dispatch_failures: AtomicU64,
    outbox_refused: AtomicU64,
    latency: Histogram,
    /// The `consumer` label of the facade's copies.
    #[cfg(feature = "metrics")]
    consumer: metrics::SharedString,
}

/// Buckets of the latency histogram: bucket 0 holds everything up to 1 ms,
/// bucket `i` up to `1.25^i` ms; the last one (about 21 minutes and above)
/// everything longer. Fewer than EMF's 100 values per metric, so one line
/// carries the whole histogram.
pub const LATENCY_BUCKETS: usize = 64;
const BUCKET_RATIO: f64 = 1.25;

/// A fixed-size histogram of durations with log-spaced buckets (about 12%
/// precision), lock-free to record.
#[derive(Debug)]
struct Histogram([AtomicU64; LATENCY_BUCKETS]);

impl Default for Histogram {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Histogram {
    fn bucket(ms: f64) -> usize {
        if ms <= 1.0 {
            return 0;
        }
        let i = (ms.ln() / BUCKET_RATIO.ln()).ceil();
        (i as usize).min(LATENCY_BUCKETS - 1)
    }

    /// The value a bucket reports: its upper bound (bucket 0: 1 ms).
    fn value(i: usize) -> f64 {
        let v = BUCKET_RATIO.powi(i32::try_from(i).unwrap_or(i32::MAX));
        (v * 1000.0).round() / 1000.0
    }

    fn record(&self, d: Duration) {
        self.0[Self::bucket(d.as_secs_f64() * 1000.0)].fetch_add(1, Ordering::Relaxed);
    }

    fn take(&self) -> Latencies {
        Latencies(
            self.0
                .iter()
                .enumerate()
                .filter_map(|(i, c)| {
                    let n = c.swap(0, Ordering::Relaxed);
                    (n > 0).then(|| (Self::value(i), n))
                })
                .collect(),
        )
    }
}

/// Handler latencies since the last [`Metrics::take`], as (bucket upper bound
/// in milliseconds, count) pairs in increasing order: EMF's `Values` and
/// `Counts`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latencies(pub Vec<(f64, u64)>);

impl Latencies {
    /// How many samples.
    pub fn count(&self) -> u64 {
        self.0.iter().map(|(_, n)| n).sum()
    }

    /// The bucket bound below which a fraction `q` (0..=1) of samples fall.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        self.0.iter().find_map(|(v, n)| {
            seen += n;
            (seen >= want).then_some(*v)
        })
    }
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
    /// Claims lost while the handler ran: taken over by another consumer, or
    /// not extended in time (the handler was interrupted).
    pub lease_lost: u64,
    /// Successful lease or visibility extensions.
    pub heartbeat_extensions: u64,
    /// Claims taken over from another consumer whose lease had expired
    /// unreleased (it crashed, was cut off, or its handler outran the lease).
    pub takeovers: u64,
    /// DynamoDB writes whose answer was lost, sent again with the same token
    /// and found applied once (by the first send or the retry).
    pub unknown_resolved: u64,
    /// DynamoDB store attempts refused for a transaction conflict on a hot
    /// item (the AWS SDK's own retries inside an attempt are not seen).
    /// Against `Retries` it tells a hot item from an outage or throttling.
    pub store_busy: u64,
    /// Messages whose dedup key was recorded for a different body: a producer
    /// bug (`SQS_ONCE_PAYLOAD_MISMATCH` says whether they are parked).
    pub payload_mismatches: u64,
    /// `sqs_once_dedup_key` / `sqs_once_message_id` attributes that did not
    /// verify under `SQS_ONCE_CARRY_SECRET` and were ignored: set by a producer
    /// (an attempt to take another message's key), forwarded from another
    /// message, or sealed under a secret no longer configured.
    pub unverified_attributes: u64,
    /// Outgoing messages ([`Context::send`](crate::Context::send)) sent
    /// after their commit.
    pub outbox_dispatched: u64,
    /// Outgoing messages sent by a redelivery or duplicate because the run
    /// that committed them did not send them (it crashed, timed out or
    /// failed to send after its commit).
    pub outbox_recovered: u64,
    /// Dispatches that failed after a commit (the message came back to send
    /// them).
    pub outbox_dispatch_failures: u64,
    /// Of those, sends SQS refused as invalid (a target's size limit, a
    /// missing queue, no permission): no retry mends them until the target
    /// is fixed, and the incoming message ends in the DLQ meanwhile.
    pub outbox_refused: u64,
    /// Handler run times.
    pub handler_latency: Latencies,
}

impl Metrics {
    /// Counters of the consumer `consumer` (the `consumer` label of the
    /// `metrics` facade's copies, feature `metrics`).
    pub fn new(consumer: &str) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = consumer;
        Self {
            #[cfg(feature = "metrics")]
            consumer: metrics::SharedString::from_shared(std::sync::Arc::from(consumer)),
            ..Self::default()
        }
    }

    /// Adds `n` to `counter`, and to the facade's counter `name`.
    fn add(&self, counter: &AtomicU64, name: &'static str, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(name, "consumer" => self.consumer.clone()).increment(n);
        #[cfg(not(feature = "metrics"))]
        let _ = name;
    }

    /// Counts a message's outcome.
    pub fn outcome(&self, outcome: &Outcome) {
        let (counter, name) = match outcome {
            Outcome::Completed { .. } => (&self.processed, const { facade("Processed") }),
            Outcome::Duplicate { .. } => (&self.duplicates, const { facade("DuplicatesSkipped") }),
            Outcome::InFlight { .. } => (&self.in_flight, const { facade("InFlightDuplicates") }),
            Outcome::Retry { .. } => (&self.retries, const { facade("Retries") }),
            Outcome::Park { .. } => (
                &self.permanent_failures,
                const { facade("PermanentFailures") },
            ),
        };
        self.add(counter, name, 1);
    }

    /// Counts a lease lost to another consumer.
    pub(crate) fn lease_lost(&self) {
        self.add(&self.lease_lost, const { facade("LeaseLost") }, 1);
    }

    /// Counts a claim taken over from an expired, unreleased one.
    pub fn takeover(&self) {
        self.add(&self.takeovers, const { facade("Takeovers") }, 1);
    }

    /// Counts a write whose lost answer was resolved by sending it again.
    pub(crate) fn unknown_outcome_resolved(&self) {
        self.add(
            &self.unknown_resolved,
            const { facade("UnknownOutcomesResolved") },
            1,
        );
    }

    /// Counts a DynamoDB store attempt refused for a transaction conflict.
    pub(crate) fn store_busy(&self) {
        self.add(&self.store_busy, const { facade("StoreBusy") }, 1);
    }

    /// Counts a duplicate whose body differs from the recorded one.
    pub(crate) fn payload_mismatch(&self) {
        self.add(
            &self.payload_mismatches,
            const { facade("PayloadMismatches") },
            1,
        );
    }

    /// Counts a carried attribute that did not verify and was ignored.
    pub(crate) fn unverified_attribute(&self) {
        self.add(
            &self.unverified_attributes,
            const { facade("UnverifiedAttributes") },
            1,
        );
    }

    /// Counts outgoing messages sent after their commit.
    pub(crate) fn outbox_dispatched(&self, n: u64) {
        self.add(
            &self.outbox_dispatched,
            const { facade("OutboxDispatched") },
            n,
        );
    }

    /// Counts outgoing messages a redelivery or duplicate sent for a run
    /// that committed them and did not send them.
    pub fn outbox_recovered(&self, n: u64) {
        self.add(
            &self.outbox_recovered,
            const { facade("OutboxRecovered") },
            n,
        );
    }

    /// Counts a dispatch that failed after its commit.
    pub(crate) fn outbox_dispatch_failure(&self) {
        self.add(
            &self.outbox_dispatch_failures,
            const { facade("OutboxDispatchFailures") },
            1,
        );
    }

    /// Counts a send SQS refused as invalid.
    pub(crate) fn outbox_refused(&self) {
        self.add(&self.outbox_refused, const { facade("OutboxRefused") }, 1);
    }

    /// Counts a successful heartbeat extension.
    pub(crate) fn heartbeat_extension(&self) {
        self.add(
            &self.heartbeat_extensions,
            const { facade("HeartbeatExtensions") },
            1,
        );
    }

    /// Records how long a handler ran (a histogram bucket; no allocation).
    pub(crate) fn handler_latency(&self, d: Duration) {
        self.latency.record(d);
        #[cfg(feature = "metrics")]
        metrics::histogram!(FACADE_LATENCY, "consumer" => self.consumer.clone())
            .record(d.as_secs_f64());
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
            takeovers: t(&self.takeovers),
            unknown_resolved: t(&self.unknown_resolved),
            store_busy: t(&self.store_busy),
            payload_mismatches: t(&self.payload_mismatches),
            unverified_attributes: t(&self.unverified_attributes),
            outbox_dispatched: t(&self.outbox_dispatched),
            outbox_recovered: t(&self.outbox_recovered),
            outbox_dispatch_failures: t(&self.outbox_dispatch_failures),
            outbox_refused: t(&self.outbox_refused),
            handler_latency: self.latency.take(),
        }
    }
}

impl Snapshot {
    /// The EMF line for these counters with dimension `Consumer`, timestamped
    /// `timestamp_ms`: every counter, and the latency histogram as `Values` and
    /// `Counts` (at most [`LATENCY_BUCKETS`] values, within EMF's 100).
    pub fn emf_lines(&self, consumer: &str, timestamp_ms: i64) -> Vec<Value> {
        let counters = [
            ("Processed", self.processed),
            ("DuplicatesSkipped", self.duplicates),
            ("InFlightDuplicates", self.in_flight),
            ("Retries", self.retries),
            ("PermanentFailures", self.permanent_failures),
            ("LeaseLost", self.lease_lost),
            ("HeartbeatExtensions", self.heartbeat_extensions),
            ("Takeovers", self.takeovers),
            ("UnknownOutcomesResolved", self.unknown_resolved),
            ("StoreBusy", self.store_busy),
            ("PayloadMismatches", self.payload_mismatches),
            ("UnverifiedAttributes", self.unverified_attributes),
            ("OutboxDispatched", self.outbox_dispatched),
            ("OutboxRecovered", self.outbox_recovered),
            ("OutboxDispatchFailures", self.outbox_dispatch_failures),
            ("OutboxRefused", self.outbox_refused),
        ];
        let latency = &self.handler_latency.0;
        let histogram = (!latency.is_empty()).then(|| {
            (
                "HandlerLatency",
                "Milliseconds",
                json!({
                    "Values": latency.iter().map(|(v, _)| v).collect::<Vec<_>>(),
                    "Counts": latency.iter().map(|(_, n)| n).collect::<Vec<_>>(),
                }),
            )
        });
        vec![line(
            consumer,
            timestamp_ms,
            counters
                .iter()
                .map(|(name, v)| (*name, "Count", json!(v)))
                .chain(histogram)
                .collect(),
        )]
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
                "Dimensions": [[DIMENSION]],
                "Metrics": definitions,
            }],
        }),
    );
    root.insert(DIMENSION.into(), json!(consumer));
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
    let now_ms = crate::protocol::clock::Clock::now_ms(&crate::protocol::clock::SystemClock);
    for line in snapshot.emf_lines(consumer, now_ms) {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_emf_counter_has_a_facade_name() {
        for name in METRIC_NAMES.iter().filter(|n| **n != "HandlerLatency") {
            let facade = FACADE_NAMES.iter().find(|(emf, _)| emf == name);
            assert!(facade.is_some(), "{name} has no facade name");
        }
        assert_eq!(FACADE_NAMES.len() + 1, METRIC_NAMES.len());
    }

    /// Processes a message twice over the in-memory store with the
    /// debugging recorder installed: what the facade recorded, by name and
    /// consumer label, and the EMF line of the same counts.
    #[cfg(feature = "metrics")]
    fn recorded() -> (Vec<(String, String, u64)>, Value) {
        use crate::{MemoryStore, Message, Processor, ProcessorConfig, handler_fn};
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let emf = metrics::with_local_recorder(&recorder, || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let handler = handler_fn(|_m, _ctx| async { Ok(None) });
                let config = ProcessorConfig::new("orders");
                let p = Processor::new(MemoryStore::default(), handler, config).unwrap();
                for _ in 0..2 {
                    p.process(Message::new("m-1", "{}")).await;
                }
                p.metrics().take().emf_lines("orders", 0).remove(0)
            })
        });
        let seen = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let consumer = key
                    .labels()
                    .find(|l| l.key() == "consumer")
                    .map_or(String::new(), |l| l.value().to_owned());
                let n = match value {
                    DebugValue::Counter(n) => n,
                    DebugValue::Histogram(samples) => samples.len() as u64,
                    DebugValue::Gauge(_) => 0,
                };
                (key.name().to_owned(), consumer, n)
            })
            .collect();
        (seen, emf)
    }

    #[cfg(feature = "metrics")]
    #[test]
    fn the_facade_counts_what_emf_counts() {
        let (seen, emf) = recorded();
        let count = |name: &str| {
            seen.iter()
                .filter(|(n, _, _)| n == name)
                .map(|(_, consumer, n)| {
                    assert_eq!(consumer, "orders", "{name} is labelled by consumer");
                    *n
                })
                .sum::<u64>()
        };
        assert_eq!(count("sqs_once_processed"), 1, "{seen:?}");
        assert_eq!(count("sqs_once_duplicates_skipped"), 1, "{seen:?}");
        assert_eq!(count(FACADE_LATENCY), 1, "one handler run: {seen:?}");
        for (emf_name, name) in FACADE_NAMES {
            assert_eq!(
                Some(count(name)),
                emf[emf_name].as_u64(),
                "{name} and EMF's {emf_name}"
            );
        }
    }

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
        assert_eq!(lines.len(), 1, "the histogram fits one line");
        let first = &lines[0];
        assert_eq!(first["_aws"]["Timestamp"], 1_700_000_000_000_i64);
        let directive = &first["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "sqs-once");
        assert_eq!(directive["Dimensions"], json!([["Consumer"]]));
        for def in directive["Metrics"].as_array().unwrap() {
            let name = def["Name"].as_str().unwrap();
            assert!(!first[name].is_null(), "{name} declared but missing");
            assert!(METRIC_NAMES.contains(&name), "{name} not in METRIC_NAMES");
        }
        assert_eq!(first["Consumer"], "ledger");
        assert_eq!(first["Processed"], 1);
        assert_eq!(first["DuplicatesSkipped"], 2);
        let values = first["HandlerLatency"]["Values"].as_array().unwrap();
        let counts = first["HandlerLatency"]["Counts"].as_array().unwrap();
        assert_eq!(values.len(), counts.len());
        assert!(values.len() <= 100, "EMF allows 100 values");
        let total: u64 = counts.iter().map(|c| c.as_u64().unwrap()).sum();
        assert_eq!(total, 150);
        assert_eq!(m.take(), Snapshot::default(), "take resets");
    }

    #[test]
    fn a_million_latencies_with_no_reader_stay_in_fixed_memory() {
        let m = Metrics::default();
        let before = std::mem::size_of_val(&m);
        for i in 0..1_000_000u64 {
            m.handler_latency(Duration::from_micros(i * 997 % 3_600_000_000));
        }
        // No heap: the histogram is a fixed array inside the struct.
        assert_eq!(std::mem::size_of_val(&m), before);
        assert!(before <= 1024, "{before} bytes");
        let snap = m.take();
        assert_eq!(snap.handler_latency.count(), 1_000_000);
        assert!(snap.handler_latency.0.len() <= LATENCY_BUCKETS);
    }

    #[test]
    fn histogram_buckets_are_within_a_quarter_of_the_sample() {
        for ms in [0.5, 1.0, 3.0, 20.0, 123.0, 2_000.0, 60_000.0] {
            let b = Histogram::value(Histogram::bucket(ms));
            assert!(
                b >= ms && b <= ms.max(1.0) * BUCKET_RATIO + 1e-9,
                "{ms} -> {b}"
            );
        }
        let m = Metrics::default();
        for i in 1..=100 {
            m.handler_latency(Duration::from_millis(i));
        }
        let l = m.take().handler_latency;
        let p50 = l.quantile(0.5).unwrap();
        assert!((50.0..=63.0).contains(&p50), "{p50}");
    }
}
