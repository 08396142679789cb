//! Unit tests of the operations' pure parts.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_sqs::types::{Message, MessageAttributeValue};

use sqs_once::Record;
use sqs_once::aws::dynamodb::record_from_item;
use sqs_once::key::{CarrySecret, DEDUP_KEY_ATTRIBUTE, carry_key};
use sqs_once::parking::REASON_ATTRIBUTE;

use super::records::*;
use super::redrive::*;

#[test]
fn the_record_key_is_made_as_the_consumer_makes_it_and_takes_the_logged_form() {
    let hex = sqs_once::key::sha256_hex(b"evt-1");
    assert_eq!(record_key_of("ledger", "evt-1", false), "ledger#evt-1");
    assert_eq!(
        record_key_of("ledger", "evt-1", true),
        format!("ledger#sha256:{hex}")
    );
    // What logs and spans show of a hashed key, given back.
    let shown = format!("sha256:{hex}");
    assert_eq!(
        record_key_of("ledger", &shown, true),
        format!("ledger#sha256:{hex}")
    );
    // Anything else is a key to hash, and without hashing nothing is taken as hashed.
    for other in [
        format!("sha256:{}", &hex[1..]),
        format!("sha256:{}", hex.to_uppercase()),
    ] {
        assert_ne!(
            record_key_of("ledger", &other, true),
            format!("ledger#{other}")
        );
    }
    assert_eq!(
        record_key_of("ledger", &shown, false),
        sqs_once::key::record_key("ledger", &shown)
    );
}

#[test]
fn a_redrive_takes_at_most_what_the_dlq_held_at_its_start_and_at_most_max() {
    assert_eq!(redrive_limit(25, None), 25);
    assert_eq!(redrive_limit(25, Some(10)), 10);
    assert_eq!(redrive_limit(5, Some(10)), 5);
    assert_eq!(redrive_limit(0, None), 0);
}

/// The receives of a run over a DLQ that held 25: 10, 10, 5, then none,
/// however many more are parked meanwhile.
#[test]
fn receives_stop_at_the_limit() {
    let mut taken = 0;
    let mut asked = Vec::new();
    while let Some(want) = next_receive(25, taken) {
        asked.push(want);
        taken += u64::try_from(want).unwrap();
    }
    assert_eq!(asked, [10, 10, 5]);
    assert_eq!(next_receive(25, 30), None);
    assert_eq!(next_receive(0, 0), None);
}

fn record(extra: &[(&str, AttributeValue)]) -> Record {
    let mut item: HashMap<String, AttributeValue> = [
        ("pk", AttributeValue::S("ledger#evt-1".into())),
        ("status", AttributeValue::S("FAILED".into())),
        ("attempts", AttributeValue::N("1".into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    item.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    record_from_item(&item).unwrap()
}

#[test]
fn pace_keeps_the_average_rate_at_most_the_limit() {
    let rate = 50.0;
    assert_eq!(pace(25.0, rate, Duration::ZERO), Duration::from_millis(500));
    assert_eq!(
        pace(25.0, rate, Duration::from_millis(200)),
        Duration::from_millis(300)
    );
    assert_eq!(pace(25.0, rate, Duration::from_secs(1)), Duration::ZERO);
    assert_eq!(
        pace(25.0, 0.0, Duration::ZERO),
        Duration::ZERO,
        "0: no limit"
    );
}

#[test]
fn describe_record_escapes_the_fields_it_prints() {
    let r = record(&[(
        "error",
        AttributeValue::S("bad\nstatus     COMPLETED\u{1b}[2J".into()),
    )]);
    let text = describe_record(&r, 0);
    assert_eq!(
        text.lines().filter(|l| l.starts_with("status")).count(),
        1,
        "{text}"
    );
    assert!(!text.contains('\u{1b}'), "{text}");
    assert!(
        text.contains("bad\\nstatus     COMPLETED\\u{1b}[2J"),
        "{text}"
    );
}

#[test]
fn describe_record_without_expires_at_says_never() {
    let text = describe_record(&record(&[]), 1_700_000_000_000);
    assert!(text.contains("expires    never"), "{text}");
}

fn message(body_len: usize) -> Message {
    Message::builder()
        .body("x".repeat(body_len))
        .message_attributes(
            "sqs_once_reason",
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value("why")
                .build()
                .unwrap(),
        )
        .build()
}

#[test]
fn the_operator_redrive_seals_a_carried_key_again_under_the_first_secret() {
    let old = CarrySecret::parse(&"o".repeat(32)).unwrap();
    let new = CarrySecret::parse(&"n".repeat(32)).unwrap();
    let rotating = CarrySecret::parse(&format!("{},{}", "n".repeat(32), "o".repeat(32))).unwrap();
    let parked = Message::builder()
        .message_id("dlq-1")
        .body("{}")
        .message_attributes(
            DEDUP_KEY_ATTRIBUTE,
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(carry_key(&old, "{}", "k-1"))
                .build()
                .unwrap(),
        )
        .build();
    let mut report = Redriven::default();
    let copy = carrying_key(parked, 262_144, Some(&rotating), &mut report).unwrap();
    let carried = copy.message_attributes.as_ref().unwrap()[DEDUP_KEY_ATTRIBUTE]
        .string_value()
        .unwrap()
        .to_owned();
    assert_eq!(
        carried,
        carry_key(&new, "{}", "k-1"),
        "sealed under the first secret"
    );
    assert!(report.without_key.is_empty());
}

#[test]
fn message_size_counts_body_and_attribute_names_types_and_values() {
    assert_eq!(message_size(&message(100)), 100 + 15 + 6 + 3);
}

#[test]
fn size_batches_keep_each_batch_within_the_size_and_ten_messages() {
    let max = 262_144;
    let big: Vec<Message> = (0..4).map(|_| message(100_000)).collect();
    let sizes: Vec<usize> = size_batches(&big, max).iter().map(|b| b.len()).collect();
    assert_eq!(sizes, vec![2, 2]);
    let small: Vec<Message> = (0..23).map(|_| message(10)).collect();
    let sizes: Vec<usize> = size_batches(&small, max).iter().map(|b| b.len()).collect();
    assert_eq!(sizes, vec![10, 10, 3]);
    let huge = vec![message(300_000), message(10)];
    let sizes: Vec<usize> = size_batches(&huge, max).iter().map(|b| b.len()).collect();
    assert_eq!(sizes, vec![1, 1], "an oversized message goes alone");
}

#[test]
fn a_copy_parked_under_another_secret_is_left_in_the_dlq_not_given_a_new_key() {
    let consumers = CarrySecret::parse(&"c".repeat(32)).unwrap();
    let other = CarrySecret::parse(&"x".repeat(32)).unwrap();
    let string = |v: String| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
            .unwrap()
    };
    let parked = Message::builder()
        .message_id("dlq-1")
        .body("{}")
        .message_attributes(REASON_ATTRIBUTE, string("failed".into()))
        .message_attributes(
            DEDUP_KEY_ATTRIBUTE,
            string(carry_key(&consumers, "{}", "k-1")),
        )
        .build();
    let mut report = Redriven::default();
    assert!(carrying_key(parked.clone(), 262_144, Some(&other), &mut report).is_none());
    assert_eq!(report.not_sent.len(), 1, "{report:?}");
    assert!(
        report.not_sent[0].1.contains("another secret"),
        "{report:?}"
    );
    // Under the consumers' own secret it goes back with its key.
    let mut report = Redriven::default();
    let copy = carrying_key(parked, 262_144, Some(&consumers), &mut report).unwrap();
    assert_eq!(
        copy.message_attributes.unwrap()[DEDUP_KEY_ATTRIBUTE].string_value(),
        Some(carry_key(&consumers, "{}", "k-1").as_str())
    );
    // A copy parked by a consumer without a secret (its first id unsealed,
    // for people to read) goes back, keyed by its DLQ id.
    let unsealed = Message::builder()
        .message_id("dlq-3")
        .body("{}")
        .message_attributes(REASON_ATTRIBUTE, string("failed".into()))
        .message_attributes(
            sqs_once::parking::MESSAGE_ID_ATTRIBUTE,
            string("first-id".into()),
        )
        .build();
    let mut report = Redriven::default();
    assert!(carrying_key(unsealed, 262_144, Some(&other), &mut report).is_some());
    assert!(report.not_sent.is_empty(), "{report:?}");
    // A message SQS moved (no reason) whose key does not verify gets one
    // from its own id instead.
    let moved = Message::builder()
        .message_id("dlq-2")
        .body("{}")
        .message_attributes(DEDUP_KEY_ATTRIBUTE, string("forged:victim".into()))
        .build();
    let mut report = Redriven::default();
    let copy = carrying_key(moved, 262_144, Some(&other), &mut report).unwrap();
    assert_eq!(
        copy.message_attributes.unwrap()[DEDUP_KEY_ATTRIBUTE].string_value(),
        Some(carry_key(&other, "{}", "dlq-2").as_str())
    );
}
