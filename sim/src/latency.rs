//! Latencies of the AWS calls, modelled on published figures, for runs at
//! scale in virtual time ([`crate::scale`]). [`LatentQueue`] and
//! [`LatentStore`] wrap the SQS model and the dedup store as `FaultyQueue`
//! and `FaultyStore` do for faults: every call waits half its latency before
//! it applies and the other half after (the request's and the answer's trip),
//! each latency drawn from the operation's distribution with the run's seeded
//! generator, and every call is counted by operation.
//!
//! An operation's distribution is a log-normal fitted to a median and a 99th
//! percentile ([`LatencyModel::aws`], the default), or a piecewise-linear
//! quantile function through published quantiles ([`LatencyModel::aws_quantiles`]).
//! Draws are independent, or correlated in time ([`Correlation`]): calls to
//! one service in the same window share part of their draw, so a slow period
//! makes a call's neighbours in time slower too, each call's distribution
//! unchanged.
//!
//! The figures and where they come from are in [`LatencyModel::aws`],
//! [`LatencyModel::aws_quantiles`] and section 9 of `bench/RESULTS.md`.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqs_once::metrics::Metrics;
use sqs_once::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
};
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{Claim, DedupStore, Message, Record, StagedWrite, StoreError};
use tokio::time::Instant;

/// An AWS operation, as the service bills and answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    /// `ReceiveMessage` that returned messages.
    ReceiveMessage,
    /// `ReceiveMessage` that returned none (a long poll that ran out).
    EmptyReceive,
    /// `DeleteMessage`.
    DeleteMessage,
    /// `DeleteMessageBatch`.
    DeleteMessageBatch,
    /// `ChangeMessageVisibility`.
    ChangeMessageVisibility,
    /// `ChangeMessageVisibilityBatch`.
    ChangeMessageVisibilityBatch,
    /// `SendMessage`.
    SendMessage,
    /// `GetQueueAttributes`, `GetQueueUrl`.
    QueueMetadata,
    /// `TransactWriteItems` (the record with staged writes).
    TransactWriteItems,
    /// `UpdateItem` (claims, completions without writes, releases, leases).
    UpdateItem,
    /// `GetItem`.
    GetItem,
}

impl Op {
    /// Every operation, in order.
    pub const ALL: [Op; 11] = [
        Op::ReceiveMessage,
        Op::EmptyReceive,
        Op::DeleteMessage,
        Op::DeleteMessageBatch,
        Op::ChangeMessageVisibility,
        Op::ChangeMessageVisibilityBatch,
        Op::SendMessage,
        Op::QueueMetadata,
        Op::TransactWriteItems,
        Op::UpdateItem,
        Op::GetItem,
    ];

    /// The API name.
    pub fn name(self) -> &'static str {
        match self {
            Op::ReceiveMessage => "SQS.ReceiveMessage",
            Op::EmptyReceive => "SQS.ReceiveMessage (empty)",
            Op::DeleteMessage => "SQS.DeleteMessage",
            Op::DeleteMessageBatch => "SQS.DeleteMessageBatch",
            Op::ChangeMessageVisibility => "SQS.ChangeMessageVisibility",
            Op::ChangeMessageVisibilityBatch => "SQS.ChangeMessageVisibilityBatch",
            Op::SendMessage => "SQS.SendMessage",
            Op::QueueMetadata => "SQS.GetQueueAttributes/GetQueueUrl",
            Op::TransactWriteItems => "DynamoDB.TransactWriteItems",
            Op::UpdateItem => "DynamoDB.UpdateItem",
            Op::GetItem => "DynamoDB.GetItem",
        }
    }

    fn index(self) -> usize {
        Op::ALL.iter().position(|o| *o == self).unwrap_or(0)
    }

    /// An SQS call (else DynamoDB).
    pub fn is_sqs(self) -> bool {
        self.index() < Op::TransactWriteItems.index()
    }
}

/// A log-normal distribution given by its median and 99th percentile, with
/// draws capped at five times the 99th percentile.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormal {
    /// Median, milliseconds.
    pub median_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
}

/// The standard normal's 99th percentile.
const Z99: f64 = 2.326_347_874;

impl LogNormal {
    /// Given by its median and 99th percentile, milliseconds.
    pub const fn new(median_ms: f64, p99_ms: f64) -> Self {
        Self { median_ms, p99_ms }
    }

    /// The log's standard deviation.
    pub fn sigma(&self) -> f64 {
        (self.p99_ms / self.median_ms).ln() / Z99
    }

    /// The mean, milliseconds.
    pub fn mean_ms(&self) -> f64 {
        self.median_ms * (self.sigma().powi(2) / 2.0).exp()
    }

    /// The latency at standard normal `z`, milliseconds (capped).
    fn at(&self, z: f64) -> f64 {
        (self.median_ms * (self.sigma() * z).exp()).min(5.0 * self.p99_ms)
    }

    #[cfg(test)]
    fn draw(&self, rng: &mut StdRng) -> Duration {
        Duration::from_secs_f64(self.at(normal(rng)) / 1000.0)
    }
}

/// One standard normal from two uniforms (Box-Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random_range(0.0..1.0);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The standard normal's distribution function (Abramowitz and Stegun
/// 7.1.26; absolute error under 1e-7).
fn phi(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs() / std::f64::consts::SQRT_2);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-(x * x) / 2.0).exp();
    if x >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

/// A distribution given by quantiles: `(q, ms)` points with `q` rising from
/// 0 to 1, the quantile function linear between them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    /// The points, `q` rising, the first at 0 and the last at 1.
    pub points: &'static [(f64, f64)],
}

impl Quantiles {
    /// The latency at quantile `q`, milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        let p = self.points;
        let q = q.clamp(0.0, 1.0);
        let i = p.iter().position(|(at, _)| *at >= q).unwrap_or(p.len() - 1);
        if i == 0 {
            return p[0].1;
        }
        let ((q0, v0), (q1, v1)) = (p[i - 1], p[i]);
        if q1 <= q0 {
            return v1;
        }
        v0 + (v1 - v0) * (q - q0) / (q1 - q0)
    }
}

/// An operation's latency distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dist {
    /// Fitted to a median and a 99th percentile.
    LogNormal(LogNormal),
    /// Through published quantiles.
    Quantiles(Quantiles),
}

impl Dist {
    /// The latency at quantile `q`, milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        match self {
            Dist::LogNormal(d) => {
                // Bisection on the normal's distribution function.
                let (mut lo, mut hi) = (-8.0, 8.0);
                for _ in 0..60 {
                    let mid: f64 = (lo + hi) / 2.0;
                    if phi(mid) < q {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                d.at(lo)
            }
            Dist::Quantiles(d) => d.quantile_ms(q),
        }
    }

    /// The median, milliseconds.
    pub fn median_ms(&self) -> f64 {
        self.quantile_ms(0.5)
    }

    /// The 99th percentile, milliseconds.
    pub fn p99_ms(&self) -> f64 {
        self.quantile_ms(0.99)
    }

    /// The mean, milliseconds (of the capped draws).
    pub fn mean_ms(&self) -> f64 {
        match self {
            Dist::LogNormal(d) => d.mean_ms(),
            Dist::Quantiles(d) => {
                let n = 10_000;
                (0..n)
                    .map(|i| d.quantile_ms((f64::from(i) + 0.5) / f64::from(n)))
                    .sum::<f64>()
                    / f64::from(n)
            }
        }
    }

    /// The latency at standard normal `z` (the quantile `phi(z)`).
    fn at(&self, z: f64) -> Duration {
        let ms = match self {
            Dist::LogNormal(d) => d.at(z),
            Dist::Quantiles(d) => d.quantile_ms(phi(z)),
        };
        Duration::from_secs_f64(ms / 1000.0)
    }
}

impl From<LogNormal> for Dist {
    fn from(d: LogNormal) -> Self {
        Dist::LogNormal(d)
    }
}

/// `PutItem` from Lambda in the same region, 400 calls: min 5.47, p50 7.55,
/// p90 11.3, p95 13.2, p99 16.2, max 29 ms (DeBrie, "DynamoDB Transactions
/// Performance Testing", 2020; the table in the README of
/// github.com/alexdebrie/dynamodb-performance-testing). The min and max are
/// placed at the plotting positions of 400 samples' first and last
/// (0.5/400 and 1 - 0.5/400); nothing is drawn below the min or above the max.
pub const DEBRIE_PUT_ITEM: Quantiles = Quantiles {
    points: &[
        (0.0, 5.47),
        (0.001_25, 5.47),
        (0.5, 7.55),
        (0.9, 11.3),
        (0.95, 13.2),
        (0.99, 16.2),
        (0.998_75, 29.0),
        (1.0, 29.0),
    ],
};

/// `TransactWriteItems` of 5 items, the same test: min 19.4, p50 25.3, p90
/// 30.7, p95 36.4, p99 92.5, max 218 ms.
pub const DEBRIE_TRANSACT_5: Quantiles = Quantiles {
    points: &[
        (0.0, 19.4),
        (0.001_25, 19.4),
        (0.5, 25.3),
        (0.9, 30.7),
        (0.95, 36.4),
        (0.99, 92.5),
        (0.998_75, 218.0),
        (1.0, 218.0),
    ],
};

/// Correlated draws: time cut into windows; the calls to one service (SQS,
/// DynamoDB) in a window share a standard normal `w`, each call's own `c`
/// independent, and a call's draw is the quantile of
/// `rho * w + sqrt(1 - rho^2) * c` (a Gaussian copula): each call's
/// distribution is the operation's, and two calls in one window are
/// correlated `rho^2` in their normal scores. Not calibrated on a published
/// figure (none found): a way to see how much a slow period that slows
/// neighbouring calls together moves the results.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Correlation {
    /// The window.
    pub window: Duration,
    /// The weight of the shared part, 0 to 1.
    pub rho: f64,
}

/// A latency distribution per operation (an empty receive's is the round
/// trip after its long poll ran out).
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyModel {
    /// By [`Op::ALL`]'s order.
    pub ops: [Dist; 11],
    /// Draws correlated in time, or independent (`None`).
    pub correlation: Option<Correlation>,
}

impl LatencyModel {
    /// Figures for a client in the same region (see `bench/RESULTS.md`,
    /// section 9, for the sources and which numbers are assumptions):
    /// - DynamoDB `PutItem`, measured client-side from Lambda in the same
    ///   region: median 7.55 ms, p99 16.2 ms (Alex DeBrie, "DynamoDB
    ///   Transactions Performance Testing", 2020); used for `UpdateItem` and
    ///   `GetItem` too (assumed: not measured there).
    /// - DynamoDB `TransactWriteItems` of 5 items: median 25.3 ms, p99 92.5 ms
    ///   (the same test; a cancelled one 25.3 / 84.9); used for 2 items
    ///   (assumed: no published figure for 2).
    /// - SQS: median 10 ms for every call (AWS's own result of 16 ms for a
    ///   1 KB send, 2012, and "under 10 ms on publish and receive" in
    ///   training material); p99 50 ms assumed (no published percentile).
    pub fn aws() -> Self {
        let sqs = LogNormal::new(10.0, 50.0).into();
        let item = LogNormal::new(7.55, 16.2).into();
        let transaction = LogNormal::new(25.3, 92.5).into();
        Self::of_three(sqs, item, transaction)
    }

    /// The published quantiles where there are some: DynamoDB's item calls
    /// by [`DEBRIE_PUT_ITEM`] and its transactions by [`DEBRIE_TRANSACT_5`]
    /// (the same assumptions as [`Self::aws`]: `UpdateItem` and `GetItem`
    /// as `PutItem`, a 2- or 3-item transaction as one of 5); SQS as in
    /// [`Self::aws`], a log-normal of median 10 ms and p99 50 ms (no
    /// published percentiles found).
    pub fn aws_quantiles() -> Self {
        let sqs = LogNormal::new(10.0, 50.0).into();
        Self::of_three(
            sqs,
            Dist::Quantiles(DEBRIE_PUT_ITEM),
            Dist::Quantiles(DEBRIE_TRANSACT_5),
        )
    }

    fn of_three(sqs: Dist, item: Dist, transaction: Dist) -> Self {
        Self {
            correlation: None,
            ops: [
                sqs,
                sqs,
                sqs,
                sqs,
                sqs,
                sqs,
                sqs,
                sqs,
                transaction,
                item,
                item,
            ],
        }
    }

    /// Every SQS call's distribution set to `d`.
    pub fn with_sqs(mut self, d: LogNormal) -> Self {
        for op in Op::ALL {
            if op.is_sqs() {
                self.ops[op.index()] = d.into();
            }
        }
        self
    }

    /// `TransactWriteItems`'s distribution set to `d`.
    pub fn with_transaction(mut self, d: LogNormal) -> Self {
        self.ops[Op::TransactWriteItems.index()] = d.into();
        self
    }

    /// Draws correlated by `c`.
    pub fn with_correlation(mut self, c: Correlation) -> Self {
        self.correlation = Some(c);
        self
    }

    /// The distribution of `op`.
    pub fn of(&self, op: Op) -> Dist {
        self.ops[op.index()]
    }
}

/// Calls counted by operation, and the time they took.
#[derive(Debug, Default)]
pub struct Calls {
    counts: [AtomicU64; 11],
    micros: [AtomicU64; 11],
    /// When the last `DeleteMessageBatch` or `DeleteMessage` answered.
    last_delete: Mutex<Option<Instant>>,
    /// When each staged write committed, by the `pk` of its first write
    /// (the scale run's ledger row: the event).
    commits: Mutex<Vec<(String, Instant)>>,
    /// Deliveries by the receive count SQS gave them (index: the count).
    receive_counts: Mutex<Vec<u64>>,
}

impl Calls {
    /// Calls of `op`.
    pub fn count(&self, op: Op) -> u64 {
        self.counts[op.index()].load(Ordering::Relaxed)
    }

    /// Seconds spent in calls of `op` (latency drawn plus, for a receive,
    /// the long poll's wait).
    pub fn seconds(&self, op: Op) -> f64 {
        self.micros[op.index()].load(Ordering::Relaxed) as f64 / 1e6
    }

    /// When the last delete answered.
    pub fn last_delete(&self) -> Option<Instant> {
        *self.last_delete.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Messages received at least `n` times (the deliveries whose receive
    /// count was `n`).
    pub fn received_at_least(&self, n: u32) -> u64 {
        let counts = self
            .receive_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        counts.get(n as usize).copied().unwrap_or(0)
    }

    /// The highest receive count of any delivery.
    pub fn max_receive_count(&self) -> u32 {
        let counts = self
            .receive_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        u32::try_from(counts.iter().rposition(|n| *n > 0).unwrap_or(0)).unwrap_or(u32::MAX)
    }

    fn note_deliveries(&self, got: &[Message]) {
        let mut counts = self
            .receive_counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for m in got {
            let n = m.receive_count() as usize;
            if counts.len() <= n {
                counts.resize(n + 1, 0);
            }
            counts[n] += 1;
        }
    }

    /// Every commit of staged writes: the first write's `pk` and when its
    /// answer came back.
    pub fn commits(&self) -> Vec<(String, Instant)> {
        self.commits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn note_commit(&self, writes: &[StagedWrite]) {
        let pk = writes
            .first()
            .and_then(|w| w.item.put())
            .and_then(|p| p.item().get("pk"))
            .and_then(|v| v.as_s().ok());
        if let Some(pk) = pk {
            let mut commits = self.commits.lock().unwrap_or_else(|e| e.into_inner());
            commits.push((pk.clone(), Instant::now()));
        }
    }

    fn note(&self, op: Op, took: Duration) {
        self.counts[op.index()].fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.micros[op.index()].fetch_add(micros, Ordering::Relaxed);
        if matches!(op, Op::DeleteMessage | Op::DeleteMessageBatch) {
            *self.last_delete.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        }
    }
}

/// The model, the run's generator and the counts, shared by every wrapper.
#[derive(Debug, Clone)]
pub struct Latency {
    model: Arc<LatencyModel>,
    rng: Arc<Mutex<StdRng>>,
    calls: Arc<Calls>,
    /// For correlated draws: the start, and each service's current window
    /// (SQS, DynamoDB) with its shared normal.
    start: Instant,
    windows: Arc<Mutex<[(u64, f64); 2]>>,
    seed: u64,
}

impl Latency {
    /// Latencies of `model`, drawn from `seed`.
    pub fn new(model: LatencyModel, seed: u64) -> Self {
        Self {
            model: Arc::new(model),
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
            calls: Arc::default(),
            start: Instant::now(),
            windows: Arc::new(Mutex::new([(u64::MAX, 0.0); 2])),
            seed,
        }
    }

    /// The shared normal of `op`'s service in the current window.
    fn shared(&self, op: Op, window: Duration) -> f64 {
        let service = usize::from(!op.is_sqs());
        let n = Instant::now().duration_since(self.start).as_nanos() / window.as_nanos().max(1);
        let n = u64::try_from(n).unwrap_or(u64::MAX - 1);
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        let (at, w) = &mut windows[service];
        if *at != n {
            // Each window's normal from its own generator: the same run
            // draws the same windows whatever the calls in between.
            let mut rng = StdRng::seed_from_u64(
                self.seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((service as u64) << 63),
            );
            *at = n;
            *w = normal(&mut rng);
        }
        *w
    }

    /// The counts so far.
    pub fn calls(&self) -> &Calls {
        &self.calls
    }

    fn draw(&self, op: Op) -> Duration {
        let own = normal(&mut self.rng.lock().unwrap_or_else(|e| e.into_inner()));
        let z = match self.model.correlation {
            Some(c) => {
                let rho = c.rho.clamp(0.0, 1.0);
                rho * self.shared(op, c.window) + (1.0 - rho * rho).sqrt() * own
            }
            None => own,
        };
        self.model.of(op).at(z)
    }

    /// Runs `call` half a latency after now and answers half a latency after
    /// it applied; `op` names the call, `empty` (given the answer) tells a
    /// receive that returned nothing.
    async fn around<T>(
        &self,
        op: Op,
        call: impl Future<Output = T>,
        empty: impl FnOnce(&T) -> bool,
    ) -> T {
        let start = Instant::now();
        let trip = self.draw(op);
        tokio::time::sleep(trip / 2).await;
        let out = call.await;
        tokio::time::sleep(trip - trip / 2).await;
        let op = if op == Op::ReceiveMessage && empty(&out) {
            Op::EmptyReceive
        } else {
            op
        };
        self.calls.note(op, start.elapsed());
        out
    }

    async fn call<T>(&self, op: Op, call: impl Future<Output = T>) -> T {
        self.around(op, call, |_| false).await
    }
}

/// A [`QueueClient`] whose calls take modelled latencies.
#[derive(Debug, Clone)]
pub struct LatentQueue<Q> {
    inner: Q,
    latency: Latency,
}

impl<Q: QueueClient> LatentQueue<Q> {
    /// `inner` behind `latency`.
    pub fn new(inner: Q, latency: Latency) -> Self {
        Self { inner, latency }
    }
}

impl<Q: QueueClient> QueueClient for LatentQueue<Q> {
    async fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Result<Vec<Message>, QueueError> {
        let call = self.inner.receive(queue, request);
        let empty = |r: &Result<Vec<Message>, QueueError>| r.as_ref().is_ok_and(Vec::is_empty);
        let got = self.latency.around(Op::ReceiveMessage, call, empty).await;
        if let Ok(got) = &got {
            self.latency.calls.note_deliveries(got);
        }
        got
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        let call = self.inner.delete(queue, receipt);
        self.latency.call(Op::DeleteMessage, call).await
    }

    async fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let call = self.inner.delete_batch(queue, receipts);
        self.latency.call(Op::DeleteMessageBatch, call).await
    }

    async fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        let call = self.inner.change_visibility(queue, receipt, timeout);
        self.latency.call(Op::ChangeMessageVisibility, call).await
    }

    async fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let call = self.inner.change_visibility_batch(queue, receipts, timeout);
        self.latency
            .call(Op::ChangeMessageVisibilityBatch, call)
            .await
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        let call = self.inner.send(queue, message);
        self.latency.call(Op::SendMessage, call).await
    }

    async fn attributes(&self, queue: &str) -> Result<QueueAttributes, QueueError> {
        let call = self.inner.attributes(queue);
        self.latency.call(Op::QueueMetadata, call).await
    }

    async fn queue_url(&self, name: &str, account: &str) -> Result<String, QueueError> {
        let call = self.inner.queue_url(name, account);
        self.latency.call(Op::QueueMetadata, call).await
    }
}

/// A [`DedupStore`] whose calls take modelled latencies, each named by the
/// DynamoDB operation `DynamoStore` makes for it.
#[derive(Debug, Clone)]
pub struct LatentStore<S> {
    inner: S,
    latency: Latency,
}

impl<S: DedupStore> LatentStore<S> {
    /// `inner` behind `latency`.
    pub fn new(inner: S, latency: Latency) -> Self {
        Self { inner, latency }
    }
}

impl<S: DedupStore> DedupStore for LatentStore<S> {
    fn report_to(&self, metrics: Arc<Metrics>) {
        self.inner.report_to(metrics);
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.latency
            .call(Op::UpdateItem, self.inner.claim(req))
            .await
    }

    async fn complete(&self, c: Completion) -> Result<(), StoreError> {
        let op = if c.writes.is_empty() {
            Op::UpdateItem
        } else {
            Op::TransactWriteItems
        };
        let writes = c.writes.clone();
        let out = self.latency.call(op, self.inner.complete(c)).await;
        if out.is_ok() {
            self.latency.calls.note_commit(&writes);
        }
        out
    }

    async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
        let call = self.inner.release(pk, owner, error);
        self.latency.call(Op::UpdateItem, call).await
    }

    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let call = self.inner.mark_failed(pk, owner, error, ttl);
        self.latency.call(Op::UpdateItem, call).await
    }

    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let call = self.inner.extend_lease(pk, owner, lease, ttl);
        self.latency.call(Op::UpdateItem, call).await
    }

    async fn commit_unprotected(&self, writes: Vec<StagedWrite>) -> Result<(), StoreError> {
        let call = self.inner.commit_unprotected(writes);
        self.latency.call(Op::TransactWriteItems, call).await
    }

    async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
        let writes = c.writes.clone();
        let call = self.inner.commit_fast(c);
        let out = self.latency.call(Op::TransactWriteItems, call).await;
        if matches!(out, Ok(FastCommitted::Committed)) {
            self.latency.calls.note_commit(&writes);
        }
        out
    }

    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        let call = self.inner.mark_dispatched(pk, sent);
        self.latency.call(Op::UpdateItem, call).await
    }

    async fn get(&self, pk: &str) -> Result<Option<Record>, StoreError> {
        self.latency.call(Op::GetItem, self.inner.get(pk)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_have_the_median_and_p99_they_were_given() {
        let d = LogNormal::new(25.3, 92.5);
        let mut rng = StdRng::seed_from_u64(7);
        let mut ms: Vec<f64> = (0..100_000)
            .map(|_| d.draw(&mut rng).as_secs_f64() * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        let (median, p99) = (ms[50_000], ms[99_000]);
        assert!((median - 25.3).abs() < 0.5, "median {median}");
        assert!((p99 - 92.5).abs() < 4.0, "p99 {p99}");
    }

    #[test]
    fn quantile_draws_have_the_published_quantiles() {
        let d = Dist::Quantiles(DEBRIE_TRANSACT_5);
        let mut rng = StdRng::seed_from_u64(7);
        let mut ms: Vec<f64> = (0..100_000)
            .map(|_| d.at(normal(&mut rng)).as_secs_f64() * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        for (q, want, within) in [
            (0.5, 25.3, 0.3),
            (0.9, 30.7, 0.4),
            (0.95, 36.4, 1.0),
            (0.99, 92.5, 4.0),
        ] {
            let got = ms[(q * 100_000.0) as usize];
            assert!((got - want).abs() < within, "q{q}: {got} for {want}");
        }
        assert!(ms[0] >= 19.4 && ms[99_999] <= 218.0);
    }

    #[tokio::test(start_paused = true)]
    async fn correlated_draws_keep_their_distribution_and_move_together_in_a_window() {
        let model = LatencyModel::aws().with_correlation(Correlation {
            window: Duration::from_millis(100),
            rho: 0.8,
        });
        let latency = Latency::new(model, 3);
        // Pairs of calls in the same window, 1,000 windows.
        let mut pairs = Vec::new();
        let mut all = Vec::new();
        for _ in 0..1_000 {
            let a = latency.draw(Op::TransactWriteItems).as_secs_f64().ln();
            let b = latency.draw(Op::TransactWriteItems).as_secs_f64().ln();
            pairs.push((a, b));
            all.extend([a, b]);
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (ma, mb) = (
            mean(&pairs.iter().map(|p| p.0).collect::<Vec<_>>()),
            mean(&pairs.iter().map(|p| p.1).collect::<Vec<_>>()),
        );
        let cov = mean(
            &pairs
                .iter()
                .map(|(a, b)| (a - ma) * (b - mb))
                .collect::<Vec<_>>(),
        );
        let var = mean(
            &all.iter()
                .map(|x| (x - mean(&all)).powi(2))
                .collect::<Vec<_>>(),
        );
        let corr = cov / var;
        // Log-normal: the logs are the normal scores, correlated rho^2 = 0.64.
        assert!((corr - 0.64).abs() < 0.08, "correlation {corr}");
        // Each draw still log-normal with the operation's median.
        all.sort_by(f64::total_cmp);
        let median_ms = all[1_000].exp() * 1000.0;
        assert!((median_ms - 25.3).abs() < 3.0, "median {median_ms}");
    }
}
