//! Deletes: finished messages wait for their delete in batches of ten,
//! retried until their visibility would end.

use super::*;

/// A finished message for the [`DeleteBatcher`]: its receipt handle, and its
/// large payload's object when that is to be deleted after it.
pub(super) struct Finished {
    pub(super) receipt: String,
    pub(super) payload: Option<S3Pointer>,
    /// Until when, by this host's clock, the message is known to stay
    /// invisible: its delete must land before, or the receipt no longer
    /// deletes (and a message on its last allowed receive goes to the DLQ).
    pub(super) invisible_until: Instant,
    /// Until when, at the latest, it may stay invisible: a failed delete is
    /// tried again until then (landing late costs nothing).
    pub(super) retry_until: Instant,
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
pub(super) struct DeleteBatcher<Q> {
    pub(super) queue: Q,
    pub(super) url: String,
    pub(super) wait: Duration,
    pub(super) receipts: mpsc::Receiver<Finished>,
    pub(super) payloads: Option<LargePayloads>,
    /// The batch calls, the retries of failed deletes and the deletes of
    /// large-payload objects after them, run beside the loop.
    pub(super) retries: TaskTracker,
    /// Slots for the batch calls in flight ([`DELETE_CALLS_IN_FLIGHT`]).
    pub(super) calls: Arc<Semaphore>,
}

/// `DeleteMessageBatch` calls a poller has in flight at most.
pub(super) const DELETE_CALLS_IN_FLIGHT: usize = 4;

impl<Q: QueueClient> DeleteBatcher<Q> {
    pub(super) async fn run(mut self) {
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
pub(super) async fn delete_batch<Q: QueueClient>(
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
    let undeleted = delete_messages(&queue, &url, &batch, slot).await;
    if let Some(payloads) = payloads {
        delete_objects_of_deleted(&payloads, batch, &undeleted).await;
    }
}

/// Deletes `batch` in one call, then one by one what it did not delete (or
/// all of it, beside the call, when the call is not answered in time);
/// answers the receipts left undeleted.
async fn delete_messages<Q: QueueClient>(
    queue: &Q,
    url: &str,
    batch: &[Finished],
    slot: OwnedSemaphorePermit,
) -> Vec<String> {
    let first_end = batch.iter().map(|f| f.invisible_until).min();
    let bound = first_end.map_or(BATCH_CALL_LEAST, |end| {
        (end.saturating_duration_since(Instant::now()) / 2).max(BATCH_CALL_LEAST)
    });
    {
        let call = send_batch(queue, url, batch);
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
    }
}

/// Deletes the large-payload objects of the messages of `batch` that were
/// deleted (not those `undeleted`: they come back and need their object),
/// within [`OBJECT_DELETE_TIME`].
async fn delete_objects_of_deleted(
    payloads: &LargePayloads,
    batch: Vec<Finished>,
    undeleted: &[String],
) {
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
pub(super) const BATCH_CALL_LEAST: Duration = Duration::from_secs(1);

/// Deletes the messages in one call; returns those whose delete failed
/// (the whole call, or their entries) by their place in `batch`, to be
/// tried again alone.
pub(super) async fn send_batch<Q: QueueClient>(
    queue: &Q,
    url: &str,
    batch: &[Finished],
) -> Vec<usize> {
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
pub(super) async fn delete_retrying<Q: QueueClient>(
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
pub(super) const DELETE_TRY: Duration = Duration::from_secs(2);

/// How long a delete try goes unanswered before another is sent beside it:
/// [`DELETE_TRY`], or half of what is left of the message's known
/// visibility where that is less, and no less than [`DELETE_TRY_NEAR_END`]
/// (simulator seed 932779: a try sent 1.7 s before the end of a message on
/// its last allowed receive, after a batch call sent into a cut from SQS
/// had failed, went unanswered, and the next was sent only when the client
/// gave up on it, 1.8 s later, reaching SQS after the end).
pub(super) fn beside_after(invisible_until: Instant) -> Duration {
    let known = invisible_until.saturating_duration_since(Instant::now());
    DELETE_TRY.min((known / 2).max(DELETE_TRY_NEAR_END))
}

/// The least time a delete try goes unanswered before another is sent
/// beside it (see [`beside_after`]).
pub(super) const DELETE_TRY_NEAR_END: Duration = Duration::from_millis(250);

/// Delete tries of one message on their way at most ([`DELETE_TRY`]).
pub(super) const DELETE_TRIES_AT_ONCE: usize = 3;

/// The least time before a failed delete's last chance for which it is
/// still tried again.
pub(super) const DELETE_RETRY_LAST: Duration = Duration::from_millis(200);

/// The longest pause between two tries of a failed delete.
pub(super) const DELETE_RETRY_PAUSE: Duration = Duration::from_secs(4);

/// The longest time between two tries' sends of a failed delete once its
/// known visibility end has passed (see [`delete_retrying`]).
pub(super) const DELETE_RETRY_PAST_KNOWN: Duration = Duration::from_secs(1);

/// How long a failed delete is tried again (transient failures).
pub(super) const DELETE_RETRY_FOR: Duration = Duration::from_secs(10);

/// The latest a finished message's delete is sent: [`DELETE_RETRY_FOR`]
/// before its known visibility ends (at once when that has passed).
pub(super) fn send_by(f: &Finished) -> Instant {
    send_by_end(f.invisible_until)
}

/// [`send_by`] for a message known to stay invisible until `end`.
pub(super) fn send_by_end(end: Instant) -> Instant {
    end.checked_sub(DELETE_RETRY_FOR).unwrap_or(end)
}

/// How long a lane keeper's extension call may take, counted toward a
/// finished message's latest end when its delete is handed over while that
/// call is on its way: a batch call and single calls after it, each up to
/// three attempts of 5 s (the SQS adapter's) and their pauses. The keeper
/// drops a call still on its way 5 s before, whatever the client's retries.
pub(super) const KEEPER_CALL_MAX: Duration = Duration::from_secs(40);
