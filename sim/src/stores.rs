//! The run's dedup store, one of two paths drawn per seed: the memory path
//! ([`sqs_once::MemoryStore`] behind [`FaultyStore`]) or the wire path (the
//! real [`DynamoStore`] and SDK client over [`crate::wire`] to the DynamoDB
//! model). [`Backend`] is what the checker reads, [`HostStore`] what a
//! host's processor calls.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use rand::{RngExt, SeedableRng};
use sqs_once::aws::dynamodb::record_from_item;
use sqs_once::clock::Clock;
use sqs_once::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
};
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{
    Claim, DedupStore, DynamoStore, MemoryQueue, MemoryStore, Message, Record, StagedWrite,
    StoreError,
};

use crate::check::Effect;
use crate::faults::{FaultyStore, Life, Link};
use crate::wire::dynamodb::{DynamoModel, Stamp};
use crate::wire::expr::{Av, Item};
use crate::wire::{self, Service, Wire};

/// Milliseconds of tokio time since `start`.
fn ms_since(start: tokio::time::Instant) -> i64 {
    i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
}

/// Which store a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorePath {
    /// `MemoryStore` behind `FaultyStore` (faster).
    Memory,
    /// `DynamoStore` and the SDK over the wire to the DynamoDB model.
    Wire,
}

/// One seed in this many runs on the wire path.
pub const WIRE_SHARE: u64 = 3;

impl StorePath {
    /// The path of `seed`: drawn from the seed on a stream of its own, so the
    /// scenario's draws (and every memory-path seed's schedule) are as they
    /// were before the wire path existed. `SIM_STORE=memory|wire` forces it.
    pub fn of(seed: u64) -> Self {
        match std::env::var("SIM_STORE").as_deref() {
            Ok("memory") => return Self::Memory,
            Ok("wire") => return Self::Wire,
            _ => {}
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5749_5245_5041_5448);
        if rng.random_range(0..WIRE_SHARE) == 0 {
            Self::Wire
        } else {
            Self::Memory
        }
    }
}

/// The run's store, as the checker reads it.
#[derive(Debug, Clone)]
pub enum Backend {
    /// The memory store (on true time).
    Memory(MemoryStore),
    /// The DynamoDB model.
    Wire(DynamoModel),
}

/// An item of the model as the SDK types it.
pub fn sdk_item(item: &Item) -> HashMap<String, AttributeValue> {
    item.iter()
        .map(|(k, v)| (k.clone(), sdk_value(v)))
        .collect()
}

fn sdk_value(v: &Av) -> AttributeValue {
    match v {
        Av::S(s) => AttributeValue::S(s.clone()),
        Av::N(n) => AttributeValue::N(n.clone()),
        Av::B(b) => AttributeValue::S(b.clone()),
        Av::Bool(b) => AttributeValue::Bool(*b),
        Av::Null => AttributeValue::Null(true),
        Av::L(l) => AttributeValue::L(l.iter().map(sdk_value).collect()),
        Av::M(m) => AttributeValue::M(sdk_item(m)),
        Av::Ss(s) => AttributeValue::Ss(s.clone()),
        Av::Ns(s) => AttributeValue::Ns(s.clone()),
        Av::Bs(s) => AttributeValue::Ss(s.clone()),
    }
}

impl Backend {
    /// A fresh store on `path` (the memory store on true time).
    pub fn new(path: StorePath) -> Self {
        match path {
            StorePath::Memory => Self::Memory(MemoryStore::new(Arc::new(
                sqs_once::clock::TokioClock::starting_at(crate::hosts::epoch()),
            ))),
            StorePath::Wire => Self::Wire(wire::dynamo_model()),
        }
    }

    /// Which path this is.
    pub fn path(&self) -> StorePath {
        match self {
            Self::Memory(_) => StorePath::Memory,
            Self::Wire(_) => StorePath::Wire,
        }
    }

    /// Every dedup record. On the wire path, the dedup table's items read as
    /// `DynamoStore` reads them (`record_from_item`); an item that does not
    /// read as a record is left out (only the store writes that table).
    pub fn records(&self) -> Vec<Record> {
        match self {
            Self::Memory(s) => s.records(),
            Self::Wire(m) => m
                .items(wire::TABLE)
                .iter()
                .filter_map(|i| record_from_item(&sdk_item(i)).ok())
                .collect(),
        }
    }

    /// The ledger rows committed so far, in commit order, each with when it
    /// committed (ms from `start`, the run's start).
    pub fn rows(&self, start: tokio::time::Instant) -> Vec<Effect> {
        let ms = |at: tokio::time::Instant| at.saturating_duration_since(start).as_millis();
        match self {
            Self::Memory(s) => {
                let mut rows = Vec::new();
                s.for_each_committed_at(|at, writes| {
                    rows.extend(
                        writes
                            .iter()
                            .filter_map(|w| crate::world::row_effect(w, ms(at))),
                    );
                });
                rows
            }
            Self::Wire(m) => m
                .committed()
                .into_iter()
                .filter(|(table, _, _)| table == wire::LEDGER)
                .filter_map(|(_, item, at)| {
                    let text = |k: &str| match item.get(k) {
                        Some(Av::S(s)) => Some(s.clone()),
                        _ => None,
                    };
                    Some(Effect {
                        event: text("pk")?,
                        message: text("message")?,
                        at_ms: ms(at),
                        by: text("by").unwrap_or_default(),
                    })
                })
                .collect(),
        }
    }

    /// When the record `pk` became `COMPLETED`, in ms from `start` (the run's
    /// start, when true time read `epoch_ms`), if it says so now and has not
    /// expired: a record past its `expires_at` (by true time plus `grace`,
    /// the most a host's clock runs ahead) is gone to the protocol, whether
    /// or not TTL has deleted it yet. The memory store stamps its records
    /// when it applies a write; on the wire the record's `completed_at` is
    /// the writer's clock when it built the request (before a pause, or a
    /// resend after an attempt timeout), so the model's own time of the
    /// change is used.
    pub fn completed_ms(
        &self,
        pk: &str,
        (epoch_ms, start): (i64, tokio::time::Instant),
        grace: Duration,
    ) -> Option<u128> {
        let now_ms = epoch_ms + ms_since(start) + i64::try_from(grace.as_millis()).unwrap_or(0);
        let record = self
            .records()
            .into_iter()
            .find(|r| r.pk == pk && r.status == sqs_once::Status::Completed)
            .filter(|r| r.expires_at_s.saturating_mul(1000) >= now_ms)?;
        match self {
            Self::Memory(_) => Some(
                u128::try_from(record.completed_at_ms.unwrap_or(epoch_ms) - epoch_ms).unwrap_or(0),
            ),
            Self::Wire(m) => m
                .completed_at(pk)
                .map(|at| at.saturating_duration_since(start).as_millis()),
        }
    }

    /// DynamoDB's TTL deletion: deletes every record past its `expires_at`
    /// at true time `now_ms` for which `due(key, expires_at)` says its
    /// deletion has come; answers the records deleted.
    pub fn sweep_expired(
        &self,
        now_ms: i64,
        mut due: impl FnMut(&str, i64) -> bool,
    ) -> Vec<Record> {
        match self {
            Self::Memory(s) => s.sweep_expired(now_ms, |r| due(&r.pk, r.expires_at_s)),
            Self::Wire(m) => m
                .sweep_expired(wire::TABLE, now_ms.div_euclid(1000), due)
                .iter()
                .filter_map(|i| record_from_item(&sdk_item(i)).ok())
                .collect(),
        }
    }

    /// When TTL ended each key's `COMPLETED` record (ms from `start`, in
    /// order): a claim or a fast-path commit replaced it after its
    /// `expires_at`, or TTL deleted it. The memory store judges expiry by
    /// the writer's clock, as its condition did; the model (whose writers'
    /// clocks it does not know) by true time plus `grace`, the most a
    /// host's clock runs ahead.
    pub fn ended_by_ttl(
        &self,
        clock: (i64, tokio::time::Instant),
        grace: Duration,
    ) -> BTreeMap<String, Vec<u128>> {
        let start = clock.1;
        let ends: Vec<(String, tokio::time::Instant)> = match self {
            Self::Memory(s) => s.ended_by_ttl(),
            Self::Wire(m) => m
                .ended_by_ttl()
                .into_iter()
                .filter(|(_, expires_s, at)| expired(clock, grace, *expires_s, *at))
                .map(|(key, _, at)| (key, at))
                .collect(),
        };
        let mut by_key: BTreeMap<String, Vec<u128>> = BTreeMap::new();
        for (key, at) in ends {
            by_key
                .entry(key)
                .or_default()
                .push(at.saturating_duration_since(start).as_millis());
        }
        for ends in by_key.values_mut() {
            ends.sort_unstable();
        }
        by_key
    }

    /// Each claim's lease end as stored, by (key, attempt), on tokio's clock
    /// (the memory path; see [`MemoryStore::lease_ends`]). The wire path has
    /// none: its items hold a lease end on the writer's clock, not the
    /// instant the write applied, so the check of calls open past their
    /// lease runs on the memory path's seeds.
    pub fn lease_ends(&self) -> Option<Vec<(String, u32, tokio::time::Instant)>> {
        match self {
            Self::Memory(s) => Some(s.lease_ends()),
            Self::Wire(_) => None,
        }
    }

    /// Checks from now on that every record write carries `ttl`, the TTL
    /// the consumers are configured with: its `expires_at` is the writer's
    /// clock, as the store read it for the write, in whole seconds plus
    /// `ttl` ([`MemoryStore::expect_ttl`], [`DynamoModel::expect_ttl`]).
    /// TTL ending a record that failed it excuses nothing.
    pub fn expect_ttl(&self, ttl: Duration) {
        match self {
            Self::Memory(s) => s.expect_ttl(ttl),
            Self::Wire(m) => m.expect_ttl(ttl),
        }
    }

    /// Record writes that did not carry the expected TTL (see
    /// [`Backend::expect_ttl`]), and TTL ends of their records.
    pub fn ttl_breaches(&self) -> Vec<String> {
        match self {
            Self::Memory(s) => s.ttl_breaches(),
            Self::Wire(m) => m.ttl_breaches(),
        }
    }

    /// Writes that changed a record another owner held (none while fencing holds).
    pub fn fencing_breaches(
        &self,
        clock: (i64, tokio::time::Instant),
        grace: Duration,
    ) -> Vec<String> {
        match self {
            Self::Memory(s) => s.fencing_breaches(),
            Self::Wire(m) => {
                let mut breaches = m.fencing_breaches();
                // A `COMPLETED` record another owner's write replaced before
                // its `expires_at` (by true time plus `grace`): never, with
                // the store's conditions intact.
                breaches.extend(
                    m.ended_by_ttl()
                        .into_iter()
                        .filter(|(_, expires_s, at)| !expired(clock, grace, *expires_s, *at))
                        .map(|(key, _, _)| {
                            format!("{key}: its COMPLETED record replaced by another owner before its expires_at")
                        }),
                );
                breaches
            }
        }
    }

    /// A host generation's store: on the host's clock, behind its link and life.
    pub fn for_host(&self, link: &Link, life: &Life, clock: &Arc<dyn Clock>) -> HostStore {
        match self {
            Self::Memory(s) => HostStore::Memory(FaultyStore::new(
                s.with_clock(clock.clone()),
                link.clone(),
                life.clone(),
                clock.clone(),
            )),
            Self::Wire(m) => {
                let wire = Wire::new(Service::Dynamo(m.clone()), Some(link.clone()), life.clone());
                let client = wire::dynamodb_client(wire, clock.clone());
                let store = DynamoStore::with_clock(client, wire::TABLE, clock.clone());
                let stamps = Stamps {
                    model: m.clone(),
                    clock: clock.clone(),
                };
                HostStore::Wire(store, link.clone(), stamps)
            }
        }
    }
}

/// A host's store on either path.
#[derive(Debug, Clone)]
pub enum HostStore {
    /// The memory path.
    Memory(FaultyStore<MemoryStore>),
    /// The wire path (the link notes failed reads, as `FaultyStore` does;
    /// the stamps note each write call's clock reading for the model's
    /// check of its TTL).
    Wire(DynamoStore, Link, Stamps),
}

/// Notes the clock reading of each store call that writes a record on the
/// wire path ([`DynamoModel::stamp`]): read on the store's own clock just
/// before the call, in the same poll as the store's own reading (virtual
/// time does not move within a poll), so it is the very time the store
/// computes the record's `expires_at` from.
#[derive(Debug, Clone)]
pub struct Stamps {
    model: DynamoModel,
    clock: Arc<dyn Clock>,
}

impl Stamps {
    fn note(&self, pk: &str, owner: &str, call: Stamp) {
        self.model.stamp(pk, owner, call, self.clock.now_ms());
    }
}

impl DedupStore for HostStore {
    fn report_to(&self, metrics: Arc<sqs_once::metrics::Metrics>) {
        match self {
            Self::Memory(s) => s.report_to(metrics),
            Self::Wire(s, ..) => s.report_to(metrics),
        }
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        match self {
            Self::Memory(s) => s.claim(req).await,
            Self::Wire(s, _, stamps) => {
                stamps.note(&req.pk, &req.owner, Stamp::Claim);
                s.claim(req).await
            }
        }
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.complete(c).await,
            Self::Wire(s, _, stamps) => {
                stamps.note(&c.pk, &c.owner, Stamp::Complete);
                s.complete(c).await
            }
        }
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.release(pk, owner, error).await,
            Self::Wire(s, ..) => s.release(pk, owner, error).await,
        }
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.mark_failed(pk, owner, error, ttl).await,
            Self::Wire(s, _, stamps) => {
                stamps.note(pk, owner, Stamp::Fail);
                s.mark_failed(pk, owner, error, ttl).await
            }
        }
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.extend_lease(pk, owner, lease, ttl).await,
            Self::Wire(s, _, stamps) => {
                stamps.note(pk, owner, Stamp::Extend);
                s.extend_lease(pk, owner, lease, ttl).await
            }
        }
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.commit_unprotected(writes).await,
            Self::Wire(s, ..) => s.commit_unprotected(writes).await,
        }
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        match self {
            Self::Memory(s) => s.commit_fast(c).await,
            Self::Wire(s, _, stamps) => {
                stamps.note(&c.pk, &c.owner, Stamp::Fast);
                s.commit_fast(c).await
            }
        }
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        match self {
            Self::Memory(s) => s.mark_dispatched(pk, sent).await,
            Self::Wire(s, ..) => s.mark_dispatched(pk, sent).await,
        }
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        match self {
            Self::Memory(s) => s.get(pk).await,
            Self::Wire(s, link, _) => {
                let read = s.get(pk).await;
                if read.is_err() {
                    link.failed_read(pk);
                }
                read
            }
        }
    }
}

/// A host's SQS client on either path: the model itself (memory path,
/// `FaultyQueue` drawing SQS's faults above it), or the production adapter
/// (`QueueClient for aws_sdk_sqs::Client`) and SDK over the wire to the same
/// model, SQS's faults drawn on the wire from the host's link (wire path).
#[derive(Debug, Clone)]
pub enum HostQueue {
    /// The memory path.
    Memory(MemoryQueue),
    /// The wire path.
    Wire(aws_sdk_sqs::Client),
}

impl HostQueue {
    /// The host's queue client on `path` to `model`; `attempt` bounds one
    /// SQS request as production's does (the long-poll wait plus 10 s for a
    /// poller).
    pub fn new(
        path: StorePath,
        model: &wire::sqs::SqsModel,
        (link, life): (&Link, &Life),
        clock: &Arc<dyn Clock>,
        attempt: Duration,
    ) -> Self {
        match path {
            StorePath::Memory => Self::Memory(model.queue().clone()),
            StorePath::Wire => {
                let service = Service::Sqs(model.clone());
                let wire =
                    Wire::new(service, Some(link.clone()), life.clone()).giving_up_after(attempt);
                Self::Wire(wire::sqs_client(wire, clock.clone(), attempt))
            }
        }
    }
}

impl QueueClient for HostQueue {
    async fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Result<Vec<Message>, QueueError> {
        match self {
            Self::Memory(q) => q.receive(queue, request).await,
            Self::Wire(q) => q.receive(queue, request).await,
        }
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        match self {
            Self::Memory(q) => q.delete(queue, receipt).await,
            Self::Wire(q) => q.delete(queue, receipt).await,
        }
    }

    async fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        match self {
            Self::Memory(q) => q.delete_batch(queue, receipts).await,
            Self::Wire(q) => q.delete_batch(queue, receipts).await,
        }
    }

    async fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        match self {
            Self::Memory(q) => q.change_visibility(queue, receipt, timeout).await,
            Self::Wire(q) => q.change_visibility(queue, receipt, timeout).await,
        }
    }

    async fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        match self {
            Self::Memory(q) => q.change_visibility_batch(queue, receipts, timeout).await,
            Self::Wire(q) => q.change_visibility_batch(queue, receipts, timeout).await,
        }
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        match self {
            Self::Memory(q) => q.send(queue, message).await,
            Self::Wire(q) => q.send(queue, message).await,
        }
    }

    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        match self {
            Self::Memory(q) => q.send_batch(queue, messages).await,
            Self::Wire(q) => q.send_batch(queue, messages).await,
        }
    }

    async fn attributes(&self, queue: &str) -> Result<QueueAttributes, QueueError> {
        match self {
            Self::Memory(q) => q.attributes(queue).await,
            Self::Wire(q) => q.attributes(queue).await,
        }
    }

    async fn queue_url(&self, name: &str, account: &str) -> Result<String, QueueError> {
        match self {
            Self::Memory(q) => q.queue_url(name, account).await,
            Self::Wire(q) => q.queue_url(name, account).await,
        }
    }
}

/// Whether a record expiring at `expires_s` (epoch seconds) had expired at
/// `at`, judged by true time (the run's `clock`: true epoch ms at its start
/// instant) plus `grace`, the most a host's clock runs ahead.
fn expired(
    (epoch_ms, start): (i64, tokio::time::Instant),
    grace: Duration,
    expires_s: i64,
    at: tokio::time::Instant,
) -> bool {
    let true_ms = epoch_ms
        + i64::try_from(at.saturating_duration_since(start).as_millis()).unwrap_or(i64::MAX / 2);
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(0);
    expires_s.saturating_mul(1000) < true_ms + grace_ms
}
