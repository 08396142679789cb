//! An in-memory SQS service behind [`QueueClient`], written from the Amazon SQS
//! Developer Guide and API reference (not from an emulator), for tests and the
//! deterministic simulator.
//!
//! Time is tokio's clock ([`tokio::time::Instant`]): on a paused runtime the
//! queues move only as virtual time does. Message ids (`msg-N`) and receipt
//! handles (`rh-SEQ-N`) come from counters, so a run is a function of its inputs.
//!
//! What is modelled, as SQS documents it:
//! - **Visibility.** A receive hides what it returns for the request's
//!   visibility timeout; `ChangeMessageVisibility` takes 0 to 43,200 s,
//!   counted from the call, and is refused when it would keep the message
//!   invisible more than 12 hours after its last receive, when the message is
//!   not in flight (`MessageNotInflight`), and when the receipt handle is not
//!   the latest one issued for the message (`ReceiptHandleIsInvalid`).
//! - **Receipt handles.** Every receive issues a new one. `DeleteMessage` with
//!   the latest handle deletes the message (also after its visibility timeout
//!   ran out, as long as no one received it since); with an older handle the
//!   call succeeds and the message is **not** deleted (the API reference: "If
//!   you use an old ReceiptHandle, the request will succeed, but the message
//!   might not be deleted": the model takes the strict reading). A handle for a
//!   message already deleted succeeds; one never issued is `ReceiptHandleIsInvalid`.
//! - **Redrive.** `ApproximateReceiveCount` counts receives; with a redrive
//!   policy, a message whose count has reached `maxReceiveCount` is moved to the
//!   DLQ by the next receive that would have returned it (same message id;
//!   its receive count starts again).
//! - **Delay** (queue `DelaySeconds`, or per message on standard queues, 0 to
//!   900 s), **retention** (a message older than `MessageRetentionPeriod` is
//!   dropped, whatever its state), **`MaximumMessageSize`** (body plus message
//!   attributes; a send above it fails), at most 10 message attributes, batch
//!   calls of 1 to 10 entries.
//! - **FIFO** (a name ending in `.fifo`): a message group is blocked while any
//!   of its messages is in flight, one receive may return several messages of
//!   a group, in order; sends need a group id and a deduplication id (or
//!   content-based deduplication: the SHA-256 of the body); a send whose
//!   deduplication id was seen in the last five minutes is accepted and not
//!   delivered again (it answers with the first message's id). Per-message
//!   delays are refused on FIFO queues.
//!
//! What SQS only *might* do ([`Might`], off by default: then a receive sees
//! every message, in send order, at most once at a time, and so on): on
//! standard queues, a message delivered twice at once (two live receipt
//! handles), a deleted message delivered again once, later, receives that
//! return fewer messages than are visible (servers sampled) or return them
//! out of send order, a delete with an old receipt handle that does delete;
//! on FIFO queues, a delete whose receipt handle's visibility ran out refused;
//! on both, single entries of a batch call failing (`InternalError`) while
//! the call succeeds. The random choices come from a source the caller
//! supplies (the simulator's seed), so a run stays a function of its inputs.
//!
//! Not modelled: in-flight limits, and message system attributes other than
//! the receive count, the group and the deduplication id.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::Message;
use crate::protocol::limits::{
    SQS_DEDUP_WINDOW, SQS_DEFAULT_MAX_MESSAGE_BYTES, SQS_MAX_ATTRIBUTES, SQS_MAX_DELAY,
    SQS_MAX_VISIBILITY, SQS_MAX_WAIT,
};
use crate::protocol::message::Attribute;
use crate::protocol::queue::{
    EntryFailure, OutgoingMessage, QueueAttributes, QueueClient, QueueError, ReceiveRequest,
    SQS_BATCH, is_fifo,
};

/// The account in every queue URL.
pub const ACCOUNT: &str = "000000000000";

/// The redrive policy of a source queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedrivePolicy {
    /// The DLQ's URL (a queue of this service, FIFO for a FIFO source).
    pub dlq_url: String,
    /// Receives after which the next receive moves the message to the DLQ.
    pub max_receive_count: u32,
}

/// Numbers in `0.0..1.0`, one per call: the random choices of [`Might`].
pub type Draw = Arc<Mutex<dyn FnMut() -> f64 + Send>>;

/// A [`Draw`] whose first `n` numbers hit every rate above zero and whose
/// later ones hit none: what SQS might do, done `n` draws' worth, then never
/// (a test that wants one twin delivery, or one failed batch entry).
pub fn first_draws_hit(n: u32) -> Draw {
    let mut drawn = 0u32;
    Arc::new(Mutex::new(move || {
        drawn = drawn.saturating_add(1);
        if drawn <= n { 0.0 } else { 1.0 }
    }))
}

/// What SQS might do, where the Developer Guide says it might: each a
/// probability (per receive, per message, per delete or per batch entry);
/// all zero (the default) is the kind reading everywhere. Nothing is drawn
/// from `draw` for a rate of zero.
#[derive(Clone, Default)]
pub struct Might {
    /// Standard: per message received, the same receive returns it twice
    /// (two receipt handles, both valid); per receive, one message already
    /// in flight is returned again (its earlier handle stays valid).
    pub twice: f64,
    /// Standard: per delete that deletes, the message comes back once, up to
    /// two minutes later (a copy on a server the delete missed).
    pub again_after_delete: f64,
    /// Standard: per receive, fewer messages than asked for and visible
    /// (maybe none): a short poll that sampled some servers.
    pub fewer: f64,
    /// Standard: per receive, messages in no particular order.
    pub unordered: f64,
    /// Standard: per delete with a receipt handle of an earlier receive of a
    /// message received again since, the message is deleted.
    pub old_handle_deletes: f64,
    /// FIFO: a delete whose receipt handle's visibility timeout ran out is
    /// refused (`ReceiptHandleIsInvalid`).
    pub expired_fifo_handles: bool,
    /// Per entry of `DeleteMessageBatch` and `ChangeMessageVisibilityBatch`:
    /// it fails with `InternalError` (not applied) while the call succeeds.
    pub entry_errors: f64,
    /// Where the random choices come from (`None`: nothing unkind happens).
    pub draw: Option<Draw>,
}

impl std::fmt::Debug for Might {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Might")
            .field("twice", &self.twice)
            .field("again_after_delete", &self.again_after_delete)
            .field("fewer", &self.fewer)
            .field("unordered", &self.unordered)
            .field("old_handle_deletes", &self.old_handle_deletes)
            .field("expired_fifo_handles", &self.expired_fifo_handles)
            .field("entry_errors", &self.entry_errors)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Might {
    fn eq(&self, o: &Self) -> bool {
        let rates = |m: &Self| {
            [
                m.twice,
                m.again_after_delete,
                m.fewer,
                m.unordered,
                m.old_handle_deletes,
                m.entry_errors,
            ]
            .map(f64::to_bits)
        };
        let same_draw = match (&self.draw, &o.draw) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        rates(self) == rates(o) && self.expired_fifo_handles == o.expired_fifo_handles && same_draw
    }
}

// Rates compare by their bits: equality is reflexive.
impl Eq for Might {}

impl Might {
    /// True with probability `p` (never for zero, or without a source).
    fn hits(&self, p: f64) -> bool {
        p > 0.0 && self.draw.as_ref().is_some_and(|d| self.roll(d) < p)
    }

    fn roll(&self, d: &Draw) -> f64 {
        let mut f = d.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }

    /// A number in `0..n` (`n` at least 1).
    fn below(&self, n: usize) -> usize {
        let x = self.draw.as_ref().map_or(0.0, |d| self.roll(d));
        ((x * n as f64) as usize).min(n.saturating_sub(1))
    }
}

/// A queue's attributes at creation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSettings {
    /// The queue's name (`.fifo` at the end makes it FIFO).
    pub name: String,
    /// `VisibilityTimeout` (default 30 s): returned by `GetQueueAttributes`;
    /// receives name their own.
    pub visibility_timeout: Duration,
    /// `MessageRetentionPeriod` (default 4 days).
    pub retention: Duration,
    /// `MaximumMessageSize` in bytes.
    pub max_message_bytes: usize,
    /// `DelaySeconds` of every message sent.
    pub delay: Duration,
    /// `RedrivePolicy`.
    pub redrive: Option<RedrivePolicy>,
    /// `ContentBasedDeduplication` (FIFO).
    pub content_based_deduplication: bool,
    /// What SQS might do besides (nothing, by default).
    pub might: Might,
    /// The most messages in flight at once: a receive beyond it is refused
    /// with `OverLimit` (SQS's quota: 120,000 for a standard queue, 20,000
    /// for a FIFO one, the defaults).
    pub max_in_flight: usize,
}

impl QueueSettings {
    /// SQS's defaults for a queue named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        let max_in_flight = if name.ends_with(".fifo") {
            20_000
        } else {
            120_000
        };
        Self {
            max_in_flight,
            name,
            visibility_timeout: Duration::from_secs(30),
            retention: Duration::from_secs(4 * 24 * 3600),
            max_message_bytes: SQS_DEFAULT_MAX_MESSAGE_BYTES,
            delay: Duration::ZERO,
            redrive: None,
            content_based_deduplication: false,
            might: Might::default(),
        }
    }
}

/// Per-send options beyond [`OutgoingMessage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendOptions {
    /// `DelaySeconds` of this message (standard queues only).
    pub delay: Option<Duration>,
}

/// What a send did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    /// The message id (the first message's, for a deduplicated send).
    pub message_id: String,
    /// FIFO: accepted but not enqueued (its deduplication id was seen in the
    /// last five minutes).
    pub deduplicated: bool,
}

/// Where a stored message stands now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageState {
    /// Sent with a delay that has not run out, never received.
    Delayed,
    /// Can be received.
    Visible,
    /// Received and its visibility timeout not yet run out.
    InFlight,
}

/// A message as it is stored (for inspection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// Message id.
    pub id: String,
    /// Body.
    pub body: String,
    /// Message attributes.
    pub attributes: BTreeMap<String, Attribute>,
    /// FIFO message group.
    pub group_id: Option<String>,
    /// FIFO deduplication id.
    pub deduplication_id: Option<String>,
    /// Receives so far (`ApproximateReceiveCount`).
    pub receive_count: u32,
    /// Now.
    pub state: MessageState,
}

/// What happened in a queue so far, and what it holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// Stored and visible.
    pub visible: usize,
    /// Stored and in flight.
    pub in_flight: usize,
    /// Stored and delayed.
    pub delayed: usize,
    /// Messages enqueued (sends and moves from a source queue).
    pub enqueued: u64,
    /// FIFO sends dropped by the deduplication window.
    pub deduplicated: u64,
    /// Messages deleted.
    pub deleted: u64,
    /// Deletes with a receipt handle that was no longer the latest (ignored).
    pub stale_deletes: u64,
    /// Messages moved to the DLQ by the redrive policy.
    pub moved_to_dlq: u64,
    /// Messages dropped at the end of the retention period.
    pub expired: u64,
    /// Messages returned by receives.
    pub received: u64,
    /// [`Might`]: deliveries made while another receipt handle of the
    /// message was valid (a concurrent duplicate).
    pub twice: u64,
    /// [`Might`]: deleted messages that will come back.
    pub again_after_delete: u64,
    /// [`Might`]: deletes with an old receipt handle that deleted.
    pub old_handle_deletes: u64,
    /// [`Might`]: batch entries failed with `InternalError`.
    pub entry_errors: u64,
}

impl QueueCounts {
    /// Messages stored now, in any state.
    pub fn stored(&self) -> usize {
        self.visible + self.in_flight + self.delayed
    }
}

/// One stored message.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    body: String,
    attributes: BTreeMap<String, Attribute>,
    group_id: Option<String>,
    dedup_id: Option<String>,
    sent_at: Instant,
    visible_at: Instant,
    receive_count: u32,
    /// The latest receipt handle, and when it was issued.
    receipt: Option<(String, Instant)>,
    /// [`Might`]: an earlier receipt handle that is still valid (the message
    /// was delivered twice at once).
    twin: Option<String>,
    /// [`Might`]: it was deleted and came back (at most once).
    came_back: bool,
    /// [`Might`]: it was delivered twice at once. The model keeps one
    /// visibility for both copies, so a later delivery may be of the copy
    /// whose holder still holds the other: counted as concurrent too.
    doubled: bool,
}

impl Entry {
    fn state(&self, now: Instant) -> MessageState {
        match (self.visible_at > now, self.receipt.is_some()) {
            (false, _) => MessageState::Visible,
            (true, true) => MessageState::InFlight,
            (true, false) => MessageState::Delayed,
        }
    }

    fn to_message(&self, receipt: &str) -> Message {
        let mut m = Message::new(&self.id, &self.body)
            .with_receipt_handle(receipt)
            .with_receive_count(self.receive_count);
        if let Some(g) = &self.group_id {
            m = m.with_group_id(g);
        }
        if let Some(d) = &self.dedup_id {
            m = m.with_deduplication_id(d);
        }
        for (name, a) in &self.attributes {
            m = m.with_typed_attribute(name, a.clone());
        }
        m
    }
}

/// One queue: its settings, its messages in send order, its FIFO
/// deduplication ids.
///
/// Besides the messages, three indexes over them make a receive, a delete or
/// a visibility change cost O(log n) in the number of messages stored, not
/// O(n): they are caches of what the entries say, kept by [`Queue::insert`],
/// [`Queue::remove`], [`Queue::set_visible_at`] and [`Queue::refresh`], and
/// every message is in exactly one of `visible` and `hidden`.
#[derive(Debug)]
struct Queue {
    settings: QueueSettings,
    fifo: bool,
    /// By sequence number: send order.
    messages: BTreeMap<u64, Entry>,
    /// Sequence numbers of the messages visible as of the last refresh (or
    /// made visible since), in send order.
    visible: BTreeSet<u64>,
    /// `(visible_at, seq)` of the others: in flight or delayed as of the
    /// last refresh.
    hidden: BTreeSet<(Instant, u64)>,
    /// `(sent_at, seq)` of every message, for retention.
    by_sent: BTreeSet<(Instant, u64)>,
    /// FIFO deduplication id -> (first sent, message id).
    dedup: HashMap<String, (Instant, String)>,
    counts: QueueCounts,
    /// [`Might`]: receipt handles issued while another handle of their
    /// message was valid.
    twins: BTreeSet<String>,
    /// [`Might`]: receipt handles whose delete deleted a message that came back.
    back_after_delete: BTreeSet<String>,
}

impl Queue {
    fn new(settings: QueueSettings, fifo: bool) -> Self {
        Self {
            settings,
            fifo,
            messages: BTreeMap::new(),
            visible: BTreeSet::new(),
            hidden: BTreeSet::new(),
            by_sent: BTreeSet::new(),
            dedup: HashMap::new(),
            counts: QueueCounts::default(),
            twins: BTreeSet::new(),
            back_after_delete: BTreeSet::new(),
        }
    }

    /// Stores a message.
    fn insert(&mut self, seq: u64, entry: Entry, now: Instant) {
        self.by_sent.insert((entry.sent_at, seq));
        self.index(seq, entry.visible_at, now);
        self.messages.insert(seq, entry);
    }

    /// Removes a message, whatever its state.
    fn remove(&mut self, seq: u64) -> Option<Entry> {
        let entry = self.messages.remove(&seq)?;
        self.unindex(seq, entry.visible_at);
        self.by_sent.remove(&(entry.sent_at, seq));
        Some(entry)
    }

    /// Sets when a stored message becomes visible.
    fn set_visible_at(&mut self, seq: u64, at: Instant, now: Instant) {
        let Some(entry) = self.messages.get_mut(&seq) else {
            return;
        };
        let old = std::mem::replace(&mut entry.visible_at, at);
        self.unindex(seq, old);
        self.index(seq, at, now);
    }

    fn index(&mut self, seq: u64, visible_at: Instant, now: Instant) {
        if visible_at <= now {
            self.visible.insert(seq);
        } else {
            self.hidden.insert((visible_at, seq));
        }
    }

    fn unindex(&mut self, seq: u64, visible_at: Instant) {
        if !self.visible.remove(&seq) {
            self.hidden.remove(&(visible_at, seq));
        }
    }

    /// Brings the indexes up to `now`: drops messages past retention and
    /// deduplication ids past the window, and counts as visible what has
    /// become so since the last refresh.
    fn refresh(&mut self, now: Instant) {
        let retention = self.settings.retention;
        while let Some(&(sent_at, seq)) = self.by_sent.first() {
            if sent_at + retention > now {
                break;
            }
            self.remove(seq);
            self.counts.expired += 1;
        }
        if !self.dedup.is_empty() {
            self.dedup.retain(|_, (at, _)| *at + SQS_DEDUP_WINDOW > now);
        }
        while let Some(&(at, seq)) = self.hidden.first() {
            if at > now {
                break;
            }
            self.hidden.pop_first();
            self.visible.insert(seq);
        }
    }

    /// The first visible message at or after `from` in send order (after a
    /// refresh: every message visible now).
    fn next_visible(&self, from: u64) -> Option<u64> {
        self.visible.range(from..).next().copied()
    }

    /// The sequence numbers a receive may take now, in order: visible ones; on
    /// a FIFO queue none of a group with a message in flight, and none after a
    /// message of its group that is not visible.
    fn candidates(&self, now: Instant) -> Vec<u64> {
        let mut blocked: BTreeSet<&str> = BTreeSet::new();
        if self.fifo {
            for e in self.messages.values() {
                if e.state(now) == MessageState::InFlight {
                    blocked.insert(e.group_id.as_deref().unwrap_or_default());
                }
            }
        }
        let mut out = Vec::new();
        for (seq, e) in &self.messages {
            let group = e.group_id.as_deref().unwrap_or_default();
            if self.fifo && blocked.contains(group) {
                continue;
            }
            if e.state(now) == MessageState::Visible {
                out.push(*seq);
            } else if self.fifo {
                blocked.insert(group);
            }
        }
        out
    }

    /// The next instant something stored becomes visible.
    fn next_change(&self, now: Instant) -> Option<Instant> {
        self.hidden.iter().map(|(at, _)| *at).find(|t| *t > now)
    }

    /// Hands out a stored message with a new receipt handle: its receive
    /// count up, invisible for `visibility`. With `twin`, the handle it had
    /// stays valid too (a concurrent duplicate delivery).
    fn take(
        &mut self,
        seq: u64,
        receipt: String,
        now: Instant,
        visibility: Duration,
        twin: bool,
    ) -> Option<Message> {
        let e = self.messages.get_mut(&seq)?;
        e.receive_count += 1;
        let before = e.receipt.replace((receipt.clone(), now));
        e.twin = before.filter(|_| twin).map(|(r, _)| r);
        let m = e.to_message(&receipt);
        let again = e.doubled;
        e.doubled |= twin;
        if again && !twin {
            self.twins.insert(receipt.clone());
        }
        if twin {
            self.twins.insert(receipt);
            self.counts.twice += 1;
        }
        self.set_visible_at(seq, now + visibility, now);
        Some(m)
    }

    /// [`Might::unordered`]: the visible messages in an order drawn (`None`:
    /// in send order, walked from the index).
    fn unordered(&self) -> Option<Vec<u64>> {
        let m = &self.settings.might;
        if self.fifo || !m.hits(m.unordered) {
            return None;
        }
        let mut seqs: Vec<u64> = self.visible.iter().copied().collect();
        for i in (1..seqs.len()).rev() {
            seqs.swap(i, m.below(i + 1));
        }
        Some(seqs)
    }

    /// [`Might::fewer`]: how many a receive asking for `max` may return.
    fn fewer(&self, max: usize) -> usize {
        let m = &self.settings.might;
        if self.fifo || !m.hits(m.fewer) {
            return max;
        }
        m.below(max)
    }

    /// How many messages are in flight, when that reaches the queue's
    /// quota (a receive is then refused); counted only when the hidden
    /// messages, delayed ones too, reach it.
    fn at_in_flight_quota(&self, now: Instant) -> Option<usize> {
        let limit = self.settings.max_in_flight;
        if self.hidden.len() < limit {
            return None;
        }
        let in_flight = self
            .hidden
            .iter()
            .filter(|(_, seq)| {
                matches!(
                    self.messages.get(seq).map(|e| e.state(now)),
                    Some(MessageState::InFlight)
                )
            })
            .count();
        (in_flight >= limit).then_some(in_flight)
    }

    /// [`Might::twice`]: a message in flight (with one valid handle) that a
    /// receive returns again.
    fn in_flight_again(&self, now: Instant) -> Option<u64> {
        let m = &self.settings.might;
        if self.fifo || !m.hits(m.twice) {
            return None;
        }
        let held: Vec<u64> = self
            .hidden
            .iter()
            .map(|(_, seq)| *seq)
            .filter(|seq| {
                self.messages.get(seq).is_some_and(|e| {
                    e.twin.is_none()
                        && e.state(now) == MessageState::InFlight
                        && self.below_max_receives(e)
                })
            })
            .collect();
        (!held.is_empty()).then(|| held[m.below(held.len())])
    }

    /// Whether one more receive of `e` stays within the redrive policy's
    /// `maxReceiveCount`: a twin delivery is a receive, and SQS moves a
    /// message to its DLQ rather than deliver it past that count.
    fn below_max_receives(&self, e: &Entry) -> bool {
        self.settings
            .redrive
            .as_ref()
            .is_none_or(|r| e.receive_count < r.max_receive_count)
    }
}

/// The whole service: queues by URL and the id counters.
#[derive(Debug, Default)]
struct Service {
    queues: BTreeMap<String, Queue>,
    next_seq: u64,
    next_message: u64,
    next_receipt: u64,
}

/// An in-memory SQS service with any number of queues. Clones share state.
#[derive(Debug, Clone, Default)]
pub struct MemoryQueue {
    service: Arc<Mutex<Service>>,
    /// Woken on every send, delete and visibility change (long polls).
    changed: Arc<Notify>,
}

fn error(
    operation: &'static str,
    queue: &str,
    code: &str,
    detail: impl std::fmt::Display,
) -> QueueError {
    QueueError::new(operation, queue, format!("{code}: {detail}"), false).with_code(code)
}

fn no_queue(operation: &'static str, queue: &str) -> QueueError {
    error(
        operation,
        queue,
        "AWS.SimpleQueueService.NonExistentQueue",
        "the specified queue does not exist",
    )
}

/// Parses `rh-SEQ-N` into the message's sequence number.
fn receipt_seq(receipt: &str) -> Option<u64> {
    let rest = receipt.strip_prefix("rh-")?;
    let (seq, n) = rest.split_once('-')?;
    n.parse::<u64>().ok()?;
    seq.parse().ok()
}

/// What a receipt handle names now.
enum Handle {
    /// The latest handle of the stored message with this sequence number.
    Latest(u64),
    /// A handle of a stored message that was received again since.
    Stale,
    /// A well-formed handle whose message is gone (deleted, moved, expired).
    Gone,
}

fn payload_bytes(body: &str, attributes: &BTreeMap<String, Attribute>) -> usize {
    body.len() + attributes.iter().map(|(n, a)| a.size(n)).sum::<usize>()
}

impl MemoryQueue {
    /// A service with no queues.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Service> {
        // A panic while the lock is held leaves the model as it was between
        // two whole operations (each completes under the lock), so carry on.
        self.service.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The URL of a queue named `name`.
    pub fn url_of(name: &str) -> String {
        format!("https://sqs.us-east-1.amazonaws.com/{ACCOUNT}/{name}")
    }

    /// Creates a queue (its DLQ first, if it has one); answers its URL.
    pub fn create_queue(&self, settings: QueueSettings) -> Result<String, QueueError> {
        const OP: &str = "CreateQueue";
        let url = Self::url_of(&settings.name);
        let fifo = is_fifo(&settings.name);
        let bad = |detail: &str| Err(error(OP, &url, "InvalidAttributeValue", detail));
        if settings.visibility_timeout > SQS_MAX_VISIBILITY {
            return bad("VisibilityTimeout above 43200");
        }
        if settings.delay > SQS_MAX_DELAY {
            return bad("DelaySeconds above 900");
        }
        if !(1024..=1_048_576).contains(&settings.max_message_bytes) {
            return bad("MaximumMessageSize outside 1024 to 1048576");
        }
        if settings.retention < Duration::from_secs(60)
            || settings.retention > Duration::from_secs(14 * 24 * 3600)
        {
            return bad("MessageRetentionPeriod outside 60 s to 14 days");
        }
        let mut service = self.lock();
        if let Some(r) = &settings.redrive {
            match service.queues.get(&r.dlq_url) {
                None => return bad("the redrive policy's DLQ does not exist"),
                Some(dlq) if dlq.fifo != fifo => {
                    return bad("a FIFO queue's DLQ must be FIFO, a standard queue's standard");
                }
                Some(_) if !(1..=1000).contains(&r.max_receive_count) => {
                    return bad("maxReceiveCount outside 1 to 1000");
                }
                Some(_) => {}
            }
        }
        service
            .queues
            .entry(url.clone())
            .or_insert_with(|| Queue::new(settings, fifo));
        Ok(url)
    }

    /// Sends a message with per-send options.
    pub fn send_with(
        &self,
        url: &str,
        message: OutgoingMessage,
        options: SendOptions,
    ) -> Result<Sent, QueueError> {
        const OP: &str = "SendMessage";
        let now = Instant::now();
        let mut guard = self.lock();
        let service = &mut *guard;
        let queue = service
            .queues
            .get_mut(url)
            .ok_or_else(|| no_queue(OP, url))?;
        queue.refresh(now);
        let delay = validate_send(queue, url, &message, options)?;
        let dedup_id = match queue.fifo {
            true => Some(
                message
                    .deduplication_id
                    .clone()
                    .unwrap_or_else(|| crate::protocol::key::sha256_hex(message.body.as_bytes())),
            ),
            false => message.deduplication_id.clone(),
        };
        if queue.fifo
            && let Some(id) = dedup_id.as_ref()
            && let Some((_, first)) = queue.dedup.get(id)
        {
            queue.counts.deduplicated += 1;
            return Ok(Sent {
                message_id: first.clone(),
                deduplicated: true,
            });
        }
        service.next_message += 1;
        service.next_seq += 1;
        let id = format!("msg-{:08}", service.next_message);
        if let (true, Some(d)) = (queue.fifo, dedup_id.as_ref()) {
            queue.dedup.insert(d.clone(), (now, id.clone()));
        }
        queue.insert(
            service.next_seq,
            Entry {
                id: id.clone(),
                body: message.body,
                attributes: message.attributes,
                group_id: message.group_id,
                dedup_id,
                sent_at: now,
                visible_at: now + delay,
                receive_count: 0,
                receipt: None,
                twin: None,
                came_back: false,
                doubled: false,
            },
            now,
        );
        queue.counts.enqueued += 1;
        drop(guard);
        self.changed.notify_waiters();
        Ok(Sent {
            message_id: id,
            deduplicated: false,
        })
    }

    /// What a queue holds and what happened in it; `None` for an unknown queue.
    pub fn counts(&self, url: &str) -> Option<QueueCounts> {
        let now = Instant::now();
        let mut service = self.lock();
        let queue = service.queues.get_mut(url)?;
        queue.refresh(now);
        let mut counts = queue.counts;
        counts.visible = queue.visible.len();
        for (_, seq) in &queue.hidden {
            match queue.messages.get(seq).map(|e| e.state(now)) {
                Some(MessageState::Delayed) => counts.delayed += 1,
                Some(MessageState::InFlight) => counts.in_flight += 1,
                Some(MessageState::Visible) | None => {}
            }
        }
        Some(counts)
    }

    /// A queue's stored messages in send order (empty for an unknown queue).
    pub fn contents(&self, url: &str) -> Vec<StoredMessage> {
        let now = Instant::now();
        let mut service = self.lock();
        let Some(queue) = service.queues.get_mut(url) else {
            return Vec::new();
        };
        queue.refresh(now);
        queue
            .messages
            .values()
            .map(|e| StoredMessage {
                id: e.id.clone(),
                body: e.body.clone(),
                attributes: e.attributes.clone(),
                group_id: e.group_id.clone(),
                deduplication_id: e.dedup_id.clone(),
                receive_count: e.receive_count,
                state: e.state(now),
            })
            .collect()
    }

    /// One receive attempt now: the messages taken, and when something may
    /// next become visible.
    fn try_receive(
        &self,
        url: &str,
        request: &ReceiveRequest,
    ) -> Result<(Vec<Message>, Option<Instant>), QueueError> {
        let now = Instant::now();
        let mut guard = self.lock();
        let service = &mut *guard;
        let queue = service
            .queues
            .get_mut(url)
            .ok_or_else(|| no_queue("ReceiveMessage", url))?;
        queue.refresh(now);
        if let Some(in_flight) = queue.at_in_flight_quota(now) {
            return Err(error(
                "ReceiveMessage",
                url,
                "OverLimit",
                format!("{in_flight} messages in flight, the queue's maximum"),
            ));
        }
        let redrive = queue.settings.redrive.clone();
        let mut taken = Vec::new();
        let mut moved = Vec::new();
        let max = queue.fewer(request.max);
        if max > 0
            && let Some(seq) = queue.in_flight_again(now)
        {
            service.next_receipt += 1;
            let receipt = format!("rh-{seq}-{}", service.next_receipt);
            taken.extend(queue.take(seq, receipt, now, request.visibility, true));
        }
        // A FIFO queue's candidates depend on its groups: found by a scan. A
        // standard queue's are its visible messages in send order, walked
        // from the index one at a time (unless drawn in another order).
        let mut listed = match queue.fifo {
            true => Some(queue.candidates(now).into_iter()),
            false => queue.unordered().map(Vec::into_iter),
        };
        let mut from = 0;
        while taken.len() < max {
            let next = match listed.as_mut() {
                Some(candidates) => candidates.next(),
                None => queue.next_visible(from),
            };
            let Some(seq) = next else {
                break;
            };
            from = seq + 1;
            if let Some(r) = &redrive
                && queue.messages[&seq].receive_count >= r.max_receive_count
            {
                if let Some(e) = queue.remove(seq) {
                    moved.push(e);
                }
                continue;
            }
            service.next_receipt += 1;
            let receipt = format!("rh-{seq}-{}", service.next_receipt);
            taken.extend(queue.take(seq, receipt, now, request.visibility, false));
            let might = &queue.settings.might;
            let twin_allowed = queue
                .messages
                .get(&seq)
                .is_some_and(|e| queue.below_max_receives(e));
            if !queue.fifo && taken.len() < max && twin_allowed && might.hits(might.twice) {
                service.next_receipt += 1;
                let receipt = format!("rh-{seq}-{}", service.next_receipt);
                taken.extend(queue.take(seq, receipt, now, request.visibility, true));
            }
        }
        queue.counts.received += taken.len() as u64;
        queue.counts.moved_to_dlq += moved.len() as u64;
        let next = queue.next_change(now);
        if let Some(r) = redrive {
            move_to_dlq(service, &r.dlq_url, moved, now);
        }
        Ok((taken, next))
    }

    /// Finds what a receipt handle names in `url`.
    fn handle(
        queue: &Queue,
        operation: &'static str,
        url: &str,
        receipt: &str,
    ) -> Result<Handle, QueueError> {
        let invalid = || {
            error(
                operation,
                url,
                "ReceiptHandleIsInvalid",
                format!("the receipt handle {receipt:?} is not valid"),
            )
        };
        let seq = receipt_seq(receipt).ok_or_else(invalid)?;
        match queue.messages.get(&seq) {
            Some(e)
                if e.receipt.as_ref().is_some_and(|(r, _)| r == receipt)
                    || e.twin.as_deref() == Some(receipt) =>
            {
                Ok(Handle::Latest(seq))
            }
            // Received before (a message that came back after a delete has
            // no handle now, and its earlier ones are old).
            Some(e) if e.receipt.is_some() || e.receive_count > 0 => Ok(Handle::Stale),
            Some(_) => Err(invalid()),
            None => Ok(Handle::Gone),
        }
    }

    /// `DeleteMessage` on a locked service.
    fn delete_one(
        &self,
        service: &mut Service,
        url: &str,
        receipt: &str,
    ) -> Result<(), QueueError> {
        const OP: &str = "DeleteMessage";
        let now = Instant::now();
        let queue = service
            .queues
            .get_mut(url)
            .ok_or_else(|| no_queue(OP, url))?;
        let might = queue.settings.might.clone();
        match Self::handle(queue, OP, url, receipt)? {
            Handle::Latest(seq)
                if queue.fifo
                    && might.expired_fifo_handles
                    && queue.messages[&seq].state(now) != MessageState::InFlight =>
            {
                return Err(error(
                    OP,
                    url,
                    "ReceiptHandleIsInvalid",
                    "the receipt handle has expired (its visibility timeout ran out)",
                ));
            }
            Handle::Latest(seq) => {
                let gone = queue.remove(seq);
                queue.counts.deleted += 1;
                if let Some(e) = gone.filter(|e| !queue.fifo && !e.came_back)
                    && might.hits(might.again_after_delete)
                {
                    let after = Duration::from_secs(1 + might.below(120) as u64);
                    queue.counts.again_after_delete += 1;
                    queue.back_after_delete.insert(receipt.to_owned());
                    let back = Entry {
                        visible_at: now + after,
                        receipt: None,
                        twin: None,
                        came_back: true,
                        ..e
                    };
                    queue.insert(seq, back, now);
                }
            }
            Handle::Stale if !queue.fifo && might.hits(might.old_handle_deletes) => {
                // Delete with a handle of an earlier receive in the
                // documented "might": this one is honoured.
                let Some(seq) = receipt_seq(receipt) else {
                    return Ok(());
                };
                queue.remove(seq);
                queue.counts.deleted += 1;
                queue.counts.old_handle_deletes += 1;
            }
            Handle::Stale => queue.counts.stale_deletes += 1,
            Handle::Gone => {}
        }
        Ok(())
    }

    /// `ChangeMessageVisibility` on a locked service.
    fn change_one(
        &self,
        service: &mut Service,
        url: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        const OP: &str = "ChangeMessageVisibility";
        let now = Instant::now();
        let queue = service
            .queues
            .get_mut(url)
            .ok_or_else(|| no_queue(OP, url))?;
        if timeout > SQS_MAX_VISIBILITY {
            return Err(error(
                OP,
                url,
                "InvalidParameterValue",
                "VisibilityTimeout above 43200",
            ));
        }
        let seq = match Self::handle(queue, OP, url, receipt)? {
            Handle::Latest(seq) => seq,
            Handle::Stale | Handle::Gone => {
                return Err(error(
                    OP,
                    url,
                    "ReceiptHandleIsInvalid",
                    "the receipt handle has expired (the message was received again, or is gone)",
                ));
            }
        };
        let Some(entry) = queue.messages.get_mut(&seq) else {
            return Err(error(
                OP,
                url,
                "ReceiptHandleIsInvalid",
                "the message is gone",
            ));
        };
        if entry.state(now) != MessageState::InFlight {
            return Err(error(
                OP,
                url,
                "AWS.SimpleQueueService.MessageNotInflight",
                "the message is not in flight",
            ));
        }
        let received_at = entry.receipt.as_ref().map_or(now, |(_, at)| *at);
        if now + timeout > received_at + SQS_MAX_VISIBILITY {
            return Err(error(
                OP,
                url,
                "InvalidParameterValue",
                "the message would stay invisible more than 12 hours after its receive",
            ));
        }
        queue.set_visible_at(seq, now + timeout, now);
        Ok(())
    }

    /// [`Might::entry_errors`]: whether a batch entry fails (not applied).
    fn entry_error(
        service: &mut Service,
        operation: &'static str,
        url: &str,
    ) -> Option<QueueError> {
        let queue = service.queues.get_mut(url)?;
        let might = &queue.settings.might;
        if !might.hits(might.entry_errors) {
            return None;
        }
        queue.counts.entry_errors += 1;
        Some(error(
            operation,
            url,
            "InternalError",
            "the entry failed (try it again)",
        ))
    }

    /// The receipt handles of `url` whose delete deleted a message that then
    /// came back ([`Might::again_after_delete`]).
    pub fn back_after_delete(&self, url: &str) -> BTreeSet<String> {
        self.lock()
            .queues
            .get(url)
            .map(|q| q.back_after_delete.clone())
            .unwrap_or_default()
    }

    /// Receipt handles of `url` issued while another handle of their message
    /// was valid ([`Might::twice`]): concurrent duplicate deliveries.
    pub fn twin_receipts(&self, url: &str) -> BTreeSet<String> {
        self.lock()
            .queues
            .get(url)
            .map(|q| q.twins.clone())
            .unwrap_or_default()
    }

    fn check_batch(operation: &'static str, url: &str, n: usize) -> Result<(), QueueError> {
        match n {
            0 => Err(error(
                operation,
                url,
                "AWS.SimpleQueueService.EmptyBatchRequest",
                "no entries",
            )),
            n if n > SQS_BATCH => Err(error(
                operation,
                url,
                "AWS.SimpleQueueService.TooManyEntriesInBatchRequest",
                format!("{n} entries; at most {SQS_BATCH}"),
            )),
            _ => Ok(()),
        }
    }
}

/// Checks a send against the queue's rules; the delay it gets.
fn validate_send(
    queue: &Queue,
    url: &str,
    message: &OutgoingMessage,
    options: SendOptions,
) -> Result<Duration, QueueError> {
    const OP: &str = "SendMessage";
    let bad = |code: &str, detail: String| Err(error(OP, url, code, detail));
    if message.body.is_empty() {
        return bad("MissingParameter", "the message body is empty".into());
    }
    if message.attributes.len() > SQS_MAX_ATTRIBUTES {
        return bad(
            "InvalidParameterValue",
            format!(
                "{} message attributes; at most {SQS_MAX_ATTRIBUTES}",
                message.attributes.len()
            ),
        );
    }
    if let Some((name, _)) = message.attributes.iter().find(|(_, a)| match &a.value {
        crate::AttributeValue::Text(t) => t.is_empty(),
        crate::AttributeValue::Binary(b) => b.is_empty(),
    }) {
        return bad(
            "InvalidParameterValue",
            format!("message attribute '{name}' must contain a non-empty value"),
        );
    }
    let bytes = payload_bytes(&message.body, &message.attributes);
    if bytes > queue.settings.max_message_bytes {
        return bad(
            "InvalidParameterValue",
            format!(
                "message of {bytes} bytes is longer than MaximumMessageSize ({})",
                queue.settings.max_message_bytes
            ),
        );
    }
    if queue.fifo {
        if message.group_id.is_none() {
            return bad(
                "MissingParameter",
                "a FIFO send needs MessageGroupId".into(),
            );
        }
        if message.deduplication_id.is_none() && !queue.settings.content_based_deduplication {
            return bad(
                "InvalidParameterValue",
                "no MessageDeduplicationId and ContentBasedDeduplication is off".into(),
            );
        }
        if options.delay.is_some() {
            return bad(
                "InvalidParameterValue",
                "per-message DelaySeconds is not supported on FIFO queues".into(),
            );
        }
    }
    let delay = options.delay.unwrap_or(queue.settings.delay);
    if delay > SQS_MAX_DELAY {
        return bad("InvalidParameterValue", "DelaySeconds above 900".into());
    }
    Ok(delay)
}

/// Enqueues messages moved by a redrive policy at the end of the DLQ, with
/// their ids. As the SQS Developer Guide says: a standard queue's message
/// keeps its enqueue time (its retention counted from the first send); a
/// FIFO queue's enqueue time starts again at the move, and its
/// deduplication id is replaced by its message id.
fn move_to_dlq(service: &mut Service, dlq_url: &str, moved: Vec<Entry>, now: Instant) {
    for mut e in moved {
        service.next_seq += 1;
        let seq = service.next_seq;
        let Some(dlq) = service.queues.get_mut(dlq_url) else {
            tracing::error!(dlq = dlq_url, message_id = %e.id, "redrive DLQ missing; message dropped");
            continue;
        };
        if dlq.fifo {
            // In the DLQ's deduplication window too: a copy sent there under
            // that id within five minutes (a park of the same delivery) is
            // dropped as SQS drops it.
            e.sent_at = now;
            e.dedup_id = Some(e.id.clone());
            dlq.dedup.insert(e.id.clone(), (now, e.id.clone()));
        }
        e.receive_count = 0;
        e.receipt = None;
        e.twin = None;
        e.came_back = false;
        e.visible_at = now;
        dlq.insert(seq, e, now);
        dlq.counts.enqueued += 1;
    }
}

impl QueueClient for MemoryQueue {
    async fn receive(
        &self,
        queue: &str,
        request: ReceiveRequest,
    ) -> Result<Vec<Message>, QueueError> {
        const OP: &str = "ReceiveMessage";
        if !(1..=SQS_BATCH).contains(&request.max) {
            return Err(error(
                OP,
                queue,
                "InvalidParameterValue",
                "MaxNumberOfMessages outside 1 to 10",
            ));
        }
        if request.visibility > SQS_MAX_VISIBILITY || request.wait > SQS_MAX_WAIT {
            return Err(error(
                OP,
                queue,
                "InvalidParameterValue",
                "VisibilityTimeout or WaitTimeSeconds out of range",
            ));
        }
        let deadline = Instant::now() + request.wait;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (got, next) = self.try_receive(queue, &request)?;
            if !got.is_empty() || Instant::now() >= deadline {
                return Ok(got);
            }
            let wake = next.map_or(deadline, |t| t.min(deadline));
            tokio::select! {
                biased;
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    async fn delete(&self, queue: &str, receipt: &str) -> Result<(), QueueError> {
        let mut service = self.lock();
        self.delete_one(&mut service, queue, receipt)?;
        drop(service);
        self.changed.notify_waiters();
        Ok(())
    }

    async fn delete_batch(
        &self,
        queue: &str,
        receipts: &[String],
    ) -> Result<Vec<EntryFailure>, QueueError> {
        const OP: &str = "DeleteMessageBatch";
        Self::check_batch(OP, queue, receipts.len())?;
        let mut service = self.lock();
        if !service.queues.contains_key(queue) {
            return Err(no_queue(OP, queue));
        }
        let failed = receipts
            .iter()
            .enumerate()
            .filter_map(|(index, r)| {
                Self::entry_error(&mut service, OP, queue)
                    .or_else(|| self.delete_one(&mut service, queue, r).err())
                    .map(|e| entry_failure(index, &e))
            })
            .collect();
        drop(service);
        self.changed.notify_waiters();
        Ok(failed)
    }

    async fn change_visibility(
        &self,
        queue: &str,
        receipt: &str,
        timeout: Duration,
    ) -> Result<(), QueueError> {
        let mut service = self.lock();
        self.change_one(&mut service, queue, receipt, timeout)?;
        drop(service);
        self.changed.notify_waiters();
        Ok(())
    }

    async fn change_visibility_batch(
        &self,
        queue: &str,
        receipts: &[String],
        timeout: Duration,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        const OP: &str = "ChangeMessageVisibilityBatch";
        Self::check_batch(OP, queue, receipts.len())?;
        let mut service = self.lock();
        if !service.queues.contains_key(queue) {
            return Err(no_queue(OP, queue));
        }
        let failed = receipts
            .iter()
            .enumerate()
            .filter_map(|(index, r)| {
                Self::entry_error(&mut service, OP, queue)
                    .or_else(|| self.change_one(&mut service, queue, r, timeout).err())
                    .map(|e| entry_failure(index, &e))
            })
            .collect();
        drop(service);
        self.changed.notify_waiters();
        Ok(failed)
    }

    async fn send(&self, queue: &str, message: OutgoingMessage) -> Result<(), QueueError> {
        let options = SendOptions {
            delay: message.delay,
        };
        self.send_with(queue, message, options).map(|_| ())
    }

    async fn send_batch(
        &self,
        queue: &str,
        messages: Vec<OutgoingMessage>,
    ) -> Result<Vec<EntryFailure>, QueueError> {
        const OP: &str = "SendMessageBatch";
        Self::check_batch(OP, queue, messages.len())?;
        let total: usize = messages
            .iter()
            .map(|m| payload_bytes(&m.body, &m.attributes))
            .sum();
        if total > crate::protocol::limits::SQS_MAX_BATCH_BYTES {
            return Err(error(
                OP,
                queue,
                "AWS.SimpleQueueService.BatchRequestTooLong",
                format!(
                    "{total} bytes in the batch; at most {}",
                    crate::protocol::limits::SQS_MAX_BATCH_BYTES
                ),
            ));
        }
        let mut failed = Vec::new();
        for (index, message) in messages.into_iter().enumerate() {
            let drawn = {
                let mut service = self.lock();
                if !service.queues.contains_key(queue) {
                    return Err(no_queue(OP, queue));
                }
                Self::entry_error(&mut service, OP, queue)
            };
            let options = SendOptions {
                delay: message.delay,
            };
            if let Some(e) = drawn.or_else(|| self.send_with(queue, message, options).err()) {
                failed.push(entry_failure(index, &e));
            }
        }
        Ok(failed)
    }

    async fn attributes(&self, queue: &str) -> Result<QueueAttributes, QueueError> {
        let service = self.lock();
        let q = service
            .queues
            .get(queue)
            .ok_or_else(|| no_queue("GetQueueAttributes", queue))?;
        Ok(QueueAttributes {
            visibility_timeout: Some(q.settings.visibility_timeout),
            retention: Some(q.settings.retention),
            max_message_bytes: Some(q.settings.max_message_bytes),
            dead_letter_target_arn: q.settings.redrive.as_ref().map(|r| {
                let name = r.dlq_url.rsplit('/').next().unwrap_or_default();
                format!("arn:aws:sqs:us-east-1:{ACCOUNT}:{name}")
            }),
            content_based_deduplication: is_fifo(queue)
                .then_some(q.settings.content_based_deduplication),
            max_receive_count: q.settings.redrive.as_ref().map(|r| r.max_receive_count),
        })
    }

    async fn queue_url(&self, name: &str, account: &str) -> Result<String, QueueError> {
        let url = Self::url_of(name);
        if account != ACCOUNT || !self.lock().queues.contains_key(&url) {
            return Err(no_queue("GetQueueUrl", name));
        }
        Ok(url)
    }
}

/// A batch entry's failure from the error its single call would have given.
fn entry_failure(index: usize, e: &QueueError) -> EntryFailure {
    let (code, message) = e.detail.split_once(": ").unwrap_or((&e.detail, ""));
    EntryFailure {
        index,
        code: code.to_owned(),
        message: Some(message.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    //! What only the model can show quickly (hours of virtual time); the rest
    //! is the contract suite (`tests/it/queue_contract.rs`), shared with LocalStack.
    use super::*;

    fn service(settings: QueueSettings) -> (MemoryQueue, String) {
        let q = MemoryQueue::new();
        let url = q.create_queue(settings).expect("valid settings");
        (q, url)
    }

    fn plain(body: &str) -> OutgoingMessage {
        OutgoingMessage {
            body: body.to_owned(),
            ..Default::default()
        }
    }

    fn req(visibility_secs: u64) -> ReceiveRequest {
        ReceiveRequest {
            max: 10,
            wait: Duration::ZERO,
            visibility: Duration::from_secs(visibility_secs),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn visibility_is_capped_at_twelve_hours_after_the_receive() {
        let (q, url) = service(QueueSettings::new("cap"));
        q.send(&url, plain("m")).await.unwrap();
        let got = q.receive(&url, req(7200)).await.unwrap();
        let receipt = got[0].receipt_handle().unwrap();
        tokio::time::advance(Duration::from_secs(3600)).await;
        let err = q.change_visibility(&url, receipt, SQS_MAX_VISIBILITY).await;
        assert!(err.is_err(), "12 h more after 1 h in flight was accepted");
        q.change_visibility(
            &url,
            receipt,
            SQS_MAX_VISIBILITY - Duration::from_secs(3600),
        )
        .await
        .expect("up to 12 h after the receive");
    }

    #[tokio::test(start_paused = true)]
    async fn a_visibility_change_with_an_old_handle_is_refused() {
        let (q, url) = service(QueueSettings::new("old"));
        q.send(&url, plain("m")).await.unwrap();
        let first = q.receive(&url, req(1)).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        let second = q.receive(&url, req(30)).await.unwrap();
        let old = first[0].receipt_handle().unwrap();
        let err = q
            .change_visibility(&url, old, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(err.detail.starts_with("ReceiptHandleIsInvalid"), "{err}");
        assert_eq!(
            q.counts(&url).unwrap().in_flight,
            1,
            "the new receive's hold stands"
        );
        q.delete(&url, old)
            .await
            .expect("an old handle's delete succeeds");
        assert_eq!(q.counts(&url).unwrap().stale_deletes, 1);
        q.delete(&url, second[0].receipt_handle().unwrap())
            .await
            .unwrap();
        assert_eq!(q.counts(&url).unwrap().stored(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn messages_past_retention_are_dropped() {
        let mut settings = QueueSettings::new("ret");
        settings.retention = Duration::from_secs(60);
        let (q, url) = service(settings);
        q.send(&url, plain("old")).await.unwrap();
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(q.receive(&url, req(30)).await.unwrap().is_empty());
        assert_eq!(q.counts(&url).unwrap().expired, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_deduplication_id_is_free_again_after_five_minutes() {
        let (q, url) = service(QueueSettings::new("dd.fifo"));
        let m = OutgoingMessage {
            group_id: Some("g".into()),
            deduplication_id: Some("d".into()),
            ..plain("m")
        };
        let first = q
            .send_with(&url, m.clone(), SendOptions::default())
            .unwrap();
        let again = q
            .send_with(&url, m.clone(), SendOptions::default())
            .unwrap();
        assert_eq!(
            again,
            Sent {
                message_id: first.message_id.clone(),
                deduplicated: true
            }
        );
        tokio::time::advance(SQS_DEDUP_WINDOW).await;
        let later = q.send_with(&url, m, SendOptions::default()).unwrap();
        assert!(!later.deduplicated);
        assert_eq!(q.counts(&url).unwrap().visible, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn ids_and_receipt_handles_are_counters() {
        let (q, url) = service(QueueSettings::new("ids"));
        q.send(&url, plain("a")).await.unwrap();
        let got = q.receive(&url, req(30)).await.unwrap();
        assert_eq!(got[0].id(), "msg-00000001");
        assert_eq!(got[0].receipt_handle(), Some("rh-1-1"));
    }

    /// Settings whose draws always answer `x` (0.0: every rate above zero hits).
    fn might(name: &str, x: f64, set: impl FnOnce(&mut Might)) -> QueueSettings {
        let mut settings = QueueSettings::new(name);
        settings.might.draw = Some(Arc::new(Mutex::new(move || x)));
        set(&mut settings.might);
        settings
    }

    #[tokio::test(start_paused = true)]
    async fn a_receive_may_return_one_message_twice_with_two_valid_handles() {
        let (q, url) = service(might("twice", 0.0, |m| m.twice = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        let got = q.receive(&url, req(30)).await.unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].id(), got[1].id());
        let (first, second) = (
            got[0].receipt_handle().unwrap(),
            got[1].receipt_handle().unwrap(),
        );
        assert_ne!(first, second);
        assert_eq!(q.twin_receipts(&url), BTreeSet::from([second.to_owned()]));
        q.change_visibility(&url, first, Duration::from_secs(60))
            .await
            .expect("the first handle is still valid");
        q.delete(&url, first).await.unwrap();
        assert_eq!(
            q.counts(&url).unwrap().stored(),
            0,
            "the first handle deletes"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_in_flight_may_be_delivered_again_while_its_handle_stays_valid() {
        let (q, url) = service(might("held", 0.0, |m| m.twice = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        let one = ReceiveRequest { max: 1, ..req(30) };
        let first = q.receive(&url, one).await.unwrap();
        let again = q.receive(&url, one).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].id(), first[0].id());
        assert_eq!(again[0].receive_count(), 2);
        q.change_visibility(
            &url,
            first[0].receipt_handle().unwrap(),
            Duration::from_secs(5),
        )
        .await
        .expect("the first holder's handle is still valid");
        assert_eq!(q.counts(&url).unwrap().twice, 1);
    }

    /// A twin delivery is a receive: none is made past the redrive
    /// policy's `maxReceiveCount` (SQS moves the message rather than
    /// deliver it past that count).
    #[tokio::test(start_paused = true)]
    async fn no_twin_delivery_goes_past_the_max_receive_count() {
        let q = MemoryQueue::new();
        let dlq = q.create_queue(QueueSettings::new("twin-dlq")).unwrap();
        let mut settings = might("twin-max", 0.0, |m| m.twice = 1.0);
        settings.redrive = Some(RedrivePolicy {
            dlq_url: dlq,
            max_receive_count: 2,
        });
        let url = q.create_queue(settings).unwrap();
        q.send(&url, plain("m")).await.unwrap();
        let one = ReceiveRequest { max: 1, ..req(30) };
        // Receive 1, then its twin, receive 2: the count is spent.
        assert_eq!(q.receive(&url, one).await.unwrap()[0].receive_count(), 1);
        assert_eq!(q.receive(&url, one).await.unwrap()[0].receive_count(), 2);
        assert!(q.receive(&url, one).await.unwrap().is_empty());
        // Two at once from one receive: the twin would be receive 2.
        q.send(&url, plain("n")).await.unwrap();
        let both = q.receive(&url, req(30)).await.unwrap();
        assert_eq!(both.len(), 2, "receive 1 and its twin");
        assert!(q.receive(&url, req(30)).await.unwrap().is_empty());
        assert_eq!(q.counts(&url).unwrap().twice, 2);
    }

    /// The move to a DLQ as the SQS Developer Guide gives it: a standard
    /// queue's message keeps its enqueue time (the DLQ's retention counts
    /// from the first send), a FIFO queue's starts again at the move and its
    /// deduplication id becomes its message id.
    #[tokio::test(start_paused = true)]
    async fn a_move_to_a_fifo_dlq_starts_its_retention_again_and_replaces_its_deduplication_id() {
        for fifo in [false, true] {
            let q = MemoryQueue::new();
            let suffix = if fifo { ".fifo" } else { "" };
            let mut dlq_settings = QueueSettings::new(format!("moved-dlq{suffix}"));
            dlq_settings.retention = Duration::from_secs(120);
            let dlq = q.create_queue(dlq_settings).unwrap();
            let mut settings = QueueSettings::new(format!("moved{suffix}"));
            settings.redrive = Some(RedrivePolicy {
                dlq_url: dlq.clone(),
                max_receive_count: 1,
            });
            let url = q.create_queue(settings).unwrap();
            let m = OutgoingMessage {
                group_id: fifo.then(|| "g".to_owned()),
                deduplication_id: fifo.then(|| "producer-dedup".to_owned()),
                ..plain("m")
            };
            q.send(&url, m).await.unwrap();
            let got = q.receive(&url, req(30)).await.unwrap();
            let id = got[0].id().to_owned();
            // Its visibility runs out at 30 s; the receive at 100 s moves it.
            tokio::time::advance(Duration::from_secs(100)).await;
            assert!(q.receive(&url, req(30)).await.unwrap().is_empty());
            // 160 s after the send, 60 s after the move.
            tokio::time::advance(Duration::from_secs(60)).await;
            let moved = q.receive(&dlq, req(30)).await.unwrap();
            if fifo {
                assert_eq!(
                    moved.len(),
                    1,
                    "a FIFO message's retention starts at the move"
                );
                assert_eq!(moved[0].id(), id);
                assert_eq!(moved[0].deduplication_id(), Some(id.as_str()));
                // In the DLQ's deduplication window: a park of the same
                // delivery (its id as deduplication id) is dropped.
                let park = OutgoingMessage {
                    group_id: Some("g".to_owned()),
                    deduplication_id: Some(id.clone()),
                    ..plain("parked copy")
                };
                q.send(&dlq, park).await.unwrap();
                assert_eq!(q.counts(&dlq).unwrap().deduplicated, 1);
            } else {
                assert!(
                    moved.is_empty(),
                    "kept past its first send's retention: {moved:?}"
                );
                assert_eq!(q.counts(&dlq).unwrap().expired, 1);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_deleted_message_may_come_back_once() {
        let (q, url) = service(might("back", 0.0, |m| m.again_after_delete = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        let got = q.receive(&url, req(30)).await.unwrap();
        q.delete(&url, got[0].receipt_handle().unwrap())
            .await
            .unwrap();
        assert!(
            q.receive(&url, req(30)).await.unwrap().is_empty(),
            "not at once"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        let back = q.receive(&url, req(30)).await.unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].id(), got[0].id());
        assert_ne!(back[0].receipt_handle(), got[0].receipt_handle());
        q.delete(&url, back[0].receipt_handle().unwrap())
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(300)).await;
        let counts = q.counts(&url).unwrap();
        assert_eq!(
            (counts.stored(), counts.again_after_delete),
            (0, 1),
            "once only"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_receive_may_return_fewer_than_are_visible() {
        let (q, url) = service(might("fewer", 0.0, |m| m.fewer = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        assert!(q.receive(&url, req(30)).await.unwrap().is_empty());
        assert_eq!(q.counts(&url).unwrap().visible, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_receive_may_return_messages_out_of_send_order() {
        let (q, url) = service(might("order", 0.0, |m| m.unordered = 1.0));
        for body in ["a", "b", "c"] {
            q.send(&url, plain(body)).await.unwrap();
        }
        let got = q.receive(&url, req(30)).await.unwrap();
        let bodies: Vec<&str> = got.iter().map(|m| m.body()).collect();
        assert_eq!(bodies, ["b", "c", "a"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_delete_with_an_old_handle_may_delete() {
        let (q, url) = service(might("old2", 0.0, |m| m.old_handle_deletes = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        let first = q.receive(&url, req(1)).await.unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        q.receive(&url, req(30)).await.unwrap();
        q.delete(&url, first[0].receipt_handle().unwrap())
            .await
            .unwrap();
        let counts = q.counts(&url).unwrap();
        assert_eq!((counts.stored(), counts.old_handle_deletes), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_fifo_delete_after_the_visibility_ran_out_may_be_refused() {
        for refused in [false, true] {
            let name = format!("exp{refused}.fifo");
            let (q, url) = service(might(&name, 0.0, |m| m.expired_fifo_handles = refused));
            let m = OutgoingMessage {
                group_id: Some("g".into()),
                deduplication_id: Some("d".into()),
                ..plain("m")
            };
            q.send(&url, m).await.unwrap();
            let got = q.receive(&url, req(1)).await.unwrap();
            tokio::time::advance(Duration::from_secs(2)).await;
            let out = q.delete(&url, got[0].receipt_handle().unwrap()).await;
            match refused {
                true => assert!(
                    out.unwrap_err()
                        .detail
                        .starts_with("ReceiptHandleIsInvalid")
                ),
                false => out.expect("deleted: no one received it since"),
            }
            assert_eq!(q.counts(&url).unwrap().stored(), usize::from(refused));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn batch_entries_may_fail_while_the_call_succeeds() {
        let (q, url) = service(might("entries", 0.0, |m| m.entry_errors = 1.0));
        q.send(&url, plain("m")).await.unwrap();
        let got = q.receive(&url, req(30)).await.unwrap();
        let receipts = vec![got[0].receipt_handle().unwrap().to_owned()];
        let failed = q
            .change_visibility_batch(&url, &receipts, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(failed[0].code, "InternalError");
        let failed = q.delete_batch(&url, &receipts).await.unwrap();
        assert_eq!((failed.len(), failed[0].index), (1, 0));
        let counts = q.counts(&url).unwrap();
        assert_eq!(
            (counts.in_flight, counts.entry_errors),
            (1, 2),
            "nothing applied"
        );
    }
}
