//! What the two runtimes share: the lane split ([`lanes`]), visibility through
//! the [`QueueClient`], and turning an [`Outcome`] into what happens to the
//! message ([`Settler::settle`]: finished, parked, or back after a delay).
//!
//! The poller deletes what is finished and parked itself; the Lambda adapter
//! leaves it out of the batch's failures and Lambda deletes it. Either way a
//! message is let go only after its effect is recorded or its copy parked.
//!
//! See the project's `docs/DESIGN.md` ("The runtimes").

pub(crate) mod lanes;

use std::time::Duration;

use futures::future::BoxFuture;
use tracing::{error, info, warn};

use crate::processor::VisibilityExtender;
use crate::queue::{BATCH, Dlq, QueueClient, QueueError};
use crate::{Message, Outcome, ProcessorConfig};

/// Extends visibility with the message's receipt handle on one queue.
pub(crate) struct QueueVisibility<'a, Q> {
    pub(crate) queue: &'a Q,
    pub(crate) url: &'a str,
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
                match self
                    .queue
                    .change_visibility(self.url, receipt, timeout)
                    .await
                {
                    Err(e) if e.is_transient() && tries < VISIBILITY_TRIES => {
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

/// Attempts of one visibility extension (transient failures only).
const VISIBILITY_TRIES: u32 = 4;

/// Makes a message visible again after `after` (best effort: on failure it
/// returns when its current visibility timeout ends).
pub(crate) async fn retry_later<Q: QueueClient>(
    queue: &Q,
    url: &str,
    message: &Message,
    after: Duration,
) {
    let Some(receipt) = message.receipt_handle() else {
        return;
    };
    if let Err(e) = queue.change_visibility(url, receipt, after).await {
        warn!(message_id = message.id(), error = %e, "could not set the retry delay; the message returns after its visibility timeout");
    }
}

/// Sets the visibility timeout of several messages of one queue at once
/// (10 per call, by receipt handle): keeps received messages that wait for
/// their turn invisible. Failures are logged; those messages return when their
/// current visibility ends. True when every one was extended.
pub(crate) async fn extend_many<Q: QueueClient>(
    queue: &Q,
    url: &str,
    receipts: &[String],
    timeout: Duration,
) -> bool {
    let mut all = true;
    for chunk in receipts.chunks(BATCH) {
        match queue.change_visibility_batch(url, chunk, timeout).await {
            Ok(failed) => {
                for f in failed {
                    all = false;
                    warn!(code = f.code, message = ?f.message, "could not keep a waiting message invisible");
                }
            }
            Err(e) => {
                all = false;
                warn!(error = %e, "could not keep waiting messages invisible");
            }
        }
    }
    all
}

/// What became of a message once its outcome was acted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Finished with (completed now or before): let it go.
    Done,
    /// Its copy is in the DLQ with the reason: let it go.
    Parked,
    /// It comes back after this delay (already set on its visibility when
    /// the source queue is known).
    Again(Duration),
}

/// Acts on outcomes: retries later, parks, or lets go.
#[derive(Debug)]
pub(crate) struct Settler<Q> {
    pub(crate) queue: Q,
    pub(crate) dlq: Option<Dlq<Q>>,
}

impl<Q: QueueClient> Settler<Q> {
    /// A settler parking in `dlq_url`, if any.
    pub(crate) fn new(queue: Q, dlq_url: Option<&str>) -> Self {
        Self {
            dlq: dlq_url.map(|url| Dlq::new(queue.clone(), url)),
            queue,
        }
    }

    /// Acts on `outcome` for `message`, received from the queue at `source`
    /// (`None` when it is not known: delays are then not set).
    pub(crate) async fn settle(
        &self,
        config: &ProcessorConfig,
        source: Option<&str>,
        message: &Message,
        outcome: Outcome,
    ) -> Settled {
        match outcome {
            Outcome::Completed { .. } | Outcome::Duplicate { .. } => Settled::Done,
            Outcome::InFlight { retry_after } => self.again(source, message, retry_after).await,
            Outcome::Retry { after, reason } => {
                info!(message_id = message.id(), %reason, ?after, "will retry");
                self.again(source, message, after).await
            }
            Outcome::Park { reason } => self.park(config, source, message, &reason).await,
        }
    }

    async fn again(&self, source: Option<&str>, message: &Message, after: Duration) -> Settled {
        if let Some(url) = source {
            retry_later(&self.queue, url, message, after).await;
        }
        Settled::Again(after)
    }

    /// Sends the message with its reason to the DLQ. Without a DLQ, or when
    /// the send fails, the message comes back (and, failing again, ends in the
    /// DLQ by the queue's redrive policy).
    async fn park(
        &self,
        config: &ProcessorConfig,
        source: Option<&str>,
        message: &Message,
        reason: &str,
    ) -> Settled {
        let Some(dlq) = &self.dlq else {
            error!(message_id = message.id(), %reason, "permanent failure but no SQS_ONCE_DLQ_URL: it comes back until the queue's redrive policy parks it");
            return self.again(source, message, config.backoff_max).await;
        };
        let key = config.key_source.extract(message).ok();
        match dlq.park(message, reason, key.as_deref()).await {
            Ok(()) => {
                warn!(message_id = message.id(), %reason, dlq = dlq.url(), "parked in the DLQ");
                Settled::Parked
            }
            Err(e) => {
                error!(message_id = message.id(), error = %e, "could not park the message; it comes back");
                let delay = config.backoff(message.receive_count());
                self.again(source, message, delay).await
            }
        }
    }
}
