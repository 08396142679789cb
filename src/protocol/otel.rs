//! OpenTelemetry export (cargo feature `otel`): the messages' spans (see
//! [`crate::protocol::trace`]) sent by OTLP over HTTP/protobuf when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is
//! set, and nothing otherwise.
//!
//! `cli::init_logging` installs [`layer`] next to the log output; a
//! process that sets up its own subscriber adds it itself. The standard
//! variables apply: `OTEL_SERVICE_NAME` (default: the Lambda function's name,
//! else the executable's), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`
//! (default: follow the producer's sampling decision, sample new traces),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, and
//! `OTEL_SDK_DISABLED=true` to turn it off. The endpoint is plain HTTP: a
//! collector beside the process (the ADOT Lambda layer, an ECS sidecar, the
//! CloudWatch agent) that forwards to X-Ray or any other backend.
//!
//! Spans are batched on a background thread; [`flush`] exports what has
//! ended (the Lambda runtime calls it after every invocation, since the
//! environment may be frozen until the next one) and [`shutdown`] does so for
//! the last time (the poller's exit).

use std::sync::OnceLock;
use std::time::Duration;

use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};
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
        .build();
    let tracer = provider.tracer("sqs-once");
    let _ = PROVIDER.set(provider);
    Ok(Some(tracing_opentelemetry::layer().with_tracer(tracer)))
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
