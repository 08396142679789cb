//! The `sqs-once` operations commands against LocalStack, as an operator runs them.

use std::collections::BTreeSet;
use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use sqs_once::dedup::{ClaimRequest, Completion};
use sqs_once::{DedupStore, DynamoStore, StoredResult};

use crate::common::{ddb, dedup_table, depth, queues, sqs, unique};

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

async fn cli(args: &[&str]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_sqs-once"))
        .args(args)
        .env("AWS_ENDPOINT_URL", crate::common::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env_remove("SQS_ONCE_TABLE")
        .env_remove("SQS_ONCE_CONSUMER")
        .output()
        .await
        .unwrap();
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn claim(pk: &str) -> ClaimRequest {
    ClaimRequest {
        pk: pk.to_owned(),
        owner: uuid::Uuid::new_v4().to_string(),
        message_id: "m-1".into(),
        payload_sha256: "p".into(),
        lease: Duration::from_secs(300),
        ttl: Duration::from_secs(3600),
    }
}

async fn completed(store: &DynamoStore, pk: &str, result: Option<serde_json::Value>) {
    let c = claim(pk);
    store.claim(&c).await.unwrap();
    store
        .complete(Completion {
            pk: c.pk.clone(),
            owner: c.owner.clone(),
            result: result.map(StoredResult::Value),
            ttl: Duration::from_secs(3600),
            writes: vec![],
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn init_twice_is_a_no_op_and_check_then_passes() {
    let table = unique("init");
    let queue = unique("initq");
    for _ in 0..2 {
        let r = cli(&["init", "--table", &table, "--queue", &queue]).await;
        assert!(r.ok, "{}", r.stderr);
        assert!(r.stdout.contains("TTL on expires_at"), "{}", r.stdout);
    }
    let r = cli(&["init", "--table", &table, "--queue", &queue, "--check"]).await;
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("redrive to"), "{}", r.stdout);
}

#[tokio::test]
async fn init_check_flags_what_is_missing_and_changes_nothing() {
    let client = ddb().await;
    let table = unique("nottl");
    sqs_once::setup::ensure_table(&client, &table)
        .await
        .unwrap();
    let r = cli(&[
        "init",
        "--table",
        &table,
        "--queue",
        &unique("missing"),
        "--check",
    ])
    .await;
    assert!(!r.ok);
    assert!(
        r.stdout.contains("expires_at") && r.stdout.contains(&table),
        "names the TTL problem: {}",
        r.stdout
    );
    assert!(
        r.stdout.contains("does not exist"),
        "the queue: {}",
        r.stdout
    );
    assert!(r.stderr.contains("2 problem(s)"), "{}", r.stderr);
    let ttl = client
        .describe_time_to_live()
        .table_name(&table)
        .send()
        .await
        .unwrap();
    let status = ttl
        .time_to_live_description()
        .and_then(|d| d.time_to_live_status())
        .map(|s| s.as_str().to_owned());
    assert_ne!(
        status.as_deref(),
        Some("ENABLED"),
        "--check changed nothing"
    );
}

#[tokio::test]
async fn inspect_and_forget_round_trip() {
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let store = DynamoStore::new(client.clone(), table.as_str());
    let pk = sqs_once::key::record_key("ledger", "evt-1");
    completed(&store, &pk, Some(serde_json::json!({"charge_id": "ch_1"}))).await;

    let r = cli(&[
        "inspect",
        "evt-1",
        "--table",
        &table,
        "--consumer",
        "ledger",
    ])
    .await;
    assert!(r.ok, "{}", r.stderr);
    for part in [
        "status     COMPLETED",
        "attempts   1",
        "ch_1",
        "expires",
        "message    m-1",
    ] {
        assert!(
            r.stdout.contains(part),
            "{part:?} missing from:\n{}",
            r.stdout
        );
    }

    let r = cli(&["forget", "evt-1", "--table", &table, "--consumer", "ledger"]).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(
        r.stdout.contains("forgot") && r.stdout.contains("COMPLETED"),
        "{}",
        r.stdout
    );
    assert_eq!(store.get(&pk).await.unwrap(), None);

    let r = cli(&[
        "inspect",
        "evt-1",
        "--table",
        &table,
        "--consumer",
        "ledger",
    ])
    .await;
    assert!(!r.ok);
    assert!(r.stderr.contains("no record"), "{}", r.stderr);
    let r = cli(&["forget", "evt-1", "--table", &table, "--consumer", "ledger"]).await;
    assert!(
        r.ok && r.stdout.contains("nothing to forget"),
        "{}",
        r.stdout
    );
}

#[tokio::test]
async fn forget_refuses_a_live_claim_unless_forced() {
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let store = DynamoStore::new(client.clone(), table.as_str());
    let pk = sqs_once::key::record_key("ledger", "evt-busy");
    store.claim(&claim(&pk)).await.unwrap();

    let r = cli(&[
        "forget",
        "evt-busy",
        "--table",
        &table,
        "--consumer",
        "ledger",
    ])
    .await;
    assert!(!r.ok);
    assert!(
        r.stderr.contains("IN_PROGRESS") && r.stderr.contains("--force"),
        "{}",
        r.stderr
    );
    assert!(store.get(&pk).await.unwrap().is_some(), "still there");

    let r = cli(&[
        "forget",
        "evt-busy",
        "--table",
        &table,
        "--consumer",
        "ledger",
        "--force",
    ])
    .await;
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(store.get(&pk).await.unwrap(), None);
}

/// Every message body in the queue, sorted, copies kept (a set would hide a
/// message moved twice).
async fn bodies(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(60)
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            out.sort();
            return out;
        }
        out.extend(got.into_iter().map(|m| m.body.unwrap_or_default()));
    }
}

#[tokio::test]
async fn redrive_moves_messages_back_and_loses_none() {
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    let sent: BTreeSet<String> = (0..25).map(|i| format!("parked-{i}")).collect();
    let list: Vec<&String> = sent.iter().collect();
    for chunk in list.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, b)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(*b)
                    .message_attributes(
                        "sqs_once_reason",
                        MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value("handler failed permanently: test")
                            .build()
                            .unwrap(),
                    )
                    .build()
                    .unwrap()
            })
            .collect();
        sqs.send_message_batch()
            .queue_url(&q.dlq_url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
    }
    let args = |extra: &[&str]| {
        let mut a = vec![
            "redrive".to_owned(),
            "--dlq-url".into(),
            q.dlq_url.clone(),
            "--queue-url".into(),
            q.queue_url.clone(),
        ];
        a.extend(extra.iter().map(|s| (*s).to_owned()));
        a
    };
    let run = |a: Vec<String>| async move {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        cli(&refs).await
    };

    let r = run(args(&["--dry-run"])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(
        r.stdout.contains("handler failed permanently: test"),
        "{}",
        r.stdout
    );
    assert_eq!(
        depth(&sqs, &q.queue_url).await,
        0,
        "a dry run moves nothing"
    );

    // The DLQ's messages must be visible again after the dry run's peek.
    let r = run(args(&["--max", "10"])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 10 message(s)"), "{}", r.stdout);
    assert_eq!(depth(&sqs, &q.queue_url).await, 10);
    assert_eq!(depth(&sqs, &q.dlq_url).await, 15);

    let r = run(args(&[])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 15 message(s)"), "{}", r.stdout);
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0);
    assert_eq!(
        bodies(&sqs, &q.queue_url).await,
        sent.iter().cloned().collect::<Vec<_>>(),
        "every message, exactly once"
    );
}

#[tokio::test]
async fn stats_counts_a_consumers_records_by_status() {
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let store = DynamoStore::new(client.clone(), table.as_str());
    for key in ["a", "b"] {
        completed(&store, &sqs_once::key::record_key("ledger", key), None).await;
    }
    store
        .claim(&claim(&sqs_once::key::record_key("ledger", "c")))
        .await
        .unwrap();
    let failed = claim(&sqs_once::key::record_key("ledger", "d"));
    store.claim(&failed).await.unwrap();
    store
        .mark_failed(&failed.pk, &failed.owner, "bad", Duration::from_secs(3600))
        .await
        .unwrap();
    completed(&store, &sqs_once::key::record_key("other", "a"), None).await;

    let r = cli(&["stats", "--table", &table, "--consumer", "ledger"]).await;
    assert!(r.ok, "{}", r.stderr);
    let line = |status: &str| {
        r.stdout
            .lines()
            .find(|l| l.trim_start().starts_with(status))
            .map(|l| l.split_whitespace().last().unwrap().to_owned())
    };
    assert_eq!(line("COMPLETED").as_deref(), Some("2"), "{}", r.stdout);
    assert_eq!(line("IN_PROGRESS").as_deref(), Some("1"), "{}", r.stdout);
    assert_eq!(line("FAILED").as_deref(), Some("1"), "{}", r.stdout);
    assert!(
        r.stderr.contains("scanned 5 items"),
        "progress: {}",
        r.stderr
    );
}
