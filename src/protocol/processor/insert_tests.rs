//! Unit tests of the insert path on the in-memory store.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem, Update};

use super::*;
use crate::protocol::config::{PayloadMismatch, ProcessorConfig};
use crate::protocol::handler::{Context, HandlerError, HandlerResult};
use crate::protocol::outcome::Outcome;
use crate::protocol::store::{
    INSERT_KEY_ATTRIBUTE, INSERT_PAYLOAD_ATTRIBUTE, InsertCommit, Inserted,
};
use crate::{MemoryStore, Status, handler_fn, insert_once};

const TABLE: &str = "orders";

fn config(mismatch: PayloadMismatch) -> ProcessorConfig {
    let mut c = ProcessorConfig::new("shop");
    c.key_source = "json:/id".parse().unwrap();
    c.payload_mismatch = mismatch;
    c
}

fn order_put(order: &str, amount: i64) -> TransactWriteItem {
    let put = Put::builder()
        .table_name(TABLE)
        .item("order_id", AttributeValue::S(order.to_owned()))
        .item("amount", AttributeValue::N(amount.to_string()))
        .build()
        .unwrap();
    TransactWriteItem::builder().put(put).build()
}

/// What the test handler stages, chosen by the body's `shape`.
fn stage(ctx: &Context, body: &serde_json::Value) -> HandlerResult {
    let order = body["order"].as_str().unwrap_or("o-1");
    let amount = body["amount"].as_i64().unwrap_or(1);
    match body["shape"].as_str().unwrap_or("one") {
        "one" => ctx.stage(order_put(order, amount)),
        "none" => {}
        "two" => {
            ctx.stage(order_put(order, amount));
            ctx.stage(order_put("o-other", amount));
        }
        "update" => {
            let update = Update::builder()
                .table_name(TABLE)
                .key("order_id", AttributeValue::S(order.to_owned()))
                .update_expression("SET amount = :a")
                .expression_attribute_values(":a", AttributeValue::N("1".into()))
                .build()?;
            ctx.stage(TransactWriteItem::builder().update(update).build());
        }
        "conditioned" => {
            let put = Put::builder()
                .table_name(TABLE)
                .item("order_id", AttributeValue::S(order.to_owned()))
                .condition_expression("attribute_not_exists(order_id)")
                .build()?;
            ctx.stage(TransactWriteItem::builder().put(put).build());
        }
        "keyless" => {
            let put = Put::builder()
                .table_name(TABLE)
                .item("amount", AttributeValue::N("1".into()))
                .build()?;
            ctx.stage(TransactWriteItem::builder().put(put).build());
        }
        other => return Err(HandlerError::permanent(format!("no shape {other}"))),
    }
    Ok(Some(serde_json::json!({ "order": order })))
}

/// An insert-shaped handler counting its runs.
fn orders() -> (Arc<AtomicU32>, impl Handler + Clone) {
    let runs = Arc::new(AtomicU32::new(0));
    let r = runs.clone();
    let handler = insert_once(
        &["order_id"],
        handler_fn(move |m: Message, ctx: Context| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                let body: serde_json::Value = m.json().map_err(HandlerError::permanent)?;
                stage(&ctx, &body)
            }
        }),
    );
    (runs, handler)
}

fn amount_of(item: &HashMap<String, AttributeValue>) -> &str {
    item["amount"].as_n().unwrap()
}

#[tokio::test]
async fn the_insert_is_the_record_duplicates_apply_once_and_no_dedup_record_is_written() {
    let store = MemoryStore::default();
    let (runs, handler) = orders();
    let p = Processor::new(store.clone(), handler, config(PayloadMismatch::Warn)).unwrap();
    assert_eq!(p.handler.effects(), Effects::Insert { key: &["order_id"] });
    let body = r#"{"id":"evt-1","order":"o-1","amount":5}"#;
    let first = p.process(Message::new("m1", body)).await;
    assert!(
        matches!(&first, Outcome::Completed { result: Some(StoredResult::Value(v)) } if v["order"] == "o-1"),
        "{first:?}"
    );
    // SQS's second copy, a redelivery, a producer's re-send under a new id.
    let copies = [
        Message::new("m1", body),
        Message::new("m1", body).with_receive_count(2),
        Message::new("m1-resend", body),
    ];
    for copy in copies {
        let o = p.process(copy).await;
        assert!(
            matches!(
                o,
                Outcome::Duplicate {
                    result: None,
                    payload_matches: true
                }
            ),
            "{o:?}"
        );
    }
    let items = store.items(TABLE);
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(amount_of(&items[0]), "5");
    assert_eq!(items[0][INSERT_KEY_ATTRIBUTE].as_s().unwrap(), "shop#evt-1");
    assert_eq!(
        items[0][INSERT_PAYLOAD_ATTRIBUTE].as_s().unwrap(),
        &p.config.payload_sha256(&Message::new("m1", body))
    );
    // One store write, the item: no dedup record, before or after.
    assert!(store.records().is_empty(), "{:?}", store.records());
    let mut commits = 0;
    store.for_each_committed(|w| commits += w.len());
    assert_eq!(commits, 1);
    // The handler ran for each copy (its write then refused), as on the fast path.
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    let seen = p.metrics().take();
    assert_eq!((seen.processed, seen.duplicates), (1, 3));
}

#[tokio::test]
async fn concurrent_copies_insert_once() {
    let store = MemoryStore::default();
    let (_, handler) = orders();
    let p = Processor::new(store.clone(), handler, config(PayloadMismatch::Warn)).unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..10 {
        for copy in 0..3 {
            let p = p.clone();
            let body = format!(r#"{{"id":"evt-{i}","order":"o-{i}","amount":{i}}}"#);
            tasks.spawn(async move { p.process(Message::new(format!("m{i}-{copy}"), body)).await });
        }
    }
    let mut completed = 0;
    while let Some(o) = tasks.join_next().await {
        match o.unwrap() {
            Outcome::Completed { .. } => completed += 1,
            Outcome::Duplicate {
                payload_matches: true,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(completed, 10);
    let items = store.items(TABLE);
    assert_eq!(items.len(), 10);
    let mut amounts: Vec<i64> = items
        .iter()
        .map(|i| amount_of(i).parse().unwrap())
        .collect();
    amounts.sort_unstable();
    assert_eq!(amounts, (0..10).collect::<Vec<_>>());
}

#[tokio::test]
async fn another_body_under_the_key_is_a_payload_mismatch_warned_or_parked() {
    let store = MemoryStore::default();
    let (_, handler) = orders();
    let warn = Processor::new(
        store.clone(),
        handler.clone(),
        config(PayloadMismatch::Warn),
    )
    .unwrap();
    let park = Processor::new(store.clone(), handler, config(PayloadMismatch::Park)).unwrap();
    let first = warn
        .process(Message::new(
            "m1",
            r#"{"id":"evt-1","order":"o-1","amount":5}"#,
        ))
        .await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    let other = r#"{"id":"evt-1","order":"o-1","amount":7}"#;
    let o = warn.process(Message::new("m2", other)).await;
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
    assert_eq!(warn.metrics().take().payload_mismatches, 1);
    let o = park.process(Message::new("m3", other)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("payload mismatch")),
        "{o:?}"
    );
    assert_eq!(park.metrics().take().payload_mismatches, 1);
    let items = store.items(TABLE);
    assert_eq!(items.len(), 1);
    assert_eq!(amount_of(&items[0]), "5", "the first effect stands");
}

#[tokio::test]
async fn an_item_another_message_or_tool_wrote_is_never_taken_for_done_silently() {
    let store = MemoryStore::default();
    let (_, handler) = orders();
    let warn = Processor::new(
        store.clone(),
        handler.clone(),
        config(PayloadMismatch::Warn),
    )
    .unwrap();
    let park = Processor::new(store.clone(), handler, config(PayloadMismatch::Park)).unwrap();
    // Another event (its own dedup key) inserts order o-1 first.
    let first = warn
        .process(Message::new(
            "m1",
            r#"{"id":"evt-1","order":"o-1","amount":5}"#,
        ))
        .await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    let second = r#"{"id":"evt-2","order":"o-1","amount":6}"#;
    let o = park.process(Message::new("m2", second)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("another message") && reason.contains("shop#evt-1")),
        "{o:?}"
    );
    // Under `warn` too: two events, not one key with two bodies, so letting
    // it go would drop an effect that never ran.
    let o = warn.process(Message::new("m2", second)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("another message")),
        "{o:?}"
    );
    // An item written outside sqs-once: no marker.
    store.put_item(
        TABLE,
        &["order_id"],
        HashMap::from([
            ("order_id".to_owned(), AttributeValue::S("o-9".into())),
            ("amount".to_owned(), AttributeValue::N("99".into())),
        ]),
    );
    let o = park
        .process(Message::new(
            "m9",
            r#"{"id":"evt-9","order":"o-9","amount":1}"#,
        ))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("outside sqs-once")),
        "{o:?}"
    );
    let items = store.items(TABLE);
    assert_eq!(items.len(), 2);
    assert_eq!(amount_of(&items[0]), "5");
    assert_eq!(amount_of(&items[1]), "99");
    assert_eq!(
        warn.metrics().take().payload_mismatches + park.metrics().take().payload_mismatches,
        3
    );
}

#[tokio::test]
async fn any_other_shape_fails_permanently_with_the_reason_and_writes_nothing() {
    let store = MemoryStore::default();
    let (runs, handler) = orders();
    let p = Processor::new(store.clone(), handler, config(PayloadMismatch::Warn)).unwrap();
    let cases = [
        ("none", "exactly one Put"),
        ("two", "it staged 2 write(s)"),
        ("update", "Update, Delete or ConditionCheck"),
        ("conditioned", "condition of its own"),
        ("keyless", "without its key attribute \"order_id\""),
    ];
    for (i, (shape, says)) in cases.into_iter().enumerate() {
        let body = format!(r#"{{"id":"evt-{i}","order":"o-{i}","shape":"{shape}"}}"#);
        let o = p.process(Message::new(format!("m{i}"), body.clone())).await;
        assert!(
            matches!(&o, Outcome::Park { reason } if reason.contains(says) && reason.contains("Effects::Insert")),
            "{shape}: {o:?}"
        );
        // Recorded FAILED, as a fast-path failure is: a redelivery of the
        // parked message is parked again without running.
        let pk = p.config.record_key(&format!("evt-{i}"));
        let rec = store.get(&pk).await.unwrap().unwrap();
        assert_eq!(rec.status, Status::Failed);
        let before = runs.load(Ordering::SeqCst);
        let again = Message::new(format!("m{i}"), body).with_receive_count(2);
        let o = p.process(again).await;
        assert!(
            matches!(&o, Outcome::Park { reason } if reason.contains("redelivered after it was parked")),
            "{o:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), before, "not run again");
    }
    assert!(store.items(TABLE).is_empty());
    let mut commits = 0;
    store.for_each_committed(|w| commits += w.len());
    assert_eq!(commits, 0);
}

#[tokio::test]
async fn a_handler_that_sends_is_refused() {
    let store = MemoryStore::default();
    let handler = insert_once(
        &["order_id"],
        handler_fn(|_m: Message, ctx: Context| async move {
            ctx.stage(order_put("o-1", 1));
            ctx.send(
                "https://sqs.eu-west-1.amazonaws.com/123456789012/shipped",
                "o-1",
            )?;
            Ok(None)
        }),
    );
    let queue = crate::testkit::MemoryQueue::new();
    let p = Processor::new(store.clone(), handler, config(PayloadMismatch::Warn))
        .unwrap()
        .with_dispatcher(queue);
    let o = p.process(Message::new("m1", r#"{"id":"evt-1"}"#)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("records no outbox")),
        "{o:?}"
    );
    assert!(store.items(TABLE).is_empty());
}

#[tokio::test]
async fn an_unavailable_store_writes_nothing_and_the_message_comes_back() {
    let store = MemoryStore::default();
    let (_, handler) = orders();
    let p = Processor::new(store.clone(), handler, config(PayloadMismatch::Warn)).unwrap();
    store.set_unavailable(true);
    let body = r#"{"id":"evt-1","order":"o-1","amount":5}"#;
    let o = p.process(Message::new("m1", body)).await;
    assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    assert!(store.items(TABLE).is_empty());
    store.set_unavailable(false);
    let o = p
        .process(Message::new("m1", body).with_receive_count(2))
        .await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(store.items(TABLE).len(), 1);
}

#[test]
fn a_refused_put_is_answered_from_the_item_in_the_way() {
    let c = InsertCommit {
        pk: "shop#evt-1".into(),
        payload_sha256: "p1".into(),
        table: TABLE.into(),
        key: vec!["order_id".into()],
        item: HashMap::from([("order_id".to_owned(), AttributeValue::S("o-1".into()))]),
    };
    let ours = c.marked_item();
    // Our own earlier send, its answer lost: ours.
    assert_eq!(c.found(&ours, true), Inserted::Inserted);
    // Found without a send of ours in doubt: an earlier delivery's.
    assert_eq!(
        c.found(&ours, false),
        Inserted::Duplicate {
            payload_matches: true
        }
    );
    let mut other_body = ours.clone();
    other_body.insert(
        INSERT_PAYLOAD_ATTRIBUTE.into(),
        AttributeValue::S("p2".into()),
    );
    assert_eq!(
        c.found(&other_body, true),
        Inserted::Duplicate {
            payload_matches: false
        }
    );
    let mut other_key = ours.clone();
    other_key.insert(
        INSERT_KEY_ATTRIBUTE.into(),
        AttributeValue::S("shop#evt-2".into()),
    );
    assert_eq!(
        c.found(&other_key, true),
        Inserted::Taken {
            by: Some("shop#evt-2".into())
        }
    );
    assert_eq!(c.found(&c.item, true), Inserted::Taken { by: None });
}

#[test]
fn an_insert_shaped_handler_without_a_key_is_refused_at_start() {
    let handler = insert_once(
        &[],
        handler_fn(|_m: Message, _ctx: Context| async { Ok(None) }),
    );
    let started = Processor::new(
        MemoryStore::default(),
        handler,
        config(PayloadMismatch::Warn),
    );
    let Err(e) = started else {
        panic!("an insert-shaped handler without a key attribute started");
    };
    assert_eq!(e.setting, "insert_once");
    assert!(e.problem.contains("key attributes"), "{e}");
}

#[tokio::test]
async fn a_redelivery_completed_by_another_path_is_a_duplicate_and_runs_nothing() {
    // A consumer switched to the insert path while a message completed by
    // the fast path was still in flight: its redelivery finds that record.
    let store = MemoryStore::default();
    let staged = Processor::new(
        store.clone(),
        crate::staged_only(handler_fn(
            |_m: Message, _ctx: Context| async move { Ok(None) },
        )),
        config(PayloadMismatch::Park),
    )
    .unwrap();
    let body = r#"{"id":"evt-1","order":"o-1","amount":5}"#;
    let first = staged.process(Message::new("m1", body)).await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    let (runs, handler) = orders();
    let insert = Processor::new(store.clone(), handler, config(PayloadMismatch::Park)).unwrap();
    let again = insert
        .process(Message::new("m1", body).with_receive_count(2))
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
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler did not run");
    assert!(store.items(TABLE).is_empty(), "nothing inserted");
}
