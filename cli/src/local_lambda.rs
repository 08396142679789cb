//! Running a Lambda function binary locally: a Lambda Runtime API server, and
//! an SQS event source that feeds it batches the way Lambda's event source
//! mapping does.
//!
//! [`LocalLambda`] serves the Runtime API (`/2018-06-01/runtime/...`) on
//! 127.0.0.1, starts the function binary with `AWS_LAMBDA_RUNTIME_API` pointing
//! at it, and turns [`LocalLambda::invoke`] calls into invocations. Like Lambda,
//! it restarts the function after it exits or times out.
//!
//! [`run_event_source`] long-polls a queue, invokes the function with each batch
//! as an SQS event, and deletes the records the function did not list in
//! `batchItemFailures` (`ReportBatchItemFailures` semantics: a function error, or
//! a response naming a record that was not in the batch, fails the whole batch).
//!
//! This is for development and tests; it is not a sandbox (no memory limit, no
//! freeze between invocations).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::error::SdkError;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use aws_smithy_types::error::display::DisplayErrorContext;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};
use tracing::{info, warn};

type GetQueueAttributesError =
    aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesError;

/// Why an invocation produced no response.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The function reported an error (the Runtime API's `/error` body).
    #[error("function error: {0}")]
    Function(Value),
    /// No response within the function timeout; the function was restarted.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The function process exited (or failed to start) before responding.
    #[error("the function exited: {0}")]
    Exited(String),
}

struct Invocation {
    id: String,
    event: Bytes,
    deadline_ms: u64,
}

#[derive(Default)]
struct State {
    pending: Mutex<VecDeque<Invocation>>,
    ready: Notify,
    waiting: Mutex<HashMap<String, oneshot::Sender<Result<Value, InvokeError>>>>,
}

impl State {
    fn resolve(&self, id: &str, result: Result<Value, InvokeError>) -> bool {
        let sender = self.waiting.lock().expect("lock").remove(id);
        sender.is_some_and(|s| s.send(result).is_ok())
    }

    fn fail_all(&self, why: &str) {
        let waiting: Vec<_> = self.waiting.lock().expect("lock").drain().collect();
        for (_, s) in waiting {
            let _ = s.send(Err(InvokeError::Exited(why.to_owned())));
        }
        self.pending.lock().expect("lock").clear();
    }
}

/// A function binary behind a local Lambda Runtime API.
pub struct LocalLambda {
    program: PathBuf,
    env: Vec<(String, String)>,
    function_name: String,
    timeout: Duration,
    api: String,
    state: Arc<State>,
    /// Stops the running function process (dropping it kills the process).
    process: tokio::sync::Mutex<Option<oneshot::Sender<()>>>,
    alive: Arc<std::sync::atomic::AtomicBool>,
}

impl LocalLambda {
    /// Serves the Runtime API on a free local port and starts `program` with
    /// this process's environment, then `env` (the function's configuration),
    /// then the Lambda variables.
    pub async fn start(
        program: impl Into<PathBuf>,
        function_name: &str,
        timeout: Duration,
        env: Vec<(String, String)>,
    ) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let api = listener.local_addr()?.to_string();
        let state = Arc::new(State::default());
        tokio::spawn(serve(listener, state.clone()));
        let lambda = Self {
            program: program.into(),
            env,
            function_name: function_name.to_owned(),
            timeout,
            api,
            state,
            process: Default::default(),
            alive: Default::default(),
        };
        lambda.spawn().await?;
        Ok(lambda)
    }

    /// The Runtime API address (`host:port`).
    pub fn runtime_api(&self) -> &str {
        &self.api
    }

    async fn spawn(&self) -> std::io::Result<()> {
        let mut child = tokio::process::Command::new(&self.program)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("AWS_LAMBDA_RUNTIME_API", &self.api)
            .env("AWS_LAMBDA_FUNCTION_NAME", &self.function_name)
            .env("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128")
            .env("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
            .env(
                "AWS_LAMBDA_LOG_GROUP_NAME",
                format!("/aws/lambda/{}", self.function_name),
            )
            .env("AWS_LAMBDA_LOG_STREAM_NAME", "local")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let (kill_tx, kill_rx) = oneshot::channel::<()>();
        let state = self.state.clone();
        let alive = self.alive.clone();
        alive.store(true, std::sync::atomic::Ordering::SeqCst);
        tokio::spawn(async move {
            let why = tokio::select! {
                status = child.wait() => match status {
                    Ok(s) => format!("exited with {s}"),
                    Err(e) => format!("wait failed: {e}"),
                },
                _ = kill_rx => {
                    let _ = child.kill().await;
                    "stopped".to_owned()
                }
            };
            alive.store(false, std::sync::atomic::Ordering::SeqCst);
            state.fail_all(&why);
        });
        *self.process.lock().await = Some(kill_tx);
        Ok(())
    }

    async fn stop_process(&self) {
        if let Some(kill) = self.process.lock().await.take() {
            let _ = kill.send(());
        }
        // Wait until the watcher has seen it go.
        while self.alive.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Invokes the function with `event` and waits for its response.
    pub async fn invoke(&self, event: &Value) -> Result<Value, InvokeError> {
        let id = uuid::Uuid::new_v4().to_string();
        let (tx, rx) = oneshot::channel();
        self.state
            .waiting
            .lock()
            .expect("lock")
            .insert(id.clone(), tx);
        // Checked after registering, so an exit from now on fails this invocation.
        if !self.alive.load(std::sync::atomic::Ordering::SeqCst)
            && let Err(e) = self.spawn().await
        {
            self.state.waiting.lock().expect("lock").remove(&id);
            return Err(InvokeError::Exited(format!("cannot start: {e}")));
        }
        let deadline = SystemTime::now() + self.timeout;
        self.state
            .pending
            .lock()
            .expect("lock")
            .push_back(Invocation {
                id: id.clone(),
                event: Bytes::from(serde_json::to_vec(event).expect("JSON value")),
                deadline_ms: deadline
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
            });
        self.state.ready.notify_one();
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(InvokeError::Exited(
                "the runtime API dropped the invocation".into(),
            )),
            Err(_) => {
                // Lambda ends a timed-out invocation by stopping the sandbox.
                self.state.waiting.lock().expect("lock").remove(&id);
                self.stop_process().await;
                Err(InvokeError::Timeout(self.timeout))
            }
        }
    }

    /// Stops the function process.
    pub async fn shutdown(&self) {
        self.stop_process().await;
    }
}

/// The largest request body the Runtime API reads: Lambda's 6 MB limit on a
/// synchronous invocation's response (and on an error report).
pub const MAX_BODY: usize = 6 * 1024 * 1024;

async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, say: pause instead of spinning.
                warn!(error = %e, "runtime API: accept failed; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| route(req, state.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

async fn route(
    req: Request<hyper::body::Incoming>,
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let rest = path.strip_prefix("/2018-06-01/runtime/").unwrap_or("");
    if method == Method::GET && rest == "invocation/next" {
        let inv = loop {
            let ready = state.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            if let Some(inv) = state.pending.lock().expect("lock").pop_front() {
                break inv;
            }
            ready.await;
        };
        let mut r = reply(StatusCode::OK, inv.event);
        let h = r.headers_mut();
        h.insert(
            "lambda-runtime-aws-request-id",
            inv.id.parse().expect("uuid header"),
        );
        h.insert("lambda-runtime-deadline-ms", inv.deadline_ms.into());
        h.insert(
            "lambda-runtime-invoked-function-arn",
            "arn:aws:lambda:us-east-1:000000000000:function:local"
                .parse()
                .expect("header"),
        );
        h.insert("content-type", "application/json".parse().expect("header"));
        return Ok(r);
    }
    if method == Method::POST {
        let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                warn!(
                    path = rest,
                    "runtime API: request body over {MAX_BODY} bytes; refused"
                );
                return Ok(reply(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("body over {MAX_BODY} bytes"),
                ));
            }
            Err(_) => return Ok(reply(StatusCode::BAD_REQUEST, "unreadable body")),
        };
        let value = serde_json::from_slice::<Value>(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
        if rest == "init/error" {
            warn!(error = %value, "the function reported an init error");
            state.fail_all(&format!("init error: {value}"));
            return Ok(reply(StatusCode::ACCEPTED, "{}"));
        }
        if let Some(id) = rest.strip_prefix("invocation/") {
            let result = if let Some(id) = id.strip_suffix("/response") {
                Some((id, Ok(value)))
            } else {
                id.strip_suffix("/error")
                    .map(|id| (id, Err(InvokeError::Function(value))))
            };
            if let Some((id, result)) = result {
                return Ok(if state.resolve(id, result) {
                    reply(StatusCode::ACCEPTED, "{}")
                } else {
                    reply(StatusCode::BAD_REQUEST, "unknown or finished invocation")
                });
            }
        }
    }
    Ok(reply(StatusCode::NOT_FOUND, "not a Runtime API path"))
}

/// Builds the SQS event Lambda's event source mapping sends for these messages
/// (the documented record shape: `messageId`, `receiptHandle`, `body`,
/// `attributes`, `messageAttributes`, `md5OfBody`, `eventSource`,
/// `eventSourceARN`, `awsRegion`).
pub fn sqs_event(queue_arn: &str, messages: &[aws_sdk_sqs::types::Message]) -> Value {
    let region = queue_arn.split(':').nth(3).unwrap_or("us-east-1");
    let records: Vec<Value> = messages
        .iter()
        .map(|m| {
            let attributes: serde_json::Map<String, Value> = m
                .attributes()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.as_str().to_owned(), Value::String(v.clone())))
                .collect();
            let message_attributes: serde_json::Map<String, Value> = m
                .message_attributes()
                .into_iter()
                .flatten()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        json!({
                            "stringValue": v.string_value(),
                            "stringListValues": [],
                            "binaryListValues": [],
                            "dataType": v.data_type(),
                        }),
                    )
                })
                .collect();
            json!({
                "messageId": m.message_id(),
                "receiptHandle": m.receipt_handle(),
                "body": m.body(),
                "attributes": attributes,
                "messageAttributes": message_attributes,
                "md5OfBody": m.md5_of_body(),
                "eventSource": "aws:sqs",
                "eventSourceARN": queue_arn,
                "awsRegion": region,
            })
        })
        .collect();
    json!({ "Records": records })
}

/// What [`run_event_source`] did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct EventSourceStats {
    /// Invocations made.
    pub invocations: u64,
    /// Records sent to the function.
    pub records: u64,
    /// Records deleted after the function's response.
    pub deleted: u64,
    /// Records the function listed in `batchItemFailures`.
    pub reported_failed: u64,
    /// Invocations that failed as a whole (function error, timeout, bad response).
    pub failed_invocations: u64,
}

/// Why [`run_event_source`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventSourceError {
    /// `GetQueueAttributes` (for the queue's ARN) failed.
    #[error("cannot read queue {queue}: {}", DisplayErrorContext(.source))]
    ReadQueue {
        /// The queue's URL.
        queue: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetQueueAttributesError>>,
    },
    /// The queue's attributes came back without its ARN.
    #[error("queue {queue} has no QueueArn attribute")]
    NoQueueArn {
        /// The queue's URL.
        queue: String,
    },
}

/// Feeds `queue_url` to the function in batches of up to `batch_size` until the
/// queue has been empty for `exit_when_idle`.
pub async fn run_event_source(
    sqs: &aws_sdk_sqs::Client,
    queue_url: &str,
    lambda: &LocalLambda,
    batch_size: i32,
    exit_when_idle: Duration,
) -> Result<EventSourceStats, EventSourceError> {
    let mut source = EventSource {
        sqs,
        queue_arn: queue_arn(sqs, queue_url).await?,
        queue_url,
        lambda,
        batch_size: batch_size.clamp(1, 10),
        wait: exit_when_idle.clamp(Duration::from_secs(1), Duration::from_secs(20)),
        stats: EventSourceStats::default(),
    };
    let mut idle_since = tokio::time::Instant::now();
    loop {
        let Some(messages) = source.receive().await else {
            continue;
        };
        if messages.is_empty() {
            if idle_since.elapsed() >= exit_when_idle {
                return Ok(source.stats);
            }
            continue;
        }
        if source.deliver(&messages).await {
            idle_since = tokio::time::Instant::now();
        }
    }
}

/// The queue's ARN (the event's `eventSourceARN`).
async fn queue_arn(sqs: &aws_sdk_sqs::Client, queue_url: &str) -> Result<String, EventSourceError> {
    sqs.get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| EventSourceError::ReadQueue {
            queue: queue_url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| EventSourceError::NoQueueArn {
            queue: queue_url.to_owned(),
        })
}

/// One queue feeding one function, as Lambda's event source mapping does: it
/// never gives up on a failed call, it tries again (a lost delete brings the
/// records back).
struct EventSource<'a> {
    sqs: &'a aws_sdk_sqs::Client,
    queue_url: &'a str,
    queue_arn: String,
    lambda: &'a LocalLambda,
    /// Records per invocation, 1 to 10.
    batch_size: i32,
    /// The long-poll wait, 1 to 20 s.
    wait: Duration,
    stats: EventSourceStats,
}

impl EventSource<'_> {
    /// The next batch (empty when the queue is); `None` when the receive failed
    /// (logged, and tried again after 1 s).
    async fn receive(&self) -> Option<Vec<aws_sdk_sqs::types::Message>> {
        let received = self
            .sqs
            .receive_message()
            .queue_url(self.queue_url)
            .max_number_of_messages(self.batch_size)
            .wait_time_seconds(self.wait.as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await;
        match received {
            Ok(out) => Some(out.messages.unwrap_or_default()),
            Err(e) => {
                warn!(error = %DisplayErrorContext(e), "receive failed; trying again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            }
        }
    }

    /// Invokes the function with the batch and deletes the records it did not
    /// list. Whether the idle clock starts again: the batch was delivered, or
    /// the invocation failed as a whole (every record comes back); not when the
    /// delete failed (the records come back).
    async fn deliver(&mut self, messages: &[aws_sdk_sqs::types::Message]) -> bool {
        self.stats.invocations += 1;
        self.stats.records += messages.len() as u64;
        let event = sqs_event(&self.queue_arn, messages);
        let listed = match self.lambda.invoke(&event).await {
            Ok(response) => failures_in(&response, messages),
            Err(e) => {
                warn!(error = %e, "invocation failed; the whole batch comes back");
                None
            }
        };
        let Some(listed) = listed else {
            self.stats.failed_invocations += 1;
            return true;
        };
        self.stats.reported_failed += listed.len() as u64;
        if !self.delete_done(messages, &listed).await {
            return false;
        }
        info!(
            records = messages.len(),
            failed = listed.len(),
            "batch delivered"
        );
        true
    }

    /// Deletes the records of the batch not `listed`; false when the delete
    /// call failed (logged: the records come back).
    async fn delete_done(
        &mut self,
        messages: &[aws_sdk_sqs::types::Message],
        listed: &[String],
    ) -> bool {
        let done: Vec<&aws_sdk_sqs::types::Message> = messages
            .iter()
            .filter(|m| !listed.iter().any(|id| Some(id.as_str()) == m.message_id()))
            .collect();
        if done.is_empty() {
            return true;
        }
        let entries =
            crate::ops::delete_entries(done.iter().map(|m| m.receipt_handle().unwrap_or_default()));
        let deleted = self
            .sqs
            .delete_message_batch()
            .queue_url(self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await;
        let out = match deleted {
            Ok(out) => out,
            Err(e) => {
                warn!(error = %DisplayErrorContext(e), "delete failed; the records come back");
                return false;
            }
        };
        self.stats.deleted += (done.len() - out.failed.len()) as u64;
        for f in out.failed {
            warn!(
                id = f.id,
                code = f.code,
                "delete failed; the record comes back"
            );
        }
        true
    }
}

/// The ids listed in a `batchItemFailures` response; `None` when the response
/// fails the whole batch (not that shape, or naming a record not in the batch).
fn failures_in(response: &Value, batch: &[aws_sdk_sqs::types::Message]) -> Option<Vec<String>> {
    // As in AWS: a null response, `{}`, or a null or empty `batchItemFailures`
    // means every record succeeded; a response of another shape fails the batch.
    let list = match response {
        Value::Null => return Some(Vec::new()),
        Value::Object(o) => match o.get("batchItemFailures") {
            None | Some(Value::Null) => return Some(Vec::new()),
            Some(Value::Array(list)) => list,
            Some(other) => {
                warn!(%other, "batchItemFailures is not a list: the whole batch fails");
                return None;
            }
        },
        other => {
            warn!(%other, "the response is not an object: the whole batch fails");
            return None;
        }
    };
    let mut ids = Vec::with_capacity(list.len());
    for f in list {
        let id = f
            .get("itemIdentifier")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !batch.iter().any(|m| m.message_id() == Some(id)) {
            warn!(
                id,
                "batchItemFailures names a record not in the batch: the whole batch fails"
            );
            return None;
        }
        ids.push(id.to_owned());
    }
    Some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> Vec<aws_sdk_sqs::types::Message> {
        ["m-1", "m-2"]
            .iter()
            .map(|id| {
                aws_sdk_sqs::types::Message::builder()
                    .message_id(*id)
                    .build()
            })
            .collect()
    }

    #[test]
    fn empty_and_null_responses_are_a_successful_batch() {
        for response in [
            json!(null),
            json!({}),
            json!({"batchItemFailures": null}),
            json!({"batchItemFailures": []}),
        ] {
            assert_eq!(failures_in(&response, &batch()), Some(vec![]), "{response}");
        }
    }

    #[test]
    fn listed_records_fail_and_a_bad_response_fails_the_batch() {
        let listed = json!({"batchItemFailures": [{"itemIdentifier": "m-2"}]});
        assert_eq!(failures_in(&listed, &batch()), Some(vec!["m-2".to_owned()]));
        for response in [
            json!({"batchItemFailures": [{"itemIdentifier": "m-9"}]}),
            json!({"batchItemFailures": [{"itemIdentifier": ""}]}),
            json!({"batchItemFailures": "m-1"}),
            json!("ok"),
        ] {
            assert_eq!(failures_in(&response, &batch()), None, "{response}");
        }
    }

    #[tokio::test]
    async fn runtime_api_refuses_a_body_over_the_limit() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, Arc::new(State::default())));
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>();
        let post = |len: usize| {
            Request::post(format!(
                "http://{addr}/2018-06-01/runtime/invocation/unknown/response"
            ))
            .body(Full::new(Bytes::from(vec![b'x'; len])))
            .unwrap()
        };
        let big = client.request(post(MAX_BODY + 1)).await.unwrap();
        assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let small = client.request(post(10)).await.unwrap();
        assert_eq!(
            small.status(),
            StatusCode::BAD_REQUEST,
            "read, then refused as an unknown invocation"
        );
    }
}
