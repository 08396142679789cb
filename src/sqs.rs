//! SQS calls both runtimes make: visibility changes and parking in the DLQ.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageAttributeValue, QueueAttributeName,
};
use aws_smithy_types::error::display::DisplayErrorContext;
use futures::future::BoxFuture;
use tracing::{error, warn};

use crate::Message;
use crate::config::SQS_MAX_VISIBILITY;
use crate::key::{DEDUP_KEY_ATTRIBUTE, carry_key};
use crate::message::{Attribute, AttributeValue};
use crate::processor::VisibilityExtender;

/// The message attribute that carries a parked message's reason.
pub const REASON_ATTRIBUTE: &str = "sqs_once_reason";
/// The message attribute that carries the id of a parked message's first
/// delivery (kept through later parks).
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

/// A visibility timeout as SQS takes it: whole seconds, capped at 12 hours.
pub(crate) fn visibility_secs(timeout: Duration) -> i32 {
    i32::try_from(timeout.min(SQS_MAX_VISIBILITY).as_secs()).unwrap_or(43_200)
}

/// Sets a message's visibility timeout (capped at SQS's 12 hours).
pub(crate) async fn set_visibility(
    sqs: &Client,
    queue_url: &str,
    receipt: &str,
    timeout: Duration,
) -> Result<(), String> {
    sqs.change_message_visibility()
        .queue_url(queue_url)
        .receipt_handle(receipt)
        .visibility_timeout(visibility_secs(timeout))
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

/// Entries in one SQS batch request.
const BATCH: usize = 10;
/// SQS allows this many message attributes per message.
const MAX_ATTRIBUTES: usize = 10;
/// SQS's default `MaximumMessageSize`, assumed when the DLQ's cannot be read.
const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// A reason shorter than this is dropped rather than cut to nothing useful.
const MIN_REASON_BYTES: usize = 64;

/// Why a message could not be parked. It then comes back (and, failing
/// again, ends in the DLQ by the queue's redrive policy, without a reason).
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// The body and the original attributes alone exceed the DLQ's limit.
    #[error(
        "the message ({bytes} bytes with its attributes) is larger than the DLQ's MaximumMessageSize ({limit} bytes); left to the queue's redrive policy"
    )]
    TooLarge {
        /// Body and original attributes.
        bytes: usize,
        /// The DLQ's limit.
        limit: usize,
    },
    /// `SendMessage` to the DLQ failed.
    #[error("sending to the DLQ failed: {0}")]
    Send(String),
}

/// The DLQ where permanent failures are parked, with its size limit read once.
/// Both runtimes park through it.
#[derive(Debug)]
pub struct Dlq {
    sqs: Client,
    url: String,
    max_bytes: tokio::sync::OnceCell<usize>,
}

impl Dlq {
    /// The DLQ at `url`.
    pub fn new(sqs: Client, url: impl Into<String>) -> Self {
        Self {
            sqs,
            url: url.into(),
            max_bytes: tokio::sync::OnceCell::new(),
        }
    }

    /// The DLQ's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The DLQ's `MaximumMessageSize` (read once; SQS's default when it cannot
    /// be read, and then read again next time).
    async fn max_bytes(&self) -> usize {
        let read = self
            .max_bytes
            .get_or_try_init(|| async {
                let out = self
                    .sqs
                    .get_queue_attributes()
                    .queue_url(&self.url)
                    .attribute_names(QueueAttributeName::MaximumMessageSize)
                    .send()
                    .await
                    .map_err(|e| DisplayErrorContext(e).to_string())?;
                out.attributes()
                    .and_then(|a| a.get(&QueueAttributeName::MaximumMessageSize))
                    .and_then(|v| v.parse::<usize>().ok())
                    .ok_or_else(|| "no MaximumMessageSize in the answer".to_owned())
            })
            .await;
        read.copied().unwrap_or_else(|e| {
            warn!(dlq = %self.url, error = %e, "cannot read the DLQ's MaximumMessageSize; assuming SQS's default");
            DEFAULT_MAX_MESSAGE_BYTES
        })
    }

    /// Sends a copy of the message to the DLQ: the body and every message
    /// attribute exactly as received (data types included), plus
    /// `sqs_once_dedup_key` (the key it was processed under, so a copy brought
    /// back is processed under the same key), `sqs_once_reason` (this park's
    /// reason, replacing an earlier one) and `sqs_once_message_id` (the first
    /// delivery's id), as far as SQS's attribute count and the DLQ's size limit
    /// allow; the reason is shortened to fit, the body is never altered. The
    /// caller deletes the original after this succeeds.
    pub async fn park(
        &self,
        message: &Message,
        reason: &str,
        dedup_key: Option<&str>,
    ) -> Result<(), ParkError> {
        let copy = ParkedCopy::new(message, reason, dedup_key, self.max_bytes().await)?;
        let mut send = self
            .sqs
            .send_message()
            .queue_url(&self.url)
            .message_body(message.body())
            .set_message_attributes(Some(copy.attributes));
        if self.url.ends_with(".fifo") {
            // The same delivery parked twice within five minutes is sent once.
            send = send
                .message_group_id(message.group_id().unwrap_or("sqs-once-parked"))
                .message_deduplication_id(message.id());
        }
        send.send()
            .await
            .map(|_| ())
            .map_err(|e| ParkError::Send(DisplayErrorContext(e).to_string()))
    }
}

/// The attributes of a parked copy, fitted to SQS's limits.
struct ParkedCopy {
    attributes: HashMap<String, MessageAttributeValue>,
}

impl ParkedCopy {
    fn new(
        message: &Message,
        reason: &str,
        dedup_key: Option<&str>,
        limit: usize,
    ) -> Result<Self, ParkError> {
        let ours = |name: &str| name.starts_with("sqs_once_");
        let original: Vec<(&String, &Attribute)> = message
            .attributes()
            .iter()
            .filter(|(name, _)| !ours(name))
            .collect();
        let mut bytes =
            message.body().len() + original.iter().map(|(name, a)| a.size(name)).sum::<usize>();
        if bytes > limit {
            return Err(ParkError::TooLarge { bytes, limit });
        }
        let mut attributes: HashMap<String, MessageAttributeValue> = original
            .iter()
            .map(|(name, a)| ((*name).clone(), sdk_attribute(a)))
            .collect();
        let first_id = message
            .attribute(MESSAGE_ID_ATTRIBUTE)
            .unwrap_or(message.id())
            .to_owned();
        let mut add = |name: &str, value: String, shorten: bool| {
            if attributes.len() >= MAX_ATTRIBUTES {
                return;
            }
            let overhead = name.len() + "String".len();
            let room = limit.saturating_sub(bytes + overhead);
            let value = match (value.len() <= room, shorten) {
                (true, _) => value,
                (false, true) if room >= MIN_REASON_BYTES => truncate(&value, room),
                _ => return,
            };
            bytes += overhead + value.len();
            attributes.insert(name.to_owned(), sdk_attribute(&Attribute::string(value)));
        };
        if let Some(key) = dedup_key {
            add(DEDUP_KEY_ATTRIBUTE, carry_key(message.body(), key), false);
        }
        add(REASON_ATTRIBUTE, truncate(reason, 4096), true);
        add(MESSAGE_ID_ATTRIBUTE, first_id, false);
        if dedup_key.is_some() && !attributes.contains_key(DEDUP_KEY_ATTRIBUTE) {
            error!(
                message_id = message.id(),
                "parked without its dedup key (no attribute slot or size left): with `message-id` or `dedup-id` keys a copy brought back is processed under a new key"
            );
        }
        Ok(Self { attributes })
    }
}

/// An attribute as the SDK sends it.
fn sdk_attribute(a: &Attribute) -> MessageAttributeValue {
    let b = MessageAttributeValue::builder().data_type(&a.data_type);
    match &a.value {
        AttributeValue::Text(t) => b.string_value(t),
        AttributeValue::Binary(bytes) => b.binary_value(Blob::new(bytes.clone())),
    }
    .build()
    .expect("data type is set")
}

/// Sets the visibility timeout of several messages of one queue at once
/// (`ChangeMessageVisibilityBatch`, 10 per call, by receipt handle): keeps
/// received messages that wait for their turn invisible. Failures are logged;
/// those messages return when their current visibility ends. True when every
/// one was extended.
pub(crate) async fn extend_many(
    sqs: &Client,
    queue_url: &str,
    receipts: &[String],
    timeout: Duration,
) -> bool {
    let mut all = true;
    let secs = visibility_secs(timeout);
    for chunk in receipts.chunks(BATCH) {
        let entries: Vec<_> = chunk
            .iter()
            .enumerate()
            .filter_map(|(i, receipt)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(format!("m{i}"))
                    .receipt_handle(receipt)
                    .visibility_timeout(secs)
                    .build()
                    .ok()
            })
            .collect();
        if entries.is_empty() {
            continue;
        }
        match sqs
            .change_message_visibility_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            Ok(out) => {
                for f in out.failed() {
                    all = false;
                    warn!(id = f.id(), code = f.code(), message = ?f.message(), "could not keep a waiting message invisible");
                }
            }
            Err(e) => {
                all = false;
                warn!(error = %DisplayErrorContext(e), "could not keep waiting messages invisible");
            }
        }
    }
    all
}

/// `s` cut to at most `max` bytes at a character boundary.
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
