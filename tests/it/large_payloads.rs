//! Large payloads through S3 (LocalStack's S3), sent by the real Amazon SQS
//! Extended Client Library for Python (`tests/support/extended_client.py`),
//! through the `ledger` binary in both runtimes: the handler gets the
//! payload, the dedup key is read from it, a missing object is parked with
//! its reason, a parked message keeps its pointer (and its object), and
//! objects are deleted after their messages only when asked.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use sqs_once::payloads::{S3Pointer, SIZE_ATTRIBUTE};
use sqs_once_cli::local_lambda::{LocalLambda, run_event_source};

use crate::common::{
    Ledger, ddb, depth, endpoint, ledger_rows, run_until_drained, sdk_config, sqs, unique,
};

/// S3's endpoint: `AWS_ENDPOINT_URL_S3` (as the SDKs read it), else LocalStack's.
fn s3_endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL_S3").unwrap_or_else(|_| endpoint())
}

pub(crate) async fn s3() -> aws_sdk_s3::Client {
    let conf = aws_sdk_s3::config::Builder::from(&sdk_config().await)
        .endpoint_url(s3_endpoint())
        .force_path_style(true)
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

pub(crate) async fn bucket(s3: &aws_sdk_s3::Client) -> String {
    let name = unique("payloads");
    if let Err(e) = s3.create_bucket().bucket(&name).send().await {
        panic!(
            "cannot create a bucket in S3 at {}: {}. LocalStack must serve S3: localstack/up \
             starts it with s3; one started before s3 was added needs localstack/down && localstack/up",
            s3_endpoint(),
            aws_smithy_types::error::display::DisplayErrorContext(e)
        );
    }
    name
}

/// The bucket's keys, sorted.
pub(crate) async fn objects(s3: &aws_sdk_s3::Client, bucket: &str) -> Vec<String> {
    let listed = s3.list_objects_v2().bucket(bucket).send().await.unwrap();
    let mut keys: Vec<String> = listed
        .contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_owned))
        .collect();
    keys.sort();
    keys
}

/// The Python with the extended client installed (installed on first use).
fn extended_python() -> &'static str {
    static PYTHON: OnceLock<String> = OnceLock::new();
    PYTHON.get_or_init(|| {
        let setup = format!("{}/tools/setup-extended-client", env!("CARGO_MANIFEST_DIR"));
        let out = std::process::Command::new(&setup)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("run tools/setup-extended-client");
        assert!(out.status.success(), "{setup} failed: {:?}", out.status);
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines().last().expect("the venv's python").to_owned()
    })
}

/// Sends `(body, legacy)` messages through the Python extended client;
/// returns their message ids.
async fn send_extended(queue_url: &str, bucket: &str, messages: &[(String, bool)]) -> Vec<String> {
    let request = serde_json::json!({
        "queue_url": queue_url,
        "bucket": bucket,
        "messages": messages.iter().map(|(body, legacy)| serde_json::json!({"body": body, "legacy": legacy})).collect::<Vec<_>>(),
    });
    let ids: Vec<String> = serde_json::from_value(extended_client(request).await).unwrap();
    assert_eq!(ids.len(), messages.len());
    ids
}

/// Receives (and deletes) `n` messages through the Python extended client:
/// their bodies as it hands them over, payloads read from S3.
pub(crate) async fn receive_extended(queue_url: &str, bucket: &str, n: usize) -> Vec<String> {
    let request = serde_json::json!({"queue_url": queue_url, "bucket": bucket, "receive": n});
    serde_json::from_value(extended_client(request).await).unwrap()
}

/// Runs `tests/support/extended_client.py` on `request`: what it printed.
async fn extended_client(request: serde_json::Value) -> serde_json::Value {
    let python = extended_python();
    let script = format!(
        "{}/tests/support/extended_client.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let mut child = tokio::process::Command::new(python)
        .arg(&script)
        .env("AWS_ENDPOINT_URL", endpoint())
        .env("AWS_ENDPOINT_URL_S3", s3_endpoint())
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, request.to_string().as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "the extended client failed: {:?}",
        out.status
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A ledger event too large for SQS (300 KiB: JSON whitespace pads it).
fn large_event(id: &str, account: &str, amount: i64) -> String {
    let pad = " ".repeat(300 * 1024);
    format!(r#"{{"id":"{id}",{pad}"account":"{account}","amount_cents":{amount}}}"#)
}

/// A parked copy: its body, `sqs_once_reason`, and whether it still carries
/// the extended client's size attribute.
#[derive(Debug)]
struct Parked {
    body: String,
    reason: String,
    size_attribute: bool,
}

/// Everything in the DLQ.
async fn parked(sqs: &aws_sdk_sqs::Client, dlq: &str) -> Vec<Parked> {
    let mut out: Vec<Parked> = crate::common::receive_all(sqs, dlq)
        .await
        .iter()
        .map(|m| {
            let attributes = m.message_attributes().unwrap();
            Parked {
                body: m.body().unwrap().to_owned(),
                reason: attributes["sqs_once_reason"]
                    .string_value()
                    .unwrap()
                    .to_owned(),
                size_attribute: attributes.contains_key(SIZE_ATTRIBUTE),
            }
        })
        .collect();
    out.sort_by(|a, b| a.reason.cmp(&b.reason));
    out
}

#[derive(Debug, Clone, Copy)]
enum Runtime {
    Poller,
    Lambda,
}

/// Runs the `ledger` binary in `runtime` until the queue is drained.
async fn consume(runtime: Runtime, l: &Ledger, sqs: &aws_sdk_sqs::Client, env: &[(&str, &str)]) {
    match runtime {
        Runtime::Poller => {
            let stats = run_until_drained(l, sqs, 1, env).await;
            let s = &stats[0];
            assert_eq!(
                (
                    &s["completed"],
                    &s["duplicates"],
                    &s["parked"],
                    &s["retried"]
                ),
                (&2.into(), &1.into(), &2.into(), &0.into()),
                "{s}"
            );
            // Every payload read once, counted with the other AWS calls.
            assert_eq!(s["calls"]["S3.GetObject"], 5, "{s}");
        }
        Runtime::Lambda => {
            let mut vars: Vec<(String, String)> = [
                ("SQS_ONCE_DLQ_URL", l.queues.dlq_url.as_str()),
                ("SQS_ONCE_TABLE", &l.dedup),
                ("SQS_ONCE_CONSUMER", "ledger"),
                ("SQS_ONCE_DEDUP_KEY", "json:/id"),
                ("LEDGER_TABLE", &l.ledger),
                ("AWS_REGION", "us-east-1"),
                ("AWS_ACCESS_KEY_ID", "test"),
                ("AWS_SECRET_ACCESS_KEY", "test"),
                ("RUST_LOG", "warn"),
            ]
            .iter()
            .chain(env)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            vars.push(("AWS_ENDPOINT_URL".into(), endpoint()));
            vars.push(("AWS_ENDPOINT_URL_S3".into(), s3_endpoint()));
            let function = LocalLambda::start(
                crate::common::binary("ledger"),
                "ledger",
                Duration::from_secs(30),
                vars,
            )
            .await
            .unwrap();
            let stats = run_event_source(
                sqs,
                &l.queues.queue_url,
                &function,
                10,
                Duration::from_secs(2),
            )
            .await
            .unwrap();
            function.shutdown().await;
            assert_eq!(
                (
                    stats.records,
                    stats.deleted,
                    stats.reported_failed,
                    stats.failed_invocations
                ),
                (5, 5, 0, 0),
                "{stats:?}"
            );
        }
    }
}

/// Sends five messages through the extended client: one whose object is
/// deleted before it is received, e1 and e2 (e2 with the 1.x attribute and
/// pointer class), e1 re-sent (a new object, the same dedup key), and a
/// payload that is not a ledger event. Returns the missing object's key and
/// the keys stored.
async fn send_scenario(s3: &aws_sdk_s3::Client, url: &str, bucket: &str) -> (String, Vec<String>) {
    send_extended(url, bucket, &[(large_event("e0", "acct-z", 1), false)]).await;
    let gone = objects(s3, bucket).await;
    assert_eq!(gone.len(), 1, "{gone:?}");
    s3.delete_object()
        .bucket(bucket)
        .key(&gone[0])
        .send()
        .await
        .unwrap();
    let not_an_event = format!("not a ledger event{}", " ".repeat(300 * 1024));
    send_extended(
        url,
        bucket,
        &[
            (large_event("e1", "acct-a", 100), false),
            (large_event("e2", "acct-b", 200), true),
            (large_event("e1", "acct-a", 100), false),
            (not_an_event, false),
        ],
    )
    .await;
    let stored = objects(s3, bucket).await;
    assert_eq!(stored.len(), 4, "{stored:?}");
    (gone[0].clone(), stored)
}

/// The DLQ holds exactly the two pointers, with their size attribute: the
/// missing object's, then (sorted by reason) the payload that is not an event,
/// whose dedup key (`json:/id`) was read from the payload. Returns the latter's
/// object key.
async fn assert_parked(sqs: &aws_sdk_sqs::Client, dlq: &str, bucket: &str, gone: &str) -> String {
    let parked = parked(sqs, dlq).await;
    assert_eq!(parked.len(), 2, "{parked:?}");
    let pointers: Vec<S3Pointer> = parked
        .iter()
        .map(|p| S3Pointer::parse(&p.body).expect("a parked copy keeps its pointer"))
        .collect();
    assert!(parked.iter().all(|p| p.size_attribute), "{parked:?}");
    assert!(pointers.iter().all(|p| p.bucket == bucket));
    assert_eq!(pointers[0].key, gone);
    let missing = format!("large payload s3://{bucket}/{gone} is missing (NoSuchKey");
    assert!(parked[0].reason.starts_with(&missing), "{parked:?}");
    let not_json = "no dedup key: the body is not valid JSON";
    assert!(parked[1].reason.starts_with(not_json), "{parked:?}");
    pointers[1].key.clone()
}

async fn large_payloads_end_to_end(runtime: Runtime, delete: bool) {
    let (sqs, ddb, s3) = (sqs().await, ddb().await, s3().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let bucket = bucket(&s3).await;
    let url = &l.queues.queue_url;
    let (gone, stored) = send_scenario(&s3, url, &bucket).await;

    let on_off = if delete { "on" } else { "off" };
    let env = [
        ("SQS_ONCE_LARGE_PAYLOADS", "on"),
        ("SQS_ONCE_DELETE_PAYLOADS", on_off),
        ("SQS_ONCE_LARGE_PAYLOAD_BUCKETS", bucket.as_str()),
    ];
    consume(runtime, &l, &sqs, &env).await;

    assert_eq!(depth(&sqs, url).await, 0);
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([
            ("acct-a".to_owned(), (100, 1)),
            ("acct-b".to_owned(), (200, 1)),
        ]),
        "each event applied once, read from its payload"
    );
    let bad = assert_parked(&sqs, &l.queues.dlq_url, &bucket, &gone).await;
    assert!(stored.contains(&bad));
    let left = objects(&s3, &bucket).await;
    if delete {
        assert_eq!(left, vec![bad], "only the parked message's object is kept");
    } else {
        assert_eq!(left, stored, "no object is deleted");
    }
}

#[tokio::test]
async fn poller_reads_large_payloads_and_deletes_their_objects_when_asked() {
    if !crate::common::localstack_up().await {
        return;
    }
    large_payloads_end_to_end(Runtime::Poller, true).await;
}

#[tokio::test]
async fn poller_reads_large_payloads_and_keeps_their_objects_by_default() {
    if !crate::common::localstack_up().await {
        return;
    }
    large_payloads_end_to_end(Runtime::Poller, false).await;
}

#[tokio::test]
async fn lambda_reads_large_payloads_and_deletes_their_objects_when_asked() {
    if !crate::common::localstack_up().await {
        return;
    }
    large_payloads_end_to_end(Runtime::Lambda, true).await;
}

#[tokio::test]
async fn lambda_reads_large_payloads_and_keeps_their_objects_by_default() {
    if !crate::common::localstack_up().await {
        return;
    }
    large_payloads_end_to_end(Runtime::Lambda, false).await;
}

/// Off (the default), a pointer is an ordinary body: the ledger cannot read
/// it and parks it, and nothing is read from S3.
#[tokio::test]
async fn off_a_pointer_body_is_processed_as_it_is() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb, s3) = (sqs().await, ddb().await, s3().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let bucket = bucket(&s3).await;
    send_extended(
        &l.queues.queue_url,
        &bucket,
        &[(large_event("e1", "acct-a", 100), false)],
    )
    .await;
    let stats = run_until_drained(&l, &sqs, 1, &[]).await;
    assert_eq!(stats[0]["parked"], 1, "{}", stats[0]);
    assert!(ledger_rows(&ddb, &l.ledger).await.is_empty());
    let parked = parked(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 1);
    S3Pointer::parse(&parked[0].body).unwrap();
    assert_eq!(objects(&s3, &bucket).await.len(), 1);
}

/// Issue 31: a pointer may name any bucket and key. One outside
/// `SQS_ONCE_LARGE_PAYLOAD_BUCKETS` (another bucket, or the payload bucket
/// outside its prefix) is parked with the reason without calling S3, and
/// with deletion on its object is not deleted.
#[tokio::test]
async fn a_pointer_outside_the_payload_buckets_is_parked_without_calling_s3() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb, s3) = (sqs().await, ddb().await, s3().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let (payloads, foreign) = (bucket(&s3).await, bucket(&s3).await);
    for (b, key) in [(&foreign, "secret-report"), (&payloads, "elsewhere/k")] {
        s3.put_object()
            .bucket(b)
            .key(key)
            .body(large_event("e-f", "acct-f", 1).into_bytes().into())
            .send()
            .await
            .unwrap();
        let pointer = format!(
            r#"["software.amazon.payloadoffloading.PayloadS3Pointer",{{"s3BucketName":"{b}","s3Key":"{key}"}}]"#
        );
        sqs.send_message()
            .queue_url(&l.queues.queue_url)
            .message_body(pointer)
            .message_attributes(
                "ExtendedPayloadSize",
                aws_sdk_sqs::types::MessageAttributeValue::builder()
                    .data_type("Number")
                    .string_value("60")
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
    }
    let allowed = format!("{payloads}/in/");
    let env = [
        ("SQS_ONCE_LARGE_PAYLOADS", "on"),
        ("SQS_ONCE_DELETE_PAYLOADS", "on"),
        ("SQS_ONCE_LARGE_PAYLOAD_BUCKETS", allowed.as_str()),
    ];
    let stats = run_until_drained(&l, &sqs, 1, &env).await;
    let s = &stats[0];
    assert_eq!(s["parked"], 2, "{s}");
    assert_eq!(s["completed"], 0, "{s}");
    assert!(
        s["calls"].get("S3.GetObject").is_none_or(|n| n == 0),
        "S3 was called: {s}"
    );
    assert!(ledger_rows(&ddb, &l.ledger).await.is_empty());
    let parked = parked(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 2, "{parked:?}");
    for p in &parked {
        assert!(
            p.reason.contains(
                "is outside the payload buckets (SQS_ONCE_LARGE_PAYLOAD_BUCKETS); not read"
            ),
            "{p:?}"
        );
    }
    assert_eq!(
        objects(&s3, &foreign).await,
        vec!["secret-report".to_owned()]
    );
    assert_eq!(
        objects(&s3, &payloads).await,
        vec!["elsewhere/k".to_owned()]
    );
}

/// Each S3 request's operation and `x-amz-expected-bucket-owner` header.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

/// Records the `x-amz-expected-bucket-owner` header of each S3 request.
#[derive(Debug, Default, Clone)]
struct OwnerHeaders(Seen);

impl aws_sdk_s3::config::Intercept for OwnerHeaders {
    fn name(&self) -> &'static str {
        "OwnerHeaders"
    }

    fn read_before_transmit(
        &self,
        ctx: &aws_sdk_s3::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _rc: &aws_sdk_s3::config::RuntimeComponents,
        cfg: &mut aws_sdk_s3::config::ConfigBag,
    ) -> Result<(), aws_smithy_runtime_api::box_error::BoxError> {
        let op = cfg
            .load::<aws_smithy_runtime_api::client::orchestrator::Metadata>()
            .map_or_else(String::new, |m| m.name().to_owned());
        let owner = ctx
            .request()
            .headers()
            .get("x-amz-expected-bucket-owner")
            .map(str::to_owned);
        self.0.lock().unwrap().push((op, owner));
        Ok(())
    }
}

/// The S3 payload store the front door builds names the bucket's owner on
/// every call (S3's `ExpectedBucketOwner`), so a payload bucket deleted and
/// made again by another account is refused. (LocalStack does not enforce
/// the header: this checks that each call carries it, and that the calls
/// still work against the bucket's real owner.)
#[tokio::test]
async fn every_s3_payload_call_names_the_expected_bucket_owner() {
    if !crate::common::localstack_up().await {
        return;
    }
    use sqs_once::aws::s3::S3Payloads;
    use sqs_once::payloads::PayloadStore;
    let plain = s3().await;
    let bucket = bucket(&plain).await;
    let seen = OwnerHeaders::default();
    let conf = aws_sdk_s3::config::Builder::from(&sdk_config().await)
        .endpoint_url(s3_endpoint())
        .force_path_style(true)
        .interceptor(seen.clone())
        .build();
    let store =
        S3Payloads::new(aws_sdk_s3::Client::from_conf(conf)).expecting_owner("000000000000");
    let pointer = S3Pointer {
        bucket: bucket.clone(),
        key: "owned/one".into(),
    };
    store.put(&pointer, b"payload".to_vec()).await.unwrap();
    assert_eq!(store.get(&pointer, 1024).await.unwrap(), b"payload");
    store.delete(&pointer).await.unwrap();
    assert_eq!(objects(&plain, &bucket).await, Vec::<String>::new());
    let seen = seen.0.lock().unwrap().clone();
    let ops: Vec<&str> = seen.iter().map(|(op, _)| op.as_str()).collect();
    assert_eq!(ops, ["PutObject", "GetObject", "DeleteObject"], "{seen:?}");
    assert!(
        seen.iter()
            .all(|(_, owner)| owner.as_deref() == Some("000000000000")),
        "a call without the expected owner: {seen:?}"
    );
}
