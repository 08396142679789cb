//! What became of every delivery a consumer saw: when it arrived, from which
//! queue, how long its consumer held it, whether a delete of it was sent in
//! time and whether any reached SQS, and whether its consumer died holding it.
//!
//! The checker needs this for one case. A message whose effect is recorded
//! (its dedup record is `COMPLETED`) may still be moved to the DLQ by SQS's
//! redrive policy when its last allowed delivery could not be deleted: the
//! consumer sent the delete and SQS stayed out of its reach until the
//! visibility timeout ran out, or the consumer died holding it. No consumer
//! can do better there (the delete is the only thing that keeps a message
//! from its next receive), and a copy brought back completes as a duplicate.
//! Any other way for a completed message to reach the DLQ is a violation: a
//! delivery known done and never deleted, a delete sent after the message was
//! visible again or to another queue, a delete that reached SQS and deleted
//! nothing, or one given up on while SQS could have been reached again before
//! the visibility ran out. See docs/DESIGN.md, "What ends in the DLQ".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::faults::{Cuts, Life};

/// One delivery: a receive of one message that reached a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Its receipt handle.
    pub receipt: String,
    /// The SQS message id.
    pub message: String,
    /// The queue it was received from.
    pub queue: String,
    /// Its receive count at this delivery.
    pub count: u32,
    /// The consumer (or event source mapping) that received it.
    pub consumer: String,
    /// When SQS delivered it: issued its receipt handle, where the service
    /// notes that (the wire path's model: a slow or retried answer reaches
    /// the consumer later), else when it reached the consumer.
    pub at: Instant,
    /// When it reached its consumer (a slow answer after `at`).
    pub arrived: Instant,
    /// Until when it stays invisible, as far as SQS is concerned (the
    /// receive's visibility, then every visibility change SQS applied).
    pub held_until: Instant,
    /// When a delete of it was first sent to its queue while it was held.
    pub delete_sent: Option<Instant>,
    /// When the link to SQS of the host that sent that first delete was
    /// cut (the host's own for a Lambda record's direct delete, not the
    /// event source mapping's), where the sender said.
    first_sender_cuts: Option<Cuts>,
    /// A delete of it reached SQS (and was answered there, lost or not).
    pub delete_reached: bool,
    /// When a delete of it first reached SQS.
    pub delete_reached_at: Option<Instant>,
    /// When the message became visible again by a visibility change that
    /// another host made through a receipt of its own while this delivery
    /// held it, or any host made before this delivery's answer reached its
    /// host (a twin delivery, SQS's "might": SQS keeps one visibility per
    /// message, so the last change through any valid receipt holds, until
    /// the message is visible: the first change that made it so stands,
    /// whatever later deliveries set); `None` once a change by this host
    /// came after it. With the receipt the change went through.
    pub visible_by_another: Option<(Instant, String)>,
    /// The object key its body points to, if sent through S3.
    pub payload: Option<String>,
    /// When the message became visible again because SQS handed it out
    /// again while this delivery held it (a twin) with a shorter
    /// visibility, through a receive whose answer may never have reached a
    /// consumer: (when, that receipt). Cleared by a later visibility change
    /// of the message and by a receive of it on this delivery's host. The
    /// checker counts it only where that receipt reached no consumer
    /// ([`crate::check::stranded`]; seed 235811).
    pub unheard_take: Option<(Instant, String)>,
    /// Each delete call made with its receipt: when it was sent and when
    /// its answer (or failure) came back to the consumer (`None`: never,
    /// in flight when the run ended).
    tries: Vec<(Instant, Option<Instant>)>,
    /// The life of the host that holds it.
    life: Life,
    /// When its Lambda invocation timed out: the event source mapping
    /// gave its records up, and deletes none of them (for them, as if
    /// their holder died then).
    given_up_at: Option<Instant>,
    /// When the host's link to SQS was cut.
    cuts: Cuts,
}

/// How long before a cut a delivery may have learned its message done and
/// still be excused by it ([`Delivery::overtaken_by`]): the poller's delete
/// batcher waits up to a second before it sends.
const LEARNED_BEFORE_CUT: Duration = Duration::from_secs(1);

impl Delivery {
    /// When a delete call with its receipt was first sent (held or not).
    pub fn first_delete_try(&self) -> Option<Instant> {
        self.tries.iter().map(|&(sent, _)| sent).min()
    }

    /// Its consumer died while holding it.
    pub fn holder_died(&self) -> bool {
        self.life
            .died_at()
            .or(self.given_up_at)
            .is_some_and(|t| t >= self.at && t < self.held_until)
    }

    /// Another host's receipt made its message visible again while this
    /// delivery held it, and its delete was sent only after that, or a
    /// delete call of it sent before that was still on its way when one
    /// first reached SQS, after that and while the delivery held the
    /// message (a slow call; seed 271312: sent 0.45 s before, it reached
    /// SQS 1.55 s after; a consumer whose earlier call came back and that
    /// tried again only later is not excused by it): the next receive may
    /// move the message (on its last allowed receive, to the DLQ) before
    /// the delete comes. Answers the receipt the change went through; the
    /// checker ([`crate::check::stranded`]) still asks whether that receipt
    /// was this one's twin and whether its delivery knew the message done.
    pub fn overtaken_by(&self, calm_at: Option<Instant>, learned: Option<Instant>) -> Option<&str> {
        // Or it learned the message done (`learned`) while its host was cut
        // off from SQS, and its first delete was sent before that instant
        // by that host, cut off from then until that instant, none reaching
        // SQS before it (a host that knew it done before the cut began had
        // time to delete it)
        // (seed 882949: a Lambda record's direct delete, its host cut off
        // from SQS, while a poller's retry delay through its twin's receipt
        // made the message visible 1.9 s later; the event source mapping's
        // delete came only at the invocation's end, naming nothing then).
        let cut_through = |t: Instant| {
            self.delete_sent.is_some_and(|s| {
                s < t
                    && self.delete_reached_at.is_none_or(|r| r >= t)
                    && self.first_sender_cuts.as_ref().is_some_and(|c| {
                        c.within(s, t, calm_at).into_iter().any(|(from, until)| {
                            from <= s
                                && until >= t
                                && learned.is_some_and(|l| l + LEARNED_BEFORE_CUT >= from)
                        })
                    })
            })
        };
        let slow_call = |t: Instant| {
            self.delete_reached_at.is_some_and(|r| {
                t <= r
                    && r < self.held_until
                    && self
                        .tries
                        .iter()
                        .any(|&(sent, back)| sent < t && back.is_none_or(|b| b >= r))
            })
        };
        self.visible_by_another
            .as_ref()
            .filter(|(t, _)| {
                *t < self.held_until
                    && (self.delete_sent.is_some_and(|s| s >= *t || slow_call(*t))
                        || cut_through(*t))
            })
            .map(|(_, by)| by.as_str())
    }

    /// Its consumer did all it could to delete it: it died holding it, or it
    /// sent the delete while holding it, no delete reached SQS before the
    /// visibility ran out, and SQS was out of its reach at some point of the
    /// visibility's last [`CONNECT_TIMEOUT`] while a delete call of it was
    /// on its way (then, not only earlier in the same cut): a try started in that cut fails only after the
    /// visibility's end, so trying again could not have landed it (seed
    /// 204589: the cut ended 0.26 s before the end); or it was pausing
    /// between two tries across the end, SQS out of its reach from the
    /// last failure until the end (seed 307323). A consumer that had
    /// given up before that cut began is not excused by it.
    ///
    /// [`CONNECT_TIMEOUT`]: crate::faults::CONNECT_TIMEOUT
    pub fn delete_was_out_of_reach(&self, calm_at: Option<Instant>) -> bool {
        self.holder_died() || self.delete_out_of_reach_until(self.held_until, calm_at)
    }

    /// It sent the delete while it held the message, none reached SQS
    /// before `end`, and a delete call of it was on its way while SQS was
    /// out of its reach within the connect timeout before `end` (see
    /// [`Delivery::delete_was_out_of_reach`]).
    pub fn delete_out_of_reach_until(&self, end: Instant, calm_at: Option<Instant>) -> bool {
        let last_try = end - crate::faults::CONNECT_TIMEOUT;
        let cut_at_end =
            self.cuts
                .within(last_try, end, calm_at)
                .into_iter()
                .any(|(from, until)| {
                    // The cut's part within the last connect timeout.
                    let (from, until) = (from.max(last_try), until.min(end));
                    self.tries
                        .iter()
                        .any(|&(sent, back)| sent < until && back.is_none_or(|b| b > from))
                });
        // Or it paused between two tries across `end` while SQS stayed out
        // of reach from its last try's failure until `end`: every try it
        // could have started in that pause would have failed too. It went
        // on trying after `end` (one that had given up is not excused;
        // seed 307323: a poller's 4 s pause toward the latest end it knew
        // of stepped over the end SQS had, inside a 62 s cut).
        let last_back = self
            .tries
            .iter()
            .filter_map(|&(sent, back)| back.filter(|&b| sent < end && b <= end))
            .max();
        let tried_after = self.tries.iter().any(|&(sent, _)| sent >= end);
        let cut_across_pause = tried_after
            && last_back.is_some_and(|b| {
                self.cuts
                    .within(b, end, calm_at)
                    .into_iter()
                    .any(|(from, until)| from <= b && until >= end)
            });
        // A delete that reached SQS only after the visibility ran out (the
        // model answers one for a message already moved as done) kept
        // nothing out (wire seed 5002236).
        let reached_in_time = self.delete_reached_at.is_some_and(|t| t < end);
        self.delete_sent.is_some() && !reached_in_time && (cut_at_end || cut_across_pause)
    }
}

/// Every delivery of a run, by receipt handle. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Deliveries {
    all: Arc<Mutex<BTreeMap<String, Delivery>>>,
    calm_at: Arc<Mutex<Option<Instant>>>,
    /// When SQS issued each receipt handle, where the service notes it (the
    /// wire path's model): an answer may reach its consumer later.
    issued: Arc<Mutex<BTreeMap<String, Instant>>>,
    /// Every visibility change SQS applied, in order, by (queue, message):
    /// for a delivery whose answer reaches its host after its receipt was
    /// issued ([`Deliveries::received`]).
    changes: Arc<Mutex<ChangeLog>>,
    /// Until when each message (by queue and id) is invisible as far as the
    /// takes and visibility changes SQS applied say: a take before then
    /// hands out a message still in flight (a twin).
    invisible: Arc<Mutex<BTreeMap<(String, String), Instant>>>,
}

/// Visibility changes SQS applied, in order, by (queue, message id).
type ChangeLog = BTreeMap<(String, String), Vec<Change>>;

/// A visibility change SQS applied, or a take (a receive SQS applied, which
/// sets the message's one visibility too).
#[derive(Debug, Clone)]
struct Change {
    applied: Instant,
    receipt: String,
    until: Instant,
    take: bool,
}

/// What the changes SQS applied to a message while a receipt's answer was on
/// its way (after `issued`, before `arrived`) left of its hold to
/// `held_until`: the first change through another receipt that set it
/// visible before then, unless a later one in that time held it again
/// before it took effect. A take through another receipt in that time (a
/// twin: the message was still in flight) sets the one visibility anew, so
/// it undoes an exposure not yet in effect; what the twin's own visibility
/// makes of this delivery is not an exposure by a change and is not
/// counted here. Replayed in order; `(until, receipt)`.
fn exposed_on_the_way(
    changes: &[Change],
    receipt: &str,
    issued: Instant,
    arrived: Instant,
    held_until: Instant,
) -> Option<(Instant, String)> {
    let mut exposed: Option<(Instant, String)> = None;
    for c in changes
        .iter()
        .filter(|c| c.receipt != receipt && issued < c.applied && c.applied < arrived)
    {
        match &exposed {
            // Already visible when this change came: it stands.
            Some((at, _)) if *at <= c.applied => break,
            _ if c.take => exposed = None,
            _ if c.until < held_until => exposed = Some((c.until, c.receipt.clone())),
            _ => exposed = None,
        }
    }
    exposed
}

impl Deliveries {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<String, Delivery>) -> T) -> T {
        f(&mut self.all.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Faults were switched off now (cuts end).
    pub fn calm(&self) {
        *self.calm_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// When faults were switched off.
    pub fn calm_at(&self) -> Option<Instant> {
        *self.calm_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SQS issued these receipt handles now (a receive applied; its answer
    /// may come later, or never).
    pub fn issued(&self, receipts: &[String]) {
        let now = Instant::now();
        let mut issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        for r in receipts {
            issued.insert(r.clone(), now);
        }
    }

    /// A receive's answer from `queue` reached `consumer` (whose host lives
    /// `life`, cut off from SQS at `cuts`); each message was delivered, and
    /// stays invisible `visibility` from, when SQS issued its receipt handle
    /// (where noted), else now.
    pub fn received(
        &self,
        who: (&str, &Life, &Cuts),
        queue: &str,
        messages: &[sqs_once::Message],
        visibility: Duration,
    ) {
        let (consumer, life, cuts) = who;
        let now = Instant::now();
        let issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        let changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let mut invisible = self.invisible.lock().unwrap_or_else(|e| e.into_inner());
        self.with(|all| {
            for m in messages {
                let Some(receipt) = m.receipt_handle() else {
                    continue;
                };
                let noted = issued.get(receipt).copied();
                let at = noted.unwrap_or(now);
                let held_until = at + visibility;
                // Where no take was noted (a caller that notes only what
                // reached a consumer), this receive is the take.
                invisible
                    .entry((queue.to_owned(), m.id().to_owned()))
                    .or_insert(held_until);
                // A change SQS applied through another receipt of the
                // message after this receipt was issued and before its
                // answer arrived: no host knew of this delivery then, its
                // own included (seed 213871: its host's retry delay of the
                // earlier delivery, whose first try failed, landed on a
                // retry before the twin's slow answer came). Only where the
                // service noted the issue (the wire path), and strictly
                // between the two instants.
                let exposed = noted.and_then(|issued| {
                    let key = (queue.to_owned(), m.id().to_owned());
                    let log = changes.get(&key)?;
                    exposed_on_the_way(log, receipt, issued, now, held_until)
                });
                // A delivery of the message to the same host: that host now
                // knows of the newer receipt (its runtime's to mind), so an
                // earlier exposure by another host no longer explains what
                // becomes of the message.
                for o in all
                    .values_mut()
                    .filter(|o| o.message == m.id() && o.queue == queue && o.life.same_host(life))
                {
                    o.visible_by_another = None;
                    o.unheard_take = None;
                }
                all.insert(
                    receipt.to_owned(),
                    Delivery {
                        receipt: receipt.to_owned(),
                        message: m.id().to_owned(),
                        queue: queue.to_owned(),
                        count: m.receive_count(),
                        consumer: consumer.to_owned(),
                        at,
                        arrived: now,
                        held_until,
                        delete_sent: None,
                        first_sender_cuts: None,
                        delete_reached: false,
                        delete_reached_at: None,
                        visible_by_another: exposed,
                        tries: Vec::new(),
                        unheard_take: None,
                        payload: sqs_once::payloads::S3Pointer::of(m)
                            .and_then(Result::ok)
                            .map(|p| p.key),
                        life: life.clone(),
                        given_up_at: None,
                        cuts: cuts.clone(),
                    },
                );
            }
        });
    }

    /// SQS took these messages from `queue` now for a receive (its answer
    /// may come later, or never), each invisible for `visibility`. SQS keeps
    /// one visibility per message: a delivery of one still held (so this is
    /// a twin) is visible again at the take's end if that comes first.
    pub fn taken(&self, queue: &str, messages: &[sqs_once::Message], visibility: Duration) {
        let now = Instant::now();
        let until = now + visibility;
        let mut changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let mut invisible = self.invisible.lock().unwrap_or_else(|e| e.into_inner());
        self.with(|all| {
            for m in messages {
                let Some(receipt) = m.receipt_handle() else {
                    continue;
                };
                let key = (queue.to_owned(), m.id().to_owned());
                // Handed out while still in flight: a twin. Otherwise the
                // message was visible (its visibility ran out, or a change
                // made it so): earlier receipts no longer hold it, and what
                // made it visible is judged elsewhere.
                let twin = invisible.get(&key).is_some_and(|t| now < *t);
                invisible.insert(key.clone(), until);
                // Logged for a delivery whose answer is still on its way
                // (`exposed_on_the_way`).
                changes.entry(key).or_default().push(Change {
                    applied: now,
                    receipt: receipt.to_owned(),
                    until,
                    take: true,
                });
                if !twin {
                    continue;
                }
                for o in all.values_mut().filter(|o| {
                    o.message == m.id()
                        && o.queue == queue
                        && o.receipt != receipt
                        && o.at <= now
                        && now < o.held_until
                }) {
                    // One that has made the message visible already stands;
                    // one not yet in effect gives way to this take, which
                    // now sets when the message is visible (so does a
                    // change's exposure not yet in effect).
                    if o.unheard_take.as_ref().is_none_or(|(t, _)| *t > now) {
                        o.unheard_take =
                            (until < o.held_until).then(|| (until, receipt.to_owned()));
                    }
                    if o.visible_by_another.as_ref().is_some_and(|(t, _)| *t > now) {
                        o.visible_by_another = None;
                    }
                }
            }
        });
    }

    /// A delete of these receipts was sent to `queue` (whatever became of it).
    pub fn delete_sent(&self, queue: &str, receipts: &[String]) {
        self.note_delete(queue, receipts, None);
    }

    /// [`Deliveries::delete_sent`] by a host whose link to SQS was cut at
    /// `cuts`.
    pub fn delete_sent_by(&self, queue: &str, receipts: &[String], cuts: &Cuts) {
        self.note_delete(queue, receipts, Some(cuts));
    }

    fn note_delete(&self, queue: &str, receipts: &[String], sender: Option<&Cuts>) {
        let now = Instant::now();
        self.with(|all| {
            for r in receipts {
                let Some(d) = all.get_mut(r).filter(|d| d.queue == queue) else {
                    continue;
                };
                d.tries.push((now, None));
                if d.delete_sent.is_none() && now < d.held_until {
                    d.delete_sent = Some(now);
                    d.first_sender_cuts = sender.cloned();
                }
            }
        });
    }

    /// The Lambda invocation holding these receipts of `queue` timed out
    /// now: the event source mapping deletes none of them (campaign seed
    /// 1044268: an invocation paused across its deadline had completed a
    /// record; its later deliveries, cut off from DynamoDB, could not learn
    /// it done before its receives ran out).
    pub fn given_up(&self, queue: &str, receipts: &[String]) {
        let now = Instant::now();
        self.with(|all| {
            for r in receipts {
                if let Some(d) = all.get_mut(r).filter(|d| d.queue == queue) {
                    d.given_up_at.get_or_insert(now);
                }
            }
        });
    }

    /// A delete call of these receipts returned to its consumer (done or
    /// failed).
    pub fn delete_returned(&self, queue: &str, receipts: &[String]) {
        let now = Instant::now();
        self.with(|all| {
            for r in receipts {
                let Some(d) = all.get_mut(r).filter(|d| d.queue == queue) else {
                    continue;
                };
                if let Some(t) = d.tries.iter_mut().rev().find(|t| t.1.is_none()) {
                    t.1 = Some(now);
                }
            }
        });
    }

    /// A delete of these receipts reached SQS (its answer may still be lost).
    pub fn delete_reached(&self, queue: &str, receipts: &[String]) {
        self.with(|all| {
            for r in receipts {
                if let Some(d) = all.get_mut(r)
                    && d.queue == queue
                {
                    d.delete_reached = true;
                    d.delete_reached_at.get_or_insert_with(Instant::now);
                }
            }
        });
    }

    /// SQS applied a visibility change of these receipts to `timeout` (its
    /// answer may still be lost). SQS keeps one visibility per message, so
    /// the change holds for every delivery of the message still held: one
    /// another host holds (a twin delivery) notes when it became visible
    /// by another's hand ([`Delivery::visible_by_another`]).
    pub fn visibility_set(&self, receipts: &[String], timeout: Duration) {
        let now = Instant::now();
        let until = now + timeout;
        let mut changes = self.changes.lock().unwrap_or_else(|e| e.into_inner());
        let mut invisible = self.invisible.lock().unwrap_or_else(|e| e.into_inner());
        self.with(|all| {
            for r in receipts {
                let Some(d) = all.get_mut(r) else {
                    continue;
                };
                invisible.insert((d.queue.clone(), d.message.clone()), until);
                changes
                    .entry((d.queue.clone(), d.message.clone()))
                    .or_default()
                    .push(Change {
                        applied: now,
                        receipt: r.clone(),
                        until,
                        take: false,
                    });
                d.held_until = until;
                d.visible_by_another = None;
                d.unheard_take = None;
                let (message, queue, life) = (d.message.clone(), d.queue.clone(), d.life.clone());
                for o in all.values_mut().filter(|o| {
                    o.receipt != *r
                        && o.message == message
                        && o.queue == queue
                        && o.at <= now
                        && now < o.held_until
                }) {
                    // This change, not an earlier take not yet in effect,
                    // now sets when the message is visible.
                    if o.unheard_take.as_ref().is_some_and(|(t, _)| *t > now) {
                        o.unheard_take = None;
                    }
                    if o.life.same_host(&life) {
                        o.visible_by_another = None;
                    } else if o
                        .visible_by_another
                        .as_ref()
                        .is_none_or(|(exposed, _)| *exposed > now)
                    {
                        // An earlier change that has already made the
                        // message visible stands: from then on any receive
                        // may take it, and what later deliveries set
                        // follows from that one.
                        o.visible_by_another = Some((until, r.clone()));
                    }
                }
            }
        });
    }

    /// Whether some delivery whose body points to the object `key` is
    /// finished with (`done` says so of its message id and receive count:
    /// completed or a duplicate, not parked or sent again) and a delete of
    /// it has reached SQS (its message was deleted, or SQS said so).
    pub fn payload_released(&self, key: &str, done: impl Fn(&str, u32) -> bool) -> bool {
        self.with(|all| {
            all.values().any(|d| {
                d.delete_reached && d.payload.as_deref() == Some(key) && done(&d.message, d.count)
            })
        })
    }

    /// Every delivery of `message` that reached a consumer, in arrival order.
    pub fn all_of(&self, message: &str) -> Vec<Delivery> {
        let mut found: Vec<Delivery> = self.with(|all| {
            all.values()
                .filter(|d| d.message == message)
                .cloned()
                .collect()
        });
        found.sort_by_key(|d| d.at);
        found
    }

    /// Every delivery that reached a consumer, by receipt handle.
    pub fn every(&self) -> Vec<Delivery> {
        self.with(|all| all.values().cloned().collect())
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
