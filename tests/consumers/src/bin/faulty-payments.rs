//! The payments example's consumer with a fault injected (for the LocalStack
//! suites and the chaos harness; never a template):
//! `PAYMENTS_PAUSE_AFTER_CALL` (e.g. `60s`) waits after the API answered and
//! before the runtime records the charge, a window in which to crash the
//! consumer between the effect and its completion
//! ([`sqs_once::testkit::Faulty::pause_after`]).
//!
//! Everything else is the `payments` binary's: the `SQS_ONCE_*` settings,
//! `PAYMENTS_URL`, `PAYMENTS_CA_FILE`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sqs_once::env::RuntimeArgs;
use sqs_once::testkit::Faulty;
use sqs_once_example_payments::PaymentHandler;

#[derive(Parser)]
#[command(about = "the sqs-once payments example with a fault injected")]
struct Args {
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[arg(long, env = "PAYMENTS_URL")]
    payments_url: String,
    #[arg(long, env = "PAYMENTS_CA_FILE")]
    payments_ca_file: Option<std::path::PathBuf>,
    /// Pause after the API answered, before completing.
    #[arg(long, env = "PAYMENTS_PAUSE_AFTER_CALL", default_value = "0s", value_parser = pause)]
    pause_after_call: Duration,
}

fn pause(s: &str) -> Result<Duration, String> {
    sqs_once::config::parse_duration("PAYMENTS_PAUSE_AFTER_CALL", s).map_err(|e| e.to_string())
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
        Ok(payments) => {
            let handler = Faulty::new(payments).pause_after(args.pause_after_call);
            sqs_once::env::run(args.runtime, handler).await
        }
        Err(e) => {
            eprintln!("PAYMENTS_URL: {e}; not started");
            ExitCode::from(2)
        }
    }
}
