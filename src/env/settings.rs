//! The runtimes' settings: each flag has an `SQS_ONCE_*` environment variable.

use std::time::Duration;

use crate::KeySource;
use crate::protocol::config::{
    ConfigError, MissingKey, PayloadMismatch, ProcessorConfig, parse_duration,
};
use crate::protocol::payloads::PayloadLocation;
use crate::runtime::lambda::LambdaConfig;
use crate::runtime::poller::{Liveness, PollerConfig};

/// The runtimes' settings; each flag has an `SQS_ONCE_*` environment variable.
#[derive(Debug, Clone, clap::Args)]
pub struct RuntimeArgs {
    /// The source queue URL (required for the poller; in Lambda it is looked up
    /// from the event's queue ARN unless given).
    #[arg(long, env = "SQS_ONCE_QUEUE_URL")]
    pub queue_url: Option<String>,
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    pub table: String,
    /// The consumer name: the namespace of its dedup records.
    #[arg(long, env = "SQS_ONCE_CONSUMER")]
    pub consumer: String,
    /// Where the dedup key comes from: message-id, dedup-id, attribute:NAME, json:/pointer (json:/a>/b inside a JSON string), body-sha256, or several joined by commas.
    #[arg(long, env = "SQS_ONCE_DEDUP_KEY", default_value = "message-id")]
    pub dedup_key: String,
    /// What wraps the payload in each body: none, sns (a notification
    /// without raw message delivery), eventbridge or s3. The dedup key and
    /// the handler read the payload inside.
    #[arg(long, env = "SQS_ONCE_ENVELOPE", default_value = "none", value_parser = ["none", "sns", "eventbridge", "s3"])]
    pub envelope: String,
    /// Process messages without a dedup key unprotected instead of parking them.
    #[arg(long, env = "SQS_ONCE_ALLOW_MISSING_KEY", default_value_t = false)]
    pub allow_missing_key: bool,
    /// The dead-letter queue URL for permanent failures.
    #[arg(long, env = "SQS_ONCE_DLQ_URL")]
    pub dlq_url: Option<String>,
    /// Handlers running at once at most (in Lambda: records, or FIFO groups, at once).
    #[arg(long, env = "SQS_ONCE_CONCURRENCY", default_value_t = 10)]
    pub concurrency: usize,
    /// Messages the poller receives ahead beyond the running ones, waiting
    /// (invisible) for a slot (0: receive only for free slots).
    #[arg(long, env = "SQS_ONCE_PREFETCH", default_value_t = 10)]
    pub prefetch: usize,
    /// Claim lease.
    #[arg(long, env = "SQS_ONCE_LEASE", default_value = "60s")]
    pub lease: String,
    /// Record retention (must exceed the queue's retention + redelivery window).
    #[arg(long, env = "SQS_ONCE_TTL", default_value = "7d")]
    pub ttl: String,
    /// Heartbeat interval: lease and visibility extension while a handler runs.
    #[arg(long, env = "SQS_ONCE_HEARTBEAT", default_value = "20s")]
    pub heartbeat: String,
    /// A handler whose lease could not be extended is interrupted this long
    /// before the lease ends (room for clock skew; at most a tenth of the lease).
    #[arg(long, env = "SQS_ONCE_LEASE_MARGIN", default_value = "5s")]
    pub lease_margin: String,
    /// Drain deadline at shutdown (then up to 5 s for releases and the last deletes).
    #[arg(long, env = "SQS_ONCE_DRAIN", default_value = "20s")]
    pub drain: String,
    /// Long-poll wait.
    #[arg(long, env = "SQS_ONCE_WAIT", default_value = "20s")]
    pub wait: String,
    /// First retry delay (doubled per receive).
    #[arg(long, env = "SQS_ONCE_BACKOFF", default_value = "2s")]
    pub backoff: String,
    /// How long one DynamoDB request may take before it is abandoned and sent
    /// again (with the same token: an abandoned write that committed is found).
    #[arg(long, env = "SQS_ONCE_DYNAMODB_TIMEOUT", default_value = "5s")]
    pub dynamodb_timeout: String,
    /// How long a receive waits for room to hold ten, and a delete for ten receipts.
    #[arg(long, env = "SQS_ONCE_BATCH_WAIT", default_value = "1s")]
    pub batch_wait: String,
    /// How often the poller prints its counters as CloudWatch EMF lines on stdout
    /// (`0s`: never; Lambda prints them after every invocation).
    #[arg(long, env = "SQS_ONCE_METRICS_INTERVAL", default_value = "60s")]
    pub metrics_interval: String,
    /// Exit once idle this long with nothing in flight (batch runs, demos, tests).
    #[arg(long, env = "SQS_ONCE_EXIT_WHEN_IDLE")]
    pub exit_when_idle: Option<String>,
    /// The poller answers health checks on 127.0.0.1:PORT (how long ago its
    /// receive loop last turned); `--health` asks it. Unset: no health check.
    #[arg(long, env = "SQS_ONCE_HEALTH_PORT")]
    pub health_port: Option<u16>,
    /// `--health` reports unhealthy when the receive loop last turned longer
    /// ago than this (it turns at least every long poll plus 10 s, or every
    /// 5 s while every slot is busy; a failing receive waits up to 20 s more).
    #[arg(long, env = "SQS_ONCE_HEALTH_MAX_AGE", default_value = "60s")]
    pub health_max_age: String,
    /// Do not run: ask the poller running beside (SQS_ONCE_HEALTH_PORT)
    /// whether it is alive and exit 0 if so, 1 if not (a container health
    /// check without a shell).
    #[arg(long)]
    pub health: bool,
    /// Use the one-transaction fast path for handlers that only stage DynamoDB
    /// writes (`false`/`off`: claim first, as for every other handler). Every
    /// on/off setting takes `true`/`false`, `on`/`off`, `yes`/`no` or `1`/`0`.
    #[arg(long, env = "SQS_ONCE_FAST_PATH", default_value = "true", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub fast_path: bool,
    /// A duplicate whose body differs from the recorded one (a producer reusing
    /// a key): `warn` (skip it as its key says, with a warning) or `park`.
    #[arg(long, env = "SQS_ONCE_PAYLOAD_MISMATCH", default_value = "warn", value_parser = ["warn", "park"])]
    pub payload_mismatch: String,
    /// JSON pointers, comma-separated, to the parts of the payload that tell
    /// "same key, different payload" (default: the whole payload).
    #[arg(long, env = "SQS_ONCE_PAYLOAD_POINTERS", value_delimiter = ',')]
    pub payload_pointers: Vec<String>,
    /// The secret that seals the dedup key and first message id a parked copy
    /// carries (at least 32 bytes; several separated by commas rotate: the
    /// first seals, each verifies). Only consumers and operators hold it: a
    /// carried key is honoured only when it verifies. Unset, nothing carried
    /// is honoured and parked copies carry no key.
    #[arg(long, env = "SQS_ONCE_CARRY_SECRET", hide_env_values = true)]
    pub carry_secret: Option<SecretText>,
    /// Hash dedup keys (`on`/`off`): records are keyed by, and logs and
    /// spans show, `sha256:{hex}` of the key instead of the key. Turning it
    /// on or off under a live queue makes duplicates of earlier messages run
    /// again: drain first (docs/OPERATIONS.md).
    #[arg(long, env = "SQS_ONCE_HASH_KEYS", default_value = "off", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub hash_keys: bool,
    /// Keep handler error text out of records, DLQ reasons, logs and span
    /// status (`on`/`off`): a fixed text names the failure's kind and the
    /// error's type instead.
    #[arg(long, env = "SQS_ONCE_REDACT_REASONS", default_value = "off", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub redact_reasons: bool,
    /// Let a producer's trace context decide whether a message's span is
    /// sampled (`on`/`off`). Off, the span stays in the producer's trace but
    /// this consumer's sampler (OTEL_TRACES_SAMPLER) decides.
    #[arg(long, env = "SQS_ONCE_TRUST_PRODUCER_SAMPLING", default_value = "off", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub trust_producer_sampling: bool,
    /// Lambda: no record is started with less time than this left in the invocation.
    #[arg(long, env = "SQS_ONCE_LAMBDA_MARGIN", default_value = "3s")]
    pub lambda_margin: String,
    /// Lambda: when every record of a batch is to come back, answer with an
    /// error (`error`, so the whole batch comes back even without
    /// ReportBatchItemFailures, and counts in Lambda's Errors) or with the
    /// full list (`list`).
    #[arg(long, env = "SQS_ONCE_LAMBDA_FULL_FAILURE", default_value = "error", value_parser = ["error", "list"])]
    pub lambda_full_failure: String,
    /// Large payloads (`on`/`off`, or `true`/`false`): a body that is an SQS Extended Client
    /// Library's S3 pointer is replaced by the object's content before the
    /// dedup key is read and the handler runs.
    #[arg(long, env = "SQS_ONCE_LARGE_PAYLOADS", default_value = "off", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub large_payloads: bool,
    /// Delete a large payload's object after its message is deleted
    /// (`on`/`off`; parked messages keep theirs). Needs large payloads on.
    #[arg(long, env = "SQS_ONCE_DELETE_PAYLOADS", default_value = "off", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub delete_payloads: bool,
    /// The largest large payload read, in bytes: a pointer that declares
    /// more is parked without calling S3, and a read is cut off past it.
    #[arg(long, env = "SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES", default_value_t = sqs_once_payload_max())]
    pub large_payload_max_bytes: usize,
    /// Where large payloads may be, comma-separated: `bucket` or
    /// `bucket/prefix`. A pointer to anything else is parked without calling
    /// S3. Required with large payloads on; `*` allows any bucket (unsafe).
    #[arg(long, env = "SQS_ONCE_LARGE_PAYLOAD_BUCKETS")]
    pub large_payload_buckets: Option<String>,
    /// Where outgoing bodies too large for SQS are stored (`bucket` or
    /// `bucket/prefix`): the handler's `ctx.send` of such a body stores it
    /// there and sends an extended client's pointer. Unset: such a send
    /// fails the message permanently.
    #[arg(long, env = "SQS_ONCE_OUTBOX_PAYLOAD_BUCKET")]
    pub outbox_payload_bucket: Option<String>,
}

/// The default of `SQS_ONCE_LARGE_PAYLOAD_MAX_BYTES`.
fn sqs_once_payload_max() -> usize {
    crate::protocol::payloads::DEFAULT_MAX_PAYLOAD_BYTES
}

impl RuntimeArgs {
    fn processor_config(&self) -> Result<ProcessorConfig, ConfigError> {
        let mut p = ProcessorConfig::new(&self.consumer);
        p.key_source = self
            .dedup_key
            .parse::<KeySource>()
            .map_err(|e| ConfigError {
                setting: "SQS_ONCE_DEDUP_KEY",
                problem: e.to_string(),
            })?;
        p.envelope = self.envelope.parse().map_err(|e| ConfigError {
            setting: "SQS_ONCE_ENVELOPE",
            problem: format!("{e}"),
        })?;
        if self.allow_missing_key {
            p.missing_key = MissingKey::ProcessUnprotected;
        }
        p.lease = parse_duration("SQS_ONCE_LEASE", &self.lease)?;
        p.ttl = parse_duration("SQS_ONCE_TTL", &self.ttl)?;
        p.heartbeat = parse_duration("SQS_ONCE_HEARTBEAT", &self.heartbeat)?;
        p.lease_margin = parse_duration("SQS_ONCE_LEASE_MARGIN", &self.lease_margin)?;
        p.backoff_base = parse_duration("SQS_ONCE_BACKOFF", &self.backoff)?;
        p.fast_path = self.fast_path;
        p.hash_keys = self.hash_keys;
        p.redact_reasons = self.redact_reasons;
        p.trust_producer_sampling = self.trust_producer_sampling;
        p.payload_mismatch = match self.payload_mismatch.as_str() {
            "park" => PayloadMismatch::Park,
            _ => PayloadMismatch::Warn,
        };
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
    pub(super) fn payload_locations(&self) -> Result<Option<Vec<PayloadLocation>>, ConfigError> {
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
    pub(super) fn outbox_payload_location(&self) -> Result<Option<PayloadLocation>, ConfigError> {
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

    /// Validated processor and poller settings.
    pub fn poller_configs(&self) -> Result<(ProcessorConfig, PollerConfig), ConfigError> {
        let p = self.processor_config()?;
        let Some(queue_url) = self.queue_url.as_deref().filter(|u| !u.is_empty()) else {
            return Err(ConfigError {
                setting: "SQS_ONCE_QUEUE_URL",
                problem: "the poller needs the source queue's URL".into(),
            });
        };
        let mut q = PollerConfig::new(queue_url);
        q.dlq_url = self.dlq_url();
        q.concurrency = self.concurrency;
        q.prefetch = self.prefetch;
        q.drain = parse_duration("SQS_ONCE_DRAIN", &self.drain)?;
        q.wait_time = parse_duration("SQS_ONCE_WAIT", &self.wait)?;
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
        q.batch_wait = parse_duration("SQS_ONCE_BATCH_WAIT", &self.batch_wait)?;
        let every = parse_duration("SQS_ONCE_METRICS_INTERVAL", &self.metrics_interval)?;
        q.metrics_interval = (!every.is_zero()).then_some(every);
        q.exit_when_idle = self
            .exit_when_idle
            .as_deref()
            .map(|v| parse_duration("SQS_ONCE_EXIT_WHEN_IDLE", v))
            .transpose()?;
        q.liveness = self.health_port.map(|_| Liveness::new());
        Ok((p, q))
    }

    /// Validated processor and Lambda settings.
    pub fn lambda_configs(&self) -> Result<(ProcessorConfig, LambdaConfig), ConfigError> {
        let p = self.processor_config()?;
        let l = LambdaConfig {
            dlq_url: self.dlq_url(),
            concurrency: self.concurrency,
            margin: parse_duration("SQS_ONCE_LAMBDA_MARGIN", &self.lambda_margin)?,
            queue_url: self.queue_url.clone().filter(|u| !u.is_empty()),
            emf: true,
            error_on_full_failure: self.lambda_full_failure == "error",
            check_retention: true,
        };
        Ok((p, l))
    }
}

/// A secret setting's text: its `Debug` never shows it, so printing the
/// settings (`{args:?}`) cannot leak it.
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
mod settings_tests {
    use clap::Parser;

    #[derive(Parser)]
    struct Args {
        #[command(flatten)]
        runtime: super::RuntimeArgs,
    }

    fn parse(extra: &[&str]) -> super::RuntimeArgs {
        let mut argv = vec!["consumer", "--table", "t", "--consumer", "c"];
        argv.extend_from_slice(extra);
        Args::try_parse_from(argv).expect("valid flags").runtime
    }

    #[test]
    fn on_off_settings_share_one_vocabulary() {
        for (value, on) in [
            ("on", true),
            ("off", false),
            ("true", true),
            ("false", false),
            ("1", true),
            ("no", false),
        ] {
            let args = parse(&["--fast-path", value, "--large-payloads", value]);
            assert_eq!((args.fast_path, args.large_payloads), (on, on), "{value}");
        }
        assert!(
            Args::try_parse_from([
                "consumer",
                "--table",
                "t",
                "--consumer",
                "c",
                "--fast-path",
                "maybe"
            ])
            .is_err()
        );
    }

    #[test]
    fn envelope_and_payload_pointers_reach_the_processor_config() {
        let c = parse(&["--envelope", "sns", "--payload-pointers", "/a, /b/c"])
            .processor_config()
            .unwrap();
        assert_eq!(c.envelope, crate::Envelope::Sns);
        assert_eq!(c.payload_pointers, ["/a", "/b/c"]);
        let c = parse(&[]).processor_config().unwrap();
        assert_eq!(c.envelope, crate::Envelope::None);
        assert!(c.payload_pointers.is_empty());
        let bad = parse(&["--payload-pointers", "a"])
            .processor_config()
            .and_then(|c| c.validate());
        assert_eq!(bad.unwrap_err().setting, "SQS_ONCE_PAYLOAD_POINTERS");
    }
}
