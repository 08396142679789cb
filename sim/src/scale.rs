//! At scale, in virtual time: many pollers and a large
//! queue on one single-threaded runtime with paused time, every AWS call
//! delayed by a latency from [`crate::latency`]'s model of published figures.
//!
//! Each consumer drains the same messages from a fresh [`MemoryQueue`] into a
//! fresh [`MemoryStore`], one run each:
//! - [`Consumer::SqsOnce`]: `sqs_once::poller::run` as the library ships it,
//!   `pollers` of them with `concurrency` slots and `prefetch` each, a fast-path handler that
//!   waits its handler time and stages the event's ledger row, committed with
//!   the record in one transaction;
//! - [`Consumer::Loop`]: the hand-written transactional loop of
//!   `bench/localstack/src/handwritten.rs` in the same model, `pollers x concurrency / 10`
//!   workers that receive 10, run the same handler time for each message and
//!   make one conditional transaction per message (the store's fast commit:
//!   the record and the ledger row, or nothing for a duplicate), then delete
//!   the batch (the simple loop: it waits for its whole batch);
//! - [`Consumer::BestLoop`] and [`Consumer::BestLoopHeld`]: the best-effort
//!   hand-written loop (`scale/best.rs`: a slot freed per message, receives
//!   ahead, deletes batched in the background), `pollers` of them, with
//!   sqs-once's slots and messages held, or with as many slots as sqs-once
//!   holds messages.
//!
//! Optionally the messages are sent at a fixed rate while the consumer runs
//! (`rate`) instead of all queued at the start; either way each event's time
//! from its first send to its commit is measured.
//!
//! Optionally DynamoDB's capacity is modelled (`capacity`, see
//! [`capacity`]): per-item and per-table write units, transaction conflicts,
//! and the SDK's and the store's retries of what they refuse, the same for
//! every consumer; and each event's transaction also adds its amount to one
//! of `hot_accounts` account items (hot items under load).
//!
//! Each run is checked: every event's ledger row committed exactly once,
//! every account's balance the sum of its events' amounts, and nothing left
//! in the queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sqs_once::clock::{Clock, TokioClock};
use sqs_once::dynamodb_types::{AttributeValue, Put, TransactWriteItem, Update};
use sqs_once::metrics::Snapshot;
use sqs_once::poller::{PollerConfig, RunStats};
use sqs_once::queue::{OutgoingMessage, QueueClient, ReceiveRequest};
use sqs_once::store::{FastCommit, FastCommitted, clock_fence};
use sqs_once::testkit::queue::{QueueSettings, SendOptions};
use sqs_once::{
    Context, DedupStore, Effects, FailureKind, Handler, HandlerError, HandlerResult, MemoryQueue,
    MemoryStore, Message, Processor, ProcessorConfig, StagedWrite,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::latency::{Latency, LatencyModel, LatentQueue, LatentStore, Op};

mod best;
pub mod capacity;
pub use best::{BATCH_WAIT, Places};
pub use capacity::{Capacity, CapacityModel, Refusals};

use capacity::{Retrying, Throttled};

/// The store every consumer of a run writes through: the client's retries
/// of refusals, the latency, the service's capacity, the records.
type ScaleStore = Retrying<LatentStore<Throttled<MemoryStore>>>;

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct ScaleConfig {
    /// Pollers (sqs-once) or slots / 10 workers (the loop).
    pub pollers: usize,
    /// Handler slots per poller.
    pub concurrency: usize,
    /// Messages sqs-once's poller (and the best-effort loop) receive ahead
    /// beyond the running ones, per poller.
    pub prefetch: usize,
    /// Messages in the queue at the start.
    pub messages: usize,
    /// Events sent twice, as a fraction of the events (0.1: 10% of events
    /// have a second copy somewhere in the queue).
    pub duplicate_rate: f64,
    /// How long the handler works on a message.
    pub handler: Duration,
    /// Seeds the order of the messages and the latencies.
    pub seed: u64,
    /// Messages sent per virtual second while the consumer runs (`None`: all
    /// in the queue at the start, a backlog).
    pub rate: Option<f64>,
    /// The calls' latencies.
    pub model: LatencyModel,
    /// A FIFO queue with this many message groups (events spread over them
    /// by number), instead of a standard queue. sqs-once only: the loops do
    /// not keep a group's order.
    pub fifo_groups: Option<usize>,
    /// DynamoDB's capacity (default: unlimited, no conflicts).
    pub capacity: CapacityModel,
    /// Each event's transaction also adds its amount to account item
    /// `a{event % n}` (`None`: the ledger row only).
    pub hot_accounts: Option<usize>,
    /// sqs-once's retry delay, first and longest (`ProcessorConfig`'s
    /// `backoff_base` and `backoff_max`; `None`: its defaults, 2 s and 15
    /// min).
    pub backoff: Option<(Duration, Duration)>,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        Self {
            pollers: 100,
            concurrency: 10,
            prefetch: 10,
            messages: 1_000_000,
            duplicate_rate: 0.1,
            handler: Duration::from_millis(5),
            seed: 1,
            rate: None,
            model: LatencyModel::aws(),
            fifo_groups: None,
            capacity: CapacityModel::unlimited(),
            hot_accounts: None,
            backoff: None,
        }
    }
}

impl ScaleConfig {
    /// Distinct events among the messages.
    pub fn events(&self) -> usize {
        let events = (self.messages as f64 / (1.0 + self.duplicate_rate)).round() as usize;
        events.clamp(self.messages.min(1), self.messages)
    }
}

/// Which consumer drains the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// The library's poller.
    SqsOnce,
    /// The hand-written transactional loop.
    Loop,
    /// The best-effort hand-written loop at sqs-once's slots (concurrency per
    /// poller) and messages held (concurrency + prefetch).
    BestLoop,
    /// The best-effort loop given as many slots as sqs-once holds messages
    /// (concurrency + prefetch per poller, all of them running).
    BestLoopHeld,
}

impl Consumer {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Consumer::SqsOnce => "sqs-once",
            Consumer::Loop => "hand-written loop",
            Consumer::BestLoop => "best-effort loop (equal slots)",
            Consumer::BestLoopHeld => "best-effort loop (equal messages held)",
        }
    }

    /// Handler slots of the run.
    pub fn slots(self, config: &ScaleConfig) -> usize {
        match self {
            Consumer::BestLoopHeld => config.pollers * (config.concurrency + config.prefetch),
            _ => slots(config),
        }
    }
}

/// The ledger check of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Distinct events sent.
    pub events: usize,
    /// Events whose ledger row committed exactly once.
    pub applied_once: usize,
    /// Events with no ledger row.
    pub missing: usize,
    /// Events whose row committed more than once.
    pub applied_more: usize,
    /// Committed writes that are no event's row nor an account's update.
    pub foreign: usize,
    /// Accounts whose balance (the sum of the committed updates) is not the
    /// sum of their events' amounts.
    pub accounts_wrong: usize,
    /// Messages left in the queue (visible, in flight or delayed).
    pub left_in_queue: usize,
}

impl Ledger {
    /// Every event applied exactly once, nothing left in the queue.
    pub fn ok(&self) -> bool {
        self.applied_once == self.events
            && self.missing == 0
            && self.applied_more == 0
            && self.foreign == 0
            && self.accounts_wrong == 0
            && self.left_in_queue == 0
    }
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// Which consumer.
    pub consumer: Consumer,
    /// The run's settings.
    pub config: ScaleConfig,
    /// Virtual seconds from the start until the last delete answered.
    pub virtual_secs: f64,
    /// Wall-clock seconds the run took (the queue's filling included).
    pub wall_secs: f64,
    /// Calls by operation.
    pub calls: Vec<(Op, u64)>,
    /// Seconds spent in DynamoDB calls (all slots together).
    pub store_secs: f64,
    /// Seconds handlers worked (all slots together).
    pub handler_secs: f64,
    /// Handler slots: pollers x concurrency.
    pub slots: usize,
    /// Copies found already done (skipped).
    pub duplicates: u64,
    /// The ledger check.
    pub ledger: Ledger,
    /// Each event's time from its first send until its ledger row committed:
    /// p50, p99 and the largest, milliseconds.
    pub commit_latency_ms: [f64; 3],
    /// Writes DynamoDB refused, and the client's retries of them.
    pub refusals: Refusals,
    /// The library's metrics, summed over its processors (sqs-once only).
    pub metrics: Option<Snapshot>,
    /// Messages returned by receives (a message received twice counts twice).
    pub deliveries: u64,
    /// Messages received more than 5 times: those a redrive policy of
    /// `maxReceiveCount` 5 would have moved to the DLQ unprocessed (the
    /// scale queue has none).
    pub over_five_receives: u64,
    /// The highest receive count of any delivery.
    pub max_receive_count: u32,
    /// Deletes SQS ignored because the message had been received again
    /// since (its visibility ran out before the delete).
    pub stale_deletes: u64,
}

impl RunReport {
    /// Messages per virtual second.
    pub fn throughput(&self) -> f64 {
        self.config.messages as f64 / self.virtual_secs.max(1e-9)
    }

    /// Busy handler-seconds / (slots x virtual time).
    pub fn slot_use(&self) -> f64 {
        self.handler_secs / (self.slots as f64 * self.virtual_secs.max(1e-9))
    }

    /// (Handler + DynamoDB) seconds / (slots x virtual time): the share of
    /// slot time spent on a message's own work, its commit included.
    pub fn work_slot_use(&self) -> f64 {
        (self.handler_secs + self.store_secs) / (self.slots as f64 * self.virtual_secs.max(1e-9))
    }

    /// Receives per message: deliveries / messages.
    pub fn receives_per_message(&self) -> f64 {
        self.deliveries as f64 / self.config.messages.max(1) as f64
    }

    /// Calls of `op` per message.
    pub fn per_message(&self, op: Op) -> f64 {
        let n = self.calls.iter().find(|(o, _)| *o == op).map_or(0, |c| c.1);
        n as f64 / self.config.messages.max(1) as f64
    }

    /// Billed calls per message, empty receives apart.
    pub fn calls_per_message(&self) -> f64 {
        let n: u64 = self
            .calls
            .iter()
            .filter(|(o, _)| *o != Op::EmptyReceive)
            .map(|c| c.1)
            .sum();
        n as f64 / self.config.messages.max(1) as f64
    }
}

/// The services of one run.
struct Services {
    queue: MemoryQueue,
    url: String,
    store: MemoryStore,
    clock: Arc<TokioClock>,
    latency: Latency,
    capacity: Arc<Capacity>,
    hot_accounts: Option<usize>,
    handler_micros: Arc<AtomicU64>,
    /// The send order, when the queue is fed while the consumer runs.
    to_send: Vec<u32>,
    /// Each event's first send.
    sent: std::sync::Mutex<Vec<Option<Instant>>>,
    /// Whether every message has been sent.
    fed: std::sync::atomic::AtomicBool,
    /// FIFO message groups, if the queue is FIFO.
    groups: Option<usize>,
}

/// A time no run reaches: what is left then is stuck.
const GIVE_UP_AFTER: Duration = Duration::from_secs(24 * 3600);

/// Runs `consumer` over the configured messages on a fresh single-threaded
/// runtime with paused time.
pub fn run(config: &ScaleConfig, consumer: Consumer) -> std::io::Result<RunReport> {
    let wall = std::time::Instant::now();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()?;
    let mut report = runtime.block_on(drain(config, consumer));
    report.wall_secs = wall.elapsed().as_secs_f64();
    Ok(report)
}

/// Fills the queue, lets `consumer` drain it, checks the ledger.
async fn drain(config: &ScaleConfig, consumer: Consumer) -> RunReport {
    let services = Arc::new(fill(config));
    let start = Instant::now();
    if let Some(rate) = config.rate {
        tokio::spawn(feed(services.clone(), rate));
    } else {
        let mut sent = services.sent.lock().unwrap_or_else(|e| e.into_inner());
        sent.iter_mut().for_each(|t| *t = Some(start));
    }
    let duplicates = match consumer {
        Consumer::SqsOnce => sqs_once(config, &services).await,
        Consumer::Loop => hand_loop(config, &services).await,
        Consumer::BestLoop | Consumer::BestLoopHeld => {
            let held = config.concurrency + config.prefetch;
            let slots = if consumer == Consumer::BestLoop {
                config.concurrency
            } else {
                held
            };
            best::run(config, &services, best::Places { slots, held }).await
        }
    };
    let end = services.latency.calls().last_delete().unwrap_or(start);
    let calls = services.latency.calls();
    let counts = services.queue.counts(&services.url).unwrap_or_default();
    RunReport {
        consumer,
        config: config.clone(),
        virtual_secs: end.duration_since(start).as_secs_f64(),
        wall_secs: 0.0,
        calls: Op::ALL
            .iter()
            .map(|op| (*op, calls.count(*op)))
            .filter(|(_, n)| *n > 0)
            .collect(),
        store_secs: [Op::TransactWriteItems, Op::UpdateItem, Op::GetItem]
            .iter()
            .map(|op| calls.seconds(*op))
            .sum(),
        handler_secs: services.handler_micros.load(Ordering::Relaxed) as f64 / 1e6,
        slots: consumer.slots(config),
        duplicates,
        ledger: ledger(&services, config.events()),
        commit_latency_ms: commit_latency(&services),
        refusals: services.capacity.refusals(),
        metrics: (consumer == Consumer::SqsOnce).then(|| services.capacity.take_metrics()),
        deliveries: counts.received,
        over_five_receives: calls.received_at_least(6),
        max_receive_count: calls.max_receive_count(),
        stale_deletes: counts.stale_deletes,
    }
}

/// Sends the queue's messages at `rate` per virtual second, in 1 ms ticks.
async fn feed(services: Arc<Services>, rate: f64) {
    let start = Instant::now();
    let mut next = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    while next < services.to_send.len() {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * rate) as usize).min(services.to_send.len());
        while next < due {
            let event = services.to_send[next];
            send(&services, next, event);
            let mut sent = services.sent.lock().unwrap_or_else(|e| e.into_inner());
            sent[event as usize].get_or_insert(Instant::now());
            next += 1;
        }
    }
    services.fed.store(true, Ordering::Relaxed);
}

/// p50, p99 and the largest of each event's first send until its commit, ms.
fn commit_latency(services: &Services) -> [f64; 3] {
    let sent = services.sent.lock().unwrap_or_else(|e| e.into_inner());
    let mut ms: Vec<f64> = services
        .latency
        .calls()
        .commits()
        .iter()
        .filter_map(|(pk, at)| {
            let event: usize = pk.strip_prefix('e')?.parse().ok()?;
            let from = (*sent.get(event)?)?;
            Some(at.duration_since(from).as_secs_f64() * 1e3)
        })
        .collect();
    if ms.is_empty() {
        return [0.0; 3];
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
    [at(0.5), at(0.99), ms[ms.len() - 1]]
}

fn slots(config: &ScaleConfig) -> usize {
    config.pollers * config.concurrency
}

/// The send order: every event once, the first `messages - events` of a
/// shuffled list of events once more, all shuffled.
fn send_order(config: &ScaleConfig) -> Vec<u32> {
    let events = config.events();
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut order: Vec<u32> = (0..events as u32).collect();
    shuffle(&mut order, &mut rng);
    let copies: Vec<u32> = order[..config.messages - events].to_vec();
    order.extend(copies);
    shuffle(&mut order, &mut rng);
    order
}

fn shuffle(v: &mut [u32], rng: &mut StdRng) {
    for i in (1..v.len()).rev() {
        let j = rng.random_range(0..=i);
        v.swap(i, j);
    }
}

/// A queue holding the run's messages (none yet when they are fed at a
/// rate), an empty store, the latencies.
fn fill(config: &ScaleConfig) -> Services {
    let queue = MemoryQueue::new();
    let name = if config.fifo_groups.is_some() {
        "scale.fifo"
    } else {
        "scale"
    };
    let mut settings = QueueSettings::new(name);
    settings.visibility_timeout = Duration::from_secs(30);
    let url = queue
        .create_queue(settings)
        .unwrap_or_else(|e| panic!("the scale queue's settings are valid: {e}"));
    let clock = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let mut services = Services {
        queue,
        url,
        store: MemoryStore::new(clock.clone()),
        clock,
        latency: Latency::new(config.model.clone(), config.seed),
        capacity: Arc::new(Capacity::new(config.capacity.clone(), config.seed)),
        hot_accounts: config.hot_accounts.filter(|n| *n > 0),
        handler_micros: Arc::default(),
        fed: std::sync::atomic::AtomicBool::new(config.rate.is_none()),
        to_send: send_order(config),
        sent: std::sync::Mutex::new(vec![None; config.events()]),
        groups: config.fifo_groups,
    };
    if config.rate.is_none() {
        for (i, e) in services.to_send.iter().enumerate() {
            send(&services, i, *e);
        }
        services.to_send.clear();
    }
    services
}

/// Sends `event`'s message, the `nth` sent (on a FIFO queue: in its group,
/// with a deduplication id of its own, so a copy is a second message).
fn send(services: &Services, nth: usize, event: u32) {
    let message = OutgoingMessage {
        body: format!(
            r#"{{"id":"e{event}","account":"a{}","amount_cents":{}}}"#,
            event % 1000,
            100 + event % 9900
        ),
        group_id: services
            .groups
            .map(|g| format!("g{}", event as usize % g.max(1))),
        deduplication_id: services.groups.map(|_| format!("m{nth}")),
        ..Default::default()
    };
    services
        .queue
        .send_with(&services.url, message, SendOptions::default())
        .unwrap_or_else(|e| panic!("the scale queue takes every message: {e}"));
}

/// Waits until the queue holds nothing (or [`GIVE_UP_AFTER`]).
async fn until_empty(services: &Services) {
    let deadline = Instant::now() + GIVE_UP_AFTER;
    while Instant::now() < deadline {
        let counts = services.queue.counts(&services.url);
        if services.fed.load(Ordering::Relaxed) && counts.is_none_or(|c| c.stored() == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The event a body names, and its amount.
#[derive(serde::Deserialize)]
struct Body {
    id: String,
    amount_cents: i64,
}

/// An event's amount (as its body says).
fn amount(event: usize) -> i64 {
    100 + (event % 9900) as i64
}

/// What an event's transaction stages: its ledger row first (the commit's
/// time is noted by the first write's key), then, with hot accounts, the
/// update adding its amount to its account.
fn staged(
    body: &Body,
    message: &str,
    accounts: Option<usize>,
) -> Result<Vec<TransactWriteItem>, HandlerError> {
    let mut writes = vec![ledger_row(&body.id, message)?];
    if let Some(n) = accounts {
        let event: usize = body
            .id
            .strip_prefix('e')
            .and_then(|e| e.parse().ok())
            .ok_or_else(|| HandlerError::permanent(format!("event id {}", body.id)))?;
        writes.push(account_update(event % n, body.amount_cents)?);
    }
    Ok(writes)
}

/// `ADD balance :amount` to account `a{account}`.
fn account_update(account: usize, amount_cents: i64) -> Result<TransactWriteItem, HandlerError> {
    let update = Update::builder()
        .table_name("accounts")
        .key("pk", AttributeValue::S(format!("a{account}")))
        .update_expression("ADD balance :amount")
        .expression_attribute_values(":amount", AttributeValue::N(amount_cents.to_string()))
        .build()
        .map_err(HandlerError::permanent)?;
    Ok(TransactWriteItem::builder().update(update).build())
}

/// A store of the run: the client's retries around the latency around the
/// capacity around the records.
fn scale_store(services: &Services) -> ScaleStore {
    let throttled = Throttled::new(services.store.clone(), services.capacity.clone());
    let latent = LatentStore::new(throttled, services.latency.clone());
    Retrying::new(latent, services.capacity.clone())
}

/// The event's ledger row, naming the message that made it.
fn ledger_row(event: &str, message: &str) -> Result<TransactWriteItem, HandlerError> {
    let put = Put::builder()
        .table_name("ledger")
        .item("pk", AttributeValue::S(event.to_owned()))
        .item("message", AttributeValue::S(message.to_owned()))
        .build()
        .map_err(HandlerError::permanent)?;
    Ok(TransactWriteItem::builder().put(put).build())
}

/// Works its handler time, then stages the event's ledger row (and account
/// update) (the fast path).
struct ScaleHandler {
    took: Duration,
    busy: Arc<AtomicU64>,
    accounts: Option<usize>,
}

impl Handler for ScaleHandler {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        let body: Body = message.json().map_err(HandlerError::permanent)?;
        work(self.took, &self.busy).await;
        for write in staged(&body, message.id(), self.accounts)? {
            ctx.stage(write);
        }
        Ok(None)
    }

    fn effects(&self) -> Effects {
        Effects::StagedOnly
    }
}

async fn work(took: Duration, busy: &AtomicU64) {
    tokio::time::sleep(took).await;
    let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
    busy.fetch_add(micros, Ordering::Relaxed);
}

/// The library's pollers until the queue is empty; the duplicates they skipped.
async fn sqs_once(config: &ScaleConfig, services: &Arc<Services>) -> u64 {
    let stop = CancellationToken::new();
    let mut processor_config = ProcessorConfig::new("scale");
    processor_config.key_source = "json:/id"
        .parse()
        .unwrap_or_else(|e| panic!("json:/id is a key source: {e}"));
    if let Some((base, max)) = config.backoff {
        processor_config.backoff_base = base;
        processor_config.backoff_max = max;
    }
    let pollers: Vec<_> = (0..config.pollers)
        .map(|_| {
            let latency = services.latency.clone();
            let store = scale_store(services);
            let handler = ScaleHandler {
                took: config.handler,
                busy: services.handler_micros.clone(),
                accounts: services.hot_accounts,
            };
            let processor = Processor::new(store, handler, processor_config.clone())
                .unwrap_or_else(|e| panic!("the scale processor config is valid: {e}"))
                .with_clock(services.clock.clone());
            let queue = LatentQueue::new(services.queue.clone(), latency);
            let mut poller = PollerConfig::new(&services.url);
            poller.concurrency = config.concurrency;
            poller.prefetch = config.prefetch;
            poller.drain = Duration::from_secs(1);
            tokio::spawn(sqs_once::poller::run(
                queue,
                processor,
                poller,
                stop.clone(),
            ))
        })
        .collect();
    until_empty(services).await;
    stop.cancel();
    let mut duplicates = 0;
    for p in pollers {
        let stats: RunStats = p.await.unwrap_or_default();
        duplicates += stats.duplicates;
    }
    duplicates
}

/// The hand-written loop's workers until the queue is empty; the duplicates
/// they found.
async fn hand_loop(config: &ScaleConfig, services: &Arc<Services>) -> u64 {
    let stop = CancellationToken::new();
    let duplicates = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..slots(config).div_ceil(10).max(1))
        .map(|_| {
            let worker = LoopWorker::new(config, services, &duplicates);
            tokio::spawn(worker.run(stop.clone()))
        })
        .collect();
    until_empty(services).await;
    stop.cancel();
    for w in workers {
        let _ = w.await;
    }
    duplicates.load(Ordering::Relaxed)
}

/// One worker of the hand-written loop.
struct LoopWorker {
    services: Arc<Services>,
    queue: LatentQueue<MemoryQueue>,
    store: ScaleStore,
    took: Duration,
    duplicates: Arc<AtomicU64>,
}

impl LoopWorker {
    fn new(config: &ScaleConfig, services: &Arc<Services>, duplicates: &Arc<AtomicU64>) -> Self {
        Self {
            services: services.clone(),
            queue: LatentQueue::new(services.queue.clone(), services.latency.clone()),
            store: scale_store(services),
            took: config.handler,
            duplicates: duplicates.clone(),
        }
    }

    fn url(&self) -> String {
        self.services.url.clone()
    }

    /// Receive 10 (20 s long poll), handle them all at once, delete the
    /// batch; until stopped.
    async fn run(self, stop: CancellationToken) {
        let request = ReceiveRequest {
            max: 10,
            wait: Duration::from_secs(20),
            visibility: Duration::from_secs(30),
        };
        let url = &self.services.url;
        loop {
            let received = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                r = self.queue.receive(url, request) => r,
            };
            let got = match received {
                Ok(got) if !got.is_empty() => got,
                Ok(_) => continue,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let done = futures::future::join_all(got.iter().map(|m| self.handle(m))).await;
            let receipts: Vec<String> = got
                .iter()
                .zip(done)
                .filter(|(_, done)| *done)
                .filter_map(|(m, _)| m.receipt_handle().map(str::to_owned))
                .collect();
            if !receipts.is_empty() {
                // A failed delete brings the messages back, then duplicates.
                let _ = self.queue.delete_batch(url, &receipts).await;
            }
        }
    }

    /// The handler's time, then one conditional transaction of the record
    /// and the ledger row: whether the message is done (applied, or a
    /// duplicate of an applied event).
    async fn handle(&self, m: &Message) -> bool {
        let Ok(body) = m.json::<Body>() else {
            return false;
        };
        // The fence, read before the handler's work, as the fast path does.
        let fence = clock_fence(self.services.clock.now_ms());
        work(self.took, &self.services.handler_micros).await;
        let Ok(items) = staged(&body, m.id(), self.services.hot_accounts) else {
            return false;
        };
        let commit = FastCommit {
            pk: format!("loop#{}", body.id),
            owner: m.id().to_owned(),
            message_id: m.id().to_owned(),
            payload_sha256: String::new(),
            fence,
            result: None,
            ttl: Duration::from_secs(7 * 24 * 3600),
            writes: items
                .into_iter()
                .map(|item| StagedWrite {
                    item,
                    on_condition_failed: FailureKind::Retry,
                })
                .collect(),
            outbox: Vec::new(),
        };
        match self.store.commit_fast(commit).await {
            Ok(FastCommitted::Committed) => true,
            Ok(FastCommitted::Duplicate { .. }) => {
                self.duplicates.fetch_add(1, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }
}

/// Counts each event's committed ledger rows, sums each account's
/// committed updates, and what the queue holds.
fn ledger(services: &Services, events: usize) -> Ledger {
    let mut applied = vec![0u32; events];
    let mut foreign = 0;
    let accounts = services.hot_accounts.unwrap_or(0);
    let mut balances = vec![0i64; accounts];
    services.store.for_each_committed(|transaction| {
        for item in transaction {
            if let Some((account, amount)) = account_added(item).filter(|(a, _)| *a < accounts) {
                balances[account] += amount;
                continue;
            }
            let event = item
                .put()
                .and_then(|p| p.item().get("pk"))
                .and_then(|v| v.as_s().ok())
                .and_then(|s| s.strip_prefix('e'))
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|i| *i < events);
            match event {
                Some(i) => applied[i] += 1,
                None => foreign += 1,
            }
        }
    });
    let mut expected = vec![0i64; accounts];
    for event in 0..events {
        if accounts > 0 {
            expected[event % accounts] += amount(event);
        }
    }
    Ledger {
        events,
        accounts_wrong: balances
            .iter()
            .zip(&expected)
            .filter(|(b, e)| b != e)
            .count(),
        applied_once: applied.iter().filter(|n| **n == 1).count(),
        missing: applied.iter().filter(|n| **n == 0).count(),
        applied_more: applied.iter().filter(|n| **n > 1).count(),
        foreign,
        left_in_queue: services
            .queue
            .counts(&services.url)
            .map_or(0, |c| c.stored()),
    }
}

/// The account and amount of a committed account update.
fn account_added(item: &TransactWriteItem) -> Option<(usize, i64)> {
    let u = item.update().filter(|u| u.table_name() == "accounts")?;
    let account = u
        .key()
        .get("pk")?
        .as_s()
        .ok()?
        .strip_prefix('a')?
        .parse()
        .ok()?;
    let amount = u
        .expression_attribute_values()?
        .get(":amount")?
        .as_n()
        .ok()?
        .parse()
        .ok()?;
    Some((account, amount))
}
