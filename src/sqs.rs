//! SQS calls both runtimes make: visibility changes and parking in the DLQ.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, MessageAttributeValue};
use aws_smithy_types::error::display::DisplayErrorContext;
use futures::future::BoxFuture;
use tracing::warn;

use crate::Message;
use crate::config::SQS_MAX_VISIBILITY;
use crate::processor::VisibilityExtender;

/// The message attribute that carries a parked message's reason.
pub const REASON_ATTRIBUTE: &str = "sqs_once_reason";
/// The message attribute that carries a parked message's original message id.
pub const MESSAGE_ID_ATTRIBUTE: &str = "sqs_once_message_id";

/// Extends visibility with the message's receipt handle on one queue.
pub(crate) struct SqsVisibility {
    pub(crate) sqs: Client,
    pub(crate) queue_url: String,
}

impl VisibilityExtender for SqsVisibility {
    fn extend<'a>(
        &'a self,
        message: &'a Message,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let Some(receipt) = message.receipt_handle() else {
                return Err("no receipt handle".into());
            };
            set_visibility(&self.sqs, &self.queue_url, receipt, timeout).await
        })
    }
}

/// Sets a message's visibility timeout (capped at SQS's 12 hours).
pub(crate) async fn set_visibility(
    sqs: &Client,
    queue_url: &str,
    receipt: &str,
    timeout: Duration,
) -> Result<(), String> {
    let secs = timeout.min(SQS_MAX_VISIBILITY).as_secs();
    sqs.change_message_visibility()
        .queue_url(queue_url)
        .receipt_handle(receipt)
        .visibility_timeout(i32::try_from(secs).unwrap_or(43_200))
        .send()
        .await
        .map(|_| ())
        .map_err(|e| DisplayErrorContext(e).to_string())
}

/// Makes a message visible again after `after` (best effort: on failure it
/// returns when its current visibility timeout ends).
pub(crate) async fn retry_later(sqs: &Client, queue_url: &str, message: &Message, after: Duration) {
    let Some(receipt) = message.receipt_handle() else {
        return;
    };
    if let Err(e) = set_visibility(sqs, queue_url, receipt, after).await {
        warn!(message_id = message.id(), error = %e, "could not set the retry delay; the message returns after its visibility timeout");
    }
}

/// Sends a copy of the message to the DLQ with its reason (attribute
/// `sqs_once_reason`) and original id. The caller deletes the original after this
/// succeeds.
pub(crate) async fn send_to_dlq(
    sqs: &Client,
    dlq_url: &str,
    message: &Message,
    reason: &str,
) -> Result<(), String> {
    let attr = |v: &str| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
            .expect("complete attribute")
    };
    // SQS allows 10 attributes per message: ours, then up to 8 of the original's.
    let mut send = sqs
        .send_message()
        .queue_url(dlq_url)
        .message_body(message.body())
        .message_attributes(REASON_ATTRIBUTE, attr(&truncate(reason, 4096)))
        .message_attributes(MESSAGE_ID_ATTRIBUTE, attr(message.id()));
    for (k, v) in message.attributes().iter().take(8) {
        send = send.message_attributes(k, attr(v));
    }
    if dlq_url.ends_with(".fifo") {
        send = send
            .message_group_id(message.group_id().unwrap_or("sqs-once-parked"))
            .message_deduplication_id(message.id());
    }
    send.send()
        .await
        .map(|_| ())
        .map_err(|e| DisplayErrorContext(e).to_string())
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// `DeleteMessageBatch` entries for these receipt handles, with ids `m0`, `m1`, ...
/// (unique within the batch; `m{i}` maps a failed entry back to its receipt).
pub(crate) fn delete_entries<'a>(
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
