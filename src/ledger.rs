//! The ledger example: a deliberately non-idempotent effect, so a duplicate
//! would show.
//!
//! Body: `{"id": "<event id>", "account": "<account>", "amount_cents": <i64>}`.
//! Effect: `ADD balance_cents :amount, applied_events :1` on item `pk = <account>`
//! of the ledger table, staged into the transaction that completes the claim, so
//! a crash at any instant applies it exactly once. A body of another shape is a
//! permanent failure (parked with its reason).
//!
//! Its only effect is that staged write, so it declares
//! [`Effects::StagedOnly`](crate::Effects::StagedOnly) and runs on the
//! one-transaction fast path unless `SQS_ONCE_FAST_PATH=false`.

use aws_sdk_dynamodb::types::{AttributeValue, TransactWriteItem, Update};
use serde::Deserialize;

use crate::{Context, Effects, Handler, HandlerError, HandlerResult, Message};

/// One ledger event.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LedgerEvent {
    /// The business id (the dedup key).
    pub id: String,
    /// The account credited (negative amounts debit).
    pub account: String,
    /// The amount in cents.
    pub amount_cents: i64,
}

/// The ledger handler.
#[derive(Debug, Clone)]
pub struct LedgerHandler {
    table: String,
    work: std::time::Duration,
}

impl LedgerHandler {
    /// A handler writing to `table` (string partition key `pk`).
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
            work: std::time::Duration::ZERO,
        }
    }

    /// Simulated work per event before the effect is staged (a slow downstream
    /// call), to watch heartbeats, crashes and shutdown mid-handler.
    pub fn with_work(mut self, work: std::time::Duration) -> Self {
        self.work = work;
        self
    }
}

impl Handler for LedgerHandler {
    async fn handle(&self, message: &Message, ctx: &Context) -> HandlerResult {
        let event: LedgerEvent = message
            .json()
            .map_err(|e| HandlerError::permanent(format!("not a ledger event: {e}")))?;
        if event.account.is_empty() {
            return Err(HandlerError::permanent("not a ledger event: empty account"));
        }
        if !self.work.is_zero() {
            tokio::time::sleep(self.work).await;
        }
        let update = Update::builder()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(event.account.clone()))
            .update_expression("ADD balance_cents :amount, applied_events :one")
            .expression_attribute_values(
                ":amount",
                AttributeValue::N(event.amount_cents.to_string()),
            )
            .expression_attribute_values(":one", AttributeValue::N("1".into()))
            .build()
            .map_err(HandlerError::permanent)?;
        ctx.stage(TransactWriteItem::builder().update(update).build());
        Ok(None)
    }

    fn effects(&self) -> Effects {
        Effects::StagedOnly
    }
}
