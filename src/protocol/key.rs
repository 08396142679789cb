//! Where a message's dedup key comes from, and how it becomes a record key.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::Message;

/// Where the dedup key of a message is taken from.
///
/// Parsed from the forms used in configuration (`SQS_ONCE_DEDUP_KEY`):
///
/// | form | key |
/// |---|---|
/// | `message-id` (default) | the SQS message id: catches redeliveries only |
/// | `dedup-id` | the FIFO `MessageDeduplicationId` |
/// | `attribute:NAME` | the string message attribute `NAME` |
/// | `json:/pointer` | a string or number at that JSON pointer in the body, e.g. `json:/id` |
/// | `body-sha256` | the SHA-256 of the body |
/// | `json:/outer>/inner` | `/inner` in the JSON held as a string at `/outer`, e.g. `json:/detail/payload>/orderId` |
/// | `SOURCE,SOURCE,...` | a compound key: each part's key, length-prefixed and joined, e.g. `attribute:tenant,json:/id` |
///
/// [`KeySource::custom`] takes the key from a closure (not parseable: it
/// shows as `custom`).
///
/// A compound key joins its parts as `{bytes}:{part}` separated by `|`
/// (`6:tenant|3:o-1`): each part's length comes first, so two different
/// tuples never make the same key, whatever the parts contain. Commas
/// separate the parts, so a JSON pointer in a compound spec cannot contain
/// one.
///
/// A producer that sends the same business event twice creates two message ids:
/// only a business id from the producer (`json:` or `attribute:`) catches that.
/// A producer that mints a new id on every retry defeats any key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeySource {
    /// The SQS message id.
    #[default]
    MessageId,
    /// The FIFO deduplication id.
    DeduplicationId,
    /// A string message attribute.
    Attribute(String),
    /// A JSON pointer (RFC 6901) into the body.
    JsonPointer(String),
    /// The SHA-256 of the body.
    BodySha256,
    /// Who sent the message (SQS's `SenderId`, set by SQS, not the
    /// producer): as a part of a compound key (`sender,json:/order_id`), it
    /// scopes a producer-chosen key to its sender, so one producer cannot
    /// make another's message skip by sending its id first. A copy brought
    /// back from the DLQ (sent again by a consumer or an operator) carries
    /// its first sender sealed ([`SENDER_ATTRIBUTE`]).
    Sender,
    /// Several sources, each part's key length-prefixed and joined.
    Compound(Vec<KeySource>),
    /// A key computed by the application.
    Custom(CustomKey),
}

type KeyFn = dyn Fn(&Message) -> Result<String, String> + Send + Sync;

/// A key taken by a closure: see [`KeySource::custom`]. Two are equal when
/// they are clones of one closure.
#[derive(Clone)]
pub struct CustomKey(std::sync::Arc<KeyFn>);

impl fmt::Debug for CustomKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CustomKey(..)")
    }
}

impl PartialEq for CustomKey {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CustomKey {}

/// Why no dedup key could be taken from a message. A permanent failure: the same
/// message will never yield a key on redelivery.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The message has no FIFO deduplication id.
    #[error("the message has no FIFO deduplication id (dedup key source `dedup-id`)")]
    NoDeduplicationId,
    /// The attribute is absent.
    #[error("the message has no attribute `{0}` (dedup key source `attribute:{0}`)")]
    MissingAttribute(String),
    /// The body is not JSON.
    #[error("the body is not valid JSON, so `json:{pointer}` cannot be read: {reason}")]
    BodyNotJson {
        /// The configured pointer.
        pointer: String,
        /// The parser's message.
        reason: String,
    },
    /// Nothing at the pointer.
    #[error("the body has no value at `{0}` (dedup key source `json:{0}`)")]
    MissingPointer(String),
    /// A value that is not a string or number.
    #[error("the value at `{pointer}` is {found}, expected a string or a number")]
    NotScalar {
        /// The configured pointer.
        pointer: String,
        /// What was found there.
        found: &'static str,
    },
    /// An empty key.
    #[error("the dedup key from {0} is empty")]
    Empty(String),
    /// The value at a pointer is not a string holding JSON, so the pointer
    /// after `>` cannot be read inside it.
    #[error(
        "the value at `{pointer}` is not a string holding JSON, so `>{inner}` cannot be read in it: {reason}"
    )]
    NotEmbeddedJson {
        /// The pointer (up to this level) whose value was to hold JSON.
        pointer: String,
        /// The pointer to read inside it.
        inner: String,
        /// What was wrong.
        reason: String,
    },
    /// One part of a compound key could not be taken.
    #[error("part {position} of the compound dedup key (`{part}`): {error}")]
    Part {
        /// 1-based place of the part in the compound key.
        position: usize,
        /// The part's source, as configured.
        part: String,
        /// Why it could not be taken.
        error: Box<KeyError>,
    },
    /// The envelope around the payload could not be opened (or holds no
    /// payload: S3's test event).
    #[error("{0}")]
    Envelope(String),
    /// A custom key's closure failed.
    #[error("the custom dedup key could not be taken: {0}")]
    Custom(String),
    /// The key is scoped to the sender, and the message has no `SenderId`
    /// (a runtime that did not read it, or a test message without one).
    #[error("the message has no SenderId (the key is scoped to its sender)")]
    NoSender,
}

impl KeySource {
    /// A key computed by `key` from the message (as the handler sees it: the
    /// payload inside an envelope). An error is a permanent failure, like
    /// any key that cannot be taken.
    pub fn custom<F, E>(key: F) -> Self
    where
        F: Fn(&Message) -> Result<String, E> + Send + Sync + 'static,
        E: fmt::Display,
    {
        KeySource::Custom(CustomKey(std::sync::Arc::new(move |m: &Message| {
            key(m).map_err(|e| e.to_string())
        })))
    }

    /// Whether the key is taken without reading the body.
    pub(crate) fn is_body_free(&self) -> bool {
        match self {
            KeySource::MessageId
            | KeySource::DeduplicationId
            | KeySource::Attribute(_)
            | KeySource::Sender => true,
            KeySource::Compound(parts) => parts.iter().all(KeySource::is_body_free),
            KeySource::JsonPointer(_) | KeySource::BodySha256 | KeySource::Custom(_) => false,
        }
    }

    /// Whether the key comes (wholly or in part) from the FIFO
    /// deduplication id.
    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(crate) fn uses_deduplication_id(&self) -> bool {
        match self {
            KeySource::DeduplicationId => true,
            KeySource::Compound(parts) => parts.iter().any(KeySource::uses_deduplication_id),
            _ => false,
        }
    }

    /// Whether the key comes (wholly or in part) from the message id or the
    /// FIFO deduplication id: what a copy brought back from the DLQ has anew,
    /// so its key is carried (see [`DEDUP_KEY_ATTRIBUTE`]).
    pub(crate) fn uses_ids(&self) -> bool {
        match self {
            KeySource::MessageId | KeySource::DeduplicationId => true,
            KeySource::Compound(parts) => parts.iter().any(KeySource::uses_ids),
            _ => false,
        }
    }

    /// Whether the key is scoped to its sender (wholly or in part).
    pub fn uses_sender(&self) -> bool {
        match self {
            KeySource::Sender => true,
            KeySource::Compound(parts) => parts.iter().any(KeySource::uses_sender),
            _ => false,
        }
    }

    /// This source scoped to the message's sender: `sender` and it, as a
    /// compound key. Unchanged when it already reads the sender, and for the
    /// ids: a message id is SQS's own, unique whoever sent it, and SQS
    /// deduplicates a FIFO deduplication id across senders itself (and the
    /// ids cannot be part of a compound key).
    #[must_use]
    pub fn scoped_to_sender(self) -> Self {
        match self {
            s if s.uses_sender() || s.uses_ids() => s,
            KeySource::Compound(mut parts) => {
                parts.insert(0, KeySource::Sender);
                KeySource::Compound(parts)
            }
            s => KeySource::Compound(vec![KeySource::Sender, s]),
        }
    }

    /// Takes the dedup key from a message, honouring no carried key (see
    /// [`Self::extract_with`]).
    pub fn extract(&self, message: &Message) -> Result<String, KeyError> {
        self.extract_with(message, None)
    }

    /// Takes the dedup key from a message: under `message-id` and `dedup-id`,
    /// the key a copy brought back from the DLQ carries when it is sealed under
    /// `secret` for the message's body.
    pub fn extract_with(
        &self,
        message: &Message,
        secret: Option<&CarrySecret>,
    ) -> Result<String, KeyError> {
        let key = match self {
            // A copy brought back from the DLQ has a new message id (and maybe
            // no deduplication id): it carries the original's key instead.
            KeySource::MessageId => match carried_key(message, secret) {
                Some(original) => original.to_owned(),
                None => message.id().to_owned(),
            },
            KeySource::DeduplicationId => match carried_key(message, secret) {
                Some(original) => original.to_owned(),
                None => message
                    .deduplication_id()
                    .ok_or(KeyError::NoDeduplicationId)?
                    .to_owned(),
            },
            KeySource::Attribute(name) => message
                .attribute(name)
                .ok_or_else(|| KeyError::MissingAttribute(name.clone()))?
                .to_owned(),
            KeySource::JsonPointer(pointer) => json_key(message.body(), pointer)?,
            KeySource::BodySha256 => sha256_hex(message.body().as_bytes()),
            KeySource::Sender => sender_of(message, secret)?.to_owned(),
            KeySource::Compound(parts) => match carried_key(message, secret) {
                Some(original) if self.uses_ids() => original.to_owned(),
                _ => compound_key(parts, message, secret)?,
            },
            KeySource::Custom(CustomKey(key)) => key(message).map_err(KeyError::Custom)?,
        };
        if key.trim().is_empty() {
            return Err(KeyError::Empty(self.to_string()));
        }
        Ok(key)
    }
}

/// The message attribute a parked copy carries with the dedup key its consumer
/// used, so that a copy brought back from the DLQ (with a new message id) is
/// processed under the same key. Read by the `message-id` and `dedup-id`
/// sources only, and only when it verifies under the consumer's
/// [`CarrySecret`] (see [`carry_key`]): the other sources find their key in
/// the body or attributes, which parking keeps exactly.
pub const DEDUP_KEY_ATTRIBUTE: &str = "sqs_once_dedup_key";

/// The message attribute that carries the id of a parked message's first
/// delivery (kept through later parks, and the key redrive gives a copy that
/// has no [`DEDUP_KEY_ATTRIBUTE`]). Sealed like it.
pub const MESSAGE_ID_ATTRIBUTE: &str = "sqs_once_message_id";

/// The message attribute that carries who sent a parked message first (SQS's
/// `SenderId` of its first delivery), so that a copy brought back from the
/// DLQ, which SQS credits to whoever sent it back, keeps a sender-scoped key.
/// Sealed like [`DEDUP_KEY_ATTRIBUTE`]: a producer cannot name another sender.
pub const SENDER_ATTRIBUTE: &str = "sqs_once_sender";

/// The attributes sqs-once seals: honoured only when their seal verifies.
pub const SEALED_ATTRIBUTES: [&str; 3] =
    [DEDUP_KEY_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, SENDER_ATTRIBUTE];

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 32;

/// What starts every sealed value's MAC input: the format's version.
const SEAL_DOMAIN: &[u8] = b"sqs-once/carry/v1";

type HmacSha256 = hmac::Hmac<Sha256>;
use hmac::{KeyInit, Mac};

/// The secret that seals what parking and redrive make a message carry
/// (`SQS_ONCE_CARRY_SECRET`): the dedup key and the first delivery's id. Only
/// the consumers of a queue and its operators hold it, so a producer, who
/// can set any message attribute, cannot make a message carry a key (a
/// victim's message id, say) that a consumer honours.
///
/// A value is sealed as `{tag}:{value}`, the tag the 64 hex digits of
/// HMAC-SHA256 over the format's version, the attribute's name, the body's
/// SHA-256 and the value: bound to its attribute and its body, so neither
/// copied onto another message nor moved to the other attribute does it
/// verify. Several secrets, separated by commas, rotate: the first seals,
/// every one verifies.
#[derive(Clone)]
pub struct CarrySecret {
    keys: Vec<Vec<u8>>,
}

impl fmt::Debug for CarrySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CarrySecret(<{} redacted>)", self.keys.len())
    }
}

/// A secret that cannot seal: it never quotes the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CarrySecretError {
    /// No secret at all.
    #[error("empty: set at least one secret of {MIN_SECRET_BYTES} bytes or more")]
    Empty,
    /// One of the secrets is too short.
    #[error(
        "secret {position} of the list is {bytes} bytes long: each must be at least {MIN_SECRET_BYTES} bytes (e.g. 64 hex digits of random)"
    )]
    TooShort {
        /// 1-based place in the comma-separated list.
        position: usize,
        /// Its length.
        bytes: usize,
    },
}

impl CarrySecret {
    /// One secret.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, CarrySecretError> {
        Self::from_keys([secret.as_ref().to_vec()])
    }

    /// Secrets separated by commas (surrounding white space dropped): the
    /// first seals, each verifies.
    pub fn parse(text: &str) -> Result<Self, CarrySecretError> {
        Self::from_keys(text.split(',').map(|s| s.trim().as_bytes().to_vec()))
    }

    fn from_keys(keys: impl IntoIterator<Item = Vec<u8>>) -> Result<Self, CarrySecretError> {
        let keys: Vec<Vec<u8>> = keys.into_iter().collect();
        if keys.iter().all(Vec::is_empty) {
            return Err(CarrySecretError::Empty);
        }
        for (i, k) in keys.iter().enumerate() {
            if k.len() < MIN_SECRET_BYTES {
                return Err(CarrySecretError::TooShort {
                    position: i + 1,
                    bytes: k.len(),
                });
            }
        }
        Ok(Self { keys })
    }

    fn mac(key: &[u8], attribute: &str, body: &str, value: &str) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
        mac.update(SEAL_DOMAIN);
        mac.update(b"\0");
        mac.update(attribute.as_bytes());
        mac.update(b"\0");
        mac.update(&Sha256::digest(body.as_bytes()));
        mac.update(value.as_bytes());
        mac
    }

    /// `value` sealed for `attribute` on a message with `body`.
    pub fn seal(&self, attribute: &str, body: &str, value: &str) -> String {
        let tag = Self::mac(&self.keys[0], attribute, body, value).finalize();
        format!("{}:{value}", hex::encode(tag.into_bytes()))
    }

    /// The value of `sealed` when it was sealed for `attribute` on a message
    /// with `body` under one of the secrets (compared in constant time).
    pub fn open<'a>(&self, attribute: &str, body: &str, sealed: &'a str) -> Option<&'a str> {
        let (tag, value) = sealed.split_once(':')?;
        let tag = hex::decode(tag).ok().filter(|t| t.len() == 32)?;
        self.keys
            .iter()
            .any(|k| {
                Self::mac(k, attribute, body, value)
                    .verify_slice(&tag)
                    .is_ok()
            })
            .then_some(value)
    }
}

/// The value of [`DEDUP_KEY_ATTRIBUTE`] for `key` on a message with `body`.
pub fn carry_key(secret: &CarrySecret, body: &str, key: &str) -> String {
    secret.seal(DEDUP_KEY_ATTRIBUTE, body, key)
}

/// The value of [`MESSAGE_ID_ATTRIBUTE`] for the first delivery's `id` on a
/// message with `body`.
pub fn carry_message_id(secret: &CarrySecret, body: &str, id: &str) -> String {
    secret.seal(MESSAGE_ID_ATTRIBUTE, body, id)
}

/// The value of the sealed attribute `name` of `message`, if it carries one
/// sealed under `secret` for its own body. Without a secret nothing is
/// honoured.
pub fn carried<'a>(
    message: &'a Message,
    name: &str,
    secret: Option<&CarrySecret>,
) -> Option<&'a str> {
    let sealed = message.attribute(name)?;
    secret?
        .open(name, message.raw_body(), sealed)
        .filter(|v| !v.is_empty())
}

/// The key a parked copy carries, if sealed for its own body (a handler or
/// bridge that forwards received attributes onto other messages must not give
/// them all one key, and a producer must not name another message's key).
pub(crate) fn carried_key<'a>(
    message: &'a Message,
    secret: Option<&CarrySecret>,
) -> Option<&'a str> {
    carried(message, DEDUP_KEY_ATTRIBUTE, secret)
}

/// The value of [`SENDER_ATTRIBUTE`] for the first sender `sender` of a
/// message with `body`.
pub fn carry_sender(secret: &CarrySecret, body: &str, sender: &str) -> String {
    secret.seal(SENDER_ATTRIBUTE, body, sender)
}

/// Who sent `message` first: the sender a copy brought back from the DLQ
/// carries sealed for its own body, else SQS's `SenderId` of this delivery.
pub fn first_sender<'a>(message: &'a Message, secret: Option<&CarrySecret>) -> Option<&'a str> {
    carried(message, SENDER_ATTRIBUTE, secret).or(message.sender_id())
}

/// The sender part of a key ([`KeySource::Sender`]): the principal of the
/// first sender. SQS names an assumed role's caller `AROA…:SESSION` (the
/// session an instance, a task or a function runs under): one producer
/// sending again from another instance is the same role, so a role's
/// session is dropped. Any other form stays whole (a federated user's
/// `ACCOUNT:NAME` is that user, not the account).
fn sender_of<'a>(message: &'a Message, secret: Option<&CarrySecret>) -> Result<&'a str, KeyError> {
    let sender = first_sender(message, secret).ok_or(KeyError::NoSender)?;
    Ok(match sender.split_once(':') {
        Some((role, _)) if role.starts_with("AROA") => role,
        _ => sender,
    })
}

/// The first delivery's id a parked copy carries, if sealed for its own body.
pub(crate) fn carried_message_id<'a>(
    message: &'a Message,
    secret: Option<&CarrySecret>,
) -> Option<&'a str> {
    carried(message, MESSAGE_ID_ATTRIBUTE, secret)
}

/// The sealed attributes `message` has that do not verify (set by a
/// producer, forwarded from another message, sealed under a secret no longer
/// configured, or any at all without a secret): ignored, and to be counted.
pub(crate) fn unverified_attributes(
    message: &Message,
    secret: Option<&CarrySecret>,
) -> Vec<&'static str> {
    SEALED_ATTRIBUTES
        .into_iter()
        .filter(|name| {
            message.attribute(name).is_some() && carried(message, name, secret).is_none()
        })
        .collect()
}

/// The parts' keys, each as `{bytes}:{key}`, joined by `|`.
fn compound_key(
    parts: &[KeySource],
    message: &Message,
    secret: Option<&CarrySecret>,
) -> Result<String, KeyError> {
    let mut joined = String::new();
    for (i, part) in parts.iter().enumerate() {
        // (A part from the ids honours no carried key here: a whole key
        // carried for them was taken before.)
        let key = part
            .extract_with(message, secret)
            .map_err(|e| KeyError::Part {
                position: i + 1,
                part: part.to_string(),
                error: Box::new(e),
            })?;
        if i > 0 {
            joined.push('|');
        }
        joined.push_str(&format!("{}:{key}", key.len()));
    }
    Ok(joined)
}

/// The key at a JSON pointer; `>` before a `/` reads the rest of the pointer
/// in the JSON held as a string at the pointer before it.
fn json_key(body: &str, pointer: &str) -> Result<String, KeyError> {
    let mut levels = pointer.split(">/");
    let mut level = levels.next().unwrap_or_default().to_owned();
    let mut shown = level.clone();
    let mut text = std::borrow::Cow::Borrowed(body);
    for next in levels {
        let inner = format!("/{next}");
        let embedded = |reason: String| KeyError::NotEmbeddedJson {
            pointer: shown.clone(),
            inner: inner.clone(),
            reason,
        };
        let held = match json_at(&text, &level, &shown)?.0 {
            serde_json::Value::String(s) => s,
            other => return Err(embedded(format!("it is {}", json_kind(&other)))),
        };
        serde_json::from_str::<&serde_json::value::RawValue>(&held)
            .map_err(|e| embedded(e.to_string()))?;
        text = std::borrow::Cow::Owned(held);
        shown = format!("{shown}>{inner}");
        level = inner;
    }
    json_scalar(&text, &level, &shown)
}

/// The string or number at `pointer` in `body` (`shown`: the pointer as
/// errors name it).
fn json_scalar(body: &str, pointer: &str, shown: &str) -> Result<String, KeyError> {
    let (value, raw) = json_at(body, pointer, shown)?;
    match value {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        serde_json::Value::Number(_) => Ok(raw),
        other => Err(KeyError::NotScalar {
            pointer: shown.to_owned(),
            found: json_kind(&other),
        }),
    }
}

/// The value at a JSON pointer and its exact text: the body is walked as raw
/// JSON, so numbers keep their text and `12345678901234567890123` and
/// `...124` stay apart (an `f64` would make them one key). Integers within
/// `i64`/`u64` render as before. Each level is read once (the body's whole
/// text at the first): its members off the path are skipped (still checked
/// to be JSON), member names are read in full, and the member on the path
/// is kept as raw text, the last one where a name is given twice (as a map
/// read of the object takes it), and read at the next level.
fn json_at(
    body: &str,
    pointer: &str,
    shown: &str,
) -> Result<(serde_json::Value, String), KeyError> {
    use serde::de::DeserializeSeed;
    use serde_json::value::RawValue;
    let not_json = |e: serde_json::Error| KeyError::BodyNotJson {
        pointer: shown.to_owned(),
        reason: e.to_string(),
    };
    let mut raw: &RawValue = serde_json::from_str("null").map_err(not_json)?;
    let mut text = body;
    let mut tokens = pointer.split('/').skip(1).peekable();
    if tokens.peek().is_none() {
        raw = serde_json::from_str(body).map_err(not_json)?;
    }
    for token in tokens {
        let token = token.replace("~1", "/").replace("~0", "~");
        let opens = text.trim_start().as_bytes().first();
        if !matches!(opens, Some(b'{' | b'[')) {
            // A scalar has no members (the body, at the first level, must
            // still be JSON); it is never read here, so a string or number
            // that a full read would refuse leads nowhere, as before.
            if std::ptr::eq(text, body) {
                serde_json::from_str::<&RawValue>(body).map_err(not_json)?;
            }
            return Err(KeyError::MissingPointer(shown.to_owned()));
        }
        let mut level = serde_json::Deserializer::from_str(text);
        let found = pointer_walk::Member(&token)
            .deserialize(&mut level)
            // What follows the document must be only whitespace.
            .and_then(|found| level.end().map(|()| found))
            .map_err(not_json)?;
        raw = found.ok_or_else(|| KeyError::MissingPointer(shown.to_owned()))?;
        text = raw.get();
    }
    let value: serde_json::Value = serde_json::from_str(raw.get()).map_err(not_json)?;
    Ok((value, raw.get().trim().to_owned()))
}

/// One level of a JSON pointer's walk, as a serde seed.
mod pointer_walk {
    use std::fmt;

    use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use serde_json::value::RawValue;

    /// The raw text of the member or element an (unescaped) token names;
    /// `None` where there is none (a scalar has no members). A name given
    /// twice in one object takes its last value.
    pub(super) struct Member<'t>(pub(super) &'t str);

    impl<'de> DeserializeSeed<'de> for Member<'_> {
        type Value = Option<&'de RawValue>;

        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    /// Whether an object's member name is the token sought.
    struct Named<'t>(&'t str);

    impl<'de> DeserializeSeed<'de> for Named<'_> {
        type Value = bool;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
            d.deserialize_str(self)
        }
    }

    impl Visitor<'_> for Named<'_> {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a member name")
        }
        fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<bool, E> {
            Ok(name == self.0)
        }
    }

    impl<'de> Visitor<'de> for Member<'_> {
        type Value = Option<&'de RawValue>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("JSON")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(named) = map.next_key_seed(Named(self.0))? {
                if named {
                    found = Some(map.next_value::<&RawValue>()?);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(found)
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let token = self.0;
            let valid_index = !token.is_empty()
                && token.bytes().all(|b| b.is_ascii_digit())
                && (token == "0" || !token.starts_with('0'));
            let wanted: Option<usize> = valid_index.then(|| token.parse().ok()).flatten();
            let (mut i, mut found) = (0, None);
            loop {
                if Some(i) == wanted {
                    match seq.next_element::<&RawValue>()? {
                        Some(f) => found = Some(f),
                        None => break,
                    }
                } else if seq.next_element::<IgnoredAny>()?.is_none() {
                    break;
                }
                i += 1;
            }
            Ok(found)
        }

        // A scalar has no members: the pointer leads nowhere. (Strings and
        // numbers read here are skipped as raw text by the level above.)
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Number(_) => "a number",
    }
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::MessageId => f.write_str("message-id"),
            KeySource::DeduplicationId => f.write_str("dedup-id"),
            KeySource::Attribute(n) => write!(f, "attribute:{n}"),
            KeySource::JsonPointer(p) => write!(f, "json:{p}"),
            KeySource::BodySha256 => f.write_str("body-sha256"),
            KeySource::Sender => f.write_str("sender"),
            KeySource::Compound(parts) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{part}")?;
                }
                Ok(())
            }
            KeySource::Custom(_) => f.write_str("custom"),
        }
    }
}

/// An unparseable key source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid dedup key source `{0}`: expected `message-id`, `dedup-id`, `attribute:NAME`, `json:/pointer`, `json:/pointer>/pointer`, `body-sha256` or `sender`, or several of them separated by commas"
)]
pub struct KeySourceParseError(String);

impl FromStr for KeySource {
    type Err = KeySourceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.contains(',') {
            let parts = s
                .split(',')
                .map(|part| part.trim().parse::<KeySource>())
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(KeySource::Compound(parts));
        }
        let bad = || KeySourceParseError(s.to_owned());
        match s {
            "message-id" => Ok(KeySource::MessageId),
            "dedup-id" => Ok(KeySource::DeduplicationId),
            "body-sha256" => Ok(KeySource::BodySha256),
            "sender" => Ok(KeySource::Sender),
            _ => {
                if let Some(name) = s.strip_prefix("attribute:") {
                    if name.is_empty() {
                        return Err(bad());
                    }
                    Ok(KeySource::Attribute(name.to_owned()))
                } else if let Some(pointer) = s.strip_prefix("json:") {
                    if !pointer.starts_with('/') || pointer.ends_with('>') {
                        return Err(bad());
                    }
                    Ok(KeySource::JsonPointer(pointer.to_owned()))
                } else {
                    Err(bad())
                }
            }
        }
    }
}

/// Longest record key stored as is. DynamoDB allows 2048 bytes for a partition
/// key; longer keys are hashed well before that.
pub const MAX_PLAIN_KEY_BYTES: usize = 1024;

/// The key derivation this build makes keys by: the rules that turn a message
/// and the key settings into a record key and an idempotency key. A change to
/// them (which would leave every record made before unfound, so every message
/// seen before would run again) bumps this number; the dedup table's stamp
/// of each consumer keeps the number its records were made by, and a build
/// whose number differs refuses to start on it (`StampError`).
/// `tests::key_derivation_is_pinned` fails on any such change.
pub const KEY_DERIVATION: u32 = 1;

/// What starts the dedup-key part of a hashed record key.
const HASHED_PREFIX: &str = "sha256:";

/// The record's partition key: `{consumer}#{dedup_key}`, or
/// `{consumer}#sha256:{hex}` when that would be longer than [`MAX_PLAIN_KEY_BYTES`].
/// A dedup key that itself starts with `sha256:` is always hashed, so a short
/// key can never name the record of a hashed long one.
pub fn record_key(consumer: &str, dedup_key: &str) -> String {
    let plain = format!("{consumer}#{dedup_key}");
    if plain.len() <= MAX_PLAIN_KEY_BYTES && !dedup_key.starts_with(HASHED_PREFIX) {
        plain
    } else {
        hashed_record_key(consumer, dedup_key)
    }
}

/// The record key of `dedup_key` when keys are hashed
/// (`SQS_ONCE_HASH_KEYS`): always `{consumer}#sha256:{hex}`, the form
/// [`record_key`] gives long keys, so a long key's record is the same either way.
pub fn hashed_record_key(consumer: &str, dedup_key: &str) -> String {
    format!("{consumer}#{}", hashed_key(dedup_key))
}

/// `sha256:{hex}` of `dedup_key`: what logs and spans show of it when keys
/// are hashed, and the part of its record key after the consumer.
pub fn hashed_key(dedup_key: &str) -> String {
    format!("{HASHED_PREFIX}{}", sha256_hex(dedup_key.as_bytes()))
}

/// The stable idempotency key to pass downstream (`Idempotency-Key` header):
/// the same for every delivery of one logical message to one consumer.
pub fn idempotency_key(consumer: &str, dedup_key: &str) -> String {
    let digest = sha256_hex(format!("{consumer}#{dedup_key}").as_bytes());
    format!("sqs-once-{}", &digest[..40])
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    // Encoded into a buffer of its size (`hex::encode` builds the text a
    // char at a time: most of the cost of a short hash).
    let mut out = [0u8; 64];
    hex::encode_to_slice(Sha256::digest(bytes), &mut out).expect("64 hex digits for 32 bytes");
    std::str::from_utf8(&out)
        .expect("hex digits are ASCII")
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys read through an envelope, as the processor's configuration
    /// takes them (for [`key_derivation_is_pinned`]).
    fn enveloped_keys() -> Vec<String> {
        let mut keys = Vec::new();
        let sns = serde_json::json!({
            "Type": "Notification",
            "MessageId": "sns-1",
            "TopicArn": "arn:aws:sns:us-east-1:123456789012:orders",
            "Message": r#"{"order":{"id":"o-2"}}"#,
            "MessageAttributes": {"tenant": {"Type": "String", "Value": "t-8"}}
        })
        .to_string();
        let bridge = serde_json::json!({
            "version": "0", "id": "e-1", "detail-type": "Order", "source": "shop",
            "detail": {"order": {"id": "o-3"}}
        })
        .to_string();
        for (envelope, body) in [
            (crate::protocol::message::Envelope::Sns, &sns),
            (crate::protocol::message::Envelope::EventBridge, &bridge),
        ] {
            for source in [
                "json:/order/id",
                "attribute:tenant",
                "body-sha256",
                "message-id",
            ] {
                let mut config = crate::protocol::config::ProcessorConfig::new("c");
                config.envelope = envelope;
                config.key_source = source.parse().unwrap();
                keys.push(
                    config
                        .dedup_key(&Message::new("m-3", body.as_str()))
                        .unwrap_or_else(|e| format!("error: {e}")),
                );
            }
        }
        keys
    }

    /// Every rule that turns a message into a record key and an idempotency
    /// key, pinned: a change here leaves every record made before unfound.
    /// If this fails, the derivation changed: bump [`KEY_DERIVATION`] (a
    /// consumer's stamp then refuses the new build until the operator drains
    /// and re-stamps) and mark the change **Re-applies** in CHANGELOG.md.
    #[test]
    fn key_derivation_is_pinned() {
        assert_eq!(KEY_DERIVATION, 1, "see this test's comment");
        let secret = CarrySecret::new([7u8; 32]).unwrap();
        let body = r#"{"order":{"id":"o-1","n":12.50},"big":123456789012345678901234567890,"s":"{\"inner\":\"x\"}"}"#;
        let message = Message::new("m-1", body)
            .with_attribute("tenant", "t-9")
            .with_deduplication_id("d-1")
            .with_sender_id("AROAEXAMPLE:session-1");
        let sealed = Message::new("m-2", body)
            .with_attribute(DEDUP_KEY_ATTRIBUTE, carry_key(&secret, body, "original"));
        let mut got = Vec::new();
        for source in [
            "message-id",
            "dedup-id",
            "attribute:tenant",
            "json:/order/id",
            "json:/order/n",
            "json:/big",
            "json:/s>/inner",
            "json:/order/id,attribute:tenant",
            "body-sha256",
        ] {
            let parsed: KeySource = source.parse().unwrap();
            got.push(parsed.extract(&message).unwrap());
            got.push(
                parsed
                    .clone()
                    .scoped_to_sender()
                    .extract(&message)
                    .unwrap_or_default(),
            );
        }
        got.push(
            "message-id"
                .parse::<KeySource>()
                .unwrap()
                .extract_with(&sealed, Some(&secret))
                .unwrap(),
        );
        got.extend(enveloped_keys());
        let long = "k".repeat(MAX_PLAIN_KEY_BYTES);
        let keys: Vec<String> = got
            .iter()
            .chain([&long, &"sha256:abc".to_owned()])
            .flat_map(|k| {
                [
                    record_key("c", k),
                    hashed_record_key("c", k),
                    idempotency_key("c", k),
                ]
            })
            .collect();
        assert_eq!(
            sha256_hex(keys.join("\n").as_bytes()),
            "0aa0dee7d04346dafe353eb685475b9c97afdae32ad192ee0d0824a9c4556f66",
            "the key derivation changed: {keys:#?}"
        );
    }

    #[test]
    fn sha256_hex_is_the_lower_case_digest() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn parses_every_form_and_round_trips() {
        for s in [
            "message-id",
            "dedup-id",
            "attribute:order",
            "json:/id",
            "body-sha256",
        ] {
            let parsed: KeySource = s.parse().unwrap();
            assert_eq!(parsed.to_string(), s);
        }
        for bad in ["", "json:id", "attribute:", "uuid", "json"] {
            assert!(
                bad.parse::<KeySource>().is_err(),
                "{bad:?} should not parse"
            );
        }
    }

    #[test]
    fn json_pointer_takes_strings_and_numbers_and_names_what_is_wrong() {
        let src = KeySource::JsonPointer("/id".into());
        assert_eq!(
            src.extract(&Message::new("m", r#"{"id":"e-1"}"#)).unwrap(),
            "e-1"
        );
        assert_eq!(
            src.extract(&Message::new("m", r#"{"id":42}"#)).unwrap(),
            "42"
        );
        assert_eq!(
            src.extract(&Message::new("m", r#"{"other":1}"#)),
            Err(KeyError::MissingPointer("/id".into()))
        );
        assert!(matches!(
            src.extract(&Message::new("m", r#"{"id":{"a":1}}"#)),
            Err(KeyError::NotScalar {
                found: "an object",
                ..
            })
        ));
        assert!(matches!(
            src.extract(&Message::new("m", "not json")),
            Err(KeyError::BodyNotJson { .. })
        ));
        assert!(matches!(
            src.extract(&Message::new("m", r#"{"id":"  "}"#)),
            Err(KeyError::Empty(_))
        ));
    }

    #[test]
    fn other_sources() {
        let m = Message::new("mid", "body")
            .with_attribute("biz", "b-7")
            .with_deduplication_id("d-1");
        assert_eq!(KeySource::MessageId.extract(&m).unwrap(), "mid");
        assert_eq!(KeySource::DeduplicationId.extract(&m).unwrap(), "d-1");
        assert_eq!(
            KeySource::Attribute("biz".into()).extract(&m).unwrap(),
            "b-7"
        );
        assert_eq!(
            KeySource::BodySha256.extract(&m).unwrap(),
            sha256_hex(b"body")
        );
        assert_eq!(
            KeySource::Attribute("nope".into()).extract(&m),
            Err(KeyError::MissingAttribute("nope".into()))
        );
        assert_eq!(
            KeySource::DeduplicationId.extract(&Message::new("x", "y")),
            Err(KeyError::NoDeduplicationId)
        );
    }

    #[test]
    fn compound_keys_parse_join_every_part_and_name_the_missing_one() {
        let src: KeySource = "attribute:tenant, json:/id".parse().unwrap();
        assert_eq!(
            src,
            KeySource::Compound(vec![
                KeySource::Attribute("tenant".into()),
                KeySource::JsonPointer("/id".into())
            ])
        );
        assert_eq!(src.to_string(), "attribute:tenant,json:/id");
        let m = Message::new("m", r#"{"id":"o-1"}"#).with_attribute("tenant", "acme");
        assert_eq!(src.extract(&m).unwrap(), "4:acme|3:o-1");
        let err = src
            .extract(&Message::new("m", r#"{"id":"o-1"}"#))
            .unwrap_err();
        assert_eq!(
            err,
            KeyError::Part {
                position: 1,
                part: "attribute:tenant".into(),
                error: Box::new(KeyError::MissingAttribute("tenant".into())),
            }
        );
        let err = src
            .extract(&Message::new("m", "{}").with_attribute("tenant", "acme"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("part 2") && err.contains("`json:/id`") && err.contains("no value"),
            "{err}"
        );
        for bad in ["json:/a,", ",json:/a", "json:/a,uuid"] {
            assert!(
                bad.parse::<KeySource>().is_err(),
                "{bad:?} should not parse"
            );
        }
    }

    #[test]
    fn a_carried_key_stands_for_a_compound_key_only_when_it_reads_an_id() {
        let secret = secret();
        let body = r#"{"id":"o-1"}"#;
        let copy = Message::new("new-id", body)
            .with_attribute("tenant", "acme")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, carry_key(&secret, body, "original"));
        let with_id: KeySource = "attribute:tenant,message-id".parse().unwrap();
        let without: KeySource = "attribute:tenant,json:/id".parse().unwrap();
        assert!(with_id.uses_ids() && !without.uses_ids());
        assert_eq!(
            with_id.extract_with(&copy, Some(&secret)).unwrap(),
            "original"
        );
        assert_eq!(with_id.extract(&copy).unwrap(), "4:acme|6:new-id");
        assert_eq!(
            without.extract_with(&copy, Some(&secret)).unwrap(),
            "4:acme|3:o-1"
        );
    }

    proptest::proptest! {
        #[test]
        fn different_tuples_never_make_the_same_compound_key(
            a in proptest::collection::vec(".{0,6}", 2..4),
            b in proptest::collection::vec(".{0,6}", 2..4),
        ) {
            let key = |parts: &[String]| {
                let names: Vec<String> = (0..parts.len()).map(|i| format!("p{i}")).collect();
                let mut m = Message::new("m", "b");
                for (n, v) in names.iter().zip(parts) {
                    m = m.with_attribute(n, v.clone());
                }
                let src = KeySource::Compound(
                    names.iter().map(|n| KeySource::Attribute(n.clone())).collect(),
                );
                src.extract(&m).ok()
            };
            let (ka, kb) = (key(&a), key(&b));
            if a != b && ka.is_some() {
                proptest::prop_assert_ne!(ka, kb);
            }
        }
    }

    #[test]
    fn separators_inside_parts_do_not_make_tuples_collide() {
        let src: KeySource = "attribute:a,attribute:b".parse().unwrap();
        let key = |a: &str, b: &str| {
            src.extract(
                &Message::new("m", "x")
                    .with_attribute("a", a)
                    .with_attribute("b", b),
            )
            .unwrap()
        };
        let pairs = [
            ("x|1:y", "z"),
            ("x", "1:y|1:z"),
            ("x|", "y"),
            ("x", "|y"),
            ("1:x", "y"),
        ];
        let keys: std::collections::HashSet<String> =
            pairs.iter().map(|(a, b)| key(a, b)).collect();
        assert_eq!(keys.len(), pairs.len(), "{keys:?}");
    }

    #[test]
    fn a_custom_key_is_the_closures_and_its_error_names_it() {
        let src = KeySource::custom(|m: &Message| {
            m.attribute("order")
                .map(|o| format!("order-{o}"))
                .ok_or("no order attribute")
        });
        assert_eq!(src.to_string(), "custom");
        assert_eq!(src, src.clone());
        assert_ne!(
            src,
            KeySource::custom(|_: &Message| Ok::<_, String>("k".into()))
        );
        assert!(format!("{src:?}").contains("Custom"));
        assert!("custom".parse::<KeySource>().is_err());
        let m = Message::new("m", "b").with_attribute("order", "7");
        assert_eq!(src.extract(&m).unwrap(), "order-7");
        let err = src.extract(&Message::new("m", "b")).unwrap_err();
        assert_eq!(err, KeyError::Custom("no order attribute".into()));
        assert!(err.to_string().contains("custom dedup key"), "{err}");
        assert!(!src.is_body_free());
    }

    #[test]
    fn a_key_inside_a_json_string_in_the_body_and_what_is_wrong_with_it() {
        let src: KeySource = "json:/detail/payload>/orderId".parse().unwrap();
        assert_eq!(src.to_string(), "json:/detail/payload>/orderId");
        let body =
            r#"{"detail":{"payload":"{\"orderId\":\"o-9\",\"n\":{\"x\":\"{\\\"y\\\":3}\"}}"}}"#;
        assert_eq!(src.extract(&Message::new("m", body)).unwrap(), "o-9");
        // Two levels down.
        let deep: KeySource = "json:/detail/payload>/n/x>/y".parse().unwrap();
        assert_eq!(deep.extract(&Message::new("m", body)).unwrap(), "3");
        assert_eq!(
            src.extract(&Message::new("m", r#"{"detail":{}}"#)),
            Err(KeyError::MissingPointer("/detail/payload".into()))
        );
        assert_eq!(
            src.extract(&Message::new("m", r#"{"detail":{"payload":"{}"}}"#)),
            Err(KeyError::MissingPointer("/detail/payload>/orderId".into()))
        );
        let not_json = src
            .extract(&Message::new("m", r#"{"detail":{"payload":"nope"}}"#))
            .unwrap_err();
        assert!(
            matches!(&not_json, KeyError::NotEmbeddedJson { pointer, inner, .. }
                if pointer == "/detail/payload" && inner == "/orderId"),
            "{not_json:?}"
        );
        let not_string = src
            .extract(&Message::new(
                "m",
                r#"{"detail":{"payload":{"orderId":"o"}}}"#,
            ))
            .unwrap_err()
            .to_string();
        assert!(not_string.contains("it is an object"), "{not_string}");
        assert!("json:/a>".parse::<KeySource>().is_err());
    }

    #[test]
    fn long_keys_are_hashed_short_ones_kept() {
        assert_eq!(record_key("c", "k"), "c#k");
        let long = "x".repeat(5000);
        let k = record_key("c", &long);
        assert!(k.starts_with("c#sha256:") && k.len() < 100, "{k}");
        assert_eq!(k, record_key("c", &long), "hashing is stable");
        assert_ne!(idempotency_key("a", "k"), idempotency_key("b", "k"));
        assert_eq!(idempotency_key("a", "k"), idempotency_key("a", "k"));
    }

    #[test]
    fn large_json_numbers_keep_their_exact_text_as_keys() {
        let src = KeySource::JsonPointer("/id".into());
        let a = src
            .extract(&Message::new("m", r#"{"id":12345678901234567890123}"#))
            .unwrap();
        let b = src
            .extract(&Message::new("m", r#"{"id":12345678901234567890124}"#))
            .unwrap();
        assert_eq!(a, "12345678901234567890123");
        assert_eq!(b, "12345678901234567890124");
        assert_ne!(a, b);
        // Decimals keep their text too; integers in range render as before.
        let d = src.extract(&Message::new("m", r#"{"id": 0.10000000000000000001 }"#));
        assert_eq!(d.unwrap(), "0.10000000000000000001");
        assert_eq!(
            src.extract(&Message::new("m", r#"{"id":18446744073709551615}"#))
                .unwrap(),
            "18446744073709551615"
        );
        // Nested pointers, escapes and array indices.
        let nested = KeySource::JsonPointer("/a~1b/1/c~0d".into());
        assert_eq!(
            nested
                .extract(&Message::new("m", r#"{"a/b":[0,{"c~d":"x"}]}"#))
                .unwrap(),
            "x"
        );
        let idx = KeySource::JsonPointer("/l/01".into());
        assert_eq!(
            idx.extract(&Message::new("m", r#"{"l":[1,2]}"#)),
            Err(KeyError::MissingPointer("/l/01".into()))
        );
    }

    /// The body is read once; what is off the pointer's path must still be
    /// JSON, a name given twice takes its last value (as a map read takes
    /// it), escaped names match, and a pointer through a scalar is missing.
    #[test]
    fn the_one_pass_read_checks_the_whole_body_and_reads_names_as_a_map_would() {
        let id = KeySource::JsonPointer("/id".into());
        let read = |body: &str| id.extract(&Message::new("m", body));
        assert_eq!(read(r#"{"id":"a","id":"b"}"#).unwrap(), "b");
        assert_eq!(read(r#"{"i\u0064":"x"}"#).unwrap(), "x");
        for bad in [
            r#"{"id":"a"} trailing"#,
            r#"{"id":"a","x":[1,}"#,
            r#"{"x":tru,"id":"a"}"#,
            r#"{"id":"a""#,
        ] {
            assert!(
                matches!(read(bad), Err(KeyError::BodyNotJson { .. })),
                "{bad}: {:?}",
                read(bad)
            );
        }
        let deep = KeySource::JsonPointer("/a/b".into());
        for body in [
            r#"{"a":"s"}"#,
            r#"{"a":[1]}"#,
            r#"{"a":{"c":1}}"#,
            r#"{"a":null}"#,
        ] {
            assert_eq!(
                deep.extract(&Message::new("m", body)),
                Err(KeyError::MissingPointer("/a/b".into())),
                "{body}"
            );
        }
        let far = KeySource::JsonPointer("/l/5".into());
        assert_eq!(
            far.extract(&Message::new("m", r#"{"l":[0,1]}"#)),
            Err(KeyError::MissingPointer("/l/5".into()))
        );
        let second = KeySource::JsonPointer("/l/1/k".into());
        assert_eq!(
            second
                .extract(&Message::new("m", r#"{"l":[{"k":1},{"k":2},{"k":3}]}"#))
                .unwrap(),
            "2"
        );
        // What is off the path, or passed over by a later member of the same
        // name, is only checked to be JSON: a lone surrogate or a number no
        // f64 holds there changes nothing; one on the path's way leads
        // nowhere.
        let ab = KeySource::JsonPointer("/a/b".into());
        for (body, key) in [
            (r#"{"a":"\ud800","a":{"b":"k"}}"#, Ok("k".to_owned())),
            (r#"{"a":1e999,"a":{"b":"k"}}"#, Ok("k".to_owned())),
            (r#"{"a":{"\ud800":1},"a":{"b":"k"}}"#, Ok("k".to_owned())),
            (r#"{"x":"\ud800","a":{"b":"k"}}"#, Ok("k".to_owned())),
            (
                r#"{"a":"\ud800"}"#,
                Err(KeyError::MissingPointer("/a/b".into())),
            ),
            (
                r#"{"a":1e999}"#,
                Err(KeyError::MissingPointer("/a/b".into())),
            ),
        ] {
            assert_eq!(ab.extract(&Message::new("m", body)), key, "{body}");
        }
        assert_eq!(
            id.extract(&Message::new("m", r#""\ud800""#)),
            Err(KeyError::MissingPointer("/id".into()))
        );
    }

    #[test]
    fn hashed_keys_take_the_long_keys_form_so_a_long_key_keeps_its_record() {
        assert_eq!(
            hashed_record_key("c", "k"),
            format!("c#sha256:{}", sha256_hex(b"k"))
        );
        assert_eq!(hashed_key("k"), format!("sha256:{}", sha256_hex(b"k")));
        let long = "x".repeat(5000);
        assert_eq!(hashed_record_key("c", &long), record_key("c", &long));
        assert_ne!(hashed_record_key("c", "k"), record_key("c", "k"));
    }

    #[test]
    fn a_short_key_that_looks_hashed_does_not_share_a_hashed_long_keys_record() {
        let long = "x".repeat(5000);
        let hashed = record_key("c", &long);
        let lookalike = hashed.strip_prefix("c#").unwrap();
        assert_ne!(record_key("c", lookalike), hashed);
    }

    #[test]
    fn a_sender_scoped_key_is_the_senders_and_a_copy_brought_back_keeps_its_first_sender() {
        let src: KeySource = "json:/id".parse::<KeySource>().unwrap().scoped_to_sender();
        assert_eq!(src.to_string(), "sender,json:/id");
        assert_eq!(src.clone().scoped_to_sender(), src, "scoped once");
        assert_eq!(
            KeySource::MessageId.scoped_to_sender(),
            KeySource::MessageId,
            "SQS's own id"
        );
        assert_eq!("sender,json:/id".parse::<KeySource>().unwrap(), src);
        let body = r#"{"id":"o-1"}"#;
        let alice = Message::new("m-1", body).with_sender_id("AIDAALICE");
        let mallory = Message::new("m-2", body).with_sender_id("AIDAMALLORY");
        let (a, m) = (src.extract(&alice).unwrap(), src.extract(&mallory).unwrap());
        assert_eq!(a, "9:AIDAALICE|3:o-1");
        assert_ne!(a, m, "one order id, two senders: two keys");
        // Brought back by an operator: SQS names the operator; the sealed
        // first sender wins, and only when it verifies.
        let s = secret();
        let redriven = Message::new("m-3", body)
            .with_sender_id("AIDAOPERATOR")
            .with_attribute(SENDER_ATTRIBUTE, carry_sender(&s, body, "AIDAALICE"));
        assert_eq!(src.extract_with(&redriven, Some(&s)).unwrap(), a);
        let forged = Message::new("m-4", body)
            .with_sender_id("AIDAMALLORY")
            .with_attribute(SENDER_ATTRIBUTE, "AIDAALICE");
        assert_eq!(
            src.extract_with(&forged, Some(&s)).unwrap(),
            m,
            "an unsealed sender is ignored"
        );
        let other_body = Message::new("m-5", r#"{"id":"o-1","x":1}"#)
            .with_sender_id("AIDAMALLORY")
            .with_attribute(SENDER_ATTRIBUTE, carry_sender(&s, body, "AIDAALICE"));
        assert_eq!(
            src.extract_with(&other_body, Some(&s)).unwrap(),
            m,
            "a seal copied onto another body does not verify"
        );
        let role = |session: &str| {
            Message::new("m-7", body).with_sender_id(format!("AROAPRODUCER:{session}"))
        };
        assert_eq!(
            src.extract(&role("i-0aaa")).unwrap(),
            src.extract(&role("i-0bbb")).unwrap(),
            "one role's instances are one sender"
        );
        let federated =
            |name: &str| Message::new("m-8", body).with_sender_id(format!("123456789012:{name}"));
        assert_ne!(
            src.extract(&federated("bob")).unwrap(),
            src.extract(&federated("eve")).unwrap(),
            "two federated users are two senders"
        );
        let err = src.extract(&Message::new("m-6", body)).unwrap_err();
        assert!(err.to_string().contains("no SenderId"), "{err}");
    }

    fn secret() -> CarrySecret {
        CarrySecret::new("s".repeat(MIN_SECRET_BYTES)).unwrap()
    }

    #[test]
    fn a_copy_back_from_the_dlq_keeps_the_original_message_id_and_dedup_id_keys() {
        let secret = secret();
        let copy = Message::new("new-id", "body")
            .with_deduplication_id("new-dedup")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, carry_key(&secret, "body", "orig:inal"));
        let s = Some(&secret);
        assert_eq!(
            KeySource::MessageId.extract_with(&copy, s).unwrap(),
            "orig:inal"
        );
        assert_eq!(
            KeySource::DeduplicationId.extract_with(&copy, s).unwrap(),
            "orig:inal"
        );
        // Without the secret a carried key is not honoured at all.
        assert_eq!(KeySource::MessageId.extract(&copy).unwrap(), "new-id");
        assert_eq!(
            KeySource::MessageId.extract_with(&copy, None).unwrap(),
            "new-id"
        );
        // Sources that read the body or a producer's attribute ignore it.
        assert_eq!(
            KeySource::BodySha256.extract_with(&copy, s).unwrap(),
            sha256_hex(b"body")
        );
    }

    #[test]
    fn a_producer_cannot_make_a_message_carry_another_messages_key() {
        let secret = secret();
        let s = Some(&secret);
        let body = r#"{"attacker":1}"#;
        let other = CarrySecret::new("o".repeat(MIN_SECRET_BYTES)).unwrap();
        let forgeries = [
            // What the body's own hash used to be enough for.
            format!("{}:victim-id", &sha256_hex(body.as_bytes())[..16]),
            format!("{}:victim-id", sha256_hex(body.as_bytes())),
            // Sealed under a secret the consumer does not hold.
            carry_key(&other, body, "victim-id"),
            // Sealed for another body (forwarded from a parked copy).
            carry_key(&secret, "the victim's body", "victim-id"),
            // Sealed as the other attribute.
            carry_message_id(&secret, body, "victim-id"),
            // A valid seal with its value changed.
            carry_key(&secret, body, "own-key").replace("own-key", "victim-id"),
            "victim-id".to_owned(),
            ":victim-id".to_owned(),
        ];
        for forged in forgeries {
            // Each forgery in both attributes (a seal made for the one in the other).
            let swapped = carry_key(&secret, body, "victim-id");
            let as_id = if forged == carry_message_id(&secret, body, "victim-id") {
                swapped
            } else {
                forged.clone()
            };
            let m = Message::new("own-id", body)
                .with_deduplication_id("own-dedup")
                .with_attribute(DEDUP_KEY_ATTRIBUTE, forged.clone())
                .with_attribute(MESSAGE_ID_ATTRIBUTE, as_id);
            assert_eq!(
                KeySource::MessageId.extract_with(&m, s).unwrap(),
                "own-id",
                "{forged}"
            );
            assert_eq!(
                KeySource::DeduplicationId.extract_with(&m, s).unwrap(),
                "own-dedup",
                "{forged}"
            );
            assert_eq!(carried_message_id(&m, s), None, "{forged}");
            assert_eq!(
                unverified_attributes(&m, s),
                vec![DEDUP_KEY_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE],
                "{forged}"
            );
        }
        // A sealed message id moved into the key's place does not verify either.
        let m = Message::new("own-id", body).with_attribute(
            MESSAGE_ID_ATTRIBUTE,
            carry_message_id(&secret, body, "first"),
        );
        assert_eq!(carried_message_id(&m, s), Some("first"));
        assert!(unverified_attributes(&m, s).is_empty());
        assert_eq!(unverified_attributes(&m, None), vec![MESSAGE_ID_ATTRIBUTE]);
    }

    #[test]
    fn secrets_rotate_and_are_never_shown() {
        let old = "o".repeat(40);
        let new = "n".repeat(40);
        let before = CarrySecret::parse(&old).unwrap();
        let during = CarrySecret::parse(&format!("{new}, {old}")).unwrap();
        let after = CarrySecret::parse(&new).unwrap();
        let sealed_before = carry_key(&before, "b", "k");
        let sealed_during = carry_key(&during, "b", "k");
        assert_eq!(
            during.open(DEDUP_KEY_ATTRIBUTE, "b", &sealed_before),
            Some("k")
        );
        assert_eq!(
            after.open(DEDUP_KEY_ATTRIBUTE, "b", &sealed_during),
            Some("k")
        );
        assert_eq!(after.open(DEDUP_KEY_ATTRIBUTE, "b", &sealed_before), None);
        assert!(!format!("{during:?}").contains(&old));
        assert_eq!(
            CarrySecret::parse(" , ").err(),
            Some(CarrySecretError::Empty)
        );
        assert_eq!(
            CarrySecret::parse(&format!("{new},short")).err(),
            Some(CarrySecretError::TooShort {
                position: 2,
                bytes: 5
            })
        );
        let err = CarrySecret::parse("short-secret").unwrap_err().to_string();
        assert!(!err.contains("short-secret"), "{err}");
    }
}
