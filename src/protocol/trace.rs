//! Traces across the queue: the spans the runtimes make, named and attributed
//! by OpenTelemetry's messaging semantic conventions, and the trace context a
//! message carries from its producer.
//!
//! # Spans
//! - One per message, `process {queue}` (kind consumer): `messaging.system =
//!   aws_sqs`, `messaging.destination.name`, `messaging.message.id`,
//!   `messaging.operation.type` and `.name` = `process`, and sqs-once's own
//!   `sqs_once.consumer`, `sqs_once.dedup_key`, `sqs_once.record_key`,
//!   `sqs_once.group`, `sqs_once.receive_count`, `sqs_once.attempt`,
//!   `sqs_once.path` (`fast`, `claim` or `unprotected`), `sqs_once.outcome`
//!   and, for a message with a producer context, `sqs_once.producer_sampling`.
//!   A retry or a park sets the span's status to error, with `error.type`.
//! - One per poller receive that returned messages, `receive {queue}`
//!   (`messaging.operation.type = receive`, `messaging.batch.message_count`),
//!   linked to each message's producer context. A long poll that returns
//!   nothing makes no span: it would be one trace every 20 s per poller.
//! - One per Lambda invocation, `process {queue}` with
//!   `messaging.batch.message_count` and `faas.trigger = pubsub`, linked to
//!   each message's producer context (OpenTelemetry's AWS Lambda conventions
//!   make the invocation of an SQS event a `process` span, not a `receive`).
//!
//! # The producer's context
//! A message's span is the child of the context its producer sent: a W3C
//! `traceparent` message attribute (with `tracestate`, if any), else the
//! `AWSTraceHeader` system attribute (X-Ray format, set by SQS from the
//! sender's X-Ray segment or by the sender). When both are there the
//! `traceparent` wins: it is what an OpenTelemetry producer set on purpose,
//! while `AWSTraceHeader` may be the X-Ray segment of the `SendMessage` call.
//! A malformed value is ignored (logged at debug level): the message is
//! processed as if it had none, never failed for it. Without a context, the
//! span starts a trace (Lambda: a child of the invocation's span).
//!
//! The context's sampled flag is the producer's say: unless
//! [`ProcessorConfig::trust_producer_sampling`](crate::ProcessorConfig::trust_producer_sampling)
//! (`SQS_ONCE_TRUST_PRODUCER_SAMPLING`), the span carries
//! `sqs_once.producer_sampling = ignored` and the sampler `cli::init_logging`
//! installs (`sqs_once::otel::MessageSampler`) decides as for a new trace,
//! the span staying in the producer's trace: a producer can neither force
//! its messages into the traces nor keep them out.
//!
//! # Exporting
//! Spans are `tracing` spans. With the cargo feature `otel`, a
//! `tracing-opentelemetry` layer turns them into OpenTelemetry spans with the
//! producer as parent; `cli::init_logging` installs one that exports
//! by OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (see
//! `sqs_once::otel`), and the runtimes flush it: after each Lambda
//! invocation (the environment may be frozen next) and when the poller stops.
//! A handler passes the context on with [`crate::Context::traceparent`].

use std::fmt;

use tracing::Span;

use crate::Message;
use crate::protocol::outcome::Outcome;

/// The message attribute of a W3C trace context (`traceparent`).
pub const TRACEPARENT: &str = "traceparent";
/// The message attribute of a W3C trace state (`tracestate`).
pub const TRACESTATE: &str = "tracestate";
/// The SQS system attribute carrying an X-Ray trace header.
pub const AWS_TRACE_HEADER: &str = "AWSTraceHeader";

/// A span in another process to continue: trace id, span id and whether the
/// trace is sampled. Written and read as a W3C `traceparent` or an X-Ray
/// trace header.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace id (16 bytes, never all zero).
    pub trace_id: [u8; 16],
    /// The parent span's id (8 bytes, never all zero).
    pub span_id: [u8; 8],
    /// Whether the producer sampled the trace.
    pub sampled: bool,
}

/// Why a trace header was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceHeaderError {
    /// A `traceparent` that is not `{version}-{trace id}-{span id}-{flags}`
    /// in lowercase hex of the right lengths.
    #[error("not a W3C traceparent: {0}")]
    W3c(&'static str),
    /// An X-Ray header without a well-formed `Root` and `Parent`.
    #[error("not an X-Ray trace header: {0}")]
    Xray(&'static str),
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceParent({})", self.w3c())
    }
}

impl TraceParent {
    /// Reads a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`). A later
    /// version is read by its first four fields, as the specification says.
    pub fn parse_w3c(value: &str) -> Result<Self, TraceHeaderError> {
        use TraceHeaderError::W3c;
        let value = value.trim();
        let mut parts = value.split('-');
        let (Some(version), Some(trace), Some(span), Some(flags)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(W3c("fewer than four fields"));
        };
        let version = hex_array::<1>(version).ok_or(W3c("bad version"))?[0];
        if version == 0xff {
            return Err(W3c("version ff is invalid"));
        }
        if version == 0 && (parts.next().is_some() || value.len() != 55) {
            return Err(W3c("version 00 has exactly four fields"));
        }
        let trace_id = hex_array::<16>(trace).ok_or(W3c("bad trace id"))?;
        let span_id = hex_array::<8>(span).ok_or(W3c("bad parent id"))?;
        let flags = hex_array::<1>(flags).ok_or(W3c("bad flags"))?[0];
        Self::checked(trace_id, span_id, flags & 1 == 1).ok_or(W3c("all-zero id"))
    }

    /// Reads an X-Ray trace header (`Root=1-<8 hex>-<24 hex>;Parent=<16
    /// hex>;Sampled=1`, fields in any order, others ignored). `Sampled=0`
    /// is not sampled; `Sampled=?` or none (the decision left to the
    /// receiver) is sampled.
    pub fn parse_xray(value: &str) -> Result<Self, TraceHeaderError> {
        use TraceHeaderError::Xray;
        let (mut root, mut parent, mut sampled) = (None, None, true);
        for field in value.split(';') {
            let Some((k, v)) = field.split_once('=') else {
                continue;
            };
            match k.trim() {
                "Root" => root = Some(v.trim()),
                "Parent" => parent = Some(v.trim()),
                "Sampled" => sampled = v.trim() != "0",
                _ => {}
            }
        }
        let root = root.ok_or(Xray("no Root"))?;
        let mut parts = root.split('-');
        let (Some("1"), Some(time), Some(random), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Xray("Root is not 1-<time>-<random>"));
        };
        if time.len() != 8 || random.len() != 24 {
            return Err(Xray("Root is not 1-<8 hex>-<24 hex>"));
        }
        let trace_id = hex_array::<16>(&format!("{time}{random}")).ok_or(Xray("bad Root"))?;
        let span_id = hex_array::<8>(parent.ok_or(Xray("no Parent"))?).ok_or(Xray("bad Parent"))?;
        Self::checked(trace_id, span_id, sampled).ok_or(Xray("all-zero id"))
    }

    fn checked(trace_id: [u8; 16], span_id: [u8; 8], sampled: bool) -> Option<Self> {
        (trace_id != [0; 16] && span_id != [0; 8]).then_some(Self {
            trace_id,
            span_id,
            sampled,
        })
    }

    /// The producer's context a message carries: its `traceparent` attribute
    /// if it reads, else its `AWSTraceHeader`; `None` when it has neither
    /// (a malformed one is logged at debug level and ignored).
    pub(crate) fn of_message(message: &Message) -> Option<Self> {
        let w3c = message.attribute(TRACEPARENT).and_then(|v| {
            Self::parse_w3c(v)
                .inspect_err(|e| tracing::debug!(message_id = message.id(), error = %e, "traceparent attribute ignored"))
                .ok()
        });
        w3c.or_else(|| {
            Self::parse_xray(message.aws_trace_header()?)
                .inspect_err(|e| tracing::debug!(message_id = message.id(), error = %e, "AWSTraceHeader ignored"))
                .ok()
        })
    }

    /// As a W3C `traceparent` (version 00).
    pub fn w3c(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            u8::from(self.sampled)
        )
    }

    /// As an X-Ray trace header (`Root=1-...;Parent=...;Sampled=0|1`).
    pub fn xray(&self) -> String {
        let trace = hex::encode(self.trace_id);
        format!(
            "Root=1-{}-{};Parent={};Sampled={}",
            &trace[..8],
            &trace[8..],
            hex::encode(self.span_id),
            u8::from(self.sampled)
        )
    }
}

/// `N` bytes from exactly `2N` lowercase or uppercase hex digits.
fn hex_array<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// The queue's name from its URL (`https://.../123456789012/orders`) or ARN
/// (`arn:aws:sqs:eu-west-1:123456789012:orders`): the destination of the spans.
pub fn queue_name(url_or_arn: &str) -> &str {
    url_or_arn.rsplit(['/', ':']).next().unwrap_or(url_or_arn)
}

/// The span attribute that says whether a message's producer context
/// decided its sampling (`trusted`) or the consumer's sampler did
/// (`ignored`); absent when the message carries no context. Read by
/// `sqs_once::otel::MessageSampler`.
pub const PRODUCER_SAMPLING: &str = "sqs_once.producer_sampling";

/// The span of one message, child of its producer's context (see the module
/// documentation); the processor records the rest of its fields. Unless
/// `trust_sampling`, the span says its producer's sampled flag is to be
/// ignored ([`PRODUCER_SAMPLING`]).
pub(crate) fn message_span(message: &Message, consumer: &str, trust_sampling: bool) -> Span {
    let queue = message.queue();
    let parent = TraceParent::of_message(message);
    let producer_sampling = match (&parent, trust_sampling) {
        (None, _) => None,
        (Some(_), true) => Some("trusted"),
        (Some(_), false) => Some("ignored"),
    };
    let span = tracing::info_span!(
        "message",
        otel.name = process_name(queue).as_str(),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        otel.status_description = tracing::field::Empty,
        error.type = tracing::field::Empty,
        messaging.system = "aws_sqs",
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = queue,
        messaging.message.id = message.id(),
        sqs_once.consumer = consumer,
        sqs_once.dedup_key = tracing::field::Empty,
        sqs_once.record_key = tracing::field::Empty,
        sqs_once.group = message.group_id(),
        sqs_once.receive_count = message.receive_count(),
        sqs_once.attempt = tracing::field::Empty,
        sqs_once.path = tracing::field::Empty,
        sqs_once.outcome = tracing::field::Empty,
        sqs_once.producer_sampling = producer_sampling,
    );
    if let Some(parent) = parent {
        // A `tracestate` goes with its `traceparent` only.
        let w3c = message
            .attribute(TRACEPARENT)
            .is_some_and(|v| TraceParent::parse_w3c(v) == Ok(parent));
        let state = message.attribute(TRACESTATE).filter(|_| w3c);
        otel::continue_trace(&span, &parent, state);
    }
    span
}

/// `process {queue}`, or `process` when the queue is not known.
fn process_name(queue: Option<&str>) -> String {
    match queue {
        Some(q) => format!("process {q}"),
        None => "process".to_owned(),
    }
}

/// Records the outcome on a message's span: a retry or a park is an error.
pub(crate) fn record_outcome(span: &Span, outcome: &Outcome) {
    span.record("sqs_once.outcome", outcome.name());
    let reason = match outcome {
        Outcome::Retry { reason, .. } | Outcome::Park { reason } => reason,
        _ => return,
    };
    span.record("otel.status_code", "error");
    span.record("otel.status_description", reason.as_str());
    span.record("error.type", outcome.name());
}

/// The span of a receive that returned `messages` from `queue` (a name).
#[cfg(feature = "poller")]
pub(crate) fn receive_span(queue: &str, messages: &[Message]) -> Span {
    let span = tracing::info_span!(
        "receive",
        otel.name = %format!("receive {queue}"),
        otel.kind = "consumer",
        messaging.system = "aws_sqs",
        messaging.operation.type = "receive",
        messaging.operation.name = "receive",
        messaging.destination.name = queue,
        messaging.batch.message_count = messages.len(),
    );
    link_producers(&span, messages);
    span
}

/// The span of a Lambda invocation with an SQS event of `count` records,
/// from `queue` (a name) when known.
#[cfg(feature = "lambda")]
pub(crate) fn invocation_span(queue: Option<&str>, count: usize, request_id: Option<&str>) -> Span {
    tracing::info_span!(
        "invocation",
        otel.name = process_name(queue).as_str(),
        otel.kind = "consumer",
        faas.trigger = "pubsub",
        faas.invocation_id = request_id,
        messaging.system = "aws_sqs",
        messaging.operation.type = "process",
        messaging.operation.name = "process",
        messaging.destination.name = queue,
        messaging.batch.message_count = count,
    )
}

/// Links `span` to each message's producer context (batch spans, by the
/// conventions: a batch has no single parent).
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) fn link_producers<'a>(span: &Span, messages: impl IntoIterator<Item = &'a Message>) {
    for m in messages {
        if let Some(parent) = TraceParent::of_message(m) {
            otel::link(span, &parent);
        }
    }
}

/// The context of `span` for outgoing calls, when spans are OpenTelemetry
/// spans (the `otel` feature, with its layer installed); else `None`.
pub(crate) fn context_of(span: &Span) -> Option<TraceParent> {
    otel::context_of(span)
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceParent;

    fn span_context(parent: &TraceParent, state: Option<&str>) -> SpanContext {
        let state = state
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let flags = if parent.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.span_id),
            flags,
            true,
            state,
        )
    }

    pub(super) fn continue_trace(span: &Span, parent: &TraceParent, state: Option<&str>) {
        // The runtime's span (Lambda: the invocation) is linked instead.
        let outer = Span::current().context().span().span_context().clone();
        let cx =
            opentelemetry::Context::new().with_remote_span_context(span_context(parent, state));
        // Fails only without the layer: the span is then not an OTel span.
        if span.set_parent(cx).is_ok() && outer.is_valid() {
            span.add_link(outer);
        }
    }

    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(super) fn link(span: &Span, parent: &TraceParent) {
        span.add_link(span_context(parent, None));
    }

    pub(super) fn context_of(span: &Span) -> Option<TraceParent> {
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        sc.is_valid().then(|| TraceParent {
            trace_id: sc.trace_id().to_bytes(),
            span_id: sc.span_id().to_bytes(),
            sampled: sc.is_sampled(),
        })
    }
}

#[cfg(not(feature = "otel"))]
mod otel {
    use tracing::Span;

    use super::TraceParent;

    pub(super) fn continue_trace(_: &Span, _: &TraceParent, _: Option<&str>) {}

    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(super) fn link(_: &Span, _: &TraceParent) {}

    pub(super) fn context_of(_: &Span) -> Option<TraceParent> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";

    fn tp(sampled: bool) -> TraceParent {
        TraceParent {
            trace_id: hex_array(TRACE).unwrap(),
            span_id: hex_array(SPAN).unwrap(),
            sampled,
        }
    }

    #[test]
    fn w3c_traceparent_reads_and_writes_back() {
        let v = format!("00-{TRACE}-{SPAN}-01");
        assert_eq!(TraceParent::parse_w3c(&v), Ok(tp(true)));
        assert_eq!(tp(true).w3c(), v);
        let unsampled = format!("00-{TRACE}-{SPAN}-00");
        assert_eq!(TraceParent::parse_w3c(&unsampled), Ok(tp(false)));
        // A later version: its first four fields, whatever follows.
        let later = format!("cc-{TRACE}-{SPAN}-01-what-the-future-holds");
        assert_eq!(TraceParent::parse_w3c(&later), Ok(tp(true)));
    }

    #[test]
    fn malformed_w3c_traceparents_are_rejected() {
        for bad in [
            String::new(),
            "garbage".into(),
            format!("00-{TRACE}-{SPAN}"),
            format!("00-{TRACE}-{SPAN}-01-extra"),
            format!("ff-{TRACE}-{SPAN}-01"),
            format!("00-{}-{SPAN}-01", "0".repeat(32)),
            format!("00-{TRACE}-{}-01", "0".repeat(16)),
            format!("00-{}-{SPAN}-01", &TRACE[1..]),
            format!("00-{TRACE}-{}x-01", &SPAN[1..]),
            format!("0-{TRACE}-{SPAN}-01"),
        ] {
            assert!(TraceParent::parse_w3c(&bad).is_err(), "{bad:?} was read");
        }
    }

    #[test]
    fn xray_header_reads_and_writes_back() {
        let v = "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1";
        assert_eq!(TraceParent::parse_xray(v), Ok(tp(true)));
        assert_eq!(tp(true).xray(), v);
        let reordered = "Sampled=0;Lineage=a87bd80c:1|68fd508a:5; Parent=00f067aa0ba902b7 ;Root=1-4bf92f35-77b34da6a3ce929d0e0e4736";
        assert_eq!(TraceParent::parse_xray(reordered), Ok(tp(false)));
        let deferred = "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=?";
        assert_eq!(TraceParent::parse_xray(deferred), Ok(tp(true)));
    }

    #[test]
    fn malformed_xray_headers_are_rejected() {
        for bad in [
            "",
            "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736",
            "Parent=00f067aa0ba902b7;Sampled=1",
            "Root=2-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7",
            "Root=1-4bf92f3-577b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7",
            "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736-1;Parent=00f067aa0ba902b7",
            "Root=1-4bf92f35-77b34da6a3ce929d0e0e473z;Parent=00f067aa0ba902b7",
            "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902",
            "Root=1-00000000-000000000000000000000000;Parent=00f067aa0ba902b7",
        ] {
            assert!(TraceParent::parse_xray(bad).is_err(), "{bad:?} was read");
        }
    }

    #[test]
    fn a_message_s_traceparent_wins_over_its_aws_trace_header_and_bad_ones_are_ignored() {
        let xray = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1";
        let from_xray = TraceParent::parse_xray(xray).unwrap();
        let m = Message::new("m1", "{}").with_aws_trace_header(xray);
        assert_eq!(TraceParent::of_message(&m), Some(from_xray));
        let both = m.clone().with_attribute(TRACEPARENT, tp(true).w3c());
        assert_eq!(TraceParent::of_message(&both), Some(tp(true)));
        // A malformed traceparent falls back to the X-Ray header; a malformed
        // X-Ray header alone is no context at all.
        let bad = m.with_attribute(TRACEPARENT, "00-nonsense");
        assert_eq!(TraceParent::of_message(&bad), Some(from_xray));
        let none = Message::new("m2", "{}").with_aws_trace_header("Root=nonsense");
        assert_eq!(TraceParent::of_message(&none), None);
        assert_eq!(TraceParent::of_message(&Message::new("m3", "")), None);
    }

    #[tokio::test]
    async fn a_message_with_malformed_trace_headers_is_processed_as_any_other() {
        use crate::{MemoryStore, Processor, ProcessorConfig, handler_fn};
        let handler = handler_fn(|_m, ctx: crate::Context| async move {
            // No OpenTelemetry layer here: nothing to pass on.
            assert_eq!(ctx.traceparent(), None);
            Ok(None)
        });
        let p = Processor::new(MemoryStore::default(), handler, ProcessorConfig::new("c")).unwrap();
        let m = Message::new("m1", "{}")
            .with_attribute(TRACEPARENT, "00-not-a-trace-01")
            .with_attribute(TRACESTATE, "vendor=x")
            .with_aws_trace_header("Root=1-nope;Parent=nope");
        assert!(matches!(p.process(m).await, Outcome::Completed { .. }));
    }

    #[test]
    fn queue_names_come_from_urls_and_arns() {
        assert_eq!(
            queue_name("https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"),
            "orders.fifo"
        );
        assert_eq!(
            queue_name("arn:aws:sqs:eu-west-1:123456789012:orders"),
            "orders"
        );
        assert_eq!(queue_name("orders"), "orders");
    }
}
