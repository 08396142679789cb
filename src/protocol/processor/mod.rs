//! One message through claim, handler, complete or release: the outcome the
//! runtimes act on.
//!
//! The protocol (record, conditions, fencing, the local lease, unknown
//! outcomes, the fast path) is in the project's `docs/DESIGN.md`.
//!
//! - this module: the [`Processor`], its options, the large payload's
//!   download, and the outcomes both paths share;
//! - `fast`: the fast path (no claim: the handler's staged writes commit
//!   with the record, or it runs unprotected);
//! - `claim`: the claim path (claim, wait for a holder, run, finish);
//! - `lease`: the local lease and visibility ends, and the heartbeat that
//!   moves them.

mod claim;
mod fast;
mod insert;
mod lease;
mod outbox;

#[cfg(feature = "poller")]
pub(crate) use fast::KeyFound;
use lease::LocalEnd;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use tracing::{Instrument, error, info, warn};

use crate::protocol::config::{MissingKey, PayloadMismatch, ProcessorConfig};
use crate::protocol::envelope::Opened;
use crate::protocol::handler::{Effects, Handler, HandlerError};
use crate::protocol::limits::SQS_MAX_VISIBILITY;
use crate::protocol::metrics::Metrics;
use crate::protocol::outbox::Dispatcher;
use crate::protocol::outcome::{FailureKind, Outcome, StoredResult};
use crate::protocol::payloads::{LargePayloads, PayloadGrant};
use crate::protocol::store::DedupStore;
use crate::{Message, clock};

/// Extends a message's visibility timeout while its handler runs; provided by
/// the runtime that received it.
pub trait VisibilityExtender: Send + Sync {
    /// Sets the message's visibility timeout to `timeout` from now.
    fn extend<'a>(
        &'a self,
        message: &'a Message,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<(), crate::protocol::queue::QueueError>>;
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
    /// A copy of a key in flight elsewhere waits for its holder until this
    /// instant at the latest, then comes back as [`Outcome::InFlight`]
    /// (Lambda: the margin before the invocation's deadline, which leaves
    /// the runtime time to send the copy again); a large payload's failing
    /// read starts no try after it. `None`: until `stop`.
    pub wait_until: Option<Instant>,
}

/// Takes messages through the claim protocol around a handler.
pub struct Processor<S, H> {
    store: Arc<S>,
    handler: Arc<H>,
    config: Arc<ProcessorConfig>,
    clock: Arc<dyn clock::Clock>,
    metrics: Arc<Metrics>,
    payloads: Option<LargePayloads>,
    dispatcher: Option<Arc<dyn Dispatcher>>,
}

impl<S: std::fmt::Debug, H: std::fmt::Debug> std::fmt::Debug for Processor<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("store", &self.store)
            .field("handler", &self.handler)
            .field("config", &self.config)
            .field("payloads", &self.payloads)
            .field("dispatcher", &self.dispatcher.is_some())
            .finish_non_exhaustive()
    }
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
            dispatcher: self.dispatcher.clone(),
        }
    }
}

impl<S: DedupStore, H: Handler> Processor<S, H> {
    /// A processor; validates the configuration.
    pub fn new(
        store: S,
        handler: H,
        config: ProcessorConfig,
    ) -> Result<Self, crate::protocol::config::ConfigError> {
        config.validate()?;
        // An insert-shaped handler that names no key could only fail every
        // message: refused here.
        if let Effects::Insert { key } = handler.effects()
            && (key.is_empty() || key.iter().any(|k| k.is_empty()))
        {
            return Err(crate::protocol::config::ConfigError {
                setting: "insert_once",
                problem: format!(
                    "an insert-shaped handler (Effects::Insert) must name its item's key attributes, the partition key first (insert_once(&[\"order_id\"], handler)); it names {key:?}"
                ),
            });
        }
        let metrics = Arc::new(Metrics::new(&config.consumer));
        store.report_to(metrics.clone());
        Ok(Self {
            store: Arc::new(store),
            handler: Arc::new(handler),
            config: Arc::new(config),
            clock: Arc::new(clock::SystemClock),
            metrics,
            payloads: None,
            dispatcher: None,
        })
    }

    /// Judges other consumers' leases by `clock` instead of the system clock
    /// (tests and simulation; the store should share it).
    pub fn with_clock(mut self, clock: Arc<dyn clock::Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Replaces an S3 pointer body (the SQS Extended Client Libraries') by
    /// the object's content before the dedup key is read: see [`crate::protocol::payloads`].
    pub fn with_large_payloads(mut self, payloads: LargePayloads) -> Self {
        self.payloads = Some(payloads);
        self
    }

    /// Sends what handlers send ([`Context::send`](crate::Context::send))
    /// through `dispatcher` after each commit: any [`QueueClient`](crate::queue::QueueClient)
    /// (an `aws_sdk_sqs::Client`). The runtimes set their own SQS client
    /// when none is set. Without one, a handler that sends fails permanently.
    pub fn with_dispatcher(mut self, dispatcher: impl Dispatcher) -> Self {
        self.dispatcher = Some(Arc::new(dispatcher));
        self
    }

    /// This processor, sending through `queue` unless a dispatcher is set
    /// (the runtimes give it theirs).
    pub fn dispatching_through<Q: crate::protocol::queue::QueueClient>(self, queue: &Q) -> Self {
        if self.dispatcher.is_some() {
            return self;
        }
        self.with_dispatcher(queue.clone())
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

    /// What this processor (and its clones) did; see [`crate::protocol::metrics`].
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Warns of and counts the carried attributes of `message` that do not
    /// verify (they are ignored): see [`crate::protocol::key::CarrySecret`].
    fn count_unverified(&self, message: &Message) {
        let secret = self.config.carry_secret.as_ref();
        for attribute in crate::protocol::key::unverified_attributes(message, secret) {
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

    /// The message's dedup key: as the runtime read it already by this
    /// processor's config when this is the message it read it from (no
    /// large payload resolved, no envelope opened since), else read now.
    fn key_of(&self, message: &Message) -> Result<String, crate::protocol::key::KeyError> {
        let unchanged = self.payloads.is_none()
            && self.config.envelope == crate::protocol::message::Envelope::None;
        match message.pre_read_key(self.config.identity()) {
            Some(key) if unchanged => Ok(key.to_owned()),
            _ => self.config.dedup_key(message),
        }
    }

    /// Processes one message with no visibility extension.
    pub async fn process(&self, message: Message) -> Outcome {
        self.process_with(message, ProcessOptions::default()).await
    }

    /// Processes one message.
    pub async fn process_with(&self, message: Message, opts: ProcessOptions<'_>) -> Outcome {
        let span = crate::protocol::trace::message_span(
            &message,
            &self.config.consumer,
            self.config.trust_producer_sampling,
        );
        let outcome = async {
            // The message is kept invisible from here on, a large payload's
            // download included.
            let lease = lease_within(self.config.lease, opts.deadline);
            let visible = LocalEnd::visibility(&opts, self.config.margin_for(lease));
            // The paths below are boxed, each only when taken: held inline,
            // every one would count in this future's size.
            // A large payload's grant of the payload budget is held until
            // the message is finished with (the end of this block).
            let (message, _grant) = if let Some(payloads) = &self.payloads {
                match Box::pin(self.resolve_payload(payloads, message, &opts, &visible)).await {
                    Ok(resolved) => resolved,
                    Err(outcome) => return outcome,
                }
            } else {
                (message, None)
            };
            let mut message = match self.open_envelope(message) {
                Ok(message) => message,
                Err(outcome) => return outcome,
            };
            self.count_unverified(&message);
            let key = match self.key_of(&message) {
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
                        return Box::pin(self.run_unprotected(&message)).await;
                    }
                },
            };
            let span = tracing::Span::current();
            // (The record key is computed again where it is written: here
            // only for a span that records it.)
            if !span.is_disabled() {
                span.record("sqs_once.dedup_key", &*self.config.shown_key(&key));
                span.record("sqs_once.record_key", self.config.record_key(&key).as_str());
            }
            message.set_dedup_key(key);
            let effects = self.handler.effects();
            if matches!(effects, Effects::Insert { .. }) {
                // The insert path's claim is its item: it takes no claim
                // whatever SQS_ONCE_FAST_PATH says.
                span.record("sqs_once.path", "insert");
                Box::pin(self.run_fast(&message, &opts, &visible)).await
            } else if self.config.fast_path && effects == Effects::StagedOnly {
                span.record("sqs_once.path", "fast");
                Box::pin(self.run_fast(&message, &opts, &visible)).await
            } else {
                span.record("sqs_once.path", "claim");
                Box::pin(self.run_claimed(&message, &opts, &visible)).await
            }
        }
        .instrument(span.clone())
        .await;
        crate::protocol::trace::record_outcome(&span, &outcome);
        self.metrics.outcome(&outcome);
        outcome
    }

    /// The message with its payload taken out of the configured envelope
    /// (see [`crate::protocol::envelope`]): a malformed one is parked, S3's
    /// test event completed with no handler run and no record.
    fn open_envelope(&self, message: Message) -> Result<Message, Outcome> {
        match self.config.envelope.open(message) {
            Ok(Opened::Payload(message)) => Ok(message),
            Ok(Opened::S3TestEvent) => Err(Outcome::Completed { result: None }),
            Err(e) => Err(Outcome::Park {
                reason: e.to_string(),
            }),
        }
    }

    /// The message with a large payload's pointer replaced by the payload
    /// read through `payloads` (see [`crate::protocol::payloads`]); what
    /// cannot be read is the outcome. The download runs under the same
    /// visibility keeping as a handler: the
    /// message is extended while it lasts, so a slow download does not let
    /// SQS hand it to another consumer, and it stops (the message not run)
    /// when its visibility could not be kept, or when the runtime stops.
    async fn resolve_payload(
        &self,
        payloads: &LargePayloads,
        message: Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
    ) -> Result<(Message, Option<PayloadGrant>), Outcome> {
        let resolved = tokio::select! {
            biased;
            r = payloads.resolve(&message, &self.config, &*self.store, &*self.clock, opts.wait_until) => r,
            () = visible.passed() => {
                error!("the message's visibility could not be kept during its large payload's download: not run");
                Err(Outcome::Retry {
                    after: Duration::ZERO,
                    reason: "visibility could not be kept during the large payload's download".into(),
                })
            }
            () = stopped(opts) => Err(Outcome::Retry {
                after: Duration::ZERO,
                reason: "interrupted by shutdown during the large payload's download".into(),
            }),
            () = self.keep_visible(&message, opts, visible) => unreachable!("never returns"),
        };
        match resolved {
            Err(duplicate @ Outcome::Duplicate { .. }) => {
                let sending = self.duplicate_without_payload(&message);
                Err(self
                    .kept_visible(&message, opts, visible, sending)
                    .await
                    .unwrap_or(duplicate))
            }
            other => Ok(other?.unwrap_or((message, None))),
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
        // (The `duplicate-as-retry` mutant, for the simulator only, answers
        // a delivery that finds its record completed "to come back": the
        // message is never deleted.)
        if crate::protocol::mutants::active("duplicate-as-retry") {
            return Outcome::Retry {
                after: self.config.backoff(message.receive_count()),
                reason: "a duplicate taken for a retry (mutant)".into(),
            };
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
}

/// The outcome of a claim-path message whose visibility ran out before its
/// claim: not claimed, not run; it comes back with no delay of its own (it
/// is visible again already).
pub(super) fn visibility_lost_before_claim() -> Outcome {
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
pub(super) fn failure_kind(e: &HandlerError) -> FailureKind {
    if crate::protocol::mutants::active("transient-as-permanent") {
        return FailureKind::Permanent;
    }
    e.kind()
}

/// A redelivery of a message that was parked before (its delete after the park
/// failed, or a Lambda invocation ended after the park): never run again,
/// parked again with the recorded reason.
pub(super) fn already_parked(reason: Option<String>) -> Outcome {
    warn!("redelivery of a message already parked; not run, parked again");
    Outcome::Park {
        reason: format!(
            "redelivered after it was parked; not run again (first reason: {})",
            reason.as_deref().unwrap_or("not recorded")
        ),
    }
}

/// Completes when the runtime asks running handlers to stop.
pub(super) async fn stopped(opts: &ProcessOptions<'_>) {
    match &opts.stop {
        Some(t) => t.cancelled().await,
        None => std::future::pending().await,
    }
}

/// `lease`, cut so that it ends by `deadline`.
pub(super) fn lease_within(lease: Duration, deadline: Option<Instant>) -> Duration {
    deadline.map_or(lease, |d| {
        lease.min(d.saturating_duration_since(Instant::now()))
    })
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod outbox_tests;

#[cfg(test)]
mod insert_tests;

#[cfg(all(test, feature = "poller"))]
mod privacy_tests;
