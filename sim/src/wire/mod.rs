//! The wire path: the real `aws-sdk-dynamodb` and `aws-sdk-sqs` clients,
//! configured as production configures them (`sqs_once::aws::calls`
//! interceptor, standard retries, attempt timeouts from
//! `sqs_once::aws::attempt_timeouts`), send their HTTP requests to [`Wire`],
//! an in-process connector whose other end is [`dynamodb::DynamoModel`] or
//! [`sqs::SqsModel`]. Faults strike on the wire, per request, drawn from the
//! host's [`Link`]: a cut link (connect timeout), a reset before or after
//! the request applied, a 500 with or without applying, throttling, a
//! transaction conflict (DynamoDB), batch entries failing alone (SQS), an
//! answer that never comes (the SDK's attempt timeout gives up), a request
//! that lands after the client gave up, a slow answer, and a host pause
//! before an owned write leaves (DynamoDB). The SDK's own retries, its
//! timeouts, `DynamoStore`'s classification and the SQS adapter's then run
//! for real. Time is tokio's paused clock: the SDK sleeps on it, and reads the
//! host's (skewed) clock as its time source.

pub mod dynamodb;
pub mod expr;
pub mod s3;
pub mod sqs;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_sdk_dynamodb::config::{
    AsyncSleep, BehaviorVersion, Credentials, Region, SharedCredentialsProvider, Sleep,
};
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
use aws_smithy_runtime_api::client::result::ConnectorError;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_runtime_api::http::StatusCode;
use aws_smithy_types::body::SdkBody;
use sqs_once::clock::Clock;

use crate::faults::{Life, Link};
use dynamodb::{Answer, DdbError, DynamoModel};

/// The host every client's endpoint names.
pub const ENDPOINT_HOST: &str = "wire.sim";

/// The dedup table's name on the wire path.
pub const TABLE: &str = "sim-dedup";
/// The table the simulator's handlers stage ledger rows into.
pub const LEDGER: &str = "ledger";

/// What happens to one request on the wire.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WireFault {
    /// Goes through.
    None,
    /// The host cannot connect: a connect timeout.
    Cut,
    /// The connection resets before the request reached the service.
    ResetBefore,
    /// The service applies it, then the connection resets.
    ResetAfter,
    /// `InternalServerError` (500) without applying.
    InternalBefore,
    /// `InternalServerError` (500) after applying.
    InternalAfter,
    /// `ThrottlingException`.
    Throttled,
    /// `ProvisionedThroughputExceededException`.
    Provisioned,
    /// A transaction cancelled by a `TransactionConflict` (transactions only).
    Conflict,
    /// No answer ever (applied or not): the SDK's attempt timeout gives up.
    Silent {
        /// Whether the service applied it.
        applied: bool,
    },
    /// The client gives up; the service applies it this long after.
    Late(Duration),
    /// The answer comes this much later (a slow body).
    Slow(Duration),
}

/// What happens to one SQS request on the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum SqsFault {
    /// Goes through.
    None,
    /// The host cannot connect: a connect timeout.
    Cut,
    /// The connection resets before the request reached the service.
    ResetBefore,
    /// The service applies it, then the connection resets (a receive's
    /// messages stay invisible, their receive counts spent).
    ResetAfter,
    /// `InternalFailure` (500) without applying.
    InternalBefore,
    /// `InternalFailure` (500) after applying.
    InternalAfter,
    /// Throttled, with this code (`ThrottlingException`, `RequestThrottled`).
    Throttled(&'static str),
    /// A batch call succeeds while the entries at these places fail alone
    /// (`InternalError`, not applied).
    EntriesFailed(Vec<usize>),
    /// No answer ever (applied or not): the SDK's attempt timeout gives up.
    Silent {
        /// Whether the service applied it.
        applied: bool,
    },
    /// The client gives up (its attempt timeout); the service applies it
    /// this long after that.
    Late(Duration),
    /// The answer comes this much later (a slow body).
    Slow(Duration),
}

/// The model a request reaches.
#[derive(Debug, Clone)]
pub enum Service {
    /// DynamoDB.
    Dynamo(DynamoModel),
    /// SQS.
    Sqs(sqs::SqsModel),
    /// S3 (large payloads).
    S3(s3::S3Model),
}

/// The in-process connector: one host's (or the checker's) way to the
/// models. Without a link, no faults.
#[derive(Debug, Clone)]
pub struct Wire {
    service: Service,
    link: Option<Link>,
    life: Life,
    /// The client's attempt timeout, where a request that lands after the
    /// client gave up counts its delay from (SQS).
    gives_up: Duration,
    /// SQS faults given in advance, one per request in order, before the
    /// link's draws (tests).
    script: Arc<Mutex<VecDeque<SqsFault>>>,
    /// DynamoDB faults given in advance, likewise (tests).
    dynamo_script: Arc<Mutex<VecDeque<WireFault>>>,
}

impl Wire {
    /// A connector to `service`, through `link`'s faults when given, that
    /// hangs once `life` ends (a crashed host sends nothing more).
    pub fn new(service: Service, link: Option<Link>, life: Life) -> Self {
        Self {
            service,
            link,
            life,
            gives_up: Duration::ZERO,
            script: Arc::default(),
            dynamo_script: Arc::default(),
        }
    }

    /// The next SQS requests meet these faults, in order (the link's draws
    /// come after them).
    pub fn scripted(self, faults: impl IntoIterator<Item = SqsFault>) -> Self {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(faults);
        self
    }

    /// The next DynamoDB requests meet these faults, in order (the link's
    /// draws come after them).
    pub fn scripted_dynamo(self, faults: impl IntoIterator<Item = WireFault>) -> Self {
        self.dynamo_script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(faults);
        self
    }

    /// The next S3 requests meet these faults, in order (the link's draws
    /// come after them): a [`WireFault::ResetAfter`] of an object being
    /// read resets half-way through its body.
    pub fn scripted_s3(self, faults: impl IntoIterator<Item = WireFault>) -> Self {
        self.scripted_dynamo(faults)
    }

    /// For a client whose attempts time out after `attempt`: an SQS request
    /// that lands after the client gave up lands that long after it was sent
    /// and more.
    pub fn giving_up_after(mut self, attempt: Duration) -> Self {
        self.gives_up = attempt;
        self
    }
}

fn response(answer: &Answer) -> HttpResponse {
    let body = serde_json::to_vec(&answer.body).unwrap_or_default();
    let status = StatusCode::try_from(answer.status).unwrap_or_else(|_| {
        StatusCode::try_from(500).unwrap_or_else(|e| panic!("500 is a status: {e}"))
    });
    let mut r = HttpResponse::new(status, SdkBody::from(body));
    r.headers_mut()
        .insert("content-type", "application/x-amz-json-1.0");
    r.headers_mut().insert("x-amzn-requestid", "sim");
    r
}

fn sqs_response(answer: &sqs::SqsAnswer) -> HttpResponse {
    let mut r = response(&Answer {
        status: answer.status,
        body: answer.body.clone(),
    });
    if let Some(code) = &answer.query_error {
        r.headers_mut().insert("x-amzn-query-error", code.clone());
    }
    r
}

fn s3_response(answer: &s3::S3Answer) -> HttpResponse {
    let status = StatusCode::try_from(answer.status).unwrap_or_else(|_| {
        StatusCode::try_from(500).unwrap_or_else(|e| panic!("500 is a status: {e}"))
    });
    let mut r = HttpResponse::new(status, SdkBody::from(answer.body.clone()));
    for (name, value) in &answer.headers {
        r.headers_mut().insert(*name, value.clone());
    }
    r.headers_mut().insert("x-amz-request-id", "sim");
    r
}

/// `answer` (an object) whose body stops half-way with a connection reset.
fn s3_cut_response(answer: &s3::S3Answer) -> HttpResponse {
    let half = answer.body[..answer.body.len() / 2].to_vec();
    let frames = futures::stream::iter(vec![
        Ok(http_body::Frame::data(bytes::Bytes::from(half))),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "connection reset while the body was sent (simulated)",
        )),
    ]);
    let body = SdkBody::from_body_1_x(http_body_util::StreamBody::new(frames));
    let ok = StatusCode::try_from(200).unwrap_or_else(|e| panic!("200 is a status: {e}"));
    let mut r = HttpResponse::new(ok, body);
    for (name, value) in &answer.headers {
        r.headers_mut().insert(*name, value.clone());
    }
    r.headers_mut().insert("x-amz-request-id", "sim");
    r
}

fn reset() -> ConnectorError {
    ConnectorError::io("connection reset by peer (simulated)".into())
}

/// The operation of a DynamoDB request (`X-Amz-Target: DynamoDB_20120810.<Op>`).
fn operation(request: &HttpRequest) -> String {
    let target = request.headers().get("x-amz-target").unwrap_or_default();
    target
        .rsplit_once('.')
        .map_or(target, |(_, op)| op)
        .to_owned()
}

/// Whether the request is a write that carries an owner's fencing token
/// (sent after a handler ran): what a host pause before sending is for.
fn owned_write(op: &str, body: &serde_json::Value) -> bool {
    match op {
        "TransactWriteItems" => true,
        "UpdateItem" => body
            .get("ConditionExpression")
            .and_then(|c| c.as_str())
            .is_some_and(|c| c.starts_with("#owner = :owner")),
        _ => false,
    }
}

/// What a DynamoDB request was made for (see [`crate::trace::Trouble::calls`]):
/// every record key (`pk`) it names.
fn dynamo_subjects(body: &serde_json::Value) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    if k == sqs_once::aws::dynamodb::KEY_ATTRIBUTE
                        && let Some(pk) = v.get("S").and_then(|s| s.as_str())
                    {
                        out.push(crate::trace::Subject::key(pk));
                    } else {
                        walk(v, out);
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(body, &mut out);
    out
}

/// What an SQS request was made for (see [`crate::trace::Trouble::calls`]):
/// its receipt handles, the events its outgoing bodies name, or for a
/// receive the deliveries it takes.
fn sqs_subjects(op: &str, body: &serde_json::Value, trace: &crate::trace::Trace) -> Vec<String> {
    use crate::trace::Subject;
    if op == "ReceiveMessage" {
        return vec![Subject::RECEIVE.to_owned()];
    }
    let one = std::iter::once(body);
    let entries = body
        .get("Entries")
        .and_then(|e| e.as_array())
        .into_iter()
        .flatten();
    one.chain(entries)
        .flat_map(|v| {
            let receipt = v
                .get("ReceiptHandle")
                .and_then(|r| r.as_str())
                .map(Subject::receipt);
            let sent = v
                .get("MessageBody")
                .and_then(|b| b.as_str())
                .map(|b| Subject::of_body(b, trace))
                .unwrap_or_default();
            let parked = v
                .get("MessageAttributes")
                .and_then(|a| a.get(sqs_once::parking::MESSAGE_ID_ATTRIBUTE))
                .and_then(|a| a.get("StringValue"))
                .and_then(|id| id.as_str())
                .map(Subject::message);
            receipt.into_iter().chain(sent).chain(parked)
        })
        .collect()
}

/// A transaction cancelled because its first item is being written by
/// another transaction (one reason per item, as DynamoDB answers); a
/// single-item write refused with `TransactionConflictException`.
fn conflict(body: &serde_json::Value) -> Answer {
    let Some(n) = body
        .get("TransactItems")
        .and_then(|t| t.as_array())
        .map(Vec::len)
    else {
        return DdbError::Conflict.answer();
    };
    let reasons = (0..n.max(1))
        .map(|i| dynamodb::Reason {
            code: if i == 0 {
                "TransactionConflict"
            } else {
                "None"
            },
            item: None,
            message: (i == 0).then(|| "Transaction is ongoing for the item".to_owned()),
        })
        .collect();
    DdbError::Cancelled(reasons).answer()
}

impl Wire {
    /// Answers one request through the faults drawn for it.
    async fn exchange(
        self,
        op: String,
        body: serde_json::Value,
        connect_timeout: Duration,
    ) -> Result<HttpResponse, ConnectorError> {
        match self.service.clone() {
            Service::Dynamo(model) => self.dynamo(&model, op, body, connect_timeout).await,
            Service::Sqs(model) => self.sqs(&model, op, body, connect_timeout).await,
            // S3 requests take the other way in (`call_with`).
            Service::S3(_) => Ok(s3_response(&s3::internal_error())),
        }
    }

    /// One S3 request (`method` on `uri`, with its headers and body) through
    /// the faults drawn for it: the link's DynamoDB plan (the same network
    /// path out of the host), an error being a 500 `InternalError` (before
    /// or after applying), a 503 `SlowDown` or a reset; a lost answer a reset
    /// or silence after applying (a `PutObject` stored, its answer lost).
    async fn s3(
        &self,
        model: &s3::S3Model,
        method: String,
        uri: String,
        content: s3::S3Content,
        connect_timeout: Duration,
    ) -> Result<HttpResponse, ConnectorError> {
        let rest = uri.split_once("://").map_or(uri.as_str(), |(_, r)| r);
        let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
        let Some((bucket, key)) = s3::bucket_and_key(host, &format!("/{path}"), ENDPOINT_HOST)
        else {
            return Ok(s3_response(&s3::error(
                400,
                "InvalidRequest",
                "no bucket and key in the request",
            )));
        };
        let op = match method.as_str() {
            "GET" => "GetObject",
            "DELETE" => "DeleteObject",
            "PUT" => "PutObject",
            _ => "S3",
        };
        let scripted = self
            .dynamo_script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        let fault = scripted.unwrap_or_else(|| {
            self.link.as_ref().map_or(WireFault::None, |link| {
                use crate::trace::Subject;
                if op == "PutObject"
                    && let Some(event) = Subject::id_in(&content.body)
                {
                    link.trace.object_stored(&key, &event);
                }
                let event = crate::world::event_of_payload_key(&key)
                    .map(str::to_owned)
                    .or_else(|| link.trace.object_event(&key));
                let subjects: Vec<String> = event.iter().map(|e| Subject::event(e)).collect();
                link.draw_wire(op, false, &subjects)
            })
        });
        let apply = |model: &s3::S3Model| model.handle_with(&method, &bucket, &key, &content);
        let answer = match fault {
            WireFault::None => apply(model),
            WireFault::Cut => {
                tokio::time::sleep(connect_timeout).await;
                return Err(ConnectorError::timeout(
                    "connect timeout (the host is cut off)".into(),
                ));
            }
            WireFault::ResetBefore => return Err(reset()),
            WireFault::ResetAfter => {
                let answer = apply(model);
                // An object being sent: the connection resets half-way
                // through its body, after the status and headers came.
                if method == "GET" && answer.status == 200 {
                    return Ok(s3_cut_response(&answer));
                }
                return Err(reset());
            }
            WireFault::InternalBefore | WireFault::Conflict => s3::internal_error(),
            WireFault::InternalAfter => {
                let _ = apply(model);
                s3::internal_error()
            }
            WireFault::Throttled | WireFault::Provisioned => s3::slow_down(),
            WireFault::Silent { applied } => {
                if applied {
                    let _ = apply(model);
                }
                return std::future::pending().await;
            }
            WireFault::Late(after) => {
                let (model, method) = (model.clone(), method.clone());
                let (bucket, key) = (bucket.clone(), key.clone());
                let landing = self.link.as_ref().map(Link::lands_later);
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = model.handle_with(&method, &bucket, &key, &content);
                    drop(landing);
                });
                return std::future::pending().await;
            }
            WireFault::Slow(d) => {
                let answer = apply(model);
                tokio::time::sleep(d).await;
                answer
            }
        };
        Ok(s3_response(&answer))
    }

    /// One SQS request through the faults drawn for it.
    async fn sqs(
        &self,
        model: &sqs::SqsModel,
        op: String,
        body: serde_json::Value,
        connect_timeout: Duration,
    ) -> Result<HttpResponse, ConnectorError> {
        let scripted = self
            .script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        let fault = scripted.unwrap_or_else(|| {
            self.link.as_ref().map_or(SqsFault::None, |link| {
                link.draw_sqs_wire(
                    &op,
                    sqs::entries_of(&op, &body),
                    &sqs_subjects(&op, &body, &link.trace),
                )
            })
        });
        let answer = match fault {
            SqsFault::None => model.handle(&op, &body).await,
            SqsFault::Cut => {
                tokio::time::sleep(connect_timeout).await;
                return Err(ConnectorError::timeout(
                    "connect timeout (the host is cut off)".into(),
                ));
            }
            SqsFault::ResetBefore => return Err(reset()),
            SqsFault::ResetAfter => {
                let _ = model.handle(&op, &body).await;
                return Err(reset());
            }
            SqsFault::InternalBefore => sqs::internal_failure(),
            SqsFault::InternalAfter => {
                let _ = model.handle(&op, &body).await;
                sqs::internal_failure()
            }
            SqsFault::Throttled(code) => sqs::throttled(code),
            SqsFault::EntriesFailed(failing) => model.handle_failing(&op, &body, &failing).await,
            SqsFault::Silent { applied } => {
                if applied {
                    let _ = model.handle(&op, &body).await;
                }
                return std::future::pending().await;
            }
            SqsFault::Late(after) => {
                // The adapter bounds the attempts of deletes, visibility
                // changes and lookups more tightly than the client does
                // (receives and sends keep the client's).
                let gives_up = if matches!(
                    op.as_str(),
                    "ReceiveMessage" | "SendMessage" | "SendMessageBatch"
                ) {
                    self.gives_up
                } else {
                    self.gives_up.min(sqs_once::aws::sqs::CALL_ATTEMPT)
                };
                let (model, at) = (model.clone(), gives_up + after);
                let landing = self.link.as_ref().map(Link::lands_later);
                tokio::spawn(async move {
                    tokio::time::sleep(at).await;
                    let _ = model.handle(&op, &body).await;
                    drop(landing);
                });
                return std::future::pending().await;
            }
            SqsFault::Slow(d) => {
                let answer = model.handle(&op, &body).await;
                tokio::time::sleep(d).await;
                answer
            }
        };
        Ok(sqs_response(&answer))
    }

    /// One DynamoDB request through the faults drawn for it.
    async fn dynamo(
        &self,
        model: &DynamoModel,
        op: String,
        body: serde_json::Value,
        connect_timeout: Duration,
    ) -> Result<HttpResponse, ConnectorError> {
        let scripted = self
            .dynamo_script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        let fault = match (&self.link, scripted) {
            (_, Some(fault)) => fault,
            (None, None) => WireFault::None,
            (Some(link), None) => {
                if let Some(pause) = owned_write(&op, &body)
                    .then(|| link.draw_wire_pause(&op))
                    .flatten()
                {
                    tokio::time::sleep(pause).await;
                }
                link.draw_wire(&op, op == "TransactWriteItems", &dynamo_subjects(&body))
            }
        };
        let apply = |model: &DynamoModel| {
            model
                .hold(&op, &body)
                .unwrap_or_else(|| model.handle(&op, &body))
        };
        match fault {
            WireFault::None => Ok(response(&apply(model))),
            WireFault::Cut => {
                tokio::time::sleep(connect_timeout).await;
                Err(ConnectorError::timeout(
                    "connect timeout (the host is cut off)".into(),
                ))
            }
            WireFault::ResetBefore => Err(reset()),
            WireFault::ResetAfter => {
                let _ = apply(model);
                Err(reset())
            }
            WireFault::InternalBefore => Ok(response(&DdbError::Internal.answer())),
            WireFault::InternalAfter => {
                let _ = apply(model);
                Ok(response(&DdbError::Internal.answer()))
            }
            WireFault::Throttled => Ok(response(&DdbError::Throttling.answer())),
            WireFault::Provisioned => Ok(response(&DdbError::Provisioned.answer())),
            WireFault::Conflict => Ok(response(&conflict(&body))),
            WireFault::Silent { applied } => {
                if applied {
                    let _ = apply(model);
                }
                std::future::pending().await
            }
            WireFault::Late(after) => {
                // The service holds the request's token meanwhile: a resend
                // of the same transaction finds it in progress.
                let early = model.hold(&op, &body);
                if early.is_none() {
                    let (model, op, body) = (model.clone(), op.clone(), body.clone());
                    let landing = self.link.as_ref().map(Link::lands_later);
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = model.handle(&op, &body);
                        drop(landing);
                    });
                }
                std::future::pending().await
            }
            WireFault::Slow(d) => {
                let answer = apply(model);
                tokio::time::sleep(d).await;
                Ok(response(&answer))
            }
        }
    }
}

impl HttpConnector for Wire {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        self.call_with(request, Duration::from_secs(3))
    }
}

impl Wire {
    fn call_with(
        &self,
        mut request: HttpRequest,
        connect_timeout: Duration,
    ) -> HttpConnectorFuture {
        let op = operation(&request);
        let (wire, life) = (self.clone(), self.life.clone());
        let sent = request.take_body();
        if let Service::S3(model) = &self.service {
            let (model, method) = (model.clone(), request.method().to_owned());
            let uri = request.uri().to_owned();
            let mut headers: std::collections::BTreeMap<String, String> = request
                .headers()
                .iter()
                .map(|(name, value)| (name.to_ascii_lowercase(), value.to_owned()))
                .collect();
            return HttpConnectorFuture::new(async move {
                // The body read to its end (see below), and any HTTP
                // trailers sent after it taken as headers.
                let read = http_body_util::BodyExt::collect(sent).await;
                let body = match read {
                    Ok(collected) => {
                        if let Some(trailers) = collected.trailers() {
                            for (name, value) in trailers {
                                if let Ok(value) = value.to_str() {
                                    headers.insert(name.as_str().to_owned(), value.to_owned());
                                }
                            }
                        }
                        collected.to_bytes().to_vec()
                    }
                    Err(_) => return Err(reset()),
                };
                let content = s3::S3Content { headers, body };
                let link = wire.link.clone();
                life.guard(async move {
                    thaw(link.as_ref()).await;
                    let answer = wire.s3(&model, method, uri, content, connect_timeout).await;
                    thaw(link.as_ref()).await;
                    answer
                })
                .await
            });
        }
        HttpConnectorFuture::new(async move {
            // The body is read to its end, as an HTTP client sends it: the
            // SDK's upload stall check, which watches it being read, would
            // otherwise cut every request whose answer takes more than a
            // few seconds (an empty long poll, a silent service) short.
            let read = http_body_util::BodyExt::collect(sent).await;
            let body = read
                .ok()
                .and_then(|b| serde_json::from_slice(&b.to_bytes()).ok())
                .unwrap_or(serde_json::Value::Null);
            let link = wire.link.clone();
            life.guard(async move {
                thaw(link.as_ref()).await;
                let answer = wire.exchange(op, body, connect_timeout).await;
                thaw(link.as_ref()).await;
                answer
            })
            .await
        })
    }
}

/// Waits out a stop-the-world pause of the host, if it is in one
/// ([`crate::faults::Link::freeze`]): no request leaves it and no answer
/// reaches it meanwhile.
async fn thaw(link: Option<&crate::faults::Link>) {
    if let Some(link) = link {
        link.thaw().await;
    }
}

/// The connector with the client's connect timeout.
#[derive(Debug)]
struct Connected(Wire, Duration);

impl HttpConnector for Connected {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        self.0.call_with(request, self.1)
    }
}

impl HttpClient for Wire {
    fn http_connector(
        &self,
        settings: &HttpConnectorSettings,
        _components: &RuntimeComponents,
    ) -> SharedHttpConnector {
        let connect = settings.connect_timeout().unwrap_or(Duration::from_secs(3));
        SharedHttpConnector::new(Connected(self.clone(), connect))
    }
}

/// tokio's sleep, which paused time drives.
#[derive(Debug)]
struct TokioSleep;

impl AsyncSleep for TokioSleep {
    fn sleep(&self, duration: Duration) -> Sleep {
        Sleep::new(tokio::time::sleep(duration))
    }
}

/// The host's clock as the SDK's time source (request signing, clock skew).
#[derive(Debug)]
struct HostTime(Arc<dyn Clock>);

impl aws_smithy_async::time::TimeSource for HostTime {
    fn now(&self) -> SystemTime {
        self.0.now()
    }
}

/// The SDK configuration production loads from the environment, built by
/// hand: a fixed region, endpoint and static credentials, the wire as the
/// HTTP client, tokio's sleep and the host's clock. Retries are the SDK's
/// standard ones; only their jitter is fixed (`use_static_exponential_base`),
/// as it would otherwise come from the OS's randomness.
pub fn sdk_config(wire: Wire, clock: Arc<dyn Clock>) -> aws_config::SdkConfig {
    aws_config::SdkConfig::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(format!("http://{ENDPOINT_HOST}"))
        .credentials_provider(SharedCredentialsProvider::new(Credentials::new(
            "sim", "sim", None, None, "sim",
        )))
        .http_client(wire)
        .sleep_impl(aws_sdk_dynamodb::config::SharedAsyncSleep::new(TokioSleep))
        .time_source(HostTime(clock))
        .retry_config(
            aws_sdk_dynamodb::config::retry::RetryConfig::standard()
                .with_use_static_exponential_base(true),
        )
        .build()
}

/// How long one DynamoDB request may take (production's default
/// `SQS_ONCE_DYNAMODB_TIMEOUT`).
pub const DYNAMODB_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// A DynamoDB client as production builds it, over `wire`. Its retry quota
/// (the token bucket) is its own, as in a production process with one
/// client: the SDK otherwise keeps one per partition name in a static, which
/// every client of every run in this process would share, and a seed would
/// replay differently after other seeds ran (seed 422 did).
pub fn dynamodb_client(wire: Wire, clock: Arc<dyn Clock>) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::retry::{RetryPartition, TokenBucket};
    let sdk = sdk_config(wire, clock);
    let calls = sqs_once::aws::calls::CallCounter::default();
    let partition = RetryPartition::custom("dynamodb")
        .token_bucket(TokenBucket::default())
        .build();
    aws_sdk_dynamodb::Client::from_conf(
        calls
            .dynamodb_config(&sdk)
            .to_builder()
            .timeout_config(sqs_once::aws::attempt_timeouts(DYNAMODB_ATTEMPT_TIMEOUT))
            .retry_partition(partition)
            .build(),
    )
}

/// An SQS client as production builds it (`calls` interceptor, standard
/// retries, `attempt` per request), over `wire`.
pub fn sqs_client(wire: Wire, clock: Arc<dyn Clock>, attempt: Duration) -> aws_sdk_sqs::Client {
    use aws_sdk_sqs::config::retry::{RetryPartition, TokenBucket};
    let sdk = sdk_config(wire, clock);
    let calls = sqs_once::aws::calls::CallCounter::default();
    let partition = RetryPartition::custom("sqs")
        .token_bucket(TokenBucket::default())
        .build();
    aws_sdk_sqs::Client::from_conf(
        calls
            .sqs_config(&sdk)
            .to_builder()
            .timeout_config(sqs_once::aws::attempt_timeouts(attempt))
            .retry_partition(partition)
            .build(),
    )
}

/// How long one S3 request may take (production's large-payload client).
pub const S3_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(30);

/// An S3 client as production builds it for large payloads (`calls`
/// interceptor, standard retries, [`S3_ATTEMPT_TIMEOUT`] per request), over
/// `wire`, with a retry quota of its own (see [`dynamodb_client`]).
pub fn s3_client(wire: Wire, clock: Arc<dyn Clock>) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::retry::{RetryPartition, TokenBucket};
    let sdk = sdk_config(wire, clock);
    let calls = sqs_once::aws::calls::CallCounter::default();
    let partition = RetryPartition::custom("s3")
        .token_bucket(TokenBucket::default())
        .build();
    aws_sdk_s3::Client::from_conf(
        calls
            .s3_config(&sdk)
            .to_builder()
            .timeout_config(sqs_once::aws::attempt_timeouts(S3_ATTEMPT_TIMEOUT))
            .retry_partition(partition)
            .build(),
    )
}

/// A fresh DynamoDB model with the simulator's tables: the dedup table (TTL
/// on `expires_at`, its writes watched for fencing) and the ledger.
pub fn dynamo_model() -> DynamoModel {
    let model = DynamoModel::new();
    model.create_table(
        TABLE,
        sqs_once::aws::dynamodb::KEY_ATTRIBUTE,
        Some(sqs_once::aws::dynamodb::TTL_ATTRIBUTE),
    );
    model.create_table(LEDGER, "pk", None);
    model.watch_fencing(TABLE);
    model
}

#[cfg(test)]
mod tests;
