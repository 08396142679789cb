//! The Lambda runtime against LocalStack: the adapter on events in AWS's
//! documented shape (`tests/fixtures`) and on events built from real receives,
//! and the real `ledger` binary behind a local Lambda Runtime API.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lambda_events::event::sqs::SqsBatchResponse;
use serde_json::{Value, json};
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::store::ClaimRequest;
use sqs_once::{DedupStore, DynamoStore, Handler, HandlerError, Processor, handler_fn};
use sqs_once_cli::local_lambda::{LocalLambda, run_event_source, sqs_event};
use sqs_once_example_ledger::LedgerHandler;

use crate::common::{
    Ledger, bodies_with_reasons, ddb, dedup_table, depth, ledger_rows, send_all, sqs, unique,
};

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A record for [`event_like`]: message id, body, FIFO group.
struct Rec<'a>(&'a str, Value, Option<&'a str>);

fn rec<'a>(id: &'a str, body: &str) -> Rec<'a> {
    Rec(id, Value::String(body.to_owned()), None)
}

fn fifo_rec<'a>(id: &'a str, body: &str, group: &'a str) -> Rec<'a> {
    Rec(id, Value::String(body.to_owned()), Some(group))
}

/// An event whose records copy the fixture's first record with these ids,
/// bodies (a non-string body makes an unreadable record) and groups.
fn event_like(fixture_name: &str, records: &[Rec<'_>]) -> Value {
    let template = fixture(fixture_name)["Records"][0].clone();
    let records: Vec<Value> = records
        .iter()
        .enumerate()
        .map(|(i, Rec(id, body, group))| {
            let mut r = template.clone();
            r["messageId"] = json!(id);
            r["body"] = body.clone();
            r["receiptHandle"] = json!(format!("receipt-{id}"));
            if let Some(g) = group {
                r["attributes"]["MessageGroupId"] = json!(g);
                r["attributes"]["MessageDeduplicationId"] = json!(id);
                r["attributes"]["SequenceNumber"] = json!(format!("{:020}", i));
            }
            r
        })
        .collect();
    json!({ "Records": records })
}

fn ledger_body(id: &str, account: &str, amount: i64) -> String {
    json!({"id": id, "account": account, "amount_cents": amount}).to_string()
}

fn failures(r: &SqsBatchResponse) -> Vec<String> {
    r.batch_item_failures
        .iter()
        .map(|f| f.item_identifier.clone())
        .collect()
}

/// Answers a batch whose every record fails with the list (not an error),
/// for tests of which records are listed.
fn listing() -> LambdaConfig {
    {
        let mut c = LambdaConfig::default();
        c.error_on_full_failure = false;
        c
    }
}

fn in_secs(secs: u64) -> SystemTime {
    SystemTime::now() + Duration::from_secs(secs)
}

fn ledger_config() -> ProcessorConfig {
    let mut c = ProcessorConfig::new("ledger");
    c.key_source = "json:/id".parse().unwrap();
    c
}

async fn adapter<H: Handler>(
    dedup: &str,
    handler: H,
    processor_config: ProcessorConfig,
    config: LambdaConfig,
) -> LambdaAdapter<DynamoStore, H> {
    let store = DynamoStore::new(ddb().await, dedup);
    let processor = Processor::new(store, handler, processor_config).unwrap();
    LambdaAdapter::new(sqs().await, processor, config)
}

/// A handler that records each body it sees, then answers with `f(body)`.
fn recording(f: fn(&str) -> sqs_once::HandlerResult) -> (impl Handler, Arc<Mutex<Vec<String>>>) {
    let calls: Arc<Mutex<Vec<String>>> = Default::default();
    let c = calls.clone();
    let handler = handler_fn(move |m, _ctx| {
        let c = c.clone();
        let body = m.body().to_owned();
        async move {
            c.lock().unwrap().push(body.clone());
            f(&body)
        }
    });
    (handler, calls)
}

#[tokio::test]
async fn standard_event_applies_each_event_once_and_parks_bad_bodies() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let a = adapter(&l.dedup, LedgerHandler::new(&l.ledger), ledger_config(), {
        let mut c = LambdaConfig::default();
        c.dlq_url = Some(l.queues.dlq_url.clone());
        c
    })
    .await;
    let good = [
        rec("m1", &ledger_body("e1", "acct-a", 100)),
        rec("m2", &ledger_body("e2", "acct-b", 250)),
        // The producer sent e1 again: a new message id, the same business id.
        rec("m3", &ledger_body("e1", "acct-a", 100)),
    ];
    let mut records = good
        .iter()
        .map(|Rec(i, b, g)| Rec(i, b.clone(), *g))
        .collect::<Vec<_>>();
    records.push(rec("m4", "not json"));
    records.push(rec("m5", r#"{"id":"e5","account":"acct-a"}"#));
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(
        failures(&response),
        Vec::<String>::new(),
        "completed, duplicate and parked records are all done"
    );
    let expected = HashMap::from([
        ("acct-a".to_owned(), (100, 1)),
        ("acct-b".to_owned(), (250, 1)),
    ]);
    assert_eq!(ledger_rows(&ddb, &l.ledger).await, expected);
    let parked = bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 2, "{parked:?}");
    assert_eq!(parked[0].0, "not json");
    assert!(parked[0].1.contains("json:/id"), "{}", parked[0].1);
    assert!(parked[1].1.contains("amount_cents"), "{}", parked[1].1);

    // Lambda delivers the same records again (e.g. the response was lost).
    let again = a
        .handle(event_like("sqs-standard-event.json", &good), in_secs(60))
        .await
        .unwrap();
    assert_eq!(failures(&again), Vec::<String>::new());
    assert_eq!(ledger_rows(&ddb, &l.ledger).await, expected, "applied once");
}

#[tokio::test]
async fn exactly_the_records_that_must_come_back_are_listed() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let (handler, calls) = recording(|body| match body.split(':').next().unwrap() {
        "ok" => Ok(None),
        "retry" => Err(HandlerError::retry("downstream busy")),
        "panic" => panic!("handler bug"),
        _ => Err(HandlerError::permanent("cannot apply")),
    });
    let mut pconf = ProcessorConfig::new("c");
    pconf.backoff_base = Duration::from_secs(1);
    // No DLQ configured: a permanent failure cannot be parked, so it is listed.
    let a = adapter(&dedup, handler, pconf, LambdaConfig::default()).await;
    // Another consumer holds a live claim on m-busy.
    let store = DynamoStore::new(ddb.clone(), dedup.as_str());
    store
        .claim(&ClaimRequest {
            pk: sqs_once::key::record_key("c", "m-busy"),
            owner: "someone-else".into(),
            message_id: "m-busy".into(),
            payload_sha256: sqs_once::key::sha256_hex(b"ok:busy"),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    let records = [
        rec("m-ok", "ok:1"),
        rec("m-retry", "retry:1"),
        rec("m-panic", "panic:1"),
        rec("m-busy", "ok:busy"),
        Rec("m-unreadable", json!(42), None),
        rec("m-perm", "perm:1"),
        rec("m-ok2", "ok:2"),
    ];
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(
        failures(&response),
        ["m-retry", "m-panic", "m-busy", "m-unreadable", "m-perm"],
        "listed in event order; completed records are not"
    );
    let mut ran = calls.lock().unwrap().clone();
    ran.sort();
    assert_eq!(
        ran,
        ["ok:1", "ok:2", "panic:1", "perm:1", "retry:1"],
        "each readable record ran once; the in-flight one did not run"
    );
}

#[tokio::test]
async fn not_an_sqs_event_fails_the_invocation() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let a = adapter(
        &dedup,
        handler_fn(|_m, _c| async { Ok(None) }),
        ProcessorConfig::new("c"),
        LambdaConfig::default(),
    )
    .await;
    for (event, says) in [
        (json!({"detail": {}}), "Records"),
        (json!([1, 2]), "JSON object"),
        (json!({"Records": [{"body": "x"}]}), "messageId"),
    ] {
        let e = a.handle(event, in_secs(60)).await.unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
    }
}

#[tokio::test]
async fn standard_records_run_concurrently_within_the_bound() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    // All ten handlers must be inside at once to pass the barrier.
    let barrier = Arc::new(tokio::sync::Barrier::new(10));
    let b = barrier.clone();
    let handler = handler_fn(move |_m, _c| {
        let b = b.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(20), b.wait())
                .await
                .map_err(|_| HandlerError::retry("not all ten ran at once"))?;
            Ok(None)
        }
    });
    let a = adapter(
        &dedup,
        handler,
        ProcessorConfig::new("c"),
        LambdaConfig::default(),
    )
    .await;
    let ids: Vec<String> = (0..10).map(|i| format!("m{i}")).collect();
    let records: Vec<Rec<'_>> = ids.iter().map(|id| rec(id, "x")).collect();
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(failures(&response), Vec::<String>::new());

    // With a bound of 3, never more than 3 at once.
    let dedup = dedup_table(&ddb).await;
    let (now, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (n, p) = (now.clone(), peak.clone());
    let handler = handler_fn(move |_m, _c| {
        let (n, p) = (n.clone(), p.clone());
        async move {
            let current = n.fetch_add(1, Ordering::SeqCst) + 1;
            p.fetch_max(current, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            n.fetch_sub(1, Ordering::SeqCst);
            Ok(None)
        }
    });
    let a = adapter(&dedup, handler, ProcessorConfig::new("c"), {
        let mut c = LambdaConfig::default();
        c.concurrency = 3;
        c
    })
    .await;
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(failures(&response), Vec::<String>::new());
    assert!(
        peak.load(Ordering::SeqCst) <= 3,
        "peak {}",
        peak.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn fifo_failure_stops_its_group_only_and_keeps_order() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let (handler, calls) = recording(|body| match body {
        "a2" => Err(HandlerError::retry("a2 fails")),
        _ => Ok(None),
    });
    let a = adapter(
        &dedup,
        handler,
        ProcessorConfig::new("c"),
        LambdaConfig::default(),
    )
    .await;
    let records = [
        fifo_rec("id-a1", "a1", "A"),
        fifo_rec("id-b1", "b1", "B"),
        fifo_rec("id-a2", "a2", "A"),
        fifo_rec("id-b2", "b2", "B"),
        fifo_rec("id-a3", "a3", "A"),
        fifo_rec("id-b3", "b3", "B"),
    ];
    let response = a
        .handle(event_like("sqs-fifo-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(failures(&response), ["id-a2", "id-a3"]);
    let ran = calls.lock().unwrap().clone();
    let of = |g: char| -> Vec<&str> {
        ran.iter()
            .filter(|b| b.starts_with(g))
            .map(String::as_str)
            .collect()
    };
    assert_eq!(of('a'), ["a1", "a2"], "a3 did not run after a2 failed");
    assert_eq!(of('b'), ["b1", "b2", "b3"], "group B went on, in order");
}

#[tokio::test]
async fn no_record_starts_with_too_little_time_left() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = calls.clone();
    // One record at a time: m1 takes 4.5 s of the 6 s, so m2 would start
    // with 1.5 s left, under the 2 s margin.
    let handler = handler_fn(move |m, _ctx| {
        c.lock().unwrap().push(m.id().to_owned());
        let slow = m.body() == "slow";
        async move {
            if slow {
                tokio::time::sleep(Duration::from_millis(4500)).await;
            }
            Ok(None)
        }
    });
    let a = adapter(&dedup, handler, ProcessorConfig::new("c"), {
        let mut c = LambdaConfig::default();
        c.margin = Duration::from_secs(2);
        c.concurrency = 1;
        c
    })
    .await;
    let records = [rec("m1", "slow"), rec("m2", "y")];
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(6))
        .await
        .unwrap();
    assert_eq!(failures(&response), ["m2"]);
    assert_eq!(*calls.lock().unwrap(), ["m1"], "m2 was not started");
}

/// A function timeout not above twice the margin (Lambda's default 3 s
/// against the default 3 s margin) would start no record ever, and every
/// message would end in the DLQ unprocessed: the invocation runs with a
/// quarter of its time as the margin instead (and logs an error).
#[tokio::test]
async fn a_function_timeout_near_the_margin_still_runs_its_records() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let handler = handler_fn(move |_m, _ctx| {
        c.fetch_add(1, Ordering::SeqCst);
        async { Ok(None) }
    });
    let a = adapter(&dedup, handler, ProcessorConfig::new("c"), {
        let mut c = LambdaConfig::default();
        c.margin = Duration::from_secs(3);
        c
    })
    .await;
    let records = [rec("m1", "x"), rec("m2", "y")];
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(3))
        .await
        .unwrap();
    assert_eq!(failures(&response), Vec::<String>::new());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Every record to come back: the invocation answers with an error (so the
/// whole batch comes back even where the event source mapping was created
/// without ReportBatchItemFailures, which would delete every record of a
/// listed response), or, configured so, with the full list.
#[tokio::test]
async fn a_batch_whose_every_record_fails_is_answered_with_an_error() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let handler = || handler_fn(|_m, _c| async { Err(HandlerError::retry("not yet")) });
    let records = [rec("m1", "x"), rec("m2", "y")];
    let a = adapter(
        &dedup,
        handler(),
        ProcessorConfig::new("c"),
        LambdaConfig::default(),
    )
    .await;
    let err = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, sqs_once::lambda::EventError::WholeBatch(ids) if *ids == ["m1", "m2"]),
        "{err}"
    );
    let listing = {
        let mut c = LambdaConfig::default();
        c.error_on_full_failure = false;
        c
    };
    let a = adapter(&dedup, handler(), ProcessorConfig::new("c2"), listing).await;
    let response = a
        .handle(event_like("sqs-standard-event.json", &records), in_secs(60))
        .await
        .unwrap();
    assert_eq!(failures(&response), ["m1", "m2"]);
}

#[tokio::test]
async fn lease_ends_by_the_deadline_and_a_late_handler_is_interrupted_and_released() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let dedup = dedup_table(&ddb).await;
    let store = DynamoStore::new(ddb.clone(), dedup.as_str());
    let seen_lease: Arc<Mutex<Option<i64>>> = Default::default();
    let (s, seen) = (store.clone(), seen_lease.clone());
    let handler = handler_fn(move |_m, ctx| {
        let (s, seen) = (s.clone(), seen.clone());
        let pk = sqs_once::key::record_key(ctx.consumer(), ctx.dedup_key().unwrap());
        async move {
            let record = s.get(&pk).await.unwrap().unwrap();
            *seen.lock().unwrap() = Some(record.lease_until_ms);
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(None)
        }
    });
    let a = adapter(&dedup, handler, ProcessorConfig::new("c"), {
        let mut c = LambdaConfig::default();
        c.margin = Duration::from_secs(2);
        c.error_on_full_failure = false;
        c
    })
    .await;
    let deadline = in_secs(6);
    let deadline_ms = deadline.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64;
    let response = a
        .handle(
            event_like("sqs-standard-event.json", &[rec("m1", "x")]),
            deadline,
        )
        .await
        .unwrap();
    assert!(
        SystemTime::now() < deadline,
        "answered before the invocation's deadline"
    );
    assert_eq!(
        failures(&response),
        ["m1"],
        "interrupted, so it must come back"
    );
    let lease = seen_lease.lock().unwrap().expect("the handler ran");
    assert!(
        lease <= deadline_ms,
        "lease {lease} outlives the invocation ({deadline_ms})"
    );
    let record = store
        .get(&sqs_once::key::record_key("c", "m1"))
        .await
        .unwrap()
        .unwrap();
    // Released, not merely run out: a lease that ran out would still end at
    // the time the handler saw; a release moves it back and records why.
    assert!(
        record.lease_until_ms < lease,
        "the claim was released before its lease ran out (lease {lease}): {record:?}"
    );
    assert_eq!(record.status, sqs_once::Status::InProgress, "{record:?}");
    assert!(record.error.is_some(), "the release says why: {record:?}");
    assert!(record.claimable(now_ms()), "{record:?}");
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Receives `n` messages as Lambda's event source mapping would, as one event.
pub(crate) async fn receive_event(sqs: &aws_sdk_sqs::Client, url: &str, n: usize) -> Value {
    let arn = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()[&aws_sdk_sqs::types::QueueAttributeName::QueueArn]
        .clone();
    let mut messages = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while messages.len() < n && tokio::time::Instant::now() < deadline {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages((n - messages.len()) as i32)
            .wait_time_seconds(1)
            .message_system_attribute_names(aws_sdk_sqs::types::MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        messages.extend(got.messages.unwrap_or_default());
    }
    assert_eq!(messages.len(), n, "received");
    sqs_event(&arn, &messages)
}

#[tokio::test]
async fn heartbeat_extends_the_records_visibility_in_lambda() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    // A 2 s visibility timeout and a handler that takes 5 s.
    let l = Ledger::with_visibility(&sqs, &ddb, 2).await;
    let mut pconf = ledger_config();
    pconf.heartbeat = Duration::from_millis(500);
    let a = adapter(
        &l.dedup,
        sqs_once::testkit::Faulty::new(LedgerHandler::new(&l.ledger)).work(Duration::from_secs(5)),
        pconf,
        LambdaConfig::default(),
    )
    .await;
    send_all(&sqs, &l.queues.queue_url, &[ledger_body("e1", "acct-a", 7)]).await;
    let event = receive_event(&sqs, &l.queues.queue_url, 1).await;
    // While the handler runs, nobody else may receive the message.
    let (watch_sqs, url) = (sqs.clone(), l.queues.queue_url.clone());
    let watcher = tokio::spawn(async move {
        let mut seen = 0;
        let until = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::time::Instant::now() < until {
            seen += watch_sqs
                .receive_message()
                .queue_url(&url)
                .wait_time_seconds(1)
                .send()
                .await
                .unwrap()
                .messages
                .unwrap_or_default()
                .len();
        }
        seen
    });
    let response = a.handle(event, in_secs(60)).await.unwrap();
    assert_eq!(failures(&response), Vec::<String>::new());
    assert_eq!(
        watcher.await.unwrap(),
        0,
        "the message was redelivered mid-handler"
    );
    assert_eq!(
        depth(&sqs, &l.queues.queue_url).await,
        1,
        "still in flight until Lambda deletes it"
    );
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([("acct-a".to_owned(), (7, 1))])
    );
}

/// A record finished early in a long batch stays invisible until the
/// invocation answers (and Lambda deletes it), though its heartbeat's
/// extensions ask for a lease shorter than the rest of the batch: each
/// extension keeps it invisible past the deadline, for Lambda's delete after
/// the answer (simulator seed 360899).
#[tokio::test]
async fn a_record_finished_early_in_a_long_batch_is_not_received_again_before_the_answer() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    // A 2 s visibility timeout, a 3 s lease: the short record (4 s) is
    // extended, its last extension ending about 7 s in; the long one runs 12 s.
    let l = Ledger::with_visibility(&sqs, &ddb, 2).await;
    let mut pconf = ledger_config();
    pconf.lease = Duration::from_secs(3);
    pconf.heartbeat = Duration::from_millis(500);
    let effects: Arc<Mutex<Vec<String>>> = Default::default();
    let handler = handler_fn({
        let effects = effects.clone();
        move |m, _ctx| {
            let effects = effects.clone();
            async move {
                let takes = if m.body().contains("short") { 4 } else { 12 };
                tokio::time::sleep(Duration::from_secs(takes)).await;
                effects.lock().unwrap().push(m.body().to_owned());
                Ok(None)
            }
        }
    });
    let a = adapter(&l.dedup, handler, pconf, LambdaConfig::default()).await;
    let bodies = [
        r#"{"id":"short"}"#.to_owned(),
        r#"{"id":"long"}"#.to_owned(),
    ];
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let event = receive_event(&sqs, &l.queues.queue_url, 2).await;
    let deadline = in_secs(20);
    let invocation = tokio::spawn(async move { a.handle(event, deadline).await });
    // Another consumer, while the invocation runs and until Lambda's
    // delete, here 5 s past the deadline.
    let mut seen = Vec::new();
    while SystemTime::now() < deadline + Duration::from_secs(5) {
        let got = sqs
            .receive_message()
            .queue_url(&l.queues.queue_url)
            .wait_time_seconds(1)
            .send()
            .await
            .unwrap();
        seen.extend(got.messages.unwrap_or_default().into_iter().map(|m| m.body));
    }
    let response = invocation.await.unwrap().unwrap();
    assert_eq!(failures(&response), Vec::<String>::new());
    assert!(
        seen.is_empty(),
        "received again before the answer: {seen:?}"
    );
    let mut effects = effects.lock().unwrap().clone();
    effects.sort();
    assert_eq!(effects, [r#"{"id":"long"}"#, r#"{"id":"short"}"#]);
    assert_eq!(
        depth(&sqs, &l.queues.queue_url).await,
        2,
        "both still stored (invisible: none was received above) until Lambda deletes them"
    );
}

#[tokio::test]
async fn a_retried_record_comes_back_after_its_backoff() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::with_visibility(&sqs, &ddb, 300).await;
    let handler = handler_fn(|_m, _c| async { Err(HandlerError::retry("not yet")) });
    let mut pconf = ProcessorConfig::new("c");
    pconf.backoff_base = Duration::from_secs(1);
    let a = adapter(&l.dedup, handler, pconf, listing()).await;
    send_all(&sqs, &l.queues.queue_url, &["x".to_owned()]).await;
    let event = receive_event(&sqs, &l.queues.queue_url, 1).await;
    let id = event["Records"][0]["messageId"]
        .as_str()
        .unwrap()
        .to_owned();
    let response = a.handle(event, in_secs(60)).await.unwrap();
    assert_eq!(failures(&response), std::slice::from_ref(&id));
    // Without the backoff it would stay invisible for the queue's 300 s.
    let again = receive_event(&sqs, &l.queues.queue_url, 1).await;
    assert_eq!(again["Records"][0]["messageId"], json!(id));
    assert_eq!(
        again["Records"][0]["attributes"]["ApproximateReceiveCount"],
        json!("2")
    );
}

/// The `ledger` binary under the local Runtime API, configured for `l`.
async fn ledger_function(l: &Ledger, extra: &[(&str, &str)]) -> LocalLambda {
    let mut env: Vec<(String, String)> = [
        ("SQS_ONCE_DLQ_URL", l.queues.dlq_url.as_str()),
        ("SQS_ONCE_TABLE", &l.dedup),
        ("SQS_ONCE_CONSUMER", "ledger"),
        ("SQS_ONCE_DEDUP_KEY", "json:/id"),
        ("LEDGER_TABLE", &l.ledger),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("RUST_LOG", "warn"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    env.push(("AWS_ENDPOINT_URL".into(), crate::common::endpoint()));
    env.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    LocalLambda::start(
        crate::common::binary("ledger"),
        "ledger",
        Duration::from_secs(30),
        env,
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn ledger_binary_as_a_lambda_function_answers_exact_batch_item_failures() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let function = ledger_function(&l, &[]).await;

    // Standard: two events, one re-sent, a malformed body, an unreadable record.
    let standard = event_like(
        "sqs-standard-event.json",
        &[
            rec("s1", &ledger_body("e1", "acct-a", 100)),
            rec("s2", &ledger_body("e2", "acct-b", 200)),
            rec("s3", &ledger_body("e1", "acct-a", 100)),
            rec("s4", "{not json"),
            Rec("s5", json!({"not": "a string"}), None),
        ],
    );
    let response = function.invoke(&standard).await.unwrap();
    assert_eq!(
        response,
        json!({"batchItemFailures": [{"itemIdentifier": "s5"}]})
    );

    // FIFO: group g1's second event is in flight elsewhere, so g1 stops there; g2 goes on.
    DynamoStore::new(ddb.clone(), l.dedup.as_str())
        .claim(&ClaimRequest {
            pk: sqs_once::key::record_key("ledger", "f2"),
            owner: "another-consumer".into(),
            message_id: "other".into(),
            payload_sha256: String::new(),
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
        })
        .await
        .unwrap();
    let fifo = event_like(
        "sqs-fifo-event.json",
        &[
            fifo_rec("f1", &ledger_body("f1", "acct-a", 1), "g1"),
            fifo_rec("g1", &ledger_body("g1", "acct-c", 10), "g2"),
            fifo_rec("f2", &ledger_body("f2", "acct-a", 2), "g1"),
            fifo_rec("f3", &ledger_body("f3", "acct-a", 4), "g1"),
            fifo_rec("g2", &ledger_body("g2", "acct-c", 20), "g2"),
        ],
    );
    let response = function.invoke(&fifo).await.unwrap();
    assert_eq!(
        response,
        json!({"batchItemFailures": [{"itemIdentifier": "f2"}, {"itemIdentifier": "f3"}]})
    );
    function.shutdown().await;

    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([
            ("acct-a".to_owned(), (101, 2)),
            ("acct-b".to_owned(), (200, 1)),
            ("acct-c".to_owned(), (30, 2)),
        ])
    );
    let parked = bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].0, "{not json");
}

#[tokio::test]
async fn ledger_function_behind_a_local_event_source_drains_the_queue_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let mut bodies = Vec::new();
    let mut expected: HashMap<String, (i64, i64)> = HashMap::new();
    for i in 0..40 {
        let account = format!("acct-{}", i % 4);
        let e = expected.entry(account.clone()).or_default();
        e.0 += i;
        e.1 += 1;
        let body = ledger_body(&format!("evt-{i}"), &account, i);
        if i % 3 == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    bodies.push("not json".into());
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let function = ledger_function(&l, &[]).await;
    let stats = run_event_source(
        &sqs,
        &l.queues.queue_url,
        &function,
        10,
        Duration::from_secs(2),
    )
    .await
    .unwrap();
    function.shutdown().await;
    assert_eq!(stats.records, bodies.len() as u64, "{stats:?}");
    assert_eq!(stats.deleted, bodies.len() as u64, "{stats:?}");
    assert_eq!(ledger_rows(&ddb, &l.ledger).await, expected);
    assert_eq!(depth(&sqs, &l.queues.queue_url).await, 0);
    assert_eq!(bodies_with_reasons(&sqs, &l.queues.dlq_url).await.len(), 1);
}

#[tokio::test]
async fn ledger_function_with_a_bad_setting_fails_its_invocations_and_loses_nothing() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let function = ledger_function(&l, &[("SQS_ONCE_TABLE", &unique("missing"))]).await;
    let err = function
        .invoke(&event_like("sqs-standard-event.json", &[rec("m1", "x")]))
        .await
        .unwrap_err();
    assert!(
        matches!(err, sqs_once_cli::local_lambda::InvokeError::Exited(ref why) if why.contains("exit status: 2")),
        "{err}"
    );
    function.shutdown().await;
}

/// Regression: a failed `GetQueueUrl` was cached for the life
/// of the environment, so every later invocation ran without visibility
/// changes (no backoff, no heartbeat) for that queue.
#[tokio::test]
async fn a_failed_queue_url_lookup_is_tried_again_by_the_next_invocation() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let name = unique("late-queue");
    let handler = handler_fn(|_m, _c| async { Err(HandlerError::retry("not yet")) });
    let mut pconf = ProcessorConfig::new("c");
    pconf.backoff_base = Duration::from_secs(1);
    let dedup = dedup_table(&ddb).await;
    let a = adapter(&dedup, handler, pconf, listing()).await;
    // The queue does not exist yet: the lookup fails.
    let arn = format!("arn:aws:sqs:us-east-1:000000000000:{name}");
    let early = json!({"Records": [{
        "messageId": "early", "receiptHandle": "none", "body": "x",
        "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {},
        "eventSource": "aws:sqs", "eventSourceARN": arn, "awsRegion": "us-east-1"
    }]});
    a.handle(early, in_secs(60)).await.unwrap();
    // Now it exists, with a long visibility timeout.
    let url = sqs
        .create_queue()
        .queue_name(&name)
        .attributes(
            aws_sdk_sqs::types::QueueAttributeName::VisibilityTimeout,
            "300",
        )
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    send_all(&sqs, &url, &["x".to_owned()]).await;
    let event = receive_event(&sqs, &url, 1).await;
    assert_eq!(event["Records"][0]["eventSourceARN"], json!(arn));
    let response = a.handle(event, in_secs(60)).await.unwrap();
    assert_eq!(failures(&response).len(), 1);
    // The retry delay was set through the looked-up URL: back after 1 s,
    // not after the queue's 300 s.
    let again = receive_event(&sqs, &url, 1).await;
    assert_eq!(
        again["Records"][0]["attributes"]["ApproximateReceiveCount"],
        json!("2")
    );
}
