//! What became of every delivery a consumer saw: when it arrived, how long
//! its consumer held it, whether a delete of it was sent in time, and whether
//! its consumer died while holding it.
//!
//! The checker needs this for one case. A message whose effect is recorded
//! (its dedup record is `COMPLETED`) may still be moved to the DLQ by SQS's
//! redrive policy when its last allowed delivery could not be deleted: the
//! consumer sent the delete and SQS was out of reach until the visibility
//! timeout ran out, or the consumer died holding it. No consumer can do
//! better there (the delete is the only thing that keeps a message from its
//! next receive), and a copy brought back from the DLQ completes as a
//! duplicate. Any other way for a completed message to reach the DLQ (a
//! delivery known done and never deleted, a delete sent after the message was
//! visible again) is a violation. See docs/DESIGN.md, "What ends in the DLQ".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::faults::Life;

/// One delivery: a receive of one message that reached a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The SQS message id.
    pub message: String,
    /// Its receive count at this delivery.
    pub count: u32,
    /// The consumer (or event source mapping) that received it.
    pub consumer: String,
    /// When it arrived.
    pub at: Instant,
    /// Until when it stays invisible, as far as its consumer knows (the
    /// receive's visibility, then every visibility change that was accepted).
    pub held_until: Instant,
    /// When a delete of it was first sent while it was still held.
    pub delete_sent: Option<Instant>,
    /// The life of the host that holds it.
    life: Life,
}

impl Delivery {
    /// Its consumer died while holding it.
    pub fn holder_died(&self) -> bool {
        self.life
            .died_at()
            .is_some_and(|t| t >= self.at && t < self.held_until)
    }

    /// Its consumer did all it could to delete it: sent the delete while it
    /// held it, or died holding it.
    pub fn delete_was_out_of_reach(&self) -> bool {
        self.delete_sent.is_some() || self.holder_died()
    }
}

/// Every delivery of a run, by receipt handle. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Deliveries(Arc<Mutex<BTreeMap<String, Delivery>>>);

impl Deliveries {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Delivery>) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A receive's answer reached `consumer` (whose host lives `life`).
    pub fn received(
        &self,
        consumer: &str,
        life: &Life,
        messages: &[sqs_once::Message],
        visibility: Duration,
    ) {
        let now = Instant::now();
        self.with(|all| {
            for m in messages {
                let Some(receipt) = m.receipt_handle() else {
                    continue;
                };
                all.insert(
                    receipt.to_owned(),
                    Delivery {
                        message: m.id().to_owned(),
                        count: m.receive_count(),
                        consumer: consumer.to_owned(),
                        at: now,
                        held_until: now + visibility,
                        delete_sent: None,
                        life: life.clone(),
                    },
                );
            }
        });
    }

    /// A delete of these receipts was sent (whatever became of it).
    pub fn delete_sent(&self, receipts: &[String]) {
        let now = Instant::now();
        self.with(|all| {
            for r in receipts {
                if let Some(d) = all.get_mut(r)
                    && d.delete_sent.is_none()
                    && now < d.held_until
                {
                    d.delete_sent = Some(now);
                }
            }
        });
    }

    /// SQS accepted a visibility change of these receipts to `timeout`.
    pub fn visibility_set(&self, receipts: &[String], timeout: Duration) {
        let until = Instant::now() + timeout;
        self.with(|all| {
            for r in receipts {
                if let Some(d) = all.get_mut(r) {
                    d.held_until = until;
                }
            }
        });
    }

    /// The last delivery of `message` that reached a consumer.
    pub fn last_of(&self, message: &str) -> Option<Delivery> {
        self.with(|all| {
            all.values()
                .filter(|d| d.message == message)
                .max_by_key(|d| (d.count, d.at))
                .cloned()
        })
    }
}
