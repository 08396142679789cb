//! The fast path: no claim; the handler's staged writes commit with the
//! `COMPLETED` record in one transaction, or it runs unprotected.

use std::time::Duration;

use tracing::{info, warn};

use crate::Message;
use crate::protocol::handler::{Context, Handler, HandlerError};
use crate::protocol::outcome::{FailureKind, Outcome};
use crate::protocol::store::{
    Claim, DedupStore, FENCE_PER_MS, FastCommit, FastCommitted, StoreError, clock_fence,
};

use super::lease::bound;
use super::outbox::Sending;
use super::*;
use crate::protocol::outbox::Outgoing;

impl<S: DedupStore, H: Handler> Processor<S, H> {
    pub(super) async fn run_unprotected(&self, message: &Message) -> Outcome {
        let ctx = self.context(None, (message.receive_count(), 0), message);
        let handled = self.handle(message, &ctx).await;
        match handled {
            Ok((value, outbox)) => match self.store.commit_unprotected(ctx.take_staged()).await {
                Ok(()) => {
                    // No record to recover from: sent once after the commit,
                    // and again only if the message runs again.
                    let id = format!("{}#unprotected#{}", self.config.consumer, message.id());
                    if let Err(outcome) = self
                        .send_outbox(message, &id, &outbox, Sending::Unprotected)
                        .await
                    {
                        return outcome;
                    }
                    Outcome::Completed {
                        result: value.map(|v| self.bounded(&v)),
                    }
                }
                Err(e) => self.unrecorded_failure(message, e),
            },
            Err(e) => self.failure_without_record(message, &e),
        }
    }

    /// The fast path: run the handler without a claim, then commit the
    /// `COMPLETED` record and the staged writes in one transaction (or find the
    /// key done and write nothing).
    pub(super) async fn run_fast(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
    ) -> Outcome {
        let key = message.dedup_key().expect("set by process_with");
        // The fence: the clock's, taken before the handler runs; the commit
        // stores it only over a lower one.
        let fence = clock_fence(self.clock.now_ms());
        let ctx = self.context(Some(key), (message.receive_count(), fence), message);
        // Kept visible through the read and a duplicate's sends, as
        // through every step that follows (seed 659792).
        // (This step and the commit boxed: inline, each would count in
        // this future's size, moved whole into its box.)
        let insert = match self.handler.effects() {
            Effects::Insert { key } => Some(key),
            _ => None,
        };
        let before = async {
            if insert.is_some() {
                self.parked_before_insert(message, key).await
            } else {
                self.completed_before(message, key).await
            }
        };
        if let Some(done) = Box::pin(self.kept_visible(message, opts, visible, before)).await {
            return done;
        }
        // No claim, so on a standard queue no visibility end enforced here:
        // the commit's condition makes a late finish harmless (a copy run
        // meanwhile is a duplicate at its commit), and finishing records the
        // effect even where SQS is out of reach, so the redelivery is a
        // cheap duplicate. On a FIFO queue a message whose visibility ran
        // out may be moved to the DLQ by the next receive and its group go
        // on: a commit after that would apply it after later messages of
        // its group (simulator seed 291716). There the handler is
        // interrupted at the known end, and nothing commits after it; nor
        // after a Lambda invocation's deadline, where the end is not known
        // before the first extension: the event source mapping has given
        // the record up by then (simulator seed 1162266: an invocation
        // paused before its first extension ran on past its timeout and
        // committed after the record, its receives spent, had gone to the
        // DLQ and its group had moved on).
        let fifo = message.from_fifo_queue();
        bound(&ctx, opts, &[visible]);
        let handled = tokio::select! {
            biased;
            () = visible.passed(), if fifo => {
                ctx.cancelled().cancel();
                return visibility_lost_before_commit();
            }
            () = past_deadline(opts), if fifo && visible.enforced() => {
                ctx.cancelled().cancel();
                return visibility_lost_before_commit();
            }
            r = self.handle(message, &ctx) => r,
            () = self.keep_visible(message, opts, visible) => unreachable!("never returns"),
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted before its commit");
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        let deadline_passed = opts.deadline.is_some_and(|d| d <= Instant::now());
        if fifo && (visible.passed_already() || deadline_passed) && visible.enforced() {
            return visibility_lost_before_commit();
        }
        match handled {
            Ok((value, outbox)) if insert.is_some() => {
                let item_key = insert.unwrap_or_default();
                let commit =
                    self.commit_insert(message, key, opts, visible, &ctx, value, &outbox, item_key);
                Box::pin(commit).await
            }
            Ok((value, outbox)) => {
                let done = Done {
                    ctx: &ctx,
                    value,
                    outbox,
                };
                Box::pin(self.commit(message, key, opts, visible, done)).await
            }
            Err(e) => {
                Box::pin(self.kept_visible(message, opts, visible, self.fast_failure(message, &e)))
                    .await
            }
        }
    }

    /// The fast path's commit of the handler's result, staged writes and
    /// outbox (the message kept visible meanwhile: see
    /// [`Self::while_visible`]), then its outbox sent: the outcome.
    async fn commit(
        &self,
        message: &Message,
        key: &str,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        Done { ctx, value, outbox }: Done<'_>,
    ) -> Outcome {
        let result = value.map(|v| self.bounded(&v));
        let pk = self.config.record_key(key);
        let recorded = self.to_record(message, &pk, &outbox).await;
        let commit = FastCommit {
            pk: pk.clone(),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message.id().to_owned(),
            payload_sha256: self.config.payload_sha256(message),
            fence: ctx.fence(),
            result: result.clone(),
            ttl: self.config.record_ttl(),
            writes: ctx.take_staged(),
            outbox: recorded,
        };
        let committed = self
            .while_visible(message, opts, visible, self.store.commit_fast(commit))
            .await;
        let Some(committed) = committed else {
            return visibility_lost_during_commit();
        };
        match committed {
            Ok(FastCommitted::Committed) => {
                match self
                    .kept_visible(
                        message,
                        opts,
                        visible,
                        self.send_outbox(message, &pk, &outbox, Sending::Committed),
                    )
                    .await
                {
                    Ok(()) => Outcome::Completed { result },
                    Err(outcome) => outcome,
                }
            }
            Ok(FastCommitted::Duplicate {
                result,
                payload_matches,
                outbox: recorded,
            }) => {
                // (The `duplicate-sends-own` mutant, for the simulator only,
                // sends this run's messages instead of the recorded ones.)
                let recorded = if crate::protocol::mutants::active("duplicate-sends-own") {
                    outbox
                } else {
                    recorded
                };
                let sending = self.duplicate_sending(message, result, payload_matches, recorded);
                self.kept_visible(message, opts, visible, sending).await
            }
            Ok(FastCommitted::InFlight {
                lease_until_ms,
                payload_matches,
            }) => self.in_flight(lease_until_ms, payload_matches),
            Ok(FastCommitted::Parked { reason }) => already_parked(reason),
            Ok(FastCommitted::FenceBehind { stored }) => self.fence_behind(ctx.fence(), stored),
            Err(StoreError::WriteConditionFailed { index, kind }) => {
                let e = HandlerError::new(
                    kind,
                    format!("staged write #{index} failed its condition; nothing was written"),
                );
                self.kept_visible(message, opts, visible, self.fast_failure(message, &e))
                    .await
            }
            Err(e) if e.is_permanent() => {
                let e = HandlerError::permanent(e.to_string());
                self.kept_visible(message, opts, visible, self.fast_failure(message, &e))
                    .await
            }
            Err(e) => self.unrecorded_failure(message, e),
        }
    }

    /// A message that came back (receive count above one) may have completed
    /// on an earlier delivery whose answer was lost, or whose invocation ran
    /// out of time after the commit: its record is read before the handler
    /// runs again, so a completed message is let go as a duplicate even when
    /// its handler could never finish again in time (a slow handler on a
    /// short Lambda timeout would otherwise run it out of receives into the
    /// DLQ). One read per redelivery; a first delivery costs nothing more. A
    /// failed read only skips the shortcut.
    pub(super) async fn completed_before(&self, message: &Message, key: &str) -> Option<Outcome> {
        let r = self.completed_record(message, key).await?;
        Some(self.duplicate_of(message, r).await)
    }

    /// The `COMPLETED` record of a message that came back (receive count
    /// above one) under `key`, if its read answers one.
    pub(super) async fn completed_record(
        &self,
        message: &Message,
        key: &str,
    ) -> Option<crate::Record> {
        // (The `no-redelivery-read` mutant, for the simulator only, skips the read.)
        if message.receive_count() <= 1 || crate::protocol::mutants::active("no-redelivery-read") {
            return None;
        }
        self.read_completed(message, key).await
    }

    /// The `COMPLETED` record under `key`, if its read answers one (a failed
    /// read answers none).
    async fn read_completed(&self, message: &Message, key: &str) -> Option<crate::Record> {
        let pk = self.config.record_key(key);
        // A record past its TTL counts as absent, as the claim condition
        // says (DynamoDB deletes expired items late, by days at times).
        let now_ms = self.clock.now_ms();
        match self.store.get(&pk).await {
            Ok(Some(r))
                if r.status == crate::Status::Completed
                    && !r.claimable_by(now_ms, message.id()) =>
            {
                Some(r)
            }
            Ok(_) => None,
            Err(e) => {
                warn!(error = %e, "could not read the record of a message's key");
                None
            }
        }
    }

    /// A duplicate's outcome for the `COMPLETED` record `r` (its recorded
    /// messages sent if still due).
    async fn duplicate_of(&self, message: &Message, r: crate::Record) -> Outcome {
        let payload_matches = r
            .payload_sha256
            .as_deref()
            .is_none_or(|p| p == self.config.payload_sha256(message));
        self.duplicate_sending(message, r.result, payload_matches, r.outbox)
            .await
    }

    /// What the poller finds of a redelivery's key before giving the message
    /// back unprocessed at shutdown (read only for a redelivery, as
    /// [`Self::completed_record`]): done (`COMPLETED`, nothing left to send,
    /// the same body: deleted instead, so a drain does not spend the receive
    /// of a message that is done, on its last allowed receive that would
    /// move it to the DLQ), held elsewhere under a live lease (left invisible
    /// rather than brought back at once: see the poller's `give_back`), or
    /// neither. A message that reuses a key with another body goes through
    /// the processor, which parks it where `SQS_ONCE_PAYLOAD_MISMATCH=park`
    /// says so.
    #[cfg(feature = "poller")]
    pub(crate) async fn before_giving_back(&self, message: &Message) -> KeyFound {
        let Ok(key) = self.config.dedup_key(message) else {
            return KeyFound::Unknown;
        };
        // (The `no-redelivery-read` mutant, for the simulator only, skips the read.)
        if message.receive_count() <= 1 || crate::protocol::mutants::active("no-redelivery-read") {
            return KeyFound::Unknown;
        }
        let pk = self.config.record_key(&key);
        // A record past its TTL or its lease counts as absent, as the claim
        // condition says.
        let now_ms = self.clock.now_ms();
        match self.store.get(&pk).await {
            Ok(Some(r)) if r.claimable_by(now_ms, message.id()) => KeyFound::Unknown,
            // One with messages still to send goes through the processor,
            // which sends them.
            Ok(Some(r))
                if r.status == crate::Status::Completed
                    && r.outbox.is_empty()
                    && r.payload_sha256
                        .as_ref()
                        .is_none_or(|p| *p == self.config.payload_sha256(message)) =>
            {
                KeyFound::Done
            }
            Ok(Some(r)) if r.status == crate::Status::InProgress => KeyFound::HeldElsewhere,
            Ok(_) => KeyFound::Unknown,
            Err(e) => {
                warn!(error = %e, "could not read the record of a redelivery");
                KeyFound::Unknown
            }
        }
    }

    /// A failure on the fast path. A permanent one is recorded as a `FAILED`
    /// record (a claim, then mark-failed) before it is parked, so that a
    /// redelivery of the parked message is recognised and never run; a
    /// duplicate of completed work found on the way is just a duplicate.
    ///
    /// A transient failure reads the key's record first: where another
    /// delivery completed the key meanwhile (a copy SQS handed out twice at
    /// once, another message of the same event), the message is a
    /// duplicate, deleted, not sent back to spend its receives (simulator
    /// seed 614771: a copy on its last allowed receive, whose twin's
    /// delete through the older receipt SQS did not honour, answered retry
    /// a second after its key completed, and went to the DLQ with its
    /// effect made). One read per transient failure; a failed read keeps
    /// the retry.
    pub(super) async fn fast_failure(&self, message: &Message, e: &HandlerError) -> Outcome {
        let outcome = self.failure_without_record(message, e);
        let key = message.dedup_key().expect("set by process_with");
        let Outcome::Park { reason } = outcome else {
            // (The `no-redelivery-read` mutant skips this read too.)
            let read = !crate::protocol::mutants::active("no-redelivery-read");
            if read && let Some(r) = self.read_completed(message, key).await {
                info!(error = %e, "the handler failed, but its key completed on another delivery meanwhile: a duplicate");
                return self.duplicate_of(message, r).await;
            }
            return outcome;
        };
        let req = self.claim_request(message, key, self.config.lease);
        match self.store.claim(&req).await {
            Ok(Claim::Acquired { .. }) => self.mark_failed(message, &req, reason).await,
            Ok(Claim::Duplicate {
                result,
                payload_matches,
                outbox,
            }) => {
                self.duplicate_sending(message, result, payload_matches, outbox)
                    .await
            }
            Ok(Claim::InFlight {
                lease_until_ms,
                payload_matches,
            }) => self.in_flight(lease_until_ms, payload_matches),
            Ok(Claim::Parked { reason }) => already_parked(reason),
            Err(e) => self.unrecorded_failure(message, e),
        }
    }

    /// A fast-path commit refused because the key's stored fence is not
    /// below the one its handler read: a claim or commit came since, or by a
    /// clock ahead of ours. Nothing was written; the message runs again once
    /// this clock's fence passes the stored one.
    fn fence_behind(&self, fence: u64, stored: u64) -> Outcome {
        let behind_ms = (stored - fence.min(stored)) / FENCE_PER_MS + 1;
        warn!(
            fence,
            stored, "the key's fence passed the one the handler read: not committed; it runs again"
        );
        Outcome::Retry {
            after: Duration::from_millis(behind_ms)
                .max(Duration::from_secs(1))
                .min(self.config.backoff_max),
            reason: format!("the key's fence {stored} is not below this run's {fence}"),
        }
    }

    /// A handler failure where no claim is held (fast path, unprotected).
    pub(super) fn failure_without_record(&self, message: &Message, e: &HandlerError) -> Outcome {
        match failure_kind(e) {
            FailureKind::Permanent => Outcome::Park {
                reason: format!("handler failed permanently: {e}"),
            },
            kind => Outcome::Retry {
                after: self.retry_delay(message, kind),
                reason: e.to_string(),
            },
        }
    }
}

/// What [`Processor::before_giving_back`] found of a message's key.
#[cfg(feature = "poller")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyFound {
    /// `COMPLETED`, nothing left to send, the same body.
    Done,
    /// `IN_PROGRESS` under a live lease (another attempt runs it).
    HeldElsewhere,
    /// Neither, or not read.
    Unknown,
}

/// What a handler returned on the fast path, to commit.
struct Done<'a> {
    ctx: &'a Context,
    value: Option<serde_json::Value>,
    outbox: Vec<Outgoing>,
}

/// A FIFO message's visibility ran out while its commit was still trying:
/// no try starts after that end; the commit's outcome is unknown (a try on
/// its way may still land) and the message comes back, where a redelivery
/// finds out.
pub(super) fn visibility_lost_during_commit() -> Outcome {
    warn!(
        "the message's visibility ran out during its commit (FIFO): no further try; it comes back"
    );
    Outcome::Retry {
        after: Duration::ZERO,
        reason: "visibility ran out during the commit (FIFO)".into(),
    }
}

/// A FIFO message's visibility ran out before its fast-path commit: its
/// group may have moved on, so nothing is committed and it comes back.
/// Returns once a Lambda invocation's deadline has passed (never without one).
async fn past_deadline(opts: &ProcessOptions<'_>) {
    match opts.deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn visibility_lost_before_commit() -> Outcome {
    warn!(
        "the message's visibility ran out before its commit (FIFO): not committed; it comes back"
    );
    Outcome::Retry {
        after: Duration::ZERO,
        reason: "visibility ran out before the commit (FIFO)".into(),
    }
}
