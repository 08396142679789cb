//! Bringing messages back from a DLQ to their source queue through any
//! [`QueueClient`]: each is sent to the source with its body and attributes
//! (carrying the dedup key it was first processed under) and only then
//! deleted from the DLQ, so a failure in between leaves a copy in both queues,
//! never none. The simulator redrives its DLQ with it at the end of every
//! run; the operator tool's `redrive` adds SQS's message move task, batches
//! and a preview around the same rule.

use std::time::Duration;

use super::{
    MESSAGE_ID_ATTRIBUTE, OutgoingMessage, QueueClient, QueueError, REASON_ATTRIBUTE,
    ReceiveRequest,
};
use crate::Message;
use crate::key::{DEDUP_KEY_ATTRIBUTE, carry_key};
use crate::message::Attribute;

/// SQS's limit on message attributes per message.
const MAX_ATTRIBUTES: usize = 10;

/// What one redrive did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Redriven {
    /// Messages sent back and deleted from the DLQ.
    pub moved: u64,
    /// Message ids sent back without the carried dedup key (no room for it).
    pub without_key: Vec<String>,
    /// Message ids sent back whose delete from the DLQ failed: in both queues.
    pub in_both: Vec<String>,
}

/// The copy of DLQ message `m` to send to its source queue: its body and
/// attributes, plus the dedup key a `message-id` consumer gave it when it
/// does not carry one (the parked copy's first delivery id, or the DLQ
/// message's own id for a message SQS's redrive policy moved, which keeps its
/// id there); on a FIFO source its group, and a deduplication id from the DLQ
/// message id (a resend after a crash is deduplicated by SQS). `None` as the
/// second value when the key had no room (`max_bytes`, or 10 attributes).
pub fn copy_for_source(m: &Message, fifo: bool, max_bytes: usize) -> (OutgoingMessage, bool) {
    let mut attributes = m.attributes().clone();
    let mut carries = attributes.contains_key(DEDUP_KEY_ATTRIBUTE);
    if !carries {
        let parked = attributes.contains_key(REASON_ATTRIBUTE)
            || attributes.contains_key(MESSAGE_ID_ATTRIBUTE);
        let original = if parked {
            m.attribute(MESSAGE_ID_ATTRIBUTE).map(str::to_owned)
        } else {
            Some(m.id().to_owned())
        };
        if let Some(key) = original
            .filter(|k| !k.is_empty())
            .map(|k| carry_key(m.body(), &k))
        {
            let size: usize =
                m.body().len() + attributes.iter().map(|(n, a)| a.size(n)).sum::<usize>();
            let attribute = Attribute::string(key);
            if attributes.len() < MAX_ATTRIBUTES
                && size + attribute.size(DEDUP_KEY_ATTRIBUTE) <= max_bytes
            {
                attributes.insert(DEDUP_KEY_ATTRIBUTE.to_owned(), attribute);
                carries = true;
            }
        }
    }
    let copy = OutgoingMessage {
        body: m.body().to_owned(),
        attributes,
        group_id: if fifo {
            m.group_id().map(str::to_owned)
        } else {
            None
        },
        deduplication_id: fifo.then(|| format!("redrive-{}", m.id())),
    };
    (copy, carries)
}

/// Moves up to `limit` messages from `dlq_url` back to `source_url` (whose
/// `MaximumMessageSize` is `max_bytes`), one receive of up to ten at a time,
/// until a receive comes back empty or `limit` is reached.
pub async fn redrive<Q: QueueClient>(
    queue: &Q,
    dlq_url: &str,
    source_url: &str,
    max_bytes: usize,
    limit: u64,
) -> Result<Redriven, QueueError> {
    let fifo = source_url.ends_with(".fifo");
    let mut report = Redriven::default();
    // Counted as taken, moved or not: a message whose delete from the DLQ
    // fails is received again, and must not be sent again and again.
    let mut taken = 0u64;
    while taken < limit {
        let want = usize::try_from((limit - taken).min(10)).unwrap_or(10);
        let request = ReceiveRequest {
            max: want,
            wait: Duration::from_secs(1),
            visibility: Duration::from_secs(60),
        };
        let got = queue.receive(dlq_url, request).await?;
        if got.is_empty() {
            break;
        }
        taken += got.len() as u64;
        for m in got {
            let (copy, carries) = copy_for_source(&m, fifo, max_bytes);
            if !carries {
                report.without_key.push(m.id().to_owned());
            }
            queue.send(source_url, copy).await?;
            match queue
                .delete(dlq_url, m.receipt_handle().unwrap_or_default())
                .await
            {
                Ok(()) => report.moved += 1,
                Err(_) => report.in_both.push(m.id().to_owned()),
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_sqs_moved_carries_its_dlq_id_as_key_and_a_parked_copy_its_first_delivery_id() {
        let moved = Message::new("dlq-1", "{}").with_group_id("g");
        let (copy, carries) = copy_for_source(&moved, true, 262_144);
        assert!(carries);
        assert_eq!(
            copy.attributes.get(DEDUP_KEY_ATTRIBUTE),
            Some(&Attribute::string(carry_key("{}", "dlq-1")))
        );
        assert_eq!(copy.group_id.as_deref(), Some("g"));
        assert_eq!(copy.deduplication_id.as_deref(), Some("redrive-dlq-1"));
        let parked = Message::new("dlq-2", "{}")
            .with_attribute(REASON_ATTRIBUTE, "bad")
            .with_attribute(MESSAGE_ID_ATTRIBUTE, "first");
        let (copy, _) = copy_for_source(&parked, false, 262_144);
        assert_eq!(
            copy.attributes.get(DEDUP_KEY_ATTRIBUTE),
            Some(&Attribute::string(carry_key("{}", "first")))
        );
        assert_eq!(copy.group_id, None);
        // No room: sent as it is.
        let (copy, carries) = copy_for_source(&moved, false, 3);
        assert!(!carries);
        assert!(!copy.attributes.contains_key(DEDUP_KEY_ATTRIBUTE));
    }
}
