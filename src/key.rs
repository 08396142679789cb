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
///
/// A producer that sends the same business event twice creates two message ids:
/// only a business id from the producer (`json:` or `attribute:`) catches that.
/// A producer that mints a new id on every retry defeats any key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
}

/// Why no dedup key could be taken from a message. A permanent failure: the same
/// message will never yield a key on redelivery.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
}

impl KeySource {
    /// Takes the dedup key from a message.
    pub fn extract(&self, message: &Message) -> Result<String, KeyError> {
        let key = match self {
            // A copy brought back from the DLQ has a new message id (and maybe
            // no deduplication id): it carries the original's key instead.
            KeySource::MessageId => match carried_key(message) {
                Some(original) => original.to_owned(),
                None => message.id().to_owned(),
            },
            KeySource::DeduplicationId => match carried_key(message) {
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
/// sources only: the other sources find their key in the body or attributes,
/// which parking keeps exactly. Its value is bound to the body (see
/// [`carry_key`]): copied onto another message it is ignored.
pub const DEDUP_KEY_ATTRIBUTE: &str = "sqs_once_dedup_key";

/// The value of [`DEDUP_KEY_ATTRIBUTE`] for `key` on a message with `body`:
/// the first 16 hex digits of the body's SHA-256, a colon, then the key.
pub fn carry_key(body: &str, key: &str) -> String {
    format!("{}:{key}", &sha256_hex(body.as_bytes())[..16])
}

/// The key a parked copy carries, if it carries one made for its own body (a
/// handler or bridge that forwards received attributes onto other messages
/// must not give them all one key).
pub(crate) fn carried_key(message: &Message) -> Option<&str> {
    let (tag, key) = message.attribute(DEDUP_KEY_ATTRIBUTE)?.split_once(':')?;
    (tag == &sha256_hex(message.body().as_bytes())[..16] && !key.is_empty()).then_some(key)
}

/// The key at a JSON pointer, numbers as their exact text: the body is walked
/// as raw JSON, so `12345678901234567890123` and `...124` stay apart (an `f64`
/// would make them one key). Integers within `i64`/`u64` render as before.
fn json_key(body: &str, pointer: &str) -> Result<String, KeyError> {
    use serde_json::value::RawValue;
    let not_json = |e: serde_json::Error| KeyError::BodyNotJson {
        pointer: pointer.to_owned(),
        reason: e.to_string(),
    };
    let missing = || KeyError::MissingPointer(pointer.to_owned());
    let mut raw: &RawValue = serde_json::from_str(body).map_err(not_json)?;
    for token in pointer.split('/').skip(1) {
        let token = token.replace("~1", "/").replace("~0", "~");
        let text = raw.get().trim_start();
        raw = if text.starts_with('{') {
            let mut object: std::collections::HashMap<String, &RawValue> =
                serde_json::from_str(raw.get()).map_err(not_json)?;
            object.remove(&token).ok_or_else(missing)?
        } else if text.starts_with('[') {
            let array: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(not_json)?;
            let valid_index = !token.is_empty()
                && token.bytes().all(|b| b.is_ascii_digit())
                && (token == "0" || !token.starts_with('0'));
            let i: usize = valid_index
                .then(|| token.parse().ok())
                .flatten()
                .ok_or_else(missing)?;
            *array.get(i).ok_or_else(missing)?
        } else {
            return Err(missing());
        };
    }
    let value: serde_json::Value = serde_json::from_str(raw.get()).map_err(not_json)?;
    match value {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        serde_json::Value::Number(_) => Ok(raw.get().trim().to_owned()),
        other => Err(KeyError::NotScalar {
            pointer: pointer.to_owned(),
            found: json_kind(&other),
        }),
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
        }
    }
}

/// An unparseable key source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid dedup key source `{0}`: expected `message-id`, `dedup-id`, `attribute:NAME`, `json:/pointer` or `body-sha256`"
)]
pub struct KeySourceParseError(String);

impl FromStr for KeySource {
    type Err = KeySourceParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || KeySourceParseError(s.to_owned());
        match s {
            "message-id" => Ok(KeySource::MessageId),
            "dedup-id" => Ok(KeySource::DeduplicationId),
            "body-sha256" => Ok(KeySource::BodySha256),
            _ => {
                if let Some(name) = s.strip_prefix("attribute:") {
                    if name.is_empty() {
                        return Err(bad());
                    }
                    Ok(KeySource::Attribute(name.to_owned()))
                } else if let Some(pointer) = s.strip_prefix("json:") {
                    if !pointer.starts_with('/') {
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
        format!(
            "{consumer}#{HASHED_PREFIX}{}",
            sha256_hex(dedup_key.as_bytes())
        )
    }
}

/// The stable idempotency key to pass downstream (`Idempotency-Key` header):
/// the same for every delivery of one logical message to one consumer.
pub fn idempotency_key(consumer: &str, dedup_key: &str) -> String {
    let digest = sha256_hex(format!("{consumer}#{dedup_key}").as_bytes());
    format!("sqs-once-{}", &digest[..40])
}

/// Lower-case hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn a_short_key_that_looks_hashed_does_not_share_a_hashed_long_keys_record() {
        let long = "x".repeat(5000);
        let hashed = record_key("c", &long);
        let lookalike = hashed.strip_prefix("c#").unwrap();
        assert_ne!(record_key("c", lookalike), hashed);
    }

    #[test]
    fn a_copy_back_from_the_dlq_keeps_the_original_message_id_and_dedup_id_keys() {
        let copy = Message::new("new-id", "body")
            .with_deduplication_id("new-dedup")
            .with_attribute(DEDUP_KEY_ATTRIBUTE, carry_key("body", "orig:inal"));
        assert_eq!(KeySource::MessageId.extract(&copy).unwrap(), "orig:inal");
        assert_eq!(
            KeySource::DeduplicationId.extract(&copy).unwrap(),
            "orig:inal"
        );
        // Forwarded onto another body, or bare, it is ignored.
        for forged in [carry_key("other body", "orig:inal"), "original".to_owned()] {
            let m = Message::new("id-2", "body").with_attribute(DEDUP_KEY_ATTRIBUTE, forged);
            assert_eq!(KeySource::MessageId.extract(&m).unwrap(), "id-2");
        }
        // Sources that read the body or a producer's attribute ignore it.
        assert_eq!(
            KeySource::BodySha256.extract(&copy).unwrap(),
            sha256_hex(b"body")
        );
    }
}
