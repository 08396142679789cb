//! The user's side: the [`Handler`] trait, its [`Context`] and its error kinds.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_dynamodb::types::TransactWriteItem;
use tokio_util::sync::CancellationToken;

use crate::Message;
use crate::protocol::outbox::{OutboxError, Outgoing};
use crate::protocol::outcome::{FailureKind, StagedWrite};
use crate::protocol::payloads::LargePayloads;

/// What a handler returns: an optional small result, recorded with the dedup
/// record and handed back to duplicates.
pub type HandlerResult = Result<Option<serde_json::Value>, HandlerError>;

/// The code that makes a message's effect.
///
/// It never deletes, acknowledges or retries: the runtime does that from the
/// returned [`HandlerResult`]. The same handler runs unchanged under the Lambda
/// adapter and the long-polling runtime.
///
/// ```
/// use sqs_once::{Context, Handler, HandlerResult, Message};
///
/// struct Greeter;
///
/// impl Handler for Greeter {
///     async fn handle(&self, message: &Message, _ctx: &Context) -> HandlerResult {
///         println!("hello {}", message.body());
///         Ok(None)
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Makes the effect of one message.
    fn handle(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> impl Future<Output = HandlerResult> + Send;

    /// What this handler's effects are, which decides the protocol. The default,
    /// [`Effects::External`], is always safe.
    fn effects(&self) -> Effects {
        Effects::External
    }
}

/// Which protocol a handler's effects need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Effects {
    /// Anything, including calls outside DynamoDB (a payment API, e-mail): the
    /// key is claimed before the handler runs, so at most one attempt runs at a
    /// time, and completed after it (two DynamoDB calls per message).
    #[default]
    External,
    /// Only DynamoDB writes staged on the [`Context`]: no claim; the handler runs
    /// and one `TransactWriteItems` commits the `COMPLETED` record with its writes,
    /// or finds the key done and writes nothing (one call per message). A
    /// duplicate still runs the handler, whose staged writes are then dropped, so
    /// the handler must have no other side effect.
    StagedOnly,
    /// One new item keyed by the business id (an order, a payment): the
    /// handler stages exactly one `Put` of it, and the item itself is the
    /// dedup record. One conditional `PutItem` (`attribute_not_exists` on
    /// the first of `key`) writes it with a marker (the record key and the
    /// body's SHA-256): 1 write unit for an item up to 1 KB, no dedup record
    /// written. A refused put reads the item in the way (returned by the same
    /// call): ours is a duplicate; another message's item, or another body
    /// under our key, is a payload mismatch (`SQS_ONCE_PAYLOAD_MISMATCH`).
    ///
    /// What it cannot do: no result is recorded (a duplicate gets none), no
    /// message can be sent ([`Context::send`]), and once the item is deleted
    /// a redelivery inserts it again. A handler that stages anything else (a
    /// second write, an `Update`, a condition of its own) fails permanently
    /// with the reason. See docs/DESIGN.md, "The insert path".
    Insert {
        /// The item's key attributes: the partition key first, then the sort
        /// key if the table has one.
        key: &'static [&'static str],
    },
}

/// Declares a handler [`Effects::StagedOnly`]: see [`staged_only`].
#[derive(Debug, Clone)]
pub struct StagedOnly<H>(pub H);

/// Declares that `handler`'s only effects are the DynamoDB writes it stages, so
/// the one-transaction fast path applies.
///
/// ```
/// use sqs_once::{handler_fn, staged_only};
///
/// let handler = staged_only(handler_fn(|_message, _ctx| async move { Ok(None) }));
/// # let _ = handler;
/// ```
pub fn staged_only<H: Handler>(handler: H) -> StagedOnly<H> {
    StagedOnly(handler)
}

impl<H: Handler> Handler for StagedOnly<H> {
    fn handle(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> impl Future<Output = HandlerResult> + Send {
        self.0.handle(message, ctx)
    }

    fn effects(&self) -> Effects {
        Effects::StagedOnly
    }
}

/// Declares a handler [`Effects::Insert`]: see [`insert_once`].
#[derive(Debug, Clone)]
pub struct InsertOnce<H> {
    handler: H,
    key: &'static [&'static str],
}

/// Declares that `handler`'s only effect is one new item, keyed by `key`
/// (the table's partition key attribute, then its sort key if any), that
/// it stages as one `Put`: the item carries the dedup marker and one
/// conditional `PutItem` writes it (see [`Effects::Insert`]).
///
/// ```
/// use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
/// use sqs_once::{handler_fn, insert_once};
///
/// let handler = insert_once(&["order_id"], handler_fn(|message, ctx| async move {
///     let put = Put::builder()
///         .table_name("orders")
///         .item("order_id", AttributeValue::S(message.id().to_owned()))
///         .item("body", AttributeValue::S(message.body().to_owned()))
///         .build()?;
///     ctx.stage(TransactWriteItem::builder().put(put).build());
///     Ok(None)
/// }));
/// # let _ = handler;
/// ```
pub fn insert_once<H: Handler>(key: &'static [&'static str], handler: H) -> InsertOnce<H> {
    InsertOnce { handler, key }
}

impl<H: Handler> Handler for InsertOnce<H> {
    fn handle(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> impl Future<Output = HandlerResult> + Send {
        self.handler.handle(message, ctx)
    }

    fn effects(&self) -> Effects {
        Effects::Insert { key: self.key }
    }
}

/// A handler made from a closure; see [`handler_fn`].
#[derive(Debug, Clone)]
pub struct HandlerFn<F>(F);

/// Makes a [`Handler`] from an async closure taking owned copies of the message
/// and context (both are cheap to clone).
///
/// ```
/// use sqs_once::{handler_fn, HandlerError};
///
/// let handler = handler_fn(|message, _ctx| async move {
///     if message.body().is_empty() {
///         return Err(HandlerError::permanent("empty body"));
///     }
///     Ok(None)
/// });
/// # let _ = handler;
/// ```
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Message, Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send,
{
    HandlerFn(f)
}

impl<F, Fut> Handler for HandlerFn<F>
where
    F: Fn(Message, Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send,
{
    fn handle(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> impl Future<Output = HandlerResult> + Send {
        (self.0)(message.clone(), ctx.clone())
    }
}

/// A handler's failure, saying what happens next.
///
/// Any `std::error::Error` converts into a `HandlerError` with `?`. It is
/// retryable (retrying is the safe default, and the queue's redrive policy
/// parks a message that keeps failing) except for a request the handler could
/// not even build: an AWS SDK `BuildError` (a required field left out of
/// `Update::builder()...build()`) or `SerializationError`, found anywhere in
/// the error's source chain (so also inside an `SdkError`'s construction
/// failure). Those are programming errors that no retry mends, so they are
/// permanent: the message is parked with the reason at once.
///
/// A service's refusal of a well-formed request (DynamoDB's
/// `ValidationException`, an access denied) cannot be told apart through the
/// generic error and stays retryable: map it with [`HandlerError::permanent`]
/// where the handler knows it will never pass.
#[derive(Debug)]
pub struct HandlerError {
    kind: FailureKind,
    source: Box<dyn std::error::Error + Send + Sync>,
    /// The type of the error given, as Rust names it.
    type_name: &'static str,
}

impl HandlerError {
    /// A retryable failure.
    pub fn retry(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::new(FailureKind::Retry, error)
    }

    /// A failure to retry after `delay`.
    pub fn retry_after(
        delay: Duration,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::new(FailureKind::RetryAfter(delay), error)
    }

    /// A permanent failure: the message is parked, never retried.
    pub fn permanent(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::new(FailureKind::Permanent, error)
    }

    /// A failure of the given kind.
    pub fn new(
        kind: FailureKind,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            type_name: std::any::type_name_of_val(&error),
            source: error.into(),
        }
    }

    /// What happens next.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The type of the error the handler gave, as Rust names it
    /// (`serde_json::error::Error`); `None` for text (`&str`, `String`) and
    /// boxed errors, whose type says nothing.
    pub fn error_type(&self) -> Option<&'static str> {
        let t = self.type_name;
        let says_nothing = t.starts_with('&')
            || t == "alloc::string::String"
            || t.starts_with("alloc::boxed::Box<dyn ")
            || t.starts_with("alloc::borrow::Cow<");
        (!says_nothing).then_some(t)
    }

    /// The same failure with a fixed text instead of the error's: its kind
    /// and type only (`SQS_ONCE_REDACT_REASONS`).
    pub(crate) fn redacted(&self) -> Self {
        let kind = match self.kind {
            FailureKind::Permanent => "permanent error".to_owned(),
            FailureKind::Retry => "transient error".to_owned(),
            FailureKind::RetryAfter(d) => format!(
                "transient error (retry after {})",
                humantime::format_duration(d)
            ),
        };
        let of_type = self
            .error_type()
            .map(|t| format!(" of type {t}"))
            .unwrap_or_default();
        Self {
            kind: self.kind,
            source: format!("{kind}{of_type}, its text redacted ({REDACTED_BY})").into(),
            type_name: self.type_name,
        }
    }
}

/// The setting named where a text is left out.
pub(crate) const REDACTED_BY: &str = "SQS_ONCE_REDACT_REASONS";

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.source, f)
    }
}

impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        let type_name = std::any::type_name::<E>();
        let source = error.into();
        let kind = if unbuildable(&*source) {
            FailureKind::Permanent
        } else {
            FailureKind::Retry
        };
        Self {
            kind,
            source,
            type_name,
        }
    }
}

/// Whether `error`, or any error in its source chain, says the request could
/// not be built or serialized (no retry can mend it).
fn unbuildable(error: &(dyn std::error::Error + 'static)) -> bool {
    use aws_smithy_types::error::operation::{BuildError, SerializationError};
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<BuildError>() || e.is::<SerializationError>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// What the runtime tells a handler about the message being processed, and where
/// the handler stages DynamoDB writes.
///
/// Cheap to clone: clones share the staged writes and the cancellation signal.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

#[derive(Debug)]
struct ContextInner {
    consumer: String,
    dedup_key: Option<String>,
    /// Derived from consumer and dedup key when first asked for (a hash:
    /// most handlers never ask).
    idempotency_key: std::sync::OnceLock<Option<String>>,
    attempt: u32,
    fence: u64,
    max_result_bytes: usize,
    staged: Mutex<Vec<StagedWrite>>,
    /// What the handler sent.
    outbox: Mutex<Sent>,
    /// Where outgoing bodies too large for SQS are stored (`None`: such a
    /// message is refused).
    offload: Option<LargePayloads>,
    cancelled: CancellationToken,
    /// The message's span (current when the processor makes the context).
    span: tracing::Span,
    /// The message's receive count.
    receive_count: u32,
    /// The Lambda invocation's request id (Lambda only).
    request_id: Option<Arc<str>>,
    /// The ends the handler must finish by: the invocation's deadline, the
    /// claim's local lease end, the message's visibility end (each as the
    /// runtime keeps it, moved by the heartbeat; `None` while not known).
    ends: Mutex<Vec<tokio::sync::watch::Receiver<Option<tokio::time::Instant>>>>,
}

/// What a handler sent through its [`Context`].
#[derive(Debug, Default)]
struct Sent {
    /// The messages, in order.
    messages: Vec<Outgoing>,
    /// The first one refused: the incoming message fails with it.
    refused: Option<OutboxError>,
    /// Whether the processor took them (a send after that is refused).
    taken: bool,
}

tokio::task_local! {
    /// The request id of the Lambda invocation being served.
    static REQUEST_ID: Arc<str>;
}

/// Runs `f` as part of the Lambda invocation `request_id`: the contexts made
/// meanwhile (in this task) report it.
#[cfg(feature = "lambda")]
pub(crate) async fn in_invocation<F: Future>(request_id: Arc<str>, f: F) -> F::Output {
    REQUEST_ID.scope(request_id, f).await
}

/// The request id of the Lambda invocation this task serves, if any.
#[cfg(feature = "lambda")]
pub(crate) fn current_request_id() -> Option<Arc<str>> {
    REQUEST_ID.try_with(Arc::clone).ok()
}

impl Context {
    pub(crate) fn new(
        consumer: &str,
        dedup_key: Option<&str>,
        (attempt, fence): (u32, u64),
        message: &Message,
        max_result_bytes: usize,
    ) -> Self {
        Self {
            inner: Arc::new(ContextInner {
                consumer: consumer.to_owned(),
                dedup_key: dedup_key.map(str::to_owned),
                idempotency_key: std::sync::OnceLock::new(),
                attempt,
                fence,
                max_result_bytes,
                staged: Mutex::new(Vec::new()),
                outbox: Mutex::default(),
                offload: None,
                cancelled: CancellationToken::new(),
                span: tracing::Span::current(),
                receive_count: message.receive_count(),
                request_id: REQUEST_ID.try_with(Arc::clone).ok(),
                ends: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Outgoing bodies too large for SQS are stored in S3 through
    /// `payloads` (when it has an outgoing location).
    pub(crate) fn offloading(mut self, payloads: Option<&LargePayloads>) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("a new context is not shared")
            .offload = payloads
            .filter(|p| p.outgoing_max_bytes().is_some())
            .cloned();
        self
    }

    /// Whether outgoing bodies too large for SQS are stored in S3.
    pub(crate) fn offloads(&self) -> bool {
        self.inner.offload.is_some()
    }

    /// The longest [`outbox_id`](crate::protocol::outbox::outbox_id) of
    /// this message's outgoing messages.
    pub(crate) fn outbox_id_bytes(&self) -> usize {
        crate::protocol::outbox::max_id_bytes(&self.inner.consumer, self.inner.dedup_key.as_deref())
    }

    /// The consumer name (the namespace of the dedup records).
    pub fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    /// The message's dedup key; `None` only when the processor was configured to
    /// run messages without a key unprotected.
    pub fn dedup_key(&self) -> Option<&str> {
        self.inner.dedup_key.as_deref()
    }

    /// A stable key derived from consumer and dedup key, the same on every
    /// redelivery: send it downstream as `Idempotency-Key` so an external API
    /// applies a retried call once.
    pub fn idempotency_key(&self) -> Option<&str> {
        let inner = &*self.inner;
        inner
            .idempotency_key
            .get_or_init(|| {
                let key = inner.dedup_key.as_deref()?;
                let stable = crate::protocol::key::idempotency_key(&inner.consumer, key);
                // (The `key-per-attempt` mutant, for the simulator only,
                // hands each attempt a key of its own.)
                if crate::protocol::mutants::active("key-per-attempt") {
                    return Some(format!("{stable}-{}", inner.attempt));
                }
                Some(stable)
            })
            .as_deref()
    }

    /// How many claims this key has seen, this one included (1 on the first run).
    /// On the fast path, which makes no claim: the message's receive count.
    /// A count for logs, not a fence: it starts again at 1 when the record's
    /// TTL deletes it, and the fast path does not count claims (see
    /// [`Self::fence`]).
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }

    /// This run's fence for the key: a number that only grows for a key,
    /// across claims, takeovers of a lease that ran out, and the record's
    /// deletion by its TTL. Send it with every call outside DynamoDB (a
    /// header, say): an API that keeps the highest fence it has seen per key
    /// and refuses a lower one refuses the call of an older holder that a
    /// cooperative interrupt could not stop (a blocking section, a spawned
    /// task, a request already sent) once the next holder has called.
    ///
    /// On the claim path it is the claim's, stored with the record before
    /// the handler runs: above every fence given out for the key before.
    /// On the fast path, which writes nothing before the handler, it is the
    /// clock's ([`FENCE_PER_MS`](crate::store::FENCE_PER_MS) per millisecond
    /// since the epoch), and the commit applies only over a lower stored
    /// fence, storing this one (otherwise nothing is written and the message
    /// runs again with a later fence). 0 for a message processed without a
    /// key. See docs/DESIGN.md, "Fencing an API".
    pub fn fence(&self) -> u64 {
        self.inner.fence
    }

    /// The largest result (as JSON text) that is stored as is; a larger one is
    /// stored as its SHA-256 and size, and duplicates get that digest back.
    pub fn max_result_bytes(&self) -> usize {
        self.inner.max_result_bytes
    }

    /// Stages a DynamoDB write that commits together with the dedup record, or not
    /// at all. A failure of its own condition is retried.
    pub fn stage(&self, item: TransactWriteItem) {
        self.stage_with(item, FailureKind::Retry);
    }

    /// Stages a DynamoDB write, saying what a failure of its own condition means
    /// (e.g. [`FailureKind::Permanent`] for "insufficient funds").
    pub fn stage_with(&self, item: TransactWriteItem, on_condition_failed: FailureKind) {
        self.inner
            .staged
            .lock()
            .expect("staged writes lock")
            .push(StagedWrite {
                item,
                on_condition_failed,
            });
    }

    /// Sends `body` to the queue at `queue_url` once this message's effect
    /// commits, and never otherwise: the message is recorded with the
    /// `COMPLETED` record (in the fast path's transaction, or in the claim
    /// path's completion) and sent after the commit, before the incoming
    /// message is deleted; a crash in between is recovered by the
    /// redelivery. Each carries a stable id for downstream dedup
    /// ([`crate::protocol::outbox`]).
    ///
    /// An error (a FIFO target with no group, over SQS's limits) is
    /// permanent, and the message fails with it even if the handler goes on.
    ///
    /// ```
    /// use sqs_once::{handler_fn, staged_only};
    ///
    /// let handler = staged_only(handler_fn(|message, ctx| async move {
    ///     ctx.send("https://sqs.eu-west-1.amazonaws.com/123456789012/paid", message.body())?;
    ///     Ok(None)
    /// }));
    /// # let _ = handler;
    /// ```
    pub fn send(&self, queue_url: &str, body: impl Into<String>) -> Result<(), HandlerError> {
        self.send_message(Outgoing::new(queue_url, body))
    }

    /// Sends `message` once this message's effect commits (see [`Self::send`]),
    /// with its attributes, group and delay.
    pub fn send_message(&self, message: Outgoing) -> Result<(), HandlerError> {
        let id_bytes = self.outbox_id_bytes();
        let checked = match self
            .inner
            .offload
            .as_ref()
            .and_then(LargePayloads::outgoing_max_bytes)
        {
            Some(max) => message.check_offloading(id_bytes, max),
            None => message.check(id_bytes),
        };
        self.keep_outgoing(message, checked)
    }

    /// Sends `message` once this message's effect commits, as
    /// [`Self::send_message`] does, but stores a body too large for SQS in
    /// S3 now (with `SQS_ONCE_OUTBOX_PAYLOAD_BUCKET`), not after the handler
    /// returns. A handler whose effect is outside DynamoDB (the claim path)
    /// should send large bodies this way before making its effect: a failed
    /// upload then fails the handler before the effect (a retry), instead of
    /// after it (where the retry makes the effect again, as a failed
    /// completion would).
    pub async fn send_large(&self, message: Outgoing) -> Result<(), HandlerError> {
        let id_bytes = self.outbox_id_bytes();
        let Some(payloads) = self
            .inner
            .offload
            .as_ref()
            .filter(|_| message.needs_offload(id_bytes))
        else {
            return self.send_message(message);
        };
        let max = payloads.outgoing_max_bytes().unwrap_or_default();
        if let Err(e) = message.check_offloading(id_bytes, max) {
            return self.keep_outgoing(message, Err(e));
        }
        let pointer = payloads.store_outgoing(&message.body).await.map_err(|e| {
            HandlerError::retry(format!(
                "an outgoing message's body could not be stored in S3 (nothing recorded): {e}"
            ))
        })?;
        self.keep_outgoing(message.offloaded(&pointer), Ok(()))
    }

    /// Keeps `message` to send after the commit, or the first refusal.
    fn keep_outgoing(
        &self,
        message: Outgoing,
        checked: Result<(), OutboxError>,
    ) -> Result<(), HandlerError> {
        let mut outbox = self.inner.outbox.lock().expect("outbox lock");
        if outbox.taken {
            tracing::error!(queue = %message.queue_url, "a message sent after the handler returned (from a task it left running) is dropped: send before returning");
            return Err(HandlerError::permanent(OutboxError::AfterReturn));
        }
        match checked {
            Ok(()) => {
                outbox.messages.push(message);
                Ok(())
            }
            Err(e) => {
                outbox.refused.get_or_insert_with(|| e.clone());
                Err(HandlerError::permanent(e))
            }
        }
    }

    /// How many times SQS has delivered this message, this time included.
    pub fn receive_count(&self) -> u32 {
        self.inner.receive_count
    }

    /// The Lambda invocation's request id (`None` outside Lambda), for logs
    /// and calls that should name the invocation.
    pub fn lambda_request_id(&self) -> Option<&str> {
        self.inner.request_id.as_deref()
    }

    /// How long the handler has before the runtime interrupts it, as things
    /// stand: the nearest of the Lambda invocation's deadline, the claim's
    /// local lease end and the message's visibility end (these two less the
    /// runtime's margin, and moved on by the heartbeat while it succeeds)
    /// that are known. In Lambda the runtime stops handlers half
    /// `SQS_ONCE_LAMBDA_MARGIN` before the deadline: keep that much in hand.
    /// `None` when nothing bounds the handler yet. A long handler can use it
    /// to stop at a safe point, or to bound the timeouts of its own calls.
    pub fn time_left(&self) -> Option<Duration> {
        let now = tokio::time::Instant::now();
        self.inner
            .ends
            .lock()
            .expect("ends lock")
            .iter()
            .filter_map(|end| *end.borrow())
            .min()
            .map(|end| end.saturating_duration_since(now))
    }

    /// The handler must finish by the end `end` keeps (see [`Self::time_left`]).
    pub(crate) fn bounded_by(
        &self,
        end: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>,
    ) {
        self.inner.ends.lock().expect("ends lock").push(end);
    }

    /// Cancelled when the claim's lease was lost (someone else owns the key now):
    /// a long handler should stop; its result would not be recorded.
    pub fn cancelled(&self) -> &CancellationToken {
        &self.inner.cancelled
    }

    /// The trace context of this message's span, for outgoing calls: see
    /// [`Context::traceparent`].
    pub fn trace_context(&self) -> Option<crate::protocol::trace::TraceParent> {
        crate::protocol::trace::context_of(&self.inner.span)
    }

    /// The W3C `traceparent` of this message's span: send it as a
    /// `traceparent` header (or message attribute) so that what the call
    /// does joins the message's trace. `None` unless spans are OpenTelemetry
    /// spans (the `otel` feature with its layer installed, as
    /// `cli::init_logging` does when an OTLP endpoint is set).
    pub fn traceparent(&self) -> Option<String> {
        self.trace_context().map(|t| t.w3c())
    }

    /// The same context as an X-Ray trace header, for the `X-Amzn-Trace-Id`
    /// header or an `AWSTraceHeader` system attribute.
    pub fn xray_trace_header(&self) -> Option<String> {
        self.trace_context().map(|t| t.xray())
    }

    /// The messages sent, or the first refusal (the whole outbox is checked
    /// by the processor, once large bodies are stored in S3).
    pub(crate) fn take_outbox(&self) -> Result<Vec<Outgoing>, OutboxError> {
        let mut outbox = self.inner.outbox.lock().expect("outbox lock");
        outbox.taken = true;
        if let Some(e) = outbox.refused.take() {
            return Err(e);
        }
        Ok(std::mem::take(&mut outbox.messages))
    }

    pub(crate) fn take_staged(&self) -> Vec<StagedWrite> {
        std::mem::take(&mut *self.inner.staged.lock().expect("staged writes lock"))
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_dynamodb::types::Update;

    use super::*;

    #[test]
    fn the_idempotency_key_is_derived_from_consumer_and_dedup_key_when_asked_for() {
        let message = Message::new("m-1", "{}");
        let ctx = Context::new("payments", Some("order-7"), (1, 1), &message, 1024);
        let expected = crate::protocol::key::idempotency_key("payments", "order-7");
        assert_eq!(ctx.idempotency_key(), Some(expected.as_str()));
        // Asked again (and through a clone): the same key.
        assert_eq!(ctx.clone().idempotency_key(), Some(expected.as_str()));
        let unkeyed = Context::new("payments", None, (1, 0), &message, 1024);
        assert_eq!(unkeyed.idempotency_key(), None);
    }

    fn build_update() -> Result<Update, HandlerError> {
        // No key, table or update expression: the builder refuses.
        Ok(Update::builder().build()?)
    }

    #[test]
    fn an_unbuildable_request_is_permanent() {
        let err = build_update().expect_err("an update without its required fields");
        assert_eq!(err.kind(), FailureKind::Permanent, "{err}");
    }

    #[test]
    fn an_unbuildable_request_inside_another_error_is_permanent() {
        #[derive(Debug)]
        struct Wrapped(aws_smithy_types::error::operation::BuildError);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "staging the ledger row")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let inner = aws_smithy_types::error::operation::BuildError::missing_field("key", "the key");
        let err = HandlerError::from(Wrapped(inner));
        assert_eq!(err.kind(), FailureKind::Permanent);
    }

    #[test]
    fn other_errors_are_retried() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(HandlerError::from(io).kind(), FailureKind::Retry);
        let parse = "x".parse::<u32>().expect_err("not a number");
        assert_eq!(HandlerError::from(parse).kind(), FailureKind::Retry);
    }
}
