//! The payload budget (`SQS_ONCE_PAYLOAD_BUDGET_BYTES`) over real S3
//! (LocalStack's, through `aws-sdk-s3`): payloads read at once never hold
//! more than the budget, every message completes exactly once, and a
//! payload that could never fit is parked unread.
//!
//! `peak_rss_of_ten_60_mib_payloads_at_once` (ignored: it moves 600 MiB
//! through S3) measures the process's peak RSS for ten 60 MiB pointers
//! processed at once, with the budget fitted to the template's 256 MB
//! function, or none (see bench/RESULTS.md, "Payload budget"):
//!
//! ```text
//! source scripts/local-env
//! BENCH_PAYLOAD_BUDGET=fitted cargo test --all-features --test payload_budget -- --ignored --nocapture
//! BENCH_PAYLOAD_BUDGET=none   cargo test --all-features --test payload_budget -- --ignored --nocapture
//! ```
//!
//! (`BENCH_PAYLOAD_HANDLER=copy`: the handler holds a copy of each
//! message, as a `handler_fn` handler is handed one.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_config::Region;
use sqs_once::payloads::{LargePayloads, MemoryLimits, PayloadBudget, SIZE_ATTRIBUTE, fit_budget};
use sqs_once::{Attribute, MemoryStore, Message, Outcome, Processor, ProcessorConfig};

const MIB: usize = 1024 * 1024;

fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL_S3")
        .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
        .unwrap_or_else(|_| "http://127.0.0.1:4566".to_owned())
}

/// LocalStack's S3, or `None` (the test passes without running) when
/// nothing answers and the run does not require it.
async fn s3() -> Option<aws_sdk_s3::Client> {
    let endpoint = endpoint();
    let addr = endpoint.trim_start_matches("http://").trim_end_matches('/');
    if tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            std::env::var("SQS_ONCE_LOCALSTACK").as_deref() != Ok("required"),
            "LocalStack is not answering on {endpoint}"
        );
        return None;
    }
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(&endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_s3::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .load()
        .await;
    let conf = aws_sdk_s3::config::Builder::from(&sdk)
        .force_path_style(true)
        .build();
    Some(aws_sdk_s3::Client::from_conf(conf))
}

/// Deletes the bucket and its objects (LocalStack is shared).
async fn remove(s3: &aws_sdk_s3::Client, bucket: &str) {
    let listed = s3.list_objects_v2().bucket(bucket).send().await.unwrap();
    for o in listed.contents() {
        let key = o.key().unwrap_or_default();
        s3.delete_object()
            .bucket(bucket)
            .key(key)
            .send()
            .await
            .unwrap();
    }
    s3.delete_bucket().bucket(bucket).send().await.unwrap();
}

async fn bucket(s3: &aws_sdk_s3::Client) -> String {
    let name = format!("budget-{}", uuid::Uuid::new_v4().simple());
    s3.create_bucket().bucket(&name).send().await.unwrap();
    name
}

fn pointer(id: &str, bucket: &str, key: &str, declared: usize) -> Message {
    let body = format!(
        r#"["software.amazon.payloadoffloading.PayloadS3Pointer", {{"s3BucketName": "{bucket}", "s3Key": "{key}"}}]"#
    );
    Message::new(id, body)
        .with_typed_attribute(
            SIZE_ATTRIBUTE,
            Attribute::typed("Number", Some(declared.to_string()), None).unwrap(),
        )
        .with_receipt_handle(format!("rh-{id}"))
}

type Runs = Arc<Mutex<HashMap<String, u32>>>;

/// Counts its runs by message id, checks the budget is never passed while
/// it holds its payload, and takes `hold` doing so. It borrows the message
/// (as the `ledger` example's handler does): `handler_fn` would be handed a
/// copy, one more payload's worth of memory per message.
struct Counting {
    runs: Runs,
    budget: Option<Arc<PayloadBudget>>,
    hold: Duration,
    /// Takes a copy of the message, as `handler_fn` is handed one.
    copy: bool,
}

impl sqs_once::Handler for Counting {
    async fn handle(&self, m: &Message, _ctx: &sqs_once::Context) -> sqs_once::HandlerResult {
        let copy = self.copy.then(|| m.clone());
        let m = copy.as_ref().unwrap_or(m);
        if let Some(b) = &self.budget {
            assert!(b.held() >= m.body().len(), "the payload's grant is held");
            assert!(b.held() <= b.bytes(), "within the budget");
        }
        // Touch every byte: the payload is resident.
        let sum: u64 = m.body().bytes().map(u64::from).sum();
        tokio::time::sleep(self.hold).await;
        *self
            .runs
            .lock()
            .unwrap()
            .entry(m.id().to_owned())
            .or_default() += 1;
        Ok(Some(serde_json::json!({ "sum": sum })))
    }
}

/// A processor over S3 within `budget` (none: no budget), its handler
/// [`Counting`].
fn processor(
    s3: aws_sdk_s3::Client,
    budget: Option<Arc<PayloadBudget>>,
    hold: Duration,
    copy: bool,
) -> (Processor<MemoryStore, Counting>, Runs) {
    let runs: Runs = Arc::default();
    let handler = Counting {
        runs: runs.clone(),
        budget: budget.clone(),
        hold,
        copy,
    };
    let mut payloads = LargePayloads::new(s3);
    if let Some(b) = budget {
        payloads = payloads.within(b);
    }
    let config = ProcessorConfig::new("budget");
    let p = Processor::new(MemoryStore::default(), handler, config)
        .unwrap()
        .with_large_payloads(payloads);
    (p, runs)
}

/// Ten 1 MiB payloads at once within a budget of 3.5 MiB (a pointer that
/// understates its size among them): never more than three held, each
/// message's effect applied once (a redelivery of each is a duplicate), and
/// a pointer declaring more than the budget parked without reading it.
#[tokio::test]
async fn budget_limited_s3_reads_never_hold_more_than_the_budget() {
    let Some(s3) = s3().await else { return };
    let bucket = bucket(&s3).await;
    for i in 0..10 {
        let body = format!("{i:08}{}", "p".repeat(MIB - 8));
        s3.put_object()
            .bucket(&bucket)
            .key(format!("k{i}"))
            .body(body.into_bytes().into())
            .send()
            .await
            .unwrap();
    }
    let budget = Arc::new(PayloadBudget::new(7 * MIB / 2));
    let (p, runs) = processor(
        s3.clone(),
        Some(budget.clone()),
        Duration::from_millis(100),
        false,
    );
    let messages: Vec<Message> = (0..10)
        .map(|i| {
            let declared = if i == 3 { 100 } else { MIB };
            pointer(&format!("m{i}"), &bucket, &format!("k{i}"), declared)
        })
        .collect();
    let outcomes = futures::future::join_all(messages.iter().cloned().map(|m| p.process(m))).await;
    for o in &outcomes {
        assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    }
    // Three at once (and the understated pointer's first, cut-off grant).
    let high_water = budget.high_water();
    assert!(
        (3 * MIB..=budget.bytes()).contains(&high_water),
        "{high_water}"
    );
    assert_eq!(budget.held(), 0, "all given back");
    // Redelivered: duplicates, no effect applied again.
    let again = futures::future::join_all(messages.into_iter().map(|m| p.process(m))).await;
    for o in &again {
        assert!(matches!(o, Outcome::Duplicate { .. }), "{o:?}");
    }
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 10);
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
    // Could never fit: parked, not read.
    let o = p.process(pointer("big", &bucket, "k0", 4 * MIB)).await;
    let Outcome::Park { reason } = o else {
        panic!("{o:?}")
    };
    assert!(reason.contains("more than the payload budget"), "{reason}");
    assert_eq!(budget.high_water(), high_water);
    remove(&s3, &bucket).await;
}

/// The process's peak and current resident memory, in bytes.
fn rss() -> (usize, usize) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .unwrap()
            * 1024
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// Ten 60 MiB pointers processed at once, the budget fitted to the
/// template's function (`MemorySize: 256`) or none: the peak RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "moves 600 MiB through S3; run by hand (bench/RESULTS.md)"]
async fn peak_rss_of_ten_60_mib_payloads_at_once() {
    let Some(s3) = s3().await else { return };
    let mode = std::env::var("BENCH_PAYLOAD_BUDGET").unwrap_or_else(|_| "fitted".into());
    let memory_mib = 256;
    let budget = match mode.as_str() {
        "none" => None,
        _ => {
            let fitted = fit_budget(
                None,
                &MemoryLimits {
                    lambda_mb: Some(memory_mib.to_string()),
                    ..MemoryLimits::default()
                },
            );
            eprintln!("budget: {:?} from {}", fitted.bytes, fitted.from);
            Some(Arc::new(PayloadBudget::new(fitted.bytes.unwrap())))
        }
    };
    let bucket = bucket(&s3).await;
    let size = 60 * MIB;
    {
        let body = vec![b'x'; size];
        s3.put_object()
            .bucket(&bucket)
            .key("sixty")
            .body(body.into())
            .send()
            .await
            .unwrap();
    }
    let copy = std::env::var("BENCH_PAYLOAD_HANDLER").as_deref() == Ok("copy");
    let (p, runs) = processor(s3.clone(), budget.clone(), Duration::from_millis(300), copy);
    // The peak so far (the upload's) is forgotten: from here on it counts.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let (_, baseline) = rss();
    let started = std::time::Instant::now();
    let outcomes = futures::future::join_all(
        (0..10).map(|i| p.process(pointer(&format!("m{i}"), &bucket, "sixty", size))),
    )
    .await;
    let elapsed = started.elapsed();
    let (peak, _) = rss();
    remove(&s3, &bucket).await;
    for o in &outcomes {
        assert!(matches!(o, Outcome::Completed { .. }), "{o:?}");
    }
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 10);
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
    let high_water = budget.as_ref().map(|b| b.high_water());
    eprintln!(
        "payload budget {mode}, handler copying: {copy}: baseline RSS {} MiB, peak RSS {} MiB, budget high-water {:?} MiB, {elapsed:?} for 10 x 60 MiB",
        baseline / MIB,
        peak / MIB,
        high_water.map(|h| h / MIB),
    );
    if let Some(b) = &budget {
        assert!(b.high_water() <= b.bytes());
        assert!(
            peak < memory_mib * MIB,
            "peak RSS {peak} within the function's memory"
        );
        let copies = if copy { 2 } else { 1 };
        assert!(
            peak <= baseline + copies * b.bytes() + 16 * MIB,
            "peak RSS {peak} within the budget (twice with the handler's copy) + baseline"
        );
    }
}
