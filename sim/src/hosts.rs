//! The consumer hosts: pollers (`sqs_once::poller::run`) and Lambda
//! functions (an event source mapping that receives, builds SQS events, calls
//! `LambdaAdapter::handle_until` with the invocation's deadline, and deletes
//! what is not in `batchItemFailures`). Each host runs generation after
//! generation: a crash kills one (its tasks freeze), a SIGTERM drains it, and
//! a new one starts after the host's down time.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqs_once::clock::{Clock, TokioClock};
use sqs_once::lambda::LambdaConfig;
use sqs_once::poller::PollerConfig;
use sqs_once::queue::{QueueClient, ReceiveRequest};
use sqs_once::{LambdaAdapter, MemoryQueue, Message, Processor, ProcessorConfig};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::deliveries::Deliveries;
use crate::faults::{FaultPlan, FaultyQueue, Life, Link};
use crate::stores::{Backend, HostQueue, HostStore, StorePath};
use crate::trace::Trace;
use crate::wire::sqs::SqsModel;
use crate::world::{ConsumerSpec, Gauge, Runtime, Scenario, SimApi, SimHandler};

/// True time at the start of every run (a fixed instant: no wall clock).
pub fn epoch() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

/// What the hosts share: the services, the queues, the run's dice and trace.
pub struct World {
    /// The SQS model.
    pub queue: MemoryQueue,
    /// The source queue.
    pub url: String,
    /// Its DLQ.
    pub dlq_url: String,
    /// The second stage's queue, in a chained run: each event's handler
    /// sends one message there with `Context::send`.
    pub next_url: Option<String>,
    /// Sends made while their event's record was not `COMPLETED` (a
    /// message dispatched for an effect not, or not yet, committed), or
    /// pointing to a large body's object S3 did not hold yet.
    pub early_sends: Arc<std::sync::Mutex<Vec<String>>>,
    /// The dedup records (on true time; each host views them on its own
    /// clock): the memory store or the DynamoDB model, by the seed's path.
    pub store: Backend,
    /// The external API.
    pub api: SimApi,
    /// The run's dice.
    pub dice: crate::faults::Dice,
    /// The trace.
    pub trace: Trace,
    /// The scenario.
    pub scenario: Scenario,
    /// Every delivery the hosts saw, and what became of it.
    pub deliveries: Deliveries,
    /// The messages each event was sent as (accepted sends).
    pub sent: std::sync::Mutex<std::collections::BTreeMap<String, Vec<String>>>,
    /// The dice of the handlers' retry-after hints (a stream of its own).
    pub retry_dice: crate::faults::Dice,
    /// Set once the run's long handler ([`Scenario::long_handler`]) has
    /// started its hours: only the first run of its event takes them.
    pub long_started: Arc<std::sync::atomic::AtomicBool>,
    /// Invocations that timed out and ran on in their reused environment
    /// ([`Scenario::runs_on_after_timeout`]).
    pub ran_on: std::sync::atomic::AtomicU64,
    /// Process pauses of Lambda invocations.
    pub pauses: std::sync::Mutex<Vec<crate::check::Pause>>,
    /// Records DynamoDB's TTL deleted, in order.
    pub swept: std::sync::Mutex<Vec<sqs_once::Record>>,
    /// When each record [`World::swept`] holds was deleted, in its order.
    pub swept_at: std::sync::Mutex<Vec<tokio::time::Instant>>,
    /// The S3 model: the producer's large payloads, and the outbox's large
    /// outgoing bodies.
    pub s3: crate::wire::s3::S3Model,
    /// Objects deleted before any delete of a message pointing to them
    /// reached SQS.
    pub early_objects: Arc<std::sync::Mutex<Vec<String>>>,
}

impl World {
    /// Objects deleted before any delete of a message pointing to them
    /// reached SQS, described.
    pub fn objects_deleted_early(&self) -> Vec<String> {
        self.early_objects
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every event's record as last written: the store's, and those TTL
    /// deleted since (the last deleted, where the store has none now), by
    /// key.
    pub fn records(&self) -> Vec<sqs_once::Record> {
        let mut all: std::collections::BTreeMap<String, sqs_once::Record> = self
            .swept
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|r| (r.pk.clone(), r.clone()))
            .collect();
        for r in self.store.records() {
            all.insert(r.pk.clone(), r);
        }
        all.into_values().collect()
    }
}

/// What the scheduler tells a host.
#[derive(Debug, Clone, Copy)]
pub enum Command {
    /// Die now, come back after this long.
    Crash(Duration),
    /// Drain and stop, come back after this long.
    Sigterm(Duration),
    /// Drain and stop for good (the end of the run).
    Stop,
}

/// What a host reports at the end: per generation, the most handler calls
/// at once and the bound it must stay within.
#[derive(Debug, Default)]
pub struct HostReport {
    /// (peak, bound) per generation.
    pub peaks: Vec<(usize, usize)>,
}

/// One host generation's services and processor.
struct Generation {
    life: Life,
    gauge: Arc<Gauge>,
    queue: FaultyQueue<HostQueue>,
    processor: Processor<HostStore, SimHandler>,
}

fn processor_config(scenario: &Scenario) -> ProcessorConfig {
    let mut config = ProcessorConfig::new("sim");
    config.key_source = scenario.key.source().parse().unwrap_or_default();
    config.lease = scenario.lease;
    config.heartbeat = scenario.heartbeat;
    config.lease_margin = Duration::from_secs(3);
    config.backoff_base = Duration::from_secs(1);
    config.backoff_max = Duration::from_secs(60);
    config.ttl = scenario.ttl;
    config
}

impl Generation {
    fn new(world: &World, spec: &ConsumerSpec, link: &Link, clock: &Arc<dyn Clock>) -> Self {
        let life = Life::default();
        let gauge = Arc::new(Gauge::default());
        let clock = clock.clone();
        let sqs_clock = clock.clone();
        let store = world.store.for_host(link, &life, &clock);
        let handler = SimHandler {
            kind: spec.kind,
            consumer: spec.name.clone(),
            life: life.clone(),
            dice: world.dice.clone(),
            api: world.api.clone(),
            trace: world.trace.clone(),
            gauge: gauge.clone(),
            panic_rate: world.scenario.panic_rate,
            slow_rate: world.scenario.slow_rate,
            lease: world.scenario.lease,
            // Where the kinds mix, a row is a fast-path application.
            claim_stages: world.scenario.claim_stages && !world.scenario.mixed(),
            next_url: world.next_url.clone(),
            calm_cap: matches!(spec.runtime, crate::world::Runtime::Lambda { .. })
                .then_some(world.scenario.deployment.function_timeout / 2),
            retry_after: (world.scenario.retry_after > 0.0)
                .then(|| (world.scenario.retry_after, world.retry_dice.clone())),
            large_results: world.scenario.large_results,
            large_outgoing: Arc::new(world.scenario.large_outgoing.clone()),
            long: matches!(spec.runtime, crate::world::Runtime::Poller { .. })
                .then(|| world.scenario.long_handler.clone())
                .flatten()
                .map(|(event, took)| (event, took, world.long_started.clone())),
        };
        let mut processor = Processor::new(store, handler, processor_config(&world.scenario))
            .unwrap_or_else(|e| panic!("the simulator's processor config is valid: {e}"))
            .with_clock(clock.clone());
        let sends_large = !world.scenario.large_outgoing.is_empty();
        if world.scenario.payloads.is_some() || sends_large {
            // The real S3 client over the wire, its faults drawn on the
            // host's link (on both store paths).
            let wire = crate::wire::Wire::new(
                crate::wire::Service::S3(world.s3.clone()),
                Some(link.clone()),
                life.clone(),
            );
            let s3 = crate::wire::s3_client(wire, clock.clone());
            let mut payloads = sqs_once::payloads::LargePayloads::new(s3);
            payloads = match world.scenario.payloads {
                Some(plan) => payloads.deleting(plan.delete).only_from(vec![
                    sqs_once::payloads::PayloadLocation {
                        bucket: crate::world::PAYLOAD_BUCKET.to_owned(),
                        prefix: "payloads/".to_owned(),
                    },
                ]),
                // Sending only, as the library configures a consumer with
                // an outbox bucket and no payload buckets: no incoming
                // pointer is read.
                None => payloads.reading(false).only_from(Vec::new()),
            };
            if sends_large {
                payloads = payloads.sending_large_to(sqs_once::payloads::PayloadLocation {
                    bucket: crate::world::PAYLOAD_BUCKET.to_owned(),
                    prefix: crate::world::OUTBOX_PREFIX.to_owned(),
                });
            }
            processor = processor.with_large_payloads(payloads);
        }
        // Production bounds one SQS request by the long-poll wait plus 10 s
        // (a poller's 20 s wait), or 10 s (Lambda).
        let attempt = match spec.runtime {
            Runtime::Poller { .. } => Duration::from_secs(30),
            Runtime::Lambda { .. } => Duration::from_secs(10),
        };
        // On the wire path SQS's faults strike on the wire, and the model
        // notes what it applies when it applies it.
        let path = world.store.path();
        let model = SqsModel::new(world.queue.clone()).watched(world.deliveries.clone());
        let sqs = HostQueue::new(path, &model, (link, &life), &sqs_clock, attempt);
        let queue = FaultyQueue::new(sqs, link.clone(), life.clone(), world.deliveries.clone())
            .with_late(world.scenario.might.late)
            .faults_on_wire(path == StorePath::Wire);
        // What the handler sends goes through the host's own (faulty) SQS,
        // each send checked against the record it follows.
        let processor = processor.with_dispatcher(Watched {
            queue: queue.clone(),
            store: world.store.clone(),
            early: world.early_sends.clone(),
            s3: world.s3.clone(),
        });
        Self {
            life,
            gauge,
            queue,
            processor,
        }
    }
}

/// The hosts' dispatcher: the host's SQS, with each message's event looked
/// up in the store (directly, on true time) when it is sent; one whose
/// record is not `COMPLETED` then is noted as sent early, and so is a
/// pointer to a large body whose object S3 does not hold then (a consumer
/// may receive the message at once).
struct Watched {
    queue: FaultyQueue<HostQueue>,
    store: Backend,
    early: Arc<std::sync::Mutex<Vec<String>>>,
    s3: crate::wire::s3::S3Model,
}

impl sqs_once::Dispatcher for Watched {
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<sqs_once::queue::OutgoingMessage>,
    ) -> futures::future::BoxFuture<
        'a,
        Result<Vec<sqs_once::queue::EntryFailure>, sqs_once::QueueError>,
    > {
        for m in &messages {
            let id = match m.attributes.get(sqs_once::outbox::OUTBOX_ID_ATTRIBUTE) {
                Some(a) => match &a.value {
                    sqs_once::AttributeValue::Text(t) => t.clone(),
                    sqs_once::AttributeValue::Binary(_) => String::new(),
                },
                None => String::new(),
            };
            let pk = id.rsplit_once("#out-").map_or(id.as_str(), |(pk, _)| pk);
            let status = self
                .store
                .records()
                .into_iter()
                .find(|r| r.pk == pk)
                .map(|r| r.status);
            if status != Some(sqs_once::Status::Completed) {
                self.early
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("{id} sent while its record was {status:?}"));
            }
            if m.attributes
                .contains_key(sqs_once::payloads::SIZE_ATTRIBUTE)
                && let Ok(p) = sqs_once::payloads::S3Pointer::parse(&m.body)
                && !self.s3.contains(&p.bucket, &p.key)
            {
                self.early
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!(
                        "{id} sent pointing to {}/{}, an object not stored",
                        p.bucket, p.key
                    ));
            }
        }
        Box::pin(QueueClient::send_batch(&self.queue, queue, messages))
    }
}

/// A host's clock that is off by `jump.before_ms` until `jump.at` into the
/// run, and from then on by `skew_ms`: one step, forward or back.
#[derive(Debug)]
struct SteppingClock {
    after: TokioClock,
    step_at: tokio::time::Instant,
    before_by_ms: i64,
}

impl SteppingClock {
    /// `after` reads with `skew_ms`; made at the run's start.
    fn new(after: TokioClock, skew_ms: i64, jump: crate::world::ClockJump) -> Self {
        Self {
            after,
            step_at: tokio::time::Instant::now() + jump.at,
            before_by_ms: jump.before_ms - skew_ms,
        }
    }
}

impl Clock for SteppingClock {
    fn now(&self) -> std::time::SystemTime {
        let now = self.after.now();
        if tokio::time::Instant::now() >= self.step_at {
            return now;
        }
        let by = Duration::from_millis(self.before_by_ms.unsigned_abs());
        if self.before_by_ms >= 0 {
            now + by
        } else {
            now - by
        }
    }
}

/// Runs one host until told to stop.
pub async fn host(
    world: Arc<World>,
    index: usize,
    link: Link,
    mut commands: mpsc::UnboundedReceiver<Command>,
) -> HostReport {
    let spec = world.scenario.consumers[index].clone();
    let mut report = HostReport::default();
    // The host's clock, skewed, for all its generations (hosts start with the run).
    let skew = Duration::from_millis(spec.skew_ms.unsigned_abs());
    let start = if spec.skew_ms >= 0 {
        epoch() + skew
    } else {
        epoch() - skew
    };
    let clock: Arc<dyn Clock> = match spec.jump {
        None => Arc::new(TokioClock::starting_at(start)),
        Some(jump) => Arc::new(SteppingClock::new(
            TokioClock::starting_at(start),
            spec.skew_ms,
            jump,
        )),
    };
    loop {
        let generation = Generation::new(&world, &spec, &link, &clock);
        let gauge = generation.gauge.clone();
        world.trace.event(format!("start {}", spec.name));
        let (next, bound) = match spec.runtime {
            Runtime::Poller { concurrency } => (
                run_poller(&world, &spec, generation, concurrency, &mut commands).await,
                concurrency,
            ),
            Runtime::Lambda { batch } => {
                let peak = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let next =
                    run_lambda(&world, &spec, generation, (batch, &peak), &mut commands).await;
                // Invocations that timed out and ran on in the reused
                // environment ran their records beside the next ones: a
                // batch more for each running on at once, at the most.
                let extra = peak.load(std::sync::atomic::Ordering::Relaxed);
                (next, batch.saturating_mul(1 + extra))
            }
        };
        report.peaks.push((gauge.peak(), bound));
        match next {
            None => return report,
            Some(down) => tokio::time::sleep(down).await,
        }
    }
}

/// One poller generation: `Some(down time)` after a crash or a SIGTERM,
/// `None` after the final stop.
async fn run_poller(
    world: &World,
    spec: &ConsumerSpec,
    generation: Generation,
    concurrency: usize,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> Option<Duration> {
    let mut config = PollerConfig::new(&world.url);
    config.dlq_url = Some(world.dlq_url.clone());
    config.concurrency = concurrency;
    config.prefetch = world.scenario.deployment.prefetch;
    config.drain = world.scenario.deployment.drain;
    let shutdown = CancellationToken::new();
    let run = sqs_once::poller::run(
        generation.queue,
        generation.processor,
        config,
        shutdown.clone(),
    );
    let task = tokio::spawn(run);
    let command = commands.recv().await.unwrap_or(Command::Stop);
    world.trace.event(format!("{command:?} {}", spec.name));
    // A crash or a SIGTERM is trouble on the host until it is back: what
    // it held or still receives meanwhile comes back unprocessed.
    let from = world.trace.now_ms();
    match command {
        Command::Crash(down) => {
            generation.life.kill();
            task.abort();
            world.trace.host_trouble_since(&spec.name, from, down);
            Some(down)
        }
        Command::Sigterm(down) => {
            shutdown.cancel();
            let _ = task.await;
            world.trace.event(format!("drained {}", spec.name));
            world.trace.host_trouble_since(&spec.name, from, down);
            Some(down)
        }
        Command::Stop => {
            shutdown.cancel();
            let _ = task.await;
            // The process exits once `run` returns: a lane still running
            // (a commit held by a pause past the drain and its cleanup)
            // makes no call after it, as after a crash. Left alive, it sent
            // an outbox message again after the second stage had finished
            // (seed 192822).
            generation.life.kill();
            None
        }
    }
}

/// One Lambda generation (the function's execution environment).
async fn run_lambda(
    world: &World,
    spec: &ConsumerSpec,
    generation: Generation,
    (batch, running_on_peak): (usize, &std::sync::atomic::AtomicUsize),
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> Option<Duration> {
    let config = {
        let mut c = LambdaConfig::default();
        c.dlq_url = Some(world.dlq_url.clone());
        c.queue_url = Some(world.url.clone());
        c
    };
    let adapter = LambdaAdapter::new(generation.queue.clone(), generation.processor, config);
    // The event source mapping is the Lambda service: no crash, no partition.
    let esm_link = Link::new(
        &format!("{}-esm", spec.name),
        world.dice.clone(),
        FaultPlan::NONE,
        world.trace.clone(),
        Arc::default(),
        Arc::default(),
    );
    // It stops with the function's generation: a crash ends the invocation
    // in hand, whose records are then not deleted.
    let esm = FaultyQueue::new(
        world.queue.clone(),
        esm_link,
        generation.life.clone(),
        world.deliveries.clone(),
    );
    let stop = CancellationToken::new();
    let work = invocations(
        world,
        spec,
        (adapter, esm),
        (batch, running_on_peak),
        stop.clone(),
    );
    tokio::pin!(work);
    let command = tokio::select! {
        biased;
        c = commands.recv() => c.unwrap_or(Command::Stop),
        () = &mut work => Command::Stop,
    };
    world.trace.event(format!("{command:?} {}", spec.name));
    let from = world.trace.now_ms();
    match command {
        Command::Crash(down) => {
            generation.life.kill();
            world.trace.host_trouble_since(&spec.name, from, down);
            Some(down)
        }
        Command::Sigterm(down) => {
            stop.cancel();
            work.await;
            world.trace.host_trouble_since(&spec.name, from, down);
            Some(down)
        }
        Command::Stop => {
            stop.cancel();
            work.await;
            None
        }
    }
}

/// The event source mapping's loop: receive, invoke, delete the successes.
async fn invocations(
    world: &World,
    spec: &ConsumerSpec,
    (adapter, esm): (
        LambdaAdapter<HostStore, SimHandler, FaultyQueue<HostQueue>>,
        FaultyQueue<MemoryQueue>,
    ),
    (batch, running_on_peak): (usize, &std::sync::atomic::AtomicUsize),
    stop: CancellationToken,
) {
    let request = ReceiveRequest {
        max: batch,
        wait: Duration::from_secs(20),
        visibility: world.scenario.deployment.visibility,
    };
    // Invocations that timed out and run on in the reused environment
    // ([`Scenario::runs_on_after_timeout`]), polled beside the next ones
    // until the environment ends.
    let (ran_on, mut running_on) = mpsc::unbounded_channel::<RunningOn<'_>>();
    let invoking = async {
        while !stop.is_cancelled() {
            let received = tokio::select! {
                biased;
                () = stop.cancelled() => return,
                r = esm.receive(&world.url, request) => r,
            };
            let messages = match received {
                Ok(m) if m.is_empty() => continue,
                Ok(m) => m,
                Err(_) => {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            if let Some(on) = invoke(world, spec, &adapter, &esm, messages).await {
                let _ = ran_on.send(on);
            }
        }
    };
    let runs_on = async {
        let mut running = futures::stream::FuturesUnordered::new();
        loop {
            // Biased, as every select of a run: a random branch order
            // would make a seed's schedule differ from one run to the next.
            tokio::select! {
                biased;
                Some(on) = running_on.recv() => {
                    running.push(on);
                    running_on_peak.fetch_max(running.len(), std::sync::atomic::Ordering::Relaxed);
                }
                Some(()) = futures::StreamExt::next(&mut running), if !running.is_empty() => {}
            }
        }
    };
    tokio::select! {
        biased;
        () = invoking => {}
        () = runs_on => {}
    }
}

/// Where timed-out invocations run on, one invocation in ten is paused (its
/// tasks not polled while time runs, as a process starved or stopped) for
/// 1 s to a minute, from a point drawn within its time: a pause across its
/// deadline times it out. The window, and what notes the pause in
/// [`World::pauses`] when it begins (an invocation that ended first was
/// never paused).
fn draw_pause<'a>(
    world: &'a World,
    spec: &'a ConsumerSpec,
    messages: &[Message],
) -> Option<((Instant, Instant), OnPause<'a>)> {
    if !(world.scenario.runs_on_after_timeout && world.dice.chance(0.1)) {
        return None;
    }
    let within = world.scenario.deployment.function_timeout;
    let from = Instant::now() + world.dice.millis(Duration::ZERO, within);
    let until = from
        + world
            .dice
            .millis(Duration::from_secs(1), Duration::from_secs(60));
    let messages: std::collections::BTreeSet<String> =
        messages.iter().map(|m| m.id().to_owned()).collect();
    let noted = move |began: Instant| {
        let from_ms = world.trace.now_ms();
        let length = until.saturating_duration_since(began);
        world
            .trace
            .event(format!("invocation {} paused for {length:?}", spec.name));
        world
            .pauses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(crate::check::Pause {
                host: spec.name.clone(),
                messages,
                from_ms,
                until_ms: from_ms + length.as_millis(),
            });
    };
    Some(((from, until), Box::new(noted)))
}

/// What notes a pause when it begins.
type OnPause<'a> = Box<dyn FnOnce(Instant) + Send + 'a>;

/// An invocation that timed out, running on in its reused environment.
type RunningOn<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// A future that is not polled from `from` until `until` (a process
/// pause): woken in that window, it waits for the window's end; its timers
/// that came due meanwhile fire late, all at once, when it is polled again.
struct Paused<'a, F> {
    inner: std::pin::Pin<Box<F>>,
    window: Option<(Instant, Instant)>,
    wake: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Called when the pause begins.
    on_pause: Option<OnPause<'a>>,
    /// When it began, if it did.
    began: Option<Instant>,
}

impl<'a, F> Paused<'a, F> {
    fn new(inner: F, pause: Option<((Instant, Instant), OnPause<'a>)>) -> Self {
        let (window, on_pause) = pause.unzip();
        Self {
            inner: Box::pin(inner),
            window,
            wake: Box::pin(tokio::time::sleep(Duration::ZERO)),
            on_pause,
            began: None,
        }
    }

    /// Whether the pause began before `t`.
    fn paused_before(&self, t: Instant) -> bool {
        self.began.is_some_and(|b| b < t)
    }
}

impl<F: std::future::Future> std::future::Future for Paused<'_, F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        if let Some((from, until)) = self.window {
            let now = Instant::now();
            if now >= until {
                self.window = None;
            } else if now >= from {
                if let Some(noted) = self.on_pause.take() {
                    self.began = Some(now);
                    noted(now);
                }
                self.wake.as_mut().reset(until);
                let _ = self.wake.as_mut().poll(cx);
                return std::task::Poll::Pending;
            }
        }
        self.inner.as_mut().poll(cx)
    }
}

/// One invocation, killed at its deadline as Lambda does (or, where the
/// run says so, left to run on in its reused environment: returned, to be
/// polled beside the next invocations); then the event source mapping
/// deletes the records not listed as failures.
async fn invoke<'a>(
    world: &'a World,
    spec: &'a ConsumerSpec,
    adapter: &'a LambdaAdapter<HostStore, SimHandler, FaultyQueue<HostQueue>>,
    esm: &FaultyQueue<MemoryQueue>,
    messages: Vec<Message>,
) -> Option<RunningOn<'a>> {
    let deadline = Instant::now() + world.scenario.deployment.function_timeout;
    let event = lambda_event(&messages, sqs_once::trace::queue_name(&world.url));
    let handling = adapter.handle_until(event, deadline);
    let pause = draw_pause(world, spec, &messages);
    let mut handling = Box::pin(Paused::new(handling, pause));
    let answer = tokio::time::timeout_at(deadline, &mut handling).await;
    let failed: Vec<String> = match answer {
        Ok(Ok(response)) => response
            .batch_item_failures
            .into_iter()
            .map(|f| f.item_identifier)
            .collect(),
        Ok(Err(e)) => {
            world
                .trace
                .event(format!("invocation {} failed: {e}", spec.name));
            return None;
        }
        Err(_) => {
            // Paused across its deadline, it could not answer: the event
            // source mapping gives its records up (for the checker, as if
            // their holder died). A timeout without a pause is the
            // runtime's, and excuses nothing.
            if handling.paused_before(deadline) {
                let receipts: Vec<String> = messages
                    .iter()
                    .filter_map(|m| m.receipt_handle().map(str::to_owned))
                    .collect();
                world.deliveries.given_up(&world.url, &receipts);
            }
            return ran_on(world, spec, handling);
        }
    };
    let done: Vec<String> = messages
        .iter()
        .filter(|m| !failed.iter().any(|f| f == m.id()))
        .filter_map(|m| m.receipt_handle().map(str::to_owned))
        .collect();
    world.trace.event(format!(
        "invocation {}: {} records, {} failed",
        spec.name,
        messages.len(),
        failed.len()
    ));
    esm_delete(world, esm, &done).await;
    None
}

/// A timed-out invocation: killed as Lambda does, or, where the run says
/// so, left to run on in its reused environment (returned, to be polled
/// beside the next invocations).
fn ran_on<'a, F>(world: &'a World, spec: &'a ConsumerSpec, handling: F) -> Option<RunningOn<'a>>
where
    F: std::future::Future + Send + 'a,
{
    if !world.scenario.runs_on_after_timeout {
        world
            .trace
            .event(format!("invocation {} timed out", spec.name));
        return None;
    }
    world.trace.event(format!(
        "invocation {} timed out; it runs on in its reused environment",
        spec.name
    ));
    world
        .ran_on
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(Box::pin(async move {
        handling.await;
        world
            .trace
            .event(format!("invocation {} that timed out ended", spec.name));
    }))
}

/// The event source mapping's delete of an invocation's finished records.
async fn esm_delete(world: &World, esm: &FaultyQueue<MemoryQueue>, done: &[String]) {
    for chunk in done.chunks(10) {
        match esm.delete_batch(&world.url, chunk).await {
            // Entries that failed alone (SQS "might") are tried once more, one
            // by one, as a careful client does.
            Ok(failed) => {
                for f in failed {
                    if let Some(receipt) = chunk.get(f.index)
                        && let Err(e) = esm.delete(&world.url, receipt).await
                    {
                        world.trace.event(format!("esm delete failed: {e}"));
                    }
                }
            }
            Err(e) => world.trace.event(format!("esm delete failed: {e}")),
        }
    }
}

/// A message's attributes as a Lambda SQS event carries them.
fn message_attributes(m: &Message) -> serde_json::Value {
    let attributes: serde_json::Map<String, serde_json::Value> = m
        .attributes()
        .iter()
        .filter_map(|(name, a)| match &a.value {
            sqs_once::AttributeValue::Text(t) => Some((
                name.clone(),
                serde_json::json!({ "dataType": a.data_type, "stringValue": t }),
            )),
            // The simulator sends none.
            sqs_once::AttributeValue::Binary(_) => None,
        })
        .collect();
    attributes.into()
}

/// An SQS event as Lambda builds it.
fn lambda_event(messages: &[Message], queue: &str) -> serde_json::Value {
    let records: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            let mut attributes = serde_json::json!({
                "ApproximateReceiveCount": m.receive_count().to_string(),
                "SentTimestamp": "0",
                "SenderId": "sim",
                "ApproximateFirstReceiveTimestamp": "0",
            });
            if let Some(g) = m.group_id() {
                attributes["MessageGroupId"] = g.into();
            }
            if let Some(d) = m.deduplication_id() {
                attributes["MessageDeduplicationId"] = d.into();
            }
            serde_json::json!({
                "messageId": m.id(),
                "receiptHandle": m.receipt_handle(),
                "body": m.body(),
                "attributes": attributes,
                "messageAttributes": message_attributes(m),
                "md5OfBody": "",
                "eventSource": "aws:sqs",
                "eventSourceARN": format!("arn:aws:sqs:us-east-1:000000000000:{queue}"),
                "awsRegion": "us-east-1",
            })
        })
        .collect();
    serde_json::json!({ "Records": records })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock reads `before_ms` off true time until the step, then
    /// `skew_ms`: here 2 s ahead, then 1 s behind (a step back of 3 s).
    #[tokio::test(start_paused = true)]
    async fn a_stepping_clock_reads_its_first_offset_until_the_step_then_its_second() {
        let skew_ms = -1000;
        let jump = crate::world::ClockJump {
            at: Duration::from_secs(10),
            before_ms: 2000,
        };
        let clock = SteppingClock::new(
            TokioClock::starting_at(epoch() - Duration::from_secs(1)),
            skew_ms,
            jump,
        );
        let start = Instant::now();
        let off = |c: &SteppingClock| {
            let truth = epoch() + start.elapsed();
            let read = c.now();
            match read.duration_since(truth) {
                Ok(ahead) => i64::try_from(ahead.as_millis()).unwrap_or(i64::MAX),
                Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
            }
        };
        assert_eq!(off(&clock), 2000, "before the step");
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert_eq!(off(&clock), 2000, "just before the step");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(off(&clock), -1000, "at the step");
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(off(&clock), -1000, "after it");
    }
}
