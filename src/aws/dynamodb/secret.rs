//! The carry secret kept in the dedup table itself: made by the first
//! consumer that starts without one, read by every later one and by the
//! operator tool's redrive, so sealing works without a secret to provision.
//!
//! Deleting the item re-keys: consumers started after it make a new secret,
//! those running keep the old one, and copies sealed under either are not
//! honoured by the other (processed under a new key). Never delete it.
//!
//! Whoever can read the dedup table can read it, and so forge a carried key
//! (see docs/DESIGN.md, "Parking"): producers must not be granted
//! `dynamodb:GetItem` on the table. A secret set explicitly
//! (`SQS_ONCE_CARRY_SECRET`) wins and is never written here.

use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::AttributeValue;
use aws_smithy_types::error::display::DisplayErrorContext;

use super::{DynamoStore, KEY_ATTRIBUTE};
use crate::protocol::key::CarrySecret;

/// The key of the item holding the table's carry secret. It has no `#`, so
/// no record (`{consumer}#{key}`) can have it, and no TTL attribute, so it
/// never expires.
pub const CARRY_SECRET_ITEM: &str = "sqs-once:carry-secret";
/// The attribute of that item holding the secret (64 hex digits).
const SECRET_ATTRIBUTE: &str = "secret";

/// Why the table's carry secret could not be read or made.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot {doing} the carry secret kept in dedup table `{table}` (item pk = {CARRY_SECRET_ITEM}; grant dynamodb:{action} on it, or set SQS_ONCE_CARRY_SECRET): {reason}"
)]
pub struct SecretError {
    table: String,
    doing: &'static str,
    action: &'static str,
    reason: String,
    transient: bool,
}

impl SecretError {
    /// Whether trying again may succeed (no answer, throttling, a 5xx).
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

impl DynamoStore {
    /// The carry secret kept in the table ([`CARRY_SECRET_ITEM`]), made
    /// first when there is none and `create` (a conditional put: when two
    /// consumers start at once, both end with the one that landed first).
    /// `Ok(None)`: there is none and `create` is off.
    pub async fn table_carry_secret(
        &self,
        create: bool,
    ) -> Result<Option<CarrySecret>, SecretError> {
        if let Some(secret) = self.read_carry_secret().await? {
            return Ok(Some(secret));
        }
        if !create {
            return Ok(None);
        }
        let made = random_secret();
        let put = self
            .client
            .put_item()
            .table_name(&*self.table)
            .item(
                KEY_ATTRIBUTE,
                AttributeValue::S(CARRY_SECRET_ITEM.to_owned()),
            )
            .item(SECRET_ATTRIBUTE, AttributeValue::S(made))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await;
        match put {
            Ok(_) => tracing::info!(
                table = %self.table,
                "made a carry secret and kept it in the dedup table (item {CARRY_SECRET_ITEM})"
            ),
            Err(e)
                if e.as_service_error()
                    .is_some_and(|e| e.is_conditional_check_failed_exception()) => {}
            Err(e) => return Err(self.secret_error("make", "PutItem", &e)),
        }
        self.read_carry_secret()
            .await?
            .map(Some)
            .ok_or_else(|| SecretError {
                table: self.table.to_string(),
                doing: "read back",
                action: "GetItem",
                reason: "no secret after it was written".into(),
                transient: true,
            })
    }

    async fn read_carry_secret(&self) -> Result<Option<CarrySecret>, SecretError> {
        let got = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(
                KEY_ATTRIBUTE,
                AttributeValue::S(CARRY_SECRET_ITEM.to_owned()),
            )
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.secret_error("read", "GetItem", &e))?;
        let Some(text) = got
            .item()
            .and_then(|item| item.get(SECRET_ATTRIBUTE))
            .and_then(|v| v.as_s().ok())
        else {
            return Ok(None);
        };
        CarrySecret::parse(text).map(Some).map_err(|e| SecretError {
            table: self.table.to_string(),
            doing: "use",
            action: "GetItem",
            reason: e.to_string(),
            transient: false,
        })
    }

    fn secret_error<E, R>(
        &self,
        doing: &'static str,
        action: &'static str,
        e: &SdkError<E, R>,
    ) -> SecretError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        SecretError {
            table: self.table.to_string(),
            doing,
            action,
            reason: DisplayErrorContext(e).to_string(),
            transient: crate::aws::is_transient(e),
        }
    }
}

/// 32 bytes from the operating system's random source, as 64 hex digits
/// (the form `SQS_ONCE_CARRY_SECRET` takes).
fn random_secret() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source");
    hex::encode(bytes)
}
