//! The vocabulary of what one message's processing comes to: the handler's
//! staged writes and failure kinds, the result as recorded, and the
//! [`Outcome`] the runtimes turn into a delete, a later retry or a park.
//! It sits at the bottom of the protocol core: the store, the handler's
//! context, the metrics and the traces all speak it.

use std::time::Duration;

use aws_sdk_dynamodb::types::TransactWriteItem;

/// What should happen to a message whose handler failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureKind {
    /// Try again later, with backoff from the receive count.
    Retry,
    /// Try again after this delay (capped at SQS's 12 hours).
    RetryAfter(Duration),
    /// Never retry: record `FAILED` and park the message in the DLQ with the reason.
    Permanent,
}

/// A DynamoDB write staged by the handler, committed in the same
/// `TransactWriteItems` call as the `COMPLETED` dedup record.
#[derive(Debug, Clone)]
pub struct StagedWrite {
    /// The write (put, update, delete or condition check).
    pub item: TransactWriteItem,
    /// What a failure of this write's own condition means.
    pub on_condition_failed: FailureKind,
}

/// A handler result as recorded: the value itself, or its digest when larger
/// than the configured bound.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StoredResult {
    /// The result, as JSON.
    Value(serde_json::Value),
    /// A result too large to store: its SHA-256 and size.
    Digest {
        /// Hex SHA-256 of the JSON text.
        sha256: String,
        /// Size of the JSON text in bytes.
        bytes: u64,
    },
}

impl StoredResult {
    /// Stores `value` as is when its JSON text is at most `max_bytes`, else as a digest.
    pub fn bounded(value: &serde_json::Value, max_bytes: usize) -> Self {
        let text = value.to_string();
        if text.len() <= max_bytes {
            StoredResult::Value(value.clone())
        } else {
            StoredResult::Digest {
                sha256: crate::protocol::key::sha256_hex(text.as_bytes()),
                bytes: text.len() as u64,
            }
        }
    }
}

/// What the runtime must do with a message after processing.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The effect is recorded: delete the message.
    Completed {
        /// The recorded result.
        result: Option<StoredResult>,
    },
    /// Already completed earlier: delete the message without running the handler.
    Duplicate {
        /// The result recorded by the first run.
        result: Option<StoredResult>,
        /// False when the record was made by a different body (a producer bug,
        /// logged as such); the message is still treated as a duplicate.
        payload_matches: bool,
    },
    /// Another consumer holds the claim: make the message visible again when that
    /// lease ends, or after the backoff if that comes first.
    InFlight {
        /// Time until the other lease ends, capped by the backoff.
        retry_after: Duration,
    },
    /// Not done: make the message visible again after this delay.
    Retry {
        /// The delay (backoff from the receive count, or the handler's).
        after: Duration,
        /// Why.
        reason: String,
    },
    /// Permanent failure: send the message to the DLQ with the reason, then delete it.
    Park {
        /// Why, for the DLQ and the logs.
        reason: String,
    },
}

/// An [`Outcome`]'s variant, without its data (for counting).
#[cfg(any(feature = "poller", feature = "lambda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutcomeKind {
    /// [`Outcome::Completed`].
    Completed,
    /// [`Outcome::Duplicate`].
    Duplicate,
    /// [`Outcome::InFlight`].
    InFlight,
    /// [`Outcome::Retry`].
    Retry,
    /// [`Outcome::Park`].
    Park,
}

impl Outcome {
    /// The variant, without its data.
    #[cfg(any(feature = "poller", feature = "lambda"))]
    pub(crate) fn kind(&self) -> OutcomeKind {
        match self {
            Outcome::Completed { .. } => OutcomeKind::Completed,
            Outcome::Duplicate { .. } => OutcomeKind::Duplicate,
            Outcome::InFlight { .. } => OutcomeKind::InFlight,
            Outcome::Retry { .. } => OutcomeKind::Retry,
            Outcome::Park { .. } => OutcomeKind::Park,
        }
    }

    /// Whether the message is finished with (delete it; for `Park`, after the DLQ send).
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            Outcome::Completed { .. } | Outcome::Duplicate { .. } | Outcome::Park { .. }
        )
    }

    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::InFlight { .. } => "in_flight",
            Outcome::Retry { .. } => "retry",
            Outcome::Park { .. } => "parked",
        }
    }
}
