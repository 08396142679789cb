//! Behaviour that depends on DynamoDB's own semantics: transactions, lost
//! responses, table checks, and the emulator's atomicity.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, ConditionCheck, KeySchemaElement, KeyType,
    ScalarAttributeType, TransactWriteItem, Update,
};
use sqs_once::aws::dynamodb::TableCheckError;
use sqs_once::config::ProcessorConfig;
use sqs_once::store::{ClaimRequest, Completion, FastCommit, FastCommitted};
use sqs_once::{
    Claim, Context, DedupStore, DynamoStore, FailureKind, Handler, HandlerError, HandlerResult,
    Message, Outcome, Processor, Status, StoreError, StoredResult,
};

use aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextMut,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use std::sync::atomic::AtomicU32;

use crate::common::{ddb, ddb_losing, dedup_table, unique};

const TTL: Duration = Duration::from_secs(3600);

/// The fast path's fence now, by the system clock.
fn now_fence() -> u64 {
    sqs_once::store::clock_fence(sqs_once::clock::Clock::now_ms(
        &sqs_once::clock::SystemClock,
    ))
}

/// The attempt of an acquired claim, or the claim that was not.
fn acquired(claim: Claim) -> Result<u32, Claim> {
    match claim {
        Claim::Acquired { attempt, .. } => Ok(attempt),
        other => Err(other),
    }
}

fn req(pk: &str) -> ClaimRequest {
    ClaimRequest {
        pk: pk.to_owned(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        lease: Duration::from_secs(30),
        ttl: TTL,
    }
}

/// `ADD balance_cents :amount, applied_events :1` on account `pk` of `table`.
fn add_to(table: &str, account: &str, amount: i64) -> TransactWriteItem {
    TransactWriteItem::builder()
        .update(
            Update::builder()
                .table_name(table)
                .key("pk", AttributeValue::S(account.into()))
                .update_expression("ADD balance_cents :a, applied_events :one")
                .expression_attribute_values(":a", AttributeValue::N(amount.to_string()))
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .build()
                .unwrap(),
        )
        .build()
}

/// A condition check that fails unless `account` exists.
fn require_exists(table: &str, account: &str) -> TransactWriteItem {
    TransactWriteItem::builder()
        .condition_check(
            ConditionCheck::builder()
                .table_name(table)
                .key("pk", AttributeValue::S(account.into()))
                .condition_expression("attribute_exists(pk)")
                .build()
                .unwrap(),
        )
        .build()
}

async fn business_table(client: &aws_sdk_dynamodb::Client) -> String {
    let name = unique("ledger");
    sqs_once_cli::setup::ensure_table(client, &name)
        .await
        .unwrap();
    name
}

async fn balance(client: &aws_sdk_dynamodb::Client, table: &str, account: &str) -> (i64, i64) {
    let item = client
        .get_item()
        .table_name(table)
        .key("pk", AttributeValue::S(account.into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .unwrap_or_default();
    let n = |k: &str| {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .map_or(0, |v| v.parse().unwrap())
    };
    (n("balance_cents"), n("applied_events"))
}

/// Completes `r` as its owner, with `writes` staged.
fn completion(r: &ClaimRequest, writes: Vec<sqs_once::StagedWrite>) -> Completion {
    Completion {
        pk: r.pk.clone(),
        owner: r.owner.clone(),
        result: None,
        ttl: TTL,
        writes,
        outbox: vec![],
    }
}

fn staged(item: TransactWriteItem, kind: FailureKind) -> sqs_once::StagedWrite {
    sqs_once::StagedWrite {
        item,
        on_condition_failed: kind,
    }
}

#[tokio::test]
async fn staged_writes_commit_with_the_record_or_not_at_all() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (dedup, ledger) = (dedup_table(&client).await, business_table(&client).await);
    let store = DynamoStore::new(client.clone(), dedup);

    // A business condition fails: nothing is written, the claim is still ours.
    let a = req("c#tx");
    store.claim(&a).await.unwrap();
    let err = store
        .complete(completion(
            &a,
            vec![
                staged(add_to(&ledger, "acct-1", 500), FailureKind::Retry),
                staged(
                    require_exists(&ledger, "no-such-account"),
                    FailureKind::Permanent,
                ),
            ],
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::WriteConditionFailed {
                index: 1,
                kind: FailureKind::Permanent
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        balance(&client, &ledger, "acct-1").await,
        (0, 0),
        "no half-applied effect"
    );
    assert_eq!(
        store.get(&a.pk).await.unwrap().unwrap().status,
        Status::InProgress
    );

    // Without the failing check both land together.
    store
        .complete(completion(
            &a,
            vec![staged(add_to(&ledger, "acct-1", 500), FailureKind::Retry)],
        ))
        .await
        .unwrap();
    assert_eq!(balance(&client, &ledger, "acct-1").await, (500, 1));
    assert_eq!(
        store.get(&a.pk).await.unwrap().unwrap().status,
        Status::Completed
    );

    // A fenced-out owner's staged writes never apply.
    let b = req("c#tx2");
    store.claim(&b).await.unwrap();
    let err = store
        .complete(Completion {
            owner: "not-the-owner".into(),
            ..completion(
                &b,
                vec![staged(add_to(&ledger, "acct-2", 7), FailureKind::Retry)],
            )
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::LeaseLost { .. }), "{err:?}");
    assert_eq!(balance(&client, &ledger, "acct-2").await, (0, 0));
}

#[tokio::test]
async fn too_many_staged_writes_is_a_clear_error_and_nothing_is_written() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (dedup, ledger) = (dedup_table(&client).await, business_table(&client).await);
    let store = DynamoStore::new(client.clone(), dedup);
    let a = req("c#big");
    store.claim(&a).await.unwrap();
    let writes = (0..100)
        .map(|i| staged(add_to(&ledger, &format!("acct-{i}"), 1), FailureKind::Retry))
        .collect();
    let err = store.complete(completion(&a, writes)).await.unwrap_err();
    assert!(
        matches!(err, StoreError::TransactionTooLarge { items: 100, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("at most 99"), "{err}");
    assert_eq!(balance(&client, &ledger, "acct-0").await, (0, 0));
}

/// The fence of an acquired claim.
fn fence_of(claim: Claim) -> u64 {
    match claim {
        Claim::Acquired { fence, .. } => fence,
        other => panic!("not acquired: {other:?}"),
    }
}

/// The `fence` attribute as DynamoDB holds it.
async fn stored_fence(client: &aws_sdk_dynamodb::Client, table: &str, pk: &str) -> u64 {
    let item = client
        .get_item()
        .table_name(table)
        .key("pk", AttributeValue::S(pk.into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .expect("a record");
    item["fence"].as_n().unwrap().parse().unwrap()
}

#[tokio::test]
async fn the_fence_grows_across_a_takeover_expiry_and_the_records_deletion_by_ttl() {
    if !crate::common::localstack_up().await {
        return;
    }
    let clock = sqs_once::clock::ManualClock::starting_now();
    let client = ddb().await;
    let dedup = dedup_table(&client).await;
    let store = DynamoStore::with_clock(client.clone(), dedup.clone(), Arc::new(clock.clone()));
    let pk = "c#fence";
    let first = fence_of(store.claim(&req(pk)).await.unwrap());
    assert_eq!(stored_fence(&client, &dedup, pk).await, first);

    // The lease runs out: taken over, one above.
    clock.advance(Duration::from_secs(31));
    let taker = req(pk);
    let taken = fence_of(store.claim(&taker).await.unwrap());
    assert_eq!(taken, first + 1);
    store
        .complete(Completion {
            pk: pk.into(),
            owner: taker.owner.clone(),
            result: None,
            ttl: TTL,
            writes: vec![],
            outbox: vec![],
        })
        .await
        .unwrap();

    // Past its expires_at, still there: one above again.
    clock.advance(TTL + Duration::from_secs(1));
    let late = req(pk);
    let expired = fence_of(store.claim(&late).await.unwrap());
    assert_eq!(expired, taken + 1);
    store.release(pk, &late.owner, "gave up").await.unwrap();

    // Deleted, as TTL deletes it, later: a claim starts from the clock, above.
    clock.advance(TTL + Duration::from_secs(1));
    client
        .delete_item()
        .table_name(&dedup)
        .key("pk", AttributeValue::S(pk.into()))
        .send()
        .await
        .unwrap();
    let again = fence_of(store.claim(&req(pk)).await.unwrap());
    assert!(again > expired, "{again} after {expired}");
    assert_eq!(stored_fence(&client, &dedup, pk).await, again);
}

#[tokio::test]
async fn lost_claim_response_is_retried_with_the_same_token_and_acquires() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (client, lost) = ddb_losing("UpdateItem", 1).await;
    let store = DynamoStore::new(client, dedup_table(&ddb().await).await);
    let metrics = Arc::new(sqs_once::metrics::Metrics::default());
    store.report_to(metrics.clone());
    let a = req("c#lost");
    assert_eq!(acquired(store.claim(&a).await.unwrap()), Ok(1));
    assert_eq!(
        lost.load(Ordering::SeqCst),
        1,
        "the first response was really lost"
    );
    let rec = store.get(&a.pk).await.unwrap().unwrap();
    assert_eq!((rec.attempts, rec.owner), (1, Some(a.owner.clone())));
    let seen = metrics.take();
    assert_eq!(seen.unknown_resolved, 1, "the lost answer is counted once");
    assert_eq!(seen.takeovers, 0, "finding our own claim is no takeover");
}

#[tokio::test]
async fn a_claim_over_an_expired_one_is_counted_as_a_takeover_and_numbered_after_it() {
    if !crate::common::localstack_up().await {
        return;
    }
    let clock = sqs_once::clock::ManualClock::starting_now();
    let store = DynamoStore::with_clock(
        ddb().await,
        dedup_table(&ddb().await).await,
        Arc::new(clock.clone()),
    );
    let metrics = Arc::new(sqs_once::metrics::Metrics::default());
    store.report_to(metrics.clone());
    let (gone, released) = (req("c#gone"), req("c#released"));
    for r in [&gone, &released] {
        assert_eq!(acquired(store.claim(r).await.unwrap()), Ok(1));
    }
    store
        .release(&released.pk, &released.owner, "gave up")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    for r in [&gone, &released] {
        let next = ClaimRequest {
            owner: uuid::Uuid::new_v4().to_string(),
            ..r.clone()
        };
        assert_eq!(acquired(store.claim(&next).await.unwrap()), Ok(2));
    }
    let seen = metrics.take();
    assert_eq!(
        seen.takeovers, 1,
        "only the expired, unreleased claim is a takeover"
    );
    assert_eq!(seen.unknown_resolved, 0);
}

#[tokio::test]
async fn lost_complete_response_applies_the_effect_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let (client, lost) = ddb_losing("TransactWriteItems", 2).await;
    let store = DynamoStore::new(client, dedup);
    let a = req("c#lost-complete");
    store.claim(&a).await.unwrap();
    store
        .complete(completion(
            &a,
            vec![staged(add_to(&ledger, "acct", 250), FailureKind::Retry)],
        ))
        .await
        .unwrap();
    assert_eq!(lost.load(Ordering::SeqCst), 2);
    assert_eq!(
        balance(&plain, &ledger, "acct").await,
        (250, 1),
        "applied exactly once"
    );
}

#[tokio::test]
async fn lost_fast_commit_response_applies_the_effect_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let (client, lost) = ddb_losing("TransactWriteItems", 2).await;
    let store = DynamoStore::new(client, dedup);
    let metrics = Arc::new(sqs_once::metrics::Metrics::default());
    store.report_to(metrics.clone());
    let commit = FastCommit {
        pk: "c#lost-fast".into(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        fence: now_fence(),
        result: None,
        ttl: TTL,
        writes: vec![staged(add_to(&ledger, "acct", 250), FailureKind::Retry)],
        outbox: vec![],
    };
    assert_eq!(
        store.commit_fast(commit.clone()).await.unwrap(),
        FastCommitted::Committed,
        "the retry with the same token finds its own commit"
    );
    assert_eq!(lost.load(Ordering::SeqCst), 2);
    assert_eq!(
        balance(&plain, &ledger, "acct").await,
        (250, 1),
        "applied exactly once"
    );
    assert_eq!(
        metrics.take().unknown_resolved,
        1,
        "one write, resolved once"
    );
    // Another delivery of the key writes nothing.
    let again = FastCommit {
        owner: uuid::Uuid::new_v4().to_string(),
        ..commit
    };
    assert!(matches!(
        store.commit_fast(again).await.unwrap(),
        FastCommitted::Duplicate { .. }
    ));
    assert_eq!(balance(&plain, &ledger, "acct").await, (250, 1));
}

/// The fast path writes a new key's record with a put and a record it
/// takes over with a conditional update: the two must leave the same
/// attributes (a field one of them forgot would be lost on every new key,
/// or kept from the old record on every takeover).
#[tokio::test]
async fn a_new_keys_record_is_the_record_a_takeover_leaves() {
    if !crate::common::localstack_up().await {
        return;
    }
    let clock = sqs_once::clock::ManualClock::starting_now();
    let plain = ddb().await;
    let dedup = dedup_table(&plain).await;
    let store = DynamoStore::with_clock(plain.clone(), dedup.clone(), Arc::new(clock.clone()));
    let outbox = vec![sqs_once::Outgoing::new(
        "https://sqs.example/q",
        "{\"n\":1}",
    )];
    let fast = |pk: &str, result: Option<StoredResult>| FastCommit {
        pk: pk.into(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        fence: sqs_once::store::clock_fence(sqs_once::clock::Clock::now_ms(&clock)),
        result,
        ttl: TTL,
        writes: vec![],
        outbox: outbox.clone(),
    };
    let results = [
        None,
        Some(StoredResult::Value(serde_json::json!({"charge": "ch_1"}))),
        Some(StoredResult::Digest {
            sha256: "d".repeat(64),
            bytes: 500_000,
        }),
    ];
    for (i, result) in results.iter().cloned().enumerate() {
        let (new, taken) = (format!("c#new-{i}"), format!("c#taken-{i}"));
        let done = format!("c#done-{i}");
        // The record taken over: a claim released with an error, then expired,
        // carrying every attribute a record can have that a completion drops.
        let old = req(&taken);
        store.claim(&old).await.unwrap();
        store.release(&old.pk, &old.owner, "gave up").await.unwrap();
        // And one completed before with another result, its outbox sent,
        // then expired: the takeover leaves nothing of the first completion.
        let earlier = results[(i + 1) % results.len()].clone();
        store.commit_fast(fast(&done, earlier)).await.unwrap();
        store.mark_dispatched(&done, &outbox).await.unwrap();
        clock.advance(TTL + Duration::from_secs(1));
        for pk in [&new, &taken, &done] {
            assert_eq!(
                store.commit_fast(fast(pk, result.clone())).await.unwrap(),
                FastCommitted::Committed,
                "{pk}"
            );
        }
        let item = |pk: String| {
            let (plain, dedup) = (plain.clone(), dedup.clone());
            async move {
                let mut item = plain
                    .get_item()
                    .table_name(dedup)
                    .key("pk", AttributeValue::S(pk))
                    .consistent_read(true)
                    .send()
                    .await
                    .unwrap()
                    .item
                    .expect("a record");
                // What differs by construction: the key, the owner, and
                // the attempts (the takeover's is the second).
                for a in ["pk", "owner", "attempts"] {
                    item.remove(a);
                }
                item
            }
        };
        let new_item = item(new.clone()).await;
        assert_eq!(new_item, item(taken.clone()).await, "result {i}, released");
        assert_eq!(new_item, item(done.clone()).await, "result {i}, completed");
        let record = store.get(&new).await.unwrap().unwrap();
        assert_eq!((record.status, record.attempts), (Status::Completed, 1));
        assert_eq!(store.get(&taken).await.unwrap().unwrap().attempts, 2);
        assert_eq!(store.get(&done).await.unwrap().unwrap().attempts, 2);
    }
}

/// A policy that refuses `PutItem` on the dedup table, as IAM refuses a
/// transaction with a `Put` item the role may not make: the request is
/// emptied before it is sent (LocalStack then writes nothing) and answered
/// `AccessDeniedException`. Counts the refused requests.
#[derive(Debug, Default)]
struct RefusePuts {
    refused: Arc<AtomicU32>,
    refusing: std::sync::atomic::AtomicBool,
}

impl Intercept for RefusePuts {
    fn name(&self) -> &'static str {
        "RefusePuts"
    }

    fn modify_before_transmit(
        &self,
        ctx: &mut BeforeTransmitInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let request = ctx.request_mut();
        let put = request
            .body()
            .bytes()
            .is_some_and(|b| String::from_utf8_lossy(b).contains("\"Put\":{"));
        self.refusing.store(put, Ordering::SeqCst);
        if put {
            self.refused.fetch_add(1, Ordering::SeqCst);
            *request.body_mut() = aws_smithy_types::body::SdkBody::from("{}");
            request.headers_mut().insert("content-length", "2");
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        ctx: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &RuntimeComponents,
        _cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        if self.refusing.swap(false, Ordering::SeqCst) {
            let response = ctx.response_mut();
            *response.status_mut() = 400.try_into().expect("a status");
            response
                .headers_mut()
                .insert("x-amzn-errortype", "AccessDeniedException");
            *response.body_mut() = aws_smithy_types::body::SdkBody::from(
                r#"{"__type":"com.amazon.coral.service#AccessDeniedException","message":"not authorized to perform: dynamodb:PutItem"}"#,
            );
        }
        Ok(())
    }
}

/// Where the table's policy predates the fast path's put (UpdateItem
/// granted, PutItem not), the commit falls back to the conditional update,
/// applies once, and stops trying the put for ten minutes (then tries it
/// again: a grant made meanwhile is taken up without a restart).
#[tokio::test]
async fn a_policy_without_put_item_falls_back_to_the_update_for_ten_minutes() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let refused = Arc::new(AtomicU32::new(0));
    let conf = aws_sdk_dynamodb::config::Builder::from(&crate::common::sdk_config().await)
        .interceptor(RefusePuts {
            refused: refused.clone(),
            ..RefusePuts::default()
        })
        .build();
    let clock = sqs_once::clock::ManualClock::starting_now();
    let store = DynamoStore::with_clock(
        aws_sdk_dynamodb::Client::from_conf(conf),
        dedup,
        Arc::new(clock.clone()),
    );
    for (i, pk) in ["c#no-put-1", "c#no-put-2", "c#no-put-3"]
        .into_iter()
        .enumerate()
    {
        if i == 2 {
            assert_eq!(refused.load(Ordering::SeqCst), 1, "the put tried once");
            clock.advance(Duration::from_secs(601));
        }
        let commit = FastCommit {
            pk: pk.into(),
            owner: uuid::Uuid::new_v4().to_string(),
            message_id: "m".into(),
            payload_sha256: "p".into(),
            fence: now_fence(),
            result: None,
            ttl: TTL,
            writes: vec![staged(add_to(&ledger, "acct", 10), FailureKind::Retry)],
            outbox: vec![],
        };
        assert_eq!(
            store.commit_fast(commit).await.unwrap(),
            FastCommitted::Committed,
            "{pk}"
        );
        let record = store.get(pk).await.unwrap().unwrap();
        assert_eq!((record.status, record.attempts), (Status::Completed, 1));
        assert_eq!(
            balance(&plain, &ledger, "acct").await,
            (10 * (i as i64 + 1), i as i64 + 1)
        );
    }
    assert_eq!(
        refused.load(Ordering::SeqCst),
        2,
        "tried again after ten minutes"
    );
}

/// A record whose `expires_at` another tool wrote as a fraction (long past)
/// is expired to DynamoDB's condition though not a whole number: the fast
/// path's put, finding it, leaves the decision to the conditional update,
/// which takes it over, rather than answering "duplicate" from a number it
/// could not read.
#[tokio::test]
async fn a_record_expired_in_a_fraction_of_a_second_is_taken_over() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let store = DynamoStore::new(plain.clone(), dedup.clone());
    plain
        .put_item()
        .table_name(&dedup)
        .item("pk", AttributeValue::S("c#fraction".into()))
        .item("status", AttributeValue::S("COMPLETED".into()))
        .item("owner", AttributeValue::S("someone-else".into()))
        .item("expires_at", AttributeValue::N("1000000000.5".into()))
        .send()
        .await
        .unwrap();
    let commit = FastCommit {
        pk: "c#fraction".into(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        fence: now_fence(),
        result: None,
        ttl: TTL,
        writes: vec![staged(add_to(&ledger, "acct", 7), FailureKind::Retry)],
        outbox: vec![],
    };
    assert_eq!(
        store.commit_fast(commit).await.unwrap(),
        FastCommitted::Committed
    );
    assert_eq!(
        balance(&plain, &ledger, "acct").await,
        (7, 1),
        "applied once"
    );
    let record = store.get("c#fraction").await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    assert!(record.expires_at_s > 1_000_000_000, "a new expiry");
}

#[tokio::test]
async fn fast_commit_with_a_failing_staged_condition_writes_nothing() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let store = DynamoStore::new(plain.clone(), dedup);
    let commit = FastCommit {
        pk: "c#fast-cond".into(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        fence: now_fence(),
        result: None,
        ttl: TTL,
        writes: vec![
            staged(add_to(&ledger, "acct", 5), FailureKind::Retry),
            staged(require_exists(&ledger, "nobody"), FailureKind::Permanent),
        ],
        outbox: vec![],
    };
    assert!(matches!(
        store.commit_fast(commit).await,
        Err(StoreError::WriteConditionFailed {
            index: 1,
            kind: FailureKind::Permanent
        })
    ));
    assert_eq!(store.get("c#fast-cond").await.unwrap(), None, "no record");
    assert_eq!(balance(&plain, &ledger, "acct").await, (0, 0), "no effect");
}

#[tokio::test]
async fn fast_path_transaction_over_the_limits_is_a_clear_error_and_writes_nothing() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let store = DynamoStore::new(plain.clone(), dedup);
    let writes = (0..100)
        .map(|i| staged(add_to(&ledger, &format!("acct-{i}"), 1), FailureKind::Retry))
        .collect();
    let commit = FastCommit {
        pk: "c#fast-big".into(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m".into(),
        payload_sha256: "p".into(),
        fence: now_fence(),
        result: None,
        ttl: TTL,
        writes,
        outbox: vec![],
    };
    let err = store.commit_fast(commit).await.unwrap_err();
    assert!(
        matches!(err, StoreError::TransactionTooLarge { items: 100, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("at most 99 items"), "{err}");
    assert_eq!(store.get("c#fast-big").await.unwrap(), None);
    assert_eq!(balance(&plain, &ledger, "acct-0").await, (0, 0));
}

#[tokio::test]
async fn table_checks_name_what_is_wrong() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let good = dedup_table(&client).await;
    DynamoStore::new(client.clone(), good)
        .check_table()
        .await
        .unwrap();

    let missing = DynamoStore::new(client.clone(), unique("absent"))
        .check_table()
        .await;
    assert!(
        matches!(missing, Err(TableCheckError::Missing(_))),
        "{missing:?}"
    );

    let no_ttl = business_table(&client).await;
    let err = DynamoStore::new(client.clone(), no_ttl.clone())
        .check_table()
        .await
        .unwrap_err();
    assert!(matches!(err, TableCheckError::Ttl { .. }), "{err:?}");
    assert!(
        err.to_string().contains("expires_at") && err.to_string().contains(&no_ttl),
        "{err}"
    );

    let wrong = unique("wrong-schema");
    client
        .create_table()
        .table_name(&wrong)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("id")
                .attribute_type(ScalarAttributeType::N)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("id")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let err = DynamoStore::new(client.clone(), wrong)
        .check_table()
        .await
        .unwrap_err();
    assert!(matches!(err, TableCheckError::KeySchema { .. }), "{err:?}");
    assert!(
        err.to_string().contains("id:HASH") && err.to_string().contains("SQS_ONCE_TABLE"),
        "{err}"
    );
}

/// Regression guard for the emulator: a threaded DynamoDB stand-in loses
/// concurrent updates, which would make every concurrency test meaningless.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn emulator_applies_every_concurrent_update_to_one_item() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let table = business_table(&client).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let (client, table) = (client.clone(), table.clone());
        tasks.spawn(async move {
            client
                .update_item()
                .table_name(table)
                .key("pk", AttributeValue::S("hot".into()))
                .update_expression("ADD applied_events :one")
                .expression_attribute_values(":one", AttributeValue::N("1".into()))
                .send()
                .await
                .unwrap();
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    assert_eq!(balance(&client, &table, "hot").await.1, 50);
}

/// The ledger effect: a deliberately non-idempotent ADD staged into the
/// completing transaction.
struct Ledger {
    table: String,
}

#[derive(serde::Deserialize)]
struct Event {
    account: String,
    amount_cents: i64,
}

impl Handler for Ledger {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        let e: Event = message.json().map_err(HandlerError::permanent)?;
        if e.account == "frozen" {
            ctx.stage_with(
                require_exists(&self.table, "no-such-account"),
                FailureKind::Permanent,
            );
        }
        ctx.stage(add_to(&self.table, &e.account, e.amount_cents));
        Ok(None)
    }
}

/// A processor keyed on the body's `id` around [`Ledger`], and its ledger table.
async fn ledger_processor(
    client: &aws_sdk_dynamodb::Client,
) -> (Processor<DynamoStore, Ledger>, String) {
    let (dedup, ledger) = (dedup_table(client).await, business_table(client).await);
    let mut config = ProcessorConfig::new("ledger");
    config.key_source = "json:/id".parse().unwrap();
    let handler = Ledger {
        table: ledger.clone(),
    };
    let store = DynamoStore::new(client.clone(), dedup);
    (Processor::new(store, handler, config).unwrap(), ledger)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processor_applies_each_event_once_across_concurrent_duplicates() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (processor, ledger) = ledger_processor(&client).await;

    // 20 events for 4 accounts, each delivered 3 times (a redelivery and a
    // producer re-send with a new message id), all at once.
    let mut expected: HashMap<String, (i64, i64)> = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..20 {
        let account = format!("acct-{}", i % 4);
        let amount = 100 + i;
        let e = expected.entry(account.clone()).or_default();
        e.0 += amount;
        e.1 += 1;
        let body = serde_json::json!({"id": format!("evt-{i}"), "account": account, "amount_cents": amount}).to_string();
        for copy in 0..3 {
            let (p, body) = (processor.clone(), body.clone());
            let mid = if copy == 2 {
                format!("m{i}-resend")
            } else {
                format!("m{i}")
            };
            tasks.spawn(async move { p.process(Message::new(mid, body)).await });
        }
    }
    let mut outcomes: HashMap<&'static str, u32> = HashMap::new();
    while let Some(o) = tasks.join_next().await {
        *outcomes.entry(o.unwrap().name()).or_default() += 1;
    }
    assert_eq!(outcomes.get("completed"), Some(&20), "{outcomes:?}");
    assert_eq!(outcomes.values().sum::<u32>(), 60, "{outcomes:?}");
    for (account, want) in &expected {
        assert_eq!(balance(&client, &ledger, account).await, *want, "{account}");
    }

    // Retrying every in-flight one later still applies nothing twice.
    for i in 0..20 {
        let body = serde_json::json!({"id": format!("evt-{i}"), "account": "x", "amount_cents": 1})
            .to_string();
        let o = processor
            .process(Message::new(format!("late-{i}"), body))
            .await;
        assert!(
            matches!(
                o,
                Outcome::Duplicate {
                    payload_matches: false,
                    ..
                }
            ),
            "{o:?}"
        );
    }
    assert_eq!(balance(&client, &ledger, "x").await, (0, 0));
}

#[tokio::test]
async fn a_business_condition_failure_parks_the_message_and_writes_nothing() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (processor, ledger) = ledger_processor(&client).await;
    let body = r#"{"id":"evt-frozen","account":"frozen","amount_cents":5}"#;
    let o = processor.process(Message::new("m", body)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("condition")),
        "{o:?}"
    );
    assert_eq!(balance(&client, &ledger, "frozen").await, (0, 0));
    let rec = processor
        .store()
        .get("ledger#evt-frozen")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.status, Status::Failed);

    // A malformed body is parked with the parser's reason and claims nothing twice.
    let o = processor
        .process(Message::new("m2", r#"{"id":"evt-bad","account":7}"#))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("invalid type")),
        "{o:?}"
    );
}

#[tokio::test]
async fn dynamodb_unavailable_means_no_handler_runs() {
    if !crate::common::localstack_up().await {
        return;
    }
    // Nothing listens on port 9: every call fails to connect.
    let conf = aws_sdk_dynamodb::config::Builder::from(&crate::common::sdk_config().await)
        .endpoint_url("http://127.0.0.1:9")
        .build();
    let store = DynamoStore::new(aws_sdk_dynamodb::Client::from_conf(conf), "t");
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r = ran.clone();
    let processor = Processor::new(
        store,
        sqs_once::handler_fn(move |_m, _c| {
            let r = r.clone();
            async move {
                r.store(true, Ordering::SeqCst);
                Ok(None)
            }
        }),
        ProcessorConfig::new("c"),
    )
    .unwrap();
    let o = processor.process(Message::new("m", "b")).await;
    assert!(
        matches!(&o, Outcome::Retry { reason, .. } if reason.contains("claim failed")),
        "{o:?}"
    );
    assert!(!ran.load(Ordering::SeqCst));
}

/// A handler that stages one ledger write and returns a result of `size` bytes
/// (as JSON text), on the fast path or the general one.
async fn results_round_trip(fast: bool) {
    let plain = ddb().await;
    let (dedup, ledger) = (dedup_table(&plain).await, business_table(&plain).await);
    let table = ledger.clone();
    let handler = sqs_once::handler_fn(move |m: Message, ctx: Context| {
        let table = table.clone();
        async move {
            let size: usize = m.body().parse().unwrap();
            assert_eq!(ctx.max_result_bytes(), 64, "the handler knows the bound");
            ctx.stage(add_to(&table, "acct", 1));
            // A JSON string of `size` bytes including its quotes.
            Ok(Some(serde_json::Value::String("x".repeat(size - 2))))
        }
    });
    let mut config = ProcessorConfig::new("results");
    config.max_result_bytes = 64;
    config.fast_path = fast;
    let store = DynamoStore::new(plain.clone(), dedup);
    let p = Processor::new(store, sqs_once::staged_only(handler), config).unwrap();

    let small = serde_json::Value::String("x".repeat(38));
    let first = p.process(Message::new("m-small", "40")).await;
    assert_eq!(
        first,
        Outcome::Completed {
            result: Some(StoredResult::Value(small.clone()))
        }
    );
    let again = p.process(Message::new("m-small", "40")).await;
    assert_eq!(
        again,
        Outcome::Duplicate {
            result: Some(StoredResult::Value(small)),
            payload_matches: true
        },
        "a redelivery gets the stored result"
    );

    let big = p.process(Message::new("m-big", "1000")).await;
    let Outcome::Completed {
        result: Some(StoredResult::Digest { sha256, bytes }),
    } = big
    else {
        panic!("over the bound: stored as a digest, not failed: {big:?}");
    };
    assert_eq!(bytes, 1000);
    let expected = sqs_once::key::sha256_hex(format!("\"{}\"", "x".repeat(998)).as_bytes());
    assert_eq!(sha256, expected);
    assert_eq!(
        p.process(Message::new("m-big", "1000")).await,
        Outcome::Duplicate {
            result: Some(StoredResult::Digest { sha256, bytes }),
            payload_matches: true
        }
    );
    assert_eq!(
        balance(&plain, &ledger, "acct").await,
        (2, 2),
        "each effect once"
    );
}

#[tokio::test]
async fn results_are_stored_and_returned_to_duplicates_on_the_fast_path() {
    if !crate::common::localstack_up().await {
        return;
    }
    results_round_trip(true).await;
}

#[tokio::test]
async fn results_are_stored_and_returned_to_duplicates_on_the_general_path() {
    if !crate::common::localstack_up().await {
        return;
    }
    results_round_trip(false).await;
}
