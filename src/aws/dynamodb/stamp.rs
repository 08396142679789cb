//! The consumer's stamp: one item per consumer in the dedup table saying
//! which record format its records are written in, which key derivation made
//! their keys, and the key settings in force. Read at start-up, so a build
//! that would not find the records it wrote before (a changed key
//! derivation: every message seen before would run again) or could not read
//! them (a newer record format) refuses to start instead of re-applying.
//!
//! A table written by a version from before the stamp gets one at the first
//! start: those versions derived keys and wrote records as derivation and
//! format 1 do.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::AttributeValue;
use aws_smithy_types::error::display::DisplayErrorContext;

use super::DynamoStore;
use super::KEY_ATTRIBUTE;
use crate::protocol::key::KEY_DERIVATION;

/// The format this build writes records in ([`RECORD_FORMAT_ATTRIBUTE`] on
/// each record) and the newest it reads. A record without the attribute is
/// of format 1.
pub const RECORD_FORMAT: u32 = 1;
/// The attribute of a record holding its format.
pub const RECORD_FORMAT_ATTRIBUTE: &str = "fmt";

const FORMAT: &str = "record_format";
const DERIVATION: &str = "key_derivation";
const SCHEME: &str = "key_settings";
const WRITTEN_BY: &str = "written_by";

/// The key of consumer `consumer`'s stamp, in the table's key space beside
/// the records (`{consumer}#{key}`, which always hold a `#` after the
/// consumer's name) and the carry secret.
pub fn stamp_key(consumer: &str) -> String {
    format!("sqs-once:stamp:{consumer}")
}

/// What the start-up found in the stamp.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StampCheck {
    /// There was none: this start wrote it.
    Written,
    /// It matches this build and these settings.
    Same,
    /// The key settings differ from those the stamp names (now replaced):
    /// records made under the old ones are not found by the new ones.
    KeySettingsChanged {
        /// What the stamp said before.
        was: String,
    },
}

/// Why the consumer may not start on this table, or its stamp could not be
/// read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StampError {
    /// The records were written in a format newer than this build reads.
    #[error(
        "dedup table `{table}`: consumer `{consumer}`'s records are written in record format {stored} (by sqs-once {by}); this build (sqs-once {ours}) reads formats up to {RECORD_FORMAT}: run the newer version (an older one beside it would misread its records)",
        ours = env!("CARGO_PKG_VERSION")
    )]
    NewerRecords {
        /// The dedup table.
        table: String,
        /// The consumer.
        consumer: String,
        /// The format the stamp names.
        stored: u32,
        /// The version that wrote the stamp.
        by: String,
    },
    /// This build derives keys differently from the one that made the
    /// records: every message seen before would run again.
    #[error(
        "dedup table `{table}`: consumer `{consumer}`'s keys were made by key derivation {stored} (sqs-once {by}); this build (sqs-once {ours}) makes them by derivation {KEY_DERIVATION}, so no record made before would be found and every message seen before would run again. Run the version that made them until the queue and its DLQ are drained (on Lambda, disable the event source mapping before deploying a build that refuses: each failed start spends a receive), then set the stamp's key_derivation to {KEY_DERIVATION} (item {KEY_ATTRIBUTE} = \"{pk}\"; deleting it stamps derivation {LEGACY_KEY_DERIVATION} again) to start under the new one (CHANGELOG.md marks such changes Re-applies)",
        ours = env!("CARGO_PKG_VERSION")
    )]
    KeyDerivationChanged {
        /// The dedup table.
        table: String,
        /// The consumer.
        consumer: String,
        /// The stamp's key.
        pk: String,
        /// The derivation the stamp names.
        stored: u32,
        /// The version that wrote the stamp.
        by: String,
    },
    /// The stamp holds something other than a stamp.
    #[error(
        "dedup table `{table}`: the consumer's stamp (item {KEY_ATTRIBUTE} = \"{pk}\") has no whole number `{attribute}`: fix it, or delete it to have it written again"
    )]
    Malformed {
        /// The dedup table.
        table: String,
        /// The stamp's key.
        pk: String,
        /// The attribute that is missing or not a number.
        attribute: String,
    },
    /// The stamp could not be read or written.
    #[error(
        "cannot {doing} consumer `{consumer}`'s stamp in dedup table `{table}` (item {KEY_ATTRIBUTE} = \"sqs-once:stamp:{consumer}\"; grant dynamodb:{action} on the table): {reason}"
    )]
    Call {
        /// The dedup table.
        table: String,
        /// The consumer.
        consumer: String,
        /// What was being done.
        doing: &'static str,
        /// The permission it needs.
        action: &'static str,
        /// What went wrong.
        reason: String,
        /// Whether trying again may succeed.
        transient: bool,
    },
}

impl StampError {
    /// Whether trying again may succeed (no answer, throttling, a 5xx).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StampError::Call {
                transient: true,
                ..
            }
        )
    }
}

struct Stored {
    format: u32,
    derivation: u32,
    scheme: String,
    by: String,
}

impl Stored {
    /// A stamp this build writes: its record format, `derivation`, the key
    /// settings in force and its version.
    fn this_build(derivation: u32, key_settings: &str) -> Self {
        Self {
            format: RECORD_FORMAT,
            derivation,
            scheme: key_settings.to_owned(),
            by: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }
}

/// The key derivation of the versions from before the stamp: a consumer
/// without a stamp is taken to have made its keys by it (a newer build
/// finding no stamp cannot tell a new consumer from an old one, so it
/// stamps this and refuses until the operator says otherwise).
pub const LEGACY_KEY_DERIVATION: u32 = 1;

impl DynamoStore {
    /// Checks consumer `consumer`'s stamp against this build and
    /// `key_settings` (the key settings in force, as text), writing it when
    /// there is none (as [`LEGACY_KEY_DERIVATION`]'s) and replacing its key
    /// settings when they changed.
    pub async fn check_stamp(
        &self,
        consumer: &str,
        key_settings: &str,
    ) -> Result<StampCheck, StampError> {
        let pk = stamp_key(consumer);
        let (stored, written) = self.stamp_or_first(consumer, &pk, key_settings).await?;
        self.refuse_if_incompatible(consumer, &pk, &stored)?;
        if written {
            return Ok(StampCheck::Written);
        }
        if stored.scheme == key_settings && stored.format == RECORD_FORMAT {
            return Ok(StampCheck::Same);
        }
        // An older format (read as well as ours) is moved up to ours; new
        // key settings replace the old ones, which the caller reports. Only
        // over the stamp as read: one changed meanwhile (another start, an
        // operator) is checked again from the start.
        let ours = Stored::this_build(KEY_DERIVATION, key_settings);
        if !self
            .write_stamp(consumer, &pk, &ours, Some(&stored))
            .await?
        {
            return Err(self.call_error(
                consumer,
                "replace",
                "PutItem",
                "the stamp changed while it was checked".into(),
                true,
            ));
        }
        if stored.scheme == key_settings {
            Ok(StampCheck::Same)
        } else {
            Ok(StampCheck::KeySettingsChanged { was: stored.scheme })
        }
    }

    /// The consumer's stamp, and whether this start wrote it: the one
    /// stored, or, where there is none, a first one naming
    /// [`LEGACY_KEY_DERIVATION`] (a conditional put: when another start
    /// wrote one meanwhile, that one).
    async fn stamp_or_first(
        &self,
        consumer: &str,
        pk: &str,
        key_settings: &str,
    ) -> Result<(Stored, bool), StampError> {
        if let Some(stored) = self.read_stamp(consumer, pk).await? {
            return Ok((stored, false));
        }
        let first = Stored::this_build(LEGACY_KEY_DERIVATION, key_settings);
        if self.write_stamp(consumer, pk, &first, None).await? {
            tracing::info!(
                table = %self.table, consumer, record_format = first.format,
                key_derivation = first.derivation,
                "stamped the dedup table with this consumer's record format and key derivation"
            );
            return Ok((first, true));
        }
        let theirs = self.read_stamp(consumer, pk).await?.ok_or_else(|| {
            self.call_error(consumer, "read back", "GetItem", "gone".into(), true)
        })?;
        Ok((theirs, false))
    }

    /// Refuses a stamp whose records this build cannot read, or whose keys
    /// it would make otherwise.
    fn refuse_if_incompatible(
        &self,
        consumer: &str,
        pk: &str,
        stored: &Stored,
    ) -> Result<(), StampError> {
        if stored.format > RECORD_FORMAT {
            return Err(StampError::NewerRecords {
                table: self.table.to_string(),
                consumer: consumer.to_owned(),
                stored: stored.format,
                by: stored.by.clone(),
            });
        }
        if stored.derivation != KEY_DERIVATION {
            return Err(StampError::KeyDerivationChanged {
                table: self.table.to_string(),
                consumer: consumer.to_owned(),
                pk: pk.to_owned(),
                stored: stored.derivation,
                by: stored.by.clone(),
            });
        }
        Ok(())
    }

    async fn read_stamp(&self, consumer: &str, pk: &str) -> Result<Option<Stored>, StampError> {
        let got = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(KEY_ATTRIBUTE, AttributeValue::S(pk.to_owned()))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.sdk_error(consumer, "read", "GetItem", &e))?;
        let Some(item) = got.item() else {
            return Ok(None);
        };
        let number = |name: &str| -> Result<u32, StampError> {
            item.get(name)
                .and_then(|v| v.as_n().ok())
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| StampError::Malformed {
                    table: self.table.to_string(),
                    pk: pk.to_owned(),
                    attribute: name.to_owned(),
                })
        };
        let text = |name: &str| {
            item.get(name)
                .and_then(|v| v.as_s().ok())
                .cloned()
                .unwrap_or_default()
        };
        Ok(Some(Stored {
            format: number(FORMAT)?,
            derivation: number(DERIVATION)?,
            scheme: text(SCHEME),
            by: text(WRITTEN_BY),
        }))
    }

    /// Writes `stamp`: only where there is none (`over` is `None`), or only
    /// over the stamp `over` as read. False when that condition failed.
    async fn write_stamp(
        &self,
        consumer: &str,
        pk: &str,
        stamp: &Stored,
        over: Option<&Stored>,
    ) -> Result<bool, StampError> {
        let put = self
            .client
            .put_item()
            .table_name(&*self.table)
            .item(KEY_ATTRIBUTE, AttributeValue::S(pk.to_owned()))
            .item(FORMAT, AttributeValue::N(stamp.format.to_string()))
            .item(DERIVATION, AttributeValue::N(stamp.derivation.to_string()))
            .item(SCHEME, AttributeValue::S(stamp.scheme.clone()))
            .item(WRITTEN_BY, AttributeValue::S(stamp.by.clone()));
        let put = match over {
            None => put.condition_expression("attribute_not_exists(pk)"),
            Some(old) => put
                .condition_expression("#f = :f AND #d = :d AND #s = :s")
                .expression_attribute_names("#f", FORMAT)
                .expression_attribute_names("#d", DERIVATION)
                .expression_attribute_names("#s", SCHEME)
                .expression_attribute_values(":f", AttributeValue::N(old.format.to_string()))
                .expression_attribute_values(":d", AttributeValue::N(old.derivation.to_string()))
                .expression_attribute_values(":s", AttributeValue::S(old.scheme.clone())),
        };
        match put.send().await {
            Ok(_) => Ok(true),
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) =>
            {
                Ok(false)
            }
            Err(e) => Err(self.sdk_error(consumer, "write", "PutItem", &e)),
        }
    }

    fn sdk_error<E, R>(
        &self,
        consumer: &str,
        doing: &'static str,
        action: &'static str,
        e: &SdkError<E, R>,
    ) -> StampError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        self.call_error(
            consumer,
            doing,
            action,
            DisplayErrorContext(e).to_string(),
            crate::aws::is_transient(e),
        )
    }

    fn call_error(
        &self,
        consumer: &str,
        doing: &'static str,
        action: &'static str,
        reason: String,
        transient: bool,
    ) -> StampError {
        StampError::Call {
            table: self.table.to_string(),
            consumer: consumer.to_owned(),
            doing,
            action,
            reason,
            transient,
        }
    }
}
