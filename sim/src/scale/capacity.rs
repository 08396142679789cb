//! DynamoDB's write capacity and transaction conflicts in the scale model.
//!
//! [`Throttled`] sits between [`crate::latency::LatentStore`] and the memory
//! store: when a write arrives at the service (half its latency after it was
//! sent) it is admitted or refused as DynamoDB documents it:
//! - **Capacity.** A write of up to 1 KB costs 1 write unit, an item in a
//!   `TransactWriteItems` 2 (the Developer Guide, "Read/write capacity mode"
//!   and "Capacity management for transactions"); every item this model
//!   writes is under 1 KB. An item (a partition) takes at most
//!   [`CapacityModel::item_wcu`] units a second (1,000: "Partitions and data
//!   distribution", adaptive capacity isolates a hot item but never lifts it
//!   above this); a table at most [`CapacityModel::table_wcu`] (a new
//!   on-demand table: 4,000 write units a second until its traffic has
//!   established a higher previous peak, which it may then double within 30
//!   minutes; a run here lasts minutes, so the limit is a fixed parameter).
//!   Each is a token bucket holding one second's units, full at the start.
//!   A refused write consumes nothing; an admitted one consumes its units
//!   whether its conditions then pass or not (a duplicate's cancelled
//!   transaction too). Reads (`GetItem`, a redelivery's record check) are
//!   not limited here.
//! - **Transaction conflicts.** A transaction holds its items for
//!   [`CapacityModel::hold`] after it is admitted (its two-phase commit on
//!   the service side: not published; assumed); a transaction or a
//!   single-item write that touches a held item is refused with
//!   `TransactionConflict` and writes nothing.
//!
//! Refusals are [`StoreError::Unavailable`] (throttled) or
//! [`StoreError::Busy`] (a transaction conflict), as the library's
//! `DynamoStore` answers them, with a text naming the code
//! DynamoDB answers. [`Retrying`], outside the latency, then does what the
//! library's `DynamoStore` does with them on top of the AWS SDK's standard
//! retries: a refused single-item write (`ProvisionedThroughputExceeded`)
//! is retried by the SDK (3 attempts, the n-th retry after a uniformly drawn
//! 0 to 2^(n-1) seconds; the SDK's retry-token bucket is not modelled); a
//! cancelled transaction (`TransactionCanceledException` with
//! `ThrottlingError` or `TransactionConflict` reasons) and a conflicted
//! single write (`TransactionConflictException`) are not SDK-retried.
//! `DynamoStore::retrying` then sends any of these again, 4 attempts in all,
//! 50 ms after the first, doubling; after that the caller gets the
//! last refusal (and the processor, for `Busy`, its short contention
//! backoff). The hand-written loops use the same client: the
//! SDK's retries are theirs too, and a careful engineer retries a
//! cancelled transaction the same way before giving up on the message.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqs_once::dynamodb_types::{AttributeValue, TransactWriteItem};
use sqs_once::metrics::{Metrics, Snapshot};
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{Claim, DedupStore, Record, StagedWrite, StoreError};
use tokio::time::Instant;

/// The table the dedup records are in, for the capacity model.
pub const DEDUP_TABLE: &str = "dedup";

/// What the service admits.
#[derive(Debug, Clone, PartialEq)]
pub struct CapacityModel {
    /// Write units a second one item takes at most (DynamoDB: 1,000).
    pub item_wcu: f64,
    /// Write units a second each table takes at most (`None`: no limit; a
    /// new on-demand table: 4,000).
    pub table_wcu: Option<f64>,
    /// How long a transaction holds its items after it is admitted; zero:
    /// no conflicts.
    pub hold: Duration,
    /// A what-if for the client, not what the library does: the store's
    /// retries wait a uniform draw from zero to their delay (full jitter)
    /// instead of the delay itself.
    pub jittered_store_retries: bool,
}

impl CapacityModel {
    /// No limit and no conflicts: the model before throttling was added.
    pub fn unlimited() -> Self {
        Self {
            item_wcu: f64::INFINITY,
            table_wcu: None,
            hold: Duration::ZERO,
            jittered_store_retries: false,
        }
    }

    /// DynamoDB's per-item limit, a table limit, conflicts over a 10 ms hold
    /// (assumed: the service's transaction time is not published; DeBrie's
    /// 2020 test measured a 5-item transaction's median 18 ms above a
    /// `PutItem`'s, client-side).
    pub fn dynamodb(table_wcu: Option<f64>) -> Self {
        Self {
            item_wcu: 1_000.0,
            table_wcu,
            hold: Duration::from_millis(10),
            jittered_store_retries: false,
        }
    }

    fn limited(&self) -> bool {
        self.item_wcu.is_finite() || self.table_wcu.is_some() || !self.hold.is_zero()
    }
}

/// Refusals and retries counted over a run.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Refusals {
    /// Writes refused for an item's capacity.
    pub item_throttled: u64,
    /// Writes refused for a table's capacity.
    pub table_throttled: u64,
    /// Writes refused for a transaction holding one of their items.
    pub conflicts: u64,
    /// Attempts sent again after a refusal (the SDK's and the store's).
    pub retries: u64,
    /// Calls that gave up after their last attempt was refused.
    pub gave_up: u64,
}

/// A token bucket of one second's units.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: f64, now: Instant) -> Self {
        Self {
            tokens: rate,
            at: now,
        }
    }

    fn refill(&mut self, rate: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + rate * dt).min(rate);
        self.at = now;
    }
}

#[derive(Debug, Default)]
struct State {
    items: HashMap<String, Bucket>,
    tables: HashMap<String, Bucket>,
    held: HashMap<String, Instant>,
    admitted: u64,
}

/// Why a write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Item,
    Table,
    Conflict,
}

/// The texts of refusals, as DynamoDB's error codes.
const THROTTLED: &str = "ProvisionedThroughputExceeded";
const CONFLICT: &str = "TransactionConflict";

/// The run's capacity: buckets, held items, counts, and the library's
/// metrics handed to the stores.
#[derive(Debug)]
pub struct Capacity {
    model: CapacityModel,
    state: Mutex<State>,
    rng: Mutex<StdRng>,
    item_throttled: AtomicU64,
    table_throttled: AtomicU64,
    conflicts: AtomicU64,
    retries: AtomicU64,
    gave_up: AtomicU64,
    metrics: Mutex<Vec<Arc<Metrics>>>,
}

impl Capacity {
    /// `model`, the SDK's jitter drawn from `seed`.
    pub fn new(model: CapacityModel, seed: u64) -> Self {
        Self {
            model,
            state: Mutex::default(),
            rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed_cafe)),
            item_throttled: AtomicU64::new(0),
            table_throttled: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            gave_up: AtomicU64::new(0),
            metrics: Mutex::default(),
        }
    }

    /// The counts so far.
    pub fn refusals(&self) -> Refusals {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Refusals {
            item_throttled: l(&self.item_throttled),
            table_throttled: l(&self.table_throttled),
            conflicts: l(&self.conflicts),
            retries: l(&self.retries),
            gave_up: l(&self.gave_up),
        }
    }

    /// The sum of the metrics of every processor whose store reported to
    /// this run (counters only; taking them resets them).
    pub fn take_metrics(&self) -> Snapshot {
        let all = self.metrics.lock().unwrap_or_else(|e| e.into_inner());
        let mut sum = Snapshot::default();
        for m in all.iter() {
            let s = m.take();
            sum.processed += s.processed;
            sum.duplicates += s.duplicates;
            sum.in_flight += s.in_flight;
            sum.retries += s.retries;
            sum.permanent_failures += s.permanent_failures;
            sum.lease_lost += s.lease_lost;
            sum.heartbeat_extensions += s.heartbeat_extensions;
            sum.takeovers += s.takeovers;
            sum.unknown_resolved += s.unknown_resolved;
        }
        sum
    }

    /// Admits a write of `items` (a transaction's, or one item's) now, or
    /// refuses it.
    fn admit(&self, items: &[String], transaction: bool) -> Result<(), StoreError> {
        if !self.model.limited() {
            return Ok(());
        }
        let refused = self.try_admit(items, transaction);
        let (counter, code) = match refused {
            Ok(()) => return Ok(()),
            Err(Refusal::Item) => (&self.item_throttled, THROTTLED),
            Err(Refusal::Table) => (&self.table_throttled, THROTTLED),
            Err(Refusal::Conflict) => (&self.conflicts, CONFLICT),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let detail = format!("{code}: refused by the scale model's capacity ({refused:?})");
        Err(if code == CONFLICT {
            StoreError::Busy(detail)
        } else {
            StoreError::Unavailable(detail)
        })
    }

    fn try_admit(&self, items: &[String], transaction: bool) -> Result<(), Refusal> {
        let now = Instant::now();
        let cost = if transaction { 2.0 } else { 1.0 };
        let m = &self.model;
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let state = &mut *guard;
        if items
            .iter()
            .any(|k| state.held.get(k).is_some_and(|until| *until > now))
        {
            return Err(Refusal::Conflict);
        }
        if m.item_wcu.is_finite() {
            for k in items {
                let b = state
                    .items
                    .entry(k.clone())
                    .or_insert_with(|| Bucket::full(m.item_wcu, now));
                b.refill(m.item_wcu, now);
                // The same item twice in one transaction is a validation
                // error in DynamoDB; never made here.
                if b.tokens < cost {
                    return Err(Refusal::Item);
                }
            }
        }
        let mut per_table: Vec<(&str, f64)> = Vec::new();
        if let Some(rate) = m.table_wcu {
            for k in items {
                let table = k.split_once('/').map_or(k.as_str(), |(t, _)| t);
                match per_table.iter_mut().find(|(t, _)| *t == table) {
                    Some((_, c)) => *c += cost,
                    None => per_table.push((table, cost)),
                }
            }
            for (table, c) in &per_table {
                let b = state
                    .tables
                    .entry((*table).to_owned())
                    .or_insert_with(|| Bucket::full(rate, now));
                b.refill(rate, now);
                if b.tokens < *c {
                    return Err(Refusal::Table);
                }
            }
        }
        for k in items {
            if let Some(b) = state.items.get_mut(k) {
                b.tokens -= cost;
            }
            if transaction && !m.hold.is_zero() {
                state.held.insert(k.clone(), now + m.hold);
            }
        }
        for (table, c) in &per_table {
            if let Some(b) = state.tables.get_mut(*table) {
                b.tokens -= c;
            }
        }
        state.admitted += 1;
        if state.admitted.is_multiple_of(65_536) {
            // Forget what no longer matters: full buckets, ended holds.
            let rate = m.item_wcu;
            state.items.retain(|_, b| {
                b.refill(rate, now);
                b.tokens < rate
            });
            state.held.retain(|_, until| *until > now);
        }
        Ok(())
    }

    /// The store's wait before its next attempt: `delay`, or with
    /// [`CapacityModel::jittered_store_retries`] a uniform draw below it.
    fn store_backoff(&self, delay: Duration) -> Duration {
        if !self.model.jittered_store_retries {
            return delay;
        }
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        delay.mul_f64(rng.random_range(0.0..1.0))
    }

    fn sdk_backoff(&self, retry: u32) -> Duration {
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        let jitter: f64 = rng.random_range(0.0..1.0);
        Duration::from_secs_f64(jitter * f64::from(1u32 << (retry - 1).min(10)))
    }
}

/// The capacity key of an item: `table/pk`.
fn key(table: &str, pk: Option<&AttributeValue>) -> String {
    match pk {
        Some(AttributeValue::S(s)) => format!("{table}/{s}"),
        Some(other) => format!("{table}/{other:?}"),
        None => format!("{table}/?"),
    }
}

/// The items a staged write touches.
fn write_key(w: &TransactWriteItem) -> String {
    if let Some(p) = w.put() {
        key(p.table_name(), p.item().get("pk"))
    } else if let Some(u) = w.update() {
        key(u.table_name(), u.key().get("pk"))
    } else if let Some(d) = w.delete() {
        key(d.table_name(), d.key().get("pk"))
    } else if let Some(c) = w.condition_check() {
        key(c.table_name(), c.key().get("pk"))
    } else {
        "?/?".to_owned()
    }
}

fn transaction_keys(record: Option<&str>, writes: &[StagedWrite]) -> Vec<String> {
    record
        .map(|pk| format!("{DEDUP_TABLE}/{pk}"))
        .into_iter()
        .chain(writes.iter().map(|w| write_key(&w.item)))
        .collect()
}

/// A [`DedupStore`] whose writes pass the [`Capacity`] when they apply.
#[derive(Debug, Clone)]
pub struct Throttled<S> {
    inner: S,
    capacity: Arc<Capacity>,
}

impl<S: DedupStore> Throttled<S> {
    /// `inner` behind `capacity`.
    pub fn new(inner: S, capacity: Arc<Capacity>) -> Self {
        Self { inner, capacity }
    }

    fn single(&self, pk: &str) -> Result<(), StoreError> {
        self.capacity.admit(&[format!("{DEDUP_TABLE}/{pk}")], false)
    }
}

impl<S: DedupStore> DedupStore for Throttled<S> {
    fn report_to(&self, metrics: Arc<Metrics>) {
        self.inner.report_to(metrics);
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.single(&req.pk)?;
        self.inner.claim(req).await
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        if c.writes.is_empty() {
            self.single(&c.pk)?;
        } else {
            self.capacity
                .admit(&transaction_keys(Some(&c.pk), &c.writes), true)?;
        }
        self.inner.complete(c).await
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        self.single(pk)?;
        self.inner.release(pk, owner, error).await
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.single(pk)?;
        self.inner.mark_failed(pk, owner, error, ttl).await
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.single(pk)?;
        self.inner.extend_lease(pk, owner, lease, ttl).await
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        self.capacity
            .admit(&transaction_keys(None, &writes), true)?;
        self.inner.commit_unprotected(writes).await
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        self.capacity
            .admit(&transaction_keys(Some(&c.pk), &c.writes), true)?;
        self.inner.commit_fast(c).await
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        self.single(pk)?;
        self.inner.mark_dispatched(pk, sent).await
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        self.inner.get(pk).await
    }
}

/// What kind of call, for the SDK's retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// `UpdateItem`: a throttle is retried by the SDK.
    Single,
    /// `TransactWriteItems`: a cancellation is not.
    Transaction,
}

/// The client side of a refusal: the SDK's retries and
/// `DynamoStore::retrying`'s (see the module's text).
#[derive(Debug, Clone)]
pub struct Retrying<S> {
    inner: S,
    capacity: Arc<Capacity>,
}

/// Attempts `DynamoStore::retrying` makes (its `UNKNOWN_OUTCOME_ATTEMPTS`).
const STORE_ATTEMPTS: u32 = 4;
/// Attempts the SDK's standard retry mode makes.
const SDK_ATTEMPTS: u32 = 3;

impl<S: DedupStore> Retrying<S> {
    /// `inner`, its refusals retried; the library's metrics noted in
    /// `capacity`.
    pub fn new(inner: S, capacity: Arc<Capacity>) -> Self {
        Self { inner, capacity }
    }

    async fn retry<T, F, Fut>(&self, call: Call, mut op: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let refused = |r: &Result<T, StoreError>| match r {
            Err(StoreError::Unavailable(m)) if m.starts_with(THROTTLED) => Some(THROTTLED),
            Err(StoreError::Busy(m)) if m.starts_with(CONFLICT) => Some(CONFLICT),
            _ => None,
        };
        let mut delay = Duration::from_millis(50);
        let mut attempt = 1;
        loop {
            let mut sdk_retry = 1;
            let out = loop {
                let out = op().await;
                if call == Call::Single
                    && refused(&out) == Some(THROTTLED)
                    && sdk_retry < SDK_ATTEMPTS
                {
                    self.capacity.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(self.capacity.sdk_backoff(sdk_retry)).await;
                    sdk_retry += 1;
                    continue;
                }
                break out;
            };
            if refused(&out).is_none() {
                return out;
            }
            if attempt == STORE_ATTEMPTS {
                self.capacity.gave_up.fetch_add(1, Ordering::Relaxed);
                return out;
            }
            self.capacity.retries.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(self.capacity.store_backoff(delay)).await;
            delay *= 2;
            attempt += 1;
        }
    }
}

impl<S: DedupStore> DedupStore for Retrying<S> {
    fn report_to(&self, metrics: Arc<Metrics>) {
        self.capacity
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(metrics.clone());
        self.inner.report_to(metrics);
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.retry(Call::Single, || self.inner.claim(req)).await
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        let call = if c.writes.is_empty() {
            Call::Single
        } else {
            Call::Transaction
        };
        self.retry(call, || self.inner.complete(c.clone())).await
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        self.retry(Call::Single, || self.inner.release(pk, owner, error))
            .await
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.retry(Call::Single, || {
            self.inner.mark_failed(pk, owner, error, ttl)
        })
        .await
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.retry(Call::Single, || {
            self.inner.extend_lease(pk, owner, lease, ttl)
        })
        .await
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        self.retry(Call::Transaction, || {
            self.inner.commit_unprotected(writes.clone())
        })
        .await
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        self.retry(Call::Transaction, || self.inner.commit_fast(c.clone()))
            .await
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        self.retry(Call::Single, || self.inner.mark_dispatched(pk, sent))
            .await
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        self.inner.get(pk).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("ledger/e{i}")).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn an_item_takes_a_thousand_units_a_second_and_no_more() {
        let c = Capacity::new(CapacityModel::dynamodb(None), 1);
        let hot = ["accounts/a0".to_owned()];
        // 1,000 single writes (1 unit each) in one instant: the bucket's second.
        for _ in 0..1_000 {
            c.admit(&hot, false).expect("within the item's units");
        }
        assert!(c.admit(&hot, false).is_err(), "the 1,001st is throttled");
        assert_eq!(c.refusals().item_throttled, 1);
        // Another item is not affected.
        c.admit(&["accounts/a1".to_owned()], false)
            .expect("a cold item");
        tokio::time::advance(Duration::from_millis(100)).await;
        for _ in 0..100 {
            c.admit(&hot, false).expect("refilled at 1,000 a second");
        }
        assert!(c.admit(&hot, false).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_table_limit_counts_two_units_per_transactional_item() {
        let c = Capacity::new(
            CapacityModel {
                hold: Duration::ZERO,
                ..CapacityModel::dynamodb(Some(4_000.0))
            },
            1,
        );
        // Transactions of 2 items in one table: 4 units each, 1,000 of them.
        let all = items(2_002);
        for pair in all.chunks(2).take(1_000) {
            c.admit(pair, true).expect("within the table's units");
        }
        assert!(c.admit(&all[2_000..], true).is_err());
        assert_eq!(c.refusals().table_throttled, 1);
        // Another table has its own limit.
        c.admit(&["dedup/x".to_owned()], true)
            .expect("a second table");
    }

    #[tokio::test(start_paused = true)]
    async fn a_transaction_holds_its_items_against_writes_until_its_hold_ends() {
        let c = Capacity::new(CapacityModel::dynamodb(None), 1);
        let a = vec!["dedup/k1".to_owned(), "accounts/a0".to_owned()];
        let b = vec!["dedup/k2".to_owned(), "accounts/a0".to_owned()];
        c.admit(&a, true).expect("first");
        assert!(c.admit(&b, true).is_err(), "the account is held");
        assert!(
            c.admit(&["accounts/a0".to_owned()], false).is_err(),
            "a single write to a held item conflicts too"
        );
        assert_eq!(c.refusals().conflicts, 2);
        tokio::time::advance(Duration::from_millis(10)).await;
        c.admit(&b, true).expect("the hold has ended");
    }

    #[tokio::test(start_paused = true)]
    async fn unlimited_admits_everything() {
        let c = Capacity::new(CapacityModel::unlimited(), 1);
        let hot = ["accounts/a0".to_owned()];
        for _ in 0..10_000 {
            c.admit(&hot, true).expect("no limit");
        }
        assert_eq!(c.refusals(), Refusals::default());
    }
}
