//! Clients and unique resources for tests against LocalStack.

#[path = "../support/mod.rs"]
mod support;
pub use support::payments_api::{ApiFaults, StubApi};
pub use support::{binary, depth, ledger_rows, self_signed_tls, send_all, unique};

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_dynamodb::config::interceptors::AfterDeserializationInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use sqs_once_cli::setup::{QueuePair, ensure_queue_with_dlq};

/// The consumers' and operators' `SQS_ONCE_CARRY_SECRET` in these tests.
pub const CARRY_SECRET: &str = "test-carry-secret-0123456789abcdef0123456789abcdef";

/// [`CARRY_SECRET`] parsed.
pub fn carry_secret() -> sqs_once::key::CarrySecret {
    sqs_once::key::CarrySecret::parse(CARRY_SECRET).unwrap()
}

/// The LocalStack endpoint: `AWS_ENDPOINT_URL`, else 127.0.0.1:4566.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".to_owned())
}

/// Whether LocalStack answers on [`endpoint`]. When it does not, a run that
/// expects it (`SQS_ONCE_LOCALSTACK=required`, as `scripts/test` sets) fails
/// here, and any other run (a plain `cargo test`) skips the test, saying so
/// once on stderr past the test harness's capture.
pub async fn localstack_up() -> bool {
    let endpoint = endpoint();
    let addr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    if tokio::net::TcpStream::connect(&addr).await.is_ok() {
        return true;
    }
    assert!(
        std::env::var("SQS_ONCE_LOCALSTACK").as_deref() != Ok("required"),
        "LocalStack is not answering on {endpoint} and this run requires it \
         (SQS_ONCE_LOCALSTACK=required): start it with `localstack/up`"
    );
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "LocalStack is not answering on {endpoint}: the tests that need it pass without \
             running (start it with `localstack/up`, or run `scripts/test`, which requires it)"
        );
    });
    false
}

pub async fn sdk_config() -> SdkConfig {
    let endpoint = endpoint();
    // Fail fast with a clear message rather than a wall of SDK retries.
    let addr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    if tokio::net::TcpStream::connect(&addr).await.is_err() {
        panic!("LocalStack is not answering on {endpoint}: start it with `localstack/up`");
    }
    aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .load()
        .await
}

pub async fn ddb() -> aws_sdk_dynamodb::Client {
    aws_sdk_dynamodb::Client::new(&sdk_config().await)
}

/// A fresh dedup table (key `pk`, TTL on `expires_at`).
pub async fn dedup_table(client: &aws_sdk_dynamodb::Client) -> String {
    let name = unique("dedup");
    sqs_once_cli::setup::ensure_dedup_table(client, &name)
        .await
        .expect("create dedup table");
    name
}

/// Makes the first `n` responses of one DynamoDB operation fail on the client
/// *after* the server has applied the request: a lost response.
#[derive(Debug)]
pub struct LoseResponses {
    pub operation: &'static str,
    pub remaining: AtomicU32,
    pub lost: Arc<AtomicU32>,
}

impl Intercept for LoseResponses {
    fn name(&self) -> &'static str {
        "LoseResponses"
    }

    fn read_after_deserialization(
        &self,
        _ctx: &AfterDeserializationInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let op = cfg.load::<Metadata>().map(|m| m.name().to_owned());
        if op.as_deref() == Some(self.operation)
            && self
                .remaining
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return Err("injected: response lost after the write committed".into());
        }
        Ok(())
    }
}

/// A client whose first `n` responses to `operation` are lost after commit.
pub async fn ddb_losing(
    operation: &'static str,
    n: u32,
) -> (aws_sdk_dynamodb::Client, Arc<AtomicU32>) {
    let lost = Arc::new(AtomicU32::new(0));
    let conf = aws_sdk_dynamodb::config::Builder::from(&sdk_config().await)
        .interceptor(LoseResponses {
            operation,
            remaining: AtomicU32::new(n),
            lost: lost.clone(),
        })
        .build();
    (aws_sdk_dynamodb::Client::from_conf(conf), lost)
}

pub async fn sqs() -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&sdk_config().await)
}

pub async fn queues(sqs: &aws_sdk_sqs::Client, fifo: bool, visibility: u64) -> QueuePair {
    ensure_queue_with_dlq(sqs, &unique("q"), fifo, Duration::from_secs(visibility), 5)
        .await
        .unwrap()
}

/// A queue pair, a dedup table and a ledger table for the `ledger` binary.
pub struct Ledger {
    pub queues: QueuePair,
    pub dedup: String,
    pub ledger: String,
}

impl Ledger {
    pub async fn new(sqs: &aws_sdk_sqs::Client, ddb: &aws_sdk_dynamodb::Client) -> Self {
        Self::with_visibility(sqs, ddb, 30).await
    }

    pub async fn with_visibility(
        sqs: &aws_sdk_sqs::Client,
        ddb: &aws_sdk_dynamodb::Client,
        secs: u64,
    ) -> Self {
        let ledger = unique("ledger");
        sqs_once_cli::setup::ensure_table(ddb, &ledger)
            .await
            .unwrap();
        Self {
            queues: queues(sqs, false, secs).await,
            dedup: dedup_table(ddb).await,
            ledger,
        }
    }

    /// The ledger consumer configured for these resources: the example's
    /// `ledger` binary, or `faulty-ledger` when `extra` sets a fault knob.
    pub fn command(&self, extra: &[(&str, &str)]) -> tokio::process::Command {
        self.command_for(&ledger_binary(extra), extra)
    }

    /// A consumer binary configured for these resources.
    pub fn command_for(&self, bin: &Path, extra: &[(&str, &str)]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(bin);
        c.env("SQS_ONCE_QUEUE_URL", &self.queues.queue_url)
            .env("SQS_ONCE_DLQ_URL", &self.queues.dlq_url)
            .env("SQS_ONCE_TABLE", &self.dedup)
            .env("SQS_ONCE_CONSUMER", "ledger")
            .env("SQS_ONCE_DEDUP_KEY", "json:/id")
            .env("SQS_ONCE_CARRY_SECRET", CARRY_SECRET)
            .env("SQS_ONCE_WAIT", "1s")
            .env("SQS_ONCE_CONCURRENCY", "5")
            .env("LEDGER_TABLE", &self.ledger)
            .env("AWS_ENDPOINT_URL", crate::common::endpoint())
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in extra {
            c.env(k, v);
        }
        c
    }
}

/// Every message in a queue, with its message attributes: received until
/// the queue answers empty (they are left to time out).
pub async fn receive_all(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<aws_sdk_sqs::types::Message> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            break;
        }
        out.extend(got);
    }
    out
}

/// The messages in a queue as (body, `sqs_once_reason`), sorted.
pub async fn bodies_with_reasons(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = receive_all(sqs, url)
        .await
        .iter()
        .map(|m| {
            let reason = m.message_attributes().unwrap()["sqs_once_reason"]
                .string_value()
                .unwrap()
                .to_owned();
            (m.body().unwrap().to_owned(), reason)
        })
        .collect();
    out.sort();
    out
}

/// Runs `k` pollers until the source queue is empty (visible and in flight:
/// retries and in-flight duplicates can be invisible for a backoff, so idleness
/// is not enough), then stops them with SIGTERM; returns their stats lines.
pub async fn run_until_drained(
    l: &Ledger,
    sqs: &aws_sdk_sqs::Client,
    k: usize,
    env: &[(&str, &str)],
) -> Vec<serde_json::Value> {
    run_until_drained_with(l, sqs, k, &ledger_binary(env), env).await
}

/// The example's `ledger` binary, which has no fault knobs, or the test
/// consumers' `faulty-ledger` when `env` sets one (`LEDGER_WORK`,
/// `LEDGER_SLOW_PERCENT`, `LEDGER_PANIC_PERCENT`, `LEDGER_MUTANT`).
pub fn ledger_binary(env: &[(&str, &str)]) -> PathBuf {
    const KNOBS: [&str; 4] = [
        "LEDGER_WORK",
        "LEDGER_SLOW_PERCENT",
        "LEDGER_PANIC_PERCENT",
        "LEDGER_MUTANT",
    ];
    const SETTINGS: [&str; 2] = ["LEDGER_TABLE", "LEDGER_FORWARD_QUEUE_URL"];
    // A knob nobody reads would leave a test without its fault.
    for (k, _) in env {
        assert!(
            !k.starts_with("LEDGER_") || KNOBS.contains(k) || SETTINGS.contains(k),
            "{k} is neither a ledger setting nor a fault knob of faulty-ledger"
        );
    }
    let faulty = env.iter().any(|(k, _)| KNOBS.contains(k));
    binary(if faulty { "faulty-ledger" } else { "ledger" })
}

/// [`run_until_drained`] with another consumer binary. Each poller's stats line
/// comes with its EMF lines under `"emf"`.
pub async fn run_until_drained_with(
    l: &Ledger,
    sqs: &aws_sdk_sqs::Client,
    k: usize,
    bin: &Path,
    env: &[(&str, &str)],
) -> Vec<serde_json::Value> {
    let children: Vec<_> = (0..k)
        .map(|_| l.command_for(bin, env).spawn().unwrap())
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while depth(sqs, &l.queues.queue_url).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue did not drain in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut stats = Vec::new();
    for child in children {
        let pid = child.id().unwrap().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .expect("a poller stops on SIGTERM")
            .unwrap();
        assert!(out.status.success(), "{:?}", out.status);
        let mut line = stats_line(&out.stdout);
        line["emf"] = serde_json::Value::Array(emf_lines(&out.stdout));
        stats.push(line);
    }
    stats
}

/// The poller's stats: the last line of its stdout (EMF metric lines come before).
pub fn stats_line(stdout: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(stdout);
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("{}");
    serde_json::from_str(last).unwrap()
}

/// The EMF lines (objects with `_aws`) in a process's stdout.
pub fn emf_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("_aws").is_some())
        .collect()
}

/// A TCP forwarder to LocalStack that can stop answering: after [`Forwarder::hold`]
/// open connections are cut and new ones are accepted and never answered.
pub struct Forwarder {
    pub url: String,
    hold: Arc<std::sync::atomic::AtomicBool>,
    open: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Forwarder {
    /// Listens on 127.0.0.1:`port` (0: any free port).
    pub async fn start(port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let upstream = endpoint()
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let hold = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>> = Default::default();
        let (h, o) = (hold.clone(), open.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (mut inbound, _) = listener.accept().await.unwrap();
                if h.load(Ordering::SeqCst) {
                    held.push(inbound);
                    continue;
                }
                let upstream = upstream.clone();
                let task = tokio::spawn(async move {
                    let mut outbound = tokio::net::TcpStream::connect(upstream).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                });
                o.lock().unwrap().push(task.abort_handle());
            }
        });
        Self { url, hold, open }
    }

    /// Stops answering.
    pub fn hold(&self) {
        self.hold.store(true, Ordering::SeqCst);
        for t in self.open.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}
