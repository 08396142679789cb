//! The checker: reads what happened (ledger tables or the payment API's
//! charges, the dead-letter queues, the dedup records) and counts every way the
//! history can be wrong.

use std::collections::{BTreeMap, HashMap};

use crate::Event;

/// The seq of an event from its body or any text naming it (`evt-<seq>`).
pub fn seq_of(text: &str) -> Option<u64> {
    let at = text.find("evt-")? + 4;
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// (account -> (balance, applied_events, applied_seq)) of a ledger table.
pub async fn ledger(
    ddb: &aws_sdk_dynamodb::Client,
    table: &str,
) -> BTreeMap<String, (i64, i64, Vec<u64>)> {
    let mut out = BTreeMap::new();
    let mut pages = ddb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        let n = |k: &str| {
            item.get(k)
                .and_then(|v| v.as_n().ok())
                .map_or(0, |v| v.parse().unwrap())
        };
        let seqs = item
            .get("applied_seq")
            .and_then(|v| v.as_l().ok())
            .map(|l| {
                l.iter()
                    .map(|v| v.as_n().unwrap().parse().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        out.insert(
            item["pk"].as_s().unwrap().clone(),
            (n("balance_cents"), n("applied_events"), seqs),
        );
    }
    out
}

/// Parked messages as (seq, reason). Each is deleted once read: a FIFO DLQ
/// hands out no more of a group while one of it is in flight.
pub async fn parked(sqs: &aws_sdk_sqs::Client, url: &str) -> Vec<(Option<u64>, String)> {
    let mut out = Vec::new();
    loop {
        let got = sqs
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(300)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap()
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            return out;
        }
        let entries = got
            .iter()
            .enumerate()
            .map(|(i, m)| {
                aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle().unwrap_or_default())
                    .build()
                    .unwrap()
            })
            .collect();
        let deleted = sqs
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(
            deleted.failed.is_empty(),
            "DLQ delete failed: {:?}",
            deleted.failed
        );
        for m in got {
            let reason = m
                .message_attributes()
                .and_then(|a| a.get("sqs_once_reason"))
                .and_then(|v| v.string_value())
                .unwrap_or("")
                .to_owned();
            out.push((seq_of(m.body().unwrap_or("")), reason));
        }
    }
}

/// Dedup records neither `COMPLETED` nor `FAILED` (claims never finished), and
/// records claimed more than once (a claim released, run out or taken over).
pub async fn records(ddb: &aws_sdk_dynamodb::Client, table: &str) -> (Vec<String>, u64) {
    let (mut unfinished, mut reclaimed) = (Vec::new(), 0);
    let mut pages = ddb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        // The table's carry secret and the consumers' stamps are no
        // records: a record's key is `{consumer}#{key}`.
        if item
            .get("pk")
            .and_then(|v| v.as_s().ok())
            .is_none_or(|pk| !pk.contains('#'))
        {
            continue;
        }
        let status = item.get("status").and_then(|v| v.as_s().ok());
        let attempts: u64 = item
            .get("attempts")
            .and_then(|v| v.as_n().ok())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if !matches!(status.map(String::as_str), Some("COMPLETED" | "FAILED")) {
            let key = item.get("pk").and_then(|v| v.as_s().ok());
            unfinished.push(format!(
                "{} {} after {attempts} attempt(s)",
                key.map_or("?", String::as_str),
                status.map_or("?", String::as_str)
            ));
        }
        reclaimed += u64::from(attempts > 1);
    }
    (unfinished, reclaimed)
}

/// What went wrong, by kind.
#[derive(Default, Debug)]
pub struct Verdict {
    pub applied_once: u64,
    pub lost: u64,
    pub doubled: u64,
    pub parked_valid: u64,
    pub applied_and_parked: u64,
    pub parked_malformed: u64,
    pub malformed_applied: u64,
    pub malformed_not_parked: u64,
    pub violations: Vec<String>,
}

/// Every valid event applied exactly once and never parked; every malformed
/// one parked with a reason and never applied.
pub fn judge(
    events: &[Event],
    applied: &HashMap<u64, u64>,
    parked: &[(Option<u64>, String)],
) -> Verdict {
    let mut v = Verdict::default();
    let mut parked_by_seq: HashMap<u64, u64> = HashMap::new();
    for (seq, reason) in parked {
        let Some(seq) = seq else {
            v.violations
                .push(format!("a parked message names no event: {reason}"));
            continue;
        };
        if reason.is_empty() {
            v.violations
                .push(format!("event {seq} parked without a reason"));
        }
        *parked_by_seq.entry(*seq).or_default() += 1;
    }
    for e in events {
        let n = applied.get(&e.seq).copied().unwrap_or(0);
        let p = parked_by_seq.get(&e.seq).copied().unwrap_or(0);
        if !e.valid {
            v.malformed_applied += u64::from(n > 0);
            v.malformed_not_parked += u64::from(p == 0);
            v.parked_malformed += u64::from(p > 0);
            continue;
        }
        match n {
            0 => v.lost += 1,
            1 => v.applied_once += 1,
            n => v.doubled += n - 1,
        }
        v.parked_valid += u64::from(p > 0);
        v.applied_and_parked += u64::from(p > 0 && n > 0);
    }
    let counts = [
        (v.lost, "valid event(s) lost (never applied)"),
        (v.doubled, "extra application(s) of valid events (doubled)"),
        (v.parked_valid, "valid event(s) parked in the DLQ"),
        (v.applied_and_parked, "event(s) both applied and parked"),
        (v.malformed_applied, "malformed event(s) applied"),
        (v.malformed_not_parked, "malformed event(s) not parked"),
    ];
    for (n, what) in counts {
        if n > 0 {
            v.violations.push(format!("{n} {what}"));
        }
    }
    v
}
