//! Keeping a message invisible through the queue: the handler's extensions
//! ([`QueueVisibility`]), a retry delay cut to SQS's 12 hours from the
//! receive ([`retry_later`]), and a lane's waiting messages ([`extend_many`]).

use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use tracing::warn;

use crate::Message;
use crate::protocol::limits::SQS_MAX_VISIBILITY;
use crate::protocol::processor::VisibilityExtender;
use crate::protocol::queue::{QueueClient, QueueError};

/// Extends visibility with the message's receipt handle on one queue.
pub(crate) struct QueueVisibility<'a, Q> {
    pub(crate) queue: &'a Q,
    pub(crate) url: &'a str,
    /// Until when the last successful extension keeps the message invisible
    /// (sent at an instant, plus its timeout), by this host's clock.
    pub(crate) extended_until: std::sync::Mutex<Option<Instant>>,
    /// Until when, at the latest, an extension may keep the message
    /// invisible (answered at an instant, plus its timeout; a failure that
    /// passes counts too: it may have landed).
    pub(crate) extended_at_most: std::sync::Mutex<Option<Instant>>,
    /// Every extension keeps the message invisible at least until then
    /// ([`Self::at_least_through`]).
    floor: Option<Instant>,
}

impl<'a, Q> QueueVisibility<'a, Q> {
    pub(crate) fn new(queue: &'a Q, url: &'a str) -> Self {
        Self {
            queue,
            url,
            extended_until: std::sync::Mutex::new(None),
            extended_at_most: std::sync::Mutex::new(None),
            floor: None,
        }
    }

    /// Every extension sets at least what is left until `floor` (in whole
    /// seconds, rounded up; the caller cuts it to SQS's 12 hours from the
    /// receive), whatever it asks: a
    /// Lambda record is extended for a lease cut to end by the invocation's
    /// deadline, and one that finished early in a long batch would
    /// otherwise become visible again before the invocation answers and
    /// the event source mapping deletes it.
    pub(crate) fn at_least_through(self, floor: Option<Instant>) -> Self {
        Self { floor, ..self }
    }

    /// `timeout`, raised to end no sooner than the floor.
    fn floored(&self, timeout: Duration) -> Duration {
        let Some(floor) = self.floor else {
            return timeout;
        };
        let left = floor.saturating_duration_since(Instant::now());
        let left = Duration::from_secs(left.as_secs() + u64::from(left.subsec_nanos() > 0));
        timeout.max(left.min(SQS_MAX_VISIBILITY))
    }

    /// Until when the last successful extension keeps the message invisible.
    pub(crate) fn extended_until(&self) -> Option<Instant> {
        *self
            .extended_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
    /// Until when, at the latest, an extension may keep the message
    /// invisible (one that failed may have landed).
    pub(crate) fn extended_at_most(&self) -> Option<Instant> {
        *self
            .extended_at_most
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// An extension may keep the message invisible until `latest`.
    fn may_hold_until(&self, latest: Instant) {
        let mut most = self
            .extended_at_most
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *most = Some(most.map_or(latest, |k| k.max(latest)));
    }
}

impl<Q: QueueClient> VisibilityExtender for QueueVisibility<'_, Q> {
    fn extend<'a>(
        &'a self,
        message: &'a Message,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), QueueError>> {
        Box::pin(async move {
            let Some(receipt) = message.receipt_handle() else {
                return Err(QueueError::new(
                    "ChangeMessageVisibility",
                    self.url,
                    format!("message {} has no receipt handle", message.id()),
                    false,
                ));
            };
            // A transient failure is tried again at once, a few times: one lost
            // extension would otherwise let the message reappear (and be
            // received, counting towards the redrive policy's maxReceiveCount)
            // before the next heartbeat.
            let mut pause = Duration::from_millis(250);
            let mut tries = 1;
            loop {
                let sent = Instant::now();
                let timeout = self.floored(timeout);
                // A call dropped on its way (the handler finished and its
                // heartbeat with it) may land all the same.
                let in_flight = MayLand {
                    visibility: self,
                    timeout,
                };
                let changed = self
                    .queue
                    .change_visibility(self.url, receipt, timeout)
                    .await;
                std::mem::forget(in_flight);
                match changed {
                    Ok(()) => {
                        let until = sent + timeout;
                        let mut known = self
                            .extended_until
                            .lock()
                            .unwrap_or_else(|e| e.into_inner());
                        *known = Some(known.map_or(until, |k| k.max(until)));
                        drop(known);
                        self.may_hold_until(Instant::now() + timeout);
                        return Ok(());
                    }
                    // A failure that passes (a timeout, a lost answer) may
                    // have landed all the same: the message may then stay
                    // invisible that long, and its failed delete is tried
                    // until then (simulator seed 247521: a heartbeat's call
                    // timed out but landed, SQS was out of reach until 4 s
                    // before the end it set, and the delete's tries had
                    // stopped at the end known before it).
                    Err(e) if e.is_transient() => {
                        self.may_hold_until(Instant::now() + timeout + LANDS_LATE);
                        if tries == VISIBILITY_TRIES {
                            return Err(e);
                        }
                        warn!(message_id = message.id(), error = %e, "visibility extension failed; trying again");
                        tokio::time::sleep(pause).await;
                        pause *= 2;
                        tries += 1;
                    }
                    done => return done,
                }
            }
        })
    }
}

/// Counts a visibility change dropped on its way toward the latest end it
/// may set ([`QueueVisibility::extended_at_most`]); forgotten once the call
/// has answered.
struct MayLand<'v, 'a, Q> {
    visibility: &'v QueueVisibility<'a, Q>,
    timeout: Duration,
}

impl<Q> Drop for MayLand<'_, '_, Q> {
    fn drop(&mut self) {
        self.visibility
            .may_hold_until(Instant::now() + self.timeout + LANDS_LATE);
    }
}

/// How much later than its failure a visibility change the client gave up
/// on (a timeout, a dropped call) is counted as still able to land: SQS
/// may apply a request after its client stopped waiting, and does not say
/// how late (simulator seed 315952: a heartbeat's call given up after
/// 1.5 s landed 19.6 s after it, setting an end 19.6 s past the latest
/// known; SQS was out of reach, and the delete's tries had stopped 15.6 s
/// before that end). The simulator draws such landings up to 20 s late.
pub(crate) const LANDS_LATE: Duration = Duration::from_secs(30);

/// Attempts of one visibility extension (transient failures only).
const VISIBILITY_TRIES: u32 = 4;

/// How long before the end of SQS's 12 hours from a message's receive a
/// retry delay is made to end: room for the whole-second rounding of the
/// visibility timeout and for the call's own time on the wire.
pub(crate) const VISIBILITY_CAP_MARGIN: Duration = Duration::from_secs(60);

/// `after`, cut so that the message is visible again by 12 hours after its
/// receive (at or after `received_at`, by this host's clock), less
/// [`VISIBILITY_CAP_MARGIN`]: SQS counts its 12-hour cap on a message's
/// visibility from the receive, not from the call, and refuses a timeout
/// beyond it (the message would then come back when its current visibility
/// ends, a lease later, instead of after the delay).
pub(crate) fn within_visibility_cap(after: Duration, received_at: Instant) -> Duration {
    let last = received_at + SQS_MAX_VISIBILITY;
    let left = last
        .saturating_duration_since(Instant::now())
        .saturating_sub(VISIBILITY_CAP_MARGIN);
    after.min(left)
}

/// Makes a message, received at or after `received_at`, visible again after
/// `after`, cut to SQS's 12 hours from the receive
/// ([`within_visibility_cap`]); returns the delay set. Best effort: on
/// failure it returns when its current visibility timeout ends.
pub(crate) async fn retry_later<Q: QueueClient>(
    queue: &Q,
    url: &str,
    message: &Message,
    after: Duration,
    received_at: Instant,
) -> Duration {
    let after = within_visibility_cap(after, received_at);
    let Some(receipt) = message.receipt_handle() else {
        return after;
    };
    if let Err(e) = queue.change_visibility(url, receipt, after).await {
        warn!(message_id = message.id(), error = %e, "could not set the retry delay; the message returns after its visibility timeout");
    }
    after
}

/// Sets the visibility timeout of several messages of one queue at once
/// (10 per call, by receipt handle): keeps received messages that wait for
/// their turn invisible. An entry that failed, or a call that failed as a
/// whole, is tried again once per message: SQS's batch calls may fail single
/// entries while the call succeeds ("try it again"), and one such entry must
/// not let a lane's waiting messages go (each spends a receive coming back,
/// and on a low `maxReceiveCount` reaches the DLQ unprocessed: simulator
/// seed 7417). A waiting message set again alone gets what is left of
/// `timeout` since the first call, in whole seconds rounded down, so that it
/// ends no later than the batch's (within one call's latency: a lane's
/// waiting messages should not outlast the one before them); where less
/// than a second is left it is not set (a timeout of 0 would make it
/// visible). The `running` receipt is not set again alone: its own
/// heartbeat keeps it.
/// After a call that failed as a whole, the singles stop at the first that
/// fails for a transient reason too: SQS is out of reach, and the caller
/// holds its lane meanwhile. What still fails is logged; those messages
/// return when their current visibility ends. A single whose receipt
/// handle SQS refuses ([`QueueError::is_receipt_refused`]: stale because
/// the message was received again, or the message is visible again) is
/// named in [`Extended::refused`]: that delivery no longer holds the
/// message, whatever the last extension that worked promised; the others
/// count toward [`Extended::all`] as before.
#[cfg(feature = "poller")]
pub(crate) async fn extend_many<Q: QueueClient>(
    queue: &Q,
    url: &str,
    receipts: &[String],
    running: Option<&str>,
    timeout: Duration,
) -> Extended {
    let sent = Instant::now();
    // Each with whether its whole call failed.
    let mut again: Vec<(&String, bool)> = Vec::new();
    for chunk in receipts.chunks(crate::protocol::limits::SQS_BATCH) {
        match queue.change_visibility_batch(url, chunk, timeout).await {
            Ok(failed) => {
                for f in failed {
                    tracing::debug!(code = f.code, message = ?f.message, "a waiting message's extension failed in its batch; trying it alone");
                    again.extend(chunk.get(f.index).map(|r| (r, false)));
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "extending waiting messages failed; trying each alone");
                again.extend(chunk.iter().map(|r| (r, true)));
            }
        }
    }
    // Every one not refused was extended.
    let mut all = true;
    let mut refused = Vec::new();
    let mut out_of_reach = false;
    for (receipt, whole_call_failed) in again {
        if whole_call_failed && out_of_reach {
            all = false;
            continue;
        }
        if running == Some(receipt.as_str()) {
            // Its own heartbeat keeps it; set alone here it would end
            // either sooner than that heartbeat set or later than the
            // poller knows.
            continue;
        }
        let left = Duration::from_secs(timeout.saturating_sub(sent.elapsed()).as_secs());
        if left.is_zero() {
            all = false;
            warn!(
                "no time left to keep a waiting message invisible; it returns when its current visibility ends"
            );
            continue;
        }
        if let Err(e) = queue.change_visibility(url, receipt, left).await {
            out_of_reach |= whole_call_failed && e.is_transient();
            if e.is_receipt_refused() {
                refused.push(receipt.clone());
            } else {
                all = false;
            }
            warn!(error = %e, "could not keep a waiting message invisible");
        }
    }
    Extended { all, refused }
}

/// What an [`extend_many`] did.
#[cfg(feature = "poller")]
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Extended {
    /// Every message was extended but those refused.
    pub(crate) all: bool,
    /// The receipt handles SQS refused outright.
    pub(crate) refused: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_delay_ends_by_twelve_hours_after_the_receive_less_the_margin() {
        let received_at = Instant::now();
        let hour = Duration::from_secs(3600);
        // Shorter delays are kept.
        assert_eq!(within_visibility_cap(hour, received_at), hour);
        tokio::time::advance(hour * 3).await;
        let cap = hour * 9 - VISIBILITY_CAP_MARGIN;
        assert_eq!(within_visibility_cap(hour * 12, received_at), cap);
        assert_eq!(within_visibility_cap(hour * 5, received_at), hour * 5);
        // Past the cap: visible again at once.
        tokio::time::advance(hour * 9).await;
        assert_eq!(within_visibility_cap(hour, received_at), Duration::ZERO);
    }

    /// On the in-memory SQS, which refuses a visibility beyond 12 hours from
    /// the receive as SQS does: a 12-hour retry delay set 3 hours after the
    /// receive is accepted (cut), and the message stays away until then.
    #[tokio::test(start_paused = true)]
    async fn a_long_retry_delay_late_in_a_receive_is_accepted_not_lost() {
        use crate::protocol::queue::ReceiveRequest;
        use crate::testkit::queue::{MemoryQueue, QueueSettings};
        let q = MemoryQueue::new();
        let url = q.create_queue(QueueSettings::new("cap")).unwrap();
        q.send(
            &url,
            crate::protocol::queue::OutgoingMessage {
                body: "m".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let request = ReceiveRequest {
            max: 1,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(30),
        };
        let received_at = Instant::now();
        let got = q.receive(&url, request).await.unwrap();
        // The handler ran three hours (its visibility extended meanwhile).
        for _ in 0..(3 * 3600 / 20) {
            tokio::time::advance(Duration::from_secs(20)).await;
            q.change_visibility(
                &url,
                got[0].receipt_handle().unwrap(),
                Duration::from_secs(30),
            )
            .await
            .unwrap();
        }
        let hour = Duration::from_secs(3600);
        let set = retry_later(&q, &url, &got[0], hour * 12, received_at).await;
        tokio::time::advance(hour * 8).await;
        let again = q.receive(&url, request).await.unwrap();
        assert!(again.is_empty(), "back after a lease, not after the delay");
        tokio::time::advance(hour).await;
        assert_eq!(q.receive(&url, request).await.unwrap().len(), 1);
        assert_eq!(set, hour * 9 - VISIBILITY_CAP_MARGIN);
    }

    /// Simulator seed 7417 (FIFO, `maxReceiveCount` 3): one entry of a
    /// batch extension failed ("try it again") while the call succeeded, and
    /// the poller let the lane's waiting messages go; each came back with a
    /// receive spent, and after a few rounds reached the DLQ unprocessed. A
    /// failed entry is now tried again alone.
    #[cfg(feature = "poller")]
    #[tokio::test(start_paused = true)]
    async fn an_entry_that_failed_in_its_batch_is_extended_alone() {
        use crate::protocol::queue::{OutgoingMessage, ReceiveRequest};
        use crate::testkit::queue::{MemoryQueue, QueueSettings, first_draws_hit};
        let q = MemoryQueue::new();
        let mut settings = QueueSettings::new("entries");
        // The first entry of the first batch fails; nothing else does.
        settings.might.entry_errors = 1.0;
        settings.might.draw = Some(first_draws_hit(1));
        let url = q.create_queue(settings).unwrap();
        for body in ["a", "b", "c"] {
            let m = OutgoingMessage {
                body: body.into(),
                ..Default::default()
            };
            q.send(&url, m).await.unwrap();
        }
        let request = ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(30),
        };
        let got = q.receive(&url, request).await.unwrap();
        assert_eq!(got.len(), 3);
        let receipts: Vec<String> = got
            .iter()
            .map(|m| m.receipt_handle().unwrap().to_owned())
            .collect();
        let extended = extend_many(&q, &url, &receipts, None, Duration::from_secs(120)).await;
        assert!(extended.all, "every message extended");
        assert!(extended.refused.is_empty());
        assert_eq!(q.counts(&url).unwrap().entry_errors, 1, "one entry failed");
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(
            q.receive(&url, request).await.unwrap().is_empty(),
            "a message came back though its extension was tried again"
        );
    }

    /// A waiting message received again elsewhere (its visibility lapsed)
    /// is named refused: SQS will not take its old receipt handle, so that
    /// delivery no longer holds it. The newer delivery is extended, and
    /// counts as all the rest.
    #[cfg(feature = "poller")]
    #[tokio::test(start_paused = true)]
    async fn a_stale_receipt_is_named_refused() {
        use crate::protocol::queue::{OutgoingMessage, ReceiveRequest};
        use crate::testkit::queue::{MemoryQueue, QueueSettings};
        let q = MemoryQueue::new();
        let url = q.create_queue(QueueSettings::new("stale")).unwrap();
        let m = OutgoingMessage {
            body: "a".into(),
            ..Default::default()
        };
        q.send(&url, m).await.unwrap();
        let request = ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(1),
        };
        let old = q.receive(&url, request).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        let new = q.receive(&url, request).await.unwrap();
        let receipts: Vec<String> = old
            .iter()
            .chain(&new)
            .map(|m| m.receipt_handle().unwrap().to_owned())
            .collect();
        let extended = extend_many(&q, &url, &receipts, None, Duration::from_secs(30)).await;
        assert!(extended.all, "the newer delivery was extended");
        assert_eq!(extended.refused, vec![receipts[0].clone()]);
    }

    /// A queue whose batch extensions take `batch_takes` and then fail
    /// every entry (`whole: false`) or the whole call (`whole: true`), and
    /// whose single extensions succeed unless the batch failed as a whole;
    /// it notes every single extension's timeout.
    #[cfg(feature = "poller")]
    #[derive(Clone)]
    struct SlowBatches {
        batch_takes: Duration,
        /// How long each single change takes to answer.
        single_takes: Duration,
        whole: bool,
        singles: std::sync::Arc<std::sync::Mutex<Vec<Duration>>>,
    }

    #[cfg(feature = "poller")]
    impl QueueClient for SlowBatches {
        async fn receive(
            &self,
            _: &str,
            _: crate::protocol::queue::ReceiveRequest,
        ) -> Result<Vec<Message>, QueueError> {
            Ok(Vec::new())
        }
        async fn delete(&self, _: &str, _: &str) -> Result<(), QueueError> {
            Ok(())
        }
        async fn delete_batch(
            &self,
            _: &str,
            _: &[String],
        ) -> Result<Vec<crate::protocol::queue::EntryFailure>, QueueError> {
            Ok(Vec::new())
        }
        async fn change_visibility(
            &self,
            queue: &str,
            _: &str,
            timeout: Duration,
        ) -> Result<(), QueueError> {
            self.singles.lock().unwrap().push(timeout);
            tokio::time::sleep(self.single_takes).await;
            if self.whole {
                return Err(QueueError::new(
                    "ChangeMessageVisibility",
                    queue,
                    "no answer",
                    true,
                ));
            }
            Ok(())
        }
        async fn change_visibility_batch(
            &self,
            queue: &str,
            receipts: &[String],
            _: Duration,
        ) -> Result<Vec<crate::protocol::queue::EntryFailure>, QueueError> {
            tokio::time::sleep(self.batch_takes).await;
            if self.whole {
                return Err(QueueError::new(
                    "ChangeMessageVisibilityBatch",
                    queue,
                    "no answer",
                    true,
                ));
            }
            Ok((0..receipts.len())
                .map(|index| crate::protocol::queue::EntryFailure {
                    index,
                    code: "InternalError".into(),
                    message: None,
                })
                .collect())
        }
        async fn send(
            &self,
            _: &str,
            _: crate::protocol::queue::OutgoingMessage,
        ) -> Result<(), QueueError> {
            Ok(())
        }
        async fn attributes(
            &self,
            _: &str,
        ) -> Result<crate::protocol::queue::QueueAttributes, QueueError> {
            Ok(Default::default())
        }
        async fn queue_url(&self, _: &str, name: &str) -> Result<String, QueueError> {
            Ok(name.to_owned())
        }
    }

    /// A message extended alone after its batch gets what is left of the
    /// timeout since the batch call, rounded down to whole seconds, so that
    /// it never outlasts the messages the batch extended; with less than a
    /// second left it is not set at all (0 would make it visible); the
    /// running one is left to its own heartbeat. After a call that failed as a
    /// whole the singles stop at the first (transient) failure.
    #[cfg(feature = "poller")]
    #[tokio::test(start_paused = true)]
    async fn a_message_extended_alone_gets_what_is_left_and_singles_stop_when_sqs_is_out_of_reach()
    {
        let timeout = Duration::from_secs(30);
        let receipts: Vec<String> = (0..12).map(|i| format!("r{i}")).collect();
        let queue = |batch_takes, whole| SlowBatches {
            batch_takes,
            single_takes: Duration::ZERO,
            whole,
            singles: Default::default(),
        };

        // Two batch calls of 0.75 s each, every entry failed: 1.5 s gone.
        let q = queue(Duration::from_millis(750), false);
        // The running one ("r0") is left to its own heartbeat, the waiting
        // ones get what is left.
        assert!(
            extend_many(&q, "q", &receipts, Some("r0"), timeout)
                .await
                .all
        );
        let singles = q.singles.lock().unwrap().clone();
        assert_eq!(singles, vec![Duration::from_secs(28); 11]);

        // Nearly all of it gone in the batch calls: none set alone.
        let q = queue(Duration::from_millis(14_600), false);
        assert!(!extend_many(&q, "q", &receipts, None, timeout).await.all);
        assert!(q.singles.lock().unwrap().is_empty());

        // Both calls failed as a whole: one single tried, then no more.
        let q = queue(Duration::from_secs(1), true);
        let extended = extend_many(&q, "q", &receipts, None, timeout).await;
        assert!(!extended.all);
        assert!(
            extended.refused.is_empty(),
            "a transient failure refuses nothing"
        );
        assert_eq!(
            q.singles.lock().unwrap().clone(),
            vec![Duration::from_secs(28)]
        );
    }

    /// Simulator seed 247521: a heartbeat's extension timed out but landed,
    /// SQS was out of reach until 4 s before the end it set, and the failed
    /// delete of the finished message had stopped trying at the end known
    /// before it, so the message went to the DLQ, effect made, on its last
    /// allowed receive. An extension that failed for a cause that passes,
    /// or was dropped on its way, counts toward the latest end (the delete
    /// is tried until then), never toward the known one; one that
    /// succeeded counts toward both.
    #[cfg(feature = "poller")]
    #[tokio::test(start_paused = true)]
    async fn an_extension_that_failed_or_was_dropped_counts_toward_the_latest_end_only() {
        let lease = Duration::from_secs(30);
        let message = Message::new("m", "b").with_receipt_handle("r");
        let failing = SlowBatches {
            batch_takes: Duration::ZERO,
            single_takes: Duration::ZERO,
            whole: true,
            singles: Default::default(),
        };
        let v = QueueVisibility::new(&failing, "q");
        let start = Instant::now();
        assert!(v.extend(&message, lease).await.is_err());
        assert_eq!(failing.singles.lock().unwrap().len(), 4, "tried four times");
        assert_eq!(v.extended_until(), None);
        // The last try failed after pauses of 0.25, 0.5 and 1 s.
        let last_try = start + Duration::from_millis(1750);
        // It may land later still: counted `LANDS_LATE` beyond.
        assert_eq!(v.extended_at_most(), Some(last_try + lease + LANDS_LATE));

        let working = SlowBatches {
            whole: false,
            ..failing
        };
        let v = QueueVisibility::new(&working, "q");
        let sent = Instant::now();
        v.extend(&message, lease).await.unwrap();
        assert_eq!(v.extended_until(), Some(sent + lease));
        assert_eq!(v.extended_at_most(), Some(sent + lease));

        // Dropped on its way (the handler finished, and its heartbeat with
        // it): it may land, so it counts toward the latest end too.
        let slow = SlowBatches {
            single_takes: Duration::from_secs(10),
            ..working
        };
        let v = QueueVisibility::new(&slow, "q");
        let start = Instant::now();
        let cut = tokio::time::timeout(Duration::from_secs(2), v.extend(&message, lease)).await;
        assert!(cut.is_err(), "still on its way when dropped");
        assert_eq!(v.extended_until(), None);
        assert_eq!(
            v.extended_at_most(),
            Some(start + Duration::from_secs(2) + lease + LANDS_LATE)
        );
    }
}
