//! The consumers' settings, each an `SQS_ONCE_*` environment variable:
//! [`Settings`], loaded with [`Settings::from_env`] (no clap needed), or,
//! with the feature `env`, from flags and the environment by clap
//! (`#[command(flatten)] settings: Settings`, as the binaries do). Both read
//! the same variables with the same parsers ([`duration`], [`switch`],
//! [`number`], and clap's `ValueEnum` over the same names as
//! [`parse_choice`]), and
//! [`Settings::builder`] hands them to the front door.
//!
//! One vocabulary: durations are `humantime`'s (`500ms`, `30s`, `5m`, `7d`,
//! `1h 30m`); every on/off setting takes `on`/`off`, `true`/`false`,
//! `yes`/`no` or `1`/`0` (any case; [`SWITCH_WORDS`]), and as a flag alone
//! (`--fast-path`) means on. A bad value is an error naming its variable.

use std::time::Duration;

use crate::KeySource;
use crate::app::SqsOnce;
pub use crate::protocol::config::SWITCH_WORDS;
use crate::protocol::config::{
    ConfigError, MissingKey, PayloadMismatch, ProcessorConfig, parse_choice, parse_duration,
    parse_number, parse_switch,
};
use crate::protocol::payloads::PayloadLocation;
#[cfg(feature = "lambda")]
use crate::runtime::lambda::LambdaConfig;
#[cfg(feature = "poller")]
use crate::runtime::poller::PollerConfig;

/// The consumers' settings; each is an `SQS_ONCE_*` environment variable
/// (and, with the feature `env`, a flag).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "env", derive(clap::Args))]
#[non_exhaustive]
pub struct Settings {
    /// The source queue URL (required for the poller; in Lambda it is looked up
    /// from the event's queue ARN unless given).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_QUEUE_URL"))]
    pub queue_url: Option<String>,
    /// The dedup table.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_TABLE"))]
    pub table: String,
    /// The consumer name: the namespace of its dedup records.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_CONSUMER"))]
    pub consumer: String,
    /// Where the dedup key comes from: message-id, dedup-id, attribute:NAME, json:/pointer (json:/a>/b inside a JSON string), body-sha256, sender (SQS's SenderId), or several joined by commas.
    #[cfg_attr(
        feature = "env",
        arg(long, env = "SQS_ONCE_DEDUP_KEY", default_value = "message-id")
    )]
    pub dedup_key: String,
    /// Whose keys a key is: `none` (one space for every producer) or
    /// `sender` (a key from the body or an attribute scoped to SQS's
    /// SenderId, so a producer cannot make another producer's message skip
    /// by sending its id first; a copy brought back from the DLQ keeps its
    /// first sender, sealed). `message-id` and `dedup-id` keys stay as they
    /// are: SQS sets the one, and deduplicates the other across senders.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_KEY_SCOPE", default_value = "none", value_parser = ["none", "sender"]))]
    pub key_scope: String,
    /// What wraps the payload in each body: none, sns (a notification
    /// without raw message delivery), eventbridge or s3. The dedup key and
    /// the handler read the payload inside.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_ENVELOPE", default_value = "none", value_parser = ["none", "sns", "eventbridge", "s3"]))]
    pub envelope: String,
    /// Process messages without a dedup key unprotected instead of parking
    /// them (on/off; the flag alone: on).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_ALLOW_MISSING_KEY", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_ALLOW_MISSING_KEY"), action = clap::ArgAction::Set))]
    pub allow_missing_key: bool,
    /// The dead-letter queue URL for permanent failures.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_DLQ_URL"))]
    pub dlq_url: Option<String>,
    /// Handlers running at once at most (in Lambda: records, or FIFO groups, at once).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_CONCURRENCY", default_value = "10", value_parser = number("SQS_ONCE_CONCURRENCY")))]
    pub concurrency: usize,
    /// Messages the poller receives ahead beyond the running ones, waiting
    /// (invisible) for a slot (0: receive only for free slots).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_PREFETCH", default_value = "10", value_parser = number("SQS_ONCE_PREFETCH")))]
    pub prefetch: usize,
    /// Claim lease.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LEASE", default_value = "60s", value_parser = duration("SQS_ONCE_LEASE")))]
    pub lease: Duration,
    /// Record retention (must exceed the queue's retention plus its DLQ's).
    /// Unset: fitted at start-up to the queue's retention plus its DLQ's plus
    /// a day, or 43 days (longer than any queue can keep a copy) when they
    /// cannot be read.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_TTL", value_parser = duration("SQS_ONCE_TTL")))]
    pub ttl: Option<Duration>,
    /// Heartbeat interval: lease and visibility extension while a handler runs.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_HEARTBEAT", default_value = "20s", value_parser = duration("SQS_ONCE_HEARTBEAT")))]
    pub heartbeat: Duration,
    /// A handler whose lease could not be extended is interrupted this long
    /// before the lease ends (room for clock skew; at most a tenth of the lease).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LEASE_MARGIN", default_value = "5s", value_parser = duration("SQS_ONCE_LEASE_MARGIN")))]
    pub lease_margin: Duration,
    /// Drain deadline at shutdown (then up to 5 s for releases and the last deletes).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_DRAIN", default_value = "20s", value_parser = duration("SQS_ONCE_DRAIN")))]
    pub drain: Duration,
    /// Long-poll wait.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_WAIT", default_value = "20s", value_parser = duration("SQS_ONCE_WAIT")))]
    pub wait: Duration,
    /// First retry delay (doubled per receive).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_BACKOFF", default_value = "2s", value_parser = duration("SQS_ONCE_BACKOFF")))]
    pub backoff: Duration,
    /// Longest retry delay: the doubling stops here (at most SQS's 12 hours).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_BACKOFF_MAX", default_value = "15m", value_parser = duration("SQS_ONCE_BACKOFF_MAX")))]
    pub backoff_max: Duration,
    /// How long one DynamoDB request may take before it is abandoned and sent
    /// again (with the same token: an abandoned write that committed is found).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_DYNAMODB_TIMEOUT", default_value = "5s", value_parser = duration("SQS_ONCE_DYNAMODB_TIMEOUT")))]
    pub dynamodb_timeout: Duration,
    /// How long a receive waits for room to hold ten, and a delete for ten receipts.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_BATCH_WAIT", default_value = "1s", value_parser = duration("SQS_ONCE_BATCH_WAIT")))]
    pub batch_wait: Duration,
    /// How often the poller prints its counters as CloudWatch EMF lines on stdout
    /// (`0s`: never; Lambda prints them after every invocation).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_METRICS_INTERVAL", default_value = "60s", value_parser = duration("SQS_ONCE_METRICS_INTERVAL")))]
    pub metrics_interval: Duration,
    /// Exit once idle this long with nothing in flight (batch runs, demos, tests).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_EXIT_WHEN_IDLE", value_parser = duration("SQS_ONCE_EXIT_WHEN_IDLE")))]
    pub exit_when_idle: Option<Duration>,
    /// The poller answers health checks on 127.0.0.1:PORT (how long ago its
    /// receive loop last turned); `--health` asks it. Unset: no health check.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_HEALTH_PORT"))]
    pub health_port: Option<u16>,
    /// `--health` reports unhealthy when the receive loop last turned longer
    /// ago than this (it turns at least every long poll plus 10 s, or every
    /// 5 s while every slot is busy; a failing receive waits up to 20 s more).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_HEALTH_MAX_AGE", default_value = "60s", value_parser = duration("SQS_ONCE_HEALTH_MAX_AGE")))]
    pub health_max_age: Duration,
    /// Do not run: ask the poller running beside (SQS_ONCE_HEALTH_PORT)
    /// whether it is alive and exit 0 if so, 1 if not (a container health
    /// check without a shell). A flag only.
    #[cfg_attr(feature = "env", arg(long))]
    pub health: bool,
    /// Use the one-transaction fast path for handlers that only stage DynamoDB
    /// writes (`off`: claim first, as for every other handler). Every
    /// on/off setting takes `on`/`off`, `true`/`false`, `yes`/`no` or `1`/`0`.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_FAST_PATH", default_value = "on", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_FAST_PATH"), action = clap::ArgAction::Set))]
    pub fast_path: bool,
    /// A duplicate whose body differs from the recorded one (a producer reusing
    /// a key): `warn` (the default: skipped as its key says, with a
    /// warning) or `park` (parked with the reason, never dropped silently).
    #[cfg_attr(
        feature = "env",
        arg(
            long,
            env = "SQS_ONCE_PAYLOAD_MISMATCH",
            default_value = "warn",
            value_enum
        )
    )]
    pub payload_mismatch: PayloadMismatch,
    /// JSON pointers, comma-separated, to the parts of the payload that tell
    /// "same key, different payload" (default: the whole payload).
    #[cfg_attr(
        feature = "env",
        arg(long, env = "SQS_ONCE_PAYLOAD_POINTERS", value_delimiter = ',')
    )]
    pub payload_pointers: Vec<String>,
    /// The secret that seals the dedup key and first message id a parked copy
    /// carries (at least 32 bytes; several separated by commas rotate: the
    /// first seals, each verifies). Only consumers and operators hold it: a
    /// carried key is honoured only when it verifies. Unset: the secret kept
    /// in the dedup table (made by `sqs-once init` or the first consumer to
    /// start); only where that can be neither read nor made is nothing
    /// carried honoured, and parked copies carry no key.
    #[cfg_attr(
        feature = "env",
        arg(long, env = "SQS_ONCE_CARRY_SECRET", hide_env_values = true)
    )]
    pub carry_secret: Option<SecretText>,
    /// Hash dedup keys (`on`/`off`): records are keyed by, and logs and
    /// spans show, `sha256:{hex}` of the key instead of the key. Turning it
    /// on or off under a live queue makes duplicates of earlier messages run
    /// again: drain first (docs/OPERATIONS.md).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_HASH_KEYS", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_HASH_KEYS"), action = clap::ArgAction::Set))]
    pub hash_keys: bool,
    /// Keep handler error text out of records, DLQ reasons, logs and span
    /// status (`on`/`off`): a fixed text names the failure's kind and the
    /// error's type instead.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_REDACT_REASONS", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_REDACT_REASONS"), action = clap::ArgAction::Set))]
    pub redact_reasons: bool,
    /// Let a producer's trace context decide whether a message's span is
    /// sampled (`on`/`off`). Off, the span stays in the producer's trace but
    /// this consumer's sampler (OTEL_TRACES_SAMPLER) decides.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_TRUST_PRODUCER_SAMPLING", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_TRUST_PRODUCER_SAMPLING"), action = clap::ArgAction::Set))]
    pub trust_producer_sampling: bool,
    /// Lambda: no record is started with less time than this left in the invocation.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LAMBDA_MARGIN", default_value = "3s", value_parser = duration("SQS_ONCE_LAMBDA_MARGIN")))]
    pub lambda_margin: Duration,
    /// Lambda: when every record of a batch is to come back, answer with an
    /// error (`error`, so the whole batch comes back even without
    /// ReportBatchItemFailures, and counts in Lambda's Errors) or with the
    /// full list (`list`).
    #[cfg_attr(
        feature = "env",
        arg(
            long,
            env = "SQS_ONCE_LAMBDA_FULL_FAILURE",
            default_value = "error",
            value_enum
        )
    )]
    pub lambda_full_failure: FullFailure,
    /// Large payloads (`on`/`off`): a body that is an SQS Extended Client
    /// Library's S3 pointer is replaced by the object's content before the
    /// dedup key is read and the handler runs (feature `s3-payloads`).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LARGE_PAYLOADS", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_LARGE_PAYLOADS"), action = clap::ArgAction::Set))]
    pub large_payloads: bool,
    /// Delete a large payload's object after its message is deleted
    /// (`on`/`off`; parked messages keep theirs). Needs large payloads on.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_DELETE_PAYLOADS", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = switch("SQS_ONCE_DELETE_PAYLOADS"), action = clap::ArgAction::Set))]
    pub delete_payloads: bool,
    /// The largest large payload read, in bytes: a pointer that declares
    /// more is parked without calling S3, and a read is cut off past it.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES", default_value_t = crate::protocol::payloads::DEFAULT_MAX_PAYLOAD_BYTES, value_parser = number("SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES")))]
    pub large_payload_max_bytes: usize,
    /// The most large payload bytes held at once, across every message in
    /// flight: a payload waits (kept invisible) until its bytes fit, and
    /// one that could never fit is parked. Unset: a third of the memory the
    /// process may use (the Lambda function's memory size, else the
    /// container's cgroup limit, else the host's memory), two thirds kept
    /// for a copy of each payload and the rest of the process. `0`: no
    /// budget.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_PAYLOAD_BUDGET_BYTES", value_parser = number("SQS_ONCE_PAYLOAD_BUDGET_BYTES")))]
    pub payload_budget_bytes: Option<usize>,
    /// Where large payloads may be, comma-separated: `bucket` or
    /// `bucket/prefix`. A pointer to anything else is parked without calling
    /// S3. Required with large payloads on; `*` allows any bucket (unsafe).
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_LARGE_PAYLOAD_BUCKETS"))]
    pub large_payload_buckets: Option<String>,
    /// Where outgoing bodies too large for SQS are stored (`bucket` or
    /// `bucket/prefix`): the handler's `ctx.send` of such a body stores it
    /// there and sends an extended client's pointer. Unset: such a send
    /// fails the message permanently.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_OUTBOX_PAYLOAD_BUCKET"))]
    pub outbox_payload_bucket: Option<String>,
    /// The AWS account (12 digits) that must own every payload bucket the
    /// consumer reads, writes or deletes in (S3's `ExpectedBucketOwner`: a
    /// bucket made again under the same name by another account is
    /// refused, and the message retried until its receives run out). `queue`:
    /// the source queue's account, from its URL; `any`: none checked.
    /// Unset: none checked, with a warning at start-up.
    #[cfg_attr(feature = "env", arg(long, env = "SQS_ONCE_PAYLOAD_BUCKET_OWNER"))]
    pub payload_bucket_owner: Option<String>,
}

/// `SQS_ONCE_LAMBDA_FULL_FAILURE`: how a Lambda batch whose every record is
/// to come back is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FullFailure {
    /// With an error: the whole batch comes back even without
    /// ReportBatchItemFailures, and counts in Lambda's Errors.
    #[default]
    Error,
    /// With the full list of item failures.
    List,
}

impl FullFailure {
    /// Each value's name in `SQS_ONCE_LAMBDA_FULL_FAILURE`.
    pub const CHOICES: &[(&str, Self)] = &[("error", Self::Error), ("list", Self::List)];
}

/// The clap value of a choice: its name in `choices`.
#[cfg(feature = "env")]
fn possible_value<T: PartialEq>(
    choices: &[(&'static str, T)],
    v: &T,
) -> clap::builder::PossibleValue {
    let name = choices.iter().find(|(_, c)| c == v).map_or("", |(n, _)| n);
    clap::builder::PossibleValue::new(name)
}

#[cfg(feature = "env")]
impl clap::ValueEnum for PayloadMismatch {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::Warn, Self::Park]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(possible_value(Self::CHOICES, self))
    }
}

#[cfg(feature = "env")]
impl clap::ValueEnum for FullFailure {
    fn value_variants<'a>() -> &'a [Self] {
        &[Self::Error, Self::List]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(possible_value(Self::CHOICES, self))
    }
}

/// A parser of durations for `setting` (`humantime`'s: `500ms`, `30s`,
/// `7d`), naming it on error; usable as a clap `value_parser`.
pub fn duration(
    setting: &'static str,
) -> impl Fn(&str) -> Result<Duration, ConfigError> + Clone + Send + Sync + 'static {
    move |value| parse_duration(setting, value)
}

/// A parser of on/off values ([`SWITCH_WORDS`]) for `setting`, naming it on
/// error; usable as a clap `value_parser`.
pub fn switch(
    setting: &'static str,
) -> impl Fn(&str) -> Result<bool, ConfigError> + Clone + Send + Sync + 'static {
    move |value| parse_switch(setting, value)
}

/// A parser of whole numbers for `setting`, naming it on error; usable as a
/// clap `value_parser`.
pub fn number(
    setting: &'static str,
) -> impl Fn(&str) -> Result<usize, ConfigError> + Clone + Send + Sync + 'static {
    move |value| parse_number(setting, value)
}

/// Reads variables through `var`, with the settings' defaults and parsers.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn text(&self, name: &'static str) -> Option<String> {
        (self.0)(name)
    }

    fn required(&self, name: &'static str) -> Result<String, ConfigError> {
        self.text(name).ok_or(ConfigError {
            setting: name,
            problem: "not set (required)".into(),
        })
    }

    fn duration(&self, name: &'static str, default: &str) -> Result<Duration, ConfigError> {
        parse_duration(name, self.text(name).as_deref().unwrap_or(default))
    }

    fn switch(&self, name: &'static str, default: bool) -> Result<bool, ConfigError> {
        self.text(name)
            .map_or(Ok(default), |v| parse_switch(name, &v))
    }

    fn number(&self, name: &'static str, default: usize) -> Result<usize, ConfigError> {
        self.text(name)
            .map_or(Ok(default), |v| parse_number(name, &v))
    }

    fn choice<T: Clone + Default>(
        &self,
        name: &'static str,
        choices: &[(&str, T)],
    ) -> Result<T, ConfigError> {
        self.text(name)
            .map_or(Ok(T::default()), |v| parse_choice(name, choices, &v))
    }
}

impl Settings {
    /// The settings from the process's `SQS_ONCE_*` environment variables,
    /// as the binaries read them (without clap: no flags). Unset variables
    /// take the binaries' defaults; `SQS_ONCE_TABLE` and `SQS_ONCE_CONSUMER`
    /// are required. A variable that is not valid unicode counts as unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The settings from variables `var` looks up by name (`None`: unset),
    /// as [`from_env`](Self::from_env) does from the process's environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let v = Vars(var);
        Ok(Self {
            queue_url: v.text("SQS_ONCE_QUEUE_URL"),
            table: v.required("SQS_ONCE_TABLE")?,
            consumer: v.required("SQS_ONCE_CONSUMER")?,
            dedup_key: v
                .text("SQS_ONCE_DEDUP_KEY")
                .unwrap_or_else(|| "message-id".into()),
            key_scope: v
                .text("SQS_ONCE_KEY_SCOPE")
                .unwrap_or_else(|| "none".into()),
            envelope: v.text("SQS_ONCE_ENVELOPE").unwrap_or_else(|| "none".into()),
            allow_missing_key: v.switch("SQS_ONCE_ALLOW_MISSING_KEY", false)?,
            dlq_url: v.text("SQS_ONCE_DLQ_URL"),
            concurrency: v.number("SQS_ONCE_CONCURRENCY", 10)?,
            prefetch: v.number("SQS_ONCE_PREFETCH", 10)?,
            lease: v.duration("SQS_ONCE_LEASE", "60s")?,
            ttl: v
                .text("SQS_ONCE_TTL")
                .map(|t| parse_duration("SQS_ONCE_TTL", &t))
                .transpose()?,
            heartbeat: v.duration("SQS_ONCE_HEARTBEAT", "20s")?,
            lease_margin: v.duration("SQS_ONCE_LEASE_MARGIN", "5s")?,
            drain: v.duration("SQS_ONCE_DRAIN", "20s")?,
            wait: v.duration("SQS_ONCE_WAIT", "20s")?,
            backoff: v.duration("SQS_ONCE_BACKOFF", "2s")?,
            backoff_max: v.duration("SQS_ONCE_BACKOFF_MAX", "15m")?,
            dynamodb_timeout: v.duration("SQS_ONCE_DYNAMODB_TIMEOUT", "5s")?,
            batch_wait: v.duration("SQS_ONCE_BATCH_WAIT", "1s")?,
            metrics_interval: v.duration("SQS_ONCE_METRICS_INTERVAL", "60s")?,
            exit_when_idle: v
                .text("SQS_ONCE_EXIT_WHEN_IDLE")
                .map(|t| parse_duration("SQS_ONCE_EXIT_WHEN_IDLE", &t))
                .transpose()?,
            health_port: crate::protocol::config::health_port_from(&v.0)?,
            health_max_age: v.duration("SQS_ONCE_HEALTH_MAX_AGE", "60s")?,
            health: false,
            fast_path: v.switch("SQS_ONCE_FAST_PATH", true)?,
            payload_mismatch: v.choice("SQS_ONCE_PAYLOAD_MISMATCH", PayloadMismatch::CHOICES)?,
            payload_pointers: v
                .text("SQS_ONCE_PAYLOAD_POINTERS")
                .map(|t| t.split(',').map(str::to_owned).collect())
                .unwrap_or_default(),
            carry_secret: v.text("SQS_ONCE_CARRY_SECRET").map(SecretText),
            hash_keys: v.switch("SQS_ONCE_HASH_KEYS", false)?,
            redact_reasons: v.switch("SQS_ONCE_REDACT_REASONS", false)?,
            trust_producer_sampling: v.switch("SQS_ONCE_TRUST_PRODUCER_SAMPLING", false)?,
            lambda_margin: v.duration("SQS_ONCE_LAMBDA_MARGIN", "3s")?,
            lambda_full_failure: v.choice("SQS_ONCE_LAMBDA_FULL_FAILURE", FullFailure::CHOICES)?,
            large_payloads: v.switch("SQS_ONCE_LARGE_PAYLOADS", false)?,
            delete_payloads: v.switch("SQS_ONCE_DELETE_PAYLOADS", false)?,
            large_payload_max_bytes: v.number(
                "SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES",
                crate::protocol::payloads::DEFAULT_MAX_PAYLOAD_BYTES,
            )?,
            payload_budget_bytes: v
                .text("SQS_ONCE_PAYLOAD_BUDGET_BYTES")
                .map(|t| parse_number("SQS_ONCE_PAYLOAD_BUDGET_BYTES", &t))
                .transpose()?,
            large_payload_buckets: v.text("SQS_ONCE_LARGE_PAYLOAD_BUCKETS"),
            outbox_payload_bucket: v.text("SQS_ONCE_OUTBOX_PAYLOAD_BUCKET"),
            payload_bucket_owner: v.text("SQS_ONCE_PAYLOAD_BUCKET_OWNER"),
        })
    }

    /// The validated processor settings.
    pub fn processor_config(&self) -> Result<ProcessorConfig, ConfigError> {
        let mut p = ProcessorConfig::new(&self.consumer);
        p.key_source = self
            .dedup_key
            .parse::<KeySource>()
            .map_err(|e| ConfigError {
                setting: "SQS_ONCE_DEDUP_KEY",
                problem: e.to_string(),
            })?;
        match self.key_scope.trim() {
            "none" | "" => {}
            "sender" => p.key_source = p.key_source.scoped_to_sender(),
            other => {
                return Err(ConfigError {
                    setting: "SQS_ONCE_KEY_SCOPE",
                    problem: format!("`{other}`: expected `none` or `sender`"),
                });
            }
        }
        p.envelope = self.envelope.parse().map_err(|e| ConfigError {
            setting: "SQS_ONCE_ENVELOPE",
            problem: format!("{e}"),
        })?;
        if self.allow_missing_key {
            p.missing_key = MissingKey::ProcessUnprotected;
        }
        p.lease = self.lease;
        if let Some(ttl) = self.ttl {
            p.ttl = ttl;
            p.fit_ttl = false;
        }
        p.heartbeat = self.heartbeat;
        p.lease_margin = self.lease_margin;
        p.backoff_base = self.backoff;
        p.backoff_max = self.backoff_max;
        p.fast_path = self.fast_path;
        p.hash_keys = self.hash_keys;
        p.redact_reasons = self.redact_reasons;
        p.trust_producer_sampling = self.trust_producer_sampling;
        p.payload_mismatch = self.payload_mismatch;
        p.payload_pointers = self
            .payload_pointers
            .iter()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        p.carry_secret = self
            .carry_secret
            .as_ref()
            .map(SecretText::expose)
            .filter(|s| !s.is_empty())
            .map(crate::protocol::key::CarrySecret::parse)
            .transpose()
            .map_err(|e| ConfigError {
                setting: "SQS_ONCE_CARRY_SECRET",
                problem: e.to_string(),
            })?;
        p.validate()?;
        if self.delete_payloads && !self.large_payloads {
            return Err(ConfigError {
                setting: "SQS_ONCE_DELETE_PAYLOADS",
                problem: "needs SQS_ONCE_LARGE_PAYLOADS=on".into(),
            });
        }
        self.payload_locations()?;
        self.outbox_payload_location()?;
        if self.concurrency == 0 {
            return Err(ConfigError {
                setting: "SQS_ONCE_CONCURRENCY",
                problem: "must be at least 1".into(),
            });
        }
        Ok(p)
    }

    /// Where large payloads may be: `None` for anywhere (`*`).
    pub(crate) fn payload_locations(&self) -> Result<Option<Vec<PayloadLocation>>, ConfigError> {
        let bad = |problem: String| ConfigError {
            setting: "SQS_ONCE_LARGE_PAYLOAD_BUCKETS",
            problem,
        };
        match self.large_payload_buckets.as_deref().map(str::trim) {
            _ if !self.large_payloads => Ok(None),
            None | Some("") => Err(bad(
                "required with SQS_ONCE_LARGE_PAYLOADS=on: the buckets (`bucket` or `bucket/prefix`, comma-separated) payloads may be read from (`*`: any, unsafe)".into(),
            )),
            Some("*") => Ok(None),
            Some(list) => PayloadLocation::parse_list(list).map(Some).map_err(bad),
        }
    }

    /// Where outgoing bodies too large for SQS are stored, if anywhere.
    pub(crate) fn outbox_payload_location(&self) -> Result<Option<PayloadLocation>, ConfigError> {
        let Some(text) = self.outbox_payload_bucket.as_deref().map(str::trim) else {
            return Ok(None);
        };
        let bad = |problem: String| ConfigError {
            setting: "SQS_ONCE_OUTBOX_PAYLOAD_BUCKET",
            problem,
        };
        if text.is_empty() {
            return Ok(None);
        }
        match PayloadLocation::parse_list(text).map_err(bad)?.as_slice() {
            [one] => Ok(Some(one.clone())),
            _ => Err(bad("one `bucket` or `bucket/prefix`, not a list".into())),
        }
    }

    fn dlq_url(&self) -> Option<String> {
        self.dlq_url.clone().filter(|u| !u.is_empty())
    }

    fn queue_url(&self) -> Option<String> {
        self.queue_url.clone().filter(|u| !u.is_empty())
    }

    /// The poller's settings, its queue URL empty when none is set.
    #[cfg(feature = "poller")]
    fn poller_config(&self) -> Result<PollerConfig, ConfigError> {
        let mut q = PollerConfig::new(self.queue_url().unwrap_or_default());
        q.dlq_url = self.dlq_url();
        q.concurrency = self.concurrency;
        q.prefetch = self.prefetch;
        q.drain = self.drain;
        q.wait_time = self.wait;
        if q.wait_time > Duration::from_secs(20) {
            return Err(ConfigError {
                setting: "SQS_ONCE_WAIT",
                problem: "SQS long polls wait at most 20s".into(),
            });
        }
        if q.drain + crate::runtime::poller::CLEANUP < q.wait_time {
            tracing::warn!(
                drain = ?q.drain, wait = ?q.wait_time,
                "SQS_ONCE_DRAIN (plus 5 s) is shorter than SQS_ONCE_WAIT: what a long poll open at shutdown takes may be left invisible for the lease (and hold its FIFO groups)"
            );
        }
        q.batch_wait = self.batch_wait;
        q.metrics_interval = (!self.metrics_interval.is_zero()).then_some(self.metrics_interval);
        q.exit_when_idle = self.exit_when_idle;
        q.liveness = self
            .health_port
            .map(|_| crate::runtime::poller::Liveness::new());
        Ok(q)
    }

    /// Validated processor and poller settings.
    #[cfg(feature = "poller")]
    pub fn poller_configs(&self) -> Result<(ProcessorConfig, PollerConfig), ConfigError> {
        let p = self.processor_config()?;
        if self.queue_url().is_none() {
            return Err(ConfigError {
                setting: "SQS_ONCE_QUEUE_URL",
                problem: "the poller needs the source queue's URL".into(),
            });
        }
        Ok((p, self.poller_config()?))
    }

    /// Validated processor and Lambda settings.
    #[cfg(feature = "lambda")]
    pub fn lambda_configs(&self) -> Result<(ProcessorConfig, LambdaConfig), ConfigError> {
        let p = self.processor_config()?;
        let l = LambdaConfig {
            dlq_url: self.dlq_url(),
            concurrency: self.concurrency,
            margin: self.lambda_margin,
            queue_url: self.queue_url(),
            emf: true,
            error_on_full_failure: self.lambda_full_failure == FullFailure::Error,
            check_retention: true,
        };
        Ok((p, l))
    }

    /// The front door with these settings, validated: `run` it with a
    /// handler (or change it further first). The poller's queue URL is
    /// checked when the poller starts, so Lambda needs none.
    ///
    /// ```no_run
    /// # async fn f(handler: impl sqs_once::Handler) -> Result<(), sqs_once::StartError> {
    /// sqs_once::settings::Settings::from_env()?
    ///     .builder()?
    ///     .run(handler)
    ///     .await
    /// # }
    /// ```
    pub fn builder(&self) -> Result<SqsOnce, ConfigError> {
        let processor = self.processor_config()?;
        let mut front = SqsOnce::builder(&self.table, &self.consumer)
            .processor_config(|c| *c = processor)
            .dynamodb_timeout(self.dynamodb_timeout);
        #[cfg(feature = "poller")]
        {
            let poller = self.poller_config()?;
            front = front.poller_config(|c| *c = poller);
        }
        #[cfg(feature = "lambda")]
        {
            let (_, lambda) = self.lambda_configs()?;
            front = front.lambda_config(|c| *c = lambda);
        }
        self.with_large_payloads(front)
    }

    #[cfg(feature = "s3-payloads")]
    fn with_large_payloads(&self, mut front: SqsOnce) -> Result<SqsOnce, ConfigError> {
        if let Some(location) = self.outbox_payload_location()? {
            front = front.send_large_through(location);
        }
        match self.payload_bucket_owner.as_deref().map(str::trim) {
            None | Some("") => {}
            Some("any") => front = front.any_payload_bucket_owner(),
            Some("queue") => front = front.payload_buckets_owned_by_the_queues_account(),
            Some(account) if account.len() == 12 && account.bytes().all(|b| b.is_ascii_digit()) => {
                front = front.payload_bucket_owner(account);
            }
            Some(other) => {
                return Err(ConfigError {
                    setting: "SQS_ONCE_PAYLOAD_BUCKET_OWNER",
                    problem: format!(
                        "`{other}` is not a 12-digit AWS account id, `queue` or `any`"
                    ),
                });
            }
        }
        if !self.large_payloads {
            return Ok(front);
        }
        let mut front = front.large_payloads(self.delete_payloads, self.large_payload_max_bytes);
        if let Some(bytes) = self.payload_budget_bytes {
            front = front.payload_budget_bytes(bytes);
        }
        Ok(match self.payload_locations()? {
            Some(places) => front.payload_buckets(places),
            None => front.any_payload_bucket(),
        })
    }

    #[cfg(not(feature = "s3-payloads"))]
    fn with_large_payloads(&self, front: SqsOnce) -> Result<SqsOnce, ConfigError> {
        if self.outbox_payload_location()?.is_some() {
            return Err(ConfigError {
                setting: "SQS_ONCE_OUTBOX_PAYLOAD_BUCKET",
                problem: "outgoing payloads through S3 need the `s3-payloads` feature of sqs-once"
                    .into(),
            });
        }
        if self.large_payloads {
            return Err(ConfigError {
                setting: "SQS_ONCE_LARGE_PAYLOADS",
                problem: "large payloads need the `s3-payloads` feature of sqs-once".into(),
            });
        }
        Ok(front)
    }
}

/// A secret setting's text: its `Debug` never shows it, so printing the
/// settings (`{settings:?}`) cannot leak it.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretText(String);

impl SecretText {
    /// The text itself, for the code that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SecretText(<redacted>)")
    }
}

impl std::str::FromStr for SecretText {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn from_map(vars: &BTreeMap<&str, &str>) -> Result<Settings, ConfigError> {
        Settings::from_vars(|name| vars.get(name).map(|v| (*v).to_owned()))
    }

    /// The same variables given to clap: each as the flag whose `env` it is
    /// (clap reads a variable as if it were its flag's value).
    #[cfg(feature = "env")]
    fn through_clap(vars: &BTreeMap<&str, &str>) -> Result<Settings, clap::Error> {
        use clap::{Args, FromArgMatches};
        let command = Settings::augment_args(clap::Command::new("consumer").no_binary_name(true));
        let mut argv = Vec::new();
        for arg in command.get_arguments() {
            let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
                continue;
            };
            if let Some(value) = vars.get(env.to_str().expect("a unicode name")) {
                argv.push(format!("--{long}={value}"));
            }
        }
        let matches = command.try_get_matches_from(argv)?;
        Settings::from_arg_matches(&matches)
    }

    /// Every variable set, none to its default.
    fn every_variable() -> BTreeMap<&'static str, &'static str> {
        BTreeMap::from([
            ("SQS_ONCE_QUEUE_URL", "https://sqs.example/1/q"),
            ("SQS_ONCE_TABLE", "dedup"),
            ("SQS_ONCE_CONSUMER", "orders"),
            ("SQS_ONCE_DEDUP_KEY", "json:/id"),
            ("SQS_ONCE_KEY_SCOPE", "sender"),
            ("SQS_ONCE_ALLOW_MISSING_KEY", "yes"),
            ("SQS_ONCE_DLQ_URL", "https://sqs.example/1/dlq"),
            ("SQS_ONCE_CONCURRENCY", "4"),
            ("SQS_ONCE_PREFETCH", "0"),
            ("SQS_ONCE_LEASE", "2m"),
            ("SQS_ONCE_TTL", "14d"),
            ("SQS_ONCE_HEARTBEAT", "30s"),
            ("SQS_ONCE_LEASE_MARGIN", "7s"),
            ("SQS_ONCE_DRAIN", "1m 30s"),
            ("SQS_ONCE_WAIT", "10s"),
            ("SQS_ONCE_BACKOFF", "500ms"),
            ("SQS_ONCE_BACKOFF_MAX", "2m"),
            ("SQS_ONCE_DYNAMODB_TIMEOUT", "3s"),
            ("SQS_ONCE_BATCH_WAIT", "200ms"),
            ("SQS_ONCE_METRICS_INTERVAL", "0s"),
            ("SQS_ONCE_EXIT_WHEN_IDLE", "15s"),
            ("SQS_ONCE_FAST_PATH", "OFF"),
            ("SQS_ONCE_PAYLOAD_MISMATCH", "park"),
            ("SQS_ONCE_CARRY_SECRET", "k0123456789abcdef0123456789abcdef"),
            ("SQS_ONCE_HASH_KEYS", "1"),
            ("SQS_ONCE_REDACT_REASONS", "true"),
            ("SQS_ONCE_TRUST_PRODUCER_SAMPLING", "on"),
            ("SQS_ONCE_LAMBDA_MARGIN", "4s"),
            ("SQS_ONCE_LAMBDA_FULL_FAILURE", "list"),
            ("SQS_ONCE_LARGE_PAYLOADS", "Y"),
            ("SQS_ONCE_DELETE_PAYLOADS", "t"),
            ("SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES", "1048576"),
            ("SQS_ONCE_PAYLOAD_BUDGET_BYTES", "134217728"),
            ("SQS_ONCE_ENVELOPE", "sns"),
            ("SQS_ONCE_PAYLOAD_POINTERS", "/a,/b/c"),
            ("SQS_ONCE_HEALTH_PORT", "8081"),
            ("SQS_ONCE_HEALTH_MAX_AGE", "90s"),
            ("SQS_ONCE_OUTBOX_PAYLOAD_BUCKET", "out/sent/"),
            ("SQS_ONCE_PAYLOAD_BUCKET_OWNER", "123456789012"),
            (
                "SQS_ONCE_LARGE_PAYLOAD_BUCKETS",
                "payloads, shared/tenant-a/",
            ),
        ])
    }

    #[cfg(feature = "poller")]
    #[test]
    fn the_front_doors_health_settings_read_as_the_settings_do() {
        let only = |table: bool| {
            move |n: &str| match n {
                "SQS_ONCE_TABLE" | "SQS_ONCE_CONSUMER" if table => Some("t".to_owned()),
                "SQS_ONCE_HEALTH_PORT" if !table => Some("8081".to_owned()),
                _ => None,
            }
        };
        let settings = Settings::from_vars(only(true)).unwrap();
        assert_eq!(
            crate::protocol::config::health_max_age_from(&only(true)).unwrap(),
            settings.health_max_age
        );
        assert_eq!(
            crate::protocol::config::health_port_from(&only(true)).unwrap(),
            settings.health_port
        );
        assert_eq!(
            crate::protocol::config::health_port_from(&only(false)).unwrap(),
            Some(8081)
        );
    }

    #[cfg(feature = "env")]
    #[test]
    fn from_env_and_clap_read_a_full_set_of_variables_alike() {
        let vars = every_variable();
        let command = <Settings as clap::Args>::augment_args(clap::Command::new("c"));
        // `--health` is an action (ask the poller beside), not a setting.
        let settings: Vec<_> = command
            .get_arguments()
            .filter(|a| a.get_id() != "health")
            .collect();
        for arg in &settings {
            let env = arg.get_env().expect("every setting has a variable");
            assert!(
                vars.contains_key(env.to_str().unwrap()),
                "{env:?} is missing from the full set"
            );
        }
        assert_eq!(vars.len(), settings.len());
        let loaded = from_map(&vars).expect("valid variables");
        assert_eq!(loaded, through_clap(&vars).expect("valid flags"));
        let required = [("SQS_ONCE_TABLE", "t"), ("SQS_ONCE_CONSUMER", "c")];
        let defaults = from_map(&BTreeMap::from(required)).unwrap();
        for (name, value) in &vars {
            let mut one = BTreeMap::from(required);
            one.insert(name, value);
            assert_ne!(
                from_map(&one).unwrap(),
                defaults,
                "{name}={value} is read as its default"
            );
        }
    }

    #[cfg(feature = "env")]
    #[test]
    fn from_env_and_clap_take_the_same_defaults() {
        let vars = BTreeMap::from([("SQS_ONCE_TABLE", "t"), ("SQS_ONCE_CONSUMER", "c")]);
        let loaded = from_map(&vars).unwrap();
        assert_eq!(loaded, through_clap(&vars).unwrap());
        assert_eq!(loaded.lease, Duration::from_secs(60));
        assert!(loaded.fast_path && !loaded.hash_keys);
        assert_eq!(loaded.lambda_full_failure, FullFailure::Error);
    }

    #[test]
    fn the_full_set_reaches_every_config() {
        let s = from_map(&every_variable()).unwrap();
        let (p, q) = s.poller_configs().unwrap();
        assert_eq!(p.lease, Duration::from_secs(120));
        assert_eq!(p.payload_mismatch, PayloadMismatch::Park);
        assert_eq!(p.missing_key, MissingKey::ProcessUnprotected);
        assert!(!p.fast_path && p.hash_keys && p.carry_secret.is_some());
        assert_eq!(q.drain, Duration::from_secs(90));
        assert_eq!(q.metrics_interval, None, "0s: never");
        assert_eq!(q.exit_when_idle, Some(Duration::from_secs(15)));
        let (_, l) = s.lambda_configs().unwrap();
        assert!(!l.error_on_full_failure);
        assert_eq!(l.margin, Duration::from_secs(4));
        assert_eq!(p.envelope, crate::Envelope::Sns);
        assert_eq!(p.payload_pointers, ["/a", "/b/c"]);
        assert!(
            q.liveness.is_some(),
            "SQS_ONCE_HEALTH_PORT turns the liveness on"
        );
        assert_eq!(s.health_max_age, Duration::from_secs(90));
        assert_eq!(
            s.outbox_payload_location().unwrap(),
            Some(PayloadLocation {
                bucket: "out".into(),
                prefix: "sent/".into()
            })
        );
        let _front = s.builder().expect("a front door");
    }

    #[test]
    fn envelope_payload_pointers_and_the_outbox_bucket_are_checked() {
        let base = BTreeMap::from([("SQS_ONCE_TABLE", "t"), ("SQS_ONCE_CONSUMER", "c")]);
        let c = from_map(&base).unwrap().processor_config().unwrap();
        assert_eq!(c.envelope, crate::Envelope::None);
        assert!(c.payload_pointers.is_empty());
        for (name, value) in [
            ("SQS_ONCE_PAYLOAD_POINTERS", "a"),
            ("SQS_ONCE_OUTBOX_PAYLOAD_BUCKET", "a,b"),
            ("SQS_ONCE_OUTBOX_PAYLOAD_BUCKET", "Not A Bucket"),
            ("SQS_ONCE_ENVELOPE", "kafka"),
        ] {
            let mut vars = base.clone();
            vars.insert(name, value);
            let bad = from_map(&vars)
                .and_then(|s| s.processor_config())
                .and_then(|c| c.validate());
            assert_eq!(bad.unwrap_err().setting, name, "{value}");
        }
    }

    #[test]
    fn bad_values_are_errors_naming_their_variable() {
        for (name, value, says) in [
            ("SQS_ONCE_LEASE", "soon", "not a duration"),
            ("SQS_ONCE_EXIT_WHEN_IDLE", "", "not a duration"),
            ("SQS_ONCE_FAST_PATH", "maybe", "not on or off"),
            ("SQS_ONCE_CONCURRENCY", "-1", "not a whole number"),
            ("SQS_ONCE_PAYLOAD_MISMATCH", "drop", "not one of warn, park"),
            (
                "SQS_ONCE_LAMBDA_FULL_FAILURE",
                "Error",
                "not one of error, list",
            ),
        ] {
            let mut vars = every_variable();
            vars.insert(name, value);
            let e = from_map(&vars).unwrap_err();
            assert_eq!(e.setting, name);
            assert!(e.problem.contains(says), "{e}");
        }
        let mut vars = every_variable();
        vars.remove("SQS_ONCE_TABLE");
        assert_eq!(from_map(&vars).unwrap_err().setting, "SQS_ONCE_TABLE");
    }

    #[cfg(feature = "env")]
    #[test]
    fn clap_rejects_bad_values_naming_the_variable_or_the_choices() {
        for (name, value, says) in [
            ("SQS_ONCE_LEASE", "soon", "SQS_ONCE_LEASE"),
            ("SQS_ONCE_HASH_KEYS", "maybe", "SQS_ONCE_HASH_KEYS"),
            ("SQS_ONCE_PREFETCH", "ten", "SQS_ONCE_PREFETCH"),
            (
                "SQS_ONCE_PAYLOAD_MISMATCH",
                "drop",
                "[possible values: warn, park]",
            ),
        ] {
            let mut vars = every_variable();
            vars.insert(name, value);
            let e = through_clap(&vars).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    /// The retry delay doubles up to `SQS_ONCE_BACKOFF_MAX`; a maximum below
    /// the first delay is refused at start-up, naming both.
    #[test]
    fn the_backoff_maximum_caps_the_delay_and_is_not_below_the_first() {
        let mut vars = every_variable();
        vars.insert("SQS_ONCE_BACKOFF", "1s");
        vars.insert("SQS_ONCE_BACKOFF_MAX", "30s");
        let c = from_map(&vars).unwrap().processor_config().unwrap();
        assert_eq!(c.backoff(1), Duration::from_secs(1));
        assert_eq!(c.backoff(5), Duration::from_secs(16));
        assert_eq!(c.backoff(9), Duration::from_secs(30));
        vars.insert("SQS_ONCE_BACKOFF_MAX", "500ms");
        let e = from_map(&vars).unwrap().processor_config().unwrap_err();
        assert_eq!(e.setting, "SQS_ONCE_BACKOFF");
        assert!(e.problem.contains("SQS_ONCE_BACKOFF_MAX"), "{}", e.problem);
    }

    /// Every value the docs and templates show for a setting still parses,
    /// both ways.
    #[test]
    fn documented_example_values_parse() {
        let durations = [
            "60s", "7d", "21d", "20s", "5s", "500ms", "0s", "1m", "14d", "1h 30m", "90s", "15m",
        ];
        for d in durations {
            let mut vars = every_variable();
            vars.insert("SQS_ONCE_EXIT_WHEN_IDLE", d);
            assert!(from_map(&vars).is_ok(), "{d}");
        }
        let switches = [
            "on", "off", "true", "false", "yes", "no", "1", "0", "ON", "True",
        ];
        for word in switches {
            let mut vars = every_variable();
            vars.insert("SQS_ONCE_HASH_KEYS", word);
            let s = from_map(&vars).unwrap_or_else(|e| panic!("{word}: {e}"));
            #[cfg(feature = "env")]
            assert_eq!(s, through_clap(&vars).unwrap(), "{word}");
            assert_eq!(
                s.hash_keys,
                ["on", "true", "yes", "1"].contains(&&*word.to_lowercase())
            );
        }
        for key in [
            "message-id",
            "dedup-id",
            "attribute:order_id",
            "json:/id",
            "body-sha256",
        ] {
            let mut vars = every_variable();
            vars.insert("SQS_ONCE_DEDUP_KEY", key);
            from_map(&vars).unwrap().processor_config().unwrap();
        }
    }

    #[cfg(feature = "env")]
    #[test]
    fn an_on_off_flag_alone_means_on() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            settings: Settings,
        }
        let base = ["x", "--table", "t", "--consumer", "c"];
        let cli = Cli::try_parse_from(base.iter().chain(&["--allow-missing-key", "--hash-keys"]))
            .unwrap();
        assert!(cli.settings.allow_missing_key && cli.settings.hash_keys);
        let cli = Cli::try_parse_from(base.iter().chain(&["--fast-path", "off"])).unwrap();
        assert!(!cli.settings.fast_path);
    }
}
