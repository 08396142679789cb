//! The claim path: claim the key (or wait for its holder), run the handler
//! under the heartbeat, then complete, release or mark failed.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tracing::{error, info, warn};

use crate::Message;
use crate::protocol::handler::{Context, Handler, HandlerError};
use crate::protocol::limits::SQS_MAX_VISIBILITY;
use crate::protocol::outbox::Outgoing;
use crate::protocol::outcome::{FailureKind, Outcome, StoredResult};
use crate::protocol::store::{Claim, ClaimRequest, Completion, DedupStore, StoreError};

use super::lease::*;
use super::outbox::Sending;
use super::*;

impl<S: DedupStore, H: Handler> Processor<S, H> {
    pub(super) fn claim_request(
        &self,
        message: &Message,
        key: &str,
        lease: Duration,
    ) -> ClaimRequest {
        ClaimRequest {
            pk: self.config.record_key(key),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message.id().to_owned(),
            payload_sha256: self.config.payload_sha256(message),
            lease,
            ttl: self.config.record_ttl(),
        }
    }

    /// The claim path: claim the key, run the handler only while the lease
    /// holds (extended by the heartbeat), then complete, release or mark failed.
    pub(super) async fn run_claimed(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
    ) -> Outcome {
        let key = message.dedup_key().expect("set by process_with");
        let lease = lease_within(self.config.lease, opts.deadline);
        if lease < Duration::from_secs(1) {
            return Outcome::Retry {
                after: Duration::ZERO,
                reason: "too little time left to start".into(),
            };
        }
        if visible.passed_already() {
            return visibility_lost_before_claim();
        }
        let mut req = self.claim_request(message, key, lease);
        // (The steps around the handler boxed: inline, each would count in
        // this future's size, moved whole into its box.)
        let ((sent, sent_wall_ms), attempt) =
            match Box::pin(self.claim_or_wait(message, opts, visible, &mut req)).await {
                Ok(claimed) => claimed,
                Err(outcome) => return outcome,
            };
        // A wait for a holder shortened the time to the deadline: the lease
        // the claim took.
        let lease = req.lease;
        tracing::Span::current().record("sqs_once.attempt", attempt.0);
        let local = LocalEnd::lease(sent, lease, self.config.margin_for(lease), sent_wall_ms);
        // A step back while the claim was on its way is seen here.
        local.note_wall(self.clock.now_ms());
        if local.remaining() < lease / 2 || visible.passed_already() {
            // The claim's own retries used most of the lease: running now would
            // leave the handler too little time before it must be interrupted.
            warn!(remaining = ?local.remaining(), ?lease, "claim committed too late to be useful; released");
            self.release(&req, "claim committed too late to be useful")
                .await;
            return Outcome::Retry {
                after: self.config.backoff(message.receive_count()),
                reason: "claim committed with too little of its lease left".into(),
            };
        }
        let ctx = self.context(Some(key), attempt, message);
        bound(&ctx, opts, &[&local, visible]);
        // The ends first: a handler woken with its lease or delivery over
        // (a process paused past them, all its timers firing at once) is
        // not polled again, so it starts nothing more.
        let handled = tokio::select! {
            biased;
            () = local.passed() => {
                return Box::pin(self.lease_ended(message, &req, &ctx, LeaseEnd::NotExtended)).await;
            }
            () = visible.passed() => {
                return Box::pin(self.lease_ended(message, &req, &ctx, LeaseEnd::VisibilityLost)).await;
            }
            r = self.handle(message, &ctx) => r,
            found = self.heartbeat(message, &req, lease, opts, Ends { lease: &local, visible }) => {
                return Box::pin(self.lease_ended(message, &req, &ctx, LeaseEnd::TakenOver(found))).await;
            }
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted, claim released");
                Box::pin(self.release(&req, "interrupted by shutdown")).await;
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        Box::pin(self.finish_claimed(message, &req, &ctx, handled, (opts, visible))).await
    }

    /// Claims the key, waiting for another attempt that holds it (see
    /// [`Self::wait_for_holder`]): when the claim was sent and the attempt
    /// number and fence, or the outcome when it was not acquired. Each claim after a
    /// wait asks for a lease cut again to end by the deadline, which the
    /// wait brought closer (Lambda), so that it never outlives the
    /// invocation.
    pub(super) async fn claim_or_wait(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        req: &mut ClaimRequest,
    ) -> Result<((Instant, i64), (u32, u64)), Outcome> {
        loop {
            // The lease is counted from before the claim was sent: the store
            // sets `lease_until` from a clock read no earlier than this. The
            // wall clock read beside it anchors the lease end the store
            // writes (see `LocalEnd::extended`).
            let sent = Instant::now();
            let sent_wall_ms = self.clock.now_ms();
            // Kept visible meanwhile: a duplicate's claim sends what its
            // record left unsent before it answers (seed 659792's case on
            // a later delivery).
            match self
                .kept_visible(message, opts, visible, self.claim(message, req))
                .await
            {
                Ok(attempt) => return Ok(((sent, sent_wall_ms), attempt)),
                Err(Outcome::InFlight { retry_after }) => {
                    let holder_end = Instant::now() + retry_after;
                    if let Some(left) = self
                        .wait_for_holder(message, opts, visible, retry_after, req.lease)
                        .await
                    {
                        return Err(Outcome::InFlight { retry_after: left });
                    }
                    req.lease = lease_within(self.config.lease, opts.deadline);
                    if req.lease < Duration::from_secs(1) {
                        let left = holder_end.saturating_duration_since(Instant::now());
                        return Err(Outcome::InFlight {
                            retry_after: left.max(Duration::from_secs(1)),
                        });
                    }
                }
                Err(outcome) => return Err(outcome),
            }
        }
    }

    /// A copy of a key another attempt holds waits for it here, its message
    /// kept invisible, instead of coming back at the holder's lease end:
    /// the holder's heartbeat keeps moving that end, so a copy bounced each
    /// lease would spend a receive per lease, and one whose holder runs for
    /// longer than `maxReceiveCount` leases would reach the DLQ though its
    /// key completes. Waits until the holder's lease end or a
    /// heartbeat interval, whichever is first, then the claim is tried
    /// again (a duplicate once the holder completed; acquired if it
    /// failed). `None`: try the claim again. `Some(left)`: stop waiting
    /// (no way to keep the message invisible, its visibility could not be
    /// kept, the runtime stops at shutdown, or `wait_until` passed: a
    /// Lambda invocation's margin before its deadline, where the runtime
    /// sends the copy again), and come back after `left`, when the
    /// holder's lease ends.
    pub(super) async fn wait_for_holder(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        retry_after: Duration,
        lease: Duration,
    ) -> Option<Duration> {
        // (The `bounce-in-flight` mutant, for the simulator only, sends the
        // copy back at once, as before.)
        if opts.visibility.is_none() || crate::protocol::mutants::active("bounce-in-flight") {
            return Some(retry_after);
        }
        let started = Instant::now();
        let step = retry_after.min(self.config.beat_for(lease));
        let left = || {
            retry_after
                .saturating_sub(started.elapsed())
                .max(Duration::from_secs(1))
        };
        info!(
            ?retry_after,
            "in flight elsewhere: waiting for that attempt, the message kept invisible"
        );
        let wait_until = async {
            match opts.wait_until {
                Some(until) => tokio::time::sleep_until(until).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = stopped(opts) => Some(left()),
            () = visible.passed() => Some(left()),
            () = wait_until => Some(left()),
            () = tokio::time::sleep(step) => None,
            () = self.keep_visible(message, opts, visible) => unreachable!("never returns"),
        }
    }

    /// Claims the key: the attempt number and the claim's fence, or the
    /// outcome when the claim was not acquired (a duplicate, in flight elsewhere, parked before, or
    /// the claim failed).
    pub(super) async fn claim(
        &self,
        message: &Message,
        req: &ClaimRequest,
    ) -> Result<(u32, u64), Outcome> {
        match self.store.claim(req).await {
            Ok(Claim::Acquired { attempt, fence }) => Ok((attempt, fence)),
            Ok(Claim::Duplicate {
                result,
                payload_matches,
                outbox,
            }) => Err(self
                .duplicate_sending(message, result, payload_matches, outbox)
                .await),
            Ok(Claim::InFlight {
                lease_until_ms,
                payload_matches,
            }) => Err(self.in_flight(lease_until_ms, payload_matches)),
            Ok(Claim::Parked { reason }) => Err(already_parked(reason)),
            Err(e) if e.is_permanent() => Err(Outcome::Park {
                reason: format!("the dedup record cannot be written: {e}"),
            }),
            Err(e) => {
                warn!(error = %e, "claim failed; the handler does not run without a claim");
                Err(Outcome::Retry {
                    after: self.config.store_backoff(message, &e),
                    reason: format!("claim failed: {e}"),
                })
            }
        }
    }

    /// The handler was interrupted because its lease ended: taken over by
    /// another consumer, or not extended in time (this host is cut off from
    /// DynamoDB, or the maximum extension was reached). Its effect is not
    /// recorded; the message comes back.
    pub(super) async fn lease_ended(
        &self,
        message: &Message,
        req: &ClaimRequest,
        ctx: &Context,
        why: LeaseEnd,
    ) -> Outcome {
        ctx.cancelled().cancel();
        self.metrics.lease_lost();
        let reason = match why {
            LeaseEnd::TakenOver(found) => {
                error!(pk = %req.pk, %found, "lease lost while the handler ran; handler interrupted, its effect not recorded");
                "lease lost to another consumer while the handler ran".to_owned()
            }
            LeaseEnd::NotExtended => {
                error!(pk = %req.pk, "the lease could not be extended in time; handler interrupted before it ran out, its effect not recorded");
                // Best effort: if the record is still ours, the key is free at once.
                self.release(req, "lease could not be extended; handler interrupted")
                    .await;
                "lease could not be extended in time; handler interrupted".to_owned()
            }
            LeaseEnd::VisibilityLost => {
                error!(pk = %req.pk, "the message's visibility could not be kept: handler interrupted before SQS can deliver it again, its effect not recorded");
                // Released before the message can reach another consumer,
                // which then claims the key at once instead of bouncing on
                // this lease (each bounce spends one of its receives).
                self.release(req, "visibility could not be kept; handler interrupted")
                    .await;
                "visibility could not be kept; handler interrupted".to_owned()
            }
        };
        Outcome::Retry {
            after: self.config.backoff(message.receive_count()),
            reason,
        }
    }

    /// Completes the claim with the staged writes and the messages sent
    /// (the message kept visible meanwhile: see [`Self::while_visible`]),
    /// then sends them: the outcome, or the failure to handle as the
    /// handler's (a staged write's condition, a permanent store error).
    async fn complete_sending(
        &self,
        message: &Message,
        req: &ClaimRequest,
        ctx: &Context,
        (result, outbox): (Option<StoredResult>, Vec<Outgoing>),
        (opts, visible): Kept<'_, '_>,
    ) -> Result<Outcome, HandlerError> {
        let recorded = self.to_record(message, &req.pk, &outbox).await;
        let completion = Completion {
            pk: req.pk.clone(),
            owner: req.owner.clone(),
            result: result.clone(),
            ttl: self.config.record_ttl(),
            writes: ctx.take_staged(),
            outbox: recorded,
        };
        let completed = self
            .while_visible(message, opts, visible, self.store.complete(completion))
            .await;
        let Some(completed) = completed else {
            self.release(req, "visibility ran out during the completion (FIFO)")
                .await;
            return Ok(super::fast::visibility_lost_during_commit());
        };
        match completed {
            Ok(()) => Ok(
                match self
                    .kept_visible(
                        message,
                        opts,
                        visible,
                        self.send_outbox(message, &req.pk, &outbox, Sending::Committed),
                    )
                    .await
                {
                    Ok(()) => Outcome::Completed { result },
                    Err(outcome) => outcome,
                },
            ),
            Err(StoreError::WriteConditionFailed { index, kind }) => Err(HandlerError::new(
                kind,
                format!("staged write #{index} failed its condition; nothing was written"),
            )),
            Err(e) if e.is_permanent() => Err(HandlerError::permanent(e.to_string())),
            Err(e @ StoreError::LeaseLost { .. }) => {
                self.metrics.lease_lost();
                error!(error = %e, "complete failed the fencing check: lease lost; the effect was not recorded");
                Ok(Outcome::Retry {
                    after: self.config.backoff(message.receive_count()),
                    reason: e.to_string(),
                })
            }
            Err(e) => {
                // Unknown after retries: release (best effort) and let the
                // redelivery find out whether it committed.
                self.release(req, &format!("complete failed: {e}")).await;
                Ok(self.unrecorded_failure(message, e))
            }
        }
    }

    /// After the handler returned: complete (with the staged writes), or
    /// release for a retry, or record `FAILED` and park.
    pub(super) async fn finish_claimed(
        &self,
        message: &Message,
        req: &ClaimRequest,
        ctx: &Context,
        handled: Result<(Option<serde_json::Value>, Vec<Outgoing>), HandlerError>,
        kept: Kept<'_, '_>,
    ) -> Outcome {
        let failure = match handled {
            Ok((value, outbox)) => {
                let result = value.map(|v| self.bounded(&v));
                match self
                    .complete_sending(message, req, ctx, (result, outbox), kept)
                    .await
                {
                    Ok(outcome) => return outcome,
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        match failure_kind(&failure) {
            FailureKind::Permanent => {
                let reason = format!("handler failed permanently: {failure}");
                self.mark_failed(message, req, reason).await
            }
            kind => {
                self.release(req, &failure.to_string()).await;
                Outcome::Retry {
                    after: self.retry_delay(message, kind),
                    reason: failure.to_string(),
                }
            }
        }
    }

    /// Records `FAILED` (with the reason) on our claim, then parks. A message
    /// is parked only once its failure is recorded, so a redelivery of it is
    /// recognised; when the record cannot be written the message comes back
    /// instead.
    pub(super) async fn mark_failed(
        &self,
        message: &Message,
        req: &ClaimRequest,
        reason: String,
    ) -> Outcome {
        // (The `failed-not-marked` mutant, for the simulator only, parks
        // without recording FAILED: the claim is left IN_PROGRESS.)
        if crate::protocol::mutants::active("failed-not-marked") {
            return Outcome::Park { reason };
        }
        match self
            .store
            .mark_failed(&req.pk, &req.owner, &reason, self.config.record_ttl())
            .await
        {
            Ok(()) => Outcome::Park { reason },
            Err(e) => {
                warn!(error = %e, %reason, "could not record FAILED; the message comes back instead of being parked");
                if !matches!(e, StoreError::LeaseLost { .. }) {
                    self.release(req, &reason).await;
                }
                Outcome::Retry {
                    after: self.config.store_backoff(message, &e),
                    reason: format!("permanent failure not recorded ({e}): {reason}"),
                }
            }
        }
    }

    pub(super) fn retry_delay(&self, message: &Message, kind: FailureKind) -> Duration {
        match kind {
            FailureKind::RetryAfter(d) => d.min(SQS_MAX_VISIBILITY),
            _ => self.config.backoff(message.receive_count()),
        }
    }

    /// Recording the effect failed (unknown after retries): the message comes back.
    pub(super) fn unrecorded_failure(&self, message: &Message, e: StoreError) -> Outcome {
        Outcome::Retry {
            after: self.config.store_backoff(message, &e),
            reason: format!("recording the result failed: {e}"),
        }
    }

    pub(super) async fn release(&self, req: &ClaimRequest, reason: &str) {
        // (The `release-skipped` mutant, for the simulator only, leaves the
        // claim held: the key stays blocked until its lease ends.)
        if crate::protocol::mutants::active("release-skipped") {
            return;
        }
        if let Err(e) = self.store.release(&req.pk, &req.owner, reason).await {
            warn!(error = %e, "release failed; the key stays claimed until its lease ends");
        }
    }

    /// The handler, with panics turned into retryable failures.
    pub(super) async fn call_handler(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> Result<Option<serde_json::Value>, HandlerError> {
        let started = tokio::time::Instant::now();
        let redact = self.config.redact_reasons;
        if redact {
            install_redacting_panic_hook();
        }
        let handled = REDACTING
            .scope(
                redact,
                AssertUnwindSafe(self.handler.handle(message, ctx)).catch_unwind(),
            )
            .await;
        self.metrics.handler_latency(started.elapsed());
        match handled {
            Ok(r) if self.config.redact_reasons => r.map_err(|e| e.redacted()),
            Ok(r) => r,
            Err(_) if self.config.redact_reasons => {
                let what = format!(
                    "handler panicked, its message redacted ({})",
                    crate::protocol::handler::REDACTED_BY
                );
                error!("{what}; retrying");
                Err(HandlerError::retry(what))
            }
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".to_owned());
                error!(panic = %what, "handler panicked; retrying");
                Err(HandlerError::retry(format!("handler panicked: {what}")))
            }
        }
    }
}

/// The runtime's options and the message's visibility end, kept during
/// the completion.
type Kept<'o, 'a> = (&'o ProcessOptions<'a>, &'o LocalEnd);

tokio::task_local! {
    /// Set while a handler runs whose panics are redacted
    /// (`redact_reasons`): read by the panic hook.
    static REDACTING: bool;
}

/// Installs, once per process, a panic hook that keeps the message of a
/// redacting handler's panic out of stderr (Rust's default hook prints it
/// before `catch_unwind` sees it, and stderr goes to the logs): for such a
/// panic it prints only where it happened; every other panic goes to the
/// hook that was installed before.
fn install_redacting_panic_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if REDACTING.try_with(|r| *r).unwrap_or(false) {
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                eprintln!(
                    "a handler panicked{at}: its message redacted ({})",
                    crate::protocol::handler::REDACTED_BY
                );
            } else {
                previous(info);
            }
        }));
    });
}
