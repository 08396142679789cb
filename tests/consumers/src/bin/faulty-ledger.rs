//! The ledger example's consumer with faults injected (for the LocalStack
//! suites and the chaos harness; never a template):
//!
//! - `LEDGER_WORK` (e.g. `2s`) on `LEDGER_SLOW_PERCENT` % of events, and
//!   `LEDGER_PANIC_PERCENT` % of attempts panicking
//!   ([`sqs_once::testkit::Faulty`]);
//! - `LEDGER_MUTANT=delete-first`: a deliberately broken consumer that deletes
//!   each message before making its effect (a crash or a panic in between
//!   loses the event), for the chaos harness to catch;
//! - `SQS_ONCE_MUTANT` refused unless the build has the mutants.
//!
//! Everything else is the `ledger` binary's: the `SQS_ONCE_*` settings,
//! `LEDGER_TABLE`, `LEDGER_FORWARD_QUEUE_URL`.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sqs_once::env::RuntimeArgs;
use sqs_once::testkit::Faulty;
use sqs_once::{Context, Effects, Handler, HandlerResult, Message};
use sqs_once_example_ledger::LedgerHandler;

#[derive(Parser)]
#[command(about = "the sqs-once ledger example with faults injected")]
struct Args {
    #[command(flatten)]
    runtime: RuntimeArgs,
    #[arg(long, env = "LEDGER_TABLE")]
    ledger_table: String,
    #[arg(long, env = "LEDGER_FORWARD_QUEUE_URL")]
    forward_queue_url: Option<String>,
    /// Simulated work per event (e.g. `2s`), to watch heartbeats and crashes.
    #[arg(long, env = "LEDGER_WORK", default_value = "0s", value_parser = humantime_duration)]
    work: Duration,
    /// The percentage of events (by body) that take the simulated work.
    #[arg(long, env = "LEDGER_SLOW_PERCENT", default_value_t = 100)]
    slow_percent: u8,
    /// Panic on about this percentage of attempts.
    #[arg(long, env = "LEDGER_PANIC_PERCENT", default_value_t = 0)]
    panic_percent: u8,
    /// A deliberate bug for the chaos harness to catch (`delete-first`).
    #[arg(long, env = "LEDGER_MUTANT")]
    mutant: Option<String>,
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    sqs_once::config::parse_duration("LEDGER_WORK", s).map_err(|e| e.to_string())
}

/// The `delete-first` mutant: deletes the message, then runs the handler.
struct DeleteFirst<H> {
    inner: H,
    sqs: aws_sdk_sqs::Client,
    queue_url: String,
}

impl<H: Handler> Handler for DeleteFirst<H> {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        if let Some(receipt) = message.receipt_handle() {
            let delete = self.sqs.delete_message().queue_url(&self.queue_url);
            let _ = delete.receipt_handle(receipt).send().await;
        }
        self.inner.handle(message, ctx).await
    }

    fn effects(&self) -> Effects {
        self.inner.effects()
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    sqs_once::env::init_logging();
    let args = Args::parse();
    if std::env::var_os("SQS_ONCE_MUTANT").is_some() && !sqs_once::mutants::COMPILED {
        eprintln!(
            "SQS_ONCE_MUTANT is set but this build has no mutants (build with SQS_ONCE_MUTANTS=1); not started"
        );
        return ExitCode::from(2);
    }
    let mut ledger = LedgerHandler::new(args.ledger_table);
    if let Some(next) = args.forward_queue_url.filter(|u| !u.is_empty()) {
        ledger = ledger.with_forward(next);
    }
    let handler = Faulty::new(ledger)
        .work(args.work)
        .slow_percent(args.slow_percent)
        .panic_percent(args.panic_percent);
    match args.mutant.as_deref() {
        None | Some("") => sqs_once::env::run(args.runtime, handler).await,
        Some("delete-first") => {
            let Some(queue_url) = args.runtime.queue_url.clone() else {
                eprintln!("LEDGER_MUTANT=delete-first needs SQS_ONCE_QUEUE_URL; not started");
                return ExitCode::from(2);
            };
            let sqs = aws_sdk_sqs::Client::new(&aws_config::load_from_env().await);
            let handler = DeleteFirst {
                inner: handler,
                sqs,
                queue_url,
            };
            sqs_once::env::run(args.runtime, handler).await
        }
        Some(other) => {
            eprintln!("LEDGER_MUTANT={other} is not a known mutant (delete-first); not started");
            ExitCode::from(2)
        }
    }
}
