//! The ledger example: a deliberately non-idempotent effect, so a duplicate
//! would show. The `ledger` binary (`src/main.rs`) runs [`LedgerHandler`] as a
//! long-polling consumer or as a Lambda function.
//!
//! Body: `{"id": "<event id>", "account": "<account>", "amount_cents": <i64>}`,
//! optionally with `"seq": <u64>`.
//! Effect: `ADD balance_cents :amount, applied_events :1` on item `pk = <account>`
//! of the ledger table (and, with `seq`, appends it to the item's `applied_seq`
//! list: the order in which events were applied, for order checks), staged into
//! the transaction that records the event done, so a crash at any instant
//! applies it exactly once. A body of another shape is a
//! permanent failure (parked with its reason).
//!
//! Its only effect is that staged write, so it declares
//! [`Effects::StagedOnly`] and runs on the
//! one-transaction fast path unless `SQS_ONCE_FAST_PATH=false`.
//!
//! With [`LedgerHandler::with_forward`] it is the first stage of a pipeline:
//! each applied event is also sent on to another queue through the outbox
//! (`Context::send`), recorded with the effect and sent after its commit.
//!
//! Its fault-injection knobs ([`LedgerHandler::with_panics`], simulated work)
//! are for the tests and the chaos harness.

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

use aws_sdk_dynamodb::types::{AttributeValue, TransactWriteItem, Update};
use serde::Deserialize;

use sqs_once::{Context, Effects, Handler, HandlerError, HandlerResult, Message};

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
    /// A sequence number to record in the account's `applied_seq` list.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// The ledger handler.
#[derive(Debug, Clone)]
pub struct LedgerHandler {
    table: String,
    work: std::time::Duration,
    slow_percent: u8,
    panic_percent: u8,
    forward: Option<String>,
}

impl LedgerHandler {
    /// A handler writing to `table` (string partition key `pk`).
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
            work: std::time::Duration::ZERO,
            slow_percent: 100,
            panic_percent: 0,
            forward: None,
        }
    }

    /// Panics on about `percent` % of attempts (chosen by event id and attempt,
    /// so a retry usually succeeds): to watch panics become retries.
    pub fn with_panics(mut self, percent: u8) -> Self {
        self.panic_percent = percent.min(100);
        self
    }

    /// Simulated work per event before the effect is staged (a slow downstream
    /// call), to watch heartbeats, crashes and shutdown mid-handler.
    pub fn with_work(mut self, work: std::time::Duration) -> Self {
        self.work = work;
        self
    }

    /// Spends the [`with_work`](Self::with_work) time on about `percent` % of
    /// events only (chosen by event id, the same on every attempt), so events of
    /// one batch finish in another order than they started.
    pub fn with_slow_percent(mut self, percent: u8) -> Self {
        self.slow_percent = percent.min(100);
        self
    }

    /// Sends each applied event on to the queue at `queue_url` (its body
    /// unchanged), exactly when its effect commits: the next stage.
    pub fn with_forward(mut self, queue_url: impl Into<String>) -> Self {
        self.forward = Some(queue_url.into());
        self
    }

    /// Whether `roll` (a hex digest) falls within `percent` %.
    fn within(roll: &str, percent: u8) -> bool {
        u8::from_str_radix(&roll[..2], 16).unwrap_or(255) % 100 < percent
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
        if self.panic_percent > 0 {
            let roll =
                sqs_once::key::sha256_hex(format!("{}#{}", event.id, ctx.attempt()).as_bytes());
            if Self::within(&roll, self.panic_percent) {
                panic!(
                    "simulated handler bug (LEDGER_PANIC_PERCENT) on {}",
                    event.id
                );
            }
        }
        if !self.work.is_zero()
            && Self::within(
                &sqs_once::key::sha256_hex(event.id.as_bytes()),
                self.slow_percent,
            )
        {
            tokio::time::sleep(self.work).await;
        }
        let mut update = Update::builder()
            .table_name(&self.table)
            .key("pk", AttributeValue::S(event.account.clone()))
            .update_expression("ADD balance_cents :amount, applied_events :one")
            .expression_attribute_values(
                ":amount",
                AttributeValue::N(event.amount_cents.to_string()),
            )
            .expression_attribute_values(":one", AttributeValue::N("1".into()));
        if let Some(seq) = event.seq {
            update = update
                .update_expression(
                    "ADD balance_cents :amount, applied_events :one \
                     SET applied_seq = list_append(if_not_exists(applied_seq, :empty), :seq)",
                )
                .expression_attribute_values(":empty", AttributeValue::L(vec![]))
                .expression_attribute_values(
                    ":seq",
                    AttributeValue::L(vec![AttributeValue::N(seq.to_string())]),
                );
        }
        let update = update.build().map_err(HandlerError::permanent)?;
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
