//! The visibility keeper: extends what a lane holds while it waits, and
//! covers a waiting message until its handler's first heartbeat.

use super::*;

impl<Q: QueueClient, S: DedupStore, H: Handler> Shared<Q, S, H> {
    /// Every heartbeat, extends the visibility of the lane's waiting messages,
    /// with the running one's, by the lease, and notes until when they are
    /// invisible. When extensions fail until the next one would come too late,
    /// the waiting messages are let go (dropped from the lane, not run): they
    /// reappear for another receive instead of running while another consumer
    /// may hold them. Never returns.
    pub(super) async fn keep_waiting_invisible(
        &self,
        waiting: &Waiting,
        latest: &std::sync::Mutex<Instant>,
    ) {
        let config = self.processor.config();
        let interval = config.beat_for(config.lease);
        loop {
            tokio::time::sleep(interval).await;
            let mut w = waiting.lock().await;
            if w.messages.is_empty() {
                continue;
            }
            let sent = Instant::now();
            let extended = self.extend_held(&w).await;
            // Even a call that failed may have landed (a timeout, a lost
            // answer): the failed deletes of these messages, the running one
            // included, are tried until then (`Held::invisible_at_most`).
            // One given up on may land later still (`LANDS_LATE`), even
            // where the singles after a batch call that timed out worked:
            // the batch's entry of the running message is not sent again
            // alone.
            let late = crate::runtime::visibility::LANDS_LATE;
            let mut l = latest.lock().unwrap_or_else(|e| e.into_inner());
            *l = (*l).max(Instant::now() + config.lease + late);
            drop(l);
            self.let_go_refused(&mut w, &extended.refused);
            if extended.all {
                // (Those refused are let go above.)
                // A message set again alone may end up to a second sooner
                // (its timeout is what was left, rounded down).
                w.invisible_until = sent + config.lease.saturating_sub(Duration::from_secs(1));
            } else if Instant::now() + interval >= w.invisible_until {
                let let_go = w.messages.len() as u64;
                w.messages.clear();
                warn!(
                    messages = let_go,
                    "waiting messages could not be kept invisible; let go unprocessed (they come back when their visibility ends)"
                );
                self.count(|s| s.held_back += let_go);
            }
        }
    }

    /// Extends the running message and the waiting ones by the lease, in one
    /// call: the waiting ones must never stay invisible longer than the one
    /// before them (a queue that re-opens a group whenever one of its
    /// messages reappears would otherwise hand out a later message first
    /// after a crash).
    async fn extend_held(&self, w: &Pending) -> crate::runtime::visibility::Extended {
        let receipts: Vec<String> = w
            .running
            .iter()
            .cloned()
            .chain(
                w.messages
                    .iter()
                    .filter_map(|m| m.receipt_handle().map(str::to_owned)),
            )
            .collect();
        let url = &self.config.queue_url;
        let lease = self.processor.config().lease;
        // Cut at `KEEPER_CALL_MAX` less a margin, whatever retries the
        // client is set for: a finished message's hand-over counts the call
        // on its way that long (a dropped call may land all the same: the
        // caller counts it).
        tokio::time::timeout(
            KEEPER_CALL_MAX - Duration::from_secs(5),
            crate::runtime::extend_many(&self.queue, url, &receipts, w.running.as_deref(), lease),
        )
        .await
        .unwrap_or_default()
    }

    /// Lets go of the waiting messages whose receipt SQS `refused` to extend:
    /// each is another delivery's now (received again, or visible again),
    /// whatever the last extension promised, so it is dropped, not started,
    /// and in a FIFO group those after it too (simulator seed 400349: a lane
    /// trusted an extension that SQS had since overtaken, started its
    /// message 26 s after another consumer had received it, and the effect's
    /// delete through the stale receipt left the message to reach the DLQ on
    /// its next receive).
    fn let_go_refused(&self, w: &mut Pending, refused: &[String]) {
        let is_refused = |m: &Message| {
            m.receipt_handle()
                .is_some_and(|r| refused.iter().any(|x| x == r))
        };
        let gone: Vec<Message> = if self.config.is_fifo() {
            match w.messages.iter().position(is_refused) {
                Some(first) => w.messages.drain(first..).collect(),
                None => Vec::new(),
            }
        } else {
            let (gone, kept) = std::mem::take(&mut w.messages)
                .into_iter()
                .partition(|m| is_refused(m));
            w.messages = kept;
            gone.into()
        };
        // Let go of in `holding` too: while held, a newer delivery of one of
        // them would set no retry delay.
        for m in &gone {
            self.holding.let_go_delivery(m);
        }
        let let_go = gone.len() as u64;
        if let_go > 0 {
            warn!(
                messages = let_go,
                "SQS refused to keep a waiting message invisible through its receipt (received again, or visible again); let go unprocessed"
            );
            self.count(|s| s.held_back += let_go);
        }
    }

    /// Before a waiting message starts: extends its visibility now unless the
    /// keeper's last extension still covers it until the processor's first
    /// heartbeat (with room to spare), so it never becomes visible while held.
    /// Answers until when it is known to stay invisible, or `None` when it
    /// could not be extended and its visibility has run out: it may be another
    /// consumer's now, and must not start.
    pub(super) async fn cover_until_first_beat(
        &self,
        message: &Message,
        invisible_until: Instant,
        latest: &std::sync::Mutex<Instant>,
    ) -> Option<Instant> {
        let config = self.processor.config();
        let interval = config.beat_for(config.lease);
        if invisible_until > Instant::now() + interval + interval / 2 {
            return Some(invisible_until);
        }
        let Some(receipt) = message.receipt_handle() else {
            return Some(invisible_until);
        };
        let url = &self.config.queue_url;
        let sent = Instant::now();
        let changed = self
            .queue
            .change_visibility(url, receipt, config.lease)
            .await;
        // Even one that failed may have landed (`Held::invisible_at_most`),
        // later still (`LANDS_LATE`).
        let late = if changed.is_ok() {
            Duration::ZERO
        } else {
            crate::runtime::visibility::LANDS_LATE
        };
        let mut l = latest.lock().unwrap_or_else(|e| e.into_inner());
        *l = (*l).max(Instant::now() + config.lease + late);
        drop(l);
        match changed {
            Ok(()) => Some(invisible_until.max(sent + config.lease)),
            Err(e) => {
                // Its receipt refused: this delivery no longer holds the
                // message, however long it was covered.
                let covered = !e.is_receipt_refused() && invisible_until > Instant::now();
                warn!(message_id = message.id(), error = %e, covered, "could not extend a waiting message before it starts");
                covered.then_some(invisible_until)
            }
        }
    }
}
