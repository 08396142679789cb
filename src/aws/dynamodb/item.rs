//! A dedup record read from its DynamoDB item.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use super::{
    KEY_ATTRIBUTE, OUTBOX_ATTRIBUTE, RECORD_FORMAT, RECORD_FORMAT_ATTRIBUTE, TTL_ATTRIBUTE,
};
use crate::protocol::outcome::StoredResult;
use crate::protocol::store::{Record, Status, StoreError};

/// What a committed claim replaced (its `ALL_OLD` item), as [`Replaced`].
/// Read field by field and leniently: the claim is ours whatever the old
/// item held (a status from a newer version, say), and must not fail after
/// it committed.
pub(super) fn replaced(old: Option<&HashMap<String, AttributeValue>>, owner: &str) -> Replaced {
    let Some(old) = old else {
        return Replaced::default();
    };
    let text = |k: &str| old.get(k).and_then(|v| v.as_s().ok()).map(String::as_str);
    let number = |k: &str| -> Option<i64> { old.get(k)?.as_n().ok()?.parse().ok() };
    let attempts = number("attempts")
        .and_then(|a| u32::try_from(a).ok())
        .unwrap_or(0);
    let taken_over = text("status") == Some(Status::InProgress.as_str())
        && number("lease_until").is_some_and(|l| l > 0)
        && text("owner") != Some(owner);
    Replaced {
        attempts,
        taken_over,
        fence: number_u64(old, "fence"),
    }
}

/// What a committed claim replaced.
#[derive(Debug, Default)]
pub(super) struct Replaced {
    /// The attempts so far.
    pub(super) attempts: u32,
    /// Whether it was another consumer's claim left to expire.
    pub(super) taken_over: bool,
    /// Its fence, if it had one.
    pub(super) fence: Option<u64>,
}

/// The whole number `key` of `item`, if it reads as one.
fn number_u64(item: &HashMap<String, AttributeValue>, key: &str) -> Option<u64> {
    item.get(key)?.as_n().ok()?.parse().ok()
}

/// A DynamoDB item that is not a dedup record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// No partition key.
    #[error("dedup record without `pk`")]
    NoKey,
    /// No status.
    #[error("dedup record {pk} without `status`")]
    NoStatus {
        /// The record's key.
        pk: String,
    },
    /// A status this version does not know.
    #[error("dedup record {pk} has unknown status {status:?}")]
    UnknownStatus {
        /// The record's key.
        pk: String,
        /// What it has.
        status: String,
    },
    /// A stored outbox that does not read back.
    #[error("dedup record {pk}: its outbox (messages to send) does not read back: {source}")]
    OutboxUnreadable {
        /// The record's key.
        pk: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A record written in a format newer than this build reads.
    #[error(
        "dedup record {pk} is in record format {format}, newer than this build reads (up to {RECORD_FORMAT}): run the newer sqs-once"
    )]
    NewerFormat {
        /// The record's key.
        pk: String,
        /// Its format, as stored.
        format: String,
    },
    /// A stored result that is not JSON.
    #[error("dedup record {pk}: result is not JSON: {source}")]
    ResultNotJson {
        /// The record's key.
        pk: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

impl From<RecordError> for StoreError {
    /// A newer build's record is a failure that may pass (the message is
    /// retried, for a newer consumer to take, or for this one once
    /// upgraded); any other unreadable record is invalid.
    fn from(e: RecordError) -> Self {
        match e {
            RecordError::NewerFormat { .. } => StoreError::Unavailable(e.to_string()),
            e => StoreError::Invalid(e.to_string()),
        }
    }
}

/// Whether the numbers the claim condition compares (`expires_at`,
/// `lease_until`, `claimed_at`) are, where present, whole numbers as
/// [`record_from_item`] reads them. One written otherwise (`1800000000.5`
/// by another tool) reads as absent, and an absent `expires_at` as never
/// expiring, where DynamoDB's condition compares the number itself: a
/// decision from such a record is left to the condition.
pub(super) fn condition_numbers_exact(item: &HashMap<String, AttributeValue>) -> bool {
    [TTL_ATTRIBUTE, "lease_until", "claimed_at", "fence"]
        .iter()
        .all(|k| {
            item.get(*k)
                .is_none_or(|v| v.as_n().is_ok_and(|n| n.parse::<i64>().is_ok()))
        })
}

/// Reads a dedup record from a DynamoDB item.
pub fn record_from_item(item: &HashMap<String, AttributeValue>) -> Result<Record, RecordError> {
    let str_of = |k: &str| item.get(k).and_then(|v| v.as_s().ok()).cloned();
    let num_of = |k: &str| -> Option<i64> {
        item.get(k)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse().ok())
    };
    let pk = str_of(KEY_ATTRIBUTE).ok_or(RecordError::NoKey)?;
    // No format attribute: format 1, written before records carried one.
    // One that is not a whole number this build knows is not misread as 1.
    if let Some(stored) = item.get(RECORD_FORMAT_ATTRIBUTE) {
        let format = stored.as_n().ok().and_then(|n| n.parse::<i64>().ok());
        if format.is_none_or(|f| f > i64::from(RECORD_FORMAT)) {
            return Err(RecordError::NewerFormat {
                pk,
                format: format.map_or_else(|| format!("{stored:?}"), |f| f.to_string()),
            });
        }
    }
    let Some(status_s) = str_of("status") else {
        return Err(RecordError::NoStatus { pk });
    };
    let Some(status) = Status::parse(&status_s) else {
        return Err(RecordError::UnknownStatus {
            pk,
            status: status_s,
        });
    };
    let result = if let Some(text) = str_of("result") {
        match serde_json::from_str(&text) {
            Ok(value) => Some(StoredResult::Value(value)),
            Err(source) => return Err(RecordError::ResultNotJson { pk, source }),
        }
    } else {
        str_of("result_sha256").map(|sha256| StoredResult::Digest {
            sha256,
            bytes: num_of("result_bytes")
                .and_then(|b| u64::try_from(b).ok())
                .unwrap_or(0),
        })
    };
    let outbox = match str_of(OUTBOX_ATTRIBUTE) {
        None => Vec::new(),
        Some(text) => match crate::protocol::outbox::from_stored(&text) {
            Ok(outbox) => outbox,
            Err(source) => return Err(RecordError::OutboxUnreadable { pk, source }),
        },
    };
    Ok(Record {
        status,
        outbox,
        owner: str_of("owner"),
        lease_until_ms: num_of("lease_until").unwrap_or(0),
        expires_at_s: num_of(TTL_ATTRIBUTE).unwrap_or(i64::MAX),
        attempts: num_of("attempts")
            .and_then(|a| u32::try_from(a).ok())
            .unwrap_or(0),
        fence: number_u64(item, "fence").unwrap_or(0),
        payload_sha256: str_of("payload_sha256"),
        result,
        message_id: str_of("message_id"),
        claimed_at_ms: num_of("claimed_at"),
        completed_at_ms: num_of("completed_at"),
        error: str_of("error"),
        pk,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_numbers_in_the_compared_attributes_are_exact() {
        let item = |pairs: &[(&str, AttributeValue)]| -> HashMap<String, AttributeValue> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect()
        };
        let n = |v: &str| AttributeValue::N(v.into());
        assert!(condition_numbers_exact(&item(&[])));
        assert!(condition_numbers_exact(&item(&[
            ("expires_at", n("1800000000")),
            ("lease_until", n("1800000000000")),
            ("claimed_at", n("-5")),
            ("attempts", n("1.5")),
        ])));
        for attribute in ["expires_at", "lease_until", "claimed_at"] {
            for bad in [n("1800000000.5"), n("1e9"), AttributeValue::S("1".into())] {
                assert!(
                    !condition_numbers_exact(&item(&[(attribute, bad.clone())])),
                    "{attribute} {bad:?}"
                );
            }
        }
    }

    #[test]
    fn a_record_without_a_format_is_read_as_format_one_and_a_newer_one_is_refused() {
        let record = |format: Option<&str>| {
            let mut item = HashMap::from([
                (KEY_ATTRIBUTE.to_owned(), AttributeValue::S("c#k".into())),
                ("status".to_owned(), AttributeValue::S("COMPLETED".into())),
                ("owner".to_owned(), AttributeValue::S("o".into())),
            ]);
            if let Some(f) = format {
                item.insert(
                    RECORD_FORMAT_ATTRIBUTE.to_owned(),
                    AttributeValue::N(f.into()),
                );
            }
            record_from_item(&item)
        };
        // Written before records carried a format: found, as before.
        let old = record(None).expect("a record of format 1 without the attribute");
        assert_eq!(old.status, Status::Completed);
        assert_eq!(old.pk, "c#k");
        assert!(record(Some(&RECORD_FORMAT.to_string())).is_ok());
        let newer = (RECORD_FORMAT + 1).to_string();
        let err = record(Some(&newer)).expect_err("a newer format is not misread");
        assert!(matches!(err, RecordError::NewerFormat { .. }), "{err}");
        assert!(
            err.to_string().contains("newer than this build reads"),
            "{err}"
        );
        // Retried, not parked: a newer consumer (or this one, upgraded) reads it.
        assert!(!StoreError::from(err).is_permanent());
        // A format that is not a whole number is not read as format 1.
        assert!(matches!(
            record(Some("1.5")),
            Err(RecordError::NewerFormat { .. })
        ));
    }
}
