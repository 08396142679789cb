//! What the binaries share (the feature `env`): settings from
//! environment variables and flags, logging, and [`run`], which starts the
//! runtime the environment asks for: the Lambda runtime when
//! `AWS_LAMBDA_RUNTIME_API` is set, else the poller (until SIGTERM/SIGINT).
//!
//! - [`Settings`] (also named [`RuntimeArgs`]): every `SQS_ONCE_*` setting
//!   and its flag (from `sqs_once::settings`, which loads them without clap too);
//! - `logging`: the log format and filter, escaping, OTLP export;
//! - `health`: the poller's health answer (`SQS_ONCE_HEALTH_PORT`) and
//!   `--health`, which asks it;
//! - this module: [`run`], handing the settings to the front door.

use std::process::ExitCode;

use crate::Handler;
use crate::app::StartError;

use crate::runtime::health;
mod logging;

/// The binaries' settings: [`Settings`] under the name the binaries' flags
/// have always had.
pub use crate::settings::Settings as RuntimeArgs;
pub use crate::settings::{SecretText, Settings};
pub use logging::{LogChoice, escape, escaped_fields, init_logging};

pub use crate::app::shutdown_on_signals;
pub use crate::aws::attempt_timeouts;

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

/// Prints a start-up failure; exit code 2 (a failed Lambda runtime: 1).
fn startup_failure(e: impl Into<StartError>) -> ExitCode {
    let e = e.into();
    eprintln!("{e}");
    match e {
        StartError::Lambda(_) => ExitCode::FAILURE,
        _ => ExitCode::from(2),
    }
}

/// `--health`: asks the poller on `SQS_ONCE_HEALTH_PORT`; exit 0 if it is
/// alive, 1 if not, 2 for a setting missing.
pub async fn health_check(args: &RuntimeArgs) -> ExitCode {
    let Some(port) = args.health_port else {
        eprintln!("--health needs SQS_ONCE_HEALTH_PORT (the port the poller answers on)");
        return ExitCode::from(2);
    };
    let max_age = args.health_max_age;
    tokio::task::spawn_blocking(move || health::check(port, max_age))
        .await
        .unwrap_or(ExitCode::FAILURE)
}

/// Checks the table, then serves Lambda invocations. A start-up failure exits
/// with code 2 (Lambda reports it as an init error with the message in the log).
pub async fn run_lambda<H: Handler>(args: RuntimeArgs, handler: H) -> ExitCode {
    match args.builder() {
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
    // The poller's settings as checked, with the liveness the health answer
    // (served by the front door from the start) reads.
    let front = configs.and_then(|(_, poller)| {
        let front = args
            .builder()?
            .poller_config(|c| *c = poller)
            .shutdown_on(shutdown);
        Ok(match args.health_port {
            Some(port) => front.health_port(port),
            None => front,
        })
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
