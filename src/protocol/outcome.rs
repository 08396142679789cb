//! What processing decided for one message: the protocol's answer to the
//! runtimes, which turn it into a delete, a later retry or a park.

use std::time::Duration;

use crate::protocol::store::StoredResult;

/// What the runtime must do with a message after processing.
#[derive(Debug, Clone, PartialEq)]
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

impl Outcome {
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
