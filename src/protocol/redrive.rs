//! Bringing messages back from a DLQ to their source queue through any
//! [`QueueClient`] (only those parked from it, when the DLQ is shared): each
//! is sent to the source with its body and attributes
//! (carrying the dedup key it was first processed under) and only then
//! deleted from the DLQ, so a failure in between leaves a copy in both queues,
//! never none. The simulator redrives its DLQ with it at the end of every
//! run; the operator tool's `redrive` adds SQS's message move task, batches
//! and a preview around the same rule.

use std::time::Duration;

use crate::Message;
use crate::protocol::key::{
    CarrySecret, DEDUP_KEY_ATTRIBUTE, carried_key, carried_message_id, carry_key,
};
use crate::protocol::message::Attribute;
use crate::protocol::queue::{OutgoingMessage, QueueClient, QueueError, ReceiveRequest};

/// SQS's limit on message attributes per message.
const SQS_MAX_ATTRIBUTES: usize = 10;

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
/// attributes, with the dedup key a `message-id` consumer gave it sealed
/// under `secret` when it does not carry one that verifies (the parked copy's
/// first delivery id when that verifies, else the DLQ message's own id: the
/// original's for a message SQS's redrive policy moved, which keeps its id
/// there); an `sqs_once_dedup_key` that does not verify is replaced (or
/// dropped). A key or first id that verifies is sealed again under the
/// first secret, so a copy sealed under a secret being rotated out carries
/// one the next configuration still honours. On a FIFO source its group, and a deduplication id from the DLQ
/// message id (a resend after a crash is deduplicated by SQS). The second
/// value is false when the copy carries no key: no secret, or no room
/// (`max_bytes`, or 10 attributes).
pub(crate) fn copy_for_source(
    m: &Message,
    fifo: bool,
    max_bytes: usize,
    secret: Option<&CarrySecret>,
) -> (OutgoingMessage, bool) {
    let mut attributes = m.attributes().clone();
    let mut carries = carried_key(m, secret).is_some();
    if let Some(secret) = secret {
        // Sealed again under the first secret (same length: a rotation
        // never makes a copy too large).
        if let Some(key) = carried_key(m, Some(secret)) {
            let resealed = carry_key(secret, m.body(), key);
            attributes.insert(DEDUP_KEY_ATTRIBUTE.to_owned(), Attribute::string(resealed));
        }
        if let Some(first) = carried_message_id(m, Some(secret)) {
            let resealed = crate::protocol::key::carry_message_id(secret, m.body(), first);
            attributes.insert(
                crate::protocol::key::MESSAGE_ID_ATTRIBUTE.to_owned(),
                Attribute::string(resealed),
            );
        }
    }
    if let (false, Some(secret)) = (carries, secret) {
        attributes.remove(DEDUP_KEY_ATTRIBUTE);
        let original = carried_message_id(m, Some(secret)).unwrap_or(m.id());
        if !original.is_empty() {
            let key = carry_key(secret, m.body(), original);
            let size: usize =
                m.body().len() + attributes.iter().map(|(n, a)| a.size(n)).sum::<usize>();
            let attribute = Attribute::string(key);
            if attributes.len() < SQS_MAX_ATTRIBUTES
                && size + attribute.size(DEDUP_KEY_ATTRIBUTE) <= max_bytes
            {
                attributes.insert(DEDUP_KEY_ATTRIBUTE.to_owned(), attribute);
                carries = true;
            }
        }
    }
    if let Some(secret) = secret {
        carry_first_sender(m, &mut attributes, max_bytes, secret);
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
        ..OutgoingMessage::default()
    };
    (copy, carries)
}

/// Who sent `m` first, sealed under `secret` into `attributes`: the copy sent
/// back is SQS's from whoever redrives it, so a key scoped to the sender
/// would change. The sender a parked copy carries when it verifies (sealed
/// again under the first secret), else, for a message SQS's redrive policy
/// moved (no parking reason), its own `SenderId` (SQS keeps the producer's
/// through such a move), where there is room; a carried one that does not
/// verify is left as it is.
fn carry_first_sender(
    m: &Message,
    attributes: &mut std::collections::BTreeMap<String, Attribute>,
    max_bytes: usize,
    secret: &CarrySecret,
) {
    use crate::protocol::key::{SENDER_ATTRIBUTE, carried, carry_sender};
    let sender = match carried(m, SENDER_ATTRIBUTE, Some(secret)) {
        Some(first) => first,
        // One that does not verify under this secret may under the
        // consumers': left as it is.
        None if attributes.contains_key(SENDER_ATTRIBUTE) => return,
        // A copy a consumer parked is SQS's from that consumer: its own
        // SenderId is not the producer's.
        None if attributes.contains_key(crate::protocol::parking::REASON_ATTRIBUTE) => return,
        None => match m.sender_id() {
            Some(own) if !own.is_empty() => own,
            _ => return,
        },
    };
    let attribute = Attribute::string(carry_sender(secret, m.body(), sender));
    attributes.remove(SENDER_ATTRIBUTE);
    let size: usize = m.body().len() + attributes.iter().map(|(n, a)| a.size(n)).sum::<usize>();
    if attributes.len() < SQS_MAX_ATTRIBUTES && size + attribute.size(SENDER_ATTRIBUTE) <= max_bytes
    {
        attributes.insert(SENDER_ATTRIBUTE.to_owned(), attribute);
    }
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
    secret: Option<&CarrySecret>,
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
            let parked_from = m.attribute(crate::protocol::parking::SOURCE_QUEUE_ATTRIBUTE);
            if crate::protocol::parking::from_another_queue(parked_from, None, source_url) {
                // Another queue's copy in a shared DLQ: left for its redrive.
                let receipt = m.receipt_handle().unwrap_or_default();
                let _ = queue
                    .change_visibility(dlq_url, receipt, Duration::ZERO)
                    .await;
                continue;
            }
            let (copy, carries) = copy_for_source(&m, fifo, max_bytes, secret);
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
    use crate::protocol::key::{MESSAGE_ID_ATTRIBUTE, carry_message_id};
    use crate::protocol::parking::REASON_ATTRIBUTE;

    fn secret() -> CarrySecret {
        CarrySecret::new([7u8; 32]).unwrap()
    }

    fn key_of(copy: &OutgoingMessage) -> Option<&Attribute> {
        copy.attributes.get(DEDUP_KEY_ATTRIBUTE)
    }

    #[test]
    fn a_message_sqs_moved_carries_its_dlq_id_as_key_and_a_parked_copy_its_first_delivery_id() {
        let s = secret();
        let moved = Message::new("dlq-1", "{}").with_group_id("g");
        let (copy, carries) = copy_for_source(&moved, true, 262_144, Some(&s));
        assert!(carries);
        assert_eq!(
            key_of(&copy),
            Some(&Attribute::string(carry_key(&s, "{}", "dlq-1")))
        );
        assert_eq!(copy.group_id.as_deref(), Some("g"));
        assert_eq!(copy.deduplication_id.as_deref(), Some("redrive-dlq-1"));
        let parked = Message::new("dlq-2", "{}")
            .with_attribute(REASON_ATTRIBUTE, "bad")
            .with_attribute(MESSAGE_ID_ATTRIBUTE, carry_message_id(&s, "{}", "first"));
        let (copy, _) = copy_for_source(&parked, false, 262_144, Some(&s));
        assert_eq!(
            key_of(&copy),
            Some(&Attribute::string(carry_key(&s, "{}", "first")))
        );
        assert_eq!(copy.group_id, None);
        // No room: sent as it is.
        let (copy, carries) = copy_for_source(&moved, false, 3, Some(&s));
        assert!(!carries);
        assert!(!copy.attributes.contains_key(DEDUP_KEY_ATTRIBUTE));
        // No secret: nothing is sealed.
        let (copy, carries) = copy_for_source(&moved, false, 262_144, None);
        assert!(!carries);
        assert!(!copy.attributes.contains_key(DEDUP_KEY_ATTRIBUTE));
    }

    #[test]
    fn redrive_seals_a_carried_key_again_under_the_first_secret() {
        let rotating =
            CarrySecret::parse(&format!("{},{}", "n".repeat(32), "o".repeat(32))).unwrap();
        let only_old = CarrySecret::parse(&"o".repeat(32)).unwrap();
        let only_new = CarrySecret::parse(&"n".repeat(32)).unwrap();
        let parked = Message::new("dlq-3", "{}")
            .with_attribute(REASON_ATTRIBUTE, "bad")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, carry_key(&only_old, "{}", "k-1"))
            .with_attribute(
                MESSAGE_ID_ATTRIBUTE,
                carry_message_id(&only_old, "{}", "first"),
            );
        let (copy, carries) = copy_for_source(&parked, false, 262_144, Some(&rotating));
        assert!(carries);
        assert_eq!(
            key_of(&copy),
            Some(&Attribute::string(carry_key(&only_new, "{}", "k-1")))
        );
        assert_eq!(
            copy.attributes.get(MESSAGE_ID_ATTRIBUTE),
            Some(&Attribute::string(carry_message_id(
                &only_new, "{}", "first"
            )))
        );
    }

    #[test]
    fn a_producers_message_id_or_key_is_not_sealed_by_redrive() {
        let s = secret();
        // A producer's message that SQS's redrive policy moved, naming a
        // victim's id in both attributes: the copy is keyed by its own id.
        let forged = Message::new("own-id", "{}")
            .with_attribute(REASON_ATTRIBUTE, "x")
            .with_attribute(MESSAGE_ID_ATTRIBUTE, "victim")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, "44136fa355b3678a:victim");
        let (copy, carries) = copy_for_source(&forged, false, 262_144, Some(&s));
        assert!(carries);
        assert_eq!(
            key_of(&copy),
            Some(&Attribute::string(carry_key(&s, "{}", "own-id")))
        );
    }
}
