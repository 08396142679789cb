//! What the binaries share (the default feature `cli`): settings from
//! environment variables and flags, logging, and [`run`], which starts the
//! runtime the environment asks for: the Lambda runtime when
//! `AWS_LAMBDA_RUNTIME_API` is set, else the poller (until SIGTERM/SIGINT).

use std::process::ExitCode;
use std::time::Duration;

use crate::app::{SqsOnce, StartError};
use crate::protocol::config::{
    ConfigError, MissingKey, PayloadMismatch, ProcessorConfig, parse_duration,
};
use crate::protocol::payloads::PayloadLocation;
use crate::runtime::lambda::LambdaConfig;
use crate::runtime::poller::PollerConfig;
use crate::{Handler, KeySource};

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
    /// Where the dedup key comes from: message-id, dedup-id, attribute:NAME, json:/pointer, body-sha256.
    #[arg(long, env = "SQS_ONCE_DEDUP_KEY", default_value = "message-id")]
    pub dedup_key: String,
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
    /// Use the one-transaction fast path for handlers that only stage DynamoDB
    /// writes (`false`/`off`: claim first, as for every other handler). Every
    /// on/off setting takes `true`/`false`, `on`/`off`, `yes`/`no` or `1`/`0`.
    #[arg(long, env = "SQS_ONCE_FAST_PATH", default_value = "true", value_parser = clap::builder::BoolishValueParser::new(), action = clap::ArgAction::Set)]
    pub fast_path: bool,
    /// A duplicate whose body differs from the recorded one (a producer reusing
    /// a key): `warn` (skip it as its key says, with a warning) or `park`.
    #[arg(long, env = "SQS_ONCE_PAYLOAD_MISMATCH", default_value = "warn", value_parser = ["warn", "park"])]
    pub payload_mismatch: String,
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
        if self.concurrency == 0 {
            return Err(ConfigError {
                setting: "SQS_ONCE_CONCURRENCY",
                problem: "must be at least 1".into(),
            });
        }
        Ok(p)
    }

    /// Where large payloads may be: `None` for anywhere (`*`).
    fn payload_locations(&self) -> Result<Option<Vec<PayloadLocation>>, ConfigError> {
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

/// `s` safe to print to a terminal: control characters (newlines, escape
/// sequences) and bidirectional overrides are escaped (`\n`, `\u{1b}`); all
/// else is as it is.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The text format's fields, each value escaped with [`escape`]: a
/// field carrying message content (a reason, a key read from a body) cannot
/// start a forged log line or send escape sequences to a terminal.
pub fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let text = escape(&format!("{value:?}"));
        if field.name() == "message" {
            write!(w, "{text}")
        } else {
            write!(w, "{field}={text}")
        }
    })
    .delimited(" ")
}

/// Logs to stderr: JSON or text (field values escaped: [`escaped_fields`])
/// and filtered as [`LogChoice::from_env`] says: `SQS_ONCE_LOG_FORMAT` and
/// `RUST_LOG` first, then Lambda's own log controls (`AWS_LAMBDA_LOG_FORMAT`,
/// `AWS_LAMBDA_LOG_LEVEL`), then JSON in Lambda and text elsewhere, at `info`. With the feature `otel`, spans are also exported by OTLP
/// when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (see `sqs_once::otel`), filtered
/// by `SQS_ONCE_TRACE_FILTER` (same syntax, default `info`) whatever
/// `RUST_LOG` says.
pub fn init_logging() {
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let choice = LogChoice::from_env(|name| std::env::var(name).ok());
    let filter = tracing_subscriber::EnvFilter::try_new(&choice.filter).unwrap_or_else(|e| {
        eprintln!("log filter {:?}: {e}; using info", choice.filter);
        tracing_subscriber::EnvFilter::new("info")
    });
    let json = choice.json;
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json().boxed()
    } else {
        fmt.fmt_fields(escaped_fields()).boxed()
    };
    #[cfg(feature = "otel")]
    let otel = crate::protocol::otel::layer()
        .unwrap_or_else(|e| {
            eprintln!("{e}; traces are not exported");
            None
        })
        .map(|layer| {
            let filter = std::env::var("SQS_ONCE_TRACE_FILTER").unwrap_or_else(|_| "info".into());
            let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
                eprintln!("SQS_ONCE_TRACE_FILTER: {e}; using info");
                tracing_subscriber::EnvFilter::new("info")
            });
            layer.with_filter(filter)
        });
    #[cfg(not(feature = "otel"))]
    let otel: Option<tracing_subscriber::layer::Identity> = None;
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .init();
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

/// How the logs are written and filtered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogChoice {
    /// JSON lines (else text).
    pub json: bool,
    /// The `EnvFilter` directives.
    pub filter: String,
}

impl LogChoice {
    /// From the environment (`var` reads one variable): the format from
    /// `SQS_ONCE_LOG_FORMAT` (`json` or `text`), else Lambda's
    /// `AWS_LAMBDA_LOG_FORMAT` (`JSON` or `Text`), else JSON inside Lambda and
    /// text elsewhere; the filter from `RUST_LOG`, else Lambda's
    /// `AWS_LAMBDA_LOG_LEVEL` (`TRACE` .. `FATAL`), else `info`.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Self {
        let in_lambda = var("AWS_LAMBDA_RUNTIME_API").is_some();
        let json = match var("SQS_ONCE_LOG_FORMAT").as_deref() {
            Some(f) if f.eq_ignore_ascii_case("json") => true,
            Some(f) if f.eq_ignore_ascii_case("text") => false,
            _ => match var("AWS_LAMBDA_LOG_FORMAT").as_deref() {
                Some(f) if f.eq_ignore_ascii_case("json") => true,
                Some(f) if f.eq_ignore_ascii_case("text") => false,
                _ => in_lambda,
            },
        };
        let lambda_level = var("AWS_LAMBDA_LOG_LEVEL").and_then(|l| {
            Some(match l.to_ascii_uppercase().as_str() {
                "TRACE" => "trace",
                "DEBUG" => "debug",
                "INFO" => "info",
                "WARN" => "warn",
                "ERROR" | "FATAL" => "error",
                _ => return None,
            })
        });
        let filter = var("RUST_LOG")
            .filter(|f| !f.trim().is_empty())
            .or_else(|| lambda_level.map(str::to_owned))
            .unwrap_or_else(|| "info".to_owned());
        Self { json, filter }
    }
}

pub use crate::app::shutdown_on_signals;
pub use crate::aws::attempt_timeouts;

impl RuntimeArgs {
    /// The front door with these settings' common part (table, consumer,
    /// processor, DynamoDB timeout, large payloads).
    fn front_door(&self, processor: ProcessorConfig) -> Result<SqsOnce, ConfigError> {
        let ddb_timeout = parse_duration("SQS_ONCE_DYNAMODB_TIMEOUT", &self.dynamodb_timeout)?;
        let mut front = SqsOnce::builder(&self.table, &self.consumer)
            .processor_config(|c| *c = processor)
            .dynamodb_timeout(ddb_timeout);
        if self.large_payloads {
            front = front.large_payloads(self.delete_payloads, self.large_payload_max_bytes);
            front = match self.payload_locations()? {
                Some(places) => front.payload_buckets(places),
                None => front.any_payload_bucket(),
            };
        }
        Ok(front)
    }
}

/// Runs `handler` in the runtime the environment asks for: Lambda when
/// `AWS_LAMBDA_RUNTIME_API` is set, else the poller.
pub async fn run<H: Handler>(args: RuntimeArgs, handler: H) -> ExitCode {
    if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
        run_lambda(args, handler).await
    } else {
        run_poller(args, handler).await
    }
}

/// Prints a start-up failure; exit code 2 (a failed Lambda runtime: 1).
fn startup_failure(e: impl Into<StartError>) -> ExitCode {
    let e = e.into();
    eprintln!("{e}");
    match e {
        StartError::Lambda(_) => ExitCode::FAILURE,
        _ => ExitCode::from(2),
    }
}

/// Checks the table, then serves Lambda invocations. A start-up failure exits
/// with code 2 (Lambda reports it as an init error with the message in the log).
pub async fn run_lambda<H: Handler>(args: RuntimeArgs, handler: H) -> ExitCode {
    let front = args.lambda_configs().and_then(|(processor, lambda)| {
        Ok(args.front_door(processor)?.lambda_config(|c| *c = lambda))
    });
    match front {
        Ok(front) => match front.run_lambda(handler).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => startup_failure(e),
        },
        Err(e) => startup_failure(e),
    }
}

/// Checks the table and queue, then runs the poller until a signal, and
/// prints what it did as one JSON line. The exit code is non-zero only for a
/// start-up failure.
pub async fn run_poller<H: Handler>(args: RuntimeArgs, handler: H) -> ExitCode {
    // First, so a signal during the start-up checks stops the process cleanly.
    let shutdown = shutdown_on_signals();
    let front = args.poller_configs().and_then(|(processor, poller)| {
        Ok(args
            .front_door(processor)?
            .poller_config(|c| *c = poller)
            .shutdown_on(shutdown))
    });
    let report = match front {
        Ok(front) => match front.run_poller(handler).await {
            Ok(report) => report,
            Err(e) => return startup_failure(e),
        },
        Err(e) => return startup_failure(e),
    };
    let (stats, calls) = (report.stats, report.calls);
    println!(
        "{}",
        serde_json::json!({
            "received": stats.received, "empty_receives": stats.empty_receives, "completed": stats.completed, "duplicates": stats.duplicates,
            "in_flight": stats.in_flight, "retried": stats.retried, "parked": stats.parked,
            "held_back": stats.held_back, "calls": calls,
        })
    );
    ExitCode::SUCCESS
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
}

#[cfg(test)]
mod log_tests {
    use super::LogChoice;

    fn choice(vars: &[(&str, &str)]) -> LogChoice {
        LogChoice::from_env(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn text_at_info_outside_lambda_json_inside() {
        assert_eq!(
            choice(&[]),
            LogChoice {
                json: false,
                filter: "info".into()
            }
        );
        let lambda = choice(&[("AWS_LAMBDA_RUNTIME_API", "127.0.0.1:9001")]);
        assert!(lambda.json);
    }

    #[test]
    fn lambdas_log_controls_are_honoured() {
        let text = choice(&[
            ("AWS_LAMBDA_RUNTIME_API", "127.0.0.1:9001"),
            ("AWS_LAMBDA_LOG_FORMAT", "Text"),
            ("AWS_LAMBDA_LOG_LEVEL", "WARN"),
        ]);
        assert_eq!(
            text,
            LogChoice {
                json: false,
                filter: "warn".into()
            }
        );
        let fatal = choice(&[
            ("AWS_LAMBDA_LOG_FORMAT", "JSON"),
            ("AWS_LAMBDA_LOG_LEVEL", "FATAL"),
        ]);
        assert_eq!(
            fatal,
            LogChoice {
                json: true,
                filter: "error".into()
            }
        );
    }

    #[test]
    fn the_projects_own_settings_win() {
        let own = choice(&[
            ("AWS_LAMBDA_RUNTIME_API", "127.0.0.1:9001"),
            ("AWS_LAMBDA_LOG_FORMAT", "JSON"),
            ("AWS_LAMBDA_LOG_LEVEL", "ERROR"),
            ("SQS_ONCE_LOG_FORMAT", "text"),
            ("RUST_LOG", "sqs_once=debug"),
        ]);
        assert_eq!(
            own,
            LogChoice {
                json: false,
                filter: "sqs_once=debug".into()
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::escape;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: super::RuntimeArgs,
    }

    fn parse(extra: &[&str]) -> Result<super::RuntimeArgs, clap::Error> {
        use clap::Parser;
        let base = ["x", "--table", "t", "--consumer", "c", "--queue-url", "q"];
        Cli::try_parse_from(base.iter().chain(extra)).map(|c| c.args)
    }

    #[test]
    fn large_payloads_are_off_unless_on_and_deletion_needs_them() {
        let off = parse(&[]).unwrap();
        assert!(!off.large_payloads && !off.delete_payloads);
        let on = parse(&["--large-payloads", "on", "--delete-payloads", "on"]).unwrap();
        assert!(on.large_payloads && on.delete_payloads);
        let e = on.poller_configs().unwrap_err();
        assert_eq!(
            e.setting, "SQS_ONCE_LARGE_PAYLOAD_BUCKETS",
            "required when on"
        );
        let buckets = |list: &str| {
            let mut args = on.clone();
            args.large_payload_buckets = Some(list.to_owned());
            args
        };
        let on = buckets("payloads-1, shared/tenant-a/");
        assert!(on.poller_configs().is_ok() && on.lambda_configs().is_ok());
        assert_eq!(
            on.payload_locations().unwrap().unwrap()[1],
            crate::protocol::payloads::PayloadLocation {
                bucket: "shared".into(),
                prefix: "tenant-a/".into()
            }
        );
        assert_eq!(buckets("*").payload_locations().unwrap(), None);
        let e = buckets("Bad_Bucket").poller_configs().unwrap_err();
        assert_eq!(e.setting, "SQS_ONCE_LARGE_PAYLOAD_BUCKETS");
        assert!(e.problem.contains("Bad_Bucket"), "{e}");
        let alone = parse(&["--delete-payloads", "on"]).unwrap();
        let e = alone.poller_configs().unwrap_err();
        assert_eq!(e.setting, "SQS_ONCE_DELETE_PAYLOADS");
        assert!(alone.lambda_configs().is_err());
        assert!(parse(&["--large-payloads", "maybe"]).is_err());
    }

    #[test]
    fn the_carry_secret_is_parsed_with_a_clear_error_that_never_quotes_it() {
        let none = parse(&[]).unwrap().poller_configs().unwrap().0;
        assert!(none.carry_secret.is_none());
        let long = "k".repeat(40);
        let set = parse(&["--carry-secret", &long]).unwrap();
        assert!(set.poller_configs().unwrap().0.carry_secret.is_some());
        let short = parse(&["--carry-secret", "hunter2-hunter2"]).unwrap();
        let e = short.poller_configs().unwrap_err();
        assert_eq!(e.setting, "SQS_ONCE_CARRY_SECRET");
        assert!(e.problem.contains("at least 32 bytes"), "{e}");
        assert!(!e.to_string().contains("hunter2"), "{e}");
        assert!(
            !format!("{short:?}").contains("hunter2"),
            "the settings' Debug shows no secret"
        );
    }

    #[test]
    fn the_key_reason_and_sampling_switches_are_off_by_default_and_reach_the_processor() {
        let off = parse(&[]).unwrap().poller_configs().unwrap().0;
        assert!(!off.hash_keys && !off.redact_reasons && !off.trust_producer_sampling);
        let on = parse(&[
            "--hash-keys",
            "on",
            "--redact-reasons",
            "yes",
            "--trust-producer-sampling",
            "true",
        ])
        .unwrap();
        for p in [
            on.poller_configs().unwrap().0,
            on.lambda_configs().unwrap().0,
        ] {
            assert!(p.hash_keys && p.redact_reasons && p.trust_producer_sampling);
        }
        for flag in [
            "--hash-keys",
            "--redact-reasons",
            "--trust-producer-sampling",
        ] {
            assert!(parse(&[flag, "maybe"]).is_err(), "{flag}");
        }
    }

    #[test]
    fn payload_mismatch_warns_by_default_parks_when_asked_and_takes_nothing_else() {
        use crate::protocol::config::PayloadMismatch;
        let mismatch = |extra: &[&str]| {
            parse(extra)
                .unwrap()
                .poller_configs()
                .unwrap()
                .0
                .payload_mismatch
        };
        assert_eq!(mismatch(&[]), PayloadMismatch::Warn);
        assert_eq!(
            mismatch(&["--payload-mismatch", "park"]),
            PayloadMismatch::Park
        );
        assert_eq!(
            mismatch(&["--payload-mismatch", "warn"]),
            PayloadMismatch::Warn
        );
        assert!(parse(&["--payload-mismatch", "drop"]).is_err());
    }

    #[test]
    fn escape_leaves_text_and_escapes_control_characters_and_bidi_overrides() {
        assert_eq!(escape("plain ünïcode text"), "plain ünïcode text");
        assert_eq!(
            escape("a\nforged line\u{1b}[31mred\r\u{202e}"),
            "a\\nforged line\\u{1b}[31mred\\r\\u{202e}"
        );
    }

    #[test]
    fn text_logs_escape_newlines_and_escape_sequences_in_fields() {
        let out = Buffer::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .fmt_fields(super::escaped_fields())
            .finish();
        let reason = "bad key\n2026-01-01T00:00:00Z  INFO forged: all good\u{1b}[2J";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(reason = %reason, key = "k", "parked");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "one line: {text}");
        assert!(!text.contains('\u{1b}'), "no escape character: {text}");
        assert!(
            text.contains("parked reason=bad key\\n2026-01-01T00:00:00Z  INFO forged: all good\\u{1b}[2J key=\"k\""),
            "{text}"
        );
    }
}
