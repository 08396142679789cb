//! Processor settings, validated once at start-up.

use std::time::Duration;

use crate::protocol::envelope::Opened;
use crate::protocol::key::{CarrySecret, KeyError};
use crate::protocol::limits::SQS_MAX_VISIBILITY;
use crate::protocol::message::Envelope;
pub use crate::protocol::queue::LONGEST_TTL;
use crate::{KeySource, Message};

/// What to do with a message from which no dedup key can be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKey {
    /// Permanent failure: park it in the DLQ with the reason (the default).
    #[default]
    Park,
    /// Run the handler without dedup protection, with a warning.
    ProcessUnprotected,
}

/// What to do with a message whose dedup key was recorded for a different
/// body: a producer reusing a key for other content. Either way it is counted
/// (`PayloadMismatches`) and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PayloadMismatch {
    /// Treat it as the duplicate its key says it is (the default): its body
    /// is dropped, with a warning and a count. Right where producers send
    /// one event with fields that change between sends, and where a
    /// second stage may get a re-applied event's new body under its old
    /// outbox id; wrong where another producer can reuse a key (see the
    /// threat model in docs/DESIGN.md).
    #[default]
    Warn,
    /// Park it in the DLQ with the reason, for someone to look at: a
    /// different body under a known key is never dropped silently. The
    /// record of the first body is left as it is.
    Park,
}

impl PayloadMismatch {
    /// Each value's name in `SQS_ONCE_PAYLOAD_MISMATCH`.
    pub const CHOICES: &[(&str, Self)] = &[("warn", Self::Warn), ("park", Self::Park)];
}

/// How the processor claims, retries and records. Every runtime builds one.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProcessorConfig {
    /// The namespace of this consumer's records (`SQS_ONCE_CONSUMER`).
    pub consumer: String,
    /// Where the dedup key comes from (`SQS_ONCE_DEDUP_KEY`).
    pub key_source: KeySource,
    /// What a keyless message gets.
    pub missing_key: MissingKey,
    /// What wraps the payload in a body (`SQS_ONCE_ENVELOPE`, default
    /// none): opened before the key is read and the handler runs.
    pub envelope: Envelope,
    /// How long a claim holds the key before another consumer may take over
    /// (`SQS_ONCE_LEASE`, default 60 s).
    pub lease: Duration,
    /// How long records are kept (`SQS_ONCE_TTL`); must exceed the queue's
    /// retention plus its DLQ's, so no copy of a message comes back after
    /// its record expired. Default: [`LONGEST_TTL`] (43 days: longer than
    /// any queue SQS allows can keep a copy), fitted at start-up by
    /// [`SqsOnce`](crate::SqsOnce) to the queue's retention plus its DLQ's
    /// plus a day while [`Self::fit_ttl`] is on.
    pub ttl: Duration,
    /// Whether the front door ([`SqsOnce`](crate::SqsOnce)) replaces
    /// [`Self::ttl`] at start-up by the queue's retention plus its DLQ's
    /// plus a day, read from SQS (on by default; off once a TTL is set by
    /// `SQS_ONCE_TTL` or [`SqsOnce::ttl`](crate::SqsOnce::ttl)). When the
    /// retention cannot be read the TTL stays [`LONGEST_TTL`].
    pub fit_ttl: bool,
    /// How often a running handler's lease (and visibility) is extended
    /// (`SQS_ONCE_HEARTBEAT`, default 20 s); must be below the lease.
    pub heartbeat: Duration,
    /// How long before its lease ends, by this host's clock, a handler whose
    /// lease could not be extended is interrupted (`SQS_ONCE_LEASE_MARGIN`,
    /// default 5 s): room for clock skew between consumers, so that the handler
    /// has stopped before another consumer can take the key over. Never more
    /// than a tenth of the lease actually granted.
    pub lease_margin: Duration,
    /// The longest a handler's lease and visibility are extended in total (default
    /// and cap: SQS's 12 hours).
    pub max_extension: Duration,
    /// The first retry delay; doubled per receive (default 2 s).
    pub backoff_base: Duration,
    /// The longest retry delay (default 15 min; `SQS_ONCE_BACKOFF_MAX`).
    pub backoff_max: Duration,
    /// The longest retry delay after the store refused a write for
    /// contention on an item ([`StoreError::Busy`](crate::StoreError::Busy):
    /// a transaction conflict on a hot item), default 30 s. Such a retry
    /// waits about half of [`backoff`](Self::backoff), spread per message,
    /// up to this.
    pub busy_backoff_max: Duration,
    /// Results whose JSON is larger are stored as a digest (default 32 KiB).
    pub max_result_bytes: usize,
    /// Use the one-transaction fast path for handlers whose effects are
    /// [`Effects::StagedOnly`](crate::Effects::StagedOnly) (`SQS_ONCE_FAST_PATH`,
    /// default true). Off, every handler is claimed first.
    pub fast_path: bool,
    /// A duplicate (or a message in flight elsewhere) whose body differs from
    /// the recorded one (`SQS_ONCE_PAYLOAD_MISMATCH`: `warn`, the default, or
    /// `park`).
    pub payload_mismatch: PayloadMismatch,
    /// JSON pointers to the parts of the payload that tell "same key,
    /// different payload" (`SQS_ONCE_PAYLOAD_POINTERS`, comma-separated;
    /// default none: the whole payload). When set, the recorded payload hash
    /// covers the values at these pointers only (compared as JSON values, a
    /// missing one apart from `null`), so fields that change between sends
    /// of one event (a timestamp, a trace id) are not a mismatch. A payload
    /// that is not JSON is hashed whole.
    pub payload_pointers: Vec<String>,
    /// Seals the dedup key and first message id a parked copy carries, and
    /// verifies them on a copy brought back (`SQS_ONCE_CARRY_SECRET`). Without
    /// it nothing carried is honoured: under `message-id` and `dedup-id` keys a
    /// copy brought back from the DLQ is processed under a new key.
    pub carry_secret: Option<CarrySecret>,
    /// Store and show a SHA-256 of each dedup key instead of the key
    /// (`SQS_ONCE_HASH_KEYS`, default off): the record's `pk` is
    /// `{consumer}#sha256:{hex}` and logs and span attributes show
    /// `sha256:{hex}`. Pseudonymisation, not anonymisation: a guessable key
    /// (an order number) is found by hashing guesses. Turning it on or off
    /// changes every record's key: see the operations guide before changing
    /// it under a live queue.
    pub hash_keys: bool,
    /// Keep handler error text out of records, DLQ reasons, logs and span
    /// status (`SQS_ONCE_REDACT_REASONS`, default off): a fixed text names
    /// the failure's kind (permanent or transient) and the error's type
    /// instead. Panic messages are left out too.
    pub redact_reasons: bool,
    /// Let a producer's `traceparent` (or `AWSTraceHeader`) sampled flag
    /// decide whether a message's span is sampled
    /// (`SQS_ONCE_TRUST_PRODUCER_SAMPLING`, default off). Off, the span stays
    /// in the producer's trace but the consumer's own sampler decides (see
    /// `sqs_once::otel::MessageSampler`): a producer can neither force its
    /// messages to be traced nor keep them out of the traces.
    pub trust_producer_sampling: bool,
}

impl ProcessorConfig {
    /// The TTL each record write carries: [`Self::ttl`]. (The `short-ttl`
    /// mutant, for the simulator only, writes a twentieth of it.)
    pub(crate) fn record_ttl(&self) -> Duration {
        if crate::protocol::mutants::active("short-ttl") {
            return self.ttl / 20;
        }
        self.ttl
    }

    /// This config's identity while it lives (its address): a key read by
    /// it for the lane split is taken as read only by the processor that
    /// holds this very config.
    pub(crate) fn identity(&self) -> usize {
        std::ptr::from_ref(self) as usize
    }

    /// Defaults for a consumer name.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            key_source: KeySource::default(),
            missing_key: MissingKey::default(),
            envelope: Envelope::default(),
            lease: Duration::from_secs(60),
            ttl: LONGEST_TTL,
            fit_ttl: true,
            heartbeat: Duration::from_secs(20),
            lease_margin: Duration::from_secs(5),
            max_extension: SQS_MAX_VISIBILITY,
            backoff_base: Duration::from_secs(2),
            backoff_max: Duration::from_secs(15 * 60),
            busy_backoff_max: Duration::from_secs(30),
            max_result_bytes: 32 * 1024,
            fast_path: true,
            payload_mismatch: PayloadMismatch::Warn,
            payload_pointers: Vec::new(),
            carry_secret: None,
            hash_keys: false,
            redact_reasons: false,
            trust_producer_sampling: false,
        }
    }

    /// The record key (`pk`) of `dedup_key`: hashed when [`Self::hash_keys`]
    /// says so (see [`crate::protocol::key::record_key`]).
    pub fn record_key(&self, dedup_key: &str) -> String {
        if self.hash_keys {
            crate::protocol::key::hashed_record_key(&self.consumer, dedup_key)
        } else {
            crate::protocol::key::record_key(&self.consumer, dedup_key)
        }
    }

    /// `dedup_key` as logs, span attributes and reasons show it: as is, or
    /// `sha256:{hex}` when [`Self::hash_keys`] says so.
    pub fn shown_key<'a>(&self, dedup_key: &'a str) -> std::borrow::Cow<'a, str> {
        if self.hash_keys {
            crate::protocol::key::hashed_key(dedup_key).into()
        } else {
            dedup_key.into()
        }
    }

    /// The dedup key of `message` (a carried key honoured when it verifies
    /// under [`Self::carry_secret`]), read from the payload inside
    /// [`Self::envelope`] (opened here when it is not yet).
    pub fn dedup_key(&self, message: &Message) -> Result<String, KeyError> {
        // Keys that never read the payload are taken from the message as
        // received: the message and dedup ids, and attributes (but under SNS,
        // whose attributes are inside the envelope). So a duplicate whose
        // large payload is gone (its body a pointer) keeps its key.
        let outside = match &self.key_source {
            KeySource::MessageId | KeySource::DeduplicationId => true,
            source => source.is_body_free() && self.envelope != Envelope::Sns,
        };
        // `body-sha256` under an envelope hashes the body as received: the
        // payload alone would make two events with one payload (another type,
        // source or topic) one key.
        if outside || (self.key_source == KeySource::BodySha256 && self.envelope != Envelope::None)
        {
            return self
                .key_source
                .extract_with(&message.as_received(), self.carry_secret.as_ref());
        }
        let opened = self.opened(message)?;
        self.key_source
            .extract_with(&opened, self.carry_secret.as_ref())
    }

    /// The SHA-256 recorded with a message's key, that tells a duplicate
    /// from a reuse of the key for another payload: of the payload inside
    /// [`Self::envelope`].
    /// With [`Self::payload_pointers`], of the values at those pointers.
    pub fn payload_sha256(&self, message: &Message) -> String {
        let opened = self.opened(message);
        let body = match &opened {
            Ok(opened) => opened.body(),
            Err(_) => message.body(),
        };
        let selected = (!self.payload_pointers.is_empty())
            .then(|| serde_json::from_str::<serde_json::Value>(body).ok())
            .flatten()
            .map(|payload| selected_parts(&payload, &self.payload_pointers));
        let hashed = selected.as_deref().unwrap_or(body);
        crate::protocol::key::sha256_hex(hashed.as_bytes())
    }

    /// `message` with [`Self::envelope`] opened, borrowed when there is
    /// nothing to open.
    fn opened<'a>(&self, message: &'a Message) -> Result<std::borrow::Cow<'a, Message>, KeyError> {
        if self.envelope == Envelope::None || message.envelope().is_some() {
            return Ok(std::borrow::Cow::Borrowed(message));
        }
        match self.envelope.open(message.clone()) {
            Ok(Opened::Payload(m)) => Ok(std::borrow::Cow::Owned(m)),
            Ok(Opened::S3TestEvent) => Err(KeyError::Envelope(
                "S3's test event (s3:TestEvent) has no payload".to_owned(),
            )),
            Err(e) => Err(KeyError::Envelope(e.to_string())),
        }
    }

    /// Rejects invalid combinations with a message naming the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |setting: &'static str, problem: String| Err(ConfigError { setting, problem });
        if self.consumer.is_empty() || self.consumer.contains('#') {
            return bad(
                "SQS_ONCE_CONSUMER",
                format!("{:?}: must be non-empty and contain no `#`", self.consumer),
            );
        }
        if self.lease < Duration::from_secs(1) {
            return bad("SQS_ONCE_LEASE", format!("{:?} is below 1s", self.lease));
        }
        if self.heartbeat.is_zero() || self.heartbeat >= self.lease {
            return bad(
                "SQS_ONCE_HEARTBEAT",
                format!(
                    "{} must be above zero and below the lease ({}), or the lease runs out between beats",
                    humantime::format_duration(self.heartbeat),
                    humantime::format_duration(self.lease)
                ),
            );
        }
        if self.heartbeat + self.margin_for(self.lease) >= self.lease {
            return bad(
                "SQS_ONCE_HEARTBEAT",
                format!(
                    "{} plus the lease margin ({}) must be below the lease ({}), or a handler is interrupted before its first extension",
                    humantime::format_duration(self.heartbeat),
                    humantime::format_duration(self.margin_for(self.lease)),
                    humantime::format_duration(self.lease)
                ),
            );
        }
        if self.ttl <= self.lease {
            return bad(
                "SQS_ONCE_TTL",
                format!(
                    "{} must be longer than the lease ({})",
                    humantime::format_duration(self.ttl),
                    humantime::format_duration(self.lease)
                ),
            );
        }
        if self.max_extension > SQS_MAX_VISIBILITY {
            return bad(
                "ProcessorConfig::max_extension",
                "must be at most 12h (SQS's visibility cap)".to_owned(),
            );
        }
        if self.backoff_base.is_zero() || self.backoff_max < self.backoff_base {
            return bad(
                "SQS_ONCE_BACKOFF",
                format!(
                    "{:?} must be above zero and not above the maximum, SQS_ONCE_BACKOFF_MAX ({:?})",
                    self.backoff_base, self.backoff_max
                ),
            );
        }
        if self.busy_backoff_max.is_zero() {
            return bad(
                "ProcessorConfig::busy_backoff_max",
                "must be above zero".to_owned(),
            );
        }
        self.validate_keys()?;
        if self.max_result_bytes > 350 * 1024 {
            return bad(
                "ProcessorConfig::max_result_bytes",
                format!(
                    "{} leaves no room in DynamoDB's 400 KB item limit; use at most 358400",
                    self.max_result_bytes
                ),
            );
        }
        Ok(())
    }

    /// The key source and the payload pointers.
    fn validate_keys(&self) -> Result<(), ConfigError> {
        let bad = |setting: &'static str, problem: String| Err(ConfigError { setting, problem });
        if let Some(p) = self.payload_pointers.iter().find(|p| p.contains(">/")) {
            return bad(
                "SQS_ONCE_PAYLOAD_POINTERS",
                format!(
                    "{p:?}: payload pointers are plain JSON pointers; the `>/` of keys (inside a JSON string) is not read here"
                ),
            );
        }
        if let Some(p) = self.payload_pointers.iter().find(|p| !p.starts_with('/')) {
            return bad(
                "SQS_ONCE_PAYLOAD_POINTERS",
                format!(
                    "{p:?} is not a JSON pointer: each must start with `/`, e.g. /order/amount"
                ),
            );
        }
        if let KeySource::Compound(parts) = &self.key_source
            && parts.iter().any(KeySource::uses_ids)
        {
            return bad(
                "SQS_ONCE_DEDUP_KEY",
                format!(
                    "{}: `message-id` and `dedup-id` cannot be part of a compound key (a copy brought back from the DLQ has a new id, and its carried key is the whole key); use one alone",
                    self.key_source
                ),
            );
        }
        Ok(())
    }

    /// The safety margin for a granted lease: [`Self::lease_margin`], at most a
    /// tenth of the lease (a lease cut short by a Lambda deadline keeps most of
    /// its time).
    pub(crate) fn margin_for(&self, lease: Duration) -> Duration {
        self.lease_margin.min(lease / 10)
    }

    /// How often a lease of this length (and the visibility of what is held
    /// with it) is extended: the heartbeat, at most half the lease.
    pub(crate) fn beat_for(&self, lease: Duration) -> Duration {
        self.heartbeat
            .min(lease / 2)
            .max(Duration::from_millis(100))
    }

    /// The retry delay for the given receive count: exponential, capped.
    pub fn backoff(&self, receive_count: u32) -> Duration {
        let exp = receive_count.saturating_sub(1).min(20);
        self.backoff_base
            .saturating_mul(1 << exp)
            .min(self.backoff_max)
            .min(SQS_MAX_VISIBILITY)
    }

    /// The retry delay of message `message_id` on its `receive_count`th
    /// receive after the store refused a write for contention on an item
    /// ([`StoreError::Busy`](crate::StoreError::Busy)): half the backoff,
    /// spread over 0.5x to 1.5x of that by a hash of the message id and the
    /// receive count (so messages that collided come back apart, and a
    /// replay with the same ids waits the same), capped at
    /// [`busy_backoff_max`](Self::busy_backoff_max). Under one hot item the
    /// outage backoff (doubling to 15 min) leaves the item idle while its
    /// messages wait; this keeps them coming back while the item can take
    /// them.
    pub fn busy_backoff(&self, message_id: &str, receive_count: u32) -> Duration {
        let half = self.backoff(receive_count) / 2;
        // FNV-1a: a spread, not a secret.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in message_id.bytes().chain(receive_count.to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let spread = 0.5 + (h >> 11) as f64 / (1u64 << 53) as f64;
        half.mul_f64(spread)
            .min(self.busy_backoff_max)
            .max(Duration::from_millis(1))
    }

    /// The retry delay after a store call for `message` failed with `e`: the
    /// contention backoff for [`StoreError::Busy`](crate::StoreError::Busy),
    /// the backoff otherwise.
    pub fn store_backoff(&self, message: &Message, e: &super::store::StoreError) -> Duration {
        match e {
            super::store::StoreError::Busy(_) => {
                self.busy_backoff(message.id(), message.receive_count())
            }
            _ => self.backoff(message.receive_count()),
        }
    }
}

/// The values at `pointers` in `payload` as one text: a JSON array with, for
/// each pointer, `[]` when nothing is there, else `[value]`, object keys in
/// sorted order (the same values give the same text whatever order their
/// keys came in).
fn selected_parts(payload: &serde_json::Value, pointers: &[String]) -> String {
    fn canonical(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(map) => {
                let sorted: std::collections::BTreeMap<&String, serde_json::Value> =
                    map.iter().map(|(k, v)| (k, canonical(v))).collect();
                serde_json::to_value(sorted).unwrap_or_default()
            }
            serde_json::Value::Array(items) => items.iter().map(canonical).collect(),
            other => other.clone(),
        }
    }
    let parts: Vec<serde_json::Value> = pointers
        .iter()
        .map(|p| {
            let found: Vec<serde_json::Value> =
                payload.pointer(p).map(canonical).into_iter().collect();
            serde_json::Value::Array(found)
        })
        .collect();
    serde_json::Value::Array(parts).to_string()
}

/// An invalid setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting {setting}: {problem}")]
pub struct ConfigError {
    /// The setting at fault: its environment variable (`SQS_ONCE_LEASE`), or
    /// the config field (`ProcessorConfig::max_extension`) where no variable
    /// sets it.
    pub setting: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

/// Parses a duration like `500ms`, `30s`, `5m`, `7d`, naming the setting on error.
pub fn parse_duration(setting: &'static str, value: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(value.trim()).map_err(|e| ConfigError {
        setting,
        problem: format!("{value:?} is not a duration like 30s, 5m or 7d ({e})"),
    })
}

/// The words an on/off setting takes (any case): `on`/`off`, `true`/`false`,
/// `yes`/`no`, `1`/`0`, and the letters `y`/`n`, `t`/`f`.
pub const SWITCH_WORDS: &[(&str, bool)] = &[
    ("on", true),
    ("off", false),
    ("true", true),
    ("false", false),
    ("yes", true),
    ("no", false),
    ("1", true),
    ("0", false),
    ("y", true),
    ("n", false),
    ("t", true),
    ("f", false),
];

/// Parses an on/off setting ([`SWITCH_WORDS`]), naming the setting on error.
pub fn parse_switch(setting: &'static str, value: &str) -> Result<bool, ConfigError> {
    let word = value.trim();
    SWITCH_WORDS
        .iter()
        .find(|(w, _)| w.eq_ignore_ascii_case(word))
        .map(|(_, on)| *on)
        .ok_or_else(|| ConfigError {
            setting,
            problem: format!("{value:?} is not on or off (on/off, true/false, yes/no or 1/0)"),
        })
}

/// Parses a whole number (`10`, `1048576`), naming the setting on error.
pub fn parse_number(setting: &'static str, value: &str) -> Result<usize, ConfigError> {
    value.trim().parse().map_err(|e| ConfigError {
        setting,
        problem: format!("{value:?} is not a whole number ({e})"),
    })
}

/// Parses one of a setting's fixed values (`choices`: each name and its
/// value, names matched exactly), naming the setting and the choices on error.
pub fn parse_choice<T: Clone>(
    setting: &'static str,
    choices: &[(&str, T)],
    value: &str,
) -> Result<T, ConfigError> {
    choices
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, v)| v.clone())
        .ok_or_else(|| ConfigError {
            setting,
            problem: format!(
                "{value:?} is not one of {}",
                choices
                    .iter()
                    .map(|(name, _)| *name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
}

/// `SQS_ONCE_HEALTH_PORT` as `var` gives it (the settings and the front
/// door read it alike).
#[cfg(any(feature = "poller", feature = "lambda"))]
pub(crate) fn health_port_from(
    var: &impl Fn(&str) -> Option<String>,
) -> Result<Option<u16>, ConfigError> {
    const NAME: &str = "SQS_ONCE_HEALTH_PORT";
    var(NAME)
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim().parse::<u16>().map_err(|_| ConfigError {
                setting: NAME,
                problem: format!("{t:?} is not a port number (1 to 65535)"),
            })
        })
        .transpose()
}

/// `SQS_ONCE_HEALTH_MAX_AGE` as `var` gives it, with the settings' default
/// (a test holds the two together).
#[cfg(feature = "poller")]
pub(crate) fn health_max_age_from(
    var: &impl Fn(&str) -> Option<String>,
) -> Result<Duration, ConfigError> {
    const NAME: &str = "SQS_ONCE_HEALTH_MAX_AGE";
    parse_duration(NAME, var(NAME).as_deref().unwrap_or("60s"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_combinations_name_the_setting() {
        ProcessorConfig::new("c").validate().unwrap();
        let mut c = ProcessorConfig::new("c");
        c.heartbeat = c.lease;
        assert_eq!(c.validate().unwrap_err().setting, "SQS_ONCE_HEARTBEAT");
        let mut c = ProcessorConfig::new("c");
        c.ttl = Duration::from_secs(30);
        assert_eq!(c.validate().unwrap_err().setting, "SQS_ONCE_TTL");
        assert_eq!(
            ProcessorConfig::new("a#b").validate().unwrap_err().setting,
            "SQS_ONCE_CONSUMER"
        );
        assert!(parse_duration("SQS_ONCE_TTL", "7d").unwrap() == Duration::from_secs(604_800));
        assert_eq!(
            parse_duration("SQS_ONCE_TTL", "soon").unwrap_err().setting,
            "SQS_ONCE_TTL"
        );
    }

    #[test]
    fn payload_pointers_hash_only_their_parts() {
        let mut c = ProcessorConfig::new("c");
        c.payload_pointers = vec!["/order/amount".into(), "/order/items".into()];
        let hash_with =
            |c: &ProcessorConfig, body: &str| c.payload_sha256(&Message::new("m", body));
        let hash = |body: &str| hash_with(&c, body);
        let base = hash(r#"{"order":{"amount":5,"items":[{"a":1,"b":2}]},"sentAt":"t1"}"#);
        // Outside the pointers, and key order inside them: the same.
        assert_eq!(
            base,
            hash(r#"{"sentAt":"t2","order":{"items":[{"b":2,"a":1}],"amount":5,"note":"x"}}"#)
        );
        // Inside them: different, and missing is not null.
        assert_ne!(
            base,
            hash(r#"{"order":{"amount":6,"items":[{"a":1,"b":2}]}}"#)
        );
        let missing = hash(r#"{"order":{"items":[{"a":1,"b":2}]}}"#);
        let null = hash(r#"{"order":{"amount":null,"items":[{"a":1,"b":2}]}}"#);
        assert_ne!(missing, null);
        // Not JSON: the whole body.
        assert_eq!(hash("text"), crate::protocol::key::sha256_hex(b"text"));
        // Without pointers: the whole body.
        c.payload_pointers.clear();
        assert_ne!(
            hash_with(&c, r#"{"a":1,"t":1}"#),
            hash_with(&c, r#"{"a":1,"t":2}"#)
        );
        c.payload_pointers = vec!["order".into()];
        assert_eq!(
            c.validate().unwrap_err().setting,
            "SQS_ONCE_PAYLOAD_POINTERS"
        );
    }

    #[test]
    fn backoff_doubles_and_is_capped() {
        let c = ProcessorConfig::new("c");
        assert_eq!(c.backoff(1), Duration::from_secs(2));
        assert_eq!(c.backoff(3), Duration::from_secs(8));
        assert_eq!(c.backoff(1000), Duration::from_secs(900));
    }

    #[test]
    fn a_store_busy_for_contention_retries_sooner_and_capped() {
        let c = ProcessorConfig::new("t");
        let busy = super::super::store::StoreError::Busy("TransactionConflict".into());
        let down = super::super::store::StoreError::Unavailable("InternalServerError".into());
        let received = |id: &str, n: u32| Message::new(id, "{}").with_receive_count(n);
        // Half the backoff, spread 0.5x to 1.5x per message, capped.
        let within =
            |d: Duration, half: f64| d.as_secs_f64() >= half * 0.5 && d.as_secs_f64() < half * 1.5;
        for n in 1..=5u32 {
            let half = f64::from(1u32 << (n - 1));
            let delays: Vec<Duration> = (0..50)
                .map(|i| c.store_backoff(&received(&format!("m{i}"), n), &busy))
                .collect();
            assert!(delays.iter().all(|d| within(*d, half)), "{n}: {delays:?}");
            let mean = delays.iter().map(Duration::as_secs_f64).sum::<f64>() / 50.0;
            assert!((mean / half - 1.0).abs() < 0.2, "{n}: mean {mean}");
            assert!(delays.iter().any(|d| *d != delays[0]), "not spread");
        }
        // The same message and count: the same delay (replays wait alike).
        assert_eq!(
            c.store_backoff(&received("m1", 3), &busy),
            c.store_backoff(&received("m1", 3), &busy)
        );
        assert_eq!(
            c.store_backoff(&received("m1", 1000), &busy),
            Duration::from_secs(30)
        );
        // Any other store error: the outage backoff.
        assert_eq!(
            c.store_backoff(&received("m1", 6), &down),
            Duration::from_secs(64)
        );
        let mut bad = ProcessorConfig::new("t");
        bad.busy_backoff_max = Duration::ZERO;
        assert!(bad.validate().is_err());
    }
}
