//! [`QueueClient`] for [`aws_sdk_sqs::Client`]: the production queue.

use crate::aws::OnHeap;
use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry,
    DeleteMessageBatchRequestEntry, MessageAttributeValue, MessageSystemAttributeName,
    MessageSystemAttributeNameForSends, MessageSystemAttributeValue, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use tracing::error;

use crate::Message;
use crate::protocol::limits::{SQS_MAX_DELAY, visibility_secs};
use crate::protocol::message::is_fifo;
use crate::protocol::message::{Attribute, AttributeValue};
use crate::protocol::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
};

/// The longest one attempt of a delete, a visibility change or a queue
/// lookup may take. A client's attempt timeout is sized for a long poll (its
/// wait plus a margin: 30 s for a poller's); these calls answer in
/// milliseconds, and one whose answer never comes must be tried again while
/// the message is still held: with 30 s attempts a poller's delete batches
/// waited out a silent attempt after another while the messages behind them
/// came back, until one on its last allowed receive reached the DLQ
/// completed (simulator seeds 24 and 34 of the wire path). Sends keep the
/// client's attempt timeout: a batch of large messages on a slow link may
/// need longer, and each attempt cut short that had landed sends a copy.
pub const CALL_ATTEMPT: Duration = Duration::from_secs(5);

/// The configuration a delete, a visibility change or a lookup runs with: one
/// attempt bounded by the client's attempt timeout or [`CALL_ATTEMPT`],
/// whichever is shorter; the rest as the client has it.
fn quick_call(client: &Client) -> aws_sdk_sqs::config::Builder {
    let configured = client
        .config()
        .timeout_config()
        .and_then(aws_smithy_types::timeout::TimeoutConfig::operation_attempt_timeout);
    let attempt = configured.map_or(CALL_ATTEMPT, |c| c.min(CALL_ATTEMPT));
    aws_sdk_sqs::config::Builder::default().timeout_config(
        aws_smithy_types::timeout::TimeoutConfig::builder()
            .operation_attempt_timeout(attempt)
            .build(),
    )
}

/// A failed SDK call as a [`QueueError`], keeping the SDK error as its source.
fn queue_error<E, R>(operation: &'static str, queue: &str, e: SdkError<E, R>) -> QueueError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let transient = crate::aws::is_transient(&e);
    let detail = crate::aws::error_detail(&e);
    let code = e.as_service_error().and_then(|se| se.code()).unwrap_or("");
    let error = QueueError::new(operation, queue, detail, transient).with_code(code);
    error.with_source(e)
}

/// The failed entries of a batch of `entries`, by index. An id that is not
/// one of ours (`m{i}`) cannot be told apart: then every entry counts as
/// failed, never one that failed as done.
fn failures(failed: &[BatchResultErrorEntry], entries: usize) -> Vec<EntryFailure> {
    if crate::protocol::mutants::active("batch-failures-dropped") {
        return Vec::new();
    }
    let index = |id: &str| {
        id.strip_prefix('m')
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|i| *i < entries)
    };
    if failed.iter().any(|f| index(&f.id).is_none()) {
        return (0..entries)
            .map(|index| EntryFailure {
                index,
                code: "UnknownEntry".into(),
                message: Some("a failed entry's id is not one this batch sent".into()),
            })
            .collect();
    }
    failed
        .iter()
        .filter_map(|f| {
            Some(EntryFailure {
                index: index(&f.id)?,
                code: f.code.clone(),
                message: f.message.clone(),
            })
        })
        .collect()
}

/// The system attributes a receive asks for: those [`to_message`] reads, no
/// more (`All` would add `SentTimestamp`,
/// `ApproximateFirstReceiveTimestamp`, `SequenceNumber`, ... to every
/// message, to be parsed and dropped). Message attributes are all asked for:
/// key sources, trace contexts and carried keys read them, and a parked or
/// retried copy carries them on.
const RECEIVED_SYSTEM_ATTRIBUTES: [MessageSystemAttributeName; 5] = [
    MessageSystemAttributeName::ApproximateReceiveCount,
    MessageSystemAttributeName::SenderId,
    MessageSystemAttributeName::MessageGroupId,
    MessageSystemAttributeName::MessageDeduplicationId,
    MessageSystemAttributeName::AwsTraceHeader,
];

/// Converts a received SQS message (received with the system attributes of
/// `RECEIVED_SYSTEM_ATTRIBUTES` and all message attributes); `None` (logged) for one without id or receipt handle.
pub fn to_message(m: aws_sdk_sqs::types::Message) -> Option<Message> {
    let (Some(id), Some(receipt)) = (m.message_id, m.receipt_handle) else {
        error!("received a message without id or receipt handle; left to its visibility timeout");
        return None;
    };
    let sys = m.attributes.unwrap_or_default();
    let mut msg = Message::new(id, m.body.unwrap_or_default()).with_receipt_handle(receipt);
    if let Some(n) = sys
        .get(&MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|v| v.parse().ok())
    {
        msg = msg.with_receive_count(n);
    }
    if let Some(g) = sys.get(&MessageSystemAttributeName::MessageGroupId) {
        msg = msg.with_group_id(g);
    }
    if let Some(d) = sys.get(&MessageSystemAttributeName::MessageDeduplicationId) {
        msg = msg.with_deduplication_id(d);
    }
    if let Some(s) = sys.get(&MessageSystemAttributeName::SenderId) {
        msg = msg.with_sender_id(s);
    }
    if let Some(t) = sys.get(&MessageSystemAttributeName::AwsTraceHeader) {
        msg = msg.with_aws_trace_header(t);
    }
    for (name, value) in m.message_attributes.unwrap_or_default() {
        let binary = value.binary_value.map(|b| b.into_inner());
        msg = msg.with_received_attribute(name, value.data_type, value.string_value, binary);
    }
    Some(msg)
}

/// A per-message delay as SQS takes it: whole seconds, rounded up (a
/// part-second delay must not become 0), at most [`SQS_MAX_DELAY`].
fn delay_secs(delay: Duration) -> i32 {
    visibility_secs(delay.min(SQS_MAX_DELAY))
}

/// The `AWSTraceHeader` system attribute of a send.
fn trace_header(
    header: String,
) -> HashMap<MessageSystemAttributeNameForSends, MessageSystemAttributeValue> {
    let value = MessageSystemAttributeValue::builder()
        .data_type("String")
        .string_value(header)
        .build()
        .expect("data type set");
    HashMap::from([(MessageSystemAttributeNameForSends::AwsTraceHeader, value)])
}

/// The entries of a `SendMessageBatch`, with ids `m{i}`.
fn send_entries(messages: Vec<OutgoingMessage>) -> Vec<SendMessageBatchRequestEntry> {
    messages
        .into_iter()
        .enumerate()
        .map(|(i, message)| {
            SendMessageBatchRequestEntry::builder()
                .id(format!("m{i}"))
                .message_body(message.body)
                .set_message_attributes(Some(sdk_attributes(&message.attributes)))
                .set_message_group_id(message.group_id)
                .set_message_deduplication_id(message.deduplication_id)
                .set_delay_seconds(message.delay.map(delay_secs))
                .set_message_system_attributes(message.trace_header.map(trace_header))
                .build()
                .expect("id and body set")
        })
        .collect()
}

/// Message attributes as the SDK sends them.
fn sdk_attributes(
    attributes: &std::collections::BTreeMap<String, Attribute>,
) -> HashMap<String, MessageAttributeValue> {
    attributes
        .iter()
        .map(|(name, a)| (name.clone(), sdk_attribute(a)))
        .collect()
}

/// An attribute as the SDK sends it.
pub(crate) fn sdk_attribute(a: &Attribute) -> MessageAttributeValue {
    let b = MessageAttributeValue::builder().data_type(&a.data_type);
    match &a.value {
        AttributeValue::Text(t) => b.string_value(t),
        AttributeValue::Binary(bytes) => b.binary_value(Blob::new(bytes.clone())),
    }
    .build()
    .expect("data type is set")
}

/// `DeleteMessageBatch` entries for these receipt handles, with ids `m0`, `m1`, ...
/// (unique within the batch; `m{i}` maps a failed entry back to its receipt).
pub fn delete_entries<'a>(
    receipts: impl IntoIterator<Item = &'a str>,
) -> Vec<DeleteMessageBatchRequestEntry> {
    receipts
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(format!("m{i}"))
                .receipt_handle(r)
                .build()
                .expect("complete entry")
        })
        .collect()
}

fn visibility_entries(
    receipts: &[String],
    secs: i32,
) -> Vec<ChangeMessageVisibilityBatchRequestEntry> {
    receipts
        .iter()
        .enumerate()
        .map(|(i, receipt)| {
            ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(format!("m{i}"))
                .receipt_handle(receipt)
                .visibility_timeout(secs)
                .build()
                .expect("complete entry")
        })
        .collect()
}

fn attribute_secs(
    attrs: &HashMap<QueueAttributeName, String>,
    n: &QueueAttributeName,
) -> Option<Duration> {
    attrs
        .get(n)
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs)
}

impl QueueClient for Client {
    async fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Result<Vec<Message>, QueueError> {
        // On a FIFO queue an attempt id: the SDK sends the same request again
        // after a timeout or a 5xx, and SQS answers a repeated attempt with
        // the messages the lost answer held instead of keeping their groups
        // locked for a visibility timeout.
        let attempt = is_fifo(queue).then(|| uuid::Uuid::new_v4().simple().to_string());
        let out = self
            .receive_message()
            .queue_url(queue)
            .set_receive_request_attempt_id(attempt)
            .visibility_timeout(visibility_secs(request.visibility))
            .max_number_of_messages(i32::try_from(request.max.clamp(1, 10)).unwrap_or(10))
            .wait_time_seconds(i32::try_from(request.wait.as_secs().min(20)).unwrap_or(20))
            .set_message_system_attribute_names(Some(RECEIVED_SYSTEM_ATTRIBUTES.to_vec()))
            .message_attribute_names("All")
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("ReceiveMessage", queue, e))?;
        Ok(out
            .messages
            .unwrap_or_default()
            .into_iter()
            .filter_map(to_message)
            .collect())
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        self.delete_message()
            .queue_url(queue)
            .receipt_handle(receipt)
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map(|_| ())
            .map_err(|e| queue_error("DeleteMessage", queue, e))
    }

    async fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let out = self
            .delete_message_batch()
            .queue_url(queue)
            .set_entries(Some(delete_entries(receipts.iter().map(String::as_str))))
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("DeleteMessageBatch", queue, e))?;
        Ok(failures(&out.failed, receipts.len()))
    }

    async fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        self.change_message_visibility()
            .queue_url(queue)
            .receipt_handle(receipt)
            .visibility_timeout(visibility_secs(timeout))
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map(|_| ())
            .map_err(|e| queue_error("ChangeMessageVisibility", queue, e))
    }

    async fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let out = self
            .change_message_visibility_batch()
            .queue_url(queue)
            .set_entries(Some(visibility_entries(receipts, visibility_secs(timeout))))
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("ChangeMessageVisibilityBatch", queue, e))?;
        Ok(failures(&out.failed, receipts.len()))
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        self.send_message()
            .queue_url(queue)
            .message_body(message.body)
            .set_message_attributes(Some(sdk_attributes(&message.attributes)))
            .set_message_group_id(message.group_id)
            .set_message_deduplication_id(message.deduplication_id)
            .set_delay_seconds(message.delay.map(delay_secs))
            .set_message_system_attributes(message.trace_header.map(trace_header))
            .send()
            .on_heap()
            .await
            .map(|_| ())
            .map_err(|e| queue_error("SendMessage", queue, e))
    }

    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let entries = messages.len();
        let out = self
            .send_message_batch()
            .queue_url(queue)
            .set_entries(Some(send_entries(messages)))
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("SendMessageBatch", queue, e))?;
        Ok(failures(&out.failed, entries))
    }

    async fn attributes(&self, queue: &str) -> Result<QueueAttributes, QueueError> {
        let mut names = vec![
            QueueAttributeName::VisibilityTimeout,
            QueueAttributeName::MessageRetentionPeriod,
            QueueAttributeName::MaximumMessageSize,
            QueueAttributeName::RedrivePolicy,
        ];
        if is_fifo(queue) {
            names.push(QueueAttributeName::ContentBasedDeduplication);
        }
        let out = self
            .get_queue_attributes()
            .queue_url(queue)
            .set_attribute_names(Some(names))
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("GetQueueAttributes", queue, e))?;
        let attrs = out.attributes.unwrap_or_default();
        let dead_letter_target_arn = attrs
            .get(&QueueAttributeName::RedrivePolicy)
            .and_then(|p| crate::protocol::queue::dead_letter_target_arn(p));
        let max_receive_count = attrs
            .get(&QueueAttributeName::RedrivePolicy)
            .and_then(|p| crate::protocol::queue::max_receive_count(p));
        Ok(QueueAttributes {
            visibility_timeout: attribute_secs(&attrs, &QueueAttributeName::VisibilityTimeout),
            retention: attribute_secs(&attrs, &QueueAttributeName::MessageRetentionPeriod),
            max_message_bytes: attrs
                .get(&QueueAttributeName::MaximumMessageSize)
                .and_then(|v| v.parse().ok()),
            dead_letter_target_arn,
            content_based_deduplication: attrs
                .get(&QueueAttributeName::ContentBasedDeduplication)
                .map(|v| v == "true"),
            max_receive_count,
        })
    }

    async fn queue_url(&self, name: &str, account: &str) -> Result<String, QueueError> {
        let out = self
            .get_queue_url()
            .queue_name(name)
            .queue_owner_aws_account_id(account)
            .customize()
            .config_override(quick_call(self))
            .send()
            .on_heap()
            .await
            .map_err(|e| queue_error("GetQueueUrl", name, e))?;
        out.queue_url
            .ok_or_else(|| QueueError::new("GetQueueUrl", name, "no QueueUrl in the answer", true))
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::error::SdkError;
    use aws_sdk_sqs::operation::change_message_visibility::ChangeMessageVisibilityError;
    use aws_smithy_types::error::ErrorMetadata;

    /// The service's code is read into the queue error, so that a stale
    /// receipt handle is told from other refusals.
    #[test]
    fn a_refused_receipt_handle_is_told_from_other_refusals() {
        let error = |code: &str, message: &str| {
            let meta = ErrorMetadata::builder().code(code).message(message).build();
            let e: SdkError<ChangeMessageVisibilityError, ()> =
                SdkError::service_error(ChangeMessageVisibilityError::generic(meta), ());
            super::queue_error("ChangeMessageVisibility", "q", e)
        };
        for (code, message) in [
            ("ReceiptHandleIsInvalid", "stale"),
            ("AWS.SimpleQueueService.MessageNotInflight", "visible"),
            ("MessageNotInflight", "visible"),
            (
                "InvalidParameterValue",
                "Value x for parameter ReceiptHandle is invalid. Reason: Message does not exist or is not available for visibility timeout change.",
            ),
        ] {
            assert!(
                error(code, message).is_receipt_refused(),
                "{code}: {message}"
            );
        }
        for (code, message) in [
            ("AccessDenied", "no"),
            ("InvalidParameterValue", "VisibilityTimeout above 43200"),
            ("", "no code"),
            ("ServiceUnavailable", "later"),
        ] {
            assert!(
                !error(code, message).is_receipt_refused(),
                "{code}: {message}"
            );
        }
    }
}
