//! The long-polling runtime (ECS or any host): receive, process, delete.
//!
//! # Backpressure
//! At most `concurrency` handlers run, and at most `concurrency + prefetch`
//! messages are held (received, not yet finished): the poller receives ahead
//! up to `prefetch` messages more than it can run, in batches of ten, so a
//! slot that comes free starts a waiting message at once and receives stay at
//! 0.1 per message whatever the handlers' durations. What it receives is made
//! invisible for a lease (whatever the queue's visibility timeout), and
//! messages that wait (for a free slot, or behind an earlier message of their
//! FIFO group or dedup key) are extended every heartbeat while they wait, and
//! before they start if need be, so none becomes visible again while this
//! poller still holds it; one whose extension fails until it would reappear is
//! let go, not run.
//!
//! Finished messages wait for their delete in batches of ten; while
//! `PENDING_DELETES` already wait (deletes failing slowly or not answering
//! while receives still work), a finished handler keeps its slot until there
//! is room, so no receive brings more messages (nor redelivered duplicates of
//! the undeleted ones) until deletes catch up.
//!
//! # Shutdown
//! [`run`] takes a [`CancellationToken`]; only binaries know about signals. When
//! it is cancelled the poller stops receiving, gives back at once what was
//! received ahead and waits for a slot, lets running handlers finish within
//! the drain deadline, interrupts and releases the rest (their messages
//! become visible again at once), flushes pending deletes and returns.
//!
//! The protocol this runtime follows is in the project's `docs/DESIGN.md`
//! ("The runtimes").

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::protocol::limits::SQS_BATCH;
use crate::protocol::outcome::OutcomeKind;
use crate::protocol::payloads::{LargePayloads, S3Pointer};
use crate::protocol::processor::{KeyFound, ProcessOptions};
use crate::protocol::queue::{QueueClient, QueueError, ReceiveRequest};
use crate::protocol::store::DedupStore;
use crate::runtime::{Delivery, Holding, OnRetry, Settled, Settler, hold_group, lanes};
use crate::{Handler, Message, Processor};

mod deletes;
mod keeper;
mod lane;
mod receive;

use deletes::*;
use lane::*;
use receive::*;

/// Settings of the long-polling runtime.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PollerConfig {
    /// The source queue (`SQS_ONCE_QUEUE_URL`).
    pub queue_url: String,
    /// Where permanent failures are parked (`SQS_ONCE_DLQ_URL`). Without one, a
    /// permanent failure is retried until the queue's redrive policy parks it.
    pub dlq_url: Option<String>,
    /// Handlers running at once at most (`SQS_ONCE_CONCURRENCY`, default 10).
    pub concurrency: usize,
    /// Messages received ahead beyond the running ones, at most
    /// (`SQS_ONCE_PREFETCH`, default 10; 0: receive only for free slots).
    /// They wait, invisible, for a slot; with 10 or more every receive asks
    /// for a full batch and a freed slot never waits for a receive.
    pub prefetch: usize,
    /// Long-poll wait (default 20 s).
    pub wait_time: Duration,
    /// How long in-flight work may finish after shutdown (`SQS_ONCE_DRAIN`,
    /// default 20 s); releases and the last deletes then get [`CLEANUP`] (5 s)
    /// more at most, so a stop takes under 25 s, below ECS's 30 s stop timeout.
    pub drain: Duration,
    /// Return once nothing was received for this long and nothing is in flight
    /// (`SQS_ONCE_EXIT_WHEN_IDLE`; for batch jobs, demos and tests).
    pub exit_when_idle: Option<Duration>,
    /// The longest wait to fill a batch of 10 (`SQS_ONCE_BATCH_WAIT`, default
    /// 1 s): a receive, once one message can be held, waits this long at most
    /// for room to hold ten (`concurrency + prefetch` at most); a delete waits
    /// this long for ten receipts once one is pending. Batches of ten make
    /// receive and delete cost 0.1 calls per message each.
    pub batch_wait: Duration,
    /// Print the processor's counters as EMF lines on stdout this often, and
    /// once at exit (`SQS_ONCE_METRICS_INTERVAL`; the binaries default to 60 s).
    pub metrics_interval: Option<Duration>,
    /// The source queue's `maxReceiveCount` (its redrive policy's; read at
    /// start-up by the binaries). On a FIFO queue, with a DLQ to park in,
    /// a message that fails transiently while later messages of its group
    /// wait behind it is retried in place, its group kept invisible, and
    /// parked on its `max_receive_count`th attempt (receives and retries in
    /// place counted together) instead of handed back with its group: the
    /// group's other messages spend no receive for it. `None`: the failed
    /// message is handed back, the rest of its group with it.
    pub max_receive_count: Option<u32>,
    /// Beaten by the receive loop at every turn, and every [`BEAT_WHILE_FULL`]
    /// while every place is held by running or waiting messages: what a
    /// health check reads (`SQS_ONCE_HEALTH_PORT`). Left alone once the loop
    /// stops receiving.
    pub liveness: Option<Liveness>,
}

/// How often the receive loop beats its [`Liveness`] while it waits for a
/// place (every place held by running or waiting messages).
pub const BEAT_WHILE_FULL: Duration = Duration::from_secs(5);

/// When the receive loop last turned: a poller's liveness for a health check.
/// Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Liveness(Arc<std::sync::Mutex<Option<Instant>>>);

impl Liveness {
    /// A liveness never beaten (a poller not yet receiving).
    pub fn new() -> Self {
        Self::default()
    }

    /// The receive loop is turning now.
    pub fn beat(&self) {
        *self.0.lock().expect("liveness lock") = Some(Instant::now());
    }

    /// How long ago the loop last turned; `None` before its first turn.
    pub fn since_last_beat(&self) -> Option<Duration> {
        self.0.lock().expect("liveness lock").map(|at| at.elapsed())
    }
}

impl PollerConfig {
    /// Defaults for a queue.
    pub fn new(queue_url: impl Into<String>) -> Self {
        Self {
            queue_url: queue_url.into(),
            dlq_url: None,
            concurrency: 10,
            prefetch: 10,
            wait_time: Duration::from_secs(20),
            drain: Duration::from_secs(20),
            exit_when_idle: None,
            batch_wait: Duration::from_secs(1),
            metrics_interval: None,
            max_receive_count: None,
            liveness: None,
        }
    }

    /// Whether the queue is FIFO (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        crate::protocol::queue::is_fifo(&self.queue_url)
    }
}

/// What a poller run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunStats {
    /// Messages received.
    pub received: u64,
    /// Receives that returned no message (long polls that timed out).
    pub empty_receives: u64,
    /// Handlers completed (effects recorded).
    pub completed: u64,
    /// Duplicates of completed work skipped.
    pub duplicates: u64,
    /// Messages held by another consumer's claim, made visible again later.
    pub in_flight: u64,
    /// Retryable failures (made visible again after a backoff).
    pub retried: u64,
    /// Messages parked in the DLQ.
    pub parked: u64,
    /// Messages released unprocessed: after an earlier failure in their FIFO
    /// group, received but not started before shutdown, or waiting when SQS
    /// refused its receipt or a newer delivery of it arrived.
    pub held_back: u64,
}

/// The queue could not be read at start-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QueueCheckError {
    /// `GetQueueAttributes` failed.
    #[error(
        "cannot read queue {queue} (setting SQS_ONCE_QUEUE_URL; grant sqs:GetQueueAttributes on it): {source}"
    )]
    Unreachable {
        /// The queue's URL.
        queue: String,
        /// The failed call.
        #[source]
        source: QueueError,
    },
}

impl QueueCheckError {
    /// Whether the check may pass when tried again (no answer, throttled, 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Unreachable { source, .. } => source.is_transient(),
        }
    }
}

/// Reads the queue's attributes and warns about settings that defeat the
/// protocol: a visibility timeout below the heartbeat, a retention longer than
/// the records are kept. Answers the attributes read (their
/// `max_receive_count` is [`PollerConfig::max_receive_count`]'s).
pub async fn check_queue<Q: QueueClient>(
    queue: &Q,
    queue_url: &str,
    heartbeat: Duration,
    ttl: Duration,
) -> Result<crate::protocol::queue::QueueAttributes, QueueCheckError> {
    let attributes =
        queue
            .attributes(queue_url)
            .await
            .map_err(|source| QueueCheckError::Unreachable {
                queue: queue_url.to_owned(),
                source,
            })?;
    if let Some(vis) = attributes.visibility_timeout
        && vis <= heartbeat
    {
        warn!(
            visibility_timeout = ?vis, ?heartbeat,
            "the queue's visibility timeout is not above the heartbeat interval: messages may be redelivered while their handler runs (lower SQS_ONCE_HEARTBEAT or raise the queue's VisibilityTimeout)"
        );
    }
    crate::protocol::queue::check_retention(queue, queue_url, &attributes, ttl).await;
    Ok(attributes)
}

/// What the poller's tasks share: the queue, the processor, where finished
/// messages go to be deleted, and the counters.
struct Shared<Q, S, H> {
    queue: Q,
    processor: Processor<S, H>,
    config: PollerConfig,
    settler: Settler<Q>,
    /// The deliveries held, by message id (shared with [`Self::settler`]):
    /// a delivery superseded by a newer one of its message sets no retry
    /// delay.
    holding: Holding,
    /// Finished messages, for the [`DeleteBatcher`]: at most
    /// [`PENDING_DELETES`] wait in it.
    deletes: mpsc::Sender<Finished>,
    /// Set while [`Self::deletes`] is full (warned about once per episode).
    deletes_behind: AtomicBool,
    /// Cancelled at the drain deadline: running handlers are interrupted.
    stop: CancellationToken,
    /// Cancelled when [`run`] returns: a lane still running then (a release
    /// or a commit that AWS has not answered by the cleanup's end) is
    /// dropped, so no lane makes a call afterwards (the last deletes of
    /// finished messages may still be on their way: they only keep those
    /// from coming back).
    ended: CancellationToken,
    /// The caller's shutdown: lanes still waiting for a slot give their
    /// messages back.
    shutdown: CancellationToken,
    /// One permit per running handler (`concurrency`).
    running: Arc<Semaphore>,
    stats: std::sync::Mutex<RunStats>,
}

impl<Q: QueueClient, S: DedupStore, H: Handler> Shared<Q, S, H> {
    fn count(&self, f: impl FnOnce(&mut RunStats)) {
        f(&mut self.stats.lock().expect("stats lock"));
    }

    /// Runs one message (`held` says since when and until when) through the
    /// shared step, counts what became of it, and hands a message let go to
    /// the [`DeleteBatcher`].
    async fn handle(&self, message: Message, held: Held<'_>) -> Settled {
        let url = self.config.queue_url.as_str();
        // (The `delete-before-effect` mutant, for the simulator only, deletes
        // the message before its effect is recorded.)
        if crate::protocol::mutants::active("delete-before-effect") {
            self.to_delete(Finished {
                receipt: message.receipt_handle().unwrap_or_default().to_owned(),
                payload: None,
                invisible_until: held.invisible_until,
                retry_until: held.at_most(),
            })
            .await;
        }
        let at = Delivery {
            source: Some(url),
            message: &message,
            received_at: held.received_at,
            superseded: false,
            invisible_through: None,
        };
        let options = ProcessOptions {
            visibility: None,
            deadline: None,
            stop: Some(self.stop.clone()),
            invisible_until: Some(held.invisible_until),
            received_at: Some(held.received_at),
            wait_until: None,
        };
        let mut step = self
            .settler
            .process_and_settle(&self.processor, at, options, held.on_retry)
            .await;
        let finished_elsewhere = self.finished_elsewhere(&message, &mut step);
        self.count(|s| match step.outcome {
            OutcomeKind::Completed => s.completed += 1,
            OutcomeKind::Duplicate => s.duplicates += 1,
            OutcomeKind::InFlight => s.in_flight += 1,
            OutcomeKind::Retry => s.retried += 1,
            OutcomeKind::Park => {}
        });
        // A parked message keeps its payload: its copy in the DLQ points to it.
        let payload = match step.settled {
            // The delivery that finished it dealt with its object: deleted
            // it, or kept it for its parked copy (simulator seed 2340: a
            // delivery let go after another parked the message deleted the
            // object the parked copy points to).
            Settled::Done if finished_elsewhere => None,
            Settled::Done => self
                .processor
                .large_payloads()
                .and_then(|p| p.to_delete(&message)),
            Settled::Parked => {
                self.count(|s| s.parked += 1);
                // (The `payload-deleted-on-park` mutant, for the simulator
                // only, deletes a parked message's object too.)
                crate::protocol::mutants::active("payload-deleted-on-park")
                    .then(|| self.processor.large_payloads()?.to_delete(&message))
                    .flatten()
            }
            // (The poller waits for a key held elsewhere: never sent again.)
            Settled::SentAgain => None,
            // Still held: its lane runs it again (`Lane::work`).
            Settled::InPlace { .. } => return step.settled,
            Settled::Again { .. } => {
                // Let go now (not at its lane's end): a copy of it in this
                // lane or another may then set its own delay. A finished one
                // stays held until its lane ends, its delete still on its way.
                if let Some(receipt) = message.receipt_handle() {
                    let latest = step
                        .invisible_at_most
                        .map_or(held.at_most(), |e| e.max(held.at_most()));
                    self.holding.let_go_until(message.id(), receipt, latest);
                }
                return step.settled;
            }
        };
        self.holding.finished(&message);
        self.hand_over(&message, held, &step, payload).await;
        step.settled
    }

    /// Another delivery of `message`, held here alongside this one,
    /// finished it (its delete handed over, maybe through a receipt SQS
    /// ignores), and this one, which did not learn so (its turn with the
    /// store failed), is to come back: it is made a duplicate, deleted
    /// through its own receipt too, instead of coming back to spend a
    /// receive (on the last allowed one, the message would reach the DLQ,
    /// its effect made). Answers whether it was.
    fn finished_elsewhere(
        &self,
        message: &Message,
        step: &mut crate::runtime::settle::Settlement,
    ) -> bool {
        if !matches!(step.settled, Settled::Again { .. }) || !self.holding.finished_here(message) {
            return false;
        }
        info!(
            message_id = message.id(),
            "not finished by this delivery, but by another one held here: deleted through this delivery's receipt too"
        );
        step.outcome = OutcomeKind::Duplicate;
        step.settled = Settled::Done;
        true
    }

    /// Hands a finished message's delete to the [`DeleteBatcher`], with
    /// until when it is known to stay invisible and may at the latest.
    async fn hand_over(
        &self,
        message: &Message,
        held: Held<'_>,
        step: &crate::runtime::settle::Settlement,
        payload: Option<S3Pointer>,
    ) {
        // Known to stay invisible until the later of the lane's and the
        // handler's last extension (the lane keeper's of a running message
        // is not counted: an earlier end only sends its delete sooner).
        let invisible_until = step
            .invisible_until
            .map_or(held.invisible_until, |e| e.max(held.invisible_until));
        let keeper_on_its_way = self.stop_keeping(&held, invisible_until).await;
        let retry_until =
            self.retry_deletes_until(message, &held, step, invisible_until, keeper_on_its_way);
        let deletes = self.delete_every_receipt(message, payload, invisible_until, retry_until);
        let not_running = async {
            if keeper_on_its_way {
                held.waiting.lock().await.running = None;
            }
        };
        tokio::join!(deletes, not_running);
    }

    /// Takes the message off its lane's keeper (no extension of it starts
    /// after this); answers whether one may still be on its way.
    ///
    /// The lane keeper holds its lane's lock through an extension call: one
    /// of this message on its way is counted toward the latest end before the
    /// delete is handed over, and none starts after. Waited for only until
    /// the delete must be sent: a call the SDK retries can outlast a short
    /// visibility (simulator seed 309608: about 12 s against a 10.6 s lease,
    /// the delete sent after the end). Past that, the delete goes first,
    /// tried until the call on its way may have ended and landed too, and
    /// the lock is asked for beside it (granted in turn: before the keeper's
    /// next call, so none of those includes this message, however long the
    /// hand-over waits for room). At shutdown not waited for at all: the
    /// drain's time is short, and a lane still waiting at the cleanup's end
    /// is dropped with its delete (simulator seed 348641: the keeper's call
    /// went unanswered through a drain, the message, completed on its last
    /// allowed receive, was never deleted and reached the DLQ).
    async fn stop_keeping(&self, held: &Held<'_>, invisible_until: Instant) -> bool {
        let by = send_by_end(invisible_until);
        tokio::select! {
            biased;
            locked = tokio::time::timeout_at(by, held.waiting.lock()) => match locked {
                Ok(mut w) => {
                    w.running = None;
                    false
                }
                Err(_) => true,
            },
            () = self.shutdown.cancelled() => true,
        }
    }

    /// Until when the message's deletes are tried: the latest it may stay
    /// invisible by any extension sent, landed or on its way.
    fn retry_deletes_until(
        &self,
        message: &Message,
        held: &Held<'_>,
        step: &crate::runtime::settle::Settlement,
        invisible_until: Instant,
        keeper_on_its_way: bool,
    ) -> Instant {
        let mut retry_until = step
            .invisible_at_most
            .map_or(held.at_most(), |e| e.max(held.at_most()))
            .max(invisible_until);
        // A visibility set back through its receipt after an older
        // delivery's retry delay may keep it invisible that long too.
        if let Some(set_back) = self.holding.set_back_until(message) {
            retry_until = retry_until.max(set_back);
        }
        if keeper_on_its_way {
            let lease = self.processor.config().lease;
            retry_until = retry_until.max(
                Instant::now() + KEEPER_CALL_MAX + lease + crate::runtime::visibility::LANDS_LATE,
            );
        }
        retry_until
    }

    /// Hands over the delete through this delivery's receipt, and, first,
    /// through a newer delivery's that reached this poller and came back let
    /// go: SQS may honour only its receipt, tried until its own latest end.
    async fn delete_every_receipt(
        &self,
        message: &Message,
        payload: Option<S3Pointer>,
        invisible_until: Instant,
        retry_until: Instant,
    ) {
        if let Some((newest, until)) = self.holding.newest_let_go(message) {
            self.to_delete(Finished {
                receipt: newest,
                payload: None,
                invisible_until,
                retry_until: until.map_or(retry_until, |u| u.max(retry_until)),
            })
            .await;
        }
        self.to_delete(Finished {
            receipt: message.receipt_handle().unwrap_or_default().to_owned(),
            payload,
            invisible_until,
            retry_until,
        })
        .await;
    }

    /// Hands a finished message to the [`DeleteBatcher`]. While
    /// [`PENDING_DELETES`] are already waiting (deletes failing slowly or not
    /// answering while receives still work) this waits for room, holding the
    /// message's slot and place: no receive brings more messages while
    /// deletes are that far behind, and the backlog stays bounded instead of
    /// growing by every redelivered duplicate. Given up at the drain deadline:
    /// the message then comes back and is skipped as a duplicate.
    async fn to_delete(&self, finished: Finished) {
        let finished = match self.deletes.try_send(finished) {
            Ok(()) => {
                self.deletes_behind.store(false, Ordering::Relaxed);
                return;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
            Err(mpsc::error::TrySendError::Full(f)) => f,
        };
        if !self.deletes_behind.swap(true, Ordering::Relaxed) {
            warn!(
                pending = PENDING_DELETES,
                "deletes are behind; no more messages are received until they catch up"
            );
        }
        tokio::select! {
            biased;
            _ = self.deletes.send(finished) => {}
            () = self.stop.cancelled() => {
                warn!("drain deadline reached with deletes behind; the message comes back and is skipped as a duplicate");
            }
        }
    }

    /// Makes a message received at or after `received_at` visible again
    /// after `after` (cut to SQS's 12 hours from the receive), unless a
    /// newer delivery of it reached this poller ([`Holding`]).
    async fn retry_later(&self, message: &Message, after: Duration, received_at: Instant) {
        let url = self.config.queue_url.as_str();
        let at = Delivery {
            source: Some(url),
            message,
            received_at,
            superseded: false,
            invisible_through: None,
        };
        self.settler.retry_later(url, &at, after).await;
    }
}

/// A lane's task: the lane run until it ends or [`Shared::ended`] is
/// cancelled (after the drain and cleanup: then dropped, as in a crash);
/// not started if that came first.
///
/// The task is moved whole at its spawn, so its size is a cost paid per
/// lane (bench/RESULTS.md, 2026-12-05: at 416 KiB, copying it was an
/// eighth of the poller's instructions a message). It is kept small: each
/// message's step is boxed within the lane ([`Lane::work`]), the lane's
/// work future is held once ([`Lane::run`]), and the lane is run here,
/// not through `CancellationToken::run_until_cancelled_owned`, whose two
/// nested async fns each hold a copy of the future they run.
fn lane_task<Q: QueueClient, S: DedupStore, H: Handler>(
    lane: Lane<Q, S, H>,
) -> impl Future<Output = ()> + Send + 'static {
    let ended = lane.shared.ended.clone();
    async move {
        if ended.is_cancelled() {
            return;
        }
        tokio::select! {
            biased;
            () = lane.run() => {}
            () = ended.cancelled() => {}
        }
    }
}

/// Prints the processor's counters as EMF every `every`, until aborted.
fn spawn_metrics<S: DedupStore, H: Handler>(
    processor: Processor<S, H>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(Instant::now() + every, every);
        loop {
            tick.tick().await;
            let consumer = &processor.config().consumer;
            crate::protocol::metrics::print_emf(&processor.metrics().take(), consumer);
        }
    })
}

/// Lets running lanes finish within `drain`, then interrupts them (their
/// claims are released). Returns the instant by which releases and the last
/// deletes must be done: [`CLEANUP`] later at most, so the whole stop takes
/// no longer than drain + CLEANUP even when AWS does not answer; what is left
/// then comes back when its lease and visibility run out.
async fn drain(tasks: &TaskTracker, stop: &CancellationToken, drain: Duration) -> Instant {
    tasks.close();
    if tokio::time::timeout(drain, tasks.wait()).await.is_err() {
        warn!(
            ?drain,
            "drain deadline reached; interrupting and releasing unfinished work"
        );
        stop.cancel();
    }
    let cleanup_by = Instant::now() + CLEANUP;
    if tokio::time::timeout_at(cleanup_by, tasks.wait())
        .await
        .is_err()
    {
        warn!(
            ?CLEANUP,
            "releases did not finish in time; those claims end with their leases"
        );
    }
    cleanup_by
}

/// Runs the poller until `shutdown` is cancelled (or it has been idle for
/// `exit_when_idle`). Returns what it did, within `drain` + [`CLEANUP`] of
/// the stop: handlers still running at the drain's end are interrupted and
/// their claims released; what is still running at the cleanup's end (AWS
/// did not answer) is dropped, as in a crash, and no handler or lane of
/// this poller runs after it returns.
///
/// `queue` is any [`QueueClient`]; pass an [`aws_sdk_sqs::Client`] in production.
pub async fn run<Q: QueueClient, S: DedupStore, H: Handler>(
    queue: Q,
    processor: Processor<S, H>,
    config: PollerConfig,
    shutdown: CancellationToken,
) -> RunStats {
    let processor = processor.dispatching_through(&queue);
    let (deletes, receipts) = mpsc::channel(PENDING_DELETES);
    let deleter = tokio::spawn(
        DeleteBatcher {
            queue: queue.clone(),
            url: config.queue_url.clone(),
            wait: config.batch_wait,
            receipts,
            payloads: processor.large_payloads().filter(|p| p.deletes()).cloned(),
            retries: TaskTracker::new(),
            calls: Arc::new(Semaphore::new(DELETE_CALLS_IN_FLIGHT)),
        }
        .run(),
    );
    let concurrency = config.concurrency.max(1);
    let capacity = concurrency + config.prefetch;
    let metrics = config
        .metrics_interval
        .map(|every| spawn_metrics(processor.clone(), every));
    let holding = Holding::default();
    let shared = Arc::new(Shared {
        settler: Settler::new(queue.clone(), config.dlq_url.as_deref()).holding(holding.clone()),
        holding,
        queue,
        processor,
        config,
        deletes,
        deletes_behind: AtomicBool::new(false),
        stop: CancellationToken::new(),
        ended: CancellationToken::new(),
        shutdown: shutdown.clone(),
        // (The `concurrency-unbounded` mutant, for the simulator only, lets
        // every message held run at once: `concurrency + prefetch`.)
        running: Arc::new(Semaphore::new(
            if crate::protocol::mutants::active("concurrency-unbounded") {
                capacity
            } else {
                concurrency
            },
        )),
        stats: Default::default(),
    });
    let tasks = ReceiveLoop {
        shared: shared.clone(),
        places: Arc::new(Semaphore::new(capacity)),
        capacity,
        tasks: TaskTracker::new(),
        shutdown,
        error_backoff: Duration::from_millis(200),
        idle_since: Instant::now(),
    }
    .run()
    .await;
    let cleanup_by = drain(&tasks, &shared.stop, shared.config.drain).await;
    // What the cleanup left running stops here, as after a crash: its claim
    // ends with its lease, its message comes back when its visibility ends.
    shared.ended.cancel();
    tasks.wait().await;
    if let Some(task) = metrics {
        task.abort();
        let consumer = &shared.processor.config().consumer;
        crate::protocol::metrics::print_emf(&shared.processor.metrics().take(), consumer);
    }
    let stats = shared.stats.lock().expect("stats lock").clone();
    // The last sender of finished receipts: the batcher flushes and ends.
    drop(shared);
    match tokio::time::timeout_at(cleanup_by, deleter).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %e, "delete task failed"),
        Err(_) => warn!(
            "the last deletes did not finish in time; those messages come back and are skipped as duplicates"
        ),
    }
    super::flush_spans().await;
    stats
}

/// Finished messages waiting for the [`DeleteBatcher`], at most (ten full
/// batches): beyond this, finishing handlers wait for room and keep their
/// slots, so receives stop until deletes catch up.
const PENDING_DELETES: usize = 10 * SQS_BATCH;

/// How long the deletes of one batch's large-payload objects may take.
const OBJECT_DELETE_TIME: Duration = Duration::from_secs(10);

/// How long releases and the last deletes may take after the drain.
pub const CLEANUP: Duration = Duration::from_secs(5);

#[cfg(test)]
#[path = "../poller_tests.rs"]
mod tests;
