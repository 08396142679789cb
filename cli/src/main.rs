//! `sqs-once`: set up and operate sqs-once consumers (init, inspect, forget,
//! redrive, stats), run a Lambda function locally, and walk through the demo.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sqs_once::DynamoStore;
use sqs_once_cli::local_lambda::{LocalLambda, run_event_source};
use sqs_once_cli::ops;
use sqs_once_example_ledger::LedgerEvent;

#[derive(Parser)]
#[command(
    version,
    about = "Effectively-once processing of SQS messages: operations tool"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct InitArgs {
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    table: String,
    /// A queue to create with `<name>-dlq` as its dead-letter queue.
    #[arg(long)]
    queue: Option<String>,
    /// Make the queue (and DLQ) FIFO.
    #[arg(long)]
    fifo: bool,
    /// Receives before SQS moves a message to the DLQ (new queue: 5; an existing
    /// queue is compared only when given).
    #[arg(long)]
    max_receive_count: Option<u32>,
    /// The queue's visibility timeout in seconds (new queue: 60; an existing
    /// queue is compared only when given).
    #[arg(long)]
    visibility_timeout: Option<u64>,
    /// Also create the ledger example's table (string key `pk`).
    #[arg(long)]
    ledger_table: Option<String>,
    /// Only report what is missing or wrong; create nothing.
    #[arg(long)]
    check: bool,
    /// Change an existing dedup table: enable TTL on `expires_at` (its keys are
    /// checked first; TTL deletes expired items).
    #[arg(long)]
    enable_ttl: bool,
    /// Change an existing queue: set its visibility timeout to --visibility-timeout.
    #[arg(long, requires = "visibility_timeout")]
    set_visibility_timeout: bool,
    /// Change an existing queue: point its redrive policy at `<name>-dlq` (created
    /// if missing), after --max-receive-count receives (else its current count, else 5).
    #[arg(long)]
    set_redrive_policy: bool,
}

impl InitArgs {
    fn allowed(&self) -> Vec<sqs_once_cli::setup::Change> {
        use sqs_once_cli::setup::Change;
        [
            (self.enable_ttl, Change::EnableTtl),
            (self.set_visibility_timeout, Change::SetVisibilityTimeout),
            (self.set_redrive_policy, Change::SetRedrivePolicy),
        ]
        .into_iter()
        .filter_map(|(on, c)| on.then_some(c))
        .collect()
    }
}

#[derive(clap::Args)]
struct KeyArgs {
    /// The dedup key (e.g. the business id the consumer's SQS_ONCE_DEDUP_KEY reads).
    key: String,
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    table: String,
    /// The consumer whose record it is.
    #[arg(long, env = "SQS_ONCE_CONSUMER")]
    consumer: String,
}

#[derive(Subcommand)]
enum Command {
    /// Create the dedup table (key `pk`, TTL on `expires_at`) and optionally a
    /// queue with its DLQ and redrive policy, standard or FIFO. Creates what is
    /// missing and never changes what exists: an existing table's keys are
    /// checked before anything is written to it, and a difference (TTL off,
    /// another visibility timeout or redrive target) is reported (exit 1) and
    /// changed only with the flag that names the change (--enable-ttl,
    /// --set-visibility-timeout, --set-redrive-policy). With --check, only
    /// report what is missing or wrong (exit 1 if anything is).
    ///
    /// Example: sqs-once init --table dedup --queue orders --fifo
    ///
    /// Example: sqs-once init --table dedup --queue orders --check
    ///
    /// Example: sqs-once init --table dedup --queue orders --visibility-timeout 360 --set-visibility-timeout
    Init(InitArgs),
    /// Show the dedup record of one key: status, owner, lease, attempts, times,
    /// result (or its digest) and last error.
    ///
    /// Example: sqs-once inspect evt-42 --table dedup --consumer ledger
    Inspect(KeyArgs),
    /// Delete the dedup record of one key so its event can be processed again
    /// (e.g. after fixing the effect by hand). Refuses a record under a live
    /// claim unless --force: its handler may still be running.
    ///
    /// Example: sqs-once forget evt-42 --table dedup --consumer ledger
    Forget {
        #[command(flatten)]
        key: KeyArgs,
        /// Delete even a record under a live claim.
        #[arg(long)]
        force: bool,
    },
    /// Move parked messages from a DLQ back to their source queue: with SQS's
    /// message move task where available (all messages), else (or with --max,
    /// or FIFO) by receive, send, then delete, so a crash never loses a message.
    /// Refuses unless the source queue's redrive policy names the DLQ. Every
    /// message attribute is kept as it is (the dedup key parking recorded among
    /// them): a message left in both queues by a crash or a failed delete is
    /// reported, and its second copy is a duplicate, not a second effect.
    ///
    /// Example: sqs-once redrive --dlq-url $DLQ --queue-url $QUEUE --max 100
    ///
    /// Example: sqs-once redrive --dlq-url $DLQ --queue-url $QUEUE --dry-run
    Redrive {
        /// The dead-letter queue to empty.
        #[arg(long, env = "SQS_ONCE_DLQ_URL")]
        dlq_url: String,
        /// The source queue to move them to.
        #[arg(long, env = "SQS_ONCE_QUEUE_URL")]
        queue_url: String,
        /// Move at most this many.
        #[arg(long)]
        max: Option<u64>,
        /// Show what would move; move nothing.
        #[arg(long)]
        dry_run: bool,
        /// Move even when the source queue's redrive policy does not name
        /// --dlq-url (by default that is refused: swapped URLs would move live
        /// messages into the DLQ unprocessed).
        #[arg(long)]
        skip_redrive_check: bool,
    },
    /// Count a consumer's records by status (a bounded scan, with progress) and
    /// show the queue's and the DLQ's depth.
    ///
    /// Cost: a Scan reads the whole table (every consumer's records, at most
    /// --max-items): about 0.5 read capacity units per 4 KB, e.g. ~125 units per
    /// million small (~1 KB) records. It is paced to --read-units-per-second;
    /// on a provisioned table keep that well below the table's read capacity,
    /// which the live claims share.
    ///
    /// Example: sqs-once stats --table dedup --consumer ledger --queue-url $QUEUE --dlq-url $DLQ
    Stats {
        /// The dedup table.
        #[arg(long, env = "SQS_ONCE_TABLE")]
        table: String,
        /// The consumer whose records to count.
        #[arg(long, env = "SQS_ONCE_CONSUMER")]
        consumer: String,
        /// The source queue.
        #[arg(long, env = "SQS_ONCE_QUEUE_URL")]
        queue_url: Option<String>,
        /// Its DLQ.
        #[arg(long, env = "SQS_ONCE_DLQ_URL")]
        dlq_url: Option<String>,
        /// Read at most this many items (the scan costs read capacity).
        #[arg(long, default_value_t = 1_000_000)]
        max_items: u64,
        /// Read capacity units per second the scan may use on average (0: no limit).
        #[arg(long, default_value_t = 50.0)]
        read_units_per_second: f64,
    },
    /// Walk through the protocol on LocalStack: sends ledger events with
    /// duplicates and a malformed body, processes them, checks the balances.
    ///
    /// Example: sqs-once demo --events 300 --runtime lambda
    Demo {
        /// How many distinct events to send.
        #[arg(long, default_value_t = 40)]
        events: usize,
        /// Run the `ledger` binary as a long-polling consumer (`poller`) or as a
        /// Lambda function behind a local Runtime API and SQS event source (`lambda`).
        #[arg(long, value_enum, default_value_t = Runtime::Poller)]
        runtime: Runtime,
        /// Claim before every event (two DynamoDB calls each) instead of the
        /// one-transaction fast path the ledger handler qualifies for.
        #[arg(long)]
        general_path: bool,
    },
    /// Run a Lambda function binary locally: serve the Lambda Runtime API, start
    /// the binary against it, and feed it a queue's messages in batches as Lambda's
    /// event source mapping does (deleting what it does not list in
    /// `batchItemFailures`), or invoke it once with an event file.
    ///
    /// The function gets this process's environment (SQS_ONCE_*, AWS_ENDPOINT_URL, ...).
    ///
    /// Example: sqs-once local-lambda --function target/debug/ledger --queue-url http://localhost:4566/000000000000/orders
    LocalLambda {
        /// The function binary (built for this machine).
        #[arg(long)]
        function: std::path::PathBuf,
        /// Feed this queue to the function until it is idle.
        #[arg(long, required_unless_present = "event", conflicts_with = "event")]
        queue_url: Option<String>,
        /// Invoke once with this event file and print the response.
        #[arg(long)]
        event: Option<std::path::PathBuf>,
        /// The function timeout.
        #[arg(long, default_value = "30s")]
        timeout: String,
        /// Records per invocation (1 to 10).
        #[arg(long, default_value_t = 10)]
        batch_size: i32,
        /// Stop once the queue has been empty this long.
        #[arg(long, default_value = "3s")]
        exit_when_idle: String,
    },
}

/// Warnings to stderr, field values escaped.
fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqs_once=warn".into()),
        )
        .with_writer(std::io::stderr)
        .fmt_fields(sqs_once::cli::escaped_fields())
        .init();
}

#[tokio::main]
async fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    let sdk = aws_config::load_from_env().await;
    let result = match cli.command {
        Command::Init(args) if args.check => check(&sdk, &args).await,
        Command::Init(args) => init(&sdk, &args).await,
        Command::Inspect(k) => inspect(&sdk, &k).await,
        Command::Forget { key, force } => forget(&sdk, &key, force).await,
        Command::Redrive {
            dlq_url,
            queue_url,
            max,
            dry_run,
            skip_redrive_check,
        } => {
            let options = ops::RedriveOptions {
                max,
                dry_run,
                skip_redrive_check,
            };
            redrive(&sdk, &dlq_url, &queue_url, &options).await
        }
        Command::Stats {
            table,
            consumer,
            queue_url,
            dlq_url,
            max_items,
            read_units_per_second,
        } => {
            let scan = ScanLimits {
                max_items,
                read_units_per_second,
            };
            stats(
                &sdk,
                &table,
                &consumer,
                queue_url.as_deref(),
                dlq_url.as_deref(),
                scan,
            )
            .await
        }
        Command::Demo {
            events,
            runtime,
            general_path,
        } => demo(&sdk, events, runtime, general_path).await,
        Command::LocalLambda {
            function,
            queue_url,
            event,
            timeout,
            batch_size,
            exit_when_idle,
        } => {
            local_lambda(
                &sdk,
                function,
                queue_url,
                event,
                &timeout,
                batch_size,
                &exit_when_idle,
            )
            .await
        }
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

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Runtime {
    Poller,
    Lambda,
}

async fn local_lambda(
    sdk: &aws_config::SdkConfig,
    function: std::path::PathBuf,
    queue_url: Option<String>,
    event: Option<std::path::PathBuf>,
    timeout: &str,
    batch_size: i32,
    exit_when_idle: &str,
) -> Result<(), BoxError> {
    let timeout = sqs_once::config::parse_duration("--timeout", timeout)?;
    let idle = sqs_once::config::parse_duration("--exit-when-idle", exit_when_idle)?;
    let name = function
        .file_name()
        .map_or("function".into(), |n| n.to_string_lossy().into_owned());
    let lambda = LocalLambda::start(&function, &name, timeout, Vec::new())
        .await
        .map_err(|e| format!("cannot start {}: {e}", function.display()))?;
    let result = match (queue_url, event) {
        (Some(queue_url), _) => {
            let sqs = aws_sdk_sqs::Client::new(sdk);
            run_event_source(&sqs, &queue_url, &lambda, batch_size, idle)
                .await
                .map(|stats| println!("{}", serde_json::to_string(&stats).expect("stats JSON")))
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path)
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

async fn init(sdk: &aws_config::SdkConfig, args: &InitArgs) -> Result<(), BoxError> {
    use sqs_once_cli::setup::{Outcome, QueueSpec};
    let table = &args.table;
    let allow = args.allowed();
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let mut outcome = Outcome::default();
    let merge = |into: &mut Outcome, o: Outcome| {
        into.created.extend(o.created);
        into.changed.extend(o.changed);
        into.differences.extend(o.differences);
    };
    let o = sqs_once_cli::setup::init_dedup_table(&ddb, table, &allow).await?;
    if o.differences.is_empty() {
        DynamoStore::new(ddb.clone(), table.as_str())
            .check_table()
            .await?;
        println!("dedup table {table}: ok (key pk, TTL on expires_at)");
    }
    merge(&mut outcome, o);
    if let Some(ledger) = &args.ledger_table {
        if sqs_once_cli::setup::init_table(&ddb, ledger).await? {
            outcome.created.push(format!("table {ledger}"));
        }
        println!("ledger table {ledger}: ok");
    }
    if let Some(q) = &args.queue {
        let spec = QueueSpec {
            name: q.clone(),
            fifo: args.fifo,
            visibility_timeout: args.visibility_timeout.map(Duration::from_secs),
            max_receive_count: args.max_receive_count,
        };
        let sqs = aws_sdk_sqs::Client::new(sdk);
        let q = sqs_once_cli::setup::init_queue_with_dlq(&sqs, &spec, &allow).await?;
        println!("queue {}", q.queue_url);
        if let Some(dlq) = &q.dlq_url {
            println!("dlq   {dlq}");
        }
        merge(&mut outcome, q.outcome);
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

/// `init --check`: reports every problem, changes nothing.
async fn check(sdk: &aws_config::SdkConfig, args: &InitArgs) -> Result<(), BoxError> {
    let mut problems = Vec::new();
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    match DynamoStore::new(ddb, args.table.as_str())
        .check_table()
        .await
    {
        Ok(()) => println!("dedup table {}: ok (key pk, TTL on expires_at)", args.table),
        Err(e) => problems.push(e.to_string()),
    }
    if let Some(q) = &args.queue {
        let sqs = aws_sdk_sqs::Client::new(sdk);
        let spec = sqs_once_cli::setup::QueueSpec {
            name: q.clone(),
            fifo: args.fifo,
            visibility_timeout: args.visibility_timeout.map(Duration::from_secs),
            max_receive_count: args.max_receive_count,
        };
        match sqs_once_cli::setup::check_queue(&sqs, &spec).await {
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

async fn inspect(sdk: &aws_config::SdkConfig, k: &KeyArgs) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    match ops::inspect(&ddb, &k.table, &k.consumer, &k.key).await? {
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

async fn forget(sdk: &aws_config::SdkConfig, k: &KeyArgs, force: bool) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    match ops::forget(&ddb, &k.table, &k.consumer, &k.key, force).await? {
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

async fn redrive(
    sdk: &aws_config::SdkConfig,
    dlq_url: &str,
    queue_url: &str,
    options: &ops::RedriveOptions,
) -> Result<(), BoxError> {
    let sqs = aws_sdk_sqs::Client::new(sdk);
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
            println!(
                "  {}: {}",
                sqs_once::cli::escape(&body),
                sqs_once::cli::escape(reason)
            );
        }
        return Ok(());
    }
    println!(
        "moved {} message(s) from {dlq_url} to {queue_url}{}",
        report.moved,
        if report.by_move_task {
            " (SQS message move task)"
        } else {
            ""
        }
    );
    for id in &report.in_both {
        eprintln!(
            "warning: message {} was sent to {queue_url} but not deleted from {dlq_url}: it is in both queues (the DLQ's copy is visible again in 60 s; its dedup key makes a second copy a duplicate, not a second effect)",
            sqs_once::cli::escape(id)
        );
    }
    for (id, why) in &report.not_sent {
        eprintln!(
            "warning: message {} was not sent ({}); it stays in {dlq_url}, visible again in 60 s",
            sqs_once::cli::escape(id),
            sqs_once::cli::escape(why)
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

/// How much of the table `stats` may read, and how fast.
struct ScanLimits {
    max_items: u64,
    read_units_per_second: f64,
}

async fn stats(
    sdk: &aws_config::SdkConfig,
    table: &str,
    consumer: &str,
    queue_url: Option<&str>,
    dlq_url: Option<&str>,
    scan: ScanLimits,
) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let counts = ops::count_records(
        &ddb,
        table,
        consumer,
        scan.max_items,
        scan.read_units_per_second,
        |c| eprintln!("scanned {} items...", c.scanned),
    )
    .await?;
    println!("records of consumer {consumer} in {table}:");
    for (status, n) in &counts.by_status {
        println!("  {:<12} {n}", sqs_once::cli::escape(status));
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
    for (name, url) in [("queue", queue_url), ("dlq", dlq_url)] {
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

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

async fn demo(
    sdk: &aws_config::SdkConfig,
    events: usize,
    runtime: Runtime,
    general_path: bool,
) -> Result<(), BoxError> {
    let ddb = aws_sdk_dynamodb::Client::new(sdk);
    let sqs = aws_sdk_sqs::Client::new(sdk);
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let (dedup_table, ledger_table) = (format!("demo-dedup-{run}"), format!("demo-ledger-{run}"));
    sqs_once_cli::setup::ensure_dedup_table(&ddb, &dedup_table).await?;
    sqs_once_cli::setup::ensure_table(&ddb, &ledger_table).await?;
    let queues = sqs_once_cli::setup::ensure_queue_with_dlq(
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
            seq: None,
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

    // Run the real `ledger` binary (built next to this binary) until the queue is drained.
    let ledger_bin = std::env::current_exe()?
        .parent()
        .ok_or("no directory for this executable")?
        .join("ledger");
    let env: Vec<(String, String)> = [
        ("SQS_ONCE_DLQ_URL", queues.dlq_url.as_str()),
        ("SQS_ONCE_TABLE", &dedup_table),
        ("SQS_ONCE_CONSUMER", "demo"),
        ("SQS_ONCE_DEDUP_KEY", "json:/id"),
        ("LEDGER_TABLE", &ledger_table),
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
    .collect();
    let started = std::time::Instant::now();
    let (applied, summary) = match runtime {
        Runtime::Poller => {
            let stats = run_ledger_poller(&ledger_bin, &queues.queue_url, &env).await?;
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
            (Some(n("completed") as usize), summary)
        }
        Runtime::Lambda => {
            let lambda = LocalLambda::start(&ledger_bin, "ledger", Duration::from_secs(30), env)
                .await
                .map_err(|e| format!("cannot start {}: {e}", ledger_bin.display()))?;
            let stats =
                run_event_source(&sqs, &queues.queue_url, &lambda, 10, Duration::from_secs(3))
                    .await;
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
            (None, summary)
        }
    };
    println!(
        "{summary} ({:.1} s incl. 3 s idle wait)",
        started.elapsed().as_secs_f64()
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
    let applied_events = count_applied(&ddb, &ledger_table).await?;
    if !ok || applied_events != events || applied.is_some_and(|a| a != events) || parked.len() != 2
    {
        return Err(format!(
            "ledger check failed: {applied_events} events recorded in the ledger for {events} sent"
        )
        .into());
    }
    println!(
        "every event applied exactly once; duplicates skipped; malformed bodies parked in the DLQ"
    );
    Ok(())
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
                "running {} (build it with `cargo build --bins`): {e}",
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
