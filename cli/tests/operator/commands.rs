//! The `sqs-once` operations commands against LocalStack, as an operator runs them.

use std::collections::BTreeSet;
use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use sqs_once::store::{ClaimRequest, Completion};
use sqs_once::{DedupStore, DynamoStore, StoredResult};

use crate::common::{ddb, dedup_table, depth, queues, sqs, unique};

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

async fn cli(args: &[&str]) -> Run {
    let out = tokio::process::Command::new(crate::common::binary("sqs-once"))
        .args(args)
        .env("AWS_ENDPOINT_URL", crate::common::endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("SQS_ONCE_CARRY_SECRET", crate::common::CARRY_SECRET)
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
            outbox: vec![],
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn init_twice_is_a_no_op_and_check_then_passes() {
    if !crate::common::localstack_up().await {
        return;
    }
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
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let table = unique("nottl");
    sqs_once_cli::setup::ensure_table(&client, &table)
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
    if !crate::common::localstack_up().await {
        return;
    }
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
        "fence      ",
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

/// A consumer that hashes its keys (`SQS_ONCE_HASH_KEYS=on`) keeps its
/// records under `sha256:` of the key: the tool finds them with the same
/// setting, by the key or by the form the logs show, and not without it.
#[tokio::test]
async fn inspect_and_forget_find_a_hashing_consumers_record_by_its_key_or_its_logged_form() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let store = DynamoStore::new(client.clone(), table.as_str());
    let pk = sqs_once::key::hashed_record_key("ledger", "evt-h");
    completed(&store, &pk, None).await;
    let shown = sqs_once::key::hashed_key("evt-h");
    let base = ["--table", &table, "--consumer", "ledger"];
    let with = |cmd: &'static str, key: &str, hash: &str| {
        let mut args = vec![
            cmd.to_owned(),
            key.to_owned(),
            "--hash-keys".to_owned(),
            hash.to_owned(),
        ];
        args.extend(base.iter().map(|s| (*s).to_owned()));
        args
    };
    let r = cli_owned(with("inspect", "evt-h", "off")).await;
    assert!(!r.ok && r.stderr.contains("no record"), "{}", r.stderr);
    for key in ["evt-h", shown.as_str()] {
        let r = cli_owned(with("inspect", key, "on")).await;
        assert!(r.ok, "{key}: {}", r.stderr);
        assert!(
            r.stdout.contains(&pk) && r.stdout.contains("COMPLETED"),
            "{}",
            r.stdout
        );
        assert!(
            !r.stdout.contains("evt-h"),
            "the raw key shown: {}",
            r.stdout
        );
    }
    let r = cli_owned(with("forget", "evt-h", "on")).await;
    assert!(r.ok && r.stdout.contains("forgot"), "{}", r.stderr);
    assert_eq!(store.get(&pk).await.unwrap(), None);
}

#[tokio::test]
async fn forget_refuses_a_live_claim_unless_forced() {
    if !crate::common::localstack_up().await {
        return;
    }
    // Built first: on a busy machine building the binaries can outlast the
    // claim's lease, and an expired claim is not "live".
    crate::common::binary("sqs-once");
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

#[tokio::test]
async fn inspect_shows_unsent_messages_and_forget_refuses_to_lose_them_unless_forced() {
    if !crate::common::localstack_up().await {
        return;
    }
    crate::common::binary("sqs-once");
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let store = DynamoStore::new(client.clone(), table.as_str());
    let pk = sqs_once::key::record_key("ledger", "evt-sending");
    let c = claim(&pk);
    store.claim(&c).await.unwrap();
    store
        .complete(Completion {
            pk: c.pk.clone(),
            owner: c.owner.clone(),
            result: None,
            ttl: Duration::from_secs(3600),
            writes: vec![],
            outbox: vec![sqs_once::Outgoing::new(
                "http://sqs.local/000000000000/paid",
                "b",
            )],
        })
        .await
        .unwrap();
    let args = ["--table", &table, "--consumer", "ledger"];
    let r = cli(&[&["inspect", "evt-sending"][..], &args].concat()).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(
        r.stdout.contains("1 message(s) recorded, not yet sent"),
        "{}",
        r.stdout
    );
    let r = cli(&[&["forget", "evt-sending"][..], &args].concat()).await;
    assert!(!r.ok);
    assert!(
        r.stderr.contains("not yet sent") && r.stderr.contains("--force"),
        "{}",
        r.stderr
    );
    assert!(store.get(&pk).await.unwrap().is_some(), "still there");
    let r = cli(&[&["forget", "evt-sending", "--force"][..], &args].concat()).await;
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
    if !crate::common::localstack_up().await {
        return;
    }
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
    if !crate::common::localstack_up().await {
        return;
    }
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

async fn queue_attrs(
    sqs: &aws_sdk_sqs::Client,
    url: &str,
) -> std::collections::HashMap<aws_sdk_sqs::types::QueueAttributeName, String> {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::All)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default()
}

async fn queue_exists(sqs: &aws_sdk_sqs::Client, name: &str) -> bool {
    sqs.get_queue_url().queue_name(name).send().await.is_ok()
}

/// A queue as a SAM stack makes it: 360 s visibility, redrive to its own DLQ
/// (not `<name>-dlq`). Returns (queue URL, the DLQ's ARN).
async fn stack_queue(sqs: &aws_sdk_sqs::Client, name: &str) -> (String, String) {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let dlq = sqs
        .create_queue()
        .queue_name(format!("{name}-ops-dead-letters"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let dlq_arn = queue_attrs(sqs, &dlq).await[&A::QueueArn].clone();
    let url = sqs
        .create_queue()
        .queue_name(name)
        .attributes(A::VisibilityTimeout, "360")
        .attributes(
            A::RedrivePolicy,
            serde_json::json!({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "3"}).to_string(),
        )
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    (url, dlq_arn)
}

fn redrive_target(
    attrs: &std::collections::HashMap<aws_sdk_sqs::types::QueueAttributeName, String>,
) -> String {
    let p: serde_json::Value =
        serde_json::from_str(&attrs[&aws_sdk_sqs::types::QueueAttributeName::RedrivePolicy])
            .unwrap();
    p["deadLetterTargetArn"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn init_reports_an_existing_queues_other_visibility_and_redrive_and_changes_nothing() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let sqs = sqs().await;
    let table = unique("init");
    let name = unique("stackq");
    let (url, ops_dlq) = stack_queue(&sqs, &name).await;

    let r = cli(&[
        "init",
        "--table",
        &table,
        "--queue",
        &name,
        "--visibility-timeout",
        "60",
    ])
    .await;
    assert!(!r.ok, "differences fail the run: {}", r.stdout);
    assert!(
        r.stdout.contains("visibility timeout is 360 s, not 60 s")
            && r.stdout.contains("--set-visibility-timeout"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains(&format!("sends to {ops_dlq}, not to {name}-dlq"))
            && r.stdout.contains("--set-redrive-policy"),
        "{}",
        r.stdout
    );
    assert!(r.stderr.contains("2 difference(s)"), "{}", r.stderr);
    let attrs = queue_attrs(&sqs, &url).await;
    assert_eq!(attrs[&A::VisibilityTimeout], "360", "visibility unchanged");
    assert_eq!(redrive_target(&attrs), ops_dlq, "redrive target unchanged");
    assert!(
        !queue_exists(&sqs, &format!("{name}-dlq")).await,
        "no unused <name>-dlq is created"
    );
}

#[tokio::test]
async fn init_changes_an_existing_queue_only_with_the_flag_naming_the_change() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let sqs = sqs().await;
    let table = unique("init");
    let name = unique("stackq");
    let (url, ops_dlq) = stack_queue(&sqs, &name).await;

    let base = ["init", "--table", &table, "--queue", &name];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    let r = cli(&with(&[
        "--visibility-timeout",
        "90",
        "--set-visibility-timeout",
    ]))
    .await;
    assert!(!r.ok, "the redrive difference is still there: {}", r.stdout);
    assert!(r.stdout.contains("changed: queue"), "{}", r.stdout);
    let attrs = queue_attrs(&sqs, &url).await;
    assert_eq!(attrs[&A::VisibilityTimeout], "90");
    assert_eq!(
        redrive_target(&attrs),
        ops_dlq,
        "only the named change was made"
    );

    let r = cli(&with(&["--set-redrive-policy"])).await;
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    let attrs = queue_attrs(&sqs, &url).await;
    let dlq_url = sqs
        .get_queue_url()
        .queue_name(format!("{name}-dlq"))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    assert_eq!(
        redrive_target(&attrs),
        queue_attrs(&sqs, &dlq_url).await[&A::QueueArn]
    );
    assert_eq!(attrs[&A::VisibilityTimeout], "90", "visibility left as set");
    let policy: serde_json::Value = serde_json::from_str(&attrs[&A::RedrivePolicy]).unwrap();
    assert_eq!(
        policy["maxReceiveCount"].to_string().trim_matches('"'),
        "3",
        "the queue's receive count is kept when none is given"
    );
}

#[tokio::test]
async fn init_refuses_a_table_with_other_keys_before_writing_anything_to_it() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
        ScalarAttributeType,
    };
    let client = ddb().await;
    let table = unique("orders");
    client
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("order_id")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("order_id")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    client
        .put_item()
        .table_name(&table)
        .item("order_id", AttributeValue::S("o-1".into()))
        .item("expires_at", AttributeValue::N("1".into()))
        .send()
        .await
        .unwrap();

    let r = cli(&["init", "--table", &table, "--enable-ttl"]).await;
    assert!(!r.ok, "{}", r.stdout);
    assert!(
        r.stderr.contains("order_id:HASH") && r.stderr.contains("nothing was written"),
        "{}",
        r.stderr
    );
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
    assert!(
        matches!(status.as_deref(), None | Some("DISABLED")),
        "TTL left off: {status:?}"
    );
    let item = client
        .get_item()
        .table_name(&table)
        .key("order_id", AttributeValue::S("o-1".into()))
        .consistent_read(true)
        .send()
        .await
        .unwrap();
    assert!(item.item.is_some(), "the table's item is untouched");
}

#[tokio::test]
async fn init_enables_ttl_on_an_existing_dedup_table_only_with_enable_ttl() {
    if !crate::common::localstack_up().await {
        return;
    }
    let client = ddb().await;
    let table = unique("nottl");
    sqs_once_cli::setup::ensure_table(&client, &table)
        .await
        .unwrap();
    let ttl_status = || async {
        client
            .describe_time_to_live()
            .table_name(&table)
            .send()
            .await
            .unwrap()
            .time_to_live_description()
            .and_then(|d| d.time_to_live_status())
            .map(|s| s.as_str().to_owned())
    };

    let r = cli(&["init", "--table", &table]).await;
    assert!(!r.ok, "{}", r.stdout);
    assert!(
        r.stdout.contains("TTL is") && r.stdout.contains("--enable-ttl"),
        "{}",
        r.stdout
    );
    assert!(
        matches!(ttl_status().await.as_deref(), None | Some("DISABLED")),
        "left off without the flag"
    );

    let r = cli(&["init", "--table", &table, "--enable-ttl"]).await;
    assert!(r.ok, "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("changed: table"), "{}", r.stdout);
    assert!(
        matches!(ttl_status().await.as_deref(), Some("ENABLED" | "ENABLING")),
        "enabled with the flag"
    );
}

fn redrive_args(dlq: &str, queue: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["redrive", "--dlq-url", dlq, "--queue-url", queue]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    a.extend(extra.iter().map(|s| (*s).to_owned()));
    a
}

async fn cli_owned(args: Vec<String>) -> Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    cli(&refs).await
}

#[tokio::test]
async fn redrive_refuses_a_dlq_the_source_queue_does_not_redrive_to() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    crate::common::send_all(
        &sqs,
        &q.queue_url,
        &["live-1".to_owned(), "live-2".to_owned()],
    )
    .await;

    // Swapped: the live queue given as the DLQ.
    let r = cli_owned(redrive_args(&q.queue_url, &q.dlq_url, &["--max", "10"])).await;
    assert!(!r.ok, "{}", r.stdout);
    assert!(
        r.stderr.contains("refusing to move") && r.stderr.contains("--skip-redrive-check"),
        "{}",
        r.stderr
    );
    assert_eq!(depth(&sqs, &q.queue_url).await, 2, "the live messages stay");
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0);
    let r = cli_owned(redrive_args(&q.queue_url, &q.dlq_url, &["--dry-run"])).await;
    assert!(
        !r.ok && r.stderr.contains("refusing"),
        "a dry run checks too: {}",
        r.stderr
    );

    // The override moves them (an operator who means it).
    let r = cli_owned(redrive_args(
        &q.queue_url,
        &q.dlq_url,
        &["--max", "10", "--skip-redrive-check"],
    ))
    .await;
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(depth(&sqs, &q.dlq_url).await, 2);
}

fn attribute(
    data_type: &str,
    string: Option<&str>,
    binary: Option<&[u8]>,
) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type(data_type)
        .set_string_value(string.map(str::to_owned))
        .set_binary_value(binary.map(aws_smithy_types::Blob::new))
        .build()
        .unwrap()
}

#[tokio::test]
async fn redrive_keeps_every_message_attribute_with_its_data_type() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    // Sealed as parking seals them (see `redrive_does_not_honour_...` for
    // values that are not).
    let secret = crate::common::carry_secret();
    let first_id = sqs_once::key::carry_message_id(&secret, "parked body", "orig-id-1");
    let key = sqs_once::key::carry_key(&secret, "parked body", "orig-id-1");
    let attrs: std::collections::HashMap<String, MessageAttributeValue> = [
        ("tenant", attribute("String", Some("acme"), None)),
        ("amount", attribute("Number", Some("12.50"), None)),
        (
            "signature",
            attribute("Binary", None, Some(&[0, 159, 255, 10])),
        ),
        ("kind", attribute("String.order-v2", Some("created"), None)),
        (
            "sqs_once_reason",
            attribute("String", Some("handler failed permanently: x"), None),
        ),
        (
            "sqs_once_message_id",
            attribute("String", Some(&first_id), None),
        ),
        ("sqs_once_dedup_key", attribute("String", Some(&key), None)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    sqs.send_message()
        .queue_url(&q.dlq_url)
        .message_body("parked body")
        .set_message_attributes(Some(attrs.clone()))
        .send()
        .await
        .unwrap();

    let r = cli_owned(redrive_args(&q.dlq_url, &q.queue_url, &["--max", "10"])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 1 message(s)"), "{}", r.stdout);
    let got = sqs
        .receive_message()
        .queue_url(&q.queue_url)
        .wait_time_seconds(5)
        .message_attribute_names("All")
        .send()
        .await
        .unwrap()
        .messages
        .unwrap_or_default();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body(), Some("parked body"));
    let back = got[0].message_attributes().cloned().unwrap_or_default();
    let view = |m: &std::collections::HashMap<String, MessageAttributeValue>| {
        type Seen = (String, String, Option<String>, Option<Vec<u8>>);
        let mut v: Vec<Seen> = m
            .iter()
            .map(|(k, a)| {
                (
                    k.clone(),
                    a.data_type().to_owned(),
                    a.string_value().map(str::to_owned),
                    a.binary_value().map(|b| b.as_ref().to_vec()),
                )
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(view(&back), view(&attrs), "every attribute as it was");
}

#[tokio::test]
async fn redrive_moves_messages_whose_total_is_over_one_batchs_limit() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    // Five 300 KB messages: 1.5 MB, over a send batch's total (the queue's
    // maximum message size, 1 MiB here).
    let sent: BTreeSet<String> = (0..5)
        .map(|i| format!("{i}{}", "x".repeat(300_000)))
        .collect();
    for body in &sent {
        sqs.send_message()
            .queue_url(&q.dlq_url)
            .message_body(body)
            .send()
            .await
            .unwrap();
    }
    let r = cli_owned(redrive_args(&q.dlq_url, &q.queue_url, &["--max", "10"])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 5 message(s)"), "{}", r.stdout);
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0);
    // Each once: a sorted list, not a set, so a duplicate shows.
    let sent: Vec<String> = sent.into_iter().collect();
    assert_eq!(bodies(&sqs, &q.queue_url).await, sent);
}

/// A message as parking leaves it in the DLQ: its body, the reason, the first
/// delivery's id and the dedup key it was processed under.
async fn park(sqs: &aws_sdk_sqs::Client, dlq_url: &str, body: &str, original_id: &str) {
    let s = |v: &str| attribute("String", Some(v), None);
    let secret = crate::common::carry_secret();
    sqs.send_message()
        .queue_url(dlq_url)
        .message_body(body)
        .message_attributes(
            "sqs_once_reason",
            s("handler failed permanently: fixed since"),
        )
        .message_attributes(
            "sqs_once_message_id",
            s(&sqs_once::key::carry_message_id(&secret, body, original_id)),
        )
        .message_attributes(
            "sqs_once_dedup_key",
            s(&sqs_once::key::carry_key(&secret, body, original_id)),
        )
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_second_copy_after_a_crash_between_send_and_delete_is_a_duplicate_not_a_second_effect() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = crate::common::Ledger::new(&sqs, &ddb).await;
    // Keyed by message id: every copy has a new SQS message id, so only the
    // dedup key the parked copy carries ties the copies together.
    let env = [("SQS_ONCE_DEDUP_KEY", "message-id")];
    let event = r#"{"id":"evt-r","account":"acct-r","amount_cents":700}"#;
    park(&sqs, &l.queues.dlq_url, event, "m-original").await;

    let redrive = || {
        cli_owned(redrive_args(
            &l.queues.dlq_url,
            &l.queues.queue_url,
            &["--max", "1"],
        ))
    };
    let r = redrive().await;
    assert!(r.ok, "{}", r.stderr);
    // A crash between the send and the delete leaves the DLQ's message in place:
    // the same message is in both queues.
    park(&sqs, &l.queues.dlq_url, event, "m-original").await;
    let first = crate::common::run_until_drained(&l, &sqs, 1, &env).await;
    assert_eq!(first[0]["completed"], 1, "{first:?}");

    // The operator runs redrive again: the second copy goes back too.
    let r = redrive().await;
    assert!(
        r.ok && r.stdout.contains("moved 1 message(s)"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    let second = crate::common::run_until_drained(&l, &sqs, 1, &env).await;
    assert_eq!(second[0]["duplicates"], 1, "{second:?}");
    assert_eq!(second[0]["completed"], 0, "{second:?}");

    let rows = crate::common::ledger_rows(&ddb, &l.ledger).await;
    assert_eq!(rows["acct-r"], (700, 1), "applied once");
    assert_eq!(depth(&sqs, &l.queues.dlq_url).await, 0);
}

#[tokio::test]
async fn redrive_to_a_fifo_queue_keeps_each_messages_group() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_sqs::types::MessageSystemAttributeName as S;
    let sqs = sqs().await;
    let q = queues(&sqs, true, 30).await;
    for (i, group) in ["g-a", "g-b", "g-a"].iter().enumerate() {
        sqs.send_message()
            .queue_url(&q.dlq_url)
            .message_body(format!("{group}-{i}"))
            .message_group_id(*group)
            .message_deduplication_id(format!("d-{i}"))
            .send()
            .await
            .unwrap();
    }
    let r = cli_owned(redrive_args(&q.dlq_url, &q.queue_url, &[])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 3 message(s)"), "{}", r.stdout);
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while seen.len() < 3 && tokio::time::Instant::now() < deadline {
        let got = sqs
            .receive_message()
            .queue_url(&q.queue_url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_system_attribute_names(S::MessageGroupId)
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        for m in got {
            let group = m.attributes().unwrap()[&S::MessageGroupId].clone();
            seen.push((m.body().unwrap().to_owned(), group));
            sqs.delete_message()
                .queue_url(&q.queue_url)
                .receipt_handle(m.receipt_handle().unwrap())
                .send()
                .await
                .unwrap();
        }
    }
    seen.sort();
    let expected: Vec<(String, String)> = [("g-a-0", "g-a"), ("g-a-2", "g-a"), ("g-b-1", "g-b")]
        .iter()
        .map(|(b, g)| ((*b).to_owned(), (*g).to_owned()))
        .collect();
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn init_check_reports_an_existing_queues_differences_as_init_does() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let sqs = sqs().await;
    let client = ddb().await;
    let table = dedup_table(&client).await;
    let name = unique("stackq");
    let (url, ops_dlq) = stack_queue(&sqs, &name).await;
    let r = cli(&[
        "init",
        "--table",
        &table,
        "--queue",
        &name,
        "--visibility-timeout",
        "60",
        "--check",
    ])
    .await;
    assert!(!r.ok, "{}", r.stdout);
    assert!(
        r.stdout.contains("problem: queue")
            && r.stdout.contains("visibility timeout is 360 s, not 60 s"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(&format!("sends to {ops_dlq}")),
        "{}",
        r.stdout
    );
    assert!(r.stderr.contains("2 problem(s)"), "{}", r.stderr);
    assert_eq!(queue_attrs(&sqs, &url).await[&A::VisibilityTimeout], "360");
}

/// Sends `body` to the source and receives it until SQS's redrive policy (5
/// receives) moves it to the DLQ; its message id.
async fn moved_by_sqs(
    sqs: &aws_sdk_sqs::Client,
    q: &sqs_once_cli::setup::QueuePair,
    body: &str,
) -> String {
    let original = sqs
        .send_message()
        .queue_url(&q.queue_url)
        .message_body(body)
        .send()
        .await
        .unwrap()
        .message_id
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while depth(sqs, &q.dlq_url).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never moved to the DLQ"
        );
        sqs.receive_message()
            .queue_url(&q.queue_url)
            .visibility_timeout(0)
            .wait_time_seconds(1)
            .send()
            .await
            .unwrap();
    }
    original
}

/// The source's messages, with their message attributes.
async fn received(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<aws_sdk_sqs::types::Message> {
    sqs.receive_message()
        .queue_url(url)
        .message_attribute_names("All")
        .wait_time_seconds(5)
        .send()
        .await
        .unwrap()
        .messages
        .unwrap_or_default()
}

/// A message SQS's redrive policy moved to the DLQ (its receives ran out: not
/// parked by sqs-once, so it carries no dedup key) keeps its message id there.
/// Brought back it gets a new id; `redrive` adds the key a `message-id`
/// consumer used for it, so its record is found and its effect not made again.
#[tokio::test]
async fn redrive_gives_a_message_sqs_moved_the_key_its_consumer_used() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    let original = moved_by_sqs(&sqs, &q, "{\"id\":\"evt-moved\"}").await;
    let r = cli_owned(redrive_args(&q.dlq_url, &q.queue_url, &[])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 1 message(s)"), "{}", r.stdout);

    let got = received(&sqs, &q.queue_url).await;
    assert_eq!(got.len(), 1);
    let m = &got[0];
    let carried = m
        .message_attributes()
        .and_then(|a| a.get(sqs_once::key::DEDUP_KEY_ATTRIBUTE))
        .and_then(|v| v.string_value())
        .expect("the redriven copy carries a dedup key")
        .to_owned();
    let copy = sqs_once::Message::new(m.message_id().unwrap(), m.body().unwrap())
        .with_attribute(sqs_once::key::DEDUP_KEY_ATTRIBUTE, carried);
    assert_ne!(copy.id(), original, "SQS gave the copy a new id");
    assert_eq!(
        sqs_once::KeySource::MessageId
            .extract_with(&copy, Some(&crate::common::carry_secret()))
            .unwrap(),
        original,
        "a message-id consumer finds the original's record"
    );
}

/// A message too close to the source's size limit for the key's attribute is
/// sent back without it, with a warning, rather than left in the DLQ.
#[tokio::test]
async fn redrive_sends_a_message_with_no_room_for_the_key_as_it_is_and_says_so() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, false, 30).await;
    sqs.set_queue_attributes()
        .queue_url(&q.queue_url)
        .attributes(
            aws_sdk_sqs::types::QueueAttributeName::MaximumMessageSize,
            "1024",
        )
        .send()
        .await
        .unwrap();
    let body = "x".repeat(1000);
    moved_by_sqs(&sqs, &q, &body).await;
    let r = cli_owned(redrive_args(&q.dlq_url, &q.queue_url, &[])).await;
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("moved 1 message(s)"), "{}", r.stdout);
    assert!(r.stderr.contains("without a dedup key"), "{}", r.stderr);
    let got = received(&sqs, &q.queue_url).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].body(), Some(body.as_str()));
    assert_eq!(depth(&sqs, &q.dlq_url).await, 0);
}

/// Two source queues share one DLQ: `redrive` to one of them moves back
/// only the copies parked from it (their `sqs_once_source_queue`), and
/// leaves the other's for its own redrive.
#[tokio::test]
async fn redrive_from_a_shared_dlq_moves_only_the_copies_of_the_queue_it_is_given() {
    if !crate::common::localstack_up().await {
        return;
    }
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let sqs = sqs().await;
    let a = queues(&sqs, false, 30).await;
    let dlq_arn = queue_attrs(&sqs, &a.dlq_url).await[&A::QueueArn].clone();
    let b_url = sqs
        .create_queue()
        .queue_name(unique("shares-dlq"))
        .attributes(
            A::RedrivePolicy,
            serde_json::json!({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "3"}).to_string(),
        )
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    let dlq = sqs_once::parking::Dlq::new(sqs.clone(), a.dlq_url.clone());
    for (id, from) in [("m-a", &a.queue_url), ("m-b", &b_url)] {
        let m = sqs_once::Message::new(id, format!("{{\"from\":\"{id}\"}}")).with_queue(from);
        dlq.park(&m, "failed", None, None).await.unwrap();
    }

    let r = cli_owned(redrive_args(&a.dlq_url, &a.queue_url, &[])).await;
    assert!(r.ok, "{}", r.stderr);
    assert!(r.stdout.contains("moved 1 message(s)"), "{}", r.stdout);
    assert!(r.stderr.contains("other queues"), "{}", r.stderr);
    assert_eq!(bodies(&sqs, &a.queue_url).await, [r#"{"from":"m-a"}"#]);
    assert_eq!(depth(&sqs, &a.dlq_url).await, 1, "B's copy stays");

    let r = cli_owned(redrive_args(&a.dlq_url, &b_url, &[])).await;
    assert!(r.ok, "{}", r.stderr);
    assert_eq!(bodies(&sqs, &b_url).await, [r#"{"from":"m-b"}"#]);
    assert_eq!(depth(&sqs, &a.dlq_url).await, 0);
}

/// `local-lambda` feeds a queue to a function on this machine, deleting
/// what it answers for: against AWS's own endpoints (no `AWS_ENDPOINT_URL`)
/// it refuses before it starts anything, unless told.
#[tokio::test]
async fn local_lambda_refuses_a_non_local_endpoint_unless_told() {
    let out = tokio::process::Command::new(crate::common::binary("sqs-once"))
        .args(["local-lambda", "--function", "/bin/true"])
        .args([
            "--queue-url",
            "https://sqs.us-east-1.amazonaws.com/1/orders",
        ])
        .env_remove("AWS_ENDPOINT_URL")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("refusing") && stderr.contains("--allow-remote"),
        "{stderr}"
    );
}
