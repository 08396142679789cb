//! The queue seam: the few calls the runtimes make to SQS.
//!
//! The poller and the Lambda adapter never hold an SQS client directly; they
//! talk to a [`QueueClient`]: receive, delete (one or a batch), change
//! visibility (one or a batch), send (to park in the DLQ), the queue's
//! attributes, and a queue URL from a name. [`aws_sdk_sqs::Client`] is the
//! production implementation ([`sqs`]); an in-memory model of SQS can stand
//! behind the same trait, so the runtimes run unchanged in a simulation.
//!
//! Queues are named by URL in every call, as in SQS: one client serves the
//! source queue and its DLQ. Batch calls take at most [`BATCH`] entries and
//! answer with the entries that failed.
//!
//! See the project's `docs/DESIGN.md` ("The runtimes", "Parking").

mod dlq;
pub mod memory;
pub mod sqs;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use crate::Message;
use crate::config::SQS_MAX_VISIBILITY;
use crate::message::Attribute;

pub use dlq::{Dlq, MESSAGE_ID_ATTRIBUTE, ParkError, REASON_ATTRIBUTE};

/// Entries in one SQS batch request.
pub const BATCH: usize = 10;

/// A receive: up to `max` messages (at most [`BATCH`]), waiting up to `wait`
/// for the first, made invisible for `visibility`. Messages come with all
/// their system and message attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiveRequest {
    /// Messages at most (1 to 10).
    pub max: usize,
    /// Long-poll wait (whole seconds, at most 20).
    pub wait: Duration,
    /// Visibility timeout of what is received.
    pub visibility: Duration,
}

/// A message to send.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutgoingMessage {
    /// The body, unchanged.
    pub body: String,
    /// Message attributes with their data types.
    pub attributes: BTreeMap<String, Attribute>,
    /// FIFO queues: the message group.
    pub group_id: Option<String>,
    /// FIFO queues: the deduplication id (sends with the same id within five
    /// minutes are accepted but delivered once).
    pub deduplication_id: Option<String>,
}

/// The attributes of a queue the runtimes read (`None` when not answered).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QueueAttributes {
    /// `VisibilityTimeout`.
    pub visibility_timeout: Option<Duration>,
    /// `MessageRetentionPeriod`.
    pub retention: Option<Duration>,
    /// `MaximumMessageSize`, in bytes.
    pub max_message_bytes: Option<usize>,
}

/// One entry of a batch call that failed; the others succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryFailure {
    /// The entry's position in the request.
    pub index: usize,
    /// The error code (e.g. `ReceiptHandleIsInvalid`).
    pub code: String,
    /// SQS's message, if any.
    pub message: Option<String>,
}

/// A queue call that failed as a whole.
#[derive(Debug, thiserror::Error)]
#[error("{operation} on {queue} failed: {detail}")]
pub struct QueueError {
    /// The SQS operation (`ReceiveMessage`, ...).
    pub operation: &'static str,
    /// The queue's URL (or name, for a lookup).
    pub queue: String,
    /// What the service or the transport said.
    pub detail: String,
    transient: bool,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl QueueError {
    /// A failure of `operation` on `queue`; `transient` when it may pass if
    /// tried again (no answer, throttling, 5xx).
    pub fn new(
        operation: &'static str,
        queue: impl Into<String>,
        detail: impl Into<String>,
        transient: bool,
    ) -> Self {
        Self {
            operation,
            queue: queue.into(),
            detail: detail.into(),
            transient,
            source: None,
        }
    }

    /// Keeps the underlying error as the source.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Whether the call may pass when tried again.
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

/// The SQS calls the runtimes make. Cheap to clone (a client handle).
///
/// Every future is `Send`, so calls can run in spawned tasks.
pub trait QueueClient: Clone + Send + Sync + 'static {
    /// `ReceiveMessage`. Messages without an id or receipt handle are left out
    /// (and logged).
    fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> impl Future<Output = Result<Vec<Message>, QueueError>> + Send;

    /// `DeleteMessage` by receipt handle.
    fn delete(
        &self,
        queue: &str,
        receipt: &str,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// `DeleteMessageBatch` (at most [`BATCH`] receipts): the entries that failed.
    fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> impl Future<Output = Result<Vec<EntryFailure>, QueueError>> + Send;

    /// `ChangeMessageVisibility`: the message becomes visible `timeout` from now.
    fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// `ChangeMessageVisibilityBatch` (at most [`BATCH`] receipts): the
    /// entries that failed.
    fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> impl Future<Output = Result<Vec<EntryFailure>, QueueError>> + Send;

    /// `SendMessage`.
    fn send(
        &self,
        queue: &str,
        message: OutgoingMessage,
    ) -> impl Future<Output = Result<(), QueueError>> + Send;

    /// `GetQueueAttributes` (visibility timeout, retention, size limit).
    fn attributes(
        &self,
        queue: &str,
    ) -> impl Future<Output = Result<QueueAttributes, QueueError>> + Send;

    /// `GetQueueUrl` of the queue `name` owned by `account`.
    fn queue_url(
        &self,
        name: &str,
        account: &str,
    ) -> impl Future<Output = Result<String, QueueError>> + Send;
}

/// Whether a queue URL (or name) is a FIFO queue's.
pub fn is_fifo(queue: &str) -> bool {
    queue.ends_with(".fifo")
}

/// A visibility timeout as SQS takes it: whole seconds, capped at 12 hours.
pub fn visibility_secs(timeout: Duration) -> i32 {
    i32::try_from(timeout.min(SQS_MAX_VISIBILITY).as_secs()).unwrap_or(43_200)
}
