//! One message through claim, handler, complete or release: the outcome the
//! runtimes act on.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tracing::{Instrument, error, info, info_span, warn};

use crate::config::{MissingKey, ProcessorConfig, SQS_MAX_VISIBILITY};
use crate::dedup::{
    Claim, ClaimRequest, Completion, DedupStore, FastCommit, FastCommitted, StoreError,
    StoredResult,
};
use crate::handler::{Context, Effects, FailureKind, Handler, HandlerError};
use crate::key::{record_key, sha256_hex};
use crate::metrics::Metrics;
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
    ) -> BoxFuture<'a, Result<(), String>>;
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
}

/// Takes messages through the claim protocol around a handler.
#[derive(Debug)]
pub struct Processor<S, H> {
    store: Arc<S>,
    handler: Arc<H>,
    config: Arc<ProcessorConfig>,
    clock: Arc<dyn clock::Clock>,
    metrics: Arc<Metrics>,
}

impl<S, H> Clone for Processor<S, H> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            handler: self.handler.clone(),
            config: self.config.clone(),
            clock: self.clock.clone(),
            metrics: self.metrics.clone(),
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
        Ok(Self {
            store: Arc::new(store),
            handler: Arc::new(handler),
            config: Arc::new(config),
            clock: Arc::new(clock::SystemClock),
            metrics: Arc::default(),
        })
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

    /// Processes one message with no visibility extension.
    pub async fn process(&self, message: Message) -> Outcome {
        self.process_with(message, ProcessOptions::default()).await
    }

    /// Processes one message.
    pub async fn process_with(&self, mut message: Message, opts: ProcessOptions<'_>) -> Outcome {
        let span = info_span!(
            "message",
            message_id = message.id(),
            dedup_key = tracing::field::Empty,
            group = message.group_id(),
            receive_count = message.receive_count(),
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let outcome = async {
            let key = match self.config.key_source.extract(&message) {
                Ok(key) => key,
                Err(e) => match self.config.missing_key {
                    MissingKey::Park => {
                        return Outcome::Park {
                            reason: format!("no dedup key: {e}"),
                        };
                    }
                    MissingKey::ProcessUnprotected => {
                        warn!(reason = %e, "no dedup key; processing unprotected as configured");
                        return self.run_unprotected(&message).await;
                    }
                },
            };
            tracing::Span::current().record("dedup_key", key.as_str());
            message.set_dedup_key(key);
            if self.config.fast_path && self.handler.effects() == Effects::StagedOnly {
                self.run_fast(&message, &opts).await
            } else {
                self.run_claimed(&message, &opts).await
            }
        }
        .instrument(span.clone())
        .await;
        span.record("outcome", outcome.name());
        self.metrics.outcome(&outcome);
        outcome
    }

    async fn run_unprotected(&self, message: &Message) -> Outcome {
        let ctx = Context::new(
            &self.config.consumer,
            None,
            message.receive_count(),
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
            self.config.max_result_bytes,
        );
        let handled = tokio::select! {
            r = self.call_handler(message, &ctx) => r,
            () = self.keep_visible(message, opts.visibility) => unreachable!("never returns"),
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted before its commit");
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        let value = match handled {
            Ok(value) => value,
            Err(e) => return self.failure_without_record(message, &e),
        };
        let result = value.map(|v| self.bounded(&v));
        let commit = FastCommit {
            pk: record_key(&self.config.consumer, key),
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
            }) => duplicate(result, payload_matches),
            Ok(FastCommitted::InFlight {
                lease_until_ms,
                payload_matches,
            }) => self.in_flight(message, lease_until_ms, payload_matches),
            Err(StoreError::WriteConditionFailed { index, kind }) => self.failure_without_record(
                message,
                &HandlerError::new(
                    kind,
                    format!("staged write #{index} failed its condition; nothing was written"),
                ),
            ),
            Err(e @ StoreError::TransactionTooLarge { .. }) => Outcome::Park {
                reason: format!("handler failed permanently: {e}"),
            },
            Err(e) => self.unrecorded_failure(message, e),
        }
    }

    /// A handler failure where no claim is held (fast path, unprotected).
    fn failure_without_record(&self, message: &Message, e: &HandlerError) -> Outcome {
        match e.kind() {
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
    fn in_flight(&self, message: &Message, lease_until_ms: i64, payload_matches: bool) -> Outcome {
        if !payload_matches {
            warn!("same dedup key, different payload while in flight: a producer bug");
        }
        let wait = (lease_until_ms - self.clock.now_ms()).max(1000);
        Outcome::InFlight {
            retry_after: Duration::from_millis(u64::try_from(wait).unwrap_or(1000))
                .min(self.config.backoff(message.receive_count()))
                .min(SQS_MAX_VISIBILITY),
        }
    }

    /// Extends the message's visibility every heartbeat while a handler without a
    /// claim runs (fast path). Never returns.
    async fn keep_visible(&self, message: &Message, visibility: Option<&dyn VisibilityExtender>) {
        let Some(v) = visibility else {
            return std::future::pending().await;
        };
        let started = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(self.config.heartbeat).await;
            if started.elapsed() + self.config.lease > self.config.max_extension {
                return std::future::pending().await;
            }
            match v.extend(message, self.config.lease).await {
                Ok(()) => self.metrics.heartbeat_extension(),
                Err(e) => warn!(error = %e, "visibility extension failed"),
            }
        }
    }

    async fn run_claimed(&self, message: &Message, opts: &ProcessOptions<'_>) -> Outcome {
        let key = message.dedup_key().expect("set by process_with");
        let lease = lease_within(self.config.lease, opts.deadline);
        if lease < Duration::from_secs(1) {
            return Outcome::Retry {
                after: Duration::ZERO,
                reason: "too little time left to start".into(),
            };
        }
        let req = ClaimRequest {
            pk: record_key(&self.config.consumer, key),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: message.id().to_owned(),
            payload_sha256: sha256_hex(message.body().as_bytes()),
            lease,
            ttl: self.config.ttl,
        };
        let attempt = match self.store.claim(&req).await {
            Ok(Claim::Acquired { attempt }) => attempt,
            Ok(Claim::Duplicate {
                result,
                payload_matches,
            }) => return duplicate(result, payload_matches),
            Ok(Claim::InFlight {
                lease_until_ms,
                payload_matches,
            }) => return self.in_flight(message, lease_until_ms, payload_matches),
            Err(e) => {
                warn!(error = %e, "claim failed; the handler does not run without a claim");
                return Outcome::Retry {
                    after: self.config.backoff(message.receive_count()),
                    reason: format!("claim failed: {e}"),
                };
            }
        };
        tracing::Span::current().record("attempt", attempt);

        let ctx = Context::new(
            &self.config.consumer,
            Some(key),
            attempt,
            self.config.max_result_bytes,
        );
        let handled = tokio::select! {
            r = self.call_handler(message, &ctx) => Some(r),
            () = self.heartbeat(message, &req, lease, opts) => None,
            () = stopped(opts) => {
                ctx.cancelled().cancel();
                warn!("stopping: handler interrupted, claim released");
                self.release(&req, "interrupted by shutdown").await;
                return Outcome::Retry { after: Duration::ZERO, reason: "interrupted by shutdown".into() };
            }
        };
        let Some(handled) = handled else {
            ctx.cancelled().cancel();
            self.metrics.lease_lost();
            error!(pk = %req.pk, "lease lost while the handler ran; handler cancelled, its effect not recorded");
            return Outcome::Retry {
                after: self.config.backoff(message.receive_count()),
                reason: "lease lost to another consumer while the handler ran".into(),
            };
        };

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
                    Err(e @ StoreError::TransactionTooLarge { .. }) => {
                        HandlerError::permanent(e.to_string())
                    }
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
                        self.release(&req, &format!("complete failed: {e}")).await;
                        return self.unrecorded_failure(message, e);
                    }
                }
            }
            Err(e) => e,
        };

        match failure.kind() {
            FailureKind::Permanent => {
                let reason = format!("handler failed permanently: {failure}");
                if let Err(e) = self
                    .store
                    .mark_failed(&req.pk, &req.owner, &reason, self.config.ttl)
                    .await
                {
                    warn!(error = %e, "could not record FAILED; parking anyway");
                }
                Outcome::Park { reason }
            }
            kind => {
                self.release(&req, &failure.to_string()).await;
                Outcome::Retry {
                    after: self.retry_delay(message, kind),
                    reason: failure.to_string(),
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
            Ok(r) => r,
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
    /// reaches the maximum. Returns only when the lease was lost.
    async fn heartbeat(
        &self,
        message: &Message,
        req: &ClaimRequest,
        lease: Duration,
        opts: &ProcessOptions<'_>,
    ) {
        let interval = self
            .config
            .heartbeat
            .min(lease / 2)
            .max(Duration::from_millis(100));
        let started = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(interval).await;
            if started.elapsed() + lease > self.config.max_extension {
                warn!("maximum extension reached; the lease and visibility are no longer extended");
                std::future::pending::<()>().await;
            }
            let lease = lease_within(lease, opts.deadline);
            if lease.is_zero() {
                // At the deadline: the runtime stops the handler, not the heartbeat.
                std::future::pending::<()>().await;
            }
            match self.store.extend_lease(&req.pk, &req.owner, lease).await {
                Ok(()) => self.metrics.heartbeat_extension(),
                Err(StoreError::LeaseLost { found, .. }) => {
                    warn!(%found, "lease lost");
                    return;
                }
                Err(e) => warn!(error = %e, "lease extension failed; will try again"),
            }
            if let Some(v) = opts.visibility
                && let Err(e) = v.extend(message, lease).await
            {
                warn!(error = %e, "visibility extension failed");
            }
        }
    }
}

/// Completes when the runtime asks running handlers to stop.
async fn stopped(opts: &ProcessOptions<'_>) {
    match &opts.stop {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// A duplicate of completed work, with the recorded result.
fn duplicate(result: Option<StoredResult>, payload_matches: bool) -> Outcome {
    if !payload_matches {
        warn!("same dedup key, different payload: a producer bug; treated as duplicate");
    }
    info!("duplicate of completed work; skipped");
    Outcome::Duplicate {
        result,
        payload_matches,
    }
}

/// `lease`, cut so that it ends by `deadline`.
fn lease_within(lease: Duration, deadline: Option<tokio::time::Instant>) -> Duration {
    deadline.map_or(lease, |d| {
        lease.min(d.saturating_duration_since(tokio::time::Instant::now()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::{MemoryStore, handler_fn};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn config() -> ProcessorConfig {
        let mut c = ProcessorConfig::new("test");
        c.key_source = "json:/id".parse().unwrap();
        c
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
}
