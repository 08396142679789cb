//! The payments example's consumer: [`PaymentHandler`] as a Lambda function
//! or a long-polling consumer, through the front door that
//! `sqs_once::env::run` builds from the `SQS_ONCE_*` settings (or flags:
//! `--help`). Its own settings: `PAYMENTS_URL` (`https://` only) and
//! `PAYMENTS_CA_FILE` (PEM certificates to trust beside the system's, for an
//! API behind a private CA).

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
    /// PEM certificates to trust beside the system's roots.
    #[arg(long, env = "PAYMENTS_CA_FILE")]
    payments_ca_file: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    sqs_once::env::init_logging();
    let args = Args::parse();
    let roots = match args
        .payments_ca_file
        .as_ref()
        .map(std::fs::read)
        .transpose()
    {
        Ok(roots) => roots,
        Err(e) => {
            eprintln!("PAYMENTS_CA_FILE: {e}; not started");
            return ExitCode::from(2);
        }
    };
    match PaymentHandler::new(&args.payments_url, roots.as_deref()) {
        Ok(handler) => sqs_once::env::run(args.runtime, handler).await,
        Err(e) => {
            eprintln!("PAYMENTS_URL: {e}; not started");
            ExitCode::from(2)
        }
    }
}
