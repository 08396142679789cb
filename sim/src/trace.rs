//! The run's history as text lines stamped with virtual time: what `--seed`
//! prints, and what the determinism check hashes.

use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// The trace of one run. Clones share it.
#[derive(Debug, Clone)]
pub struct Trace {
    inner: Arc<Mutex<TraceInner>>,
    start: Instant,
}

#[derive(Debug)]
struct TraceInner {
    hasher: Sha256,
    lines: Option<Vec<String>>,
    count: u64,
    /// Message id -> the outcomes its deliveries ended with.
    outcomes: std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
    /// (message id, receive count) -> when that delivery's outcome came (ms)
    /// and which it was.
    outcome_at: std::collections::BTreeMap<(String, u32), (u128, String)>,
    /// Record reads that failed: (consumer, record key, ms).
    failed_reads: Vec<(String, String, u128)>,
    /// Handlers that started for a redelivery whose record already said
    /// `COMPLETED`: (message id, receive count, consumer, event, when the
    /// record was completed in ms, when the handler started in ms).
    reruns: Vec<(String, u32, String, String, u128, u128)>,
    /// What went wrong, and when ([`Trouble`]).
    trouble: Trouble,
    /// Objects stored in S3 by key: the event whose body each holds.
    objects: std::collections::BTreeMap<String, String>,
}

/// Spans of trouble by host or event: (from, until), ms from the run's start.
pub type Spans = std::collections::BTreeMap<String, Vec<(u128, u128)>>;

/// Spans of trouble on calls by host: (from, until, what the call was made
/// for: [`Subject`]s), ms from the run's start.
pub type CallSpans = std::collections::BTreeMap<String, Vec<(u128, u128, Vec<String>)>>;

/// What a call was made for, as [`Trouble::calls`] names it: a record key,
/// a receipt handle, an event (a large payload's object, an outgoing
/// message), or a receive (the deliveries it took).
pub struct Subject;

impl Subject {
    /// A call on the record `pk`.
    pub fn key(pk: &str) -> String {
        format!("key:{pk}")
    }

    /// A call through the receipt handle `receipt`.
    pub fn receipt(receipt: &str) -> String {
        format!("receipt:{receipt}")
    }

    /// A call for event `id` (its payload's object, its outgoing message).
    pub fn event(id: &str) -> String {
        format!("event:{id}")
    }

    /// A call for the message `id` (a copy of it parked in the DLQ, which
    /// names it).
    pub fn message(id: &str) -> String {
        format!("message:{id}")
    }

    /// A receive: it stands for the deliveries taken over its span.
    pub const RECEIVE: &'static str = "receive";

    /// The event an outgoing message's body names (its `id`; for a
    /// pointer to a body stored in S3, the event whose body the object
    /// holds: [`Trace::object_stored`]), as a subject.
    pub fn of_body(body: &str, trace: &Trace) -> Vec<String> {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
            return Vec::new();
        };
        let event = match v
            .get(1)
            .and_then(|p| p.get("s3Key"))
            .and_then(|k| k.as_str())
        {
            Some(key) => crate::world::event_of_payload_key(key)
                .map(str::to_owned)
                .or_else(|| trace.object_event(key)),
            None => v.get("id").and_then(|i| i.as_str()).map(str::to_owned),
        };
        event.iter().map(|e| Self::event(e)).collect()
    }

    /// What an outgoing message was sent for: the event its body names
    /// ([`Subject::of_body`]), and for a copy parked in the DLQ the message
    /// it stands for.
    pub fn of_outgoing(m: &sqs_once::queue::OutgoingMessage, trace: &Trace) -> Vec<String> {
        let mut out = Self::of_body(&m.body, trace);
        if let Some(sqs_once::Attribute {
            value: sqs_once::AttributeValue::Text(id),
            ..
        }) = m.attributes.get(sqs_once::parking::MESSAGE_ID_ATTRIBUTE)
        {
            out.push(Self::message(id));
        }
        out
    }

    /// The event an object's content names (`"id":"…"` in a body stored
    /// whole or `aws-chunked`).
    pub fn id_in(content: &[u8]) -> Option<String> {
        let text = String::from_utf8_lossy(content);
        let from = text.find("\"id\":\"")? + 6;
        let len = text[from..].find('"')?;
        Some(text[from..from + len].to_owned())
    }
}

/// What went wrong during a run, and when (ms from its start, each a span
/// `(from, until)`): what may explain a receive a message spent without
/// completing ([`crate::check::unexplained_receives`]).
#[derive(Debug, Clone, Default)]
pub struct Trouble {
    /// By host, the trouble of the whole host: a freeze, a partition, a
    /// pause before a request, a crash or a SIGTERM.
    pub hosts: Spans,
    /// By host, trouble on one call, with what the call was made for
    /// ([`Subject`]): a fault drawn for it (over the call's wait, where it
    /// has one), a request landing late, a batch call's entries that failed
    /// alone (those entries' subjects).
    pub calls: CallSpans,
    /// By host: what stops it keeping a message's visibility, a freeze, a
    /// cut from SQS, a pause before a request (each also in `hosts`).
    pub stalls: Spans,
    /// By event: a handler call that panicked, asked to be retried or ran
    /// long (drawn), for its length.
    pub events: Spans,
    /// By delivery (message id, receive count): why it was retried or
    /// parked, as its span said.
    pub reasons: std::collections::BTreeMap<(String, u32), String>,
}

impl Trouble {
    /// Whether `spans` has one that meets `from..=until`.
    pub fn meets(spans: Option<&Vec<(u128, u128)>>, from: u128, until: u128) -> bool {
        spans.is_some_and(|s| s.iter().any(|&(f, u)| f <= until && u >= from))
    }
}

impl Trace {
    /// A trace starting now; keeps its lines only when `keep` (else only
    /// their hash).
    pub fn new(keep: bool) -> Self {
        Self {
            inner: Arc::new(Mutex::new(TraceInner {
                hasher: Sha256::new(),
                lines: keep.then(Vec::new),
                count: 0,
                outcomes: std::collections::BTreeMap::new(),
                outcome_at: std::collections::BTreeMap::new(),
                failed_reads: Vec::new(),
                reruns: Vec::new(),
                trouble: Trouble::default(),
                objects: std::collections::BTreeMap::new(),
            })),
            start: Instant::now(),
        }
    }

    /// When the trace (the run) started.
    pub fn start(&self) -> Instant {
        self.start
    }

    /// Virtual milliseconds since the start.
    pub fn now_ms(&self) -> u128 {
        self.start.elapsed().as_millis()
    }

    /// Records one event.
    pub fn event(&self, what: impl AsRef<str>) {
        let line = format!("{:>10.3}s {}", self.now_ms() as f64 / 1000.0, what.as_ref());
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.hasher.update(line.as_bytes());
        t.hasher.update(b"\n");
        t.count += 1;
        if let Some(lines) = t.lines.as_mut() {
            lines.push(line);
        }
    }

    /// Notes that a record read by `consumer` failed.
    pub fn failed_read(&self, consumer: &str, pk: &str) {
        let now = self.now_ms();
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.failed_reads
            .push((consumer.to_owned(), pk.to_owned(), now));
    }

    /// Notes a handler started for a redelivery whose record said `COMPLETED`.
    /// (`done_ms`: when the record was completed, ms from the start.)
    /// (Noted as the handler starts: now is its start.)
    pub fn rerun(&self, message: &str, count: u32, consumer: &str, event: &str, done_ms: u128) {
        let now = self.now_ms();
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.reruns.push((
            message.to_owned(),
            count,
            consumer.to_owned(),
            event.to_owned(),
            done_ms,
            now,
        ));
    }

    /// Notes trouble on `host` from now for `d` ([`Trouble::hosts`]).
    pub fn host_trouble(&self, host: &str, d: std::time::Duration) {
        self.host_trouble_since(host, self.now_ms(), d);
    }

    /// Notes trouble on `host` from `from` (ms) until `d` from now.
    /// Notes trouble on a call of `host` made for `subjects` (see
    /// [`Trouble::calls`]) from now for `d`.
    pub fn call_trouble(&self, host: &str, subjects: &[String], d: std::time::Duration) {
        let now = self.now_ms();
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.trouble.calls.entry(host.to_owned()).or_default().push((
            now,
            now + d.as_millis(),
            subjects.to_vec(),
        ));
    }

    /// Notes a stall of `host` (see [`Trouble::stalls`]) from now for `d`.
    pub fn host_stall(&self, host: &str, d: std::time::Duration) {
        self.note_trouble(|t| &mut t.stalls, host, self.now_ms(), d);
    }

    /// Notes trouble on `host` from `from` (ms) to `d` from now.
    pub fn host_trouble_since(&self, host: &str, from: u128, d: std::time::Duration) {
        self.note_trouble(|t| &mut t.hosts, host, from, d);
    }

    /// Notes a handler call of `event` that fails or runs long, from now
    /// for `d` ([`Trouble::events`]).
    pub fn event_trouble(&self, event: &str, d: std::time::Duration) {
        self.note_trouble(|t| &mut t.events, event, self.now_ms(), d);
    }

    /// Adds the span from `from` (ms) to `d` from now to `key`'s in the
    /// map `which` picks.
    fn note_trouble(
        &self,
        which: fn(&mut Trouble) -> &mut Spans,
        key: &str,
        from: u128,
        d: std::time::Duration,
    ) {
        let now = self.now_ms();
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        which(&mut t.trouble)
            .entry(key.to_owned())
            .or_default()
            .push((from, now + d.as_millis()));
    }

    /// Notes that the object `key` holds event `event`'s body (an outgoing
    /// body stored in S3 by the outbox).
    pub fn object_stored(&self, key: &str, event: &str) {
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.objects.insert(key.to_owned(), event.to_owned());
    }

    /// The event whose body the object `key` holds, if noted.
    pub fn object_event(&self, key: &str) -> Option<String> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.objects.get(key).cloned()
    }

    /// What went wrong during the run.
    pub fn trouble(&self) -> Trouble {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.trouble.clone()
    }

    /// Record reads that failed: (consumer, record key, ms).
    pub fn failed_reads(&self) -> Vec<(String, String, u128)> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.failed_reads.clone()
    }

    /// Handlers started for completed redeliveries.
    pub fn reruns(&self) -> Vec<(String, u32, String, String, u128, u128)> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.reruns.clone()
    }

    /// When each delivery ended, and how: (message id, receive count) ->
    /// (ms, outcome).
    pub fn outcome_times(&self) -> std::collections::BTreeMap<(String, u32), (u128, String)> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.outcome_at.clone()
    }

    /// The outcome the delivery of `message` at receive `count` ended with,
    /// if it has ended.
    pub fn outcome_of(&self, message: &str, count: u32) -> Option<String> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.outcome_at
            .get(&(message.to_owned(), count))
            .map(|(_, o)| o.clone())
    }

    /// Notes that a delivery of `message` ended with `outcome`.
    fn outcome(&self, message: &str, count: &str, outcome: &str, reason: Option<&str>) {
        let now = self.now_ms();
        let mut t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Ok(count) = count.parse::<u32>() {
            t.outcome_at
                .insert((message.to_owned(), count), (now, outcome.to_owned()));
            if let Some(reason) = reason {
                t.trouble
                    .reasons
                    .insert((message.to_owned(), count), reason.to_owned());
            }
        }
        t.outcomes
            .entry(message.to_owned())
            .or_default()
            .insert(outcome.to_owned());
    }

    /// The outcomes the deliveries of `message` ended with (`completed`,
    /// `duplicate`, `in_flight`, `retry`, `parked`).
    pub fn outcomes_of(&self, message: &str) -> std::collections::BTreeSet<String> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.outcomes.get(message).cloned().unwrap_or_default()
    }

    /// The hash of every line so far (hex), and how many.
    pub fn hash(&self) -> (String, u64) {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (hex::encode(t.hasher.clone().finalize()), t.count)
    }

    /// The kept lines (empty when not kept).
    pub fn lines(&self) -> Vec<String> {
        let t = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        t.lines.clone().unwrap_or_default()
    }
}

/// The fields of a processor's `message` span that the trace keeps.
#[derive(Debug, Default)]
struct MessageSpan {
    fields: Vec<(String, String)>,
}

impl tracing::field::Visit for MessageSpan {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.fields
            .push((field.name().to_owned(), format!("{value:?}")));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.fields
            .push((field.name().to_owned(), value.to_owned()));
    }
}

/// Puts every processed message's outcome in the trace: the processor's
/// `message` span (message id, dedup key, receive count, outcome) when it closes.
pub struct OutcomeLayer(pub Trace);

impl<S> tracing_subscriber::Layer<S> for OutcomeLayer
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() != "message" {
            return;
        }
        let mut fields = MessageSpan::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id)
            && let Some(fields) = span.extensions_mut().get_mut::<MessageSpan>()
        {
            values.record(fields);
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let extensions = span.extensions();
        let Some(fields) = extensions.get::<MessageSpan>() else {
            return;
        };
        let get = |name: &str| {
            fields
                .fields
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map_or("-", |(_, v)| v.as_str())
        };
        let (message, outcome) = (get("messaging.message.id"), get("sqs_once.outcome"));
        let count = get("sqs_once.receive_count");
        self.0.event(format!(
            "outcome {message} key {} receive {count}: {outcome}",
            get("sqs_once.dedup_key"),
        ));
        let reason = Some(get("otel.status_description")).filter(|r| *r != "-");
        self.0.outcome(message, count, outcome, reason);
    }
}
