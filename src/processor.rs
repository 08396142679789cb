//! One message through claim, handler, complete or release: the outcome the
//! runtimes act on.
//!
//! The protocol (record, conditions, fencing, the local lease, unknown
//! outcomes, the fast path) is in the project's `docs/DESIGN.md`.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{Instrument, error, info, warn};

use crate::config::{MissingKey, PayloadMismatch, ProcessorConfig, SQS_MAX_VISIBILITY};
use crate::dedup::{
    Claim, ClaimRequest, Completion, DedupStore, FastCommit, FastCommitted, StoreError,
    StoredResult,
};
use crate::handler::{Context, Effects, FailureKind, Handler, HandlerError};
use crate::key::sha256_hex;
use crate::metrics::Metrics;
use crate::payloads::LargePayloads;
use crate::{Message, clock};

/// What the runtime must do with a message after processing.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The effect is recorded: delete the message.
    Completed {
        /// The recorded result.
        result: Option<StoredResult>,
    },
    /// Already completed earlier: delete the message without running the handler.
    Duplicate {
        /// The result recorded by the first run.
        result: Option<StoredResult>,
        /// False when the record was made by a different body (a producer bug,
        /// logged as such); the message is still treated as a duplicate.
        payload_matches: bool,
    },
    /// Another consumer holds the claim: make the message visible again when that
    /// lease ends, or after the backoff if that comes first.
    InFlight {
        /// Time until the other lease ends, capped by the backoff.
        retry_after: Duration,
    },
    /// Not done: make the message visible again after this delay.
    Retry {
        /// The delay (backoff from the receive count, or the handler's).
        after: Duration,
        /// Why.
        reason: String,
    },
    /// Permanent failure: send the message to the DLQ with the reason, then delete it.
    Park {
        /// Why, for the DLQ and the logs.
        reason: String,
    },
}

impl Outcome {
    /// Whether the message is finished with (delete it; for `Park`, after the DLQ send).
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            Outcome::Completed { .. } | Outcome::Duplicate { .. } | Outcome::Park { .. }
        )
    }

    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Completed { .. } => "completed",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::InFlight { .. } => "in_flight",
            Outcome::Retry { .. } => "retry",
            Outcome::Park { .. } => "parked",
        }
    }
}

/// Extends a message's visibility timeout while its handler runs; provided by
/// the runtime that received it.
pub trait VisibilityExtender: Send + Sync {
    /// Sets the message's visibility timeout to `timeout` from now.
    fn extend<'a>(
        &'a self,
        message: &'a Message,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), crate::queue::QueueError>>;
}

/// Per-call options from the runtime.
#[derive(Default)]
pub struct ProcessOptions<'a> {
    /// Extends the message's visibility alongside the lease.
    pub visibility: Option<&'a dyn VisibilityExtender>,
    /// The lease never outlives this instant (Lambda: the invocation's deadline):
    /// the claim's lease and every extension are cut to end by then.
    pub deadline: Option<tokio::time::Instant>,
    /// Cancelled when the runtime must stop (shutdown deadline): a running handler
    /// is dropped, the claim released, and the outcome is a retry with no delay.
    pub stop: Option<tokio_util::sync::CancellationToken>,
    /// Until when, by this host's clock, the message is known to stay
    /// invisible (the receive or the last extension, sent at an instant, plus
    /// the timeout it asked for). A handler never runs past it: once SQS can
    /// hand the message to another consumer, this one is interrupted (a
    /// margin before) and its claim released, whatever its lease. `None`:
    /// not known yet (a Lambda record before its first extension); from the
    /// first successful extension on it is kept all the same.
    pub invisible_until: Option<Instant>,
    /// When the receive that delivered the message was sent: SQS's 12-hour
    /// visibility cap counts from the receive, so the extensions stop in time
    /// for it. `None`: counted from the start of processing.
    pub received_at: Option<Instant>,
}

/// Takes messages through the claim protocol around a handler.
#[derive(Debug)]
pub struct Processor<S, H> {
    store: Arc<S>,
    handler: Arc<H>,
    config: Arc<ProcessorConfig>,
    clock: Arc<dyn clock::Clock>,
    metrics: Arc<Metrics>,
    payloads: Option<LargePayloads>,
}

impl<S, H> Clone for Processor<S, H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            handler: self.handler.clone(),
            config: self.config.clone(),
            clock: self.clock.clone(),
            metrics: self.metrics.clone(),
            payloads: self.payloads.clone(),
        }
    }
}

impl<S: DedupStore, H: Handler> Processor<S, H> {
    /// A processor; validates the configuration.
    pub fn new(
        store: S,
        handler: H,
        config: ProcessorConfig,
    ) -> Result<Self, crate::config::ConfigError> {
        config.validate()?;
        let metrics = Arc::new(Metrics::default());
        store.report_to(metrics.clone());
        Ok(Self {
            store: Arc::new(store),
            handler: Arc::new(handler),
            config: Arc::new(config),
            clock: Arc::new(clock::SystemClock),
            metrics,
            payloads: None,
        })
    }

    /// Judges other consumers' leases by `clock` instead of the system clock
    /// (tests and simulation; the store should share it).
    pub fn with_clock(mut self, clock: Arc<dyn clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Replaces an S3 pointer body (the SQS Extended Client Libraries') by
    /// the object's content before the dedup key is read: see [`crate::payloads`].
    pub fn with_large_payloads(mut self, payloads: LargePayloads) -> Self {
        self.payloads = Some(payloads);
        self
    }

    /// Large payload support, when on.
    pub fn large_payloads(&self) -> Option<&LargePayloads> {
        self.payloads.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &ProcessorConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// What this processor (and its clones) did; see [`crate::metrics`].
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Warns of and counts the carried attributes of `message` that do not
    /// verify (they are ignored): see [`crate::key::CarrySecret`].
    fn count_unverified(&self, message: &Message) {
        let secret = self.config.carry_secret.as_ref();
        for attribute in crate::key::unverified_attributes(message, secret) {
            let why = if secret.is_some() {
                "its seal does not verify under SQS_ONCE_CARRY_SECRET"
            } else {
                "no SQS_ONCE_CARRY_SECRET is set"
            };
            warn!(
                message_id = message.id(),
                attribute,
                "a carried attribute is ignored: {why} (set by a producer, forwarded from another message, or sealed under another secret)"
            );
            self.metrics.unverified_attribute();
        }
    }

    /// Processes one message with no visibility extension.
    pub async fn process(&self, message: Message) -> Outcome {
        self.process_with(message, ProcessOptions::default()).await
    }

    /// Processes one message.
    pub async fn process_with(&self, mut message: Message, opts: ProcessOptions<'_>) -> Outcome {
        let span = crate::trace::message_span(
            &message,
            &self.config.consumer,
            self.config.trust_producer_sampling,
        );
        let outcome = async {
            if let Some(payloads) = &self.payloads
                && let Err(outcome) = payloads
                    .resolve(&mut message, &self.config, &*self.store)
                    .await
            {
                return outcome;
            }
            self.count_unverified(&message);
            let key = match self.config.dedup_key(&message) {
                Ok(key) => key,
                Err(e) => match self.config.missing_key {
                    MissingKey::Park => {
                        return Outcome::Park {
                            reason: format!("no dedup key: {e}"),
                        };
                    }
                    MissingKey::ProcessUnprotected => {
                        warn!(reason = %e, "no dedup key; processing unprotected as configured");
                        tracing::Span::current().record("sqs_once.path", "unprotected");
                        return self.run_unprotected(&message).await;
                    }
                },
            };
            let span = tracing::Span::current();
            span.record("sqs_once.dedup_key", &*self.config.shown_key(&key));
            span.record("sqs_once.record_key", self.config.record_key(&key).as_str());
            message.set_dedup_key(key);
            if self.config.fast_path && self.handler.effects() == Effects::StagedOnly {
                span.record("sqs_once.path", "fast");
                self.run_fast(&message, &opts).await
            } else {
                span.record("sqs_once.path", "claim");
                self.run_claimed(&message, &opts).await
            }
        }
        .instrument(span.clone())
        .await;
        crate::trace::record_outcome(&span, &outcome);
        self.metrics.outcome(&outcome);
        outcome
    }

    async fn run_unprotected(&self, message: &Message) -> Outcome {
        let ctx = Context::new(
            &self.config.consumer,
            None,
            message.receive_count(),
            message,
            self.config.max_result_bytes,
        );
        match self.call_handler(message, &ctx).await {
            Ok(value) => match self.store.commit_unprotected(ctx.take_staged()).await {
                Ok(()) => Outcome::Completed {
                    result: value.map(|v| self.bounded(&v)),
                },
                Err(e) => self.unrecorded_failure(message, e),
            },
            Err(e) => self.failure_without_record(message, &e),
        }
    }

    /// The fast path: run the handler without a claim, then commit the
    /// `COMPLETED` record and the staged writes in one transaction (or find the
    /// key done and write nothing).
    async fn run_fast(&self, message: &Message, opts: &ProcessOptions<'_>) -> Outcome {
        let key = message.dedup_key().expect("set by process_with");
        let ctx = Context::new(
            &self.config.consumer,
            Some(key),
            message.receive_count(),
            message,
            self.config.max_result_bytes,
        );
        if let Some(done) = self.completed_before(message, key).await {
            return done;
        }
        // No claim, so no visibility end enforced here: the commit's
        // condition makes a late finish harmless (a copy run meanwhile is a
        // duplicate at its commit), and finishing records the effect even
        // where SQS is out of reach, so the redelivery is a cheap duplicate.
        let visible = LocalEnd::visibility(opts, self.config.margin_for(self.config.lease));
        bound(&ctx, opts, &[&visible]);
        let handled = tokio::select! {
            biased;
            r = self.call_handler(message, &ctx) => r,
            () = self.keep_visible(message, opts, &visible) => unreachable!("never returns"),
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted before its commit");
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        let value = match handled {
            Ok(value) => value,
            Err(e) => return self.fast_failure(message, &e).await,
        };
        let result = value.map(|v| self.bounded(&v));
        let commit = FastCommit {
            pk: self.config.record_key(key),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message.id().to_owned(),
            payload_sha256: sha256_hex(message.body().as_bytes()),
            result: result.clone(),
            ttl: self.config.ttl,
            writes: ctx.take_staged(),
        };
        match self.store.commit_fast(commit).await {
            Ok(FastCommitted::Committed) => Outcome::Completed { result },
            Ok(FastCommitted::Duplicate {
                result,
                payload_matches,
            }) => self.duplicate(message, result, payload_matches),
            Ok(FastCommitted::InFlight {
                lease_until_ms,
                payload_matches,
            }) => self.in_flight(lease_until_ms, payload_matches),
            Ok(FastCommitted::Parked { reason }) => already_parked(reason),
            Err(StoreError::WriteConditionFailed { index, kind }) => {
                let e = HandlerError::new(
                    kind,
                    format!("staged write #{index} failed its condition; nothing was written"),
                );
                self.fast_failure(message, &e).await
            }
            Err(e) if e.is_permanent() => {
                let e = HandlerError::permanent(e.to_string());
                self.fast_failure(message, &e).await
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
    async fn completed_before(&self, message: &Message, key: &str) -> Option<Outcome> {
        let r = self.completed_record(message, key).await?;
        let payload_matches = r
            .payload_sha256
            .as_deref()
            .is_none_or(|p| p == sha256_hex(message.body().as_bytes()));
        Some(self.duplicate(message, r.result, payload_matches))
    }

    /// The `COMPLETED` record of a message that came back (receive count
    /// above one) under `key`, if its read answers one.
    async fn completed_record(&self, message: &Message, key: &str) -> Option<crate::Record> {
        // (The `no-redelivery-read` mutant, for the simulator only, skips the read.)
        if message.receive_count() <= 1 || crate::mutants::active("no-redelivery-read") {
            return None;
        }
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
                warn!(error = %e, "could not read the record of a redelivery");
                None
            }
        }
    }

    /// Whether a message that came back is known done: its key's record says
    /// `COMPLETED`. The poller asks before giving a received message back
    /// unprocessed at shutdown: a completed one is deleted instead, so a
    /// drain does not spend the receive of a message that is done (on its
    /// last allowed receive that would move it to the DLQ).
    /// Only a record of the same body counts: a message that reuses a key
    /// with another body goes through the processor, which parks it where
    /// `SQS_ONCE_PAYLOAD_MISMATCH=park` says so.
    #[cfg(feature = "poller")]
    pub(crate) async fn known_completed(&self, message: &Message) -> bool {
        let Ok(key) = self.config.dedup_key(message) else {
            return false;
        };
        self.completed_record(message, &key).await.is_some_and(|r| {
            r.payload_sha256
                .is_none_or(|p| p == sha256_hex(message.body().as_bytes()))
        })
    }

    /// A failure on the fast path. A permanent one is recorded as a `FAILED`
    /// record (a claim, then mark-failed) before it is parked, so that a
    /// redelivery of the parked message is recognised and never run; a
    /// duplicate of completed work found on the way is just a duplicate.
    async fn fast_failure(&self, message: &Message, e: &HandlerError) -> Outcome {
        let outcome = self.failure_without_record(message, e);
        let Outcome::Park { reason } = outcome else {
            return outcome;
        };
        let key = message.dedup_key().expect("set by process_with");
        let req = self.claim_request(message, key, self.config.lease);
        match self.store.claim(&req).await {
            Ok(Claim::Acquired { .. }) => self.mark_failed(message, &req, reason).await,
            Ok(Claim::Duplicate {
                result,
                payload_matches,
            }) => self.duplicate(message, result, payload_matches),
            Ok(Claim::InFlight {
                lease_until_ms,
                payload_matches,
            }) => self.in_flight(lease_until_ms, payload_matches),
            Ok(Claim::Parked { reason }) => already_parked(reason),
            Err(e) => self.unrecorded_failure(message, e),
        }
    }

    /// A handler failure where no claim is held (fast path, unprotected).
    fn failure_without_record(&self, message: &Message, e: &HandlerError) -> Outcome {
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

    /// The result as recorded: as is, or its digest when over the bound.
    fn bounded(&self, value: &serde_json::Value) -> StoredResult {
        let result = StoredResult::bounded(value, self.config.max_result_bytes);
        if let StoredResult::Digest { bytes, .. } = &result {
            warn!(
                bytes,
                limit = self.config.max_result_bytes,
                "result too large; stored as a digest"
            );
        }
        result
    }

    /// Someone else holds the key: come back when their lease ends, or sooner by
    /// the backoff. The other consumer usually finishes long before its lease runs
    /// out, and the backoff grows with every receive, so this never spins.
    /// A duplicate of completed work: skipped, unless its body differs and
    /// such messages are parked.
    fn duplicate(
        &self,
        message: &Message,
        result: Option<StoredResult>,
        payload_matches: bool,
    ) -> Outcome {
        if let Some(parked) = self.payload_mismatch(message, payload_matches, "completed") {
            return parked;
        }
        info!("duplicate of completed work; skipped");
        Outcome::Duplicate {
            result,
            payload_matches,
        }
    }

    /// A body that differs from the one recorded under its key (`state`:
    /// what the record is; only a completed one is ever parked against):
    /// counted and logged; `Some(Park)` when such messages are parked.
    fn payload_mismatch(
        &self,
        message: &Message,
        payload_matches: bool,
        state: &str,
    ) -> Option<Outcome> {
        if payload_matches {
            return None;
        }
        self.metrics.payload_mismatch();
        let key = self
            .config
            .shown_key(message.dedup_key().unwrap_or_default());
        match self.config.payload_mismatch {
            PayloadMismatch::Warn => {
                warn!(
                    state,
                    "same dedup key, different payload: a producer bug; treated as its key says (SQS_ONCE_PAYLOAD_MISMATCH=warn)"
                );
                None
            }
            PayloadMismatch::Park => Some(Outcome::Park {
                reason: format!(
                    "payload mismatch: dedup key {key:?} is {state} for a message with a different body (a producer reused the key); parked as SQS_ONCE_PAYLOAD_MISMATCH=park says, the recorded effect is unchanged"
                ),
            }),
        }
    }

    fn in_flight(&self, lease_until_ms: i64, payload_matches: bool) -> Outcome {
        if !payload_matches {
            // Counted and logged, never parked while in flight: that
            // attempt may yet fail, and this message then be the one whose
            // effect is recorded (a park here, with no FAILED record, could
            // be redelivered and run after later messages of its group).
            self.metrics.payload_mismatch();
            warn!(
                "same dedup key, different payload while in flight: a producer bug; comes back when that attempt ends"
            );
        }
        // Back when the other attempt's lease ends, not sooner: every bounce
        // spends one of the message's receives, and a copy bounced every
        // backoff step while a long handler runs elsewhere can run out of
        // them and be moved to the DLQ, its effect made (simulator seed
        // 18184). A copy whose key completes meanwhile is deleted as a
        // duplicate when it comes back.
        let wait = (lease_until_ms - self.clock.now_ms()).max(1000);
        Outcome::InFlight {
            retry_after: Duration::from_millis(u64::try_from(wait).unwrap_or(1000))
                .min(SQS_MAX_VISIBILITY),
        }
    }

    /// Extends the message's visibility every heartbeat while a handler without a
    /// claim runs (fast path), moving the local visibility end after each
    /// extension. Never returns.
    async fn keep_visible(&self, message: &Message, opts: &ProcessOptions<'_>, visible: &LocalEnd) {
        let Some(v) = opts.visibility else {
            return std::future::pending().await;
        };
        let lease = self.config.lease;
        let margin = self.config.margin_for(lease);
        let interval = self.config.beat_for(lease);
        let counted_from = opts.received_at.unwrap_or_else(Instant::now);
        loop {
            tokio::time::sleep(visible.next_beat(interval)).await;
            if counted_from.elapsed() + lease > self.config.max_extension {
                return std::future::pending().await;
            }
            let sent = Instant::now();
            match v.extend(message, lease).await {
                Ok(()) => {
                    visible.move_to(sent + lease.saturating_sub(margin));
                    self.metrics.heartbeat_extension();
                }
                Err(e) => warn!(error = %e, "visibility extension failed"),
            }
        }
    }

    fn claim_request(&self, message: &Message, key: &str, lease: Duration) -> ClaimRequest {
        ClaimRequest {
            pk: self.config.record_key(key),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message.id().to_owned(),
            payload_sha256: sha256_hex(message.body().as_bytes()),
            lease,
            ttl: self.config.ttl,
        }
    }

    /// The claim path: claim the key, run the handler only while the lease
    /// holds (extended by the heartbeat), then complete, release or mark failed.
    async fn run_claimed(&self, message: &Message, opts: &ProcessOptions<'_>) -> Outcome {
        let key = message.dedup_key().expect("set by process_with");
        let lease = lease_within(self.config.lease, opts.deadline);
        if lease < Duration::from_secs(1) {
            return Outcome::Retry {
                after: Duration::ZERO,
                reason: "too little time left to start".into(),
            };
        }
        let visible = LocalEnd::visibility(opts, self.config.margin_for(lease));
        if visible.passed_already() {
            return visibility_lost_before_claim();
        }
        let req = self.claim_request(message, key, lease);
        let (sent, attempt) = loop {
            // The lease is counted from before the claim was sent: the store
            // sets `lease_until` from a clock read no earlier than this.
            let sent = Instant::now();
            match self.claim(message, &req).await {
                Ok(attempt) => break (sent, attempt),
                Err(Outcome::InFlight { retry_after }) => {
                    if let Some(left) = self
                        .wait_for_holder(message, opts, &visible, retry_after, lease)
                        .await
                    {
                        return Outcome::InFlight { retry_after: left };
                    }
                }
                Err(outcome) => return outcome,
            }
        };
        tracing::Span::current().record("sqs_once.attempt", attempt);
        let local = LocalEnd::lease(sent, lease, self.config.margin_for(lease));
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
        let ctx = Context::new(
            &self.config.consumer,
            Some(key),
            attempt,
            message,
            self.config.max_result_bytes,
        );
        bound(&ctx, opts, &[&local, &visible]);
        let handled = tokio::select! {
            biased;
            r = self.call_handler(message, &ctx) => r,
            found = self.heartbeat(message, &req, lease, opts, Ends { lease: &local, visible: &visible }) => {
                return self.lease_ended(message, &req, &ctx, LeaseEnd::TakenOver(found)).await;
            }
            () = local.passed() => {
                return self.lease_ended(message, &req, &ctx, LeaseEnd::NotExtended).await;
            }
            () = visible.passed() => {
                return self.lease_ended(message, &req, &ctx, LeaseEnd::VisibilityLost).await;
            }
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted, claim released");
                self.release(&req, "interrupted by shutdown").await;
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        self.finish_claimed(message, &req, &ctx, handled).await
    }

    /// A copy of a key another attempt holds waits for it here, its message
    /// kept invisible, instead of coming back at the holder's lease end:
    /// the holder's heartbeat keeps moving that end, so a copy bounced each
    /// lease would spend a receive per lease, and one whose holder runs for
    /// longer than `maxReceiveCount` leases would reach the DLQ though its
    /// key completes (issue 27). Waits until the holder's lease end or a
    /// heartbeat interval, whichever is first, then the claim is tried
    /// again (a duplicate once the holder completed; acquired if it
    /// failed). `None`: try the claim again. `Some(left)`: stop waiting
    /// (no way to keep the message invisible, its visibility could not be
    /// kept, or the runtime stops: shutdown, a Lambda deadline), and come
    /// back after `left`, when the holder's lease ends.
    async fn wait_for_holder(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        retry_after: Duration,
        lease: Duration,
    ) -> Option<Duration> {
        // (The `bounce-in-flight` mutant, for the simulator only, sends the
        // copy back at once, as before.)
        if opts.visibility.is_none() || crate::mutants::active("bounce-in-flight") {
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
        tokio::select! {
            biased;
            () = stopped(opts) => Some(left()),
            () = visible.passed() => Some(left()),
            () = tokio::time::sleep(step) => None,
            () = self.keep_visible(message, opts, visible) => unreachable!("never returns"),
        }
    }

    /// Claims the key: the attempt number, or the outcome when the claim
    /// was not acquired (a duplicate, in flight elsewhere, parked before, or
    /// the claim failed).
    async fn claim(&self, message: &Message, req: &ClaimRequest) -> Result<u32, Outcome> {
        match self.store.claim(req).await {
            Ok(Claim::Acquired { attempt }) => Ok(attempt),
            Ok(Claim::Duplicate {
                result,
                payload_matches,
            }) => Err(self.duplicate(message, result, payload_matches)),
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
                    after: self.config.backoff(message.receive_count()),
                    reason: format!("claim failed: {e}"),
                })
            }
        }
    }

    /// The handler was interrupted because its lease ended: taken over by
    /// another consumer, or not extended in time (this host is cut off from
    /// DynamoDB, or the maximum extension was reached). Its effect is not
    /// recorded; the message comes back.
    async fn lease_ended(
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

    /// After the handler returned: complete (with the staged writes), or
    /// release for a retry, or record `FAILED` and park.
    async fn finish_claimed(
        &self,
        message: &Message,
        req: &ClaimRequest,
        ctx: &Context,
        handled: Result<Option<serde_json::Value>, HandlerError>,
    ) -> Outcome {
        let failure = match handled {
            Ok(value) => {
                let result = value.map(|v| self.bounded(&v));
                let completion = Completion {
                    pk: req.pk.clone(),
                    owner: req.owner.clone(),
                    result: result.clone(),
                    ttl: self.config.ttl,
                    writes: ctx.take_staged(),
                };
                match self.store.complete(completion).await {
                    Ok(()) => return Outcome::Completed { result },
                    Err(StoreError::WriteConditionFailed { index, kind }) => HandlerError::new(
                        kind,
                        format!("staged write #{index} failed its condition; nothing was written"),
                    ),
                    Err(e) if e.is_permanent() => HandlerError::permanent(e.to_string()),
                    Err(e @ StoreError::LeaseLost { .. }) => {
                        self.metrics.lease_lost();
                        error!(error = %e, "complete failed the fencing check: lease lost; the effect was not recorded");
                        return Outcome::Retry {
                            after: self.config.backoff(message.receive_count()),
                            reason: e.to_string(),
                        };
                    }
                    Err(e) => {
                        // Unknown after retries: release (best effort) and let the
                        // redelivery find out whether it committed.
                        self.release(req, &format!("complete failed: {e}")).await;
                        return self.unrecorded_failure(message, e);
                    }
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
    async fn mark_failed(&self, message: &Message, req: &ClaimRequest, reason: String) -> Outcome {
        match self
            .store
            .mark_failed(&req.pk, &req.owner, &reason, self.config.ttl)
            .await
        {
            Ok(()) => Outcome::Park { reason },
            Err(e) => {
                warn!(error = %e, %reason, "could not record FAILED; the message comes back instead of being parked");
                if !matches!(e, StoreError::LeaseLost { .. }) {
                    self.release(req, &reason).await;
                }
                Outcome::Retry {
                    after: self.config.backoff(message.receive_count()),
                    reason: format!("permanent failure not recorded ({e}): {reason}"),
                }
            }
        }
    }

    fn retry_delay(&self, message: &Message, kind: FailureKind) -> Duration {
        match kind {
            FailureKind::RetryAfter(d) => d.min(SQS_MAX_VISIBILITY),
            _ => self.config.backoff(message.receive_count()),
        }
    }

    /// Recording the effect failed (unknown after retries): the message comes back.
    fn unrecorded_failure(&self, message: &Message, e: StoreError) -> Outcome {
        Outcome::Retry {
            after: self.config.backoff(message.receive_count()),
            reason: format!("recording the result failed: {e}"),
        }
    }

    async fn release(&self, req: &ClaimRequest, reason: &str) {
        if let Err(e) = self.store.release(&req.pk, &req.owner, reason).await {
            warn!(error = %e, "release failed; the key stays claimed until its lease ends");
        }
    }

    /// The handler, with panics turned into retryable failures.
    async fn call_handler(
        &self,
        message: &Message,
        ctx: &Context,
    ) -> Result<Option<serde_json::Value>, HandlerError> {
        let started = tokio::time::Instant::now();
        let handled = AssertUnwindSafe(self.handler.handle(message, ctx))
            .catch_unwind()
            .await;
        self.metrics.handler_latency(started.elapsed());
        match handled {
            Ok(r) if self.config.redact_reasons => r.map_err(|e| e.redacted()),
            Ok(r) => r,
            Err(_) if self.config.redact_reasons => {
                let what = format!(
                    "handler panicked, its message redacted ({})",
                    crate::handler::REDACTED_BY
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

    /// Extends the lease (and the visibility) every heartbeat until the total
    /// (counted from the receive, as SQS counts its 12 hours) reaches the
    /// maximum, moving the local lease and visibility ends forward after each
    /// extension; beats sooner when the visibility would end before the next
    /// beat. Returns only when another consumer holds the key (what the
    /// record holds now); a failed extension is tried again at the next beat,
    /// and if none succeeds in time the local ends interrupt the handler.
    async fn heartbeat(
        &self,
        message: &Message,
        req: &ClaimRequest,
        lease: Duration,
        opts: &ProcessOptions<'_>,
        ends: Ends<'_>,
    ) -> String {
        let interval = self.config.beat_for(lease);
        let counted_from = opts.received_at.unwrap_or_else(Instant::now);
        loop {
            tokio::time::sleep(ends.visible.next_beat(interval)).await;
            if counted_from.elapsed() + lease > self.config.max_extension {
                warn!(
                    "maximum extension reached: the lease is no longer extended and the handler is interrupted when it ends"
                );
                return std::future::pending().await;
            }
            let lease = lease_within(lease, opts.deadline);
            if lease.is_zero() {
                // At the deadline: the runtime stops the handler, not the heartbeat.
                return std::future::pending().await;
            }
            let margin = self.config.margin_for(lease);
            // Visibility and lease together: a slow DynamoDB must not delay
            // the message's extension past its visibility timeout.
            let sent = Instant::now();
            let visibility = async {
                if let Some(v) = opts.visibility {
                    match v.extend(message, lease).await {
                        Ok(()) => ends.visible.move_to(sent + lease.saturating_sub(margin)),
                        Err(e) => warn!(error = %e, "visibility extension failed"),
                    }
                }
            };
            let extended = self
                .store
                .extend_lease(&req.pk, &req.owner, lease, self.config.ttl);
            match futures::join!(extended, visibility).0 {
                Ok(()) => {
                    ends.lease.move_to(sent + lease.saturating_sub(margin));
                    self.metrics.heartbeat_extension();
                }
                Err(StoreError::LeaseLost { found, .. }) => return found,
                Err(e) => warn!(error = %e, "lease extension failed; will try again"),
            }
        }
    }
}

/// A running claim's two local ends, both moved by the heartbeat.
#[derive(Clone, Copy)]
struct Ends<'a> {
    lease: &'a LocalEnd,
    visible: &'a LocalEnd,
}

/// Why a running handler's lease ended.
enum LeaseEnd {
    /// Another consumer took the key over (what the record holds now).
    TakenOver(String),
    /// No extension succeeded before the local lease end.
    NotExtended,
    /// The message's visibility was not extended before its local end: SQS
    /// may hand it to another consumer.
    VisibilityLost,
}

/// An end this host keeps by its own clock, moved later by extensions.
///
/// For the claim's lease: it ends `margin` before the lease the store holds,
/// counted from before the claim (or the last successful extension) was sent,
/// so the handler has stopped before another consumer can take the key, even
/// with some clock skew between them. For the message's visibility: `margin`
/// before SQS can deliver it again, counted from before the receive (or the
/// last successful extension) was sent; `None` while it is not known.
struct LocalEnd {
    end: watch::Sender<Option<Instant>>,
    /// The message's visibility (else the claim's lease).
    visibility: bool,
}

/// Tells `ctx` the ends its handler must finish by: the invocation's
/// deadline and `ends` (see [`Context::time_left`]).
fn bound(ctx: &Context, opts: &ProcessOptions<'_>, ends: &[&LocalEnd]) {
    if let Some(deadline) = opts.deadline {
        ctx.bounded_by(watch::Sender::new(Some(deadline)).subscribe());
    }
    for end in ends {
        ctx.bounded_by(end.end.subscribe());
    }
}

impl LocalEnd {
    fn lease(sent: Instant, lease: Duration, margin: Duration) -> Self {
        Self {
            end: watch::Sender::new(Some(sent + lease.saturating_sub(margin))),
            visibility: false,
        }
    }

    /// The visibility end the runtime knows of, less `margin`.
    fn visibility(opts: &ProcessOptions<'_>, margin: Duration) -> Self {
        let end = opts
            .invisible_until
            .map(|until| until.checked_sub(margin).unwrap_or(until));
        Self {
            end: watch::Sender::new(end),
            visibility: true,
        }
    }

    /// Time left before the handler must be interrupted (a long time if not known).
    fn remaining(&self) -> Duration {
        self.end.borrow().map_or(SQS_MAX_VISIBILITY, |end| {
            end.saturating_duration_since(Instant::now())
        })
    }

    /// The end is known and has passed.
    fn passed_already(&self) -> bool {
        self.end.borrow().is_some_and(|end| end <= Instant::now())
    }

    /// How long to wait before the next extension: the heartbeat's interval,
    /// or less when the end would come first (half the time left, so that an
    /// extension and its retries land before it).
    fn next_beat(&self, interval: Duration) -> Duration {
        interval
            .min(self.remaining() / 2)
            .max(Duration::from_millis(50))
    }

    /// An extension moved the end to `end` (never earlier than it was).
    fn move_to(&self, end: Instant) {
        self.end.send_if_modified(|current| {
            let later = current.is_none_or(|c| end > c);
            if later {
                *current = Some(end);
            }
            later
        });
    }

    /// Completes when the end passes without an extension.
    async fn passed(&self) {
        let mut rx = self.end.subscribe();
        loop {
            let end = *rx.borrow_and_update();
            let Some(end) = end.filter(|_| self.enforced()) else {
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
                continue;
            };
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(end) => {
                    if rx.borrow().is_some_and(|e| e <= Instant::now()) {
                        return;
                    }
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        return std::future::pending().await;
                    }
                }
            }
        }
    }

    /// Whether this end interrupts a handler. (The `lease-not-enforced` and
    /// `visibility-not-kept` mutants, for the simulator only, let a handler
    /// run past its lease or its visibility.)
    fn enforced(&self) -> bool {
        let mutant = if self.visibility {
            "visibility-not-kept"
        } else {
            "lease-not-enforced"
        };
        !crate::mutants::active(mutant)
    }
}

/// The outcome of a claim-path message whose visibility ran out before its
/// claim: not claimed, not run; it comes back with no delay of its own (it
/// is visible again already).
fn visibility_lost_before_claim() -> Outcome {
    error!(
        "the message's visibility could not be kept before its claim: not run, its effect not recorded"
    );
    Outcome::Retry {
        after: Duration::ZERO,
        reason: "visibility could not be kept before its claim".into(),
    }
}

/// What a failure says happens next. (The `transient-as-permanent` mutant,
/// for the simulator only, takes every failure as permanent: a panic or a
/// store outage parks the message.)
fn failure_kind(e: &HandlerError) -> FailureKind {
    if crate::mutants::active("transient-as-permanent") {
        return FailureKind::Permanent;
    }
    e.kind()
}

/// A redelivery of a message that was parked before (its delete after the park
/// failed, or a Lambda invocation ended after the park): never run again,
/// parked again with the recorded reason.
fn already_parked(reason: Option<String>) -> Outcome {
    warn!("redelivery of a message already parked; not run, parked again");
    Outcome::Park {
        reason: format!(
            "redelivered after it was parked; not run again (first reason: {})",
            reason.as_deref().unwrap_or("not recorded")
        ),
    }
}

/// Completes when the runtime asks running handlers to stop.
async fn stopped(opts: &ProcessOptions<'_>) {
    match &opts.stop {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// `lease`, cut so that it ends by `deadline`.
fn lease_within(lease: Duration, deadline: Option<Instant>) -> Duration {
    deadline.map_or(lease, |d| {
        lease.min(d.saturating_duration_since(Instant::now()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::key::record_key;
    use crate::{MemoryStore, handler_fn};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn config() -> ProcessorConfig {
        let mut c = ProcessorConfig::new("test");
        c.key_source = "json:/id".parse().unwrap();
        c
    }

    #[tokio::test(start_paused = true)]
    async fn the_context_tells_the_receive_count_the_invocation_and_the_time_left() {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let handler = handler_fn(move |_m: Message, ctx: Context| {
            let log = log.clone();
            async move {
                log.lock().unwrap().push((
                    ctx.receive_count(),
                    ctx.lambda_request_id().map(str::to_owned),
                    ctx.time_left(),
                ));
                Ok(None)
            }
        });
        let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
        let message = Message::new("m-1", r#"{"id":"a"}"#).with_receive_count(3);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let opts = ProcessOptions {
            deadline: Some(deadline),
            ..ProcessOptions::default()
        };
        let run = crate::handler::in_invocation("req-1".into(), p.process_with(message, opts));
        assert!(matches!(run.await, Outcome::Completed { .. }));
        let (count, request, left) = seen.lock().unwrap()[0].clone();
        assert_eq!(count, 3);
        assert_eq!(request.as_deref(), Some("req-1"));
        // The nearest end: the claim's lease, cut to end at the invocation's
        // deadline in 20 s, less its margin (a tenth of the 20 s).
        assert_eq!(left, Some(Duration::from_secs(18)));

        let plain = Message::new("m-2", r#"{"id":"b"}"#);
        assert!(matches!(p.process(plain).await, Outcome::Completed { .. }));
        let (count, request, left) = seen.lock().unwrap()[1].clone();
        assert_eq!((count, request), (1, None));
        let lease_left = left.expect("the claim's lease bounds the handler");
        assert!(
            lease_left <= Duration::from_secs(60) && lease_left >= Duration::from_secs(50),
            "{lease_left:?}"
        );
    }

    #[tokio::test]
    async fn a_redelivery_of_a_completed_message_on_the_fast_path_is_skipped_without_running_its_handler()
     {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let handler = crate::staged_only(handler_fn(move |_m, _ctx| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                Ok(Some(serde_json::json!({"ok": true})))
            }
        }));
        let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
        let first = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
        assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
        // The same message back (its delete lost, or its invocation out of
        // time after the commit): read first, never run again.
        let again = p
            .process(Message::new("m1", r#"{"id":"e1"}"#).with_receive_count(2))
            .await;
        assert_eq!(
            again,
            Outcome::Duplicate {
                result: Some(StoredResult::Value(serde_json::json!({"ok": true}))),
                payload_matches: true
            }
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran again");
        // A first delivery of another message with the key runs the handler
        // (its writes are dropped at the commit): no read on the happy path.
        let other = p.process(Message::new("m2", r#"{"id":"e1"}"#)).await;
        assert!(matches!(other, Outcome::Duplicate { .. }), "{other:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn runs_once_then_skips_duplicates_with_the_result() {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let handler = handler_fn(move |_m, _ctx| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                Ok(Some(serde_json::json!({"ok": true})))
            }
        });
        let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
        let first = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
        assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
        // A redelivery, and a producer re-send with a new message id.
        for m in [
            Message::new("m1", r#"{"id":"e1"}"#),
            Message::new("m2", r#"{"id":"e1"}"#),
        ] {
            let o = p.process(m).await;
            assert_eq!(
                o,
                Outcome::Duplicate {
                    result: Some(StoredResult::Value(serde_json::json!({"ok": true}))),
                    payload_matches: true
                }
            );
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_duplicate_with_another_body_is_counted_and_skipped_or_parked_as_configured() {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let handler = handler_fn(move |_m, _ctx| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        });
        let store = MemoryStore::default();
        let warn = Processor::new(store.clone(), handler.clone(), config()).unwrap();
        let mut parking = config();
        parking.payload_mismatch = PayloadMismatch::Park;
        let park = Processor::new(store, handler, parking).unwrap();
        let first = warn
            .process(Message::new("m1", r#"{"id":"e1","amount":5}"#))
            .await;
        assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
        let other_body = || Message::new("m2", r#"{"id":"e1","amount":7}"#);
        let skipped = warn.process(other_body()).await;
        assert!(
            matches!(
                skipped,
                Outcome::Duplicate {
                    payload_matches: false,
                    ..
                }
            ),
            "{skipped:?}"
        );
        match park.process(other_body()).await {
            Outcome::Park { reason } => {
                assert!(
                    reason.contains("payload mismatch") && reason.contains("e1"),
                    "{reason}"
                )
            }
            o => panic!("expected a park, got {o:?}"),
        }
        // The same body again is an ordinary duplicate, for either setting.
        let same = park
            .process(Message::new("m3", r#"{"id":"e1","amount":5}"#))
            .await;
        assert!(
            matches!(
                same,
                Outcome::Duplicate {
                    payload_matches: true,
                    ..
                }
            ),
            "{same:?}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(warn.metrics().take().payload_mismatches, 1);
        assert_eq!(park.metrics().take().payload_mismatches, 1);
    }

    #[tokio::test]
    async fn a_claim_taken_over_from_an_expired_one_is_counted_and_one_after_a_release_is_not() {
        let clock = ManualClock::starting_now();
        let store = MemoryStore::new(Arc::new(clock.clone()));
        let p = Processor::new(
            store.clone(),
            handler_fn(|_m, _c| async { Ok(None) }),
            config(),
        )
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
        let stale = |pk: &str, owner: &str| ClaimRequest {
            pk: pk.to_owned(),
            owner: owner.to_owned(),
            message_id: "elsewhere".into(),
            payload_sha256: sha256_hex(br#"{"id":"e1"}"#),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        // Another consumer claimed e1 and vanished; it released e2.
        let (pk1, pk2) = (record_key("test", "e1"), record_key("test", "e2"));
        assert!(matches!(
            store.claim(&stale(&pk1, "gone")).await,
            Ok(Claim::Acquired { .. })
        ));
        assert!(matches!(
            store.claim(&stale(&pk2, "polite")).await,
            Ok(Claim::Acquired { .. })
        ));
        store.release(&pk2, "polite", "gave up").await.unwrap();
        clock.advance(Duration::from_secs(31));
        for body in [r#"{"id":"e1"}"#, r#"{"id":"e2"}"#] {
            let o = p.process(Message::new("m", body)).await;
            assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
        }
        assert_eq!(p.metrics().take().takeovers, 1);
    }

    #[tokio::test]
    async fn missing_key_is_parked_and_the_handler_never_runs() {
        let p = Processor::new(
            MemoryStore::default(),
            handler_fn(|_m, _c| async { panic!("must not run") }),
            config(),
        )
        .unwrap();
        match p.process(Message::new("m", r#"{"no_id":1}"#)).await {
            Outcome::Park { reason } => assert!(reason.contains("/id"), "{reason}"),
            o => panic!("{o:?}"),
        }
    }

    #[tokio::test]
    async fn retryable_failure_releases_and_the_redelivery_runs_again() {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let handler = handler_fn(move |_m, ctx: Context| {
            let c = c.clone();
            async move {
                let n = c.fetch_add(1, Ordering::SeqCst);
                assert_eq!(ctx.attempt(), n + 1);
                if n == 0 {
                    return Err(HandlerError::retry("downstream 503"));
                }
                Ok(None)
            }
        });
        let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
        let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
        assert!(
            matches!(o, Outcome::Retry { after, .. } if after == Duration::from_secs(2)),
            "{o:?}"
        );
        let o = p
            .process(Message::new("m", r#"{"id":"e"}"#).with_receive_count(2))
            .await;
        assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn panic_is_a_retry_and_permanent_error_parks_with_failed_record() {
        let p = Processor::new(
            MemoryStore::default(),
            handler_fn(|m: Message, _c| async move {
                if m.body().contains("boom") {
                    panic!("boom");
                }
                Err(HandlerError::permanent("card declined"))
            }),
            config(),
        )
        .unwrap();
        let o = p.process(Message::new("m", r#"{"id":"a","boom":1}"#)).await;
        assert!(
            matches!(&o, Outcome::Retry { reason, .. } if reason.contains("panicked")),
            "{o:?}"
        );
        let o = p.process(Message::new("m2", r#"{"id":"b"}"#)).await;
        assert!(
            matches!(&o, Outcome::Park { reason } if reason.contains("card declined")),
            "{o:?}"
        );
        let rec = p.store().get("test#b").await.unwrap().unwrap();
        assert_eq!(rec.status, crate::Status::Failed);
        assert!(rec.error.unwrap().contains("card declined"));
    }

    #[tokio::test]
    async fn store_outage_means_no_handler_run_and_a_retry() {
        let store = MemoryStore::new(Arc::new(ManualClock::starting_now()));
        store.set_unavailable(true);
        let p = Processor::new(
            store,
            handler_fn(|_m, _c| async { panic!("must not run without a claim") }),
            config(),
        )
        .unwrap();
        let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
        assert!(
            matches!(&o, Outcome::Retry { reason, .. } if reason.contains("claim failed")),
            "{o:?}"
        );
    }

    #[tokio::test]
    async fn oversized_result_is_stored_as_digest() {
        let mut c = config();
        c.max_result_bytes = 16;
        let p = Processor::new(
            MemoryStore::default(),
            handler_fn(|_m, _c| async { Ok(Some(serde_json::json!({"big": "x".repeat(100)}))) }),
            c,
        )
        .unwrap();
        let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
        assert!(
            matches!(o, Outcome::Completed { result: Some(StoredResult::Digest { bytes, .. }) } if bytes > 100),
            "{o:?}"
        );
    }

    /// A store that delegates to a [`MemoryStore`] but can be cut off: extends
    /// (and, when `releases` too, releases) fail as unavailable; a claim's
    /// answer can be held back after it committed.
    #[derive(Clone)]
    struct Faulty {
        inner: MemoryStore,
        extends_fail: Arc<std::sync::atomic::AtomicBool>,
        releases_fail: Arc<std::sync::atomic::AtomicBool>,
        claim_answer_delay: Duration,
    }

    impl Faulty {
        fn new(inner: MemoryStore) -> Self {
            Self {
                inner,
                extends_fail: Arc::default(),
                releases_fail: Arc::default(),
                claim_answer_delay: Duration::ZERO,
            }
        }
    }

    impl DedupStore for Faulty {
        async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
            let c = self.inner.claim(req).await;
            tokio::time::sleep(self.claim_answer_delay).await;
            c
        }
        async fn complete(&self, c: Completion) -> Result<(), StoreError> {
            self.inner.complete(c).await
        }
        async fn release(&self, pk: &str, owner: &str, error: &str) -> Result<(), StoreError> {
            if self.releases_fail.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("cut off".into()));
            }
            self.inner.release(pk, owner, error).await
        }
        async fn mark_failed(
            &self,
            pk: &str,
            owner: &str,
            error: &str,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            self.inner.mark_failed(pk, owner, error, ttl).await
        }
        async fn extend_lease(
            &self,
            pk: &str,
            owner: &str,
            lease: Duration,
            ttl: Duration,
        ) -> Result<(), StoreError> {
            if self.extends_fail.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("cut off".into()));
            }
            self.inner.extend_lease(pk, owner, lease, ttl).await
        }
        async fn commit_unprotected(&self, w: Vec<crate::StagedWrite>) -> Result<(), StoreError> {
            self.inner.commit_unprotected(w).await
        }
        async fn commit_fast(&self, c: FastCommit) -> Result<FastCommitted, StoreError> {
            self.inner.commit_fast(c).await
        }
        async fn get(&self, pk: &str) -> Result<Option<crate::Record>, StoreError> {
            self.inner.get(pk).await
        }
    }

    /// Counts live handler attempts of one key: each attempt holds a guard
    /// that is dropped when the handler ends or is interrupted.
    #[derive(Default)]
    struct Live {
        now: AtomicU32,
        max: AtomicU32,
        started: AtomicU32,
    }

    struct LiveGuard(Arc<Live>);

    impl Live {
        fn enter(self: &Arc<Self>) -> LiveGuard {
            let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
            self.max.fetch_max(n, Ordering::SeqCst);
            self.started.fetch_add(1, Ordering::SeqCst);
            LiveGuard(self.clone())
        }
    }

    impl Drop for LiveGuard {
        fn drop(&mut self) {
            self.0.now.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn lease_config() -> ProcessorConfig {
        let mut c = config();
        c.lease = Duration::from_secs(10);
        c.heartbeat = Duration::from_secs(3);
        c.lease_margin = Duration::from_secs(1);
        c
    }

    /// A handler with an external effect that takes `work` (virtual time).
    fn slow_external(live: Arc<Live>, work: Duration) -> impl Handler {
        handler_fn(move |_m, _c| {
            let live = live.clone();
            async move {
                let _guard = live.enter();
                tokio::time::sleep(work).await;
                Ok(None)
            }
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_cut_off_from_dynamodb_is_interrupted_before_another_consumer_can_take_the_key()
     {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let shared = MemoryStore::new(clock.clone());
        let cut_off = Faulty::new(shared.clone());
        let live = Arc::new(Live::default());
        let a = Processor::new(
            cut_off.clone(),
            slow_external(live.clone(), Duration::from_secs(60)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock.clone());
        let b = Processor::new(
            shared.clone(),
            slow_external(live.clone(), Duration::from_millis(10)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock.clone());
        // A claims, then loses DynamoDB entirely: no extension, no release.
        cut_off.extends_fail.store(true, Ordering::SeqCst);
        cut_off.releases_fail.store(true, Ordering::SeqCst);
        let msg = Message::new("m", r#"{"id":"k"}"#);
        let a_run = tokio::spawn({
            let (a, msg) = (a.clone(), msg.clone());
            async move {
                let o = a.process(msg).await;
                (o, tokio::time::Instant::now())
            }
        });
        // B tries every 100 ms until it gets the key.
        let started = tokio::time::Instant::now();
        let b_outcome = loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            match b.process(msg.clone()).await {
                Outcome::InFlight { .. } => continue,
                o => break o,
            }
        };
        let (a_outcome, a_stopped) = a_run.await.unwrap();
        assert!(
            matches!(b_outcome, Outcome::Completed { .. }),
            "{b_outcome:?}"
        );
        assert!(
            matches!(&a_outcome, Outcome::Retry { reason, .. } if reason.contains("could not be extended")),
            "{a_outcome:?}"
        );
        assert_eq!(
            live.max.load(Ordering::SeqCst),
            1,
            "two live attempts of one key"
        );
        // A stopped by its local lease end (lease minus margin), not later.
        assert!(a_stopped - started <= Duration::from_secs(9) + Duration::from_millis(50));
        assert_eq!(a.metrics().take().lease_lost, 1);
    }

    /// Extends visibility, or fails to (SQS cut off), counting the calls.
    #[derive(Default)]
    struct Visibility {
        fails: std::sync::atomic::AtomicBool,
        calls: AtomicU32,
    }

    impl VisibilityExtender for Visibility {
        fn extend<'a>(
            &'a self,
            _message: &'a Message,
            _timeout: Duration,
        ) -> BoxFuture<'a, Result<(), crate::queue::QueueError>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let fails = self.fails.load(Ordering::SeqCst);
            Box::pin(async move {
                if fails {
                    Err(crate::queue::QueueError::new(
                        "ChangeMessageVisibility",
                        "q",
                        "cut off",
                        true,
                    ))
                } else {
                    Ok(())
                }
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_claimed_handler_cut_off_from_sqs_only_is_interrupted_before_its_visibility_ends_and_its_claim_released()
     {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let store = MemoryStore::new(clock.clone());
        let live = Arc::new(Live::default());
        let a = Processor::new(
            store.clone(),
            slow_external(live.clone(), Duration::from_secs(120)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock.clone());
        // DynamoDB works (the lease is extended), SQS does not: the message
        // becomes visible again 12 s after its receive whatever the lease.
        let sqs = Visibility::default();
        sqs.fails.store(true, Ordering::SeqCst);
        let received_at = tokio::time::Instant::now();
        let invisible_until = received_at + Duration::from_secs(12);
        let o = a
            .process_with(
                Message::new("m", r#"{"id":"k"}"#),
                ProcessOptions {
                    visibility: Some(&sqs),
                    invisible_until: Some(invisible_until),
                    received_at: Some(received_at),
                    ..ProcessOptions::default()
                },
            )
            .await;
        let stopped = tokio::time::Instant::now();
        assert!(
            matches!(&o, Outcome::Retry { reason, .. } if reason.contains("visibility could not be kept")),
            "{o:?}"
        );
        assert_eq!(
            live.now.load(Ordering::SeqCst),
            0,
            "the handler was dropped"
        );
        // Interrupted a margin (1 s) before SQS can deliver it again, not at
        // the lease end the heartbeat kept moving.
        assert!(
            stopped <= invisible_until - Duration::from_secs(1),
            "{:?}",
            stopped - received_at
        );
        assert!(
            sqs.calls.load(Ordering::SeqCst) >= 1,
            "an extension was tried"
        );
        // The claim is released: another consumer takes the key at once,
        // not after the lease the heartbeat kept extending.
        let b = Processor::new(
            store,
            slow_external(live.clone(), Duration::ZERO),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock);
        let o = b.process(Message::new("m", r#"{"id":"k"}"#)).await;
        assert!(matches!(&o, Outcome::Completed { .. }), "{o:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_whose_visibility_ended_before_it_started_is_not_claimed_or_run() {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let store = MemoryStore::new(clock.clone());
        let live = Arc::new(Live::default());
        let a = Processor::new(
            store.clone(),
            slow_external(live.clone(), Duration::from_secs(1)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock);
        let received_at = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(30)).await;
        let o = a
            .process_with(
                Message::new("m", r#"{"id":"k"}"#),
                ProcessOptions {
                    invisible_until: Some(received_at + Duration::from_secs(10)),
                    received_at: Some(received_at),
                    ..ProcessOptions::default()
                },
            )
            .await;
        assert!(
            matches!(&o, Outcome::Retry { after, .. } if after.is_zero()),
            "{o:?}"
        );
        assert_eq!(live.started.load(Ordering::SeqCst), 0, "never run");
        assert!(
            store.get(&record_key("test", "k")).await.unwrap().is_none(),
            "never claimed"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_short_visibility_is_extended_before_it_ends_not_at_the_next_heartbeat() {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let store = MemoryStore::new(clock.clone());
        let live = Arc::new(Live::default());
        let mut config = lease_config();
        config.heartbeat = Duration::from_secs(5);
        let a = Processor::new(
            store,
            slow_external(live.clone(), Duration::from_secs(20)),
            config,
        )
        .unwrap()
        .with_clock(clock);
        let sqs = Visibility::default();
        let received_at = tokio::time::Instant::now();
        // Visible again 3 s after the receive: before the first 5 s beat.
        let o = a
            .process_with(
                Message::new("m", r#"{"id":"k"}"#),
                ProcessOptions {
                    visibility: Some(&sqs),
                    invisible_until: Some(received_at + Duration::from_secs(3)),
                    received_at: Some(received_at),
                    ..ProcessOptions::default()
                },
            )
            .await;
        assert!(matches!(&o, Outcome::Completed { .. }), "{o:?}");
        assert!(
            sqs.calls.load(Ordering::SeqCst) >= 4,
            "extended through the 20 s handler"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_whose_extensions_fail_is_interrupted_and_its_claim_released() {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let shared = MemoryStore::new(clock.clone());
        let flaky = Faulty::new(shared.clone());
        flaky.extends_fail.store(true, Ordering::SeqCst);
        let live = Arc::new(Live::default());
        let a = Processor::new(
            flaky,
            slow_external(live.clone(), Duration::from_secs(60)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock.clone());
        let o = a.process(Message::new("m", r#"{"id":"k"}"#)).await;
        assert!(matches!(&o, Outcome::Retry { .. }), "{o:?}");
        assert_eq!(
            live.now.load(Ordering::SeqCst),
            0,
            "the handler was dropped"
        );
        let rec = shared.get("test#k").await.unwrap().unwrap();
        assert_eq!(rec.status, crate::Status::InProgress);
        assert_eq!(
            rec.lease_until_ms, 0,
            "released: the next delivery need not wait"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_handler_past_the_maximum_extension_is_interrupted_not_left_running() {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let store = MemoryStore::new(clock.clone());
        let mut c = lease_config();
        c.max_extension = Duration::from_secs(20);
        let live = Arc::new(Live::default());
        let p = Processor::new(
            store.clone(),
            slow_external(live.clone(), Duration::from_secs(600)),
            c,
        )
        .unwrap()
        .with_clock(clock.clone());
        let started = tokio::time::Instant::now();
        let o = p.process(Message::new("m", r#"{"id":"k"}"#)).await;
        assert!(matches!(&o, Outcome::Retry { .. }), "{o:?}");
        let ran = started.elapsed();
        assert!(
            ran < Duration::from_secs(20),
            "ran {ran:?} past the maximum extension"
        );
        assert_eq!(live.now.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_that_commits_with_too_little_lease_left_is_released_not_run() {
        let clock: Arc<dyn clock::Clock> =
            Arc::new(clock::TokioClock::starting_at(std::time::SystemTime::now()));
        let shared = MemoryStore::new(clock.clone());
        let mut late = Faulty::new(shared.clone());
        late.claim_answer_delay = Duration::from_secs(6);
        let live = Arc::new(Live::default());
        let p = Processor::new(
            late,
            slow_external(live.clone(), Duration::from_millis(10)),
            lease_config(),
        )
        .unwrap()
        .with_clock(clock.clone());
        let o = p.process(Message::new("m", r#"{"id":"k"}"#)).await;
        assert!(
            matches!(&o, Outcome::Retry { reason, .. } if reason.contains("too little")),
            "{o:?}"
        );
        assert_eq!(
            live.started.load(Ordering::SeqCst),
            0,
            "the handler must not run"
        );
        let rec = shared.get("test#k").await.unwrap().unwrap();
        assert_eq!(rec.lease_until_ms, 0, "released");
    }

    #[tokio::test]
    async fn a_redelivery_of_a_parked_message_is_parked_again_not_run() {
        // "Insufficient funds" the first time, then it would pass: the
        // redelivery after a park whose delete failed must not apply it.
        let calls = Arc::new(AtomicU32::new(0));
        for fast in [false, true] {
            let c = calls.clone();
            let handler = handler_fn(move |_m, _ctx| {
                let c = c.clone();
                async move {
                    if c.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(HandlerError::permanent("insufficient funds"));
                    }
                    Ok(None)
                }
            });
            calls.store(0, Ordering::SeqCst);
            let mut cfg = config();
            cfg.fast_path = fast;
            let clock = ManualClock::starting_now();
            let store = MemoryStore::new(Arc::new(clock.clone()));
            let p = Processor::new(store, crate::staged_only(handler), cfg)
                .unwrap()
                .with_clock(Arc::new(clock.clone()));
            let m = Message::new("m1", r#"{"id":"e"}"#);
            let first = p.process(m.clone()).await;
            assert!(
                matches!(&first, Outcome::Park { reason } if reason.contains("insufficient")),
                "{first:?}"
            );
            let again = p.process(m.clone().with_receive_count(2)).await;
            assert!(
                matches!(&again, Outcome::Park { reason } if reason.contains("redelivered after it was parked")),
                "fast={fast}: {again:?}"
            );
            // A copy brought back from the DLQ (new message id) runs again:
            // its claim is made after the failed one (a claim made in the
            // same millisecond could be one that landed late).
            clock.advance(Duration::from_millis(1));
            let redriven = Message::new("m2", r#"{"id":"e"}"#);
            let o = p.process(redriven).await;
            assert!(matches!(o, Outcome::Completed { .. }), "fast={fast}: {o:?}");
            let rec = p.store().get("test#e").await.unwrap().unwrap();
            assert_eq!(rec.status, crate::Status::Completed);
        }
    }

    #[tokio::test]
    async fn a_huge_handler_error_is_stored_bounded() {
        let p = Processor::new(
            MemoryStore::default(),
            handler_fn(|_m, _c| async { Err(HandlerError::retry("x".repeat(1_000_000))) }),
            config(),
        )
        .unwrap();
        let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
        assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
        let rec = p.store().get("test#e").await.unwrap().unwrap();
        let error = rec.error.unwrap();
        assert!(
            error.len() <= crate::dedup::MAX_ERROR_BYTES,
            "{}",
            error.len()
        );
        assert!(
            error.ends_with("(1000000 bytes in all)"),
            "{}",
            &error[error.len() - 40..]
        );
    }
}

#[cfg(all(test, feature = "poller"))]
#[path = "processor_privacy_tests.rs"]
mod privacy_tests;
