//! Faults in the simulated services, every one drawn from the run's seed:
//! [`FaultyQueue`] and [`FaultyStore`] wrap the shared SQS model and dedup
//! store for one consumer host, and fail its calls before they apply (5xx,
//! throttling, a timeout after a delay), lose the answer after they applied,
//! delay them, or cut the host off from SQS, DynamoDB or both for a while.
//! A host's [`Life`] ends at a crash: from then on every call it makes hangs
//! forever, as a dead process makes no more calls.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqs_once::clock::Clock;
use sqs_once::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
};
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{Claim, DedupStore, Message, Record, StagedWrite, StoreError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::deliveries::Deliveries;
use crate::trace::{Subject, Trace};

/// How long a call made while its host's link is cut takes to fail (a
/// connect timeout): a call started in a cut that ends sooner than this
/// before some deadline cannot land by it.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Every random choice of a run, from one seed. Clones share the generator;
/// on the simulator's single thread the order of draws is fixed by the seed.
#[derive(Debug, Clone)]
pub struct Dice(Arc<Mutex<StdRng>>);

impl Dice {
    /// Dice for a seed.
    pub fn new(seed: u64) -> Self {
        Self(Arc::new(Mutex::new(StdRng::seed_from_u64(seed))))
    }

    fn with<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// True with probability `p`.
    pub fn chance(&self, p: f64) -> bool {
        self.with(|r| r.random_bool(p.clamp(0.0, 1.0)))
    }

    /// A number in `lo..=hi`.
    pub fn int(&self, lo: u64, hi: u64) -> u64 {
        self.with(|r| r.random_range(lo..=hi.max(lo)))
    }

    /// A probability in `lo..hi`.
    pub fn rate(&self, lo: f64, hi: f64) -> f64 {
        self.with(|r| r.random_range(lo..hi))
    }

    /// A duration in `lo..=hi` (milliseconds).
    pub fn millis(&self, lo: Duration, hi: Duration) -> Duration {
        let (lo, hi) = (lo.as_millis() as u64, hi.as_millis() as u64);
        Duration::from_millis(self.int(lo, hi))
    }
}

/// How often each kind of fault strikes a call, for one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    /// Fails before it applies: 5xx or throttling.
    pub error: f64,
    /// Applies, then the answer is lost.
    pub lost: f64,
    /// No answer: fails after a delay, without applying.
    pub timeout: f64,
    /// Answers late.
    pub delay: f64,
    /// DynamoDB: the client gives up (a timeout), and the request is applied
    /// later anyway (a stale write landing after its sender moved on).
    pub late: f64,
    /// The longest delay or timeout.
    pub max_delay: Duration,
    /// DynamoDB: the host stops (a stop-the-world pause, a frozen process)
    /// just before it sends the request, which then goes out after the pause
    /// with the time read then: a write that leaves long after the handler's
    /// last look at its lease, which fencing must make harmless.
    pub pause: f64,
    /// The longest pause.
    pub max_pause: Duration,
}

impl FaultPlan {
    /// No faults (the calm end of a run, the Lambda service's own calls).
    pub const NONE: Self = Self {
        error: 0.0,
        lost: 0.0,
        timeout: 0.0,
        delay: 0.0,
        late: 0.0,
        max_delay: Duration::ZERO,
        pause: 0.0,
        max_pause: Duration::ZERO,
    };
}

/// Faults injected so far, by kind.
#[derive(Debug, Default)]
pub struct FaultCounts {
    /// Failed before applying.
    pub errors: AtomicU64,
    /// Applied, answer lost.
    pub lost: AtomicU64,
    /// Timed out without applying.
    pub timeouts: AtomicU64,
    /// Delayed.
    pub delays: AtomicU64,
    /// Failed because the host was cut off.
    pub cut: AtomicU64,
    /// Given up on by the client, applied later.
    pub late: AtomicU64,
    /// Sent after a pause of the host.
    pub pauses: AtomicU64,
    /// Throttled in a storm (sustained throttling of one host's calls to
    /// one service).
    pub stormed: AtomicU64,
    /// Refused for a transaction conflict in a conflict storm (sustained
    /// contention on the items one host writes).
    pub conflicted: AtomicU64,
    /// Requests given up on by the client that have not landed yet.
    landing: Arc<AtomicU64>,
}

/// A request given up on by its client, on its way to land later: counted
/// in [`FaultCounts::landing`] until dropped (once it has landed).
#[derive(Debug)]
pub struct OnItsWay(Arc<AtomicU64>);

impl Drop for OnItsWay {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl FaultCounts {
    /// Faults injected into calls, by class.
    pub fn by_class(&self) -> Vec<(&'static str, u64)> {
        [
            ("error", &self.errors),
            ("lost answer", &self.lost),
            ("timeout", &self.timeouts),
            ("delay", &self.delays),
            ("cut off", &self.cut),
            ("landed late", &self.late),
            ("pause", &self.pauses),
            ("throttled in a storm", &self.stormed),
            ("transaction conflict in a storm", &self.conflicted),
        ]
        .iter()
        .map(|(name, c)| (*name, c.load(Ordering::Relaxed)))
        .collect()
    }

    /// How many requests given up on by their clients have yet to land.
    pub fn landing(&self) -> u64 {
        self.landing.load(Ordering::Relaxed)
    }

    /// Counts a request given up on that lands later, until the answer
    /// is dropped.
    pub fn lands_later(&self) -> OnItsWay {
        self.landing.fetch_add(1, Ordering::Relaxed);
        OnItsWay(self.landing.clone())
    }

    /// All faults injected into calls.
    pub fn total(&self) -> u64 {
        [
            &self.errors,
            &self.lost,
            &self.timeouts,
            &self.delays,
            &self.cut,
            &self.late,
            &self.pauses,
            &self.stormed,
            &self.conflicted,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

/// A service a host talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// SQS.
    Sqs,
    /// DynamoDB.
    Ddb,
}

/// The code of a call throttled in a storm ([`Link::storm`]).
const STORM: &str = "ThrottlingException (a storm)";
/// The code of a write refused in a conflict storm ([`Link::conflict_storm`]).
const CONFLICT: &str = "TransactionConflictException (a storm)";

/// Whether `op` (a store operation, or a DynamoDB API call on the wire)
/// writes an item: what a transaction on that item makes DynamoDB refuse
/// with a `TransactionConflict` (reads are not refused).
fn writes_item(op: &str) -> bool {
    matches!(
        op,
        "claim"
            | "complete"
            | "release"
            | "mark_failed"
            | "extend_lease"
            | "commit_unprotected"
            | "commit_fast"
            | "mark_dispatched"
            | "PutItem"
            | "UpdateItem"
            | "DeleteItem"
            | "TransactWriteItems"
    )
}

/// What happens to one call.
enum Fault {
    None,
    Cut,
    Fail(&'static str),
    Timeout(Duration),
    Lose,
    Delay(Duration),
}

/// Notes, when dropped, that a delete call of these receipts came back to
/// its consumer: answered, failed, or given up on (the consumer dropped the
/// call, as at a batch's timeout or an invocation's deadline).
struct Returned<'a>(&'a Deliveries, &'a str, &'a [String]);

impl Drop for Returned<'_> {
    fn drop(&mut self) {
        self.0.delete_returned(self.1, self.2);
    }
}

/// When a host's link to one service was cut: (from, until) per partition.
/// Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Cuts(Arc<Mutex<Vec<(Instant, Instant)>>>);

impl Cuts {
    /// Notes a partition from `from` until `until`.
    pub fn push(&self, from: Instant, until: Instant) {
        self.push_indexed(from, until);
    }

    /// [`Cuts::push`], answering where the cut is kept (for
    /// [`Cuts::end_early`]).
    fn push_indexed(&self, from: Instant, until: Instant) -> usize {
        let mut cuts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        cuts.push((from, until));
        cuts.len() - 1
    }

    /// Ends the cut kept at `index` at `at` if it would last longer: a
    /// later cut of the same kind replaced it.
    fn end_early(&self, index: usize, at: Instant) {
        let mut cuts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cut) = cuts.get_mut(index) {
            cut.1 = cut.1.min(at);
        }
    }

    /// Whether the link was cut at some instant of `from..to` (before
    /// `calm_at`, when faults stop).
    pub fn cut_within(&self, from: Instant, to: Instant, calm_at: Option<Instant>) -> bool {
        !self.within(from, to, calm_at).is_empty()
    }

    /// The partitions that cut the link at some instant of `from..to`
    /// (before `calm_at`, when faults stop, which also ends them).
    pub fn within(
        &self,
        from: Instant,
        to: Instant,
        calm_at: Option<Instant>,
    ) -> Vec<(Instant, Instant)> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|&&(start, until)| {
                start < to && from < until && calm_at.is_none_or(|c| start < c)
            })
            .map(|&(start, until)| (start, calm_at.map_or(until, |c| until.min(c))))
            .collect()
    }

    /// Whether the link was cut at `t` (partitions end when the run calms,
    /// at `calm_at`).
    pub fn cut_at(&self, t: Instant, calm_at: Option<Instant>) -> bool {
        calm_at.is_none_or(|c| t < c)
            && self
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|&(from, until)| from <= t && t < until)
    }
}

/// One consumer host's network: its fault plan, its partitions, and whether
/// faults are on (they are switched off for the calm end of a run).
#[derive(Debug, Clone)]
pub struct Link {
    name: String,
    dice: Dice,
    plan: FaultPlan,
    pub(crate) trace: Trace,
    cut_until: Arc<Mutex<[Option<Instant>; 2]>>,
    /// Until when each service throttles half the calls of this host.
    storm_until: Arc<Mutex<[Option<Instant>; 2]>>,
    /// Until when DynamoDB refuses half the writes of this host for a
    /// transaction conflict ([`Link::conflict_storm`]).
    conflict_until: Arc<Mutex<Option<Instant>>>,
    /// Until when the host is frozen ([`Link::freeze`]).
    frozen_until: Arc<Mutex<Option<Instant>>>,
    /// Where the last partition from SQS and the last freeze are kept in
    /// `sqs_cuts`: a later one replaces it (it ends then), so the checker
    /// must not count it on.
    last_kept: Arc<Mutex<[Option<usize>; 2]>>,
    sqs_cuts: Cuts,
    calm: Arc<AtomicBool>,
    counts: Arc<FaultCounts>,
    /// The dice of SQS's faults on the wire (see [`Link::with_sqs_wire`]).
    sqs_wire: Option<Dice>,
    /// SQS requests the client gives up on that land later, on the wire.
    sqs_late: f64,
}

impl Link {
    /// A host's link, with the run's shared calm switch and counters.
    pub fn new(
        name: &str,
        dice: Dice,
        plan: FaultPlan,
        trace: Trace,
        calm: Arc<AtomicBool>,
        counts: Arc<FaultCounts>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            dice,
            plan,
            trace,
            cut_until: Arc::default(),
            storm_until: Arc::default(),
            conflict_until: Arc::default(),
            frozen_until: Arc::default(),
            last_kept: Arc::default(),
            sqs_cuts: Cuts::default(),
            calm,
            counts,
            sqs_wire: None,
            sqs_late: 0.0,
        }
    }

    /// Draws SQS's faults on the wire (the wire path: [`Link::draw_sqs_wire`])
    /// from `dice`, a stream of their own, so the draws of the other
    /// faults stay as they were; requests land after the client gave up at
    /// `late`.
    pub fn with_sqs_wire(mut self, dice: Dice, late: f64) -> Self {
        self.sqs_wire = Some(dice);
        self.sqs_late = late;
        self
    }

    /// Throttles half the calls of the host to `service` for `d` (nine in
    /// ten made an outage of it, which the checker does not excuse as it
    /// does a cut: campaign seed 918183; `ThrottlingException`, or on DynamoDB's wire
    /// `ProvisionedThroughputExceededException` too), as a service does
    /// under a burst or a table short of capacity.
    pub fn storm(&self, service: Service, d: Duration) {
        let mut storm = self.storm_until.lock().unwrap_or_else(|e| e.into_inner());
        storm[service as usize] = Some(Instant::now() + d);
        self.trace.event(format!(
            "throttling storm on {} from {service:?} for {d:?}",
            self.name
        ));
    }

    /// Refuses half the host's writes to DynamoDB for `d` with a
    /// `TransactionConflict` (`TransactionConflictException`, or a
    /// transaction cancelled for that reason on the wire), as DynamoDB does
    /// while other transactions keep writing the same items: the store's
    /// answer is then `StoreError::Busy` when every attempt was refused so,
    /// whose short backoff spends a message's receives faster than an
    /// outage's.
    pub fn conflict_storm(&self, d: Duration) {
        *self
            .conflict_until
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + d);
        self.trace.event(format!(
            "transaction conflict storm on {} for {d:?}",
            self.name
        ));
    }

    fn in_conflict_storm(&self) -> bool {
        self.conflict_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| t > Instant::now())
            && !self.calm.load(Ordering::Relaxed)
    }

    /// Freezes the host for `d`, as a stop-the-world pause or a frozen
    /// Lambda environment does while time runs on: no request of it leaves
    /// and no answer reaches it until then (its timers still fire, and
    /// what they start waits at the door; a call on its way gets its answer
    /// after the thaw). Faults switched off end it.
    /// For the checker SQS is out of the host's reach meanwhile, as in a
    /// cut: nothing it sends can land.
    pub fn freeze(&self, d: Duration) {
        let (from, until) = (Instant::now(), Instant::now() + d);
        *self.frozen_until.lock().unwrap_or_else(|e| e.into_inner()) = Some(until);
        self.keep_sqs_cut(1, from, until);
        self.trace.host_trouble(&self.name, self.until_calm(d));
        self.trace.host_stall(&self.name, self.until_calm(d));
        self.trace.event(format!(
            "freeze {} for {d:?} (a stop-the-world pause)",
            self.name
        ));
    }

    /// Keeps a partition from SQS (`kind` 0) or a freeze (1) in
    /// `sqs_cuts`, ending the last one of its kind now: it replaced that.
    fn keep_sqs_cut(&self, kind: usize, from: Instant, until: Instant) {
        let mut last = self.last_kept.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(index) = last[kind] {
            self.sqs_cuts.end_early(index, from);
        }
        last[kind] = Some(self.sqs_cuts.push_indexed(from, until));
    }

    /// `d` from now, cut at the calm point (which ends partitions and
    /// freezes).
    fn until_calm(&self, d: Duration) -> Duration {
        let calm = self.trace.start() + crate::CALM_AT;
        d.min(calm.saturating_duration_since(Instant::now()))
    }

    /// Waits until the host is not frozen.
    pub async fn thaw(&self) {
        loop {
            let until = *self.frozen_until.lock().unwrap_or_else(|e| e.into_inner());
            match until {
                Some(t) if t > Instant::now() && !self.calm.load(Ordering::Relaxed) => {
                    tokio::time::sleep_until(t).await;
                }
                _ => return,
            }
        }
    }

    fn in_storm(&self, service: Service) -> bool {
        let storm = self.storm_until.lock().unwrap_or_else(|e| e.into_inner());
        storm[service as usize].is_some_and(|t| t > Instant::now())
            && !self.calm.load(Ordering::Relaxed)
    }

    /// Cuts the host off from `service` for `d`.
    pub fn cut(&self, service: Service, d: Duration) {
        let mut cut = self.cut_until.lock().unwrap_or_else(|e| e.into_inner());
        let (from, until) = (Instant::now(), Instant::now() + d);
        cut[service as usize] = Some(until);
        if service == Service::Sqs {
            self.keep_sqs_cut(0, from, until);
            self.trace.host_stall(&self.name, self.until_calm(d));
        }
        self.trace.host_trouble(&self.name, self.until_calm(d));
        self.trace.event(format!(
            "partition {} from {service:?} for {d:?}",
            self.name
        ));
    }

    /// Counts a request of this host given up on that lands later, until
    /// the answer is dropped (see [`FaultCounts::lands_later`]).
    pub(crate) fn lands_later(&self) -> OnItsWay {
        self.counts.lands_later()
    }

    fn is_cut(&self, service: Service) -> bool {
        let cut = self.cut_until.lock().unwrap_or_else(|e| e.into_inner());
        cut[service as usize].is_some_and(|t| t > Instant::now())
            && !self.calm.load(Ordering::Relaxed)
    }

    fn draw(&self, service: Service, op: &str, subjects: &[String]) -> Fault {
        self.draw_from(&self.dice, service, op, subjects)
    }

    /// Draws a call's fault; the trouble it makes is the call's, noted
    /// with what the call was made for (`subjects`: see
    /// [`crate::trace::Trouble::calls`]).
    fn draw_from(&self, d: &Dice, service: Service, op: &str, subjects: &[String]) -> Fault {
        if self.is_cut(service) {
            self.counts.cut.fetch_add(1, Ordering::Relaxed);
            return Fault::Cut;
        }
        if self.calm.load(Ordering::Relaxed) {
            return Fault::None;
        }
        let p = self.plan;
        let conflicted =
            service == Service::Ddb && writes_item(op) && self.in_conflict_storm() && d.chance(0.5);
        let fault = if conflicted {
            self.counts.conflicted.fetch_add(1, Ordering::Relaxed);
            Fault::Fail(CONFLICT)
        } else if self.in_storm(service) && d.chance(0.5) {
            self.counts.stormed.fetch_add(1, Ordering::Relaxed);
            Fault::Fail(STORM)
        } else if d.chance(p.error) {
            self.counts.errors.fetch_add(1, Ordering::Relaxed);
            Fault::Fail(if d.chance(0.5) {
                "ServiceUnavailable (503)"
            } else {
                "ThrottlingException"
            })
        } else if d.chance(p.lost) {
            self.counts.lost.fetch_add(1, Ordering::Relaxed);
            Fault::Lose
        } else if d.chance(p.timeout) {
            self.counts.timeouts.fetch_add(1, Ordering::Relaxed);
            Fault::Timeout(d.millis(Duration::from_millis(100), p.max_delay))
        } else if d.chance(p.delay) {
            self.counts.delays.fetch_add(1, Ordering::Relaxed);
            Fault::Delay(d.millis(Duration::from_millis(10), p.max_delay))
        } else {
            Fault::None
        };
        let (name, lasts) = match &fault {
            Fault::None => return fault,
            Fault::Cut => ("cut off", CONNECT_TIMEOUT),
            Fault::Fail(code) => (*code, Duration::ZERO),
            Fault::Timeout(d) => ("timeout", *d),
            Fault::Lose => ("answer lost", Duration::ZERO),
            Fault::Delay(d) => ("delayed", *d),
        };
        self.trace.call_trouble(&self.name, subjects, lasts);
        self.trace
            .event(format!("fault {} {service:?} {op}: {name}", self.name));
        fault
    }

    /// Whether this request is given up on by the client and lands later:
    /// (how long the client waits, when the request is applied).
    fn draw_late(
        &self,
        service: Service,
        op: &str,
        rate: f64,
        subjects: &[String],
    ) -> Option<(Duration, Duration)> {
        self.draw_late_from(&self.dice, service, op, rate, subjects)
    }

    fn draw_late_from(
        &self,
        dice: &Dice,
        service: Service,
        op: &str,
        rate: f64,
        subjects: &[String],
    ) -> Option<(Duration, Duration)> {
        if self.calm.load(Ordering::Relaxed) || self.is_cut(service) {
            return None;
        }
        if !dice.chance(rate) {
            return None;
        }
        self.counts.late.fetch_add(1, Ordering::Relaxed);
        let wait = dice.millis(Duration::from_millis(500), Duration::from_secs(3));
        let after = wait + dice.millis(Duration::ZERO, Duration::from_secs(20));
        self.trace.call_trouble(&self.name, subjects, after);
        self.trace.event(format!(
            "fault {} {service:?} {op}: given up after {wait:?}, lands after {after:?}",
            self.name
        ));
        Some((wait, after))
    }

    /// Whether the host pauses before sending this request, and for how long.
    fn draw_pause(&self, service: Service, op: &str) -> Option<Duration> {
        if self.calm.load(Ordering::Relaxed) || !self.dice.chance(self.plan.pause) {
            return None;
        }
        self.counts.pauses.fetch_add(1, Ordering::Relaxed);
        let d = self
            .dice
            .millis(Duration::from_secs(1), self.plan.max_pause);
        self.trace.host_trouble(&self.name, d);
        self.trace.host_stall(&self.name, d);
        self.trace.event(format!(
            "fault {} {service:?} {op}: the host pauses {d:?} before sending",
            self.name
        ));
        Some(d)
    }

    /// What happens to one DynamoDB request on the wire (see
    /// [`crate::wire::WireFault`]), from the same plan as the store's faults:
    /// an error is a 500 (before or after applying), throttling, a reset, or
    /// for a transaction a conflict; a lost answer is a reset or silence
    /// after applying; a timeout is silence; a delay a slow answer.
    pub(crate) fn draw_wire(
        &self,
        op: &str,
        transaction: bool,
        subjects: &[String],
    ) -> crate::wire::WireFault {
        use crate::wire::WireFault as W;
        if let Some((wait, after)) = self.draw_late(Service::Ddb, op, self.plan.late, subjects) {
            // The client's attempt timeout, not `wait`, decides when it gives up.
            let _ = wait;
            return W::Late(after);
        }
        let fault = match self.draw(Service::Ddb, op, subjects) {
            Fault::None => return W::None,
            Fault::Cut => W::Cut,
            Fault::Fail(STORM) if self.dice.chance(0.5) => W::Provisioned,
            Fault::Fail(STORM) => W::Throttled,
            Fault::Fail(CONFLICT) => W::Conflict,
            Fault::Fail(_) => match self.dice.int(0, if transaction { 5 } else { 4 }) {
                0 => W::InternalBefore,
                1 => W::InternalAfter,
                2 => W::Throttled,
                3 => W::Provisioned,
                4 => W::ResetBefore,
                _ => W::Conflict,
            },
            Fault::Lose => {
                if self.dice.chance(0.5) {
                    W::ResetAfter
                } else {
                    W::Silent { applied: true }
                }
            }
            Fault::Timeout(_) => W::Silent { applied: false },
            Fault::Delay(d) => W::Slow(d),
        };
        if !matches!(fault, W::None | W::Cut) {
            self.trace
                .event(format!("wire {} {op}: {fault:?}", self.name));
        }
        fault
    }

    /// What happens to one SQS request on the wire (see
    /// [`crate::wire::SqsFault`]), from the same plan as `FaultyQueue`'s
    /// faults but on the link's SQS dice (none without them): an error is
    /// an `InternalFailure` 500 (before or after applying), throttling
    /// (`ThrottlingException`, `RequestThrottled`), a reset, or for a batch
    /// of `entries` some entries failing alone; a lost answer is a reset or
    /// silence after applying; a timeout is silence; a delay a slow answer.
    pub(crate) fn draw_sqs_wire(
        &self,
        op: &str,
        entries: usize,
        subjects: &[String],
    ) -> crate::wire::SqsFault {
        use crate::wire::SqsFault as F;
        let Some(dice) = &self.sqs_wire else {
            return F::None;
        };
        if let Some((wait, after)) =
            self.draw_late_from(dice, Service::Sqs, op, self.sqs_late, subjects)
        {
            // The client's attempt timeout decides when it gives up; the
            // request lands this long after.
            return F::Late(after - wait);
        }
        let fault = match self.draw_from(dice, Service::Sqs, op, subjects) {
            Fault::None => return F::None,
            Fault::Cut => F::Cut,
            Fault::Fail(STORM) => F::Throttled("ThrottlingException"),
            Fault::Fail(_) => match dice.int(0, if entries > 0 { 5 } else { 4 }) {
                0 => F::InternalBefore,
                1 => F::InternalAfter,
                2 => F::Throttled("ThrottlingException"),
                3 => F::Throttled("RequestThrottled"),
                4 => F::ResetBefore,
                _ => F::EntriesFailed(Self::failing_entries(dice, entries)),
            },
            Fault::Lose => {
                if dice.chance(0.5) {
                    F::ResetAfter
                } else {
                    F::Silent { applied: true }
                }
            }
            Fault::Timeout(_) => F::Silent { applied: false },
            Fault::Delay(d) => F::Slow(d),
        };
        if !matches!(fault, F::None | F::Cut) {
            self.trace
                .event(format!("wire {} {op}: {fault:?}", self.name));
        }
        fault
    }

    /// Which of a batch's `n` entries fail alone: each one in two, at least one.
    fn failing_entries(dice: &Dice, n: usize) -> Vec<usize> {
        let first = usize::try_from(dice.int(0, n.saturating_sub(1) as u64)).unwrap_or(0);
        (0..n).filter(|&i| i == first || dice.chance(0.5)).collect()
    }

    /// Notes a read of `pk` that failed (see `Trace::failed_read`).
    pub(crate) fn failed_read(&self, pk: &str) {
        self.trace.failed_read(&self.name, pk);
    }

    /// Whether the host pauses before an owned write leaves (see
    /// [`FaultPlan::pause`]).
    pub(crate) fn draw_wire_pause(&self, op: &str) -> Option<Duration> {
        self.draw_pause(Service::Ddb, op)
    }

    /// Runs `call` through the faults drawn for it: `Err(detail)` when it
    /// failed (after applying, for a lost answer).
    async fn through<T>(
        &self,
        service: Service,
        op: &str,
        subjects: &[String],
        call: impl Future<Output = T>,
    ) -> Result<T, String> {
        self.thaw().await;
        let answer = self.through_faults(service, op, subjects, call).await;
        self.thaw().await;
        answer
    }

    async fn through_faults<T>(
        &self,
        service: Service,
        op: &str,
        subjects: &[String],
        call: impl Future<Output = T>,
    ) -> Result<T, String> {
        match self.draw(service, op, subjects) {
            Fault::None => Ok(call.await),
            Fault::Cut => {
                tokio::time::sleep(CONNECT_TIMEOUT).await;
                Err("cut off: connect timeout".into())
            }
            Fault::Fail(code) => Err(code.into()),
            Fault::Timeout(d) => {
                tokio::time::sleep(d).await;
                Err("timed out".into())
            }
            Fault::Lose => {
                let _ = call.await;
                Err("the answer was lost (the call applied)".into())
            }
            Fault::Delay(d) => {
                tokio::time::sleep(d).await;
                Ok(call.await)
            }
        }
    }
}

/// A host's life. After [`Life::kill`] every call through [`Life::guard`]
/// hangs forever: a crashed host makes no more calls.
#[derive(Debug, Clone, Default)]
pub struct Life(CancellationToken, Arc<Mutex<Option<Instant>>>);

impl Life {
    /// Kills the host.
    pub fn kill(&self) {
        self.1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(Instant::now);
        self.0.cancel();
    }

    /// Whether the host was killed.
    pub fn is_dead(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Whether `other` is this host's life (clones share it).
    pub fn same_host(&self, other: &Life) -> bool {
        Arc::ptr_eq(&self.1, &other.1)
    }

    /// When the host was killed.
    pub fn died_at(&self) -> Option<Instant> {
        *self.1.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Completes when the host is killed.
    pub async fn died(&self) {
        self.0.cancelled().await;
    }

    /// `f`, unless the host dies first: then never.
    pub async fn guard<F: Future>(&self, f: F) -> F::Output {
        // `f` is dropped at the death (its guards run then), then nothing more.
        let out = tokio::select! {
            biased;
            () = self.0.cancelled() => None,
            r = f => Some(r),
        };
        match out {
            Some(r) => r,
            None => std::future::pending().await,
        }
    }
}

/// A [`QueueClient`] for one host: the shared SQS model behind the host's
/// link and life. On the wire path its faults are drawn on the wire
/// instead ([`FaultyQueue::faults_on_wire`]): it then only notes what the
/// host receives and sends deletes for.
#[derive(Debug, Clone)]
pub struct FaultyQueue<Q> {
    inner: Q,
    link: Link,
    life: Life,
    deliveries: Deliveries,
    /// A delete or visibility change given up on and applied later.
    late: f64,
    /// Faults are drawn below, on the wire, and what SQS applies is noted
    /// where it applies it (`wire::sqs::SqsModel::watched`).
    on_wire: bool,
}

impl<Q: QueueClient + Clone + Send + Sync + 'static> FaultyQueue<Q> {
    /// One `DeleteMessage` through the link (see [`QueueClient::delete`]).
    async fn delete_once(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        let receipts = [receipt.to_owned()];
        let (inner, seen, q) = (
            self.inner.clone(),
            self.deliveries.clone(),
            queue.to_owned(),
        );
        let subjects = [Subject::receipt(receipt)];
        self.late("DeleteMessage", queue, &subjects, async move {
            if inner.delete(&q, &receipts[0]).await.is_ok() {
                seen.delete_reached(&q, &receipts);
            }
        })
        .await?;
        let receipts = [receipt.to_owned()];
        // Noted where SQS applies it, so a lost answer still counts.
        let f = async {
            let out = self.inner.delete(queue, receipt).await;
            if out.is_ok() && !self.on_wire {
                self.deliveries.delete_reached(queue, &receipts);
            }
            out
        };
        self.call("DeleteMessage", queue, &subjects, f).await
    }

    /// One `DeleteMessageBatch` through the link (see [`QueueClient::delete_batch`]).
    async fn delete_batch_once(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let (inner, seen, q, all) = (
            self.inner.clone(),
            self.deliveries.clone(),
            queue.to_owned(),
            receipts.to_vec(),
        );
        let subjects = receipt_subjects(receipts);
        self.late("DeleteMessageBatch", queue, &subjects, async move {
            if let Ok(failed) = inner.delete_batch(&q, &all).await {
                seen.delete_reached(&q, &applied(&all, &failed));
            }
        })
        .await?;
        let f = async {
            let out = self.inner.delete_batch(queue, receipts).await;
            if let Some(failed) = out.as_ref().ok().filter(|_| !self.on_wire) {
                self.deliveries
                    .delete_reached(queue, &applied(receipts, failed));
            }
            out
        };
        self.call("DeleteMessageBatch", queue, &subjects, f).await
    }

    /// `inner` as seen by a host; what it receives, deletes and keeps
    /// invisible is noted in `deliveries`.
    pub fn new(inner: Q, link: Link, life: Life, deliveries: Deliveries) -> Self {
        Self {
            inner,
            link,
            life,
            deliveries,
            late: 0.0,
            on_wire: false,
        }
    }

    /// With `on_wire`, draws no faults (the wire below draws SQS's) and
    /// leaves noting the deletes and visibility changes SQS applied to the
    /// model, which knows when it applied them.
    pub fn faults_on_wire(mut self, on_wire: bool) -> Self {
        self.on_wire = on_wire;
        self
    }

    /// Deletes and visibility changes the client gives up on (a timeout)
    /// that SQS applies later, at `rate` (see `crate::might`).
    pub fn with_late(mut self, rate: f64) -> Self {
        self.late = rate;
        self
    }

    /// Whether this call is given up on and lands later: then `land` is
    /// applied in the background, and the caller sees a timeout.
    async fn late<F>(
        &self,
        op: &'static str,
        url: &str,
        subjects: &[String],
        land: F,
    ) -> Result<(), QueueError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        if self.on_wire || self.late <= 0.0 {
            return Ok(());
        }
        let Some((wait, after)) = self.link.draw_late(Service::Sqs, op, self.late, subjects) else {
            return Ok(());
        };
        let (trace, name) = (self.link.trace.clone(), self.link.name.clone());
        let landing = self.link.lands_later();
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            land.await;
            trace.event(format!("landed late: {name} {op}"));
            drop(landing);
        });
        self.life.guard(tokio::time::sleep(wait)).await;
        let detail = "timed out (the request lands later)";
        Err(QueueError::new(op, url, detail, true))
    }

    /// Notes a batch call whose entries failed alone (a fault drawn on
    /// the wire, or SQS's model doing it: one of its "might"s, which the
    /// calm does not end) as trouble on the calls of the failed entries
    /// (`subjects`: each entry's, by its index).
    fn entries_noted(
        &self,
        out: Result<Vec<EntryFailure>, QueueError>,
        subjects: &[Vec<String>],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        if let Some(failed) = out.as_ref().ok().filter(|failed| !failed.is_empty()) {
            let failed: Vec<String> = failed
                .iter()
                .filter_map(|f| subjects.get(f.index))
                .flatten()
                .cloned()
                .collect();
            self.link
                .trace
                .call_trouble(&self.link.name, &failed, Duration::ZERO);
        }
        out
    }

    async fn call<T>(
        &self,
        op: &'static str,
        url: &str,
        subjects: &[String],
        f: impl Future<Output = Result<T, QueueError>>,
    ) -> Result<T, QueueError> {
        if self.on_wire {
            return self.life.guard(f).await;
        }
        let out = self
            .life
            .guard(self.link.through(Service::Sqs, op, subjects, f))
            .await;
        match out {
            Ok(r) => r,
            Err(detail) => Err(QueueError::new(op, url, detail, true)),
        }
    }
}

impl<Q: QueueClient + Clone + Send + Sync + 'static> QueueClient for FaultyQueue<Q> {
    async fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Result<Vec<Message>, QueueError> {
        // Noted where SQS takes the messages, so a lost answer still counts
        // (on the wire, where the service answers).
        let take = async {
            let got = self.inner.receive(queue, request).await?;
            if !self.on_wire {
                self.deliveries.taken(queue, &got, request.visibility);
                // Issued now, whenever the answer reaches the host (after a
                // freeze, later: seed 759, where a receive's answer held by
                // a freeze reached its host after SQS had handed the
                // message, its visibility run out, to another).
                let receipts: Vec<String> = got
                    .iter()
                    .filter_map(|m| m.receipt_handle().map(str::to_owned))
                    .collect();
                self.deliveries.issued(&receipts);
            }
            Ok(got)
        };
        let receive = [Subject::RECEIVE.to_owned()];
        let got = self.call("ReceiveMessage", queue, &receive, take).await?;
        if !got.is_empty() {
            let who = (self.link.name.as_str(), &self.life, &self.link.sqs_cuts);
            self.deliveries
                .received(who, queue, &got, request.visibility);
            let ids: Vec<String> = got
                .iter()
                .map(|m| format!("{}#{}", m.id(), m.receive_count()))
                .collect();
            self.link
                .trace
                .event(format!("{} received {}", self.link.name, ids.join(" ")));
        }
        Ok(got)
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        let receipts = [receipt.to_owned()];
        self.deliveries
            .delete_sent_by(queue, &receipts, &self.link.sqs_cuts);
        let _back = Returned(&self.deliveries, queue, &receipts);
        self.delete_once(queue, receipt).await
    }

    async fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        self.deliveries
            .delete_sent_by(queue, receipts, &self.link.sqs_cuts);
        let _back = Returned(&self.deliveries, queue, receipts);
        let each: Vec<Vec<String>> = receipts.iter().map(|r| vec![Subject::receipt(r)]).collect();
        self.entries_noted(self.delete_batch_once(queue, receipts).await, &each)
    }

    async fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        let (inner, seen, q, r) = (
            self.inner.clone(),
            self.deliveries.clone(),
            queue.to_owned(),
            receipt.to_owned(),
        );
        let subjects = [Subject::receipt(receipt)];
        self.late("ChangeMessageVisibility", queue, &subjects, async move {
            if inner.change_visibility(&q, &r, timeout).await.is_ok() {
                seen.visibility_set(&[r], timeout);
            }
        })
        .await?;
        let f = async {
            let out = self.inner.change_visibility(queue, receipt, timeout).await;
            if out.is_ok() && !self.on_wire {
                self.deliveries
                    .visibility_set(&[receipt.to_owned()], timeout);
            }
            out
        };
        self.call("ChangeMessageVisibility", queue, &subjects, f)
            .await
    }

    async fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let (inner, seen, q, all) = (
            self.inner.clone(),
            self.deliveries.clone(),
            queue.to_owned(),
            receipts.to_vec(),
        );
        let subjects = receipt_subjects(receipts);
        self.late(
            "ChangeMessageVisibilityBatch",
            queue,
            &subjects,
            async move {
                if let Ok(failed) = inner.change_visibility_batch(&q, &all, timeout).await {
                    seen.visibility_set(&applied(&all, &failed), timeout);
                }
            },
        )
        .await?;
        let f = async {
            let out = self
                .inner
                .change_visibility_batch(queue, receipts, timeout)
                .await;
            if let Some(failed) = out.as_ref().ok().filter(|_| !self.on_wire) {
                self.deliveries
                    .visibility_set(&applied(receipts, failed), timeout);
            }
            out
        };
        let each: Vec<Vec<String>> = receipts.iter().map(|r| vec![Subject::receipt(r)]).collect();
        let out = self
            .call("ChangeMessageVisibilityBatch", queue, &subjects, f)
            .await;
        self.entries_noted(out, &each)
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        let subjects = Subject::of_outgoing(&message, &self.link.trace);
        self.call(
            "SendMessage",
            queue,
            &subjects,
            self.inner.send(queue, message),
        )
        .await
    }

    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let (inner, q, all) = (self.inner.clone(), queue.to_owned(), messages.clone());
        let each: Vec<Vec<String>> = messages
            .iter()
            .map(|m| Subject::of_outgoing(m, &self.link.trace))
            .collect();
        let subjects: Vec<String> = each.iter().flatten().cloned().collect();
        self.late("SendMessageBatch", queue, &subjects, async move {
            let _ = inner.send_batch(&q, all).await;
        })
        .await?;
        let f = self.inner.send_batch(queue, messages);
        let out = self.call("SendMessageBatch", queue, &subjects, f).await;
        self.entries_noted(out, &each)
    }

    async fn attributes(&self, queue: &str) -> Result<QueueAttributes, QueueError> {
        self.call(
            "GetQueueAttributes",
            queue,
            &[],
            self.inner.attributes(queue),
        )
        .await
    }

    async fn queue_url(&self, name: &str, account: &str) -> Result<String, QueueError> {
        self.call(
            "GetQueueUrl",
            name,
            &[],
            self.inner.queue_url(name, account),
        )
        .await
    }
}

/// A batch call's receipts as the subjects of its trouble.
fn receipt_subjects(receipts: &[String]) -> Vec<String> {
    receipts.iter().map(|r| Subject::receipt(r)).collect()
}

/// The receipts of a batch call SQS applied: all but its failed entries.
fn applied(receipts: &[String], failed: &[EntryFailure]) -> Vec<String> {
    receipts
        .iter()
        .enumerate()
        .filter(|(i, _)| !failed.iter().any(|f| f.index == *i))
        .map(|(_, r)| r.clone())
        .collect()
}

/// Attempts per store operation, as `DynamoStore` sends each again with the
/// same token after an unknown outcome.
const STORE_ATTEMPTS: u32 = 4;

/// A [`DedupStore`] for one host: the shared records (on the host's clock)
/// behind its link and life. Like `DynamoStore`, it sends an operation again
/// (same owner token, same request) after a failure, up to 4 times, so a lost
/// answer is followed by a retry that finds its own earlier write.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    link: Link,
    life: Life,
    /// The host's clock (what a late request carries).
    clock: Arc<dyn Clock>,
}

/// A request that lands later: applied by the service in the background.
type Landing = futures::future::BoxFuture<'static, ()>;

/// A store whose conditions can be evaluated at a given time: a request
/// that lands late carries the time its client read when sending it (as a
/// DynamoDB request carries `:now_ms` and the lease end in its values).
pub trait AtTime {
    /// The same records, judged at `t`.
    fn at(&self, t: std::time::SystemTime) -> Self;
}

impl AtTime for sqs_once::MemoryStore {
    fn at(&self, t: std::time::SystemTime) -> Self {
        let clock = sqs_once::clock::ManualClock::starting_now();
        clock.set(t);
        self.with_clock(Arc::new(clock))
    }
}

impl<S: DedupStore + Clone + AtTime> FaultyStore<S> {
    /// `inner` as seen by a host.
    pub fn new(inner: S, link: Link, life: Life, clock: Arc<dyn Clock>) -> Self {
        Self {
            inner,
            link,
            life,
            clock,
        }
    }

    /// Sends `f` up to [`STORE_ATTEMPTS`] times through the host's link. A
    /// request the client gives up on may still land later: `land` is then
    /// applied in the background (a stale write arriving after its sender
    /// moved on, which fencing must make harmless).
    async fn call<T, F>(
        &self,
        op: &'static str,
        pk: &str,
        mut f: impl FnMut() -> F,
        land: impl Fn(S) -> Landing,
    ) -> Result<T, StoreError>
    where
        F: Future<Output = Result<T, StoreError>>,
    {
        let mut last = String::new();
        // Every attempt refused for a transaction conflict (as `DynamoStore`
        // answers `Busy` only then).
        let mut busy = true;
        let subjects: Vec<String> = [pk]
            .into_iter()
            .filter(|pk| !pk.is_empty())
            .map(Subject::key)
            .collect();
        for attempt in 0..STORE_ATTEMPTS {
            if attempt > 0 {
                self.life
                    .guard(tokio::time::sleep(Duration::from_millis(50 << attempt)))
                    .await;
            }
            // Pauses strike the writes sent after a handler ran: what a
            // write that leaves long after its lease was last checked does
            // is what fencing is for.
            let after_handler =
                matches!(op, "complete" | "release" | "mark_failed" | "commit_fast");
            if let Some(pause) = after_handler
                .then(|| self.link.draw_pause(Service::Ddb, op))
                .flatten()
            {
                self.life.guard(tokio::time::sleep(pause)).await;
            }
            if let Some((wait, after)) =
                self.link
                    .draw_late(Service::Ddb, op, self.link.plan.late, &subjects)
            {
                let landing = land(self.inner.at(self.clock.now()));
                let (trace, name) = (self.link.trace.clone(), self.link.name.clone());
                let counted = self.link.lands_later();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    landing.await;
                    trace.event(format!("landed late: {name} {op}"));
                    drop(counted);
                });
                self.life.guard(tokio::time::sleep(wait)).await;
                last = "timed out (the request lands later)".into();
                busy = false;
                continue;
            }
            match self
                .life
                .guard(self.link.through(Service::Ddb, op, &subjects, f()))
                .await
            {
                Ok(r) => return r,
                Err(detail) => {
                    busy &= detail == CONFLICT;
                    last = detail;
                }
            }
        }
        let detail = format!("{op}: {last} ({STORE_ATTEMPTS} attempts)");
        // As `DynamoStore` does, an unprotected commit's conflict is no
        // `Busy`: it has no key of its own to come back to.
        Err(if busy && op != "commit_unprotected" {
            StoreError::Busy(detail)
        } else {
            StoreError::Unavailable(detail)
        })
    }
}

impl<S: DedupStore + Clone + AtTime> DedupStore for FaultyStore<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let owned = req.clone();
        let land = move |inner: S| -> Landing {
            let (inner, req) = (inner.clone(), owned.clone());
            Box::pin(async move {
                let _ = inner.claim(&req).await;
            })
        };
        self.call("claim", &req.pk, || self.inner.claim(req), land)
            .await
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        let owned = c.clone();
        let land = move |inner: S| -> Landing {
            let (inner, c) = (inner.clone(), owned.clone());
            Box::pin(async move {
                let _ = inner.complete(c).await;
            })
        };
        let pk = c.pk.clone();
        self.call("complete", &pk, || self.inner.complete(c.clone()), land)
            .await
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        let (p, o, e) = (pk.to_owned(), owner.to_owned(), error.to_owned());
        let land = move |inner: S| -> Landing {
            let (inner, p, o, e) = (inner.clone(), p.clone(), o.clone(), e.clone());
            Box::pin(async move {
                let _ = inner.release(&p, &o, &e).await;
            })
        };
        self.call("release", pk, || self.inner.release(pk, owner, error), land)
            .await
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let (p, o, e) = (pk.to_owned(), owner.to_owned(), error.to_owned());
        let land = move |inner: S| -> Landing {
            let (inner, p, o, e) = (inner.clone(), p.clone(), o.clone(), e.clone());
            Box::pin(async move {
                let _ = inner.mark_failed(&p, &o, &e, ttl).await;
            })
        };
        self.call(
            "mark_failed",
            pk,
            || self.inner.mark_failed(pk, owner, error, ttl),
            land,
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
        let (p, o) = (pk.to_owned(), owner.to_owned());
        let land = move |inner: S| -> Landing {
            let (inner, p, o) = (inner.clone(), p.clone(), o.clone());
            Box::pin(async move {
                let _ = inner.extend_lease(&p, &o, lease, ttl).await;
            })
        };
        self.call(
            "extend_lease",
            pk,
            || self.inner.extend_lease(pk, owner, lease, ttl),
            land,
        )
        .await
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        let owned = writes.clone();
        let land = move |inner: S| -> Landing {
            let (inner, w) = (inner.clone(), owned.clone());
            Box::pin(async move {
                let _ = inner.commit_unprotected(w).await;
            })
        };
        self.call(
            "commit_unprotected",
            "",
            || self.inner.commit_unprotected(writes.clone()),
            land,
        )
        .await
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        let owned = c.clone();
        let land = move |inner: S| -> Landing {
            let (inner, c) = (inner.clone(), owned.clone());
            Box::pin(async move {
                let _ = inner.commit_fast(c).await;
            })
        };
        let pk = c.pk.clone();
        self.call(
            "commit_fast",
            &pk,
            || self.inner.commit_fast(c.clone()),
            land,
        )
        .await
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        let (p, owned) = (pk.to_owned(), sent.to_vec());
        let land = move |inner: S| -> Landing {
            let (inner, p, owned) = (inner.clone(), p.clone(), owned.clone());
            Box::pin(async move {
                let _ = inner.mark_dispatched(&p, &owned).await;
            })
        };
        self.call(
            "mark_dispatched",
            pk,
            || self.inner.mark_dispatched(pk, sent),
            land,
        )
        .await
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        let land = |_: S| -> Landing { Box::pin(async {}) };
        let read = self.call("get", pk, || self.inner.get(pk), land).await;
        if read.is_err() {
            self.link.trace.failed_read(&self.link.name, pk);
        }
        read
    }
}
