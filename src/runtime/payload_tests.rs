//! Deletion of large payloads by both runtimes, over an in-memory queue and
//! object store that share one log of calls: an object is deleted only after
//! its message, never for a parked message or one whose delete failed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::Message;
use crate::protocol::payloads::*;
use crate::protocol::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
};
use crate::testkit::payloads::MemoryPayloads;
use crate::{
    HandlerError, LambdaAdapter, LambdaConfig, MemoryStore, PollerConfig, Processor, handler_fn,
};

const QUEUE: &str = "http://queue/q";
const DLQ: &str = "http://queue/q-dlq";

type Log = Arc<Mutex<Vec<String>>>;

/// A queue that hands out `to_receive` once, logs deletes and parks, and
/// refuses to delete the receipts in `refuse`.
#[derive(Clone, Default)]
struct Queue {
    to_receive: Arc<Mutex<Vec<Message>>>,
    refuse: Arc<HashSet<String>>,
    log: Log,
}

impl Queue {
    fn note(&self, entry: String) {
        self.log.lock().unwrap().push(entry);
    }
}

impl QueueClient for Queue {
    async fn receive(&self, _: &str, _: ReceiveRequest) -> Result<Vec<Message>, QueueError> {
        let taken = std::mem::take(&mut *self.to_receive.lock().unwrap());
        if taken.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(taken)
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        if self.refuse.contains(receipt) {
            return Err(QueueError::new("DeleteMessage", queue, "refused", false));
        }
        self.note(format!("DeleteMessage {receipt}"));
        Ok(())
    }

    async fn delete_batch(
        &self,
        _: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        let mut failed = Vec::new();
        for (index, r) in receipts.iter().enumerate() {
            if self.refuse.contains(r) {
                failed.push(EntryFailure {
                    index,
                    code: "ReceiptHandleIsInvalid".into(),
                    message: None,
                });
            } else {
                self.note(format!("DeleteMessage {r}"));
            }
        }
        Ok(failed)
    }

    async fn change_visibility(&self, _: &str, _: &str, _: Duration) -> Result<(), QueueError> {
        Ok(())
    }

    async fn change_visibility_batch(
        &self,
        _: &str,
        _: &[String],
        _: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        Ok(Vec::new())
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        self.note(format!("SendMessage {queue} {}", message.body));
        Ok(())
    }

    async fn attributes(&self, _: &str) -> Result<QueueAttributes, QueueError> {
        Ok(QueueAttributes::default())
    }

    async fn queue_url(&self, _: &str, _: &str) -> Result<String, QueueError> {
        Ok(QUEUE.into())
    }
}

/// The in-memory store, its deletes written to the shared log.
struct Logged {
    objects: MemoryPayloads,
    log: Log,
}

impl PayloadStore for Logged {
    fn get<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, PayloadError>> {
        self.objects.get(pointer, max_bytes)
    }

    fn delete<'a>(&'a self, pointer: &'a S3Pointer) -> BoxFuture<'a, Result<(), PayloadError>> {
        self.log
            .lock()
            .unwrap()
            .push(format!("DeleteObject {}", pointer.key));
        self.objects.delete(pointer)
    }

    fn put<'a>(
        &'a self,
        pointer: &'a S3Pointer,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), PayloadError>> {
        PayloadStore::put(&self.objects, pointer, bytes)
    }
}

/// m1 (done), m2 (done, but its delete is refused), m3 (a payload the
/// handler refuses: parked), m4 (no payload).
fn messages(objects: &MemoryPayloads) -> Vec<Message> {
    let pointer = |id: &str, key: &str, payload: &str| {
        objects.put("b", key, payload);
        Message::new(
            id,
            format!(r#"["{POINTER_CLASS}",{{"s3BucketName":"b","s3Key":"{key}"}}]"#),
        )
        .with_attribute(SIZE_ATTRIBUTE, payload.len().to_string())
        .with_receipt_handle(format!("rh-{id}"))
    };
    vec![
        pointer("m1", "k1", r#"{"id":"e1"}"#),
        pointer("m2", "k2", r#"{"id":"e2"}"#),
        pointer("m3", "k3", r#"{"id":"e3","bad":true}"#),
        Message::new("m4", r#"{"id":"e4"}"#).with_receipt_handle("rh-m4"),
    ]
}

fn processor(
    objects: &MemoryPayloads,
    log: &Log,
    delete: bool,
) -> Processor<MemoryStore, impl crate::Handler> {
    let handler = handler_fn(|m: Message, _ctx| async move {
        if m.body().contains("bad") {
            return Err(HandlerError::permanent("not an event"));
        }
        Ok(None)
    });
    let mut config = crate::ProcessorConfig::new("test");
    config.key_source = "json:/id".parse().unwrap();
    let store = Logged {
        objects: objects.clone(),
        log: log.clone(),
    };
    Processor::new(MemoryStore::default(), handler, config)
        .unwrap()
        .with_large_payloads(LargePayloads::new(store).deleting(delete))
}

fn position(log: &[String], entry: &str) -> usize {
    log.iter()
        .position(|e| e == entry)
        .unwrap_or_else(|| panic!("{entry} not in {log:?}"))
}

fn object_deletes(log: &[String]) -> Vec<&str> {
    log.iter()
        .filter_map(|e| e.strip_prefix("DeleteObject "))
        .collect()
}

async fn run_poller(delete: bool) -> (Vec<String>, crate::runtime::poller::RunStats) {
    let objects = MemoryPayloads::default();
    let log = Log::default();
    let queue = Queue {
        to_receive: Arc::new(Mutex::new(messages(&objects))),
        refuse: Arc::new(HashSet::from(["rh-m2".to_owned()])),
        log: log.clone(),
    };
    let mut config = PollerConfig::new(QUEUE);
    config.dlq_url = Some(DLQ.into());
    config.exit_when_idle = Some(Duration::from_millis(300));
    config.batch_wait = Duration::from_millis(50);
    let p = processor(&objects, &log, delete);
    let stats = crate::runtime::poller::run(queue, p, config, CancellationToken::new()).await;
    let log = log.lock().unwrap().clone();
    (log, stats)
}

#[tokio::test]
async fn the_poller_deletes_an_object_only_after_its_message() {
    let (log, stats) = run_poller(true).await;
    assert_eq!((stats.completed, stats.parked), (3, 1), "{stats:?}");
    assert_eq!(object_deletes(&log), vec!["k1"], "{log:?}");
    assert!(position(&log, "DeleteMessage rh-m1") < position(&log, "DeleteObject k1"));
    // The parked copy is the pointer, and its object stays.
    assert!(
        log.iter().any(
            |e| e.starts_with(&format!("SendMessage {DLQ} [\"{POINTER_CLASS}\""))
                && e.contains("k3")
        ),
        "{log:?}"
    );
    let (log, _) = run_poller(false).await;
    assert!(object_deletes(&log).is_empty(), "{log:?}");
}

async fn run_lambda(delete: bool) -> (Vec<String>, serde_json::Value) {
    let objects = MemoryPayloads::default();
    let log = Log::default();
    let queue = Queue {
        refuse: Arc::new(HashSet::from(["rh-m2".to_owned()])),
        log: log.clone(),
        ..Queue::default()
    };
    let records: Vec<serde_json::Value> = messages(&objects)
        .into_iter()
        .map(|m| {
            let attributes: serde_json::Map<String, serde_json::Value> = m
                .attributes()
                .iter()
                .map(|(name, a)| {
                    let crate::AttributeValue::Text(t) = &a.value else {
                        unreachable!()
                    };
                    (
                        name.clone(),
                        serde_json::json!({"dataType": a.data_type, "stringValue": t}),
                    )
                })
                .collect();
            serde_json::json!({
                "messageId": m.id(), "receiptHandle": m.receipt_handle(), "body": m.body(),
                "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": attributes,
                "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:q",
            })
        })
        .collect();
    let config = LambdaConfig {
        dlq_url: Some(DLQ.into()),
        queue_url: Some(QUEUE.into()),
        ..LambdaConfig::default()
    };
    let adapter = LambdaAdapter::new(queue, processor(&objects, &log, delete), config);
    let deadline = SystemTime::now() + Duration::from_secs(30);
    let response = adapter
        .handle(serde_json::json!({ "Records": records }), deadline)
        .await
        .unwrap();
    let log = log.lock().unwrap().clone();
    (log, serde_json::to_value(response).unwrap())
}

#[tokio::test]
async fn lambda_deletes_the_messages_with_objects_itself_then_their_objects() {
    let (log, response) = run_lambda(true).await;
    assert_eq!(response["batchItemFailures"], serde_json::json!([]));
    assert_eq!(object_deletes(&log), vec!["k1"], "{log:?}");
    assert!(position(&log, "DeleteMessage rh-m1") < position(&log, "DeleteObject k1"));
    // Only messages with an object to delete are deleted by the function.
    assert!(!log.iter().any(|e| e == "DeleteMessage rh-m4"), "{log:?}");
    assert!(!log.iter().any(|e| e == "DeleteMessage rh-m3"), "{log:?}");
    let (log, response) = run_lambda(false).await;
    assert_eq!(response["batchItemFailures"], serde_json::json!([]));
    assert!(
        !log.iter().any(|e| e.starts_with("Delete")),
        "off: Lambda deletes the batch, the function nothing: {log:?}"
    );
}

/// A large payload's download ran before the heartbeat,
/// so a download slower than the visibility a receive set (the lease) let
/// SQS hand the message to another poller while this one went on with it
/// (and, its visibility gone, this one then left it unclaimed). The
/// download is now covered by the heartbeat: the message is received once,
/// read once and applied once.
#[tokio::test(start_paused = true)]
async fn a_download_slower_than_the_visibility_keeps_the_message_from_other_pollers() {
    use std::sync::atomic::{AtomicU32, Ordering};

    use crate::protocol::clock::TokioClock;
    use crate::testkit::queue::{MemoryQueue, QueueSettings};
    let queue = MemoryQueue::new();
    let url = queue.create_queue(QueueSettings::new("slow")).unwrap();
    let objects = MemoryPayloads::default();
    objects.put("b", "k1", r#"{"id":"e1"}"#);
    objects.slow_gets(Duration::from_secs(45));
    let pointer = OutgoingMessage {
        body: format!(r#"["{POINTER_CLASS}",{{"s3BucketName":"b","s3Key":"k1"}}]"#),
        attributes: [(SIZE_ATTRIBUTE.to_owned(), crate::Attribute::string("11"))].into(),
        ..OutgoingMessage::default()
    };
    queue.send(&url, pointer).await.unwrap();
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
    let mut config = crate::ProcessorConfig::new("slow");
    config.key_source = "json:/id".parse().unwrap();
    config.lease = Duration::from_secs(10);
    config.heartbeat = Duration::from_secs(4);
    let clock = Arc::new(TokioClock::starting_at(SystemTime::UNIX_EPOCH));
    let processor = Processor::new(MemoryStore::new(clock.clone()), handler, config)
        .unwrap()
        .with_clock(clock)
        .with_large_payloads(LargePayloads::new(objects.clone()));
    let mut config = PollerConfig::new(&url);
    config.exit_when_idle = Some(Duration::from_secs(60));
    let pollers = [0, 1].map(|_| {
        let run = crate::runtime::poller::run(
            queue.clone(),
            processor.clone(),
            config.clone(),
            CancellationToken::new(),
        );
        tokio::spawn(run)
    });
    let mut stats = Vec::new();
    for p in pollers {
        stats.push(p.await.unwrap());
    }
    let received: u64 = stats.iter().map(|s| s.received).sum();
    assert_eq!(received, 1, "received again elsewhere: {stats:?}");
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    assert_eq!(objects.gets(), 1);
    assert_eq!(queue.counts(&url).unwrap().stored(), 0);
}

/// On Lambda a record whose payload waits for the payload budget past the
/// invocation's margin is answered as a batch item failure (retried, not
/// lost), and runs once on the next invocation when the budget is free.
/// (The redelivery of the batch carries the completed record too: a
/// duplicate, not run again.)
#[tokio::test]
async fn lambda_retries_a_record_that_waits_for_the_payload_budget_past_its_margin() {
    let objects = MemoryPayloads::default();
    let records: Vec<serde_json::Value> = ["m1", "m2"]
        .iter()
        .map(|id| {
            let payload = format!(r#"{{"id":"{id}"}}"#);
            objects.put("b", id, payload.as_str());
            serde_json::json!({
                "messageId": id, "receiptHandle": format!("rh-{id}"),
                "body": format!(r#"["{POINTER_CLASS}",{{"s3BucketName":"b","s3Key":"{id}"}}]"#),
                "attributes": {"ApproximateReceiveCount": "1"},
                "messageAttributes": {SIZE_ATTRIBUTE: {"dataType": "Number", "stringValue": payload.len().to_string()}},
                "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:q",
            })
        })
        .chain([serde_json::json!({
            // An ordinary record beside them completes.
            "messageId": "m3", "receiptHandle": "rh-m3", "body": r#"{"id":"m3"}"#,
            "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {},
            "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:q",
        })])
        .collect();
    let runs = Arc::new(Mutex::new(Vec::<String>::new()));
    let handler = handler_fn({
        let runs = runs.clone();
        move |m: Message, _ctx| {
            let runs = runs.clone();
            async move {
                runs.lock().unwrap().push(m.body().to_owned());
                Ok(None)
            }
        }
    });
    let mut config = crate::ProcessorConfig::new("test");
    config.key_source = "json:/id".parse().unwrap();
    let budget = Arc::new(PayloadBudget::new(4 * 1024));
    let processor = Processor::new(MemoryStore::default(), handler, config)
        .unwrap()
        .with_large_payloads(LargePayloads::new(objects.clone()).within(budget.clone()));
    let config = LambdaConfig {
        dlq_url: Some(DLQ.into()),
        queue_url: Some(QUEUE.into()),
        margin: Duration::from_secs(1),
        ..LambdaConfig::default()
    };
    let adapter = LambdaAdapter::new(Queue::default(), processor, config);
    let event = serde_json::json!({ "Records": records });
    // Another payload holds the whole budget through the invocation.
    let hog = budget.try_grant(budget.bytes()).unwrap();
    let deadline = SystemTime::now() + Duration::from_secs(3);
    let response = adapter.handle(event.clone(), deadline).await.unwrap();
    let failed = serde_json::to_value(response).unwrap()["batchItemFailures"].clone();
    assert_eq!(
        failed,
        serde_json::json!([{"itemIdentifier": "m1"}, {"itemIdentifier": "m2"}]),
        "both retried"
    );
    assert_eq!(*runs.lock().unwrap(), [r#"{"id":"m3"}"#]);
    assert_eq!(objects.gets(), 0);
    drop(hog);
    let deadline = SystemTime::now() + Duration::from_secs(30);
    let response = adapter.handle(event, deadline).await.unwrap();
    let failed = serde_json::to_value(response).unwrap()["batchItemFailures"].clone();
    assert_eq!(failed, serde_json::json!([]));
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    assert_eq!(
        runs,
        [r#"{"id":"m1"}"#, r#"{"id":"m2"}"#, r#"{"id":"m3"}"#],
        "each once (m3 a duplicate the second time)"
    );
    assert_eq!(budget.held(), 0);
}
