//! What the records, the DLQ, the logs and the spans hold of a message under
//! `hash_keys` (`SQS_ONCE_HASH_KEYS`) and `redact_reasons`
//! (`SQS_ONCE_REDACT_REASONS`), and that they do hold it with the options off
//! (so the captures below can see what they look for): a poller over the
//! in-memory SQS and store, its logs (JSON, every level down to debug, span
//! fields included) and its spans (through `tracing-opentelemetry`) captured.

use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt;

use crate::protocol::clock::TokioClock;
use crate::protocol::key::{record_key, sha256_hex};
use crate::protocol::parking::REASON_ATTRIBUTE;
use crate::protocol::queue::{OutgoingMessage, QueueClient, ReceiveRequest};
use crate::protocol::store::DedupStore;
use crate::runtime::poller::{PollerConfig, RunStats, run};
use crate::testkit::queue::{MemoryQueue, QueueSettings};
use crate::{
    Handler, HandlerError, MemoryStore, Message, Outcome, PayloadMismatch, Processor,
    ProcessorConfig, Status, handler_fn,
};

/// A business key that must not show where keys are hashed.
const KEY: &str = "acct-4111111111111111";
/// What serde quotes of a bad body, which must not show where reasons are redacted.
const QUOTED: &str = "4111-1111-1111-1111";

/// Logs and spans captured while it lives (this thread: the tests run on
/// Tokio's current-thread runtime, so every task is on it).
struct Capture {
    logs: Arc<Mutex<Vec<u8>>>,
    spans: InMemorySpanExporter,
    _guard: tracing::subscriber::DefaultGuard,
}

#[derive(Clone)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture() -> Capture {
    let logs = Arc::new(Mutex::new(Vec::new()));
    let writer = Buffer(logs.clone());
    let spans = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(spans.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .json()
                .with_writer(move || writer.clone())
                .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
        )
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    Capture {
        logs,
        spans,
        _guard: tracing::subscriber::set_default(subscriber),
    }
}

impl Capture {
    fn logs(&self) -> String {
        String::from_utf8(self.logs.lock().unwrap().clone()).unwrap()
    }

    fn spans(&self) -> Vec<SpanData> {
        self.spans.get_finished_spans().unwrap()
    }

    /// Every attribute value and status text of every span, as text.
    fn span_text(&self) -> String {
        let mut out = String::new();
        for span in self.spans() {
            for kv in &span.attributes {
                out.push_str(&format!("{}={}\n", kv.key, kv.value));
            }
            out.push_str(&format!("status={:?}\n", span.status));
        }
        out
    }
}

/// The attribute `key` of the message span of the `n`th message processed.
fn message_attr(spans: &[SpanData], key: &str) -> Vec<String> {
    spans
        .iter()
        .filter(|s| s.name.starts_with("process"))
        .filter_map(|s| {
            s.attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        })
        .collect()
}

fn config(hash_keys: bool, redact_reasons: bool) -> ProcessorConfig {
    let mut c = ProcessorConfig::new("c");
    c.key_source = "json:/id".parse().unwrap();
    c.payload_mismatch = PayloadMismatch::Park;
    c.hash_keys = hash_keys;
    c.redact_reasons = redact_reasons;
    c
}

/// The queue and its DLQ, with `bodies` sent.
async fn queue_with(bodies: &[&str]) -> (MemoryQueue, String, String) {
    let queue = MemoryQueue::new();
    let url = queue.create_queue(QueueSettings::new("q")).unwrap();
    let dlq = queue.create_queue(QueueSettings::new("q-dlq")).unwrap();
    for body in bodies {
        let message = OutgoingMessage {
            body: (*body).to_owned(),
            ..Default::default()
        };
        queue.send(&url, message).await.unwrap();
    }
    (queue, url, dlq)
}

/// Polls until idle, one message at a time (in the order sent).
async fn drain<H: Handler>(
    queue: &MemoryQueue,
    url: &str,
    dlq: &str,
    processor: Processor<MemoryStore, H>,
) -> RunStats {
    let mut pc = PollerConfig::new(url);
    pc.dlq_url = Some(dlq.to_owned());
    pc.concurrency = 1;
    pc.prefetch = 0;
    pc.exit_when_idle = Some(Duration::from_secs(5));
    run(queue.clone(), processor, pc, CancellationToken::new()).await
}

/// The reasons of the messages parked in `dlq`.
async fn parked_reasons(queue: &MemoryQueue, dlq: &str) -> Vec<String> {
    let request = ReceiveRequest {
        max: 10,
        wait: Duration::ZERO,
        visibility: Duration::from_secs(30),
    };
    queue
        .receive(dlq, request)
        .await
        .unwrap()
        .iter()
        .map(|m| m.attribute(REASON_ATTRIBUTE).unwrap().to_owned())
        .collect()
}

fn store() -> MemoryStore {
    MemoryStore::new(Arc::new(TokioClock::starting_at(UNIX_EPOCH)))
}

/// What a run of one key's three messages left: the first completes, the
/// second is its duplicate, the third reuses the key with another body and
/// is parked (its reason names the key).
struct KeyRun {
    capture: Capture,
    store: MemoryStore,
    stats: RunStats,
    reasons: Vec<String>,
}

async fn key_run(hash_keys: bool) -> KeyRun {
    let capture = capture();
    let first = format!(r#"{{"id":"{KEY}","n":1}}"#);
    let other = format!(r#"{{"id":"{KEY}","n":2}}"#);
    let (queue, url, dlq) = queue_with(&[&first, &first, &other]).await;
    let handler = handler_fn(|_m: Message, _ctx| async {
        tracing::info!("handled");
        Ok(None)
    });
    let p = Processor::new(store(), handler, config(hash_keys, false)).unwrap();
    let stats = drain(&queue, &url, &dlq, p.clone()).await;
    let reasons = parked_reasons(&queue, &dlq).await;
    KeyRun {
        capture,
        store: p.store().clone(),
        stats,
        reasons,
    }
}

#[tokio::test(start_paused = true)]
async fn hashed_keys_keep_the_raw_key_out_of_records_reasons_logs_and_spans() {
    let hashed = format!("sha256:{}", sha256_hex(KEY.as_bytes()));
    let r = key_run(true).await;
    assert_eq!(
        (r.stats.completed, r.stats.duplicates, r.stats.parked),
        (1, 1, 1),
        "dedup works the same: {:?}",
        r.stats
    );
    let record = r.store.get(&format!("c#{hashed}")).await.unwrap();
    assert_eq!(record.map(|r| r.status), Some(Status::Completed));
    assert!(r.store.get(&format!("c#{KEY}")).await.unwrap().is_none());
    let [reason] = &r.reasons[..] else {
        panic!("one parked message: {:?}", r.reasons)
    };
    assert!(
        reason.contains("payload mismatch") && reason.contains(&hashed),
        "{reason}"
    );
    let (logs, spans) = (r.capture.logs(), r.capture.span_text());
    assert!(logs.contains("handled") && logs.contains(&hashed), "{logs}");
    assert!(!logs.contains(KEY), "the raw key in the logs: {logs}");
    assert!(!spans.contains(KEY), "the raw key in a span: {spans}");
    let all = r.capture.spans();
    assert_eq!(
        message_attr(&all, "sqs_once.dedup_key"),
        vec![hashed.clone(); 3]
    );
    assert_eq!(
        message_attr(&all, "sqs_once.record_key"),
        vec![format!("c#{hashed}"); 3]
    );
}

#[tokio::test(start_paused = true)]
async fn without_hashing_the_raw_key_is_in_the_record_the_reason_the_logs_and_the_spans() {
    let r = key_run(false).await;
    assert_eq!(
        (r.stats.completed, r.stats.duplicates, r.stats.parked),
        (1, 1, 1)
    );
    let record = r.store.get(&record_key("c", KEY)).await.unwrap();
    assert_eq!(record.map(|r| r.status), Some(Status::Completed));
    assert!(r.reasons[0].contains(KEY), "{:?}", r.reasons);
    assert!(r.capture.logs().contains(KEY));
    assert!(r.capture.span_text().contains(KEY));
    assert_eq!(
        message_attr(&r.capture.spans(), "sqs_once.dedup_key"),
        vec![KEY; 3]
    );
}

/// A handler failing as its message's `id` says: `bad-card` with serde's
/// error (which quotes the value) as permanent, `flaky` with an I/O error
/// naming the value as transient, `boom` with a panic naming it.
fn failing() -> impl Handler {
    handler_fn(|m: Message, _ctx| async move {
        let id: serde_json::Value = m.json()?;
        match id["id"].as_str() {
            Some("bad-card") => {
                let quoted = format!(r#""{QUOTED}""#);
                serde_json::from_str::<u64>(&quoted).map_err(HandlerError::permanent)?;
                Ok(None)
            }
            Some("flaky") => Err(std::io::Error::other(format!("timeout for {QUOTED}")).into()),
            _ => panic!("no card {QUOTED}"),
        }
    })
}

struct FailureRun {
    capture: Capture,
    /// The parked message's reason, and the outcomes of `flaky` and `boom`.
    parked: Vec<String>,
    flaky: Outcome,
    boom: Outcome,
    /// The records' `error` of `bad-card` and `flaky`.
    errors: Vec<String>,
}

async fn failure_run(redact: bool) -> FailureRun {
    let capture = capture();
    let (queue, url, dlq) = queue_with(&[r#"{"id":"bad-card"}"#]).await;
    let p = Processor::new(store(), failing(), config(false, redact)).unwrap();
    let stats = drain(&queue, &url, &dlq, p.clone()).await;
    assert_eq!(stats.parked, 1, "{stats:?}");
    let flaky = p.process(Message::new("m-f", r#"{"id":"flaky"}"#)).await;
    let boom = p.process(Message::new("m-b", r#"{"id":"boom"}"#)).await;
    let mut errors = Vec::new();
    for key in ["bad-card", "flaky"] {
        let record = p.store().get(&record_key("c", key)).await.unwrap().unwrap();
        errors.push(record.error.unwrap_or_default());
    }
    FailureRun {
        parked: parked_reasons(&queue, &dlq).await,
        capture,
        flaky,
        boom,
        errors,
    }
}

fn reason(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::Retry { reason, .. } | Outcome::Park { reason } => reason,
        other => panic!("not a failure: {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn redacted_reasons_name_the_failure_kind_and_type_but_never_its_text() {
    let r = failure_run(true).await;
    let permanent = "handler failed permanently: permanent error of type serde_json::error::Error, its text redacted (SQS_ONCE_REDACT_REASONS)";
    assert_eq!(r.parked, vec![permanent.to_owned()], "the DLQ's reason");
    assert_eq!(r.errors[0], permanent, "the FAILED record's error");
    let transient = "transient error of type std::io::error::Error, its text redacted (SQS_ONCE_REDACT_REASONS)";
    assert_eq!(reason(&r.flaky), transient);
    assert_eq!(r.errors[1], transient, "the released record's error");
    assert_eq!(
        reason(&r.boom),
        "handler panicked, its message redacted (SQS_ONCE_REDACT_REASONS)"
    );
    let (logs, spans) = (r.capture.logs(), r.capture.span_text());
    assert!(logs.contains("its text redacted"), "{logs}");
    assert!(spans.contains("its text redacted"), "{spans}");
    for (what, text) in [("logs", &logs), ("spans", &spans)] {
        assert!(
            !text.contains(QUOTED),
            "the handler's error text in the {what}: {text}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn unredacted_reasons_carry_the_handlers_error_text_everywhere() {
    let r = failure_run(false).await;
    assert!(r.parked[0].contains(QUOTED), "{:?}", r.parked);
    assert!(
        r.errors.iter().all(|e| e.contains(QUOTED)),
        "{:?}",
        r.errors
    );
    assert!(reason(&r.flaky).contains(QUOTED) && reason(&r.boom).contains(QUOTED));
    assert!(r.capture.logs().contains(QUOTED));
    assert!(r.capture.span_text().contains(QUOTED));
}

#[test]
fn an_error_s_type_is_named_only_where_it_says_something() {
    let serde = serde_json::from_str::<u64>("x").unwrap_err();
    assert_eq!(
        HandlerError::permanent(serde).error_type(),
        Some("serde_json::error::Error")
    );
    let io: HandlerError = std::io::Error::other("x").into();
    assert_eq!(io.error_type(), Some("std::io::error::Error"));
    assert_eq!(HandlerError::retry("text").error_type(), None);
    assert_eq!(HandlerError::retry(String::from("text")).error_type(), None);
    let boxed: Box<dyn std::error::Error + Send + Sync> = "x".into();
    assert_eq!(HandlerError::permanent(boxed).error_type(), None);
}
