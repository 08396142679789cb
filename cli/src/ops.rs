//! What an operator does to a running system: read a record, forget one, move
//! parked messages back, count records and messages. The `sqs-once` binary is
//! the command line over these.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use aws_smithy_types::error::display::DisplayErrorContext;

use sqs_once::cli::escape;
use sqs_once::dedup::dynamodb::{KEY_ATTRIBUTE, record_from_item};
use sqs_once::dedup::{Record, Status, StoredResult};
use sqs_once::key::{CarrySecret, DEDUP_KEY_ATTRIBUTE, carry_key, hashed_record_key, record_key};
use sqs_once::queue::{MESSAGE_ID_ATTRIBUTE, REASON_ATTRIBUTE};

type GetItemError = aws_sdk_dynamodb::operation::get_item::GetItemError;
type DeleteItemError = aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
type ScanError = aws_sdk_dynamodb::operation::scan::ScanError;
type GetQueueAttributesError =
    aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesError;
type ReceiveMessageError = aws_sdk_sqs::operation::receive_message::ReceiveMessageError;
type SendMessageBatchError = aws_sdk_sqs::operation::send_message_batch::SendMessageBatchError;
type DeleteMessageBatchError =
    aws_sdk_sqs::operation::delete_message_batch::DeleteMessageBatchError;
type StartMoveTaskError =
    aws_sdk_sqs::operation::start_message_move_task::StartMessageMoveTaskError;
type ListMoveTasksError =
    aws_sdk_sqs::operation::list_message_move_tasks::ListMessageMoveTasksError;

/// An operation that failed: what was being done, to what, and the AWS error
/// (its source) where a call failed. The message is for the operator.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// `GetItem` of a record failed.
    #[error("reading {pk} from {table}: {}", DisplayErrorContext(.source))]
    ReadRecord {
        /// The record's key.
        pk: String,
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetItemError>>,
    },
    /// `DeleteItem` of a record failed.
    #[error("deleting {pk} from {table}: {}", DisplayErrorContext(.source))]
    DeleteRecord {
        /// The record's key.
        pk: String,
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DeleteItemError>>,
    },
    /// A record read from the table is not one sqs-once wrote.
    #[error("record {pk} is malformed: {reason}")]
    MalformedRecord {
        /// The record's key.
        pk: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `Scan` page failed.
    #[error("scanning {table}: {}", DisplayErrorContext(.source))]
    Scan {
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ScanError>>,
    },
    /// `GetQueueAttributes` failed.
    #[error("reading queue {queue}: {}", DisplayErrorContext(.source))]
    ReadQueue {
        /// The queue's URL.
        queue: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetQueueAttributesError>>,
    },
    /// A queue's attributes came back without its ARN.
    #[error("queue {queue} has no QueueArn")]
    NoQueueArn {
        /// The queue's URL.
        queue: String,
    },
    /// The source queue's redrive policy does not name the DLQ: nothing moved.
    #[error(
        "refusing to move: the redrive policy of {source_url} {}, not {dlq_arn} ({dlq_url}); \
         with swapped URLs live messages would move into the DLQ unprocessed. Check \
         --dlq-url and --queue-url, or pass --skip-redrive-check to move anyway",
        .found.as_ref().map_or("is not set".to_owned(), |t| format!("sends to {t}"))
    )]
    NotItsDlq {
        /// The source queue's URL.
        source_url: String,
        /// Where its redrive policy sends messages, if it has one.
        found: Option<String>,
        /// The DLQ's URL.
        dlq_url: String,
        /// The DLQ's ARN.
        dlq_arn: String,
    },
    /// `ReceiveMessage` from the DLQ failed.
    #[error("receiving from {queue}: {}", DisplayErrorContext(.source))]
    Receive {
        /// The DLQ's URL.
        queue: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ReceiveMessageError>>,
    },
    /// `SendMessageBatch` to the source queue failed; the batch stays in the DLQ.
    #[error(
        "sending to {queue} ({moved} moved so far; this batch stays in the DLQ): {}",
        DisplayErrorContext(.source)
    )]
    Send {
        /// The source queue's URL.
        queue: String,
        /// Messages moved before this batch.
        moved: u64,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<SendMessageBatchError>>,
    },
    /// `DeleteMessageBatch` from the DLQ failed after the batch was sent: its
    /// messages are in both queues.
    #[error(
        "deleting from {queue} after sending; {in_both} message(s) are now in both queues (the DLQ's copies come back in 60 s; their dedup keys make a second copy a duplicate): {}",
        DisplayErrorContext(.source)
    )]
    DeleteAfterSend {
        /// The DLQ's URL.
        queue: String,
        /// Messages now in both queues.
        in_both: usize,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DeleteMessageBatchError>>,
    },
    /// `StartMessageMoveTask` failed (other than for an endpoint without it).
    #[error("starting the message move task: {}", DisplayErrorContext(.source))]
    StartMoveTask {
        /// The SDK's error.
        #[source]
        source: Box<SdkError<StartMoveTaskError>>,
    },
    /// `ListMessageMoveTasks` failed while waiting for the task.
    #[error("reading the message move task: {}", DisplayErrorContext(.source))]
    ReadMoveTask {
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ListMoveTasksError>>,
    },
    /// The message move task ended `FAILED` or `CANCELLED`.
    #[error("the message move task ended {status} after {moved} message(s): {reason}")]
    MoveTaskEnded {
        /// `FAILED` or `CANCELLED`.
        status: String,
        /// Messages it moved.
        moved: u64,
        /// Its failure reason.
        reason: String,
    },
    /// The message move task was still running after 15 minutes.
    #[error(
        "the message move task {handle} is still running after 15 minutes; check it with `aws sqs list-message-move-tasks`"
    )]
    MoveTaskStillRunning {
        /// The task's handle.
        handle: String,
    },
}

/// [`OpsError::MalformedRecord`] for `pk`.
fn malformed(pk: &str, reason: impl ToString) -> OpsError {
    OpsError::MalformedRecord {
        pk: pk.to_owned(),
        reason: reason.to_string(),
    }
}

/// Milliseconds since the epoch by this host's clock.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The latest time RFC 3339 can show (9999-12-31T23:59:59Z), in ms.
const LATEST_MS: i64 = 253_402_300_799_000;

fn when(ms: i64) -> String {
    let ms = ms.clamp(0, LATEST_MS);
    let t = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

fn relative(ms: i64, now: i64) -> String {
    let d = Duration::from_secs(ms.abs_diff(now) / 1000);
    let d = humantime::format_duration(d);
    if ms >= now {
        format!("in {d}")
    } else {
        format!("{d} ago")
    }
}

/// A record for a person: status, owner, lease, attempts, times as UTC and
/// relative to now, result or digest, last error. Every field read from the
/// table is [`escape`]d.
pub fn describe_record(r: &Record, now: i64) -> String {
    let mut out = vec![
        format!("key        {}", escape(&r.pk)),
        format!("status     {}", r.status.as_str()),
        format!("attempts   {}", r.attempts),
    ];
    if let Some(o) = &r.owner {
        out.push(format!("owner      {}", escape(o)));
    }
    if r.status == Status::InProgress {
        let live = if r.lease_until_ms > now {
            "live"
        } else {
            "ended: the next delivery may claim it"
        };
        out.push(format!(
            "lease      until {} ({}; {live})",
            when(r.lease_until_ms),
            relative(r.lease_until_ms, now)
        ));
    }
    if let Some(t) = r.claimed_at_ms {
        out.push(format!("claimed    {} ({})", when(t), relative(t, now)));
    }
    if let Some(t) = r.completed_at_ms {
        out.push(format!("completed  {} ({})", when(t), relative(t, now)));
    }
    match r
        .expires_at_s
        .checked_mul(1000)
        .filter(|_| r.expires_at_s != i64::MAX)
    {
        Some(expires) => {
            let expired = if expires < now {
                "; expired: no longer blocks a delivery"
            } else {
                ""
            };
            out.push(format!(
                "expires    {} ({}{expired})",
                when(expires),
                relative(expires, now)
            ));
        }
        None => {
            out.push("expires    never (no expires_at: TTL does not remove this record)".to_owned())
        }
    }
    if let Some(m) = &r.message_id {
        out.push(format!("message    {}", escape(m)));
    }
    if let Some(p) = &r.payload_sha256 {
        out.push(format!("payload    sha256 {}", escape(p)));
    }
    match &r.result {
        Some(StoredResult::Value(v)) => out.push(format!("result     {}", escape(&v.to_string()))),
        Some(StoredResult::Digest { sha256, bytes }) => out.push(format!(
            "result     {bytes} bytes, stored as sha256 {}",
            escape(sha256)
        )),
        None => {}
    }
    if let Some(e) = &r.error {
        out.push(format!("error      {}", escape(e)));
    }
    out.join("\n")
}

/// The record key of `dedup_key` for `consumer`, as the consumers make it:
/// hashed when they hash keys (`SQS_ONCE_HASH_KEYS`). With hashing on, a key
/// in the form logs and spans show (`sha256:` and 64 hex digits) is taken as
/// hashed already.
pub fn record_key_of(consumer: &str, dedup_key: &str, hash_keys: bool) -> String {
    let shown = dedup_key.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    });
    match (hash_keys, shown) {
        (false, _) => record_key(consumer, dedup_key),
        (true, true) => format!("{consumer}#{dedup_key}"),
        (true, false) => hashed_record_key(consumer, dedup_key),
    }
}

/// Reads the record whose key is `pk` (see [`record_key_of`]).
pub async fn inspect(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    pk: &str,
) -> Result<Option<Record>, OpsError> {
    let pk = pk.to_owned();
    let out = ddb
        .get_item()
        .table_name(table)
        .key(KEY_ATTRIBUTE, AttributeValue::S(pk.clone()))
        .consistent_read(true)
        .send()
        .await
        .map_err(|e| OpsError::ReadRecord {
            pk: pk.clone(),
            table: table.to_owned(),
            source: e.into(),
        })?;
    out.item()
        .map(record_from_item)
        .transpose()
        .map_err(|e| malformed(&pk, e))
}

/// What [`forget`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Forgotten {
    /// The record was deleted; this is what it held.
    Deleted(Record),
    /// There was no record.
    Absent,
    /// Not deleted: a live claim holds it (use `force`).
    InProgress(Record),
}

/// Deletes the record whose key is `pk` (see [`record_key_of`]) so its event
/// can be processed again. A record under a live claim is left alone unless
/// `force` (its handler may be running: deleting it lets a second attempt
/// start).
pub async fn forget(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    pk: &str,
    force: bool,
) -> Result<Forgotten, OpsError> {
    let pk = pk.to_owned();
    let mut delete = ddb
        .delete_item()
        .table_name(table)
        .key(KEY_ATTRIBUTE, AttributeValue::S(pk.clone()))
        .return_values(ReturnValue::AllOld);
    if !force {
        delete = delete
            .condition_expression(
                "attribute_not_exists(pk) OR #status <> :in_progress OR lease_until < :now",
            )
            .expression_attribute_names("#status", "status")
            .expression_attribute_values(
                ":in_progress",
                AttributeValue::S(Status::InProgress.as_str().into()),
            )
            .expression_attribute_values(":now", AttributeValue::N(now_ms().to_string()))
            .return_values_on_condition_check_failure(
                aws_sdk_dynamodb::types::ReturnValuesOnConditionCheckFailure::AllOld,
            );
    }
    match delete.send().await {
        Ok(out) => match out.attributes() {
            Some(item) if !item.is_empty() => Ok(Forgotten::Deleted(
                record_from_item(item).map_err(|e| malformed(&pk, e))?,
            )),
            _ => Ok(Forgotten::Absent),
        },
        Err(e) => {
            if let Some(aws_sdk_dynamodb::operation::delete_item::DeleteItemError::ConditionalCheckFailedException(c)) =
                e.as_service_error()
                && let Some(item) = c.item()
            {
                return Ok(Forgotten::InProgress(
                    record_from_item(item).map_err(|e| malformed(&pk, e))?,
                ));
            }
            Err(OpsError::DeleteRecord {
                pk,
                table: table.to_owned(),
                source: e.into(),
            })
        }
    }
}

/// Counts of a consumer's records by status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Records by status (`IN_PROGRESS`, `COMPLETED`, `FAILED`).
    pub by_status: BTreeMap<String, u64>,
    /// Of those, past their `expires_at` but not yet removed by TTL.
    pub expired: u64,
    /// `IN_PROGRESS` records whose lease has ended (a consumer died mid-handler;
    /// the next delivery takes over).
    pub stale_in_progress: u64,
    /// Items read by the scan (all consumers).
    pub scanned: u64,
    /// The scan stopped at the bound before reading the whole table.
    pub truncated: bool,
}

/// How long to wait after reading `spent` capacity units in `elapsed` so the
/// average stays at most `rate` units per second.
pub fn pace(spent: f64, rate: f64, elapsed: Duration) -> Duration {
    if rate <= 0.0 {
        return Duration::ZERO;
    }
    Duration::from_secs_f64((spent / rate - elapsed.as_secs_f64()).max(0.0))
}

/// Read capacity a Scan page consumed: as DynamoDB reports it, else estimated
/// at 0.5 units per 4 KB with items taken as 1 KB.
fn page_units(page: &aws_sdk_dynamodb::operation::scan::ScanOutput) -> f64 {
    page.consumed_capacity()
        .and_then(|c| c.capacity_units())
        .unwrap_or_else(|| f64::from(page.scanned_count()) / 8.0)
}

/// Scans the table (at most `max_items` items, reporting each page to
/// `progress`) and counts `consumer`'s records, at most `read_units_per_second`
/// read capacity units per second on average (pages of 100 items, a pause after
/// each), so the scan does not take the capacity live claims need.
pub async fn count_records(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    consumer: &str,
    max_items: u64,
    read_units_per_second: f64,
    mut progress: impl FnMut(&RecordCounts),
) -> Result<RecordCounts, OpsError> {
    let now = now_ms();
    let started = tokio::time::Instant::now();
    let mut spent = 0.0;
    let mut counts = RecordCounts::default();
    let mut start: Option<HashMap<String, AttributeValue>> = None;
    loop {
        let page = ddb
            .scan()
            .table_name(table)
            .filter_expression("begins_with(pk, :prefix)")
            .expression_attribute_values(":prefix", AttributeValue::S(format!("{consumer}#")))
            .projection_expression("pk, #status, lease_until, expires_at")
            .expression_attribute_names("#status", "status")
            .limit(i32::try_from(max_items.saturating_sub(counts.scanned).min(100)).unwrap_or(100))
            .return_consumed_capacity(aws_sdk_dynamodb::types::ReturnConsumedCapacity::Total)
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .map_err(|e| OpsError::Scan {
                table: table.to_owned(),
                source: e.into(),
            })?;
        counts.scanned += u64::try_from(page.scanned_count()).unwrap_or(0);
        spent += page_units(&page);
        for item in page.items() {
            count_item(&mut counts, item, now);
        }
        progress(&counts);
        match page.last_evaluated_key {
            Some(key) if counts.scanned < max_items => start = Some(key),
            Some(_) => {
                counts.truncated = true;
                return Ok(counts);
            }
            None => return Ok(counts),
        }
        tokio::time::sleep(pace(spent, read_units_per_second, started.elapsed())).await;
    }
}

fn count_item(counts: &mut RecordCounts, item: &HashMap<String, AttributeValue>, now: i64) {
    let status = item
        .get("status")
        .and_then(|v| v.as_s().ok())
        .cloned()
        .unwrap_or_else(|| "UNKNOWN".into());
    let num = |k: &str| {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse::<i64>().ok())
            .unwrap_or(0)
    };
    if num("expires_at").saturating_mul(1000) < now {
        counts.expired += 1;
    }
    if status == Status::InProgress.as_str() && num("lease_until") < now {
        counts.stale_in_progress += 1;
    }
    *counts.by_status.entry(status).or_default() += 1;
}

/// A queue's approximate counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages available.
    pub visible: u64,
    /// Received and not yet deleted or back.
    pub in_flight: u64,
    /// Delayed.
    pub delayed: u64,
}

/// Reads a queue's approximate counts.
pub async fn queue_depth(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<QueueDepth, OpsError> {
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .unwrap_or_default();
    let n = |a: QueueAttributeName| attrs.get(&a).and_then(|v| v.parse().ok()).unwrap_or(0);
    Ok(QueueDepth {
        visible: n(QueueAttributeName::ApproximateNumberOfMessages),
        in_flight: n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        delayed: n(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
    })
}

/// What [`redrive`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redriven {
    /// Messages sent back to the source queue (and deleted from the DLQ).
    pub moved: u64,
    /// Moved by SQS's own message move task (else by receive/send/delete).
    pub by_move_task: bool,
    /// Dry run: the messages that would move, as (body, reason), at most ten.
    pub preview: Vec<(String, String)>,
    /// The DLQ's approximate depth (`ApproximateNumberOfMessages`) when the
    /// run started (dry run: the messages that would move).
    pub waiting: u64,
    /// The most this run would take from the DLQ: [`Self::waiting`], or
    /// `--max` when smaller. Messages parked again while it runs are left
    /// for the next run rather than moved again and again.
    pub limit: u64,
    /// Sent to the source but not deleted from the DLQ: a copy is in both
    /// queues (the DLQ's comes back after 60 s; its dedup key makes a second
    /// redrive of it a duplicate, not a second effect).
    pub in_both: Vec<String>,
    /// Not sent (left in the DLQ, visible again after 60 s), with the reason.
    pub not_sent: Vec<(String, String)>,
    /// Sent without a carried dedup key, as they had no room for one (10
    /// message attributes already, or the source's size limit) or were
    /// parked without one: under `message-id` keys each runs as a new message.
    pub without_key: Vec<String>,
}

/// How [`redrive`] runs.
#[derive(Debug, Clone, Default)]
pub struct RedriveOptions {
    /// Move at most this many (receive/send/delete; else the move task where available).
    pub max: Option<u64>,
    /// Move nothing; show what would move.
    pub dry_run: bool,
    /// Move even when the source queue's redrive policy does not name the DLQ.
    pub skip_redrive_check: bool,
    /// Use SQS's message move task (standard queues, no `max`): fast, but it
    /// gives every message a new id and adds no attribute, so a message SQS's
    /// redrive policy moved (rather than sqs-once parked) loses its key under
    /// `message-id` keys and runs again.
    pub move_task: bool,
    /// Seals the key each copy carries (`SQS_ONCE_CARRY_SECRET`, the
    /// consumers' secret). Without it copies carry no key: under `message-id`
    /// keys each is processed under a new one.
    pub carry_secret: Option<CarrySecret>,
}

/// The source queue's settings redrive needs: its maximum message size (the
/// cap of a send batch's total), after checking that its redrive policy names
/// `dlq_url` (unless `skip`).
async fn source_settings(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    skip: bool,
) -> Result<usize, OpsError> {
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(source_url)
        .attribute_names(QueueAttributeName::RedrivePolicy)
        .attribute_names(QueueAttributeName::MaximumMessageSize)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: source_url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .unwrap_or_default();
    let max_size = attrs
        .get(&QueueAttributeName::MaximumMessageSize)
        .and_then(|v| v.parse().ok())
        .unwrap_or(262_144);
    if skip {
        return Ok(max_size);
    }
    let dlq_arn = queue_arn(sqs, dlq_url).await?;
    let target = attrs
        .get(&QueueAttributeName::RedrivePolicy)
        .and_then(|p| sqs_once::queue::dead_letter_target_arn(p));
    match target {
        Some(t) if t == dlq_arn => Ok(max_size),
        found => Err(OpsError::NotItsDlq {
            source_url: source_url.to_owned(),
            found,
            dlq_url: dlq_url.to_owned(),
            dlq_arn,
        }),
    }
}

/// Moves the messages in `dlq_url` back to `source_url`, after checking that
/// the source's redrive policy names the DLQ: at most as many as the DLQ held
/// when the run started (its approximate depth), and at most `max`
/// ([`redrive_limit`]). Each message is sent
/// to the source with its body and every message attribute as it is (data types
/// included, and the `sqs_once_*` ones parking added: the dedup key among them
/// keeps a copy a duplicate), in batches within the source's maximum message
/// size, and only then deleted from the DLQ: a crash in between leaves a copy
/// in both queues (reported in [`Redriven::in_both`]), never none. `dry_run`
/// moves nothing and shows what would move.
pub async fn redrive(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    options: &RedriveOptions,
    mut progress: impl FnMut(u64),
) -> Result<Redriven, OpsError> {
    let max_size = source_settings(sqs, dlq_url, source_url, options.skip_redrive_check).await?;
    if options.dry_run {
        return preview(sqs, dlq_url).await;
    }
    let mut report = Redriven::default();
    let fifo = source_url.ends_with(".fifo");
    // Only when asked (see `RedriveOptions::move_task`), and where the
    // endpoint offers it; else we move them ourselves.
    if options.move_task
        && options.max.is_none()
        && !fifo
        && let Some(moved) = move_task(sqs, dlq_url, source_url, &mut progress).await?
    {
        report.moved = moved;
        report.by_move_task = true;
        return Ok(report);
    }
    report.waiting = queue_depth(sqs, dlq_url).await?.visible;
    report.limit = redrive_limit(report.waiting, options.max);
    let mut taken = 0;
    while let Some(want) = next_receive(report.limit, taken) {
        let got = sqs
            .receive_message()
            .queue_url(dlq_url)
            .max_number_of_messages(want)
            .wait_time_seconds(1)
            .visibility_timeout(60)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| OpsError::Receive {
                queue: dlq_url.to_owned(),
                source: e.into(),
            })?
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            break;
        }
        taken += got.len() as u64;
        let got: Vec<Message> = got
            .into_iter()
            .map(|m| carrying_key(m, max_size, options.carry_secret.as_ref(), &mut report))
            .collect();
        for batch in size_batches(&got, max_size) {
            move_batch(sqs, dlq_url, source_url, fifo, batch, &mut report).await?;
            progress(report.moved);
        }
    }
    Ok(report)
}

/// The most one redrive takes from the DLQ: what was in it when the run
/// started (`depth`, approximate), or `max` when smaller. Without this bound,
/// a message the consumer parks again while the run goes on (still failing)
/// would be received and moved again, about once a second, until the run is
/// stopped.
pub fn redrive_limit(depth: u64, max: Option<u64>) -> u64 {
    max.map_or(depth, |max| max.min(depth))
}

/// How many messages the next receive of a redrive asks for, having taken
/// `taken` of at most `limit` (10 at most); `None` once the limit is reached.
pub fn next_receive(limit: u64, taken: u64) -> Option<i32> {
    let left = limit.saturating_sub(taken);
    (left > 0).then(|| i32::try_from(left.min(10)).unwrap_or(10))
}

/// `m` carrying the dedup key a `message-id` consumer gave it, sealed under
/// `secret` (see [`CarrySecret`]). A copy sqs-once parked carries its key
/// already (or, when it had no room for it, the first delivery's id); a
/// message SQS's redrive policy moved carries nothing but keeps its message
/// id in the DLQ (the key such a consumer used), while the copy sent back
/// gets a new one: without the key its effect, already made or not, would be
/// made again under a new key. A key or first id that does not verify (a
/// producer's) is not honoured: the key is replaced by one from the DLQ
/// message's own id. Other key sources ignore the attribute. A message with
/// no room left for it (10 attributes, or the source's `max_size`), or with
/// no secret to seal it, is sent as it is and reported.
fn carrying_key(
    mut m: Message,
    max_size: usize,
    secret: Option<&CarrySecret>,
    report: &mut Redriven,
) -> Message {
    let body = m.body.clone().unwrap_or_default();
    let id = m.message_id.clone().unwrap_or_default();
    let sealed = |name: &str| {
        let value = m.message_attributes.as_ref()?.get(name)?.string_value()?;
        secret?.open(name, &body, value).map(str::to_owned)
    };
    if let (Some(key), Some(secret)) = (sealed(DEDUP_KEY_ATTRIBUTE), secret) {
        // Sealed again under the first secret (the same length), so a copy
        // sealed under a secret being rotated out stays honoured.
        let resealed = carry_key(secret, &body, &key);
        if let Some(attrs) = m.message_attributes.as_mut() {
            attrs.insert(
                DEDUP_KEY_ATTRIBUTE.to_owned(),
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(resealed)
                    .build()
                    .expect("complete attribute"),
            );
        }
        return m;
    }
    let original = sealed(MESSAGE_ID_ATTRIBUTE).unwrap_or_else(|| id.clone());
    let Some(secret) = secret else {
        report.without_key.push(id);
        return m;
    };
    if let Some(attrs) = m.message_attributes.as_mut() {
        attrs.remove(DEDUP_KEY_ATTRIBUTE);
    }
    let size = message_size(&m);
    let attrs = m.message_attributes.get_or_insert_with(HashMap::new);
    let key = (!original.is_empty()).then(|| carry_key(secret, &body, &original));
    let fits = |key: &String| {
        attrs.len() < 10
            && size + DEDUP_KEY_ATTRIBUTE.len() + "String".len() + key.len() <= max_size
    };
    match key {
        Some(key) if fits(&key) => {
            attrs.insert(
                DEDUP_KEY_ATTRIBUTE.to_owned(),
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(key)
                    .build()
                    .expect("complete attribute"),
            );
        }
        _ => report.without_key.push(id),
    }
    m
}

/// The DLQ's depth and its first messages (peeked: visible again at once).
async fn preview(sqs: &aws_sdk_sqs::Client, dlq_url: &str) -> Result<Redriven, OpsError> {
    let mut report = Redriven {
        waiting: queue_depth(sqs, dlq_url).await?.visible,
        ..Redriven::default()
    };
    let peek = sqs
        .receive_message()
        .queue_url(dlq_url)
        .max_number_of_messages(10)
        .visibility_timeout(0)
        .message_attribute_names("All")
        .send()
        .await
        .map_err(|e| OpsError::Receive {
            queue: dlq_url.to_owned(),
            source: e.into(),
        })?;
    report.preview = peek
        .messages()
        .iter()
        .map(|m| {
            let reason = m
                .message_attributes()
                .and_then(|a| a.get(REASON_ATTRIBUTE))
                .and_then(|v| v.string_value())
                .unwrap_or("(no reason recorded)");
            (m.body().unwrap_or_default().to_owned(), reason.to_owned())
        })
        .collect();
    Ok(report)
}

/// A message's size as SQS counts it against the limit: the body, and each
/// attribute's name, data type and value.
pub fn message_size(m: &Message) -> usize {
    m.body().map_or(0, str::len)
        + m.message_attributes()
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                k.len()
                    + v.data_type().len()
                    + v.string_value().map_or(0, str::len)
                    + v.binary_value().map_or(0, |b| b.as_ref().len())
            })
            .sum::<usize>()
}

/// The messages in order, in batches of at most ten whose total size is at most
/// `max_size` (a message larger than that alone is a batch of one: its send
/// fails and it stays in the DLQ).
pub fn size_batches(messages: &[Message], max_size: usize) -> Vec<&[Message]> {
    let mut out = Vec::new();
    let (mut start, mut total) = (0, 0);
    for (i, m) in messages.iter().enumerate() {
        let size = message_size(m);
        if i > start && (total + size > max_size || i - start == 10) {
            out.push(&messages[start..i]);
            (start, total) = (i, 0);
        }
        total += size;
    }
    if start < messages.len() {
        out.push(&messages[start..]);
    }
    out
}

/// `DeleteMessageBatch` entries for these receipt handles, with ids `m0`, `m1`, ...
/// (unique within the batch; `m{i}` maps a failed entry back to its receipt).
pub(crate) fn delete_entries<'a>(
    receipts: impl IntoIterator<Item = &'a str>,
) -> Vec<aws_sdk_sqs::types::DeleteMessageBatchRequestEntry> {
    receipts
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                .id(format!("m{i}"))
                .receipt_handle(r)
                .build()
                .expect("complete entry")
        })
        .collect()
}

/// The attribute as it was received: data type and value (string or binary).
fn same_attribute(v: &MessageAttributeValue) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type(v.data_type())
        .set_string_value(v.string_value().map(str::to_owned))
        .set_binary_value(v.binary_value().cloned())
        .build()
        .expect("complete attribute")
}

fn send_entry(i: usize, m: &Message, fifo: bool) -> SendMessageBatchRequestEntry {
    let attrs: HashMap<String, MessageAttributeValue> = m
        .message_attributes()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), same_attribute(v)))
        .collect();
    let mut e = SendMessageBatchRequestEntry::builder()
        .id(format!("m{i}"))
        .message_body(m.body().unwrap_or_default())
        .set_message_attributes((!attrs.is_empty()).then_some(attrs));
    if fifo {
        let group = m
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .map_or("sqs-once-redrive", String::as_str);
        // From the DLQ message id: a resend after a crash is deduplicated by SQS
        // (within its 5-minute window; later, the dedup record catches it).
        e = e
            .message_group_id(group)
            .message_deduplication_id(format!("redrive-{}", m.message_id().unwrap_or_default()));
    }
    e.build().expect("complete entry")
}

/// Sends one batch to the source, then deletes from the DLQ what was sent.
async fn move_batch(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    fifo: bool,
    batch: &[Message],
    report: &mut Redriven,
) -> Result<(), OpsError> {
    let id = |m: &Message| m.message_id().unwrap_or_default().to_owned();
    let entries = batch
        .iter()
        .enumerate()
        .map(|(i, m)| send_entry(i, m, fifo))
        .collect();
    let sent = sqs
        .send_message_batch()
        .queue_url(source_url)
        .set_entries(Some(entries))
        .send()
        .await
        .map_err(|e| OpsError::Send {
            queue: source_url.to_owned(),
            moved: report.moved,
            source: e.into(),
        })?;
    let index = |entry_id: &str| entry_id[1..].parse::<usize>().ok();
    for f in sent.failed() {
        if let Some(m) = index(f.id()).and_then(|i| batch.get(i)) {
            let why = format!("{}: {}", f.code(), f.message().unwrap_or(""));
            report.not_sent.push((id(m), why));
        }
    }
    let done: Vec<&Message> = sent
        .successful()
        .iter()
        .filter_map(|s| index(s.id()).and_then(|i| batch.get(i)))
        .collect();
    if done.is_empty() {
        return Ok(());
    }
    let deletes = delete_entries(done.iter().map(|m| m.receipt_handle().unwrap_or_default()));
    match sqs
        .delete_message_batch()
        .queue_url(dlq_url)
        .set_entries(Some(deletes))
        .send()
        .await
    {
        Ok(out) => {
            let failed: Vec<usize> = out.failed().iter().filter_map(|f| index(f.id())).collect();
            for (i, m) in done.iter().enumerate() {
                if failed.contains(&i) {
                    report.in_both.push(id(m));
                } else {
                    report.moved += 1;
                }
            }
        }
        Err(e) => {
            report.in_both.extend(done.iter().map(|m| id(m)));
            return Err(OpsError::DeleteAfterSend {
                queue: dlq_url.to_owned(),
                in_both: done.len(),
                source: e.into(),
            });
        }
    }
    Ok(())
}

async fn queue_arn(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<String, OpsError> {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| OpsError::NoQueueArn {
            queue: url.to_owned(),
        })
}

/// Moves every message with SQS's `StartMessageMoveTask` and waits for it;
/// `None` when the endpoint does not offer it.
async fn move_task(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    progress: &mut impl FnMut(u64),
) -> Result<Option<u64>, OpsError> {
    let (dlq_arn, source_arn) = (
        queue_arn(sqs, dlq_url).await?,
        queue_arn(sqs, source_url).await?,
    );
    let started = sqs
        .start_message_move_task()
        .source_arn(&dlq_arn)
        .destination_arn(&source_arn)
        .send()
        .await;
    let handle = match started {
        Ok(out) => out.task_handle.unwrap_or_default(),
        Err(e) => {
            let unsupported = e
                .as_service_error()
                .is_some_and(|s| s.is_unsupported_operation())
                || e.raw_response().is_some_and(|r| r.status().as_u16() == 501);
            if unsupported {
                return Ok(None);
            }
            return Err(OpsError::StartMoveTask { source: e.into() });
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15 * 60);
    loop {
        let tasks = sqs
            .list_message_move_tasks()
            .source_arn(&dlq_arn)
            .send()
            .await
            .map_err(|e| OpsError::ReadMoveTask { source: e.into() })?;
        let task = tasks
            .results()
            .iter()
            .find(|t| t.task_handle().is_none_or(|h| h == handle) && t.status().is_some());
        if let Some(t) = task {
            let moved = u64::try_from(t.approximate_number_of_messages_moved()).unwrap_or(0);
            progress(moved);
            match t.status() {
                Some("COMPLETED") => return Ok(Some(moved)),
                Some("FAILED") | Some("CANCELLED") => {
                    return Err(OpsError::MoveTaskEnded {
                        status: t.status().unwrap_or_default().to_owned(),
                        moved,
                        reason: t.failure_reason().unwrap_or("no reason given").to_owned(),
                    });
                }
                _ => {}
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(OpsError::MoveTaskStillRunning { handle });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_key_is_made_as_the_consumer_makes_it_and_takes_the_logged_form() {
        let hex = sqs_once::key::sha256_hex(b"evt-1");
        assert_eq!(record_key_of("ledger", "evt-1", false), "ledger#evt-1");
        assert_eq!(
            record_key_of("ledger", "evt-1", true),
            format!("ledger#sha256:{hex}")
        );
        // What logs and spans show of a hashed key, given back.
        let shown = format!("sha256:{hex}");
        assert_eq!(
            record_key_of("ledger", &shown, true),
            format!("ledger#sha256:{hex}")
        );
        // Anything else is a key to hash, and without hashing nothing is taken as hashed.
        for other in [
            format!("sha256:{}", &hex[1..]),
            format!("sha256:{}", hex.to_uppercase()),
        ] {
            assert_ne!(
                record_key_of("ledger", &other, true),
                format!("ledger#{other}")
            );
        }
        assert_eq!(
            record_key_of("ledger", &shown, false),
            record_key("ledger", &shown)
        );
    }

    #[test]
    fn a_redrive_takes_at_most_what_the_dlq_held_at_its_start_and_at_most_max() {
        assert_eq!(redrive_limit(25, None), 25);
        assert_eq!(redrive_limit(25, Some(10)), 10);
        assert_eq!(redrive_limit(5, Some(10)), 5);
        assert_eq!(redrive_limit(0, None), 0);
    }

    /// The receives of a run over a DLQ that held 25: 10, 10, 5, then none,
    /// however many more are parked meanwhile.
    #[test]
    fn receives_stop_at_the_limit() {
        let mut taken = 0;
        let mut asked = Vec::new();
        while let Some(want) = next_receive(25, taken) {
            asked.push(want);
            taken += u64::try_from(want).unwrap();
        }
        assert_eq!(asked, [10, 10, 5]);
        assert_eq!(next_receive(25, 30), None);
        assert_eq!(next_receive(0, 0), None);
    }

    fn record(extra: &[(&str, AttributeValue)]) -> Record {
        let mut item: HashMap<String, AttributeValue> = [
            ("pk", AttributeValue::S("ledger#evt-1".into())),
            ("status", AttributeValue::S("FAILED".into())),
            ("attempts", AttributeValue::N("1".into())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        item.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        record_from_item(&item).unwrap()
    }

    #[test]
    fn pace_keeps_the_average_rate_at_most_the_limit() {
        let rate = 50.0;
        assert_eq!(pace(25.0, rate, Duration::ZERO), Duration::from_millis(500));
        assert_eq!(
            pace(25.0, rate, Duration::from_millis(200)),
            Duration::from_millis(300)
        );
        assert_eq!(pace(25.0, rate, Duration::from_secs(1)), Duration::ZERO);
        assert_eq!(
            pace(25.0, 0.0, Duration::ZERO),
            Duration::ZERO,
            "0: no limit"
        );
    }

    #[test]
    fn describe_record_escapes_the_fields_it_prints() {
        let r = record(&[(
            "error",
            AttributeValue::S("bad\nstatus     COMPLETED\u{1b}[2J".into()),
        )]);
        let text = describe_record(&r, 0);
        assert_eq!(
            text.lines().filter(|l| l.starts_with("status")).count(),
            1,
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text}");
        assert!(
            text.contains("bad\\nstatus     COMPLETED\\u{1b}[2J"),
            "{text}"
        );
    }

    #[test]
    fn describe_record_without_expires_at_says_never() {
        let text = describe_record(&record(&[]), 1_700_000_000_000);
        assert!(text.contains("expires    never"), "{text}");
    }

    fn message(body_len: usize) -> Message {
        Message::builder()
            .body("x".repeat(body_len))
            .message_attributes(
                "sqs_once_reason",
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value("why")
                    .build()
                    .unwrap(),
            )
            .build()
    }

    #[test]
    fn the_operator_redrive_seals_a_carried_key_again_under_the_first_secret() {
        let old = CarrySecret::parse(&"o".repeat(32)).unwrap();
        let new = CarrySecret::parse(&"n".repeat(32)).unwrap();
        let rotating =
            CarrySecret::parse(&format!("{},{}", "n".repeat(32), "o".repeat(32))).unwrap();
        let parked = Message::builder()
            .message_id("dlq-1")
            .body("{}")
            .message_attributes(
                DEDUP_KEY_ATTRIBUTE,
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(carry_key(&old, "{}", "k-1"))
                    .build()
                    .unwrap(),
            )
            .build();
        let mut report = Redriven::default();
        let copy = carrying_key(parked, 262_144, Some(&rotating), &mut report);
        let carried = copy.message_attributes.as_ref().unwrap()[DEDUP_KEY_ATTRIBUTE]
            .string_value()
            .unwrap()
            .to_owned();
        assert_eq!(
            carried,
            carry_key(&new, "{}", "k-1"),
            "sealed under the first secret"
        );
        assert!(report.without_key.is_empty());
    }

    #[test]
    fn message_size_counts_body_and_attribute_names_types_and_values() {
        assert_eq!(message_size(&message(100)), 100 + 15 + 6 + 3);
    }

    #[test]
    fn size_batches_keep_each_batch_within_the_size_and_ten_messages() {
        let max = 262_144;
        let big: Vec<Message> = (0..4).map(|_| message(100_000)).collect();
        let sizes: Vec<usize> = size_batches(&big, max).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![2, 2]);
        let small: Vec<Message> = (0..23).map(|_| message(10)).collect();
        let sizes: Vec<usize> = size_batches(&small, max).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![10, 10, 3]);
        let huge = vec![message(300_000), message(10)];
        let sizes: Vec<usize> = size_batches(&huge, max).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![1, 1], "an oversized message goes alone");
    }
}
