//! The step both runtimes take for each message they start
//! ([`Settler::process_and_settle`]): processed with its visibility kept,
//! and its [`Outcome`] turned into what happens to the message ([`Settled`]:
//! done, parked, sent again, or back after a delay). And the FIFO hold
//! ([`hold_group`]): what the rest of a group does after a failure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tracing::{error, info, warn};

use super::lanes;
use super::visibility::{QueueVisibility, retry_later, within_visibility_cap};
use crate::protocol::limits::{SQS_MAX_ATTRIBUTES, SQS_MAX_DELAY};
use crate::protocol::outcome::OutcomeKind;
use crate::protocol::parking::Dlq;
use crate::protocol::processor::{ProcessOptions, VisibilityExtender};
use crate::protocol::queue::{OutgoingMessage, QueueClient};
use crate::{DedupStore, Handler, Message, Outcome, Processor, ProcessorConfig};

/// What became of a message once its outcome was acted on: the one answer
/// both runtimes act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Finished with (completed now or before): let it go, and its large
    /// payload with it.
    Done,
    /// Its copy is in the DLQ with the reason: let it go (its large payload
    /// stays: the copy points to it).
    Parked,
    /// Its key is held elsewhere past what this runtime can wait: sent again
    /// as a new message under the same dedup key (Lambda, see
    /// [`Settler::sending_in_flight_again`]); let this delivery go, its large
    /// payload kept for the copy.
    SentAgain,
    /// Not finished: it comes back after `after` (set on its visibility when
    /// the source queue is known, cut to SQS's 12 hours from the receive),
    /// or, `None`, when its visibility ends as received (not started, or
    /// unreadable).
    Again {
        /// The delay set, if any.
        after: Option<Duration>,
    },
    /// Failed transiently and left as it was, to be run again in place
    /// after `after` ([`OnRetry::InPlace`]): no delay was set, the runtime
    /// keeps it invisible meanwhile (the poller, for the head of a FIFO
    /// group).
    InPlace {
        /// The retry delay the outcome asked for.
        after: Duration,
    },
}

/// What a runtime has a transient failure ([`Outcome::Retry`]) of a message
/// become.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnRetry {
    /// Its retry delay is set on its visibility: it comes back then.
    SetDelay,
    /// Nothing is set ([`Settled::InPlace`]): the runtime runs it again.
    #[cfg_attr(not(feature = "poller"), allow(dead_code))]
    InPlace,
    /// Its attempts are spent (`attempt` of the queue's `maxReceiveCount`):
    /// it is parked, as SQS's redrive policy would move it at its next
    /// receive.
    #[cfg_attr(not(feature = "poller"), allow(dead_code))]
    Park {
        /// The attempt that failed.
        attempt: u32,
    },
}

impl Settled {
    /// Whether the message is let go: the poller deletes it, Lambda leaves
    /// it out of the batch's failures.
    #[cfg(feature = "lambda")]
    pub(crate) fn lets_go(self) -> bool {
        !matches!(self, Settled::Again { .. } | Settled::InPlace { .. })
    }
}

/// One message's step: what processing decided, what became of the message,
/// and until when the handler's visibility extensions keep it invisible.
/// (The Lambda adapter reads only what became of it: Lambda deletes.)
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "poller"), allow(dead_code))]
pub(crate) struct Settlement {
    /// What processing decided.
    pub(crate) outcome: OutcomeKind,
    /// What became of the message.
    pub(crate) settled: Settled,
    /// The last extension's end counted from when it was sent (`None`
    /// without one).
    pub(crate) invisible_until: Option<Instant>,
    /// The latest the message may stay invisible: each extension's end
    /// counted from when it was answered, one that failed for a cause that
    /// passes or was dropped on its way included (it may have landed).
    pub(crate) invisible_at_most: Option<Instant>,
}

/// A message as received: from where (`None` when the source queue is not
/// known: delays are then not set) and at or after when (delays end by
/// SQS's 12 hours from the receive).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Delivery<'a> {
    /// The source queue's URL.
    pub(crate) source: Option<&'a str>,
    /// The message.
    pub(crate) message: &'a Message,
    /// When it was received, by this host's clock (at the latest).
    pub(crate) received_at: Instant,
    /// Another delivery of its message reached the runtime with it (Lambda:
    /// a twin in the same batch, newer or running after it), so this one's
    /// receipt must leave the message's visibility alone, as [`Holding`]
    /// says for the poller.
    pub(crate) superseded: bool,
    /// Until when the message must stay invisible once the handler's
    /// visibility is extended (Lambda: past the invocation's answer, for the
    /// event source mapping's delete that follows it): every extension sets
    /// at least that much. `None`: each extension sets what it asks.
    pub(crate) invisible_through: Option<Instant>,
}

/// The deliveries a runtime holds, by message id, each marked once a newer
/// delivery of its message reaches the same runtime. A standard queue may
/// hand a message to a consumer that already holds it: a twin delivery
/// (SQS's documented "might": the earlier receipt handle stays valid), or a
/// receive after the earlier delivery's visibility lapsed while it waited
/// for its key. Only the newest delivery sets the message's visibility: a
/// retry delay set through an older receipt that SQS still honours would
/// make the message visible while the newer delivery runs, the receive
/// after it would spend a count, and on its last allowed receive the
/// message would reach the DLQ while the newer delivery completed
/// (simulator seed 647). Nor does the newest while an older one is still
/// held: that one may be running its handler (seed 919). The poller lets a
/// delivery that is to come back go when its handling ends, and the others
/// when their lane ends (a finished one's delete is still on its way).
/// And a finished delivery's delete goes through the newest receipt too:
/// SQS may ignore a delete through an older one (seed 269966: an older
/// delivery completed the message after the newest had come back and been
/// let go; the delete through the older receipt left the message, and its
/// next receive moved it to the DLQ). Clones share it.
#[derive(Debug, Clone, Default)]
#[cfg_attr(not(feature = "poller"), allow(dead_code))]
pub(crate) struct Holding(Arc<Mutex<HashMap<String, HeldMessage>>>);

/// The deliveries of one message [`Holding`] knows of.
#[derive(Debug, Default)]
struct HeldMessage {
    deliveries: Vec<HeldReceipt>,
    /// The receipt handle of its newest delivery, held or let go.
    newest: String,
    /// Until when, at the latest, that delivery may keep the message
    /// invisible, noted when it was let go to come back.
    newest_until: Option<Instant>,
    /// A delivery of it finished here (completed, a duplicate, or parked):
    /// its delete was handed over.
    finished: bool,
}

/// One delivery [`Holding`] knows of.
#[derive(Debug)]
struct HeldReceipt {
    receipt: String,
    /// A newer delivery of its message reached the runtime after it.
    superseded: bool,
    /// The visibility timeout its runtime keeps it invisible for (each
    /// extension's).
    lease: Duration,
    /// Until when, at the latest, a visibility set back through its
    /// receipt ([`Settler::retry_later`]) may keep the message invisible.
    set_back_until: Option<Instant>,
}

#[cfg_attr(not(feature = "poller"), allow(dead_code))]
impl Holding {
    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, HeldMessage>) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `message` was received, and its runtime keeps it invisible `lease`
    /// at a time: every delivery of it held so far is now superseded by
    /// this one.
    pub(crate) fn received(&self, message: &Message, lease: Duration) {
        let Some(receipt) = message.receipt_handle() else {
            return;
        };
        self.with(|held| {
            let m = held.entry(message.id().to_owned()).or_default();
            for d in &mut m.deliveries {
                d.superseded = true;
            }
            m.deliveries.push(HeldReceipt {
                receipt: receipt.to_owned(),
                superseded: false,
                lease,
                set_back_until: None,
            });
            receipt.clone_into(&mut m.newest);
            m.newest_until = None;
        });
    }

    /// The delivery of message `id` whose receipt handle is `receipt` is
    /// to come back; it may keep the message invisible until `latest`.
    pub(crate) fn let_go_until(&self, id: &str, receipt: &str, latest: Instant) {
        self.with(|held| {
            if let Some(m) = held.get_mut(id)
                && m.newest == receipt
            {
                m.newest_until = Some(latest);
            }
        });
        self.let_go(id, receipt);
    }

    /// The runtime is done with the delivery of message `id` whose receipt
    /// handle is `receipt`.
    pub(crate) fn let_go(&self, id: &str, receipt: &str) {
        self.with(|held| {
            if let Some(m) = held.get_mut(id) {
                m.deliveries.retain(|d| d.receipt != receipt);
                if m.deliveries.is_empty() {
                    held.remove(id);
                }
            }
        });
    }

    /// Whether this delivery's receipt must leave `message`'s visibility
    /// alone: a newer delivery of it reached the runtime after this one
    /// (held now or not), or another delivery of it is still held here (an
    /// older one may be running its handler and keeps the message invisible
    /// through its own receipt: a retry delay set through this one would
    /// make the message visible under it).
    pub(crate) fn superseded(&self, message: &Message) -> bool {
        let Some(receipt) = message.receipt_handle() else {
            return false;
        };
        self.with(|held| {
            held.get(message.id()).is_some_and(|m| {
                m.deliveries
                    .iter()
                    .any(|d| d.receipt != receipt || d.superseded)
            })
        })
    }

    /// The runtime is done with this delivery of `message` ([`Self::let_go`]
    /// by its receipt handle).
    pub(crate) fn let_go_delivery(&self, message: &Message) {
        if let Some(receipt) = message.receipt_handle() {
            self.let_go(message.id(), receipt);
        }
    }

    /// Whether a newer delivery of `message` reached the runtime after
    /// this one (held or let go since).
    pub(crate) fn delivery_superseded(&self, message: &Message) -> bool {
        let Some(receipt) = message.receipt_handle() else {
            return false;
        };
        self.with(|held| held.get(message.id()).is_some_and(|m| m.newest != receipt))
    }

    /// The newest delivery of `message` held here, where that is not this
    /// delivery: its receipt handle and lease. Notes that its visibility
    /// is about to be set back, for a lease, through that receipt: it may
    /// then stay invisible until `now + lease +` [`LANDS_LATE`] at the
    /// latest ([`Holding::set_back_until`]).
    ///
    /// [`LANDS_LATE`]: super::visibility::LANDS_LATE
    fn newest_held_other(&self, message: &Message) -> Option<(String, Duration)> {
        let receipt = message.receipt_handle()?;
        self.with(|held| {
            let m = held.get_mut(message.id())?;
            if m.newest == receipt {
                return None;
            }
            let newest = m.newest.clone();
            let d = m.deliveries.iter_mut().find(|d| d.receipt == newest)?;
            let latest = Instant::now() + d.lease + super::visibility::LANDS_LATE;
            d.set_back_until = Some(d.set_back_until.map_or(latest, |u| u.max(latest)));
            Some((newest, d.lease))
        })
    }

    /// Until when, at the latest, a visibility set back through this
    /// delivery's receipt may keep its message invisible: its failed
    /// delete is tried until then too.
    pub(crate) fn set_back_until(&self, message: &Message) -> Option<Instant> {
        let receipt = message.receipt_handle()?;
        self.with(|held| {
            held.get(message.id())?
                .deliveries
                .iter()
                .find(|d| d.receipt == receipt)?
                .set_back_until
        })
    }

    /// A delivery of `message` finished here: its delete is handed over.
    pub(crate) fn finished(&self, message: &Message) {
        self.with(|held| {
            if let Some(m) = held.get_mut(message.id()) {
                m.finished = true;
            }
        });
    }

    /// Whether another delivery of `message`, held here alongside this
    /// one, finished it ([`Self::finished`]).
    pub(crate) fn finished_here(&self, message: &Message) -> bool {
        self.with(|held| held.get(message.id()).is_some_and(|m| m.finished))
    }

    /// The receipt handle of the newest delivery of `message` this runtime
    /// received, where that is not this delivery's own and it was let go to
    /// come back (one still held deletes through its own when it is done,
    /// and a delete now would undo its extensions), with until when it may
    /// keep the message invisible at the latest: a delete of the message
    /// goes through it too, tried until then.
    pub(crate) fn newest_let_go(&self, message: &Message) -> Option<(String, Option<Instant>)> {
        if crate::protocol::mutants::active("stale-receipt-delete") {
            return None;
        }
        let receipt = message.receipt_handle()?;
        self.with(|held| {
            held.get(message.id())
                .filter(|m| m.newest != receipt)
                .filter(|m| !m.deliveries.iter().any(|d| d.receipt == m.newest))
                .map(|m| (m.newest.clone(), m.newest_until))
        })
    }
}

/// Acts on outcomes: retries later, parks, sends again, or lets go.
#[derive(Debug)]
pub(crate) struct Settler<Q> {
    pub(crate) queue: Q,
    dlq: Option<Dlq<Q>>,
    send_in_flight_again: bool,
    /// The deliveries the runtime holds (the poller's): a superseded one
    /// sets no retry delay.
    holding: Option<Holding>,
}

impl<Q: QueueClient> Settler<Q> {
    /// A settler parking in `dlq_url`, if any.
    pub(crate) fn new(queue: Q, dlq_url: Option<&str>) -> Self {
        Self {
            dlq: dlq_url.map(|url| Dlq::new(queue.clone(), url)),
            queue,
            send_in_flight_again: false,
            holding: None,
        }
    }

    /// A settler that sets no retry delay through a delivery `holding`
    /// knows to be superseded by a newer one of its message (the poller).
    #[cfg(feature = "poller")]
    pub(crate) fn holding(mut self, holding: Holding) -> Self {
        self.holding = Some(holding);
        self
    }

    /// Makes the message received as `at` visible again after `after` (cut
    /// to SQS's 12 hours from the receive), unless a newer delivery of it
    /// reached this runtime: that one's receipt, not this one's, keeps the
    /// message's visibility ([`Holding`]). Answers the delay as cut.
    pub(crate) async fn retry_later(
        &self,
        url: &str,
        at: &Delivery<'_>,
        after: Duration,
    ) -> Duration {
        if at.superseded
            || self
                .holding
                .as_ref()
                .is_some_and(|h| h.superseded(at.message))
        {
            info!(
                message_id = at.message.id(),
                "another delivery of this message is held here (a newer one, or one still running): its visibility is left to that one"
            );
            return within_visibility_cap(after, at.received_at);
        }
        let after = retry_later(&self.queue, url, at.message, after, at.received_at).await;
        if let Some(holding) = &self.holding {
            self.keep_newer_invisible(holding, url, at.message).await;
        }
        after
    }

    /// After a retry delay set through `message`'s receipt: a newer
    /// delivery of the message that reached this runtime while that call was
    /// on its way may have been made visible by it (SQS keeps one
    /// visibility per message, and a standard queue honours the older
    /// receipt), so the next receive would spend a count while it runs, on
    /// its last allowed receive moving it to the DLQ however it ends
    /// (simulator seeds 308212, 321864: a poller's retry delay landed after
    /// SQS handed it the message again). Its visibility is set again
    /// through its own receipt for a whole lease, as its lane's extensions
    /// do: whichever of the calls lands last sets the end, so this one never
    /// shortens one of theirs, and its latest end is counted toward its
    /// delete's tries ([`Holding::set_back_until`]). A transient failure is
    /// tried again, twice. Standard queues only: SQS hands out no message of
    /// a FIFO queue while it is in flight.
    async fn keep_newer_invisible(&self, holding: &Holding, url: &str, message: &Message) {
        if crate::protocol::queue::is_fifo(url) {
            return;
        }
        for _ in 0..3 {
            let Some((newer, lease)) = holding.newest_held_other(message) else {
                return;
            };
            match self.queue.change_visibility(url, &newer, lease).await {
                Ok(()) => {
                    info!(
                        message_id = message.id(),
                        "a newer delivery of this message arrived while its retry delay was set: it is kept invisible through its own receipt"
                    );
                    return;
                }
                Err(e) if e.is_transient() => {
                    warn!(message_id = message.id(), error = %e, "keeping a newer delivery invisible failed; trying again");
                }
                Err(e) => {
                    warn!(
                        message_id = message.id(),
                        error = %e,
                        "a newer delivery of this message arrived while its retry delay was set, and could not be kept invisible: it may be received again while it runs"
                    );
                    return;
                }
            }
        }
    }

    /// A settler that sends a message whose key is held elsewhere again as
    /// a new message under the same key ([`Settled::SentAgain`]) where it can,
    /// instead of letting it come back: for a runtime that cannot hold a
    /// message until the holder finishes (Lambda: an invocation ends; the
    /// poller waits instead, invisible).
    #[cfg(feature = "lambda")]
    pub(crate) fn sending_in_flight_again(mut self) -> Self {
        self.send_in_flight_again = true;
        self
    }

    /// The step: processes the message with `options`, its visibility kept
    /// on its source queue, and settles the outcome.
    pub(crate) async fn process_and_settle<S: DedupStore, H: Handler>(
        &self,
        processor: &Processor<S, H>,
        at: Delivery<'_>,
        options: ProcessOptions<'_>,
        on_retry: OnRetry,
    ) -> Settlement {
        // The floor ends within SQS's 12 hours from the receive, as a
        // delay does, or SQS would refuse every extension.
        let floor = at.invisible_through.map(|t| {
            Instant::now()
                + within_visibility_cap(t.saturating_duration_since(Instant::now()), at.received_at)
        });
        let visibility = at
            .source
            .map(|url| QueueVisibility::new(&self.queue, url).at_least_through(floor));
        let options = ProcessOptions {
            visibility: visibility.as_ref().map(|v| v as &dyn VisibilityExtender),
            ..options
        };
        // Each boxed, so that this future holds neither inline.
        let outcome = Box::pin(processor.process_with(at.message.clone(), options)).await;
        let kind = outcome.kind();
        let settled = Box::pin(self.settle(processor.config(), at, outcome, on_retry)).await;
        Settlement {
            outcome: kind,
            settled,
            invisible_until: visibility
                .as_ref()
                .and_then(QueueVisibility::extended_until),
            invisible_at_most: visibility
                .as_ref()
                .and_then(QueueVisibility::extended_at_most),
        }
    }

    /// Acts on `outcome` for the message received as `at` says, a
    /// transient failure as `on_retry` says.
    async fn settle(
        &self,
        config: &ProcessorConfig,
        at: Delivery<'_>,
        outcome: Outcome,
        on_retry: OnRetry,
    ) -> Settled {
        match outcome {
            Outcome::Completed { .. } | Outcome::Duplicate { .. } => Settled::Done,
            Outcome::InFlight { retry_after } => {
                if let Some(source) = at.source
                    && self.send_in_flight_again
                    && self
                        .send_again(config, source, at.message, retry_after)
                        .await
                {
                    return Settled::SentAgain;
                }
                self.again(&at, retry_after).await
            }
            Outcome::Retry { after, reason } => match on_retry {
                OnRetry::SetDelay => {
                    info!(message_id = at.message.id(), %reason, ?after, "will retry");
                    self.again(&at, after).await
                }
                OnRetry::InPlace => {
                    info!(message_id = at.message.id(), %reason, ?after, "will retry in place, kept invisible with the rest of its group");
                    Settled::InPlace { after }
                }
                OnRetry::Park { attempt } => {
                    let reason = format!(
                        "{reason} (attempt {attempt}, the queue's maxReceiveCount, retried in place ahead of its FIFO group)"
                    );
                    self.park(config, &at, &reason).await
                }
            },
            Outcome::Park { reason } => self.park(config, &at, &reason).await,
        }
    }

    async fn again(&self, at: &Delivery<'_>, after: Duration) -> Settled {
        let after = match at.source {
            Some(url) => self.retry_later(url, at, after).await,
            None => within_visibility_cap(after, at.received_at),
        };
        Settled::Again { after: Some(after) }
    }

    /// Sends the message with its reason to the DLQ. Without a DLQ, or when
    /// the send fails, the message comes back (and, failing again, ends in the
    /// DLQ by the queue's redrive policy).
    async fn park(&self, config: &ProcessorConfig, at: &Delivery<'_>, reason: &str) -> Settled {
        let message = at.message;
        let Some(dlq) = &self.dlq else {
            error!(message_id = message.id(), %reason, "permanent failure but no SQS_ONCE_DLQ_URL: it comes back until the queue's redrive policy parks it");
            return self.again(at, config.backoff_max).await;
        };
        // Nothing reads a carried key but the ids' sources (which are never
        // scoped): under a sender-scoped key its slot goes to the sender.
        let key = config
            .dedup_key(message)
            .ok()
            .filter(|_| !config.key_source.uses_sender());
        let secret = config.carry_secret.as_ref();
        match dlq.park(message, reason, key.as_deref(), secret).await {
            Ok(()) => {
                warn!(message_id = message.id(), %reason, dlq = dlq.url(), "parked in the DLQ");
                Settled::Parked
            }
            Err(e) => {
                error!(message_id = message.id(), error = %e, "could not park the message; it comes back");
                let delay = config.backoff(message.receive_count());
                self.again(at, delay).await
            }
        }
    }

    /// A message whose key is still in flight elsewhere when it can wait no
    /// longer here: sent again as a new message that comes back `after`
    /// (when the holder's lease ends, at most 15 minutes), to be processed
    /// under the same dedup key; true when it was sent. Let come back
    /// instead, it would spend a receive each time, and a holder that
    /// outlasts `maxReceiveCount` of them would push a copy whose key
    /// completes into the DLQ. False where a copy would not keep its key
    /// ([`copy_to_send_again`]: FIFO, `message-id` or `dedup-id` keys
    /// without a carry secret) or the send failed: the message then comes
    /// back at the holder's lease end, as before. A crash between the send
    /// and the delete leaves two copies of one key: one applies, the other
    /// is a duplicate. (The `bounce-in-flight` mutant never sends.)
    async fn send_again(
        &self,
        config: &ProcessorConfig,
        queue: &str,
        message: &Message,
        after: Duration,
    ) -> bool {
        if crate::protocol::mutants::active("bounce-in-flight") {
            return false;
        }
        let Some(copy) = copy_to_send_again(message, queue, config, after) else {
            info!(
                message_id = message.id(),
                "in flight elsewhere: comes back when that lease ends, spending a receive (a copy sent again would not keep its dedup key: a FIFO queue, or message-id/dedup-id keys without SQS_ONCE_CARRY_SECRET)"
            );
            return false;
        };
        let delay = copy.delay;
        match self.queue.send(queue, copy).await {
            Ok(()) => {
                info!(
                    message_id = message.id(),
                    ?delay,
                    "in flight elsewhere past this invocation: sent again as a new message under the same dedup key, back when that lease ends; this delivery is done"
                );
                true
            }
            Err(e) => {
                warn!(message_id = message.id(), error = %e, "could not send a copy of a key in flight again; it comes back when that lease ends, spending a receive");
                false
            }
        }
    }
}

/// After a FIFO message failed with a delay `after` while `more` of its
/// group wait behind it: sets the failed message's delay again where it must
/// wait longer ([`lanes::hold_behind`]), and answers the delay for the rest
/// of the group. Both runtimes hold a group this way.
pub(crate) async fn hold_group<Q: QueueClient>(
    settler: &Settler<Q>,
    failed: Delivery<'_>,
    after: Duration,
    more: bool,
) -> Duration {
    let (again, rest) = lanes::hold_behind(after, more);
    if let (Some(again), Some(url)) = (again, failed.source) {
        settler.retry_later(url, &failed, again).await;
    }
    rest
}

/// The message to send in place of `message`, a record of the standard
/// queue `queue` whose key is in flight elsewhere, to come back `after` (cut
/// to SQS's 15-minute delay): its body, every message attribute as received
/// and its `AWSTraceHeader`, so that a key read from the body or an
/// attribute (`json:`, `attribute:`, `body-sha256`) is read again, and the
/// producer's trace goes on. Under `message-id` and `dedup-id` keys the
/// copy has a new id: the key goes with it sealed in `sqs_once_dedup_key`
/// ([`crate::protocol::key::carry_key`]), which needs the carry secret. `None` where
/// the copy would not keep its place or its key: a FIFO queue (a copy
/// would join the end of its group, and per-message delays are refused),
/// those key sources without a carry secret or with 10 attributes already,
/// no key. A key scoped to its sender likewise: the copy is SQS's from this
/// consumer, so its first sender goes with it sealed in `sqs_once_sender`
/// ([`crate::protocol::key::carry_sender`]), or no copy is sent.
pub(crate) fn copy_to_send_again(
    message: &Message,
    queue: &str,
    config: &ProcessorConfig,
    after: Duration,
) -> Option<OutgoingMessage> {
    use crate::protocol::key::{DEDUP_KEY_ATTRIBUTE, SENDER_ATTRIBUTE, first_sender};
    // A fair queue's message (a group id on a standard queue) is not sent
    // again either: deliberately conservative, its copy would be sent
    // without the group and lose its fairness.
    if crate::protocol::queue::is_fifo(queue) || message.group_id().is_some() {
        return None;
    }
    let mut attributes = message.attributes().clone();
    // What the copy must carry sealed, where its key reads it: the key
    // itself (a new id), the first sender (SQS names this consumer).
    let key = config
        .key_source
        .uses_ids()
        .then(|| config.dedup_key(message).ok());
    let sender = config
        .key_source
        .uses_sender()
        .then(|| first_sender(message, config.carry_secret.as_ref()).map(str::to_owned));
    for (name, value) in [(DEDUP_KEY_ATTRIBUTE, key), (SENDER_ATTRIBUTE, sender)] {
        let Some(value) = value else { continue };
        let sealed = config
            .carry_secret
            .as_ref()?
            .seal(name, message.body(), &value?);
        attributes.insert(
            name.to_owned(),
            crate::protocol::message::Attribute::string(sealed),
        );
    }
    if attributes.len() > SQS_MAX_ATTRIBUTES {
        return None;
    }
    Some(OutgoingMessage {
        body: message.body().to_owned(),
        attributes,
        delay: Some(after.min(SQS_MAX_DELAY)),
        trace_header: message.aws_trace_header().map(str::to_owned),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each visibility change; the first one lets a newer delivery
    /// of its message reach the runtime while it is on its way.
    #[cfg(feature = "poller")]
    #[derive(Clone)]
    struct Changes {
        inner: crate::testkit::queue::MemoryQueue,
        holding: Holding,
        newer: Message,
        sent: Arc<Mutex<Vec<(String, Duration)>>>,
    }

    #[cfg(feature = "poller")]
    impl QueueClient for Changes {
        async fn receive(
            &self,
            queue: &str,
            request: crate::protocol::queue::ReceiveRequest,
        ) -> Result<Vec<Message>, crate::protocol::queue::QueueError> {
            self.inner.receive(queue, request).await
        }
        async fn delete(
            &self,
            queue: &str,
            receipt: &str,
        ) -> Result<(), crate::protocol::queue::QueueError> {
            self.inner.delete(queue, receipt).await
        }
        async fn delete_batch(
            &self,
            queue: &str,
            receipts: &[String],
        ) -> Result<Vec<crate::protocol::queue::EntryFailure>, crate::protocol::queue::QueueError>
        {
            self.inner.delete_batch(queue, receipts).await
        }
        async fn change_visibility(
            &self,
            _queue: &str,
            receipt: &str,
            timeout: Duration,
        ) -> Result<(), crate::protocol::queue::QueueError> {
            let first = {
                let mut sent = self.sent.lock().unwrap();
                sent.push((receipt.to_owned(), timeout));
                sent.len() == 1
            };
            if first {
                // The call is slow; SQS hands the message out again meanwhile.
                tokio::time::advance(Duration::from_millis(300)).await;
                self.holding.received(&self.newer, Duration::from_secs(30));
                tokio::time::advance(Duration::from_millis(300)).await;
            }
            Ok(())
        }
        async fn change_visibility_batch(
            &self,
            queue: &str,
            receipts: &[String],
            timeout: Duration,
        ) -> Result<Vec<crate::protocol::queue::EntryFailure>, crate::protocol::queue::QueueError>
        {
            self.inner
                .change_visibility_batch(queue, receipts, timeout)
                .await
        }
        async fn send(
            &self,
            queue: &str,
            message: OutgoingMessage,
        ) -> Result<(), crate::protocol::queue::QueueError> {
            self.inner.send(queue, message).await
        }
        async fn attributes(
            &self,
            queue: &str,
        ) -> Result<crate::protocol::queue::QueueAttributes, crate::protocol::queue::QueueError>
        {
            self.inner.attributes(queue).await
        }
        async fn queue_url(
            &self,
            name: &str,
            account: &str,
        ) -> Result<String, crate::protocol::queue::QueueError> {
            self.inner.queue_url(name, account).await
        }
    }

    /// Seeds 308212, 321864: a retry delay set through an older receipt
    /// landed after SQS had handed the message to the same poller again;
    /// the newer delivery is then kept invisible through its own receipt,
    /// for a whole lease (never shorter than its lane's extensions), its
    /// latest end noted for its delete. Not where no newer delivery came,
    /// nor on a FIFO queue (SQS hands out no message in flight there).
    #[cfg(feature = "poller")]
    #[tokio::test(start_paused = true)]
    async fn a_newer_delivery_arriving_while_a_retry_delay_is_set_is_kept_invisible() {
        for (newer_comes, url, expected) in [
            (true, "q", vec![("r1", 2), ("r2", 30)]),
            (false, "q", vec![("r1", 2)]),
            (true, "q.fifo", vec![("r1", 2)]),
        ] {
            let older = Message::new("m", "b").with_receipt_handle("r1");
            let newer = if newer_comes {
                Message::new("m", "b").with_receipt_handle("r2")
            } else {
                Message::new("other", "b").with_receipt_handle("r9")
            };
            let holding = Holding::default();
            holding.received(&older, Duration::from_secs(30));
            let queue = Changes {
                inner: crate::testkit::queue::MemoryQueue::new(),
                holding: holding.clone(),
                newer: newer.clone(),
                sent: Arc::default(),
            };
            let settler = Settler::new(queue.clone(), None).holding(holding.clone());
            let at = Delivery {
                source: Some(url),
                message: &older,
                received_at: Instant::now(),
                superseded: false,
                invisible_through: None,
            };
            let start = Instant::now();
            settler.retry_later(url, &at, Duration::from_secs(2)).await;
            let sent: Vec<(String, u64)> = queue
                .sent
                .lock()
                .unwrap()
                .iter()
                .map(|(r, t)| (r.clone(), t.as_secs()))
                .collect();
            let set_back = expected.len() == 2;
            let expected: Vec<(String, u64)> = expected
                .into_iter()
                .map(|(r, t)| (r.to_owned(), t))
                .collect();
            let case = format!("newer comes: {newer_comes}, queue {url}");
            assert_eq!(sent, expected, "{case}");
            // Counted toward the newer delivery's delete: a lease and
            // `LANDS_LATE` from the set-back (sent 0.6 s after the start).
            let latest = start
                + Duration::from_millis(600)
                + Duration::from_secs(30)
                + super::super::visibility::LANDS_LATE;
            assert_eq!(
                holding.set_back_until(&newer),
                set_back.then_some(latest),
                "{case}"
            );
        }
    }

    /// Seed 269966: an older delivery completes after a newer one of its
    /// message came back and was let go; the delete must also go through
    /// the newer receipt (SQS may ignore an older one). Forgotten once no
    /// delivery of the message is held.
    #[test]
    fn the_newest_receipt_outlives_its_delivery_while_an_older_one_is_held() {
        let older = Message::new("m", "b").with_receipt_handle("r1");
        let newer = Message::new("m", "b").with_receipt_handle("r2");
        let holding = Holding::default();
        holding.received(&older, std::time::Duration::from_secs(30));
        assert_eq!(holding.newest_let_go(&older), None);
        holding.received(&newer, std::time::Duration::from_secs(30));
        assert!(holding.superseded(&older) && holding.superseded(&newer));
        // Held still: it deletes through its own receipt when done.
        assert_eq!(holding.newest_let_go(&older), None);
        let until = Instant::now() + std::time::Duration::from_secs(70);
        holding.let_go_until("m", "r2", until);
        assert_eq!(
            holding.newest_let_go(&older),
            Some(("r2".to_owned(), Some(until)))
        );
        assert_eq!(holding.newest_let_go(&newer), None);
        holding.let_go("m", "r1");
        assert_eq!(holding.newest_let_go(&older), None);
    }
}
