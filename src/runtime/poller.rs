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
        // The lane keeper holds its lane's lock through an extension call:
        // one of this message on its way is counted toward the latest end
        // before the delete is handed over, and none starts after. Waited
        // for only until the delete must be sent: a call the SDK retries
        // can outlast a short visibility (simulator seed 309608: about 12 s
        // against a 10.6 s lease, the delete sent after the end). Past
        // that, the delete goes first, tried until the call on its way may
        // have ended and landed too, and the lock is asked for beside it
        // (granted in turn: before the keeper's next call, so none of those
        // includes this message, however long the hand-over waits for room).
        // At shutdown not waited for at all: the drain's time is short, and
        // a lane still waiting at the cleanup's end is dropped with its
        // delete (simulator seed 348641: the keeper's call went unanswered
        // through a drain, the message, completed on its last allowed
        // receive, was never deleted and reached the DLQ).
        let by = send_by_end(invisible_until);
        let keeper_on_its_way = tokio::select! {
            biased;
            locked = tokio::time::timeout_at(by, held.waiting.lock()) => match locked {
                Ok(mut w) => {
                    w.running = None;
                    false
                }
                Err(_) => true,
            },
            () = self.shutdown.cancelled() => true,
        };
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
        let deletes = async {
            // A newer delivery of the message reached this poller and came
            // back, let go: SQS may honour only its receipt, tried until
            // its own latest end.
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
        };
        let not_running = async {
            if keeper_on_its_way {
                held.waiting.lock().await.running = None;
            }
        };
        tokio::join!(deletes, not_running);
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

    /// Every heartbeat, extends the visibility of the lane's waiting messages,
    /// with the running one's, by the lease, and notes until when they are
    /// invisible. When extensions fail until the next one would come too late,
    /// the waiting messages are let go (dropped from the lane, not run): they
    /// reappear for another receive instead of running while another consumer
    /// may hold them. Never returns.
    async fn keep_waiting_invisible(&self, waiting: &Waiting, latest: &std::sync::Mutex<Instant>) {
        let config = self.processor.config();
        let interval = config.beat_for(config.lease);
        loop {
            tokio::time::sleep(interval).await;
            let mut w = waiting.lock().await;
            if w.messages.is_empty() {
                continue;
            }
            // The running message too, and in one call: the waiting ones must
            // never stay invisible longer than the one before them (a queue
            // that re-opens a group whenever one of its messages reappears
            // would otherwise hand out a later message first after a crash).
            let receipts: Vec<String> = w
                .running
                .iter()
                .cloned()
                .chain(
                    w.messages
                        .iter()
                        .filter_map(|m| m.receipt_handle().map(str::to_owned)),
                )
                .collect();
            let sent = Instant::now();
            let url = &self.config.queue_url;
            let running = w.running.as_deref();
            // Cut at `KEEPER_CALL_MAX` less a margin, whatever retries the
            // client is set for: a finished message's hand-over counts the
            // call on its way that long (a dropped call may land all the
            // same: counted below).
            let extended = tokio::time::timeout(
                KEEPER_CALL_MAX - Duration::from_secs(5),
                crate::runtime::extend_many(&self.queue, url, &receipts, running, config.lease),
            )
            .await
            .unwrap_or_default();
            // Even a call that failed may have landed (a timeout, a lost
            // answer): the failed deletes of these messages, the running one
            // included, are tried until then (`Held::invisible_at_most`).
            // One given up on may land later still (`LANDS_LATE`), even
            // where the singles after a batch call that timed out worked:
            // the batch's entry of the running message is not sent again
            // alone.
            let late = crate::runtime::visibility::LANDS_LATE;
            let mut l = latest.lock().unwrap_or_else(|e| e.into_inner());
            *l = (*l).max(Instant::now() + config.lease + late);
            drop(l);
            // A waiting message whose receipt SQS refused is another
            // delivery's now (received again, or visible again), whatever
            // the last extension promised: it is let go, not started, and
            // in a FIFO group those after it too (simulator seed 400349: a
            // lane trusted an extension that SQS had since overtaken,
            // started its message 26 s after another consumer had received
            // it, and the effect's delete through the stale receipt left
            // the message to reach the DLQ on its next receive).
            let refused = |m: &Message| {
                m.receipt_handle()
                    .is_some_and(|r| extended.refused.iter().any(|x| x == r))
            };
            let gone: Vec<Message> = if self.config.is_fifo() {
                match w.messages.iter().position(refused) {
                    Some(first) => w.messages.drain(first..).collect(),
                    None => Vec::new(),
                }
            } else {
                let (gone, kept) = std::mem::take(&mut w.messages)
                    .into_iter()
                    .partition(|m| refused(m));
                w.messages = kept;
                gone.into()
            };
            // Let go of in `holding` too: while held, a newer delivery of
            // one of them would set no retry delay.
            for m in &gone {
                self.holding.let_go_delivery(m);
            }
            let let_go = gone.len() as u64;
            if let_go > 0 {
                warn!(
                    messages = let_go,
                    "SQS refused to keep a waiting message invisible through its receipt (received again, or visible again); let go unprocessed"
                );
                self.count(|s| s.held_back += let_go);
            }
            if extended.all {
                // (Those refused are let go above.)
                // A message set again alone may end up to a second sooner
                // (its timeout is what was left, rounded down).
                w.invisible_until = sent + config.lease.saturating_sub(Duration::from_secs(1));
            } else if Instant::now() + interval >= w.invisible_until {
                let let_go = w.messages.len() as u64;
                w.messages.clear();
                warn!(
                    messages = let_go,
                    "waiting messages could not be kept invisible; let go unprocessed (they come back when their visibility ends)"
                );
                self.count(|s| s.held_back += let_go);
            }
        }
    }

    /// Before a waiting message starts: extends its visibility now unless the
    /// keeper's last extension still covers it until the processor's first
    /// heartbeat (with room to spare), so it never becomes visible while held.
    /// Answers until when it is known to stay invisible, or `None` when it
    /// could not be extended and its visibility has run out: it may be another
    /// consumer's now, and must not start.
    async fn cover_until_first_beat(
        &self,
        message: &Message,
        invisible_until: Instant,
        latest: &std::sync::Mutex<Instant>,
    ) -> Option<Instant> {
        let config = self.processor.config();
        let interval = config.beat_for(config.lease);
        if invisible_until > Instant::now() + interval + interval / 2 {
            return Some(invisible_until);
        }
        let Some(receipt) = message.receipt_handle() else {
            return Some(invisible_until);
        };
        let url = &self.config.queue_url;
        let sent = Instant::now();
        let changed = self
            .queue
            .change_visibility(url, receipt, config.lease)
            .await;
        // Even one that failed may have landed (`Held::invisible_at_most`),
        // later still (`LANDS_LATE`).
        let late = if changed.is_ok() {
            Duration::ZERO
        } else {
            crate::runtime::visibility::LANDS_LATE
        };
        let mut l = latest.lock().unwrap_or_else(|e| e.into_inner());
        *l = (*l).max(Instant::now() + config.lease + late);
        drop(l);
        match changed {
            Ok(()) => Some(invisible_until.max(sent + config.lease)),
            Err(e) => {
                // Its receipt refused: this delivery no longer holds the
                // message, however long it was covered.
                let covered = !e.is_receipt_refused() && invisible_until > Instant::now();
                warn!(message_id = message.id(), error = %e, covered, "could not extend a waiting message before it starts");
                covered.then_some(invisible_until)
            }
        }
    }
}

/// What the runtime knows of a message it holds, by this host's clock: when
/// the receive that delivered it was sent, and until when it stays invisible.
#[derive(Debug, Clone, Copy)]
struct Held<'a> {
    received_at: Instant,
    invisible_until: Instant,
    /// Until when, at the latest, the receive or the lane keeper's
    /// extensions may keep it invisible, read when its delete is handed
    /// over: the receive's answer's arrival plus the timeout asked for (SQS
    /// applied the receive somewhere between the send and the answer), and
    /// each extension's end, one that failed included (a timeout or a lost
    /// answer may have landed; simulator seed 259461: the keeper's call
    /// landed just before SQS went out of reach, and the delete's tries of
    /// the running message stopped before the end it set).
    invisible_at_most: &'a std::sync::Mutex<Instant>,
    /// The lane's messages not yet started, and its running one.
    waiting: &'a Waiting,
    /// What a transient failure of it becomes ([`Lane::on_retry`]).
    on_retry: OnRetry,
}

impl Held<'_> {
    /// Until when, at the latest, it may stay invisible, as it stands now.
    fn at_most(&self) -> Instant {
        *self
            .invisible_at_most
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// The messages of a lane not yet started (a FIFO message group, or the
/// copies of one dedup key, from one receive), and until when, by this host's
/// clock, all of them are known to stay invisible.
#[derive(Debug)]
struct Pending {
    messages: std::collections::VecDeque<Message>,
    /// The running message's receipt handle, extended with the waiting ones.
    running: Option<String>,
    invisible_until: Instant,
}

type Waiting = tokio::sync::Mutex<Pending>;

/// One lane of a receive, run by its own task: its messages one at a time in
/// order, each holding one of the places taken for the receive until it is
/// finished, the lane holding one running slot from its first start to its
/// end.
struct Lane<Q, S, H> {
    shared: Arc<Shared<Q, S, H>>,
    waiting: Waiting,
    /// When the receive was sent: SQS counts its 12-hour cap from it.
    received_at: Instant,
    /// Until when, at the latest, the receive or the keeper's extensions
    /// may keep the lane's messages invisible (`Held::invisible_at_most`).
    latest: std::sync::Mutex<Instant>,
    permits: Vec<OwnedSemaphorePermit>,
    fifo: bool,
    /// The lane's deliveries, let go from [`Shared::holding`] when the lane
    /// ends.
    _held: HeldBy,
}

/// Deliveries registered in a [`Holding`], let go when dropped.
struct HeldBy {
    holding: Holding,
    /// (message id, receipt handle) of each.
    deliveries: Vec<(String, String)>,
}

impl Drop for HeldBy {
    fn drop(&mut self) {
        for (id, receipt) in &self.deliveries {
            self.holding.let_go(id, receipt);
        }
    }
}

impl<Q: QueueClient, S: DedupStore, H: Handler> Lane<Q, S, H> {
    fn new(
        shared: Arc<Shared<Q, S, H>>,
        messages: Vec<Message>,
        permits: Vec<OwnedSemaphorePermit>,
        received_at: Instant,
    ) -> Self {
        let fifo = shared.config.is_fifo();
        // Received with the lease as their visibility timeout.
        let lease = shared.processor.config().lease;
        let invisible_until = received_at + lease;
        let held = HeldBy {
            holding: shared.holding.clone(),
            deliveries: messages
                .iter()
                .filter_map(|m| Some((m.id().to_owned(), m.receipt_handle()?.to_owned())))
                .collect(),
        };
        Self {
            _held: held,
            shared,
            received_at,
            waiting: tokio::sync::Mutex::new(Pending {
                messages: messages.into(),
                running: None,
                invisible_until,
            }),
            latest: std::sync::Mutex::new(Instant::now() + lease),
            permits,
            fifo,
        }
    }

    /// Runs the lane's messages in order while keeping the ones that wait
    /// invisible. On a FIFO queue a failure stops the lane: the rest come back
    /// unprocessed, a second before the failed message (or at once at
    /// shutdown); unless the failed message runs again in place
    /// ([`Self::on_retry`]).
    async fn run(mut self) {
        let permits = std::mem::take(&mut self.permits);
        // A lane of one message that gets its slot at once never has a
        // message waiting (the running one's visibility is its processor's
        // heartbeat's to keep): it runs without a keeper and its timer.
        let slot = if self.waiting.get_mut().messages.len() == 1 {
            self.shared.running.clone().try_acquire_owned().ok()
        } else {
            None
        };
        let alone = slot.is_some();
        // One work future in either case: each message's step is boxed
        // within it, so the lane's task stays small to spawn and move.
        let mut work = std::pin::pin!(self.work(slot, permits));
        if alone {
            return work.await;
        }
        tokio::select! {
            biased;
            () = &mut work => {}
            () = self.shared.keep_waiting_invisible(&self.waiting, &self.latest) => unreachable!("never returns"),
        }
    }

    /// Runs the lane in its running slot: `slot` when already taken, else
    /// taken here.
    async fn work(
        &self,
        slot: Option<OwnedSemaphorePermit>,
        mut permits: Vec<OwnedSemaphorePermit>,
    ) {
        // A lane that must wait for a slot at shutdown gives its messages
        // back at once; one that can start runs within the drain.
        let _slot = match slot {
            Some(slot) => slot,
            None => tokio::select! {
                biased;
                p = self.shared.running.clone().acquire_owned() => p.expect("semaphore open"),
                () = self.shared.shutdown.cancelled() => {
                    let messages: Vec<Message> = self.waiting.lock().await.messages.drain(..).collect();
                    Box::pin(give_back(&self.shared, messages, self.received_at)).await;
                    return;
                }
            },
        };
        // At shutdown the rest of the lane comes back at once.
        let mut rest_after = Duration::ZERO;
        // The attempts of the lane's first message run in place so far.
        let mut in_place = 0;
        while let Some((m, invisible_until)) = self.next().await {
            // A newer delivery of it reached this poller while it waited
            // (later in this lane, a twin, or in another): that one runs
            // it. This receipt may be stale, and the last extension
            // through it promises nothing (seed 400349). In a FIFO group
            // the rest of the lane goes too.
            if self.shared.holding.delivery_superseded(&m) {
                debug!(
                    message_id = m.id(),
                    "a waiting message was received again before it started; the newer delivery runs it"
                );
                self.waiting.lock().await.running = None;
                self.shared.count(|s| s.held_back += 1);
                // Let go now, not at the lane's end: while held it would
                // keep the newer delivery from setting its retry delay.
                self.shared.holding.let_go_delivery(&m);
                if self.fifo {
                    break;
                }
                permits.pop();
                continue;
            }
            let Some(invisible_until) = self
                .shared
                .cover_until_first_beat(&m, invisible_until, &self.latest)
                .await
            else {
                // Visible again, maybe received elsewhere: let it and the
                // rest of the lane go.
                self.waiting.lock().await.running = None;
                self.shared.count(|s| s.held_back += 1);
                break;
            };
            let mut first = self.fifo.then(|| m.clone());
            let held = Held {
                received_at: self.received_at,
                invisible_until,
                invisible_at_most: &self.latest,
                waiting: &self.waiting,
                on_retry: self.on_retry(&m, in_place).await,
            };
            // Boxed: the step's future is large (its nested awaits), and a
            // lane task that held it inline would be copied whole when
            // spawned (bench/RESULTS.md, 2026-12-05).
            let settled = Box::pin(self.shared.handle(m, held)).await;
            if let Settled::InPlace { after } = settled
                && let Some(first) = first.take()
            {
                // Its place is kept: it runs again.
                in_place += 1;
                match Box::pin(self.again_in_place(first, after)).await {
                    Some(rest) => {
                        rest_after = rest;
                        break;
                    }
                    None => continue,
                }
            }
            in_place = 0;
            self.waiting.lock().await.running = None;
            permits.pop();
            if let (Settled::Again { after: Some(after) }, Some(first)) = (settled, first) {
                rest_after = Box::pin(self.hold_rest(&first, after)).await;
                break;
            }
        }
        // Taken under the lock, so no extension of the keeper lands after this.
        let rest: Vec<Message> = self.waiting.lock().await.messages.drain(..).collect();
        for m in rest {
            self.shared.count(|s| s.held_back += 1);
            self.shared
                .retry_later(&m, rest_after, self.received_at)
                .await;
        }
    }

    /// After `first`, the lane's running message on a FIFO queue, failed
    /// with its delay `after` set: the delay for the rest of its group
    /// ([`hold_group`]).
    async fn hold_rest(&self, first: &Message, after: Duration) -> Duration {
        let more = !self.waiting.lock().await.messages.is_empty();
        let failed = Delivery {
            source: Some(self.shared.config.queue_url.as_str()),
            message: first,
            received_at: self.received_at,
            superseded: false,
            invisible_through: None,
        };
        hold_group(&self.shared.settler, failed, after, more).await
    }

    /// What a transient failure of `m`, the lane's next message, becomes,
    /// after `in_place` attempts of it run in place: on a FIFO queue with a
    /// DLQ and a known `maxReceiveCount`, the first message of a group with
    /// more of it waiting behind (or already run again in place) is run
    /// again in place, its group kept invisible, until its attempts
    /// (receives, and runs in place, counted in its receive count) reach
    /// `maxReceiveCount`: that last attempt's failure parks it, as SQS
    /// would move it at its next receive. The rest of its group then runs,
    /// none of it having spent a receive. Otherwise (and at shutdown) its
    /// delay is set: it comes back, the rest of its group with it.
    async fn on_retry(&self, m: &Message, in_place: u32) -> OnRetry {
        let config = &self.shared.config;
        let Some(max) = config.max_receive_count else {
            return OnRetry::SetDelay;
        };
        if !self.fifo || config.dlq_url.is_none() || self.shared.shutdown.is_cancelled() {
            return OnRetry::SetDelay;
        }
        if in_place == 0 && self.waiting.lock().await.messages.is_empty() {
            return OnRetry::SetDelay;
        }
        if m.receive_count() >= max {
            OnRetry::Park {
                attempt: m.receive_count(),
            }
        } else {
            OnRetry::InPlace
        }
    }

    /// `head`, the lane's first message, failed transiently and is to run
    /// again in place after `after`: it goes back to the front of the lane,
    /// its receive count one more (its backoff and its handler's count go
    /// on as if it had been received again), and waits, kept invisible
    /// with the rest by the lane keeper (which lets it go, and the rest
    /// with it, as it would any waiting message whose visibility it cannot
    /// keep). `None`: run it (the lane's next message). At shutdown, or
    /// when the wait would outlast SQS's 12 hours from the receive, it is
    /// handed back instead, with what is left of its delay:
    /// `Some(delay)` for the rest of its group, as after any failure.
    async fn again_in_place(&self, head: Message, after: Duration) -> Option<Duration> {
        let again = head.clone().with_receive_count(head.receive_count() + 1);
        {
            let mut w = self.waiting.lock().await;
            w.running = None;
            w.messages.push_front(again);
        }
        let lease = self.shared.processor.config().lease;
        let until = Instant::now() + after;
        let capped =
            crate::runtime::visibility::within_visibility_cap(after + lease, self.received_at)
                < after + lease;
        if !capped {
            tokio::select! {
                biased;
                () = self.shared.shutdown.cancelled() => {}
                () = tokio::time::sleep_until(until) => return None,
            }
        }
        // Still first, unless the keeper let the lane go.
        let (head, more) = {
            let mut w = self.waiting.lock().await;
            if w.messages.front().is_none_or(|m| m.id() != head.id()) {
                return None;
            }
            let head = w.messages.pop_front()?;
            (head, !w.messages.is_empty())
        };
        let left = until.saturating_duration_since(Instant::now());
        let (again, rest) = lanes::hold_behind(left, more);
        info!(
            message_id = head.id(),
            ?left,
            "a message run again in place is handed back (shutdown, or SQS's 12-hour cap)"
        );
        self.shared
            .retry_later(&head, again.unwrap_or(left), self.received_at)
            .await;
        if let Some(receipt) = head.receipt_handle() {
            let latest = *self.latest.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.holding.let_go_until(head.id(), receipt, latest);
        }
        Some(rest)
    }

    /// The next message to start, marked running, and until when it is known
    /// to be invisible; `None` when the lane is done or the poller stops.
    async fn next(&self) -> Option<(Message, Instant)> {
        let mut w = self.waiting.lock().await;
        if self.shared.stop.is_cancelled() {
            return None;
        }
        let next = w.messages.pop_front()?;
        w.running = next.receipt_handle().map(str::to_owned);
        Some((next, w.invisible_until))
    }
}

/// Gives back whatever a receive abandoned at shutdown returns: at once on a
/// standard queue. On a FIFO queue the first message of each group comes back
/// a second after the rest of its group: SQS blocks a group while any of its
/// messages is in flight, and an emulator that re-opens a group whenever one
/// of its messages reappears then still hands the group out in order.
async fn give_back_when_received<Q: QueueClient, S: DedupStore, H: Handler>(
    shared: Arc<Shared<Q, S, H>>,
    receive: tokio_util::task::AbortOnDropHandle<Result<Vec<Message>, QueueError>>,
    received_at: Instant,
) {
    let Ok(Ok(messages)) = receive.await else {
        return;
    };
    give_back(&shared, messages, received_at).await;
}

/// Gives back messages held but not started, at shutdown: at once on a
/// standard queue; on a FIFO queue each group's first message a second after
/// the rest of its group (see [`give_back_when_received`]).
async fn give_back<Q: QueueClient, S: DedupStore, H: Handler>(
    shared: &Shared<Q, S, H>,
    messages: Vec<Message>,
    received_at: Instant,
) {
    let fifo = shared.config.is_fifo();
    // Each group as if its first message had failed with no delay.
    let (first_after, rest_after) = lanes::hold_behind(Duration::ZERO, true);
    let mut groups = std::collections::HashSet::new();
    for m in messages {
        // A read per message that came back, bounded so that a slow
        // DynamoDB cannot hold the give-back (and its FIFO group) up.
        let found = if shared.stop.is_cancelled() {
            KeyFound::Unknown
        } else {
            tokio::time::timeout(GIVE_BACK_READ, shared.processor.before_giving_back(&m))
                .await
                .unwrap_or(KeyFound::Unknown)
        };
        if found == KeyFound::HeldElsewhere && !fifo {
            // Brought back at once it would spend a receive while the holder
            // runs (and, a twin delivery's copy, while the holder's own
            // delivery is still valid), on its last allowed receive moving
            // it to the DLQ as the holder completes (simulator seed 1533
            // with maxReceiveCount drawn). Left invisible, it comes back
            // when the visibility it was received with ends, as a duplicate
            // once the holder completes. (A FIFO group's messages come back
            // in order: there the rule below holds.)
            info!(
                message_id = m.id(),
                "not started before shutdown, its key in flight elsewhere: left invisible until its visibility ends"
            );
            shared.count(|s| s.held_back += 1);
            continue;
        }
        if found == KeyFound::Done {
            info!(
                message_id = m.id(),
                "not started before shutdown, but already completed: deleted instead of given back"
            );
            // Through the newest receipt too, as a finished delivery's.
            if let Some((newest, _)) = shared.holding.newest_let_go(&m) {
                shared
                    .to_delete(Finished {
                        receipt: newest,
                        payload: None,
                        invisible_until: Instant::now(),
                        retry_until: Instant::now(),
                    })
                    .await;
            }
            shared
                .to_delete(Finished {
                    receipt: m.receipt_handle().unwrap_or_default().to_owned(),
                    payload: None,
                    // Not known here: sent at once.
                    invisible_until: Instant::now(),
                    retry_until: Instant::now(),
                })
                .await;
            continue;
        }
        let after = match (fifo, m.group_id()) {
            (false, _) => Duration::ZERO,
            (true, g) if groups.insert(g.unwrap_or_default().to_owned()) => {
                first_after.unwrap_or_default()
            }
            (true, _) => rest_after,
        };
        info!(
            message_id = m.id(),
            ?after,
            "not started before shutdown; given back"
        );
        shared.count(|s| s.held_back += 1);
        shared.retry_later(&m, after, received_at).await;
    }
}

/// How long a drain waits for the record of a message it gives back.
const GIVE_BACK_READ: Duration = Duration::from_secs(2);

/// A finished message for the [`DeleteBatcher`]: its receipt handle, and its
/// large payload's object when that is to be deleted after it.
struct Finished {
    receipt: String,
    payload: Option<S3Pointer>,
    /// Until when, by this host's clock, the message is known to stay
    /// invisible: its delete must land before, or the receipt no longer
    /// deletes (and a message on its last allowed receive goes to the DLQ).
    invisible_until: Instant,
    /// Until when, at the latest, it may stay invisible: a failed delete is
    /// tried again until then (landing late costs nothing).
    retry_until: Instant,
}

/// Deletes finished messages in batches of up to 10, each entry with a unique
/// id; receipts repeated within a batch are sent once. A batch is sent when it
/// is full, `wait` after its first receipt, or as soon as one of its messages
/// has less than [`DELETE_RETRY_FOR`] of known visibility left (so its
/// delete and the retries of a failed one land before SQS can receive it
/// again: seed 114264, a commit that returned a second before the visibility
/// end, whose delete waited a second for its batch); when the channel
/// closes, what is pending is flushed. Its channel holds at most [`PENDING_DELETES`]: a full
/// one holds up the handlers that finish (see `Shared::to_delete`). The
/// batch calls run beside the loop, [`DELETE_CALLS_IN_FLIGHT`] at most. Failed
/// entries are deleted alone, beside the loop, transient failures tried
/// again until the message's visibility ends (at least [`DELETE_RETRY_FOR`],
/// see [`delete_retrying`]), then logged (the message then comes back and is
/// skipped as a duplicate). The large payloads of the messages deleted are
/// deleted after them.
struct DeleteBatcher<Q> {
    queue: Q,
    url: String,
    wait: Duration,
    receipts: mpsc::Receiver<Finished>,
    payloads: Option<LargePayloads>,
    /// The batch calls, the retries of failed deletes and the deletes of
    /// large-payload objects after them, run beside the loop.
    retries: TaskTracker,
    /// Slots for the batch calls in flight ([`DELETE_CALLS_IN_FLIGHT`]).
    calls: Arc<Semaphore>,
}

/// `DeleteMessageBatch` calls a poller has in flight at most.
const DELETE_CALLS_IN_FLIGHT: usize = 4;

impl<Q: QueueClient> DeleteBatcher<Q> {
    async fn run(mut self) {
        while let Some(first) = self.receipts.recv().await {
            let mut deadline = (Instant::now() + self.wait).min(send_by(&first));
            let mut batch = vec![first];
            // One timer per batch, moved sooner when a receipt needs it.
            let timer = tokio::time::sleep_until(deadline);
            tokio::pin!(timer);
            while batch.len() < SQS_BATCH && deadline > Instant::now() {
                let f = tokio::select! {
                    biased;
                    f = self.receipts.recv() => f,
                    () = &mut timer => None,
                };
                // Closed or timed out: send what we have.
                let Some(f) = f else { break };
                if batch.iter().any(|b| b.receipt == f.receipt) {
                    continue;
                }
                if send_by(&f) < deadline {
                    deadline = send_by(&f);
                    timer.as_mut().reset(deadline);
                }
                batch.push(f);
            }
            // The call itself runs beside the loop too, up to
            // [`DELETE_CALLS_IN_FLIGHT`] at once: one slow or silent
            // `DeleteMessageBatch` (up to `aws::sqs::CALL_ATTEMPT` per
            // attempt) must not hold up every batch behind it until their
            // messages' visibility runs out and they come back as
            // duplicates, each needing a delete of its own (simulator seed
            // 124531: a poller with a 10 s lease whose deletes fell behind
            // and never caught up). Waiting for a slot keeps the loop, and
            // through its channel the handlers, from running ahead.
            let slot = self
                .calls
                .clone()
                .acquire_owned()
                .await
                .unwrap_or_else(|_| unreachable!("the delete slots are never closed"));
            let (queue, url, payloads) =
                (self.queue.clone(), self.url.clone(), self.payloads.clone());
            self.retries
                .spawn(delete_batch(queue, url, payloads, batch, slot));
        }
        self.retries.close();
        self.retries.wait().await;
    }
}

/// One batch's delete ([`send_batch`]), then the retries of its failed
/// entries ([`delete_retrying`]), then the large-payload objects of the
/// messages deleted.
///
/// The batch call is given at most half the time left before its first
/// message's known visibility ends (at least [`BATCH_CALL_LEAST`]): an SDK
/// call tries again on its own, each attempt up to `aws::sqs::CALL_ATTEMPT`,
/// and two silent attempts can outlast the visibility, so the deletes one by
/// one would start only once the receipts no longer delete (simulator seed
/// 149049: a `DeleteMessageBatch` unanswered twice took 11 s of the 10.7 s
/// left, and a message on its last allowed receive went to the DLQ, effect
/// made). A call cut short that had landed costs nothing: the deletes one by
/// one of a deleted message succeed.
///
/// `slot` is held for the call, and, when the call was cut short (SQS not
/// answering), through the deletes one by one too: deletes that do not
/// answer must keep holding back receives, or the messages they should have
/// deleted come back while more are received
/// (`deletes_that_do_not_answer_stop_receives_and_every_effect_is_made_once`).
/// The retries after a call that answered, or failed at once (SQS out of
/// reach: the retries may go on for a while, and the next batches must not
/// wait for them), hold no slot, and neither does a slow S3 (an object left
/// behind only costs storage until the bucket's lifecycle rule).
async fn delete_batch<Q: QueueClient>(
    queue: Q,
    url: String,
    payloads: Option<LargePayloads>,
    batch: Vec<Finished>,
    slot: OwnedSemaphorePermit,
) {
    if crate::protocol::mutants::active("payload-deleted-first")
        && let Some(payloads) = &payloads
    {
        let objects = batch.iter().filter_map(|f| f.payload.clone()).collect();
        payloads.delete_objects(objects).await;
    }
    let first_end = batch.iter().map(|f| f.invisible_until).min();
    let bound = first_end.map_or(BATCH_CALL_LEAST, |end| {
        (end.saturating_duration_since(Instant::now()) / 2).max(BATCH_CALL_LEAST)
    });
    let undeleted = {
        let call = send_batch(&queue, &url, &batch);
        tokio::pin!(call);
        let (failed, slot, on_its_way) = match tokio::time::timeout(bound, call.as_mut()).await {
            Ok(failed) => {
                drop(slot);
                (failed, None, false)
            }
            Err(_) => {
                warn!(
                    ?bound,
                    "DeleteMessageBatch not answered in time; deleting one by one beside it"
                );
                ((0..batch.len()).collect(), Some(slot), true)
            }
        };
        let tries = failed.iter().filter_map(|&i| batch.get(i)).map(|f| {
                let (queue, url) = (&queue, url.as_str());
                async move {
                    match delete_retrying(queue, url, f).await {
                        Ok(()) => None,
                        Err(e) => {
                            error!(error = %e, "delete failed; the message will come back and be skipped as a duplicate");
                            Some(f.receipt.clone())
                        }
                    }
                }
            });
        let singles = futures::future::join_all(tries);
        tokio::pin!(singles);
        // A batch call not answered in time goes on beside the deletes one by
        // one until they end: slow, it may still land first (simulator seed
        // 286599: a call slowed past half of the 5.8 s left, then the single
        // delete slowed too, reached SQS after the visibility ended).
        let undeleted: Vec<String> = if on_its_way {
            tokio::select! {
                biased;
                u = &mut singles => u,
                _ = &mut call => singles.await,
            }
        } else {
            singles.await
        }
        .into_iter()
        .flatten()
        .collect();
        drop(slot);
        undeleted
    };
    let Some(payloads) = payloads else {
        return;
    };
    let objects = batch
        .into_iter()
        .filter(|f| !undeleted.contains(&f.receipt))
        .filter_map(|f| f.payload)
        .collect::<Vec<_>>();
    if objects.is_empty() {
        return;
    }
    let deleting = payloads.delete_objects(objects);
    if tokio::time::timeout(OBJECT_DELETE_TIME, deleting)
        .await
        .is_err()
    {
        warn!(
            ?OBJECT_DELETE_TIME,
            "large-payload objects not deleted in time; left to the bucket's lifecycle rule"
        );
    }
}

/// The least time a `DeleteMessageBatch` call is given (see [`delete_batch`]).
const BATCH_CALL_LEAST: Duration = Duration::from_secs(1);

/// Deletes the messages in one call; returns those whose delete failed
/// (the whole call, or their entries) by their place in `batch`, to be
/// tried again alone.
async fn send_batch<Q: QueueClient>(queue: &Q, url: &str, batch: &[Finished]) -> Vec<usize> {
    let receipts: Vec<String> = batch.iter().map(|f| f.receipt.clone()).collect();
    match queue.delete_batch(url, &receipts).await {
        Ok(failed) => failed
            .iter()
            .map(|f| {
                warn!(code = f.code, message = ?f.message, "delete failed in batch");
                f.index
            })
            .collect(),
        Err(e) => {
            warn!(error = %e, "DeleteMessageBatch failed; deleting one by one");
            (0..batch.len()).collect()
        }
    }
}

/// Deletes one message, trying transient failures again with backoff (at
/// most [`DELETE_RETRY_PAUSE`] apart) for [`DELETE_RETRY_FOR`] or until its
/// visibility may end at the latest, whichever is later: a message on its last allowed
/// receive that is not deleted goes to the DLQ at the next receive, its
/// effect made, and a delete that lands while the receipt still holds the
/// message keeps it out (simulator seed 112055: SQS out of reach for 38 s
/// while the message stayed invisible for 45 s; the retries had stopped
/// after 10 s; and, with `maxReceiveCount` drawn, seed 530: a long poll
/// answered 17 s after it was sent, so the visibility known from its send
/// ended before SQS's did, and before SQS was within reach again).
async fn delete_retrying<Q: QueueClient>(
    queue: &Q,
    url: &str,
    finished: &Finished,
) -> Result<(), QueueError> {
    let give_up = (Instant::now() + DELETE_RETRY_FOR).max(finished.retry_until);
    let mut pause = Duration::from_millis(250);
    // The tries on their way: one not answered in `DELETE_TRY` gets
    // another beside it (at most `DELETE_TRIES_AT_ONCE`; see there), and
    // the first to succeed ends the delete. With none to start, those on
    // their way are waited for, however long: deletes that SQS does not
    // answer hold back the receives.
    use futures::StreamExt as _;
    let mut tries = futures::stream::FuturesUnordered::new();
    let mut next_try = Instant::now();
    let mut last_sent = Instant::now();
    loop {
        let time_left = Instant::now() + DELETE_RETRY_LAST < give_up;
        let due = time_left && tries.len() < DELETE_TRIES_AT_ONCE && Instant::now() >= next_try;
        if tries.is_empty() || due {
            tries.push(queue.delete(url, &finished.receipt));
            last_sent = Instant::now();
            next_try = last_sent + beside_after(finished.invisible_until);
        }
        let another = time_left && tries.len() < DELETE_TRIES_AT_ONCE;
        let answer = tokio::select! {
            biased;
            Some(answer) = tries.next() => answer,
            () = tokio::time::sleep_until(next_try), if another => continue,
        };
        match answer {
            Ok(()) => return Ok(()),
            Err(e) if !tries.is_empty() => {
                tracing::debug!(error = %e, "a delete try failed; another is on its way");
            }
            Err(e) if e.is_transient() && Instant::now() + DELETE_RETRY_LAST < give_up => {
                warn!(error = %e, "delete failed; trying again");
                // Never a pause that runs past the last chance: near the
                // end of the visibility the pauses shorten (half of what is
                // left), so a delete is still tried once SQS is in reach
                // again before the message can be received (simulator seed
                // 126236: a 4 s pause from 1.3 s before the end gave up on a
                // message on its last allowed receive while SQS was back).
                // The same toward the known end of its visibility while
                // that is ahead (the likeliest end: tries come close to it
                // there too, then go on to the latest; seed 294007, where
                // 4 s pauses toward a later latest end left the last
                // stretch before the known end untried).
                let left = give_up.saturating_duration_since(Instant::now());
                let known = finished
                    .invisible_until
                    .saturating_duration_since(Instant::now());
                let room = if known > DELETE_RETRY_LAST {
                    known.min(left)
                } else {
                    left
                };
                let mut wait = pause.min(room / 2);
                // Within `DELETE_RETRY_LAST` of the known end, or past it,
                // SQS's own may come at any moment until the latest: after a failed try the next is
                // sent within `DELETE_RETRY_PAST_KNOWN` of the last one's
                // send (one cut off by a connect timeout is followed at
                // once; one not answered gets another beside it after
                // `DELETE_TRY`), so SQS back in reach is found soon (seed
                // 564057: a 4 s pause after a try cut off in a 30 s cut
                // stepped over the 1.5 s between the cut's end and SQS's
                // end of a message on its last allowed receive).
                if known <= DELETE_RETRY_LAST {
                    let since = last_sent.elapsed();
                    wait = wait.min(DELETE_RETRY_PAST_KNOWN.saturating_sub(since));
                }
                tokio::time::sleep(wait).await;
                pause = (pause * 2).min(DELETE_RETRY_PAUSE);
            }
            Err(e) => return Err(e),
        }
    }
}

/// How long one try of a failed message's delete goes unanswered before
/// another is sent beside it: a call started while SQS was out of reach
/// spends the client's own attempts and backoff, each attempt up to a
/// connect timeout, and near the visibility's end a new call lands sooner
/// than that call's retry (simulator seed 391853, wire path: a try sent 1 s
/// before a 37 s cut from SQS ended answered 6 s later, its retry inside
/// the client reaching SQS 0.2 s after the visibility had ended; the
/// message, on its last allowed receive, went to the DLQ, its effect
/// recorded). The slow try is kept (a slow SQS may still answer it first);
/// a delete twice is harmless.
const DELETE_TRY: Duration = Duration::from_secs(2);

/// How long a delete try goes unanswered before another is sent beside it:
/// [`DELETE_TRY`], or half of what is left of the message's known
/// visibility where that is less, and no less than [`DELETE_TRY_NEAR_END`]
/// (simulator seed 932779: a try sent 1.7 s before the end of a message on
/// its last allowed receive, after a batch call sent into a cut from SQS
/// had failed, went unanswered, and the next was sent only when the client
/// gave up on it, 1.8 s later, reaching SQS after the end).
fn beside_after(invisible_until: Instant) -> Duration {
    let known = invisible_until.saturating_duration_since(Instant::now());
    DELETE_TRY.min((known / 2).max(DELETE_TRY_NEAR_END))
}

/// The least time a delete try goes unanswered before another is sent
/// beside it (see [`beside_after`]).
const DELETE_TRY_NEAR_END: Duration = Duration::from_millis(250);

/// Delete tries of one message on their way at most ([`DELETE_TRY`]).
const DELETE_TRIES_AT_ONCE: usize = 3;

/// The least time before a failed delete's last chance for which it is
/// still tried again.
const DELETE_RETRY_LAST: Duration = Duration::from_millis(200);

/// The longest pause between two tries of a failed delete.
const DELETE_RETRY_PAUSE: Duration = Duration::from_secs(4);

/// The longest time between two tries' sends of a failed delete once its
/// known visibility end has passed (see [`delete_retrying`]).
const DELETE_RETRY_PAST_KNOWN: Duration = Duration::from_secs(1);

/// How long a failed delete is tried again (transient failures).
const DELETE_RETRY_FOR: Duration = Duration::from_secs(10);

/// The latest a finished message's delete is sent: [`DELETE_RETRY_FOR`]
/// before its known visibility ends (at once when that has passed).
fn send_by(f: &Finished) -> Instant {
    send_by_end(f.invisible_until)
}

/// [`send_by`] for a message known to stay invisible until `end`.
fn send_by_end(end: Instant) -> Instant {
    end.checked_sub(DELETE_RETRY_FOR).unwrap_or(end)
}

/// How long a lane keeper's extension call may take, counted toward a
/// finished message's latest end when its delete is handed over while that
/// call is on its way: a batch call and single calls after it, each up to
/// three attempts of 5 s (the SQS adapter's) and their pauses. The keeper
/// drops a call still on its way 5 s before, whatever the client's retries.
const KEEPER_CALL_MAX: Duration = Duration::from_secs(40);

/// What one turn of the receive loop got.
enum Received {
    /// Messages, with the places held for them and when the receive was sent.
    Messages(Vec<Message>, Vec<OwnedSemaphorePermit>, Instant),
    /// Nothing: a long poll that timed out, or a failure already waited out.
    Nothing,
    /// Stop receiving: shutdown, or idle as configured.
    Stop,
}

/// The receive loop: takes free places, receives as many messages, and
/// starts one task per lane.
struct ReceiveLoop<Q, S, H> {
    shared: Arc<Shared<Q, S, H>>,
    /// One permit per message held, received and not yet finished.
    places: Arc<Semaphore>,
    /// `concurrency + prefetch`: the places.
    capacity: usize,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    error_backoff: Duration,
    idle_since: Instant,
}

impl<Q: QueueClient, S: DedupStore, H: Handler> ReceiveLoop<Q, S, H> {
    async fn run(mut self) -> TaskTracker {
        loop {
            self.beat();
            match self.turn().await {
                Received::Messages(messages, held, received_at) => {
                    self.start_lanes(messages, held, received_at);
                    self.idle_since = Instant::now();
                }
                Received::Nothing => {}
                Received::Stop => return self.tasks,
            }
        }
    }

    /// [`BEAT_WHILE_FULL`] from now with a liveness to beat, else never.
    async fn beat_while_full(&self) {
        if self.shared.config.liveness.is_some() {
            tokio::time::sleep(BEAT_WHILE_FULL).await;
        } else {
            std::future::pending::<()>().await;
        }
    }

    fn beat(&self) {
        if let Some(liveness) = &self.shared.config.liveness {
            liveness.beat();
        }
    }

    async fn turn(&mut self) -> Received {
        let Some(held) = self.free_places().await else {
            return Received::Stop;
        };
        self.receive(held).await
    }

    /// Waits until one more message can be held, then up to `batch_wait` for
    /// room to hold a full batch (ten, or all the places if fewer). With
    /// `prefetch` of ten or more, a slot can only idle (no message waiting
    /// for it) once eleven places are free, so the wait never leaves a slot
    /// idle: the received batch waits for slots instead, and each receive
    /// brings ten. `None` at shutdown.
    async fn free_places(&self) -> Option<Vec<OwnedSemaphorePermit>> {
        let acquire = self.places.clone().acquire_owned();
        tokio::pin!(acquire);
        let first = loop {
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => return None,
                p = &mut acquire => break p.expect("semaphore open"),
                // Every place held: the loop waits for running handlers, alive.
                // (No timer at all without a liveness to beat.)
                () = self.beat_while_full() => self.beat(),
            }
        };
        // The rest of the batch in one wait (not one wake-up per place
        // freed); at `fill_by`, whatever is free.
        let more = self.capacity.min(SQS_BATCH) - 1;
        let fill_by = Instant::now() + self.shared.config.batch_wait;
        let all = self.places.clone().acquire_many_owned(more as u32);
        let mut rest = tokio::select! {
            biased;
            () = self.shutdown.cancelled() => return None,
            p = tokio::time::timeout_at(fill_by, all) => match p {
                Ok(p) => Some(p.expect("semaphore open")),
                Err(_) => {
                    let free = self.places.available_permits().min(more);
                    self.places.clone().try_acquire_many_owned(free as u32).ok()
                }
            },
        };
        let mut held = vec![first];
        while let Some(p) = rest.as_mut().and_then(|r| r.split(1)) {
            held.push(p);
        }
        Some(held)
    }

    /// One receive for the places held. What is received stays invisible for
    /// a lease (whatever the queue's own visibility timeout), so the heartbeat,
    /// at most half a lease, always extends it in time.
    async fn receive(&mut self, held: Vec<OwnedSemaphorePermit>) -> Received {
        let config = &self.shared.config;
        let wait = match config.exit_when_idle {
            Some(idle) => config.wait_time.min(idle).max(Duration::from_secs(1)),
            None => config.wait_time,
        };
        let request = ReceiveRequest {
            max: held.len(),
            wait,
            visibility: self.shared.processor.config().lease,
        };
        let received_at = Instant::now();
        let (queue, url) = (self.shared.queue.clone(), config.queue_url.clone());
        // Aborted if dropped: a receive still open when `run` returns takes
        // nothing more.
        let mut receive = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            queue.receive(&url, request).await
        }));
        let out = tokio::select! {
            biased;
            r = &mut receive => r.expect("the receive task does not panic"),
            () = self.shutdown.cancelled() => {
                // The receive may already have taken messages: give them back
                // as soon as it answers (within the drain), rather than leave
                // them (and their FIFO groups) invisible.
                let giving_back = give_back_when_received(self.shared.clone(), receive, received_at);
                self.tasks.spawn(self.shared.ended.clone().run_until_cancelled_owned(giving_back));
                return Received::Stop;
            }
        };
        match out {
            Ok(messages) if messages.is_empty() => self.nothing_received(held.len()),
            Ok(messages) => {
                self.error_backoff = Duration::from_millis(200);
                Received::Messages(messages, held, received_at)
            }
            Err(e) => self.back_off(e).await,
        }
    }

    /// An empty receive: stop if idle as configured, else go on.
    fn nothing_received(&mut self, held: usize) -> Received {
        self.error_backoff = Duration::from_millis(200);
        self.shared.count(|s| s.empty_receives += 1);
        if let Some(idle) = self.shared.config.exit_when_idle
            && self.places.available_permits() + held == self.capacity
            && self.idle_since.elapsed() >= idle
        {
            info!("idle; exiting as configured");
            return Received::Stop;
        }
        Received::Nothing
    }

    /// A failed receive: wait, doubling the wait up to 20 s.
    async fn back_off(&mut self, e: QueueError) -> Received {
        warn!(error = %e, retry_in = ?self.error_backoff, "receive failed; backing off");
        tokio::select! {
            biased;
            () = self.shutdown.cancelled() => return Received::Stop,
            () = tokio::time::sleep(self.error_backoff) => {}
        }
        self.error_backoff = (self.error_backoff * 2).min(Duration::from_secs(20));
        Received::Nothing
    }

    /// One task per lane, messages in receive order within it: on a FIFO
    /// queue a lane is a message group (stopped by a failure); on a standard
    /// queue it is a dedup key, so a duplicate within one receive runs after
    /// the first copy and is skipped instead of found in flight.
    fn start_lanes(
        &self,
        messages: Vec<Message>,
        mut held: Vec<OwnedSemaphorePermit>,
        received_at: Instant,
    ) {
        self.shared.count(|s| s.received += messages.len() as u64);
        let queue = crate::protocol::trace::queue_name(&self.shared.config.queue_url);
        let keys = self.shared.processor.config();
        // (The `fifo-parallel` mutant, for the chaos harness only, runs a
        // FIFO group's messages in parallel.)
        let by_group =
            self.shared.config.is_fifo() && !crate::protocol::mutants::active("fifo-parallel");
        // A standard queue's lanes are keys: each is read here once, and the
        // processor takes it as read (the same message, the same key).
        let messages: Vec<Message> = messages
            .into_iter()
            .map(|m| {
                let m = m.with_queue(queue);
                if by_group {
                    m
                } else {
                    lanes::with_key(m, keys)
                }
            })
            .collect();
        let _receive = crate::protocol::trace::receive_span(queue, &messages).entered();
        // Before any lane runs: an older delivery of one of these messages
        // held here leaves its visibility to the newer one from now on.
        let lease = self.shared.processor.config().lease;
        for m in &messages {
            self.shared.holding.received(m, lease);
        }
        for lane in lanes::split(messages, |m| lanes::lane_of(m, by_group, keys)) {
            let permits: Vec<_> = held.drain(..lane.len().min(held.len())).collect();
            let lane = Lane::new(self.shared.clone(), lane, permits, received_at);
            self.tasks.spawn(lane_task(lane));
        }
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
#[path = "poller_tests.rs"]
mod tests;
