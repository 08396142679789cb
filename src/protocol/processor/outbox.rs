//! The outbox after a commit: send what the handler sent, mark it
//! dispatched, and only then let the incoming message be deleted; a
//! duplicate that finds messages still to send sends them first.

use tracing::{error, info, warn};

use crate::Message;
use crate::protocol::handler::{Context, Handler, HandlerError};
use crate::protocol::outbox::{
    OutboxError, Outgoing, check_outbox, dispatch, dispatch_as, outbox_id,
};
use crate::protocol::outcome::{Outcome, StoredResult};
use crate::protocol::payloads::PayloadErrorKind;
use crate::protocol::store::DedupStore;

use super::Processor;

/// Whether the messages being sent were found on a record (a redelivery or
/// duplicate recovering them) or come from the run that just committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sending {
    /// The run that committed them.
    Committed,
    /// Found on a `COMPLETED` record not marked dispatched.
    Recovered,
    /// A keyless message processed unprotected: no record to mark.
    Unprotected,
}

impl<S: DedupStore, H: Handler> Processor<S, H> {
    /// A context for the handler of `message` (keyed by `key`, unless it
    /// runs unprotected), its attempt and fence, in the processor's settings.
    pub(super) fn context(
        &self,
        key: Option<&str>,
        attempt: (u32, u64),
        message: &Message,
    ) -> Context {
        Context::new(
            &self.config.consumer,
            key,
            attempt,
            message,
            self.config.max_result_bytes,
        )
        .offloading(self.payloads.as_ref())
    }

    /// The handler, then the messages it sent, ready to record: one step, so
    /// that the runtimes keep the message (and the claim) while large
    /// outgoing bodies are stored in S3.
    pub(super) async fn handle(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> Result<(Option<serde_json::Value>, Vec<Outgoing>), HandlerError> {
        let value = self.call_handler(message, ctx).await?;
        Ok((value, self.outbox_of(ctx).await?))
    }

    /// The messages the handler sent, checked, their bodies too large for
    /// SQS stored in S3: a refusal, or sends with no dispatcher to send
    /// them, fail the message permanently before anything is recorded; a
    /// body S3 did not store makes it a retry.
    async fn outbox_of(&self, ctx: &Context) -> Result<Vec<Outgoing>, HandlerError> {
        let outbox = ctx.take_outbox().map_err(HandlerError::permanent)?;
        if outbox.is_empty() {
            // Most handlers send nothing: no id lengths to work out.
            return Ok(outbox);
        }
        if self.dispatcher.is_none() {
            return Err(HandlerError::permanent(OutboxError::NoDispatcher));
        }
        let id_bytes = ctx.outbox_id_bytes();
        let mut ready = Vec::with_capacity(outbox.len());
        for message in outbox {
            if !message.needs_offload(id_bytes) {
                ready.push(message);
                continue;
            }
            let Some(payloads) = self.payloads.as_ref().filter(|_| ctx.offloads()) else {
                return Err(HandlerError::permanent(OutboxError::TooLarge {
                    bytes: message.size(id_bytes),
                }));
            };
            let pointer = payloads
                .store_outgoing(&message.body)
                .await
                .map_err(|e| match e.kind {
                    PayloadErrorKind::TooLarge => HandlerError::permanent(e),
                    _ => HandlerError::retry(format!(
                        "an outgoing message's body could not be stored in S3 (nothing recorded): {e}"
                    )),
                })?;
            ready.push(message.offloaded(&pointer));
        }
        check_outbox(&ready).map_err(HandlerError::permanent)?;
        Ok(ready)
    }

    /// Sends the messages recorded with the `COMPLETED` record `pk`, then
    /// marks them dispatched. `Err(outcome)`: they could not all be sent;
    /// the incoming message must come back (not be deleted) so that its
    /// redelivery sends them.
    pub(super) async fn send_outbox(
        &self,
        message: &Message,
        pk: &str,
        outbox: &[Outgoing],
        sending: Sending,
    ) -> Result<(), Outcome> {
        // (The `outbox-not-recovered` mutant, for the simulator only, lets a
        // duplicate go without sending what its record left unsent.)
        let skip = sending == Sending::Recovered
            && crate::protocol::mutants::active("outbox-not-recovered");
        if outbox.is_empty() || skip {
            return Ok(());
        }
        let Some(dispatcher) = &self.dispatcher else {
            error!(
                pk,
                messages = outbox.len(),
                "the record has messages to send but this processor has no dispatcher (Processor::with_dispatcher): the message comes back"
            );
            return Err(Outcome::Retry {
                after: self.config.backoff(message.receive_count()),
                reason: "committed messages to send, and no dispatcher".into(),
            });
        };
        let secret = self.config.carry_secret.as_ref();
        // (The `send-after-delete` mutant, for the simulator only, sends in
        // the background and answers at once: the incoming message can be
        // deleted before its messages are sent.)
        if sending == Sending::Committed && crate::protocol::mutants::active("send-after-delete") {
            let (dispatcher, store) = (dispatcher.clone(), self.store.clone());
            let (pk, outbox, secret) = (pk.to_owned(), outbox.to_vec(), secret.cloned());
            tokio::spawn(async move {
                if dispatch(&*dispatcher, &pk, &outbox, secret.as_ref())
                    .await
                    .is_ok()
                {
                    let _ = store.mark_dispatched(&pk, &outbox).await;
                }
            });
            return Ok(());
        }
        // (The `outbox-id-per-send` mutant, for the simulator only, mints
        // the messages' ids anew at each send, from the sender's clock: a
        // message sent again carries another id.)
        let sent = if crate::protocol::mutants::active("outbox-id-per-send") {
            let now_ms = self.clock.now_ms();
            let id_of = |i| format!("{}@{now_ms}", outbox_id(pk, i));
            dispatch_as(&**dispatcher, &id_of, outbox, secret).await
        } else {
            dispatch(&**dispatcher, pk, outbox, secret).await
        };
        if let Err(e) = sent {
            self.metrics.outbox_dispatch_failure();
            if e.is_refusal() {
                self.metrics.outbox_refused();
                error!(error = %e, pk, "the effect committed but SQS refuses one of its messages (the target's size limit, a missing queue, no permission): the message comes back until its redrive policy parks it; fix the target, then redrive");
            } else {
                warn!(error = %e, pk, "the effect committed but its messages could not all be sent: the message comes back and its redelivery sends them");
            }
            return Err(Outcome::Retry {
                after: self.config.backoff(message.receive_count()),
                reason: format!("committed, but {e}; sent on redelivery"),
            });
        }
        let n = outbox.len() as u64;
        match sending {
            Sending::Committed => self.metrics.outbox_dispatched(n),
            Sending::Unprotected => {
                self.metrics.outbox_dispatched(n);
                return Ok(());
            }
            Sending::Recovered => {
                info!(
                    pk,
                    messages = n,
                    "sent the messages a committed run left unsent"
                );
                self.metrics.outbox_recovered(n);
            }
        }
        // Best effort: a mark that fails only means a later duplicate sends
        // them again, which their stable ids make harmless.
        if let Err(e) = self.store.mark_dispatched(pk, outbox).await {
            warn!(error = %e, pk, "sent, but the record could not be marked dispatched: a later duplicate sends them again (each carries its stable id)");
        }
        Ok(())
    }

    /// The messages to record with the commit: all of them, except under
    /// the `dispatch-before-commit` mutant (for the simulator only), which
    /// sends them before the commit that should come first and records
    /// none.
    pub(super) async fn to_record(
        &self,
        message: &Message,
        pk: &str,
        outbox: &[Outgoing],
    ) -> Vec<Outgoing> {
        if !outbox.is_empty()
            && crate::protocol::mutants::active("dispatch-before-commit")
            && self
                .send_outbox(message, pk, outbox, Sending::Committed)
                .await
                .is_ok()
        {
            return Vec::new();
        }
        outbox.to_vec()
    }

    /// A duplicate of completed work: its record's unsent messages sent
    /// first (see [`Self::send_outbox`]), then skipped as
    /// [`Processor::duplicate`] says.
    pub(super) async fn duplicate_sending(
        &self,
        message: &Message,
        result: Option<StoredResult>,
        payload_matches: bool,
        outbox: Vec<Outgoing>,
    ) -> Outcome {
        let pk = self
            .config
            .record_key(message.dedup_key().expect("set by process_with"));
        if let Err(outcome) = self
            .send_outbox(message, &pk, &outbox, Sending::Recovered)
            .await
        {
            return outcome;
        }
        self.duplicate(message, result, payload_matches)
    }

    /// A message whose large payload is gone but whose record is
    /// `COMPLETED` (a duplicate, see [`crate::protocol::payloads`]): the
    /// record's unsent messages are sent before it is let go.
    pub(super) async fn duplicate_without_payload(&self, message: &Message) -> Option<Outcome> {
        let key = self.config.dedup_key(message).ok()?;
        let pk = self.config.record_key(&key);
        let now_ms = self.clock.now_ms();
        let record = match self.store.get(&pk).await {
            Ok(Some(r))
                if r.status == crate::Status::Completed
                    && !r.claimable_by(now_ms, message.id()) =>
            {
                r
            }
            Ok(_) => return None,
            Err(e) => {
                return Some(Outcome::Retry {
                    after: self.config.backoff(message.receive_count()),
                    reason: format!("its record could not be read for unsent messages: {e}"),
                });
            }
        };
        self.send_outbox(message, &pk, &record.outbox, Sending::Recovered)
            .await
            .err()
    }
}
