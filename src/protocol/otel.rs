//! OpenTelemetry export (cargo feature `otel`): the messages' spans (see
//! [`crate::protocol::trace`]) sent by OTLP over HTTP/protobuf when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set, and nothing otherwise.
//!
//! `cli::init_logging` installs [`layer`] next to the log output; a
//! process that sets up its own subscriber adds it itself. The standard
//! variables apply: `OTEL_SERVICE_NAME` (default: the Lambda function's name,
//! else the executable's), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`
//! (default: parent-based, always on; a producer's sampled flag decides a
//! message span only with `SQS_ONCE_TRUST_PRODUCER_SAMPLING=on`, see
//! [`MessageSampler`]),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, and
//! `OTEL_SDK_DISABLED=true` to turn it off. The endpoint is `http://` (a
//! collector beside the process: the ADOT Lambda layer, an ECS sidecar, the
//! CloudWatch agent, which forwards to X-Ray or any other backend) or
//! `https://` (a remote collector or a vendor's OTLP endpoint): TLS is
//! rustls's, the server's certificate verified against the system's trust
//! store (`SSL_CERT_FILE` or `SSL_CERT_DIR` name others, e.g. a private CA's).
//!
//! Spans are batched on a background thread; [`flush`] exports what has
//! ended (the Lambda runtime calls it after every invocation, since the
//! environment may be frozen until the next one) and [`shutdown`] does so for
//! the last time (the poller's exit).

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::{Link, SpanId, SpanKind, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, SamplingResult, SdkTracer, SdkTracerProvider, ShouldSample,
};
use tracing_opentelemetry::OpenTelemetryLayer;

/// The provider [`layer`] installed, which [`flush`] and [`shutdown`] drive.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// How long [`flush`] and [`shutdown`] wait for the collector at most.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// The OTLP exporter could not be built from the environment.
#[derive(Debug, thiserror::Error)]
#[error("cannot export traces: {0}")]
pub struct OtelError(#[from] opentelemetry_otlp::ExporterBuildError);

/// Whether the environment asks for export: an OTLP endpoint is set, and
/// neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`.
pub fn export_configured() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
    let is = |name: &str, value: &str| {
        std::env::var(name).is_ok_and(|v| v.trim().eq_ignore_ascii_case(value))
    };
    (set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        && !is("OTEL_SDK_DISABLED", "true")
        && !is("OTEL_TRACES_EXPORTER", "none")
}

/// A `tracing` layer exporting spans by OTLP/HTTP, when the environment asks
/// for it ([`export_configured`]); `Ok(None)` otherwise. The first provider
/// built is the one [`flush`] and [`shutdown`] drive.
pub fn layer<S>() -> Result<Option<OpenTelemetryLayer<S, SdkTracer>>, OtelError>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    if !export_configured() {
        return Ok(None);
    }
    if std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").is_ok_and(|p| p != "http/protobuf") {
        eprintln!("OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is supported; using it");
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource())
        .with_id_generator(XrayIds::default())
        .with_sampler(MessageSampler::from_env())
        .build();
    let tracer = provider.tracer("sqs-once");
    let _ = PROVIDER.set(provider);
    Ok(Some(tracing_opentelemetry::layer().with_tracer(tracer)))
}

/// The sampler [`layer`] installs: the one the environment names
/// (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`; by default parent-based,
/// always on), except that a message span whose producer's sampling is to be
/// ignored (`sqs_once.producer_sampling = ignored`, see
/// [`crate::protocol::trace::PRODUCER_SAMPLING`]) is decided as a new trace would be
/// (by the root sampler of a parent-based one), keeping the producer's trace
/// id and `tracestate`. A process that builds its own tracer provider
/// installs it with `with_sampler(MessageSampler::from_env())` for
/// `SQS_ONCE_TRUST_PRODUCER_SAMPLING=off` to take effect.
#[derive(Debug, Clone)]
pub struct MessageSampler {
    inner: Box<dyn ShouldSample>,
}

impl MessageSampler {
    /// Around `inner`.
    pub fn new(inner: impl ShouldSample + 'static) -> Self {
        Self {
            inner: Box::new(inner),
        }
    }

    /// Around the sampler the environment names.
    pub fn from_env() -> Self {
        Self {
            inner: opentelemetry_sdk::trace::Config::default().sampler,
        }
    }
}

impl ShouldSample for MessageSampler {
    fn should_sample(
        &self,
        parent_context: Option<&opentelemetry::Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let remote = parent_context
            .map(|cx| cx.span().span_context().clone())
            .filter(|sc| sc.is_valid() && sc.is_remote());
        let ignored = attributes.iter().any(|kv| {
            kv.key.as_str() == crate::protocol::trace::PRODUCER_SAMPLING
                && kv.value.as_str() == "ignored"
        });
        match remote {
            Some(producer) if ignored => {
                let mut own = self
                    .inner
                    .should_sample(None, trace_id, name, span_kind, attributes, links);
                own.trace_state = producer.trace_state().clone();
                own
            }
            _ => self.inner.should_sample(
                parent_context,
                trace_id,
                name,
                span_kind,
                attributes,
                links,
            ),
        }
    }
}

/// Random ids, but a new trace id starts with the epoch second, as X-Ray's
/// do: X-Ray (through a collector) accepts such a trace whatever its age
/// rules, and any other backend sees a random id.
#[derive(Debug, Default)]
struct XrayIds(RandomIdGenerator);

impl IdGenerator for XrayIds {
    fn new_trace_id(&self) -> TraceId {
        let mut id = self.0.new_trace_id().to_bytes();
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        id[..4].copy_from_slice(&u32::try_from(secs).unwrap_or(u32::MAX).to_be_bytes());
        TraceId::from_bytes(id)
    }

    fn new_span_id(&self) -> SpanId {
        self.0.new_span_id()
    }
}

/// The resource from the environment (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`), named after the Lambda function or the
/// executable when neither names the service.
fn resource() -> Resource {
    let named = std::env::var_os("OTEL_SERVICE_NAME").is_some()
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="));
    let builder = Resource::builder();
    if named {
        return builder.build();
    }
    let fallback = std::env::var("AWS_LAMBDA_FUNCTION_NAME").ok().or_else(|| {
        std::env::current_exe()
            .ok()?
            .file_name()?
            .to_str()
            .map(str::to_owned)
    });
    match fallback {
        Some(name) => builder.with_service_name(name).build(),
        None => builder.build(),
    }
}

/// Exports the spans ended so far (bounded by [`FLUSH_TIMEOUT`]); returns at
/// once when [`layer`] installed nothing.
pub async fn flush() {
    drive(|p| p.force_flush(), "flush").await;
}

/// Exports the last spans and stops the exporter (bounded by [`FLUSH_TIMEOUT`]).
pub async fn shutdown() {
    drive(|p| p.shutdown_with_timeout(FLUSH_TIMEOUT), "shutdown").await;
}

/// Runs a blocking provider call off the runtime's threads, for
/// [`FLUSH_TIMEOUT`] at most; a failure is logged, never returned.
async fn drive(
    call: fn(&SdkTracerProvider) -> opentelemetry_sdk::error::OTelSdkResult,
    what: &'static str,
) {
    let Some(provider) = PROVIDER.get() else {
        return;
    };
    let task = tokio::task::spawn_blocking(move || call(provider));
    match tokio::time::timeout(FLUSH_TIMEOUT, task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "trace {what} failed; spans may be lost"),
        Ok(Err(e)) => tracing::warn!(error = %e, "trace {what} panicked"),
        Err(_) => tracing::warn!(timeout = ?FLUSH_TIMEOUT, "trace {what} did not finish in time"),
    }
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, Sampler, SdkTracerProvider, SpanData};
    use tracing_subscriber::layer::SubscriberExt;

    use super::MessageSampler;
    use crate::protocol::trace::{TRACEPARENT, TRACESTATE, TraceParent};
    use crate::{MemoryStore, Message, Outcome, Processor, ProcessorConfig, handler_fn};

    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN: &str = "00f067aa0ba902b7";

    /// The message spans exported when a message whose producer sampled it
    /// (or not) is processed under a consumer sampler of root `root`,
    /// trusting the producer's flag or not.
    async fn exported(producer_sampled: bool, root: Sampler, trust: bool) -> Vec<SpanData> {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .with_sampler(MessageSampler::new(Sampler::ParentBased(Box::new(root))))
            .build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        let _guard = tracing::subscriber::set_default(subscriber);
        let mut config = ProcessorConfig::new("c");
        config.trust_producer_sampling = trust;
        let handler = handler_fn(|_m, _ctx| async { Ok(None) });
        let p = Processor::new(MemoryStore::default(), handler, config).unwrap();
        let flags = if producer_sampled { "01" } else { "00" };
        let m = Message::new("m-1", "{}")
            .with_attribute(TRACEPARENT, format!("00-{TRACE}-{SPAN}-{flags}"))
            .with_attribute(TRACESTATE, "vendor=x");
        assert!(matches!(p.process(m).await, Outcome::Completed { .. }));
        exporter.get_finished_spans().unwrap()
    }

    fn producer() -> TraceParent {
        TraceParent::parse_w3c(&format!("00-{TRACE}-{SPAN}-01")).unwrap()
    }

    fn attr(span: &SpanData, key: &str) -> Option<String> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    }

    /// The one exported span continues the producer's trace.
    fn assert_in_producers_trace(spans: &[SpanData], applied: &str) {
        let [span] = spans else {
            panic!("one span: {spans:#?}")
        };
        assert_eq!(
            span.span_context.trace_id(),
            TraceId::from_bytes(producer().trace_id)
        );
        assert_eq!(span.parent_span_id, SpanId::from_bytes(producer().span_id));
        assert!(span.parent_span_is_remote);
        assert_eq!(span.span_context.trace_state().header(), "vendor=x");
        assert_eq!(
            attr(span, "sqs_once.producer_sampling").as_deref(),
            Some(applied)
        );
    }

    #[tokio::test]
    async fn a_producer_cannot_force_sampling_unless_trusted() {
        let ignored = exported(true, Sampler::AlwaysOff, false).await;
        assert!(
            ignored.is_empty(),
            "the consumer samples nothing: {ignored:#?}"
        );
        let trusted = exported(true, Sampler::AlwaysOff, true).await;
        assert_in_producers_trace(&trusted, "trusted");
    }

    #[tokio::test]
    async fn a_producer_cannot_keep_its_messages_out_of_the_traces_unless_trusted() {
        let ignored = exported(false, Sampler::AlwaysOn, false).await;
        assert_in_producers_trace(&ignored, "ignored");
        let trusted = exported(false, Sampler::AlwaysOn, true).await;
        assert!(
            trusted.is_empty(),
            "the producer's 00 was followed: {trusted:#?}"
        );
    }

    #[tokio::test]
    async fn a_trace_id_ratio_decides_by_the_trace_id_whatever_the_producer_says() {
        // 4bf92f35... falls outside a ratio this small, and inside one this large.
        for (ratio, recorded) in [(1e-9, false), (1.0 - 1e-9, true)] {
            for producer_sampled in [false, true] {
                let spans =
                    exported(producer_sampled, Sampler::TraceIdRatioBased(ratio), false).await;
                assert_eq!(!spans.is_empty(), recorded, "{ratio} {producer_sampled}");
            }
        }
    }
}
