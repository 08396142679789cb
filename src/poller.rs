//! The long-polling runtime (ECS or any host): receive, process, delete.
//!
//! # Backpressure
//! At most `concurrency` messages are in flight. The poller receives only as many
//! messages as it has free slots. What it receives is made invisible for a
//! lease (whatever the queue's visibility timeout), and messages of one receive
//! that must wait for their turn (behind an earlier message of their FIFO
//! group, or of their dedup key) are extended every heartbeat while they wait,
//! and before they start if need be, so none becomes visible again while this
//! poller still holds it.
//!
//! # Shutdown
//! [`run`] takes a [`CancellationToken`]; only binaries know about signals. When
//! it is cancelled the poller stops receiving, lets running handlers finish
//! within the drain deadline, interrupts and releases the rest (their messages
//! become visible again at once), flushes pending deletes and returns.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageSystemAttributeName, QueueAttributeName};
use aws_smithy_types::error::display::DisplayErrorContext;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::dedup::DedupStore;
use crate::processor::ProcessOptions;
use crate::{Handler, Message, Outcome, Processor};

/// Settings of the long-polling runtime.
#[derive(Debug, Clone)]
pub struct PollerConfig {
    /// The source queue (`SQS_ONCE_QUEUE_URL`).
    pub queue_url: String,
    /// Where permanent failures are parked (`SQS_ONCE_DLQ_URL`). Without one, a
    /// permanent failure is retried until the queue's redrive policy parks it.
    pub dlq_url: Option<String>,
    /// Messages in flight at most (`SQS_ONCE_CONCURRENCY`, default 10).
    pub concurrency: usize,
    /// Long-poll wait (default 20 s).
    pub wait_time: Duration,
    /// How long in-flight work may finish after shutdown (`SQS_ONCE_DRAIN`,
    /// default 20 s); releases and the last deletes then get [`CLEANUP`] (5 s)
    /// more at most, so a stop takes under 25 s, below ECS's 30 s stop timeout.
    pub drain: Duration,
    /// Return once nothing was received for this long and nothing is in flight
    /// (`SQS_ONCE_EXIT_WHEN_IDLE`; for batch jobs, demos and tests).
    pub exit_when_idle: Option<Duration>,
    /// How long to wait to fill a batch of 10 (`SQS_ONCE_BATCH_WAIT`, default
    /// 1 s): a receive waits this long for ten free slots once one is free, and a
    /// delete this long for ten receipts once one is pending. Batches of ten make
    /// receive and delete cost 0.1 calls per message each.
    pub batch_wait: Duration,
    /// Print the processor's counters as EMF lines on stdout this often, and
    /// once at exit (`SQS_ONCE_METRICS_INTERVAL`; the binaries default to 60 s).
    pub metrics_interval: Option<Duration>,
}

impl PollerConfig {
    /// Defaults for a queue.
    pub fn new(queue_url: impl Into<String>) -> Self {
        Self {
            queue_url: queue_url.into(),
            dlq_url: None,
            concurrency: 10,
            wait_time: Duration::from_secs(20),
            drain: Duration::from_secs(20),
            exit_when_idle: None,
            batch_wait: Duration::from_secs(1),
            metrics_interval: None,
        }
    }

    /// Whether the queue is FIFO (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.queue_url.ends_with(".fifo")
    }
}

/// What a poller run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// group, or received but not started before shutdown.
    pub held_back: u64,
}

/// The queue could not be read at start-up.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct QueueCheckError {
    /// What went wrong, naming the setting.
    pub message: String,
    /// Whether it may pass when tried again (no answer, throttled, 5xx).
    pub transient: bool,
}

impl QueueCheckError {
    /// Whether the check may pass when tried again (no answer, throttled, 5xx).
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

/// Reads the queue's attributes and warns about settings that defeat the
/// protocol: a visibility timeout below the heartbeat, a retention longer than
/// the records are kept.
pub async fn check_queue(
    sqs: &Client,
    queue_url: &str,
    heartbeat: Duration,
    ttl: Duration,
) -> Result<(), QueueCheckError> {
    let out = sqs
        .get_queue_attributes()
        .queue_url(queue_url)
        .attribute_names(QueueAttributeName::VisibilityTimeout)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .send()
        .await
        .map_err(|e| QueueCheckError {
            transient: crate::aws::is_transient(&e),
            message: format!(
                "cannot read queue {queue_url} (setting SQS_ONCE_QUEUE_URL): {}",
                DisplayErrorContext(e)
            ),
        })?;
    let attrs = out.attributes.unwrap_or_default();
    let secs = |n: QueueAttributeName| {
        attrs
            .get(&n)
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_secs)
    };
    if let Some(vis) = secs(QueueAttributeName::VisibilityTimeout)
        && vis <= heartbeat
    {
        warn!(
            visibility_timeout = ?vis, ?heartbeat,
            "the queue's visibility timeout is not above the heartbeat interval: messages may be redelivered while their handler runs (lower SQS_ONCE_HEARTBEAT or raise the queue's VisibilityTimeout)"
        );
    }
    if let Some(retention) = secs(QueueAttributeName::MessageRetentionPeriod)
        && retention >= ttl
    {
        warn!(
            ?retention,
            ?ttl,
            "SQS_ONCE_TTL is not longer than the queue's retention: a message redelivered late could be processed again"
        );
    }
    Ok(())
}

/// Converts a received SQS message (received with all system and message
/// attributes); `None` (logged) for one without id or receipt handle.
pub fn to_message(m: aws_sdk_sqs::types::Message) -> Option<Message> {
    let (Some(id), Some(receipt)) = (m.message_id, m.receipt_handle) else {
        error!("received a message without id or receipt handle; left to its visibility timeout");
        return None;
    };
    let sys = m.attributes.unwrap_or_default();
    let mut msg = Message::new(id, m.body.unwrap_or_default()).with_receipt_handle(receipt);
    if let Some(n) = sys
        .get(&MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|v| v.parse().ok())
    {
        msg = msg.with_receive_count(n);
    }
    if let Some(g) = sys.get(&MessageSystemAttributeName::MessageGroupId) {
        msg = msg.with_group_id(g);
    }
    if let Some(d) = sys.get(&MessageSystemAttributeName::MessageDeduplicationId) {
        msg = msg.with_deduplication_id(d);
    }
    for (name, value) in m.message_attributes.unwrap_or_default() {
        let binary = value.binary_value.map(|b| b.into_inner());
        msg = msg.with_received_attribute(name, value.data_type, value.string_value, binary);
    }
    Some(msg)
}

struct Shared<S, H> {
    sqs: Client,
    processor: Processor<S, H>,
    config: PollerConfig,
    dlq: Option<crate::sqs::Dlq>,
    deletes: mpsc::UnboundedSender<String>,
    stop: CancellationToken,
    stats: std::sync::Mutex<RunStats>,
}

impl<S: DedupStore, H: Handler> Shared<S, H> {
    fn count(&self, f: impl FnOnce(&mut RunStats)) {
        f(&mut self.stats.lock().expect("stats lock"));
    }

    /// Processes one message and acts on the outcome: `None` when it is finished
    /// with, else the delay after which it comes back.
    async fn handle(&self, message: Message) -> Option<Duration> {
        let visibility = crate::sqs::SqsVisibility {
            sqs: self.sqs.clone(),
            queue_url: self.config.queue_url.clone(),
        };
        let outcome = self
            .processor
            .process_with(
                message.clone(),
                ProcessOptions {
                    visibility: Some(&visibility),
                    deadline: None,
                    stop: Some(self.stop.clone()),
                },
            )
            .await;
        match &outcome {
            Outcome::Completed { .. } => self.count(|s| s.completed += 1),
            Outcome::Duplicate { .. } => self.count(|s| s.duplicates += 1),
            Outcome::InFlight { .. } => self.count(|s| s.in_flight += 1),
            Outcome::Retry { .. } => self.count(|s| s.retried += 1),
            Outcome::Park { .. } => {}
        }
        match outcome {
            Outcome::Completed { .. } | Outcome::Duplicate { .. } => {
                let _ = self
                    .deletes
                    .send(message.receipt_handle().unwrap_or_default().to_owned());
                None
            }
            Outcome::Park { reason } => self.park(&message, &reason).await,
            Outcome::InFlight { retry_after } => {
                self.retry_later(&message, retry_after).await;
                Some(retry_after)
            }
            Outcome::Retry { after, reason } => {
                info!(message_id = message.id(), %reason, ?after, "will retry");
                self.retry_later(&message, after).await;
                Some(after)
            }
        }
    }

    /// Every heartbeat, extends the visibility of the lane's waiting messages,
    /// with the running one's, by the lease, and notes until when they are
    /// invisible. Never returns.
    async fn keep_waiting_invisible(&self, waiting: &Waiting) {
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
            let sent = tokio::time::Instant::now();
            if crate::sqs::extend_many(&self.sqs, &self.config.queue_url, &receipts, config.lease)
                .await
            {
                w.invisible_until = sent + config.lease;
            }
        }
    }

    /// Before a waiting message starts: extends its visibility now unless the
    /// keeper's last extension still covers it until the processor's first
    /// heartbeat (with room to spare), so it never becomes visible while held.
    async fn cover_until_first_beat(
        &self,
        message: &Message,
        invisible_until: tokio::time::Instant,
    ) {
        let config = self.processor.config();
        let interval = config.beat_for(config.lease);
        if invisible_until > tokio::time::Instant::now() + interval + interval / 2 {
            return;
        }
        if let Some(receipt) = message.receipt_handle()
            && let Err(e) =
                crate::sqs::set_visibility(&self.sqs, &self.config.queue_url, receipt, config.lease)
                    .await
        {
            warn!(message_id = message.id(), error = %e, "could not extend a waiting message before it starts");
        }
    }

    async fn retry_later(&self, message: &Message, after: Duration) {
        crate::sqs::retry_later(&self.sqs, &self.config.queue_url, message, after).await;
    }

    /// Sends the message with its reason to the DLQ, then deletes it.
    async fn park(&self, message: &Message, reason: &str) -> Option<Duration> {
        let Some(dlq) = &self.dlq else {
            error!(message_id = message.id(), %reason, "permanent failure but no SQS_ONCE_DLQ_URL: retried until the queue's redrive policy parks it");
            let delay = self.processor.config().backoff_max;
            self.retry_later(message, delay).await;
            return Some(delay);
        };
        let key = self.processor.config().key_source.extract(message).ok();
        match dlq.park(message, reason, key.as_deref()).await {
            Ok(()) => {
                warn!(message_id = message.id(), %reason, dlq = dlq.url(), "parked in the DLQ");
                self.count(|s| s.parked += 1);
                let _ = self
                    .deletes
                    .send(message.receipt_handle().unwrap_or_default().to_owned());
                None
            }
            Err(e) => {
                error!(error = %e, "could not park the message; it comes back");
                let delay = self.processor.config().backoff(message.receive_count());
                self.retry_later(message, delay).await;
                Some(delay)
            }
        }
    }
}

/// The messages of a lane not yet started (a FIFO message group, or the
/// copies of one dedup key, from one receive), and until when, by this host's
/// clock, all of them are known to stay invisible.
struct Pending {
    messages: std::collections::VecDeque<Message>,
    /// The running message's receipt handle, extended with the waiting ones.
    running: Option<String>,
    invisible_until: tokio::time::Instant,
}

type Waiting = tokio::sync::Mutex<Pending>;

/// Runs a lane's messages in order while keeping the ones that wait invisible.
/// On a FIFO queue a failure stops the lane: the rest come back unprocessed,
/// a second before the failed message (or at once at shutdown).
async fn run_lane<S: DedupStore, H: Handler>(
    shared: Arc<Shared<S, H>>,
    lane: Vec<Message>,
    mut permits: Vec<tokio::sync::OwnedSemaphorePermit>,
    fifo: bool,
    received_at: tokio::time::Instant,
) {
    let waiting: Waiting = tokio::sync::Mutex::new(Pending {
        messages: lane.into(),
        running: None,
        // Received with the lease as their visibility timeout.
        invisible_until: received_at + shared.processor.config().lease,
    });
    let work = async {
        // At shutdown the rest of the lane comes back at once.
        let mut rest_after = Duration::ZERO;
        loop {
            let next = {
                let mut w = waiting.lock().await;
                if shared.stop.is_cancelled() {
                    None
                } else {
                    let next = w.messages.pop_front();
                    w.running = next
                        .as_ref()
                        .and_then(|m| m.receipt_handle().map(str::to_owned));
                    next.map(|m| (m, w.invisible_until))
                }
            };
            let Some((m, invisible_until)) = next else {
                break;
            };
            shared.cover_until_first_beat(&m, invisible_until).await;
            let first = fifo.then(|| m.clone());
            let failed = shared.handle(m).await;
            waiting.lock().await.running = None;
            permits.pop();
            if let (Some(delay), Some(first)) = (failed, first) {
                let more = !waiting.lock().await.messages.is_empty();
                let (again, rest) = crate::lanes::hold_behind(delay, more);
                if let Some(again) = again {
                    shared.retry_later(&first, again).await;
                }
                rest_after = rest;
                break;
            }
        }
        // Taken under the lock, so no extension of the keeper lands after this.
        let rest: Vec<Message> = waiting.lock().await.messages.drain(..).collect();
        for m in rest {
            shared.count(|s| s.held_back += 1);
            shared.retry_later(&m, rest_after).await;
        }
    };
    tokio::select! {
        () = work => {}
        () = shared.keep_waiting_invisible(&waiting) => unreachable!("never returns"),
    }
}

/// Gives back whatever a receive abandoned at shutdown returns: at once on a
/// standard queue. On a FIFO queue the first message of each group comes back
/// a second after the rest of its group: SQS blocks a group while any of its
/// messages is in flight, and an emulator that re-opens a group whenever one
/// of its messages reappears then still hands the group out in order.
async fn give_back_when_received<S: DedupStore, H: Handler>(
    shared: Arc<Shared<S, H>>,
    receive: tokio::task::JoinHandle<
        Result<
            aws_sdk_sqs::operation::receive_message::ReceiveMessageOutput,
            aws_sdk_sqs::error::SdkError<
                aws_sdk_sqs::operation::receive_message::ReceiveMessageError,
                aws_smithy_runtime_api::client::orchestrator::HttpResponse,
            >,
        >,
    >,
) {
    let Ok(Ok(out)) = receive.await else { return };
    let fifo = shared.config.is_fifo();
    // Each group as if its first message had failed with no delay.
    let (first_after, rest_after) = crate::lanes::hold_behind(Duration::ZERO, true);
    let mut groups = std::collections::HashSet::new();
    for m in out
        .messages
        .unwrap_or_default()
        .into_iter()
        .filter_map(to_message)
    {
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
            "received while stopping; given back"
        );
        shared.count(|s| s.held_back += 1);
        shared.retry_later(&m, after).await;
    }
}

/// Deletes in batches of up to 10, each entry with a unique id; receipts repeated
/// within a batch are sent once. A batch is sent when it is full or `wait` after
/// its first receipt; when the channel closes, what is pending is flushed.
/// Failed entries are tried once more alone, then logged (the message then comes
/// back and is skipped as a duplicate).
async fn delete_loop(
    sqs: Client,
    queue_url: String,
    wait: Duration,
    mut rx: mpsc::UnboundedReceiver<String>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + wait;
        while batch.len() < 10 {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(receipt)) => {
                    if !batch.contains(&receipt) {
                        batch.push(receipt);
                    }
                }
                // Closed or timed out: send what we have.
                Ok(None) | Err(_) => break,
            }
        }
        delete_batch(&sqs, &queue_url, batch).await;
    }
}

async fn delete_batch(sqs: &Client, queue_url: &str, receipts: Vec<String>) {
    let entries = crate::sqs::delete_entries(receipts.iter().map(String::as_str));
    let failed: Vec<String> = match sqs
        .delete_message_batch()
        .queue_url(queue_url)
        .set_entries(Some(entries))
        .send()
        .await
    {
        Ok(out) => out
            .failed
            .iter()
            .filter_map(|f| {
                warn!(id = f.id, code = f.code, message = ?f.message, "delete failed in batch");
                f.id.strip_prefix('m')
                    .and_then(|i| i.parse::<usize>().ok())
                    .and_then(|i| receipts.get(i).cloned())
            })
            .collect(),
        Err(e) => {
            warn!(error = %DisplayErrorContext(e), "DeleteMessageBatch failed; deleting one by one");
            receipts.clone()
        }
    };
    for r in failed {
        if let Err(e) = sqs
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(&r)
            .send()
            .await
        {
            error!(error = %DisplayErrorContext(e), "delete failed; the message will come back and be skipped as a duplicate");
        }
    }
}

/// Runs the poller until `shutdown` is cancelled (or it has been idle for
/// `exit_when_idle`). Returns what it did.
pub async fn run<S: DedupStore, H: Handler>(
    sqs: Client,
    processor: Processor<S, H>,
    config: PollerConfig,
    shutdown: CancellationToken,
) -> RunStats {
    let (tx, rx) = mpsc::unbounded_channel();
    let deleter = tokio::spawn(delete_loop(
        sqs.clone(),
        config.queue_url.clone(),
        config.batch_wait,
        rx,
    ));
    let concurrency = config.concurrency.max(1);
    let shared = Arc::new(Shared {
        sqs: sqs.clone(),
        processor,
        dlq: config
            .dlq_url
            .as_ref()
            .map(|url| crate::sqs::Dlq::new(sqs.clone(), url)),
        config: config.clone(),
        deletes: tx,
        stop: CancellationToken::new(),
        stats: Default::default(),
    });
    let permits = Arc::new(Semaphore::new(concurrency));
    let tracker = TaskTracker::new();
    let metrics_task = config.metrics_interval.map(|every| {
        let processor = shared.processor.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                let consumer = &processor.config().consumer;
                crate::metrics::print_emf(&processor.metrics().take(), consumer);
            }
        })
    });
    let mut error_backoff = Duration::from_millis(200);
    let mut idle_since = tokio::time::Instant::now();

    'receive: loop {
        // Wait until at least one message can start now.
        let first = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("semaphore open"),
            () = shutdown.cancelled() => break 'receive,
        };
        // Then up to a full batch, waiting at most `batch_wait` for the rest.
        let mut held = vec![first];
        let batch = concurrency.min(10);
        let fill_by = tokio::time::Instant::now() + config.batch_wait;
        while held.len() < batch {
            let more = tokio::select! {
                p = tokio::time::timeout_at(fill_by, permits.clone().acquire_owned()) => p,
                () = shutdown.cancelled() => break 'receive,
            };
            match more {
                Ok(p) => held.push(p.expect("semaphore open")),
                Err(_) => break,
            }
        }
        let wait = match config.exit_when_idle {
            Some(idle) => config.wait_time.min(idle).max(Duration::from_secs(1)),
            None => config.wait_time,
        };
        // What is received stays invisible for a lease (whatever the queue's
        // own visibility timeout), so the heartbeat, at most half a lease,
        // always extends it in time.
        let received_at = tokio::time::Instant::now();
        let lease = shared.processor.config().lease;
        let mut receive = tokio::spawn(
            sqs.receive_message()
                .queue_url(&config.queue_url)
                .visibility_timeout(crate::sqs::visibility_secs(lease))
                .max_number_of_messages(i32::try_from(held.len()).unwrap_or(10))
                .wait_time_seconds(i32::try_from(wait.as_secs()).unwrap_or(20))
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send(),
        );
        let out = tokio::select! {
            r = &mut receive => r.expect("the receive task does not panic"),
            () = shutdown.cancelled() => {
                // The receive may already have taken messages: give them back
                // as soon as it answers (within the drain), rather than leave
                // them (and their FIFO groups) invisible.
                tracker.spawn(give_back_when_received(shared.clone(), receive));
                break 'receive;
            }
        };
        let messages = match out {
            Ok(o) => {
                error_backoff = Duration::from_millis(200);
                o.messages.unwrap_or_default()
            }
            Err(e) => {
                warn!(error = %DisplayErrorContext(e), retry_in = ?error_backoff, "receive failed; backing off");
                tokio::select! {
                    () = tokio::time::sleep(error_backoff) => {}
                    () = shutdown.cancelled() => break 'receive,
                }
                error_backoff = (error_backoff * 2).min(Duration::from_secs(20));
                continue;
            }
        };
        if messages.is_empty() {
            shared.count(|s| s.empty_receives += 1);
            if let Some(idle) = config.exit_when_idle
                && permits.available_permits() + held.len() == concurrency
                && idle_since.elapsed() >= idle
            {
                info!("idle; exiting as configured");
                break 'receive;
            }
            continue;
        }
        let messages: Vec<Message> = messages.into_iter().filter_map(to_message).collect();
        shared.count(|s| s.received += messages.len() as u64);
        // One task per lane, messages in receive order within it: on a FIFO
        // queue a lane is a message group (stopped by a failure); on a standard
        // queue it is a dedup key, so a duplicate within one receive runs after
        // the first copy and is skipped instead of found in flight.
        let fifo = config.is_fifo();
        let keys = &shared.processor.config().key_source;
        // (The `fifo-parallel` mutant, for the chaos harness only, runs a
        // FIFO group's messages in parallel.)
        let laned_by_group = fifo && !crate::mutants::active("fifo-parallel");
        let lanes =
            crate::lanes::split(messages, |m| crate::lanes::lane_of(m, laned_by_group, keys));
        for lane in lanes {
            let permits: Vec<_> = held.drain(..lane.len().min(held.len())).collect();
            tracker.spawn(run_lane(shared.clone(), lane, permits, fifo, received_at));
        }
        idle_since = tokio::time::Instant::now();
    }

    // Drain: finish within the deadline, then interrupt and release the rest.
    // Releases and the last deletes get CLEANUP more at most, so the whole stop
    // takes no longer than drain + CLEANUP even when AWS does not answer; what
    // is left then comes back when its lease and visibility run out.
    tracker.close();
    if tokio::time::timeout(config.drain, tracker.wait())
        .await
        .is_err()
    {
        warn!(drain = ?config.drain, "drain deadline reached; interrupting and releasing unfinished work");
        shared.stop.cancel();
    }
    let cleanup_by = tokio::time::Instant::now() + CLEANUP;
    if tokio::time::timeout_at(cleanup_by, tracker.wait())
        .await
        .is_err()
    {
        warn!(
            ?CLEANUP,
            "releases did not finish in time; those claims end with their leases"
        );
    }
    if let Some(task) = metrics_task {
        task.abort();
        let consumer = &shared.processor.config().consumer;
        crate::metrics::print_emf(&shared.processor.metrics().take(), consumer);
    }
    let stats = shared.stats.lock().expect("stats lock").clone();
    drop(shared);
    match tokio::time::timeout_at(cleanup_by, deleter).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error = %e, "delete task failed"),
        Err(_) => warn!(
            "the last deletes did not finish in time; those messages come back and are skipped as duplicates"
        ),
    }
    stats
}

/// How long releases and the last deletes may take after the drain.
pub const CLEANUP: Duration = Duration::from_secs(5);
