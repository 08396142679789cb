//! What a producer, who can set any message attribute and any body, must not
//! be able to do to another producer's messages, black-box against
//! LocalStack with the `ledger` consumer and the operator tool.

use std::time::Duration;

use aws_sdk_sqs::types::MessageAttributeValue;
use sqs_once::key::sha256_hex;

use crate::common::{Ledger, ddb, depth, ledger_rows, run_until_drained, sqs};

fn string_attr(v: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(v)
        .build()
        .unwrap()
}

/// A ledger event's body.
fn event(id: &str, account: &str, cents: u64) -> String {
    format!(r#"{{"id":"{id}","account":"{account}","amount_cents":{cents}}}"#)
}

/// Sends the victim's event, delayed (so that the attacker's message is
/// processed first: the poller starts within the delay), and answers its
/// message id: what the attacker learns from a log line, a trace or the DLQ.
async fn send_victim(sqs: &aws_sdk_sqs::Client, l: &Ledger, body: &str) -> String {
    sqs.send_message()
        .queue_url(&l.queues.queue_url)
        .message_body(body)
        .delay_seconds(8)
        .send()
        .await
        .unwrap()
        .message_id
        .unwrap()
}

/// The sum of one EMF metric over the pollers' stats.
fn metric(stats: &[serde_json::Value], name: &str) -> u64 {
    stats
        .iter()
        .flat_map(|s| s["emf"].as_array().cloned().unwrap_or_default())
        .filter_map(|line| line.get(name).and_then(serde_json::Value::as_u64))
        .sum()
}

/// Under `message-id` keys (the default) a producer set
/// `sqs_once_dedup_key` to the first 16 hex digits of its own body's SHA-256,
/// a colon and a victim's message id. Its message was processed under the
/// victim's key; the victim's, arriving later, was skipped as a duplicate
/// and deleted (`SQS_ONCE_PAYLOAD_MISMATCH=warn`): its effect never happened.
/// The forged attribute is now ignored and counted, and both effects happen
/// exactly once.
#[tokio::test]
async fn a_forged_carried_key_naming_a_victims_message_id_does_not_skip_the_victim() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let victim = send_victim(&sqs, &l, &event("evt-victim", "acct-victim", 500)).await;
    let own = event("evt-attacker", "acct-attacker", 1);
    let forged = format!("{}:{victim}", &sha256_hex(own.as_bytes())[..16]);
    sqs.send_message()
        .queue_url(&l.queues.queue_url)
        .message_body(&own)
        .message_attributes("sqs_once_dedup_key", string_attr(&forged))
        .message_attributes("sqs_once_message_id", string_attr(&victim))
        .send()
        .await
        .unwrap();

    let env = [("SQS_ONCE_DEDUP_KEY", "message-id")];
    let stats = run_until_drained(&l, &sqs, 1, &env).await;
    let rows = ledger_rows(&ddb, &l.ledger).await;
    assert_eq!(
        rows.get("acct-victim"),
        Some(&(500, 1)),
        "the victim's effect happened exactly once: {stats:?}"
    );
    assert_eq!(rows.get("acct-attacker"), Some(&(1, 1)));
    assert_eq!(stats[0]["completed"], 2, "{stats:?}");
    assert_eq!(stats[0]["duplicates"], 0, "{stats:?}");
    assert_eq!(metric(&stats, "UnverifiedAttributes"), 2, "{stats:?}");
    assert_eq!(depth(&sqs, &l.queues.dlq_url).await, 0);
}

/// Through the DLQ: a producer's message that reached the DLQ (its
/// receives ran out, or it was parked) with `sqs_once_message_id` naming a
/// victim's message id. `redrive` took that as the first delivery's id and
/// gave the copy the victim's key, sealed: the copy then took the victim's
/// key. The forged id is now not honoured by parking or redrive.
#[tokio::test]
async fn a_forged_first_message_id_in_the_dlq_does_not_give_a_redriven_copy_the_victims_key() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let own = event("evt-attacker-2", "acct-attacker", 1);
    let victim = send_victim(&sqs, &l, &event("evt-victim-2", "acct-victim", 700)).await;
    // As SQS's redrive policy leaves it: body and the producer's attributes.
    sqs.send_message()
        .queue_url(&l.queues.dlq_url)
        .message_body(&own)
        .message_attributes("sqs_once_message_id", string_attr(&victim))
        .message_attributes("sqs_once_reason", string_attr("handler failed"))
        .send()
        .await
        .unwrap();
    let out = tokio::process::Command::new(crate::common::binary("sqs-once"))
        .args([
            "redrive",
            "--dlq-url",
            &l.queues.dlq_url,
            "--queue-url",
            &l.queues.queue_url,
        ])
        .env("AWS_ENDPOINT_URL", crate::common::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("SQS_ONCE_CARRY_SECRET", crate::common::CARRY_SECRET)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(Duration::from_millis(200)).await;

    let env = [("SQS_ONCE_DEDUP_KEY", "message-id")];
    let stats = run_until_drained(&l, &sqs, 1, &env).await;
    let rows = ledger_rows(&ddb, &l.ledger).await;
    assert_eq!(
        rows.get("acct-victim"),
        Some(&(700, 1)),
        "the victim's effect happened exactly once: {stats:?}"
    );
    assert_eq!(rows.get("acct-attacker"), Some(&(1, 1)));
    assert_eq!(stats[0]["duplicates"], 0, "{stats:?}");
}

/// With `SQS_ONCE_HASH_KEYS=on` and `SQS_ONCE_REDACT_REASONS=on`,
/// an event whose amount is a card number (serde's error quotes it) is
/// parked with a reason that names the failure's kind but quotes nothing,
/// and its `FAILED` record is kept under the key's SHA-256, not the key.
#[tokio::test]
async fn a_hashing_redacting_consumer_parks_without_quoting_the_body_or_storing_the_key() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let card = "4111-1111-1111-1111";
    let body = format!(r#"{{"id":"evt-card","account":"acct-1","amount_cents":"{card}"}}"#);
    sqs.send_message()
        .queue_url(&l.queues.queue_url)
        .message_body(&body)
        .send()
        .await
        .unwrap();
    let env = [
        ("SQS_ONCE_HASH_KEYS", "on"),
        ("SQS_ONCE_REDACT_REASONS", "on"),
    ];
    let stats = run_until_drained(&l, &sqs, 1, &env).await;
    assert_eq!(stats[0]["parked"], 1, "{stats:?}");
    let parked = crate::common::bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    let expected =
        "handler failed permanently: permanent error, its text redacted (SQS_ONCE_REDACT_REASONS)";
    assert_eq!(parked, vec![(body, expected.to_owned())]);
    let store = sqs_once::DynamoStore::new(ddb.clone(), l.dedup.as_str());
    use sqs_once::DedupStore;
    let hashed = sqs_once::key::hashed_record_key("ledger", "evt-card");
    let record = store
        .get(&hashed)
        .await
        .unwrap()
        .expect("the record under the hashed key");
    assert_eq!(record.status, sqs_once::Status::Failed);
    assert_eq!(record.error.as_deref(), Some(expected));
    let plain = sqs_once::key::record_key("ledger", "evt-card");
    assert_eq!(store.get(&plain).await.unwrap(), None);
}

/// A client whose requests LocalStack credits to another account
/// (`SenderId` 111111111111): a second producer's identity.
async fn other_producer() -> aws_sdk_sqs::Client {
    let conf = aws_sdk_sqs::config::Builder::from(&crate::common::sdk_config().await)
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "111111111111",
            "test",
            None,
            None,
            "other-producer",
        ))
        .build();
    aws_sdk_sqs::Client::from_conf(conf)
}

/// Runs one race: another producer's message carrying the victim's
/// business id, then the victim's event (delayed, so received after it);
/// the ledger keyed on the id, with `scope`. Answers the ledger's rows.
async fn race_for_a_business_id(scope: &str) -> std::collections::HashMap<String, (i64, i64)> {
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    other_producer()
        .await
        .send_message()
        .queue_url(&l.queues.queue_url)
        .message_body(event("evt-1", "acct-attacker", 1))
        .send()
        .await
        .unwrap();
    send_victim(&sqs, &l, &event("evt-1", "acct-victim", 500)).await;
    let env = [
        ("SQS_ONCE_DEDUP_KEY", "json:/id"),
        ("SQS_ONCE_KEY_SCOPE", scope),
    ];
    let stats = run_until_drained(&l, &sqs, 1, &env).await;
    assert_eq!(depth(&sqs, &l.queues.dlq_url).await, 0, "{stats:?}");
    ledger_rows(&ddb, &l.ledger).await
}

/// A producer who knows (or guesses) another producer's business id sends
/// it first. Keyed on the id alone, the victim's message is then a
/// duplicate of the attacker's and skipped (the payload mismatch is only
/// warned of, the library's default); scoped to the sender
/// (`SQS_ONCE_KEY_SCOPE=sender`, SQS's `SenderId`, which a producer cannot
/// set), each producer's id is its own and both are applied once.
#[tokio::test]
async fn a_producer_sending_anothers_business_id_first_does_not_make_it_skip_under_sender_scope() {
    if !crate::common::localstack_up().await {
        return;
    }
    let unscoped = race_for_a_business_id("none").await;
    assert_eq!(unscoped.get("acct-attacker"), Some(&(1, 1)));
    assert_eq!(
        unscoped.get("acct-victim"),
        None,
        "unscoped, the victim's message is skipped: the premise of this test"
    );
    let scoped = race_for_a_business_id("sender").await;
    assert_eq!(scoped.get("acct-attacker"), Some(&(1, 1)));
    assert_eq!(
        scoped.get("acct-victim"),
        Some(&(500, 1)),
        "scoped to the sender, the victim's event is applied once"
    );
}
