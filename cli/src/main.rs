//! `sqs-once`: set up and operate sqs-once consumers (init, inspect, forget,
//! redrive, stats), run a Lambda function locally, and walk through the demo.
//!
//! `main` sets up logging and turns the outcome into the exit code; [`run`]
//! runs the one command asked for. The command line is in `args.rs`, the
//! commands in `commands.rs` and `demo.rs`; what they do to AWS is in the
//! library target (`sqs_once_cli::{setup, ops, local_lambda}`).

mod args;
mod commands;
mod demo;
#[cfg(test)]
mod settings_tests;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqs-once: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the command asked for.
async fn run(cli: Cli) -> Result<(), BoxError> {
    let sdk = aws_config::load_from_env().await;
    match cli.command {
        Command::Init(args) if args.check => commands::check(&sdk, &args).await,
        Command::Init(args) => commands::init(&sdk, &args).await,
        Command::Inspect(key) => commands::inspect(&sdk, &key).await,
        Command::Forget(args) => commands::forget(&sdk, &args).await,
        Command::Redrive(args) => commands::redrive(&sdk, &args).await,
        Command::Stats(args) => commands::stats(&sdk, &args).await,
        Command::Demo(args) => demo::demo(&sdk, &args).await,
        Command::LocalLambda(args) => commands::local_lambda(&sdk, &args).await,
    }
}

/// Warnings to stderr, field values escaped.
fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqs_once=warn".into()),
        )
        .with_writer(std::io::stderr)
        .fmt_fields(sqs_once::env::escaped_fields())
        .init();
}
