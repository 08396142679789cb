//! The ledger example: the same handler as a Lambda function (when
//! `AWS_LAMBDA_RUNTIME_API` is set) or as a long-polling consumer (ECS or any host).
//!
//! Configuration: the `SQS_ONCE_*` environment variables (or the equivalent
//! flags, see `--help`), `LEDGER_TABLE`, and the standard AWS SDK settings.

use std::process::ExitCode;

use clap::Parser;
use sqs_once::cli::RuntimeArgs;
use sqs_once::ledger::LedgerHandler;

#[derive(Parser)]
#[command(
    version,
    about = "sqs-once ledger example: applies each ledger event exactly once"
)]
struct Args {
    #[command(flatten)]
    runtime: RuntimeArgs,
    /// The ledger table (string partition key `pk`).
    #[arg(long, env = "LEDGER_TABLE")]
    ledger_table: String,
    /// Simulated work per event (e.g. `2s`), to watch heartbeats and crashes.
    #[arg(long, env = "LEDGER_WORK", default_value = "0s")]
    work: String,
    /// Panic on about this percentage of attempts (fault injection).
    #[arg(long, env = "LEDGER_PANIC_PERCENT", default_value_t = 0)]
    panic_percent: u8,
}

#[tokio::main]
async fn main() -> ExitCode {
    sqs_once::cli::init_logging();
    let args = Args::parse();
    let work = match sqs_once::config::parse_duration("LEDGER_WORK", &args.work) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let handler = LedgerHandler::new(args.ledger_table)
        .with_work(work)
        .with_panics(args.panic_percent);
    sqs_once::cli::run(args.runtime, handler).await
}
