//! The Lambda runtime over the in-memory SQS model and dedup store, in
//! virtual time, with the event source mapping's part played by the test:
//! receive a batch, invoke with a deadline, delete what is not listed.

use std::sync::atomic::{AtomicU32, Ordering};

use super::*;
use crate::protocol::clock::{Clock, TokioClock};
use crate::protocol::payloads::{POINTER_CLASS, SIZE_ATTRIBUTE};
use crate::protocol::queue::{OutgoingMessage, ReceiveRequest};
use crate::runtime::settle::copy_to_send_again;
use crate::testkit::payloads::MemoryPayloads;
use crate::testkit::queue::{MemoryQueue, QueueSettings, RedrivePolicy, first_draws_hit};
use crate::{HandlerError, MemoryStore, Outcome, ProcessorConfig, handler_fn};

/// The visibility timeout the event source mapping receives with.
const VISIBILITY: Duration = Duration::from_secs(30);

/// An SQS event as Lambda builds it from received messages.
fn event_of(messages: &[Message]) -> serde_json::Value {
    let records: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            let attributes: serde_json::Map<String, serde_json::Value> = m
                .attributes()
                .iter()
                .map(|(name, a)| {
                    let crate::AttributeValue::Text(t) = &a.value else {
                        unreachable!("text attributes only")
                    };
                    let value = serde_json::json!({"dataType": a.data_type, "stringValue": t});
                    (name.clone(), value)
                })
                .collect();
            serde_json::json!({
                "messageId": m.id(), "receiptHandle": m.receipt_handle(), "body": m.body(),
                "attributes": {"ApproximateReceiveCount": m.receive_count().to_string()},
                "messageAttributes": attributes,
                "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:us-east-1:000000000000:q",
            })
        })
        .collect();
    serde_json::json!({ "Records": records })
}

/// One invocation as the event source mapping makes it: receives up to ten
/// messages (long poll of 20 s), invokes the function with `timeout`, then
/// deletes the records it did not list. The messages and the ids listed.
async fn invoke<H: Handler>(
    adapter: &LambdaAdapter<MemoryStore, H, MemoryQueue>,
    queue: &MemoryQueue,
    url: &str,
    timeout: Duration,
) -> (Vec<Message>, Vec<String>) {
    let request = ReceiveRequest {
        max: 10,
        wait: Duration::from_secs(20),
        visibility: VISIBILITY,
    };
    let messages = queue.receive(url, request).await.unwrap();
    if messages.is_empty() {
        return (messages, Vec::new());
    }
    invoke_with(adapter, queue, url, messages, timeout).await
}

/// [`invoke`] with the messages already received.
async fn invoke_with<H: Handler>(
    adapter: &LambdaAdapter<MemoryStore, H, MemoryQueue>,
    queue: &MemoryQueue,
    url: &str,
    messages: Vec<Message>,
    timeout: Duration,
) -> (Vec<Message>, Vec<String>) {
    let deadline = Instant::now() + timeout;
    let answer = adapter.handle_until(event_of(&messages), deadline);
    let answer = tokio::time::timeout_at(deadline, answer)
        .await
        .expect("answered before the deadline");
    let failed: Vec<String> = match answer {
        Ok(r) => r
            .batch_item_failures
            .into_iter()
            .map(|f| f.item_identifier)
            .collect(),
        Err(EventError::WholeBatch(ids)) => ids,
        Err(e) => panic!("{e}"),
    };
    for m in messages
        .iter()
        .filter(|m| !failed.iter().any(|f| f == m.id()))
    {
        queue
            .delete(url, m.receipt_handle().unwrap())
            .await
            .unwrap();
    }
    (messages, failed)
}

/// A standard queue with a DLQ after `max_receive_count` receives: (queue,
/// DLQ).
fn queue_with_dlq(queue: &MemoryQueue, name: &str, max_receive_count: u32) -> (String, String) {
    let dlq = queue
        .create_queue(QueueSettings::new(format!("{name}-dlq")))
        .unwrap();
    let mut settings = QueueSettings::new(name);
    settings.redrive = Some(RedrivePolicy {
        dlq_url: dlq.clone(),
        max_receive_count,
    });
    (queue.create_queue(settings).unwrap(), dlq)
}

fn event(id: &str) -> OutgoingMessage {
    OutgoingMessage {
        body: format!(r#"{{"id":"{id}"}}"#),
        ..Default::default()
    }
}

/// The store and processor settings of these tests, on tokio's clock.
fn store_and_config(name: &str) -> (MemoryStore, Arc<TokioClock>, ProcessorConfig) {
    let clock = Arc::new(TokioClock::starting_at(SystemTime::UNIX_EPOCH));
    let mut config = ProcessorConfig::new(name);
    config.key_source = "json:/id".parse().unwrap();
    config.lease = Duration::from_secs(10);
    config.heartbeat = Duration::from_secs(4);
    (MemoryStore::new(clock.clone()), clock, config)
}

fn adapter<H: Handler>(
    queue: &MemoryQueue,
    url: &str,
    processor: Processor<MemoryStore, H>,
) -> LambdaAdapter<MemoryStore, H, MemoryQueue> {
    let config = LambdaConfig {
        queue_url: Some(url.to_owned()),
        ..LambdaConfig::default()
    };
    LambdaAdapter::new(queue.clone(), processor, config)
}

/// In Lambda: a producer's re-send of a key whose first
/// delivery runs 200 s, processed by a function with a 25 s timeout and a
/// queue whose `maxReceiveCount` is 2. The copy waited for the holder
/// within each invocation and was then listed, back at the holder's lease
/// end: a receive spent per invocation, and the third receive moved it to
/// the DLQ though its key completed. It is now sent again as a new message
/// under the same key each time the invocation ends (so it is received once
/// per message), and deleted as a duplicate once the holder completes.
#[tokio::test(start_paused = true)]
async fn a_copy_of_a_key_held_longer_than_max_receive_count_invocations_stays_out_of_the_dlq() {
    let queue = MemoryQueue::new();
    let (url, dlq) = queue_with_dlq(&queue, "held", 2);
    let (runs, effects) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let started = Arc::new(tokio::sync::Notify::new());
    let handler = handler_fn({
        let (runs, effects, started) = (runs.clone(), effects.clone(), started.clone());
        move |_m: Message, _ctx| {
            let (runs, effects, started) = (runs.clone(), effects.clone(), started.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                started.notify_one();
                tokio::time::sleep(Duration::from_secs(200)).await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        }
    });
    let (store, clock, config) = store_and_config("held");
    let processor = Processor::new(store, handler, config)
        .unwrap()
        .with_clock(clock);
    let adapter = adapter(&queue, &url, processor);
    queue.send(&url, event("e1")).await.unwrap();
    // The holder: a function with a timeout long enough for its handler.
    let holder = tokio::spawn({
        let (adapter, queue, url) = (adapter.clone(), queue.clone(), url.clone());
        async move { invoke(&adapter, &queue, &url, Duration::from_secs(300)).await }
    });
    started.notified().await;
    queue.send(&url, event("e1")).await.unwrap();
    let (mut copies, mut listed) = (Vec::new(), Vec::new());
    while !holder.is_finished() || queue.counts(&url).unwrap().stored() > 0 {
        assert!(copies.len() < 40, "the copy never settled");
        let (messages, failed) = invoke(&adapter, &queue, &url, Duration::from_secs(25)).await;
        copies.extend(messages.iter().map(Message::receive_count));
        listed.extend(failed);
    }
    let (held, failed) = holder.await.unwrap();
    assert_eq!((held.len(), failed.len()), (1, 0));
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the effect");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran again");
    let counts = queue.counts(&dlq).unwrap();
    assert_eq!(counts.stored(), 0, "a copy reached the DLQ: {copies:?}");
    assert!(listed.is_empty(), "listed: {listed:?}");
    // Each copy was received once: the waits spent no receives.
    assert!(copies.iter().all(|n| *n == 1), "receive counts {copies:?}");
    // The holder outlasted several invocations: the copy was sent again
    // (two producer sends, the rest the runtime's).
    let sent = queue.counts(&url).unwrap().enqueued;
    assert!(sent >= 4, "sent again {} times", sent - 2);
    assert_eq!(copies.len() as u64, sent - 1, "{copies:?}");
}

/// Found in review: a copy that waited for the holder within an invocation
/// claimed the key, once free, with the lease worked out before the wait,
/// which then outlived the invocation's deadline: a key left held after
/// the invocation ended. Each claim after a wait asks for a lease cut to
/// end by the deadline.
#[tokio::test(start_paused = true)]
async fn a_copy_that_waited_for_the_holder_claims_a_lease_ending_by_the_deadline() {
    let queue = MemoryQueue::new();
    let (url, _) = queue_with_dlq(&queue, "late", 5);
    let (store, clock, mut config) = store_and_config("late");
    config.lease = Duration::from_secs(60);
    let leases = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = handler_fn({
        let (store, leases) = (store.clone(), leases.clone());
        move |m: Message, _ctx| {
            let (store, leases) = (store.clone(), leases.clone());
            async move {
                if m.id() == "holder" {
                    tokio::time::sleep(Duration::from_secs(15)).await;
                    return Err(HandlerError::retry("the holder gives up"));
                }
                let record = store.get("late#e1").await.unwrap().expect("claimed");
                leases.lock().unwrap().push(record.lease_until_ms);
                Ok(None)
            }
        }
    });
    let processor = Processor::new(store, handler, config)
        .unwrap()
        .with_clock(clock.clone());
    let holder = tokio::spawn({
        let p = processor.clone();
        async move {
            let m = Message::new("holder", r#"{"id":"e1"}"#);
            p.process(m).await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    queue.send(&url, event("e1")).await.unwrap();
    let deadline_ms = clock.now_ms() + 25_000;
    let adapter = adapter(&queue, &url, processor);
    let (_, failed) = invoke(&adapter, &queue, &url, Duration::from_secs(25)).await;
    assert!(matches!(holder.await.unwrap(), Outcome::Retry { .. }));
    assert!(failed.is_empty(), "{failed:?}");
    let leases = leases.lock().unwrap();
    assert_eq!(leases.len(), 1, "the copy ran once");
    assert!(
        leases[0] <= deadline_ms,
        "the lease ends {} ms after the deadline",
        leases[0] - deadline_ms
    );
}

/// A copy sent again keeps its dedup key: read again from the body or the
/// attributes it keeps, or, under `message-id` keys, carried sealed. Where
/// it could not (a FIFO queue; `message-id` keys without a carry secret)
/// none is made.
#[test]
fn a_copy_sent_again_keeps_its_dedup_key_or_is_not_made() {
    let secret = crate::protocol::key::CarrySecret::new([3u8; 32]).unwrap();
    let received = Message::new("m-1", r#"{"id":"e1"}"#)
        .with_attribute("order", "o-1")
        .with_sender_id("AIDAALICE")
        .with_aws_trace_header("Root=1-5759e988-bd862e3fe1be46a994272793;Sampled=1");
    let after = Duration::from_secs(2000);
    // SQS credits the copy to the function's role.
    let as_received = |copy: &OutgoingMessage| {
        let mut m =
            Message::new("m-2", copy.body.clone()).with_sender_id("AROALAMBDAROLE:my-function");
        for (name, a) in &copy.attributes {
            m = m.with_typed_attribute(name, a.clone());
        }
        m
    };
    for source in [
        "json:/id",
        "attribute:order",
        "body-sha256",
        "message-id",
        "sender,json:/id",
    ] {
        let mut config = ProcessorConfig::new("c");
        config.key_source = source.parse().unwrap();
        config.carry_secret = Some(secret.clone());
        let copy = copy_to_send_again(&received, "https://q/std", &config, after).unwrap();
        assert_eq!(
            config.dedup_key(&as_received(&copy)),
            config.dedup_key(&received),
            "{source}"
        );
        assert_eq!(copy.delay, Some(Duration::from_secs(900)), "SQS's longest");
        assert_eq!(copy.trace_header.as_deref(), received.aws_trace_header());
        assert_eq!(copy.attributes["order"], received.attributes()["order"]);
        assert!(copy_to_send_again(&received, "https://q/f.fifo", &config, after).is_none());
        config.carry_secret = None;
        let without = copy_to_send_again(&received, "https://q/std", &config, after);
        let needs_secret = source == "message-id" || source.starts_with("sender");
        assert_eq!(without.is_some(), !needs_secret, "{source}");
    }
}

/// In Lambda: a large payload's download ran before
/// anything kept the record invisible, so one slower than the queue's
/// visibility timeout let SQS hand the record to another consumer while
/// this one went on with it. The download is now covered by the heartbeat.
#[tokio::test(start_paused = true)]
async fn a_download_slower_than_the_visibility_timeout_keeps_the_record_from_other_consumers() {
    let queue = MemoryQueue::new();
    let (url, _) = queue_with_dlq(&queue, "slow", 5);
    let objects = MemoryPayloads::default();
    objects.put("b", "k1", r#"{"id":"e1"}"#);
    objects.slow_gets(VISIBILITY * 2);
    let body = format!(r#"["{POINTER_CLASS}",{{"s3BucketName":"b","s3Key":"k1"}}]"#);
    let pointer = OutgoingMessage {
        attributes: [(SIZE_ATTRIBUTE.to_owned(), crate::Attribute::string("11"))].into(),
        ..event("unused")
    };
    queue
        .send(&url, OutgoingMessage { body, ..pointer })
        .await
        .unwrap();
    let effects = Arc::new(AtomicU32::new(0));
    let handler = handler_fn({
        let effects = effects.clone();
        move |_m: Message, _ctx| {
            let effects = effects.clone();
            async move {
                effects.fetch_add(1, Ordering::SeqCst);
                Ok(None)
            }
        }
    });
    let (store, clock, config) = store_and_config("slow");
    let processor = Processor::new(store, handler, config)
        .unwrap()
        .with_clock(clock)
        .with_large_payloads(crate::protocol::payloads::LargePayloads::new(
            objects.clone(),
        ));
    let adapter = adapter(&queue, &url, processor);
    let request = ReceiveRequest {
        max: 10,
        wait: Duration::from_secs(5),
        visibility: VISIBILITY,
    };
    let batch = queue.receive(&url, request).await.unwrap();
    let function = tokio::spawn({
        let (queue, url) = (queue.clone(), url.clone());
        let timeout = Duration::from_secs(120);
        async move { invoke_with(&adapter, &queue, &url, batch, timeout).await }
    });
    // Another consumer of the queue, for as long as the invocation runs.
    let mut elsewhere = Vec::new();
    while !function.is_finished() {
        elsewhere.extend(queue.receive(&url, request).await.unwrap());
    }
    let (received, failed) = function.await.unwrap();
    assert!(elsewhere.is_empty(), "received by another consumer");
    assert_eq!((received.len(), failed.len()), (1, 0));
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    assert_eq!(objects.gets(), 1);
    assert_eq!(queue.counts(&url).unwrap().stored(), 0);
}

/// Simulator seed 4110 (`maxReceiveCount` 3): SQS put one message twice in
/// one batch (a twin: both receipt handles valid). The twins share a lane;
/// the first to run failed and set its retry delay through its receipt,
/// which made the message visible while the other ran, and the next receive
/// (another poller of the event source mapping) moved it to the DLQ as the
/// other completed. A record with a newer copy in its batch, or one that
/// runs after it, now leaves the message's visibility alone: in either
/// order in the batch.
#[tokio::test(start_paused = true)]
async fn a_twin_in_the_batch_sets_no_retry_delay_while_the_other_runs() {
    for reversed in [false, true] {
        let queue = MemoryQueue::new();
        let dlq = queue.create_queue(QueueSettings::new("twin-dlq")).unwrap();
        let mut settings = QueueSettings::new("twin");
        settings.redrive = Some(RedrivePolicy {
            dlq_url: dlq.clone(),
            max_receive_count: 2,
        });
        // SQS's "might" hits on the first receive only (its two draws: a
        // message in flight to hand out again, none; the one taken, again):
        // one twin, in the same batch.
        settings.might.twice = 1.0;
        settings.might.draw = Some(first_draws_hit(2));
        let url = queue.create_queue(settings).unwrap();
        queue.send(&url, event("e1")).await.unwrap();
        let calls = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
        let c = calls.clone();
        let handler = handler_fn(move |m: Message, _ctx| {
            let c = c.clone();
            async move {
                let first = {
                    let mut calls = c.lock().unwrap();
                    calls.push(m.receive_count());
                    calls.len() == 1
                };
                if first {
                    return Err(HandlerError::retry_after(
                        Duration::from_secs(2),
                        "the first copy to run fails",
                    ));
                }
                // Longer than the first copy's retry delay.
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(None)
            }
        });
        let (store, _clock, config) = store_and_config("twin");
        let processor = Processor::new(store, handler, config).unwrap();
        let adapter = adapter(&queue, &url, processor);
        let request = ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: VISIBILITY,
        };
        let mut messages = queue.receive(&url, request).await.unwrap();
        assert_eq!(
            messages
                .iter()
                .map(Message::receive_count)
                .collect::<Vec<_>>(),
            [1, 2],
            "one message twice in the batch"
        );
        if reversed {
            messages.reverse();
        }
        // Another poller of the mapping receives while the second copy runs.
        let other = {
            let (queue, url) = (queue.clone(), url.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(3)).await;
                queue.receive(&url, request).await.unwrap()
            })
        };
        let (_, failed) = invoke_with(&adapter, &queue, &url, messages, VISIBILITY).await;
        let case = format!("reversed {reversed}");
        assert!(
            other.await.unwrap().is_empty(),
            "{case}: the message was visible"
        );
        assert_eq!(calls.lock().unwrap().len(), 2, "{case}");
        assert!(failed.is_empty(), "{case}: {failed:?}");
        assert_eq!(
            queue.counts(&dlq).unwrap().stored(),
            0,
            "{case}: moved to the DLQ"
        );
        assert_eq!(queue.counts(&url).unwrap().stored(), 0, "{case}");
    }
}

/// Simulator seed 360899: a first delivery finished early in a long batch.
/// Its heartbeat had extended its visibility for a lease (cut to end by the
/// deadline), so it became visible again while the rest of the batch ran,
/// before the invocation answered and Lambda deleted it: received again
/// elsewhere, a receive spent each time. Every extension now keeps a record
/// invisible past the answer, for the event source mapping's delete: here
/// it comes 20 s past the deadline.
#[tokio::test(start_paused = true)]
async fn a_record_finished_early_in_a_long_batch_stays_invisible_until_lambda_deletes_it() {
    let queue = MemoryQueue::new();
    let (url, _) = queue_with_dlq(&queue, "early", 5);
    for id in ["short", "long"] {
        queue.send(&url, event(id)).await.unwrap();
    }
    let effects = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handler = handler_fn({
        let effects = effects.clone();
        move |m: Message, _ctx| {
            let effects = effects.clone();
            async move {
                // Past the lease (10 s), so the heartbeat extends it.
                let short = m.body().contains("short");
                let takes = if short { 15 } else { 90 };
                tokio::time::sleep(Duration::from_secs(takes)).await;
                effects.lock().unwrap().push(m.body().to_owned());
                Ok(None)
            }
        }
    });
    let (store, clock, config) = store_and_config("early");
    let processor = Processor::new(store, handler, config)
        .unwrap()
        .with_clock(clock);
    let adapter = adapter(&queue, &url, processor);
    let request = ReceiveRequest {
        max: 10,
        wait: Duration::from_secs(5),
        visibility: VISIBILITY,
    };
    let batch = queue.receive(&url, request).await.unwrap();
    assert_eq!(batch.len(), 2);
    let timeout = Duration::from_secs(120);
    let deadline = Instant::now() + timeout;
    let function = tokio::spawn({
        let event = event_of(&batch);
        async move { adapter.handle_until(event, deadline).await }
    });
    // Another consumer of the queue, while the invocation runs and until
    // Lambda's delete, late: 20 s past the deadline.
    let delete_at = deadline + Duration::from_secs(20);
    let mut elsewhere = Vec::new();
    while Instant::now() < delete_at {
        elsewhere.extend(queue.receive(&url, request).await.unwrap());
    }
    let answer = function.await.unwrap().unwrap();
    assert!(answer.batch_item_failures.is_empty());
    for m in &batch {
        queue
            .delete(&url, m.receipt_handle().unwrap())
            .await
            .unwrap();
    }
    let elsewhere: Vec<&str> = elsewhere.iter().map(Message::body).collect();
    assert!(elsewhere.is_empty(), "received elsewhere: {elsewhere:?}");
    let mut effects = effects.lock().unwrap().clone();
    effects.sort();
    assert_eq!(effects, [r#"{"id":"long"}"#, r#"{"id":"short"}"#]);
    assert_eq!(queue.counts(&url).unwrap().stored(), 0, "both deleted");
}
