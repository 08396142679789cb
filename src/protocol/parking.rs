//! Parking: a permanent failure's copy, with its reason, in the DLQ.

use std::collections::BTreeMap;

use tracing::{error, warn};

use crate::Message;
pub use crate::protocol::key::MESSAGE_ID_ATTRIBUTE;
use crate::protocol::key::{
    CarrySecret, DEDUP_KEY_ATTRIBUTE, SENDER_ATTRIBUTE, carried_message_id, carry_key,
    carry_message_id, carry_sender, first_sender,
};
use crate::protocol::limits::{SQS_DEFAULT_MAX_MESSAGE_BYTES, SQS_MAX_ATTRIBUTES};
use crate::protocol::message::Attribute;
use crate::protocol::queue::{OutgoingMessage, QueueClient, QueueError, is_fifo};

/// The message attribute that carries a parked message's reason.
pub const REASON_ATTRIBUTE: &str = "sqs_once_reason";

/// The message attribute that names the queue a parked copy came from (its
/// name), so a redrive from a DLQ that several queues share moves back only
/// the copies of the queue it is given.
pub const SOURCE_QUEUE_ATTRIBUTE: &str = "sqs_once_source_queue";

/// Whether DLQ message attributes and system attributes say it came from a
/// queue other than the one named `source` (a name or URL): SQS's
/// `DeadLetterQueueSourceArn` (moved by a redrive policy: SQS's word, which
/// no producer sets, wins), else its [`SOURCE_QUEUE_ATTRIBUTE`] (parked by
/// sqs-once, which writes it over any a producer set). Neither: `false`.
pub fn from_another_queue(
    parked_from: Option<&str>,
    dead_letter_source_arn: Option<&str>,
    source: &str,
) -> bool {
    let name = crate::protocol::trace::queue_name;
    dead_letter_source_arn
        .or(parked_from)
        .is_some_and(|from| name(from) != name(source))
}

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
    Send(#[source] QueueError),
}

/// The DLQ where permanent failures are parked, with its size limit read once.
/// Both runtimes park through it.
#[derive(Debug)]
pub struct Dlq<Q> {
    queue: Q,
    url: String,
    max_bytes: tokio::sync::OnceCell<usize>,
}

impl<Q: QueueClient> Dlq<Q> {
    /// The DLQ at `url`.
    pub fn new(queue: Q, url: impl Into<String>) -> Self {
        Self {
            queue,
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
                let attributes = self.queue.attributes(&self.url).await?;
                attributes.max_message_bytes.ok_or_else(|| {
                    QueueError::new(
                        "GetQueueAttributes",
                        &self.url,
                        "no MaximumMessageSize in the answer",
                        false,
                    )
                })
            })
            .await;
        read.copied().unwrap_or_else(|e| {
            warn!(dlq = %self.url, error = %e, "cannot read the DLQ's MaximumMessageSize (grant sqs:GetQueueAttributes on the DLQ); assuming SQS's default");
            SQS_DEFAULT_MAX_MESSAGE_BYTES
        })
    }

    /// Sends a copy of the message to the DLQ: the body and every message
    /// attribute exactly as received (data types included; an
    /// `sqs_once_outbox_id` a second stage keys on among them), plus
    /// `sqs_once_dedup_key` (the key it was processed under, so a copy brought
    /// back is processed under the same key), `sqs_once_reason` (this park's
    /// reason, replacing an earlier one) and `sqs_once_message_id` (the first
    /// delivery's id), as far as SQS's attribute count and the DLQ's size limit
    /// allow; the reason is shortened to fit, the body is never altered. The
    /// key and the first id are sealed under `secret` (see [`CarrySecret`]);
    /// without one no key is carried and the id is this delivery's, unsealed
    /// (for people to read: nothing honours it), `sqs_once_sender` (who sent
    /// it first, sealed; with a secret only), and `sqs_once_source_queue`
    /// (the name of the queue it was received from, when known: a redrive
    /// from a shared DLQ moves it back only there). The caller deletes the
    /// original after this succeeds.
    pub async fn park(
        &self,
        message: &Message,
        reason: &str,
        dedup_key: Option<&str>,
        secret: Option<&CarrySecret>,
    ) -> Result<(), ParkError> {
        let copy = ParkedCopy::new(message, reason, dedup_key, secret, self.max_bytes().await)?;
        // On a FIFO DLQ the same delivery parked twice within five minutes
        // is delivered once.
        let fifo = is_fifo(&self.url);
        let outgoing = OutgoingMessage {
            body: message.body().to_owned(),
            attributes: copy.attributes,
            group_id: fifo.then(|| message.group_id().unwrap_or("sqs-once-parked").to_owned()),
            deduplication_id: fifo.then(|| message.id().to_owned()),
            ..OutgoingMessage::default()
        };
        self.queue
            .send(&self.url, outgoing)
            .await
            .map_err(ParkError::Send)
    }
}

/// The attributes of a parked copy, fitted to SQS's limits.
struct ParkedCopy {
    attributes: BTreeMap<String, Attribute>,
}

impl ParkedCopy {
    fn new(
        message: &Message,
        reason: &str,
        dedup_key: Option<&str>,
        secret: Option<&CarrySecret>,
        limit: usize,
    ) -> Result<Self, ParkError> {
        // Only what parking writes itself is replaced: a carried key that
        // verifies is sealed again below, one that does not is dropped. Any
        // other attribute, ours or not, stays, since a key source may read it
        // (`attribute:sqs_once_outbox_id` keys a second stage).
        let rewritten = |name: &str| {
            [
                DEDUP_KEY_ATTRIBUTE,
                REASON_ATTRIBUTE,
                MESSAGE_ID_ATTRIBUTE,
                SENDER_ATTRIBUTE,
                SOURCE_QUEUE_ATTRIBUTE,
            ]
            .contains(&name)
        };
        let original: Vec<(&String, &Attribute)> = message
            .attributes()
            .iter()
            .filter(|(name, _)| !rewritten(name))
            .collect();
        let mut bytes =
            message.body().len() + original.iter().map(|(name, a)| a.size(name)).sum::<usize>();
        if bytes > limit {
            return Err(ParkError::TooLarge { bytes, limit });
        }
        let mut attributes: BTreeMap<String, Attribute> = original
            .iter()
            .map(|(name, a)| ((*name).clone(), (*a).clone()))
            .collect();
        // A first id that does not verify (a producer's) is not kept.
        let first_id = carried_message_id(message, secret).unwrap_or(message.id());
        let first_id = match secret {
            Some(secret) => carry_message_id(secret, message.body(), first_id),
            None => first_id.to_owned(),
        };
        let mut add = |name: &str, value: String, shorten: bool| {
            if attributes.len() >= SQS_MAX_ATTRIBUTES {
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
            attributes.insert(name.to_owned(), Attribute::string(value));
        };
        let dedup_key = dedup_key.zip(secret);
        if let Some((key, secret)) = dedup_key {
            add(
                DEDUP_KEY_ATTRIBUTE,
                carry_key(secret, message.body(), key),
                false,
            );
        }
        // Who sent it first (a copy sent back is SQS's from whoever sends
        // it): before the reason, since a sender-scoped key needs it.
        let sender = secret.zip(first_sender(message, secret));
        if let Some((secret, sender)) = sender {
            add(
                SENDER_ATTRIBUTE,
                carry_sender(secret, message.body(), sender),
                false,
            );
        }
        add(REASON_ATTRIBUTE, truncate(reason, 4096), true);
        add(MESSAGE_ID_ATTRIBUTE, first_id, false);
        if let Some(queue) = message.queue() {
            let queue = crate::protocol::trace::queue_name(queue).to_owned();
            add(SOURCE_QUEUE_ATTRIBUTE, queue, false);
        }
        if sender.is_some() && !attributes.contains_key(SENDER_ATTRIBUTE) {
            error!(
                message_id = message.id(),
                "parked without its first sender (no attribute slot or size left): under a sender-scoped key a copy brought back is keyed under whoever sends it back"
            );
        }
        if dedup_key.is_some() && !attributes.contains_key(DEDUP_KEY_ATTRIBUTE) {
            error!(
                message_id = message.id(),
                "parked without its dedup key (no attribute slot or size left): with `message-id` or `dedup-id` keys a copy brought back is processed under a new key"
            );
        }
        Ok(Self { attributes })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with seven attributes of its own: the copy's three slots
    /// left go to the key, the first sender and the reason (the first id
    /// and the source queue give way), so a sender-scoped key survives.
    #[test]
    fn a_crowded_parked_copy_keeps_its_sealed_first_sender() {
        let secret = CarrySecret::new([5u8; 32]).unwrap();
        let mut message = Message::new("m-1", "{}").with_sender_id("AIDAALICE");
        for i in 0..7 {
            message = message.with_attribute(format!("a{i}"), "v");
        }
        let copy = ParkedCopy::new(&message, "bad", Some("k-1"), Some(&secret), 262_144).unwrap();
        assert_eq!(copy.attributes.len(), SQS_MAX_ATTRIBUTES);
        let sealed = match copy.attributes.get(SENDER_ATTRIBUTE).map(|a| &a.value) {
            Some(crate::protocol::message::AttributeValue::Text(t)) => t.clone(),
            other => panic!("no sealed sender: {other:?}"),
        };
        assert_eq!(
            secret.open(SENDER_ATTRIBUTE, "{}", &sealed),
            Some("AIDAALICE")
        );
        assert!(copy.attributes.contains_key(REASON_ATTRIBUTE));
    }

    #[test]
    fn a_parked_copy_keeps_every_attribute_but_the_ones_parking_writes() {
        let secret = CarrySecret::new([5u8; 32]).unwrap();
        let message = Message::new("m-1", "{}")
            .with_attribute(crate::protocol::outbox::OUTBOX_ID_ATTRIBUTE, "ob-1")
            .with_attribute("tenant", "t-1")
            .with_attribute(REASON_ATTRIBUTE, "an earlier reason")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, "forged:victim")
            .with_queue("https://sqs.us-east-1.amazonaws.com/123456789012/orders");
        let copy = ParkedCopy::new(&message, "bad", Some("k-1"), Some(&secret), 262_144).unwrap();
        let text = |name: &str| match copy.attributes.get(name).map(|a| &a.value) {
            Some(crate::protocol::message::AttributeValue::Text(t)) => Some(t.clone()),
            _ => None,
        };
        assert_eq!(
            text(crate::protocol::outbox::OUTBOX_ID_ATTRIBUTE).as_deref(),
            Some("ob-1"),
            "a second stage's key survives parking"
        );
        assert_eq!(text("tenant").as_deref(), Some("t-1"));
        assert_eq!(text(SOURCE_QUEUE_ATTRIBUTE).as_deref(), Some("orders"));
        assert_eq!(text(REASON_ATTRIBUTE).as_deref(), Some("bad"));
        assert_eq!(
            text(DEDUP_KEY_ATTRIBUTE),
            Some(carry_key(&secret, "{}", "k-1")),
            "the key is sealed again, the forged one dropped"
        );
    }

    #[test]
    fn a_copy_from_another_queue_is_told_by_its_attribute_or_by_sqs() {
        let orders = "https://sqs.us-east-1.amazonaws.com/1/orders";
        assert!(!from_another_queue(Some("orders"), None, orders));
        assert!(from_another_queue(Some("refunds"), None, orders));
        let arn = "arn:aws:sqs:us-east-1:1:refunds";
        assert!(from_another_queue(None, Some(arn), orders));
        assert!(!from_another_queue(None, Some(arn), "refunds"));
        assert!(!from_another_queue(None, None, orders), "unknown: moved");
        // A producer's attribute on a message SQS moved: SQS's word wins.
        let own = "arn:aws:sqs:us-east-1:1:orders";
        assert!(!from_another_queue(Some("refunds"), Some(own), orders));
    }
}
