//! An in-memory [`DedupStore`] with the protocol's semantics, for fast tests.
//!
//! Staged writes are recorded (see [`MemoryStore::for_each_committed`]) atomically
//! with the completion, but their own conditions are not evaluated: behaviour
//! that depends on DynamoDB's condition semantics is tested against DynamoDB.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_dynamodb::types::TransactWriteItem;

use crate::protocol::clock::{Clock, SystemClock};
use crate::protocol::metrics::Metrics;
use crate::protocol::outcome::StagedWrite;
use crate::protocol::store::{
    Claim, ClaimRequest, Completion, DedupStore, FastCommit, FastCommitted, InsertCommit, Inserted,
    Record, Status, StoreError, bounded_error, check_transaction_limits, decide_conflict, describe,
    next_fence, record_bytes,
};

/// The in-memory store. Clones share state.
#[derive(Debug, Clone)]
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    state: Arc<Mutex<State>>,
    unavailable: Arc<AtomicBool>,
    metrics: Arc<std::sync::OnceLock<Arc<Metrics>>>,
}

#[derive(Debug, Default)]
struct State {
    records: HashMap<String, Record>,
    /// Items written by the insert path, by table and key values.
    items: HashMap<(String, Vec<String>), Item>,
    committed: Committed,
    /// Guarded writes applied to a record another owner held, and
    /// `COMPLETED` records a claim or a fast-path commit replaced before
    /// their `expires_at` (never, with fencing and the conditions intact):
    /// what the simulator's checker reads.
    fencing_breaches: Vec<String>,
    /// Each claim's lease end as stored, by (key, attempt), as an instant of
    /// the tokio clock: the latest end its claim and extensions set (the
    /// stored `lease_until` less the writer's clock plus the instant the
    /// write applied), cut to the instant its release or failure applied.
    /// What the simulator's checker compares external calls with.
    lease_ends: HashMap<(String, u32), tokio::time::Instant>,
    /// Keys of `COMPLETED` records that TTL ended: replaced by a claim or a
    /// fast-path commit after their `expires_at` (by the writer's clock), or
    /// deleted by [`MemoryStore::sweep_expired`]. What the simulator's
    /// checker reads to tell a duplicate that came after its record's TTL
    /// (the documented limit) from one applied twice: each with the instant
    /// of the tokio clock it ended at.
    ended_by_ttl: Vec<(String, tokio::time::Instant)>,
    /// The highest fence each key's records have held, deleted ones
    /// included: a claim or fast-path commit that stores one not above it
    /// is a fencing breach (never, with the fence's rules intact and the
    /// clocks within the TTL of each other).
    fences: HashMap<String, u64>,
    /// The check of each write's `expires_at` (see [`MemoryStore::expect_ttl`]).
    ttl: TtlCheck,
}

/// The check that every record write carries the configured TTL: its
/// `expires_at` is the writer's clock (as the store reads it for the write)
/// in whole seconds plus the TTL. Off until a TTL is expected.
#[derive(Debug, Default)]
struct TtlCheck {
    /// The TTL the consumers are configured with.
    expected: Option<Duration>,
    /// Keys whose record holds an `expires_at` the check found wrong: TTL
    /// ending such a record excuses nothing (it is noted as a breach, not
    /// as an end).
    wrong: HashSet<String>,
    /// The writes found wrong, described.
    breaches: Vec<String>,
}

impl TtlCheck {
    /// Checks the `expires_at` a write of `owner` stored in `pk`'s record,
    /// its clock reading `now_ms`.
    fn check(&mut self, pk: &str, owner: &str, what: &str, now_ms: i64, stored: i64) {
        let Some(ttl) = self.expected else {
            return;
        };
        let expected = expires_at(now_ms, ttl);
        if stored == expected {
            self.wrong.remove(pk);
        } else {
            self.wrong.insert(pk.to_owned());
            self.breaches.push(format!(
                "{pk}: {what} of owner {owner} wrote expires_at {stored}, not {expected} (the writer's clock, {}s, plus the configured TTL {}s)",
                now_ms.div_euclid(1000),
                ttl.as_secs()
            ));
        }
    }

    /// Whether TTL may end `pk`'s record as an excuse: its `expires_at`
    /// passed the check. If not, the end is noted as a breach.
    fn may_end(&mut self, pk: &str, how: &str) -> bool {
        if !self.wrong.remove(pk) {
            return true;
        }
        self.breaches.push(format!(
            "{pk}: its record, written with a wrong expires_at, {how}"
        ));
        false
    }
}

/// A DynamoDB item.
type Item = HashMap<String, aws_sdk_dynamodb::types::AttributeValue>;

/// Committed transactions' staged writes, in commit order, each with the
/// instant of the tokio clock it committed at.
type Committed = Vec<(tokio::time::Instant, Vec<TransactWriteItem>)>;

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryStore {
    /// An empty store on the given clock.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: Arc::default(),
            unavailable: Arc::default(),
            metrics: Arc::default(),
        }
    }

    /// A view of the same records judged by another clock: each consumer of a
    /// simulation reads time from its own (skewed) clock, as each host's
    /// `DynamoStore` does.
    pub fn with_clock(&self, clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            state: self.state.clone(),
            unavailable: self.unavailable.clone(),
            metrics: Arc::default(),
        }
    }

    /// Guarded writes (complete, release, mark failed, extend) that applied
    /// to a record another owner held, described: none while fencing holds.
    pub fn fencing_breaches(&self) -> Vec<String> {
        self.lock().fencing_breaches.clone()
    }

    /// Checks from now on that every record write carries `ttl`: its
    /// `expires_at` is the writer's clock in whole seconds plus `ttl`, as
    /// the consumers are configured (the simulator's check that TTL, which
    /// excuses an application after it, is the one configured). A write
    /// found wrong is a breach ([`MemoryStore::ttl_breaches`]), and TTL
    /// ending its record is noted as one, not as an end
    /// ([`MemoryStore::ended_by_ttl`]).
    pub fn expect_ttl(&self, ttl: Duration) {
        self.lock().ttl.expected = Some(ttl);
    }

    /// Record writes whose `expires_at` was not the writer's clock plus the
    /// expected TTL, and TTL ends of such records, described (none while
    /// the TTL is carried as configured; see [`MemoryStore::expect_ttl`]).
    pub fn ttl_breaches(&self) -> Vec<String> {
        self.lock().ttl.breaches.clone()
    }

    /// Each claim's lease end as stored, by (key, attempt), as an instant
    /// of the tokio clock (see `State::lease_ends`).
    pub fn lease_ends(&self) -> Vec<(String, u32, tokio::time::Instant)> {
        let mut ends: Vec<_> = self
            .lock()
            .lease_ends
            .iter()
            .map(|((pk, attempt), end)| (pk.clone(), *attempt, *end))
            .collect();
        ends.sort();
        ends
    }

    /// Keys of `COMPLETED` records that TTL ended (see `State::ended_by_ttl`),
    /// once per end, with the instant of the tokio clock it ended at.
    pub fn ended_by_ttl(&self) -> Vec<(String, tokio::time::Instant)> {
        self.lock().ended_by_ttl.clone()
    }

    /// DynamoDB's TTL deletion, which comes some time after expiry: deletes
    /// each record past its `expires_at` at `now_ms` for which `due` says
    /// its deletion has come, and answers the records deleted.
    pub fn sweep_expired(&self, now_ms: i64, mut due: impl FnMut(&Record) -> bool) -> Vec<Record> {
        let mut guard = self.lock();
        let state = &mut *guard;
        // In key order: `due` may draw from a seeded stream (the simulator),
        // so the order it is asked in must not depend on the map's.
        let mut past: Vec<&Record> = state
            .records
            .values()
            .filter(|r| r.expires_at_s < now_ms.div_euclid(1000))
            .collect();
        past.sort_by(|a, b| a.pk.cmp(&b.pk));
        let expired: Vec<String> = past
            .into_iter()
            .filter(|r| due(r))
            .map(|r| r.pk.clone())
            .collect();
        let mut deleted: Vec<Record> = expired
            .iter()
            .filter_map(|pk| state.records.remove(pk))
            .collect();
        deleted.sort_by(|a, b| a.pk.cmp(&b.pk));
        let now = tokio::time::Instant::now();
        for r in &deleted {
            let ends = state.ttl.may_end(&r.pk, "was deleted by TTL");
            if ends && r.status == Status::Completed {
                state.ended_by_ttl.push((r.pk.clone(), now));
            }
        }
        deleted
    }

    /// Every record, by key.
    pub fn records(&self) -> Vec<Record> {
        let mut records: Vec<Record> = self.lock().records.values().cloned().collect();
        records.sort_by(|a, b| a.pk.cmp(&b.pk));
        records
    }

    /// Calls `f` with every committed transaction's staged writes, in commit
    /// order, without copying them (for checks over millions of commits).
    /// The store is locked meanwhile: `f` must not call it.
    pub fn for_each_committed(&self, mut f: impl FnMut(&[TransactWriteItem])) {
        self.for_each_committed_at(|_, writes| f(writes));
    }

    /// [`MemoryStore::for_each_committed`], with the instant of the tokio
    /// clock each transaction committed at.
    pub fn for_each_committed_at(
        &self,
        mut f: impl FnMut(tokio::time::Instant, &[TransactWriteItem]),
    ) {
        for (at, writes) in &self.lock().committed {
            f(*at, writes);
        }
    }

    /// The items the insert path wrote to `table` ([`crate::Effects::Insert`]),
    /// with their markers, in key order.
    pub fn items(&self, table: &str) -> Vec<Item> {
        let state = self.lock();
        let mut items: Vec<(&Vec<String>, &Item)> = state
            .items
            .iter()
            .filter(|((t, _), _)| t == table)
            .map(|((_, k), item)| (k, item))
            .collect();
        items.sort_by(|a, b| a.0.cmp(b.0));
        items.into_iter().map(|(_, item)| item.clone()).collect()
    }

    /// Writes `item` to `table` as if by another tool (no marker of its
    /// own unless it has one), keyed by `key`.
    pub fn put_item(&self, table: &str, key: &[&str], item: Item) {
        let key = key_values(key.iter().copied(), &item);
        self.lock().items.insert((table.to_owned(), key), item);
    }

    /// Makes every call fail with [`StoreError::Unavailable`] until set back.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.unavailable.store(unavailable, Ordering::SeqCst);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("memory store lock")
    }

    fn check_available(&self) -> Result<(), StoreError> {
        if self.unavailable.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable(
                "memory store set unavailable".into(),
            ));
        }
        Ok(())
    }

    /// Applies `f` to our record if `owner` still holds it in progress; a no-op
    /// when `done` says an earlier call of ours already did it. `stamp`:
    /// the write (named) sets the record's `expires_at` from the writer's
    /// clock reading this (checked: see [`MemoryStore::expect_ttl`]); with
    /// none, `f` must leave it as it was.
    fn with_owned(
        &self,
        pk: &str,
        owner: &str,
        stamp: Option<(&str, i64)>,
        done: impl FnOnce(&Record) -> bool,
        f: impl FnOnce(&mut Record, &mut Committed),
    ) -> Result<(), StoreError> {
        self.check_available()?;
        let mut guard = self.lock();
        let state = &mut *guard;
        // (The `no-fencing` mutant, for the simulator only, ignores the owner.)
        let fenced = !crate::protocol::mutants::active("no-fencing");
        match state.records.get_mut(pk) {
            Some(r)
                if (r.owner.as_deref() == Some(owner) || !fenced)
                    && r.status == Status::InProgress =>
            {
                if r.owner.as_deref() != Some(owner) {
                    state.fencing_breaches.push(format!(
                        "{pk}: a write of owner {owner} applied while {} held it",
                        r.owner.as_deref().unwrap_or("nobody")
                    ));
                }
                let expires_before = r.expires_at_s;
                f(r, &mut state.committed);
                match stamp {
                    Some((what, now_ms)) => {
                        state.ttl.check(pk, owner, what, now_ms, r.expires_at_s)
                    }
                    None if r.expires_at_s != expires_before => {
                        state.ttl.wrong.insert(pk.to_owned());
                        state.ttl.breaches.push(format!(
                            "{pk}: a release of owner {owner} changed expires_at from {expires_before} to {}",
                            r.expires_at_s
                        ));
                    }
                    None => {}
                }
                if r.lease_until_ms == 0 || r.status != Status::InProgress {
                    // Released, failed or completed: the attempt's lease ends now.
                    let now = tokio::time::Instant::now();
                    if let Some(end) = state.lease_ends.get_mut(&(pk.to_owned(), r.attempts)) {
                        *end = (*end).min(now);
                    }
                }
                Ok(())
            }
            Some(r) if r.owner.as_deref() == Some(owner) && done(r) => Ok(()),
            other => Err(StoreError::LeaseLost {
                pk: pk.to_owned(),
                found: describe(other.map(|r| &*r)),
            }),
        }
    }
}

/// The items of staged writes, in an allocation of their own size: kept for
/// the store's life, they would otherwise keep the staging vector's spare
/// capacity (a `TransactWriteItem` is close to 1 KB inline).
fn items_of(writes: Vec<StagedWrite>) -> Vec<TransactWriteItem> {
    let mut items: Vec<TransactWriteItem> = writes.into_iter().map(|w| w.item).collect();
    items.shrink_to_fit();
    items
}

/// The values of an item's `key` attributes, as text that tells types apart.
fn key_values<'a>(key: impl Iterator<Item = &'a str>, item: &Item) -> Vec<String> {
    key.map(|k| format!("{:?}", item.get(k))).collect()
}

fn expires_at(now_ms: i64, ttl: Duration) -> i64 {
    now_ms.div_euclid(1000) + i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX / 2)
}

/// A `COMPLETED` record past its `expires_at` at `now_ms`.
fn completed_and_expired(r: &Record, now_ms: i64) -> bool {
    r.status == Status::Completed && r.expires_at_s < now_ms.div_euclid(1000)
}

/// Logs the end of a `COMPLETED` record (its key, and whether it had
/// expired by the writer's clock) that a claim or a fast-path commit of
/// `owner` is replacing: by TTL when it had expired (the documented limit),
/// else as a breach (a record that said done, overwritten while alive:
/// never, with the conditions intact). Judged apart from the conditions, so
/// a bug in them shows.
fn ended_by_ttl(state: &mut State, (pk, expired): (String, bool), owner: &str) {
    if expired && !state.ttl.may_end(&pk, "was replaced after it expired") {
        return;
    }
    if expired {
        state.ended_by_ttl.push((pk, tokio::time::Instant::now()));
    } else {
        state.fencing_breaches.push(format!(
            "{pk}: its COMPLETED record replaced by owner {owner} before its expires_at"
        ));
    }
}

/// Notes the fence a claim or fast-path commit of `owner` stored for
/// `pk`: one not above every fence the key held before is a breach.
fn note_fence(state: &mut State, pk: &str, fence: u64, owner: &str) {
    let highest = state.fences.entry(pk.to_owned()).or_default();
    if fence <= *highest {
        let highest = *highest;
        state.fencing_breaches.push(format!(
            "{pk}: owner {owner} stored fence {fence}, not above the {highest} the key held"
        ));
    } else {
        *highest = fence;
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)
}

impl DedupStore for MemoryStore {
    fn report_to(&self, metrics: Arc<Metrics>) {
        let _ = self.metrics.set(metrics);
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.check_available()?;
        let now_ms = self.clock.now_ms();
        let mut state = self.lock();
        let old = state.records.get(&req.pk);
        // (The `always-in-flight` mutant, for the simulator only, answers
        // every claim as held elsewhere: a consumer that processes nothing.)
        if crate::protocol::mutants::active("always-in-flight") {
            return Ok(Claim::InFlight {
                lease_until_ms: now_ms + ms(req.lease),
                payload_matches: true,
            });
        }
        // (The `rerun-completed` mutant, for the simulator only, claims a
        // `COMPLETED` key again instead of answering a duplicate.)
        let rerun = crate::protocol::mutants::active("rerun-completed")
            && old.is_some_and(|o| o.status == Status::Completed);
        if let Some(old) = old
            && !rerun
            && !old.claimable_by(now_ms, &req.message_id)
        {
            return Ok(decide_conflict(old, req, now_ms));
        }
        if old.is_some_and(|o| o.taken_over_by(&req.owner))
            && let Some(m) = self.metrics.get()
        {
            m.takeover();
        }
        let attempts = old.map_or(0, |o| o.attempts) + 1;
        let fence = next_fence(old.map(|o| o.fence), now_ms);
        let error = old.and_then(|o| o.error.clone());
        let replaced = old
            .filter(|o| o.status == Status::Completed)
            .map(|o| (o.pk.clone(), completed_and_expired(o, now_ms)));
        if let Some(replaced) = replaced {
            ended_by_ttl(&mut state, replaced, &req.owner);
        }
        note_fence(&mut state, &req.pk, fence, &req.owner);
        state.lease_ends.insert(
            (req.pk.clone(), attempts),
            tokio::time::Instant::now() + req.lease,
        );
        state.records.insert(
            req.pk.clone(),
            Record {
                pk: req.pk.clone(),
                status: Status::InProgress,
                owner: Some(req.owner.clone()),
                lease_until_ms: now_ms + ms(req.lease),
                expires_at_s: expires_at(now_ms, req.ttl),
                attempts,
                fence,
                payload_sha256: Some(req.payload_sha256.clone()),
                result: None,
                message_id: Some(req.message_id.clone()),
                claimed_at_ms: Some(now_ms),
                completed_at_ms: None,
                error,
                outbox: Vec::new(),
            },
        );
        let stored = state.records[&req.pk].expires_at_s;
        state
            .ttl
            .check(&req.pk, &req.owner, "a claim", now_ms, stored);
        Ok(Claim::Acquired {
            attempt: attempts,
            fence,
        })
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        check_transaction_limits(&c.writes, record_bytes(&c.pk, c.result.as_ref(), &c.outbox))?;
        let now_ms = self.clock.now_ms();
        self.with_owned(
            &c.pk,
            &c.owner,
            Some(("a completion", now_ms)),
            |r| r.status == Status::Completed,
            |r, committed| {
                r.status = Status::Completed;
                r.result = c.result;
                r.outbox = c.outbox;
                r.completed_at_ms = Some(now_ms);
                r.expires_at_s = expires_at(now_ms, c.ttl);
                if !c.writes.is_empty() {
                    committed.push((tokio::time::Instant::now(), items_of(c.writes)));
                }
            },
        )
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        self.with_owned(
            pk,
            owner,
            None,
            |_| false,
            |r, _| {
                r.lease_until_ms = 0;
                r.error = Some(bounded_error(error));
            },
        )
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let now_ms = self.clock.now_ms();
        self.with_owned(
            pk,
            owner,
            Some(("a failure", now_ms)),
            |r| r.status == Status::Failed,
            |r, _| {
                r.status = Status::Failed;
                r.lease_until_ms = 0;
                r.error = Some(bounded_error(error));
                r.expires_at_s = expires_at(now_ms, ttl);
            },
        )
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.check_available()?;
        let now_ms = self.clock.now_ms();
        let lease_until = now_ms + ms(lease);
        let mut guard = self.lock();
        let state = &mut *guard;
        match state.records.get_mut(pk) {
            // Only a live lease of ours is extended, and only forward (see
            // the trait).
            Some(r)
                if (r.owner.as_deref() == Some(owner)
                    || crate::protocol::mutants::active("no-fencing"))
                    && r.status == Status::InProgress
                    && r.lease_until_ms > now_ms =>
            {
                if r.owner.as_deref() != Some(owner) {
                    let holder = r.owner.clone().unwrap_or_else(|| "nobody".into());
                    state.fencing_breaches.push(format!(
                        "{pk}: an extension of owner {owner} applied while {holder} held it"
                    ));
                }
                if r.lease_until_ms < lease_until {
                    r.lease_until_ms = lease_until;
                    r.expires_at_s = expires_at(now_ms, ttl);
                    state
                        .ttl
                        .check(pk, owner, "an extension", now_ms, r.expires_at_s);
                    let end = tokio::time::Instant::now() + lease;
                    let stored = state
                        .lease_ends
                        .entry((pk.to_owned(), r.attempts))
                        .or_insert(end);
                    *stored = (*stored).max(end);
                }
                Ok(())
            }
            other => Err(StoreError::LeaseLost {
                pk: pk.to_owned(),
                found: describe(other.map(|r| &*r)),
            }),
        }
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        check_transaction_limits(&writes, 0)?;
        self.check_available()?;
        if !writes.is_empty() {
            self.lock()
                .committed
                .push((tokio::time::Instant::now(), items_of(writes)));
        }
        Ok(())
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        check_transaction_limits(&c.writes, record_bytes(&c.pk, c.result.as_ref(), &c.outbox))?;
        self.check_available()?;
        let now_ms = self.clock.now_ms();
        let mut guard = self.lock();
        let state = &mut *guard;
        let old = state.records.get(&c.pk);
        if crate::protocol::mutants::active("always-in-flight") {
            return Ok(FastCommitted::InFlight {
                lease_until_ms: now_ms + 30_000,
                payload_matches: true,
            });
        }
        if let Some(old) = old
            && !c.may_replace(old, now_ms)
        {
            return Ok(c.conflict(old, now_ms));
        }
        let attempts = old.map_or(0, |o| o.attempts) + 1;
        let replaced = old
            .filter(|o| o.status == Status::Completed)
            .map(|o| (o.pk.clone(), completed_and_expired(o, now_ms)));
        if let Some(replaced) = replaced {
            ended_by_ttl(state, replaced, &c.owner);
        }
        note_fence(state, &c.pk, c.fence, &c.owner);
        state.records.insert(
            c.pk.clone(),
            Record {
                pk: c.pk.clone(),
                status: Status::Completed,
                owner: Some(c.owner.clone()),
                lease_until_ms: 0,
                expires_at_s: expires_at(now_ms, c.ttl),
                attempts,
                fence: c.fence,
                payload_sha256: Some(c.payload_sha256.clone()),
                result: c.result,
                message_id: Some(c.message_id.clone()),
                claimed_at_ms: Some(now_ms),
                completed_at_ms: Some(now_ms),
                error: None,
                outbox: c.outbox,
            },
        );
        let stored = state.records[&c.pk].expires_at_s;
        state
            .ttl
            .check(&c.pk, &c.owner, "a fast-path commit", now_ms, stored);
        if !c.writes.is_empty() {
            state
                .committed
                .push((tokio::time::Instant::now(), items_of(c.writes)));
        }
        Ok(FastCommitted::Committed)
    }

    async fn commit_insert(&self, c: InsertCommit) -> Result<Inserted, StoreError> {
        self.check_available()?;
        let key = key_values(c.key.iter().map(String::as_str), &c.item);
        let mut guard = self.lock();
        let state = &mut *guard;
        let slot = (c.table.clone(), key);
        // (The `insert-unconditional` mutant, for the simulator only, puts
        // the item without its condition: it replaces the one in the way.)
        let conditional = !crate::protocol::mutants::active("insert-unconditional");
        if let Some(old) = state.items.get(&slot).filter(|_| conditional) {
            return Ok(c.found(old, false));
        }
        let item = c.marked_item();
        let put = aws_sdk_dynamodb::types::Put::builder()
            .table_name(&c.table)
            .set_item(Some(item.clone()))
            .build()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        state.items.insert(slot, item);
        state.committed.push((
            tokio::time::Instant::now(),
            vec![TransactWriteItem::builder().put(put).build()],
        ));
        Ok(Inserted::Inserted)
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[crate::protocol::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        self.check_available()?;
        if let Some(r) = self.lock().records.get_mut(pk)
            && r.status == Status::Completed
            && r.outbox == sent
        {
            r.outbox.clear();
        }
        Ok(())
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        self.check_available()?;
        Ok(self.lock().records.get(pk).cloned())
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::protocol::clock::ManualClock;
    use crate::protocol::store::clock_fence;

    const LEASE: Duration = Duration::from_secs(30);
    const TTL: Duration = Duration::from_secs(3600);

    fn req(pk: &str, message_id: &str) -> ClaimRequest {
        ClaimRequest {
            pk: pk.to_owned(),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message_id.to_owned(),
            payload_sha256: "p".into(),
            lease: LEASE,
            ttl: TTL,
        }
    }

    fn completion(r: &ClaimRequest) -> Completion {
        Completion {
            pk: r.pk.clone(),
            owner: r.owner.clone(),
            result: None,
            ttl: TTL,
            writes: vec![],
            outbox: vec![],
        }
    }

    fn fast(pk: &str, fence: u64) -> FastCommit {
        FastCommit {
            pk: pk.to_owned(),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: uuid::Uuid::new_v4().to_string(),
            payload_sha256: "p".into(),
            fence,
            result: None,
            ttl: TTL,
            writes: vec![],
            outbox: vec![],
        }
    }

    /// The fence of an acquired claim.
    async fn fence_of(store: &MemoryStore, r: &ClaimRequest) -> u64 {
        match store.claim(r).await.unwrap() {
            Claim::Acquired { fence, .. } => {
                let stored = store.get(&r.pk).await.unwrap().unwrap().fence;
                assert_eq!(stored, fence, "the claim's fence is the one stored");
                fence
            }
            other => panic!("not acquired: {other:?}"),
        }
    }

    #[tokio::test]
    async fn the_fence_grows_across_a_claim_a_takeover_and_the_records_expiry_and_deletion() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let first = fence_of(&store, &req("c#k", "m1")).await;
        assert!(first > clock_fence(clock.now_ms()), "starts from the clock");

        // The first holder's lease runs out: taken over.
        clock.advance(LEASE + Duration::from_secs(1));
        let taker = req("c#k", "m1");
        let second = fence_of(&store, &taker).await;
        assert!(second > first, "{second} after {first}");
        store.complete(completion(&taker)).await.unwrap();

        // Past its expires_at, still there: claimed again.
        clock.advance(TTL + Duration::from_secs(1));
        let late = req("c#k", "m2");
        let third = fence_of(&store, &late).await;
        assert!(third > second, "{third} after {second}");
        store.complete(completion(&late)).await.unwrap();

        // Deleted by the TTL: a claim starts again from the clock, above.
        clock.advance(TTL + Duration::from_secs(1));
        let deleted = store.sweep_expired(clock.now_ms(), |_| true);
        assert_eq!(deleted.len(), 1);
        assert!(store.get("c#k").await.unwrap().is_none());
        let fourth = fence_of(&store, &req("c#k", "m3")).await;
        assert!(fourth > third, "{fourth} after {third}");
        assert_eq!(store.fencing_breaches(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn a_fence_stored_not_above_the_keys_highest_is_a_breach_for_the_checker() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let first = req("c#k", "m1");
        fence_of(&store, &first).await;
        store.complete(completion(&first)).await.unwrap();
        clock.advance(TTL + Duration::from_secs(1));
        store.sweep_expired(clock.now_ms(), |_| true);
        // A clock a whole TTL behind, far beyond any skew the lease allows
        // for, starts the record again below the deleted one's fence.
        let behind = ManualClock::starting_now();
        behind.set(SystemTime::now() - TTL);
        fence_of(&store.with_clock(Arc::new(behind)), &req("c#k", "m2")).await;
        let breaches = store.fencing_breaches();
        assert_eq!(breaches.len(), 1, "{breaches:?}");
        assert!(breaches[0].contains("not above"), "{breaches:?}");
    }

    #[tokio::test]
    async fn a_claim_by_a_clock_behind_the_last_claimers_still_gets_a_higher_fence() {
        let ahead = ManualClock::starting_now();
        let behind = ManualClock::starting_now();
        behind.set(SystemTime::now() - Duration::from_secs(4));
        let store = MemoryStore::new(Arc::new(ahead.clone()));
        let first_req = req("c#k", "m1");
        let first = fence_of(&store, &first_req).await;
        store
            .release("c#k", &first_req.owner, "retry")
            .await
            .unwrap();
        let slow = store.with_clock(Arc::new(behind));
        let second = fence_of(&slow, &req("c#k", "m1")).await;
        assert!(second > first, "{second} after {first}");
    }

    /// Every record write is held to the expected TTL, on the writer's
    /// clock: a write short of it is a breach, and TTL ending its record is
    /// a breach too, not an end (which would excuse an application after it).
    #[tokio::test]
    async fn a_record_written_with_a_ttl_other_than_expected_is_a_breach_and_ends_nothing() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new(Arc::new(clock.clone()));
        store.expect_ttl(TTL);
        let held = req("c#k", "m1");
        fence_of(&store, &held).await;
        let mut short = completion(&held);
        short.ttl = Duration::from_secs(60);
        store.complete(short).await.unwrap();
        let breaches = store.ttl_breaches();
        assert_eq!(breaches.len(), 1, "{breaches:?}");
        assert!(
            breaches[0].contains("a completion of owner"),
            "{breaches:?}"
        );
        // Past the short TTL, a claim takes it: no end by TTL, a breach.
        clock.advance(Duration::from_secs(62));
        fence_of(&store, &req("c#k", "m2")).await;
        assert!(store.ended_by_ttl().is_empty());
        let breaches = store.ttl_breaches();
        assert_eq!(breaches.len(), 2, "{breaches:?}");
        assert!(
            breaches[1].contains("wrong expires_at, was replaced"),
            "{breaches:?}"
        );
        // Written as configured, a record TTL ends is an end.
        let second = req("c#j", "m3");
        fence_of(&store, &second).await;
        store.complete(completion(&second)).await.unwrap();
        clock.advance(TTL + Duration::from_secs(1));
        store.sweep_expired(clock.now_ms(), |r| r.pk == "c#j");
        assert_eq!(store.ended_by_ttl().len(), 1);
        assert_eq!(store.ttl_breaches().len(), 2);
    }

    #[tokio::test]
    async fn a_fast_commit_stores_its_fence_only_over_a_lower_one() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let held = req("c#k", "m1");
        let claimed = fence_of(&store, &held).await;
        store.release("c#k", &held.owner, "retry").await.unwrap();

        // A handler that read its fence before the claim: refused, nothing written.
        let refused = store.commit_fast(fast("c#k", claimed - 1)).await.unwrap();
        assert_eq!(refused, FastCommitted::FenceBehind { stored: claimed });
        let record = store.get("c#k").await.unwrap().unwrap();
        assert_eq!((record.status, record.fence), (Status::InProgress, claimed));

        // One that read a later fence: committed with it; the next claim is above.
        clock.advance(Duration::from_millis(1));
        let later = clock_fence(clock.now_ms());
        assert!(later > claimed);
        let committed = store.commit_fast(fast("c#k", later)).await.unwrap();
        assert_eq!(committed, FastCommitted::Committed);
        assert_eq!(store.get("c#k").await.unwrap().unwrap().fence, later);
        clock.advance(TTL + Duration::from_secs(1));
        assert!(fence_of(&store, &req("c#k", "m2")).await > later);
    }
}
