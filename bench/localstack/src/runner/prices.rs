//! Section 7: what transfers to AWS (item sizes, write units) and dollars per million messages on list prices.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::AttributeValue;

use crate::*;

// --- what transfers to AWS --------------------------------------------------

/// DynamoDB's size of an attribute value, bytes (the documented rules:
/// strings and binaries their length, numbers one byte per two significant
/// digits plus one, lists and maps 3 bytes plus one per element).
pub(crate) fn attr_size(v: &AttributeValue) -> usize {
    match v {
        AttributeValue::S(s) => s.len(),
        AttributeValue::N(n) => {
            let digits = n.trim_start_matches('-').replace('.', "");
            let digits = digits.trim_start_matches('0').trim_end_matches('0');
            digits.len().max(1).div_ceil(2) + 1
        }
        AttributeValue::B(b) => b.as_ref().len(),
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        AttributeValue::Ss(v) => v.iter().map(String::len).sum(),
        AttributeValue::Ns(v) => v
            .iter()
            .map(|n| attr_size(&AttributeValue::N(n.clone())))
            .sum(),
        AttributeValue::Bs(v) => v.iter().map(|b| b.as_ref().len()).sum(),
        AttributeValue::L(l) => 3 + l.iter().map(|e| 1 + attr_size(e)).sum::<usize>(),
        AttributeValue::M(m) => {
            3 + m
                .iter()
                .map(|(k, e)| 1 + k.len() + attr_size(e))
                .sum::<usize>()
        }
        _ => 0,
    }
}

/// The largest item of a table, bytes.
pub(crate) async fn largest_item(ddb: &aws_sdk_dynamodb::Client, table: &str) -> usize {
    let mut pages = ddb.scan().table_name(table).into_paginator().items().send();
    let mut largest = 0;
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        largest = largest.max(item.iter().map(|(k, v)| k.len() + attr_size(v)).sum());
    }
    largest
}

/// List prices, us-east-1 (see bench/RESULTS.md for where they come from).
pub(crate) const SQS_PER_MILLION_REQUESTS: f64 = 0.40;
pub(crate) const DDB_PER_MILLION_WRU: f64 = 0.625;
pub(crate) const DDB_PER_MILLION_RRU: f64 = 0.125;
pub(crate) const LAMBDA_ARM_PER_GB_SECOND: f64 = 0.000_013_333_4;
pub(crate) const LAMBDA_PER_MILLION_REQUESTS: f64 = 0.20;
/// template.yaml's MemorySize.
pub(crate) const LAMBDA_GB: f64 = 0.256;

/// Write units of one call of `op` by `consumer`, from its item sizes: a
/// standard write is 1 unit per started KB of the item, a transaction 2 per
/// KB per item (a cancelled one counted as charged in full: an upper bound).
pub(crate) fn write_units(consumer: &str, op: &str, record: usize, ledger: usize) -> f64 {
    let kb = |b: usize| b.max(1).div_ceil(1024) as f64;
    match op {
        "DynamoDB.TransactWriteItems" => 2.0 * (kb(record) + kb(ledger)),
        "DynamoDB.UpdateItem" if consumer == "plain" => kb(ledger),
        "DynamoDB.UpdateItem" | "DynamoDB.PutItem" | "DynamoDB.DeleteItem" => kb(record),
        _ => 0.0,
    }
}

/// Write and read units per message of `consumer`, from its calls per
/// message and item sizes.
pub(crate) fn units_per_message(
    key: &str,
    calls: &BTreeMap<String, f64>,
    record: usize,
    ledger_bytes: usize,
) -> (f64, f64) {
    let mut wru = 0.0;
    let mut rru = 0.0;
    for (op, n) in calls {
        // Powertools' UpdateItem calls are, half each, the ledger update
        // and its record's completion (one of each per new message).
        if key == "powertools" && op == "DynamoDB.UpdateItem" {
            wru += n / 2.0 * write_units("plain", op, record, ledger_bytes);
            wru += n / 2.0 * write_units(key, op, record, ledger_bytes);
            continue;
        }
        wru += n * write_units(key, op, record, ledger_bytes);
        if op.ends_with("GetItem") || op.ends_with("Query") {
            rru += n * 0.5 * (record.max(1).div_ceil(4096) as f64);
        }
    }
    (wru, rru)
}

/// Section 7: dollars per million messages on list prices, from the calls counted in
/// sections 1 and 2, the item sizes found there, and Lambda batch times.
pub(crate) async fn dollars(bench: &Bench, r: &mut Report) {
    let fast_ms = lambda_batch_ms(bench, true).await;
    let claim_ms = lambda_batch_ms(bench, false).await;
    let f = bench.findings.lock().unwrap();
    r.say(String::new());
    r.say("## 7. Dollars per million messages (us-east-1 list prices; the mix of sections 1-2: 30% of events sent twice)".into());
    r.say(format!(
        "Item sizes (DynamoDB's rules, largest item): records {}; ledger item {} B",
        f.record_bytes
            .iter()
            .map(|(k, v)| format!("{k} {v} B"))
            .collect::<Vec<_>>()
            .join(", "),
        f.ledger_bytes
    ));
    r.say("| consumer | SQS requests / msg | DynamoDB calls / msg | write units / msg | poller: SQS $ | poller: DynamoDB $ | poller total $ | Lambda batch ms | Lambda GB-s + requests $ | Lambda total $ (with DynamoDB) |".into());
    r.say("|---|---|---|---|---|---|---|---|---|---|".into());
    for (name, key, ms) in [
        ("sqs-once fast path", "fast", Some(fast_ms)),
        ("sqs-once claim path", "claim", Some(claim_ms)),
        ("sqs-once insert path", "insert", None),
        (
            "hand-written loop",
            "handwritten",
            f.batch_ms.get("handwritten").copied(),
        ),
        (
            "Powertools",
            "powertools",
            f.batch_ms.get("powertools").copied(),
        ),
        (
            "plain loop (no dedup)",
            "plain",
            f.batch_ms.get("plain").copied(),
        ),
    ] {
        let Some(calls) = f.calls.get(key) else {
            continue;
        };
        let record = f.record_bytes.get(key).copied().unwrap_or(0);
        let sqs_req: f64 = calls
            .iter()
            .filter(|(op, _)| op.starts_with("SQS."))
            .map(|(_, n)| n)
            .sum();
        let ddb_calls: f64 = calls
            .iter()
            .filter(|(op, _)| op.starts_with("DynamoDB."))
            .map(|(_, n)| n)
            .sum();
        let (wru, rru) = units_per_message(key, calls, record, f.ledger_bytes);
        let sqs_usd = sqs_req * SQS_PER_MILLION_REQUESTS;
        let ddb_usd = wru * DDB_PER_MILLION_WRU + rru * DDB_PER_MILLION_RRU;
        let (ms_txt, lambda_usd, lambda_total) = match ms {
            Some(ms) => {
                // One invocation per 10 messages.
                let usd = LAMBDA_GB * ms / 1000.0 / 10.0 * LAMBDA_ARM_PER_GB_SECOND * 1e6
                    + LAMBDA_PER_MILLION_REQUESTS / 10.0;
                (
                    format!("{ms:.0}"),
                    format!("{usd:.3}"),
                    format!("{:.3}", usd + ddb_usd),
                )
            }
            None => ("-".into(), "-".into(), "-".into()),
        };
        r.say(format!(
            "| {name} | {sqs_req:.3} | {ddb_calls:.3} | {wru:.2} | {sqs_usd:.3} | {ddb_usd:.3} | {:.3} | {ms_txt} | {lambda_usd} | {lambda_total} |",
            sqs_usd + ddb_usd
        ));
    }
    r.say("On Lambda the event source mapping's receives and deletes (about 0.2 SQS requests per message, the same for every consumer) come on top.".into());
}
