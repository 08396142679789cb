//! The services' limits the protocol counts against, each defined once.
//!
//! SQS (Developer Guide, "Amazon SQS quotas") and DynamoDB (Developer Guide,
//! "Service, account, and table quotas"). The in-memory models enforce the
//! same numbers.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, TransactWriteItem};

/// SQS: the longest visibility timeout, and the longest a message may stay
/// invisible after its receive (so the cap on any retry delay).
pub const SQS_MAX_VISIBILITY: Duration = Duration::from_secs(12 * 60 * 60);
/// SQS: a queue's default `MaximumMessageSize`, 256 KiB (queues may be set
/// from 1 KiB up to [`SQS_MAX_MESSAGE_BYTES`]). What the outbox and parking
/// count against: a body over it goes through S3 (or fails) rather than be
/// refused by a queue left at its default.
pub const SQS_DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// SQS: the largest `MaximumMessageSize` a queue may be set to, 1 MiB
/// (since August 2025; the SendMessage API reference). A pointer's payload
/// is above it by definition; nothing here sends more than the default.
pub const SQS_MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// SQS: the longest delay, per queue or per message.
pub const SQS_MAX_DELAY: Duration = Duration::from_secs(15 * 60);
/// SQS: the longest long-poll wait.
pub const SQS_MAX_WAIT: Duration = Duration::from_secs(20);
/// SQS FIFO: the deduplication interval.
pub const SQS_DEDUP_WINDOW: Duration = Duration::from_secs(5 * 60);
/// SQS: message attributes per message.
pub const SQS_MAX_ATTRIBUTES: usize = 10;
/// SQS: entries per batch call, and messages per receive.
pub const SQS_BATCH: usize = 10;
/// SQS: the total payload of one `SendMessageBatch` that every region takes
/// (256 KiB; some take 1 MiB now).
pub const SQS_MAX_BATCH_BYTES: usize = 256 * 1024;

/// DynamoDB: items per transaction (the dedup record counts).
pub const DYNAMODB_MAX_TRANSACTION_ITEMS: usize = 100;
/// DynamoDB: a transaction's aggregate size (4 MB).
pub const DYNAMODB_MAX_TRANSACTION_BYTES: usize = 4 * 1024 * 1024;
/// DynamoDB: an item's size (400 KB).
pub const DYNAMODB_MAX_ITEM_BYTES: usize = 400 * 1024;

/// A visibility timeout as SQS takes it: whole seconds, rounded up (a
/// part-second extension must not become 0, which makes the message visible
/// at once), capped at [`SQS_MAX_VISIBILITY`].
pub fn visibility_secs(timeout: Duration) -> i32 {
    let secs = timeout.min(SQS_MAX_VISIBILITY).as_millis().div_ceil(1000);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

/// Approximate size of an attribute value as DynamoDB counts it.
fn value_size(v: &AttributeValue) -> usize {
    match v {
        AttributeValue::S(s) => s.len(),
        AttributeValue::N(n) => n.len().div_ceil(2) + 1,
        AttributeValue::B(b) => b.as_ref().len(),
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        AttributeValue::Ss(v) => v.iter().map(String::len).sum(),
        AttributeValue::Ns(v) => v.iter().map(|n| n.len().div_ceil(2) + 1).sum(),
        AttributeValue::Bs(v) => v.iter().map(|b| b.as_ref().len()).sum(),
        AttributeValue::L(l) => 3 + l.iter().map(|v| 1 + value_size(v)).sum::<usize>(),
        AttributeValue::M(m) => 3 + map_size(m),
        _ => 1,
    }
}

/// Approximate size of an item (names and values) as DynamoDB counts it.
pub(crate) fn map_size(m: &HashMap<String, AttributeValue>) -> usize {
    m.iter().map(|(k, v)| k.len() + value_size(v)).sum()
}

/// Approximate size of a staged write: its item or key plus its expression values.
pub(crate) fn write_size(w: &TransactWriteItem) -> usize {
    if let Some(p) = w.put() {
        map_size(p.item()) + p.expression_attribute_values().map_or(0, map_size)
    } else if let Some(u) = w.update() {
        map_size(u.key())
            + u.update_expression().len()
            + u.expression_attribute_values().map_or(0, map_size)
    } else if let Some(d) = w.delete() {
        map_size(d.key()) + d.expression_attribute_values().map_or(0, map_size)
    } else if let Some(c) = w.condition_check() {
        map_size(c.key()) + c.expression_attribute_values().map_or(0, map_size)
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_second_visibility_rounds_up_and_zero_stays_zero() {
        assert_eq!(visibility_secs(Duration::ZERO), 0);
        assert_eq!(visibility_secs(Duration::from_millis(400)), 1);
        assert_eq!(visibility_secs(Duration::from_millis(30_001)), 31);
        assert_eq!(visibility_secs(Duration::from_secs(30)), 30);
        assert_eq!(visibility_secs(Duration::from_secs(13 * 3600)), 43_200);
    }
}
