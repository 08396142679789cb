use std::sync::{Arc, Mutex};

use super::*;
use crate::testkit::payloads::MemoryPayloads;
use crate::{MemoryStore, Processor, handler_fn};

/// The body the Python extended client sends (`json.dumps`: spaces after separators).
fn python_pointer(bucket: &str, key: &str) -> String {
    format!(r#"["{POINTER_CLASS}", {{"s3BucketName": "{bucket}", "s3Key": "{key}"}}]"#)
}

fn pointer_message(id: &str, bucket: &str, key: &str, size: usize) -> Message {
    Message::new(id, python_pointer(bucket, key))
        .with_typed_attribute(
            SIZE_ATTRIBUTE,
            crate::Attribute::typed("Number", Some(size.to_string()), None).unwrap(),
        )
        .with_attribute("trace", "t-1")
        .with_receipt_handle(format!("rh-{id}"))
}

#[test]
fn parses_the_pointers_of_both_extended_clients() {
    let want = S3Pointer {
        bucket: "big".into(),
        key: "0b6c-uuid".into(),
    };
    // Python: json.dumps; Java: Jackson, no spaces; the Java 1.x class.
    let java = format!(r#"["{POINTER_CLASS}",{{"s3BucketName":"big","s3Key":"0b6c-uuid"}}]"#);
    let legacy =
        format!(r#"["{LEGACY_POINTER_CLASS}",{{"s3BucketName":"big","s3Key":"0b6c-uuid"}}]"#);
    for body in [python_pointer("big", "0b6c-uuid"), java, legacy] {
        assert_eq!(S3Pointer::parse(&body), Ok(want.clone()), "{body}");
    }
    assert_eq!(want.to_string(), "s3://big/0b6c-uuid");
}

#[test]
fn rejects_bodies_that_are_not_pointers() {
    let cases = [
        ("not json", "NotJson"),
        (r#"{"s3BucketName":"b","s3Key":"k"}"#, "NotAPointer"),
        (r#"["a","b"]"#, "NotAPointer"),
        (
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"b","s3Key":"k"},1]"#,
            "NotAPointer",
        ),
        (
            r#"["x.Other",{"s3BucketName":"b","s3Key":"k"}]"#,
            "UnknownClass",
        ),
        (
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3Key":"k"}]"#,
            "Missing(\"s3BucketName\")",
        ),
        (
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{"s3BucketName":"b","s3Key":""}]"#,
            "Missing(\"s3Key\")",
        ),
    ];
    for (body, want) in cases {
        let got = format!("{:?}", S3Pointer::parse(body).unwrap_err());
        assert!(got.starts_with(want), "{body}: {got}");
    }
}

#[test]
fn only_a_message_with_a_size_attribute_carries_a_pointer() {
    let body = python_pointer("b", "k");
    assert_eq!(S3Pointer::of(&Message::new("m", body.clone())), None);
    let legacy = Message::new("m", body).with_typed_attribute(
        LEGACY_SIZE_ATTRIBUTE,
        crate::Attribute::typed("Number", Some("3".into()), None).unwrap(),
    );
    assert_eq!(
        S3Pointer::of(&legacy),
        Some(Ok(S3Pointer {
            bucket: "b".into(),
            key: "k".into()
        }))
    );
    let plain = Message::new("m", "hello").with_attribute(SIZE_ATTRIBUTE, "5");
    assert!(matches!(S3Pointer::of(&plain), Some(Err(_))));
}

/// What the handler saw: (body, attribute names).
type Seen = Arc<Mutex<Vec<(String, Vec<String>)>>>;

fn processor(
    key: &str,
    objects: &MemoryPayloads,
    store: MemoryStore,
) -> (Processor<MemoryStore, impl crate::Handler>, Seen) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = handler_fn(move |m: Message, _ctx| {
        let s = s.clone();
        async move {
            let names = m.attributes().keys().cloned().collect();
            s.lock().unwrap().push((m.body().to_owned(), names));
            Ok(None)
        }
    });
    let mut config = crate::ProcessorConfig::new("test");
    config.key_source = key.parse().unwrap();
    config.carry_secret = Some(test_secret());
    let p = Processor::new(store, handler, config)
        .unwrap()
        .with_large_payloads(LargePayloads::new(objects.clone()));
    (p, seen)
}

fn test_secret() -> crate::protocol::key::CarrySecret {
    crate::protocol::key::CarrySecret::new([3u8; 32]).unwrap()
}

#[tokio::test]
async fn the_handler_sees_the_payload_and_the_key_comes_from_it() {
    let objects = MemoryPayloads::default();
    let payload = r#"{"id":"order-7","lines":"...."}"#;
    objects.put("big", "k1", payload);
    objects.put("big", "k2", payload);
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    let first = p
        .process(pointer_message("m1", "big", "k1", payload.len()))
        .await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    // A re-send through the extended client: a new object, the same key.
    let again = p
        .process(pointer_message("m2", "big", "k2", payload.len()))
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
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, vec![(payload.to_owned(), vec!["trace".to_owned()])]);
    assert_eq!(objects.gets(), 2);
    assert!(
        objects.deletes().is_empty(),
        "the processor deletes nothing"
    );
}

#[tokio::test]
async fn off_a_pointer_is_an_ordinary_body() {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = handler_fn(move |m: Message, _ctx| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push((m.body().to_owned(), vec![]));
            Ok(None)
        }
    });
    let p = Processor::new(
        MemoryStore::default(),
        handler,
        crate::ProcessorConfig::new("test"),
    )
    .unwrap();
    let m = pointer_message("m1", "big", "k1", 10);
    let body = m.body().to_owned();
    assert!(matches!(p.process(m).await, Outcome::Completed { .. }));
    assert_eq!(seen.lock().unwrap()[0].0, body);
}

#[tokio::test]
async fn a_missing_object_is_parked_with_its_reason() {
    let objects = MemoryPayloads::default();
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    let outcome = p.process(pointer_message("m1", "big", "gone", 10)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(
        reason.starts_with("large payload s3://big/gone is missing (NoSuchKey"),
        "{reason}"
    );
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_missing_object_of_a_completed_message_is_a_duplicate() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", "payload");
    let (p, seen) = processor("message-id", &objects, MemoryStore::default());
    let m = pointer_message("m1", "big", "k1", 7);
    assert!(matches!(
        p.process(m.clone()).await,
        Outcome::Completed { .. }
    ));
    // Its object deleted after the message, then SQS delivers it once more.
    LargePayloads::new(objects.clone())
        .delete_objects(vec![S3Pointer::of(&m).unwrap().unwrap()])
        .await;
    let again = p.process(m).await;
    assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
    // Another message whose object is missing is still parked.
    let other = p.process(pointer_message("m2", "big", "k2", 7)).await;
    assert!(matches!(other, Outcome::Park { .. }), "{other:?}");
}

#[tokio::test(start_paused = true)]
async fn s3_failures_other_than_a_missing_object_are_retried_never_parked() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", r#"{"id":"a"}"#);
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    let m = pointer_message("m1", "big", "k1", 10).with_receive_count(2);
    // A transient failure is tried in place until the window is spent
    // (pauses 0.2, 0.4, 0.8, 1.6, 3.2, then 5 s: ten tries in 26.2 s);
    // a refusal is answered at once.
    for (kind, failures) in [
        (PayloadErrorKind::Transient, 10),
        (PayloadErrorKind::Denied, 1),
        (PayloadErrorKind::Refused, 1),
    ] {
        for _ in 0..failures {
            objects.fail_next_get(kind);
        }
        let (gets, start) = (objects.gets(), tokio::time::Instant::now());
        let o = p.process(m.clone()).await;
        let Outcome::Retry { after, reason } = o else {
            panic!("{kind:?}: {o:?}");
        };
        assert_eq!(
            after,
            std::time::Duration::from_secs(4),
            "backoff of receive 2"
        );
        assert!(reason.contains("GetObject s3://big/k1 failed"), "{reason}");
        assert_eq!(objects.gets() - gets, failures, "{kind:?}: tries");
        let waited = start.elapsed();
        if kind == PayloadErrorKind::Transient {
            assert_eq!(waited, std::time::Duration::from_millis(26_200));
        } else {
            assert_eq!(waited, std::time::Duration::ZERO, "{kind:?}");
        }
    }
    assert!(seen.lock().unwrap().is_empty());
    assert!(matches!(p.process(m).await, Outcome::Completed { .. }));
}

/// Simulator seed 724910: a message whose key is inside its payload, done
/// on a receipt that did not delete it, spent its later receives on reads
/// that each failed once. A read that fails for a moment is tried again
/// in place, and the message is recognised (or run) on that receive.
#[tokio::test(start_paused = true)]
async fn a_read_that_fails_for_a_moment_is_tried_again_on_the_same_receive() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", r#"{"id":"a"}"#);
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    let m = pointer_message("m1", "big", "k1", 10);
    for _ in 0..3 {
        objects.fail_next_get(PayloadErrorKind::Transient);
    }
    let start = tokio::time::Instant::now();
    let o = p.process(m.clone()).await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(objects.gets(), 4);
    assert_eq!(start.elapsed(), std::time::Duration::from_millis(1_400));
    assert_eq!(seen.lock().unwrap().len(), 1);
    // Its next delivery reads the payload after one more failure and is
    // known done.
    objects.fail_next_get(PayloadErrorKind::Transient);
    let again = p.process(m.with_receive_count(2)).await;
    assert!(matches!(again, Outcome::Duplicate { .. }), "{again:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// On Lambda the tries stop by the time the invocation stops waiting
/// (`wait_until`), so that the failure is answered with its backoff rather
/// than cut off by the deadline and sent back at once.
#[tokio::test(start_paused = true)]
async fn a_failing_read_starts_no_try_after_the_invocation_stops_waiting() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", r#"{"id":"a"}"#);
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    for _ in 0..10 {
        objects.fail_next_get(PayloadErrorKind::Transient);
    }
    let start = tokio::time::Instant::now();
    let opts = crate::protocol::processor::ProcessOptions {
        wait_until: Some(start + std::time::Duration::from_secs(1)),
        ..Default::default()
    };
    let m = pointer_message("m1", "big", "k1", 10).with_receive_count(2);
    let o = p.process_with(m, opts).await;
    // Tries at 0, 0.2 and 0.6 s; the next would start at 1.4 s.
    let Outcome::Retry { after, reason } = o else {
        panic!("{o:?}");
    };
    assert_eq!(after, std::time::Duration::from_secs(4), "the backoff");
    assert!(reason.contains("GetObject s3://big/k1 failed"), "{reason}");
    assert_eq!(objects.gets(), 3);
    assert_eq!(start.elapsed(), std::time::Duration::from_millis(600));
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_payload_that_is_not_text_or_a_body_that_is_not_a_pointer_is_parked() {
    let objects = MemoryPayloads::default();
    objects.put("big", "bin", vec![0xff, 0xfe, 0x00]);
    let (p, _) = processor("message-id", &objects, MemoryStore::default());
    let o = p.process(pointer_message("m1", "big", "bin", 3)).await;
    assert_eq!(
        o,
        Outcome::Park {
            reason: "large payload: s3://big/bin is not UTF-8 text".into()
        }
    );
    let bad = Message::new("m2", "[1,2]").with_attribute(SIZE_ATTRIBUTE, "5");
    let o = p.process(bad).await;
    assert!(
        matches!(&o, Outcome::Park { reason } if reason.starts_with("large payload: the body is not an S3 pointer")),
        "{o:?}"
    );
    assert_eq!(objects.gets(), 1);
}

#[test]
fn only_deleting_payloads_name_an_object_to_delete() {
    let m = pointer_message("m1", "big", "k1", 3);
    let objects = MemoryPayloads::default();
    assert_eq!(LargePayloads::new(objects.clone()).to_delete(&m), None);
    let deleting = LargePayloads::new(objects).deleting(true);
    assert_eq!(
        deleting.to_delete(&m),
        Some(S3Pointer {
            bucket: "big".into(),
            key: "k1".into()
        })
    );
    assert_eq!(deleting.to_delete(&Message::new("m2", "plain")), None);
}

#[tokio::test]
async fn copies_brought_back_from_the_dlq_keep_their_carried_key_and_apply_once() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", r#"{"amount":5}"#);
    let (p, seen) = processor("message-id", &objects, MemoryStore::default());
    // The parked copy carries the key of its first delivery, bound to the
    // body it was parked with: the pointer.
    let parked = pointer_message("orig", "big", "k1", 12);
    let carried = crate::protocol::key::carry_key(&test_secret(), parked.body(), "orig");
    let copy = |id: &str| {
        Message::new(id, parked.body())
            .with_typed_attribute(
                SIZE_ATTRIBUTE,
                crate::Attribute::typed("Number", Some("12".into()), None).unwrap(),
            )
            .with_attribute(crate::protocol::key::DEDUP_KEY_ATTRIBUTE, carried.clone())
            .with_receipt_handle(format!("rh-{id}"))
    };
    let first = p.process(copy("copy-0")).await;
    assert!(matches!(first, Outcome::Completed { .. }), "{first:?}");
    let second = p.process(copy("copy-1")).await;
    assert!(
        matches!(second, Outcome::Duplicate { .. }),
        "the second copy is processed under the same key: {second:?}"
    );
    assert_eq!(seen.lock().unwrap().len(), 1, "the handler ran once");
}

#[tokio::test]
async fn a_payload_above_the_maximum_is_parked_and_one_that_declares_it_is_never_read() {
    let objects = MemoryPayloads::default();
    objects.put("big", "huge", vec![b'x'; 2048]);
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = handler_fn(move |m: Message, _ctx| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push((m.body().to_owned(), Vec::new()));
            Ok(None)
        }
    });
    let mut config = crate::ProcessorConfig::new("test");
    config.key_source = "message-id".parse().unwrap();
    let p = Processor::new(MemoryStore::default(), handler, config)
        .unwrap()
        .with_large_payloads(LargePayloads::new(objects.clone()).max_bytes(1024));
    // The pointer says 4096 bytes: parked without a GetObject.
    let outcome = p.process(pointer_message("m1", "big", "huge", 4096)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(
        reason.contains("declares 4096 bytes, above the maximum of 1024"),
        "{reason}"
    );
    assert_eq!(
        objects.gets(),
        0,
        "no S3 call for a pointer over the maximum"
    );
    // The pointer understates it: the read stops at the maximum, parked.
    let outcome = p.process(pointer_message("m2", "big", "huge", 100)).await;
    let Outcome::Park { reason } = outcome else {
        panic!("{outcome:?}");
    };
    assert!(
        reason.contains("above the maximum of 1024 bytes"),
        "{reason}"
    );
    assert!(seen.lock().unwrap().is_empty(), "the handler never ran");
}

#[tokio::test]
async fn a_pointer_outside_the_payload_buckets_is_parked_without_reading_it() {
    let objects = MemoryPayloads::default();
    objects.put("foreign", "k1", r#"{"id":"x"}"#);
    objects.put("payloads", "other/k2", r#"{"id":"y"}"#);
    objects.put("payloads", "in/k3", r#"{"id":"z"}"#);
    let (p, seen) = processor("json:/id", &objects, MemoryStore::default());
    let allowed = PayloadLocation::parse_list("payloads/in/").unwrap();
    let payloads = LargePayloads::new(objects.clone())
        .only_from(allowed)
        .deleting(true);
    let p = p.with_large_payloads(payloads.clone());
    for (bucket, key) in [("foreign", "k1"), ("payloads", "other/k2")] {
        let m = pointer_message("m", bucket, key, 10);
        match p.process(m.clone()).await {
            Outcome::Park { reason } => assert!(
                reason.contains("outside the payload buckets (SQS_ONCE_LARGE_PAYLOAD_BUCKETS)"),
                "{reason}"
            ),
            other => panic!("{bucket}/{key}: {other:?}"),
        }
        assert_eq!(payloads.to_delete(&m), None, "never deleted");
    }
    assert_eq!(objects.gets(), 0, "S3 was not called");
    let inside = p
        .process(pointer_message("m3", "payloads", "in/k3", 10))
        .await;
    assert!(matches!(inside, Outcome::Completed { .. }), "{inside:?}");
    assert_eq!(objects.gets(), 1);
    assert_eq!(seen.lock().unwrap().len(), 1);
    for bad in ["", " , ", "UPPER", "ab", "b@d/x"] {
        assert!(PayloadLocation::parse_list(bad).is_err(), "{bad:?}");
    }
    assert_eq!(
        PayloadLocation::parse_list("a-b.c, d12/p/q").unwrap(),
        vec![
            PayloadLocation {
                bucket: "a-b.c".into(),
                prefix: String::new()
            },
            PayloadLocation {
                bucket: "d12".into(),
                prefix: "p/q".into()
            },
        ]
    );
}

/// Each payload's runs, by its first eight bytes.
type Runs = Arc<Mutex<std::collections::HashMap<String, u32>>>;

/// A processor reading through `objects` within a payload budget of
/// `budget` bytes; its handler takes 50 ms and counts each payload's runs.
fn budgeted(
    objects: &MemoryPayloads,
    budget: usize,
) -> (
    Processor<MemoryStore, impl crate::Handler>,
    Arc<PayloadBudget>,
    Runs,
) {
    let budget = Arc::new(PayloadBudget::new(budget));
    let runs: Runs = Arc::default();
    let (r, b) = (runs.clone(), budget.clone());
    let handler = handler_fn(move |m: Message, _ctx| {
        let (r, b) = (r.clone(), b.clone());
        async move {
            // The payload's grant is held while its handler runs.
            assert!(b.held() >= m.body().len(), "the grant is held");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            *r.lock()
                .unwrap()
                .entry(m.body()[..8].to_owned())
                .or_default() += 1;
            Ok(None)
        }
    });
    let config = crate::ProcessorConfig::new("test");
    let p = Processor::new(MemoryStore::default(), handler, config)
        .unwrap()
        .with_large_payloads(LargePayloads::new(objects.clone()).within(budget.clone()));
    (p, budget, runs)
}

const KIB: usize = 1024;

/// Ten payloads of 10 KiB at once within a budget of 35 KiB: never more
/// than three held, each run once, and the budget is all given back.
#[tokio::test]
async fn payloads_beyond_the_budget_wait_their_turn() {
    let objects = MemoryPayloads::default();
    objects.slow_gets(std::time::Duration::from_millis(20));
    let messages: Vec<Message> = (0..10)
        .map(|i| {
            let payload = format!("{i:08}{}", "x".repeat(10 * KIB - 8));
            objects.put("big", &format!("k{i}"), payload);
            pointer_message(&format!("m{i}"), "big", &format!("k{i}"), 10 * KIB)
        })
        .collect();
    let (p, budget, runs) = budgeted(&objects, 35 * KIB);
    let outcomes = futures::future::join_all(messages.into_iter().map(|m| p.process(m))).await;
    for o in &outcomes {
        assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    }
    assert_eq!(runs.lock().unwrap().len(), 10);
    assert!(runs.lock().unwrap().values().all(|n| *n == 1));
    assert_eq!(budget.high_water(), 30 * KIB, "three at once");
    assert_eq!(budget.held(), 0);
    assert_eq!(objects.gets(), 10);
}

/// A pointer declaring more than the budget is parked without calling S3;
/// one declaring less than its object is read again under a grant of the
/// object's size (or parked when that could never fit).
#[tokio::test]
async fn a_payload_that_could_never_fit_the_budget_is_parked() {
    let objects = MemoryPayloads::default();
    let (p, budget, runs) = budgeted(&objects, 16 * KIB);
    objects.put("big", "huge", "y".repeat(20 * KIB));
    let o = p
        .process(pointer_message("m1", "big", "huge", 20 * KIB))
        .await;
    let Outcome::Park { reason } = o else {
        panic!("{o:?}")
    };
    assert!(
        reason.contains(
            "more than the payload budget of 16384 bytes (SQS_ONCE_PAYLOAD_BUDGET_BYTES)"
        ),
        "{reason}"
    );
    assert_eq!(objects.gets(), 0);
    // Understated: read again under a grant of its size.
    let payload = format!("{:08}{}", 7, "z".repeat(12 * KIB - 8));
    objects.put("big", "under", payload);
    let o = p.process(pointer_message("m2", "big", "under", 100)).await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(objects.gets(), 2);
    assert_eq!(budget.high_water(), 12 * KIB);
    // Understated and longer than the budget: parked after one cut-off read.
    let o = p.process(pointer_message("m3", "big", "huge", 100)).await;
    let Outcome::Park { reason } = o else {
        panic!("{o:?}")
    };
    assert!(
        reason.contains("needs 20480 bytes, more than the payload budget"),
        "{reason}"
    );
    assert_eq!(objects.gets(), 3);
    assert_eq!(runs.lock().unwrap().len(), 1);
    assert_eq!(budget.held(), 0);
}

/// On Lambda a wait for the budget ends when the invocation stops waiting:
/// the message is retried after its backoff, never run without its grant.
#[tokio::test(start_paused = true)]
async fn a_wait_for_the_budget_past_the_invocations_deadline_is_a_retry() {
    let objects = MemoryPayloads::default();
    objects.put("big", "k1", format!("{:08}", 1));
    let (p, budget, runs) = budgeted(&objects, 16 * KIB);
    let hog = budget.try_grant(16 * KIB).unwrap();
    let start = tokio::time::Instant::now();
    let opts = crate::protocol::processor::ProcessOptions {
        wait_until: Some(start + std::time::Duration::from_secs(2)),
        ..Default::default()
    };
    let o = p
        .process_with(
            pointer_message("m1", "big", "k1", 8).with_receive_count(2),
            opts,
        )
        .await;
    let Outcome::Retry { after, reason } = o else {
        panic!("{o:?}")
    };
    assert_eq!(after, std::time::Duration::from_secs(4), "the backoff");
    assert!(
        reason.contains("waited for 8 bytes of the payload budget"),
        "{reason}"
    );
    assert_eq!(start.elapsed(), std::time::Duration::from_secs(2));
    assert_eq!(objects.gets(), 0);
    drop(hog);
    let o = p.process(pointer_message("m1", "big", "k1", 8)).await;
    assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    assert_eq!(runs.lock().unwrap().len(), 1);
}
