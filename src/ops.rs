//! What an operator does to a running system: read a record, forget one, move
//! parked messages back, count records and messages. The `sqs-once` binary is
//! the command line over these.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};
use aws_smithy_types::error::display::DisplayErrorContext;

use crate::dedup::dynamodb::{KEY_ATTRIBUTE, record_from_item};
use crate::dedup::{Record, Status, StoredResult};
use crate::key::record_key;
use crate::sqs::{MESSAGE_ID_ATTRIBUTE, REASON_ATTRIBUTE};

/// An operation that failed, in words for the operator.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct OpsError(pub String);

fn fail(what: &str, e: impl std::fmt::Display) -> OpsError {
    OpsError(format!("{what}: {e}"))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn when(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

fn relative(ms: i64, now: i64) -> String {
    let d = Duration::from_secs(u64::try_from((ms - now).abs() / 1000).unwrap_or(0));
    let d = humantime::format_duration(d);
    if ms >= now {
        format!("in {d}")
    } else {
        format!("{d} ago")
    }
}

/// A record for a person: status, owner, lease, attempts, times as UTC and
/// relative to now, result or digest, last error.
pub fn describe_record(r: &Record, now: i64) -> String {
    let mut out = vec![
        format!("key        {}", r.pk),
        format!("status     {}", r.status.as_str()),
        format!("attempts   {}", r.attempts),
    ];
    if let Some(o) = &r.owner {
        out.push(format!("owner      {o}"));
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
    let expires = r.expires_at_s * 1000;
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
    if let Some(m) = &r.message_id {
        out.push(format!("message    {m}"));
    }
    if let Some(p) = &r.payload_sha256 {
        out.push(format!("payload    sha256 {p}"));
    }
    match &r.result {
        Some(StoredResult::Value(v)) => out.push(format!("result     {v}")),
        Some(StoredResult::Digest { sha256, bytes }) => out.push(format!(
            "result     {bytes} bytes, stored as sha256 {sha256}"
        )),
        None => {}
    }
    if let Some(e) = &r.error {
        out.push(format!("error      {e}"));
    }
    out.join("\n")
}

/// Reads the record of `dedup_key` for `consumer`.
pub async fn inspect(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    consumer: &str,
    dedup_key: &str,
) -> Result<Option<Record>, OpsError> {
    let pk = record_key(consumer, dedup_key);
    let out = ddb
        .get_item()
        .table_name(table)
        .key(KEY_ATTRIBUTE, AttributeValue::S(pk.clone()))
        .consistent_read(true)
        .send()
        .await
        .map_err(|e| {
            fail(
                &format!("reading {pk} from {table}"),
                DisplayErrorContext(e),
            )
        })?;
    out.item()
        .map(record_from_item)
        .transpose()
        .map_err(|e| fail(&format!("record {pk} is malformed"), e))
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

/// Deletes the record of `dedup_key` so the event can be processed again. A
/// record under a live claim is left alone unless `force` (its handler may be
/// running: deleting it lets a second attempt start).
pub async fn forget(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    consumer: &str,
    dedup_key: &str,
    force: bool,
) -> Result<Forgotten, OpsError> {
    let pk = record_key(consumer, dedup_key);
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
                record_from_item(item).map_err(|e| fail("the deleted record", e))?,
            )),
            _ => Ok(Forgotten::Absent),
        },
        Err(e) => {
            if let Some(aws_sdk_dynamodb::operation::delete_item::DeleteItemError::ConditionalCheckFailedException(c)) =
                e.as_service_error()
                && let Some(item) = c.item()
            {
                return Ok(Forgotten::InProgress(
                    record_from_item(item).map_err(|e| fail("the record", e))?,
                ));
            }
            Err(fail(
                &format!("deleting {pk} from {table}"),
                DisplayErrorContext(e),
            ))
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

/// Scans the table (at most `max_items` items, reporting each page to
/// `progress`) and counts `consumer`'s records.
pub async fn count_records(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
    consumer: &str,
    max_items: u64,
    mut progress: impl FnMut(&RecordCounts),
) -> Result<RecordCounts, OpsError> {
    let now = now_ms();
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
            .limit(
                i32::try_from(max_items.saturating_sub(counts.scanned).min(1000)).unwrap_or(1000),
            )
            .set_exclusive_start_key(start.take())
            .send()
            .await
            .map_err(|e| fail(&format!("scanning {table}"), DisplayErrorContext(e)))?;
        counts.scanned += u64::try_from(page.scanned_count()).unwrap_or(0);
        for item in page.items() {
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
            if num("expires_at") * 1000 < now {
                counts.expired += 1;
            }
            if status == Status::InProgress.as_str() && num("lease_until") < now {
                counts.stale_in_progress += 1;
            }
            *counts.by_status.entry(status).or_default() += 1;
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
    }
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
        .map_err(|e| fail(&format!("reading queue {url}"), DisplayErrorContext(e)))?
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
    /// Dry run: the DLQ's approximate depth.
    pub waiting: u64,
}

/// Moves up to `max` messages from `dlq_url` back to `source_url`: each is sent
/// to the source (without the `sqs_once_*` attributes parking added) and only
/// then deleted from the DLQ, so a crash in between duplicates a message (the
/// dedup record catches it) but never loses one. `dry_run` moves nothing and
/// shows what would move.
pub async fn redrive(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    max: Option<u64>,
    dry_run: bool,
    mut progress: impl FnMut(u64),
) -> Result<Redriven, OpsError> {
    let mut report = Redriven::default();
    if dry_run {
        report.waiting = queue_depth(sqs, dlq_url).await?.visible;
        let peek = sqs
            .receive_message()
            .queue_url(dlq_url)
            .max_number_of_messages(10)
            .visibility_timeout(0)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| fail(&format!("reading {dlq_url}"), DisplayErrorContext(e)))?;
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
        return Ok(report);
    }
    let fifo = source_url.ends_with(".fifo");
    if max.is_none() && !fifo {
        match move_task(sqs, dlq_url, source_url, &mut progress).await {
            Ok(Some(moved)) => {
                report.moved = moved;
                report.by_move_task = true;
                return Ok(report);
            }
            // Not supported here: move them ourselves.
            Ok(None) => {}
            Err(e) => return Err(e),
        }
    }
    let limit = max.unwrap_or(u64::MAX);
    while report.moved < limit {
        let want = (limit - report.moved).min(10);
        let got = sqs
            .receive_message()
            .queue_url(dlq_url)
            .max_number_of_messages(i32::try_from(want).unwrap_or(10))
            .wait_time_seconds(1)
            .visibility_timeout(60)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| fail(&format!("receiving from {dlq_url}"), DisplayErrorContext(e)))?
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            break;
        }
        let entries = got
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let attrs: HashMap<String, MessageAttributeValue> = m
                    .message_attributes()
                    .into_iter()
                    .flatten()
                    .filter(|(k, _)| *k != REASON_ATTRIBUTE && *k != MESSAGE_ID_ATTRIBUTE)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let mut e = SendMessageBatchRequestEntry::builder()
                    .id(format!("m{i}"))
                    .message_body(m.body().unwrap_or_default())
                    .set_message_attributes((!attrs.is_empty()).then_some(attrs));
                if fifo {
                    let sys = m.attributes();
                    let group = sys
                        .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                        .map_or("sqs-once-redrive", String::as_str);
                    // The DLQ message id: a resend after a crash is deduplicated by SQS.
                    e = e
                        .message_group_id(group)
                        .message_deduplication_id(m.message_id().unwrap_or_default());
                }
                e.build().expect("complete entry")
            })
            .collect();
        let sent = sqs
            .send_message_batch()
            .queue_url(source_url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| fail(&format!("sending to {source_url}"), DisplayErrorContext(e)))?;
        if let Some(f) = sent.failed().first() {
            // Nothing of this batch is deleted: it stays in the DLQ (visible again
            // in 60 s); what was sent is caught as a duplicate if sent again.
            return Err(OpsError(format!(
                "sending to {source_url} failed for {} message(s) ({}: {}); {} moved so far, the rest is still in the DLQ",
                sent.failed().len(),
                f.code(),
                f.message().unwrap_or(""),
                report.moved
            )));
        }
        let deletes =
            crate::sqs::delete_entries(got.iter().map(|m| m.receipt_handle().unwrap_or_default()));
        let deleted = sqs
            .delete_message_batch()
            .queue_url(dlq_url)
            .set_entries(Some(deletes))
            .send()
            .await
            .map_err(|e| {
                fail(
                    &format!(
                        "deleting from {dlq_url} after sending (they are in both queues now; the dedup records catch the copies)"
                    ),
                    DisplayErrorContext(e),
                )
            })?;
        report.moved += (got.len() - deleted.failed().len()) as u64;
        progress(report.moved);
    }
    Ok(report)
}

async fn queue_arn(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<String, OpsError> {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| fail(&format!("reading queue {url}"), DisplayErrorContext(e)))?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| OpsError(format!("queue {url} has no QueueArn")))
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
            return Err(fail(
                "starting the message move task",
                DisplayErrorContext(e),
            ));
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15 * 60);
    loop {
        let tasks = sqs
            .list_message_move_tasks()
            .source_arn(&dlq_arn)
            .send()
            .await
            .map_err(|e| fail("reading the message move task", DisplayErrorContext(e)))?;
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
                    return Err(OpsError(format!(
                        "the message move task ended {} after {moved} message(s): {}",
                        t.status().unwrap_or_default(),
                        t.failure_reason().unwrap_or("no reason given")
                    )));
                }
                _ => {}
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(OpsError(format!(
                "the message move task {handle} is still running after 15 minutes; check it with `aws sqs list-message-move-tasks`"
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
