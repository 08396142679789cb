//! A lane: the messages of one FIFO group (or one at a time on a standard
//! queue) run in order, and what is given back at shutdown.

use super::*;

/// What the runtime knows of a message it holds, by this host's clock: when
/// the receive that delivered it was sent, and until when it stays invisible.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held<'a> {
    pub(super) received_at: Instant,
    pub(super) invisible_until: Instant,
    /// Until when, at the latest, the receive or the lane keeper's
    /// extensions may keep it invisible, read when its delete is handed
    /// over: the receive's answer's arrival plus the timeout asked for (SQS
    /// applied the receive somewhere between the send and the answer), and
    /// each extension's end, one that failed included (a timeout or a lost
    /// answer may have landed; simulator seed 259461: the keeper's call
    /// landed just before SQS went out of reach, and the delete's tries of
    /// the running message stopped before the end it set).
    pub(super) invisible_at_most: &'a std::sync::Mutex<Instant>,
    /// The lane's messages not yet started, and its running one.
    pub(super) waiting: &'a Waiting,
    /// What a transient failure of it becomes ([`Lane::on_retry`]).
    pub(super) on_retry: OnRetry,
}

impl Held<'_> {
    /// Until when, at the latest, it may stay invisible, as it stands now.
    pub(super) fn at_most(&self) -> Instant {
        *self
            .invisible_at_most
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }
}

/// The messages of a lane not yet started (a FIFO message group, or the
/// copies of one dedup key, from one receive), and until when, by this host's
/// clock, all of them are known to stay invisible.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) messages: std::collections::VecDeque<Message>,
    /// The running message's receipt handle, extended with the waiting ones.
    pub(super) running: Option<String>,
    pub(super) invisible_until: Instant,
}

pub(super) type Waiting = tokio::sync::Mutex<Pending>;

/// One lane of a receive, run by its own task: its messages one at a time in
/// order, each holding one of the places taken for the receive until it is
/// finished, the lane holding one running slot from its first start to its
/// end.
pub(super) struct Lane<Q, S, H> {
    pub(super) shared: Arc<Shared<Q, S, H>>,
    pub(super) waiting: Waiting,
    /// When the receive was sent: SQS counts its 12-hour cap from it.
    pub(super) received_at: Instant,
    /// Until when, at the latest, the receive or the keeper's extensions
    /// may keep the lane's messages invisible (`Held::invisible_at_most`).
    pub(super) latest: std::sync::Mutex<Instant>,
    pub(super) permits: Vec<OwnedSemaphorePermit>,
    pub(super) fifo: bool,
    /// The lane's deliveries, let go from [`Shared::holding`] when the lane
    /// ends.
    pub(super) _held: HeldBy,
}

/// Deliveries registered in a [`Holding`], let go when dropped.
pub(super) struct HeldBy {
    pub(super) holding: Holding,
    /// (message id, receipt handle) of each.
    pub(super) deliveries: Vec<(String, String)>,
}

impl Drop for HeldBy {
    fn drop(&mut self) {
        for (id, receipt) in &self.deliveries {
            self.holding.let_go(id, receipt);
        }
    }
}

impl<Q: QueueClient, S: DedupStore, H: Handler> Lane<Q, S, H> {
    pub(super) fn new(
        shared: Arc<Shared<Q, S, H>>,
        messages: Vec<Message>,
        permits: Vec<OwnedSemaphorePermit>,
        received_at: Instant,
    ) -> Self {
        let fifo = shared.config.is_fifo();
        // Received with the lease as their visibility timeout.
        let lease = shared.processor.config().lease;
        let invisible_until = received_at + lease;
        let held = HeldBy {
            holding: shared.holding.clone(),
            deliveries: messages
                .iter()
                .filter_map(|m| Some((m.id().to_owned(), m.receipt_handle()?.to_owned())))
                .collect(),
        };
        Self {
            _held: held,
            shared,
            received_at,
            waiting: tokio::sync::Mutex::new(Pending {
                messages: messages.into(),
                running: None,
                invisible_until,
            }),
            latest: std::sync::Mutex::new(Instant::now() + lease),
            permits,
            fifo,
        }
    }

    /// Runs the lane's messages in order while keeping the ones that wait
    /// invisible. On a FIFO queue a failure stops the lane: the rest come back
    /// unprocessed, a second before the failed message (or at once at
    /// shutdown); unless the failed message runs again in place
    /// ([`Self::on_retry`]).
    pub(super) async fn run(mut self) {
        let permits = std::mem::take(&mut self.permits);
        // A lane of one message that gets its slot at once never has a
        // message waiting (the running one's visibility is its processor's
        // heartbeat's to keep): it runs without a keeper and its timer.
        let slot = if self.waiting.get_mut().messages.len() == 1 {
            self.shared.running.clone().try_acquire_owned().ok()
        } else {
            None
        };
        let alone = slot.is_some();
        // One work future in either case: each message's step is boxed
        // within it, so the lane's task stays small to spawn and move.
        let mut work = std::pin::pin!(self.work(slot, permits));
        if alone {
            return work.await;
        }
        tokio::select! {
            biased;
            () = &mut work => {}
            () = self.shared.keep_waiting_invisible(&self.waiting, &self.latest) => unreachable!("never returns"),
        }
    }

    /// Runs the lane in its running slot: `slot` when already taken, else
    /// taken here.
    pub(super) async fn work(
        &self,
        slot: Option<OwnedSemaphorePermit>,
        mut permits: Vec<OwnedSemaphorePermit>,
    ) {
        let Some(_slot) = self.slot_or_give_back(slot).await else {
            return;
        };
        // At shutdown the rest of the lane comes back at once.
        let mut rest_after = Duration::ZERO;
        // The attempts of the lane's first message run in place so far.
        let mut in_place = 0;
        while let Some((m, invisible_until)) = self.next().await {
            // A newer delivery of it reached this poller while it waited
            // (later in this lane, a twin, or in another): that one runs
            // it. This receipt may be stale, and the last extension
            // through it promises nothing (seed 400349). In a FIFO group
            // the rest of the lane goes too.
            if self.shared.holding.delivery_superseded(&m) {
                self.let_go_superseded(&m).await;
                if self.fifo {
                    break;
                }
                permits.pop();
                continue;
            }
            let Some(invisible_until) = self
                .shared
                .cover_until_first_beat(&m, invisible_until, &self.latest)
                .await
            else {
                // Visible again, maybe received elsewhere: let it and the
                // rest of the lane go.
                self.waiting.lock().await.running = None;
                self.shared.count(|s| s.held_back += 1);
                break;
            };
            let mut first = self.fifo.then(|| m.clone());
            let held = Held {
                received_at: self.received_at,
                invisible_until,
                invisible_at_most: &self.latest,
                waiting: &self.waiting,
                on_retry: self.on_retry(&m, in_place).await,
            };
            // Boxed: the step's future is large (its nested awaits), and a
            // lane task that held it inline would be copied whole when
            // spawned (bench/RESULTS.md, 2026-12-05).
            let settled = Box::pin(self.shared.handle(m, held)).await;
            if let Settled::InPlace { after } = settled
                && let Some(first) = first.take()
            {
                // Its place is kept: it runs again.
                in_place += 1;
                match Box::pin(self.again_in_place(first, after)).await {
                    Some(rest) => {
                        rest_after = rest;
                        break;
                    }
                    None => continue,
                }
            }
            in_place = 0;
            self.waiting.lock().await.running = None;
            permits.pop();
            if let (Settled::Again { after: Some(after) }, Some(first)) = (settled, first) {
                rest_after = Box::pin(self.hold_rest(&first, after)).await;
                break;
            }
        }
        self.retry_rest_later(rest_after).await;
    }

    /// The slot to run in: `slot` when the receive loop gave one, else the
    /// first that comes free. A lane that must wait for a slot at shutdown
    /// gives its messages back at once (`None`); one that can start runs
    /// within the drain.
    async fn slot_or_give_back(
        &self,
        slot: Option<OwnedSemaphorePermit>,
    ) -> Option<OwnedSemaphorePermit> {
        if slot.is_some() {
            return slot;
        }
        tokio::select! {
            biased;
            p = self.shared.running.clone().acquire_owned() => Some(p.expect("semaphore open")),
            () = self.shared.shutdown.cancelled() => {
                let messages: Vec<Message> = self.waiting.lock().await.messages.drain(..).collect();
                Box::pin(give_back(&self.shared, messages, self.received_at)).await;
                None
            }
        }
    }

    /// `m` was received again while it waited (a newer delivery runs it):
    /// counted and let go now, not at the lane's end, since while held it
    /// would keep the newer delivery from setting its retry delay.
    async fn let_go_superseded(&self, m: &Message) {
        debug!(
            message_id = m.id(),
            "a waiting message was received again before it started; the newer delivery runs it"
        );
        self.waiting.lock().await.running = None;
        self.shared.count(|s| s.held_back += 1);
        self.shared.holding.let_go_delivery(m);
    }

    /// What the lane still holds when it stops comes back after
    /// `rest_after`. Taken under the lock, so no extension of the keeper
    /// lands after this.
    async fn retry_rest_later(&self, rest_after: Duration) {
        let rest: Vec<Message> = self.waiting.lock().await.messages.drain(..).collect();
        for m in rest {
            self.shared.count(|s| s.held_back += 1);
            self.shared
                .retry_later(&m, rest_after, self.received_at)
                .await;
        }
    }

    /// After `first`, the lane's running message on a FIFO queue, failed
    /// with its delay `after` set: the delay for the rest of its group
    /// ([`hold_group`]).
    pub(super) async fn hold_rest(&self, first: &Message, after: Duration) -> Duration {
        let more = !self.waiting.lock().await.messages.is_empty();
        let failed = Delivery {
            source: Some(self.shared.config.queue_url.as_str()),
            message: first,
            received_at: self.received_at,
            superseded: false,
            invisible_through: None,
        };
        hold_group(&self.shared.settler, failed, after, more).await
    }

    /// What a transient failure of `m`, the lane's next message, becomes,
    /// after `in_place` attempts of it run in place: on a FIFO queue with a
    /// DLQ and a known `maxReceiveCount`, the first message of a group with
    /// more of it waiting behind (or already run again in place) is run
    /// again in place, its group kept invisible, until its attempts
    /// (receives, and runs in place, counted in its receive count) reach
    /// `maxReceiveCount`: that last attempt's failure parks it, as SQS
    /// would move it at its next receive. The rest of its group then runs,
    /// none of it having spent a receive. Otherwise (and at shutdown) its
    /// delay is set: it comes back, the rest of its group with it.
    pub(super) async fn on_retry(&self, m: &Message, in_place: u32) -> OnRetry {
        let config = &self.shared.config;
        let Some(max) = config.max_receive_count else {
            return OnRetry::SetDelay;
        };
        if !self.fifo || config.dlq_url.is_none() || self.shared.shutdown.is_cancelled() {
            return OnRetry::SetDelay;
        }
        if in_place == 0 && self.waiting.lock().await.messages.is_empty() {
            return OnRetry::SetDelay;
        }
        if m.receive_count() >= max {
            OnRetry::Park {
                attempt: m.receive_count(),
            }
        } else {
            OnRetry::InPlace
        }
    }

    /// `head`, the lane's first message, failed transiently and is to run
    /// again in place after `after`: it goes back to the front of the lane,
    /// its receive count one more (its backoff and its handler's count go
    /// on as if it had been received again), and waits, kept invisible
    /// with the rest by the lane keeper (which lets it go, and the rest
    /// with it, as it would any waiting message whose visibility it cannot
    /// keep). `None`: run it (the lane's next message). At shutdown, or
    /// when the wait would outlast SQS's 12 hours from the receive, it is
    /// handed back instead, with what is left of its delay:
    /// `Some(delay)` for the rest of its group, as after any failure.
    pub(super) async fn again_in_place(&self, head: Message, after: Duration) -> Option<Duration> {
        let again = head.clone().with_receive_count(head.receive_count() + 1);
        {
            let mut w = self.waiting.lock().await;
            w.running = None;
            w.messages.push_front(again);
        }
        let lease = self.shared.processor.config().lease;
        let until = Instant::now() + after;
        let capped =
            crate::runtime::visibility::within_visibility_cap(after + lease, self.received_at)
                < after + lease;
        if !capped {
            tokio::select! {
                biased;
                () = self.shared.shutdown.cancelled() => {}
                () = tokio::time::sleep_until(until) => return None,
            }
        }
        // Still first, unless the keeper let the lane go.
        let (head, more) = {
            let mut w = self.waiting.lock().await;
            if w.messages.front().is_none_or(|m| m.id() != head.id()) {
                return None;
            }
            let head = w.messages.pop_front()?;
            (head, !w.messages.is_empty())
        };
        let left = until.saturating_duration_since(Instant::now());
        let (again, rest) = lanes::hold_behind(left, more);
        info!(
            message_id = head.id(),
            ?left,
            "a message run again in place is handed back (shutdown, or SQS's 12-hour cap)"
        );
        self.shared
            .retry_later(&head, again.unwrap_or(left), self.received_at)
            .await;
        if let Some(receipt) = head.receipt_handle() {
            let latest = *self.latest.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.holding.let_go_until(head.id(), receipt, latest);
        }
        Some(rest)
    }

    /// The next message to start, marked running, and until when it is known
    /// to be invisible; `None` when the lane is done or the poller stops.
    pub(super) async fn next(&self) -> Option<(Message, Instant)> {
        let mut w = self.waiting.lock().await;
        if self.shared.stop.is_cancelled() {
            return None;
        }
        let next = w.messages.pop_front()?;
        w.running = next.receipt_handle().map(str::to_owned);
        Some((next, w.invisible_until))
    }
}

/// Gives back whatever a receive abandoned at shutdown returns: at once on a
/// standard queue. On a FIFO queue the first message of each group comes back
/// a second after the rest of its group: SQS blocks a group while any of its
/// messages is in flight, and an emulator that re-opens a group whenever one
/// of its messages reappears then still hands the group out in order.
pub(super) async fn give_back_when_received<Q: QueueClient, S: DedupStore, H: Handler>(
    shared: Arc<Shared<Q, S, H>>,
    receive: tokio_util::task::AbortOnDropHandle<Result<Vec<Message>, QueueError>>,
    received_at: Instant,
) {
    let Ok(Ok(messages)) = receive.await else {
        return;
    };
    give_back(&shared, messages, received_at).await;
}

/// Gives back messages held but not started, at shutdown: at once on a
/// standard queue; on a FIFO queue each group's first message a second after
/// the rest of its group (see [`give_back_when_received`]).
pub(super) async fn give_back<Q: QueueClient, S: DedupStore, H: Handler>(
    shared: &Shared<Q, S, H>,
    messages: Vec<Message>,
    received_at: Instant,
) {
    let fifo = shared.config.is_fifo();
    // Each group as if its first message had failed with no delay.
    let (first_after, rest_after) = lanes::hold_behind(Duration::ZERO, true);
    let mut groups = std::collections::HashSet::new();
    for m in messages {
        // A read per message that came back, bounded so that a slow
        // DynamoDB cannot hold the give-back (and its FIFO group) up.
        let found = if shared.stop.is_cancelled() {
            KeyFound::Unknown
        } else {
            tokio::time::timeout(GIVE_BACK_READ, shared.processor.before_giving_back(&m))
                .await
                .unwrap_or(KeyFound::Unknown)
        };
        if found == KeyFound::HeldElsewhere && !fifo {
            // Brought back at once it would spend a receive while the holder
            // runs (and, a twin delivery's copy, while the holder's own
            // delivery is still valid), on its last allowed receive moving
            // it to the DLQ as the holder completes (simulator seed 1533
            // with maxReceiveCount drawn). Left invisible, it comes back
            // when the visibility it was received with ends, as a duplicate
            // once the holder completes. (A FIFO group's messages come back
            // in order: there the rule below holds.)
            info!(
                message_id = m.id(),
                "not started before shutdown, its key in flight elsewhere: left invisible until its visibility ends"
            );
            shared.count(|s| s.held_back += 1);
            continue;
        }
        if found == KeyFound::Done {
            info!(
                message_id = m.id(),
                "not started before shutdown, but already completed: deleted instead of given back"
            );
            // Through the newest receipt too, as a finished delivery's.
            if let Some((newest, _)) = shared.holding.newest_let_go(&m) {
                shared
                    .to_delete(Finished {
                        receipt: newest,
                        payload: None,
                        invisible_until: Instant::now(),
                        retry_until: Instant::now(),
                    })
                    .await;
            }
            shared
                .to_delete(Finished {
                    receipt: m.receipt_handle().unwrap_or_default().to_owned(),
                    payload: None,
                    // Not known here: sent at once.
                    invisible_until: Instant::now(),
                    retry_until: Instant::now(),
                })
                .await;
            continue;
        }
        let after = match (fifo, m.group_id()) {
            (false, _) => Duration::ZERO,
            (true, g) if groups.insert(g.unwrap_or_default().to_owned()) => {
                first_after.unwrap_or_default()
            }
            (true, _) => rest_after,
        };
        info!(
            message_id = m.id(),
            ?after,
            "not started before shutdown; given back"
        );
        shared.count(|s| s.held_back += 1);
        shared.retry_later(&m, after, received_at).await;
    }
}

/// How long a drain waits for the record of a message it gives back.
pub(super) const GIVE_BACK_READ: Duration = Duration::from_secs(2);
