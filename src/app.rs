//! The front door: [`SqsOnce`] builds what a consumer process needs (the AWS
//! clients with bounded timeouts and call counting, the DynamoDB store, the
//! processor, the large-payload reader), checks the dedup table and the queue
//! at start-up (retrying answers that may pass), and runs a handler as a
//! poller or as the Lambda function. It starts from the binaries' defaults, so
//! a handler embedded in a user's own `main` behaves as it does under the
//! `sqs-once` binaries, which use it too.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::aws::calls::CallCounter;
use crate::aws::dynamodb::TableCheckError;
use crate::protocol::config::{ConfigError, ProcessorConfig};
#[cfg(feature = "s3-payloads")]
use crate::protocol::payloads::{LargePayloads, PayloadLocation};
use crate::protocol::queue::{
    LONGEST_TTL, QueueAttributes, QueueClient, QueueError, TTL_SLACK, retention_window,
    warn_unread_dlq,
};
#[cfg(feature = "lambda")]
use crate::runtime::lambda::{LambdaAdapter, LambdaConfig};
#[cfg(feature = "poller")]
use crate::runtime::poller::{PollerConfig, QueueCheckError, RunStats, check_queue};
use crate::{DynamoStore, Handler, KeySource, Processor};

/// How long one SQS request may take beyond its long-poll wait.
const SQS_SLACK: Duration = Duration::from_secs(10);
/// How long a start-up check is tried again while its failure may pass.
const START_UP_RETRIES_FOR: Duration = Duration::from_secs(60);

/// Why a consumer could not start (or its Lambda runtime stopped).
///
/// Its `Debug` is its message and its sources', so a `main` that returns
/// `Result<(), StartError>` prints what was wrong and how to fix it, not
/// the enum's shape.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A setting is invalid; the error names it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The dedup table cannot serve (missing, wrong key schema, no TTL, ...),
    /// or could not be described.
    #[error(transparent)]
    Table(#[from] TableCheckError),
    /// The source queue could not be read, or its settings cannot work with
    /// the lease and TTL.
    #[cfg(feature = "poller")]
    #[error(transparent)]
    Queue(#[from] QueueCheckError),
    /// The carry secret kept in the dedup table could not be read or made,
    /// and the dedup key comes from message or deduplication ids (a copy
    /// brought back from the DLQ would run again under a new key).
    #[error(transparent)]
    Secret(#[from] crate::aws::dynamodb::SecretError),
    /// The consumer's stamp in the dedup table names a key derivation other
    /// than this build's (every message seen before would run again) or a
    /// record format newer than it reads, or could not be read.
    #[error(transparent)]
    Stamp(#[from] crate::aws::dynamodb::StampError),
    /// [`SqsOnce::ensure_table`] was asked for against an endpoint that is
    /// not this machine's or LocalStack's, without
    /// [`SqsOnce::allow_remote_ensure_table`]. Nothing was created.
    #[error(
        "ensure_table: refusing to create the dedup table {table} at {endpoint}: creating the table from the consumer is for development (LocalStack, a local endpoint); create it with `sqs-once init --table {table}` or your template, or call allow_remote_ensure_table() to create it there"
    )]
    EnsureTableRefused {
        /// The dedup table.
        table: String,
        /// The DynamoDB endpoint (AWS's own when none is configured).
        endpoint: String,
    },
    /// [`SqsOnce::ensure_table`] could not create or check the dedup table.
    #[error("ensure_table: {0}")]
    EnsureTable(#[from] crate::aws::setup::SetupError),
    /// The Lambda runtime failed.
    #[cfg(feature = "lambda")]
    #[error("Lambda runtime failed: {0}")]
    Lambda(lambda_runtime::Error),
    /// The runtime asked for is not compiled in (its feature is off).
    #[error("the {0} runtime is not compiled in: turn on the `{0}` feature of sqs-once")]
    NotCompiledIn(&'static str),
    /// The process was started with `--health` (a container's health
    /// check) and the poller beside it is not alive, or no port is known
    /// to ask it on.
    #[error("unhealthy: {0}")]
    Unhealthy(String),
}

impl std::fmt::Debug for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")?;
        let mut source = std::error::Error::source(self);
        while let Some(e) = source {
            // `#[error(transparent)]` variants show their source already.
            if e.to_string() != self.to_string() {
                write!(f, ": {e}")?;
            }
            source = e.source();
        }
        Ok(())
    }
}

impl From<crate::protocol::key::KeySourceParseError> for StartError {
    fn from(e: crate::protocol::key::KeySourceParseError) -> Self {
        Self::Config(ConfigError {
            setting: "SQS_ONCE_DEDUP_KEY",
            problem: e.to_string(),
        })
    }
}

impl StartError {
    /// Whether trying again later may succeed (no answer, throttling, a 5xx);
    /// a refusal or a misconfiguration will not pass by itself.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Table(e) => e.is_transient(),
            Self::Secret(e) => e.is_transient(),
            Self::Stamp(e) => e.is_transient(),
            #[cfg(feature = "poller")]
            Self::Queue(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// What a poller run did, when it stopped.
#[cfg(feature = "poller")]
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct PollerReport {
    /// Messages received, completed, retried, parked, ...
    pub stats: RunStats,
    /// AWS calls made, by `Service.Operation` (`DynamoDB.UpdateItem`).
    pub calls: std::collections::BTreeMap<String, u64>,
}

/// Builds and runs an sqs-once consumer.
///
/// ```no_run
/// use sqs_once::{Context, HandlerResult, KeySource, Message, SqsOnce, handler_fn};
///
/// #[tokio::main]
/// async fn main() -> Result<(), sqs_once::StartError> {
///     let handler = handler_fn(|message: Message, _ctx: Context| async move {
///         println!("{}", message.body());
///         HandlerResult::Ok(None)
///     });
///     SqsOnce::builder("dedup-table", "orders")
///         .key("json:/order_id".parse::<KeySource>()?)
///         .queue_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
///         .run(handler) // Lambda under the Lambda runtime, else a poller until SIGTERM
///         .await
/// }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct SqsOnce {
    table: String,
    queue_url: Option<String>,
    dlq_url: Option<String>,
    concurrency: Option<usize>,
    processor: ProcessorConfig,
    #[cfg(feature = "poller")]
    poller: PollerConfig,
    #[cfg(feature = "lambda")]
    lambda: LambdaConfig,
    dynamodb_timeout: Duration,
    #[cfg(feature = "s3-payloads")]
    large_payloads: Option<LargePayloadOptions>,
    #[cfg(feature = "s3-payloads")]
    bucket_owner: BucketOwner,
    sdk: Option<aws_config::SdkConfig>,
    shutdown: Option<CancellationToken>,
    default_logging: bool,
    ensure_table: bool,
    ensure_table_remote: bool,
    /// Where the poller answers health checks (`SQS_ONCE_HEALTH_PORT` when
    /// not set here), and how old its last receive may be.
    #[cfg(feature = "poller")]
    health_port: Option<u16>,
    #[cfg(feature = "poller")]
    health_max_age: Option<Duration>,
}

/// Large payloads through S3 (the SQS Extended Client's pointers).
#[cfg(feature = "s3-payloads")]
#[derive(Debug, Clone)]
struct LargePayloadOptions {
    delete: bool,
    max_bytes: usize,
    /// Where pointers may point: `None` until set (a start-up error), then
    /// `Some(None)` for any bucket or `Some(Some(places))`.
    places: Option<Option<Vec<PayloadLocation>>>,
    /// Where outgoing bodies too large for SQS are stored.
    outgoing: Option<PayloadLocation>,
    /// Whether incoming pointers are read ([`SqsOnce::large_payloads`]).
    read: bool,
    /// The payload budget set ([`SqsOnce::payload_budget_bytes`]); `None`:
    /// fitted to the process's memory.
    budget: Option<usize>,
}

/// The account the front door's S3 calls expect to own a payload's bucket
/// (`ExpectedBucketOwner`).
#[cfg(feature = "s3-payloads")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum BucketOwner {
    /// Not set: none checked, with a warning at start-up.
    #[default]
    Unset,
    /// The source queue's account, read from its URL (none, with a
    /// warning, when the front door does not know the queue).
    QueueAccount,
    /// This account.
    Account(String),
    /// None checked, on purpose.
    Any,
}

#[cfg(feature = "s3-payloads")]
impl BucketOwner {
    /// `QueueAccount` made the account of `queue_url` (none checked, with a
    /// warning, when the URL is not known); the others as they are.
    fn for_queue(self, queue_url: Option<&str>) -> Self {
        if self != Self::QueueAccount {
            return self;
        }
        match queue_url.and_then(account_of_queue_url) {
            Some(account) => Self::Account(account.to_owned()),
            None => {
                tracing::warn!(
                    "SQS_ONCE_PAYLOAD_BUCKET_OWNER=queue: the source queue's URL is not known, so S3 calls check no bucket owner"
                );
                Self::Any
            }
        }
    }
}

/// Behind an envelope SQS's `SenderId` is the delivering service, the same
/// for every publisher: a sender-scoped key separates none of them.
fn warn_of_a_scope_behind_an_envelope(config: &ProcessorConfig) {
    if config.key_source.uses_sender()
        && config.envelope != crate::protocol::message::Envelope::None
    {
        tracing::warn!(
            envelope = %config.envelope,
            "the key is scoped to the sender, but behind an envelope SQS's sender is the service that delivered it, the same for every publisher: the scope separates none of them"
        );
    }
}

#[cfg(feature = "s3-payloads")]
impl Default for LargePayloadOptions {
    fn default() -> Self {
        Self {
            delete: false,
            max_bytes: crate::protocol::payloads::DEFAULT_MAX_PAYLOAD_BYTES,
            places: None,
            outgoing: None,
            read: false,
            budget: None,
        }
    }
}

impl SqsOnce {
    /// A consumer named `consumer` (the namespace of its dedup records) with
    /// its records in the DynamoDB table `table`, with the binaries' defaults:
    /// dedup key `message-id` (set a business key with [`key`](Self::key)),
    /// lease 60 s, heartbeat 20 s, TTL fitted to the queue's retention plus
    /// its DLQ's plus a day, concurrency 10, prefetch 10,
    /// EMF metrics every 60 s (after every invocation in Lambda), retention
    /// checked against the TTL, DynamoDB requests abandoned after 5 s.
    pub fn builder(table: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            table: table.into(),
            queue_url: None,
            dlq_url: None,
            concurrency: None,
            processor: ProcessorConfig::new(consumer),
            #[cfg(feature = "poller")]
            poller: PollerConfig {
                metrics_interval: Some(Duration::from_secs(60)),
                ..PollerConfig::new("")
            },
            #[cfg(feature = "lambda")]
            lambda: LambdaConfig {
                emf: true,
                check_retention: true,
                ..LambdaConfig::default()
            },
            dynamodb_timeout: Duration::from_secs(5),
            #[cfg(feature = "s3-payloads")]
            large_payloads: None,
            #[cfg(feature = "s3-payloads")]
            bucket_owner: BucketOwner::Unset,
            sdk: None,
            shutdown: None,
            default_logging: true,
            ensure_table: false,
            ensure_table_remote: false,
            #[cfg(feature = "poller")]
            health_port: None,
            #[cfg(feature = "poller")]
            health_max_age: None,
        }
    }

    /// Where the dedup key comes from (a business id: see [`KeySource`]).
    pub fn key(mut self, key: KeySource) -> Self {
        self.processor.key_source = key;
        self
    }

    /// What wraps the payload in each body (SNS, EventBridge, S3 event
    /// notifications): opened before the key is read and the handler runs
    /// (see [`crate::envelope`]).
    pub fn envelope(mut self, envelope: crate::Envelope) -> Self {
        self.processor.envelope = envelope;
        self
    }

    /// JSON pointers to the parts of the payload whose hash tells "same
    /// key, different payload" (see [`ProcessorConfig::payload_pointers`]).
    pub fn payload_pointers<P: Into<String>>(
        mut self,
        pointers: impl IntoIterator<Item = P>,
    ) -> Self {
        self.processor.payload_pointers = pointers.into_iter().map(Into::into).collect();
        self
    }

    /// The source queue (required for the poller; in Lambda it is looked up
    /// from each record's queue ARN unless given).
    pub fn queue_url(mut self, url: impl Into<String>) -> Self {
        self.queue_url = Some(url.into());
        self
    }

    /// Where permanent failures are parked, with their reason. Without one, a
    /// permanent failure comes back until the queue's redrive policy moves it.
    pub fn dlq_url(mut self, url: impl Into<String>) -> Self {
        self.dlq_url = Some(url.into());
        self
    }

    /// Handlers running at once at most (in Lambda: records, or FIFO groups;
    /// default 10).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }

    /// The claim's lease and the heartbeat that extends it (and the message's
    /// visibility) while a handler runs.
    pub fn lease(mut self, lease: Duration, heartbeat: Duration) -> Self {
        self.processor.lease = lease;
        self.processor.heartbeat = heartbeat;
        self
    }

    /// The secret that seals the dedup key a parked copy carries, and
    /// verifies a carried one (`SQS_ONCE_CARRY_SECRET` for the binaries).
    /// Without it the consumer uses the secret kept in the dedup table
    /// (item `sqs-once:carry-secret`), made by the first consumer to start:
    /// `sqs-once redrive --table` reads the same one. Only when neither can
    /// be had (a warning at start-up says so) is a copy brought back from
    /// the DLQ under `message-id`/`dedup-id` keys processed under a new key.
    pub fn carry_secret(mut self, secret: crate::protocol::key::CarrySecret) -> Self {
        self.processor.carry_secret = Some(secret);
        self
    }

    /// Key records by a SHA-256 of each dedup key and show only that in logs
    /// and spans (`SQS_ONCE_HASH_KEYS`); see [`ProcessorConfig::hash_keys`].
    /// Changing it changes every record's key: drain the queue first.
    pub fn hash_keys(mut self, on: bool) -> Self {
        self.processor.hash_keys = on;
        self
    }

    /// Keep handler error text out of records, DLQ reasons, logs and span
    /// status (`SQS_ONCE_REDACT_REASONS`); see [`ProcessorConfig::redact_reasons`].
    pub fn redact_reasons(mut self, on: bool) -> Self {
        self.processor.redact_reasons = on;
        self
    }

    /// Let a producer's sampled flag decide whether a message's span is
    /// sampled (`SQS_ONCE_TRUST_PRODUCER_SAMPLING`); see
    /// [`ProcessorConfig::trust_producer_sampling`].
    pub fn trust_producer_sampling(mut self, on: bool) -> Self {
        self.processor.trust_producer_sampling = on;
        self
    }

    /// How long records are kept (must exceed the queue's retention plus
    /// its DLQ's; checked at start-up, with a warning). Unset, the TTL is
    /// fitted at start-up to the queue's retention plus its DLQ's plus a day
    /// (43 days when they cannot be read: see [`ProcessorConfig::fit_ttl`]).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.processor.ttl = ttl;
        self.processor.fit_ttl = false;
        self
    }

    /// How long one DynamoDB request may take before it is abandoned and sent
    /// again (with the same token, so an abandoned write that committed is found).
    pub fn dynamodb_timeout(mut self, timeout: Duration) -> Self {
        self.dynamodb_timeout = timeout;
        self
    }

    /// Read large payloads from S3 (feature `s3-payloads`): bodies that are
    /// an SQS Extended Client pointer, at most `max_bytes` each; with
    /// `delete`, an object is deleted after its message is. Name the buckets
    /// pointers may point into with [`payload_buckets`](Self::payload_buckets)
    /// (start-up fails without them).
    #[cfg(feature = "s3-payloads")]
    pub fn large_payloads(mut self, delete: bool, max_bytes: usize) -> Self {
        let options = self.large_payloads.get_or_insert_default();
        options.delete = delete;
        options.max_bytes = max_bytes;
        options.read = true;
        self
    }

    /// The most large payload bytes held at once, across every message in
    /// flight (`SQS_ONCE_PAYLOAD_BUDGET_BYTES`; `0`: no budget). Unset: a
    /// third of the memory the process may use (the Lambda function's memory size,
    /// else the container's cgroup limit, else the host's memory). A
    /// payload waits for room before it is read; one that could never fit
    /// is parked.
    #[cfg(feature = "s3-payloads")]
    pub fn payload_budget_bytes(mut self, bytes: usize) -> Self {
        self.large_payloads.get_or_insert_default().budget = Some(bytes);
        self
    }

    /// Send outgoing messages ([`Context::send`](crate::Context::send)) whose
    /// body is too large for SQS through S3, as the SQS Extended Client
    /// does (feature `s3-payloads`, `SQS_ONCE_OUTBOX_PAYLOAD_BUCKET`): the
    /// body is stored as a new object under `location` before the effect
    /// commits, and a pointer to it is recorded and sent. Without it such a
    /// message fails its incoming message permanently. Incoming pointers are
    /// read only with [`large_payloads`](Self::large_payloads) and its
    /// buckets.
    #[cfg(feature = "s3-payloads")]
    pub fn send_large_through(mut self, location: PayloadLocation) -> Self {
        self.large_payloads.get_or_insert_default().outgoing = Some(location);
        self
    }

    /// The only buckets (and key prefixes) large payload pointers may name;
    /// any other pointer is parked without calling S3
    /// (`SQS_ONCE_LARGE_PAYLOAD_BUCKETS`).
    #[cfg(feature = "s3-payloads")]
    pub fn payload_buckets(mut self, places: Vec<PayloadLocation>) -> Self {
        self.payload_places(Some(places));
        self
    }

    /// Let large payload pointers name any object this role can read (and,
    /// with deletion on, delete): unsafe where producers are not trusted.
    #[cfg(feature = "s3-payloads")]
    pub fn any_payload_bucket(mut self) -> Self {
        self.payload_places(None);
        self
    }

    /// The AWS account (12 digits) that must own every bucket a payload is
    /// read from, stored in or deleted from (S3's `ExpectedBucketOwner`;
    /// `SQS_ONCE_PAYLOAD_BUCKET_OWNER`): a bucket deleted and made again
    /// under the same name by another account is refused (403) rather than
    /// its payload taken from, or written to, a stranger's bucket; the
    /// message is retried and, its receives spent, reaches the DLQ unrun.
    /// Unset, no owner is checked (a warning says so at start-up): payload
    /// buckets are often a producer's, in another account.
    #[cfg(feature = "s3-payloads")]
    pub fn payload_bucket_owner(mut self, account: impl Into<String>) -> Self {
        self.bucket_owner = BucketOwner::Account(account.into());
        self
    }

    /// The source queue's account (from its URL) must own every payload
    /// bucket (`SQS_ONCE_PAYLOAD_BUCKET_OWNER=queue`; see
    /// [`payload_bucket_owner`](Self::payload_bucket_owner)).
    #[cfg(feature = "s3-payloads")]
    pub fn payload_buckets_owned_by_the_queues_account(mut self) -> Self {
        self.bucket_owner = BucketOwner::QueueAccount;
        self
    }

    /// Check no bucket owner on S3 calls (`SQS_ONCE_PAYLOAD_BUCKET_OWNER=any`),
    /// without the start-up warning.
    #[cfg(feature = "s3-payloads")]
    pub fn any_payload_bucket_owner(mut self) -> Self {
        self.bucket_owner = BucketOwner::Any;
        self
    }

    #[cfg(feature = "s3-payloads")]
    fn payload_places(&mut self, places: Option<Vec<PayloadLocation>>) {
        self.large_payloads.get_or_insert_default().places = Some(places);
    }

    /// Whether the consumer logs to stderr when the process has installed no
    /// `tracing` subscriber of its own (on by default, feature `logging`):
    /// text at a terminal, JSON in Lambda, filtered by `RUST_LOG` (default
    /// `info`). Off: nothing is logged unless the process installs one.
    pub fn default_logging(mut self, on: bool) -> Self {
        self.default_logging = on;
        self
    }

    /// Creates the dedup table at start-up when it is missing, for
    /// development: the same table `sqs-once init` makes (one string
    /// partition key `pk`, on-demand billing, TTL on `expires_at`), waiting
    /// until it is active. An existing table is only checked (one with other
    /// keys is an error and nothing is written to it); TTL off on an existing
    /// table is turned on.
    ///
    /// Refused ([`StartError::EnsureTableRefused`], before any call) unless
    /// the DynamoDB endpoint is this machine's or LocalStack's (a loopback
    /// address, `localhost`, `localstack`, `localhost.localstack.cloud`: the
    /// rule `sqs-once demo` follows), read from `AWS_ENDPOINT_URL_DYNAMODB`,
    /// else the SDK configuration's endpoint URL (`AWS_ENDPOINT_URL`); with
    /// none, the endpoint is AWS's own and the call is refused. In production
    /// the table belongs to your template (or `sqs-once init`), where its
    /// billing, backups and alarms are chosen;
    /// [`allow_remote_ensure_table`](Self::allow_remote_ensure_table) lets
    /// this call create it anywhere. Creating needs `dynamodb:CreateTable`,
    /// `DescribeTable`, `DescribeTimeToLive` and `UpdateTimeToLive`; the
    /// policies in `docs/iam/` grant no `CreateTable` or `UpdateTimeToLive`.
    ///
    /// ```no_run
    /// # async fn f(handler: impl sqs_once::Handler) -> Result<(), sqs_once::StartError> {
    /// // AWS_ENDPOINT_URL=http://localhost:4566 (LocalStack)
    /// sqs_once::SqsOnce::builder("dedup-dev", "orders")
    ///     .queue_url("http://localhost:4566/000000000000/orders")
    ///     .ensure_table()
    ///     .run(handler)
    ///     .await
    /// # }
    /// ```
    pub fn ensure_table(mut self) -> Self {
        self.ensure_table = true;
        self
    }

    /// Lets [`ensure_table`](Self::ensure_table) create the dedup table at an
    /// endpoint that is not local (AWS's own included). Without
    /// `ensure_table` it does nothing.
    pub fn allow_remote_ensure_table(mut self) -> Self {
        self.ensure_table_remote = true;
        self
    }

    /// The AWS configuration to use instead of loading it from the environment.
    pub fn sdk_config(mut self, sdk: aws_config::SdkConfig) -> Self {
        self.sdk = Some(sdk);
        self
    }

    /// Stop the poller when `token` is cancelled, instead of on SIGTERM/SIGINT.
    pub fn shutdown_on(mut self, token: CancellationToken) -> Self {
        self.shutdown = Some(token);
        self
    }

    /// Any other processor setting.
    pub fn processor_config(mut self, f: impl FnOnce(&mut ProcessorConfig)) -> Self {
        let ttl = self.processor.ttl;
        f(&mut self.processor);
        // A TTL set here is a TTL set: it is not fitted over.
        if self.processor.ttl != ttl {
            self.processor.fit_ttl = false;
        }
        self
    }

    /// Any other poller setting (feature `poller`) (the queue URL set here wins over
    /// [`queue_url`](Self::queue_url) for the poller).
    #[cfg(feature = "poller")]
    pub fn poller_config(mut self, f: impl FnOnce(&mut PollerConfig)) -> Self {
        f(&mut self.poller);
        self
    }

    /// Any other Lambda setting (feature `lambda`).
    #[cfg(feature = "lambda")]
    pub fn lambda_config(mut self, f: impl FnOnce(&mut LambdaConfig)) -> Self {
        f(&mut self.lambda);
        self
    }

    /// The poller answers a container's health check on `127.0.0.1:port`
    /// (default: `SQS_ONCE_HEALTH_PORT`, else none), with how long ago its
    /// receive loop last turned; the same binary started with `--health`
    /// asks it (see [`run`](Self::run)).
    #[cfg(feature = "poller")]
    pub fn health_port(mut self, port: u16) -> Self {
        self.health_port = Some(port);
        self
    }

    /// The oldest last turn of the receive loop `--health` accepts (default:
    /// `SQS_ONCE_HEALTH_MAX_AGE`, else 60 s).
    #[cfg(feature = "poller")]
    pub fn health_max_age(mut self, age: Duration) -> Self {
        self.health_max_age = Some(age);
        self
    }

    /// The health check's port: set here, else `SQS_ONCE_HEALTH_PORT`.
    #[cfg(feature = "poller")]
    fn health_port_or_env(&self) -> Result<Option<u16>, StartError> {
        if self.health_port.is_some() {
            return Ok(self.health_port);
        }
        Ok(crate::protocol::config::health_port_from(&|n| {
            std::env::var(n).ok()
        })?)
    }

    /// Answers `--health`: `Ok` (printed) when the poller on the health
    /// port turned its receive loop recently enough, else
    /// [`StartError::Unhealthy`] (a `main` returning it exits 1).
    #[cfg(feature = "poller")]
    pub async fn check_health(&self) -> Result<(), StartError> {
        let Some(port) = self.health_port_or_env()? else {
            return Err(StartError::Unhealthy(
                "--health needs the port the poller answers on (SQS_ONCE_HEALTH_PORT, or health_port)".into(),
            ));
        };
        let max_age = match self.health_max_age {
            Some(age) => age,
            None => crate::protocol::config::health_max_age_from(&|n| std::env::var(n).ok())?,
        };
        let age = tokio::task::spawn_blocking(move || crate::runtime::health::ask(port, max_age))
            .await
            .map_err(|e| StartError::Unhealthy(e.to_string()))?
            .map_err(StartError::Unhealthy)?;
        println!("healthy: the receive loop last turned {age:?} ago");
        Ok(())
    }

    /// Runs `handler` in the runtime the environment asks for: the Lambda
    /// function when `AWS_LAMBDA_RUNTIME_API` is set, else the poller (until
    /// SIGTERM/SIGINT or the [`shutdown_on`](Self::shutdown_on) token).
    /// A runtime whose feature is off is a [`StartError::NotCompiledIn`].
    /// A process whose first argument is `--health` (the ECS template's
    /// container health check) runs nothing: it asks the poller beside it
    /// ([`check_health`](Self::check_health)).
    pub async fn run<H: Handler>(self, handler: H) -> Result<(), StartError> {
        #[cfg(feature = "poller")]
        if std::env::args_os().nth(1).is_some_and(|a| a == "--health") {
            return self.check_health().await;
        }
        if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
            #[cfg(feature = "lambda")]
            return self.run_lambda(handler).await;
            #[cfg(not(feature = "lambda"))]
            return Err(StartError::NotCompiledIn("lambda"));
        }
        #[cfg(feature = "poller")]
        return self.run_poller(handler).await.map(|_| ());
        #[cfg(not(feature = "poller"))]
        return Err(StartError::NotCompiledIn("poller"));
    }

    /// Checks the table, then serves Lambda invocations until the environment ends.
    #[cfg(feature = "lambda")]
    pub async fn run_lambda<H: Handler>(self, handler: H) -> Result<(), StartError> {
        let adapter = self.lambda_adapter(handler).await?;
        crate::runtime::lambda::run(adapter)
            .await
            .map_err(StartError::Lambda)
    }

    /// Checks the table and builds the Lambda adapter, for a process that
    /// drives `lambda_runtime` itself (see [`crate::runtime::lambda::run`]).
    #[cfg(feature = "lambda")]
    pub async fn lambda_adapter<H: Handler>(
        self,
        handler: H,
    ) -> Result<LambdaAdapter<DynamoStore, H, aws_sdk_sqs::Client>, StartError> {
        self.log_by_default();
        let mut lambda = self.lambda.clone();
        if lambda.queue_url.is_none() {
            lambda.queue_url.clone_from(&self.queue_url);
        }
        if lambda.dlq_url.is_none() {
            lambda.dlq_url.clone_from(&self.dlq_url);
        }
        lambda.concurrency = self.concurrency.unwrap_or(lambda.concurrency);
        let fit_to = lambda.queue_url.clone();
        let parking = lambda.dlq_url.clone();
        let prepared = self
            .prepare(handler, lambda.concurrency, SQS_SLACK, fit_to, parking)
            .await?;
        Ok(LambdaAdapter::new(prepared.sqs, prepared.processor, lambda))
    }

    /// Checks the table and the queue, then polls until shutdown (or, with
    /// `exit_when_idle`, until idle), draining what is in flight.
    #[cfg(feature = "poller")]
    pub async fn run_poller<H: Handler>(mut self, handler: H) -> Result<PollerReport, StartError> {
        self.log_by_default();
        let shutdown = self.shutdown.take().unwrap_or_else(shutdown_on_signals);
        let mut poller = self.poller.clone();
        // Answered from the start, so a check during the start-up checks
        // says "not receiving yet" rather than nothing; closed when this
        // returns.
        let _serving = match self.health_port_or_env()? {
            Some(port) => {
                let liveness = poller
                    .liveness
                    .get_or_insert_with(crate::runtime::poller::Liveness::new)
                    .clone();
                let serving = crate::runtime::health::serve(port, liveness)
                    .await
                    .map_err(|e| {
                        StartError::from(ConfigError {
                            setting: "SQS_ONCE_HEALTH_PORT",
                            problem: format!("cannot listen on 127.0.0.1:{port}: {e}"),
                        })
                    })?;
                tracing::info!(port, "answering health checks on 127.0.0.1");
                Some(serving)
            }
            None => None,
        };
        if poller.queue_url.is_empty() {
            poller.queue_url = self.queue_url.clone().unwrap_or_default();
        }
        if poller.dlq_url.is_none() {
            poller.dlq_url.clone_from(&self.dlq_url);
        }
        poller.concurrency = self.concurrency.unwrap_or(poller.concurrency);
        if poller.queue_url.is_empty() {
            return Err(ConfigError {
                setting: "SQS_ONCE_QUEUE_URL",
                problem: "the poller needs the source queue's URL".into(),
            }
            .into());
        }
        let heartbeat = self.processor.heartbeat;
        let start = async {
            let prepared = self
                .prepare(
                    handler,
                    poller.concurrency,
                    poller.wait_time + SQS_SLACK,
                    Some(poller.queue_url.clone()),
                    poller.dlq_url.clone(),
                )
                .await?;
            let ttl = prepared.processor.config().ttl;
            let attributes = retry_transient(|| async {
                check_queue(&prepared.sqs, &poller.queue_url, heartbeat, ttl)
                    .await
                    .map_err(StartError::from)
            })
            .await?;
            Ok::<_, StartError>((prepared, attributes.max_receive_count))
        };
        // A signal during the start-up checks stops the process cleanly too.
        let (prepared, max_receive_count) = tokio::select! {
            r = start => r?,
            () = shutdown.cancelled() => {
                tracing::info!("stopped during start-up");
                return Ok(PollerReport::default());
            }
        };
        if poller.max_receive_count.is_none() {
            poller.max_receive_count = max_receive_count;
        }
        tracing::info!(queue = %poller.queue_url, concurrency = poller.concurrency, "polling");
        let stats =
            crate::runtime::poller::run(prepared.sqs, prepared.processor, poller, shutdown).await;
        tracing::info!(?stats, "stopped");
        Ok(PollerReport {
            stats,
            calls: prepared.calls.snapshot(),
        })
    }

    /// Installs the default logging unless turned off or the process has a
    /// subscriber of its own.
    fn log_by_default(&self) {
        #[cfg(feature = "logging")]
        if self.default_logging && !tracing::dispatcher::has_been_set() {
            install_default_logging();
        }
    }

    /// Loads the SDK configuration, builds the clients, checks the dedup
    /// table and builds the processor for a runtime running `concurrency`
    /// handlers at once. `sqs_timeout` bounds one SQS request. The records'
    /// TTL is fitted to the retention of `fit_to` (the source queue, when
    /// known) and its DLQ (its redrive policy's, else `parking_dlq`) unless
    /// one was set.
    async fn prepare<H: Handler>(
        mut self,
        handler: H,
        concurrency: usize,
        sqs_timeout: Duration,
        fit_to: Option<String>,
        parking_dlq: Option<String>,
    ) -> Result<Prepared<H>, StartError> {
        self.processor.validate()?;
        warn_of_a_scope_behind_an_envelope(&self.processor);
        if concurrency == 0 {
            return Err(ConfigError {
                setting: "SQS_ONCE_CONCURRENCY",
                problem: "must be at least 1".into(),
            }
            .into());
        }
        let sdk = match self.sdk {
            Some(sdk) => sdk,
            None => aws_config::load_from_env().await,
        };
        let calls = CallCounter::default();
        let attempt_timeout = crate::aws::attempt_timeouts;
        let ddb = aws_sdk_dynamodb::Client::from_conf(
            calls
                .dynamodb_config(&sdk)
                .to_builder()
                .timeout_config(attempt_timeout(self.dynamodb_timeout))
                .build(),
        );
        let sqs = aws_sdk_sqs::Client::from_conf(
            calls
                .sqs_config(&sdk)
                .to_builder()
                .timeout_config(attempt_timeout(sqs_timeout))
                .build(),
        );
        if self.ensure_table {
            let endpoint = dynamodb_endpoint(&sdk);
            ensure_dedup_table(&ddb, &self.table, endpoint, self.ensure_table_remote).await?;
        }
        fit_to_queue(
            &mut self.processor,
            &sqs,
            fit_to.as_deref(),
            parking_dlq.as_deref(),
        )
        .await;
        let store = DynamoStore::new(ddb, self.table);
        check_table_and_secret(&store, &mut self.processor).await?;
        #[cfg_attr(not(feature = "s3-payloads"), allow(unused_mut))]
        let mut processor = Processor::new(store, handler, self.processor)?;
        #[cfg(feature = "s3-payloads")]
        if let Some(options) = self.large_payloads {
            let owner = self.bucket_owner.for_queue(fit_to.as_deref());
            processor = processor.with_large_payloads(options.reader(&sdk, &calls, owner)?);
        }
        Ok(Prepared {
            sqs,
            processor,
            calls,
        })
    }
}

#[cfg(feature = "s3-payloads")]
impl LargePayloadOptions {
    /// The large-payload reader these options describe, its S3 client
    /// counting into `calls`.
    fn reader(
        self,
        sdk: &aws_config::SdkConfig,
        calls: &CallCounter,
        owner: BucketOwner,
    ) -> Result<LargePayloads, StartError> {
        // Sending only: no incoming pointer is read.
        let read = self.read || self.places.is_some() || self.outgoing.is_none();
        let places = self.places.or_else(|| (!read).then(|| Some(Vec::new())));
        let Some(places) = places else {
            return Err(ConfigError {
                setting: "SQS_ONCE_LARGE_PAYLOAD_BUCKETS",
                problem: "large payloads need the buckets pointers may name (`payload_buckets`, or `any_payload_bucket`: unsafe)".into(),
            }
            .into());
        };
        let s3 = aws_sdk_s3::Client::from_conf(
            calls
                .s3_config(sdk)
                .to_builder()
                .timeout_config(crate::aws::attempt_timeouts(Duration::from_secs(30)))
                .build(),
        );
        let s3 = match owner {
            BucketOwner::Account(account)
                if account.len() != 12 || !account.bytes().all(|b| b.is_ascii_digit()) =>
            {
                // A typo would refuse every S3 call, and send every large
                // message to the DLQ unrun.
                return Err(ConfigError {
                    setting: "SQS_ONCE_PAYLOAD_BUCKET_OWNER",
                    problem: format!("`{account}` is not a 12-digit AWS account id"),
                }
                .into());
            }
            BucketOwner::Account(account) => {
                tracing::info!(%account, "S3 calls expect the payload buckets' owner");
                crate::aws::s3::S3Payloads::new(s3).expecting_owner(account)
            }
            BucketOwner::Unset => {
                tracing::warn!(
                    "S3 calls check no payload bucket's owner: set SQS_ONCE_PAYLOAD_BUCKET_OWNER (an account id, `queue` for the source queue's, or `any`) so a bucket name taken over by another account is refused"
                );
                crate::aws::s3::S3Payloads::new(s3)
            }
            BucketOwner::QueueAccount | BucketOwner::Any => crate::aws::s3::S3Payloads::new(s3),
        };
        let mut payloads = LargePayloads::new(s3)
            .deleting(self.delete)
            .max_bytes(self.max_bytes)
            .reading(read);
        if let Some(outgoing) = self.outgoing {
            tracing::info!(bucket = %outgoing.bucket, prefix = %outgoing.prefix, "outgoing bodies too large for SQS go through S3");
            payloads = payloads.sending_large_to(outgoing);
        }
        match places {
            Some(places) => payloads = payloads.only_from(places),
            None => tracing::warn!(
                "SQS_ONCE_LARGE_PAYLOAD_BUCKETS=*: a pointer may name any object this role can read (or delete)"
            ),
        }
        tracing::info!(read, delete = self.delete, "large payloads through S3: on");
        if read {
            let fitted = crate::protocol::payloads::fit_budget(
                self.budget,
                &crate::protocol::payloads::MemoryLimits::of_this_process(),
            );
            match fitted.bytes {
                Some(bytes) => {
                    let budget = crate::protocol::payloads::PayloadBudget::new(bytes);
                    tracing::info!(
                        budget_bytes = budget.bytes(),
                        max_payload_bytes = self.max_bytes,
                        from = %fitted.from,
                        "payload budget: at most this many large payload bytes held at once"
                    );
                    payloads = payloads.within(std::sync::Arc::new(budget));
                }
                None => tracing::warn!(
                    from = %fitted.from,
                    "payload budget: none; up to concurrency x SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES of payloads may be held at once"
                ),
            }
        }
        Ok(payloads)
    }
}

/// The account (12 digits) in an SQS queue URL's path: the part before the
/// queue's name (`https://sqs.REGION.amazonaws.com/ACCOUNT/NAME`;
/// LocalStack's `/ACCOUNT/NAME` and `/queue/REGION/ACCOUNT/NAME` alike).
#[cfg(feature = "s3-payloads")]
fn account_of_queue_url(url: &str) -> Option<&str> {
    let path = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (_host, path) = path.split_once('/')?;
    let (rest, name) = path.rsplit_once('/')?;
    let account = rest.rsplit('/').next()?;
    (!name.is_empty() && account.len() == 12 && account.bytes().all(|b| b.is_ascii_digit()))
        .then_some(account)
}

/// [`SqsOnce::ensure_table`]'s work: `sqs-once init`'s dedup table, made if
/// missing (TTL turned on if off); an existing table with other keys, or
/// with TTL on another attribute, is an error. Refused before any call when
/// `endpoint` is not local, unless `remote` allows it.
async fn ensure_dedup_table(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    endpoint: Option<String>,
    remote: bool,
) -> Result<(), StartError> {
    use crate::aws::setup::{Change, SetupError, init_dedup_table, is_local_endpoint};
    if !remote && !is_local_endpoint(endpoint.as_deref()) {
        return Err(StartError::EnsureTableRefused {
            table: table.to_owned(),
            endpoint: endpoint.unwrap_or_else(|| "AWS's own endpoint".into()),
        });
    }
    let outcome = init_dedup_table(ddb, table, &[Change::EnableTtl]).await?;
    if !outcome.differences.is_empty() {
        return Err(SetupError::Differences(outcome.differences).into());
    }
    if outcome.created.is_empty() {
        tracing::info!(table, "ensure_table: the dedup table exists");
    } else {
        tracing::info!(
            table,
            "ensure_table: created the dedup table (TTL on expires_at)"
        );
    }
    for change in &outcome.changed {
        tracing::info!(table, "ensure_table: {change}");
    }
    Ok(())
}

/// The DynamoDB endpoint the clients built from `sdk` use: the service's own
/// (`AWS_ENDPOINT_URL_DYNAMODB`) unless configured endpoints are ignored,
/// else the configuration's; `None` for AWS's own.
fn dynamodb_endpoint(sdk: &aws_config::SdkConfig) -> Option<String> {
    let ignored = std::env::var("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
        .is_ok_and(|v| v.eq_ignore_ascii_case("true"));
    let service = std::env::var("AWS_ENDPOINT_URL_DYNAMODB")
        .ok()
        .filter(|v| !v.is_empty() && !ignored);
    service.or_else(|| sdk.endpoint_url().map(str::to_owned))
}

/// Reads the source queue `fit_to` once: fits the records' TTL to it and
/// its DLQs unless one was set, and warns about settings that defeat the
/// dedup key.
async fn fit_to_queue(
    config: &mut ProcessorConfig,
    sqs: &aws_sdk_sqs::Client,
    fit_to: Option<&str>,
    parking_dlq: Option<&str>,
) {
    let source = match fit_to.filter(|u| !u.is_empty()) {
        Some(url) => Some((url, QueueClient::attributes(sqs, url).await)),
        None => None,
    };
    if config.fit_ttl {
        config.ttl = fitted_ttl(sqs, source.as_ref(), parking_dlq).await;
    }
    if let Some((url, Ok(attributes))) = &source {
        warn_content_deduplication(url, attributes, config);
    }
}

/// Checks the table and, unless a carry secret was set, reads (or, first,
/// makes) the one the table keeps, beside the check in one round trip. A
/// consumer keyed by ids does not start without a secret (it would run a
/// redriven copy again under a new key); others warn, since they never read
/// a carried key (what they park and send is unsealed).
async fn check_table_and_secret(
    store: &DynamoStore,
    config: &mut ProcessorConfig,
) -> Result<(), StartError> {
    let wants_secret = config.carry_secret.is_none();
    let key_settings = key_settings(config);
    let (checked, secret, stamp) = tokio::join!(
        retry_transient(|| async { store.check_table().await.map_err(StartError::from) }),
        async {
            if !wants_secret {
                return Ok(None);
            }
            retry_transient(|| async { Ok(store.table_carry_secret(true).await?) }).await
        },
        retry_transient(|| async { Ok(store.check_stamp(&config.consumer, &key_settings).await?) })
    );
    // A change of key settings is said even when the table check fails
    // after the stamp noted it; a table that cannot serve is named first. A
    // stamp that cannot be read or written (a missing permission) stops the
    // start: unchecked, a build that derives keys otherwise would re-apply.
    if let Ok(crate::aws::dynamodb::StampCheck::KeySettingsChanged { was }) = &stamp {
        tracing::warn!(
            consumer = %config.consumer, was = %was, now = %key_settings,
            "the key settings changed since this consumer last started: records made under the old ones are not found, so a message seen before runs again (drain the queue and its DLQ before such a change)"
        );
    }
    checked?;
    stamp?;
    match secret {
        Ok(Some(secret)) => config.carry_secret = Some(secret),
        Ok(None) => {}
        Err(e) if config.key_source.uses_ids() => return Err(e),
        Err(e) => tracing::warn!(
            error = %e,
            "no carry secret: what this consumer parks and sends carries no sealed key"
        ),
    }
    Ok(())
}

/// The settings that decide what a record is keyed by, as the consumer's
/// stamp keeps them (a change means records made before are not found).
fn key_settings(config: &ProcessorConfig) -> String {
    format!(
        "key={}; envelope={}; hash_keys={}",
        config.key_source, config.envelope, config.hash_keys,
    )
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`): JSON lines in
/// Lambda (CloudWatch reads them), else text with every field escaped (a
/// value from a message cannot forge a line). A subscriber installed
/// meanwhile by another thread wins.
#[cfg(feature = "logging")]
fn install_default_logging() {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
        fmt.json().boxed()
    } else {
        fmt.fmt_fields(crate::protocol::logfmt::escaped_fields())
            .boxed()
    };
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .try_init();
}

/// The TTL that outlives every copy of a message of the source queue (its
/// URL and attributes, as read): its retention plus its DLQ's (see
/// [`retention_window`]) plus [`TTL_SLACK`]; [`LONGEST_TTL`] when there is
/// no queue URL to read or its retention cannot be read (a warning names the
/// permission).
async fn fitted_ttl(
    sqs: &aws_sdk_sqs::Client,
    source: Option<&(&str, Result<QueueAttributes, QueueError>)>,
    parking_dlq: Option<&str>,
) -> Duration {
    let longest = |why: &str| {
        tracing::warn!(
            ttl = %humantime::format_duration(LONGEST_TTL),
            "{why}: records are kept 43 days, longer than any queue can keep a copy of a message (set SQS_ONCE_TTL to choose)"
        );
        LONGEST_TTL
    };
    let (url, attributes) = match source {
        None => {
            tracing::info!(
                ttl = %humantime::format_duration(LONGEST_TTL),
                "no queue URL to fit the record TTL to (SQS_ONCE_QUEUE_URL): records are kept 43 days, longer than any queue can keep a copy of a message"
            );
            return LONGEST_TTL;
        }
        Some((url, Err(e))) => {
            return longest(&format!(
                "cannot read the queue's retention (grant sqs:GetQueueAttributes on {url}): {e}"
            ));
        }
        Some((url, Ok(attributes))) => (*url, attributes),
    };
    let Some(window) = retention_window(sqs, url, attributes, parking_dlq).await else {
        return longest("the queue's attributes name no MessageRetentionPeriod");
    };
    warn_unread_dlq(&window);
    let ttl = window.total + TTL_SLACK;
    tracing::info!(
        queue = url,
        ttl = %humantime::format_duration(ttl),
        "record TTL fitted to the queue's retention plus its DLQ's, plus a day"
    );
    ttl
}

/// Under `dedup-id` keys on a queue with content-based deduplication, two
/// equal bodies are one key for as long as the record lives, not for SQS's
/// five minutes: said at start-up.
fn warn_content_deduplication(url: &str, attributes: &QueueAttributes, config: &ProcessorConfig) {
    if attributes.content_based_deduplication == Some(true)
        && config.key_source.uses_deduplication_id()
    {
        tracing::warn!(
            queue = url,
            ttl = %humantime::format_duration(config.ttl),
            "`dedup-id` keys on a queue with ContentBasedDeduplication: SQS drops an equal body only within five minutes, this consumer skips it for the record's TTL; send an explicit MessageDeduplicationId per event, or key on a business id (json:/attribute:)"
        );
    }
}

/// The clients, counting their calls, and the processor for a runtime.
struct Prepared<H> {
    sqs: aws_sdk_sqs::Client,
    processor: Processor<DynamoStore, H>,
    #[cfg_attr(not(feature = "poller"), allow(dead_code))]
    calls: CallCounter,
}

/// Runs a start-up check again while it fails for a reason that may pass (no
/// answer, throttling) for up to a minute; a definite failure, or one that
/// lasts, is returned.
async fn retry_transient<T, F, Fut>(mut check: F) -> Result<T, StartError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StartError>>,
{
    let give_up = tokio::time::Instant::now() + START_UP_RETRIES_FOR;
    let mut delay = Duration::from_millis(500);
    loop {
        match check().await {
            Ok(value) => return Ok(value),
            Err(e) if e.is_transient() && tokio::time::Instant::now() + delay < give_up => {
                tracing::warn!(error = %e, retry_in = ?delay, "start-up check failed; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(8));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Cancelled on SIGTERM or SIGINT. The handlers are in place when this
/// returns: call it first, so a signal during start-up stops the process
/// cleanly instead of killing it.
pub fn shutdown_on_signals() -> CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let t = token.clone();
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping"),
            _ = int.recv() => tracing::info!("SIGINT: stopping"),
        }
        t.cancel();
    });
    token
}

#[cfg(test)]
mod tests {
    #[cfg(feature = "s3-payloads")]
    #[tokio::test]
    async fn a_payload_bucket_owner_that_is_not_an_account_id_is_refused_at_start() {
        let sdk = aws_config::SdkConfig::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .build();
        let options = || LargePayloadOptions {
            places: Some(Some(Vec::new())),
            read: true,
            ..LargePayloadOptions::default()
        };
        let typo = BucketOwner::Account("12345678901".into());
        let Err(err) = options().reader(&sdk, &CallCounter::default(), typo) else {
            panic!("a bucket owner that is not an account id is refused");
        };
        assert!(
            err.to_string().contains("SQS_ONCE_PAYLOAD_BUCKET_OWNER"),
            "{err}"
        );
        let account = BucketOwner::Account("123456789012".into());
        assert!(
            options()
                .reader(&sdk, &CallCounter::default(), account)
                .is_ok()
        );
    }

    /// The payload budget set reaches the reader (`0`: none); unset, it is
    /// fitted to this process's memory (here, at least the host's).
    #[cfg(feature = "s3-payloads")]
    #[tokio::test]
    async fn the_payload_budget_reaches_the_large_payload_reader() {
        let sdk = aws_config::SdkConfig::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .build();
        let reader = |budget: Option<usize>| {
            LargePayloadOptions {
                places: Some(Some(Vec::new())),
                read: true,
                budget,
                ..LargePayloadOptions::default()
            }
            .reader(&sdk, &CallCounter::default(), BucketOwner::Any)
            .expect("valid")
        };
        let set = reader(Some(100 << 20));
        assert_eq!(set.budget().map(|b| b.bytes()), Some(100 << 20));
        assert!(reader(Some(0)).budget().is_none());
        let fitted = crate::protocol::payloads::fit_budget(
            None,
            &crate::protocol::payloads::MemoryLimits::of_this_process(),
        );
        assert_eq!(
            reader(None).budget().map(|b| b.bytes()),
            fitted.bytes.map(|b| b / 1024 * 1024)
        );
    }

    #[cfg(feature = "poller")]
    #[tokio::test]
    async fn the_front_door_answers_health_from_the_poller_beside_it() {
        let liveness = crate::runtime::poller::Liveness::new();
        let serving = crate::runtime::health::serve(0, liveness.clone())
            .await
            .unwrap();
        let port = serving.port();
        let front = SqsOnce::builder("t", "c").health_port(port);
        let before = front.check_health().await.unwrap_err();
        assert!(
            before.to_string().contains("not started receiving"),
            "{before}"
        );
        liveness.beat();
        front.check_health().await.unwrap();
        let nobody = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let closed = nobody.local_addr().unwrap().port();
        drop(nobody);
        let err = SqsOnce::builder("t", "c")
            .health_port(closed)
            .check_health()
            .await
            .unwrap_err();
        assert!(matches!(err, StartError::Unhealthy(_)), "{err}");
    }

    #[cfg(feature = "s3-payloads")]
    #[test]
    fn a_queue_urls_account_is_the_path_s_first_part_of_twelve_digits() {
        use super::account_of_queue_url as account;
        let aws = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders";
        assert_eq!(account(aws), Some("123456789012"));
        let local = "http://localhost:4566/000000000000/orders.fifo";
        assert_eq!(account(local), Some("000000000000"));
        let by_path = "http://localhost:4566/queue/us-east-1/000000000000/orders";
        assert_eq!(account(by_path), Some("000000000000"));
        assert_eq!(
            account("https://sqs.eu-west-1.amazonaws.com/12345/orders"),
            None
        );
        assert_eq!(
            account("https://sqs.eu-west-1.amazonaws.com/123456789012"),
            None
        );
        assert_eq!(account("orders"), None);
    }

    use super::*;
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Logs(Arc<Mutex<Vec<u8>>>);

    impl Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What `f` logs at `warn` and above.
    fn warnings_of(f: impl FnOnce()) -> String {
        let logs = Logs::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::WARN)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        String::from_utf8(logs.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn a_start_error_returned_from_main_prints_its_message() {
        let e = StartError::Table(TableCheckError::Missing("sqs-once-dedup".into()));
        let shown = format!("{e:?}");
        assert_eq!(shown, e.to_string());
        assert!(shown.contains("sqs-once init"), "{shown}");
        assert!(!shown.contains("Missing("), "{shown}");
    }

    #[test]
    fn dedup_id_keys_on_a_content_deduplicated_queue_are_warned_about() {
        let url = "https://sqs.us-east-1.amazonaws.com/1/orders.fifo";
        let mut config = ProcessorConfig::new("c");
        config.key_source = KeySource::DeduplicationId;
        let content = QueueAttributes {
            content_based_deduplication: Some(true),
            ..QueueAttributes::default()
        };
        let warned = warnings_of(|| warn_content_deduplication(url, &content, &config));
        assert!(warned.contains("ContentBasedDeduplication"), "{warned}");
        let explicit = QueueAttributes {
            content_based_deduplication: Some(false),
            ..QueueAttributes::default()
        };
        assert_eq!(
            warnings_of(|| warn_content_deduplication(url, &explicit, &config)),
            ""
        );
        config.key_source = KeySource::MessageId;
        assert_eq!(
            warnings_of(|| warn_content_deduplication(url, &content, &config)),
            ""
        );
    }

    #[test]
    fn a_denied_start_up_check_names_the_permission_to_grant() {
        let table = StartError::Table(TableCheckError::Unreachable {
            table: "dedup".into(),
            transient: false,
            reason: "AccessDeniedException".into(),
        });
        let shown = table.to_string();
        assert!(
            shown.contains("grant dynamodb:DescribeTable and dynamodb:DescribeTimeToLive"),
            "{shown}"
        );
        #[cfg(feature = "poller")]
        {
            let queue = StartError::Queue(QueueCheckError::Unreachable {
                queue: "https://sqs.us-east-1.amazonaws.com/1/orders".into(),
                source: QueueError::new(
                    "GetQueueAttributes",
                    "https://sqs.us-east-1.amazonaws.com/1/orders",
                    "AccessDenied",
                    false,
                ),
            });
            let shown = queue.to_string();
            assert!(shown.contains("grant sqs:GetQueueAttributes"), "{shown}");
        }
    }

    /// An SDK configuration pointed at `endpoint`, with no credentials: a
    /// call through it would fail, so a refusal is made before any call.
    fn sdk_at(endpoint: Option<&str>) -> aws_config::SdkConfig {
        let mut sdk = aws_config::SdkConfig::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"));
        if let Some(endpoint) = endpoint {
            sdk = sdk.endpoint_url(endpoint);
        }
        sdk.build()
    }

    #[tokio::test]
    async fn ensure_table_is_refused_against_a_remote_endpoint_unless_allowed() {
        let ddb = aws_sdk_dynamodb::Client::new(&sdk_at(None));
        for endpoint in [
            None,
            Some("https://dynamodb.us-east-1.amazonaws.com"),
            Some("http://localhost.evil.example:4566"),
        ] {
            let err = ensure_dedup_table(&ddb, "dev-dedup", endpoint.map(str::to_owned), false)
                .await
                .expect_err("refused");
            assert!(
                matches!(&err, StartError::EnsureTableRefused { table, .. } if table == "dev-dedup"),
                "{err:?}"
            );
            let shown = err.to_string();
            assert!(shown.contains("allow_remote_ensure_table"), "{shown}");
            assert!(shown.contains("sqs-once init --table dev-dedup"), "{shown}");
            assert!(!err.is_transient());
        }
        // Allowed, the same call goes on to DynamoDB (and fails here for want
        // of credentials: not a refusal).
        let err = ensure_dedup_table(&ddb, "dev-dedup", None, true)
            .await
            .expect_err("no credentials");
        assert!(matches!(err, StartError::EnsureTable(_)), "{err:?}");
    }

    #[cfg(feature = "poller")]
    #[tokio::test]
    async fn the_front_door_refuses_ensure_table_at_aws() {
        if std::env::var_os("AWS_ENDPOINT_URL_DYNAMODB").is_some() {
            return; // the endpoint is that one, whatever the configuration says
        }
        let handler =
            crate::handler_fn(|_m: crate::Message, _c| async { crate::HandlerResult::Ok(None) });
        let err = SqsOnce::builder("dev-dedup", "orders")
            .sdk_config(sdk_at(Some("https://dynamodb.eu-west-1.amazonaws.com")))
            .queue_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
            .default_logging(false)
            .shutdown_on(CancellationToken::new())
            .ensure_table()
            .run_poller(handler)
            .await
            .expect_err("refused");
        assert!(
            matches!(&err, StartError::EnsureTableRefused { endpoint, .. } if endpoint == "https://dynamodb.eu-west-1.amazonaws.com"),
            "{err:?}"
        );
    }
}
