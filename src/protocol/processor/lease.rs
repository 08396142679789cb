//! The local lease and visibility ends a handler never runs past, and the
//! heartbeat that moves them.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::warn;

use crate::Message;
use crate::protocol::handler::{Context, Handler};
use crate::protocol::limits::SQS_MAX_VISIBILITY;
use crate::protocol::store::{ClaimRequest, DedupStore, StoreError};

use super::*;

impl<S: DedupStore, H: Handler> Processor<S, H> {
    /// Extends the message's visibility every heartbeat while a handler
    /// without a claim runs (fast path), a copy waits for its key's holder,
    /// or a commit runs, moving the local visibility end after each
    /// extension. Each is cut to end by the deadline (Lambda); none is sent
    /// once the deadline or the 12-hour cap leaves no room. Never returns.
    pub(super) async fn keep_visible(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
    ) {
        let Some(v) = opts.visibility else {
            return std::future::pending().await;
        };
        let lease = self.config.lease;
        let interval = self.config.beat_for(lease);
        let counted_from = opts.received_at.unwrap_or_else(Instant::now);
        loop {
            tokio::time::sleep(visible.next_beat(interval)).await;
            if counted_from.elapsed() + lease > self.config.max_extension {
                return std::future::pending().await;
            }
            // Cut to end by the deadline (Lambda), as the heartbeat's are.
            let timeout = lease_within(lease, opts.deadline);
            if timeout.is_zero() {
                return std::future::pending().await;
            }
            let margin = self.config.margin_for(timeout);
            let sent = Instant::now();
            match v.extend(message, timeout).await {
                Ok(()) => {
                    visible.move_to(sent + timeout.saturating_sub(margin));
                    self.metrics.heartbeat_extension();
                }
                Err(e) => warn!(error = %e, "visibility extension failed"),
            }
        }
    }

    /// Runs `commit` (the record's write, with its retries) with the
    /// message's visibility kept beside it, so that a slow store does not
    /// let SQS hand the message out while its effect is being recorded. On
    /// a FIFO queue the commit is dropped once the visibility end passes
    /// without an extension (`None`): the next receive may move the message
    /// to the DLQ and its group go on, so no try may start after that end
    /// (a write sent before it can still land later: the window narrowed
    /// to one request, see DESIGN.md). On a standard queue a late commit is
    /// harmless (a copy run meanwhile is a duplicate at its own commit), so
    /// it runs to its end.
    pub(super) async fn while_visible<T>(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        commit: impl Future<Output = T>,
    ) -> Option<T> {
        let fifo = message.from_fifo_queue();
        // A handler that returned at its end (the same wake-up, or a task
        // run late) starts no try.
        if fifo && visible.enforced() && visible.passed_already() {
            return None;
        }
        tokio::select! {
            biased;
            r = commit => Some(r),
            // Before the end's own wake-up: an extension answered at the
            // same instant moves the end first.
            () = self.keep_visible(message, opts, visible) => unreachable!("never returns"),
            () = visible.passed(), if fifo => None,
        }
    }

    /// Runs `work` to its end with the message's visibility kept beside it,
    /// whatever becomes of the visibility: for what follows a commit (the
    /// outbox's sends, with their retries). The effect is recorded, so a
    /// redelivery would find it done; but a message whose visibility ends
    /// while its messages are still being sent may reach the DLQ before its
    /// delete, its effect made (simulator seed 659792: a claim, a handler,
    /// a slow completion and an outbox send tried twice, each shorter than
    /// a beat, took 11.9 s of a 13.1 s lease with no extension, and the
    /// delete, on the last allowed receive, came too late).
    pub(super) async fn kept_visible<T>(
        &self,
        message: &Message,
        opts: &ProcessOptions<'_>,
        visible: &LocalEnd,
        work: impl Future<Output = T>,
    ) -> T {
        tokio::select! {
            biased;
            r = work => r,
            () = self.keep_visible(message, opts, visible) => unreachable!("never returns"),
        }
    }

    /// Extends the lease (and the visibility) every heartbeat until the total
    /// (counted from the receive, as SQS counts its 12 hours) reaches the
    /// maximum, moving the local lease and visibility ends forward after each
    /// extension; beats sooner when the visibility would end before the next
    /// beat. Returns only when another consumer holds the key (what the
    /// record holds now); a failed extension is tried again at the next beat,
    /// and if none succeeds in time the local ends interrupt the handler.
    pub(super) async fn heartbeat(
        &self,
        message: &Message,
        req: &ClaimRequest,
        lease: Duration,
        opts: &ProcessOptions<'_>,
        ends: Ends<'_>,
    ) -> String {
        let interval = self.config.beat_for(lease);
        let counted_from = opts.received_at.unwrap_or_else(Instant::now);
        loop {
            // The wall clock read every second meanwhile, so that a step
            // back between two extensions is seen (`LocalEnd::extended`).
            let beat_at = Instant::now() + ends.visible.next_beat(interval);
            let read_every = WALL_READ_EVERY
                .min(self.config.margin_for(lease) / 2)
                .max(Duration::from_millis(50));
            while Instant::now() < beat_at {
                tokio::time::sleep_until(beat_at.min(Instant::now() + read_every)).await;
                ends.lease.note_wall(self.clock.now_ms());
            }
            if counted_from.elapsed() + lease > self.config.max_extension {
                warn!(
                    "maximum extension reached: the lease is no longer extended and the handler is interrupted when it ends"
                );
                return std::future::pending().await;
            }
            let lease = lease_within(lease, opts.deadline);
            if lease.is_zero() {
                // At the deadline: the runtime stops the handler, not the heartbeat.
                return std::future::pending().await;
            }
            let margin = self.config.margin_for(lease);
            // Visibility and lease together: a slow DynamoDB must not delay
            // the message's extension past its visibility timeout.
            let sent = Instant::now();
            // The store writes the lease's end by this host's wall clock,
            // read as the extension is sent.
            let wall_ms = self.clock.now_ms();
            let visibility = async {
                if let Some(v) = opts.visibility {
                    match v.extend(message, lease).await {
                        Ok(()) => ends.visible.move_to(sent + lease.saturating_sub(margin)),
                        Err(e) => warn!(error = %e, "visibility extension failed"),
                    }
                }
            };
            let extended =
                self.store
                    .extend_lease(&req.pk, &req.owner, lease, self.config.record_ttl());
            match futures::join!(extended, visibility).0 {
                Ok(()) => {
                    ends.lease
                        .extended(sent, wall_ms, lease.saturating_sub(margin));
                    self.metrics.heartbeat_extension();
                }
                Err(StoreError::LeaseLost { found, .. }) => return found,
                Err(e) => warn!(error = %e, "lease extension failed; will try again"),
            }
        }
    }
}

/// How often, at most, a running claim's heartbeat reads the wall clock
/// between extensions, to see it step back (and at least every half
/// margin, so a step back unseen between two readings is inside it).
const WALL_READ_EVERY: Duration = Duration::from_secs(1);

/// A running claim's two local ends, both moved by the heartbeat.
#[derive(Clone, Copy)]
pub(super) struct Ends<'a> {
    pub(super) lease: &'a LocalEnd,
    pub(super) visible: &'a LocalEnd,
}

/// Why a running handler's lease ended.
pub(super) enum LeaseEnd {
    /// Another consumer took the key over (what the record holds now).
    TakenOver(String),
    /// No extension succeeded before the local lease end.
    NotExtended,
    /// The message's visibility was not extended before its local end: SQS
    /// may hand it to another consumer.
    VisibilityLost,
}

/// An end this host keeps by its own clock, moved later by extensions.
///
/// For the claim's lease: it ends `margin` before the lease the store holds,
/// counted from before the claim (or the last successful extension) was sent,
/// so the handler has stopped before another consumer can take the key, even
/// with some clock skew between them. For the message's visibility: `margin`
/// before SQS can deliver it again, counted from before the receive (or the
/// last successful extension) was sent; `None` while it is not known.
pub(super) struct LocalEnd {
    end: watch::Sender<Option<Instant>>,
    /// The message's visibility (else the claim's lease).
    visibility: bool,
    /// For a lease: the wall clock against the monotonic one (see
    /// [`LocalEnd::extended`]).
    anchor: Option<Anchor>,
}

/// This host's wall clock (ms) and monotonic clock read together once a
/// claim was answered, and whether the wall clock was since seen to step
/// back (a reading below the one before it).
struct Anchor {
    at: Instant,
    wall_ms: i64,
    last_ms: AtomicI64,
    stepped_back: AtomicBool,
}

/// Tells `ctx` the ends its handler must finish by: the invocation's
/// deadline and `ends` (see [`Context::time_left`]).
pub(super) fn bound(ctx: &Context, opts: &ProcessOptions<'_>, ends: &[&LocalEnd]) {
    if let Some(deadline) = opts.deadline {
        ctx.bounded_by(watch::Sender::new(Some(deadline)).subscribe());
    }
    for end in ends {
        ctx.bounded_by(end.end.subscribe());
    }
}

impl LocalEnd {
    /// A claim's lease, sent at `sent`, when this host's wall clock read
    /// `wall_ms` (the anchor).
    pub(super) fn lease(sent: Instant, lease: Duration, margin: Duration, wall_ms: i64) -> Self {
        Self {
            end: watch::Sender::new(Some(sent + lease.saturating_sub(margin))),
            visibility: false,
            anchor: Some(Anchor {
                at: sent,
                wall_ms,
                last_ms: AtomicI64::new(wall_ms),
                stepped_back: AtomicBool::new(false),
            }),
        }
    }

    /// Notes a reading of this host's wall clock: one below the reading
    /// before it is a step back (a time sync correcting the clock at once,
    /// or an operator setting it). A clock that stands still (a test's
    /// system clock under tokio's paused time) never steps back.
    pub(super) fn note_wall(&self, wall_ms: i64) {
        if let Some(a) = &self.anchor
            && a.last_ms.swap(wall_ms, Ordering::Relaxed) > wall_ms
        {
            a.stepped_back.store(true, Ordering::Relaxed);
        }
    }

    /// An extension sent at `sent` (the wall clock then read `wall_ms`)
    /// succeeded: the store holds the lease until `wall_ms` plus the lease,
    /// and this end moves to `keep` (the lease less the margin) after
    /// `sent`; or less far once the wall clock stepped back since the claim.
    /// Other hosts judge the stored end by their own clocks: a step back of
    /// `s` on this host writes an end `s` earlier than the monotonic clock
    /// counts, and without this the handler could run up to `s` past the
    /// moment another consumer may take the key. The stored end is then
    /// mapped through the anchor: the monotonic instant of the claim's
    /// answer plus how far the wall clock moved since, plus `keep`. A step
    /// forward changes nothing: the end never reaches past `sent` plus
    /// `keep`. (The claim reads the wall clock when it is sent and when it
    /// is answered, and the heartbeat every second, or every half margin
    /// when that is shorter, so a step back unseen between two readings is
    /// within the margin.)
    pub(super) fn extended(&self, sent: Instant, wall_ms: i64, keep: Duration) {
        self.note_wall(wall_ms);
        let by_monotonic = sent + keep;
        let end = match &self.anchor {
            Some(a) if a.stepped_back.load(Ordering::Relaxed) => {
                let moved = Duration::from_millis((wall_ms - a.wall_ms).unsigned_abs());
                let stored = if wall_ms >= a.wall_ms {
                    Some(a.at + keep + moved)
                } else {
                    (a.at + keep).checked_sub(moved)
                };
                // A step back further than the monotonic clock reaches moves
                // nothing: the stored end only moves forward, so the end
                // already kept stays inside it.
                let Some(stored) = stored else { return };
                by_monotonic.min(stored)
            }
            _ => by_monotonic,
        };
        self.move_to(end);
    }

    /// The visibility end the runtime knows of, less `margin`.
    pub(super) fn visibility(opts: &ProcessOptions<'_>, margin: Duration) -> Self {
        let end = opts
            .invisible_until
            .map(|until| until.checked_sub(margin).unwrap_or(until));
        Self {
            end: watch::Sender::new(end),
            visibility: true,
            anchor: None,
        }
    }

    /// Time left before the handler must be interrupted (a long time if not known).
    pub(super) fn remaining(&self) -> Duration {
        self.end.borrow().map_or(SQS_MAX_VISIBILITY, |end| {
            end.saturating_duration_since(Instant::now())
        })
    }

    /// The end is known and has passed.
    pub(super) fn passed_already(&self) -> bool {
        self.end.borrow().is_some_and(|end| end <= Instant::now())
    }

    /// How long to wait before the next extension: the heartbeat's interval,
    /// or less when the end would come first (half the time left, so that an
    /// extension and its retries land before it).
    pub(super) fn next_beat(&self, interval: Duration) -> Duration {
        interval
            .min(self.remaining() / 2)
            .max(Duration::from_millis(50))
    }

    /// An extension moved the end to `end` (never earlier than it was).
    pub(super) fn move_to(&self, end: Instant) {
        self.end.send_if_modified(|current| {
            let later = current.is_none_or(|c| end > c);
            if later {
                *current = Some(end);
            }
            later
        });
    }

    /// Completes when the end passes without an extension.
    pub(super) async fn passed(&self) {
        let mut rx = self.end.subscribe();
        loop {
            let end = *rx.borrow_and_update();
            let Some(end) = end.filter(|_| self.enforced()) else {
                if rx.changed().await.is_err() {
                    return std::future::pending().await;
                }
                continue;
            };
            tokio::select! {
                biased;
                () = tokio::time::sleep_until(end) => {
                    if rx.borrow().is_some_and(|e| e <= Instant::now()) {
                        return;
                    }
                }
                changed = rx.changed() => {
                    if changed.is_err() {
                        return std::future::pending().await;
                    }
                }
            }
        }
    }

    /// Whether this end interrupts a handler. (The `lease-not-enforced` and
    /// `visibility-not-kept` mutants, for the simulator only, let a handler
    /// run past its lease or its visibility.)
    pub(super) fn enforced(&self) -> bool {
        let mutant = if self.visibility {
            "visibility-not-kept"
        } else {
            "lease-not-enforced"
        };
        !crate::protocol::mutants::active(mutant)
    }
}
