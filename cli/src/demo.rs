//! `demo`: the ledger example end to end on LocalStack. It creates fresh
//! resources, sends ledger events with duplicates and malformed bodies, runs
//! the real `ledger` binary (as a poller, or as a Lambda function behind the
//! local Runtime API) until the queue is drained, and checks the balances.
//! The ledger sends each applied event on to a second queue through its
//! outbox; a second `ledger` poller applies them to an audit ledger, whose
//! balances must match too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use sqs_once_cli::local_lambda::{LocalLambda, run_event_source};
use sqs_once_cli::setup::{self, QueuePair};

use crate::BoxError;
use crate::args::{DemoArgs, Runtime};

/// One ledger event as the ledger example reads it (its `LedgerEvent`; the
/// operator tool does not depend on the example, a test checks the two agree).
#[derive(Debug, serde::Serialize)]
struct DemoEvent {
    id: String,
    account: String,
    amount_cents: i64,
}

/// The ledger example's binary, built next to this one by `cargo build
/// --workspace` (`scripts/demo`); an installed `sqs-once` has none.
fn ledger_binary() -> Result<PathBuf, BoxError> {
    let bin = std::env::current_exe()?
        .parent()
        .ok_or("no directory for this executable")?
        .join(format!("ledger{}", std::env::consts::EXE_SUFFIX));
    if !bin.is_file() {
        return Err(format!(
            "demo: it runs the ledger example's binary, which is not next to this one ({}): run `scripts/demo` in a clone of the repository, which builds both",
            bin.display()
        )
        .into());
    }
    Ok(bin)
}

/// The bodies that are not ledger events: one is not JSON, one lacks the amount.
const MALFORMED: [&str; 2] = ["not json", r#"{"id":"evt-bad","account":"acct-0"}"#];

/// Runs the demo; an error when a balance or a count is not what was sent.
pub(crate) async fn demo(sdk: &aws_config::SdkConfig, args: &DemoArgs) -> Result<(), BoxError> {
    if !args.allow_remote && !setup::is_local_endpoint(sdk.endpoint_url()) {
        return Err(format!(
            "demo: refusing to create tables and queues at {}: the demo is for LocalStack (set AWS_ENDPOINT_URL=http://localhost:4566), or pass --allow-remote to run it against this account",
            sdk.endpoint_url().unwrap_or("AWS's own endpoints")
        )
        .into());
    }
    ledger_binary()?;
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let resources = Resources::create(&ddb, &sqs).await?;
    let sent = Events::new(args.events)?;
    sent.send(&sqs, &resources.queues.queue_url).await?;
    let started = Instant::now();
    let processed = process(&sqs, args, &resources).await?;
    println!(
        "{} ({:.1} s incl. 3 s idle wait)",
        processed.summary,
        started.elapsed().as_secs_f64()
    );
    let parked = print_parked(&sqs, &resources.queues.dlq_url).await?;
    let balances_ok = check_balances(&ddb, &resources.ledger_table, &sent.expected).await?;
    let applied_events = count_applied(&ddb, &resources.ledger_table).await?;
    let events = args.events;
    if !balances_ok
        || applied_events != events
        || processed.applied.is_some_and(|a| a != events)
        || parked != MALFORMED.len()
    {
        return Err(format!(
            "ledger check failed: {applied_events} events recorded in the ledger for {events} sent"
        )
        .into());
    }
    println!(
        "every event applied exactly once; duplicates skipped; malformed bodies parked in the DLQ"
    );
    second_stage(&ddb, &resources, &sent, events).await
}

/// The pipeline's second stage: the events the first stage sent on through
/// its outbox (each recorded with its effect, sent after the commit, with a
/// stable `sqs_once_outbox_id`), applied to the audit ledger by a second
/// `ledger` poller keyed on that id.
async fn second_stage(
    ddb: &aws_sdk_dynamodb::Client,
    resources: &Resources,
    sent: &Events,
    events: usize,
) -> Result<(), BoxError> {
    let ledger_bin = ledger_binary()?;
    let env: Vec<(String, String)> = [
        ("SQS_ONCE_DLQ_URL", resources.next.dlq_url.as_str()),
        ("SQS_ONCE_TABLE", &resources.dedup_table),
        ("SQS_ONCE_CONSUMER", "demo-audit"),
        ("SQS_ONCE_DEDUP_KEY", "attribute:sqs_once_outbox_id"),
        ("LEDGER_TABLE", &resources.audit_table),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .chain([(
        "RUST_LOG".to_owned(),
        std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
    )])
    .collect();
    let stats = run_ledger_poller(&ledger_bin, &resources.next.queue_url, &env).await?;
    let n = |k: &str| stats[k].as_u64().unwrap_or(0);
    println!(
        "second stage (audit ledger, fed by the first stage's outbox): received {}, applied {}, duplicates skipped {}",
        n("received"),
        n("completed"),
        n("duplicates"),
    );
    let balances_ok = check_balances(ddb, &resources.audit_table, &sent.expected).await?;
    let applied = count_applied(ddb, &resources.audit_table).await?;
    if !balances_ok || applied != events {
        return Err(format!(
            "second stage check failed: {applied} events recorded in the audit ledger for {events} sent"
        )
        .into());
    }
    println!("the second stage applied every event exactly once, as sent on by the first");
    Ok(())
}

/// A demo run's resources, named after its run id.
struct Resources {
    dedup_table: String,
    ledger_table: String,
    queues: QueuePair,
    /// The second stage's queue (the first stage's outbox sends to it).
    next: QueuePair,
    /// The second stage's ledger.
    audit_table: String,
}

impl Resources {
    /// Creates the dedup table, the ledger table, and a queue with its DLQ.
    async fn create(
        ddb: &aws_sdk_dynamodb::Client,
        sqs: &aws_sdk_sqs::Client,
    ) -> Result<Self, BoxError> {
        let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let (dedup_table, ledger_table) =
            (format!("demo-dedup-{run}"), format!("demo-ledger-{run}"));
        let audit_table = format!("demo-audit-{run}");
        setup::ensure_dedup_table(ddb, &dedup_table).await?;
        setup::ensure_table(ddb, &ledger_table).await?;
        setup::ensure_table(ddb, &audit_table).await?;
        let queue = |name: String| async move {
            setup::ensure_queue_with_dlq(sqs, &name, false, Duration::from_secs(30), 5).await
        };
        let queues = queue(format!("demo-{run}")).await?;
        let next = queue(format!("demo-next-{run}")).await?;
        println!(
            "created two queues with DLQs (a two-stage pipeline), the dedup table and two ledger tables (run {run})"
        );
        Ok(Self {
            dedup_table,
            ledger_table,
            queues,
            next,
            audit_table,
        })
    }
}

/// The messages the demo sends and the balances they must add up to.
struct Events {
    /// The distinct events' count.
    events: usize,
    /// Every body in sending order: the events, about a third of them again
    /// (same id, so a new message id but the same dedup key), then [`MALFORMED`].
    bodies: Vec<String>,
    /// Of those, the duplicates.
    duplicates: usize,
    /// Each account's balance once every event is applied once.
    expected: BTreeMap<String, i64>,
}

impl Events {
    fn new(events: usize) -> Result<Self, serde_json::Error> {
        let mut expected: BTreeMap<String, i64> = BTreeMap::new();
        let mut bodies = Vec::new();
        for i in 0..events {
            let e = DemoEvent {
                id: format!("evt-{i}"),
                account: format!("acct-{}", i % 5),
                amount_cents: 100 + i as i64,
            };
            *expected.entry(e.account.clone()).or_default() += e.amount_cents;
            bodies.push(serde_json::to_string(&e)?);
        }
        let duplicates: Vec<String> = bodies.iter().step_by(3).cloned().collect();
        let duplicate_count = duplicates.len();
        bodies.extend(duplicates);
        bodies.extend(MALFORMED.map(str::to_owned));
        Ok(Self {
            events,
            bodies,
            duplicates: duplicate_count,
            expected,
        })
    }

    /// Sends every body to the queue, in batches of ten.
    async fn send(&self, sqs: &aws_sdk_sqs::Client, queue_url: &str) -> Result<(), BoxError> {
        for chunk in self.bodies.chunks(10) {
            let mut batch = sqs.send_message_batch().queue_url(queue_url);
            for (i, body) in chunk.iter().enumerate() {
                batch = batch.entries(
                    SendMessageBatchRequestEntry::builder()
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
            "sent {} messages: {} events, {} duplicates, {} malformed",
            self.bodies.len(),
            self.events,
            self.duplicates,
            MALFORMED.len()
        );
        Ok(())
    }
}

/// What the `ledger` run reported.
struct Processed {
    /// Events applied as the poller counted them (the Lambda runtime has no count).
    applied: Option<usize>,
    /// One line for the operator.
    summary: String,
}

/// Runs the real `ledger` binary (built next to this binary) in the runtime
/// asked for until the queue is drained.
async fn process(
    sqs: &aws_sdk_sqs::Client,
    args: &DemoArgs,
    resources: &Resources,
) -> Result<Processed, BoxError> {
    let ledger_bin = ledger_binary()?;
    let env = ledger_env(resources, args.general_path);
    let queue_url = &resources.queues.queue_url;
    match args.runtime {
        Runtime::Poller => {
            process_with_poller(&ledger_bin, queue_url, &env, args.general_path).await
        }
        Runtime::Lambda => process_as_lambda(sqs, ledger_bin, queue_url, env).await,
    }
}

/// The `ledger` binary's settings for these resources (`RUST_LOG` is this
/// process's, else `error`).
fn ledger_env(resources: &Resources, general_path: bool) -> Vec<(String, String)> {
    [
        ("SQS_ONCE_DLQ_URL", resources.queues.dlq_url.as_str()),
        ("SQS_ONCE_TABLE", &resources.dedup_table),
        ("SQS_ONCE_CONSUMER", "demo"),
        ("SQS_ONCE_DEDUP_KEY", "json:/id"),
        ("LEDGER_TABLE", &resources.ledger_table),
        ("LEDGER_FORWARD_QUEUE_URL", &resources.next.queue_url),
        (
            "SQS_ONCE_FAST_PATH",
            if general_path { "false" } else { "true" },
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .chain([(
        "RUST_LOG".to_owned(),
        std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
    )])
    .collect()
}

/// Runs `ledger` as a poller until the queue is idle; its counts and AWS calls per message.
async fn process_with_poller(
    ledger_bin: &Path,
    queue_url: &str,
    env: &[(String, String)],
    general_path: bool,
) -> Result<Processed, BoxError> {
    let stats = run_ledger_poller(ledger_bin, queue_url, env).await?;
    let n = |k: &str| stats[k].as_u64().unwrap_or(0);
    let mut summary = format!(
        "ledger poller ({} path): received {}, applied {}, duplicates skipped {}, parked {}, retried {}",
        if general_path { "general" } else { "fast" },
        n("received"),
        n("completed"),
        n("duplicates"),
        n("parked"),
        n("retried"),
    );
    summary.push_str(&calls_per_message(
        &stats["calls"],
        n("received"),
        n("empty_receives"),
    ));
    Ok(Processed {
        applied: Some(n("completed") as usize),
        summary,
    })
}

/// Runs `ledger` as a Lambda function fed by a local event source until the
/// queue is idle; its invocation counts.
async fn process_as_lambda(
    sqs: &aws_sdk_sqs::Client,
    ledger_bin: PathBuf,
    queue_url: &str,
    env: Vec<(String, String)>,
) -> Result<Processed, BoxError> {
    let lambda = LocalLambda::start(&ledger_bin, "ledger", Duration::from_secs(30), env)
        .await
        .map_err(|e| format!("cannot start {}: {e}", ledger_bin.display()))?;
    let stats = run_event_source(sqs, queue_url, &lambda, 10, Duration::from_secs(3)).await;
    lambda.shutdown().await;
    let stats = stats?;
    let summary = format!(
        "ledger Lambda: {} invocations, {} records, {} deleted, {} listed in batchItemFailures, {} failed invocations",
        stats.invocations,
        stats.records,
        stats.deleted,
        stats.reported_failed,
        stats.failed_invocations
    );
    Ok(Processed {
        applied: None,
        summary,
    })
}

/// Prints the DLQ's messages (at most ten) with their reasons; how many there were.
async fn print_parked(sqs: &aws_sdk_sqs::Client, dlq_url: &str) -> Result<usize, BoxError> {
    let parked = sqs
        .receive_message()
        .queue_url(dlq_url)
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
    Ok(parked.len())
}

/// Prints each account's balance against the expected one; whether all agree.
async fn check_balances(
    ddb: &aws_sdk_dynamodb::Client,
    ledger_table: &str,
    expected: &BTreeMap<String, i64>,
) -> Result<bool, BoxError> {
    let mut ok = true;
    for (account, want) in expected {
        let item = ddb
            .get_item()
            .table_name(ledger_table)
            .key("pk", AttributeValue::S(account.clone()))
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
    Ok(ok)
}

/// Runs the `ledger` binary as a poller until the queue is idle; returns its stats line.
async fn run_ledger_poller(
    ledger_bin: &std::path::Path,
    queue_url: &str,
    env: &[(String, String)],
) -> Result<serde_json::Value, BoxError> {
    let out = tokio::process::Command::new(ledger_bin)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("SQS_ONCE_QUEUE_URL", queue_url)
        .env("SQS_ONCE_EXIT_WHEN_IDLE", "3s")
        .env("SQS_ONCE_WAIT", "1s")
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .map_err(|e| {
            format!(
                "running {} (build it with `cargo build --workspace --bins`): {e}",
                ledger_bin.display()
            )
        })?;
    if !out.status.success() {
        return Err(format!("the ledger poller failed: {}", out.status).into());
    }
    Ok(serde_json::from_slice(
        out.stdout
            .split(|b| *b == b'\n')
            .rev()
            .find(|l| l.starts_with(b"{"))
            .unwrap_or(b"{}"),
    )?)
}

/// The number of events applied to the ledger (the sum of the accounts' `applied_events`).
async fn count_applied(
    ddb: &aws_sdk_dynamodb::Client,
    ledger_table: &str,
) -> Result<usize, BoxError> {
    let mut n = 0;
    let mut pages = ddb
        .scan()
        .table_name(ledger_table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item?;
        n += item
            .get("applied_events")
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0);
    }
    Ok(n)
}

/// AWS calls per received message by operation, without the start-up checks
/// (Describe*, GetQueueAttributes) and the empty receives of the idle wait.
fn calls_per_message(calls: &serde_json::Value, messages: u64, empty_receives: u64) -> String {
    let Some(calls) = calls.as_object() else {
        return String::new();
    };
    let per: Vec<(String, f64)> = calls
        .iter()
        .filter(|(op, _)| !op.contains(".Describe") && !op.ends_with(".GetQueueAttributes"))
        .map(|(op, n)| {
            let mut n = n.as_u64().unwrap_or(0);
            if op == "SQS.ReceiveMessage" {
                n = n.saturating_sub(empty_receives);
            }
            (op.clone(), n as f64 / messages.max(1) as f64)
        })
        .collect();
    let total: f64 = per.iter().map(|(_, v)| v).sum();
    let detail: Vec<String> = per.iter().map(|(op, v)| format!("{op} {v:.2}")).collect();
    format!(
        "\nAWS calls per message: {total:.2} ({}; plus {empty_receives} empty receives while idle)",
        detail.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::{Events, MALFORMED};

    #[test]
    fn the_demo_events_are_ledger_events() {
        let sent = Events::new(7).expect("events");
        let (events, malformed) = sent.bodies.split_at(sent.bodies.len() - MALFORMED.len());
        for body in events {
            serde_json::from_str::<sqs_once_example_ledger::LedgerEvent>(body)
                .unwrap_or_else(|e| panic!("{body}: {e}"));
        }
        for body in malformed {
            assert!(
                serde_json::from_str::<sqs_once_example_ledger::LedgerEvent>(body).is_err(),
                "{body}"
            );
        }
    }
}
