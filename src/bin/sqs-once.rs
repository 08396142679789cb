//! `sqs-once`: set up resources and walk through the protocol.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sqs_once::DynamoStore;
use sqs_once::ledger::LedgerEvent;

#[derive(Parser)]
#[command(
    version,
    about = "Effectively-once processing of SQS messages: operations tool"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create (or check) the dedup table, with TTL on `expires_at`, and
    /// optionally a queue with its DLQ and redrive policy.
    ///
    /// Example: sqs-once init --table dedup --queue orders --fifo
    Init {
        /// The dedup table.
        #[arg(long, env = "SQS_ONCE_TABLE")]
        table: String,
        /// A queue to create with `<name>-dlq` as its dead-letter queue.
        #[arg(long)]
        queue: Option<String>,
        /// Make the queue (and DLQ) FIFO.
        #[arg(long)]
        fifo: bool,
        /// Receives before SQS moves a message to the DLQ.
        #[arg(long, default_value_t = 5)]
        max_receive_count: u32,
        /// The queue's visibility timeout in seconds.
        #[arg(long, default_value_t = 60)]
        visibility_timeout: u64,
    },
    /// Walk through the protocol on LocalStack: sends ledger events with
    /// duplicates and a malformed body, processes them, checks the balances.
    Demo {
        /// How many distinct events to send.
        #[arg(long, default_value_t = 40)]
        events: usize,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqs_once=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let sdk = aws_config::load_from_env().await;
    let result = match cli.command {
        Command::Init {
            table,
            queue,
            fifo,
            max_receive_count,
            visibility_timeout,
        } => {
            init(
                &sdk,
                &table,
                queue.as_deref(),
                fifo,
                max_receive_count,
                visibility_timeout,
            )
            .await
        }
        Command::Demo { events } => demo(&sdk, events).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqs-once: {e}");
            ExitCode::FAILURE
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn init(
    sdk: &aws_config::SdkConfig,
    table: &str,
    queue: Option<&str>,
    fifo: bool,
    max_receive_count: u32,
    visibility_timeout: u64,
) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    sqs_once::setup::ensure_dedup_table(&ddb, table).await?;
    DynamoStore::new(ddb, table).check_table().await?;
    println!("dedup table {table}: ok (key pk, TTL on expires_at)");
    if let Some(q) = queue {
        let pair = sqs_once::setup::ensure_queue_with_dlq(
            &aws_sdk_sqs::Client::new(sdk),
            q,
            fifo,
            Duration::from_secs(visibility_timeout),
            max_receive_count,
        )
        .await?;
        println!("queue {}\ndlq   {}", pair.queue_url, pair.dlq_url);
    }
    Ok(())
}

async fn demo(sdk: &aws_config::SdkConfig, events: usize) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (dedup_table, ledger_table) = (format!("demo-dedup-{run}"), format!("demo-ledger-{run}"));
    sqs_once::setup::ensure_dedup_table(&ddb, &dedup_table).await?;
    sqs_once::setup::ensure_table(&ddb, &ledger_table).await?;
    let queues = sqs_once::setup::ensure_queue_with_dlq(
        &sqs,
        &format!("demo-{run}"),
        false,
        Duration::from_secs(30),
        5,
    )
    .await?;
    println!("created queue, DLQ, dedup table and ledger table (run {run})");

    // Events, then ~30% sent again (same id, new message id), then two malformed bodies.
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();
    let mut bodies = Vec::new();
    for i in 0..events {
        let e = LedgerEvent {
            id: format!("evt-{i}"),
            account: format!("acct-{}", i % 5),
            amount_cents: 100 + i as i64,
        };
        *expected.entry(e.account.clone()).or_default() += e.amount_cents;
        bodies.push(serde_json::to_string(&e)?);
    }
    let duplicates: Vec<String> = bodies.iter().step_by(3).cloned().collect();
    let sent_duplicates = duplicates.len();
    bodies.extend(duplicates);
    bodies.push("not json".into());
    bodies.push(r#"{"id":"evt-bad","account":"acct-0"}"#.into());
    for chunk in bodies.chunks(10) {
        let mut batch = sqs.send_message_batch().queue_url(&queues.queue_url);
        for (i, body) in chunk.iter().enumerate() {
            batch = batch.entries(
                aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(body)
                    .build()?,
            );
        }
        let out = batch.send().await?;
        if !out.failed().is_empty() {
            return Err(format!("sending failed for {:?}", out.failed()).into());
        }
    }
    println!(
        "sent {} messages: {events} events, {sent_duplicates} duplicates, 2 malformed",
        bodies.len()
    );

    // Run the real `ledger` poller (built next to this binary) until the queue is drained.
    let ledger_bin = std::env::current_exe()?
        .parent()
        .ok_or("no directory for this executable")?
        .join("ledger");
    let started = std::time::Instant::now();
    let out = tokio::process::Command::new(&ledger_bin)
        .env("SQS_ONCE_QUEUE_URL", &queues.queue_url)
        .env("SQS_ONCE_DLQ_URL", &queues.dlq_url)
        .env("SQS_ONCE_TABLE", &dedup_table)
        .env("SQS_ONCE_CONSUMER", "demo")
        .env("SQS_ONCE_DEDUP_KEY", "json:/id")
        .env("SQS_ONCE_EXIT_WHEN_IDLE", "3s")
        .env("SQS_ONCE_WAIT", "1s")
        .env("LEDGER_TABLE", &ledger_table)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
        )
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .map_err(|e| {
            format!(
                "running {} (build it with `cargo build --bins`): {e}",
                ledger_bin.display()
            )
        })?;
    if !out.status.success() {
        return Err(format!("the ledger poller failed: {}", out.status).into());
    }
    let stats: serde_json::Value = serde_json::from_slice(
        out.stdout
            .split(|b| *b == b'\n')
            .find(|l| l.starts_with(b"{"))
            .unwrap_or(b"{}"),
    )?;
    let elapsed = started.elapsed();
    let n = |k: &str| stats[k].as_u64().unwrap_or(0);
    println!(
        "ledger poller: received {}, applied {}, duplicates skipped {}, parked {}, retried {} ({:.0} messages/s incl. 3 s idle wait)",
        n("received"),
        n("completed"),
        n("duplicates"),
        n("parked"),
        n("retried"),
        n("received") as f64 / elapsed.as_secs_f64()
    );
    let parked = sqs
        .receive_message()
        .queue_url(&queues.dlq_url)
        .max_number_of_messages(10)
        .message_attribute_names("All")
        .send()
        .await?
        .messages
        .unwrap_or_default();
    for m in &parked {
        let reason = m
            .message_attributes()
            .and_then(|a| a.get("sqs_once_reason"))
            .and_then(|v| v.string_value())
            .unwrap_or("(no reason)");
        println!("  in the DLQ: {:?}: {reason}", m.body().unwrap_or_default());
    }

    let mut ok = true;
    for (account, want) in &expected {
        let item = ddb
            .get_item()
            .table_name(&ledger_table)
            .key(
                "pk",
                aws_sdk_dynamodb::types::AttributeValue::S(account.clone()),
            )
            .consistent_read(true)
            .send()
            .await?
            .item
            .unwrap_or_default();
        let got: i64 = item
            .get("balance_cents")
            .and_then(|v| v.as_n().ok())
            .map_or(0, |v| v.parse().unwrap_or(0));
        let mark = if got == *want { "ok" } else { "WRONG" };
        ok &= got == *want;
        println!("  {account}: balance {got} cents, expected {want}: {mark}");
    }
    let applied = n("completed") as usize;
    if !ok || applied != events || parked.len() != 2 {
        return Err(format!("ledger check failed: {applied} applied for {events} events").into());
    }
    println!(
        "every event applied exactly once; duplicates skipped; malformed bodies parked in the DLQ"
    );
    Ok(())
}
