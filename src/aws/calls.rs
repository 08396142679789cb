//! Counting AWS calls by operation, for the cost per message: an SDK
//! interceptor added to the SQS, DynamoDB and S3 (large payloads) clients.
//!
//! ```no_run
//! # async fn f() {
//! let sdk = aws_config::load_from_env().await;
//! let calls = sqs_once::aws::calls::CallCounter::default();
//! let sqs = aws_sdk_sqs::Client::from_conf(calls.sqs_config(&sdk));
//! let ddb = aws_sdk_dynamodb::Client::from_conf(calls.dynamodb_config(&sdk));
//! // ... run ...
//! println!("{:?}", calls.snapshot()); // {"DynamoDB.TransactWriteItems": 300, "SQS.ReceiveMessage": 31, ...}
//! # let _ = (sqs, ddb);
//! # }
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use aws_smithy_runtime_api::box_error::BoxError;
use aws_smithy_runtime_api::client::interceptors::Intercept;
use aws_smithy_runtime_api::client::interceptors::context::BeforeTransmitInterceptorContextRef;
use aws_smithy_runtime_api::client::orchestrator::Metadata;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::config_bag::ConfigBag;

/// Counts every request sent (retries included), keyed `Service.Operation`.
/// Clones share the counts.
#[derive(Debug, Clone, Default)]
pub struct CallCounter {
    counts: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl CallCounter {
    /// The counts so far.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.counts.lock().expect("call counts").clone()
    }

    /// All calls so far.
    pub fn total(&self) -> u64 {
        self.counts.lock().expect("call counts").values().sum()
    }

    /// An SQS client configuration that counts into this counter.
    pub fn sqs_config(&self, sdk: &aws_config::SdkConfig) -> aws_sdk_sqs::Config {
        aws_sdk_sqs::config::Builder::from(sdk)
            .interceptor(self.clone())
            .build()
    }

    /// A DynamoDB client configuration that counts into this counter.
    pub fn dynamodb_config(&self, sdk: &aws_config::SdkConfig) -> aws_sdk_dynamodb::Config {
        aws_sdk_dynamodb::config::Builder::from(sdk)
            .interceptor(self.clone())
            .build()
    }

    /// An S3 client configuration (large payloads) that counts into this
    /// counter.
    #[cfg(feature = "s3-payloads")]
    pub fn s3_config(&self, sdk: &aws_config::SdkConfig) -> aws_sdk_s3::Config {
        aws_sdk_s3::config::Builder::from(sdk)
            .interceptor(self.clone())
            .build()
    }
}

impl Intercept for CallCounter {
    fn name(&self) -> &'static str {
        "CallCounter"
    }

    fn read_before_transmit(
        &self,
        _ctx: &BeforeTransmitInterceptorContextRef<'_>,
        _rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let op = cfg.load::<Metadata>().map_or_else(
            || "unknown".to_owned(),
            |m| format!("{}.{}", m.service(), m.name()),
        );
        *self
            .counts
            .lock()
            .expect("call counts")
            .entry(op)
            .or_default() += 1;
        Ok(())
    }
}
