//! Unit tests of the processor on the in-memory models.

use super::*;
use crate::protocol::clock::{Clock, ManualClock};
use crate::protocol::config::{PayloadMismatch, ProcessorConfig};
use crate::protocol::handler::{Context, Handler, HandlerError};
use crate::protocol::key::{record_key, sha256_hex};
use crate::protocol::outcome::{Outcome, StoredResult};
use crate::protocol::store::{
    Claim, ClaimRequest, Completion, DedupStore, FastCommit, FastCommitted, StoreError,
};
use crate::{MemoryStore, handler_fn};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

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
    let run =
        crate::protocol::handler::in_invocation("req-1".into(), p.process_with(message, opts));
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
async fn a_transient_failure_of_a_key_completed_meanwhile_on_the_fast_path_is_a_duplicate() {
    // The handler fails transiently for every message but m1.
    let handler = crate::staged_only(handler_fn(move |m: Message, _ctx| async move {
        if m.id() == "m1" {
            Ok(Some(serde_json::json!({"ok": true})))
        } else {
            Err(HandlerError::retry_after(Duration::from_secs(1), "busy"))
        }
    }));
    let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
    let first = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    // Another delivery of the key (a first one: nothing read before the
    // handler) fails transiently after the key completed: a duplicate,
    // deleted, not sent back to spend its receives.
    let copy = p.process(Message::new("m2", r#"{"id":"e1"}"#)).await;
    assert_eq!(
        copy,
        Outcome::Duplicate {
            result: Some(StoredResult::Value(serde_json::json!({"ok": true}))),
            payload_matches: true
        }
    );
    // A key not completed is retried as the handler asked.
    let other = p.process(Message::new("m3", r#"{"id":"e2"}"#)).await;
    assert!(
        matches!(other, Outcome::Retry { after, .. } if after == Duration::from_secs(1)),
        "{other:?}"
    );
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
    let (calls, handler) = counting();
    let store = MemoryStore::default();
    let mut warning = config();
    warning.payload_mismatch = PayloadMismatch::Warn;
    let warn = Processor::new(store.clone(), handler.clone(), warning).unwrap();
    let mut parking = config();
    parking.payload_mismatch = PayloadMismatch::Park;
    let park = Processor::new(store, handler, parking).unwrap();
    assert_eq!(
        config().payload_mismatch,
        PayloadMismatch::Warn,
        "the default"
    );
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

/// A handler that logs the fence it reads, failing (retry) on its first run.
fn fence_logging(failing_first: bool) -> (Arc<std::sync::Mutex<Vec<u64>>>, impl Handler + Clone) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let handler = handler_fn(move |_m, ctx: Context| {
        let log = log.clone();
        async move {
            let mut log = log.lock().unwrap();
            log.push(ctx.fence());
            if failing_first && log.len() == 1 {
                return Err(HandlerError::retry("downstream 503"));
            }
            Ok(None)
        }
    });
    (seen, handler)
}

#[tokio::test]
async fn a_claimed_handler_reads_the_fence_its_claim_stored_and_a_rerun_a_higher_one() {
    let clock = ManualClock::starting_now();
    let store = MemoryStore::new(Arc::new(clock.clone()));
    let (seen, handler) = fence_logging(true);
    let p = Processor::new(store.clone(), handler, config())
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
    assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    let o = p
        .process(Message::new("m", r#"{"id":"e"}"#).with_receive_count(2))
        .await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    let seen = seen.lock().unwrap().clone();
    let record = store.get(&record_key("test", "e")).await.unwrap().unwrap();
    assert!(seen[0] > 0 && seen[1] > seen[0], "{seen:?}");
    assert_eq!(record.fence, seen[1], "the fence of the run that completed");
}

#[tokio::test]
async fn a_fast_path_handler_reads_the_clocks_fence_and_a_claim_since_refuses_its_commit() {
    let clock = ManualClock::starting_now();
    let store = MemoryStore::new(Arc::new(clock.clone()));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (log, other, c) = (seen.clone(), store.clone(), clock.clone());
    // On its first run, another consumer claims the key (and lets it go)
    // while the handler runs, as a claim-path consumer of the same records would.
    let handler = crate::staged_only(handler_fn(move |_m, ctx: Context| {
        let (log, other, c) = (log.clone(), other.clone(), c.clone());
        async move {
            let first = {
                let mut log = log.lock().unwrap();
                log.push(ctx.fence());
                log.len() == 1
            };
            if first {
                let r = ClaimRequest {
                    pk: record_key("test", "e"),
                    owner: "other".into(),
                    message_id: "other-message".into(),
                    payload_sha256: "p".into(),
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(3600),
                };
                assert!(matches!(other.claim(&r).await, Ok(Claim::Acquired { .. })));
                other.release(&r.pk, "other", "let go").await.unwrap();
            }
            c.advance(Duration::from_millis(1));
            Ok(None)
        }
    }));
    let p = Processor::new(store.clone(), handler, config())
        .unwrap()
        .with_clock(Arc::new(clock.clone()));
    let started = crate::protocol::store::clock_fence(clock.now_ms());
    let o = p.process(Message::new("m", r#"{"id":"e"}"#)).await;
    assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    let pk = record_key("test", "e");
    let record = store.get(&pk).await.unwrap().unwrap();
    assert_eq!(
        record.status,
        crate::Status::InProgress,
        "nothing committed"
    );
    let claimed = record.fence;
    let o = p
        .process(Message::new("m", r#"{"id":"e"}"#).with_receive_count(2))
        .await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0], started, "the clock's fence before the handler");
    assert!(
        claimed > seen[0] && seen[1] > claimed,
        "{seen:?} around {claimed}"
    );
    let record = store.get(&pk).await.unwrap().unwrap();
    assert_eq!(
        record.fence, seen[1],
        "the commit stores the fence its handler read"
    );
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
/// answer can be held back after it committed; a completion or fast
/// commit can take `commit_delay` before it is applied (its tries counted).
#[derive(Clone)]
struct Faulty {
    inner: MemoryStore,
    extends_fail: Arc<std::sync::atomic::AtomicBool>,
    releases_fail: Arc<std::sync::atomic::AtomicBool>,
    claim_answer_delay: Duration,
    commit_delay: Duration,
    commits_applied: Arc<AtomicU32>,
}

impl Faulty {
    fn new(inner: MemoryStore) -> Self {
        Self {
            inner,
            extends_fail: Arc::default(),
            releases_fail: Arc::default(),
            claim_answer_delay: Duration::ZERO,
            commit_delay: Duration::ZERO,
            commits_applied: Arc::default(),
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
        tokio::time::sleep(self.commit_delay).await;
        self.commits_applied.fetch_add(1, Ordering::SeqCst);
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
        tokio::time::sleep(self.commit_delay).await;
        self.commits_applied.fetch_add(1, Ordering::SeqCst);
        self.inner.commit_fast(c).await
    }
    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[crate::protocol::outbox::Outgoing],
    ) -> Result<(), StoreError> {
        self.inner.mark_dispatched(pk, sent).await
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

/// A handler that counts its runs, and the count.
fn counting() -> (Arc<AtomicU32>, impl Handler + Clone) {
    let calls = Arc::new(AtomicU32::new(0));
    let c = calls.clone();
    let handler = handler_fn(move |_m, _ctx| {
        let c = c.clone();
        async move {
            c.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        }
    });
    (calls, handler)
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
async fn a_handler_cut_off_from_dynamodb_is_interrupted_before_another_consumer_can_take_the_key() {
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
    ) -> BoxFuture<'a, Result<(), crate::protocol::queue::QueueError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let fails = self.fails.load(Ordering::SeqCst);
        Box::pin(async move {
            if fails {
                Err(crate::protocol::queue::QueueError::new(
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

/// Simulator seed 291716: a FIFO poller's fast-path handler ran on for
/// 95 s after its message's visibility had run out (SQS cut off); a
/// receive spent the message's last allowed count unseen, the next moved it
/// to the DLQ, its group went on, and the late commit applied it after a
/// later message of its group. On a FIFO queue the fast path now
/// interrupts its handler at the known visibility end and commits nothing;
/// on a standard queue it still finishes (a copy meanwhile is a duplicate
/// at its commit). Simulator seed 1162266: the same in Lambda, where the
/// end is not known before the first extension (an invocation paused
/// before it ran on past its timeout): there the invocation's deadline
/// bounds the handler.
#[tokio::test(start_paused = true)]
async fn a_fifo_fast_path_handler_is_interrupted_at_its_visibility_end_and_commits_nothing() {
    for (fifo, lambda) in [(true, false), (false, false), (true, true), (false, true)] {
        let case = format!("FIFO: {fifo}, Lambda: {lambda}");
        let store = MemoryStore::default();
        let live = Arc::new(Live::default());
        let handler = crate::staged_only(slow_external(live.clone(), Duration::from_secs(120)));
        let p = Processor::new(store.clone(), handler, lease_config()).unwrap();
        let sqs = Visibility::default();
        sqs.fails.store(true, Ordering::SeqCst);
        let received_at = tokio::time::Instant::now();
        // The poller knows the end (less a margin); Lambda, before its
        // first extension, only its invocation's deadline.
        let end = received_at + Duration::from_secs(if lambda { 30 } else { 12 });
        let message = Message::new("m", r#"{"id":"k"}"#);
        let message = if fifo {
            message.with_group_id("g")
        } else {
            message
        };
        let opts = if lambda {
            ProcessOptions {
                deadline: Some(end),
                ..ProcessOptions::default()
            }
        } else {
            ProcessOptions {
                visibility: Some(&sqs),
                invisible_until: Some(end),
                received_at: Some(received_at),
                ..ProcessOptions::default()
            }
        };
        let o = p.process_with(message, opts).await;
        if fifo {
            assert!(
                matches!(&o, Outcome::Retry { reason, .. } if reason.contains("before the commit")),
                "{case}: {o:?}"
            );
            assert_eq!(
                live.now.load(Ordering::SeqCst),
                0,
                "{case}: the handler was dropped"
            );
            assert!(tokio::time::Instant::now() <= end, "{case}");
            assert!(store.records().is_empty(), "{case}: {:?}", store.records());
        } else {
            assert!(matches!(&o, Outcome::Completed { .. }), "{case}: {o:?}");
            assert_eq!(store.records().len(), 1, "{case}");
        }
    }
}

/// The commit window after the handler: a FIFO message's commit (fast
/// path or claim path) still trying when its visibility ends is dropped,
/// so no try lands after the next receive may have moved the message to
/// the DLQ and its group gone on; a standard queue's (and a fair queue's:
/// a group id on a standard queue) runs to its end. Where SQS answers, the
/// visibility is kept during a slow commit and it completes.
#[tokio::test(start_paused = true)]
async fn a_fifo_commit_still_trying_at_its_visibility_end_is_dropped_and_a_kept_one_completes() {
    for (queue, sqs_reachable) in [("q.fifo", false), ("q", false), ("q.fifo", true)] {
        for fast in [true, false] {
            let case = format!("{queue}, SQS reachable: {sqs_reachable}, fast path: {fast}");
            let mut store = Faulty::new(MemoryStore::default());
            store.commit_delay = Duration::from_secs(30);
            let sqs = Visibility::default();
            sqs.fails.store(!sqs_reachable, Ordering::SeqCst);
            let received_at = tokio::time::Instant::now();
            let invisible_until = received_at + Duration::from_secs(12);
            let message = Message::new("m", r#"{"id":"k"}"#)
                .with_group_id("g")
                .with_queue(queue);
            let opts = ProcessOptions {
                visibility: Some(&sqs),
                invisible_until: Some(invisible_until),
                received_at: Some(received_at),
                ..ProcessOptions::default()
            };
            let o = if fast {
                let h = crate::staged_only(handler_fn(|_m, _c| async { Ok(None) }));
                let p = Processor::new(store.clone(), h, lease_config()).unwrap();
                p.process_with(message, opts).await
            } else {
                let h = handler_fn(|_m, _c| async { Ok(None) });
                let p = Processor::new(store.clone(), h, lease_config()).unwrap();
                p.process_with(message, opts).await
            };
            let completed = store
                .inner
                .records()
                .iter()
                .any(|r| r.status == crate::Status::Completed);
            if queue == "q.fifo" && !sqs_reachable {
                assert!(
                    matches!(&o, Outcome::Retry { reason, .. } if reason.contains("during the commit")),
                    "{case}: {o:?}"
                );
                assert!(tokio::time::Instant::now() <= invisible_until, "{case}");
                assert_eq!(store.commits_applied.load(Ordering::SeqCst), 0, "{case}");
                assert!(!completed, "{case}");
            } else {
                assert!(matches!(&o, Outcome::Completed { .. }), "{case}: {o:?}");
                assert!(completed, "{case}");
                if sqs_reachable {
                    assert!(
                        sqs.calls.load(Ordering::SeqCst) >= 2,
                        "{case}: kept visible"
                    );
                }
            }
        }
    }
}

/// A FIFO handler that returns at the very instant its visibility end
/// passes (the same wake-up: the handler is polled first) starts no
/// commit, on either path: its claim is released and the message comes
/// back.
#[tokio::test(start_paused = true)]
async fn a_fifo_handler_returning_at_its_visibility_end_starts_no_commit() {
    for fast in [true, false] {
        let store = Faulty::new(MemoryStore::default());
        let sqs = Visibility::default();
        sqs.fails.store(true, Ordering::SeqCst);
        let received_at = tokio::time::Instant::now();
        // The end less the 1 s margin: 11 s after the receive.
        let invisible_until = received_at + Duration::from_secs(12);
        let until_end = |_m, _c| async {
            tokio::time::sleep(Duration::from_secs(11)).await;
            Ok(None)
        };
        let message = Message::new("m", r#"{"id":"k"}"#)
            .with_group_id("g")
            .with_queue("q.fifo");
        let opts = ProcessOptions {
            visibility: Some(&sqs),
            invisible_until: Some(invisible_until),
            received_at: Some(received_at),
            ..ProcessOptions::default()
        };
        let o = if fast {
            let h = crate::staged_only(handler_fn(until_end));
            let p = Processor::new(store.clone(), h, lease_config()).unwrap();
            p.process_with(message, opts).await
        } else {
            let p = Processor::new(store.clone(), handler_fn(until_end), lease_config()).unwrap();
            p.process_with(message, opts).await
        };
        assert!(
            matches!(&o, Outcome::Retry { .. }),
            "fast path: {fast}: {o:?}"
        );
        assert_eq!(
            store.commits_applied.load(Ordering::SeqCst),
            0,
            "fast path: {fast}"
        );
        for r in store.inner.records() {
            assert_eq!(r.status, crate::Status::InProgress, "fast path: {fast}");
            assert_eq!(r.lease_until_ms, 0, "fast path: {fast}: released");
        }
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
        error.len() <= crate::protocol::store::MAX_ERROR_BYTES,
        "{}",
        error.len()
    );
    assert!(
        error.ends_with("(1000000 bytes in all)"),
        "{}",
        &error[error.len() - 40..]
    );
}

#[tokio::test]
async fn one_event_in_two_sns_envelopes_runs_once_and_the_handler_sees_the_payload() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let handler = handler_fn(move |m: Message, _ctx: Context| {
        let log = log.clone();
        async move {
            log.lock()
                .unwrap()
                .push((m.body().to_owned(), m.raw_body().to_owned()));
            Ok(None)
        }
    });
    let mut c = config();
    c.key_source = "json:/orderId".parse().unwrap();
    c.envelope = crate::Envelope::Sns;
    let p = Processor::new(MemoryStore::default(), handler, c).unwrap();
    let envelope = |sns_id: &str, order: &str| {
        serde_json::json!({
            "Type": "Notification", "MessageId": sns_id, "TopicArn": "arn:aws:sns:us-east-1:1:t",
            "Message": serde_json::json!({"orderId": order}).to_string(),
        })
        .to_string()
    };
    let first = envelope("sns-1", "o-1");
    let outcome = p.process(Message::new("m-1", first.clone())).await;
    assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
    let again = p
        .process(Message::new("m-2", envelope("sns-2", "o-1")))
        .await;
    assert!(
        matches!(
            again,
            Outcome::Duplicate {
                payload_matches: true,
                ..
            }
        ),
        "{again:?}"
    );
    let malformed = p.process(Message::new("m-3", r#"{"orderId":"o-1"}"#)).await;
    assert!(
        matches!(&malformed, Outcome::Park { reason } if reason.contains("not an sns envelope")),
        "{malformed:?}"
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![(r#"{"orderId":"o-1"}"#.to_owned(), first)]);
}

#[tokio::test]
async fn s3s_test_event_is_done_without_a_handler_run_or_a_record() {
    let (calls, handler) = counting();
    let mut config = config();
    config.envelope = crate::Envelope::S3;
    let store = MemoryStore::default();
    let p = Processor::new(store.clone(), handler, config).unwrap();
    let test = r#"{"Service":"Amazon S3","Event":"s3:TestEvent","Time":"2014-10-13T15:57:02.089Z","Bucket":"b"}"#;
    let outcome = p.process(Message::new("t-1", test)).await;
    assert_eq!(outcome, Outcome::Completed { result: None });
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(store.records().is_empty(), "no record");
}

#[tokio::test]
async fn payload_pointers_make_a_change_outside_them_a_duplicate_and_inside_them_a_mismatch() {
    let (calls, handler) = counting();
    let mut config = config();
    config.payload_pointers = vec!["/amount".into()];
    config.payload_mismatch = PayloadMismatch::Park;
    let p = Processor::new(MemoryStore::default(), handler, config).unwrap();
    let first = p
        .process(Message::new(
            "m-1",
            r#"{"id":"k","amount":5,"sentAt":"t1"}"#,
        ))
        .await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    let resent = p
        .process(Message::new(
            "m-2",
            r#"{"id":"k","amount":5,"sentAt":"t2"}"#,
        ))
        .await;
    assert!(
        matches!(
            resent,
            Outcome::Duplicate {
                payload_matches: true,
                ..
            }
        ),
        "{resent:?}"
    );
    let changed = p
        .process(Message::new(
            "m-3",
            r#"{"id":"k","amount":6,"sentAt":"t1"}"#,
        ))
        .await;
    assert!(
        matches!(&changed, Outcome::Park { reason } if reason.contains("payload mismatch")),
        "{changed:?}"
    );
    assert_eq!(p.metrics().take().payload_mismatches, 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_compound_key_missing_a_part_is_parked_naming_the_part_and_a_custom_key_keys_the_record()
{
    let mut c = config();
    c.key_source = "attribute:tenant,json:/id".parse().unwrap();
    let p = Processor::new(
        MemoryStore::default(),
        handler_fn(|_m, _ctx| async { Ok(None) }),
        c,
    )
    .unwrap();
    let parked = p.process(Message::new("m-1", r#"{"id":"o-1"}"#)).await;
    assert!(
        matches!(&parked, Outcome::Park { reason }
            if reason.contains("part 1 of the compound dedup key (`attribute:tenant`)")),
        "{parked:?}"
    );
    let done = p
        .process(Message::new("m-2", r#"{"id":"o-1"}"#).with_attribute("tenant", "acme"))
        .await;
    assert!(matches!(done, Outcome::Completed { .. }), "{done:?}");
    assert_eq!(
        p.store().records()[0].pk,
        record_key("test", "4:acme|3:o-1")
    );

    let mut c = config();
    c.key_source = crate::KeySource::custom(|m: &Message| {
        m.json::<serde_json::Value>()
            .map_err(|e| e.to_string())?
            .get("id")
            .and_then(serde_json::Value::as_str)
            .map(|id| format!("custom-{id}"))
            .ok_or_else(|| "no id".to_owned())
    });
    let p = Processor::new(
        MemoryStore::default(),
        handler_fn(|_m, _ctx| async { Ok(None) }),
        c,
    )
    .unwrap();
    assert!(matches!(
        p.process(Message::new("m-3", r#"{"id":"x"}"#)).await,
        Outcome::Completed { .. }
    ));
    assert_eq!(p.store().records()[0].pk, record_key("test", "custom-x"));
    let parked = p.process(Message::new("m-4", "{}")).await;
    assert!(
        matches!(&parked, Outcome::Park { reason } if reason.contains("custom dedup key could not be taken: no id")),
        "{parked:?}"
    );
}

/// The key a runtime read for the lane split is taken as read only by the
/// processor whose config read it: a copy handed to a processor keyed
/// otherwise (a handler passing its message on) is keyed by that one.
#[tokio::test(start_paused = true)]
async fn a_key_read_by_another_config_is_read_again() {
    let (calls, handler) = counting();
    let by_id = Processor::new(MemoryStore::default(), handler.clone(), config()).unwrap();
    let mut by_account = config();
    by_account.key_source = "json:/account".parse().unwrap();
    // The second body differs: skipped as its key says, not parked.
    by_account.payload_mismatch = PayloadMismatch::Warn;
    let by_account = Processor::new(MemoryStore::default(), handler, by_account).unwrap();
    let body = r#"{"id":"e1","account":"a1"}"#;
    let pre_read = |id: &str, body: &str| {
        let mut m = Message::new(id, body);
        let key = by_id.config().dedup_key(&m).unwrap();
        m.set_pre_read_key(key, by_id.config().identity());
        m
    };
    let read = pre_read("m1", body);
    assert_eq!(read.pre_read_key(by_id.config().identity()), Some("e1"));
    assert_eq!(read.pre_read_key(by_account.config().identity()), None);
    assert!(matches!(
        by_account.process(read.clone()).await,
        Outcome::Completed { .. }
    ));
    // The same account under another id: a duplicate for `by_account`.
    let other = pre_read("m2", r#"{"id":"e2","account":"a1"}"#);
    let again = by_account.process(other).await;
    assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");
    assert!(matches!(
        by_id.process(read).await,
        Outcome::Completed { .. }
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A host's wall clock: tokio's virtual time plus an offset that a test
/// steps (a time sync correcting the clock at once).
#[derive(Debug)]
struct SteppedClock {
    base: clock::TokioClock,
    offset_ms: std::sync::atomic::AtomicI64,
}

impl clock::Clock for SteppedClock {
    fn now(&self) -> std::time::SystemTime {
        let t = self.base.now();
        let off = self.offset_ms.load(Ordering::SeqCst);
        let by = Duration::from_millis(off.unsigned_abs());
        if off >= 0 { t + by } else { t - by }
    }
}

/// Two hosts on one key: A, whose wall clock a test steps, behind a store
/// that can be cut off (its claims answered after `claim_answer_delay`),
/// and B on the true clock; both run `slow_external` handlers counted in
/// the same [`Live`] (A's 60 s, B's 10 ms).
#[allow(clippy::type_complexity)]
fn stepped_host_and_another(
    claim_answer_delay: Duration,
) -> (
    std::time::SystemTime,
    Arc<SteppedClock>,
    MemoryStore,
    Faulty,
    Arc<Live>,
    Processor<Faulty, impl Handler>,
    Processor<MemoryStore, impl Handler>,
) {
    let start = std::time::SystemTime::now();
    let truth: Arc<dyn clock::Clock> = Arc::new(clock::TokioClock::starting_at(start));
    let a_clock = Arc::new(SteppedClock {
        base: clock::TokioClock::starting_at(start),
        offset_ms: std::sync::atomic::AtomicI64::new(0),
    });
    let shared = MemoryStore::new(truth.clone());
    let mut a_store = Faulty::new(shared.with_clock(a_clock.clone()));
    a_store.claim_answer_delay = claim_answer_delay;
    let live = Arc::new(Live::default());
    let a = Processor::new(
        a_store.clone(),
        slow_external(live.clone(), Duration::from_secs(60)),
        lease_config(),
    )
    .unwrap()
    .with_clock(a_clock.clone());
    let b = Processor::new(
        shared.clone(),
        slow_external(live.clone(), Duration::from_millis(10)),
        lease_config(),
    )
    .unwrap()
    .with_clock(truth);
    (start, a_clock, shared, a_store, live, a, b)
}

/// The stored lease end of the key `k` (0 before any claim).
async fn lease_until(store: &MemoryStore) -> i64 {
    store
        .get("test#k")
        .await
        .unwrap()
        .map_or(0, |r| r.lease_until_ms)
}

/// Waits (by `give_up`) until the key `k` is claimed.
async fn until_claimed(store: &MemoryStore, give_up: tokio::time::Instant) {
    while lease_until(store).await == 0 {
        assert!(tokio::time::Instant::now() < give_up, "A never claimed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// B tries every 100 ms (by `give_up`) until it gets the key.
async fn until_taken(
    b: &Processor<MemoryStore, impl Handler>,
    msg: &Message,
    give_up: tokio::time::Instant,
) -> Outcome {
    loop {
        assert!(
            tokio::time::Instant::now() < give_up,
            "B never took the key"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        match b.process(msg.clone()).await {
            Outcome::InFlight { .. } => continue,
            o => return o,
        }
    }
}

/// A's wall clock steps 5 s back after its claim; its next extension writes a
/// lease end 5 s earlier, by every other host's clock, than A's monotonic
/// clock would count; then A loses DynamoDB. A must stop by the stored end
/// less the margin, before B (on the true clock) can claim the key. Without
/// the anchor, A ran until 4 s after B took the key.
#[tokio::test(start_paused = true)]
async fn a_wall_clock_stepped_back_mid_lease_shortens_the_local_lease_end_as_it_shortened_the_stored_one()
 {
    let (start, a_clock, shared, a_store, live, a, b) = stepped_host_and_another(Duration::ZERO);
    let msg = Message::new("m", r#"{"id":"k"}"#);
    let a_run = tokio::spawn({
        let (a, msg) = (a.clone(), msg.clone());
        async move {
            let o = a.process(msg).await;
            (o, tokio::time::Instant::now())
        }
    });
    let started = tokio::time::Instant::now();
    let give_up = started + Duration::from_secs(30);
    // The claim lands (a lease of 10 s from the start), then the clock steps back.
    until_claimed(&shared, give_up).await;
    let claimed_until = lease_until(&shared).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    a_clock.offset_ms.store(-5_000, Ordering::SeqCst);
    // Wait for an extension that moved the stored end (sent at 6 s by the
    // true clock, 1 s by A's: to 11 s), then cut A off from DynamoDB.
    while lease_until(&shared).await <= claimed_until {
        assert!(
            tokio::time::Instant::now() < give_up,
            "no extension moved the lease"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a_store.extends_fail.store(true, Ordering::SeqCst);
    a_store.releases_fail.store(true, Ordering::SeqCst);
    let stored_until = lease_until(&shared).await;
    let b_outcome = until_taken(&b, &msg, give_up).await;
    let (a_outcome, a_stopped) = a_run.await.unwrap();
    assert!(
        matches!(b_outcome, Outcome::Completed { .. }),
        "{b_outcome:?}"
    );
    assert!(matches!(&a_outcome, Outcome::Retry { .. }), "{a_outcome:?}");
    assert_eq!(
        live.max.load(Ordering::SeqCst),
        1,
        "two live attempts of one key"
    );
    // A stopped a margin before the stored end (by the true clock).
    let a_stopped_ms = clock::to_ms(start + (a_stopped - started));
    assert!(
        a_stopped_ms <= stored_until - 1_000 + 50,
        "A stopped {} ms after the stored lease end less the margin",
        a_stopped_ms - (stored_until - 1_000)
    );
}

/// The step back comes while the claim's answer is on its way (written at
/// once, answered 2 s later): anchored after the answer, the step was never
/// seen (every later reading rose) and the holder ran 4 s into the next
/// holder's claim. Anchored when the claim is sent, the reading at the
/// answer is below it.
#[tokio::test(start_paused = true)]
async fn a_wall_clock_stepped_back_while_the_claim_is_answered_is_seen() {
    let (_, a_clock, shared, a_store, live, a, b) =
        stepped_host_and_another(Duration::from_secs(2));
    let msg = Message::new("m", r#"{"id":"k"}"#);
    let a_run = tokio::spawn({
        let (a, msg) = (a.clone(), msg.clone());
        async move { a.process(msg).await }
    });
    let started = tokio::time::Instant::now();
    let give_up = started + Duration::from_secs(30);
    until_claimed(&shared, give_up).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    a_clock.offset_ms.store(-5_000, Ordering::SeqCst);
    tokio::time::sleep_until(started + Duration::from_secs(6)).await;
    a_store.extends_fail.store(true, Ordering::SeqCst);
    a_store.releases_fail.store(true, Ordering::SeqCst);
    let b_outcome = until_taken(&b, &msg, give_up).await;
    let a_outcome = a_run.await.unwrap();
    assert!(
        matches!(b_outcome, Outcome::Completed { .. }),
        "{b_outcome:?}"
    );
    assert!(matches!(&a_outcome, Outcome::Retry { .. }), "{a_outcome:?}");
    assert_eq!(
        live.max.load(Ordering::SeqCst),
        1,
        "two live attempts of one key"
    );
}
