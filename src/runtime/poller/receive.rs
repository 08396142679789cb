//! The receive loop: receives ahead as places come free, and starts lanes.

use super::*;

/// What one turn of the receive loop got.
pub(super) enum Received {
    /// Messages, with the places held for them and when the receive was sent.
    Messages(Vec<Message>, Vec<OwnedSemaphorePermit>, Instant),
    /// Nothing: a long poll that timed out, or a failure already waited out.
    Nothing,
    /// Stop receiving: shutdown, or idle as configured.
    Stop,
}

/// The receive loop: takes free places, receives as many messages, and
/// starts one task per lane.
pub(super) struct ReceiveLoop<Q, S, H> {
    pub(super) shared: Arc<Shared<Q, S, H>>,
    /// One permit per message held, received and not yet finished.
    pub(super) places: Arc<Semaphore>,
    /// `concurrency + prefetch`: the places.
    pub(super) capacity: usize,
    pub(super) tasks: TaskTracker,
    pub(super) shutdown: CancellationToken,
    pub(super) error_backoff: Duration,
    pub(super) idle_since: Instant,
}

impl<Q: QueueClient, S: DedupStore, H: Handler> ReceiveLoop<Q, S, H> {
    pub(super) async fn run(mut self) -> TaskTracker {
        loop {
            self.beat();
            match self.turn().await {
                Received::Messages(messages, held, received_at) => {
                    self.start_lanes(messages, held, received_at);
                    self.idle_since = Instant::now();
                }
                Received::Nothing => {}
                Received::Stop => return self.tasks,
            }
        }
    }

    /// [`BEAT_WHILE_FULL`] from now with a liveness to beat, else never.
    pub(super) async fn beat_while_full(&self) {
        if self.shared.config.liveness.is_some() {
            tokio::time::sleep(BEAT_WHILE_FULL).await;
        } else {
            std::future::pending::<()>().await;
        }
    }

    pub(super) fn beat(&self) {
        if let Some(liveness) = &self.shared.config.liveness {
            liveness.beat();
        }
    }

    pub(super) async fn turn(&mut self) -> Received {
        let Some(held) = self.free_places().await else {
            return Received::Stop;
        };
        self.receive(held).await
    }

    /// Waits until one more message can be held, then up to `batch_wait` for
    /// room to hold a full batch (ten, or all the places if fewer). With
    /// `prefetch` of ten or more, a slot can only idle (no message waiting
    /// for it) once eleven places are free, so the wait never leaves a slot
    /// idle: the received batch waits for slots instead, and each receive
    /// brings ten. `None` at shutdown.
    pub(super) async fn free_places(&self) -> Option<Vec<OwnedSemaphorePermit>> {
        let acquire = self.places.clone().acquire_owned();
        tokio::pin!(acquire);
        let first = loop {
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => return None,
                p = &mut acquire => break p.expect("semaphore open"),
                // Every place held: the loop waits for running handlers, alive.
                // (No timer at all without a liveness to beat.)
                () = self.beat_while_full() => self.beat(),
            }
        };
        // The rest of the batch in one wait (not one wake-up per place
        // freed); at `fill_by`, whatever is free.
        let more = self.capacity.min(SQS_BATCH) - 1;
        let fill_by = Instant::now() + self.shared.config.batch_wait;
        let all = self.places.clone().acquire_many_owned(more as u32);
        let mut rest = tokio::select! {
            biased;
            () = self.shutdown.cancelled() => return None,
            p = tokio::time::timeout_at(fill_by, all) => match p {
                Ok(p) => Some(p.expect("semaphore open")),
                Err(_) => {
                    let free = self.places.available_permits().min(more);
                    self.places.clone().try_acquire_many_owned(free as u32).ok()
                }
            },
        };
        let mut held = vec![first];
        while let Some(p) = rest.as_mut().and_then(|r| r.split(1)) {
            held.push(p);
        }
        Some(held)
    }

    /// One receive for the places held. What is received stays invisible for
    /// a lease (whatever the queue's own visibility timeout), so the heartbeat,
    /// at most half a lease, always extends it in time.
    pub(super) async fn receive(&mut self, held: Vec<OwnedSemaphorePermit>) -> Received {
        let config = &self.shared.config;
        let wait = match config.exit_when_idle {
            Some(idle) => config.wait_time.min(idle).max(Duration::from_secs(1)),
            None => config.wait_time,
        };
        let request = ReceiveRequest {
            max: held.len(),
            wait,
            visibility: self.shared.processor.config().lease,
        };
        let received_at = Instant::now();
        let (queue, url) = (self.shared.queue.clone(), config.queue_url.clone());
        // Aborted if dropped: a receive still open when `run` returns takes
        // nothing more.
        let mut receive = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            queue.receive(&url, request).await
        }));
        let out = tokio::select! {
            biased;
            r = &mut receive => r.expect("the receive task does not panic"),
            () = self.shutdown.cancelled() => {
                // The receive may already have taken messages: give them back
                // as soon as it answers (within the drain), rather than leave
                // them (and their FIFO groups) invisible.
                let giving_back = give_back_when_received(self.shared.clone(), receive, received_at);
                self.tasks.spawn(self.shared.ended.clone().run_until_cancelled_owned(giving_back));
                return Received::Stop;
            }
        };
        match out {
            Ok(messages) if messages.is_empty() => self.nothing_received(held.len()),
            Ok(messages) => {
                self.error_backoff = Duration::from_millis(200);
                Received::Messages(messages, held, received_at)
            }
            Err(e) => self.back_off(e).await,
        }
    }

    /// An empty receive: stop if idle as configured, else go on.
    pub(super) fn nothing_received(&mut self, held: usize) -> Received {
        self.error_backoff = Duration::from_millis(200);
        self.shared.count(|s| s.empty_receives += 1);
        if let Some(idle) = self.shared.config.exit_when_idle
            && self.places.available_permits() + held == self.capacity
            && self.idle_since.elapsed() >= idle
        {
            info!("idle; exiting as configured");
            return Received::Stop;
        }
        Received::Nothing
    }

    /// A failed receive: wait, doubling the wait up to 20 s.
    pub(super) async fn back_off(&mut self, e: QueueError) -> Received {
        warn!(error = %e, retry_in = ?self.error_backoff, "receive failed; backing off");
        tokio::select! {
            biased;
            () = self.shutdown.cancelled() => return Received::Stop,
            () = tokio::time::sleep(self.error_backoff) => {}
        }
        self.error_backoff = (self.error_backoff * 2).min(Duration::from_secs(20));
        Received::Nothing
    }

    /// One task per lane, messages in receive order within it: on a FIFO
    /// queue a lane is a message group (stopped by a failure); on a standard
    /// queue it is a dedup key, so a duplicate within one receive runs after
    /// the first copy and is skipped instead of found in flight.
    pub(super) fn start_lanes(
        &self,
        messages: Vec<Message>,
        mut held: Vec<OwnedSemaphorePermit>,
        received_at: Instant,
    ) {
        self.shared.count(|s| s.received += messages.len() as u64);
        let queue = crate::protocol::trace::queue_name(&self.shared.config.queue_url);
        let keys = self.shared.processor.config();
        // (The `fifo-parallel` mutant, for the chaos harness only, runs a
        // FIFO group's messages in parallel.)
        let by_group =
            self.shared.config.is_fifo() && !crate::protocol::mutants::active("fifo-parallel");
        // A standard queue's lanes are keys: each is read here once, and the
        // processor takes it as read (the same message, the same key).
        let messages: Vec<Message> = messages
            .into_iter()
            .map(|m| {
                let m = m.with_queue(queue);
                if by_group {
                    m
                } else {
                    lanes::with_key(m, keys)
                }
            })
            .collect();
        let _receive = crate::protocol::trace::receive_span(queue, &messages).entered();
        // Before any lane runs: an older delivery of one of these messages
        // held here leaves its visibility to the newer one from now on.
        let lease = self.shared.processor.config().lease;
        for m in &messages {
            self.shared.holding.received(m, lease);
        }
        for lane in lanes::split(messages, |m| lanes::lane_of(m, by_group, keys)) {
            let permits: Vec<_> = held.drain(..lane.len().min(held.len())).collect();
            let lane = Lane::new(self.shared.clone(), lane, permits, received_at);
            self.tasks.spawn(lane_task(lane));
        }
    }
}
