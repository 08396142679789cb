//! The outbox on the in-memory models: sent only after the commit, recovered
//! by the redelivery when the send after the commit failed, refused before
//! anything is recorded when SQS would refuse it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use futures::future::BoxFuture;

use super::*;
use crate::protocol::outbox::{OUTBOX_ID_ATTRIBUTE, Outgoing, outbox_id};
use crate::protocol::queue::{EntryFailure, OutgoingMessage, QueueError};
use crate::testkit::queue::QueueSettings;
use crate::{Context, MemoryQueue, MemoryStore, Status, handler_fn, staged_only};

fn config() -> ProcessorConfig {
    let mut c = ProcessorConfig::new("a");
    c.key_source = "json:/id".parse().unwrap();
    c
}

/// The downstream queue, and a dispatcher into it that fails while `down`
/// and, with a store to watch, notes each message's record status when it
/// is sent.
#[derive(Clone)]
struct Downstream {
    queue: MemoryQueue,
    url: String,
    down: Arc<AtomicBool>,
    watch: Option<MemoryStore>,
    seen: Arc<std::sync::Mutex<Vec<Option<Status>>>>,
}

impl Downstream {
    fn new() -> Self {
        let queue = MemoryQueue::new();
        let url = queue.create_queue(QueueSettings::new("b")).unwrap();
        Self {
            queue,
            url,
            down: Arc::default(),
            watch: None,
            seen: Arc::default(),
        }
    }

    /// Notes the record status of each message it sends, read from `store`.
    fn watching(mut self, store: &MemoryStore) -> Self {
        self.watch = Some(store.clone());
        self
    }

    /// The record statuses noted at the sends.
    fn seen(&self) -> Vec<Option<Status>> {
        self.seen.lock().unwrap().clone()
    }

    /// The outbox ids of what the queue holds, in send order.
    fn ids(&self) -> Vec<String> {
        self.queue
            .contents(&self.url)
            .iter()
            .map(|m| match &m.attributes[OUTBOX_ID_ATTRIBUTE].value {
                crate::AttributeValue::Text(t) => t.clone(),
                crate::AttributeValue::Binary(_) => panic!("a string attribute"),
            })
            .collect()
    }
}

impl crate::Dispatcher for Downstream {
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<OutgoingMessage>,
    ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>> {
        Box::pin(async move {
            if self.down.load(Ordering::SeqCst) {
                return Err(QueueError::new(
                    "SendMessageBatch",
                    queue,
                    "unreachable",
                    true,
                ));
            }
            if let Some(store) = &self.watch {
                for m in &messages {
                    let crate::AttributeValue::Text(id) = &m.attributes[OUTBOX_ID_ATTRIBUTE].value
                    else {
                        panic!("a string attribute");
                    };
                    let pk = id.rsplit_once("#out-").map_or(id.as_str(), |(pk, _)| pk);
                    let status = store.get(pk).await.unwrap().map(|r| r.status);
                    self.seen.lock().unwrap().push(status);
                }
            }
            crate::QueueClient::send_batch(&self.queue, queue, messages).await
        })
    }
}

/// A handler that sends two messages to `url` per event and counts its runs.
fn sender(url: String, runs: Arc<AtomicU32>, fail_after_send: bool) -> impl crate::Handler + Clone {
    handler_fn(move |m: Message, ctx: Context| {
        let (url, runs) = (url.clone(), runs.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            ctx.send(&url, format!("paid {}", m.body()))?;
            ctx.send_message(Outgoing::new(&url, "audit").attribute("kind", "audit"))?;
            if fail_after_send {
                return Err(HandlerError::retry("declined after the sends"));
            }
            Ok(None)
        }
    })
}

fn record_outbox(store: &MemoryStore, pk: &str) -> Vec<Outgoing> {
    futures::executor::block_on(store.get(pk))
        .unwrap()
        .unwrap()
        .outbox
}

#[tokio::test]
async fn sent_messages_go_out_after_the_commit_with_stable_ids_on_both_paths() {
    for fast in [true, false] {
        let store = MemoryStore::default();
        let down = Downstream::new().watching(&store);
        let runs = Arc::new(AtomicU32::new(0));
        let handler = sender(down.url.clone(), runs.clone(), false);
        let outcome = if fast {
            let p = Processor::new(store.clone(), staged_only(handler), config()).unwrap();
            let p = p.with_dispatcher(down.clone());
            p.process(Message::new("m1", r#"{"id":"e1"}"#)).await
        } else {
            let p = Processor::new(store.clone(), handler, config()).unwrap();
            let p = p.with_dispatcher(down.clone());
            p.process(Message::new("m1", r#"{"id":"e1"}"#)).await
        };
        assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
        assert_eq!(down.ids(), [outbox_id("a#e1", 0), outbox_id("a#e1", 1)]);
        assert_eq!(
            down.seen(),
            [Some(Status::Completed); 2],
            "sent only once the record said COMPLETED"
        );
        assert!(
            record_outbox(&store, "a#e1").is_empty(),
            "marked dispatched"
        );
    }
}

#[tokio::test]
async fn a_failed_handler_sends_nothing() {
    let down = Downstream::new();
    let runs = Arc::new(AtomicU32::new(0));
    let handler = staged_only(sender(down.url.clone(), runs.clone(), true));
    let p = Processor::new(MemoryStore::default(), handler, config())
        .unwrap()
        .with_dispatcher(down.clone());
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    assert!(matches!(outcome, Outcome::Retry { .. }), "{outcome:?}");
    assert!(
        down.ids().is_empty(),
        "sent for an effect that did not commit"
    );
}

#[tokio::test]
async fn a_send_that_fails_after_the_commit_is_made_by_the_redelivery_without_running_again() {
    for fast in [true, false] {
        let down = Downstream::new();
        down.down.store(true, Ordering::SeqCst);
        let runs = Arc::new(AtomicU32::new(0));
        let store = MemoryStore::default();
        let handler = sender(down.url.clone(), runs.clone(), false);
        let process = |m: Message| {
            let (store, down, handler) = (store.clone(), down.clone(), handler.clone());
            async move {
                if fast {
                    let p = Processor::new(store, staged_only(handler), config()).unwrap();
                    let p = p.with_dispatcher(down);
                    (p.process(m).await, p.metrics().take())
                } else {
                    let p = Processor::new(store, handler, config()).unwrap();
                    let p = p.with_dispatcher(down);
                    (p.process(m).await, p.metrics().take())
                }
            }
        };
        let (first, counts) = process(Message::new("m1", r#"{"id":"e1"}"#)).await;
        assert!(
            matches!(first, Outcome::Retry { .. }),
            "not deleted: {first:?}"
        );
        assert_eq!(counts.outbox_dispatch_failures, 1);
        let record = futures::executor::block_on(store.get("a#e1"))
            .unwrap()
            .unwrap();
        assert_eq!(record.status, Status::Completed);
        assert_eq!(record.outbox.len(), 2, "kept to send");
        assert!(down.ids().is_empty());

        down.down.store(false, Ordering::SeqCst);
        let again = Message::new("m1", r#"{"id":"e1"}"#).with_receive_count(2);
        let (second, counts) = process(again).await;
        assert!(matches!(second, Outcome::Duplicate { .. }), "{second:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
        assert_eq!(counts.outbox_recovered, 2);
        assert_eq!(down.ids(), [outbox_id("a#e1", 0), outbox_id("a#e1", 1)]);
        assert!(record_outbox(&store, "a#e1").is_empty());

        // A later duplicate finds nothing more to send.
        let third = Message::new("m2", r#"{"id":"e1"}"#).with_receive_count(2);
        assert!(matches!(process(third).await.0, Outcome::Duplicate { .. }));
        assert_eq!(down.ids().len(), 2);
    }
}

#[tokio::test]
async fn what_sqs_would_refuse_parks_the_message_and_records_nothing_to_send() {
    let fifo = MemoryQueue::url_of("b.fifo");
    let handler = staged_only(handler_fn(move |_m, ctx: Context| {
        let fifo = fifo.clone();
        async move {
            // The error ignored: the message fails all the same.
            let _ = ctx.send(&fifo, "no group");
            Ok(None)
        }
    }));
    let down = Downstream::new();
    let store = MemoryStore::default();
    let p = Processor::new(store.clone(), handler, config())
        .unwrap()
        .with_dispatcher(down.clone());
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(reason.contains("no message group"), "{reason}");
    let record = store.get("a#e1").await.unwrap().unwrap();
    assert_eq!(record.status, Status::Failed);
    assert!(record.outbox.is_empty());
}

#[tokio::test]
async fn a_processor_with_nowhere_to_send_parks_a_handler_that_sends() {
    let handler = staged_only(handler_fn(|_m, ctx: Context| async move {
        ctx.send("https://sqs.eu-west-1.amazonaws.com/1/b", "x")?;
        Ok(None)
    }));
    let p = Processor::new(MemoryStore::default(), handler, config()).unwrap();
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(reason.contains("no dispatcher"), "{reason}");
}

#[tokio::test]
async fn the_runtimes_queue_sends_only_when_no_dispatcher_is_set() {
    let down = Downstream::new();
    let runtimes = Downstream::new();
    let handler = || sender(down.url.clone(), Arc::default(), false);
    let message = || Message::new("m1", r#"{"id":"e1"}"#);
    // Set: the runtime's queue is not used.
    let p = Processor::new(MemoryStore::default(), handler(), config())
        .unwrap()
        .with_dispatcher(down.clone())
        .dispatching_through(&runtimes.queue);
    assert!(matches!(
        p.process(message()).await,
        Outcome::Completed { .. }
    ));
    assert_eq!((down.ids().len(), runtimes.ids().len()), (2, 0));
    // Not set: the runtime's queue sends (its in-memory service has a
    // queue at the same URL).
    let p = Processor::new(MemoryStore::default(), handler(), config())
        .unwrap()
        .dispatching_through(&runtimes.queue);
    assert!(matches!(
        p.process(message()).await,
        Outcome::Completed { .. }
    ));
    assert_eq!((down.ids().len(), runtimes.ids().len()), (2, 2));
}

#[tokio::test]
async fn a_record_over_dynamodbs_item_limit_with_its_result_and_outbox_is_parked_not_written() {
    let down = Downstream::new();
    let url = down.url.clone();
    let handler = staged_only(handler_fn(move |_m, ctx: Context| {
        let url = url.clone();
        async move {
            for _ in 0..2 {
                ctx.send(&url, "x".repeat(100 * 1024))?;
            }
            Ok(Some(serde_json::json!("r".repeat(300 * 1024))))
        }
    }));
    let mut c = config();
    c.max_result_bytes = 350 * 1024;
    let store = MemoryStore::default();
    let p = Processor::new(store.clone(), handler, c)
        .unwrap()
        .with_dispatcher(down.clone());
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(reason.contains("400 KB"), "{reason}");
    assert!(down.ids().is_empty());
    let record = store.get("a#e1").await.unwrap().unwrap();
    assert_eq!(record.status, Status::Failed);
}

#[tokio::test]
async fn a_send_after_the_handler_returned_is_refused_not_silently_dropped() {
    let down = Downstream::new();
    let url = down.url.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<Context>();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let handler = staged_only(handler_fn(move |_m, ctx: Context| {
        let tx = tx.clone();
        async move {
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(ctx);
            }
            Ok(None)
        }
    }));
    let p = Processor::new(MemoryStore::default(), handler, config())
        .unwrap()
        .with_dispatcher(down.clone());
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
    let late = rx.await.unwrap().send(&url, "late");
    let err = late.expect_err("refused after the handler returned");
    assert_eq!(err.kind(), crate::FailureKind::Permanent);
    assert!(
        err.to_string().contains("after the handler returned"),
        "{err}"
    );
    assert!(down.ids().is_empty());
}

/// A handler that sends one body of `bytes` bytes to `url`.
fn large_sender(url: String, bytes: usize) -> impl crate::Handler + Clone {
    handler_fn(move |m: Message, ctx: Context| {
        let url = url.clone();
        async move {
            let body = format!("{}{}", m.body(), "x".repeat(bytes));
            ctx.send_message(Outgoing::new(&url, body).attribute("kind", "large"))?;
            Ok(None)
        }
    })
}

fn offloading(objects: &crate::testkit::payloads::MemoryPayloads) -> LargePayloads {
    LargePayloads::new(objects.clone()).sending_large_to(
        crate::protocol::payloads::PayloadLocation {
            bucket: "out".into(),
            prefix: "sent/".into(),
        },
    )
}

#[tokio::test]
async fn a_body_too_large_for_sqs_goes_through_s3_and_a_reader_downstream_gets_it_once() {
    for fast in [true, false] {
        let objects = crate::testkit::payloads::MemoryPayloads::default();
        let (store, down) = (MemoryStore::default(), Downstream::new());
        let handler = large_sender(down.url.clone(), 300 * 1024);
        let outcome = if fast {
            let p = Processor::new(store.clone(), staged_only(handler), config()).unwrap();
            let p = p
                .with_dispatcher(down.clone())
                .with_large_payloads(offloading(&objects));
            p.process(Message::new("m1", r#"{"id":"e1"}"#)).await
        } else {
            let p = Processor::new(store.clone(), handler, config()).unwrap();
            let p = p
                .with_dispatcher(down.clone())
                .with_large_payloads(offloading(&objects));
            p.process(Message::new("m1", r#"{"id":"e1"}"#)).await
        };
        assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
        let puts = objects.puts();
        assert_eq!(puts.len(), 1);
        assert_eq!(puts[0].bucket, "out");
        assert!(puts[0].key.starts_with("sent/"), "{:?}", puts[0]);
        let sent = down.queue.contents(&down.url);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].body, puts[0].to_body(), "a pointer is sent");
        let size = &sent[0].attributes[crate::protocol::payloads::SIZE_ATTRIBUTE];
        assert_eq!(size.data_type, "Number");

        // A consumer downstream reading large payloads gets the body, once.
        let request = crate::protocol::queue::ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(30),
        };
        let received = crate::QueueClient::receive(&down.queue, &down.url, request)
            .await
            .unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let keep = seen.clone();
        // On the claim path: the handler runs only for the first copy.
        let reader = handler_fn(move |m: Message, _ctx: Context| {
            let keep = keep.clone();
            async move {
                keep.lock().unwrap().push(m.body().to_owned());
                Ok(None)
            }
        });
        let mut c = ProcessorConfig::new("b");
        c.key_source = format!("attribute:{OUTBOX_ID_ATTRIBUTE}").parse().unwrap();
        let p = Processor::new(MemoryStore::default(), reader, c)
            .unwrap()
            .with_large_payloads(LargePayloads::new(objects.clone()));
        for m in [received[0].clone(), received[0].clone()] {
            let outcome = p.process(m).await;
            assert!(
                matches!(
                    outcome,
                    Outcome::Completed { .. } | Outcome::Duplicate { .. }
                ),
                "{outcome:?}"
            );
        }
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "applied once");
        assert_eq!(seen[0].len(), r#"{"id":"e1"}"#.len() + 300 * 1024);
        assert!(seen[0].starts_with(r#"{"id":"e1"}x"#));
    }
}

#[tokio::test]
async fn a_large_body_with_nowhere_to_store_it_or_over_the_maximum_is_parked_with_the_reason() {
    let down = Downstream::new();
    let objects = crate::testkit::payloads::MemoryPayloads::default();
    let cases = [
        (None, "SQS_ONCE_OUTBOX_PAYLOAD_BUCKET"),
        (
            Some(offloading(&objects).max_bytes(100 * 1024)),
            "bodies sent through S3 may be at most",
        ),
    ];
    for (payloads, expected) in cases {
        let store = MemoryStore::default();
        let handler = staged_only(large_sender(down.url.clone(), 300 * 1024));
        let mut p = Processor::new(store.clone(), handler, config())
            .unwrap()
            .with_dispatcher(down.clone());
        if let Some(payloads) = payloads {
            p = p.with_large_payloads(payloads);
        }
        let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
        let Outcome::Park { reason } = outcome else {
            panic!("{outcome:?}");
        };
        assert!(reason.contains(expected), "{reason}");
        assert!(store.get("a#e1").await.unwrap().unwrap().outbox.is_empty());
    }
    assert!(objects.puts().is_empty());
    assert!(down.ids().is_empty());
}

#[tokio::test]
async fn a_large_body_s3_did_not_store_is_a_retry_with_nothing_recorded() {
    for fast in [true, false] {
        let objects = crate::testkit::payloads::MemoryPayloads::default();
        objects.fail_next_put(crate::protocol::payloads::PayloadErrorKind::Transient);
        let (store, down) = (MemoryStore::default(), Downstream::new());
        let handler = large_sender(down.url.clone(), 300 * 1024);
        let process = |m: Message| {
            let (store, down, handler) = (store.clone(), down.clone(), handler.clone());
            let payloads = offloading(&objects);
            async move {
                if fast {
                    let p = Processor::new(store, staged_only(handler), config()).unwrap();
                    p.with_dispatcher(down)
                        .with_large_payloads(payloads)
                        .process(m)
                        .await
                } else {
                    let p = Processor::new(store, handler, config()).unwrap();
                    p.with_dispatcher(down)
                        .with_large_payloads(payloads)
                        .process(m)
                        .await
                }
            }
        };
        let first = process(Message::new("m1", r#"{"id":"e1"}"#)).await;
        let Outcome::Retry { reason, .. } = first else {
            panic!("{first:?}");
        };
        assert!(reason.contains("could not be stored in S3"), "{reason}");
        let record = store.get("a#e1").await.unwrap();
        assert!(
            record
                .as_ref()
                .is_none_or(|r| r.status != Status::Completed),
            "nothing committed: {record:?}"
        );
        let again = Message::new("m1", r#"{"id":"e1"}"#).with_receive_count(2);
        assert!(matches!(process(again).await, Outcome::Completed { .. }));
        assert_eq!(objects.puts().len(), 1);
        assert_eq!(down.ids().len(), 1);
    }
}

/// a handler may give an outgoing message MAX_USER_ATTRIBUTES (8)
/// attributes; offloading adds `ExtendedPayloadSize` and, with a carry
/// secret, `to_send` adds the id and the sealed key: 11 attributes, which
/// SQS refuses, after the effect committed. `send_message` accepted it.
#[tokio::test]
async fn an_offloaded_body_with_eight_attributes_and_a_carry_secret_is_refused_before_the_commit() {
    let objects = crate::testkit::payloads::MemoryPayloads::default();
    let (store, down) = (MemoryStore::default(), Downstream::new());
    let url = down.url.clone();
    let handler = handler_fn(move |_m: Message, ctx: Context| {
        let url = url.clone();
        async move {
            let mut out = Outgoing::new(&url, "x".repeat(300 * 1024));
            for i in 0..crate::protocol::outbox::MAX_USER_ATTRIBUTES {
                out = out.attribute(format!("a{i}"), "v");
            }
            ctx.send_message(out)?;
            Ok(None)
        }
    });
    let mut c = config();
    c.carry_secret = Some(crate::protocol::key::CarrySecret::new("s".repeat(32)).unwrap());
    let p = Processor::new(store.clone(), staged_only(handler), c)
        .unwrap()
        .with_dispatcher(down.clone())
        .with_large_payloads(offloading(&objects));
    let outcome = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    // Either refused before the commit (parked, nothing recorded) or sent.
    let committed = store
        .get("a#e1")
        .await
        .unwrap()
        .is_some_and(|r| r.status == Status::Completed);
    assert!(
        !committed || down.ids().len() == 1,
        "committed but its message can never be sent: {outcome:?}"
    );
}

/// A compound key that reads the message id is refused: a copy brought
/// back from the DLQ has a new id, and redrive seals the first id as the
/// whole carried key, so it would run again under another key.
#[test]
fn a_compound_key_with_the_message_or_dedup_id_is_refused_at_start_up() {
    for spec in ["attribute:tenant,message-id", "json:/id,dedup-id"] {
        let mut c = ProcessorConfig::new("a");
        c.key_source = spec.parse().unwrap();
        let e = c.validate().unwrap_err();
        assert_eq!(e.setting, "SQS_ONCE_DEDUP_KEY", "{spec}");
        assert!(
            e.problem.contains("cannot be part of a compound key"),
            "{e}"
        );
    }
    let mut c = ProcessorConfig::new("a");
    c.key_source = "attribute:tenant,json:/id".parse().unwrap();
    c.validate().unwrap();
}

/// with the EventBridge envelope and `body-sha256` keys, two
/// different events (another `detail-type`, source and id) whose `detail`
/// is the same are one key: the second is skipped as a duplicate, and
/// its payload hash matches, so not even a mismatch is counted.
#[tokio::test]
async fn two_eventbridge_events_of_different_types_with_one_detail_are_two_keys_under_body_sha256()
{
    let mut c = ProcessorConfig::new("a");
    c.key_source = "body-sha256".parse().unwrap();
    c.envelope = crate::Envelope::EventBridge;
    let runs = Arc::new(AtomicU32::new(0));
    let counted = runs.clone();
    let handler = handler_fn(move |_m: Message, _ctx: Context| {
        let runs = counted.clone();
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(None)
        }
    });
    let p = Processor::new(MemoryStore::default(), handler, c).unwrap();
    let event = |id: &str, kind: &str| {
        format!(
            r#"{{"version":"0","id":"{id}","source":"shop.orders","detail-type":"{kind}","account":"1","time":"2026-01-01T00:00:00Z","region":"eu-west-1","resources":[],"detail":{{"orderId":"o-1"}}}}"#
        )
    };
    p.process(Message::new("m-1", event("e-1", "OrderPlaced")))
        .await;
    let second = p
        .process(Message::new("m-2", event("e-2", "OrderCancelled")))
        .await;
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the cancellation was dropped: {second:?}"
    );
}

/// `SQS_ONCE_PAYLOAD_POINTERS` takes any text starting with `/`,
/// but reads it as a plain JSON pointer: `/payload>/amount` (the `>` form
/// keys accept) matches nothing in every payload, so a changed amount under
/// one key is never a mismatch.
#[test]
fn a_payload_pointer_in_the_key_form_cannot_hide_a_mismatch() {
    let mut c = ProcessorConfig::new("a");
    c.payload_pointers = vec!["/payload>/amount".into()];
    assert!(
        c.validate().is_err()
            || c.payload_sha256(&Message::new("m", r#"{"payload":"{\"amount\":1}"}"#))
                != c.payload_sha256(&Message::new("m", r#"{"payload":"{\"amount\":2}"}"#)),
        "accepted, and amounts 1 and 2 hash the same"
    );
}

/// On the claim path a handler that stores its large body with
/// `send_large` before its effect (a card charged) fails before the effect
/// when S3 does not store it: the redelivery makes the effect once. (With
/// `send`, the body is stored after the handler returned, and a failed
/// upload there runs the handler again, as a failed completion does.)
#[tokio::test]
async fn a_large_body_stored_before_the_effect_keeps_a_failed_upload_from_doubling_it() {
    let objects = crate::testkit::payloads::MemoryPayloads::default();
    objects.fail_next_put(crate::protocol::payloads::PayloadErrorKind::Transient);
    let (store, down) = (MemoryStore::default(), Downstream::new());
    let charges = Arc::new(AtomicU32::new(0));
    let (url, counted) = (down.url.clone(), charges.clone());
    let handler = handler_fn(move |_m: Message, ctx: Context| {
        let (url, charges) = (url.clone(), counted.clone());
        async move {
            ctx.send_large(Outgoing::new(&url, "x".repeat(300 * 1024)))
                .await?;
            charges.fetch_add(1, Ordering::SeqCst); // the effect
            Ok(None)
        }
    });
    let p = Processor::new(store, handler, config())
        .unwrap()
        .with_dispatcher(down.clone())
        .with_large_payloads(offloading(&objects));
    let first = p.process(Message::new("m1", r#"{"id":"e1"}"#)).await;
    assert!(matches!(first, Outcome::Retry { .. }), "{first:?}");
    assert_eq!(
        charges.load(Ordering::SeqCst),
        0,
        "no effect before the upload"
    );
    let second = p
        .process(Message::new("m1", r#"{"id":"e1"}"#).with_receive_count(2))
        .await;
    assert!(matches!(second, Outcome::Completed { .. }), "{second:?}");
    assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
    assert_eq!(down.ids().len(), 1, "and its message sent");
    assert_eq!(objects.puts().len(), 1);
}

/// a duplicate of a completed message whose large payload was
/// deleted meanwhile (`SQS_ONCE_DELETE_PAYLOADS=on`) is recognised by its
/// body-free key; with an envelope configured, `dedup_key` tries to open
/// the envelope on the pointer body first, fails, and the duplicate of a
/// `message-id` key is parked instead.
#[tokio::test]
async fn a_duplicate_whose_payload_is_gone_is_a_duplicate_under_an_envelope() {
    let objects = crate::testkit::payloads::MemoryPayloads::default();
    let mut c = ProcessorConfig::new("a");
    c.envelope = crate::Envelope::Sns;
    let store = MemoryStore::default();
    let handler = handler_fn(|_m: Message, _ctx: Context| async move { Ok(None) });
    let p = Processor::new(store, handler, c)
        .unwrap()
        .with_large_payloads(LargePayloads::new(objects.clone()));
    let sns = r#"{"Type":"Notification","MessageId":"n-1","TopicArn":"arn:aws:sns:eu-west-1:1:t","Message":"hello","Timestamp":"2026-01-01T00:00:00Z"}"#;
    let pointer = objects.put("in", "k1", sns);
    let received = Message::new("m-1", pointer.to_body()).with_typed_attribute(
        crate::protocol::payloads::SIZE_ATTRIBUTE,
        crate::Attribute::typed("Number", Some(sns.len().to_string()), None).unwrap(),
    );
    assert!(matches!(
        p.process(received.clone()).await,
        Outcome::Completed { .. }
    ));
    // Deleted after the message was (DELETE_PAYLOADS); SQS delivers a
    // duplicate of the message.
    let objects2 = crate::testkit::payloads::MemoryPayloads::default();
    let p = Processor::new(
        p.store().clone(),
        handler_fn(|_m: Message, _ctx: Context| async move { Ok(None) }),
        {
            let mut c = ProcessorConfig::new("a");
            c.envelope = crate::Envelope::Sns;
            c
        },
    )
    .unwrap()
    .with_large_payloads(LargePayloads::new(objects2));
    let again = p.process(received.with_receive_count(2)).await;
    assert!(
        matches!(again, Outcome::Duplicate { .. }),
        "a duplicate parked: {again:?}"
    );
}

/// With an outgoing location but reading off (only sending through S3), an
/// incoming pointer is handed to the handler as received, not read.
#[tokio::test]
async fn a_processor_that_only_sends_through_s3_reads_no_incoming_pointer() {
    let objects = crate::testkit::payloads::MemoryPayloads::default();
    let pointer = objects.put("elsewhere", "k", "the payload");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = seen.clone();
    let handler = handler_fn(move |m: Message, _ctx: Context| {
        let keep = keep.clone();
        async move {
            keep.lock().unwrap().push(m.body().to_owned());
            Ok(None)
        }
    });
    let p = Processor::new(MemoryStore::default(), handler, ProcessorConfig::new("a"))
        .unwrap()
        .with_large_payloads(offloading(&objects).reading(false));
    let m = Message::new("m-1", pointer.to_body())
        .with_attribute(crate::protocol::payloads::SIZE_ATTRIBUTE, "11");
    assert!(matches!(p.process(m).await, Outcome::Completed { .. }));
    assert_eq!(*seen.lock().unwrap(), [pointer.to_body()]);
    assert_eq!(objects.gets(), 0);
}

/// Under the SNS envelope the queue's own attributes win over the
/// notification's of the same name: a publisher cannot replace them.
#[tokio::test]
async fn the_queues_own_attribute_wins_over_an_sns_attribute_of_the_same_name() {
    let mut c = ProcessorConfig::new("a");
    c.envelope = crate::Envelope::Sns;
    c.key_source = "attribute:tenant".parse().unwrap();
    let key = c
        .dedup_key(
            &Message::new(
                "m-1",
                r#"{"Type":"Notification","MessageId":"n-1","TopicArn":"arn:aws:sns:eu-west-1:1:t","Message":"hello","Timestamp":"2026-01-01T00:00:00Z","MessageAttributes":{"tenant":{"Type":"String","Value":"mallory"}}}"#,
            )
            .with_attribute("tenant", "acme"),
        )
        .unwrap();
    assert_eq!(key, "acme");
}

/// [`Downstream`] whose every send takes `takes` (virtual time).
#[derive(Clone)]
struct SlowDownstream {
    inner: Downstream,
    takes: Duration,
}

impl crate::Dispatcher for SlowDownstream {
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<OutgoingMessage>,
    ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>> {
        Box::pin(async move {
            tokio::time::sleep(self.takes).await;
            self.inner.send_batch(queue, messages).await
        })
    }
}

/// Counts the visibility extensions asked for (all succeed).
#[derive(Default)]
struct Extensions(AtomicU32);

impl crate::protocol::processor::VisibilityExtender for Extensions {
    fn extend<'a>(
        &'a self,
        _message: &'a Message,
        _timeout: Duration,
    ) -> BoxFuture<'a, Result<(), QueueError>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }
}

/// Simulator seed 659792: a claim, a handler, a slow completion and an
/// outbox send tried twice, each shorter than a beat, took 11.9 s of a
/// 13.1 s lease: the send after the commit was the one step not kept
/// visible, and the delete, on the message's last allowed receive, came
/// after SQS's end. The message's visibility is now kept through the
/// outbox's sends, on both paths: an 8 s send against a 10 s lease and a
/// 3 s beat is extended twice or more while it runs.
#[tokio::test(start_paused = true)]
async fn the_visibility_is_kept_while_the_outbox_sends_after_the_commit() {
    for fast in [true, false] {
        let store = MemoryStore::default();
        let down = Downstream::new();
        let slow = SlowDownstream {
            inner: down.clone(),
            takes: Duration::from_secs(8),
        };
        let runs = Arc::new(AtomicU32::new(0));
        let handler = sender(down.url.clone(), runs, false);
        let mut c = config();
        c.lease = Duration::from_secs(10);
        c.heartbeat = Duration::from_secs(3);
        c.lease_margin = Duration::from_secs(1);
        let sqs = Extensions::default();
        let received_at = tokio::time::Instant::now();
        let opts = ProcessOptions {
            visibility: Some(&sqs),
            invisible_until: Some(received_at + c.lease),
            received_at: Some(received_at),
            ..ProcessOptions::default()
        };
        let message = Message::new("m1", r#"{"id":"e1"}"#);
        let outcome = if fast {
            let p = Processor::new(store.clone(), staged_only(handler), c).unwrap();
            p.with_dispatcher(slow).process_with(message, opts).await
        } else {
            let p = Processor::new(store.clone(), handler, c).unwrap();
            p.with_dispatcher(slow).process_with(message, opts).await
        };
        assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
        assert_eq!(down.ids().len(), 2, "fast path: {fast}");
        let extended = sqs.0.load(Ordering::SeqCst);
        assert!(
            extended >= 2,
            "fast path: {fast}: {extended} extensions during an 8 s send"
        );
    }
}
