//! The queue seam: the few calls the runtimes make to SQS.
//!
//! The poller and the Lambda adapter never hold an SQS client directly; they
//! talk to a [`QueueClient`]: receive, delete (one or a batch), change
//! visibility (one or a batch), send (to park in the DLQ), the queue's
//! attributes, and a queue URL from a name. [`aws_sdk_sqs::Client`] is the
//! production implementation ([`sqs`](crate::aws::sqs)); an in-memory model of SQS can stand
//! behind the same trait, so the runtimes run unchanged in a simulation.
//!
//! Queues are named by URL in every call, as in SQS: one client serves the
//! source queue and its DLQ. Batch calls take at most [`SQS_BATCH`] entries and
//! answer with the entries that failed.
//!
//! See the project's `docs/DESIGN.md` ("The runtimes", "Parking").

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use crate::Message;
use crate::protocol::message::Attribute;
pub use crate::protocol::message::is_fifo;

/// Entries in one SQS batch request.
pub use crate::protocol::limits::SQS_BATCH;

/// A receive: up to `max` messages (at most [`SQS_BATCH`]), waiting up to `wait`
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
    /// Standard queues: how long the message stays hidden after the send
    /// (`DelaySeconds`, whole seconds rounded up, at most 15 minutes);
    /// `None`: the queue's own delay.
    pub delay: Option<Duration>,
    /// The `AWSTraceHeader` system attribute (a producer's X-Ray trace
    /// header), kept on a message sent again in its stead.
    pub trace_header: Option<String>,
}

/// The attributes of a queue the runtimes read (`None` when not answered).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QueueAttributes {
    /// `VisibilityTimeout`.
    pub visibility_timeout: Option<Duration>,
    /// `MessageRetentionPeriod`.
    pub retention: Option<Duration>,
    /// `MaximumMessageSize`, in bytes.
    pub max_message_bytes: Option<usize>,
    /// The ARN of the DLQ its `RedrivePolicy` names.
    pub dead_letter_target_arn: Option<String>,
    /// `ContentBasedDeduplication` (FIFO queues; `None` elsewhere).
    pub content_based_deduplication: Option<bool>,
    /// The `maxReceiveCount` of its `RedrivePolicy`: the receives after
    /// which SQS moves a message to that DLQ.
    pub max_receive_count: Option<u32>,
}

/// The DLQ ARN a queue's `RedrivePolicy` attribute (JSON) names.
pub fn dead_letter_target_arn(redrive_policy: &str) -> Option<String> {
    let policy: serde_json::Value = serde_json::from_str(redrive_policy).ok()?;
    policy
        .get("deadLetterTargetArn")?
        .as_str()
        .map(str::to_owned)
}

/// The `maxReceiveCount` a queue's `RedrivePolicy` attribute (JSON) names
/// (a number, or a number in a string as SQS answers it); `None` when it
/// names none, or 0.
pub fn max_receive_count(redrive_policy: &str) -> Option<u32> {
    let policy: serde_json::Value = serde_json::from_str(redrive_policy).ok()?;
    let count = policy.get("maxReceiveCount")?;
    let count = match count {
        serde_json::Value::String(s) => s.parse().ok()?,
        v => u32::try_from(v.as_u64()?).ok()?,
    };
    (count > 0).then_some(count)
}

/// (name, account) of a queue ARN (`arn:aws:sqs:region:account:name`).
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) fn queue_arn_parts(arn: &str) -> Option<(&str, &str)> {
    let mut parts = arn.rsplitn(3, ':');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(name), Some(account), Some(_)) if !name.is_empty() && !account.is_empty() => {
            Some((name, account))
        }
        _ => None,
    }
}

/// The longest SQS keeps a message (`MessageRetentionPeriod`'s upper bound).
pub const SQS_MAX_RETENTION: Duration = Duration::from_secs(14 * 86_400);

/// What a record's TTL is fitted above: the source queue's retention plus its
/// DLQ's, as far as they could be read.
#[cfg(any(feature = "poller", feature = "lambda"))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RetentionWindow {
    /// How long after its first send a copy of a message can still be
    /// received (see [`retention_window`]).
    pub total: Duration,
    /// The DLQs counted (the redrive policy's, the parking one), each with
    /// why its retention was assumed rather than read (SQS's longest, 14
    /// days), when it could not be read.
    pub dlqs: Vec<(String, Option<String>)>,
}

/// The URL of the queue named by `arn`, built beside `source_url`: SQS
/// requires a queue's DLQ to be in its account and region, so only the last
/// two path segments differ (no `GetQueueUrl`, which a consumer's role
/// need not grant). `None` when `source_url` has no such shape.
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) fn sibling_queue_url(source_url: &str, arn: &str) -> Option<String> {
    let (name, account) = queue_arn_parts(arn)?;
    let (base, source_name) = source_url.trim_end_matches('/').rsplit_once('/')?;
    let (host, _source_account) = base.rsplit_once('/')?;
    if source_name.is_empty() || !host.contains("://") {
        return None;
    }
    Some(format!("{host}/{account}/{name}"))
}

/// How long a copy of a message of `queue_url` can come back after its first
/// send: the source's retention plus the longer of those of the DLQ its
/// redrive policy names and `parking_dlq`, where sqs-once parks. A message can wait its
/// retention in the source, then in the DLQ, before it is brought back; on a
/// FIFO queue the source's counts twice, as a move restarts it. A DLQ whose
/// retention cannot be read counts as SQS's longest (14 days) and says why.
/// `None` when the source's own retention is unknown.
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) async fn retention_window<Q: QueueClient>(
    queue: &Q,
    queue_url: &str,
    source: &QueueAttributes,
    parking_dlq: Option<&str>,
) -> Option<RetentionWindow> {
    let retention = source.retention?;
    // The redrive policy's DLQ and the parking DLQ, when they differ, may
    // each hold a copy: the longer retention counts.
    let mut urls: Vec<(String, Result<String, String>)> = Vec::new();
    if let Some(arn) = source.dead_letter_target_arn.as_deref() {
        let url = match (sibling_queue_url(queue_url, arn), queue_arn_parts(arn)) {
            (Some(url), _) => Ok(url),
            (None, Some((name, account))) => queue
                .queue_url(name, account)
                .await
                .map_err(|e| format!("grant sqs:GetQueueUrl on the DLQ: {e}")),
            (None, None) => Err("the redrive policy names no queue ARN".to_owned()),
        };
        urls.push((arn.to_owned(), url));
    }
    if let Some(parking) = parking_dlq
        && !urls.iter().any(|(_, u)| u.as_deref() == Ok(parking))
    {
        urls.push((parking.to_owned(), Ok(parking.to_owned())));
    }
    let mut dlq_retention = Duration::ZERO;
    let mut dlqs = Vec::new();
    for (name, url) in urls {
        let read = match &url {
            Ok(url) => match queue.attributes(url).await.map(|a| a.retention) {
                Ok(Some(r)) => Ok(r),
                Ok(None) => Err("no MessageRetentionPeriod in the answer".to_owned()),
                Err(e) => Err(format!("grant sqs:GetQueueAttributes on the DLQ: {e}")),
            },
            Err(why) => Err(why.clone()),
        };
        let shown = url.unwrap_or(name);
        match read {
            Ok(r) => {
                dlq_retention = dlq_retention.max(r);
                dlqs.push((shown, None));
            }
            Err(why) => {
                dlq_retention = SQS_MAX_RETENTION;
                dlqs.push((shown, Some(why)));
            }
        }
    }
    // A standard queue's message keeps its first enqueue time in the DLQ, so
    // the DLQ's retention bounds its whole age; a FIFO queue's starts again
    // when it is moved (SQS Developer Guide, dead-letter queues), and a copy
    // brought back starts again in the source.
    let total = if is_fifo(queue_url) {
        retention * 2 + dlq_retention
    } else {
        retention + dlq_retention
    };
    Some(RetentionWindow { total, dlqs })
}

/// How much longer than the queue's retention plus its DLQ's a fitted TTL
/// keeps a record: the last receive of a message can come a lease and a retry delay
/// after its retention's start, and a record is written after the send.
pub const TTL_SLACK: Duration = Duration::from_secs(86_400);

/// The TTL that keeps a record longer than any copy of its message can come
/// back, on any queue SQS allows (a FIFO source kept 14 days, moved to a DLQ
/// kept 14 days, brought back for 14 more), plus [`TTL_SLACK`]: the default
/// when the queue's retention cannot be read.
pub const LONGEST_TTL: Duration = Duration::from_secs(43 * 86_400);

/// Warns when a message could come back after its dedup record expired, and
/// so run again: `ttl` (`SQS_ONCE_TTL`) not above [`retention_window`]. A DLQ
/// whose retention could not be read is warned about too, naming the
/// permission. Returns the retention the TTL should exceed, when it warned.
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) async fn check_retention<Q: QueueClient>(
    queue: &Q,
    queue_url: &str,
    source: &QueueAttributes,
    ttl: Duration,
) -> Option<Duration> {
    let window = retention_window(queue, queue_url, source, None).await?;
    warn_unread_dlq(&window);
    let total = window.total;
    if total >= ttl {
        tracing::warn!(
            queue = queue_url,
            retention = ?source.retention,
            dlqs = ?window.dlqs.iter().map(|(url, _)| url).collect::<Vec<_>>(),
            ?ttl,
            "SQS_ONCE_TTL is not longer than the queue's retention plus its DLQ's: a message brought back late (redelivered, or redriven from the DLQ) could find its record expired and run again; raise SQS_ONCE_TTL above {} (or leave it unset: the TTL is then fitted to the queues)",
            humantime::format_duration(total)
        );
        return Some(total);
    }
    None
}

/// A warning when the DLQ's retention was assumed rather than read.
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) fn warn_unread_dlq(window: &RetentionWindow) {
    for (url, why) in &window.dlqs {
        let Some(why) = why else { continue };
        tracing::warn!(
            dlq = %url,
            error = %why,
            "cannot read the DLQ's retention (the error names the permission to grant): counted as SQS's longest, 14 days"
        );
    }
}

/// Error codes that may pass when tried again: throttling, and the
/// services' internal errors and unavailability (5xx). Any code containing
/// `Throttl` counts too (`ThrottlingException`, `RequestThrottled`,
/// `KmsThrottled`, `KMS.ThrottlingException`, ...).
const TRANSIENT_CODES: &[&str] = &[
    // DynamoDB.
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "InternalServerError",
    // SQS's common errors (API reference, "Common Errors"): `InternalFailure`
    // is its HTTP 500, `ServiceUnavailable` its 503; the query protocol's
    // internal error too.
    "InternalFailure",
    "ServiceUnavailable",
    "InternalError",
    "AWS.SimpleQueueService.InternalError",
];

/// Whether an SQS or DynamoDB error code (of a whole call, or of one batch
/// entry) may pass when tried again: throttling, or an internal error or
/// unavailability. Any other code is a refusal.
pub fn transient_code(code: &str) -> bool {
    code.contains("Throttl") || TRANSIENT_CODES.contains(&code)
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
    /// The service refused the receipt handle itself ([`Self::with_code`]).
    receipt_refused: bool,
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
            receipt_refused: false,
            source: None,
        }
    }

    /// Reads the service's error code (`ReceiptHandleIsInvalid`, ...) for
    /// what [`Self::is_receipt_refused`] tells; the code is not kept apart
    /// (put it in the detail). A custom [`QueueClient`] calls it with the
    /// code of each failed call.
    pub fn with_code(mut self, code: &str) -> Self {
        self.receipt_refused = match code {
            "ReceiptHandleIsInvalid"
            | "MessageNotInflight"
            | "AWS.SimpleQueueService.MessageNotInflight" => true,
            // How SQS is reported to refuse a receipt handle it no longer
            // takes ("Value ... for parameter ReceiptHandle is invalid.
            // Reason: Message does not exist or is not available for
            // visibility timeout change."), and LocalStack likewise.
            "InvalidParameterValue" => self.detail.contains("ReceiptHandle"),
            _ => false,
        };
        self
    }

    /// Whether SQS refused the receipt handle itself: it is stale (the
    /// message was received again since, or is gone), or the message is
    /// not in flight (visible again). The delivery it came with no longer
    /// holds the message. Other refusals (access, parameters) say nothing
    /// of the delivery.
    pub fn is_receipt_refused(&self) -> bool {
        self.receipt_refused
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

    /// `DeleteMessageBatch` (at most [`SQS_BATCH`] receipts): the entries that failed.
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

    /// `ChangeMessageVisibilityBatch` (at most [`SQS_BATCH`] receipts): the
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

    /// `SendMessageBatch` (at most [`SQS_BATCH`] messages, sent in their
    /// order): the entries that failed. By default one `SendMessage` each, a
    /// failed one reported as its entry's failure.
    fn send_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> impl Future<Output = Result<Vec<EntryFailure>, QueueError>> + Send {
        async move {
            let mut failed = Vec::new();
            for (index, message) in messages.into_iter().enumerate() {
                if let Err(e) = self.send(queue, message).await {
                    failed.push(EntryFailure {
                        index,
                        code: if e.is_transient() {
                            "InternalError".to_owned()
                        } else {
                            "InvalidParameterValue".to_owned()
                        },
                        message: Some(e.to_string()),
                    });
                }
            }
            Ok(failed)
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::queue::{QueueSettings, RedrivePolicy};

    #[test]
    fn a_queue_arn_gives_its_name_and_account() {
        assert_eq!(
            queue_arn_parts("arn:aws:sqs:eu-west-1:123456789012:orders.fifo"),
            Some(("orders.fifo", "123456789012"))
        );
        assert_eq!(queue_arn_parts("orders"), None);
        assert_eq!(queue_arn_parts("arn:aws:sqs:eu-west-1:123:"), None);
    }

    #[test]
    fn a_redrive_policy_gives_its_max_receive_count() {
        let arn = "arn:aws:sqs:eu-west-1:123456789012:dlq";
        for (policy, count) in [
            (
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"3"}}"#),
                Some(3),
            ),
            (
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":5}}"#),
                Some(5),
            ),
            (
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":0}}"#),
                None,
            ),
            (format!(r#"{{"deadLetterTargetArn":"{arn}"}}"#), None),
            ("not json".to_owned(), None),
        ] {
            assert_eq!(max_receive_count(&policy), count, "{policy}");
        }
    }

    /// A source queue keeping messages 4 days whose DLQ keeps them 14.
    async fn source_with_dlq() -> (crate::MemoryQueue, String, QueueAttributes) {
        let queue = crate::MemoryQueue::new();
        let mut dlq = QueueSettings::new("orders-dlq");
        dlq.retention = Duration::from_secs(14 * 86_400);
        let dlq_url = queue.create_queue(dlq).unwrap();
        let mut source = QueueSettings::new("orders");
        source.retention = Duration::from_secs(4 * 86_400);
        source.redrive = Some(RedrivePolicy {
            dlq_url,
            max_receive_count: 5,
        });
        let url = queue.create_queue(source).unwrap();
        let attributes = queue.attributes(&url).await.unwrap();
        (queue, url, attributes)
    }

    #[test]
    fn a_dlq_url_is_built_beside_its_source_queue() {
        let arn = "arn:aws:sqs:us-east-1:000000000000:orders-dlq";
        assert_eq!(
            sibling_queue_url("http://localhost:4566/000000000000/orders", arn).as_deref(),
            Some("http://localhost:4566/000000000000/orders-dlq")
        );
        assert_eq!(
            sibling_queue_url(
                "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
                "arn:aws:sqs:eu-west-1:123456789012:orders-dlq.fifo"
            )
            .as_deref(),
            Some("https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq.fifo")
        );
        assert_eq!(sibling_queue_url("orders", arn), None);
    }

    #[tokio::test]
    async fn a_dlq_whose_retention_cannot_be_read_counts_as_fourteen_days() {
        let (queue, url, mut attributes) = source_with_dlq().await;
        attributes.dead_letter_target_arn =
            Some("arn:aws:sqs:us-east-1:000000000000:no-such-dlq".to_owned());
        let window = retention_window(&queue, &url, &attributes, None)
            .await
            .unwrap();
        assert_eq!(
            window.total,
            Duration::from_secs(4 * 86_400) + SQS_MAX_RETENTION
        );
        assert!(matches!(window.dlqs[..], [(_, Some(_))]), "{window:?}");
        // The warning says which permission would let it be read.
        let why = window.dlqs[0].1.as_deref().unwrap_or_default();
        assert!(
            why.starts_with("grant sqs:GetQueueAttributes on the DLQ")
                || why.starts_with("grant sqs:GetQueueUrl on the DLQ"),
            "{why}"
        );
        // Fitted, the TTL outlives the longest a copy can come back.
        let (queue, url, attributes) = source_with_dlq().await;
        let window = retention_window(&queue, &url, &attributes, None)
            .await
            .unwrap();
        assert_eq!(window.total, Duration::from_secs(18 * 86_400));
        assert!(matches!(window.dlqs[..], [(_, None)]), "{window:?}");
        assert!(SQS_MAX_RETENTION * 3 + TTL_SLACK <= LONGEST_TTL);
    }

    #[tokio::test]
    async fn a_parking_dlq_that_keeps_copies_longer_than_the_redrive_policys_counts() {
        let queue = crate::MemoryQueue::new();
        let days = |d: u64| Duration::from_secs(d * 86_400);
        let mut short = QueueSettings::new("orders-dlq");
        short.retention = days(2);
        let dlq_url = queue.create_queue(short).unwrap();
        let mut parking = QueueSettings::new("parked");
        parking.retention = days(14);
        let parking_url = queue.create_queue(parking).unwrap();
        let mut source = QueueSettings::new("orders");
        source.retention = days(4);
        source.redrive = Some(RedrivePolicy {
            dlq_url,
            max_receive_count: 5,
        });
        let url = queue.create_queue(source).unwrap();
        let attributes = queue.attributes(&url).await.unwrap();
        let alone = retention_window(&queue, &url, &attributes, None)
            .await
            .unwrap();
        assert_eq!(alone.total, days(6));
        let both = retention_window(&queue, &url, &attributes, Some(&parking_url))
            .await
            .unwrap();
        assert_eq!(both.total, days(18), "{both:?}");
        assert_eq!(both.dlqs.len(), 2, "{both:?}");
    }

    #[tokio::test]
    async fn a_ttl_below_the_source_and_dlq_retention_together_is_warned_about() {
        let (queue, url, attributes) = source_with_dlq().await;
        assert!(attributes.dead_letter_target_arn.is_some());
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(
            check_retention(&queue, &url, &attributes, week).await,
            Some(Duration::from_secs(18 * 86_400)),
            "7 days is above the source's 4 but not above 4 + 14"
        );
        let three_weeks = Duration::from_secs(21 * 86_400);
        assert_eq!(
            check_retention(&queue, &url, &attributes, three_weeks).await,
            None
        );
    }
}
