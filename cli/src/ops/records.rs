//! Dedup records: read one, describe it, forget it, count them.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};

use super::error::*;
use sqs_once::aws::dynamodb::{KEY_ATTRIBUTE, record_from_item};
use sqs_once::env::escape;
use sqs_once::key::{hashed_record_key, record_key};
use sqs_once::{Record, Status, StoredResult};

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

/// A record for a person: status, owner, lease, attempts, fence, times as UTC and
/// relative to now, result or digest, last error. Every field read from the
/// table is [`escape`]d.
pub fn describe_record(r: &Record, now: i64) -> String {
    let mut out = vec![
        format!("key        {}", escape(&r.pk)),
        format!("status     {}", r.status.as_str()),
        format!("attempts   {}", r.attempts),
    ];
    if r.fence > 0 {
        out.push(format!("fence      {}", r.fence));
    }
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
        Some(_) => out.push("result     (a form this tool does not show)".to_owned()),
        None => {}
    }
    if let Some(e) = &r.error {
        out.push(format!("error      {}", escape(e)));
    }
    if !r.outbox.is_empty() {
        let mut queues: Vec<&str> = r.outbox.iter().map(|o| o.queue_url.as_str()).collect();
        queues.dedup();
        out.push(format!(
            "outbox     {} message(s) recorded, not yet sent (the next delivery or duplicate sends them), to {}",
            r.outbox.len(),
            escape(&queues.join(", "))
        ));
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
    /// Not deleted: it holds messages its handler sent that are not yet
    /// sent; forgetting it would lose them (use `force`).
    Unsent(Record),
}

/// Deletes the record whose key is `pk` (see [`record_key_of`]) so its event
/// can be processed again. A record under a live claim is left alone unless
/// `force` (its handler may be running: deleting it lets a second attempt
/// start), and so is one holding messages not yet sent (the outbox: they
/// would be lost).
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
                "(attribute_not_exists(pk) OR #status <> :in_progress OR lease_until < :now) \
                 AND attribute_not_exists(#outbox)",
            )
            .expression_attribute_names("#status", "status")
            .expression_attribute_names("#outbox", "outbox")
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
                let record = record_from_item(item).map_err(|e| malformed(&pk, e))?;
                if !record.outbox.is_empty() {
                    return Ok(Forgotten::Unsent(record));
                }
                return Ok(Forgotten::InProgress(record));
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
