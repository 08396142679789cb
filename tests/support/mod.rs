//! Helpers shared by the integration tests, the chaos harness and the
//! benchmarks (each includes this file with `#[path]`).
#![allow(dead_code)]

pub mod payments_api;

use std::collections::HashMap;

use aws_sdk_sqs::types::{QueueAttributeName, SendMessageBatchRequestEntry};

/// An environment variable parsed, or the default.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A name no other test or run against the same LocalStack uses.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Visible, in-flight and delayed messages.
pub async fn depth(sqs: &aws_sdk_sqs::Client, url: &str) -> u64 {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default()
        .values()
        .map(|v| v.parse::<u64>().unwrap_or(0))
        .sum()
}

/// The ledger table: account -> (balance_cents, applied_events).
pub async fn ledger_rows(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> HashMap<String, (i64, i64)> {
    let mut out = HashMap::new();
    let mut pages = client
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
        out.insert(
            item["pk"].as_s().unwrap().clone(),
            (n("balance_cents"), n("applied_events")),
        );
    }
    out
}

/// Sends the bodies in batches of 10, in order; every entry must be accepted.
pub async fn send_all(sqs: &aws_sdk_sqs::Client, url: &str, bodies: &[String]) {
    for chunk in bodies.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, b)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(b)
                    .build()
                    .unwrap()
            })
            .collect();
        let out = sqs
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(out.failed().is_empty(), "{:?}", out.failed());
    }
}
