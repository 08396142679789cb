//! The claim protocol on DynamoDB: conditional writes, fencing tokens, TTL.
//!
//! - this module: [`DynamoStore`], the requests the protocol makes and how
//!   their failures are read;
//! - `table`: the start-up check of the table's key schema and TTL;
//! - `item`: a record read from its item;
//! - `secret`: the carry secret kept in the table.

mod item;
mod secret;
mod stamp;
mod table;

use crate::aws::OnHeap;
use item::replaced;
pub use item::{RecordError, record_from_item};
pub use secret::{CARRY_SECRET_ITEM, SecretError};
pub use stamp::{
    LEGACY_KEY_DERIVATION, RECORD_FORMAT, RECORD_FORMAT_ATTRIBUTE, StampCheck, StampError,
    stamp_key,
};
pub use table::TableCheckError;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeValue, Put, ReturnValue, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
    Update,
};

use crate::protocol::clock::{Clock, SystemClock};
use crate::protocol::metrics::Metrics;
use crate::protocol::outbox::Outgoing;
use crate::protocol::outcome::{FailureKind, StagedWrite, StoredResult};
use crate::protocol::store::{
    Claim, ClaimRequest, Completion, DedupStore, FastCommit, FastCommitted, InsertCommit, Inserted,
    Record, Status, StoreError, bounded_error, check_transaction_limits, clock_fence,
    decide_conflict, describe, next_fence, record_bytes,
};

/// The name of the TTL attribute the dedup table must have enabled.
pub const TTL_ATTRIBUTE: &str = "expires_at";
/// The partition key attribute (string).
pub const KEY_ATTRIBUTE: &str = "pk";
/// The attribute holding a `COMPLETED` record's messages still to send
/// (JSON text; see [`crate::protocol::outbox`]), removed once they are sent.
pub const OUTBOX_ATTRIBUTE: &str = "outbox";

// `CLAIM_CONDITION`'s text, for `FAST_COMMIT_CONDITION` to repeat.
macro_rules! claim_condition {
    () => {
        "attribute_not_exists(pk) OR expires_at < :now_s \
         OR (#status = :failed AND (attribute_not_exists(message_id) OR message_id <> :mid) \
             AND (attribute_not_exists(claimed_at) OR claimed_at <= :now_ms)) \
         OR (#status = :in_progress AND lease_until < :now_ms)"
    };
}

/// Who may take a record (see [`Record::claimable_by`]): nobody has it, it
/// expired, it failed in another delivery (a redriven copy, a re-send), or its
/// lease ran out.
/// A `FAILED` record is taken only by another delivery, and only by a claim
/// made no earlier than the failing delivery's own claim (a claim that lands
/// late must not erase the failure it never saw).
/// [`Record::claimable_by`] is the same predicate in Rust (the simulator
/// checks that the two agree).
///
/// Only over a record of a format this build writes or older: a newer
/// build's record is left alone, never rewritten in an older format.
pub const CLAIM_CONDITION: &str = concat!(
    "(",
    claim_condition!(),
    ") AND (attribute_not_exists(fmt) OR fmt <= :fmt)"
);
/// Where a fast-path commit writes over a record: where a claim could take
/// it, and only over a lower fence than the one its handler read
/// ([`FastCommit::may_replace`] in Rust).
pub const FAST_COMMIT_CONDITION: &str = concat!(
    "(",
    claim_condition!(),
    ") AND (attribute_not_exists(fence) OR fence < :fence) \
     AND (attribute_not_exists(fmt) OR fmt <= :fmt)"
);
const OWNED_CONDITION: &str = "#owner = :owner AND #status = :in_progress";
/// An extension also needs the lease to be live (one that lands after a release,
/// or after the lease ran out, must not hold the key again) and only moves it
/// forward (an earlier extension that lands after a later one must not shorten
/// it below what the holder counts on).
const LIVE_LEASE_CONDITION: &str = "#owner = :owner AND #status = :in_progress \
     AND lease_until > :now_ms AND lease_until < :lease_until";

/// [`OWNED_CONDITION`], or under the `owner-not-checked` mutant (for the
/// simulator only) one that holds whoever owns the record (`:owner` still
/// used, as DynamoDB requires of every value sent).
fn owned_condition() -> &'static str {
    if crate::protocol::mutants::active("owner-not-checked") {
        return "(#owner = :owner OR attribute_exists(pk)) AND #status = :in_progress";
    }
    OWNED_CONDITION
}

/// [`LIVE_LEASE_CONDITION`], or under the `lease-not-live` mutant (for the
/// simulator only) one that extends a lease already over (`:now_ms` still
/// used).
fn live_lease_condition() -> &'static str {
    if crate::protocol::mutants::active("lease-not-live") {
        return "#owner = :owner AND #status = :in_progress \
             AND (lease_until > :now_ms OR attribute_exists(pk)) AND lease_until < :lease_until";
    }
    LIVE_LEASE_CONDITION
}

/// How many times an operation whose outcome is unknown is sent again (with the
/// same token) before the message is given back to the queue.
const UNKNOWN_OUTCOME_ATTEMPTS: u32 = 4;
/// How long the fast path writes new keys with the conditional update after
/// the table refused its put (`dynamodb:PutItem` not granted), before it
/// tries the put again.
const PUT_DENIED_FOR: Duration = Duration::from_secs(600);

/// The DynamoDB dedup store. Build the client once and pass it in.
#[derive(Debug, Clone)]
pub struct DynamoStore {
    client: Client,
    table: Arc<str>,
    clock: Arc<dyn Clock>,
    metrics: Arc<std::sync::OnceLock<Arc<Metrics>>>,
    /// Until when (ms; 0: never refused) new keys are written with the
    /// conditional update because `dynamodb:PutItem` was refused on the
    /// table (a policy from before the fast path's put): the put is tried
    /// again [`PUT_DENIED_FOR`] after a refusal, so a grant made later is
    /// taken up without a restart.
    put_denied_until_ms: Arc<std::sync::atomic::AtomicI64>,
}

enum Attempt {
    /// A transient failure that wrote nothing: send again, same token.
    Again(String),
    /// Refused for contention on an item (a transaction conflict): wrote
    /// nothing; send again, same token. When every attempt ends so, the
    /// store answers [`StoreError::Busy`].
    Busy(String),
    /// No answer, or a server error: the write may have applied. Sent again
    /// with the same token, it applies at most once.
    Unknown(String),
    /// A definite answer.
    Done(StoreError),
}

fn classify<E: ProvideErrorMetadata + std::error::Error + 'static, R: std::fmt::Debug>(
    err: &SdkError<E, R>,
) -> Attempt {
    match err {
        SdkError::ServiceError(se) => {
            let e = se.err();
            let code = e.code().unwrap_or("Unknown");
            let msg = format!("{code}: {}", e.message().unwrap_or_default());
            // Told apart by the error code, not the HTTP status: a
            // ValidationException (HTTP 400) can never succeed, so the message
            // is a permanent failure. An HTTP 500 is retried even when it hides
            // a malformed request (LocalStack answers some malformed expressions
            // with 500): such a message ends in the DLQ by the redrive policy.
            match code {
                "ValidationException" | "SerializationException" => {
                    Attempt::Done(StoreError::Invalid(msg))
                }
                // A missing table is a deployment problem, not the message's:
                // retried (the table is checked at start-up).
                "ResourceNotFoundException" => Attempt::Done(StoreError::Unavailable(format!(
                    "{msg} (is SQS_ONCE_TABLE right, and the table created?)"
                ))),
                "AccessDeniedException" | "UnrecognizedClientException" => {
                    Attempt::Done(StoreError::Unavailable(msg))
                }
                "InternalServerError" | "InternalFailure" | "ServiceUnavailable" => {
                    Attempt::Unknown(msg)
                }
                // An earlier send of this token is still being applied: it
                // may commit, so the outcome is unknown, not "wrote nothing".
                "TransactionInProgressException" => Attempt::Unknown(msg),
                _ if busy_code(code) => Attempt::Busy(msg),
                _ => Attempt::Again(msg),
            }
        }
        other => Attempt::Unknown(
            aws_smithy_types::error::display::DisplayErrorContext(other).to_string(),
        ),
    }
}

/// Whether an error code (of a call, or a transaction's cancellation
/// reason) refuses for contention on an item: a conflict with another
/// transaction on it (`TransactionConflictException`, the reason
/// `TransactionConflict`). Throttling is not: a table or an account at its
/// limit can stay there ([`StoreError::Busy`]).
fn busy_code(code: &str) -> bool {
    code.starts_with("TransactionConflict")
}

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

fn n(v: i64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn fence(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2)
}

fn names(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl DynamoStore {
    /// A store on `table` using the system clock.
    pub fn new(client: Client, table: impl Into<Arc<str>>) -> Self {
        Self::with_clock(client, table, Arc::new(SystemClock))
    }

    /// A store with an injected clock (tests).
    pub fn with_clock(client: Client, table: impl Into<Arc<str>>, clock: Arc<dyn Clock>) -> Self {
        Self {
            client,
            table: table.into(),
            clock,
            metrics: Arc::default(),
            put_denied_until_ms: Arc::default(),
        }
    }

    /// Counts on the processor's metrics, once attached.
    fn count(&self, f: impl FnOnce(&Metrics)) {
        if let Some(m) = self.metrics.get() {
            f(m);
        }
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The error of a call sent once (not through [`Self::retrying`]).
    fn sent_once(&self, attempt: Attempt) -> StoreError {
        match attempt {
            Attempt::Done(err) => err,
            Attempt::Busy(reason) => {
                self.count(Metrics::store_busy);
                StoreError::Busy(reason)
            }
            Attempt::Again(reason) | Attempt::Unknown(reason) => StoreError::Unavailable(reason),
        }
    }

    /// Runs `op` until it gives a definite answer, at most
    /// [`UNKNOWN_OUTCOME_ATTEMPTS`] times. Callers make `op` idempotent by
    /// sending the same owner token each time.
    async fn retrying<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, Attempt>>,
    {
        let mut delay = Duration::from_millis(50);
        let mut last = String::new();
        let mut unknown = false;
        // Every failed attempt refused for contention.
        let mut busy = true;
        for attempt in 1..=UNKNOWN_OUTCOME_ATTEMPTS {
            match op().await {
                Ok(v) => {
                    if unknown {
                        // The answer to an earlier send was lost; this one
                        // (or that one, found by the same token) applied once.
                        self.count(Metrics::unknown_outcome_resolved);
                    }
                    return Ok(v);
                }
                Err(Attempt::Done(e)) => return Err(e),
                Err(Attempt::Unknown(reason)) => {
                    tracing::warn!(operation = what, attempt, %reason, "DynamoDB outcome unknown; sending again with the same token");
                    unknown = true;
                    busy = false;
                    last = reason;
                    if attempt < UNKNOWN_OUTCOME_ATTEMPTS {
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                }
                Err(Attempt::Again(reason)) => {
                    tracing::warn!(operation = what, attempt, %reason, "DynamoDB call failed transiently; sending again with the same token");
                    busy = false;
                    last = reason;
                    if attempt < UNKNOWN_OUTCOME_ATTEMPTS {
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                }
                Err(Attempt::Busy(reason)) => {
                    tracing::warn!(operation = what, attempt, %reason, "DynamoDB refused the call for a transaction conflict on the item; sending again with the same token");
                    self.count(Metrics::store_busy);
                    last = reason;
                    if attempt < UNKNOWN_OUTCOME_ATTEMPTS {
                        tokio::time::sleep(delay).await;
                        delay *= 2;
                    }
                }
            }
        }
        let detail = format!("{what}: {last}");
        Err(if busy && !unknown {
            StoreError::Busy(detail)
        } else {
            StoreError::Unavailable(detail)
        })
    }

    /// An owner-guarded update of our record (`condition`: [`OWNED_CONDITION`]
    /// or a stricter one). When the condition fails, the old record decides:
    /// `accept(old)` true means an earlier attempt of ours already did it.
    #[allow(clippy::too_many_arguments)]
    async fn owned_update(
        &self,
        what: &str,
        pk: &str,
        owner: &str,
        set: &str,
        condition: &str,
        mut values: HashMap<String, AttributeValue>,
        accept: impl Fn(&Record) -> bool,
    ) -> Result<(), StoreError> {
        values.insert(":owner".into(), s(owner));
        values.insert(":in_progress".into(), s(Status::InProgress.as_str()));
        let attr_names = used_names(
            &[
                ("#owner", "owner"),
                ("#status", "status"),
                ("#error", "error"),
            ],
            &[set, condition],
        );
        self.retrying(what, || async {
            let res = self
                .client
                .update_item()
                .table_name(&*self.table)
                .key(KEY_ATTRIBUTE, s(pk))
                .update_expression(set)
                .condition_expression(condition)
                .set_expression_attribute_names(Some(attr_names.clone()))
                .set_expression_attribute_values(Some(values.clone()))
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                )
                .send()
                .on_heap()
                .await;
            match res {
                Ok(_) => Ok(()),
                Err(e) => {
                    if let Some(ccf) = conditional_failure(&e) {
                        let old = ccf.item().map(record_from_item).transpose();
                        let old = old.map_err(|e| Attempt::Done(e.into()))?;
                        if old
                            .as_ref()
                            .is_some_and(|r| r.owner.as_deref() == Some(owner) && accept(r))
                        {
                            return Ok(());
                        }
                        return Err(Attempt::Done(StoreError::LeaseLost {
                            pk: pk.to_owned(),
                            found: describe(old.as_ref()),
                        }));
                    }
                    Err(classify(&e))
                }
            }
        })
        .await
    }

    fn completed_update(&self, c: &Completion) -> Result<Update, StoreError> {
        let now_ms = self.clock.now_ms();
        let mut values = HashMap::from([
            (":owner".to_owned(), s(&c.owner)),
            (":in_progress".to_owned(), s(Status::InProgress.as_str())),
            (":completed".to_owned(), s(Status::Completed.as_str())),
            (":completed_at".to_owned(), n(now_ms)),
            (
                ":expires_at".to_owned(),
                n(now_ms.div_euclid(1000) + secs(c.ttl)),
            ),
        ]);
        let mut set =
            "SET #status = :completed, completed_at = :completed_at, expires_at = :expires_at"
                .to_owned();
        let mut remove = vec!["lease_until"];
        set_result(c.result.as_ref(), &mut set, &mut remove, &mut values);
        set_outbox(&c.outbox, &mut set, &mut remove, &mut values);
        let expr = format!("{set} REMOVE {}", remove.join(", "));
        self.record_update(&c.pk, expr, owned_condition(), values)
    }

    /// A conditional update of the record `pk` (the old item returned when the
    /// condition fails), for use in a transaction or on its own.
    fn record_update(
        &self,
        pk: &str,
        expr: String,
        condition: &str,
        values: HashMap<String, AttributeValue>,
    ) -> Result<Update, StoreError> {
        let all = [
            ("#owner", "owner"),
            ("#status", "status"),
            ("#result", "result"),
            ("#error", "error"),
            ("#outbox", OUTBOX_ATTRIBUTE),
        ];
        Update::builder()
            .table_name(&*self.table)
            .key(KEY_ATTRIBUTE, s(pk))
            .set_expression_attribute_names(Some(used_names(&all, &[&expr, condition])))
            .update_expression(expr)
            .condition_expression(condition)
            .set_expression_attribute_values(Some(values))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| StoreError::Invalid(e.to_string()))
    }

    async fn complete_plain(&self, c: &Completion, update: Update) -> Result<(), StoreError> {
        let pk = c.pk.clone();
        self.retrying("complete", || async {
            let res = self
                .client
                .update_item()
                .table_name(update.table_name())
                .set_key(Some(update.key().clone()))
                .update_expression(update.update_expression())
                .set_condition_expression(update.condition_expression().map(str::to_owned))
                .set_expression_attribute_names(update.expression_attribute_names().cloned())
                .set_expression_attribute_values(update.expression_attribute_values().cloned())
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                )
                .send()
                .on_heap()
                .await;
            match res {
                Ok(_) => Ok(()),
                Err(e) => {
                    if let Some(ccf) = conditional_failure(&e) {
                        return completion_conflict(&pk, &c.owner, ccf.item());
                    }
                    Err(classify(&e))
                }
            }
        })
        .await
    }

    async fn complete_transact(&self, c: &Completion, update: Update) -> Result<(), StoreError> {
        // DynamoDB makes a TransactWriteItems with the same token idempotent for ten
        // minutes; the fencing check below covers a retry after that.
        let writes = c.writes.iter().map(|w| w.item.clone());
        let (items, token) = transaction("complete", update, writes, &c.pk, &c.owner);
        let token = token.as_str();
        self.retrying("complete (transaction)", || async {
            let res = self
                .client
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .client_request_token(token)
                .send()
                .on_heap()
                .await;
            match res {
                Ok(_) => Ok(()),
                Err(e) => match transaction_failure(&e, &kinds(&c.writes)) {
                    TransactionFailure::Record(item) => completion_conflict(&c.pk, &c.owner, item),
                    TransactionFailure::Other(attempt) => Err(attempt),
                },
            }
        })
        .await
    }
}

/// The `ConditionalCheckFailedException` of a failed `UpdateItem`, if that is
/// what it was: a result of the protocol, not an error.
fn conditional_failure<R>(
    e: &SdkError<UpdateItemError, R>,
) -> Option<&aws_sdk_dynamodb::types::error::ConditionalCheckFailedException> {
    // (The `conditional-as-transient` mutant, for the simulator only, misses
    // it: `classify` then takes it for a transient error.)
    if crate::protocol::mutants::active("conditional-as-transient") {
        return None;
    }
    match e.as_service_error()? {
        UpdateItemError::ConditionalCheckFailedException(c) => Some(c),
        _ => None,
    }
}

/// The `ConditionalCheckFailedException` of a failed `PutItem` (the insert
/// path's), as [`conditional_failure`] for an update.
fn put_conditional_failure<R>(
    e: &SdkError<aws_sdk_dynamodb::operation::put_item::PutItemError, R>,
) -> Option<&aws_sdk_dynamodb::types::error::ConditionalCheckFailedException> {
    use aws_sdk_dynamodb::operation::put_item::PutItemError;
    if crate::protocol::mutants::active("conditional-as-transient") {
        return None;
    }
    match e.as_service_error()? {
        PutItemError::ConditionalCheckFailedException(c) => Some(c),
        _ => None,
    }
}

impl DynamoStore {
    /// The `COMPLETED` record of a fast-path commit, put where no record is:
    /// the same attributes [`Self::takeover_update`] leaves on a record it
    /// replaces (`attempts` 1, as its `if_not_exists` makes it on a new one).
    fn new_record_put(&self, c: &FastCommit, now_ms: i64) -> Result<TransactWriteItem, StoreError> {
        let mut item = HashMap::from([
            (KEY_ATTRIBUTE.to_owned(), s(&c.pk)),
            ("status".to_owned(), s(Status::Completed.as_str())),
            ("owner".to_owned(), s(&c.owner)),
            (
                TTL_ATTRIBUTE.to_owned(),
                n(now_ms.div_euclid(1000) + secs(c.ttl)),
            ),
            ("payload_sha256".to_owned(), s(&c.payload_sha256)),
            ("message_id".to_owned(), s(&c.message_id)),
            ("claimed_at".to_owned(), n(now_ms)),
            ("completed_at".to_owned(), n(now_ms)),
            ("attempts".to_owned(), n(1)),
            ("fence".to_owned(), fence(c.fence)),
            (
                RECORD_FORMAT_ATTRIBUTE.to_owned(),
                n(i64::from(RECORD_FORMAT)),
            ),
        ]);
        match &c.result {
            None => {}
            Some(StoredResult::Value(v)) => {
                item.insert("result".to_owned(), s(v.to_string()));
            }
            Some(StoredResult::Digest { sha256, bytes }) => {
                item.insert("result_sha256".to_owned(), s(sha256));
                item.insert(
                    "result_bytes".to_owned(),
                    n(i64::try_from(*bytes).unwrap_or(i64::MAX)),
                );
            }
        }
        if !c.outbox.is_empty() {
            item.insert(
                OUTBOX_ATTRIBUTE.to_owned(),
                s(crate::protocol::outbox::to_stored(&c.outbox)),
            );
        }
        let put = Put::builder()
            .table_name(&*self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .build()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        Ok(TransactWriteItem::builder().put(put).build())
    }

    /// The `COMPLETED` record of a fast-path commit written over one that
    /// is there, where a claim would have been taken (absent, expired,
    /// `FAILED`, a lease that ran out): its other attributes removed.
    fn takeover_update(&self, c: &FastCommit, now_ms: i64) -> Result<Update, StoreError> {
        let mut values = HashMap::from([
            (":now_s".to_owned(), n(now_ms.div_euclid(1000))),
            (":now_ms".to_owned(), n(now_ms)),
            (":failed".to_owned(), s(Status::Failed.as_str())),
            (":in_progress".to_owned(), s(Status::InProgress.as_str())),
            (":completed".to_owned(), s(Status::Completed.as_str())),
            (":owner".to_owned(), s(&c.owner)),
            (
                ":expires_at".to_owned(),
                n(now_ms.div_euclid(1000) + secs(c.ttl)),
            ),
            (":payload".to_owned(), s(&c.payload_sha256)),
            (":mid".to_owned(), s(&c.message_id)),
            (":zero".to_owned(), n(0)),
            (":one".to_owned(), n(1)),
            (":fence".to_owned(), fence(c.fence)),
            (":fmt".to_owned(), n(i64::from(RECORD_FORMAT))),
        ]);
        let mut set = "SET #status = :completed, #owner = :owner, expires_at = :expires_at, \
             payload_sha256 = :payload, message_id = :mid, claimed_at = :now_ms, \
             completed_at = :now_ms, attempts = if_not_exists(attempts, :zero) + :one, \
             fence = :fence, fmt = :fmt"
            .to_owned();
        let mut remove = vec!["lease_until", "#error"];
        set_result(c.result.as_ref(), &mut set, &mut remove, &mut values);
        set_outbox(&c.outbox, &mut set, &mut remove, &mut values);
        let expr = format!("{set} REMOVE {}", remove.join(", "));
        self.record_update(&c.pk, expr, FAST_COMMIT_CONDITION, values)
    }

    /// Sends a fast-path transaction (`items`, the record first), sending
    /// it again with the same token while its outcome is unknown. A refusal
    /// by the policy is answered apart (`Denied`), for the caller to tell a
    /// missing `PutItem` from an outage.
    async fn send_fast(
        &self,
        what: &str,
        items: &[TransactWriteItem],
        token: &str,
        on_failed: &[FailureKind],
    ) -> Result<Sent, StoreError> {
        self.retrying(what, || async {
            let res = self
                .client
                .transact_write_items()
                .set_transact_items(Some(items.to_vec()))
                .client_request_token(token)
                .send()
                .on_heap()
                .await;
            let Err(e) = res else {
                return Ok(Sent::Committed);
            };
            if e.code() == Some("AccessDeniedException") {
                return match classify(&e) {
                    Attempt::Done(refused) => Ok(Sent::Denied(refused)),
                    other => Err(other),
                };
            }
            match transaction_failure(&e, on_failed) {
                TransactionFailure::Record(item) => {
                    let Some(item) = item else {
                        return Err(Attempt::Done(StoreError::Invalid(
                            "conditional check failed without the old item (ALL_OLD not honoured)"
                                .into(),
                        )));
                    };
                    Ok(Sent::Found(
                        record_from_item(item).map(Box::new),
                        item::condition_numbers_exact(item),
                    ))
                }
                TransactionFailure::Other(attempt) => Err(attempt),
            }
        })
        .await
    }
}

/// How a fast-path transaction ended.
enum Sent {
    /// The record and the writes committed.
    Committed,
    /// The record's condition failed: the record there (or why it does not
    /// read as one), and whether the numbers the claim condition compares
    /// read exactly ([`item::condition_numbers_exact`]).
    Found(Result<Box<Record>, RecordError>, bool),
    /// The policy refused the call (`AccessDeniedException`).
    Denied(StoreError),
}

/// The record's update (item 0) and the staged writes as one transaction, with
/// a `ClientRequestToken` derived from `kind`, key and owner: every resend of
/// the same attempt carries the same token.
fn transaction(
    kind: &str,
    record: Update,
    writes: impl ExactSizeIterator<Item = TransactWriteItem>,
    pk: &str,
    owner: &str,
) -> (Vec<TransactWriteItem>, String) {
    let mut items = Vec::with_capacity(writes.len() + 1);
    items.push(TransactWriteItem::builder().update(record).build());
    items.extend(writes);
    (items, transaction_token(kind, pk, owner))
}

/// A `ClientRequestToken` (at most 36 characters) derived from `kind`, key
/// and owner.
fn transaction_token(kind: &str, pk: &str, owner: &str) -> String {
    let mut token = crate::protocol::key::sha256_hex(format!("{kind}#{pk}#{owner}").as_bytes());
    token.truncate(36);
    token
}

/// What a failure of each staged write's own condition means, in order.
fn kinds(writes: &[StagedWrite]) -> Vec<FailureKind> {
    writes.iter().map(|w| w.on_condition_failed).collect()
}

/// Why a transaction of the dedup record (item 0) and staged writes failed.
enum TransactionFailure<'a> {
    /// The record's own condition failed; the old item, when returned.
    Record(Option<&'a HashMap<String, AttributeValue>>),
    /// Anything else: a staged write's condition, a validation error (both
    /// final), or a cancellation or error that wrote nothing (sent again).
    Other(Attempt),
}

fn transaction_failure<'a, R: std::fmt::Debug>(
    e: &'a SdkError<TransactWriteItemsError, R>,
    writes: &[FailureKind],
) -> TransactionFailure<'a> {
    let Some(TransactWriteItemsError::TransactionCanceledException(tc)) = e.as_service_error()
    else {
        return TransactionFailure::Other(classify(e));
    };
    let reasons = tc.cancellation_reasons();
    let code = |i: usize| reasons.get(i).and_then(|r| r.code()).unwrap_or("None");
    if code(0) == "ConditionalCheckFailed"
        && !crate::protocol::mutants::active("conditional-as-transient")
    {
        return TransactionFailure::Record(reasons[0].item());
    }
    if let Some(i) = (1..reasons.len()).find(|&i| code(i) == "ConditionalCheckFailed") {
        return TransactionFailure::Other(Attempt::Done(StoreError::WriteConditionFailed {
            index: i - 1,
            kind: writes[i - 1],
        }));
    }
    if let Some(i) = (0..reasons.len()).find(|&i| code(i) == "ValidationError") {
        return TransactionFailure::Other(Attempt::Done(StoreError::Invalid(format!(
            "transaction item #{i}: {}",
            reasons[i].message().unwrap_or("validation error")
        ))));
    }
    // TransactionConflict, ThrottlingError, ...: nothing was written.
    let all: Vec<&str> = (0..reasons.len()).map(code).collect();
    let reason = format!("transaction cancelled: {all:?}");
    // Contention only when every reason that refused is a conflict (a
    // throttled item keeps the outage backoff).
    let refusing = || all.iter().filter(|c| **c != "None");
    TransactionFailure::Other(
        if refusing().count() > 0 && refusing().all(|c| busy_code(c)) {
            Attempt::Busy(reason)
        } else {
            Attempt::Again(reason)
        },
    )
}

/// The completion's fencing check failed: done already by an earlier attempt of
/// ours (response lost), or the lease was lost.
fn completion_conflict(
    pk: &str,
    owner: &str,
    item: Option<&HashMap<String, AttributeValue>>,
) -> Result<(), Attempt> {
    let old = item
        .map(record_from_item)
        .transpose()
        .map_err(|e| Attempt::Done(StoreError::Invalid(e.to_string())))?;
    if old
        .as_ref()
        .is_some_and(|r| r.status == Status::Completed && r.owner.as_deref() == Some(owner))
    {
        return Ok(());
    }
    Err(Attempt::Done(StoreError::LeaseLost {
        pk: pk.to_owned(),
        found: describe(old.as_ref()),
    }))
}

/// Adds the result (value or digest) to an update's SET, and what it replaces to
/// its REMOVE.
fn set_result(
    result: Option<&StoredResult>,
    set: &mut String,
    remove: &mut Vec<&'static str>,
    values: &mut HashMap<String, AttributeValue>,
) {
    match result {
        None => remove.extend(["#result", "result_sha256", "result_bytes"]),
        Some(StoredResult::Value(v)) => {
            set.push_str(", #result = :result");
            values.insert(":result".into(), s(v.to_string()));
            remove.extend(["result_sha256", "result_bytes"]);
        }
        Some(StoredResult::Digest { sha256, bytes }) => {
            set.push_str(", result_sha256 = :rsha, result_bytes = :rbytes");
            values.insert(":rsha".into(), s(sha256));
            values.insert(
                ":rbytes".into(),
                n(i64::try_from(*bytes).unwrap_or(i64::MAX)),
            );
            remove.push("#result");
        }
    }
}

/// Sets the record's messages to send, or removes the attribute (a record
/// that replaces an expired one must not inherit its unsent messages).
fn set_outbox(
    outbox: &[Outgoing],
    set: &mut String,
    remove: &mut Vec<&'static str>,
    values: &mut HashMap<String, AttributeValue>,
) {
    if outbox.is_empty() {
        remove.push("#outbox");
    } else {
        set.push_str(", #outbox = :outbox");
        values.insert(
            ":outbox".into(),
            s(crate::protocol::outbox::to_stored(outbox)),
        );
    }
}

/// Only the `#names` the expressions `exprs` use (DynamoDB rejects unused ones).
fn used_names(all: &[(&str, &str)], exprs: &[&str]) -> HashMap<String, String> {
    all.iter()
        .filter(|(k, _)| exprs.iter().any(|e| e.contains(k)))
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl DedupStore for DynamoStore {
    fn report_to(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now_ms = self.clock.now_ms();
        let values = HashMap::from([
            (":now_s".to_owned(), n(now_ms.div_euclid(1000))),
            (":now_ms".to_owned(), n(now_ms)),
            (":failed".to_owned(), s(Status::Failed.as_str())),
            (":in_progress".to_owned(), s(Status::InProgress.as_str())),
            (":owner".to_owned(), s(&req.owner)),
            (":lease_until".to_owned(), n(now_ms + ms(req.lease))),
            (
                ":expires_at".to_owned(),
                n(now_ms.div_euclid(1000) + secs(req.ttl)),
            ),
            (":payload".to_owned(), s(&req.payload_sha256)),
            (":mid".to_owned(), s(&req.message_id)),
            (":zero".to_owned(), n(0)),
            (":one".to_owned(), n(1)),
            (":fence_start".to_owned(), fence(clock_fence(now_ms))),
            (":fmt".to_owned(), n(i64::from(RECORD_FORMAT))),
        ]);
        // The fence: one above the stored one, or above the clock's where
        // none is stored (see `next_fence`).
        let update = "SET #status = :in_progress, #owner = :owner, lease_until = :lease_until, \
             expires_at = :expires_at, payload_sha256 = :payload, message_id = :mid, \
             claimed_at = :now_ms, attempts = if_not_exists(attempts, :zero) + :one, \
             fence = if_not_exists(fence, :fence_start) + :one, fmt = :fmt \
             REMOVE #result, result_sha256, result_bytes, completed_at, #outbox";
        let attr_names = names(&[
            ("#status", "status"),
            ("#owner", "owner"),
            ("#result", "result"),
            ("#outbox", OUTBOX_ATTRIBUTE),
        ]);
        self.retrying("claim", || async {
            let res = self
                .client
                .update_item()
                .table_name(&*self.table)
                .key(KEY_ATTRIBUTE, s(&req.pk))
                .update_expression(update)
                .condition_expression(CLAIM_CONDITION)
                .set_expression_attribute_names(Some(attr_names.clone()))
                .set_expression_attribute_values(Some(values.clone()))
                .return_values(ReturnValue::AllOld)
                .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
                .send()
                .on_heap()
                .await;
            match res {
                Ok(out) => {
                    let old = replaced(out.attributes(), &req.owner);
                    if old.taken_over {
                        self.count(Metrics::takeover);
                    }
                    Ok(Claim::Acquired {
                        attempt: old.attempts + 1,
                        fence: next_fence(old.fence, now_ms),
                    })
                }
                Err(e) => {
                    if let Some(ccf) = conditional_failure(&e) {
                        let Some(item) = ccf.item() else {
                            return Err(Attempt::Done(StoreError::Invalid(
                                "conditional check failed without the old item (ALL_OLD not honoured)".into(),
                            )));
                        };
                        let old = record_from_item(item).map_err(|e| Attempt::Done(e.into()))?;
                        return Ok(decide_conflict(&old, req, now_ms));
                    }
                    Err(classify(&e))
                }
            }
        })
        .await
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        check_transaction_limits(&c.writes, record_bytes(&c.pk, c.result.as_ref(), &c.outbox))?;
        let update = self.completed_update(&c)?;
        if c.writes.is_empty() {
            self.complete_plain(&c, update).await
        } else {
            self.complete_transact(&c, update).await
        }
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        let values = HashMap::from([
            (":zero".to_owned(), n(0)),
            (":error".to_owned(), s(bounded_error(error))),
        ]);
        self.owned_update(
            "release",
            pk,
            owner,
            "SET lease_until = :zero, #error = :error",
            owned_condition(),
            values,
            |r| r.status == Status::InProgress,
        )
        .await
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now_ms = self.clock.now_ms();
        let values = HashMap::from([
            (":failed".to_owned(), s(Status::Failed.as_str())),
            (":error".to_owned(), s(bounded_error(error))),
            (":zero".to_owned(), n(0)),
            (
                ":expires_at".to_owned(),
                n(now_ms.div_euclid(1000) + secs(ttl)),
            ),
        ]);
        self.owned_update(
            "mark failed",
            pk,
            owner,
            "SET #status = :failed, #error = :error, lease_until = :zero, expires_at = :expires_at",
            owned_condition(),
            values,
            |r| r.status == Status::Failed,
        )
        .await
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now_ms = self.clock.now_ms();
        let lease_until = now_ms + ms(lease);
        let values = HashMap::from([
            (":now_ms".to_owned(), n(now_ms)),
            (":lease_until".to_owned(), n(lease_until)),
            (
                ":expires_at".to_owned(),
                n(now_ms.div_euclid(1000) + secs(ttl)),
            ),
        ]);
        self.owned_update(
            "extend lease",
            pk,
            owner,
            "SET lease_until = :lease_until, expires_at = :expires_at",
            live_lease_condition(),
            values,
            // An earlier send of this very extension, or a later extension of
            // ours, landed first: the lease already reaches at least as far.
            |r| r.status == Status::InProgress && r.lease_until_ms >= lease_until,
        )
        .await
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        check_transaction_limits(&writes, 0)?;
        if writes.is_empty() {
            return Ok(());
        }
        let items: Vec<TransactWriteItem> = writes.iter().map(|w| w.item.clone()).collect();
        let res = self
            .client
            .transact_write_items()
            .set_transact_items(Some(items))
            .send()
            .on_heap()
            .await;
        match res {
            Ok(_) => Ok(()),
            Err(e) => match e.as_service_error() {
                Some(TransactWriteItemsError::TransactionCanceledException(tc)) => {
                    let reasons = tc.cancellation_reasons();
                    match reasons
                        .iter()
                        .position(|r| r.code() == Some("ConditionalCheckFailed"))
                    {
                        Some(i) => Err(StoreError::WriteConditionFailed {
                            index: i,
                            kind: writes[i].on_condition_failed,
                        }),
                        None => Err(StoreError::Unavailable(format!(
                            "transaction cancelled: {tc}"
                        ))),
                    }
                }
                // Without a dedup record there is no way to tell whether an unknown
                // outcome committed; the message comes back and may apply twice.
                _ => Err(self.sent_once(classify(&e))),
            },
        }
    }

    /// A fast-path commit. Most keys are new, so the first try puts the
    /// record whole where none is (`attribute_not_exists`): about half the
    /// request the takeover's conditional update is (its SET, REMOVE and
    /// condition, with 11 placeholders), which every message paid for in
    /// hashing (SigV4 signs the body), JSON escaping and allocation. A
    /// record found there (returned whole) that no claim could take
    /// ([`Record::claimable_by`], the takeover's condition in Rust: a
    /// duplicate, our own earlier try, a live lease, this delivery's park)
    /// is answered from at once, as the takeover's failure would be; one
    /// that could be taken (expired, another delivery's `FAILED`, a lease
    /// run out), that does not read as a record, or whose numbers compared
    /// by the condition are not whole, is written by the conditional
    /// update, whose own condition decides again. Where the table's policy
    /// refuses `PutItem` (one written before the put), commits take the
    /// update for ten minutes (with a warning), then try the put again.
    async fn commit_fast(&self, mut c: FastCommit) -> Result<FastCommitted, StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        check_transaction_limits(&c.writes, record_bytes(&c.pk, c.result.as_ref(), &c.outbox))?;
        let now_ms = self.clock.now_ms();
        // The staged writes move into the request; their failure kinds stay.
        let on_failed = kinds(&c.writes);
        let writes = std::mem::take(&mut c.writes).into_iter().map(|w| w.item);
        let mut items = Vec::with_capacity(writes.len() + 1);
        items.push(self.new_record_put(&c, now_ms)?);
        items.extend(writes);
        let mut put_refused = None;
        if now_ms >= self.put_denied_until_ms.load(Relaxed) {
            let token = transaction_token("fast-new", &c.pk, &c.owner);
            let what = "commit (fast path, new key)";
            match self.send_fast(what, &items, &token, &on_failed).await? {
                Sent::Committed => return Ok(FastCommitted::Committed),
                Sent::Found(Ok(old), true) if !c.may_replace(&old, now_ms) => {
                    return Ok(c.conflict(&old, now_ms));
                }
                Sent::Found(Ok(_), true) => {}
                Sent::Found(Ok(_), false) => {
                    tracing::warn!(pk = %c.pk, "the record in the way holds a number the claim condition compares that is not a whole number; the conditional update decides on it");
                }
                // A newer build's record: neither read nor written over
                // (the takeover's condition would refuse it too).
                Sent::Found(Err(e @ RecordError::NewerFormat { .. }), _) => {
                    return Err(e.into());
                }
                Sent::Found(Err(e), _) => {
                    tracing::warn!(pk = %c.pk, error = %e, "the record in the way does not read as one; written over by the conditional update where a claim could take it");
                }
                Sent::Denied(e) => put_refused = Some(e),
            }
        }
        let record = self.takeover_update(&c, now_ms)?;
        items[0] = TransactWriteItem::builder().update(record).build();
        let token = transaction_token("fast", &c.pk, &c.owner);
        let sent = self
            .send_fast("commit (fast path)", &items, &token, &on_failed)
            .await?;
        // Refused for the put alone (the update was not): a policy that
        // grants UpdateItem and not PutItem. Refused both ways, the cause is
        // elsewhere (a staged write's table, the credentials).
        if let Some(refused) = put_refused.filter(|_| !matches!(sent, Sent::Denied(_))) {
            let until = now_ms.saturating_add(ms(PUT_DENIED_FOR));
            if self.put_denied_until_ms.swap(until, Relaxed) < now_ms {
                tracing::warn!(table = %self.table, error = %refused, "dynamodb:PutItem is not granted on the dedup table: the fast path writes new keys with the conditional update instead (a larger request) and tries the put again in 10 minutes; grant PutItem beside UpdateItem");
            }
        }
        match sent {
            Sent::Committed => Ok(FastCommitted::Committed),
            Sent::Found(old, _) => {
                let old = old.map_err(|e| StoreError::Invalid(e.to_string()))?;
                Ok(c.conflict(&old, now_ms))
            }
            Sent::Denied(e) => Err(e),
        }
    }

    /// The insert path: one `PutItem` of the item with its marker under
    /// `attribute_not_exists` on its partition key, the item in the way
    /// returned by the same call when refused (`ALL_OLD`). Sent again with
    /// the same item while its outcome is unknown: a send that applied is
    /// then found by its marker.
    async fn commit_insert(&self, c: InsertCommit) -> Result<Inserted, StoreError> {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        let Some(partition) = c.key.first() else {
            return Err(StoreError::Invalid(
                "an insert-shaped handler names no key attribute (insert_once(&[\"id\"], ..))"
                    .into(),
            ));
        };
        let item = c.marked_item();
        // (The `insert-unconditional` mutant, for the simulator only, puts
        // the item without its condition.)
        let conditional = !crate::protocol::mutants::active("insert-unconditional");
        // Whether an earlier send may have applied (its answer lost).
        let maybe_applied = AtomicBool::new(false);
        self.retrying("insert", || async {
            let mut put = self
                .client
                .put_item()
                .table_name(&c.table)
                .set_item(Some(item.clone()))
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                );
            if conditional {
                put = put
                    .condition_expression("attribute_not_exists(#k)")
                    .expression_attribute_names("#k", partition);
            }
            match put.send().on_heap().await {
                Ok(_) => Ok(Inserted::Inserted),
                Err(e) => {
                    if let Some(ccf) = put_conditional_failure(&e) {
                        let Some(old) = ccf.item() else {
                            return Err(Attempt::Done(StoreError::Invalid(
                                "conditional check failed without the old item (ALL_OLD not honoured)".into(),
                            )));
                        };
                        return Ok(c.found(old, maybe_applied.load(Relaxed)));
                    }
                    let attempt = classify(&e);
                    if matches!(attempt, Attempt::Unknown(_)) {
                        maybe_applied.store(true, Relaxed);
                    }
                    Err(attempt)
                }
            }
        })
        .await
    }

    async fn mark_dispatched(&self, pk: &str, sent: &[Outgoing]) -> Result<(), StoreError> {
        let values = HashMap::from([
            (":completed".to_owned(), s(Status::Completed.as_str())),
            (
                ":sent".to_owned(),
                s(crate::protocol::outbox::to_stored(sent)),
            ),
        ]);
        let names = HashMap::from([
            ("#status".to_owned(), "status".to_owned()),
            ("#outbox".to_owned(), OUTBOX_ATTRIBUTE.to_owned()),
        ]);
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(KEY_ATTRIBUTE, s(pk))
            .update_expression("REMOVE #outbox")
            .condition_expression("#status = :completed AND #outbox = :sent")
            .set_expression_attribute_names(Some(names))
            .set_expression_attribute_values(Some(values))
            .send()
            .on_heap()
            .await;
        match res {
            Ok(_) => Ok(()),
            // Marked already, or the record is no longer the completed one
            // whose messages were sent.
            Err(e) if conditional_failure(&e).is_some() => Ok(()),
            Err(e) => Err(self.sent_once(classify(&e))),
        }
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(KEY_ATTRIBUTE, s(pk))
            .consistent_read(true)
            .send()
            .on_heap()
            .await
            .map_err(|e| self.sent_once(classify(&e)))?;
        out.item()
            .map(record_from_item)
            .transpose()
            .map_err(StoreError::from)
    }
}
