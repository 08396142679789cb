//! The ledger example: the same handler as a Lambda function (when
//! `AWS_LAMBDA_RUNTIME_API` is set) or as a long-polling consumer (ECS or any host).
//!
//! Configuration: the `SQS_ONCE_*` environment variables (or the equivalent
//! flags, see `--help`), `LEDGER_TABLE`, `LEDGER_FORWARD_QUEUE_URL` (the next
//! stage of a pipeline, optional), and the standard AWS SDK settings.
//!
//! `LEDGER_MUTANT=delete-first` turns it into a deliberately broken consumer
//! that deletes each message from the queue before making its effect (so a
//! crash or a panic in between loses the event): the chaos harness must catch it.

use std::process::ExitCode;

use clap::Parser;
use sqs_once::env::RuntimeArgs;
use sqs_once::{Context, Effects, Handler, HandlerResult, Message};
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
    /// Simulated work per event (e.g. `2s`), to watch heartbeats and crashes.
    #[arg(long, env = "LEDGER_WORK", default_value = "0s")]
    work: String,
    /// The percentage of events (by id) that take the simulated work.
    #[arg(long, env = "LEDGER_SLOW_PERCENT", default_value_t = 100)]
    slow_percent: u8,
    /// Panic on about this percentage of attempts (fault injection).
    #[arg(long, env = "LEDGER_PANIC_PERCENT", default_value_t = 0)]
    panic_percent: u8,
    /// The next stage's queue: each applied event is sent on to it (the outbox).
    #[arg(long, env = "LEDGER_FORWARD_QUEUE_URL")]
    forward_queue_url: Option<String>,
    /// A deliberate bug for the chaos harness to catch (`delete-first`).
    #[arg(long, env = "LEDGER_MUTANT")]
    mutant: Option<String>,
}

/// The `delete-first` mutant: deletes the message, then runs the handler.
struct DeleteFirst {
    inner: LedgerHandler,
    sqs: aws_sdk_sqs::Client,
    queue_url: String,
}

impl Handler for DeleteFirst {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        if let Some(receipt) = message.receipt_handle() {
            let _ = self
                .sqs
                .delete_message()
                .queue_url(&self.queue_url)
                .receipt_handle(receipt)
                .send()
                .await;
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
    let work = match sqs_once::config::parse_duration("LEDGER_WORK", &args.work) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mut handler = LedgerHandler::new(args.ledger_table)
        .with_work(work)
        .with_slow_percent(args.slow_percent)
        .with_panics(args.panic_percent);
    if let Some(next) = args.forward_queue_url.filter(|u| !u.is_empty()) {
        handler = handler.with_forward(next);
    }
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
