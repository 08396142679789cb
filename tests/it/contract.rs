//! One contract suite for every dedup store: the same tests run against the
//! in-memory store and against DynamoDB on LocalStack.

use std::sync::Arc;
use std::time::Duration;

use sqs_once::clock::{Clock, ManualClock};
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{Claim, DedupStore, Outgoing, Status, StoreError, StoredResult};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

/// The attempt of an acquired claim, or the claim that was not.
fn acquired(claim: Claim) -> Result<u32, Claim> {
    match claim {
        Claim::Acquired { attempt, .. } => Ok(attempt),
        other => Err(other),
    }
}

fn req(pk: &str, payload: &str) -> ClaimRequest {
    ClaimRequest {
        pk: pk.to_owned(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: uuid::Uuid::new_v4().to_string(),
        payload_sha256: sqs_once::key::sha256_hex(payload.as_bytes()),
        lease: LEASE,
        ttl: TTL,
    }
}

fn completion(r: &ClaimRequest, result: Option<serde_json::Value>) -> Completion {
    Completion {
        pk: r.pk.clone(),
        owner: r.owner.clone(),
        result: result.map(StoredResult::Value),
        ttl: TTL,
        writes: vec![],
        outbox: vec![],
    }
}

pub async fn first_claim_acquires<S: DedupStore>(store: &S, clock: &ManualClock) {
    let r = req("c#first", "body");
    assert_eq!(acquired(store.claim(&r).await.unwrap()), Ok(1));
    let rec = store.get(&r.pk).await.unwrap().expect("record written");
    assert_eq!(rec.status, Status::InProgress);
    assert_eq!(rec.owner.as_deref(), Some(r.owner.as_str()));
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.lease_until_ms, clock.now_ms() + 30_000);
    assert_eq!(rec.expires_at_s, clock.now_ms() / 1000 + 3600);
    assert_eq!(rec.message_id.as_deref(), Some(r.message_id.as_str()));
}

pub async fn completed_key_is_duplicate_with_result<S: DedupStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let a = req("c#done", "body");
    store.claim(&a).await.unwrap();
    store
        .complete(completion(&a, Some(serde_json::json!({"charge": "ch_1"}))))
        .await
        .unwrap();
    let b = req("c#done", "body");
    assert_eq!(
        store.claim(&b).await.unwrap(),
        Claim::Duplicate {
            result: Some(StoredResult::Value(serde_json::json!({"charge": "ch_1"}))),
            payload_matches: true,
            outbox: Vec::new(),
        }
    );
    let rec = store.get("c#done").await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert_eq!(
        rec.owner.as_deref(),
        Some(a.owner.as_str()),
        "a duplicate does not take the record"
    );
}

pub async fn live_in_progress_key_is_in_flight_with_lease_end<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let a = req("c#live", "body");
    store.claim(&a).await.unwrap();
    let lease_end = clock.now_ms() + 30_000;
    clock.advance(Duration::from_secs(10));
    assert_eq!(
        store.claim(&req("c#live", "body")).await.unwrap(),
        Claim::InFlight {
            lease_until_ms: lease_end,
            payload_matches: true,
        }
    );
}

pub async fn stale_lease_is_taken_over_and_old_owner_is_fenced<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let old = req("c#stale", "body");
    store.claim(&old).await.unwrap();
    clock.advance(LEASE + Duration::from_secs(1));
    let new = req("c#stale", "body");
    assert_eq!(acquired(store.claim(&new).await.unwrap()), Ok(2));
    // The old owner wakes up: every guarded operation fails the fencing check.
    let err = store.complete(completion(&old, None)).await.unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    let err = store
        .extend_lease(&old.pk, &old.owner, LEASE, TTL)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    let err = store.release(&old.pk, &old.owner, "x").await.unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    let err = store
        .mark_failed(&old.pk, &old.owner, "x", TTL)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    // The new owner is unaffected.
    store.complete(completion(&new, None)).await.unwrap();
    let rec = store.get(&new.pk).await.unwrap().unwrap();
    assert_eq!(
        (rec.status, rec.owner),
        (Status::Completed, Some(new.owner.clone()))
    );
}

pub async fn release_lets_the_next_claim_acquire<S: DedupStore>(store: &S, _clock: &ManualClock) {
    let a = req("c#rel", "body");
    store.claim(&a).await.unwrap();
    store
        .release(&a.pk, &a.owner, "downstream 503")
        .await
        .unwrap();
    let b = req("c#rel", "body");
    assert_eq!(acquired(store.claim(&b).await.unwrap()), Ok(2));
    let rec = store.get(&b.pk).await.unwrap().unwrap();
    assert_eq!(
        rec.error.as_deref(),
        Some("downstream 503"),
        "last error kept for operators"
    );
}

pub async fn extended_lease_keeps_others_out<S: DedupStore>(store: &S, clock: &ManualClock) {
    let a = req("c#ext", "body");
    store.claim(&a).await.unwrap();
    clock.advance(Duration::from_secs(25));
    store
        .extend_lease(&a.pk, &a.owner, LEASE, TTL)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(25)); // past the first lease, inside the extension
    assert!(matches!(
        store.claim(&req("c#ext", "body")).await.unwrap(),
        Claim::InFlight { .. }
    ));
}

pub async fn expired_record_is_reclaimable_while_it_still_exists<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let a = req("c#exp", "body");
    store.claim(&a).await.unwrap();
    store.complete(completion(&a, None)).await.unwrap();
    clock.advance(TTL + Duration::from_secs(2));
    assert!(
        store.get(&a.pk).await.unwrap().is_some(),
        "TTL deletion is lazy: the item is still there"
    );
    assert_eq!(
        acquired(store.claim(&req("c#exp", "body")).await.unwrap()),
        Ok(2),
        "expiry is decided by the clock"
    );
}

pub async fn same_key_different_payload_is_reported<S: DedupStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let a = req("c#pay", "amount=10");
    store.claim(&a).await.unwrap();
    assert!(matches!(
        store.claim(&req("c#pay", "amount=99")).await.unwrap(),
        Claim::InFlight {
            payload_matches: false,
            ..
        }
    ));
    store.complete(completion(&a, None)).await.unwrap();
    assert_eq!(
        store.claim(&req("c#pay", "amount=99")).await.unwrap(),
        Claim::Duplicate {
            result: None,
            payload_matches: false,
            outbox: Vec::new(),
        }
    );
}

pub async fn retry_with_same_token_after_commit_is_idempotent<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    // What a caller whose response was lost does: send the same request again.
    // Each repeat answers as the first did and leaves the record as it was.
    let a = req("c#again", "body");
    assert_eq!(acquired(store.claim(&a).await.unwrap()), Ok(1));
    let claimed = store.get(&a.pk).await.unwrap().unwrap();
    // Time passes between a request and its repeat: a repeat that acted anew
    // would show in the timestamps.
    clock.advance(Duration::from_secs(1));
    assert_eq!(acquired(store.claim(&a).await.unwrap()), Ok(1));
    let again = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(again.status, Status::InProgress);
    assert_eq!(again.attempts, 1, "a repeated claim is not a new attempt");
    assert_eq!(again.owner.as_deref(), Some(a.owner.as_str()));
    assert_eq!(
        again.claimed_at_ms, claimed.claimed_at_ms,
        "not claimed anew"
    );
    store
        .extend_lease(&a.pk, &a.owner, LEASE, TTL)
        .await
        .unwrap();
    let result = serde_json::json!({"charge": "ch_1"});
    store
        .complete(completion(&a, Some(result.clone())))
        .await
        .unwrap();
    let completed = store.get(&a.pk).await.unwrap().unwrap();
    clock.advance(Duration::from_secs(1));
    store
        .complete(completion(&a, Some(result.clone())))
        .await
        .unwrap();
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.result, Some(StoredResult::Value(result)));
    assert_eq!(
        rec.completed_at_ms, completed.completed_at_ms,
        "the repeat did not complete it a second time"
    );

    let b = req("c#again-failed", "body");
    store.claim(&b).await.unwrap();
    store
        .mark_failed(&b.pk, &b.owner, "bad", TTL)
        .await
        .unwrap();
    let failed = store.get(&b.pk).await.unwrap().unwrap();
    clock.advance(Duration::from_secs(1));
    store
        .mark_failed(&b.pk, &b.owner, "bad", TTL)
        .await
        .unwrap();
    let rec = store.get(&b.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.error.as_deref(), Some("bad"));
    assert_eq!(rec.expires_at_s, failed.expires_at_s);
}

pub async fn failed_record_does_not_block_a_redrive<S: DedupStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let a = req("c#failed", "body");
    store.claim(&a).await.unwrap();
    store
        .mark_failed(&a.pk, &a.owner, "card declined", TTL)
        .await
        .unwrap();
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(
        acquired(store.claim(&req("c#failed", "body")).await.unwrap()),
        Ok(2)
    );
    assert_eq!(
        store.get(&a.pk).await.unwrap().unwrap().error.as_deref(),
        Some("card declined")
    );
}

pub async fn fifty_concurrent_claims_yield_one_acquired<S: DedupStore>(
    store: Arc<S>,
    _clock: &ManualClock,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let store = store.clone();
        tasks.spawn(async move { store.claim(&req("c#race", "body")).await.unwrap() });
    }
    let (mut acquired, mut in_flight) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            Claim::Acquired { .. } => acquired += 1,
            Claim::InFlight { .. } => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((acquired, in_flight), (1, 49));
}

pub async fn hashed_long_keys_work<S: DedupStore>(store: &S, _clock: &ManualClock) {
    let pk = sqs_once::key::record_key("c", &"k".repeat(3000));
    let a = req(&pk, "body");
    assert_eq!(acquired(store.claim(&a).await.unwrap()), Ok(1));
    store.complete(completion(&a, None)).await.unwrap();
    assert!(matches!(
        store.claim(&req(&pk, "body")).await.unwrap(),
        Claim::Duplicate { .. }
    ));
}

/// A fast-path commit whose handler read its fence from `clock` now.
fn fast(
    clock: &ManualClock,
    pk: &str,
    payload: &str,
    result: Option<serde_json::Value>,
) -> FastCommit {
    FastCommit {
        pk: pk.to_owned(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: uuid::Uuid::new_v4().to_string(),
        payload_sha256: sqs_once::key::sha256_hex(payload.as_bytes()),
        fence: sqs_once::store::clock_fence(clock.now_ms()),
        result: result.map(StoredResult::Value),
        ttl: TTL,
        writes: vec![],
        outbox: vec![],
    }
}

pub async fn fast_commit_records_completed_once_and_then_is_a_duplicate<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let a = fast(clock, "c#fast", "body", Some(serde_json::json!({"ok": 1})));
    assert_eq!(
        store.commit_fast(a.clone()).await.unwrap(),
        FastCommitted::Committed
    );
    let rec = store.get("c#fast").await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert_eq!(rec.owner.as_deref(), Some(a.owner.as_str()));
    assert_eq!(rec.attempts, 1);
    assert_eq!(rec.expires_at_s, clock.now_ms() / 1000 + 3600);
    // The same commit sent again (its response was lost) is ours, not a duplicate.
    assert_eq!(
        store.commit_fast(a.clone()).await.unwrap(),
        FastCommitted::Committed
    );
    // Another delivery of the key: a duplicate with the stored result, by both paths.
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast", "body", None))
            .await
            .unwrap(),
        FastCommitted::Duplicate {
            result: Some(StoredResult::Value(serde_json::json!({"ok": 1}))),
            payload_matches: true,
            outbox: Vec::new(),
        }
    );
    assert!(matches!(
        store.claim(&req("c#fast", "other body")).await.unwrap(),
        Claim::Duplicate {
            payload_matches: false,
            ..
        }
    ));
    assert_eq!(
        store.get("c#fast").await.unwrap().unwrap().owner.as_deref(),
        Some(a.owner.as_str())
    );
}

pub async fn fast_commit_respects_claims_failures_and_expiry<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    // A general-path consumer holds a live claim: in flight, nothing written.
    let held = req("c#fast-held", "body");
    store.claim(&held).await.unwrap();
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast-held", "body", None))
            .await
            .unwrap(),
        FastCommitted::InFlight {
            lease_until_ms: clock.now_ms() + 30_000,
            payload_matches: true,
        }
    );
    // A FAILED record (a parked message being redriven) does not block.
    let failed = req("c#fast-failed", "body");
    store.claim(&failed).await.unwrap();
    store
        .mark_failed(&failed.pk, &failed.owner, "bad", TTL)
        .await
        .unwrap();
    // (Its handler reads its fence after the failure: a later millisecond.)
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast-failed", "body", None))
            .await
            .unwrap(),
        FastCommitted::Committed
    );
    assert_eq!(
        store.get("c#fast-failed").await.unwrap().unwrap().attempts,
        2
    );
    // An expired record is decided by the clock, not by TTL deletion.
    store
        .commit_fast(fast(clock, "c#fast-exp", "body", None))
        .await
        .unwrap();
    clock.advance(TTL + Duration::from_secs(2));
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast-exp", "body", None))
            .await
            .unwrap(),
        FastCommitted::Committed
    );
    // The held lease ran out long ago: the key can be committed now.
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast-held", "body", None))
            .await
            .unwrap(),
        FastCommitted::Committed
    );
    assert!(
        matches!(
            store.complete(completion(&held, None)).await,
            Err(StoreError::LeaseLost { .. })
        ),
        "the old owner is fenced"
    );
}

pub async fn fifty_concurrent_fast_commits_yield_one_committed<S: DedupStore>(
    store: Arc<S>,
    clock: &ManualClock,
) {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let store = store.clone();
        let commit = fast(clock, "c#fast-race", "body", None);
        tasks.spawn(async move { store.commit_fast(commit).await });
    }
    let (mut committed, mut duplicates) = (0, 0);
    while let Some(r) = tasks.join_next().await {
        match r.unwrap() {
            Ok(FastCommitted::Committed) => committed += 1,
            Ok(FastCommitted::Duplicate { .. }) => duplicates += 1,
            // Concurrent transactions on one item may be cancelled as conflicting
            // and not settle within the retries: nothing was written by those.
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(committed, 1, "{duplicates} duplicates");
}

pub async fn an_extension_that_lands_after_a_release_does_not_hold_the_key<S: DedupStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let a = req("c#late-ext", "body");
    store.claim(&a).await.unwrap();
    store.release(&a.pk, &a.owner, "retry").await.unwrap();
    // A heartbeat's extension sent before the release, arriving after it.
    let err = store
        .extend_lease(&a.pk, &a.owner, LEASE, TTL)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    let b = req("c#late-ext", "body");
    assert_eq!(
        acquired(store.claim(&b).await.unwrap()),
        Ok(2),
        "the released key is free at once"
    );
}

pub async fn an_earlier_extension_landing_late_does_not_shorten_the_lease<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let a = req("c#ext-order", "body");
    store.claim(&a).await.unwrap();
    let t1 = clock.now();
    clock.advance(Duration::from_secs(4));
    // The later extension lands first...
    store
        .extend_lease(&a.pk, &a.owner, LEASE, TTL)
        .await
        .unwrap();
    let extended = store.get(&a.pk).await.unwrap().unwrap().lease_until_ms;
    // ...then one built at t1 arrives.
    clock.set(t1 + Duration::from_secs(1));
    store
        .extend_lease(&a.pk, &a.owner, LEASE, TTL)
        .await
        .unwrap();
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(rec.lease_until_ms, extended, "the lease was shortened");
}

pub async fn an_extension_keeps_the_record_beyond_its_lease<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let mut a = req("c#ext-ttl", "body");
    a.ttl = LEASE + Duration::from_secs(10);
    store.claim(&a).await.unwrap();
    for _ in 0..5 {
        clock.advance(Duration::from_secs(20));
        store
            .extend_lease(&a.pk, &a.owner, LEASE, a.ttl)
            .await
            .unwrap();
    }
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert!(
        rec.expires_at_s * 1000 > rec.lease_until_ms,
        "expires at {} s, lease until {} ms",
        rec.expires_at_s,
        rec.lease_until_ms
    );
    assert!(matches!(
        store.claim(&req("c#ext-ttl", "body")).await.unwrap(),
        Claim::InFlight { .. }
    ));
}

pub async fn a_failed_record_is_parked_for_its_own_delivery_and_claimable_by_others<
    S: DedupStore,
>(
    store: &S,
    clock: &ManualClock,
) {
    let a = req("c#parked", "body");
    store.claim(&a).await.unwrap();
    store
        .mark_failed(&a.pk, &a.owner, "insufficient funds", TTL)
        .await
        .unwrap();
    // The same delivery again (its delete after the park failed).
    let mut again = req("c#parked", "body");
    again.message_id = a.message_id.clone();
    assert_eq!(
        store.claim(&again).await.unwrap(),
        Claim::Parked {
            reason: Some("insufficient funds".into())
        }
    );
    let mut fast_again = fast(clock, "c#parked", "body", None);
    fast_again.message_id = a.message_id.clone();
    assert_eq!(
        store.commit_fast(fast_again).await.unwrap(),
        FastCommitted::Parked {
            reason: Some("insufficient funds".into())
        }
    );
    // A copy brought back from the DLQ is a new message: it may run.
    assert_eq!(
        acquired(store.claim(&req("c#parked", "body")).await.unwrap()),
        Ok(2)
    );
}

/// A claim sent before a delivery failed, and applied after the failure (a
/// request that landed late: its values carry the time it was sent), does not
/// take the `FAILED` record: the failure it never saw stands. Found by the
/// simulator (a late claim turned a parked delivery's `FAILED` record back to
/// `IN_PROGRESS`, so a redelivery of the parked message would run again).
pub async fn a_claim_sent_before_a_failure_does_not_take_the_failed_record<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let sent = clock.now();
    clock.advance(Duration::from_millis(5));
    let a = req("c#late", "body");
    store.claim(&a).await.unwrap();
    store
        .mark_failed(&a.pk, &a.owner, "declined", TTL)
        .await
        .unwrap();
    // Another delivery's claim, made before that claim (its values carry the
    // earlier time), lands now.
    let now = clock.now();
    clock.set(sent);
    let late = req("c#late", "body");
    assert!(matches!(
        store.claim(&late).await.unwrap(),
        Claim::InFlight { .. }
    ));
    clock.set(now);
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Failed, "the failure stands");
    assert_eq!(
        acquired(store.claim(&late).await.unwrap()),
        Ok(2),
        "a claim made after the failure takes it"
    );
}

fn sent() -> Vec<Outgoing> {
    vec![
        Outgoing::new("http://sqs.local/000000000000/paid", "{\"order\":1}")
            .attribute("kind", "paid"),
        Outgoing::new("http://sqs.local/000000000000/paid.fifo", "b").group("o-1"),
    ]
}

/// A completion records the messages to send; a duplicate's answer carries
/// them until they are marked dispatched; a mark is idempotent, and a mark of
/// other messages than the record holds (one that lands after the record was
/// replaced) changes nothing.
pub async fn a_completion_records_its_outbox_until_marked_dispatched<S: DedupStore>(
    store: &S,
    _clock: &ManualClock,
) {
    let a = req("c#outbox", "body");
    store.claim(&a).await.unwrap();
    // Nothing to mark on an in-progress record.
    store.mark_dispatched(&a.pk, &sent()).await.unwrap();
    let mut c = completion(&a, None);
    c.outbox = sent();
    store.complete(c).await.unwrap();
    assert_eq!(store.get(&a.pk).await.unwrap().unwrap().outbox, sent());
    assert!(matches!(
        store.claim(&req(&a.pk, "body")).await.unwrap(),
        Claim::Duplicate { outbox, .. } if outbox == sent()
    ));
    let other = vec![Outgoing::new("http://sqs.local/000000000000/paid", "other")];
    store.mark_dispatched(&a.pk, &other).await.unwrap();
    assert_eq!(
        store.get(&a.pk).await.unwrap().unwrap().outbox,
        sent(),
        "a mark of other messages leaves these to send"
    );
    store.mark_dispatched(&a.pk, &sent()).await.unwrap();
    store.mark_dispatched(&a.pk, &sent()).await.unwrap();
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert!(rec.outbox.is_empty(), "{:?}", rec.outbox);
    assert!(matches!(
        store.claim(&req(&a.pk, "body")).await.unwrap(),
        Claim::Duplicate { outbox, .. } if outbox.is_empty()
    ));
    // Nothing to mark on an absent record.
    store.mark_dispatched("c#absent", &sent()).await.unwrap();
    assert!(store.get("c#absent").await.unwrap().is_none());
}

/// A claim that takes an expired record with unsent messages does not keep
/// them, whatever becomes of it.
pub async fn a_claim_of_an_expired_record_drops_its_unsent_messages<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let mut first = fast(clock, "c#claim-outbox", "body", None);
    first.outbox = sent();
    first.ttl = Duration::from_secs(2);
    store.commit_fast(first).await.unwrap();
    clock.advance(Duration::from_secs(5));
    let b = req("c#claim-outbox", "body");
    assert!(matches!(
        store.claim(&b).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let rec = store.get(&b.pk).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::InProgress);
    assert!(rec.outbox.is_empty(), "kept {:?}", rec.outbox);
}

/// A fast commit records its outbox; a commit that replaces an expired
/// record with unsent messages does not inherit them.
pub async fn a_fast_commit_records_its_outbox_and_a_new_one_does_not_inherit<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let mut first = fast(clock, "c#fast-outbox", "body", None);
    first.outbox = sent();
    first.ttl = Duration::from_secs(2);
    assert_eq!(
        store.commit_fast(first).await.unwrap(),
        FastCommitted::Committed
    );
    assert!(matches!(
        store.commit_fast(fast(clock, "c#fast-outbox", "body", None)).await.unwrap(),
        FastCommitted::Duplicate { outbox, .. } if outbox == sent()
    ));
    clock.advance(Duration::from_secs(5));
    assert_eq!(
        store
            .commit_fast(fast(clock, "c#fast-outbox", "body", None))
            .await
            .unwrap(),
        FastCommitted::Committed,
        "the expired record is taken"
    );
    let rec = store.get("c#fast-outbox").await.unwrap().unwrap();
    assert!(rec.outbox.is_empty(), "inherited {:?}", rec.outbox);
}

/// The fence of an acquired claim, checked to be the one stored.
async fn claimed_fence<S: DedupStore>(store: &S, r: &ClaimRequest) -> u64 {
    match store.claim(r).await.unwrap() {
        Claim::Acquired { fence, .. } => {
            let stored = store.get(&r.pk).await.unwrap().unwrap().fence;
            assert_eq!(stored, fence, "the claim's fence is the one stored");
            fence
        }
        other => panic!("not acquired: {other:?}"),
    }
}

pub async fn the_fence_grows_across_claims_a_takeover_expiry_and_fast_commits<S: DedupStore>(
    store: &S,
    clock: &ManualClock,
) {
    let pk = "c#fence";
    let first = claimed_fence(store, &req(pk, "body")).await;
    assert!(
        first > sqs_once::store::clock_fence(clock.now_ms()),
        "starts from the clock"
    );
    clock.advance(LEASE + Duration::from_secs(1));
    let taker = req(pk, "body");
    let taken = claimed_fence(store, &taker).await;
    assert!(taken > first, "takeover: {taken} after {first}");
    store.complete(completion(&taker, None)).await.unwrap();
    clock.advance(TTL + Duration::from_secs(1));
    let late = req(pk, "body");
    let expired = claimed_fence(store, &late).await;
    assert!(
        expired > taken,
        "claim of the expired record: {expired} after {taken}"
    );
    store.release(pk, &late.owner, "gave up").await.unwrap();

    // A fast-path commit whose handler read a fence not above the stored
    // one writes nothing; one whose handler read a later one stores it.
    let mut behind = fast(clock, pk, "body", None);
    behind.fence = expired;
    assert_eq!(
        store.commit_fast(behind).await.unwrap(),
        FastCommitted::FenceBehind { stored: expired }
    );
    let rec = store.get(pk).await.unwrap().unwrap();
    assert_eq!(
        (rec.status, rec.fence),
        (Status::InProgress, expired),
        "unchanged"
    );
    clock.advance(Duration::from_millis(1));
    let ahead = fast(clock, pk, "body", None);
    assert_eq!(
        store.commit_fast(ahead.clone()).await.unwrap(),
        FastCommitted::Committed
    );
    assert!(ahead.fence > expired);
    assert_eq!(store.get(pk).await.unwrap().unwrap().fence, ahead.fence);
    clock.advance(TTL + Duration::from_secs(1));
    let after = claimed_fence(store, &req(pk, "body")).await;
    assert!(
        after > ahead.fence,
        "{after} after the fast commit's {}",
        ahead.fence
    );
}

macro_rules! contract_suite {
    ($make:path) => {
        contract_suite!(@one $make, first_claim_acquires);
        contract_suite!(@one $make, completed_key_is_duplicate_with_result);
        contract_suite!(@one $make, live_in_progress_key_is_in_flight_with_lease_end);
        contract_suite!(@one $make, stale_lease_is_taken_over_and_old_owner_is_fenced);
        contract_suite!(@one $make, release_lets_the_next_claim_acquire);
        contract_suite!(@one $make, extended_lease_keeps_others_out);
        contract_suite!(@one $make, expired_record_is_reclaimable_while_it_still_exists);
        contract_suite!(@one $make, same_key_different_payload_is_reported);
        contract_suite!(@one $make, retry_with_same_token_after_commit_is_idempotent);
        contract_suite!(@one $make, failed_record_does_not_block_a_redrive);
        contract_suite!(@one $make, hashed_long_keys_work);
        contract_suite!(@one $make, fast_commit_records_completed_once_and_then_is_a_duplicate);
        contract_suite!(@one $make, fast_commit_respects_claims_failures_and_expiry);
        contract_suite!(@one $make, an_extension_that_lands_after_a_release_does_not_hold_the_key);
        contract_suite!(@one $make, an_extension_keeps_the_record_beyond_its_lease);
        contract_suite!(@one $make, an_earlier_extension_landing_late_does_not_shorten_the_lease);
        contract_suite!(@one $make, a_failed_record_is_parked_for_its_own_delivery_and_claimable_by_others);
        contract_suite!(@one $make, a_claim_sent_before_a_failure_does_not_take_the_failed_record);
        contract_suite!(@one $make, a_completion_records_its_outbox_until_marked_dispatched);
        contract_suite!(@one $make, a_fast_commit_records_its_outbox_and_a_new_one_does_not_inherit);
        contract_suite!(@one $make, a_claim_of_an_expired_record_drops_its_unsent_messages);
        contract_suite!(@one $make, the_fence_grows_across_claims_a_takeover_expiry_and_fast_commits);

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn fifty_concurrent_fast_commits_yield_one_committed() {
            let Some((store, clock)) = $make().await else {
                return;
            };
            super::fifty_concurrent_fast_commits_yield_one_committed(std::sync::Arc::new(store), &clock).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn fifty_concurrent_claims_yield_one_acquired() {
            let Some((store, clock)) = $make().await else {
                return;
            };
            super::fifty_concurrent_claims_yield_one_acquired(std::sync::Arc::new(store), &clock).await;
        }
    };
    (@one $make:path, $name:ident) => {
        #[tokio::test]
        async fn $name() {
            let Some((store, clock)) = $make().await else {
                return;
            };
            super::$name(&store, &clock).await;
        }
    };
}

mod memory {
    use sqs_once::MemoryStore;
    use sqs_once::clock::ManualClock;

    async fn make() -> Option<(MemoryStore, ManualClock)> {
        let clock = ManualClock::starting_now();
        Some((MemoryStore::new(std::sync::Arc::new(clock.clone())), clock))
    }

    contract_suite!(make);
}

mod dynamodb {
    use sqs_once::DynamoStore;
    use sqs_once::clock::ManualClock;

    async fn make() -> Option<(DynamoStore, ManualClock)> {
        if !crate::common::localstack_up().await {
            return None;
        }
        let client = crate::common::ddb().await;
        let table = crate::common::dedup_table(&client).await;
        let clock = ManualClock::starting_now();
        Some((
            DynamoStore::with_clock(client, table, std::sync::Arc::new(clock.clone())),
            clock,
        ))
    }

    contract_suite!(make);
}
