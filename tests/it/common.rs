//! Clients and unique resources for tests against LocalStack.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_dynamodb::config::interceptors::AfterDeserializationInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::orchestrator::Metadata;

/// The LocalStack endpoint: `AWS_ENDPOINT_URL`, else 127.0.0.1:4566.
pub fn endpoint() -> String {
    std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".to_owned())
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

/// A name no other test (or earlier run against the same LocalStack) uses.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A fresh dedup table (key `pk`, TTL on `expires_at`).
pub async fn dedup_table(client: &aws_sdk_dynamodb::Client) -> String {
    let name = unique("dedup");
    sqs_once::setup::ensure_dedup_table(client, &name)
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
