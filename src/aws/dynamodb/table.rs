//! The start-up check of the dedup table: its key schema and its TTL.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{KeyType, ScalarAttributeType, TimeToLiveStatus};

use super::{DynamoStore, KEY_ATTRIBUTE, TTL_ATTRIBUTE};

/// Why a table cannot serve as the dedup table. Reported at start-up.
#[derive(Debug, thiserror::Error)]
pub enum TableCheckError {
    /// No such table.
    #[error(
        "dedup table `{0}` does not exist (setting SQS_ONCE_TABLE); create it with `sqs-once init`"
    )]
    Missing(String),
    /// Wrong keys.
    #[error(
        "dedup table `{table}` has key schema {found}; expected exactly one string partition key `pk` (setting SQS_ONCE_TABLE)"
    )]
    KeySchema {
        /// The table.
        table: String,
        /// What it has.
        found: String,
    },
    /// TTL not enabled on `expires_at`.
    #[error(
        "dedup table `{table}` has TTL {found}; expected TTL enabled on `expires_at`, or the table grows without bound (setting SQS_ONCE_TABLE; fix with `sqs-once init`)"
    )]
    Ttl {
        /// The table.
        table: String,
        /// What it has.
        found: String,
    },
    /// The check itself failed.
    #[error(
        "could not describe dedup table `{table}` (grant dynamodb:DescribeTable and dynamodb:DescribeTimeToLive on it): {reason}"
    )]
    Unreachable {
        /// The table.
        table: String,
        /// Whether it may pass when tried again (no answer, throttled, 5xx)
        /// rather than a refusal (access denied, bad request).
        transient: bool,
        /// The SDK's message.
        reason: String,
    },
}

impl TableCheckError {
    /// Whether the check may pass when tried again (no answer, throttled, 5xx).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Unreachable {
                transient: true,
                ..
            }
        )
    }
}

impl DynamoStore {
    /// Checks at start-up that the table has the expected key schema and TTL.
    pub async fn check_table(&self) -> Result<(), TableCheckError> {
        // Both descriptions at once: one round trip of start-up (which a
        // Lambda cold start pays) instead of two.
        let (desc, ttl) = tokio::join!(
            self.client.describe_table().table_name(&*self.table).send(),
            self.client
                .describe_time_to_live()
                .table_name(&*self.table)
                .send(),
        );
        let desc = match desc {
            Ok(d) => d,
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_resource_not_found_exception()) =>
            {
                return Err(TableCheckError::Missing(self.table.to_string()));
            }
            Err(e) => return Err(self.unreachable(&e)),
        };
        let t = desc.table().ok_or_else(|| TableCheckError::Unreachable {
            table: self.table.to_string(),
            transient: true,
            reason: "empty DescribeTable answer".into(),
        })?;
        self.check_key_schema(t)?;
        self.check_ttl(&ttl.map_err(|e| self.unreachable(&e))?)
    }

    /// The table check could not be made.
    fn unreachable<E, R>(&self, e: &SdkError<E, R>) -> TableCheckError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        TableCheckError::Unreachable {
            table: self.table.to_string(),
            transient: crate::aws::is_transient(e),
            reason: aws_smithy_types::error::display::DisplayErrorContext(e).to_string(),
        }
    }

    /// Exactly one string partition key, `pk`.
    fn check_key_schema(
        &self,
        t: &aws_sdk_dynamodb::types::TableDescription,
    ) -> Result<(), TableCheckError> {
        let pk_is_string = t.attribute_definitions().iter().any(|d| {
            d.attribute_name() == KEY_ATTRIBUTE && *d.attribute_type() == ScalarAttributeType::S
        });
        let schema_ok = t.key_schema().len() == 1
            && t.key_schema()[0].attribute_name() == KEY_ATTRIBUTE
            && *t.key_schema()[0].key_type() == KeyType::Hash
            && pk_is_string;
        if schema_ok {
            return Ok(());
        }
        let keys: Vec<String> = t
            .key_schema()
            .iter()
            .map(|k| format!("{}:{}", k.attribute_name(), k.key_type().as_str()))
            .collect();
        let types: Vec<String> = t
            .attribute_definitions()
            .iter()
            .map(|d| format!("{}({})", d.attribute_name(), d.attribute_type().as_str()))
            .collect();
        Err(TableCheckError::KeySchema {
            table: self.table.to_string(),
            found: format!("[{}] with types [{}]", keys.join(", "), types.join(", ")),
        })
    }

    /// TTL enabled (or being enabled) on `expires_at`.
    fn check_ttl(
        &self,
        ttl: &aws_sdk_dynamodb::operation::describe_time_to_live::DescribeTimeToLiveOutput,
    ) -> Result<(), TableCheckError> {
        let desc = ttl.time_to_live_description();
        let status = desc.and_then(|d| d.time_to_live_status());
        let attr = desc.and_then(|d| d.attribute_name());
        let enabled = matches!(
            status,
            Some(TimeToLiveStatus::Enabled) | Some(TimeToLiveStatus::Enabling)
        );
        if enabled && attr == Some(TTL_ATTRIBUTE) {
            return Ok(());
        }
        Err(TableCheckError::Ttl {
            table: self.table.to_string(),
            found: format!(
                "{} on {}",
                status.map_or("DISABLED", |s| s.as_str()),
                attr.unwrap_or("no attribute")
            ),
        })
    }
}
