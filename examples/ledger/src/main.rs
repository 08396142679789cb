//! The ledger example's consumer: [`LedgerHandler`] as a Lambda function (when
//! `AWS_LAMBDA_RUNTIME_API` is set) or as a long-polling consumer (ECS or any
//! host), through the front door that `sqs_once::env::run` builds from the
//! `SQS_ONCE_*` settings (or flags: `--help`). Its own settings:
//! `LEDGER_TABLE`, and `LEDGER_FORWARD_QUEUE_URL` (the next stage of a
//! pipeline, optional).

use std::process::ExitCode;

use clap::Parser;
use sqs_once::env::RuntimeArgs;
use sqs_once_example_ledger::LedgerHandler;

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
    /// The next stage's queue: each applied event is sent on to it (the outbox).
    #[arg(long, env = "LEDGER_FORWARD_QUEUE_URL")]
    forward_queue_url: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    sqs_once::env::init_logging();
    let args = Args::parse();
    let mut handler = LedgerHandler::new(args.ledger_table);
    if let Some(next) = args.forward_queue_url.filter(|url| !url.is_empty()) {
        handler = handler.with_forward(next);
    }
    sqs_once::env::run(args.runtime, handler).await
}
