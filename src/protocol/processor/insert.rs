//! The insert path ([`Effects::Insert`](crate::Effects::Insert)): the
//! handler's one staged `Put` is the claim and the record. One conditional
//! `PutItem` writes the item with its marker where no item has its key; a
//! refused one is answered from the item in the way.

use tracing::{info, warn};

use crate::Message;
use crate::protocol::handler::{Context, HandlerError};
use crate::protocol::outcome::Outcome;
use crate::protocol::store::Status;
use crate::protocol::store::{
    DedupStore, INSERT_KEY_ATTRIBUTE, INSERT_PAYLOAD_ATTRIBUTE, InsertCommit, Inserted,
};

use super::lease::LocalEnd;
use super::*;
use crate::protocol::outbox::Outgoing;

impl<S: DedupStore, H: Handler> Processor<S, H> {
    /// The insert path's commit: the handler's one `Put` checked, then
    /// written with its marker (the message kept visible meanwhile).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn commit_insert(
        &self,
        message: &Message,
        key: &str,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        ctx: &Context,
        value: Option<serde_json::Value>,
        outbox: &[Outgoing],
        item_key: &'static [&'static str],
    ) -> Outcome {
        let pk = self.config.record_key(key);
        let commit = match self.insert_of(ctx, outbox, item_key, &pk, message) {
            Ok(commit) => commit,
            Err(reason) => {
                let e = HandlerError::permanent(reason);
                return self
                    .kept_visible(message, opts, visible, self.fast_failure(message, &e))
                    .await;
            }
        };
        let written = self
            .while_visible(message, opts, visible, self.store.commit_insert(commit))
            .await;
        let Some(written) = written else {
            return super::fast::visibility_lost_during_commit();
        };
        match written {
            Ok(Inserted::Inserted) => Outcome::Completed {
                result: value.map(|v| self.bounded(&v)),
            },
            // Ours: written by an earlier delivery (or a copy). No result is
            // recorded on the insert path.
            Ok(Inserted::Duplicate { payload_matches }) => {
                self.duplicate(message, None, payload_matches)
            }
            Ok(Inserted::Taken { by }) => self.insert_taken(message, by.as_deref()),
            Err(e) if e.is_permanent() => {
                let e = HandlerError::permanent(e.to_string());
                self.kept_visible(message, opts, visible, self.fast_failure(message, &e))
                    .await
            }
            Err(e) => self.unrecorded_failure(message, e),
        }
    }

    /// The insert to write from what the handler staged, or why there is
    /// none: the shape takes exactly one `Put`, with no condition of its
    /// own, holding every key attribute and no marker attribute, and no
    /// message sent.
    fn insert_of(
        &self,
        ctx: &Context,
        outbox: &[Outgoing],
        item_key: &'static [&'static str],
        pk: &str,
        message: &Message,
    ) -> Result<InsertCommit, String> {
        const SHAPE: &str = "an insert-shaped handler (Effects::Insert)";
        if item_key.is_empty() {
            return Err(format!(
                "{SHAPE} names no key attribute: insert_once(&[\"id\"], handler)"
            ));
        }
        if !outbox.is_empty() {
            return Err(format!(
                "{SHAPE} sent {} message(s): the insert path records no outbox (use staged_only for a handler that sends); nothing was written",
                outbox.len()
            ));
        }
        let mut staged = ctx.take_staged();
        if staged.len() != 1 {
            return Err(format!(
                "{SHAPE} must stage exactly one Put of its item; it staged {} write(s): nothing was written (use staged_only for other writes)",
                staged.len()
            ));
        }
        let write = staged.pop().expect("one staged write").item;
        let Some(put) = write.put else {
            return Err(format!(
                "{SHAPE} must stage a Put of its item; it staged an Update, Delete or ConditionCheck: nothing was written (use staged_only)"
            ));
        };
        if put.condition_expression.is_some() {
            return Err(format!(
                "{SHAPE} staged a Put with a condition of its own: the insert path supplies the condition (attribute_not_exists on the key); nothing was written"
            ));
        }
        if let Some(missing) = item_key.iter().find(|k| !put.item.contains_key(**k)) {
            return Err(format!(
                "{SHAPE} staged a Put without its key attribute {missing:?}: nothing was written"
            ));
        }
        if let Some(marker) = [INSERT_KEY_ATTRIBUTE, INSERT_PAYLOAD_ATTRIBUTE]
            .iter()
            .find(|m| put.item.contains_key(**m))
        {
            return Err(format!(
                "{SHAPE} staged a Put with the attribute {marker:?}, which the insert path writes: nothing was written"
            ));
        }
        Ok(InsertCommit {
            pk: pk.to_owned(),
            payload_sha256: self.config.payload_sha256(message),
            table: put.table_name,
            key: item_key.iter().map(|k| (*k).to_owned()).collect(),
            item: put.item,
        })
    }

    /// An item with the key that no delivery of this message's key wrote
    /// (another message's, or one written outside the library): nothing
    /// was written. Parked with the reason whatever
    /// `SQS_ONCE_PAYLOAD_MISMATCH` says: unlike one key with two bodies,
    /// these are two events, and letting this one go would drop an effect
    /// that never ran. Counted as a payload mismatch.
    fn insert_taken(&self, message: &Message, by: Option<&str>) -> Outcome {
        self.metrics.payload_mismatch();
        let key = self
            .config
            .shown_key(message.dedup_key().unwrap_or_default());
        let whose = match by {
            Some(_) if self.config.hash_keys => "written by another message".to_owned(),
            Some(other) => format!("written by another message (record key {other:?})"),
            None => "written outside sqs-once (no marker)".to_owned(),
        };
        warn!(
            whose, key = %key,
            "insert path: the item's key is taken by an item of another event; nothing written, parked"
        );
        Outcome::Park {
            reason: format!(
                "insert refused: the item's key is taken by an item {whose}, not by dedup key {key:?}; nothing was written"
            ),
        }
    }

    /// A redelivery on the insert path (receive count above one) reads its
    /// key's dedup record first: a message parked before (a `FAILED` record
    /// of this delivery: its delete after the park failed) is parked again
    /// without running, as on the fast path, and a `COMPLETED` one (made by
    /// the fast path or the claim before the consumer took the insert path)
    /// is a duplicate. One read per redelivery.
    pub(super) async fn parked_before_insert(
        &self,
        message: &Message,
        key: &str,
    ) -> Option<Outcome> {
        if message.receive_count() <= 1 {
            return None;
        }
        let pk = self.config.record_key(key);
        let now_s = self.clock.now_ms().div_euclid(1000);
        match self.store.get(&pk).await {
            Ok(Some(r)) if r.failed_by(message.id()) => Some(super::already_parked(r.error)),
            // Completed by another path (a consumer switched to the insert
            // path while messages were in flight): a duplicate, as there.
            Ok(Some(r)) if r.status == Status::Completed && r.expires_at_s >= now_s => {
                let payload_matches =
                    r.payload_sha256.as_deref() == Some(&self.config.payload_sha256(message));
                Some(Outcome::Duplicate {
                    result: r.result,
                    payload_matches,
                })
            }
            Ok(_) => None,
            Err(e) => {
                info!(error = %e, "could not read the record of a redelivery (insert path)");
                None
            }
        }
    }
}
