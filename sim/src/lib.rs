//! Deterministic simulation of sqs-once: the real runtimes (poller
//! and Lambda adapter) and processor run against simulated SQS
//! ([`sqs_once::MemoryQueue`]), DynamoDB ([`sqs_once::MemoryStore`]) and an
//! external API, on one thread in tokio's paused virtual time, with every
//! random choice (scenario, faults, handler durations, panics) drawn from one
//! seed. A run is a function of its seed: a failing seed replays exactly.
//!
//! One run ([`run_seed`]): draw a [`world::Scenario`]; start the consumer
//! hosts ([`hosts`]) and the producers; crash, drain and partition hosts as
//! scheduled, with call faults from [`faults`]; after ten minutes switch the
//! faults off and let everything settle; stop the hosts; then [`check`] the
//! history and the final state.
//!
//! Store paths ([`stores`]): most seeds use `MemoryStore` behind
//! [`faults::FaultyStore`]; one in [`stores::WIRE_SHARE`] (drawn from the
//! seed) runs the production `DynamoStore` and the real `aws-sdk-dynamodb`
//! client over an in-process HTTP connector to a model of DynamoDB
//! ([`wire`]), with the faults on the wire, so the SDK's retries and
//! timeouts and the store's error classification run under faults too; its
//! hosts' SQS calls go through the production SQS adapter and SDK over the
//! wire to the SQS model ([`stores::HostQueue`]), faults still drawn above
//! the adapter.

#![warn(missing_docs)]
#![forbid(unsafe_code)]
// The hosts' async bodies nest the runtimes' futures deeply.
#![recursion_limit = "256"]

pub mod check;
pub mod deliveries;
pub mod faults;
pub mod hosts;
pub mod latency;
pub mod might;
pub mod scale;
pub mod stores;
pub mod trace;
pub mod wire;
pub mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqs_once::MemoryQueue;
use sqs_once::clock::TokioClock;
use sqs_once::queue::OutgoingMessage;
use sqs_once::testkit::queue::{QueueSettings, RedrivePolicy, SendOptions};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing_subscriber::Layer;

use crate::deliveries::Deliveries;
use crate::faults::{Dice, FaultCounts, Link};
use crate::hosts::{Command, HostReport, World};
use crate::trace::Trace;
use crate::wire::s3::S3Model;
use crate::world::{Action, MAX_MESSAGE_BYTES, Scenario, SimApi};

/// When faults stop and the run settles.
pub(crate) const CALM_AT: Duration = Duration::from_secs(15 * 60);
/// A run that has not settled by then has lost or stuck messages.
const SETTLE_BY: Duration = Duration::from_secs(4 * 3600);

/// What one run found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The hash of the trace (equal for equal seeds).
    pub trace_hash: String,
    /// Lines in the trace.
    pub trace_events: u64,
    /// The trace's lines, when asked for.
    pub trace: Vec<String>,
    /// Every violation of the promise.
    pub violations: Vec<String>,
    /// Faults injected: call faults (errors, lost answers, timeouts, delays,
    /// late landings, calls cut off) and scheduled crashes, drains, partitions.
    pub faults: u64,
    /// Events in the scenario.
    pub events: usize,
    /// Events SQS's redrive policy moved to the DLQ before their effect was
    /// recorded (receives ran out under faults; see [`check::exhausted`]).
    pub exhausted: usize,
    /// Messages SQS's redrive policy moved to the DLQ after their effect
    /// was recorded, because their last delivery's delete could not land
    /// or SQS brought the message back after it (see [`check::stranded`],
    /// and [`check::stranded_after_redrive`] for those after the redrive).
    pub stranded: usize,
    /// Virtual time the run took.
    pub virtual_time: Duration,
    /// Faults by class: call faults, and the scheduled actions by kind.
    pub fault_classes: Vec<(&'static str, u64)>,
    /// Messages the redrive at the calm point brought back from the DLQ.
    pub redriven: u64,
    /// The store the run used: the memory store, or `DynamoStore` over the wire.
    pub path: stores::StorePath,
    /// Events applied again after TTL ended their record (the documented
    /// limit; see [`check::after_ttl`]).
    pub after_ttl: usize,
    /// Overlapping API calls of one key in a run with a skew beyond the
    /// margin (see [`check::overlapping`]).
    pub overlapping: usize,
    /// API calls a process pause stopped (see [`check::paused_calls`]).
    pub paused_calls: usize,
    /// Events applied by a claim-path attempt that lost its claim and then
    /// by a fast-path commit, where the kinds mix (the documented limit;
    /// see [`check::claim_then_fast`]).
    pub claim_then_fast: usize,
    /// FIFO pairs applied out of send order because SQS moved the earlier
    /// message to the DLQ before the later one was delivered (the documented
    /// limit; see [`check::fifo_after_dlq`]).
    pub fifo_after_dlq: usize,
    /// Events whose copy was parked because its large payload was deleted
    /// after an earlier copy finished (the documented limit; see
    /// [`check::payload_gone`]).
    pub payload_gone: usize,
}

/// Runs one seed on a fresh single-threaded runtime with paused time, on
/// the store path drawn for it ([`stores::StorePath::of`]).
pub fn run_seed(seed: u64, keep_trace: bool) -> std::io::Result<Report> {
    run_seed_on(seed, keep_trace, stores::StorePath::of(seed))
}

/// Runs one seed on the given store path (a regression seed keeps the path
/// its schedule was found on).
///
/// The run has a thread of its own with a large stack: the hosts' futures
/// nest the runtimes' deeply, more than a test thread's 2 MiB hold in a
/// debug build. One thread still runs everything, so the run stays a
/// function of its seed.
pub fn run_seed_on(
    seed: u64,
    keep_trace: bool,
    path: stores::StorePath,
) -> std::io::Result<Report> {
    run_seed_drawing(seed, keep_trace, path, Draws::from_env())
}

/// Whether runs draw the source queue's `maxReceiveCount`
/// ([`Scenario::draw_knobs`]): every run does, unless
/// `SIM_FIXED_MAX_RECEIVE=1` keeps it at 10 (to replay a seed found before
/// the draw, seeds below 193,255 in the long search: see the guide,
/// docs/guide/simulator.md).
pub fn draws_max_receive() -> bool {
    std::env::var_os("SIM_FIXED_MAX_RECEIVE").is_none()
}

/// What a run draws besides its schedule that a seed found before the draw
/// existed may need to leave out to keep its schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Draws {
    /// The source queue's `maxReceiveCount` ([`Scenario::draw_knobs`]; on
    /// unless the environment says otherwise, see [`draws_max_receive`]).
    pub max_receive: bool,
    /// Large payloads through S3 ([`Scenario::draw_payloads`]; on in every
    /// run, off only for regression seeds found before it).
    pub payloads: bool,
    /// Large outgoing bodies through S3 in chained runs
    /// ([`Scenario::draw_large_outgoing`]; on in every run, off only for
    /// regression seeds found before it).
    pub outbox_payloads: bool,
    /// Trouble that lasts: a long partition from SQS alone, a handler that
    /// runs for hours ([`Scenario::draw_long_trouble`]), and clocks that
    /// step ([`Scenario::draw_clock_jumps`]); on in every run,
    /// off for the regression seeds found before it, which
    /// [`run_seed_with`] runs).
    pub long_trouble: bool,
}

impl Draws {
    /// What runs draw by default: large payloads, and `maxReceiveCount`
    /// where the environment asks for it.
    pub fn from_env() -> Self {
        Self {
            max_receive: draws_max_receive(),
            payloads: true,
            outbox_payloads: true,
            long_trouble: true,
        }
    }
}

/// Runs one seed on the given store path, drawing `maxReceiveCount` or not
/// whatever the environment says (a regression seed found with the draw
/// keeps it), without the trouble that lasts (every regression seed that
/// runs this way was found before it). See [`run_seed_on`].
pub fn run_seed_with(
    seed: u64,
    keep_trace: bool,
    path: stores::StorePath,
    draw_max_receive: bool,
) -> std::io::Result<Report> {
    let draws = Draws {
        max_receive: draw_max_receive,
        long_trouble: false,
        ..Draws::from_env()
    };
    run_seed_drawing(seed, keep_trace, path, draws)
}

/// Runs one seed on the given store path with the given draws. See
/// [`run_seed_on`].
pub fn run_seed_drawing(
    seed: u64,
    keep_trace: bool,
    path: stores::StorePath,
    draws: Draws,
) -> std::io::Result<Report> {
    std::thread::Builder::new()
        .name(format!("seed-{seed}"))
        .stack_size(RUN_STACK_BYTES)
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()?;
            Ok(runtime.block_on(simulate_with(seed, keep_trace, path, draws)))
        })?
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// The stack of a run's thread.
const RUN_STACK_BYTES: usize = 64 * 1024 * 1024;

/// The run's subscriber: outcomes into the trace, and the library's logs on
/// stdout when `RUST_LOG` is set. Scoped to this thread (the run's).
fn subscriber(trace: &Trace) -> tracing::subscriber::DefaultGuard {
    use tracing_subscriber::layer::SubscriberExt;
    let logs = std::env::var_os("RUST_LOG").is_some().then(|| {
        tracing_subscriber::fmt::layer()
            .with_timer(VirtualTime(trace.start()))
            .with_filter(tracing_subscriber::EnvFilter::from_default_env())
    });
    let registry = tracing_subscriber::registry()
        .with(trace::OutcomeLayer(trace.clone()))
        .with(logs);
    tracing::subscriber::set_default(registry)
}

/// Log lines stamped with the run's virtual time, as the trace's lines are.
struct VirtualTime(tokio::time::Instant);

impl tracing_subscriber::fmt::time::FormatTime for VirtualTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        write!(w, "{:>10.3}s", self.0.elapsed().as_secs_f64())
    }
}

/// Mixed into the seed for the dice of the knobs drawn apart
/// ([`Scenario::draw_knobs`]).
const KNOBS: u64 = 0x6b6e_6f62_735f_7631;
/// Mixed into the seed for the dice of the deployment
/// ([`world::Deployment::draw`]).
const DEPLOYMENT: u64 = 0x6465_706c_6f79_5f31;
/// Mixed into the seed for the dice of the records' TTL
/// ([`Scenario::draw_ttl`]).
const TTL_KNOB: u64 = 0x7474_6c5f_6b6e_6f62;
/// Mixed into the seed for the dice of a skew beyond the margin
/// ([`Scenario::draw_skew_beyond_margin`]).
const SKEW_KNOB: u64 = 0x736b_6577_5f6b_6e6f;
/// Mixed into the seed for the dice of the handler kinds per consumer
/// ([`Scenario::draw_mixed`]).
const MIXED_KNOB: u64 = 0x6d69_7865_645f_6b6e;
/// Mixed into the seed for the dice of the retry-after knob
/// ([`Scenario::draw_retry_after`]).
const RETRY_AFTER_KNOB: u64 = 0x7265_7472_795f_6b6e;
/// Mixed into the seed for the dice of the key source and attributes
/// ([`Scenario::draw_keys`]).
const KEYS_KNOB: u64 = 0x6b65_7973_5f6b_6e6f;
/// Mixed into the seed for the dice of large results
/// ([`Scenario::draw_large_results`]).
const LARGE_RESULTS_KNOB: u64 = 0x6c61_7267_655f_6b6e;
/// Mixed into the seed for the dice of large payloads
/// ([`Scenario::draw_payloads`]).
const PAYLOADS_KNOB: u64 = 0x7061_796c_6f61_6473;
/// Mixed into the seed for the dice of large outgoing bodies
/// ([`Scenario::draw_large_outgoing`]).
const OUTBOX_PAYLOADS_KNOB: u64 = 0x6f75_7462_6f78_5f73;
/// Mixed into the seed for the dice of trouble that lasts
/// ([`Scenario::draw_long_trouble`]).
const LONG_TROUBLE_KNOB: u64 = 0x6c6f_6e67_5f74_726f;
/// Mixed into the seed for the dice of conflict storms
/// ([`Scenario::draw_conflict_storms`]).
const CONFLICT_KNOB: u64 = 0x636f_6e66_6c69_6374;
/// Mixed into the seed for the dice of clock steps
/// ([`Scenario::draw_clock_jumps`]).
const CLOCK_JUMP_KNOB: u64 = 0x6a75_6d70_5f6b_6e6f;
/// Mixed into the seed for the dice of the handlers' retry-after hints.
const RETRY_AFTER_HINTS: u64 = 0x7265_7472_795f_6869;
/// Mixed into the seed for the dice of TTL deletions' delays ([`sweep`]).
const TTL_SWEEP: u64 = 0x7474_6c5f_7377_6565;
/// Mixed into the seed for the dice of SQS's faults on the wire path
/// ([`faults::Link::with_sqs_wire`]).
const SQS_WIRE: u64 = 0x7371_735f_7769_7265;

fn create_queues(queue: &MemoryQueue, scenario: &Scenario) -> (String, String) {
    let (fifo, might) = (scenario.fifo, scenario.might);
    let suffix = if fifo { ".fifo" } else { "" };
    let mut dlq = QueueSettings::new(format!("sim-dlq{suffix}"));
    dlq.max_message_bytes = MAX_MESSAGE_BYTES;
    dlq.retention = Duration::from_secs(14 * 24 * 3600);
    let dlq_url = queue
        .create_queue(dlq)
        .unwrap_or_else(|e| panic!("the simulator's DLQ settings are valid: {e}"));
    let mut source = QueueSettings::new(format!("sim{suffix}"));
    source.max_message_bytes = MAX_MESSAGE_BYTES;
    source.visibility_timeout = scenario.deployment.visibility;
    source.redrive = Some(RedrivePolicy {
        dlq_url: dlq_url.clone(),
        max_receive_count: scenario.max_receive_count,
    });
    source.might = might.model();
    let url = queue
        .create_queue(source)
        .unwrap_or_else(|e| panic!("the simulator's queue settings are valid: {e}"));
    (url, dlq_url)
}

/// Whether the run of `seed` chains a second stage (even seeds;
/// `SIM_CHAIN=0|1` forces it).
pub fn chained(seed: u64) -> bool {
    match std::env::var("SIM_CHAIN").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => seed.is_multiple_of(2),
    }
}

/// The run's scenario: its first draws from `dice`, then each knob from a
/// dice of its own (so that a seed keeps the rest of its schedule).
fn scenario(seed: u64, dice: &Dice, draws: Draws) -> Scenario {
    let mut scenario = Scenario::draw(dice);
    if draws.max_receive {
        scenario.draw_knobs(&Dice::new(seed ^ KNOBS));
    }
    scenario.deployment =
        world::Deployment::draw(&Dice::new(seed ^ DEPLOYMENT), scenario.heartbeat);
    scenario.draw_ttl(&Dice::new(seed ^ TTL_KNOB));
    scenario.draw_skew_beyond_margin(&Dice::new(seed ^ SKEW_KNOB));
    scenario.draw_mixed(&Dice::new(seed ^ MIXED_KNOB));
    scenario.draw_retry_after(&Dice::new(seed ^ RETRY_AFTER_KNOB));
    scenario.draw_keys(&Dice::new(seed ^ KEYS_KNOB));
    scenario.draw_large_results(&Dice::new(seed ^ LARGE_RESULTS_KNOB));
    if draws.long_trouble {
        scenario.draw_long_trouble(&Dice::new(seed ^ LONG_TROUBLE_KNOB));
        scenario.draw_clock_jumps(&Dice::new(seed ^ CLOCK_JUMP_KNOB));
        scenario.draw_conflict_storms(&Dice::new(seed ^ CONFLICT_KNOB));
    }
    if draws.payloads {
        scenario.draw_payloads(&Dice::new(seed ^ PAYLOADS_KNOB));
    }
    if draws.outbox_payloads && chained(seed) {
        scenario.draw_large_outgoing(&Dice::new(seed ^ OUTBOX_PAYLOADS_KNOB));
    }
    scenario
}

/// The run's world: its scenario (drawn), queues and store (on `path`).
fn world(
    seed: u64,
    dice: &Dice,
    trace: &Trace,
    path: stores::StorePath,
    draws: Draws,
) -> Arc<World> {
    let scenario = scenario(seed, dice, draws);
    trace.event(scenario.summary());
    let queue = MemoryQueue::new();
    let (url, dlq_url) = create_queues(&queue, &scenario);
    // Every other run chains a second stage: each event's handler sends
    // one message to it through the outbox ([`World::next_url`]).
    let next_url = chained(seed).then(|| {
        let mut next = QueueSettings::new("sim-next");
        next.max_message_bytes = MAX_MESSAGE_BYTES;
        // SQS's "might" here too: batch entries that fail alone, twin
        // deliveries to the second stage.
        next.might = scenario.might.model();
        queue
            .create_queue(next)
            .unwrap_or_else(|e| panic!("the simulator's next queue settings are valid: {e}"))
    });
    let store = stores::Backend::new(path);
    // Every record write must carry the TTL the consumers are configured
    // with ([`hosts`]' `processor_config`): what the TTL excuses rests on it.
    store.expect_ttl(scenario.ttl);
    trace.event(format!("store path: {path:?}"));
    let deliveries = Deliveries::default();
    let s3 = S3Model::with_bucket(world::PAYLOAD_BUCKET);
    let early_objects: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        // Deletion follows the delete of a finished message (completed or a
        // duplicate), never precedes it and never follows a park or a copy
        // sent again: an object deleted otherwise leaves a message (or its
        // parked copy) pointing to nothing.
        let (deliveries, early, trace) = (deliveries.clone(), early_objects.clone(), trace.clone());
        s3.on_delete(Arc::new(move |bucket, key| {
            trace.event(format!("object {bucket}/{key} deleted"));
            let done = |message: &str, count: u32| {
                matches!(
                    trace.outcome_of(message, count).as_deref(),
                    Some("completed" | "duplicate")
                )
            };
            if !deliveries.payload_released(key, done) {
                early.lock().unwrap_or_else(|e| e.into_inner()).push(format!(
                    "object {bucket}/{key} deleted before a delete of a finished message pointing to it reached SQS"
                ));
            }
        }));
    }
    Arc::new(World {
        s3,
        early_objects,
        api: SimApi::new(
            trace.clone(),
            completed_in(store.clone(), clock_grace(&scenario), &scenario),
        ),
        store,
        queue,
        url,
        dlq_url,
        next_url,
        early_sends: Arc::default(),
        dice: dice.clone(),
        trace: trace.clone(),
        scenario,
        deliveries,
        sent: Mutex::default(),
        retry_dice: Dice::new(seed ^ RETRY_AFTER_HINTS),
        long_started: Arc::default(),
        ran_on: std::sync::atomic::AtomicU64::default(),
        pauses: Mutex::default(),
        swept: Mutex::default(),
        swept_at: Mutex::default(),
    })
}

/// The most a host's clock runs ahead of true time, plus a second (records
/// keep `expires_at` in whole seconds): how early a host may take a record
/// for expired.
fn clock_grace(scenario: &Scenario) -> Duration {
    let ahead = scenario
        .consumers
        .iter()
        .map(world::ConsumerSpec::most_ahead_ms)
        .max()
        .unwrap_or(0);
    Duration::from_millis(ahead + 1000)
}

/// DynamoDB's TTL deletion, in a run whose records expire
/// ([`Scenario::draw_ttl`]): every 30 s, deletes each record whose delay
/// past its `expires_at` has come. Each expiry's delay is drawn once from a
/// dice of its own: minutes to days (DynamoDB deletes expired items
/// typically within a few days), half of them within half an hour.
async fn sweep(world: Arc<World>, seed: u64) {
    let dice = Dice::new(seed ^ TTL_SWEEP);
    let mut delays: std::collections::BTreeMap<(String, i64), i64> = Default::default();
    let epoch_ms = sqs_once::clock::Clock::now_ms(&TokioClock::starting_at(hosts::epoch()));
    let start = world.trace.start();
    loop {
        tokio::time::sleep(Duration::from_secs(30)).await;
        let now_ms = epoch_ms + i64::try_from(start.elapsed().as_millis()).unwrap_or(0);
        let deleted = world.store.sweep_expired(now_ms, |pk, expires_s| {
            let delay = *delays.entry((pk.to_owned(), expires_s)).or_insert_with(|| {
                let (lo, hi) = match dice.int(0, 9) {
                    0..=4 => (60, 1800),
                    5..=7 => (1800, 6 * 3600),
                    _ => (6 * 3600, 3 * 24 * 3600),
                };
                i64::try_from(dice.int(lo, hi)).unwrap_or(0) * 1000
            });
            expires_s.saturating_mul(1000) + delay <= now_ms
        });
        for r in deleted {
            world
                .trace
                .event(format!("TTL deleted {} ({:?})", r.pk, r.status));
            world
                .swept
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(r);
            world
                .swept_at
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(tokio::time::Instant::now());
        }
    }
}

/// One run, inside the paused runtime.
pub async fn simulate(seed: u64, keep_trace: bool, path: stores::StorePath) -> Report {
    simulate_with(seed, keep_trace, path, Draws::from_env()).await
}

/// One run, inside the paused runtime, with the given draws.
pub async fn simulate_with(
    seed: u64,
    keep_trace: bool,
    path: stores::StorePath,
    draws: Draws,
) -> Report {
    let started = Instant::now();
    let dice = Dice::new(seed);
    let trace = Trace::new(keep_trace);
    let _logs = subscriber(&trace);
    let world = world(seed, &dice, &trace, path, draws);
    let calm = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(FaultCounts::default());
    let links = links(&world, &calm, &counts, &Dice::new(seed ^ SQS_WIRE));
    let (senders, tasks) = start_hosts(&world, &links);
    let accepted = Arc::new(Mutex::new(BTreeSet::new()));
    let producer = tokio::spawn(produce(world.clone(), accepted.clone()));
    // Only where records expire: other runs keep their schedules.
    let sweeper =
        (world.scenario.ttl != world::TTL).then(|| tokio::spawn(sweep(world.clone(), seed)));
    let scheduled = schedule(&world, &links, &senders).await;
    tokio::time::sleep_until(started + CALM_AT).await;
    calm.store(true, Ordering::Relaxed);
    world.deliveries.calm();
    trace.event("calm: faults off");
    let producer_done = producer.await.is_ok();
    let mut settled = settle(&world).await;
    // The operator's answer to a DLQ: bring everything back, once the run is
    // calm, and let it settle again. Nothing valid may stay there.
    let before = Before::now(&world);
    let redriven = redrive(&world).await;
    if redriven > 0 {
        settled &= settle(&world).await;
    }
    let reports = stop_hosts(&senders, tasks).await;
    let stopped = Instant::now();
    if let Some(sweeper) = sweeper {
        sweeper.abort();
    }
    let accepted = accepted.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let all_landed = landed(&counts).await;
    let (next, large_bodies) = next_stage(&world).await;
    let mut evidence = evidence(&world, &accepted, &reports, before, stopped);
    evidence.next = next;
    let mut violations = check::check(&evidence);
    violations.extend(large_bodies);
    let exhausted = check::exhausted(&evidence).len();
    let stranded =
        check::stranded(&evidence).len() + check::stranded_after_redrive(&evidence).len();
    let (after_ttl, overlapping) = (
        check::after_ttl(&evidence).len(),
        check::overlapping(&evidence),
    );
    let paused_calls = check::paused_calls(&evidence);
    let claim_then_fast = check::claim_then_fast(&evidence).len();
    let fifo_after_dlq = check::fifo_after_dlq(&evidence).len();
    let payload_gone = check::payload_gone(&evidence).len();
    violations.extend(payload_violations(&world, &evidence));

    if exhausted > 0 && counts.total() + scheduled == 0 {
        violations.push(format!(
            "{exhausted} events reached the DLQ unprocessed in a run without a single fault"
        ));
    }
    violations.extend(run_failures(all_landed, &counts, producer_done, settled));
    let (trace_hash, trace_events) = trace.hash();
    Report {
        seed,
        trace_hash,
        trace_events,
        trace: trace.lines(),
        violations,
        faults: counts.total() + scheduled,
        fault_classes: fault_classes(&counts, &world),
        redriven,
        events: world.scenario.events.len(),
        exhausted,
        stranded,
        virtual_time: started.elapsed(),
        path,
        after_ttl,
        overlapping,
        paused_calls,
        claim_then_fast,
        fifo_after_dlq,
        payload_gone,
    }
}

/// What went wrong with the run itself: requests given up on that never
/// landed, a failed producer, a run that never settled.
fn run_failures(
    all_landed: bool,
    counts: &FaultCounts,
    producer_done: bool,
    settled: bool,
) -> Vec<String> {
    let mut v = Vec::new();
    if !all_landed {
        v.push(format!(
            "{} requests given up on had not landed an hour after the hosts stopped",
            counts.landing()
        ));
    }
    if !producer_done {
        v.push("the producer failed".into());
    }
    if !settled {
        v.push(format!("not settled {SETTLE_BY:?} into the run"));
    }
    v
}

/// Waits (an hour at most) until every request given up on before the calm
/// has landed: a send of the outbox that lands after the second stage has
/// emptied its queue would be left there unprocessed (seed 609514).
/// Answers whether all did.
async fn landed(counts: &FaultCounts) -> bool {
    let deadline = Instant::now() + Duration::from_secs(3600);
    while counts.landing() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    counts.landing() == 0
}

/// Stops every host (each drains) and collects their reports.
async fn stop_hosts(
    senders: &[mpsc::UnboundedSender<Command>],
    tasks: Vec<tokio::task::JoinHandle<HostReport>>,
) -> Vec<HostReport> {
    for tx in senders {
        let _ = tx.send(Command::Stop);
    }
    let mut reports = Vec::new();
    for t in tasks {
        reports.push(t.await.unwrap_or_default());
    }
    reports
}

/// A chained run's second stage: what the outbox sent (a large body read
/// back from its object in S3), then consumed; and what the checks of large
/// outgoing bodies found: a pointer to an object S3 does not hold, a body
/// the second stage got other than the one sent.
async fn next_stage(world: &World) -> (Option<check::SecondStage>, Vec<String>) {
    let Some(url) = world.next_url.as_ref() else {
        return (None, Vec::new());
    };
    let mut problems = Vec::new();
    let sent = world
        .queue
        .contents(url)
        .into_iter()
        .map(|m| with_object_body(world, m, &mut problems))
        .collect();
    let (applied, left, wrong) = second_stage(world, url).await;
    problems.extend(wrong);
    let stage = check::SecondStage {
        sent,
        applied,
        left,
    };
    (Some(stage), problems)
}

/// An outgoing message whose body went through S3, with its object's
/// content as its body (what the second stage reads); one whose object S3
/// does not hold is noted in `problems` and kept as sent.
fn with_object_body(
    world: &World,
    mut m: sqs_once::testkit::queue::StoredMessage,
    problems: &mut Vec<String>,
) -> sqs_once::testkit::queue::StoredMessage {
    if !m
        .attributes
        .contains_key(sqs_once::payloads::SIZE_ATTRIBUTE)
    {
        return m;
    }
    let Ok(pointer) = sqs_once::payloads::S3Pointer::parse(&m.body) else {
        problems.push(format!(
            "outbox: a message with the size attribute and no pointer: {}",
            m.body
        ));
        return m;
    };
    match world.s3.object(&pointer.bucket, &pointer.key) {
        Some(bytes) => {
            m.body = String::from_utf8(bytes)
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        }
        None => problems.push(format!(
            "outbox: a message sent pointing to {}/{}, an object S3 never stored",
            pointer.bucket, pointer.key
        )),
    }
    m
}

/// The run's faults by class: call faults, scheduled actions by kind, what
/// SQS's model did of what the guide says it might (the source queue's), and
/// DynamoDB's TTL deletions.
fn fault_classes(counts: &FaultCounts, world: &World) -> Vec<(&'static str, u64)> {
    let scenario = &world.scenario;
    let mut classes = counts.by_class();
    if let Some(q) = world.queue.counts(&world.url) {
        classes.extend([
            ("SQS: delivered twice at once", q.twice),
            ("SQS: back after a delete", q.again_after_delete),
            ("SQS: an old handle's delete deleted", q.old_handle_deletes),
            ("SQS: an old handle's delete ignored", q.stale_deletes),
            ("SQS: a batch entry failed alone", q.entry_errors),
        ]);
    }
    classes.push((
        "Lambda: timed-out invocations run on",
        world.ran_on.load(std::sync::atomic::Ordering::Relaxed),
    ));
    classes.push((
        "DynamoDB: TTL deletions",
        world.swept.lock().unwrap_or_else(|e| e.into_inner()).len() as u64,
    ));
    let kind = |a: &Action| match a {
        Action::Crash { .. } => "crash",
        Action::Sigterm { .. } => "sigterm",
        Action::Partition { services, .. } if services.len() == 2 => "partition (both)",
        Action::Partition { services, .. } if services[0] == faults::Service::Sqs => {
            "partition (SQS only)"
        }
        Action::Partition { .. } => "partition (DynamoDB only)",
        Action::Storm { .. } => "throttling storm",
        Action::Conflicts { .. } => "transaction conflict storm",
        Action::Freeze { .. } => "host frozen (stop-the-world)",
    };
    for name in [
        "crash",
        "sigterm",
        "partition (both)",
        "partition (SQS only)",
        "partition (DynamoDB only)",
        "throttling storm",
        "transaction conflict storm",
        "host frozen (stop-the-world)",
    ] {
        let n = scenario
            .actions
            .iter()
            .filter(|(_, a)| kind(a) == name)
            .count() as u64;
        classes.push((name, n));
    }
    classes
}

/// Starts one task per host: their command senders and join handles.
fn start_hosts(
    world: &Arc<World>,
    links: &[Link],
) -> (
    Vec<mpsc::UnboundedSender<Command>>,
    Vec<tokio::task::JoinHandle<HostReport>>,
) {
    let mut senders = Vec::new();
    let mut tasks = Vec::new();
    for (i, link) in links.iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        senders.push(tx);
        tasks.push(tokio::spawn(hosts::host(
            world.clone(),
            i,
            link.clone(),
            rx,
        )));
    }
    (senders, tasks)
}

/// Sends the events and their late duplicates at their times; notes which
/// were accepted (a body over the size limit is refused).
async fn produce(world: Arc<World>, accepted: Arc<Mutex<BTreeSet<String>>>) {
    let start = Instant::now();
    let mut sends: Vec<(Duration, usize, bool)> = Vec::new();
    for (i, e) in world.scenario.events.iter().enumerate() {
        sends.push((e.send_at, i, false));
        if let Some(at) = e.late_duplicate_at {
            sends.push((at, i, true));
        }
    }
    sends.sort();
    for (at, i, duplicate) in sends {
        tokio::time::sleep_until(start + at).await;
        let e = &world.scenario.events[i];
        let fifo = world.scenario.fifo;
        let mut attributes: std::collections::BTreeMap<String, sqs_once::Attribute> = e
            .attributes
            .iter()
            .map(|(n, v)| (n.clone(), sqs_once::Attribute::string(v)))
            .collect();
        // Through S3, as an extended client sends: the body as an object
        // of its own per send, a pointer and the size attribute in SQS.
        let body = if e.through_s3 {
            let key = world::payload_key(&e.id, usize::from(duplicate));
            world.s3.put(world::PAYLOAD_BUCKET, &key, e.body.clone());
            attributes.insert(
                sqs_once::payloads::SIZE_ATTRIBUTE.to_owned(),
                sqs_once::Attribute::typed("Number", Some(e.body.len().to_string()), None)
                    .unwrap_or_else(|| sqs_once::Attribute::string(e.body.len().to_string())),
            );
            serde_json::json!([
                sqs_once::payloads::POINTER_CLASS,
                {"s3BucketName": world::PAYLOAD_BUCKET, "s3Key": key}
            ])
            .to_string()
        } else {
            e.body.clone()
        };
        let message = OutgoingMessage {
            body,
            group_id: fifo.then(|| e.group.clone()),
            deduplication_id: fifo.then(|| e.id.clone()),
            attributes,
            ..Default::default()
        };
        let what = if duplicate { "late duplicate" } else { "send" };
        match world
            .queue
            .send_with(&world.url, message, SendOptions::default())
        {
            Ok(sent) => {
                accepted
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(e.id.clone());
                world
                    .sent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(e.id.clone())
                    .or_default()
                    .push(sent.message_id.clone());
                world.trace.event(format!(
                    "{what} {} as {}{}",
                    e.id,
                    sent.message_id,
                    if sent.deduplicated {
                        " (deduplicated)"
                    } else {
                        ""
                    }
                ));
            }
            Err(err) => world.trace.event(format!("{what} {} refused: {err}", e.id)),
        }
    }
}

/// When TTL deleted each event's records left `IN_PROGRESS`, ms from the
/// run's start ([`check::Evidence::unfinished_deleted_by_ttl`]).
fn unfinished_deleted_by_ttl(world: &World) -> BTreeMap<String, Vec<u128>> {
    let swept = world.swept.lock().unwrap_or_else(|e| e.into_inner());
    let at = world.swept_at.lock().unwrap_or_else(|e| e.into_inner());
    let start = world.trace.start();
    let mut by_event: BTreeMap<String, Vec<u128>> = BTreeMap::new();
    for (r, t) in swept.iter().zip(at.iter()) {
        if r.status == sqs_once::Status::InProgress {
            by_event
                .entry(event_of_record(r))
                .or_default()
                .push(t.saturating_duration_since(start).as_millis());
        }
    }
    by_event
}

/// Events whose record a host may have taken for expired by now:
/// `expires_at` less the most a host's clock runs ahead reached (`epoch_ms`:
/// true time at the run's start).
fn expired(world: &World, all: &[sqs_once::Record], epoch_ms: i64) -> BTreeSet<String> {
    let grace_ms = i64::try_from(clock_grace(&world.scenario).as_millis()).unwrap_or(i64::MAX);
    let end_ms = i64::try_from(world.trace.start().elapsed().as_millis()).unwrap_or(i64::MAX);
    all.iter()
        .filter(|r| r.expires_at_s * 1000 - epoch_ms - grace_ms <= end_ms)
        .map(event_of_record)
        .collect()
}

/// The large-payload checks the models answer: objects deleted before a
/// finished message's delete reached SQS, parked copies whose object is gone.
fn payload_violations(world: &World, evidence: &check::Evidence<'_>) -> Vec<String> {
    let mut v = world.objects_deleted_early();
    let bucket = world::PAYLOAD_BUCKET;
    v.extend(check::parked_objects(evidence, |key| {
        world.s3.contains(bucket, key)
    }));
    v
}

/// Carries out the scheduled actions; answers how many.
async fn schedule(
    world: &World,
    links: &[Link],
    senders: &[mpsc::UnboundedSender<Command>],
) -> u64 {
    let start = Instant::now();
    let mut n = 0;
    for (at, action) in &world.scenario.actions {
        tokio::time::sleep_until(start + *at).await;
        n += 1;
        match action {
            Action::Crash { consumer, down } => {
                let _ = senders[*consumer].send(Command::Crash(*down));
            }
            Action::Sigterm { consumer, down } => {
                let _ = senders[*consumer].send(Command::Sigterm(*down));
            }
            Action::Partition {
                consumer,
                services,
                length,
            } => {
                for service in services {
                    links[*consumer].cut(*service, *length);
                }
            }
            Action::Storm {
                consumer,
                service,
                length,
            } => links[*consumer].storm(*service, *length),
            Action::Conflicts { consumer, length } => links[*consumer].conflict_storm(*length),
            Action::Freeze { consumer, length } => links[*consumer].freeze(*length),
        }
    }
    n
}

/// When `event`'s record in `store` was completed (ms from the run's start),
/// if it says `COMPLETED` (its record key under `scenario`'s key source).
fn completed_in(
    store: stores::Backend,
    grace: Duration,
    scenario: &Scenario,
) -> impl Fn(&str) -> Option<u128> + Send + Sync + 'static {
    let keys: std::collections::BTreeMap<String, String> = scenario
        .events
        .iter()
        .map(|e| (e.id.clone(), scenario.record_pk(&e.id)))
        .collect();
    let pks = move |event: &str| {
        keys.get(event)
            .cloned()
            .unwrap_or_else(|| format!("sim#{event}"))
    };
    let epoch_ms = sqs_once::clock::Clock::now_ms(&TokioClock::starting_at(hosts::epoch()));
    let start = Instant::now();
    move |event: &str| store.completed_ms(&pks(event), (epoch_ms, start), grace)
}

/// Moves everything in the DLQ back to the source queue with the library's
/// redrive (as an operator would after an alarm); answers how many moved.
async fn redrive(world: &World) -> u64 {
    let limit = world.queue.contents(&world.dlq_url).len() as u64;
    if limit == 0 {
        return 0;
    }
    let done = sqs_once::redrive::redrive(
        &world.queue,
        &world.dlq_url,
        &world.url,
        world::MAX_MESSAGE_BYTES,
        limit,
        None,
    )
    .await;
    match done {
        Ok(r) => {
            world.trace.event(format!(
                "redrive: {} moved back from the DLQ ({} without the carried key, {} in both)",
                r.moved,
                r.without_key.len(),
                r.in_both.len()
            ));
            r.moved
        }
        Err(e) => {
            world.trace.event(format!("redrive failed: {e}"));
            0
        }
    }
}

/// Waits until the source queue is empty (nothing stored, in flight or
/// delayed); false if it is not by [`SETTLE_BY`].
async fn settle(world: &World) -> bool {
    let deadline = Instant::now() + SETTLE_BY;
    while Instant::now() < deadline {
        if world
            .queue
            .counts(&world.url)
            .is_some_and(|c| c.stored() == 0)
        {
            world.trace.event("settled: the source queue is empty");
            return true;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    false
}

/// The second stage of a chained run, once the first has settled: a poller
/// (the library's, on a dedup store of its own) keyed on the outbox id each
/// message carries, whose handler counts its effect per event and checks the
/// body it got (where the run sends large bodies, it reads them from S3 as
/// a consumer with payload buckets does). Returns the counts, how many
/// messages it left in the queue, and the bodies it got wrong.
async fn second_stage(
    world: &World,
    url: &str,
) -> (std::collections::BTreeMap<String, u32>, usize, Vec<String>) {
    use sqs_once::{Context, HandlerResult, Message};
    let applied: Arc<Mutex<std::collections::BTreeMap<String, u32>>> = Arc::default();
    let wrong: Arc<Mutex<Vec<String>>> = Arc::default();
    let counts = applied.clone();
    let (large, wrong_bodies) = (
        Arc::new(world.scenario.large_outgoing.clone()),
        wrong.clone(),
    );
    let handler = sqs_once::handler_fn(move |m: Message, _ctx: Context| {
        let (counts, large, wrong) = (counts.clone(), large.clone(), wrong_bodies.clone());
        async move {
            let body: serde_json::Value = serde_json::from_str(m.body()).unwrap_or_default();
            let event = body["id"].as_str().unwrap_or("?").to_owned();
            // The body the handler sent: a large one (read back from S3)
            // padded to its event's length, any other without padding.
            let pad = body["pad"].as_str();
            let expected = large.contains(&event).then(|| world::outgoing_pad(&event));
            if pad.map(str::len) != expected || pad.is_some_and(|p| p.bytes().any(|b| b != b'p')) {
                wrong.lock().unwrap_or_else(|e| e.into_inner()).push(format!(
                    "{event}: the second stage got a body padded to {:?} bytes, not the {expected:?} sent",
                    pad.map(str::len)
                ));
            }
            *counts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(event)
                .or_default() += 1;
            HandlerResult::Ok(None)
        }
    });
    let mut config = sqs_once::ProcessorConfig::new("sim-next");
    config.key_source = format!("attribute:{}", sqs_once::outbox::OUTBOX_ID_ATTRIBUTE)
        .parse()
        .unwrap_or_default();
    // (The `next-by-message-id` mutant keys the second stage on the message
    // id: a message the outbox sent twice is applied twice.)
    if sqs_once::mutants::active("next-by-message-id") {
        config.key_source = sqs_once::KeySource::MessageId;
    }
    let clock = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let store = sqs_once::MemoryStore::new(clock.clone());
    let mut processor = sqs_once::Processor::new(store, handler, config)
        .unwrap_or_else(|e| panic!("the second stage's config is valid: {e}"))
        .with_clock(clock.clone());
    if !world.scenario.large_outgoing.is_empty() {
        // Large bodies read back from S3 (the run is calm: no faults), as
        // a consumer with payload buckets reads them.
        let wire = wire::Wire::new(
            wire::Service::S3(world.s3.clone()),
            None,
            faults::Life::default(),
        );
        let payloads = sqs_once::payloads::LargePayloads::new(wire::s3_client(wire, clock))
            .only_from(vec![sqs_once::payloads::PayloadLocation {
                bucket: world::PAYLOAD_BUCKET.to_owned(),
                prefix: world::OUTBOX_PREFIX.to_owned(),
            }]);
        processor = processor.with_large_payloads(payloads);
    }
    let poller = sqs_once::PollerConfig::new(url);
    let token = tokio_util::sync::CancellationToken::new();
    let run = tokio::spawn(sqs_once::poller::run(
        world.queue.clone(),
        processor,
        poller,
        token.clone(),
    ));
    // Until its queue is empty (SQS may bring a deleted message back, or
    // deliver one twice: duplicates to skip), or an hour.
    let deadline = Instant::now() + Duration::from_secs(3600);
    let stored = || world.queue.counts(url).map_or(0, |c| c.stored());
    while stored() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    token.cancel();
    let _ = run.await;
    let left = stored();
    let applied = applied.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let wrong = wrong.lock().unwrap_or_else(|e| e.into_inner()).clone();
    (applied, left, wrong)
}

/// What the run looked like when it first settled, before the redrive.
struct Before {
    dlq: Vec<sqs_once::testkit::queue::StoredMessage>,
    records: std::collections::BTreeMap<String, sqs_once::Status>,
    completed_by: BTreeSet<String>,
    confirmed: BTreeSet<String>,
}

impl Before {
    /// The run as it stands when it first settled.
    fn now(world: &World) -> Self {
        let dlq = world.queue.contents(&world.dlq_url);
        let confirmed = dlq
            .iter()
            .map(|m| m.id.clone())
            .filter(|id| {
                let outcomes = world.trace.outcomes_of(id);
                outcomes.contains("completed") || outcomes.contains("duplicate")
            })
            .collect();
        let all = world.records();
        Self {
            dlq,
            records: all.iter().map(|r| (event_of_record(r), r.status)).collect(),
            completed_by: all
                .into_iter()
                .filter(|r| r.status == sqs_once::Status::Completed)
                .filter_map(|r| r.message_id)
                .collect(),
            confirmed,
        }
    }
}

/// Each consumer's link, sharing the run's calm switch and fault counters,
/// and the dice of SQS's faults on the wire.
fn links(
    world: &World,
    calm: &Arc<AtomicBool>,
    counts: &Arc<FaultCounts>,
    sqs_wire: &Dice,
) -> Vec<Link> {
    world
        .scenario
        .consumers
        .iter()
        .map(|c| {
            Link::new(
                &c.name,
                world.dice.clone(),
                world.scenario.plan,
                world.trace.clone(),
                calm.clone(),
                counts.clone(),
            )
            .with_sqs_wire(sqs_wire.clone(), world.scenario.might.late)
        })
        .collect()
}

/// The event a dedup record is for.
fn event_of_record(r: &sqs_once::Record) -> String {
    world::event_of_pk(&r.pk)
}

/// Every record's status (as last written: see [`World::records`]), by event.
fn records(world: &World) -> std::collections::BTreeMap<String, sqs_once::Status> {
    world
        .records()
        .iter()
        .map(|r| (event_of_record(r), r.status))
        .collect()
}

/// The records left `IN_PROGRESS`, by event; `epoch_ms` is the run's start
/// on its clock, `stopped` when the hosts stopped.
fn unfinished(
    world: &World,
    all: &[sqs_once::Record],
    epoch_ms: i64,
    stopped: Instant,
) -> BTreeMap<String, check::Unfinished> {
    let stopped_ms = epoch_ms
        + i64::try_from(
            stopped
                .saturating_duration_since(world.trace.start())
                .as_millis(),
        )
        .unwrap_or(i64::MAX);
    all.iter()
        .filter(|r| r.status == sqs_once::Status::InProgress)
        .map(|r| {
            let what = format!(
                "lease until {}ms from now, {} attempts, message {}, last error {:?}",
                r.lease_until_ms - epoch_ms,
                r.attempts,
                r.message_id.as_deref().unwrap_or("?"),
                r.error
            );
            let left = check::Unfinished {
                what,
                released: r.lease_until_ms == 0,
                lease_ended: r.lease_until_ms <= stopped_ms,
                message: r.message_id.clone().unwrap_or_default(),
            };
            (event_of_record(r), left)
        })
        .collect()
}

fn evidence<'a>(
    world: &'a World,
    accepted: &'a BTreeSet<String>,
    hosts: &'a [HostReport],
    before: Before,
    stopped: Instant,
) -> check::Evidence<'a> {
    let rows = world.store.rows(world.trace.start());
    let all = world.records();
    let event = event_of_record;
    let records = records(world);
    let epoch_ms = sqs_once::clock::Clock::now_ms(&TokioClock::starting_at(hosts::epoch()));
    let unfinished = unfinished(world, &all, epoch_ms, stopped);
    let charged = world.api.charges().into_values().collect();
    let start = world.trace.start();
    let expired = expired(world, &all, epoch_ms);
    let ended_by_ttl = world
        .store
        .ended_by_ttl((epoch_ms, start), clock_grace(&world.scenario))
        .into_iter()
        .map(|(pk, n)| (world::event_of_pk(&pk), n))
        .collect();
    check::Evidence {
        scenario: &world.scenario,
        accepted,
        rows,
        calls: world.api.calls(),
        charged,
        records,
        records_before: before.records,
        completed_by: before.completed_by,
        confirmed: before.confirmed,
        unfinished,
        dlq_before: before.dlq,
        dlq: world.queue.contents(&world.dlq_url),
        left: world.queue.contents(&world.url),
        hosts,
        deliveries: &world.deliveries,
        twins: world.queue.twin_receipts(&world.url),
        back_after_delete: world.queue.back_after_delete(&world.url),
        pauses: world
            .pauses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        sent: world.sent.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        fencing_breaches: world
            .store
            .fencing_breaches((epoch_ms, start), clock_grace(&world.scenario)),
        ttl_breaches: world.store.ttl_breaches(),
        lease_ends: world.store.lease_ends().map(|ends| {
            ends.into_iter()
                .map(|(pk, attempt, end)| {
                    let ms = end
                        .saturating_duration_since(world.trace.start())
                        .as_millis();
                    ((world::event_of_pk(&pk), attempt), ms)
                })
                .collect()
        }),
        reruns: world.trace.reruns(),
        failed_reads: world.trace.failed_reads(),
        outcome_at: world.trace.outcome_times(),
        trouble: world.trace.trouble(),
        start: world.trace.start(),
        next: None,
        ended_by_ttl,
        unfinished_deleted_by_ttl: unfinished_deleted_by_ttl(world),
        early_sends: world
            .early_sends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        attempts: all.iter().map(|r| (event(r), r.attempts)).collect(),
        objects_deleted: world.s3.deletes().into_iter().map(|(_, key)| key).collect(),
        expired,
    }
}
