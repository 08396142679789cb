//! The command line: one subcommand per operation, each flag documented (its
//! `--help` text) and, where it names a resource, read from the same
//! `SQS_ONCE_*` variable as the consumers.

use std::time::Duration;

use clap::{Parser, Subcommand};
use sqs_once::key::CarrySecret;
use sqs_once_cli::ops::RedriveOptions;
use sqs_once_cli::setup::{Change, QueueSpec};

#[derive(Parser)]
#[command(
    version,
    about = "Effectively-once processing of SQS messages: operations tool"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// Show the dedup record of one key: status, owner, lease, attempts, fence, times,
    /// result (or its digest) and last error.
    ///
    /// Example: sqs-once inspect evt-42 --table dedup --consumer ledger
    Inspect(KeyArgs),
    /// Delete the dedup record of one key so its event can be processed again
    /// (e.g. after fixing the effect by hand). Refuses a record under a live
    /// claim unless --force: its handler may still be running.
    ///
    /// Example: sqs-once forget evt-42 --table dedup --consumer ledger
    Forget(ForgetArgs),
    /// Move parked messages from a DLQ back to their source queue: by receive,
    /// send, then delete, so a crash never loses a message (or, with
    /// --move-task, by SQS's message move task). Refuses unless the source
    /// queue's redrive policy names the DLQ. Every message attribute is kept as
    /// it is (the dedup key parking recorded among them); a message SQS's
    /// redrive policy moved gets its dedup key added (its message id, which the
    /// copy sent back loses). A message left in both queues by a crash or a
    /// failed delete is reported, and its second copy is a duplicate, not a
    /// second effect.
    ///
    /// Example: sqs-once redrive --dlq-url $DLQ --queue-url $QUEUE --table dedup --max 100
    ///
    /// Example: sqs-once redrive --dlq-url $DLQ --queue-url $QUEUE --dry-run
    Redrive(RedriveArgs),
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
    Stats(StatsArgs),
    /// Walk through the protocol on LocalStack: sends ledger events with
    /// duplicates and a malformed body, processes them, checks the balances.
    ///
    /// Example: sqs-once demo --events 300 --runtime lambda
    Demo(DemoArgs),
    /// Run a Lambda function binary locally: serve the Lambda Runtime API, start
    /// the binary against it, and feed it a queue's messages in batches as Lambda's
    /// event source mapping does (deleting what it does not list in
    /// `batchItemFailures`), or invoke it once with an event file.
    ///
    /// The function gets this process's environment (SQS_ONCE_*, AWS_ENDPOINT_URL, ...).
    ///
    /// Example: sqs-once local-lambda --function target/debug/ledger --queue-url http://localhost:4566/000000000000/orders
    LocalLambda(LocalLambdaArgs),
}

#[derive(clap::Args)]
pub(crate) struct InitArgs {
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    pub(crate) table: String,
    /// A queue to create with `<name>-dlq` as its dead-letter queue.
    #[arg(long)]
    pub(crate) queue: Option<String>,
    /// Make the queue (and DLQ) FIFO.
    #[arg(long)]
    pub(crate) fifo: bool,
    /// Receives before SQS moves a message to the DLQ (new queue: 5; an existing
    /// queue is compared only when given).
    #[arg(long)]
    pub(crate) max_receive_count: Option<u32>,
    /// The queue's visibility timeout in seconds (new queue: 60; an existing
    /// queue is compared only when given).
    #[arg(long)]
    pub(crate) visibility_timeout: Option<u64>,
    /// Also create the ledger example's table (string key `pk`).
    #[arg(long)]
    pub(crate) ledger_table: Option<String>,
    /// Only report what is missing or wrong; create nothing.
    #[arg(long)]
    pub(crate) check: bool,
    /// Change an existing dedup table: enable TTL on `expires_at` (its keys are
    /// checked first; TTL deletes expired items).
    #[arg(long)]
    pub(crate) enable_ttl: bool,
    /// Change an existing queue: set its visibility timeout to --visibility-timeout.
    #[arg(long, requires = "visibility_timeout")]
    pub(crate) set_visibility_timeout: bool,
    /// Change an existing queue: point its redrive policy at `<name>-dlq` (created
    /// if missing), after --max-receive-count receives (else its current count, else 5).
    #[arg(long)]
    pub(crate) set_redrive_policy: bool,
    /// Create tables without deletion protection and point-in-time recovery
    /// (both on by default for the tables init creates, as in the templates).
    #[arg(long)]
    pub(crate) no_protection: bool,
}

impl InitArgs {
    /// The queue asked for (`--queue`), if any.
    pub(crate) fn queue_spec(&self) -> Option<QueueSpec> {
        self.queue.as_ref().map(|name| QueueSpec {
            name: name.clone(),
            fifo: self.fifo,
            visibility_timeout: self.visibility_timeout.map(Duration::from_secs),
            max_receive_count: self.max_receive_count,
        })
    }

    /// The changes to existing resources the flags allow.
    pub(crate) fn allowed(&self) -> Vec<Change> {
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
pub(crate) struct KeyArgs {
    /// The dedup key (e.g. the business id the consumer's SQS_ONCE_DEDUP_KEY reads).
    pub(crate) key: String,
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    pub(crate) table: String,
    /// The consumer whose record it is.
    #[arg(long, env = "SQS_ONCE_CONSUMER")]
    pub(crate) consumer: String,
    /// The consumer hashes its keys (`on`/`off`, as the consumer's own
    /// setting): KEY is hashed the same way, or given as logs show it
    /// (`sha256:` and 64 hex digits).
    #[arg(long, env = "SQS_ONCE_HASH_KEYS", default_value = "off", num_args = 0..=1, default_missing_value = "on", value_parser = sqs_once::settings::switch("SQS_ONCE_HASH_KEYS"), action = clap::ArgAction::Set)]
    pub(crate) hash_keys: bool,
}

impl KeyArgs {
    /// The record key of KEY, as the consumer makes it.
    pub(crate) fn pk(&self) -> String {
        sqs_once_cli::ops::record_key_of(&self.consumer, &self.key, self.hash_keys)
    }
}

#[derive(clap::Args)]
pub(crate) struct ForgetArgs {
    #[command(flatten)]
    pub(crate) key: KeyArgs,
    /// Delete even a record under a live claim.
    #[arg(long)]
    pub(crate) force: bool,
    /// Show the record that would be forgotten (and whether a live claim
    /// holds it); delete nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

#[derive(clap::Args)]
pub(crate) struct RedriveArgs {
    /// The dead-letter queue to empty.
    #[arg(long, env = "SQS_ONCE_DLQ_URL")]
    pub(crate) dlq_url: String,
    /// The source queue to move them to.
    #[arg(long, env = "SQS_ONCE_QUEUE_URL")]
    pub(crate) queue_url: String,
    /// Move at most this many.
    #[arg(long)]
    pub(crate) max: Option<u64>,
    /// Show what would move; move nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Move even when the source queue's redrive policy does not name
    /// --dlq-url (by default that is refused: swapped URLs would move live
    /// messages into the DLQ unprocessed).
    #[arg(long)]
    pub(crate) skip_redrive_check: bool,
    /// Let SQS's message move task do it (standard queues, no --max): fast,
    /// but every message gets a new id and no attribute can be added, so a
    /// message SQS's redrive policy moved there (rather than sqs-once parked)
    /// loses its dedup key under `message-id` keys and runs again. By default
    /// messages are moved by receive, send, delete, each carrying its key.
    #[arg(long)]
    pub(crate) move_task: bool,
    /// The consumers' secret (comma-separated for rotation: the first
    /// seals): each copy carries its dedup key sealed with it, as consumers
    /// honour a carried key only when it verifies. Without it copies carry
    /// no key.
    #[arg(long, env = "SQS_ONCE_CARRY_SECRET", hide_env_values = true)]
    pub(crate) carry_secret: Option<String>,
    /// A file holding the secret (as --carry-secret takes it; surrounding
    /// whitespace ignored), so it is not on the command line or in the
    /// environment. Not with --carry-secret.
    #[arg(
        long,
        env = "SQS_ONCE_CARRY_SECRET_FILE",
        conflicts_with = "carry_secret"
    )]
    pub(crate) carry_secret_file: Option<std::path::PathBuf>,
    /// The dedup table whose kept carry secret seals the copies (the one
    /// consumers make and use when no secret is set), when --carry-secret
    /// is not given.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    pub(crate) table: Option<String>,
}

#[derive(clap::Args)]
pub(crate) struct StatsArgs {
    /// The dedup table.
    #[arg(long, env = "SQS_ONCE_TABLE")]
    pub(crate) table: String,
    /// The consumer whose records to count.
    #[arg(long, env = "SQS_ONCE_CONSUMER")]
    pub(crate) consumer: String,
    /// The source queue.
    #[arg(long, env = "SQS_ONCE_QUEUE_URL")]
    pub(crate) queue_url: Option<String>,
    /// Its DLQ.
    #[arg(long, env = "SQS_ONCE_DLQ_URL")]
    pub(crate) dlq_url: Option<String>,
    /// Read at most this many items (the scan costs read capacity).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) max_items: u64,
    /// Read capacity units per second the scan may use on average (0: no limit).
    #[arg(long, default_value_t = 50.0)]
    pub(crate) read_units_per_second: f64,
}

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// How many distinct events to send.
    #[arg(long, default_value_t = 40)]
    pub(crate) events: usize,
    /// Run the `ledger` binary as a long-polling consumer (`poller`) or as a
    /// Lambda function behind a local Runtime API and SQS event source (`lambda`).
    #[arg(long, value_enum, default_value_t = Runtime::Poller)]
    pub(crate) runtime: Runtime,
    /// Claim before every event (two DynamoDB calls each) instead of the
    /// one-transaction fast path the ledger handler qualifies for.
    #[arg(long)]
    pub(crate) general_path: bool,
    /// Run even when the AWS endpoint is not local (the demo creates
    /// tables and queues, and leaves them): by default it refuses anything
    /// but an `AWS_ENDPOINT_URL` on localhost or LocalStack.
    #[arg(long)]
    pub(crate) allow_remote: bool,
}

#[derive(clap::Args)]
pub(crate) struct LocalLambdaArgs {
    /// The function binary (built for this machine).
    #[arg(long)]
    pub(crate) function: std::path::PathBuf,
    /// Feed this queue to the function until it is idle.
    #[arg(long, required_unless_present = "event", conflicts_with = "event")]
    pub(crate) queue_url: Option<String>,
    /// Invoke once with this event file and print the response.
    #[arg(long)]
    pub(crate) event: Option<std::path::PathBuf>,
    /// The function timeout.
    #[arg(long, default_value = "30s", value_parser = sqs_once::settings::duration("--timeout"))]
    pub(crate) timeout: Duration,
    /// Records per invocation (1 to 10).
    #[arg(long, default_value_t = 10)]
    pub(crate) batch_size: i32,
    /// Stop once the queue has been empty this long.
    #[arg(long, default_value = "3s", value_parser = sqs_once::settings::duration("--exit-when-idle"))]
    pub(crate) exit_when_idle: Duration,
    /// Run even when the AWS endpoint is not local: the function then
    /// consumes (and deletes) a real queue's messages on this machine. By
    /// default it refuses anything but an `AWS_ENDPOINT_URL` on localhost or
    /// LocalStack.
    #[arg(long)]
    pub(crate) allow_remote: bool,
}

impl RedriveArgs {
    /// How the redrive runs.
    pub(crate) fn options(&self) -> Result<RedriveOptions, String> {
        let carry_secret = match &self.carry_secret_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    format!(
                        "cannot read SQS_ONCE_CARRY_SECRET_FILE (--carry-secret-file) {}: {e}",
                        path.display()
                    )
                })?;
                let secret = CarrySecret::parse(text.trim()).map_err(|e| {
                    format!(
                        "invalid secret in SQS_ONCE_CARRY_SECRET_FILE (--carry-secret-file) {}: {e}",
                        path.display()
                    )
                })?;
                Some(secret)
            }
            None => self
                .carry_secret
                .as_deref()
                .filter(|s| !s.is_empty())
                .map(CarrySecret::parse)
                .transpose()
                .map_err(|e| {
                    format!("invalid setting SQS_ONCE_CARRY_SECRET (--carry-secret): {e}")
                })?,
        };
        Ok(RedriveOptions {
            max: self.max,
            dry_run: self.dry_run,
            skip_redrive_check: self.skip_redrive_check,
            move_task: self.move_task,
            carry_secret,
        })
    }
}

/// Where the demo runs the `ledger` binary.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Runtime {
    Poller,
    Lambda,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redrive(extra: &[&str]) -> Result<RedriveArgs, clap::Error> {
        let mut argv = vec!["sqs-once", "redrive", "--dlq-url", "d", "--queue-url", "q"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv)?.command {
            Command::Redrive(args) => Ok(args),
            _ => unreachable!("parsed a redrive"),
        }
    }

    #[test]
    fn the_redrive_secret_is_read_from_a_file_and_seals_as_the_same_secret_given_inline() {
        let secret = "k0123456789abcdef0123456789abcdef";
        let dir = std::env::temp_dir().join(format!("sqs-once-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("carry-secret");
        std::fs::write(&file, format!("{secret}\n")).unwrap();
        let from_file = redrive(&["--carry-secret-file", file.to_str().unwrap()])
            .unwrap()
            .options()
            .unwrap()
            .carry_secret
            .expect("a secret");
        let inline = redrive(&["--carry-secret", secret])
            .unwrap()
            .options()
            .unwrap()
            .carry_secret
            .expect("a secret");
        assert_eq!(
            from_file.seal("a", "body", "k"),
            inline.seal("a", "body", "k"),
            "the file's secret (its newline dropped) is the inline one"
        );
        let missing = dir.join("absent");
        let err = redrive(&["--carry-secret-file", missing.to_str().unwrap()])
            .unwrap()
            .options()
            .err()
            .expect("a missing file is an error");
        assert!(
            err.contains("SQS_ONCE_CARRY_SECRET_FILE") && err.contains("absent"),
            "{err}"
        );
        let both = redrive(&[
            "--carry-secret",
            secret,
            "--carry-secret-file",
            file.to_str().unwrap(),
        ]);
        assert!(both.is_err(), "the secret given twice is refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
