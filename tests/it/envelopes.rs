//! An SNS notification envelope on a real queue: the poller opens it, keys
//! the message by a field of the inner payload, and runs the handler on that
//! payload. SNS itself is not in the LocalStack these tests run, so the
//! bodies are written as SNS writes them (the fixture from the SNS Developer
//! Guide, with a JSON message).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqs_once::{Envelope, HandlerError, HandlerResult, KeySource, Message, SqsOnce, handler_fn};
use tokio_util::sync::CancellationToken;

use crate::common::{
    bodies_with_reasons, ddb, dedup_table, depth, queues, sdk_config, send_all, sqs,
};

/// The SNS fixture with `sns_id` as its `MessageId` and an order as its message.
fn sns_envelope(sns_id: &str, order: &str) -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/envelopes/sns-notification-order.json"
    );
    let mut n: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    n["MessageId"] = sns_id.into();
    n["Message"] = serde_json::json!({ "orderId": order, "amount": 42 })
        .to_string()
        .into();
    n.to_string()
}

#[tokio::test]
async fn one_event_in_two_sns_envelopes_has_its_effect_once_through_the_poller() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let table = dedup_table(&ddb).await;
    // o-1 published twice (two SNS message ids), o-2 once, and one body
    // that is no SNS envelope at all.
    let bodies = vec![
        sns_envelope("sns-a", "o-1"),
        sns_envelope("sns-b", "o-1"),
        sns_envelope("sns-c", "o-2"),
        r#"{"orderId":"o-3"}"#.to_owned(),
    ];
    send_all(&sqs, &q.queue_url, &bodies).await;

    let effects = Arc::new(Mutex::new(BTreeMap::<String, u32>::new()));
    let outer = Arc::new(Mutex::new(Vec::new()));
    let (seen, raw) = (effects.clone(), outer.clone());
    let handler = handler_fn(move |m: Message, _ctx| {
        let (seen, raw) = (seen.clone(), raw.clone());
        async move {
            let order: serde_json::Value = m.json().map_err(HandlerError::permanent)?;
            let id = order["orderId"].as_str().unwrap_or_default().to_owned();
            *seen.lock().unwrap().entry(id).or_insert(0) += 1;
            raw.lock()
                .unwrap()
                .push((m.envelope(), m.raw_body().to_owned()));
            HandlerResult::Ok(None)
        }
    });
    let report = SqsOnce::builder(&table, "envelopes")
        .sdk_config(sdk_config().await)
        .key("json:/orderId".parse::<KeySource>().unwrap())
        .envelope(Envelope::Sns)
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
    let expected: BTreeMap<String, u32> = [("o-1".to_owned(), 1), ("o-2".to_owned(), 1)].into();
    assert_eq!(effects, expected, "each order's effect exactly once");
    assert_eq!(report.stats.received, 4, "{report:?}");
    assert_eq!(report.stats.duplicates, 1, "{report:?}");
    assert_eq!(report.stats.parked, 1, "{report:?}");
    for (envelope, raw) in outer.lock().unwrap().iter() {
        assert_eq!(*envelope, Some(Envelope::Sns));
        assert!(
            raw.contains("\"TopicArn\""),
            "the envelope is reachable: {raw}"
        );
    }
    assert_eq!(
        depth(&sqs, &q.queue_url).await,
        0,
        "nothing left in the queue"
    );
    let parked = bodies_with_reasons(&sqs, &q.dlq_url).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].0, r#"{"orderId":"o-3"}"#, "parked as received");
    assert!(
        parked[0].1.contains("not an sns envelope"),
        "the reason names the envelope: {parked:?}"
    );
}
