//! What the binaries share (the feature `env`): settings from
//! environment variables and flags, logging, and [`run`], which starts the
//! runtime the environment asks for: the Lambda runtime when
//! `AWS_LAMBDA_RUNTIME_API` is set, else the poller (until SIGTERM/SIGINT).
//!
//! - [`settings`]: [`RuntimeArgs`], every `SQS_ONCE_*` setting and its flag;
//! - [`logging`]: the log format and filter, escaping, OTLP export;
//! - `health`: the poller's health answer (`SQS_ONCE_HEALTH_PORT`) and
//!   `--health`, which asks it;
//! - this module: [`run`], handing the settings to the front door.

use std::process::ExitCode;

use crate::Handler;
use crate::app::{SqsOnce, StartError};
use crate::protocol::config::{ConfigError, ProcessorConfig, parse_duration};

mod health;
mod logging;
mod settings;

pub use logging::{LogChoice, escape, escaped_fields, init_logging};
pub use settings::{RuntimeArgs, SecretText};

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
        if let Some(location) = self.outbox_payload_location()? {
            front = front.send_large_through(location);
        }
        Ok(front)
    }
}

/// Runs `handler` in the runtime the environment asks for: Lambda when
/// `AWS_LAMBDA_RUNTIME_API` is set, else the poller. With `--health` it runs
/// nothing: it asks the poller running beside whether it is alive.
pub async fn run<H: Handler>(args: RuntimeArgs, handler: H) -> ExitCode {
    if args.health {
        return health_check(&args).await;
    }
    if std::env::var_os("AWS_LAMBDA_RUNTIME_API").is_some() {
        run_lambda(args, handler).await
    } else {
        run_poller(args, handler).await
    }
}

/// `--health`: asks the poller on `SQS_ONCE_HEALTH_PORT`; exit 0 if it is
/// alive, 1 if not, 2 for a setting missing or invalid.
pub async fn health_check(args: &RuntimeArgs) -> ExitCode {
    let Some(port) = args.health_port else {
        eprintln!("--health needs SQS_ONCE_HEALTH_PORT (the port the poller answers on)");
        return ExitCode::from(2);
    };
    let max_age = match parse_duration("SQS_ONCE_HEALTH_MAX_AGE", &args.health_max_age) {
        Ok(max_age) => max_age,
        Err(e) => return startup_failure(e),
    };
    tokio::task::spawn_blocking(move || health::check(port, max_age))
        .await
        .unwrap_or(ExitCode::FAILURE)
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
    let configs = args.poller_configs();
    if let (Some(port), Ok((_, poller))) = (args.health_port, &configs)
        && let Some(liveness) = &poller.liveness
    {
        // Answered from the start, so a check during the start-up checks says
        // "not receiving yet" rather than nothing.
        if let Err(e) = health::serve(port, liveness.clone()).await {
            eprintln!("SQS_ONCE_HEALTH_PORT={port}: cannot listen on 127.0.0.1: {e}");
            return ExitCode::from(2);
        }
    }
    let front = configs.and_then(|(processor, poller)| {
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
