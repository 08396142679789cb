//! The real `DynamoStore` and SDK client against the model, over the wire.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
use sqs_once::clock::{Clock, TokioClock};
use sqs_once::store::{ClaimRequest, Completion};
use sqs_once::{Claim, DedupStore, DynamoStore, StagedWrite, Status, StoreError};

use super::dynamodb::Stamp;
use super::*;

fn setup() -> (DynamoModel, DynamoStore, aws_sdk_dynamodb::Client) {
    let model = dynamo_model();
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let wire = Wire::new(Service::Dynamo(model.clone()), None, Life::default());
    let client = dynamodb_client(wire, clock.clone());
    let store = DynamoStore::with_clock(client.clone(), TABLE, clock);
    (model, store, client)
}

fn claim_request(owner: &str, message: &str) -> ClaimRequest {
    ClaimRequest {
        pk: "sim#e1".into(),
        owner: owner.into(),
        message_id: message.into(),
        payload_sha256: "p".into(),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
    }
}

fn row(event: &str, message: &str) -> StagedWrite {
    let put = Put::builder()
        .table_name(LEDGER)
        .item("pk", AttributeValue::S(event.into()))
        .item("message", AttributeValue::S(message.into()))
        .condition_expression("attribute_not_exists(pk)")
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    StagedWrite {
        item: TransactWriteItem::builder().put(put).build(),
        on_condition_failed: sqs_once::FailureKind::Permanent,
    }
}

fn completion(owner: &str, writes: Vec<StagedWrite>) -> Completion {
    Completion {
        pk: "sim#e1".into(),
        owner: owner.into(),
        result: None,
        writes,
        outbox: vec![],
        ttl: Duration::from_secs(3600),
    }
}

#[tokio::test(start_paused = true)]
async fn the_table_check_passes_on_the_models_table_and_fails_on_a_missing_one() {
    let (model, store, client) = setup();
    store.check_table().await.unwrap();
    let missing = DynamoStore::new(client, "nope");
    let err = missing.check_table().await.unwrap_err();
    assert!(
        matches!(err, sqs_once::aws::dynamodb::TableCheckError::Missing(_)),
        "{err}"
    );
    assert_eq!(model.applied(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_claim_is_exclusive_until_completed_and_then_a_duplicate() {
    let (model, store, _) = setup();
    let first = store.claim(&claim_request("a", "m1")).await.unwrap();
    assert!(
        matches!(first, Claim::Acquired { attempt: 1, .. }),
        "{first:?}"
    );
    let second = store.claim(&claim_request("b", "m2")).await.unwrap();
    assert!(matches!(second, Claim::InFlight { .. }), "{second:?}");
    store
        .complete(completion("a", vec![row("e1", "m1")]))
        .await
        .unwrap();
    let third = store.claim(&claim_request("c", "m3")).await.unwrap();
    assert!(matches!(third, Claim::Duplicate { .. }), "{third:?}");
    let record = store.get("sim#e1").await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    assert_eq!(model.committed().len(), 1);
    assert!(model.fencing_breaches().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_completion_after_losing_the_lease_is_refused_and_writes_nothing() {
    let (model, store, _) = setup();
    store.claim(&claim_request("a", "m1")).await.unwrap();
    tokio::time::advance(Duration::from_secs(31)).await;
    let taken = store.claim(&claim_request("b", "m2")).await.unwrap();
    assert!(
        matches!(taken, Claim::Acquired { attempt: 2, .. }),
        "{taken:?}"
    );
    let late = store.complete(completion("a", vec![row("e1", "m1")])).await;
    assert!(
        matches!(late, Err(StoreError::LeaseLost { .. })),
        "{late:?}"
    );
    assert!(model.committed().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_staged_writes_own_failed_condition_is_reported_with_its_index() {
    let (model, store, _) = setup();
    store.claim(&claim_request("a", "m1")).await.unwrap();
    // The ledger row exists already: the staged put's own condition fails.
    store
        .commit_unprotected(vec![row("e1", "m0")])
        .await
        .unwrap();
    let out = store.complete(completion("a", vec![row("e1", "m1")])).await;
    assert!(
        matches!(out, Err(StoreError::WriteConditionFailed { index: 0, .. })),
        "{out:?}"
    );
    assert_eq!(model.committed().len(), 1);
    let record = store.get("sim#e1").await.unwrap().unwrap();
    assert_eq!(record.status, Status::InProgress);
}

fn transaction(token: &str, message: &str) -> serde_json::Value {
    serde_json::json!({
        "ClientRequestToken": token,
        "TransactItems": [{ "Put": { "TableName": LEDGER, "Item": {
            "pk": { "S": "e9" }, "message": { "S": message } } } }],
    })
}

#[tokio::test(start_paused = true)]
async fn a_token_answers_a_resend_without_applying_and_refuses_another_request() {
    let model = dynamo_model();
    let first = model.handle("TransactWriteItems", &transaction("t1", "m1"));
    assert_eq!(first.status, 200);
    let again = model.handle("TransactWriteItems", &transaction("t1", "m1"));
    assert_eq!(again, first);
    assert_eq!(model.applied(), 1);
    assert_eq!(model.committed().len(), 1);
    let other = model.handle("TransactWriteItems", &transaction("t1", "m2"));
    assert_eq!(other.status, 400);
    assert!(
        other.body["__type"]
            .as_str()
            .unwrap()
            .ends_with("#IdempotentParameterMismatchException")
    );
    // Ten minutes on, the token is forgotten: the same request applies again.
    tokio::time::advance(dynamodb::TOKEN_WINDOW).await;
    let later = model.handle("TransactWriteItems", &transaction("t1", "m2"));
    assert_eq!(later.status, 200);
    assert_eq!(model.applied(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_held_token_answers_in_progress_until_applied() {
    let model = dynamo_model();
    let t = transaction("t2", "m1");
    assert!(model.hold("TransactWriteItems", &t).is_none());
    let busy = model.hold("TransactWriteItems", &t).unwrap();
    assert!(
        busy.body["__type"]
            .as_str()
            .unwrap()
            .ends_with("#TransactionInProgressException")
    );
    assert_eq!(model.handle("TransactWriteItems", &t).status, 200);
    assert!(model.hold("TransactWriteItems", &t).is_none());
    assert_eq!(model.handle("TransactWriteItems", &t).status, 200);
    assert_eq!(model.applied(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_sdk_reads_the_models_errors_as_their_documented_types() {
    let (_, store, client) = setup();
    store.claim(&claim_request("a", "m1")).await.unwrap();
    let err = client
        .update_item()
        .table_name(TABLE)
        .key("pk", AttributeValue::S("sim#e1".into()))
        .update_expression("SET x = :v")
        .condition_expression("attribute_not_exists(pk)")
        .expression_attribute_values(":v", AttributeValue::N("1".into()))
        .return_values_on_condition_check_failure(
            aws_sdk_dynamodb::types::ReturnValuesOnConditionCheckFailure::AllOld,
        )
        .send()
        .await
        .unwrap_err();
    let service = err.into_service_error();
    let aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException(
        c,
    ) = service
    else {
        panic!("{service:?}");
    };
    assert_eq!(
        c.item()
            .and_then(|i| i.get("owner"))
            .and_then(|o| o.as_s().ok())
            .map(String::as_str),
        Some("a")
    );
    let err = client
        .update_item()
        .table_name(TABLE)
        .key("pk", AttributeValue::S("sim#e1".into()))
        .update_expression("SET status = :v")
        .expression_attribute_values(":v", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap_err();
    assert!(
        aws_sdk_dynamodb::error::ProvideErrorMetadata::code(&err) == Some("ValidationException"),
        "{err:?}"
    );
}

/// A store on `model` whose first DynamoDB requests meet `faults`.
fn scripted(model: &DynamoModel, faults: Vec<WireFault>) -> DynamoStore {
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let wire =
        Wire::new(Service::Dynamo(model.clone()), None, Life::default()).scripted_dynamo(faults);
    DynamoStore::with_clock(dynamodb_client(wire, clock.clone()), TABLE, clock)
}

#[tokio::test(start_paused = true)]
async fn a_claim_refused_for_contention_on_every_attempt_is_busy_and_writes_nothing() {
    // Enough refusals for every attempt of the SDK's (3 each) and the
    // store's (4). (A claim is one `UpdateItem`:
    // `TransactionConflictException`.)
    let model = dynamo_model();
    let err = scripted(&model, vec![WireFault::Conflict; 16])
        .claim(&claim_request("a", "m1"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Busy(_)), "{err:?}");
    // Nothing was written: another owner's claim is the first.
    let claim = scripted(&model, vec![])
        .claim(&claim_request("b", "m1"))
        .await
        .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { attempt: 1, .. }),
        "{claim:?}"
    );
    // A completion cancelled by conflicts on every attempt: busy, and the
    // claim still open (nothing of the transaction written).
    let model = dynamo_model();
    scripted(&model, vec![])
        .claim(&claim_request("a", "m1"))
        .await
        .unwrap();
    let err = scripted(&model, vec![WireFault::Conflict; 16])
        .complete(completion("a", vec![row("e1", "m1")]))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Busy(_)), "{err:?}");
    scripted(&model, vec![])
        .complete(completion("a", vec![row("e1", "m1")]))
        .await
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn throttling_or_conflicts_mixed_with_internal_errors_are_unavailable_not_busy() {
    // Throttled on every attempt: a table or account at its limit, the
    // outage backoff.
    for fault in [WireFault::Throttled, WireFault::Provisioned] {
        let err = scripted(&dynamo_model(), vec![fault; 16])
            .claim(&claim_request("a", "m1"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::Unavailable(_)),
            "{fault:?}: {err:?}"
        );
    }
    // 500s among the conflicts: the service may be failing (and may have
    // applied), so the outage backoff applies.
    let mut faults = vec![WireFault::Conflict; 16];
    for f in faults.iter_mut().skip(1).take(3) {
        *f = WireFault::InternalBefore;
    }
    let err = scripted(&dynamo_model(), faults)
        .claim(&claim_request("a", "m1"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn a_claim_refused_for_contention_then_let_through_acquires() {
    let claim = scripted(
        &dynamo_model(),
        vec![WireFault::Conflict, WireFault::Throttled],
    )
    .claim(&claim_request("a", "m1"))
    .await
    .unwrap();
    assert!(
        matches!(claim, Claim::Acquired { attempt: 1, .. }),
        "{claim:?}"
    );
}

mod sqs {
    use std::sync::Arc;
    use std::time::Duration;

    use sqs_once::MemoryQueue;
    use sqs_once::queue::{OutgoingMessage, QueueClient, ReceiveRequest};
    use sqs_once::testkit::queue::QueueSettings;

    use crate::deliveries::Deliveries;
    use crate::faults::Life;
    use crate::wire::sqs::SqsModel;
    use crate::wire::{Service, SqsFault, Wire, sqs_client};

    fn setup() -> (MemoryQueue, aws_sdk_sqs::Client, String) {
        let (queue, client, url, _) = faulty([]);
        (queue, client, url)
    }

    /// A client whose first requests meet `faults` (30 s attempts), to a
    /// fresh queue whose model the returned deliveries watch.
    fn faulty(
        faults: impl IntoIterator<Item = SqsFault>,
    ) -> (MemoryQueue, aws_sdk_sqs::Client, String, Deliveries) {
        let queue = MemoryQueue::new();
        let url = queue
            .create_queue(QueueSettings::new("q"))
            .unwrap_or_else(|e| panic!("{e}"));
        let deliveries = Deliveries::default();
        let client = client_to(&queue, &deliveries, faults);
        (queue, client, url, deliveries)
    }

    /// A client to `queue` whose first requests meet `faults`.
    fn client_to(
        queue: &MemoryQueue,
        deliveries: &Deliveries,
        faults: impl IntoIterator<Item = SqsFault>,
    ) -> aws_sdk_sqs::Client {
        let model = SqsModel::new(queue.clone()).watched(deliveries.clone());
        let attempt = Duration::from_secs(30);
        let wire = Wire::new(Service::Sqs(model), None, Life::default())
            .giving_up_after(attempt)
            .scripted(faults);
        let clock = Arc::new(sqs_once::clock::TokioClock::starting_at(
            crate::hosts::epoch(),
        ));
        sqs_client(wire, clock, attempt)
    }

    fn message(body: &str) -> OutgoingMessage {
        OutgoingMessage {
            body: body.into(),
            ..Default::default()
        }
    }

    fn request() -> ReceiveRequest {
        ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(30),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_adapter_reads_the_models_refusals_with_their_sqs_codes() {
        let (_, client, url) = setup();
        let body = OutgoingMessage {
            body: "b".into(),
            ..Default::default()
        };
        client.send(&url, body).await.unwrap();
        let got = client.receive(&url, request()).await.unwrap();
        let receipt = got[0].receipt_handle().unwrap().to_owned();
        let bad = client.delete(&url, "nonsense").await.unwrap_err();
        assert!(bad.detail.starts_with("ReceiptHandleIsInvalid"), "{bad}");
        assert!(!bad.is_transient());
        assert!(bad.is_receipt_refused(), "{bad}");
        client
            .change_visibility(&url, &receipt, Duration::ZERO)
            .await
            .unwrap();
        let visible = client
            .change_visibility(&url, &receipt, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(visible.detail.contains("MessageNotInflight"), "{visible}");
        assert!(visible.is_receipt_refused(), "{visible}");
        let again = client.receive(&url, request()).await.unwrap();
        let fresh = again[0].receipt_handle().unwrap().to_owned();
        let failed = client
            .delete_batch(&url, &[fresh, "nonsense".into()])
            .await
            .unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(
            (failed[0].index, failed[0].code.as_str()),
            (1, "ReceiptHandleIsInvalid")
        );
        let gone = client.receive(&url, request()).await.unwrap();
        assert!(gone.is_empty(), "the batch's good entry deleted: {gone:?}");
        let missing = client.attributes(&format!("{url}-nope")).await.unwrap_err();
        assert!(missing.detail.contains("NonExistentQueue"), "{missing}");
        assert!(!missing.is_transient());
    }

    #[tokio::test(start_paused = true)]
    async fn a_receive_whose_answer_is_lost_leaves_its_message_invisible_with_its_count_spent() {
        let (queue, client, url, _) = faulty([SqsFault::ResetAfter]);
        queue.send(&url, message("b")).await.unwrap();
        // The first attempt took the message; the SDK's retry finds none.
        let got = client.receive(&url, request()).await.unwrap();
        assert!(got.is_empty(), "{got:?}");
        let counts = queue.counts(&url).unwrap();
        assert_eq!((counts.in_flight, counts.received), (1, 1));
        tokio::time::advance(Duration::from_secs(31)).await;
        let again = client.receive(&url, request()).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].receive_count(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn throttling_and_internal_failures_are_retried_and_transient_when_they_last() {
        let throttled = [
            SqsFault::Throttled("RequestThrottled"),
            SqsFault::InternalBefore,
            SqsFault::Throttled("ThrottlingException"),
        ];
        let (queue, client, url, _) = faulty(throttled);
        let err = client.send(&url, message("b")).await.unwrap_err();
        assert!(err.is_transient(), "{err}");
        assert!(err.detail.starts_with("ThrottlingException"), "{err}");
        assert_eq!(queue.counts(&url).unwrap().enqueued, 0);
        // Two failures then an answer: the SDK's third attempt sends it.
        let (queue, client, url, _) = faulty([
            SqsFault::Throttled("RequestThrottled"),
            SqsFault::ResetBefore,
        ]);
        client.send(&url, message("b")).await.unwrap();
        assert_eq!(queue.counts(&url).unwrap().enqueued, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_whose_500_came_after_applying_is_sent_again() {
        let (queue, client, url, _) = faulty([SqsFault::InternalAfter]);
        client.send(&url, message("b")).await.unwrap();
        assert_eq!(queue.counts(&url).unwrap().enqueued, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn batch_entries_that_fail_alone_are_reported_by_place_and_the_others_applied() {
        let (queue, client, url, deliveries) = faulty([]);
        for b in ["a", "b", "c"] {
            queue.send(&url, message(b)).await.unwrap();
        }
        let got = client.receive(&url, request()).await.unwrap();
        let receipts: Vec<String> = got
            .iter()
            .map(|m| m.receipt_handle().unwrap().to_owned())
            .collect();
        let host = ("c0", &Life::default(), &Default::default());
        deliveries.received(host, &url, &got, Duration::from_secs(30));
        let failing = client_to(&queue, &deliveries, [SqsFault::EntriesFailed(vec![1])]);
        let failed = failing.delete_batch(&url, &receipts).await.unwrap();
        assert_eq!(failed.len(), 1);
        assert_eq!(
            (failed[0].index, failed[0].code.as_str()),
            (1, "InternalError")
        );
        let counts = queue.counts(&url).unwrap();
        assert_eq!((counts.deleted, counts.in_flight), (2, 1));
        // The model noted the deletes it applied, and only those.
        let reached: Vec<bool> = got
            .iter()
            .map(|m| deliveries.last_of(m.id()).unwrap().delete_reached)
            .collect();
        assert_eq!(reached, [true, false, true]);
        let sending = client_to(&queue, &deliveries, [SqsFault::EntriesFailed(vec![0, 2])]);
        let batch = vec![message("d"), message("e"), message("f")];
        let failed = sending.send_batch(&url, batch).await.unwrap();
        let places: Vec<usize> = failed.iter().map(|f| f.index).collect();
        assert_eq!(places, [0, 2]);
        assert_eq!(queue.counts(&url).unwrap().enqueued, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_delete_the_client_gave_up_on_lands_after_its_attempts_timed_out() {
        let late = [
            SqsFault::Late(Duration::from_secs(100)),
            SqsFault::Silent { applied: false },
            SqsFault::Silent { applied: false },
        ];
        let (queue, client, url, _) = faulty(late);
        queue.send(&url, message("b")).await.unwrap();
        let got = queue.receive(&url, request()).await.unwrap();
        let receipt = got[0].receipt_handle().unwrap();
        let started = tokio::time::Instant::now();
        let err = client.delete(&url, receipt).await.unwrap_err();
        assert!(err.is_transient(), "{err}");
        // Three attempts of `CALL_ATTEMPT` each, and the SDK's pauses between them.
        let attempt = sqs_once::aws::sqs::CALL_ATTEMPT;
        let given_up = started.elapsed();
        assert!(given_up >= attempt * 3, "{given_up:?}");
        assert_eq!(queue.counts(&url).unwrap().deleted, 0);
        tokio::time::sleep_until(started + attempt + Duration::from_secs(101)).await;
        assert_eq!(queue.counts(&url).unwrap().deleted, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_other_than_a_receive_gives_an_attempt_no_longer_than_call_attempt() {
        let silent = [SqsFault::Silent { applied: false }];
        let (queue, client, url, _) = faulty(silent.clone());
        queue.send(&url, message("b")).await.unwrap();
        let got = queue.receive(&url, request()).await.unwrap();
        let started = tokio::time::Instant::now();
        // The client's attempts may last 30 s (a long poll's); a delete's
        // silent attempt is given up after `CALL_ATTEMPT`, and the retry
        // deletes.
        client
            .delete(&url, got[0].receipt_handle().unwrap())
            .await
            .unwrap();
        let attempt = sqs_once::aws::sqs::CALL_ATTEMPT;
        assert!(started.elapsed() >= attempt, "{:?}", started.elapsed());
        assert!(started.elapsed() < attempt * 2, "{:?}", started.elapsed());
        assert_eq!(queue.counts(&url).unwrap().deleted, 1);
        // A receive keeps the client's: a long poll may wait 20 s.
        let (_, client, url, _) = faulty(silent);
        let started = tokio::time::Instant::now();
        let got = client.receive(&url, request()).await.unwrap();
        assert!(got.is_empty(), "{got:?}");
        assert!(
            started.elapsed() >= Duration::from_secs(30),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_poll_on_an_empty_queue_answers_empty_after_its_wait() {
        let (_, client, url) = setup();
        let started = tokio::time::Instant::now();
        let poll = ReceiveRequest {
            wait: Duration::from_secs(20),
            ..request()
        };
        // The connector reads the request's body as an HTTP client sends it,
        // so the SDK's upload stall check does not cut a long wait short.
        let got = client.receive(&url, poll).await.unwrap();
        assert!(got.is_empty(), "{got:?}");
        assert_eq!(started.elapsed(), Duration::from_secs(20));
    }
}

fn s3_setup() -> (s3::S3Model, aws_sdk_s3::Client) {
    let model = s3::S3Model::with_bucket("sim-payloads");
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let wire = Wire::new(Service::S3(model.clone()), None, Life::default());
    (model, s3_client(wire, clock))
}

fn pointer(bucket: &str, key: &str) -> sqs_once::payloads::S3Pointer {
    sqs_once::payloads::S3Pointer {
        bucket: bucket.into(),
        key: key.into(),
    }
}

#[tokio::test(start_paused = true)]
async fn the_s3_client_reads_and_deletes_objects_of_the_model_and_names_a_missing_one_not_found() {
    use sqs_once::payloads::{PayloadErrorKind, PayloadStore};
    let (model, client) = s3_setup();
    model.put(
        "sim-payloads",
        "payloads/evt-0001/0",
        "{\"id\":\"evt-0001\"}",
    );
    let object = pointer("sim-payloads", "payloads/evt-0001/0");
    let bytes = client
        .get(&object, 1024)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(bytes, b"{\"id\":\"evt-0001\"}");
    let small = client.get(&object, 4).await.map(|_| ()).unwrap_err();
    assert_eq!(small.kind, PayloadErrorKind::TooLarge, "{small}");
    client
        .delete(&object)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!model.contains("sim-payloads", "payloads/evt-0001/0"));
    assert_eq!(model.deletes().len(), 1);
    // S3 answers a delete of a missing key with 204 too.
    client
        .delete(&object)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let gone = client.get(&object, 1024).await.map(|_| ()).unwrap_err();
    assert_eq!(gone.kind, PayloadErrorKind::NotFound, "{gone}");
    assert!(gone.detail.contains("NoSuchKey"), "{gone}");
    let no_bucket = client
        .get(&pointer("elsewhere", "k"), 1024)
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(no_bucket.kind, PayloadErrorKind::NotFound, "{no_bucket}");
}

#[test]
fn an_s3_request_names_its_bucket_and_key_virtual_hosted_or_path_style() {
    assert_eq!(
        s3::bucket_and_key(
            "b.wire.sim",
            "/payloads/e%2F1/0?x-id=GetObject",
            ENDPOINT_HOST
        ),
        Some(("b".into(), "payloads/e/1/0".into()))
    );
    assert_eq!(
        s3::bucket_and_key("wire.sim", "/b/payloads/e1/0", ENDPOINT_HOST),
        Some(("b".into(), "payloads/e1/0".into()))
    );
}

#[tokio::test(start_paused = true)]
async fn an_object_whose_body_is_cut_half_way_is_a_transient_failure_and_reads_whole_next_time() {
    use sqs_once::payloads::{PayloadErrorKind, PayloadStore};
    let model = s3::S3Model::with_bucket("sim-payloads");
    model.put("sim-payloads", "payloads/evt-0002/0", vec![b'x'; 4096]);
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let wire = Wire::new(Service::S3(model.clone()), None, Life::default())
        .scripted_s3([WireFault::ResetAfter]);
    let client = s3_client(wire, clock);
    let object = pointer("sim-payloads", "payloads/evt-0002/0");
    let cut = client.get(&object, 1 << 20).await.map(|_| ()).unwrap_err();
    assert_eq!(cut.kind, PayloadErrorKind::Transient, "{cut}");
    assert!(cut.detail.contains("reading the object failed"), "{cut}");
    let whole = client
        .get(&object, 1 << 20)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(whole.len(), 4096);
    assert_eq!(model.gets(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_receive_past_the_in_flight_quota_is_refused_with_over_limit() {
    use sqs_once::MemoryQueue;
    use sqs_once::queue::{OutgoingMessage, QueueClient, ReceiveRequest};
    use sqs_once::testkit::queue::{QueueSettings, SendOptions};
    let queue = MemoryQueue::new();
    let mut settings = QueueSettings::new("quota");
    settings.max_in_flight = 1;
    let url = queue
        .create_queue(settings)
        .unwrap_or_else(|e| panic!("{e}"));
    for body in ["a", "b"] {
        let m = OutgoingMessage {
            body: body.into(),
            ..Default::default()
        };
        queue
            .send_with(&url, m, SendOptions::default())
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
    let wire = Wire::new(
        Service::Sqs(crate::wire::sqs::SqsModel::new(queue)),
        None,
        Life::default(),
    );
    let client = sqs_client(wire, clock, Duration::from_secs(30));
    let request = || ReceiveRequest {
        max: 1,
        wait: Duration::ZERO,
        visibility: Duration::from_secs(30),
    };
    let first = client.receive(&url, request()).await;
    assert_eq!(first.map(|m| m.len()).unwrap_or_else(|e| panic!("{e}")), 1);
    let refused = client
        .receive(&url, request())
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(refused.detail.contains("OverLimit"), "{refused}");
    assert!(!refused.is_transient(), "{refused}");
}

#[tokio::test(start_paused = true)]
async fn the_s3_client_puts_an_object_the_model_stores_and_reads_back() {
    use sqs_once::payloads::PayloadStore;
    let (model, client) = s3_setup();
    let object = pointer("sim-payloads", "outbox/7b1c");
    let body: Vec<u8> = (0..300 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
    client
        .put(&object, body.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // What the SDK sends for a body in memory: the body whole, its CRC32 in
    // a header (no aws-chunked encoding).
    let headers = model.last_put_headers().unwrap_or_default();
    assert_eq!(
        headers.get("x-amz-checksum-crc32").map(String::as_str),
        s3::checksum("x-amz-checksum-crc32", &body).as_deref(),
        "{headers:#?}"
    );
    assert_eq!(headers.get("content-encoding"), None, "{headers:#?}");
    assert_eq!(
        model.object("sim-payloads", "outbox/7b1c"),
        Some(body.clone())
    );
    let back = client
        .get(&object, 1 << 20)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back, body);
    let raw = client
        .put_object()
        .bucket("sim-payloads")
        .key("outbox/raw")
        .body(b"x".to_vec().into())
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(raw.e_tag().is_some_and(|t| t.len() == 34), "{raw:?}");
    let elsewhere = client
        .put(&pointer("elsewhere", "k"), b"x".to_vec())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(
        elsewhere.kind,
        sqs_once::payloads::PayloadErrorKind::NotFound,
        "{elsewhere}"
    );
    assert!(elsewhere.detail.contains("NoSuchBucket"), "{elsewhere}");
}

/// A streaming body goes `aws-chunked`, its CRC32 in a trailer: the model
/// decodes it and verifies the trailer.
#[tokio::test(start_paused = true)]
async fn the_s3_client_puts_a_streaming_body_aws_chunked_with_its_checksum_in_a_trailer() {
    let (model, client) = s3_setup();
    let data: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
    let frames = futures::stream::iter(
        data.chunks(16 * 1024)
            .map(|c| {
                Ok::<_, std::io::Error>(http_body::Frame::data(bytes::Bytes::copy_from_slice(c)))
            })
            .collect::<Vec<_>>(),
    );
    let stream = http_body_util::StreamBody::new(frames);
    let body = aws_smithy_types::body::SdkBody::from_body_1_x(stream);
    let body = aws_sdk_s3::primitives::ByteStream::new(body);
    client
        .put_object()
        .bucket("sim-payloads")
        .key("outbox/streamed")
        .content_length(data.len() as i64)
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("{e:?}"));
    let headers = model.last_put_headers().unwrap_or_default();
    assert!(
        headers
            .get("content-encoding")
            .is_some_and(|e| e.contains("aws-chunked")),
        "{headers:#?}"
    );
    assert_eq!(
        headers.get("x-amz-trailer").map(String::as_str),
        Some("x-amz-checksum-crc32"),
        "{headers:#?}"
    );
    assert_eq!(model.object("sim-payloads", "outbox/streamed"), Some(data));
}

#[test]
fn a_put_whose_checksum_or_length_does_not_match_is_refused_as_s3_refuses_it() {
    let model = s3::S3Model::with_bucket("b");
    let headers = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    let put = |h: &[(&str, &str)], body: &[u8]| {
        model.handle_with(
            "PUT",
            "b",
            "k",
            &s3::S3Content {
                headers: headers(h),
                body: body.to_vec(),
            },
        )
    };
    let code = |a: &s3::S3Answer| {
        let text = String::from_utf8_lossy(&a.body).into_owned();
        (a.status, text)
    };
    let crc = s3::checksum("x-amz-checksum-crc32", b"hello").unwrap_or_default();
    assert_eq!(put(&[("x-amz-checksum-crc32", &crc)], b"hello").status, 200);
    let (status, text) = code(&put(&[("x-amz-checksum-crc32", &crc)], b"hellO"));
    assert_eq!(status, 400);
    assert!(text.contains("<Code>BadDigest</Code>"), "{text}");
    let (status, text) = code(&put(&[("content-length", "9")], b"hello"));
    assert_eq!(status, 400);
    assert!(text.contains("<Code>IncompleteBody</Code>"), "{text}");
    // aws-chunked: two chunks, then the checksum as a trailer.
    let chunked = |trailer: &str| {
        format!("3;chunk-signature=ab\r\nhel\r\n2\r\nlo\r\n0\r\n{trailer}\r\n\r\n").into_bytes()
    };
    let chunked_headers = [
        ("content-encoding", "aws-chunked"),
        ("x-amz-decoded-content-length", "5"),
        ("x-amz-trailer", "x-amz-checksum-crc32"),
    ];
    let good = chunked(&format!("x-amz-checksum-crc32:{crc}"));
    assert_eq!(put(&chunked_headers, &good).status, 200);
    assert_eq!(model.object("b", "k"), Some(b"hello".to_vec()));
    let bad = chunked("x-amz-checksum-crc32:AAAAAA==");
    let (status, text) = code(&put(&chunked_headers, &bad));
    assert_eq!(status, 400);
    assert!(text.contains("<Code>BadDigest</Code>"), "{text}");
    let (status, text) = code(&put(&chunked_headers, b"3\r\nhel\r\n0\r\n\r\n"));
    assert_eq!(status, 400);
    assert!(text.contains("<Code>IncompleteBody</Code>"), "{text}");
    let short = [
        chunked_headers[0],
        ("x-amz-decoded-content-length", "3"),
        chunked_headers[2],
    ];
    let (status, text) = code(&put(&short, b"3\r\nhel\r\n0\r\n\r\n"));
    assert_eq!(status, 400, "the announced trailer is missing");
    assert!(text.contains("<Code>InvalidRequest</Code>"), "{text}");
    let (status, text) = code(&put(&chunked_headers, b"zz\r\nhel\r\n"));
    assert_eq!(status, 400);
    assert!(text.contains("malformed aws-chunked body"), "{text}");
    assert_eq!(model.handle("POST", "b", "k").status, 405);
}

/// `PutObject` meets the link's faults as `GetObject` does: a 500 after
/// the object was stored, a reset after it was stored (its answer lost), a
/// reset before it reached S3: the SDK's retries store it, whole; a put
/// that never reaches S3 within the SDK's attempts is a transient failure.
#[tokio::test(start_paused = true)]
async fn a_put_under_faults_is_retried_by_the_sdk_and_stores_the_object_whole() {
    use sqs_once::payloads::{PayloadErrorKind, PayloadStore};
    let model = s3::S3Model::with_bucket("sim-payloads");
    let client = |faults: Vec<WireFault>| {
        let clock: Arc<dyn Clock> = Arc::new(TokioClock::starting_at(crate::hosts::epoch()));
        let wire = Wire::new(Service::S3(model.clone()), None, Life::default()).scripted_s3(faults);
        s3_client(wire, clock)
    };
    let object = pointer("sim-payloads", "outbox/faulty");
    let body = vec![b'z'; 5000];
    client(vec![WireFault::InternalAfter, WireFault::ResetAfter])
        .put(&object, body.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        model.puts(),
        3,
        "stored three times, the first two answers lost"
    );
    assert_eq!(model.object("sim-payloads", "outbox/faulty"), Some(body));
    let again = pointer("sim-payloads", "outbox/reset");
    client(vec![WireFault::ResetBefore])
        .put(&again, b"y".to_vec())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(model.puts(), 4, "the reset one never reached S3");
    assert!(model.contains("sim-payloads", "outbox/reset"));
    let lost = pointer("sim-payloads", "outbox/lost");
    let failed = client(vec![WireFault::InternalBefore; 3])
        .put(&lost, b"x".to_vec())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(failed.kind, PayloadErrorKind::Transient, "{failed}");
    assert!(failed.detail.contains("InternalError"), "{failed}");
    assert!(!model.contains("sim-payloads", "outbox/lost"));
}

#[test]
fn the_s3_model_computes_the_checksums_s3_names() {
    // The catalogue's check values of "123456789": CRC-32 0xCBF43926,
    // CRC-32C 0xE3069283; base64 of their big-endian bytes.
    assert_eq!(
        s3::checksum("x-amz-checksum-crc32", b"123456789").as_deref(),
        Some("y/Q5Jg==")
    );
    assert_eq!(
        s3::checksum("x-amz-checksum-crc32c", b"123456789").as_deref(),
        Some("4waSgw==")
    );
    assert_eq!(s3::checksum("x-amz-checksum-sha1", b"123456789"), None);
}

/// The fencing check sees a put as it sees an update: a record put whole
/// over another owner's live claim (what the fast path's put would do
/// without its `attribute_not_exists`) is a breach.
#[tokio::test(start_paused = true)]
async fn a_put_over_a_live_claim_is_a_fencing_breach() {
    let (model, store, client) = setup();
    store.claim(&claim_request("a", "m1")).await.unwrap();
    let put = Put::builder()
        .table_name(TABLE)
        .item("pk", AttributeValue::S("sim#e1".into()))
        .item("status", AttributeValue::S("COMPLETED".into()))
        .item("owner", AttributeValue::S("b".into()))
        .item("expires_at", AttributeValue::N("9999999999".into()))
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    client
        .transact_write_items()
        .transact_items(TransactWriteItem::builder().put(put).build())
        .send()
        .await
        .unwrap();
    assert_eq!(
        model.fencing_breaches(),
        vec!["sim#e1: a write of owner b applied while a held it".to_owned()]
    );
}

/// A claim's fence is one above the record's; a write that stores a fence
/// not above every one the key held (here a lower one, put by hand after
/// the record was deleted) is a breach.
#[tokio::test(start_paused = true)]
async fn a_fence_stored_not_above_the_keys_highest_is_a_fencing_breach() {
    let (model, store, client) = setup();
    let Claim::Acquired { fence: first, .. } =
        store.claim(&claim_request("a", "m1")).await.unwrap()
    else {
        panic!("not acquired");
    };
    tokio::time::advance(Duration::from_secs(31)).await;
    let Claim::Acquired { fence: taken, .. } =
        store.claim(&claim_request("b", "m2")).await.unwrap()
    else {
        panic!("not acquired");
    };
    assert_eq!(taken, first + 1);
    assert!(model.fencing_breaches().is_empty());
    client
        .delete_item()
        .table_name(TABLE)
        .key("pk", AttributeValue::S("sim#e1".into()))
        .send()
        .await
        .unwrap();
    client
        .put_item()
        .table_name(TABLE)
        .item("pk", AttributeValue::S("sim#e1".into()))
        .item("status", AttributeValue::S("COMPLETED".into()))
        .item("owner", AttributeValue::S("c".into()))
        .item("fence", AttributeValue::N(first.to_string()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        model.fencing_breaches(),
        vec![format!(
            "sim#e1: a write stored fence {first}, not above the {taken} the key held"
        )]
    );
}

/// Every record write is held to the configured TTL: `expires_at` is the
/// writer's clock, as its call noted it, in whole seconds plus the TTL. A
/// write short of it is a breach, and TTL ending its record is a breach
/// too, not an end that could excuse an application after it.
#[tokio::test(start_paused = true)]
async fn a_record_written_with_a_ttl_other_than_configured_is_a_breach_and_excuses_nothing() {
    let (model, store, _) = setup();
    let clock = TokioClock::starting_at(crate::hosts::epoch());
    model.expect_ttl(Duration::from_secs(3600));
    model.stamp("sim#e1", "a", Stamp::Claim, clock.now_ms());
    let Claim::Acquired { .. } = store.claim(&claim_request("a", "m1")).await.unwrap() else {
        panic!("not acquired");
    };
    assert_eq!(model.ttl_breaches(), Vec::<String>::new());
    tokio::time::advance(Duration::from_millis(1500)).await;
    model.stamp("sim#e1", "a", Stamp::Complete, clock.now_ms());
    let mut short = completion("a", vec![]);
    short.ttl = Duration::from_secs(60);
    store.complete(short).await.unwrap();
    let breaches = model.ttl_breaches();
    assert_eq!(breaches.len(), 1, "{breaches:?}");
    assert!(
        breaches[0].contains("Complete write of owner a"),
        "{breaches:?}"
    );
    // Past that short TTL, another owner's claim takes the record: no end
    // by TTL is logged, a breach is.
    tokio::time::advance(Duration::from_secs(62)).await;
    model.stamp("sim#e1", "b", Stamp::Claim, clock.now_ms());
    let Claim::Acquired { .. } = store.claim(&claim_request("b", "m2")).await.unwrap() else {
        panic!("not acquired");
    };
    assert!(
        model.ended_by_ttl().is_empty(),
        "{:?}",
        model.ended_by_ttl()
    );
    let breaches = model.ttl_breaches();
    assert_eq!(breaches.len(), 2, "{breaches:?}");
    assert!(
        breaches[1].contains("wrong expires_at, was replaced"),
        "{breaches:?}"
    );
}
