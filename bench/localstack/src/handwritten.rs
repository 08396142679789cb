//! The baselines `bench/localstack/run` compares sqs-once with, each in its own process
//! (so the OS tells their CPU time apart), on the same SDK and runtime:
//!
//! - `BENCH_LOOP=transactional` (the default): the idempotent-consumer pattern
//!   as a careful engineer writes it by hand. Receive 10; for each message one
//!   `TransactWriteItems` of two items, a put of the dedup record
//!   (`attribute_not_exists(pk)`) and the ledger update, so the effect and the
//!   record commit together; a cancelled transaction whose first reason is
//!   `ConditionalCheckFailed` is a duplicate (deleted, not applied again), a
//!   `TransactionConflict` (two copies in flight at once) is tried again; then
//!   one `DeleteMessageBatch` for the batch. It makes the same calls per message
//!   as sqs-once's fast path, without leases, heartbeats, parking, FIFO lanes or
//!   shutdown handling.
//! - `BENCH_LOOP=best`: the same transaction per message in the best-effort
//!   loop of `best.rs` (a slot freed per message, receives ahead, deletes
//!   batched in the background).
//! - `BENCH_LOOP=plain`: no dedup at all. Receive 10, one `UpdateItem` each,
//!   delete the batch (duplicates are applied again).
//!
//! Settings: `QUEUE_URL`, `LEDGER_TABLE`, `DEDUP_TABLE` (transactional; string
//! key `pk`), `CONSUMER` (`bench`), `CONCURRENCY` (10: one receiving worker
//! per 10 messages in flight), `WAIT_SECS` (long-poll wait, 1), and the
//! standard AWS SDK variables. It exits after two empty receives in a row per
//! worker and prints one JSON line: messages deleted, duplicates, AWS calls by
//! operation (empty receives apart), and the batches' handling time (receive
//! answered to effects done, without the delete).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::types::{AttributeValue, Put, TransactWriteItem, Update};
use aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, Message};
use serde_json::{Value, json};

mod best;

/// What the workers count.
#[derive(Default)]
struct Counts {
    deleted: AtomicU64,
    duplicates: AtomicU64,
    failed: AtomicU64,
    receives: AtomicU64,
    empty_receives: AtomicU64,
    deletes: AtomicU64,
    transactions: AtomicU64,
    updates: AtomicU64,
    /// Time from a receive's answer until its messages' effects were done
    /// (what a Lambda invocation of the same batch would take), microseconds.
    batch_micros: AtomicU64,
}

struct Loop {
    sqs: aws_sdk_sqs::Client,
    ddb: aws_sdk_dynamodb::Client,
    queue_url: String,
    ledger_table: String,
    dedup_table: String,
    consumer: String,
    transactional: bool,
    wait_secs: i32,
    counts: Counts,
}

/// What became of one message.
enum Outcome {
    Applied,
    Duplicate,
    /// Not deleted: it comes back after its visibility timeout.
    Failed,
}

fn env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() {
    let sdk = aws_config::load_from_env().await;
    let mode = env("BENCH_LOOP", "transactional");
    let concurrency: usize = env("CONCURRENCY", "10").parse().expect("CONCURRENCY");
    let l = Arc::new(Loop {
        sqs: aws_sdk_sqs::Client::new(&sdk),
        ddb: aws_sdk_dynamodb::Client::new(&sdk),
        queue_url: std::env::var("QUEUE_URL").expect("QUEUE_URL"),
        ledger_table: std::env::var("LEDGER_TABLE").expect("LEDGER_TABLE"),
        dedup_table: env("DEDUP_TABLE", ""),
        consumer: env("CONSUMER", "bench"),
        transactional: match mode.as_str() {
            "transactional" | "best" => true,
            "plain" => false,
            other => panic!("BENCH_LOOP={other}: transactional, best or plain"),
        },
        wait_secs: env("WAIT_SECS", "1").parse().expect("WAIT_SECS"),
        counts: Counts::default(),
    });
    assert!(
        !l.transactional || !l.dedup_table.is_empty(),
        "DEDUP_TABLE is required"
    );
    if mode == "best" {
        best::run(l.clone(), concurrency).await;
    } else {
        let workers: Vec<_> = (0..concurrency.div_ceil(10).max(1))
            .map(|_| tokio::spawn(l.clone().worker()))
            .collect();
        for w in workers {
            w.await.expect("worker");
        }
    }
    let c = &l.counts;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut calls = BTreeMap::new();
    calls.insert(
        "SQS.ReceiveMessage",
        get(&c.receives) - get(&c.empty_receives),
    );
    calls.insert("SQS.DeleteMessageBatch", get(&c.deletes));
    if l.transactional {
        calls.insert("DynamoDB.TransactWriteItems", get(&c.transactions));
    } else {
        calls.insert("DynamoDB.UpdateItem", get(&c.updates));
    }
    println!(
        "{}",
        json!({
            "loop": mode,
            "handled": get(&c.deleted),
            "duplicates": get(&c.duplicates),
            "failed": get(&c.failed),
            "empty_receives": get(&c.empty_receives),
            "calls": calls,
            "batches": get(&c.receives) - get(&c.empty_receives),
            "batch_ms_total": get(&c.batch_micros) as f64 / 1000.0,
        })
    );
}

impl Loop {
    async fn worker(self: Arc<Self>) {
        let mut idle = 0;
        while idle < 2 {
            self.counts.receives.fetch_add(1, Ordering::Relaxed);
            let got = match self
                .sqs
                .receive_message()
                .queue_url(&self.queue_url)
                .max_number_of_messages(10)
                .wait_time_seconds(self.wait_secs)
                .send()
                .await
            {
                Ok(r) => r.messages.unwrap_or_default(),
                Err(e) => {
                    eprintln!("receive failed: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            if got.is_empty() {
                self.counts.empty_receives.fetch_add(1, Ordering::Relaxed);
                idle += 1;
                continue;
            }
            idle = 0;
            let started = std::time::Instant::now();
            let outcomes = futures::future::join_all(got.iter().map(|m| self.handle(m))).await;
            self.counts
                .batch_micros
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
            let done: Vec<&Message> = got
                .iter()
                .zip(outcomes)
                .filter_map(|(m, o)| match o {
                    Outcome::Applied => Some(m),
                    Outcome::Duplicate => {
                        self.counts.duplicates.fetch_add(1, Ordering::Relaxed);
                        Some(m)
                    }
                    Outcome::Failed => {
                        self.counts.failed.fetch_add(1, Ordering::Relaxed);
                        None
                    }
                })
                .collect();
            self.delete(&done).await;
        }
    }

    async fn delete(&self, done: &[&Message]) {
        if done.is_empty() {
            return;
        }
        let entries = done
            .iter()
            .enumerate()
            .map(|(i, m)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(format!("m{i}"))
                    .receipt_handle(m.receipt_handle().unwrap_or_default())
                    .build()
                    .expect("id and receipt handle set")
            })
            .collect();
        self.counts.deletes.fetch_add(1, Ordering::Relaxed);
        match self
            .sqs
            .delete_message_batch()
            .queue_url(&self.queue_url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            // A failed entry comes back and is then a duplicate.
            Ok(out) => {
                let failed = out.failed().len() as u64;
                self.counts
                    .deleted
                    .fetch_add(done.len() as u64 - failed, Ordering::Relaxed);
            }
            Err(e) => eprintln!("delete failed: {e}"),
        }
    }

    async fn handle(&self, m: &Message) -> Outcome {
        let Ok(event) = serde_json::from_str::<Value>(m.body().unwrap_or_default()) else {
            eprintln!("not JSON: left for the redrive policy");
            return Outcome::Failed;
        };
        let (Some(id), Some(account), Some(amount)) = (
            event["id"].as_str(),
            event["account"].as_str(),
            event["amount_cents"].as_i64(),
        ) else {
            eprintln!("not a ledger event: left for the redrive policy");
            return Outcome::Failed;
        };
        let update = Update::builder()
            .table_name(&self.ledger_table)
            .key("pk", AttributeValue::S(account.to_owned()))
            .update_expression("ADD balance_cents :a, applied_events :one")
            .expression_attribute_values(":a", AttributeValue::N(amount.to_string()))
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .build()
            .expect("table, key and expression set");
        if self.transactional {
            self.apply_once(id, update).await
        } else {
            self.apply(update).await
        }
    }

    /// The plain loop's effect: one `UpdateItem`, no dedup.
    async fn apply(&self, u: Update) -> Outcome {
        self.counts.updates.fetch_add(1, Ordering::Relaxed);
        let res = self
            .ddb
            .update_item()
            .table_name(u.table_name())
            .set_key(Some(u.key().clone()))
            .update_expression(u.update_expression())
            .set_expression_attribute_values(u.expression_attribute_values().cloned())
            .send()
            .await;
        match res {
            Ok(_) => Outcome::Applied,
            Err(e) => {
                eprintln!("update failed: {e}");
                Outcome::Failed
            }
        }
    }

    /// The dedup record and the effect in one transaction.
    async fn apply_once(&self, id: &str, update: Update) -> Outcome {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let record = Put::builder()
            .table_name(&self.dedup_table)
            .item("pk", AttributeValue::S(format!("{}#{id}", self.consumer)))
            .item("status", AttributeValue::S("DONE".into()))
            .item("completed_at", AttributeValue::N(now.to_string()))
            .item(
                "expires_at",
                AttributeValue::N((now + 7 * 24 * 3600).to_string()),
            )
            .condition_expression("attribute_not_exists(pk)")
            .build()
            .expect("table, item and condition set");
        let items = vec![
            TransactWriteItem::builder().put(record).build(),
            TransactWriteItem::builder().update(update).build(),
        ];
        let mut backoff = Duration::from_millis(20);
        for _ in 0..8 {
            self.counts.transactions.fetch_add(1, Ordering::Relaxed);
            let res = self
                .ddb
                .transact_write_items()
                .set_transact_items(Some(items.clone()))
                .send()
                .await;
            match res {
                Ok(_) => return Outcome::Applied,
                Err(e) => match e.as_service_error() {
                    Some(TransactWriteItemsError::TransactionCanceledException(c)) => {
                        let codes: Vec<&str> = c
                            .cancellation_reasons()
                            .iter()
                            .map(|r| r.code().unwrap_or("None"))
                            .collect();
                        if codes.first() == Some(&"ConditionalCheckFailed") {
                            return Outcome::Duplicate;
                        }
                        if !codes
                            .iter()
                            .any(|c| matches!(*c, "TransactionConflict" | "ThrottlingError"))
                        {
                            eprintln!("transaction cancelled: {codes:?}");
                            return Outcome::Failed;
                        }
                    }
                    // Another transaction on these items in progress: try again.
                    Some(TransactWriteItemsError::TransactionInProgressException(_)) => {}
                    // The SDK has already retried throttling and 5xx.
                    _ => {
                        eprintln!("transaction failed: {e}");
                        return Outcome::Failed;
                    }
                },
            }
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
        Outcome::Failed
    }
}
