//! The commands other than the demo: each prints what it did or found, and
//! returns an error (exit 1) when something failed or differs.

use std::time::Duration;

use sqs_once::DynamoStore;
use sqs_once::env::escape;
use sqs_once_cli::local_lambda::{LocalLambda, run_event_source};
use sqs_once_cli::ops;
use sqs_once_cli::setup::{self, Outcome};

use crate::BoxError;
use crate::args::{ForgetArgs, InitArgs, KeyArgs, LocalLambdaArgs, RedriveArgs, StatsArgs};

/// The redrive's options, its secret the one given or else the one kept in
/// `--table`; what it can re-apply is said before anything moves.
async fn redrive_options(
    sdk: &aws_config::SdkConfig,
    args: &RedriveArgs,
) -> Result<ops::RedriveOptions, BoxError> {
    let mut options = args.options()?;
    if options.carry_secret.is_none()
        && let Some(table) = &args.table
    {
        let ddb = aws_sdk_dynamodb::Client::new(sdk);
        options.carry_secret = DynamoStore::new(ddb, table.as_str())
            .table_carry_secret(false)
            .await?;
    }
    if !options.dry_run {
        for warning in redrive_warnings(&options) {
            eprintln!("warning: {warning}");
        }
    }
    Ok(options)
}

/// What a redrive with `options` can re-apply, said before anything moves.
pub(crate) fn redrive_warnings(options: &ops::RedriveOptions) -> Vec<&'static str> {
    let mut out = Vec::new();
    if options.move_task {
        out.push(
            "--move-task: SQS's message move task gives every message a new id and adds no attribute, so under `message-id` keys a message the queue's redrive policy moved (its effect perhaps made) runs again; parked copies keep their sealed key",
        );
    }
    if options.carry_secret.is_none() {
        out.push(
            "no carry secret (--carry-secret, SQS_ONCE_CARRY_SECRET, or the one kept in the dedup table: --table): copies carry no dedup key, so under `message-id`/`dedup-id` keys each runs under a new key and a message whose effect was made before it reached the DLQ applies it again",
        );
    }
    out
}

/// `init`: creates what is missing, reports how existing resources differ.
pub(crate) async fn init(sdk: &aws_config::SdkConfig, args: &InitArgs) -> Result<(), BoxError> {
    let table = &args.table;
    let allow = args.allowed();
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let mut outcome = Outcome::default();
    let o = setup::init_dedup_table(&ddb, table, &allow).await?;
    if o.created.iter().any(|c| c == &format!("table {table}")) && !args.no_protection {
        protect(&ddb, table).await?;
    }
    if o.differences.is_empty() {
        DynamoStore::new(ddb.clone(), table.as_str())
            .check_table()
            .await?;
        println!("dedup table {table}: ok (key pk, TTL on expires_at)");
        if !args.check {
            // The secret that seals the keys parked copies carry: made here
            // (or by the first consumer), read by consumers and `redrive`.
            DynamoStore::new(ddb.clone(), table.as_str())
                .table_carry_secret(true)
                .await?;
            println!(
                "carry secret: kept in {table} (item {}; producers must not read this table)",
                sqs_once::aws::dynamodb::CARRY_SECRET_ITEM
            );
        }
    }
    outcome.merge(o);
    if let Some(ledger) = &args.ledger_table {
        if setup::init_table(&ddb, ledger).await? {
            outcome.created.push(format!("table {ledger}"));
            if !args.no_protection {
                protect(&ddb, ledger).await?;
            }
        }
        println!("ledger table {ledger}: ok");
    }
    if let Some(spec) = args.queue_spec() {
        let sqs = aws_sdk_sqs::Client::new(sdk);
        let q = setup::init_queue_with_dlq(&sqs, &spec, &allow).await?;
        println!("queue {}", q.queue_url);
        if let Some(dlq) = &q.dlq_url {
            println!("dlq   {dlq}");
        }
        outcome.merge(q.outcome);
    }
    for c in &outcome.created {
        println!("created: {c}");
    }
    for c in &outcome.changed {
        println!("changed: {c}");
    }
    for d in &outcome.differences {
        println!("difference: {d}");
    }
    if outcome.differences.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} difference(s) left as they are: init changes an existing resource only with the flag named above",
        outcome.differences.len()
    )
    .into())
}

/// Turns on deletion protection and point-in-time recovery (35 days) on a
/// table init created: losing the dedup records makes every redelivery apply
/// again.
async fn protect(ddb: &aws_sdk_dynamodb::Client, table: &str) -> Result<(), BoxError> {
    use aws_sdk_dynamodb::types::PointInTimeRecoverySpecification;
    let failed = |what: &str, e: &dyn std::fmt::Display| {
        format!(
            "table {table} was created, but {what} could not be turned on ({e}); turn it on by hand, or run init with --no-protection on a new table"
        )
    };
    ddb.update_table()
        .table_name(table)
        .deletion_protection_enabled(true)
        .send()
        .await
        .map_err(|e| {
            failed(
                "deletion protection",
                &aws_smithy_types::error::display::DisplayErrorContext(e),
            )
        })?;
    let pitr = PointInTimeRecoverySpecification::builder()
        .point_in_time_recovery_enabled(true)
        .build()
        .map_err(|e| failed("point-in-time recovery", &e))?;
    ddb.update_continuous_backups()
        .table_name(table)
        .point_in_time_recovery_specification(pitr)
        .send()
        .await
        .map_err(|e| {
            failed(
                "point-in-time recovery",
                &aws_smithy_types::error::display::DisplayErrorContext(e),
            )
        })?;
    println!(
        "table {table}: deletion protection and point-in-time recovery on (--no-protection: off)"
    );
    Ok(())
}

/// `init --check`: reports every problem, changes nothing.
pub(crate) async fn check(sdk: &aws_config::SdkConfig, args: &InitArgs) -> Result<(), BoxError> {
    let mut problems = Vec::new();
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    match DynamoStore::new(ddb, args.table.as_str())
        .check_table()
        .await
    {
        Ok(()) => println!("dedup table {}: ok (key pk, TTL on expires_at)", args.table),
        Err(e) => problems.push(e.to_string()),
    }
    if let Some(spec) = args.queue_spec() {
        let sqs = aws_sdk_sqs::Client::new(sdk);
        match setup::check_queue(&sqs, &spec).await {
            Ok(found) => match (&found.dlq_url, found.outcome.differences.is_empty()) {
                (Some(dlq), true) => println!("queue {}: ok, redrive to {dlq}", found.queue_url),
                _ => problems.extend(found.outcome.differences.iter().map(ToString::to_string)),
            },
            Err(e) => problems.push(e.to_string()),
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    for p in &problems {
        println!("problem: {p}");
    }
    Err(format!(
        "{} problem(s); `sqs-once init` without --check creates what is missing (a change to an existing resource needs its flag)",
        problems.len()
    )
    .into())
}

/// `inspect`: prints the record of one key.
pub(crate) async fn inspect(sdk: &aws_config::SdkConfig, k: &KeyArgs) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    match ops::inspect(&ddb, &k.table, &k.pk()).await? {
        Some(r) => {
            println!("{}", ops::describe_record(&r, now_ms()));
            Ok(())
        }
        None => Err(format!(
            "no record for key {:?} of consumer {:?} in {} (never processed, forgotten, or removed by TTL)",
            k.key, k.consumer, k.table
        )
        .into()),
    }
}

/// `forget`: deletes the record of one key (a live claim only with --force).
pub(crate) async fn forget(sdk: &aws_config::SdkConfig, args: &ForgetArgs) -> Result<(), BoxError> {
    let (k, force) = (&args.key, args.force);
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    if args.dry_run {
        let pk = k.pk();
        return match ops::inspect(&ddb, &k.table, &pk).await? {
            None => {
                println!("dry run: no record for key {:?}: nothing to forget", k.key);
                Ok(())
            }
            Some(r) => {
                let live =
                    r.status == sqs_once::Status::InProgress && r.lease_until_ms >= ops::now_ms();
                let verdict = match (live, force) {
                    (true, false) => {
                        "would NOT be forgotten: IN_PROGRESS under a live claim (needs --force)"
                    }
                    (true, true) => "would be forgotten although a live claim holds it (--force)",
                    _ => "would be forgotten: the next delivery of this key is processed again",
                };
                println!(
                    "dry run: {pk} (now {}, {} attempt(s)) {verdict}",
                    r.status.as_str(),
                    r.attempts
                );
                Ok(())
            }
        };
    }
    match ops::forget(&ddb, &k.table, &k.pk(), force).await? {
        ops::Forgotten::Deleted(r) => {
            println!(
                "forgot {} (was {}, {} attempt(s)): the next delivery of this key is processed again",
                r.pk,
                r.status.as_str(),
                r.attempts
            );
            Ok(())
        }
        ops::Forgotten::Absent => {
            println!("no record for key {:?}: nothing to forget", k.key);
            Ok(())
        }
        ops::Forgotten::Unsent(r) => Err(format!(
            "not forgotten: {} holds {} message(s) its handler sent that are not yet sent; deleting it would lose them (the next delivery of the key sends them); use --force to delete it anyway",
            r.pk,
            r.outbox.len()
        )
        .into()),
        ops::Forgotten::InProgress(r) => Err(format!(
            "not forgotten: {} is IN_PROGRESS under a live claim until {} (a handler may be running); use --force to delete it anyway",
            r.pk,
            humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH
                    + Duration::from_millis(u64::try_from(r.lease_until_ms).unwrap_or(0))
            )
        )
        .into()),
    }
}

/// An SQS client whose every attempt is bounded, as the runtimes' clients
/// are: 3 s to connect, 20 s per attempt (well above redrive's 1 s long
/// poll), so an endpoint that does not answer fails the command after the
/// SDK's retries instead of hanging it.
fn sqs_with_timeouts(sdk: &aws_config::SdkConfig) -> aws_sdk_sqs::Client {
    let timeouts = aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(Duration::from_secs(3))
        .operation_attempt_timeout(Duration::from_secs(20))
        .build();
    let config = aws_sdk_sqs::config::Builder::from(sdk)
        .timeout_config(timeouts)
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

/// `redrive`: moves parked messages back to their source queue.
pub(crate) async fn redrive(
    sdk: &aws_config::SdkConfig,
    args: &RedriveArgs,
) -> Result<(), BoxError> {
    let options = &redrive_options(sdk, args).await?;
    let (dlq_url, queue_url) = (&args.dlq_url, &args.queue_url);
    let sqs = sqs_with_timeouts(sdk);
    let report = ops::redrive(&sqs, dlq_url, queue_url, options, |moved| {
        eprintln!("moved {moved}...");
    })
    .await?;
    if options.dry_run {
        println!(
            "dry run: about {} message(s) in {dlq_url} would move to {queue_url}; the first {}:",
            report.waiting,
            report.preview.len()
        );
        for (body, reason) in &report.preview {
            let body: String = body.chars().take(120).collect();
            println!("  {}: {}", escape(&body), escape(reason));
        }
        return Ok(());
    }
    if report.by_move_task {
        println!(
            "moved {} message(s) from {dlq_url} to {queue_url} (SQS message move task)",
            report.moved
        );
    } else {
        println!(
            "moved {} message(s) from {dlq_url} to {queue_url} (of at most {}: about {} were in the DLQ at the start{})",
            report.moved,
            report.limit,
            report.waiting,
            if options.max.is_some() { ", --max" } else { "" }
        );
    }
    for id in &report.in_both {
        eprintln!(
            "warning: message {} was sent to {queue_url} but not deleted from {dlq_url}: it is in both queues (the DLQ's copy is visible again in 60 s; its dedup key makes a second copy a duplicate, not a second effect)",
            escape(id)
        );
    }
    for id in &report.without_key {
        eprintln!(
            "warning: message {} was sent without a dedup key (no room for one under 10 attributes and the queue's size limit, or parked without one): under `message-id` keys it runs as a new message",
            escape(id)
        );
    }
    if !report.other_queues.is_empty() {
        eprintln!(
            "left {} message(s) of other queues that share {dlq_url} where they are (parked from, or moved from, another queue): redrive them to their own",
            report.other_queues.len()
        );
    }
    for (id, why) in &report.not_sent {
        eprintln!(
            "warning: message {} was not sent ({}); it stays in {dlq_url}, visible again in 60 s",
            escape(id),
            escape(why)
        );
    }
    if report.in_both.is_empty() && report.not_sent.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{} message(s) in both queues, {} not sent: see the warnings above",
        report.in_both.len(),
        report.not_sent.len()
    )
    .into())
}

/// `stats`: a consumer's records by status, the queue's and the DLQ's depth.
pub(crate) async fn stats(sdk: &aws_config::SdkConfig, args: &StatsArgs) -> Result<(), BoxError> {
    let (table, consumer) = (&args.table, &args.consumer);
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let counts = ops::count_records(
        &ddb,
        table,
        consumer,
        args.max_items,
        args.read_units_per_second,
        |c| eprintln!("scanned {} items...", c.scanned),
    )
    .await?;
    println!("records of consumer {consumer} in {table}:");
    for (status, n) in &counts.by_status {
        println!("  {:<12} {n}", escape(status));
    }
    if counts.by_status.is_empty() {
        println!("  (none)");
    }
    println!("  expired, not yet removed by TTL: {}", counts.expired);
    println!(
        "  IN_PROGRESS with an ended lease: {}",
        counts.stale_in_progress
    );
    if counts.truncated {
        println!(
            "  (stopped after {} items: --max-items; the counts are partial)",
            counts.scanned
        );
    }
    let sqs = aws_sdk_sqs::Client::new(sdk);
    for (name, url) in [("queue", &args.queue_url), ("dlq", &args.dlq_url)] {
        if let Some(url) = url {
            let d = ops::queue_depth(&sqs, url).await?;
            println!(
                "{name:<5} {url}: {} visible, {} in flight, {} delayed",
                d.visible, d.in_flight, d.delayed
            );
        }
    }
    Ok(())
}

/// `local-lambda`: starts the function behind a local Runtime API, then feeds
/// it the queue or invokes it once with the event file.
pub(crate) async fn local_lambda(
    sdk: &aws_config::SdkConfig,
    args: &LocalLambdaArgs,
) -> Result<(), BoxError> {
    if !args.allow_remote && !sqs_once_cli::setup::is_local_endpoint(sdk.endpoint_url()) {
        return Err(format!(
            "local-lambda: refusing to run against {}: it is for LocalStack (set AWS_ENDPOINT_URL=http://localhost:4566), or pass --allow-remote to let the function consume that account's queues from here",
            sdk.endpoint_url().unwrap_or("AWS's own endpoints")
        )
        .into());
    }
    let (timeout, idle) = (args.timeout, args.exit_when_idle);
    let function = &args.function;
    let name = function
        .file_name()
        .map_or("function".into(), |n| n.to_string_lossy().into_owned());
    let lambda = LocalLambda::start(function, &name, timeout, Vec::new())
        .await
        .map_err(|e| format!("cannot start {}: {e}", function.display()))?;
    let result = match (&args.queue_url, &args.event) {
        (Some(queue_url), _) => {
            let sqs = aws_sdk_sqs::Client::new(sdk);
            run_event_source(&sqs, queue_url, &lambda, args.batch_size, idle)
                .await
                .map(|stats| println!("{}", serde_json::to_string(&stats).expect("stats JSON")))
                .map_err(Into::into)
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let event: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
            match lambda.invoke(&event).await {
                Ok(response) => {
                    println!("{response}");
                    Ok(())
                }
                Err(e) => Err(e.into()),
            }
        }
        (None, None) => Err("give --queue-url or --event".into()),
    };
    lambda.shutdown().await;
    result
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
