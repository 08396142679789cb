//! The front door (`SqsOnce`) against LocalStack, used as a user's own `main`
//! would: a poller and a Lambda adapter built by it, with effects counted, and
//! start-up failures that name the problem.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sqs_once::{HandlerError, HandlerResult, KeySource, Message, SqsOnce, StartError, handler_fn};
use tokio_util::sync::CancellationToken;

use crate::common::{ddb, dedup_table, depth, queues, sdk_config, send_all, sqs, unique};
use crate::lambda::receive_event;

/// A handler that counts its effect per order id (a body without one is a
/// permanent failure).
fn counting() -> (Arc<Mutex<BTreeMap<String, u32>>>, impl sqs_once::Handler) {
    let effects = Arc::new(Mutex::new(BTreeMap::new()));
    let seen = effects.clone();
    let handler = handler_fn(move |message: Message, _ctx| {
        let seen = seen.clone();
        async move {
            let body: serde_json::Value = message.json().map_err(HandlerError::permanent)?;
            let id = body["order_id"].as_str().unwrap_or_default().to_owned();
            *seen.lock().unwrap().entry(id).or_insert(0) += 1;
            HandlerResult::Ok(None)
        }
    });
    (effects, handler)
}

fn order(id: &str) -> String {
    serde_json::json!({ "order_id": id }).to_string()
}

#[tokio::test]
async fn the_front_door_runs_a_poller_that_applies_each_order_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let table = dedup_table(&ddb).await;
    // Three orders, two sent twice, and one body with no order id.
    let mut bodies: Vec<String> = ["o-1", "o-2", "o-3", "o-1", "o-3"].map(order).to_vec();
    bodies.push(r#"{"note":"no order id"}"#.to_owned());
    send_all(&sqs, &q.queue_url, &bodies).await;

    let (effects, handler) = counting();
    let report = SqsOnce::builder(&table, "front-door")
        .sdk_config(sdk_config().await)
        .key("json:/order_id".parse::<KeySource>().unwrap())
        .queue_url(&q.queue_url)
        .dlq_url(&q.dlq_url)
        .poller_config(|c| {
            c.wait_time = Duration::from_secs(1);
            c.exit_when_idle = Some(Duration::from_secs(3));
            c.metrics_interval = None;
        })
        .shutdown_on(CancellationToken::new())
        .run_poller(handler)
        .await
        .expect("the poller starts and runs until idle");

    let effects = effects.lock().unwrap().clone();
    let expected: BTreeMap<String, u32> = [("o-1", 1), ("o-2", 1), ("o-3", 1)]
        .map(|(k, v)| (k.to_owned(), v))
        .into();
    assert_eq!(effects, expected, "each order applied exactly once");
    assert_eq!(report.stats.received, 6, "{report:?}");
    assert_eq!(report.stats.duplicates, 2, "{report:?}");
    assert_eq!(report.stats.parked, 1, "{report:?}");
    assert!(
        report.calls.contains_key("DynamoDB.DescribeTable"),
        "{:?}",
        report.calls
    );
    assert_eq!(
        depth(&sqs, &q.queue_url).await,
        0,
        "nothing left in the queue"
    );
    // No TTL set: fitted to the source's retention (4 days, SQS's default)
    // plus its DLQ's (14 days, as `sqs-once init` makes it) plus a day.
    let store = sqs_once::DynamoStore::new(ddb.clone(), table.as_str());
    let record = sqs_once::DedupStore::get(&store, "front-door#o-1")
        .await
        .unwrap()
        .expect("o-1's record");
    let kept_s = record.expires_at_s - record.claimed_at_ms.unwrap() / 1000;
    assert!(
        (19 * 86_400 - 60..=19 * 86_400 + 60).contains(&kept_s),
        "the record is kept {kept_s} s, not 4 + 14 + 1 days"
    );
    // No secret set: the consumer made one and kept it in the table, and
    // sealed the parked copy's first message id with it.
    let secret = store
        .table_carry_secret(false)
        .await
        .unwrap()
        .expect("the consumer kept a carry secret in the table");
    let parked = crate::common::receive_all(&sqs, &q.dlq_url).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    let copy = &parked[0];
    let reason = copy.message_attributes().unwrap()["sqs_once_reason"]
        .string_value()
        .unwrap();
    assert!(
        reason.contains("order_id"),
        "the reason names the key: {reason}"
    );
    let sealed = copy.message_attributes().unwrap()[sqs_once::parking::MESSAGE_ID_ATTRIBUTE]
        .string_value()
        .unwrap();
    assert!(
        secret
            .open(
                sqs_once::parking::MESSAGE_ID_ATTRIBUTE,
                copy.body().unwrap(),
                sealed
            )
            .is_some(),
        "the parked copy's first id is sealed with the table's secret"
    );
}

#[tokio::test]
async fn the_front_door_builds_a_lambda_adapter_that_applies_each_order_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let table = dedup_table(&ddb).await;
    send_all(&sqs, &q.queue_url, &["o-1", "o-2", "o-1"].map(order)).await;
    let event = receive_event(&sqs, &q.queue_url, 3).await;

    let (effects, handler) = counting();
    let adapter = SqsOnce::builder(&table, "front-door-lambda")
        .sdk_config(sdk_config().await)
        .key("json:/order_id".parse::<KeySource>().unwrap())
        .lambda_config(|c| c.emf = false)
        .lambda_adapter(handler)
        .await
        .expect("the table check passes");
    let answer = adapter
        .handle(event, SystemTime::now() + Duration::from_secs(30))
        .await
        .expect("the batch is answered");

    assert!(answer.batch_item_failures.is_empty(), "{answer:?}");
    let effects = effects.lock().unwrap().clone();
    let expected: BTreeMap<String, u32> = [("o-1", 1), ("o-2", 1)]
        .map(|(k, v)| (k.to_owned(), v))
        .into();
    assert_eq!(effects, expected, "each order applied exactly once");
}

/// `hash_keys(true)`: the records are kept under `sha256:` of each order id,
/// never under the id itself, and duplicates are still caught.
#[tokio::test]
async fn the_front_door_keys_records_by_a_hash_when_asked() {
    if !crate::common::localstack_up().await {
        return;
    }
    use sqs_once::DedupStore;
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let table = dedup_table(&ddb).await;
    send_all(&sqs, &q.queue_url, &["o-1", "o-1"].map(order)).await;
    let event = receive_event(&sqs, &q.queue_url, 2).await;

    let (effects, handler) = counting();
    let adapter = SqsOnce::builder(&table, "front-door-hashed")
        .sdk_config(sdk_config().await)
        .key("json:/order_id".parse::<KeySource>().unwrap())
        .hash_keys(true)
        .lambda_config(|c| c.emf = false)
        .lambda_adapter(handler)
        .await
        .expect("the table check passes");
    let answer = adapter
        .handle(event, SystemTime::now() + Duration::from_secs(30))
        .await
        .expect("the batch is answered");
    assert!(answer.batch_item_failures.is_empty(), "{answer:?}");
    assert_eq!(effects.lock().unwrap()["o-1"], 1, "applied once");
    let store = sqs_once::DynamoStore::new(ddb.clone(), table.as_str());
    let hashed = sqs_once::key::hashed_record_key("front-door-hashed", "o-1");
    let record = store.get(&hashed).await.unwrap();
    assert_eq!(record.map(|r| r.status), Some(sqs_once::Status::Completed));
    let plain = sqs_once::key::record_key("front-door-hashed", "o-1");
    assert_eq!(store.get(&plain).await.unwrap(), None);
}

#[tokio::test]
async fn the_front_door_names_a_missing_table_at_start_up() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    let missing = unique("no-such-table");
    let (effects, handler) = counting();
    let err = SqsOnce::builder(&missing, "front-door")
        .sdk_config(sdk_config().await)
        .queue_url(&q.queue_url)
        .shutdown_on(CancellationToken::new())
        .run_poller(handler)
        .await
        .expect_err("a missing table is a start-up failure");
    assert!(matches!(err, StartError::Table(_)), "{err:?}");
    assert!(!err.is_transient(), "{err:?}");
    assert!(err.to_string().contains(&missing), "{err}");
    assert!(effects.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_front_door_rejects_a_poller_without_a_queue() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (effects, handler) = counting();
    let err = SqsOnce::builder("any-table", "front-door")
        .sdk_config(sdk_config().await)
        .shutdown_on(CancellationToken::new())
        .run_poller(handler)
        .await
        .expect_err("no queue URL");
    assert!(err.to_string().contains("SQS_ONCE_QUEUE_URL"), "{err}");
    assert!(effects.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_front_door_creates_its_table_on_localstack_when_asked() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let fresh = unique("ensured");
    send_all(&sqs, &q.queue_url, &[order("o-1"), order("o-1")]).await;
    let run = |handler| {
        let (table, queue_url, dlq_url) = (fresh.clone(), q.queue_url.clone(), q.dlq_url.clone());
        async move {
            SqsOnce::builder(&table, "front-door-ensured")
                .sdk_config(sdk_config().await)
                .key("json:/order_id".parse::<KeySource>().unwrap())
                .queue_url(&queue_url)
                .dlq_url(&dlq_url)
                .ensure_table()
                .poller_config(|c| {
                    c.wait_time = Duration::from_secs(1);
                    c.exit_when_idle = Some(Duration::from_secs(2));
                    c.metrics_interval = None;
                })
                .shutdown_on(CancellationToken::new())
                .run_poller(handler)
                .await
        }
    };
    let (effects, handler) = counting();
    let report = run(handler)
        .await
        .expect("the poller creates its table, starts and runs until idle");
    assert_eq!(effects.lock().unwrap().get("o-1"), Some(&1), "{report:?}");
    assert_eq!(report.stats.duplicates, 1, "{report:?}");
    assert!(
        report.calls.contains_key("DynamoDB.CreateTable"),
        "{:?}",
        report.calls
    );
    // The table `sqs-once init` makes: its check finds nothing to change.
    let check = sqs_once_cli::setup::init_dedup_table(&ddb, &fresh, &[])
        .await
        .expect("the table exists");
    assert!(
        check.created.is_empty() && check.changed.is_empty() && check.differences.is_empty(),
        "{check:?}"
    );
    // A second start finds the table and creates nothing.
    send_all(&sqs, &q.queue_url, &[order("o-2")]).await;
    let (effects, handler) = counting();
    let report = run(handler).await.expect("starts on the existing table");
    assert_eq!(effects.lock().unwrap().get("o-2"), Some(&1), "{report:?}");
    assert!(
        !report.calls.contains_key("DynamoDB.CreateTable"),
        "{:?}",
        report.calls
    );
}

/// Consumer `consumer`'s stamp as the table holds it.
async fn stamp(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    consumer: &str,
) -> std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue> {
    ddb.get_item()
        .table_name(table)
        .key(
            "pk",
            aws_sdk_dynamodb::types::AttributeValue::S(sqs_once::aws::dynamodb::stamp_key(
                consumer,
            )),
        )
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_build_whose_key_derivation_or_record_format_differs_from_the_tables_stamp_refuses_to_start()
 {
    use aws_sdk_dynamodb::types::AttributeValue;
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let table = dedup_table(&ddb).await;
    let consumer = "stamped";
    let start = |key: &'static str| {
        let (effects, handler) = counting();
        let (table, queue_url, dlq_url) = (table.clone(), q.queue_url.clone(), q.dlq_url.clone());
        async move {
            let ran = SqsOnce::builder(&table, consumer)
                .sdk_config(sdk_config().await)
                .key(key.parse::<KeySource>().unwrap())
                .queue_url(&queue_url)
                .dlq_url(&dlq_url)
                .poller_config(|c| {
                    c.wait_time = Duration::from_secs(1);
                    c.exit_when_idle = Some(Duration::from_secs(2));
                    c.metrics_interval = None;
                })
                .shutdown_on(CancellationToken::new())
                .run_poller(handler)
                .await
                .map(|_| ());
            (ran, effects.lock().unwrap().values().sum::<u32>())
        }
    };

    // The first start stamps the table with this build's numbers and the
    // key settings in force.
    send_all(&sqs, &q.queue_url, &[order("o-1")]).await;
    let (ran, applied) = start("json:/order_id").await;
    ran.expect("the first start stamps and runs");
    assert_eq!(applied, 1);
    let first = stamp(&ddb, &table, consumer).await;
    assert_eq!(
        first["key_derivation"].as_n().unwrap(),
        &sqs_once::key::KEY_DERIVATION.to_string()
    );
    assert_eq!(
        first["record_format"].as_n().unwrap(),
        &sqs_once::aws::dynamodb::RECORD_FORMAT.to_string()
    );
    assert!(
        first["key_settings"]
            .as_s()
            .unwrap()
            .contains("key=json:/order_id"),
        "{first:?}"
    );
    // The record the fast path wrote carries its format.
    let record = ddb
        .get_item()
        .table_name(&table)
        .key("pk", AttributeValue::S(format!("{consumer}#o-1")))
        .send()
        .await
        .unwrap();
    assert_eq!(
        record.item().unwrap()["fmt"].as_n().unwrap(),
        &sqs_once::aws::dynamodb::RECORD_FORMAT.to_string()
    );

    // A stamp naming another key derivation (records made by a build that
    // derives keys otherwise): refused before anything is received, with
    // what to do; the message waits in the queue, not run.
    let put = |derivation: u32, format: u32| {
        let (ddb, table) = (ddb.clone(), table.clone());
        async move {
            let mut item = stamp(&ddb, &table, consumer).await;
            item.insert(
                "key_derivation".into(),
                AttributeValue::N(derivation.to_string()),
            );
            item.insert(
                "record_format".into(),
                AttributeValue::N(format.to_string()),
            );
            ddb.put_item()
                .table_name(&table)
                .set_item(Some(item))
                .send()
                .await
                .unwrap();
        }
    };
    put(
        sqs_once::key::KEY_DERIVATION + 1,
        sqs_once::aws::dynamodb::RECORD_FORMAT,
    )
    .await;
    send_all(&sqs, &q.queue_url, &[order("o-2")]).await;
    let (ran, applied) = start("json:/order_id").await;
    let err = ran.expect_err("a different key derivation is refused");
    assert!(matches!(err, StartError::Stamp(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("key derivation")
            && text.contains("drained")
            && text.contains("event source mapping"),
        "the refusal says what changed and what to do: {text}"
    );
    assert_eq!(applied, 0, "nothing ran");
    assert_eq!(depth(&sqs, &q.queue_url).await, 1, "o-2 waits in the queue");

    // Records of a newer format: refused too.
    put(
        sqs_once::key::KEY_DERIVATION,
        sqs_once::aws::dynamodb::RECORD_FORMAT + 1,
    )
    .await;
    let (ran, _) = start("json:/order_id").await;
    let err = ran.expect_err("a newer record format is refused");
    assert!(err.to_string().contains("record format"), "{err}");

    // This build's numbers again, and the key settings changed by the
    // operator: it starts (warning), and the stamp takes the new settings.
    put(
        sqs_once::key::KEY_DERIVATION,
        sqs_once::aws::dynamodb::RECORD_FORMAT,
    )
    .await;
    let (ran, applied) = start("json:/order_id,sender").await;
    ran.expect("changed key settings start, with a warning");
    assert_eq!(applied, 1, "o-2 ran once");
    let after = stamp(&ddb, &table, consumer).await;
    assert!(
        after["key_settings"].as_s().unwrap().contains("sender"),
        "{after:?}"
    );
}
