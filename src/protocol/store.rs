//! The dedup store: the claim protocol (docs/DESIGN.md), behind one trait.
//!
//! One record per logical message, keyed `{consumer}#{dedup_key}`:
//!
//! 1. **Claim** before any side effect. A conditional write takes the key when it
//!    is absent, expired (by the clock), `FAILED`, or `IN_PROGRESS` with a lease
//!    that has run out; otherwise the old record says what the message is:
//!    [`Claim::Duplicate`] (completed), [`Claim::InFlight`] (someone else holds a
//!    live lease). Every claim attempt carries a fresh random `owner` token: the
//!    fencing token of the record's own writes. Every claim also stores a
//!    `fence`, a number one above the stored one (or, on a record made where
//!    none is, the clock's: [`FENCE_PER_MS`]), that the handler can send to an
//!    API outside DynamoDB for it to refuse an older holder
//!    ([`Context::fence`](crate::Context::fence)).
//! 2. **Complete** (status `COMPLETED`, the result, staged writes in the same
//!    transaction), **release** (lease ended so a redelivery can run) and
//!    **mark failed** only succeed while `owner` is still our token.
//! 3. **Unknown outcomes** (a timeout after the write may have committed) are
//!    retried with the *same* token; a conditional failure whose old record
//!    carries our token means the first attempt won.
//!
//! [`DynamoStore`](crate::DynamoStore) is the real implementation;
//! The test kit's `MemoryStore` has the same semantics for fast tests.
//! Both share [`decide_conflict`], so the outcome of a lost race is decided in
//! one place.

use std::future::Future;
use std::time::Duration;

use crate::protocol::limits::{
    DYNAMODB_MAX_ITEM_BYTES, DYNAMODB_MAX_TRANSACTION_BYTES, DYNAMODB_MAX_TRANSACTION_ITEMS,
    write_size,
};
use crate::protocol::outbox::{Outgoing, outbox_bytes};
use crate::protocol::outcome::{FailureKind, StagedWrite, StoredResult};

/// `IN_PROGRESS`, `COMPLETED` or `FAILED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// Claimed; the owner's lease says until when.
    InProgress,
    /// Done; duplicates are skipped.
    Completed,
    /// Failed permanently; kept for inspection; does not block a redriven message.
    Failed,
}

impl Status {
    /// The stored string.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::InProgress => "IN_PROGRESS",
            Status::Completed => "COMPLETED",
            Status::Failed => "FAILED",
        }
    }

    /// Parses the stored string.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "IN_PROGRESS" => Some(Status::InProgress),
            "COMPLETED" => Some(Status::Completed),
            "FAILED" => Some(Status::Failed),
            _ => None,
        }
    }
}

/// One dedup record, as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// `{consumer}#{dedup_key}` (hashed when too long).
    pub pk: String,
    /// The state.
    pub status: Status,
    /// The fencing token of the latest claim.
    pub owner: Option<String>,
    /// Lease end, epoch milliseconds.
    pub lease_until_ms: i64,
    /// The TTL attribute, epoch seconds.
    pub expires_at_s: i64,
    /// Claims this key has seen.
    pub attempts: u32,
    /// The fence of the latest claim or fast-path commit (see [`FENCE_PER_MS`]);
    /// 0 on a record written before fences were stored.
    pub fence: u64,
    /// SHA-256 of the body that claimed it.
    pub payload_sha256: Option<String>,
    /// The recorded result.
    pub result: Option<StoredResult>,
    /// The SQS message id of the claiming delivery.
    pub message_id: Option<String>,
    /// When it was claimed, epoch ms.
    pub claimed_at_ms: Option<i64>,
    /// When it was completed, epoch ms.
    pub completed_at_ms: Option<i64>,
    /// The last error (release or permanent failure).
    pub error: Option<String>,
    /// Messages the handler sent that are recorded but not yet marked
    /// dispatched (see [`crate::protocol::outbox`]); empty when none.
    pub outbox: Vec<Outgoing>,
}

impl Record {
    /// Whether a claim by `owner` that replaces this record takes over a
    /// claim that expired unreleased (a release sets the lease to 0).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn taken_over_by(&self, owner: &str) -> bool {
        self.status == Status::InProgress
            && self.lease_until_ms > 0
            && self.owner.as_deref() != Some(owner)
    }

    /// Whether a claim at `now_ms` by a delivery other than the one that
    /// failed (a copy brought back from the DLQ, a producer's re-send) may take
    /// this record.
    pub fn claimable(&self, now_ms: i64) -> bool {
        self.claimable_by(now_ms, "")
    }

    /// Whether a claim at `now_ms` by the delivery with `message_id` may take
    /// this record: the same predicate as the DynamoDB condition expression.
    /// A `FAILED` record is not claimable by the message that failed: that is a
    /// redelivery of a parked message (its delete after the park failed), and
    /// running it again could apply it after later messages of its group.
    ///
    /// A `FAILED` record is taken only by a claim made no earlier than the
    /// failing delivery's own claim: a claim that lands late (sent before the
    /// failure, applied after it) must not erase a failure it never saw.
    pub fn claimable_by(&self, now_ms: i64, message_id: &str) -> bool {
        self.expires_at_s < now_ms.div_euclid(1000)
            || (self.status == Status::Failed
                && !self.failed_by(message_id)
                && self.claimed_at_ms.is_none_or(|c| c <= now_ms))
            || (self.status == Status::InProgress && self.lease_until_ms < now_ms)
    }

    /// Whether this is a `FAILED` record of the delivery with `message_id`.
    pub(crate) fn failed_by(&self, message_id: &str) -> bool {
        self.status == Status::Failed && self.message_id.as_deref() == Some(message_id)
    }
}

/// The longest error text a record keeps: a huge handler error must not push
/// the record past DynamoDB's 400 KB item limit (release and mark-failed would
/// then fail).
pub const MAX_ERROR_BYTES: usize = 4096;

/// How many fences one millisecond of the clock is worth: a record made where
/// none is (a new key, or one whose record TTL deleted) starts its fence at
/// the writer's clock in milliseconds since the epoch times this; every claim
/// adds one to the stored fence; a fast-path commit stores the fence its
/// handler read, and only over a lower one. So a key's fence only grows while
/// its record lives, and after a deletion starts again above every fence the
/// deleted record held: that record lived at least its TTL past its last
/// write, which exceeds the lease, ten times the clock skew the lease margin
/// allows for, while a thousand claims per millisecond of its life would be
/// needed to reach the new start. Values stay below 2^53 (exact as a
/// JavaScript number) until the year 2255.
pub const FENCE_PER_MS: u64 = 1000;

/// The fence a record made at `now_ms` (the writer's clock) starts from, and
/// the fast path's fence: `now_ms` × [`FENCE_PER_MS`].
pub fn clock_fence(now_ms: i64) -> u64 {
    u64::try_from(now_ms)
        .unwrap_or(0)
        .saturating_mul(FENCE_PER_MS)
}

/// The fence a claim stores over `stored` (the record's fence, 0 for none,
/// or no record) at `now_ms`: one above the stored fence, or, where none is
/// stored, one above the clock's ([`clock_fence`]).
pub fn next_fence(stored: Option<u64>, now_ms: i64) -> u64 {
    match stored {
        Some(f) if f > 0 => f + 1,
        _ => clock_fence(now_ms) + 1,
    }
}

/// `error` cut to [`MAX_ERROR_BYTES`] at a character boundary, saying how long
/// it was.
pub fn bounded_error(error: &str) -> String {
    if error.len() <= MAX_ERROR_BYTES {
        return error.to_owned();
    }
    let mut end = MAX_ERROR_BYTES - 64;
    while !error.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &error[..end], error.len())
}

/// A claim attempt.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The record key.
    pub pk: String,
    /// The fresh fencing token of this attempt.
    pub owner: String,
    /// The delivery's message id (for operators).
    pub message_id: String,
    /// SHA-256 of the body.
    pub payload_sha256: String,
    /// How long nobody else may claim.
    pub lease: Duration,
    /// Retention of the record (`expires_at = now + ttl`).
    pub ttl: Duration,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Claim {
    /// We own the key: run the handler.
    Acquired {
        /// Claims this key has seen, this one included.
        attempt: u32,
        /// This claim's fence: above every fence the key had before.
        fence: u64,
    },
    /// Already completed: skip the handler.
    Duplicate {
        /// The recorded result.
        result: Option<StoredResult>,
        /// False when the record was made by a different body: a producer bug.
        payload_matches: bool,
        /// Messages the first run sent that are not yet marked dispatched:
        /// send them before the duplicate is let go.
        outbox: Vec<Outgoing>,
    },
    /// Another consumer holds a live lease: do not run; try again when it ends.
    InFlight {
        /// The other lease's end, epoch ms.
        lease_until_ms: i64,
        /// False when the record was made by a different body.
        payload_matches: bool,
    },
    /// This very delivery failed permanently before and was parked: a
    /// redelivery (the delete after the park failed). Do not run it; park it
    /// again.
    Parked {
        /// The recorded reason.
        reason: Option<String>,
    },
}

/// How a claim that lost its condition is answered, given the record that won.
/// Shared by every store so the protocol is decided in one place.
pub fn decide_conflict(old: &Record, req: &ClaimRequest, now_ms: i64) -> Claim {
    let payload_matches = old
        .payload_sha256
        .as_deref()
        .is_none_or(|p| p == req.payload_sha256);
    match old.status {
        // Our own earlier attempt committed and only its response was lost.
        Status::InProgress if old.owner.as_deref() == Some(req.owner.as_str()) => Claim::Acquired {
            attempt: old.attempts,
            fence: old.fence,
        },
        Status::Completed => Claim::Duplicate {
            result: old.result.clone(),
            payload_matches,
            outbox: old.outbox.clone(),
        },
        Status::Failed if old.failed_by(&req.message_id) => Claim::Parked {
            reason: old.error.clone(),
        },
        // A live lease, or (clock skew between us and the writer) one that looks
        // claimable now: either way someone else holds it; come back when it ends.
        _ => Claim::InFlight {
            lease_until_ms: old.lease_until_ms.max(now_ms),
            payload_matches,
        },
    }
}

/// A record's state in words, for [`StoreError::LeaseLost`].
pub(crate) fn describe(r: Option<&Record>) -> String {
    match r {
        None => "absent".to_owned(),
        Some(r) => format!(
            "{} owned by {}",
            r.status.as_str(),
            r.owner.as_deref().unwrap_or("nobody")
        ),
    }
}

/// A completion: status `COMPLETED`, the result, and the staged writes, all or nothing.
#[derive(Debug, Clone)]
pub struct Completion {
    /// The record key.
    pub pk: String,
    /// Our fencing token.
    pub owner: String,
    /// The result to record.
    pub result: Option<StoredResult>,
    /// Retention from now.
    pub ttl: Duration,
    /// DynamoDB writes that commit in the same transaction.
    pub writes: Vec<StagedWrite>,
    /// Messages to send once this commits, recorded with it.
    pub outbox: Vec<Outgoing>,
}

/// A fast-path commit: the `COMPLETED` record and the staged writes in one
/// transaction, with no claim before it. The record is written only where a claim
/// would have been taken (absent, expired, `FAILED`, or a lease that ran out).
#[derive(Debug, Clone)]
pub struct FastCommit {
    /// The record key.
    pub pk: String,
    /// A fresh token for this attempt, stored as `owner`: an unknown outcome is
    /// sent again with it, and a record carrying it is our own earlier commit.
    pub owner: String,
    /// The delivery's message id (for operators).
    pub message_id: String,
    /// SHA-256 of the body.
    pub payload_sha256: String,
    /// The fence the handler read ([`clock_fence`] before it ran): stored,
    /// and only over a lower fence (else [`FastCommitted::FenceBehind`]).
    pub fence: u64,
    /// The result to record.
    pub result: Option<StoredResult>,
    /// Retention from now.
    pub ttl: Duration,
    /// DynamoDB writes that commit in the same transaction.
    pub writes: Vec<StagedWrite>,
    /// Messages to send once this commits, recorded with it.
    pub outbox: Vec<Outgoing>,
}

/// The answer to a [`FastCommit`].
#[derive(Debug, Clone, PartialEq)]
pub enum FastCommitted {
    /// The record and the writes committed.
    Committed,
    /// Already completed: nothing was written.
    Duplicate {
        /// The recorded result.
        result: Option<StoredResult>,
        /// False when the record was made by a different body: a producer bug.
        payload_matches: bool,
        /// Messages the first run sent that are not yet marked dispatched:
        /// send them before the duplicate is let go.
        outbox: Vec<Outgoing>,
    },
    /// Another consumer holds a live claim (general-path consumers of the same
    /// records): nothing was written; try again when it ends.
    InFlight {
        /// The other lease's end, epoch ms.
        lease_until_ms: i64,
        /// False when the record was made by a different body.
        payload_matches: bool,
    },
    /// This very delivery failed permanently before and was parked: nothing
    /// was written; park it again (see [`Claim::Parked`]).
    Parked {
        /// The recorded reason.
        reason: Option<String>,
    },
    /// The record could be taken, but its fence is not below the one the
    /// handler read (a claim or commit made since, or by a clock ahead of
    /// ours): nothing was written; run again with a later fence.
    FenceBehind {
        /// The stored fence.
        stored: u64,
    },
}

impl FastCommit {
    /// Whether this commit may write over `old` at `now_ms`: where a claim
    /// could take it ([`Record::claimable_by`]) and its fence is below ours.
    pub fn may_replace(&self, old: &Record, now_ms: i64) -> bool {
        old.claimable_by(now_ms, &self.message_id) && old.fence < self.fence
    }

    /// How a commit that lost the record's condition is answered, given the
    /// record that was there. Shared by every store.
    pub fn conflict(&self, old: &Record, now_ms: i64) -> FastCommitted {
        let payload_matches = old
            .payload_sha256
            .as_deref()
            .is_none_or(|p| p == self.payload_sha256);
        match old.status {
            // Our own earlier attempt committed; only its response was lost.
            Status::Completed if old.owner.as_deref() == Some(self.owner.as_str()) => {
                FastCommitted::Committed
            }
            Status::Completed => FastCommitted::Duplicate {
                result: old.result.clone(),
                payload_matches,
                outbox: old.outbox.clone(),
            },
            Status::Failed if old.failed_by(&self.message_id) => FastCommitted::Parked {
                reason: old.error.clone(),
            },
            // Free to take but for its fence.
            _ if old.claimable_by(now_ms, &self.message_id) && old.fence >= self.fence => {
                FastCommitted::FenceBehind { stored: old.fence }
            }
            // A live lease of a general-path consumer (or, with clock skew, one
            // that only looks claimable to us).
            _ => FastCommitted::InFlight {
                lease_until_ms: old.lease_until_ms.max(now_ms),
                payload_matches,
            },
        }
    }
}

/// The attribute of an insert-path item ([`crate::Effects::Insert`]) that
/// holds the record key (`{consumer}#{dedup_key}`) of the message that wrote it.
pub const INSERT_KEY_ATTRIBUTE: &str = "sqs_once_key";
/// The attribute of an insert-path item that holds the SHA-256 of the
/// payload that wrote it (as `payload_sha256` on a record).
pub const INSERT_PAYLOAD_ATTRIBUTE: &str = "sqs_once_sha256";

/// An insert-path commit ([`crate::Effects::Insert`]): the handler's one
/// item, written with the marker (the record key and the payload's SHA-256)
/// only where no item has its key. The item is the dedup record: no other
/// is written.
#[derive(Debug, Clone)]
pub struct InsertCommit {
    /// The record key the marker holds.
    pub pk: String,
    /// SHA-256 of the payload, held by the marker.
    pub payload_sha256: String,
    /// The item's table.
    pub table: String,
    /// The item's key attributes (partition key first).
    pub key: Vec<String>,
    /// The item, without the marker.
    pub item: std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>,
}

/// The answer to an [`InsertCommit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inserted {
    /// The item was written (or an earlier send of ours was, its answer lost).
    Inserted,
    /// The item under the key carries our marker: written by an earlier
    /// delivery of this message (or a copy); nothing was written.
    Duplicate {
        /// False when it was written for another payload under our key.
        payload_matches: bool,
    },
    /// An item with the key exists that no delivery of this key wrote:
    /// another message's, or one written outside the library. Nothing was
    /// written.
    Taken {
        /// The record key its marker holds; `None`: no marker.
        by: Option<String>,
    },
}

impl InsertCommit {
    /// The item as written: the handler's, with the marker.
    pub fn marked_item(
        &self,
    ) -> std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue> {
        use aws_sdk_dynamodb::types::AttributeValue;
        let mut item = self.item.clone();
        item.insert(
            INSERT_KEY_ATTRIBUTE.to_owned(),
            AttributeValue::S(self.pk.clone()),
        );
        item.insert(
            INSERT_PAYLOAD_ATTRIBUTE.to_owned(),
            AttributeValue::S(self.payload_sha256.clone()),
        );
        item
    }

    /// How a put refused by its condition is answered, given the item in
    /// the way. Shared by every store. `ours_sent`: an earlier send of this
    /// very commit may have applied (its answer was lost), so an item with
    /// our marker and payload is that send's.
    pub fn found(
        &self,
        old: &std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue>,
        ours_sent: bool,
    ) -> Inserted {
        let marker = |name: &str| old.get(name).and_then(|v| v.as_s().ok()).cloned();
        match marker(INSERT_KEY_ATTRIBUTE) {
            Some(k) if k == self.pk => {
                let payload_matches =
                    marker(INSERT_PAYLOAD_ATTRIBUTE).is_none_or(|p| p == self.payload_sha256);
                if payload_matches && ours_sent {
                    Inserted::Inserted
                } else {
                    Inserted::Duplicate { payload_matches }
                }
            }
            by => Inserted::Taken { by },
        }
    }
}

impl StoreError {
    /// Whether the same request can never succeed, so the message is a
    /// permanent failure (parked with this error) rather than retried.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            StoreError::TransactionTooLarge { .. }
                | StoreError::ItemTooLarge { .. }
                | StoreError::RecordTooLarge { .. }
                | StoreError::Invalid(_)
        )
    }
}

/// A store operation that did not do what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// Someone else owns the key now (the fencing check failed): our lease ran out
    /// and another consumer took over. Our effect must not be recorded.
    #[error("lease lost on {pk}: the record is now {found}")]
    LeaseLost {
        /// The record key.
        pk: String,
        /// What the record holds now.
        found: String,
    },
    /// A staged write's own condition failed; nothing was written.
    #[error("staged write #{index} failed its condition; nothing was written")]
    WriteConditionFailed {
        /// Index among the staged writes.
        index: usize,
        /// What the handler declared this means.
        kind: FailureKind,
    },
    /// The staged writes exceed DynamoDB's transaction limits; nothing was written.
    #[error(
        "the handler staged {items} writes / ~{bytes} bytes with the dedup record; a transaction holds at most {} items (one is the dedup record) and {} bytes",
        DYNAMODB_MAX_TRANSACTION_ITEMS - 1,
        DYNAMODB_MAX_TRANSACTION_BYTES
    )]
    TransactionTooLarge {
        /// Staged writes.
        items: usize,
        /// Estimated size, the dedup record included.
        bytes: usize,
    },
    /// A staged item is over DynamoDB's 400 KB item limit; nothing was written.
    #[error(
        "staged write #{index} is ~{bytes} bytes; DynamoDB items hold at most 400 KB ({DYNAMODB_MAX_ITEM_BYTES} bytes)"
    )]
    ItemTooLarge {
        /// Index among the staged writes.
        index: usize,
        /// Estimated size.
        bytes: usize,
    },
    /// The dedup record itself, with its result and outbox, is over
    /// DynamoDB's 400 KB item limit; nothing was written.
    #[error(
        "the dedup record would be ~{bytes} bytes with its result and the messages sent; DynamoDB items hold at most 400 KB ({DYNAMODB_MAX_ITEM_BYTES} bytes): return a smaller result (ProcessorConfig::max_result_bytes bounds what is stored as is) or send less"
    )]
    RecordTooLarge {
        /// Estimated size.
        bytes: usize,
    },
    /// DynamoDB rejected the request as invalid (`ValidationException`: an item
    /// over 400 KB, two operations on one item, a malformed expression). The
    /// same request can never succeed: a permanent failure of the message.
    #[error("DynamoDB rejected the request: {0}")]
    Invalid(String),
    /// Throttled, unavailable, or the outcome stayed unknown after retries with the
    /// same token. Nothing can be assumed; the message comes back.
    #[error("DynamoDB unavailable: {0}")]
    Unavailable(String),
    /// Refused on every attempt of the store for contention on an item: in
    /// conflict with another transaction on one of its items
    /// (`TransactionConflict`, as a cancellation reason or a
    /// `TransactionConflictException`). The message comes back after the
    /// short contention backoff
    /// ([`ProcessorConfig::busy_backoff`](crate::ProcessorConfig::busy_backoff)),
    /// not the outage backoff: a hot item frees up within milliseconds, and
    /// a long wait only leaves it idle. Throttling is
    /// [`Unavailable`](Self::Unavailable): a table or account at its limit
    /// can stay there, and a short backoff would spend the message's receives
    /// toward the DLQ. As after `Unavailable`, nothing is assumed about
    /// whether a write applied (an attempt the AWS SDK retried inside one of
    /// the store's may have applied before its answer was lost): the
    /// redelivery reads the record.
    #[error("DynamoDB busy: {0}")]
    Busy(String),
}

/// The dedup store. Every method is safe to call again with the same token after
/// an error: implementations retry unknown outcomes themselves.
pub trait DedupStore: Send + Sync + 'static {
    /// Claims a key before any side effect.
    fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Completes a claim we own, with its staged writes in the same transaction.
    fn complete(&self, c: Completion) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Ends our lease so a redelivery can claim again; keeps `attempts` and `error`.
    fn release(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Records a permanent failure (`FAILED`, with the reason).
    fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends our lease to `now + lease` and the record's retention to `now +
    /// ttl`. Only a live lease is extended: [`StoreError::LeaseLost`] when the
    /// record is not ours, or our lease has ended or was released (so an
    /// extension that lands late cannot hold a released key). A lease is only
    /// moved forward: an extension that reaches less far than the stored lease
    /// (an earlier one that landed late) changes nothing and succeeds.
    fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Commits staged writes without a dedup record (keyless messages processed
    /// unprotected by configuration).
    fn commit_unprotected(
        &self,
        writes: Vec<StagedWrite>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The fast path: writes the `COMPLETED` record together with the staged
    /// writes in one transaction, where a claim would have been taken.
    fn commit_fast(
        &self,
        c: FastCommit,
    ) -> impl Future<Output = Result<FastCommitted, StoreError>> + Send;

    /// The insert path: puts the one item with its marker where no item has
    /// its key; a refused put is answered from the item in the way
    /// ([`InsertCommit::found`]). A store that cannot write items answers
    /// [`StoreError::Invalid`] (a permanent failure, with the reason).
    fn commit_insert(
        &self,
        c: InsertCommit,
    ) -> impl Future<Output = Result<Inserted, StoreError>> + Send {
        let _ = c;
        std::future::ready(Err(StoreError::Invalid(
            "this dedup store does not implement the insert path (Effects::Insert)".into(),
        )))
    }

    /// Marks the messages `sent`, recorded with the `COMPLETED` record `pk`,
    /// as dispatched (removes them), so no later duplicate sends them again.
    /// Only if the record still holds exactly those: a mark that lands after
    /// the record was replaced (expired, run again, other messages recorded)
    /// changes nothing. A record that is not `COMPLETED`, has nothing to
    /// send or other messages, is left as it is and the call succeeds.
    fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[Outgoing],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads a record.
    fn get(&self, pk: &str) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Where the store counts what only it sees (takeovers of expired claims,
    /// lost answers resolved by sending again). The [`Processor`](crate::Processor)
    /// calls it once with its metrics; stores that see nothing ignore it.
    fn report_to(&self, metrics: std::sync::Arc<crate::protocol::metrics::Metrics>) {
        let _ = metrics;
    }
}

/// Checks staged writes, with the dedup record (`record_bytes`), against
/// DynamoDB's item and transaction limits before anything is sent.
pub(crate) fn check_transaction_limits(
    writes: &[StagedWrite],
    record_bytes: usize,
) -> Result<(), StoreError> {
    if record_bytes > DYNAMODB_MAX_ITEM_BYTES {
        return Err(StoreError::RecordTooLarge {
            bytes: record_bytes,
        });
    }
    let sizes: Vec<usize> = writes.iter().map(|w| write_size(&w.item)).collect();
    if let Some((index, &bytes)) = sizes
        .iter()
        .enumerate()
        .find(|(_, b)| **b > DYNAMODB_MAX_ITEM_BYTES)
    {
        return Err(StoreError::ItemTooLarge { index, bytes });
    }
    let bytes = record_bytes + sizes.iter().sum::<usize>();
    if writes.len() + 1 > DYNAMODB_MAX_TRANSACTION_ITEMS || bytes > DYNAMODB_MAX_TRANSACTION_BYTES {
        return Err(StoreError::TransactionTooLarge {
            items: writes.len(),
            bytes,
        });
    }
    Ok(())
}

/// An estimate of the dedup record's size in a completion or fast commit:
/// its fixed attributes plus the result and the outbox.
pub(crate) fn record_bytes(pk: &str, result: Option<&StoredResult>, outbox: &[Outgoing]) -> usize {
    const FIXED: usize = 512;
    let result = match result {
        None => 0,
        Some(StoredResult::Value(v)) => v.to_string().len(),
        Some(StoredResult::Digest { .. }) => 96,
    };
    FIXED + pk.len() + result + outbox_bytes(outbox)
}
