//! The ledger example: a deliberately non-idempotent effect, so a duplicate
//! would show. Body: `{"id", "account", "amount_cents"}` and optionally
//! `"seq"`. Effect: `ADD balance_cents :amount, applied_events :1` on the
//! account's item (and `seq` appended to its `applied_seq`, to check order),
//! staged into the transaction that records the event done, so a crash at any
//! instant applies it exactly once. Its only effect is that staged write, so
//! it declares [`Effects::StagedOnly`] (the one-transaction fast path). With
//! [`LedgerHandler::with_forward`] it also sends each applied event on through
//! the outbox, sent only after its commit.

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

use aws_sdk_dynamodb::types::{AttributeValue, TransactWriteItem, Update};
use serde::{Deserialize, Serialize};
use sqs_once::{Context, Effects, Handler, HandlerError, HandlerResult, Message};

/// One ledger event.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LedgerEvent {
    /// The business id (the dedup key).
    pub id: String,
    /// The account credited (negative amounts debit).
    pub account: String,
    /// The amount in cents.
    pub amount_cents: i64,
    /// A sequence number to append to the account's `applied_seq` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// The ledger handler, writing to a table with string partition key `pk`.
#[derive(Debug, Clone)]
pub struct LedgerHandler {
    table: String,
    forward: Option<String>,
}

impl LedgerHandler {
    /// A handler writing to `table`.
    pub fn new(table: impl Into<String>) -> Self {
        let table = table.into();
        Self {
            table,
            forward: None,
        }
    }

    /// Sends each applied event on to `queue_url` when its effect commits.
    pub fn with_forward(mut self, queue_url: impl Into<String>) -> Self {
        self.forward = Some(queue_url.into());
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
        let mut expression = "ADD balance_cents :amount, applied_events :one".to_owned();
        let mut update = Update::builder()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(event.account))
            .expression_attribute_values(
                ":amount",
                AttributeValue::N(event.amount_cents.to_string()),
            )
            .expression_attribute_values(":one", AttributeValue::N("1".into()));
        if let Some(seq) = event.seq {
            expression +=
                " SET applied_seq = list_append(if_not_exists(applied_seq, :empty), :seq)";
            let seq = AttributeValue::L(vec![AttributeValue::N(seq.to_string())]);
            update = update
                .expression_attribute_values(":empty", AttributeValue::L(vec![]))
                .expression_attribute_values(":seq", seq);
        }
        let update = update
            .update_expression(expression)
            .build()
            .map_err(HandlerError::permanent)?;
        ctx.stage(TransactWriteItem::builder().update(update).build());
        if let Some(next) = &self.forward {
            ctx.send(next, message.body())?;
        }
        Ok(None)
    }

    fn effects(&self) -> Effects {
        Effects::StagedOnly
    }
}
