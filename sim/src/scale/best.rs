//! The best-effort hand-written loop: what a good engineer writes without
//! sqs-once. Per poller (process), `slots` handler permits, each freed as its
//! message finishes; a receive loop that holds at most `held` messages
//! (received and not yet done), receiving ahead while there is room: it waits
//! for one free place, then up to [`BATCH_WAIT`] for room for ten, as
//! sqs-once's poller does, so both make ~0.1 receives per message; deletes
//! queued to a background batcher that sends `DeleteMessageBatch` of up to
//! ten when full or [`BATCH_WAIT`] after the first receipt, each batch its own
//! task. Each message: the handler's time, then one conditional
//! transaction (the dedup record and the ledger row), as the simple loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqs_once::queue::{QueueClient, ReceiveRequest};
use sqs_once::{MemoryQueue, Message};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{LoopWorker, Services, until_empty};
use crate::latency::LatentQueue;
use crate::scale::ScaleConfig;

/// The longest wait to fill a receive or a delete batch (sqs-once's default
/// `batch_wait`).
pub const BATCH_WAIT: Duration = Duration::from_secs(1);

/// Places per poller: handler slots and messages held at most.
#[derive(Debug, Clone, Copy)]
pub struct Places {
    /// Handlers at once.
    pub slots: usize,
    /// Messages received and not yet done, at most (>= slots).
    pub held: usize,
}

/// The best-effort loop's pollers until the queue is empty; the duplicates
/// they found.
pub(super) async fn run(config: &ScaleConfig, services: &Arc<Services>, places: Places) -> u64 {
    let stop = CancellationToken::new();
    let duplicates = Arc::new(AtomicU64::new(0));
    let pollers: Vec<_> = (0..config.pollers)
        .map(|_| {
            let worker = Arc::new(LoopWorker::new(config, services, &duplicates));
            tokio::spawn(poller(worker, places, stop.clone()))
        })
        .collect();
    until_empty(services).await;
    stop.cancel();
    for p in pollers {
        let _ = p.await;
    }
    duplicates.load(Ordering::Relaxed)
}

/// One process: the receive loop, the handlers, the delete batcher.
async fn poller(worker: Arc<LoopWorker>, places: Places, stop: CancellationToken) {
    let slots = Arc::new(Semaphore::new(places.slots));
    let held = Arc::new(Semaphore::new(places.held.max(places.slots)));
    let (to_delete, receipts) = mpsc::unbounded_channel::<String>();
    let batcher = tokio::spawn(delete_batches(worker.queue.clone(), worker.url(), receipts));
    loop {
        let Some(permits) = room(&held, &stop).await else {
            break;
        };
        let got = receive(&worker, permits.len(), &stop).await;
        let Some(got) = got else { break };
        for (m, place) in got.into_iter().zip(permits) {
            let (worker, slots, to_delete) = (worker.clone(), slots.clone(), to_delete.clone());
            tokio::spawn(one(worker, m, slots, place, to_delete));
        }
    }
    drop(to_delete);
    let _ = batcher.await;
}

/// One message: a slot, the handler and its transaction, the delete queued.
async fn one(
    worker: Arc<LoopWorker>,
    m: Message,
    slots: Arc<Semaphore>,
    place: OwnedSemaphorePermit,
    to_delete: mpsc::UnboundedSender<String>,
) {
    let Ok(slot) = slots.acquire_owned().await else {
        return;
    };
    let done = worker.handle(&m).await;
    drop(slot);
    if done && let Some(r) = m.receipt_handle() {
        let _ = to_delete.send(r.to_owned());
    }
    drop(place);
}

/// Waits for one free place, then up to [`BATCH_WAIT`] for ten; `None` once
/// stopped.
async fn room(
    held: &Arc<Semaphore>,
    stop: &CancellationToken,
) -> Option<Vec<OwnedSemaphorePermit>> {
    let first = tokio::select! {
        biased;
        () = stop.cancelled() => return None,
        p = held.clone().acquire_owned() => p.ok()?,
    };
    let mut permits = vec![first];
    let fill_by = Instant::now() + BATCH_WAIT;
    while permits.len() < 10 {
        let more = tokio::select! {
            biased;
            () = stop.cancelled() => return None,
            p = tokio::time::timeout_at(fill_by, held.clone().acquire_owned()) => p,
        };
        match more {
            Ok(Ok(p)) => permits.push(p),
            _ => break,
        }
    }
    Some(permits)
}

/// One receive for `n` places (20 s long poll); `None` once stopped.
async fn receive(worker: &LoopWorker, n: usize, stop: &CancellationToken) -> Option<Vec<Message>> {
    let request = ReceiveRequest {
        max: n,
        wait: Duration::from_secs(20),
        visibility: Duration::from_secs(30),
    };
    let url = worker.url();
    let received = tokio::select! {
        biased;
        () = stop.cancelled() => return None,
        r = worker.queue.receive(&url, request) => r,
    };
    match received {
        Ok(got) => Some(got),
        Err(_) => {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Some(Vec::new())
        }
    }
}

/// Sends the queued receipts in batches of up to ten, each batch when full
/// or [`BATCH_WAIT`] after its first receipt, as a task of its own; flushes
/// what is pending when the channel closes.
async fn delete_batches(
    queue: LatentQueue<MemoryQueue>,
    url: String,
    mut receipts: mpsc::UnboundedReceiver<String>,
) {
    let mut sent = Vec::new();
    while let Some(first) = receipts.recv().await {
        let fill_by = Instant::now() + BATCH_WAIT;
        let mut batch = vec![first];
        while batch.len() < 10 {
            match tokio::time::timeout_at(fill_by, receipts.recv()).await {
                Ok(Some(r)) => batch.push(r),
                _ => break,
            }
        }
        let (queue, url) = (queue.clone(), url.clone());
        // A failed delete brings the messages back, then duplicates.
        sent.push(tokio::spawn(async move {
            let _ = queue.delete_batch(&url, &batch).await;
        }));
        sent.retain(|t| !t.is_finished());
    }
    for s in sent {
        let _ = s.await;
    }
}
