//! The insert path (`Effects::Insert`) on DynamoDB: the item is the
//! record, one conditional `PutItem` per message; counted exactly once.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use sqs_once::config::ProcessorConfig;
use sqs_once::store::{INSERT_KEY_ATTRIBUTE, INSERT_PAYLOAD_ATTRIBUTE};
use sqs_once::{
    Context, DedupStore, DynamoStore, HandlerError, Message, Outcome, PayloadMismatch, Processor,
    handler_fn, insert_once,
};

use crate::common::{ddb, ddb_losing, dedup_table, unique};

/// Counts the DynamoDB requests sent, by operation (every attempt).
#[derive(Debug, Default, Clone)]
struct CountCalls(Arc<Mutex<BTreeMap<String, u32>>>);

impl Intercept for CountCalls {
    fn name(&self) -> &'static str {
        "CountCalls"
    }

    fn read_before_transmit(
        &self,
        _ctx: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let op = cfg
            .load::<Metadata>()
            .map_or_else(|| "?".to_owned(), |m| m.name().to_owned());
        *self.0.lock().unwrap().entry(op).or_default() += 1;
        Ok(())
    }
}

impl CountCalls {
    fn take(&self) -> BTreeMap<String, u32> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

async fn counting_client() -> (aws_sdk_dynamodb::Client, CountCalls) {
    let calls = CountCalls::default();
    let conf = aws_sdk_dynamodb::config::Builder::from(&crate::common::sdk_config().await)
        .interceptor(calls.clone())
        .build();
    (aws_sdk_dynamodb::Client::from_conf(conf), calls)
}

/// An orders table (key `pk`).
async fn orders_table(client: &aws_sdk_dynamodb::Client) -> String {
    let name = unique("orders");
    sqs_once_cli::setup::ensure_table(client, &name)
        .await
        .unwrap();
    name
}

/// The ledger's event as an insert: `{"id", "account", "amount_cents"}`
/// makes the item `pk = id`, with the account and amount (the ledger
/// example's item size).
fn processor(
    client: &aws_sdk_dynamodb::Client,
    dedup: &str,
    orders: &str,
    mismatch: PayloadMismatch,
    runs: Arc<AtomicU32>,
) -> Processor<DynamoStore, impl sqs_once::Handler + Clone> {
    processor_as("ledger", client, dedup, orders, mismatch, runs)
}

/// [`processor`] as consumer `consumer`.
fn processor_as(
    consumer: &str,
    client: &aws_sdk_dynamodb::Client,
    dedup: &str,
    orders: &str,
    mismatch: PayloadMismatch,
    runs: Arc<AtomicU32>,
) -> Processor<DynamoStore, impl sqs_once::Handler + Clone> {
    let table = orders.to_owned();
    let handler = insert_once(
        &["pk"],
        handler_fn(move |m: Message, ctx: Context| {
            let (table, runs) = (table.clone(), runs.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let e: serde_json::Value = m.json().map_err(HandlerError::permanent)?;
                let put = Put::builder()
                    .table_name(table)
                    .item("pk", AttributeValue::S(e["id"].as_str().unwrap().into()))
                    .item(
                        "account",
                        AttributeValue::S(e["account"].as_str().unwrap().into()),
                    )
                    .item(
                        "amount_cents",
                        AttributeValue::N(e["amount_cents"].to_string()),
                    )
                    .build()?;
                ctx.stage(TransactWriteItem::builder().put(put).build());
                if e["second"].as_bool() == Some(true) {
                    let again = Put::builder()
                        .table_name("elsewhere")
                        .item("pk", AttributeValue::S("x".into()))
                        .build()?;
                    ctx.stage(TransactWriteItem::builder().put(again).build());
                }
                Ok(None)
            }
        }),
    );
    let mut config = ProcessorConfig::new(consumer);
    config.key_source = "json:/id".parse().unwrap();
    config.payload_mismatch = mismatch;
    let store = DynamoStore::new(client.clone(), dedup.to_owned());
    Processor::new(store, handler, config).unwrap()
}

fn event(id: &str, account: &str, amount: i64) -> String {
    serde_json::json!({"id": id, "account": account, "amount_cents": amount}).to_string()
}

async fn items(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Vec<HashMap<String, AttributeValue>> {
    let mut pages = client
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    let mut all = Vec::new();
    while let Some(item) = pages.next().await {
        all.push(item.unwrap());
    }
    all.sort_by(|a, b| a["pk"].as_s().unwrap().cmp(b["pk"].as_s().unwrap()));
    all
}

fn amount(item: &HashMap<String, AttributeValue>) -> i64 {
    item["amount_cents"].as_n().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_insert_each_item_once_with_one_put_per_message_and_no_dedup_record() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (client, calls) = counting_client().await;
    let (dedup, orders) = (dedup_table(&client).await, orders_table(&client).await);
    calls.take();
    let runs = Arc::new(AtomicU32::new(0));
    let p = processor(
        &client,
        &dedup,
        &orders,
        PayloadMismatch::Warn,
        runs.clone(),
    );

    // One first delivery: one PutItem, nothing else.
    let o = p
        .process(Message::new("m-solo", event("evt-solo", "a", 7)))
        .await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(
        calls.take(),
        BTreeMap::from([("PutItem".to_owned(), 1)]),
        "one call per new message"
    );
    // Its duplicate: one PutItem, refused, answered from the item it returned.
    let o = p
        .process(Message::new("m-solo", event("evt-solo", "a", 7)))
        .await;
    assert!(
        matches!(
            o,
            Outcome::Duplicate {
                payload_matches: true,
                ..
            }
        ),
        "{o:?}"
    );
    assert_eq!(calls.take(), BTreeMap::from([("PutItem".to_owned(), 1)]));

    // 20 events, each delivered 3 times at once (SQS's copy, and a
    // producer's re-send under a new message id).
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..20 {
        for copy in 0..3 {
            let p = p.clone();
            let mid = if copy == 2 {
                format!("m{i}-resend")
            } else {
                format!("m{i}")
            };
            let body = event(&format!("evt-{i:02}"), &format!("acct-{}", i % 4), 100 + i);
            tasks.spawn(async move { p.process(Message::new(mid, body)).await });
        }
    }
    let mut outcomes: BTreeMap<&'static str, u32> = BTreeMap::new();
    while let Some(o) = tasks.join_next().await {
        *outcomes.entry(o.unwrap().name()).or_default() += 1;
    }
    assert_eq!(outcomes.get("completed"), Some(&20), "{outcomes:?}");
    assert_eq!(outcomes.get("duplicate"), Some(&40), "{outcomes:?}");
    let counted = calls.take();
    assert_eq!(
        counted,
        BTreeMap::from([("PutItem".to_owned(), 60)]),
        "{counted:?}"
    );

    // Each event's item exactly once, none lost, the first body's.
    let all = items(&client, &orders).await;
    assert_eq!(all.len(), 21);
    for (i, item) in all.iter().take(20).enumerate() {
        assert_eq!(item["pk"].as_s().unwrap(), &format!("evt-{i:02}"));
        assert_eq!(amount(item), 100 + i as i64);
        assert_eq!(
            item[INSERT_KEY_ATTRIBUTE].as_s().unwrap(),
            &format!("ledger#evt-{i:02}")
        );
        assert_eq!(item[INSERT_PAYLOAD_ATTRIBUTE].as_s().unwrap().len(), 64);
    }
    // The item is the record: the dedup table holds nothing.
    assert!(items(&client, &dedup).await.is_empty());
    // The item's size with its marker, by DynamoDB's rules: one write unit.
    let size: usize = all[0]
        .iter()
        .map(|(k, v)| {
            k.len()
                + match v {
                    AttributeValue::S(s) => s.len(),
                    AttributeValue::N(n) => n.len().div_ceil(2) + 1,
                    _ => 0,
                }
        })
        .sum();
    assert!(size <= 1024, "{size} bytes");
    eprintln!(
        "insert path: item with its marker {size} B; calls for the 60 concurrent messages: {counted:?}"
    );
}

#[tokio::test]
async fn a_lost_put_response_is_found_by_its_marker_and_applies_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = ddb().await;
    let (dedup, orders) = (dedup_table(&plain).await, orders_table(&plain).await);
    let runs = Arc::new(AtomicU32::new(0));

    // The first answer lost after the put applied: the store's own retry
    // meets the condition and finds our marker.
    let (losing, lost) = ddb_losing("PutItem", 1).await;
    let p = processor(
        &losing,
        &dedup,
        &orders,
        PayloadMismatch::Park,
        runs.clone(),
    );
    let o = p.process(Message::new("m1", event("evt-1", "a", 5))).await;
    assert_eq!(lost.load(Ordering::SeqCst), 1, "the answer was really lost");
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(p.metrics().take().unknown_resolved, 1);

    // Every answer lost (the outcome stays unknown): the message comes
    // back, and its redelivery finds the item ours.
    let (losing, lost) = ddb_losing("PutItem", 4).await;
    let p = processor(
        &losing,
        &dedup,
        &orders,
        PayloadMismatch::Park,
        runs.clone(),
    );
    let o = p.process(Message::new("m2", event("evt-2", "b", 6))).await;
    assert_eq!(lost.load(Ordering::SeqCst), 4);
    assert!(matches!(o, Outcome::Retry { .. }), "{o:?}");
    let p = processor(&plain, &dedup, &orders, PayloadMismatch::Park, runs.clone());
    let again = Message::new("m2", event("evt-2", "b", 6)).with_receive_count(2);
    let o = p.process(again).await;
    assert!(
        matches!(
            o,
            Outcome::Duplicate {
                payload_matches: true,
                ..
            }
        ),
        "{o:?}"
    );

    let all = items(&plain, &orders).await;
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!((amount(&all[0]), amount(&all[1])), (5, 6));
}

#[tokio::test]
async fn someone_elses_item_and_another_body_are_refused_as_mismatches_and_left_as_they_are() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (dedup, orders) = (dedup_table(&client).await, orders_table(&client).await);
    let runs = Arc::new(AtomicU32::new(0));
    let park = processor(
        &client,
        &dedup,
        &orders,
        PayloadMismatch::Park,
        runs.clone(),
    );
    let warn = processor(
        &client,
        &dedup,
        &orders,
        PayloadMismatch::Warn,
        runs.clone(),
    );

    // An item another tool wrote under the key.
    client
        .put_item()
        .table_name(&orders)
        .item("pk", AttributeValue::S("evt-9".into()))
        .item("amount_cents", AttributeValue::N("99".into()))
        .send()
        .await
        .unwrap();
    let o = park
        .process(Message::new("m9", event("evt-9", "a", 1)))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("outside sqs-once")),
        "{o:?}"
    );
    // Under `warn` too: another event's item is never let go as done.
    let o = warn
        .process(Message::new("m9", event("evt-9", "a", 1)))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("outside sqs-once")),
        "{o:?}"
    );

    // Another message's item: an event whose id another event's item holds.
    let o = park
        .process(Message::new("m1", event("evt-1", "a", 5)))
        .await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    // Another consumer (its own records) inserting the same item: another
    // message's item.
    let billing = processor_as(
        "billing",
        &client,
        &dedup,
        &orders,
        PayloadMismatch::Park,
        runs.clone(),
    );
    let o = billing
        .process(Message::new("m1", event("evt-1", "a", 5)))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("another message") && reason.contains("ledger#evt-1")),
        "{o:?}"
    );
    assert_eq!(billing.metrics().take().payload_mismatches, 1);

    // Another body under the same key.
    let o = park
        .process(Message::new("m1b", event("evt-1", "a", 500)))
        .await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("payload mismatch")),
        "{o:?}"
    );
    let o = warn
        .process(Message::new("m1c", event("evt-1", "a", 500)))
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

    let all = items(&client, &orders).await;
    assert_eq!(all.len(), 2);
    assert_eq!(amount(&all[0]), 5, "the first effect stands");
    assert_eq!(amount(&all[1]), 99, "the other tool's item stands");
    assert!(!all[1].contains_key(INSERT_KEY_ATTRIBUTE));
    let mismatches =
        park.metrics().take().payload_mismatches + warn.metrics().take().payload_mismatches;
    assert_eq!(mismatches, 4);
}

#[tokio::test]
async fn a_second_staged_write_is_refused_at_the_first_message_and_nothing_is_written() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let (dedup, orders) = (dedup_table(&client).await, orders_table(&client).await);
    let runs = Arc::new(AtomicU32::new(0));
    let p = processor(
        &client,
        &dedup,
        &orders,
        PayloadMismatch::Warn,
        runs.clone(),
    );
    let body =
        serde_json::json!({"id": "evt-1", "account": "a", "amount_cents": 1, "second": true})
            .to_string();
    let o = p.process(Message::new("m1", body)).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.contains("exactly one Put")),
        "{o:?}"
    );
    assert!(items(&client, &orders).await.is_empty());
    let rec = p.store().get("ledger#evt-1").await.unwrap().unwrap();
    assert_eq!(rec.status, sqs_once::Status::Failed);
}
