//! Logging: the format and filter the environment asks for, values
//! escaped, spans exported by OTLP with the feature `otel`.

pub use crate::protocol::logfmt::{escape, escaped_fields};

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
    if let Ok(format) = std::env::var("SQS_ONCE_LOG_FORMAT")
        && !["json", "text"]
            .iter()
            .any(|f| f.eq_ignore_ascii_case(format.trim()))
    {
        eprintln!("invalid setting SQS_ONCE_LOG_FORMAT: {format:?} is not json or text; ignored");
    }
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
        args: crate::env::RuntimeArgs,
    }

    fn parse(extra: &[&str]) -> Result<crate::env::RuntimeArgs, clap::Error> {
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
