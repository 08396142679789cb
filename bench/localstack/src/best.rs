//! `BENCH_LOOP=best`: the best-effort hand-written loop, as a good engineer
//! writes it without sqs-once. `CONCURRENCY` handler slots, each freed as its
//! message finishes; at most `HELD` messages (default `CONCURRENCY` + 10)
//! received and not yet done; the receive loop receives ahead while there is
//! room (it waits for one free place, then up to `BATCH_WAIT_MS`, default
//! 1,000, for room for ten, as sqs-once's poller does); finished receipts go
//! to a background batcher that sends `DeleteMessageBatch` of up to ten when
//! full or `BATCH_WAIT_MS` after the first receipt, each batch its own task.
//! Per message the same transaction as the simple loop's (the dedup record
//! and the ledger update). It exits after two empty receives in a row with
//! nothing held.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use aws_sdk_sqs::types::Message;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;

use super::{Loop, Outcome, env};

/// Runs the loop until idle.
pub(crate) async fn run(l: Arc<Loop>, concurrency: usize) {
    let held_max: usize = env("HELD", &(concurrency + 10).to_string())
        .parse()
        .expect("HELD");
    let wait = Duration::from_millis(env("BATCH_WAIT_MS", "1000").parse().expect("BATCH_WAIT_MS"));
    let slots = Arc::new(Semaphore::new(concurrency));
    let held = Arc::new(Semaphore::new(held_max.max(concurrency)));
    let (to_delete, receipts) = mpsc::unbounded_channel::<String>();
    let batcher = tokio::spawn(delete_batches(l.clone(), receipts, wait));
    let mut idle = 0;
    while idle < 2 {
        let places = room(&held, wait).await;
        let got = receive(&l, places.len()).await;
        if got.is_empty() {
            if held.available_permits() + places.len() == held_max.max(concurrency) {
                idle += 1;
            }
            continue;
        }
        idle = 0;
        for (m, place) in got.into_iter().zip(places) {
            let (l, slots, to_delete) = (l.clone(), slots.clone(), to_delete.clone());
            tokio::spawn(one(l, m, slots, place, to_delete));
        }
    }
    drop(to_delete);
    let _ = batcher.await;
}

/// One free place, then up to `wait` for ten.
async fn room(held: &Arc<Semaphore>, wait: Duration) -> Vec<OwnedSemaphorePermit> {
    let first = held.clone().acquire_owned().await.expect("semaphore open");
    let mut places = vec![first];
    let fill_by = Instant::now() + wait;
    while places.len() < 10 {
        match tokio::time::timeout_at(fill_by, held.clone().acquire_owned()).await {
            Ok(Ok(p)) => places.push(p),
            _ => break,
        }
    }
    places
}

async fn receive(l: &Loop, n: usize) -> Vec<Message> {
    l.counts.receives.fetch_add(1, Ordering::Relaxed);
    let got = l
        .sqs
        .receive_message()
        .queue_url(&l.queue_url)
        .max_number_of_messages(n as i32)
        .wait_time_seconds(l.wait_secs)
        .send()
        .await;
    match got {
        Ok(r) => {
            let got = r.messages.unwrap_or_default();
            if got.is_empty() {
                l.counts.empty_receives.fetch_add(1, Ordering::Relaxed);
            }
            got
        }
        Err(e) => {
            eprintln!("receive failed: {e}");
            tokio::time::sleep(Duration::from_millis(200)).await;
            Vec::new()
        }
    }
}

/// One message: a slot, its transaction, its receipt queued for deletion.
async fn one(
    l: Arc<Loop>,
    m: Message,
    slots: Arc<Semaphore>,
    place: OwnedSemaphorePermit,
    to_delete: mpsc::UnboundedSender<String>,
) {
    let slot = slots.acquire_owned().await.expect("semaphore open");
    let outcome = l.handle(&m).await;
    drop(slot);
    match outcome {
        Outcome::Applied | Outcome::Duplicate => {
            if matches!(outcome, Outcome::Duplicate) {
                l.counts.duplicates.fetch_add(1, Ordering::Relaxed);
            }
            let _ = to_delete.send(m.receipt_handle.unwrap_or_default());
        }
        Outcome::Failed => {
            l.counts.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    drop(place);
}

/// Batches of up to ten, each when full or `wait` after its first receipt.
async fn delete_batches(
    l: Arc<Loop>,
    mut receipts: mpsc::UnboundedReceiver<String>,
    wait: Duration,
) {
    let mut sent = Vec::new();
    while let Some(first) = receipts.recv().await {
        let fill_by = Instant::now() + wait;
        let mut batch = vec![first];
        while batch.len() < 10 {
            match tokio::time::timeout_at(fill_by, receipts.recv()).await {
                Ok(Some(r)) => batch.push(r),
                _ => break,
            }
        }
        let l = l.clone();
        sent.push(tokio::spawn(async move { delete(&l, batch).await }));
        sent.retain(|t| !t.is_finished());
    }
    for s in sent {
        let _ = s.await;
    }
}

async fn delete(l: &Loop, batch: Vec<String>) {
    let entries = sqs_once::aws::sqs::delete_entries(batch.iter().map(String::as_str));
    l.counts.deletes.fetch_add(1, Ordering::Relaxed);
    match l
        .sqs
        .delete_message_batch()
        .queue_url(&l.queue_url)
        .set_entries(Some(entries))
        .send()
        .await
    {
        Ok(out) => {
            let failed = out.failed().len() as u64;
            l.counts
                .deleted
                .fetch_add(batch.len() as u64 - failed, Ordering::Relaxed);
        }
        Err(e) => eprintln!("delete failed: {e}"),
    }
}
