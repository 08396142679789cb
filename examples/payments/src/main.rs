//! The payments example: charges each payment once through an HTTP payment API
//! that honours `Idempotency-Key`, as a Lambda function or a long-polling consumer.
//!
//! Configuration: the `SQS_ONCE_*` environment variables (or flags, see
//! `--help`), `PAYMENTS_URL`, and the standard AWS SDK settings.

use std::process::ExitCode;

use clap::Parser;
use sqs_once::env::RuntimeArgs;
use sqs_once_example_payments::PaymentHandler;

#[derive(Parser)]
#[command(
    version,
    about = "sqs-once payments example: one charge per payment, across crashes and redeliveries"
)]
struct Args {
    #[command(flatten)]
    runtime: RuntimeArgs,
    /// The payment API's base URL (`POST {url}/charges`).
    #[arg(long, env = "PAYMENTS_URL")]
    payments_url: String,
    /// Pause after the API answered, before completing (to watch a crash there).
    #[arg(long, env = "PAYMENTS_PAUSE_AFTER_CALL", default_value = "0s")]
    pause_after_call: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    sqs_once::env::init_logging();
    let args = Args::parse();
    let pause =
        match sqs_once::config::parse_duration("PAYMENTS_PAUSE_AFTER_CALL", &args.pause_after_call)
        {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
        };
    let handler = PaymentHandler::new(&args.payments_url).with_pause_after_call(pause);
    sqs_once::env::run(args.runtime, handler).await
}
