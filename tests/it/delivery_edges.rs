//! The edges of delivery, against LocalStack (SQS and DynamoDB semantics):
//! messages held longer than their visibility timeout (waiting in a FIFO
//! lane, a copy of a key in flight elsewhere), parking (every attribute kept,
//! a body near the size limit, requests DynamoDB rejects, a parked message
//! redelivered and a copy brought back), and shutdown.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};
use sqs_once::config::ProcessorConfig;
use sqs_once::dynamodb_types::{AttributeValue, Put, TransactWriteItem};
use sqs_once::parking::Dlq;
use sqs_once::poller::PollerConfig;
use sqs_once::{
    Context, DedupStore, DynamoStore, Handler, HandlerError, HandlerResult, Message, Outcome,
    Processor, handler_fn,
};
use tokio_util::sync::CancellationToken;

use crate::common::{carry_secret, ddb, dedup_table, depth, sqs, unique};

fn string_attr(v: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(v)
        .build()
        .unwrap()
}

/// A queue and its DLQ with the given visibility timeout and maxReceiveCount.
async fn queue_pair(
    sqs: &aws_sdk_sqs::Client,
    fifo: bool,
    visibility: u64,
    max_receives: u32,
) -> sqs_once_cli::setup::QueuePair {
    sqs_once_cli::setup::ensure_queue_with_dlq(
        sqs,
        &unique("edges"),
        fifo,
        Duration::from_secs(visibility),
        max_receives,
    )
    .await
    .unwrap()
}

/// Receives every message of a queue (all attributes), until it answers empty.
async fn drain(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<aws_sdk_sqs::types::Message> {
    let mut out = Vec::new();
    loop {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            return out;
        }
        out.extend(got);
    }
}

/// Runs `n` pollers (processor settings `pc`, dedup table `table`) over `q`
/// until it is empty (at most 90 s), then stops them; their stats.
async fn pollers_until_empty<H: Handler + Clone>(
    sqs: &aws_sdk_sqs::Client,
    ddb: &aws_sdk_dynamodb::Client,
    q: &sqs_once_cli::setup::QueuePair,
    table: &str,
    handler: H,
    pc: &ProcessorConfig,
    n: usize,
) -> Vec<sqs_once::poller::RunStats> {
    let store = || DynamoStore::new(ddb.clone(), table);
    pollers_on_until_empty(sqs, q, store, handler, pc, n).await
}

/// [`pollers_until_empty`], each poller on the store `store` makes.
async fn pollers_on_until_empty<S: DedupStore, H: Handler + Clone>(
    sqs: &aws_sdk_sqs::Client,
    q: &sqs_once_cli::setup::QueuePair,
    store: impl Fn() -> S,
    handler: H,
    pc: &ProcessorConfig,
    n: usize,
) -> Vec<sqs_once::poller::RunStats> {
    let shutdown = CancellationToken::new();
    let mut pollers = Vec::new();
    for _ in 0..n {
        let processor = Processor::new(store(), handler.clone(), pc.clone()).unwrap();
        let mut config = PollerConfig::new(&q.queue_url);
        config.dlq_url = Some(q.dlq_url.clone());
        config.wait_time = Duration::from_secs(1);
        config.batch_wait = Duration::from_millis(50);
        pollers.push(tokio::spawn(sqs_once::poller::run(
            sqs.clone(),
            processor,
            config,
            shutdown.clone(),
        )));
    }
    // Empty means: messages were seen on the queue, and then its counts
    // read zero five times running (one second). A single zero read is not
    // enough, as the emulator's approximate counts may pass through zero
    // while a message moves between its visible and in-flight sets.
    // (Every caller sends before; should the counts never show it, five
    // seconds stand in for having seen it.)
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(90);
    let (mut seen, mut zeros) = (false, 0);
    while zeros < 5 && tokio::time::Instant::now() < deadline {
        seen |= started.elapsed() >= Duration::from_secs(5);
        if depth(sqs, &q.queue_url).await > 0 {
            (seen, zeros) = (true, 0);
        } else if seen {
            zeros += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    let mut stats = Vec::new();
    for p in pollers {
        stats.push(p.await.unwrap());
    }
    stats
}

/// Item 2: a receive of one FIFO group runs its messages one after the other;
/// the waiting ones must stay invisible for as long as the lane takes, or
/// another poller receives them, their receive counts climb and applied
/// messages end in the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifo_messages_waiting_in_a_lane_longer_than_the_visibility_timeout_are_applied_once_in_order()
 {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&sqs, true, 5, 3).await;
    let table = dedup_table(&ddb).await;
    // Two groups of 10: a lane of 10 messages at 1 s each takes 10 s, twice
    // the 5 s visibility timeout. Deletes go out at once, so between two
    // messages of a lane the group has nothing in flight but what waits.
    let mut sent = Vec::new();
    for g in ["a", "b"] {
        let entries: Vec<_> = (0..10)
            .map(|i| {
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(format!("e{i}"))
                    .message_body(format!(r#"{{"id":"{g}-{i}","group":"{g}","seq":{i}}}"#))
                    .message_group_id(g)
                    .message_deduplication_id(format!("{g}-{i}"))
                    .build()
                    .unwrap()
            })
            .collect();
        sqs.send_message_batch()
            .queue_url(&q.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        sent.extend((0..10).map(|i| format!("{g}-{i}")));
    }
    let applied: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let handler = {
        let applied = applied.clone();
        handler_fn(move |m: Message, _ctx| {
            let applied = applied.clone();
            async move {
                #[derive(serde::Deserialize)]
                struct E {
                    group: String,
                    seq: u64,
                }
                let e: E = m.json().map_err(HandlerError::permanent)?;
                tokio::time::sleep(Duration::from_secs(1)).await;
                applied.lock().unwrap().push((e.group, e.seq));
                Ok(None)
            }
        })
    };
    let mut pc = ProcessorConfig::new("fifo-lanes");
    pc.key_source = "json:/id".parse().unwrap();
    pc.lease = Duration::from_secs(6);
    pc.heartbeat = Duration::from_secs(2);
    let stats = pollers_until_empty(&sqs, &ddb, &q, &table, handler, &pc, 2).await;
    let received: u64 = stats.iter().map(|s| s.received).sum();
    let bounced: u64 = stats
        .iter()
        .map(|s| s.in_flight + s.held_back + s.retried)
        .sum();
    let applied = applied.lock().unwrap().clone();
    let mut count: HashMap<(String, u64), u32> = HashMap::new();
    for a in &applied {
        *count.entry(a.clone()).or_default() += 1;
    }
    let doubled: Vec<_> = count.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "applied more than once: {doubled:?}");
    assert_eq!(count.len(), 20, "lost: applied {applied:?}");
    for g in ["a", "b"] {
        let order: Vec<u64> = applied
            .iter()
            .filter(|(group, _)| group == g)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(order, (0..10).collect::<Vec<_>>(), "group {g} out of order");
    }
    assert_eq!(
        depth(&sqs, &q.dlq_url).await,
        0,
        "applied messages in the DLQ"
    );
    // Nothing failed, so nothing should have been handed out twice: a waiting
    // message that became visible is received again by the other poller.
    assert_eq!(received, 20, "messages received again while they waited");
    assert_eq!(bounced, 0, "messages sent back while they waited");
}

/// A handler that fails permanently with a fixed reason.
fn always_permanent(reason: &'static str) -> impl Handler {
    handler_fn(move |_m, _c| async move { Err(HandlerError::permanent(reason)) })
}

/// Runs one poller over `queue` with `handler` until the queue is empty.
async fn poll_until_empty<H: Handler>(
    sqs: &aws_sdk_sqs::Client,
    ddb: &aws_sdk_dynamodb::Client,
    q: &sqs_once_cli::setup::QueuePair,
    key: &str,
    handler: H,
) {
    let mut pc = ProcessorConfig::new(unique("c"));
    pc.key_source = key.parse().unwrap();
    pc.carry_secret = Some(carry_secret());
    let store = DynamoStore::new(ddb.clone(), dedup_table(ddb).await);
    let processor = Processor::new(store, handler, pc).unwrap();
    let mut config = PollerConfig::new(&q.queue_url);
    config.dlq_url = Some(q.dlq_url.clone());
    config.wait_time = Duration::from_secs(1);
    let shutdown = CancellationToken::new();
    let poller = tokio::spawn(sqs_once::poller::run(
        sqs.clone(),
        processor,
        config,
        shutdown.clone(),
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while depth(sqs, &q.queue_url).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "not drained");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    poller.await.unwrap();
}

/// Item 5: the parked copy keeps every attribute exactly (Number, Binary and
/// custom types included) and carries this park's reason, not an old one.
#[tokio::test]
async fn a_parked_copy_keeps_every_attribute_with_its_type_and_the_latest_reason() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&sqs, false, 30, 5).await;
    let typed = |t: &str, v: &str| {
        MessageAttributeValue::builder()
            .data_type(t)
            .string_value(v)
            .build()
            .unwrap()
    };
    let binary = MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(Blob::new(vec![0u8, 159, 146, 150, 255]))
        .build()
        .unwrap();
    let original: HashMap<String, MessageAttributeValue> = HashMap::from([
        ("order".to_owned(), typed("String", "o-1")),
        ("amount".to_owned(), typed("Number", "12.50")),
        ("sku".to_owned(), typed("String.sku", "X-9")),
        ("ratio".to_owned(), typed("Number.float", "0.25")),
        ("blob".to_owned(), binary),
        // Left by an earlier park and redrive.
        ("sqs_once_reason".to_owned(), string_attr("an old reason")),
    ]);
    sqs.send_message()
        .queue_url(&q.queue_url)
        .message_body("the body")
        .set_message_attributes(Some(original.clone()))
        .send()
        .await
        .unwrap();
    poll_until_empty(
        &sqs,
        &ddb,
        &q,
        "attribute:order",
        always_permanent("card declined"),
    )
    .await;
    let parked = drain(&sqs, &q.dlq_url).await;
    assert_eq!(parked.len(), 1);
    let attrs = parked[0].message_attributes().unwrap();
    for (name, value) in &original {
        if name == "sqs_once_reason" {
            continue;
        }
        assert_eq!(attrs.get(name), Some(value), "attribute {name} changed");
    }
    let reason = attrs["sqs_once_reason"].string_value().unwrap();
    assert!(reason.contains("card declined"), "{reason}");
    assert_eq!(
        attrs["sqs_once_dedup_key"].string_value(),
        Some(sqs_once::key::carry_key(&carry_secret(), "the body", "o-1").as_str())
    );
    assert_eq!(parked[0].body(), Some("the body"));
}

/// Item 5: a body near the queue's size limit can still be parked: the reason
/// is shortened to fit the DLQ's MaximumMessageSize; the body is unchanged.
#[tokio::test]
async fn a_body_near_the_size_limit_is_parked_with_the_reason_shortened_to_fit() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let limit = 262_144;
    let long_reason: &'static str = Box::leak("insufficient funds; ".repeat(200).into_boxed_str());
    // Room for part of the reason; then room for none of it.
    for (len, reason_fits) in [(260_000, true), (262_080, false)] {
        let q = queue_pair(&sqs, false, 30, 5).await;
        for url in [&q.queue_url, &q.dlq_url] {
            sqs.set_queue_attributes()
                .queue_url(url)
                .attributes(QueueAttributeName::MaximumMessageSize, limit.to_string())
                .send()
                .await
                .unwrap();
        }
        let body = format!(r#"{{"id":"big","pad":"{}"}}"#, "x".repeat(len - 21));
        assert_eq!(body.len(), len);
        sqs.send_message()
            .queue_url(&q.queue_url)
            .message_body(&body)
            .message_attributes("kind", string_attr("big"))
            .send()
            .await
            .unwrap();
        poll_until_empty(&sqs, &ddb, &q, "json:/id", always_permanent(long_reason)).await;
        let parked = drain(&sqs, &q.dlq_url).await;
        assert_eq!(parked.len(), 1, "{len}: not parked");
        assert_eq!(parked[0].body(), Some(body.as_str()), "{len}: body altered");
        let attrs = parked[0].message_attributes().unwrap();
        assert_eq!(attrs["kind"].string_value(), Some("big"));
        let size: usize = body.len()
            + attrs
                .iter()
                .map(|(k, v)| k.len() + v.data_type().len() + v.string_value().map_or(0, str::len))
                .sum::<usize>();
        assert!(size <= limit, "{len}: {size} > {limit}");
        let reason = attrs
            .get("sqs_once_reason")
            .map(|r| r.string_value().unwrap());
        match (reason, reason_fits) {
            (Some(reason), true) => {
                assert!(
                    reason.starts_with("handler failed permanently: insufficient funds"),
                    "{reason}"
                );
                assert!(reason.len() < long_reason.len(), "reason not shortened");
            }
            (None, false) => {}
            (reason, _) => panic!("{len}: reason {reason:?}"),
        }
    }
}

/// A handler that stages `writes(table)` and succeeds.
fn staging(table: String, writes: fn(&str) -> Vec<TransactWriteItem>) -> impl Handler {
    sqs_once::staged_only(handler_fn(move |_m, ctx: Context| {
        let table = table.clone();
        async move {
            for w in writes(&table) {
                ctx.stage(w);
            }
            HandlerResult::Ok(None)
        }
    }))
}

fn put(table: &str, pk: &str, pad: usize) -> TransactWriteItem {
    TransactWriteItem::builder()
        .put(
            Put::builder()
                .table_name(table)
                .item("pk", AttributeValue::S(pk.to_owned()))
                .item("pad", AttributeValue::S("x".repeat(pad)))
                .build()
                .unwrap(),
        )
        .build()
}

/// Item 6: a request DynamoDB rejects as invalid can never succeed: the message
/// is parked with the service's message, not retried until the redrive policy.
#[tokio::test]
async fn requests_dynamodb_rejects_as_invalid_are_parked_not_retried() {
    if !crate::common::localstack_up().await {
        return;
    }
    let ddb = ddb().await;
    let ledger = unique("ledger");
    sqs_once_cli::setup::ensure_table(&ddb, &ledger)
        .await
        .unwrap();
    let table = dedup_table(&ddb).await;
    type Writes = fn(&str) -> Vec<TransactWriteItem>;
    let cases: [(&str, Writes, &str); 2] = [
        ("a 401 KB item", |t| vec![put(t, "big", 401 * 1024)], "400"),
        (
            "two operations on one item",
            |t| vec![put(t, "same", 1), put(t, "same", 2)],
            "one item",
        ),
    ];
    for fast in [true, false] {
        for (what, writes, says) in cases {
            let mut pc = ProcessorConfig::new(unique("c"));
            pc.key_source = "message-id".parse().unwrap();
            pc.fast_path = fast;
            let store = DynamoStore::new(ddb.clone(), table.clone());
            let p = Processor::new(store, staging(ledger.clone(), writes), pc).unwrap();
            let o = p.process(Message::new(unique("m"), "{}")).await;
            match &o {
                Outcome::Park { reason } => assert!(
                    reason.contains(says),
                    "{what} (fast path {fast}): reason {reason:?} should say {says:?}"
                ),
                other => panic!("{what} (fast path {fast}): {other:?}, expected parked"),
            }
        }
    }
}

/// Sends a parked copy back to the source queue as SQS's move task does: the
/// body and every attribute, as a new message (new id).
async fn move_back(
    sqs: &aws_sdk_sqs::Client,
    parked: &aws_sdk_sqs::types::Message,
    to: &str,
    group: Option<&str>,
) {
    let mut send = sqs
        .send_message()
        .queue_url(to)
        .message_body(parked.body().unwrap())
        .set_message_attributes(parked.message_attributes().cloned());
    if let Some(g) = group {
        send = send
            .message_group_id(g)
            .message_deduplication_id(uuid::Uuid::new_v4().to_string());
    }
    send.send().await.unwrap();
}

/// Receives one message from `url` (with all attributes) as the runtimes see it.
async fn receive_one(sqs: &aws_sdk_sqs::Client, url: &str) -> Message {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(1)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if let Some(m) = got.into_iter().next() {
            return sqs_once::aws::sqs::to_message(m).unwrap();
        }
        assert!(tokio::time::Instant::now() < deadline, "nothing to receive");
    }
}

/// Item 7: a redelivery of a parked message (its delete failed) is not run
/// again, even if it would now pass; a copy brought back from the DLQ is
/// processed again under the same dedup and idempotency keys, with
/// `message-id` and `dedup-id` keys too, and a second copy is a duplicate.
#[tokio::test]
async fn a_redelivered_parked_message_is_not_run_and_a_copy_brought_back_is_run_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    for (fifo, key) in [(false, "message-id"), (true, "dedup-id")] {
        let q = queue_pair(&sqs, fifo, 30, 10).await;
        let mut send = sqs
            .send_message()
            .queue_url(&q.queue_url)
            .message_body(r#"{"amount":5}"#);
        if fifo {
            send = send.message_group_id("g").message_deduplication_id("d-1");
        }
        send.send().await.unwrap();
        // Declined the first time, accepted whenever it runs again.
        let runs: Arc<Mutex<Vec<String>>> = Arc::default();
        let handler = {
            let runs = runs.clone();
            handler_fn(move |_m, ctx: Context| {
                let runs = runs.clone();
                async move {
                    let mut runs = runs.lock().unwrap();
                    runs.push(ctx.idempotency_key().unwrap().to_owned());
                    if runs.len() == 1 {
                        return Err(HandlerError::permanent("insufficient funds"));
                    }
                    Ok(None)
                }
            })
        };
        let mut pc = ProcessorConfig::new(unique("c"));
        pc.key_source = key.parse().unwrap();
        pc.carry_secret = Some(carry_secret());
        let p = Processor::new(
            DynamoStore::new(ddb.clone(), dedup_table(&ddb).await),
            handler,
            pc,
        )
        .unwrap();
        let dlq = Dlq::new(sqs.clone(), &q.dlq_url);
        let park = |m: Message, reason: String| {
            let (dlq, p) = (&dlq, &p);
            async move {
                let key = p.config().dedup_key(&m).unwrap();
                let secret = p.config().carry_secret.as_ref();
                dlq.park(&m, &reason, Some(&key), secret).await.unwrap();
            }
        };

        // First delivery: parked, but the delete "fails": it comes back.
        let first = receive_one(&sqs, &q.queue_url).await;
        let Outcome::Park { reason } = p.process(first.clone()).await else {
            panic!("not parked")
        };
        park(first.clone(), reason).await;
        sqs.change_message_visibility()
            .queue_url(&q.queue_url)
            .receipt_handle(first.receipt_handle().unwrap())
            .visibility_timeout(0)
            .send()
            .await
            .unwrap();
        let again = receive_one(&sqs, &q.queue_url).await;
        assert_eq!(again.id(), first.id());
        let o = p.process(again.clone()).await;
        let Outcome::Park { reason } = o else {
            panic!("{key}: a redelivery of a parked message ran: {o:?}")
        };
        assert!(
            reason.contains("redelivered after it was parked"),
            "{reason}"
        );
        assert_eq!(runs.lock().unwrap().len(), 1, "{key}: the redelivery ran");
        park(again.clone(), reason).await;
        sqs.delete_message()
            .queue_url(&q.queue_url)
            .receipt_handle(again.receipt_handle().unwrap())
            .send()
            .await
            .unwrap();

        // Brought back from the DLQ (every copy there): runs once, same keys.
        let parked = drain(&sqs, &q.dlq_url).await;
        assert!(!parked.is_empty());
        for copy in &parked {
            move_back(&sqs, copy, &q.queue_url, fifo.then_some("g")).await;
        }
        let mut outcomes = Vec::new();
        for _ in &parked {
            let back = receive_one(&sqs, &q.queue_url).await;
            assert_ne!(back.id(), first.id(), "a copy is a new message");
            outcomes.push(p.process(back.clone()).await);
            sqs.delete_message()
                .queue_url(&q.queue_url)
                .receipt_handle(back.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
        let completed = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Completed { .. }))
            .count();
        let duplicates = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Duplicate { .. }))
            .count();
        assert_eq!(
            (completed, duplicates),
            (1, parked.len() - 1),
            "{key}: {outcomes:?}"
        );
        let runs = runs.lock().unwrap();
        assert_eq!(runs.len(), 2, "{key}: runs {runs:?}");
        assert_eq!(runs[0], runs[1], "{key}: the idempotency key changed");
    }
}

/// Signals each time a `ReceiveMessage` request is about to be sent.
#[derive(Debug)]
struct ReceiveSent(Arc<tokio::sync::Notify>);

impl aws_sdk_sqs::config::Intercept for ReceiveSent {
    fn name(&self) -> &'static str {
        "ReceiveSent"
    }

    fn read_before_transmit(
        &self,
        _ctx: &aws_sdk_sqs::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _rc: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg.load::<aws_smithy_runtime_api::client::orchestrator::Metadata>();
        if op.is_some_and(|m| m.name() == "ReceiveMessage") {
            self.0.notify_one();
        }
        Ok(())
    }
}

/// Item 8: a SIGTERM while a long poll is open must not abandon what that
/// receive takes: the messages come back visible at once, not after the
/// visibility timeout (which on FIFO would also hold their groups).
#[tokio::test]
async fn messages_a_long_poll_takes_after_shutdown_are_given_back_at_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (plain, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&plain, false, 120, 5).await;
    let sent = Arc::new(tokio::sync::Notify::new());
    let conf = aws_sdk_sqs::config::Builder::from(&crate::common::sdk_config().await)
        .interceptor(ReceiveSent(sent.clone()))
        .build();
    let watched = aws_sdk_sqs::Client::from_conf(conf);
    let mut pc = ProcessorConfig::new(unique("c"));
    pc.key_source = "message-id".parse().unwrap();
    let store = DynamoStore::new(ddb.clone(), dedup_table(&ddb).await);
    let processor = Processor::new(
        store,
        handler_fn(|_m, _c| async { panic!("must not run after shutdown") }),
        pc,
    )
    .unwrap();
    let mut config = PollerConfig::new(&q.queue_url);
    config.wait_time = Duration::from_secs(10);
    let shutdown = CancellationToken::new();
    let poller = tokio::spawn(sqs_once::poller::run(
        watched,
        processor,
        config,
        shutdown.clone(),
    ));
    tokio::time::timeout(Duration::from_secs(10), sent.notified())
        .await
        .expect("the poller sends a receive");
    // Stop while the long poll is open on the server, then give it a message
    // to take. (The pause only lets the request arrive, so that the old
    // behaviour, which dropped the receive, is caught; the fix passes
    // whatever the timing.)
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    plain
        .send_message()
        .queue_url(&q.queue_url)
        .message_body("late")
        .send()
        .await
        .unwrap();
    let stats = tokio::time::timeout(Duration::from_secs(30), poller)
        .await
        .expect("the poller stops within the drain")
        .unwrap();
    assert_eq!(stats.completed + stats.retried, 0, "{stats:?}");
    assert_eq!(stats.held_back, 1, "given back: {stats:?}");
    // Visible again at once (the queue's visibility timeout is 120 s).
    let got = drain(&plain, &q.queue_url).await;
    assert_eq!(got.len(), 1, "the message was left invisible: {stats:?}");
    assert_eq!(got[0].body(), Some("late"));
}

/// Sends `{"id": id, "secs": secs}` for each of `messages`, in order, to
/// group `g` of the FIFO queue `url` (deduplicated by id).
async fn send_to_group(sqs: &aws_sdk_sqs::Client, url: &str, messages: &[(&str, u64)]) {
    let entries: Vec<_> = messages
        .iter()
        .map(|(id, secs)| {
            aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                .id(*id)
                .message_body(format!(r#"{{"id":"{id}","secs":{secs}}}"#))
                .message_group_id("g")
                .message_deduplication_id(*id)
                .build()
                .unwrap()
        })
        .collect();
    sqs.send_message_batch()
        .queue_url(url)
        .set_entries(Some(entries))
        .send()
        .await
        .unwrap();
}

/// A handler of [`send_to_group`]'s messages: notes each run's id in
/// `runs`, then works for its `secs`.
fn recording_runs(runs: Arc<Mutex<Vec<String>>>) -> impl Handler + Clone {
    handler_fn(move |m: Message, _ctx| {
        let runs = runs.clone();
        async move {
            #[derive(serde::Deserialize)]
            struct E {
                id: String,
                secs: u64,
            }
            let e: E = m.json().map_err(HandlerError::permanent)?;
            runs.lock().unwrap().push(e.id);
            tokio::time::sleep(Duration::from_secs(e.secs)).await;
            Ok(None)
        }
    })
}

/// Review finding: the next message of a lane was taken out of the keeper's
/// set when it started, before anything had extended it, and the heartbeat's
/// first beat came after the queue's visibility timeout: it was handed to the
/// other poller while this one applied it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lane_message_that_starts_late_is_not_handed_out_before_its_first_heartbeat() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    // The poller receives with the lease (12 s) as the visibility timeout: a
    // 3 s message, then a 14 s one that runs past the receive's visibility
    // and must be extended before it ends (by the extension before it
    // starts, or by its heartbeat, whose first beat comes at most 6 s after
    // it starts). Each step has seconds to spare: room for a loaded emulator.
    let q = queue_pair(&sqs, true, 8, 3).await;
    let table = dedup_table(&ddb).await;
    send_to_group(&sqs, &q.queue_url, &[("a", 3), ("b", 14)]).await;
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let handler = recording_runs(runs.clone());
    let mut pc = ProcessorConfig::new("late-start");
    pc.key_source = "json:/id".parse().unwrap();
    pc.lease = Duration::from_secs(12);
    pc.heartbeat = Duration::from_secs(6);
    let stats = pollers_until_empty(&sqs, &ddb, &q, &table, handler, &pc, 2).await;
    let received: u64 = stats.iter().map(|s| s.received).sum();
    assert_eq!(
        *runs.lock().unwrap(),
        ["a", "b"],
        "each ran once, in order: {stats:?}"
    );
    assert_eq!(
        received, 2,
        "a message was handed out again while held: {stats:?}"
    );
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0, "{stats:?}");
}

/// Issue 27, part 2: a re-send of a key whose first delivery runs for
/// longer than `maxReceiveCount` leases (here 20 s against 4 s leases and a
/// `maxReceiveCount` of 2). The copy, found in flight, used to come back at
/// the holder's lease end, which the heartbeat kept moving, and reached the
/// DLQ though its key completed. It now waits for the holder, kept invisible
/// by `ChangeMessageVisibility`, and is deleted as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_key_held_longer_than_max_receive_count_leases_stays_out_of_the_dlq() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&sqs, false, 5, 2).await;
    let table = dedup_table(&ddb).await;
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (runs, started) = (runs.clone(), started.clone());
        handler_fn(move |_m: Message, _ctx| {
            let (runs, started) = (runs.clone(), started.clone());
            async move {
                if runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(20)).await;
                }
                Ok(None)
            }
        })
    };
    let send = |sqs: aws_sdk_sqs::Client, url: String| async move {
        sqs.send_message()
            .queue_url(url)
            .message_body(r#"{"id":"held"}"#)
            .send()
            .await
            .unwrap();
    };
    send(sqs.clone(), q.queue_url.clone()).await;
    // The copy goes out once the first delivery runs: another receive.
    let copy = tokio::spawn({
        let (sqs, url) = (sqs.clone(), q.queue_url.clone());
        async move {
            started.notified().await;
            send(sqs, url).await;
        }
    });
    let mut pc = ProcessorConfig::new("long-holder");
    pc.key_source = "json:/id".parse().unwrap();
    pc.lease = Duration::from_secs(4);
    pc.heartbeat = Duration::from_secs(1);
    let stats = pollers_until_empty(&sqs, &ddb, &q, &table, handler, &pc, 2).await;
    copy.await.unwrap();
    assert_eq!(
        depth(&sqs, &q.dlq_url).await,
        0,
        "the copy reached the DLQ: {stats:?}"
    );
    assert_eq!(
        runs.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "{stats:?}"
    );
    let duplicates: u64 = stats.iter().map(|s| s.duplicates).sum();
    let completed: u64 = stats.iter().map(|s| s.completed).sum();
    assert_eq!((completed, duplicates), (1, 1), "{stats:?}");
}

/// One invocation of `adapter` as Lambda's event source mapping makes it:
/// up to ten messages of `url` received, the function invoked with
/// `timeout`, the records it did not list deleted. The receive counts of the
/// records and the ids listed; `None` when nothing came within a second.
async fn lambda_invocation<H: Handler>(
    sqs: &aws_sdk_sqs::Client,
    adapter: &sqs_once::LambdaAdapter<DynamoStore, H>,
    (url, arn): (&str, &str),
    timeout: Duration,
) -> Option<(Vec<u32>, Vec<String>)> {
    let messages = sqs
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(1)
        .message_system_attribute_names(MessageSystemAttributeName::All)
        .message_attribute_names("All")
        .send()
        .await
        .unwrap()
        .messages
        .unwrap_or_default();
    if messages.is_empty() {
        return None;
    }
    let event = sqs_once_cli::local_lambda::sqs_event(arn, &messages);
    let deadline = std::time::SystemTime::now() + timeout;
    let failed: Vec<String> = match adapter.handle(event, deadline).await {
        Ok(r) => r
            .batch_item_failures
            .into_iter()
            .map(|f| f.item_identifier)
            .collect(),
        Err(sqs_once::lambda::EventError::WholeBatch(ids)) => ids,
        Err(e) => panic!("{e}"),
    };
    let mut counts = Vec::new();
    for m in &messages {
        let count = m.attributes().unwrap()[&MessageSystemAttributeName::ApproximateReceiveCount]
            .parse()
            .unwrap();
        counts.push(count);
        if !failed.iter().any(|f| Some(f.as_str()) == m.message_id()) {
            sqs.delete_message()
                .queue_url(url)
                .receipt_handle(m.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
    }
    Some((counts, failed))
}

/// The queue's ARN (an event's `eventSourceARN`).
async fn queue_arn(sqs: &aws_sdk_sqs::Client, url: &str) -> String {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone()
}

/// A handler that takes `time` and then makes its effect: the handler, its
/// runs, its effects, and a signal of each start.
fn counted_slow_handler(
    time: Duration,
) -> (
    impl Handler + Clone,
    Arc<AtomicU32>,
    Arc<AtomicU32>,
    Arc<tokio::sync::Notify>,
) {
    let (runs, effects) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (runs, effects, started) = (runs.clone(), effects.clone(), started.clone());
        handler_fn(move |_m: Message, _ctx| {
            let (runs, effects, started) = (runs.clone(), effects.clone(), started.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                started.notify_one();
                tokio::time::sleep(time).await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        })
    };
    (handler, runs, effects, started)
}

/// In Lambda: a re-send of a key whose first delivery
/// runs 20 s, while the function's timeout is 8 s and the queue's
/// `maxReceiveCount` 2. The copy, found in flight, waited within its
/// invocation and was then listed, back at the holder's lease end: a
/// receive spent per invocation, and it reached the DLQ though its key
/// completed. It is now sent again as a new message under the same key
/// (`SendMessage` with a delay up to the holder's lease end) and answered as
/// done, each copy received once, until the holder completes and the last
/// copy is deleted as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_of_a_key_held_longer_than_max_receive_count_invocations_stays_out_of_the_dlq() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&sqs, false, 30, 2).await;
    let arn = queue_arn(&sqs, &q.queue_url).await;
    let (handler, runs, effects, started) = counted_slow_handler(Duration::from_secs(20));
    let mut pc = ProcessorConfig::new("long-holder-lambda");
    pc.key_source = "json:/id".parse().unwrap();
    pc.lease = Duration::from_secs(4);
    pc.heartbeat = Duration::from_secs(1);
    let store = DynamoStore::new(ddb.clone(), dedup_table(&ddb).await);
    let mut config = sqs_once::LambdaConfig::default();
    config.queue_url = Some(q.queue_url.clone());
    config.dlq_url = Some(q.dlq_url.clone());
    config.margin = Duration::from_secs(2);
    let adapter = sqs_once::LambdaAdapter::new(
        sqs.clone(),
        Processor::new(store, handler, pc).unwrap(),
        config,
    );
    let send = || {
        sqs.send_message()
            .queue_url(&q.queue_url)
            .message_body(r#"{"id":"held"}"#)
            .send()
    };
    send().await.unwrap();
    // The holder: an invocation with time enough for its handler.
    let holder = tokio::spawn({
        let (sqs, adapter, url, arn) = (
            sqs.clone(),
            adapter.clone(),
            q.queue_url.clone(),
            arn.clone(),
        );
        async move {
            loop {
                let at = (url.as_str(), arn.as_str());
                let timeout = Duration::from_secs(40);
                if let Some(done) = lambda_invocation(&sqs, &adapter, at, timeout).await {
                    return done;
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(20), started.notified())
        .await
        .expect("the holder starts");
    send().await.unwrap();
    let (mut copies, mut listed) = (Vec::new(), Vec::new());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while !holder.is_finished() || depth(&sqs, &q.queue_url).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled: {copies:?}"
        );
        let at = (q.queue_url.as_str(), arn.as_str());
        let invocation = lambda_invocation(&sqs, &adapter, at, Duration::from_secs(8)).await;
        if let Some((counts, failed)) = invocation {
            copies.extend(counts);
            listed.extend(failed);
        }
    }
    let (held, failed) = holder.await.unwrap();
    assert_eq!((held, failed), (vec![1], vec![]));
    assert_eq!(
        depth(&sqs, &q.dlq_url).await,
        0,
        "the copy reached the DLQ: receive counts {copies:?}"
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran again");
    assert!(listed.is_empty(), "listed: {listed:?}");
    assert!(copies.iter().all(|n| *n == 1), "receive counts {copies:?}");
    assert!(copies.len() >= 2, "never sent again: {copies:?}");
}

/// A [`DynamoStore`] whose completions and fast-path commits wait `delay`
/// before they are sent: a DynamoDB that answers slowly.
#[derive(Clone)]
struct SlowCommits {
    inner: DynamoStore,
    delay: Duration,
}

impl DedupStore for SlowCommits {
    async fn claim(
        &self,
        req: &sqs_once::store::ClaimRequest,
    ) -> Result<sqs_once::Claim, sqs_once::StoreError> {
        self.inner.claim(req).await
    }
    async fn complete(&self, c: sqs_once::store::Completion) -> Result<(), sqs_once::StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.complete(c).await
    }
    async fn release(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
    ) -> Result<(), sqs_once::StoreError> {
        self.inner.release(pk, owner, error).await
    }
    async fn mark_failed(
        &self,
        pk: &str,
        owner: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<(), sqs_once::StoreError> {
        self.inner.mark_failed(pk, owner, error, ttl).await
    }
    async fn extend_lease(
        &self,
        pk: &str,
        owner: &str,
        lease: Duration,
        ttl: Duration,
    ) -> Result<(), sqs_once::StoreError> {
        self.inner.extend_lease(pk, owner, lease, ttl).await
    }
    async fn commit_unprotected(
        &self,
        writes: Vec<sqs_once::StagedWrite>,
    ) -> Result<(), sqs_once::StoreError> {
        self.inner.commit_unprotected(writes).await
    }
    async fn commit_fast(
        &self,
        c: sqs_once::store::FastCommit,
    ) -> Result<sqs_once::store::FastCommitted, sqs_once::StoreError> {
        tokio::time::sleep(self.delay).await;
        self.inner.commit_fast(c).await
    }
    async fn mark_dispatched(
        &self,
        pk: &str,
        sent: &[sqs_once::Outgoing],
    ) -> Result<(), sqs_once::StoreError> {
        self.inner.mark_dispatched(pk, sent).await
    }
    async fn get(&self, pk: &str) -> Result<Option<sqs_once::Record>, sqs_once::StoreError> {
        self.inner.get(pk).await
    }
}

/// A commit that takes longer than the visibility timeout (a slow
/// DynamoDB) keeps its message invisible while it runs: on a FIFO queue
/// with a 5 s lease, each message's commit takes 8 s, yet neither is handed
/// to the other poller, each applies once and in order, and nothing
/// reaches the DLQ. Before, a commit ran unextended: the message came back
/// mid-commit, was received again and its handler ran a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fifo_commit_slower_than_the_visibility_timeout_keeps_its_message_invisible() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&sqs, true, 5, 2).await;
    let table = dedup_table(&ddb).await;
    send_to_group(&sqs, &q.queue_url, &[("a", 0), ("b", 0)]).await;
    let runs: Arc<Mutex<Vec<String>>> = Arc::default();
    let handler = recording_runs(runs.clone());
    let mut pc = ProcessorConfig::new("slow-commit");
    pc.key_source = "json:/id".parse().unwrap();
    pc.lease = Duration::from_secs(5);
    pc.heartbeat = Duration::from_secs(2);
    let store = || SlowCommits {
        inner: DynamoStore::new(ddb.clone(), table.as_str()),
        delay: Duration::from_secs(8),
    };
    let stats = pollers_on_until_empty(&sqs, &q, store, handler, &pc, 2).await;
    let received: u64 = stats.iter().map(|s| s.received).sum();
    assert_eq!(
        *runs.lock().unwrap(),
        ["a", "b"],
        "each ran once, in order: {stats:?}"
    );
    assert_eq!(
        received, 2,
        "a message was handed out again during its commit: {stats:?}"
    );
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0, "{stats:?}");
    let records = DynamoStore::new(ddb.clone(), table.as_str());
    for id in ["a", "b"] {
        let record = records.get(&pc.record_key(id)).await.unwrap();
        let status = record.map(|r| r.status);
        assert_eq!(status, Some(sqs_once::Status::Completed), "{id}: {stats:?}");
    }
}

/// Refuses every delete before it is sent: a consumer whose deletes are
/// lost until SQS's redrive policy moves the message.
#[derive(Debug)]
struct RefuseDeletes;

impl aws_sdk_sqs::config::Intercept for RefuseDeletes {
    fn name(&self) -> &'static str {
        "RefuseDeletes"
    }

    fn read_before_transmit(
        &self,
        _ctx: &aws_sdk_sqs::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _rc: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg.load::<aws_smithy_runtime_api::client::orchestrator::Metadata>();
        if op.is_some_and(|m| m.name().starts_with("DeleteMessage")) {
            return Err("injected: the delete is lost".into());
        }
        Ok(())
    }
}

/// The defaults end to end (issue: a redrive must not re-apply by default):
/// a `message-id` consumer with no secret set (it uses the one kept in the
/// table, as the front door does) makes its effect, its delete is lost, and
/// SQS's redrive policy (maxReceiveCount 1) moves the message to the DLQ.
/// `sqs-once redrive --table`, given no secret either, brings it back
/// carrying its key sealed with the table's secret: it is a duplicate.
#[tokio::test]
async fn a_message_moved_after_its_effect_is_redriven_as_a_duplicate_with_no_secret_set() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (plain, ddb) = (sqs().await, ddb().await);
    let q = queue_pair(&plain, false, 2, 1).await;
    let table = dedup_table(&ddb).await;
    plain
        .send_message()
        .queue_url(&q.queue_url)
        .message_body(r#"{"id":"evt-1"}"#)
        .send()
        .await
        .unwrap();
    let store = DynamoStore::new(ddb.clone(), table.as_str());
    let mut pc = ProcessorConfig::new("defaults");
    pc.carry_secret = store.table_carry_secret(true).await.unwrap();
    assert!(pc.carry_secret.is_some(), "the table's secret was made");
    let effects = Arc::new(AtomicU32::new(0));
    let consumer = |sqs: aws_sdk_sqs::Client| {
        let effects = effects.clone();
        let handler = handler_fn(move |_m, _c| {
            let effects = effects.clone();
            async move {
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        });
        let processor = Processor::new(store.clone(), handler, pc.clone()).unwrap();
        let mut config = PollerConfig::new(&q.queue_url);
        config.wait_time = Duration::from_secs(1);
        config.drain = Duration::from_secs(2);
        let stop = CancellationToken::new();
        let run = tokio::spawn(sqs_once::poller::run(sqs, processor, config, stop.clone()));
        (stop, run)
    };

    let conf = aws_sdk_sqs::config::Builder::from(&crate::common::sdk_config().await)
        .interceptor(RefuseDeletes)
        .build();
    let (stop, run) = consumer(aws_sdk_sqs::Client::from_conf(conf));
    // The poller tries a delete for a minute (holding back receives) before
    // it lets the message come back; the next receive moves it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    while depth(&plain, &q.dlq_url).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never moved to the DLQ"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    run.await.unwrap();
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect was made");

    let out = tokio::process::Command::new(crate::common::binary("sqs-once"))
        .args([
            "redrive",
            "--dlq-url",
            &q.dlq_url,
            "--queue-url",
            &q.queue_url,
        ])
        .args(["--table", &table])
        .env("AWS_ENDPOINT_URL", crate::common::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env_remove("SQS_ONCE_CARRY_SECRET")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("no carry secret"), "{stderr}");

    let (stop, run) = consumer(plain.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while depth(&plain, &q.queue_url).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "never settled");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    let stats = run.await.unwrap();
    assert_eq!(stats.duplicates, 1, "{stats:?}");
    assert_eq!(
        effects.load(Ordering::SeqCst),
        1,
        "the redriven copy applied nothing twice"
    );
}

/// Answers the first `ReceiveMessage` with a 500 (the SDK tries the call
/// again) and notes each receive request's `ReceiveRequestAttemptId`.
#[derive(Debug, Default)]
struct FirstReceiveFails {
    attempt_ids: Arc<Mutex<Vec<Option<String>>>>,
}

impl aws_sdk_sqs::config::Intercept for FirstReceiveFails {
    fn name(&self) -> &'static str {
        "FirstReceiveFails"
    }

    fn read_before_transmit(
        &self,
        ctx: &aws_sdk_sqs::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _rc: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg.load::<aws_smithy_runtime_api::client::orchestrator::Metadata>();
        if op.is_some_and(|m| m.name() == "ReceiveMessage") {
            let body = ctx.request().body().bytes().unwrap_or_default();
            let body: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let id = body["ReceiveRequestAttemptId"].as_str().map(str::to_owned);
            self.attempt_ids.lock().unwrap().push(id);
        }
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        ctx: &mut aws_sdk_sqs::config::interceptors::BeforeDeserializationInterceptorContextMut<'_>,
        _rc: &aws_sdk_sqs::config::RuntimeComponents,
        cfg: &mut aws_sdk_sqs::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg.load::<aws_smithy_runtime_api::client::orchestrator::Metadata>();
        if op.is_some_and(|m| m.name() == "ReceiveMessage")
            && self.attempt_ids.lock().unwrap().len() == 1
        {
            *ctx.response_mut().status_mut() = 500.try_into().expect("a status");
        }
        Ok(())
    }
}

/// A FIFO receive carries a `ReceiveRequestAttemptId`, and the SDK's second
/// attempt after a lost answer the same one, so SQS answers it with the
/// messages the first attempt took rather than keeping their groups locked
/// (LocalStack ignores the id: what SQS does with it is its documented
/// behaviour, not checked here); a standard queue's receive carries none.
#[tokio::test]
async fn a_fifo_receive_tried_again_by_the_sdk_repeats_its_attempt_id() {
    if !crate::common::localstack_up().await {
        return;
    }
    let plain = crate::common::sqs().await;
    for fifo in [true, false] {
        let q = crate::common::queues(&plain, fifo, 30).await;
        let watch = FirstReceiveFails::default();
        let attempt_ids = watch.attempt_ids.clone();
        let conf = aws_sdk_sqs::config::Builder::from(&crate::common::sdk_config().await)
            .interceptor(watch)
            .build();
        let client = aws_sdk_sqs::Client::from_conf(conf);
        let request = sqs_once::queue::ReceiveRequest {
            max: 10,
            wait: Duration::from_secs(1),
            visibility: Duration::from_secs(30),
        };
        sqs_once::QueueClient::receive(&client, &q.queue_url, request)
            .await
            .unwrap();
        let ids = attempt_ids.lock().unwrap().clone();
        assert_eq!(ids.len(), 2, "the SDK tried the receive again: {ids:?}");
        if fifo {
            assert!(ids[0].is_some(), "{ids:?}");
            assert_eq!(ids[0], ids[1], "the same attempt id on the retry");
        } else {
            assert_eq!(ids, [None, None], "no attempt id on a standard queue");
        }
    }
}
