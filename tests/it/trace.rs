//! Traces across the queue: messages sent through LocalStack with an
//! `AWSTraceHeader` system attribute, a `traceparent` message attribute, both,
//! or neither, processed by the poller and by the Lambda adapter (spans
//! captured in process), and by the real `payments` binary exporting to an
//! OTLP/HTTP receiver this test starts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeNameForSends, MessageSystemAttributeValue,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry::trace::{SpanId, SpanKind, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::json;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::poller::PollerConfig;
use sqs_once::trace::TraceParent;
use sqs_once::{MemoryStore, Processor, ProcessorConfig, handler_fn};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::layer::SubscriberExt;

use crate::common::{Ledger, StubApi, ddb, queues, run_until_drained_with, sqs};

const XRAY: &str = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1";
const W3C: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const W3C_BOTH: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// How a test message carries its producer's context.
#[derive(Clone, Copy)]
enum Carrier {
    Xray,
    W3c,
    /// Both: `W3C_BOTH` as `traceparent`, `XRAY` as `AWSTraceHeader`.
    Both,
    None,
}

impl Carrier {
    /// The context the consumer must continue.
    fn expected(self) -> Option<TraceParent> {
        match self {
            Carrier::Xray => Some(TraceParent::parse_xray(XRAY).unwrap()),
            Carrier::W3c => Some(TraceParent::parse_w3c(W3C).unwrap()),
            Carrier::Both => Some(TraceParent::parse_w3c(W3C_BOTH).unwrap()),
            Carrier::None => None,
        }
    }
}

const CARRIERS: [(&str, Carrier); 4] = [
    ("by-xray", Carrier::Xray),
    ("by-w3c", Carrier::W3c),
    ("by-both", Carrier::Both),
    ("by-none", Carrier::None),
];

/// Sends `body` with its context carried as `carrier` says.
async fn send(sqs: &aws_sdk_sqs::Client, url: &str, body: &str, carrier: Carrier) {
    let mut send = sqs.send_message().queue_url(url).message_body(body);
    let xray = || {
        MessageSystemAttributeValue::builder()
            .data_type("String")
            .string_value(XRAY)
            .build()
            .unwrap()
    };
    let w3c = |v: &str| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
            .unwrap()
    };
    match carrier {
        Carrier::Xray => {
            send = send.message_system_attributes(
                MessageSystemAttributeNameForSends::AwsTraceHeader,
                xray(),
            );
        }
        Carrier::W3c => send = send.message_attributes("traceparent", w3c(W3C)),
        Carrier::Both => {
            send = send
                .message_system_attributes(
                    MessageSystemAttributeNameForSends::AwsTraceHeader,
                    xray(),
                )
                .message_attributes("traceparent", w3c(W3C_BOTH));
        }
        Carrier::None => {}
    }
    send.send().await.unwrap();
}

/// Spans captured in process while the guard lives (this thread: the tests
/// run on Tokio's current-thread runtime, so every task is on it).
struct Capture {
    exporter: InMemorySpanExporter,
    _guard: tracing::subscriber::DefaultGuard,
}

fn capture() -> Capture {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    Capture {
        exporter,
        _guard: tracing::subscriber::set_default(subscriber),
    }
}

impl Capture {
    fn spans(&self) -> Vec<SpanData> {
        self.exporter.get_finished_spans().unwrap()
    }
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

/// Each message's `ctx.traceparent()` by dedup key.
type Seen = Arc<Mutex<HashMap<String, Option<String>>>>;

/// A handler recording what it sees.
fn recording_handler() -> (impl sqs_once::Handler, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = handler_fn(move |_m, ctx: sqs_once::Context| {
        let s = s.clone();
        async move {
            let key = ctx.dedup_key().unwrap_or_default().to_owned();
            s.lock().unwrap().insert(key, ctx.traceparent());
            Ok(None)
        }
    });
    (handler, seen)
}

/// Each message's `process {queue}` span continues the context it was sent
/// with (the `traceparent` when both are there), carries the conventions'
/// and sqs-once's attributes, and is what `ctx.traceparent()` names.
fn check_message_spans(
    spans: &[SpanData],
    queue: &str,
    seen: &HashMap<String, Option<String>>,
    path: &str,
) {
    for (body, carrier) in CARRIERS {
        let span = spans
            .iter()
            .find(|s| attr(s, "sqs_once.dedup_key").as_deref() == Some(body))
            .unwrap_or_else(|| panic!("no span for {body}: {spans:#?}"));
        assert_eq!(span.name, format!("process {queue}"));
        assert_eq!(span.span_kind, SpanKind::Consumer);
        for (k, v) in [
            ("messaging.system", "aws_sqs"),
            ("messaging.operation.type", "process"),
            ("messaging.operation.name", "process"),
            ("messaging.destination.name", queue),
            ("sqs_once.consumer", "traces"),
            ("sqs_once.outcome", "completed"),
            ("sqs_once.path", path),
        ] {
            assert_eq!(attr(span, k).as_deref(), Some(v), "{body}: {k}");
        }
        assert!(attr(span, "messaging.message.id").is_some());
        assert!(attr(span, "sqs_once.record_key").is_some());
        if let Some(sent) = carrier.expected() {
            assert_eq!(
                span.span_context.trace_id(),
                TraceId::from_bytes(sent.trace_id),
                "{body}"
            );
            assert_eq!(
                span.parent_span_id,
                SpanId::from_bytes(sent.span_id),
                "{body}"
            );
            assert!(span.parent_span_is_remote, "{body}");
        } else {
            assert!(
                !span.parent_span_is_remote,
                "{body} has no producer context"
            );
        }
        let passed_on = seen[body]
            .as_deref()
            .map(|t| TraceParent::parse_w3c(t).unwrap());
        let passed_on = passed_on.unwrap_or_else(|| panic!("{body}: no ctx.traceparent()"));
        assert_eq!(
            TraceId::from_bytes(passed_on.trace_id),
            span.span_context.trace_id()
        );
        assert_eq!(
            SpanId::from_bytes(passed_on.span_id),
            span.span_context.span_id()
        );
    }
}

/// The producer contexts a batch span links to.
fn linked(span: &SpanData) -> Vec<TraceId> {
    span.links
        .iter()
        .map(|l| l.span_context.trace_id())
        .collect()
}

fn sent_traces() -> Vec<TraceId> {
    CARRIERS
        .iter()
        .filter_map(|(_, c)| c.expected())
        .map(|t| TraceId::from_bytes(t.trace_id))
        .collect()
}

#[tokio::test]
async fn the_poller_continues_each_message_s_trace() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    for (id, carrier) in CARRIERS {
        send(
            &sqs,
            &q.queue_url,
            &json!({ "id": id }).to_string(),
            carrier,
        )
        .await;
    }
    let capture = capture();
    let (handler, seen) = recording_handler();
    let processor = Processor::new(MemoryStore::default(), handler, keyed_by_id()).unwrap();
    let mut pc = PollerConfig::new(&q.queue_url);
    pc.wait_time = Duration::from_secs(1);
    pc.exit_when_idle = Some(Duration::from_secs(2));
    let stats = sqs_once::poller::run(sqs.clone(), processor, pc, CancellationToken::new()).await;
    assert_eq!(stats.completed, 4);

    let spans = capture.spans();
    let queue = sqs_once::trace::queue_name(&q.queue_url);
    check_message_spans(&spans, queue, &seen.lock().unwrap(), "claim");
    let receives: Vec<_> = spans
        .iter()
        .filter(|s| s.name == format!("receive {queue}"))
        .collect();
    assert!(!receives.is_empty(), "a receive span");
    let mut links: Vec<TraceId> = receives.iter().flat_map(|s| linked(s)).collect();
    let mut count = 0;
    for r in &receives {
        assert_eq!(
            attr(r, "messaging.operation.type").as_deref(),
            Some("receive")
        );
        count += attr(r, "messaging.batch.message_count")
            .unwrap()
            .parse::<u64>()
            .unwrap();
    }
    assert_eq!(count, 4, "every message counted in a receive");
    links.sort_by_key(|t| t.to_string());
    let mut sent = sent_traces();
    sent.sort_by_key(|t| t.to_string());
    assert_eq!(links, sent, "the receives link to the producers");
}

/// Consumer `traces`, the dedup key at `/id` in the body.
fn keyed_by_id() -> ProcessorConfig {
    let mut config = ProcessorConfig::new("traces");
    config.key_source = "json:/id".parse().unwrap();
    config
}

#[tokio::test]
async fn the_lambda_adapter_continues_each_message_s_trace() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    for (id, carrier) in CARRIERS {
        send(
            &sqs,
            &q.queue_url,
            &json!({ "id": id }).to_string(),
            carrier,
        )
        .await;
    }
    let event = crate::lambda::receive_event(&sqs, &q.queue_url, 4).await;
    let capture = capture();
    let (handler, seen) = recording_handler();
    let processor = Processor::new(MemoryStore::default(), handler, keyed_by_id()).unwrap();
    let adapter = LambdaAdapter::new(sqs.clone(), processor, LambdaConfig::default());
    let deadline = SystemTime::now() + Duration::from_secs(60);
    let response = adapter.handle(event, deadline).await.unwrap();
    assert!(response.batch_item_failures.is_empty());

    let spans = capture.spans();
    let queue = sqs_once::trace::queue_name(&q.queue_url);
    let invocation = spans
        .iter()
        .find(|s| attr(s, "faas.trigger").is_some())
        .expect("an invocation span");
    assert_eq!(invocation.name, format!("process {queue}"));
    assert_eq!(
        attr(invocation, "messaging.batch.message_count").as_deref(),
        Some("4")
    );
    let mut links = linked(invocation);
    links.sort_by_key(|t| t.to_string());
    let mut sent = sent_traces();
    sent.sort_by_key(|t| t.to_string());
    assert_eq!(links, sent, "the invocation links to the producers");
    check_message_spans(&spans, queue, &seen.lock().unwrap(), "claim");
    // Without a producer context the message's span is the invocation's child.
    let orphan = spans
        .iter()
        .find(|s| attr(s, "sqs_once.dedup_key").as_deref() == Some("by-none"))
        .unwrap();
    assert_eq!(orphan.parent_span_id, invocation.span_context.span_id());
}

/// Spans an OTLP/HTTP receiver got: (service name, span) pairs.
type Received = Arc<Mutex<Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)>>>;

/// An OTLP/HTTP (protobuf) trace receiver on 127.0.0.1; its base URL.
async fn otlp_receiver() -> (String, Received) {
    otlp_receiver_over(None).await
}

/// The receiver, speaking TLS with `tls` when given (its URL `https://`).
async fn otlp_receiver_over(tls: Option<tokio_rustls::TlsAcceptor>) -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{}", listener.local_addr().unwrap());
    let received: Received = Arc::default();
    let r = received.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (r, tls) = (r.clone(), tls.clone());
            tokio::spawn(async move {
                match tls {
                    Some(tls) => {
                        if let Ok(stream) = tls.accept(stream).await {
                            serve_otlp(stream, r).await;
                        }
                    }
                    None => serve_otlp(stream, r).await,
                }
            });
        }
    });
    (url, received)
}

/// Serves OTLP/HTTP trace exports on one connection, keeping their spans.
async fn serve_otlp<S>(stream: S, r: Received)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message as _;
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        let r = r.clone();
        async move {
            assert_eq!(req.uri().path(), "/v1/traces");
            let body = req.into_body().collect().await?.to_bytes();
            let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
            for rs in export.resource_spans {
                let service = rs
                    .resource
                    .iter()
                    .flat_map(|r| &r.attributes)
                    .find(|kv| kv.key == "service.name")
                    .and_then(|kv| kv.value.clone())
                    .map(|v| format!("{:?}", v.value))
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for span in ss.spans {
                        r.lock().unwrap().push((service.clone(), span));
                    }
                }
            }
            let mut ok = hyper::Response::new(Full::new(Bytes::new()));
            ok.headers_mut()
                .insert("content-type", "application/x-protobuf".parse().unwrap());
            Ok::<_, hyper::Error>(ok)
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
        .await;
}

/// The `payments` binary exports to an `https://` collector: the OTLP
/// exporter speaks TLS (rustls), trusting the certificates of the system's
/// store, or of `SSL_CERT_FILE` (here the receiver's own).
#[tokio::test]
async fn the_payments_binary_exports_over_https() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let (tls, pem) = crate::common::self_signed_tls();
    let (otlp, received) = otlp_receiver_over(Some(tls)).await;
    assert!(otlp.starts_with("https://"), "{otlp}");
    let ca = std::env::temp_dir().join(format!("sqs-once-otlp-{}.pem", uuid::Uuid::new_v4()));
    std::fs::write(&ca, pem).unwrap();
    let l = Ledger::new(&sqs, &ddb).await;
    let body = json!({"id": "pay-tls", "customer": "cus_1", "amount_cents": 9}).to_string();
    send(&sqs, &l.queues.queue_url, &body, Carrier::W3c).await;
    let env = [
        ("PAYMENTS_URL", api.url.as_str()),
        ("PAYMENTS_CA_FILE", api.ca_file.to_str().unwrap()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("SSL_CERT_FILE", ca.to_str().unwrap()),
    ];
    run_until_drained_with(&l, &sqs, 1, &crate::common::binary("payments"), &env).await;
    let _ = std::fs::remove_file(&ca);
    let spans = received.lock().unwrap().clone();
    let queue = sqs_once::trace::queue_name(&l.queues.queue_url);
    let sent = TraceParent::parse_w3c(W3C).unwrap();
    let process = spans
        .iter()
        .map(|(_, s)| s)
        .find(|s| s.name == format!("process {queue}"))
        .unwrap_or_else(|| panic!("no process span came over TLS: {spans:#?}"));
    assert_eq!(process.trace_id, sent.trace_id);
}

#[tokio::test]
async fn the_payments_binary_exports_by_otlp_and_carries_the_trace_to_the_api() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let (otlp, received) = otlp_receiver().await;
    let l = Ledger::new(&sqs, &ddb).await;
    let body = json!({"id": "pay-traced", "customer": "cus_1", "amount_cents": 700}).to_string();
    send(&sqs, &l.queues.queue_url, &body, Carrier::Xray).await;
    let env = [
        ("PAYMENTS_URL", api.url.as_str()),
        ("PAYMENTS_CA_FILE", api.ca_file.to_str().unwrap()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
        ("OTEL_SERVICE_NAME", "payments-traced"),
    ];
    let payments = crate::common::binary("payments");
    run_until_drained_with(&l, &sqs, 1, &payments, &env).await;

    let sent = TraceParent::parse_xray(XRAY).unwrap();
    let spans = received.lock().unwrap().clone();
    let queue = sqs_once::trace::queue_name(&l.queues.queue_url);
    let (service, process) = spans
        .iter()
        .find(|(_, s)| s.name == format!("process {queue}"))
        .unwrap_or_else(|| panic!("no process span exported: {spans:#?}"));
    assert!(service.contains("payments-traced"), "{service}");
    assert_eq!(process.trace_id, sent.trace_id);
    assert_eq!(process.parent_span_id, sent.span_id);
    let (_, receive) = spans
        .iter()
        .find(|(_, s)| s.name == format!("receive {queue}"))
        .expect("the receive span is exported");
    // It starts a trace, whose id begins with the epoch second as X-Ray's do.
    let started = u32::from_be_bytes(receive.trace_id[..4].try_into().unwrap());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now.abs_diff(u64::from(started)) < 600, "{started} vs {now}");
    let headers = api.traceparents();
    assert_eq!(headers.len(), 1);
    let to_api =
        TraceParent::parse_w3c(headers[0].as_deref().expect("a traceparent header")).unwrap();
    assert_eq!(
        to_api.trace_id, sent.trace_id,
        "the API call is in the producer's trace"
    );
    assert_eq!(
        to_api.span_id.as_slice(),
        process.span_id.as_slice(),
        "under the message's span"
    );
}

/// The `payments` binary (its sampler installed by `cli::init_logging`) with
/// a producer that did not sample: by default the message's span is still
/// recorded, in the producer's trace, since the consumer's sampler decides
/// (parent-based, always on); with `SQS_ONCE_TRUST_PRODUCER_SAMPLING=on` the
/// producer's `00` is followed and nothing of the message is exported.
#[tokio::test]
async fn the_payments_binary_decides_sampling_itself_unless_told_to_trust_the_producer() {
    if !crate::common::localstack_up().await {
        return;
    }
    let unsampled = "00-5bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    let sent = TraceParent::parse_w3c(unsampled).unwrap();
    for trust in ["off", "on"] {
        let (sqs, ddb) = (sqs().await, ddb().await);
        let api = StubApi::start().await;
        let (otlp, received) = otlp_receiver().await;
        let l = Ledger::new(&sqs, &ddb).await;
        let body = json!({"id": format!("pay-{trust}"), "customer": "cus_1", "amount_cents": 5})
            .to_string();
        sqs.send_message()
            .queue_url(&l.queues.queue_url)
            .message_body(&body)
            .message_attributes(
                "traceparent",
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(unsampled)
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
        let env = [
            ("PAYMENTS_URL", api.url.as_str()),
            ("PAYMENTS_CA_FILE", api.ca_file.to_str().unwrap()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.as_str()),
            ("SQS_ONCE_TRUST_PRODUCER_SAMPLING", trust),
        ];
        run_until_drained_with(&l, &sqs, 1, &crate::common::binary("payments"), &env).await;
        let spans = received.lock().unwrap().clone();
        let queue = sqs_once::trace::queue_name(&l.queues.queue_url);
        let process: Vec<_> = spans
            .iter()
            .map(|(_, s)| s)
            .filter(|s| s.name == format!("process {queue}"))
            .collect();
        if trust == "on" {
            assert!(
                process.is_empty(),
                "the producer's 00 was followed: {process:#?}"
            );
            continue;
        }
        let [span] = &process[..] else {
            panic!("one process span: {spans:#?}")
        };
        assert_eq!(span.trace_id, sent.trace_id);
        assert_eq!(span.parent_span_id, sent.span_id);
        let applied = span
            .attributes
            .iter()
            .find(|kv| kv.key == "sqs_once.producer_sampling")
            .and_then(|kv| kv.value.clone())
            .map(|v| format!("{:?}", v.value));
        assert!(applied.is_some_and(|v| v.contains("ignored")), "{span:#?}");
    }
}
