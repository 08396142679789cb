//! The outbox: messages a handler sends, recorded with its effect and sent
//! only after that effect committed.
//!
//! A handler calls [`Context::send`](crate::Context::send) instead of an SQS
//! client. Nothing is sent while it runs: the messages are kept with the
//! context and written into the `COMPLETED` dedup record (attribute
//! `outbox`), in the same `TransactWriteItems` as the fast path's staged
//! writes, or in the claim path's completion. After the commit the
//! processor dispatches them (`SendMessageBatch`, ten at a time, per target
//! queue), marks the record dispatched (`REMOVE outbox`), and only then is
//! the incoming message deleted. A crash, a timeout or a lost answer between
//! the commit and the mark leaves `outbox` on the record: the redelivery (or
//! any later duplicate) finds the record `COMPLETED` with messages still to
//! send and sends them before it is let go. A message is therefore never
//! sent for an effect that did not commit, and sent at least once for one
//! that did.
//!
//! Each outgoing message carries a stable id, [`outbox_id`] (the incoming
//! record's key and the message's index), so that sending it twice is
//! harmless downstream:
//! - on every target, the message attribute [`OUTBOX_ID_ATTRIBUTE`] holds it
//!   (a consumer that is not sqs-once dedups on it; an sqs-once consumer can
//!   take it as its key with the key source `attribute:sqs_once_outbox_id`);
//! - with `SQS_ONCE_CARRY_SECRET` set, [`DEDUP_KEY_ATTRIBUTE`] holds it
//!   sealed, so an sqs-once consumer downstream that shares the secret and
//!   keys on the message id (the default) applies it once;
//! - on a FIFO target, the `MessageDeduplicationId` is its SHA-256, so SQS
//!   itself drops a second send within its five-minute window.
//!
//! See the project's `docs/DESIGN.md` ("The outbox").

use std::collections::BTreeMap;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::protocol::key::{CarrySecret, DEDUP_KEY_ATTRIBUTE, SEALED_ATTRIBUTES, sha256_hex};
use crate::protocol::limits::{
    SQS_BATCH, SQS_DEFAULT_MAX_MESSAGE_BYTES as SQS_MAX_MESSAGE_BYTES, SQS_MAX_ATTRIBUTES,
    SQS_MAX_BATCH_BYTES, SQS_MAX_DELAY,
};
use crate::protocol::message::Attribute;
use crate::protocol::pointer::{LEGACY_SIZE_ATTRIBUTE, POINTER_CLASS, S3Pointer, SIZE_ATTRIBUTE};
use crate::protocol::queue::{EntryFailure, OutgoingMessage, QueueClient, QueueError, is_fifo};

/// The message attribute every outgoing message carries with its
/// [`outbox_id`]: stable across sends, the id to dedup on downstream.
pub const OUTBOX_ID_ATTRIBUTE: &str = "sqs_once_outbox_id";

/// Attributes a handler may give an outgoing message: SQS's ten less the two
/// sqs-once adds ([`OUTBOX_ID_ATTRIBUTE`], [`DEDUP_KEY_ATTRIBUTE`]).
pub const MAX_USER_ATTRIBUTES: usize = SQS_MAX_ATTRIBUTES - 2;

/// The most outgoing messages one incoming message may send.
pub const MAX_OUTGOING: usize = 100;

/// The most bytes of outgoing messages one record may hold: what DynamoDB's
/// 400 KB item leaves beside the record's own attributes and its result.
pub const MAX_OUTBOX_BYTES: usize = 300 * 1024;

/// The longest extended-client pointer body: the class name, a bucket name
/// of 63 bytes and an S3 key of 1,024, in their JSON.
pub const MAX_POINTER_BODY_BYTES: usize = POINTER_CLASS.len() + 63 + 1024 + 48;

/// What the size attribute of an offloaded body adds: its name, `Number`,
/// and up to 20 digits.
const SIZE_ATTRIBUTE_BYTES: usize = SIZE_ATTRIBUTE.len() + "Number".len() + 20;

/// A message a handler sends: see [`Context::send`](crate::Context::send).
/// String attributes only; a FIFO target needs a message group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Outgoing {
    /// The target queue's URL.
    #[serde(rename = "q")]
    pub queue_url: String,
    /// The body.
    #[serde(rename = "b")]
    pub body: String,
    /// String message attributes.
    #[serde(rename = "a", default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The message group (required by FIFO targets, allowed on standard ones).
    #[serde(rename = "g", default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<String>,
    /// `DelaySeconds` (standard targets only, at most 15 minutes).
    #[serde(rename = "d", default, skip_serializing_if = "Option::is_none")]
    pub delay_secs: Option<u32>,
}

impl Outgoing {
    /// A message with `body` for the queue at `queue_url`.
    pub fn new(queue_url: impl Into<String>, body: impl Into<String>) -> Self {
        Self {
            queue_url: queue_url.into(),
            body: body.into(),
            attributes: BTreeMap::new(),
            group_id: None,
            delay_secs: None,
        }
    }

    /// With a string message attribute.
    pub fn attribute(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.attributes.insert(name.into(), value.into());
        self
    }

    /// In the message group `group_id` (required by a FIFO target).
    pub fn group(mut self, group_id: impl Into<String>) -> Self {
        self.group_id = Some(group_id.into());
        self
    }

    /// Hidden for `delay` after it is sent (standard targets; whole seconds,
    /// rounded up).
    pub fn delay(mut self, delay: Duration) -> Self {
        let secs = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
        self.delay_secs = Some(u32::try_from(secs).unwrap_or(u32::MAX));
        self
    }

    /// What SQS counts against its message size: the body and every
    /// attribute's name, type and value, with the two sqs-once adds for an
    /// id of `id_bytes` (the id, and the id sealed: 64 hex digits and a
    /// colon before it).
    pub fn size(&self, id_bytes: usize) -> usize {
        let ours = OUTBOX_ID_ATTRIBUTE.len()
            + DEDUP_KEY_ATTRIBUTE.len()
            + 2 * "String".len()
            + id_bytes
            + (65 + id_bytes);
        self.body.len()
            + ours
            + self
                .attributes
                .iter()
                .map(|(k, v)| k.len() + "String".len() + v.len())
                .sum::<usize>()
    }

    /// Checks what SQS would refuse, before anything is recorded, for a
    /// message whose [`outbox_id`] is at most `id_bytes` long.
    pub fn check(&self, id_bytes: usize) -> Result<(), OutboxError> {
        let fifo = is_fifo(&self.queue_url);
        if self.queue_url.trim().is_empty() {
            return Err(OutboxError::NoQueue);
        }
        if fifo && self.group_id.is_none() {
            return Err(OutboxError::FifoNeedsGroup(self.queue_url.clone()));
        }
        if fifo && self.delay_secs.is_some() {
            return Err(OutboxError::DelayOnFifo(self.queue_url.clone()));
        }
        if let Some(d) = self.delay_secs
            && u64::from(d) > SQS_MAX_DELAY.as_secs()
        {
            return Err(OutboxError::DelayTooLong(d));
        }
        if self.body.is_empty() {
            return Err(OutboxError::EmptyBody);
        }
        if let Some(c) = refused_char(&self.body) {
            return Err(OutboxError::Character {
                what: "body".into(),
                found: u32::from(c),
            });
        }
        if let Some(group) = &self.group_id
            && (group.is_empty()
                || group.len() > 128
                || !group.chars().all(|c| c.is_ascii_graphic()))
        {
            return Err(OutboxError::BadGroup(group.clone()));
        }
        for (name, value) in &self.attributes {
            if !attribute_name(name) {
                return Err(OutboxError::BadAttributeName(name.clone()));
            }
            if value.is_empty() {
                return Err(OutboxError::EmptyAttribute(name.clone()));
            }
            if let Some(c) = refused_char(value) {
                return Err(OutboxError::Character {
                    what: format!("attribute {name:?}"),
                    found: u32::from(c),
                });
            }
        }
        if self.attributes.len() > MAX_USER_ATTRIBUTES {
            return Err(OutboxError::TooManyAttributes(self.attributes.len()));
        }
        if let Some(name) = self.attributes.keys().find(|n| reserved(n)) {
            return Err(OutboxError::ReservedAttribute(name.clone()));
        }
        self.check_size(id_bytes, None)
    }

    /// [`Self::check`], where a body too large for SQS is stored in S3 (up
    /// to `offload_max` bytes) and a pointer sent instead: then what must
    /// fit in SQS is the message with the pointer as its body.
    pub(crate) fn check_offloading(
        &self,
        id_bytes: usize,
        offload_max: usize,
    ) -> Result<(), OutboxError> {
        self.check(id_bytes).or_else(|e| match e {
            OutboxError::TooLarge { .. } => self.check_size(id_bytes, Some(offload_max)),
            e => Err(e),
        })
    }

    fn check_size(&self, id_bytes: usize, offload_max: Option<usize>) -> Result<(), OutboxError> {
        let bytes = self.size(id_bytes);
        if bytes <= SQS_MAX_MESSAGE_BYTES {
            return Ok(());
        }
        let Some(max) = offload_max else {
            return Err(OutboxError::TooLarge { bytes });
        };
        if self.body.len() > max {
            return Err(OutboxError::TooLargeForS3 {
                bytes: self.body.len(),
                max,
            });
        }
        // Offloading adds the size attribute: with the two sqs-once adds,
        // SQS's ten must still hold it (refused after the commit otherwise).
        if self.attributes.len() + 1 > MAX_USER_ATTRIBUTES {
            return Err(OutboxError::TooManyAttributes(self.attributes.len() + 1));
        }
        let as_pointer = bytes - self.body.len() + MAX_POINTER_BODY_BYTES + SIZE_ATTRIBUTE_BYTES;
        if as_pointer > SQS_MAX_MESSAGE_BYTES {
            return Err(OutboxError::TooLarge { bytes: as_pointer });
        }
        Ok(())
    }

    /// Whether the message is too large for SQS as it is (its body goes
    /// through S3 when large payloads are sent that way).
    pub(crate) fn needs_offload(&self, id_bytes: usize) -> bool {
        self.size(id_bytes) > SQS_MAX_MESSAGE_BYTES
    }

    /// The message with an extended client's pointer to `pointer` as its
    /// body, and the payload's size in [`SIZE_ATTRIBUTE`] (`Number`).
    pub(crate) fn offloaded(mut self, pointer: &S3Pointer) -> Self {
        let size = self.body.len();
        self.body = pointer.to_body();
        self.attributes
            .insert(SIZE_ATTRIBUTE.to_owned(), size.to_string());
        self
    }

    /// The message as sent: the attributes with its [`outbox_id`] (sealed
    /// as the carried key too, under `secret`), and on a FIFO target the id's
    /// SHA-256 as the deduplication id.
    pub fn to_send(&self, id: &str, secret: Option<&CarrySecret>) -> OutgoingMessage {
        let mut attributes: BTreeMap<String, Attribute> = self
            .attributes
            .iter()
            .map(|(k, v)| {
                let attribute = if k == SIZE_ATTRIBUTE {
                    Attribute::typed("Number", Some(v.clone()), None).expect("a text value")
                } else {
                    Attribute::string(v)
                };
                (k.clone(), attribute)
            })
            .collect();
        attributes.insert(OUTBOX_ID_ATTRIBUTE.to_owned(), Attribute::string(id));
        if let Some(secret) = secret {
            let sealed = crate::protocol::key::carry_key(secret, &self.body, id);
            attributes.insert(DEDUP_KEY_ATTRIBUTE.to_owned(), Attribute::string(sealed));
        }
        OutgoingMessage {
            body: self.body.clone(),
            attributes,
            group_id: self.group_id.clone(),
            deduplication_id: is_fifo(&self.queue_url).then(|| sha256_hex(id.as_bytes())),
            delay: self.delay_secs.map(|d| Duration::from_secs(u64::from(d))),
            trace_header: None,
        }
    }
}

/// The first character of `s` SQS refuses, if any. A byte pass first
/// (bodies run to megabytes when offloaded): only a control byte or `0xEF`,
/// the lead byte of U+F000 to U+FFFF, can begin a refused character (a
/// `str` holds no surrogates), and the pass is over chunks without an early
/// exit so that it vectorises; a chunk with one is read a character at a
/// time.
fn refused_char(s: &str) -> Option<char> {
    const CHUNK: usize = 64;
    let suspect = |b: u8| (b < 0x20 && !matches!(b, b'\t' | b'\n' | b'\r')) || b == 0xEF;
    let first = s
        .as_bytes()
        .chunks(CHUNK)
        .position(|chunk| chunk.iter().fold(false, |any, &b| any | suspect(b)))?;
    // Back to the start of the character the chunk begins inside.
    let mut from = first * CHUNK;
    while !s.is_char_boundary(from) {
        from -= 1;
    }
    s[from..].chars().find(|c| !sqs_char(*c))
}

/// A character SQS takes in a body or attribute value (#x9, #xA, #xD,
/// #x20 to #xD7FF, #xE000 to #xFFFD, #x10000 to #x10FFFF).
fn sqs_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
}

/// An attribute name SQS takes: up to 256 of `A-Za-z0-9_-.`, no leading,
/// trailing or doubled period.
fn attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
}

/// Whether SQS or sqs-once reserves the attribute name.
fn reserved(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.starts_with("aws.")
        || lower.starts_with("amazon.")
        || name == OUTBOX_ID_ATTRIBUTE
        || name == SIZE_ATTRIBUTE
        || name == LEGACY_SIZE_ATTRIBUTE
        || SEALED_ATTRIBUTES.contains(&name)
        || name == crate::protocol::parking::REASON_ATTRIBUTE
        || name == crate::protocol::parking::SOURCE_QUEUE_ATTRIBUTE
}

/// The stable id of the `index`th message sent for the record `pk`.
pub fn outbox_id(pk: &str, index: usize) -> String {
    format!("{pk}#out-{index}")
}

/// The longest [`outbox_id`] of a record of `consumer` for `dedup_key`
/// (plain or hashed, as `SQS_ONCE_HASH_KEYS` says), or of a keyless message
/// processed unprotected (`None`).
pub(crate) fn max_id_bytes(consumer: &str, dedup_key: Option<&str>) -> usize {
    let pk = match dedup_key {
        Some(key) => crate::protocol::key::record_key(consumer, key)
            .len()
            .max(crate::protocol::key::hashed_record_key(consumer, key).len()),
        // `{consumer}#unprotected#{message id}`: SQS message ids are 100
        // characters at most.
        None => consumer.len() + "#unprotected#".len() + 100,
    };
    pk + "#out-".len() + MAX_OUTGOING.to_string().len()
}

/// An outgoing message refused before anything was recorded: a permanent
/// failure of the incoming message (the same handler would send the same).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// No queue URL.
    #[error("an outgoing message has no queue URL")]
    NoQueue,
    /// An empty body (SQS takes at least one character).
    #[error("an outgoing message has an empty body")]
    EmptyBody,
    /// An attribute without a value (SQS takes none empty).
    #[error("an outgoing message's attribute {0:?} is empty; SQS takes no empty attribute value")]
    EmptyAttribute(String),
    /// A character SQS refuses.
    #[error("an outgoing message's {what} has the character U+{found:04X}, which SQS refuses")]
    Character {
        /// Where.
        what: String,
        /// The character's code point.
        found: u32,
    },
    /// A message group SQS refuses.
    #[error(
        "an outgoing message's group {0:?} is not 1 to 128 printable ASCII characters, as SQS takes"
    )]
    BadGroup(String),
    /// An attribute name SQS refuses.
    #[error(
        "an outgoing message's attribute name {0:?} is not up to 256 of A-Z a-z 0-9 _ - . (no leading, trailing or doubled period)"
    )]
    BadAttributeName(String),
    /// A FIFO target without a message group.
    #[error("an outgoing message to the FIFO queue {0} has no message group (Outgoing::group)")]
    FifoNeedsGroup(String),
    /// A delay on a FIFO target.
    #[error(
        "an outgoing message to the FIFO queue {0} has a delay; FIFO queues take none per message"
    )]
    DelayOnFifo(String),
    /// A delay above SQS's 15 minutes.
    #[error("an outgoing message's delay of {0} s is above SQS's 900")]
    DelayTooLong(u32),
    /// More attributes than SQS allows with the two sqs-once adds.
    #[error(
        "an outgoing message has {0} attributes; at most {MAX_USER_ATTRIBUTES} (SQS takes {SQS_MAX_ATTRIBUTES}, sqs-once adds two)"
    )]
    TooManyAttributes(usize),
    /// An attribute name SQS or sqs-once reserves.
    #[error("an outgoing message's attribute {0:?} is reserved (by SQS or sqs-once)")]
    ReservedAttribute(String),
    /// Over SQS's message size.
    #[error(
        "an outgoing message is ~{bytes} bytes with its attributes; SQS takes at most {SQS_MAX_MESSAGE_BYTES} (larger bodies go through S3 with `SQS_ONCE_OUTBOX_PAYLOAD_BUCKET`)"
    )]
    TooLarge {
        /// Its size as SQS counts it (with the ids sqs-once adds).
        bytes: usize,
    },
    /// A body too large for SQS and above the largest stored in S3.
    #[error(
        "an outgoing message's body is {bytes} bytes; bodies sent through S3 may be at most {max} (SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES)"
    )]
    TooLargeForS3 {
        /// The body's size.
        bytes: usize,
        /// The largest body stored in S3.
        max: usize,
    },
    /// More messages, or more bytes, than one record holds.
    #[error(
        "the handler sent {count} messages / ~{bytes} bytes; one incoming message may send at most {MAX_OUTGOING} and {MAX_OUTBOX_BYTES} bytes (they are recorded in its dedup record, a DynamoDB item)"
    )]
    OutboxFull {
        /// Messages sent.
        count: usize,
        /// Their bytes.
        bytes: usize,
    },
    /// Sent after the handler returned (from a task it left running).
    #[error(
        "a message was sent after the handler returned; its effect was already being recorded without it (send before returning)"
    )]
    AfterReturn,
    /// The processor has nowhere to send.
    #[error(
        "the handler sent a message but this processor has no dispatcher (Processor::with_dispatcher; the runtimes set their SQS client)"
    )]
    NoDispatcher,
}

/// Where recorded messages are sent: SQS (every [`QueueClient`] is one).
pub trait Dispatcher: Send + Sync + 'static {
    /// Sends up to [`SQS_BATCH`] messages to `queue`: the entries that failed.
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<OutgoingMessage>,
    ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>>;
}

impl<Q: QueueClient> Dispatcher for Q {
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<OutgoingMessage>,
    ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>> {
        Box::pin(QueueClient::send_batch(self, queue, messages))
    }
}

/// Why a dispatch did not send everything.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// A whole call failed.
    #[error("sending the outbox failed: {0}")]
    Call(#[from] QueueError),
    /// Some entries failed.
    #[error("sending the outbox: {failed} of {sent} messages to {queue} failed (first: {code})")]
    Entries {
        /// The target.
        queue: String,
        /// Entries that failed.
        failed: usize,
        /// Entries in all.
        sent: usize,
        /// The first failure's code.
        code: String,
        /// Whether SQS refused one as invalid (the sender's fault: no
        /// retry sends it; see [`refused`]).
        refused: bool,
    },
}

impl DispatchError {
    /// Whether SQS refused a message as invalid (a target whose
    /// `MaximumMessageSize` is below the message, say): sending again will
    /// not help until the target changes.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            Self::Call(e) => !e.is_transient(),
            Self::Entries { refused, .. } => *refused,
        }
    }
}

/// Whether a batch entry's error code says SQS refused the message itself
/// (not throttling or an outage).
pub fn refused(code: &str) -> bool {
    !crate::protocol::queue::transient_code(code)
}

/// `messages` in batches of at most [`SQS_BATCH`] entries and
/// [`SQS_MAX_BATCH_BYTES`] (a message alone over it goes alone), in order.
fn batches(messages: Vec<OutgoingMessage>) -> Vec<Vec<OutgoingMessage>> {
    let size = |m: &OutgoingMessage| {
        m.body.len()
            + m.attributes
                .iter()
                .map(|(k, a)| {
                    k.len()
                        + a.data_type.len()
                        + match &a.value {
                            crate::protocol::message::AttributeValue::Text(t) => t.len(),
                            crate::protocol::message::AttributeValue::Binary(b) => b.len(),
                        }
                })
                .sum::<usize>()
    };
    let mut out: Vec<Vec<OutgoingMessage>> = Vec::new();
    let mut bytes = 0;
    for m in messages {
        let n = size(&m);
        match out.last_mut() {
            Some(last) if last.len() < SQS_BATCH && bytes + n <= SQS_MAX_BATCH_BYTES => {
                bytes += n;
                last.push(m);
            }
            _ => {
                bytes = n;
                out.push(vec![m]);
            }
        }
    }
    out
}

/// Sends every message recorded for `pk`, batched by target (at most
/// [`SQS_BATCH`] per call, in their order): all sent, or the first failure.
/// Sending again is harmless: each carries its stable [`outbox_id`]. Entries
/// that failed inside SQS while the call succeeded (`InternalError`,
/// throttling: not a refusal) are sent again at once, up to
/// [`ENTRY_RETRIES`] times: SQS fails single entries now and then, and
/// each failure left to the message's redelivery spends a receive (on a
/// FIFO queue, of every message held behind it in its group).
pub async fn dispatch(
    dispatcher: &dyn Dispatcher,
    pk: &str,
    outbox: &[Outgoing],
    secret: Option<&CarrySecret>,
) -> Result<(), DispatchError> {
    dispatch_as(dispatcher, &|i| outbox_id(pk, i), outbox, secret).await
}

/// [`dispatch`], each message's id `id_of` its place.
pub(crate) async fn dispatch_as(
    dispatcher: &dyn Dispatcher,
    id_of: &(dyn Fn(usize) -> String + Sync),
    outbox: &[Outgoing],
    secret: Option<&CarrySecret>,
) -> Result<(), DispatchError> {
    let message = |i: usize| outbox[i].to_send(&id_of(i), secret);
    // Each target with its messages' places in the outbox, in order.
    let mut by_queue: Vec<(&str, Vec<usize>)> = Vec::new();
    for (i, out) in outbox.iter().enumerate() {
        match by_queue.iter_mut().find(|(q, _)| *q == out.queue_url) {
            Some((_, places)) => places.push(i),
            None => by_queue.push((&out.queue_url, vec![i])),
        }
    }
    for (queue, places) in by_queue {
        let mut next = 0;
        for chunk in batches(places.iter().map(|&i| message(i)).collect()) {
            let chunk_places = &places[next..next + chunk.len()];
            next += chunk.len();
            send_chunk(dispatcher, queue, chunk, chunk_places, &message).await?;
        }
    }
    Ok(())
}

/// Times [`dispatch`] sends again the entries of a batch that failed
/// inside SQS, or a batch whose whole call failed for a cause that passes
/// (a timeout, throttling, SQS out of reach).
pub const ENTRY_RETRIES: u32 = 2;

/// The pause before a batch whose whole call failed is sent again, doubled
/// for the next try: short, so that the incoming message's delete, on its
/// last allowed receive, is not held back (its visibility is kept at the
/// heartbeat meanwhile, its effect committed).
pub const CALL_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Sends one batch (`places`: its messages' places in the outbox, for
/// `message` to build them again), then its entries that failed inside
/// SQS, up to [`ENTRY_RETRIES`] times; a whole call that failed for a cause
/// that passes is sent again the same way, after [`CALL_RETRY_PAUSE`]
/// (simulator seed 241664: a timed-out call on a message's last allowed
/// receive, left to its redelivery, sent it, effect committed, to the DLQ).
async fn send_chunk(
    dispatcher: &dyn Dispatcher,
    queue: &str,
    mut chunk: Vec<OutgoingMessage>,
    places: &[usize],
    message: &(dyn Fn(usize) -> OutgoingMessage + Sync),
) -> Result<(), DispatchError> {
    let mut places = places.to_vec();
    let mut attempt = 0;
    loop {
        let sent = chunk.len();
        let failed = match dispatcher.send_batch(queue, chunk).await {
            Ok(failed) => failed,
            Err(e) if e.is_transient() && attempt < ENTRY_RETRIES => {
                tracing::debug!(queue, error = %e, "sending the outbox failed; sending it again");
                tokio::time::sleep(CALL_RETRY_PAUSE * 2u32.pow(attempt)).await;
                chunk = places.iter().map(|&i| message(i)).collect();
                attempt += 1;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let Some(first) = failed.first() else {
            return Ok(());
        };
        let refused = failed.iter().any(|f| refused(&f.code));
        if refused || attempt == ENTRY_RETRIES {
            return Err(DispatchError::Entries {
                queue: queue.to_owned(),
                failed: failed.len(),
                sent,
                code: first.code.clone(),
                refused,
            });
        }
        tracing::debug!(
            queue,
            failed = failed.len(),
            code = %first.code,
            "outbox entries failed inside SQS; sending them again"
        );
        // In their order in the outbox (SQS lists failures in any order).
        let mut again: Vec<usize> = failed.iter().map(|f| f.index).collect();
        again.sort_unstable();
        again.dedup();
        places = again
            .into_iter()
            .filter_map(|i| places.get(i).copied())
            .collect();
        chunk = places.iter().map(|&i| message(i)).collect();
        attempt += 1;
    }
}

/// Checks a handler's outbox as a whole against what one record holds.
pub(crate) fn check_outbox(outbox: &[Outgoing]) -> Result<(), OutboxError> {
    let bytes = outbox_bytes(outbox);
    if outbox.len() > MAX_OUTGOING || bytes > MAX_OUTBOX_BYTES {
        return Err(OutboxError::OutboxFull {
            count: outbox.len(),
            bytes,
        });
    }
    Ok(())
}

/// The outbox as stored in the record (JSON text).
pub(crate) fn to_stored(outbox: &[Outgoing]) -> String {
    serde_json::to_string(outbox).expect("outgoing messages serialize")
}

/// The outbox read back from the record.
pub(crate) fn from_stored(text: &str) -> Result<Vec<Outgoing>, serde_json::Error> {
    serde_json::from_str(text)
}

/// The bytes the outbox takes in the record.
pub(crate) fn outbox_bytes(outbox: &[Outgoing]) -> usize {
    if outbox.is_empty() {
        0
    } else {
        to_stored(outbox).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_throttled_or_failed_inside_sqs_is_not_a_refusal() {
        for code in [
            "InternalError",
            "InternalFailure",
            "ServiceUnavailable",
            "ThrottlingException",
            "RequestThrottled",
            "KmsThrottled",
            "KMS.ThrottlingException",
            "AWS.SimpleQueueService.InternalError",
        ] {
            assert!(!refused(code), "{code}");
        }
        for code in [
            "InvalidParameterValue",
            "InvalidMessageContents",
            "KMS.AccessDeniedException",
            "KMS.DisabledException",
            "AWS.SimpleQueueService.NonExistentQueue",
        ] {
            assert!(refused(code), "{code}");
        }
    }

    #[test]
    fn the_byte_pass_finds_the_character_a_scan_of_every_character_finds() {
        let scan = |s: &str| s.chars().find(|c| !sqs_char(*c));
        let long = "a".repeat(200);
        for s in [
            String::new(),
            "plain".into(),
            format!("{long}\u{1}"),
            format!("{long}\u{F000}{long}"),
            format!("{long}\u{F000}{long}\u{FFFE}"),
            format!("{}\u{FFFF}", "é".repeat(100)),
            format!("{long}\t\n\r\u{7F}\u{FFFD}\u{10FFFF}"),
            format!("{}\u{1F}{long}", "€".repeat(30)),
        ] {
            assert_eq!(refused_char(&s), scan(&s), "{s:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn the_byte_pass_agrees_with_the_character_scan(
            parts in proptest::collection::vec(
                proptest::prop_oneof![
                    ".{0,80}",
                    proptest::strategy::Just("\u{FFFE}".to_owned()),
                    proptest::strategy::Just("\u{FFFF}".to_owned()),
                    proptest::strategy::Just("\u{F8FF}".to_owned()),
                    proptest::strategy::Just("\u{0}".to_owned()),
                ],
                0..8,
            )
        ) {
            let s = parts.concat();
            proptest::prop_assert_eq!(refused_char(&s), s.chars().find(|c| !sqs_char(*c)));
        }
    }

    #[test]
    fn a_fifo_target_needs_a_group_and_takes_no_delay() {
        let fifo = "https://sqs.eu-west-1.amazonaws.com/1/next.fifo";
        assert_eq!(
            Outgoing::new(fifo, "x").check(64),
            Err(OutboxError::FifoNeedsGroup(fifo.into()))
        );
        assert_eq!(Outgoing::new(fifo, "x").group("g").check(64), Ok(()));
        assert_eq!(
            Outgoing::new(fifo, "x")
                .group("g")
                .delay(Duration::from_secs(1))
                .check(64),
            Err(OutboxError::DelayOnFifo(fifo.into()))
        );
    }

    #[test]
    fn limits_are_checked_before_anything_is_recorded() {
        let q = "https://sqs.eu-west-1.amazonaws.com/1/next";
        let big = Outgoing::new(q, "x".repeat(SQS_MAX_MESSAGE_BYTES));
        assert!(matches!(big.check(64), Err(OutboxError::TooLarge { .. })));
        let mut many = Outgoing::new(q, "x");
        for i in 0..=MAX_USER_ATTRIBUTES {
            many = many.attribute(format!("a{i}"), "v");
        }
        assert!(matches!(
            many.check(64),
            Err(OutboxError::TooManyAttributes(_))
        ));
        let forged = Outgoing::new(q, "x").attribute(DEDUP_KEY_ATTRIBUTE, "k");
        assert!(matches!(
            forged.check(64),
            Err(OutboxError::ReservedAttribute(_))
        ));
        assert_eq!(Outgoing::new(q, "").check(64), Err(OutboxError::EmptyBody));
        assert_eq!(
            Outgoing::new(q, "x").attribute("note", "").check(64),
            Err(OutboxError::EmptyAttribute("note".into()))
        );
        assert!(matches!(
            Outgoing::new(q, "a\u{0}b").check(64),
            Err(OutboxError::Character { found: 0, .. })
        ));
        assert!(matches!(
            Outgoing::new(q, "x").attribute("bad name", "v").check(64),
            Err(OutboxError::BadAttributeName(_))
        ));
        assert!(matches!(
            Outgoing::new(q, "x").group("g".repeat(129)).check(64),
            Err(OutboxError::BadGroup(_))
        ));
        assert_eq!(
            Outgoing::new(q, "naïve \u{1F600}")
                .attribute("k.v-1_x", "é")
                .check(64),
            Ok(())
        );
        let late = Outgoing::new(q, "x").delay(Duration::from_secs(901));
        assert_eq!(late.check(64), Err(OutboxError::DelayTooLong(901)));
        let full = vec![Outgoing::new(q, "x".repeat(4000)); 90];
        assert!(matches!(
            check_outbox(&full),
            Err(OutboxError::OutboxFull { .. })
        ));
    }

    #[test]
    fn the_ids_sqs_once_adds_count_against_the_message_size() {
        let q = "https://sqs.eu-west-1.amazonaws.com/1/next";
        let long_key = "k".repeat(1000);
        let long = max_id_bytes("orders", Some(&long_key));
        let short = max_id_bytes("orders", Some("k"));
        let body = "x".repeat(SQS_MAX_MESSAGE_BYTES - 1500);
        assert_eq!(Outgoing::new(q, body.clone()).check(short), Ok(()));
        assert!(matches!(
            Outgoing::new(q, body).check(long),
            Err(OutboxError::TooLarge { .. })
        ));
        // What is sent is within what was counted.
        let secret = CarrySecret::new("s".repeat(32)).unwrap();
        let out = Outgoing::new(q, "b").attribute("kind", "paid");
        let pk = crate::protocol::key::record_key("orders", &long_key);
        let sent = out.to_send(&outbox_id(&pk, MAX_OUTGOING - 1), Some(&secret));
        let actual = sent.body.len()
            + sent
                .attributes
                .iter()
                .map(|(name, a)| {
                    let crate::protocol::message::AttributeValue::Text(v) = &a.value else {
                        panic!("string attributes");
                    };
                    name.len() + a.data_type.len() + v.len()
                })
                .sum::<usize>();
        assert!(actual <= out.size(long), "{actual} > {}", out.size(long));
    }

    #[test]
    fn batches_hold_ten_messages_and_256_kib_at_most_in_order() {
        let m = |n: usize| Outgoing::new("q", "x".repeat(n)).to_send("id", None);
        let sizes =
            |b: &Vec<Vec<OutgoingMessage>>| -> Vec<usize> { b.iter().map(Vec::len).collect() };
        assert_eq!(
            sizes(&batches((0..25).map(|_| m(10)).collect())),
            [10, 10, 5]
        );
        let big = batches((0..4).map(|_| m(100 * 1024)).collect());
        assert_eq!(sizes(&big), [2, 2]);
        let order: Vec<usize> = batches((1..=12).map(m).collect())
            .concat()
            .iter()
            .map(|m| m.body.len())
            .collect();
        assert_eq!(order, (1..=12).collect::<Vec<_>>());
    }

    #[test]
    fn the_stored_form_reads_back() {
        let q = "https://sqs.eu-west-1.amazonaws.com/1/next.fifo";
        let outbox = vec![
            Outgoing::new(q, "{\"paid\":1}")
                .group("o-1")
                .attribute("kind", "paid"),
            Outgoing::new("https://sqs/1/audit", "a").delay(Duration::from_millis(1500)),
        ];
        let back = from_stored(&to_stored(&outbox)).unwrap();
        assert_eq!(back, outbox);
        assert_eq!(back[1].delay_secs, Some(2), "rounded up");
    }

    #[test]
    fn each_message_carries_a_stable_id_and_fifo_targets_a_dedup_id() {
        let out = Outgoing::new("https://sqs/1/next.fifo", "b").group("g");
        let id = outbox_id("orders#o-1", 0);
        let sent = out.to_send(&id, None);
        assert_eq!(
            sent.attributes.get(OUTBOX_ID_ATTRIBUTE),
            Some(&Attribute::string(&id))
        );
        assert_eq!(sent.deduplication_id, Some(sha256_hex(id.as_bytes())));
        assert!(!sent.attributes.contains_key(DEDUP_KEY_ATTRIBUTE));
        let secret = CarrySecret::new("s".repeat(32)).unwrap();
        let sealed = out.to_send(&id, Some(&secret));
        let carried = sealed.attributes.get(DEDUP_KEY_ATTRIBUTE).unwrap();
        let crate::protocol::message::AttributeValue::Text(text) = &carried.value else {
            panic!("a string attribute");
        };
        assert_eq!(
            secret.open(DEDUP_KEY_ATTRIBUTE, "b", text),
            Some(id.as_str())
        );
        let standard = Outgoing::new("https://sqs/1/next", "b").to_send(&id, None);
        assert_eq!(standard.deduplication_id, None);
    }

    /// A target that answers each `SendMessageBatch` with the entry
    /// failures scripted for it (none once the script runs out), noting
    /// the outbox ids of every call's entries.
    #[derive(Default)]
    struct Scripted {
        answers: std::sync::Mutex<std::collections::VecDeque<Vec<(usize, &'static str)>>>,
        /// Per call, in order: fail the whole call (transient or not).
        call_errors: std::sync::Mutex<std::collections::VecDeque<Option<bool>>>,
        calls: std::sync::Mutex<Vec<Vec<String>>>,
    }

    impl Dispatcher for Scripted {
        fn send_batch<'a>(
            &'a self,
            _: &'a str,
            messages: Vec<OutgoingMessage>,
        ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>> {
            let ids = messages
                .iter()
                .map(|m| match &m.attributes[OUTBOX_ID_ATTRIBUTE].value {
                    crate::protocol::message::AttributeValue::Text(t) => t.clone(),
                    crate::protocol::message::AttributeValue::Binary(_) => String::new(),
                })
                .collect();
            self.calls.lock().unwrap().push(ids);
            if let Some(Some(transient)) = self.call_errors.lock().unwrap().pop_front() {
                let e = QueueError::new("SendMessageBatch", "next", "timed out", transient);
                return Box::pin(async move { Err(e) });
            }
            let answer = self.answers.lock().unwrap().pop_front().unwrap_or_default();
            Box::pin(async move {
                Ok(answer
                    .into_iter()
                    .map(|(index, code)| EntryFailure {
                        index,
                        code: code.into(),
                        message: None,
                    })
                    .collect())
            })
        }
    }

    /// Simulator seed 197438: outbox entries that failed inside SQS
    /// (`InternalError`) were left to the message's redelivery, which on a
    /// FIFO queue with a low `maxReceiveCount` spent the receives of the
    /// group's messages held behind it until they reached the DLQ. Such
    /// entries are now sent again at once (with their own outbox ids); a
    /// refusal is not, and entries that keep failing are reported after
    /// [`ENTRY_RETRIES`] more tries.
    #[tokio::test]
    async fn entries_that_fail_inside_sqs_are_sent_again_and_refusals_are_not() {
        let q = "https://sqs.eu-west-1.amazonaws.com/1/next";
        let outbox: Vec<Outgoing> = ["a", "b", "c"].map(|b| Outgoing::new(q, b)).to_vec();
        let ids = |places: &[usize]| -> Vec<String> {
            places.iter().map(|&i| outbox_id("pk", i)).collect()
        };
        let scripted = |answers: Vec<Vec<(usize, &'static str)>>| Scripted {
            answers: std::sync::Mutex::new(answers.into()),
            ..Scripted::default()
        };

        let target = scripted(vec![vec![(1, "InternalError")]]);
        dispatch(&target, "pk", &outbox, None).await.unwrap();
        assert_eq!(*target.calls.lock().unwrap(), [ids(&[0, 1, 2]), ids(&[1])]);

        let target = scripted(vec![vec![(0, "InvalidParameterValue")]]);
        let e = dispatch(&target, "pk", &outbox, None).await.unwrap_err();
        assert!(e.is_refusal(), "{e}");
        assert_eq!(target.calls.lock().unwrap().len(), 1);

        let always = vec![
            vec![(2, "InternalError")],
            vec![(0, "InternalError")],
            vec![(0, "InternalError")],
        ];
        let target = scripted(always);
        let e = dispatch(&target, "pk", &outbox, None).await.unwrap_err();
        assert!(!e.is_refusal(), "{e}");
        assert_eq!(
            *target.calls.lock().unwrap(),
            [ids(&[0, 1, 2]), ids(&[2]), ids(&[2])]
        );
    }

    /// Simulator seed 241664: a `SendMessageBatch` that timed out, on the
    /// last allowed receive of the message whose effect was committed, made
    /// the outcome a retry, and SQS's redrive policy moved the message to
    /// the DLQ. A whole call that failed for a cause that passes is now
    /// sent again (after 200 ms, then 400 ms), up to [`ENTRY_RETRIES`]
    /// times; one SQS refuses is not.
    #[tokio::test(start_paused = true)]
    async fn a_call_that_fails_for_a_passing_cause_is_sent_again_and_a_refused_one_is_not() {
        let q = "https://sqs.eu-west-1.amazonaws.com/1/next";
        let outbox: Vec<Outgoing> = ["a", "b"].map(|b| Outgoing::new(q, b)).to_vec();
        let all = vec![outbox_id("pk", 0), outbox_id("pk", 1)];
        let scripted = |errors: Vec<Option<bool>>| Scripted {
            call_errors: std::sync::Mutex::new(errors.into()),
            ..Scripted::default()
        };

        let target = scripted(vec![Some(true), Some(true)]);
        let start = tokio::time::Instant::now();
        dispatch(&target, "pk", &outbox, None).await.unwrap();
        assert_eq!(
            *target.calls.lock().unwrap(),
            [all.clone(), all.clone(), all.clone()]
        );
        assert_eq!(start.elapsed(), CALL_RETRY_PAUSE * 3);

        let target = scripted(vec![Some(true); 3]);
        let e = dispatch(&target, "pk", &outbox, None).await.unwrap_err();
        assert!(!e.is_refusal(), "{e}");
        assert_eq!(target.calls.lock().unwrap().len(), 3);

        let target = scripted(vec![Some(false)]);
        let e = dispatch(&target, "pk", &outbox, None).await.unwrap_err();
        assert!(e.is_refusal(), "{e}");
        assert_eq!(target.calls.lock().unwrap().len(), 1);

        // An entry that failed, then a whole call: one budget of tries, the
        // call's pause the second one (400 ms), only the failed entry sent.
        let target = Scripted {
            answers: std::sync::Mutex::new(vec![vec![(1, "InternalError")]].into()),
            call_errors: std::sync::Mutex::new(vec![None, Some(true)].into()),
            ..Scripted::default()
        };
        let start = tokio::time::Instant::now();
        dispatch(&target, "pk", &outbox, None).await.unwrap();
        let second = vec![outbox_id("pk", 1)];
        assert_eq!(*target.calls.lock().unwrap(), [all, second.clone(), second]);
        assert_eq!(start.elapsed(), CALL_RETRY_PAUSE * 2);
    }
}
