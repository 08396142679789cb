//! The checker: after a run, from the history (staged writes in commit order,
//! the API's calls) and the final state (dedup records, queues), every way the
//! promise can be broken.
//!
//! Effects are attributed to the SQS message whose delivery made them (a
//! producer's late duplicate is a message of its own, sent later), so FIFO
//! order is the order in which a group's messages were sent, and "applied and
//! in the DLQ" is about one message.

use std::collections::{BTreeMap, BTreeSet};

use sqs_once::Status;
use sqs_once::parking::{MESSAGE_ID_ATTRIBUTE, REASON_ATTRIBUTE};
use sqs_once::testkit::queue::StoredMessage;

use crate::deliveries::{Deliveries, Delivery};
use crate::hosts::HostReport;
use crate::trace::{Subject, Trouble};
use crate::world::{ApiCall, Kind, Scenario};

/// One effect made: the event, and the message whose delivery made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// The event (dedup key).
    pub event: String,
    /// The SQS message id.
    pub message: String,
    /// When it was made, ms from the run's start: a ledger row's commit, an
    /// API call's start.
    pub at_ms: u128,
    /// The consumer whose handler made it (empty where not known).
    pub by: String,
}

/// A chained run's second stage.
pub struct SecondStage {
    /// Every message the outbox sent, before the second stage ran.
    pub sent: Vec<StoredMessage>,
    /// What its consumer applied, per event.
    pub applied: BTreeMap<String, u32>,
    /// Messages it left in its queue.
    pub left: usize,
}

/// What the checker reads.
pub struct Evidence<'a> {
    /// The run's scenario.
    pub scenario: &'a Scenario,
    /// Events some send of which was accepted.
    pub accepted: &'a BTreeSet<String>,
    /// Ledger rows in commit order (staged handler).
    pub rows: Vec<Effect>,
    /// Every API call (external handler).
    pub calls: Vec<ApiCall>,
    /// Times charged, by event.
    pub charged: BTreeMap<String, u32>,
    /// Dedup records: event -> status.
    pub records: BTreeMap<String, Status>,
    /// Dedup records when the run first settled, before the redrive.
    pub records_before: BTreeMap<String, Status>,
    /// The messages whose deliveries completed a record, by the time the run
    /// first settled (the record names the message that claimed or committed it).
    pub completed_by: BTreeSet<String>,
    /// The messages some delivery of which ended `completed` or `duplicate`:
    /// a consumer learned that the effect was recorded.
    pub confirmed: BTreeSet<String>,
    /// Records left `IN_PROGRESS`, by event.
    pub unfinished: BTreeMap<String, Unfinished>,
    /// The DLQ's messages when the run first settled, before the redrive.
    pub dlq_before: Vec<StoredMessage>,
    /// The DLQ's messages at the end, after the redrive and a second settle.
    pub dlq: Vec<StoredMessage>,
    /// What is left in the source queue.
    pub left: Vec<StoredMessage>,
    /// The hosts' reports.
    pub hosts: &'a [HostReport],
    /// Every delivery and what became of it.
    pub deliveries: &'a Deliveries,
    /// Guarded writes the store applied for an owner that no longer held
    /// the record (read from the store's history).
    pub fencing_breaches: Vec<String>,
    /// Record writes whose `expires_at` was not the writer's clock plus the
    /// configured TTL, and TTL ends of such records (read from the store:
    /// [`crate::stores::Backend::expect_ttl`]). TTL excuses an application
    /// after it only for a record that passed.
    pub ttl_breaches: Vec<String>,
    /// Each claim's lease end as stored (its claim and extensions, cut at
    /// its release): (event, attempt) -> ms from the start. `None` where the
    /// store keeps no such history (the wire path: see
    /// `stores::Backend::lease_ends`).
    pub lease_ends: Option<BTreeMap<(String, u32), u128>>,
    /// Fast-path handlers started for a redelivery whose record said
    /// `COMPLETED`: (message, receive count, consumer, event, when the
    /// record was completed, when the handler started; ms from the start).
    pub reruns: Vec<(String, u32, String, String, u128, u128)>,
    /// Record reads that failed: (consumer, record key, ms from the start).
    pub failed_reads: Vec<(String, String, u128)>,
    /// When each delivery's outcome came, and which: (message, receive
    /// count) -> (ms, outcome).
    pub outcome_at: BTreeMap<(String, u32), (u128, String)>,
    /// What went wrong during the run, and when.
    pub trouble: crate::trace::Trouble,
    /// Receipt handles the model issued while another handle of the message
    /// was valid: concurrent duplicate deliveries.
    pub twins: BTreeSet<String>,
    /// Receipt handles whose delete deleted a message SQS then brought back
    /// (its documented "might": a copy on a server the delete missed).
    pub back_after_delete: BTreeSet<String>,
    /// Process pauses of Lambda invocations
    /// ([`crate::world::Scenario::runs_on_after_timeout`]).
    pub pauses: Vec<Pause>,
    /// The messages each event was sent as.
    pub sent: BTreeMap<String, Vec<String>>,
    /// When the run started (API call times count from it).
    pub start: tokio::time::Instant,
    /// A chained run's second stage: every message the outbox sent (before
    /// the second stage consumed them), then what its consumer applied per
    /// event and how many messages it left.
    pub next: Option<SecondStage>,
    /// Sends made while their event's record was not `COMPLETED`.
    pub early_sends: Vec<String>,
    /// When TTL ended each event's `COMPLETED` record, ms from the run's
    /// start, in order (a claim or a fast-path commit after its
    /// `expires_at`, or DynamoDB's TTL deletion): each lets the first
    /// application after it, and before the next end, apply again.
    pub ended_by_ttl: BTreeMap<String, Vec<u128>>,
    /// When DynamoDB's TTL deleted a record of each event left
    /// `IN_PROGRESS` (a claim past its `expires_at`), ms from the run's
    /// start, in order: a later record starts its attempts again.
    pub unfinished_deleted_by_ttl: BTreeMap<String, Vec<u128>>,
    /// Each event's record at the end: the attempts it has seen (claims
    /// and fast-path commits; the last is the one that completed it).
    pub attempts: BTreeMap<String, u32>,
    /// The large-payload objects (keys) consumers deleted.
    pub objects_deleted: BTreeSet<String>,
    /// Events whose record a host may have taken for expired by the end of
    /// the run (its `expires_at`, less the most a host's clock runs ahead,
    /// reached), whether or not TTL deleted it yet.
    pub expired: BTreeSet<String>,
}

/// The event id in a body: its `id`, or for a pointer to a large payload
/// the event its object key names.
fn event_of(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    if let Some(key) = v
        .get(1)
        .and_then(|p| p.get("s3Key"))
        .and_then(|k| k.as_str())
    {
        return crate::world::event_of_payload_key(key).map(str::to_owned);
    }
    v.get("id")?.as_str().map(str::to_owned)
}

/// Whether a DLQ copy was parked because its large payload was missing.
fn parked_for_missing_payload(m: &StoredMessage) -> bool {
    m.attributes
        .get(REASON_ATTRIBUTE)
        .is_some_and(|a| match &a.value {
            sqs_once::AttributeValue::Text(t) => {
                t.contains("large payload") && t.contains("is missing")
            }
            sqs_once::AttributeValue::Binary(_) => false,
        })
}

/// Events parked (once or more) because their large payload was gone,
/// after their effect was recorded: a second copy of a message (SQS's twin
/// delivery or a delivery after a delete, a Lambda copy of a key held
/// elsewhere, a redrive of such a park) arrived after an earlier copy
/// finished and its object was deleted, and the key is read from the body,
/// which is gone with it (docs/DESIGN.md, "Large payloads": the documented
/// limit of payload deletion with body keys). Only in runs that delete
/// objects under a body-read key source, only for events whose record is
/// `COMPLETED` (their effect is checked exactly once like any other); every
/// object deleted before a delete of a message pointing to it reached SQS
/// is a violation of its own (`World::early_objects`). Counted, not
/// violations.
pub fn payload_gone(e: &Evidence<'_>) -> BTreeSet<String> {
    if !e.scenario.payloads.is_some_and(|p| p.delete) {
        return BTreeSet::new();
    }
    let body_key = e.scenario.key != crate::world::KeyPlace::Attribute;
    e.dlq_before
        .iter()
        .chain(&e.dlq)
        .filter(|m| parked_for_missing_payload(m))
        // Its object deleted by a consumer (after a finished message's
        // delete: the run's watch fails any other), not a pointer gone astray.
        .filter(|m| pointer_key(&m.body).is_some_and(|k| e.objects_deleted.contains(&k)))
        .filter_map(|m| event_of(&m.body))
        .filter(|event| e.records.get(event) == Some(&Status::Completed))
        // With a key taken without the body the record is found: only a
        // record past its TTL (the documented limit of "Parking"), deleted
        // yet or not, leaves such a copy to park (seed 133750).
        .filter(|event| body_key || e.ended_by_ttl.contains_key(event) || e.expired.contains(event))
        .collect()
}

/// The object key a pointer body names.
fn pointer_key(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get(1)?.get("s3Key")?.as_str().map(str::to_owned)
}

/// Every copy parked in the DLQ (before the redrive or at the end) still
/// points to its object at the end (docs/DESIGN.md, "Large payloads":
/// parked messages never lose their object, so a redrive can run them),
/// unless it was parked because the object was already gone. `exists` says
/// whether an object key is there.
pub fn parked_objects(e: &Evidence<'_>, exists: impl Fn(&str) -> bool) -> Vec<String> {
    e.dlq_before
        .iter()
        .chain(&e.dlq)
        .filter(|m| parked_with_reason(m) && !parked_for_missing_payload(m))
        .filter_map(|m| Some((m, pointer_key(&m.body)?)))
        .filter(|(_, key)| !exists(key))
        .map(|(m, key)| {
            format!(
                "{}: its parked copy {} points to the object {key}, which was deleted",
                event_of(&m.body).unwrap_or_default(),
                m.id
            )
        })
        .collect()
}

/// The counter in a message id (`msg-00000012`): its send order.
fn sent_order(message: &str) -> u64 {
    message
        .trim_start_matches("msg-")
        .parse()
        .unwrap_or(u64::MAX)
}

/// Events that SQS's redrive policy moved to the DLQ before their effect was
/// recorded (by the time the run first settled): their receives ran out under
/// faults (failures, bounces, FIFO records held behind a failed one). That is
/// the documented end of a message that keeps failing, and the operator's
/// answer is the redrive: every run brings its DLQ back, and such an event
/// must then be applied like any other. Reported, never excused.
pub fn exhausted(e: &Evidence<'_>) -> BTreeSet<String> {
    e.dlq_before
        .iter()
        .filter(|m| moved_by_sqs(m))
        .filter_map(|m| event_of(&m.body))
        .filter(|ev| e.records_before.get(ev) != Some(&Status::Completed))
        .collect()
}

/// Receives spent for nothing: deliveries of an event's message that ended
/// without finishing it (to come back, in flight elsewhere, or with no
/// outcome at all) and that nothing explains. A runtime may spend a receive
/// only on trouble (docs/DESIGN.md, "What ends in the DLQ"); one that spends
/// them otherwise drains messages into the DLQ, which the redrive would
/// then hide. Judged for every delivery of every event's message, not only
/// those the DLQ got ([`exhausted`]), whose lines say so. A delivery is
/// explained by
/// - its holder dying, or its invocation timing out or being paused, while
///   it held it;
/// - trouble on its host while it held it: a fault drawn for any of the
///   host's calls (over the call's wait, where it has one), a request of
///   the host landing late, a batch call whose entries failed alone, a
///   pause before a write, a freeze or a partition (up to the calm point),
///   a crash or a SIGTERM until the host is back;
/// - a handler call of its event that failed (a panic, a retry asked for)
///   or ran long meanwhile;
/// - another delivery of its event (a twin, a producer's duplicate), or on
///   a FIFO queue of an earlier message of its group (the group stops
///   behind it), held meanwhile, or up to a lease (plus the most any clock
///   is off) before if that one met trouble or ended without an outcome
///   (its claim may still hold the key: a claim that landed late, a
///   release lost); and that one finished its event's message or is
///   explained itself.
///
/// A receive whose answer reached no consumer makes no delivery: SQS gives
/// one out only to a call whose answer is lost, late or frozen, a fault of
/// its own. Trouble is judged per host, not per message: a runtime that
/// wastes receives only while its host meets some fault is not found here
/// (docs/DESIGN.md says what that leaves).
pub fn unexplained_receives(e: &Evidence<'_>) -> Vec<String> {
    let r = Receives::of(e);
    // A delivery excuses another only if it finished its event's message
    // (it held the key meanwhile) or is explained itself, finished or not
    // (a FIFO record slow to finish leaves its group's next one too little
    // of its invocation: campaign seed 1164623): two that did nothing do
    // not excuse each other. Worked out to a fixpoint.
    let judged: Vec<&Delivery> = r.every.iter().filter(|d| !r.finished(d)).collect();
    let mut explained: BTreeSet<&str> = r
        .every
        .iter()
        .filter(|d| r.troubled(d))
        .map(|d| d.receipt.as_str())
        .collect();
    loop {
        let more: Vec<&str> = judged
            .iter()
            .filter(|d| !explained.contains(d.receipt.as_str()))
            .filter(|d| {
                r.every.iter().any(|o| {
                    r.near(o, d)
                        && ((r.finished(o) && r.event(o) == r.event(d))
                            || explained.contains(o.receipt.as_str()))
                })
            })
            .map(|d| d.receipt.as_str())
            .collect();
        if more.is_empty() {
            break;
        }
        explained.extend(more);
    }
    let exhausted = exhausted(e);
    judged
        .iter()
        .filter(|d| !explained.contains(d.receipt.as_str()))
        .map(|d| r.spent_for_nothing(d, exhausted.contains(r.event(d))))
        .collect()
}

/// What [`unexplained_receives`] judges by.
struct Receives<'a> {
    e: &'a Evidence<'a>,
    /// Each message's event.
    event_of_message: BTreeMap<&'a str, &'a str>,
    /// Each event's FIFO group.
    group_of: BTreeMap<&'a str, &'a str>,
    /// A lease, and the most any host's clock is off (one off beyond the
    /// margin takes a lease that ended for one that still holds), in ms.
    lease: u128,
    /// Every delivery of an event's message.
    every: Vec<Delivery>,
}

impl<'a> Receives<'a> {
    fn of(e: &'a Evidence<'a>) -> Self {
        let (event_of_message, group_of) = events_and_groups(e);
        let every = e
            .deliveries
            .every()
            .into_iter()
            .filter(|d| event_of_message.contains_key(d.message.as_str()))
            .collect();
        Self {
            e,
            event_of_message,
            group_of,
            lease: e.scenario.lease.as_millis() + u128::from(clock_off_ms(e.scenario)),
            every,
        }
    }

    fn event(&self, d: &Delivery) -> &'a str {
        self.event_of_message[d.message.as_str()]
    }

    fn outcome(&self, d: &Delivery) -> Option<&'a (u128, String)> {
        self.e.outcome_at.get(&(d.message.clone(), d.count))
    }

    fn finished(&self, d: &Delivery) -> bool {
        matches!(
            self.outcome(d).map(|(_, o)| o.as_str()),
            Some("completed" | "duplicate" | "parked")
        )
    }

    /// From its delivery to its outcome, or to its visibility's end (ms).
    fn window(&self, d: &Delivery) -> (u128, u128) {
        let ms = |t: tokio::time::Instant| t.saturating_duration_since(self.e.start).as_millis();
        let end = self
            .outcome(d)
            .map_or_else(|| ms(d.held_until), |(at, _)| *at);
        (ms(d.at), end)
    }

    /// The trouble that is `d`'s own: its host's as a whole (a freeze, a
    /// partition, a pause before a request, a crash or a SIGTERM), and
    /// that of the calls its host made for it ([`Trouble::calls`]): through
    /// its receipt, on its event's record, for its event's payload or
    /// outgoing message, parking a copy of its message, or the receive
    /// that took it. A fault on a call of
    /// the host made for anything else is no excuse.
    fn own_trouble(&self, d: &Delivery) -> Vec<(u128, u128)> {
        let host = d.consumer.trim_end_matches("-esm");
        let event = self.event(d);
        let at = d.at.saturating_duration_since(self.e.start).as_millis();
        let (receipt, key, of_event, of_message) = (
            Subject::receipt(&d.receipt),
            Subject::key(&self.e.scenario.record_pk(event)),
            Subject::event(event),
            Subject::message(&d.message),
        );
        let calls = self.e.trouble.calls.get(host).into_iter().flatten();
        let own_calls = calls
            .filter(|(from, until, subjects)| {
                subjects.iter().any(|s| {
                    *s == receipt
                        || *s == key
                        || *s == of_event
                        || *s == of_message
                        || (s == Subject::RECEIVE && (*from..=*until).contains(&at))
                })
            })
            .map(|&(from, until, _)| (from, until));
        let whole_host = self
            .e
            .trouble
            .hosts
            .get(host)
            .into_iter()
            .flatten()
            .copied();
        whole_host.chain(own_calls).collect()
    }

    /// Until when `o` may hold its event's key: to its window's end, and
    /// past it where it ended without an outcome or met trouble that may
    /// leave a claim behind (to the end of that trouble); a delivery that
    /// finished its message left none.
    fn held_to(&self, o: &Delivery) -> Option<u128> {
        let (f, u) = self.window(o);
        if self.finished(o) {
            return None;
        }
        if self.outcome(o).is_none() || o.holder_died() {
            return Some(u);
        }
        self.own_trouble(o)
            .iter()
            .filter(|&&(a, b)| a <= u && b >= f)
            .map(|&(_, b)| b.max(u))
            .max()
    }

    /// The line of a receive spent for nothing.
    fn spent_for_nothing(&self, d: &Delivery, in_dlq: bool) -> String {
        let ((from, until), event) = (self.window(d), self.event(d));
        let ended = self
            .outcome(d)
            .map_or("with no outcome", |(_, o)| o.as_str());
        let reason = self
            .e
            .trouble
            .reasons
            .get(&(d.message.clone(), d.count))
            .map_or("", String::as_str);
        let dlq = if in_dlq {
            "; its message reached the DLQ unprocessed"
        } else {
            ""
        };
        format!(
            "{event} ({}): receive {} by {} ({from} ms to {until} ms) ended {ended} {reason:?}, spent with nothing to explain it{dlq}",
            d.message, d.count, d.consumer
        )
    }

    /// Explained by trouble of its own: its holder's death, its host's
    /// trouble, its invocation's pause, its event's handler failing.
    fn troubled(&self, d: &Delivery) -> bool {
        let (from, until) = self.window(d);
        d.holder_died()
            || Trouble::meets(Some(&self.own_trouble(d)), from, until)
            || Trouble::meets(self.e.trouble.events.get(self.event(d)), from, until)
            || self.e.pauses.iter().any(|p| {
                p.messages.contains(&d.message) && p.from_ms <= until && p.until_ms >= from
            })
    }

    /// `o` may have kept `d` from finishing: a delivery of its event, or of
    /// an earlier message of its FIFO group, held meanwhile or (holding the
    /// key) up to a lease before.
    fn near(&self, o: &Delivery, d: &Delivery) -> bool {
        let ((f, u), (from, until)) = (self.window(o), self.window(d));
        let (of, event) = (self.event(o), self.event(d));
        let related = of == event
            || (self.e.scenario.fifo
                && sent_order(&o.message) < sent_order(&d.message)
                && self.group_of.get(of) == self.group_of.get(event));
        related
            && o.receipt != d.receipt
            && f <= until
            && (u >= from || self.held_to(o).is_some_and(|h| h + self.lease >= from))
    }
}

/// The most any host's clock is off from true time, in ms.
fn clock_off_ms(s: &crate::world::Scenario) -> u64 {
    s.consumers
        .iter()
        .flat_map(|c| [Some(c.skew_ms), c.jump.map(|j| j.before_ms)])
        .flatten()
        .map(i64::unsigned_abs)
        .max()
        .unwrap_or(0)
}

/// Each message's event, and each event's FIFO group.
fn events_and_groups<'a>(
    e: &'a Evidence<'_>,
) -> (BTreeMap<&'a str, &'a str>, BTreeMap<&'a str, &'a str>) {
    let event_of_message = e
        .sent
        .iter()
        .flat_map(|(ev, ms)| ms.iter().map(move |m| (m.as_str(), ev.as_str())))
        .collect();
    let group_of = e
        .scenario
        .events
        .iter()
        .map(|ev| (ev.id.as_str(), ev.group.as_str()))
        .collect();
    (event_of_message, group_of)
}

/// Messages SQS's redrive policy moved to the DLQ after their effect was
/// recorded, whose last delivery could not be deleted however the consumer
/// tried: it sent the delete in time and SQS was out of reach, or it died
/// holding the message; or every delivery that learned it was done was in
/// one of those positions, or deleted it and SQS brought it back, or was
/// received before such a delete removed it and learned only after (its
/// receipt then named nothing). No consumer can keep such a message from
/// the DLQ; a
/// copy brought back completes as a duplicate (see [`crate::deliveries`]).
pub fn stranded(e: &Evidence<'_>) -> BTreeSet<String> {
    e.dlq_before
        .iter()
        .filter(|m| moved_by_sqs(m))
        .filter(|m| {
            event_of(&m.body)
                .is_some_and(|ev| e.records_before.get(&ev) == Some(&Status::Completed))
        })
        .filter(|m| {
            let out_of_reach = |d: &crate::deliveries::Delivery| {
                d.delete_was_out_of_reach(e.deliveries.calm_at())
                    || ended_unheld(e, d)
                    || overtaken(e, d)
                    || taken_unheard(e, d)
            };
            // Its delete deleted the message, and SQS brought it back.
            let undone = |d: &crate::deliveries::Delivery| undone(e, d);
            let last = e
                .deliveries
                .last_of(&m.id)
                .is_some_and(|d| out_of_reach(&d));
            // Or its last delivery's own delete deleted it, and SQS
            // brought the message back ([`deleted_then_back`]); an earlier
            // delete that SQS undid excuses a later delivery only as
            // `none_could` below says.
            let deleted_then_back = deleted_then_back(e, m);
            // Or no delivery that learned the effect was recorded could
            // keep it out: each ended after its visibility, or out of
            // reach; or its delete deleted the message and SQS brought it
            // back (seeds 169132, 172328: later deliveries cut off from
            // DynamoDB until the receives ran out); or it was received
            // before such a delete removed the message and learned only
            // after, its receipt then naming nothing (seed 1750 with
            // `maxReceiveCount` drawn: a twin delivery), or learned before
            // but its own delete reached SQS only after, naming nothing
            // then either (seed 214538: the twin's delete was batched).
            let all = e.deliveries.all_of(&m.id);
            let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
            let cut_short = |d: &crate::deliveries::Delivery| {
                // Its last word: its delete reaching SQS, else its end.
                let last_word = d.delete_reached_at.map(ms).or_else(|| {
                    e.outcome_at
                        .get(&(d.message.clone(), d.count))
                        .map(|(at, _)| *at)
                });
                all.iter()
                    .filter(|l| l.receipt != d.receipt && undone(l))
                    .filter_map(|l| l.delete_reached_at)
                    .any(|t| d.at <= t && last_word.is_some_and(|w| w >= ms(t)))
            };
            let learned: Vec<_> = all.iter().filter(|d| learned_done(e, d)).collect();
            let none_could = !learned.is_empty()
                && learned
                    .iter()
                    .all(|d| out_of_reach(d) || undone(d) || cut_short(d));
            last || deleted_then_back || none_could
        })
        .map(|m| m.id.clone())
        .collect()
}

/// `d`'s delete deleted its message, and SQS brought the message back (its
/// documented "might").
fn undone(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    d.delete_reached && e.back_after_delete.contains(&d.receipt)
}

/// `m`'s last delivery's own delete deleted it, and SQS brought the
/// message back: on its last allowed receive, the next receive moves it to
/// the DLQ, and no consumer sees it again. Judged by that delivery's
/// receipt.
fn deleted_then_back(e: &Evidence<'_>, m: &StoredMessage) -> bool {
    e.deliveries.last_of(&m.id).is_some_and(|d| undone(e, &d))
}

/// After the redrive faults are off, but SQS's "might" is not: messages of
/// events recorded completed that its redrive policy moved to the DLQ again because their
/// last delivery's delete deleted them and SQS brought them back on their
/// last allowed receive ([`deleted_then_back`]), a delete sent once it
/// learned the message done ([`deleted_after_learning`]; campaign seed 983045: a
/// redriven copy received on its third and last allowed receive, completed
/// as a duplicate, deleted, brought back). The limit [`stranded`] names,
/// counted with it; any other copy of a valid event left there is a
/// violation.
pub fn stranded_after_redrive(e: &Evidence<'_>) -> BTreeSet<String> {
    e.dlq
        .iter()
        .filter(|m| moved_by_sqs(m))
        .filter(|m| {
            event_of(&m.body).is_some_and(|ev| e.records.get(&ev) == Some(&Status::Completed))
        })
        .filter(|m| deleted_then_back(e, m))
        .filter(|m| {
            e.deliveries
                .last_of(&m.id)
                .is_some_and(|d| deleted_after_learning(e, &d))
        })
        .map(|m| m.id.clone())
        .collect()
}

/// `d` learned its message done (completed, or a duplicate) no later than
/// its delete reached SQS: a delete sent before the effect was recorded
/// excuses nothing.
fn deleted_after_learning(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
    learned_done(e, d)
        && e.outcome_at
            .get(&(d.message.clone(), d.count))
            .zip(d.delete_reached_at)
            .is_some_and(|((at, _), reached)| *at <= ms(reached))
}

/// Another host made `d`'s message visible while `d` held it, through the
/// receipt of its twin (SQS handed the message to both at once: the two
/// receipts are valid, and no delivery of the message came between them),
/// and `d` sent its delete only after that ([`Delivery::overtaken_by`]);
/// the other delivery did not know the message done (a host that did must
/// delete it, not make it visible). No host knows another holds a newer
/// receipt (seed 611).
///
/// [`Delivery::overtaken_by`]: crate::deliveries::Delivery::overtaken_by
fn overtaken(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    // When it learned the message done (its outcome).
    let learned = e
        .outcome_at
        .get(&(d.message.clone(), d.count))
        .map(|(at, _)| e.start + std::time::Duration::from_millis(*at as u64));
    let Some(by) = d.overtaken_by(e.deliveries.calm_at(), learned) else {
        return false;
    };
    let all = e.deliveries.all_of(&d.message);
    let Some(setter) = all.iter().find(|o| o.receipt == by) else {
        return false;
    };
    let twins = e.twins.contains(&d.receipt) || e.twins.contains(by);
    let (from, to) = (setter.at.min(d.at), setter.at.max(d.at));
    let adjacent = !all
        .iter()
        .any(|o| o.receipt != d.receipt && o.receipt != by && from < o.at && o.at < to);
    twins && adjacent && !learned_done(e, setter)
}

/// SQS handed `d`'s message out again while `d` held it (a twin), with a
/// shorter visibility, through a receive whose answer reached no consumer
/// (lost, or given up on): the message was visible again from that
/// visibility's end, which no host knew of, and `d`, having sent its delete
/// while it held the message, had it reach SQS only after that end, or was
/// still trying while SQS was out of reach at that end (the rule of
/// [`Delivery::delete_was_out_of_reach`] with that end). Seed 235811: a
/// Lambda host paused in its commit past the poller-sized visibility of an
/// unheard twin; its delete, sent within its own visibility, named nothing.
/// A take is a twin only where the takes and changes SQS applied left the
/// message in flight ([`Deliveries::taken`]).
///
/// [`Delivery::delete_was_out_of_reach`]: crate::deliveries::Delivery::delete_was_out_of_reach
/// [`Deliveries::taken`]: crate::deliveries::Deliveries::taken
fn taken_unheard(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    let Some((visible_at, by)) = &d.unheard_take else {
        return false;
    };
    let heard = e
        .deliveries
        .all_of(&d.message)
        .iter()
        .any(|o| &o.receipt == by);
    let late = d.delete_reached_at.is_some_and(|r| r >= *visible_at);
    let out_of_reach = d.delete_out_of_reach_until(*visible_at, e.deliveries.calm_at());
    !heard && d.delete_sent.is_some() && (late || out_of_reach)
}

/// A delivery that ended only after its visibility had run out: a host
/// paused between its handler and its commit (or a commit slower than the
/// visibility) holds a receipt that can no longer delete the message, and
/// on its last allowed receive SQS moves it at the next receive.
fn ended_unheld(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
    let (from, held_until) = (ms(d.at), ms(d.held_until));
    let ended_after = e
        .outcome_at
        .get(&(d.message.clone(), d.count))
        .is_some_and(|(at, _)| *at >= held_until);
    // Only a stall of its own can make a delivery outlive its visibility
    // (the heartbeat keeps it otherwise): its host frozen, cut from SQS or
    // paused before a request, or its invocation paused, while it held
    // the message.
    let host = d.consumer.trim_end_matches("-esm");
    let stalled = Trouble::meets(e.trouble.stalls.get(host), from, held_until)
        || e.pauses.iter().any(|p| {
            p.messages.contains(&d.message) && p.from_ms <= held_until && p.until_ms >= from
        });
    ended_after && stalled
}

/// The delivery ended knowing its message's effect was recorded.
fn learned_done(e: &Evidence<'_>, d: &crate::deliveries::Delivery) -> bool {
    e.outcome_at
        .get(&(d.message.clone(), d.count))
        .is_some_and(|(_, o)| o == "completed" || o == "duplicate")
}

/// Messages in the DLQ when the run first settled whose effect was recorded
/// by their own delivery but never confirmed to any consumer: the commit's
/// answer was lost (or it landed after the client gave up), and every later
/// delivery ended without reaching the record (DynamoDB out of reach, the
/// host crashed or drained first). A consumer deletes only what it knows is
/// recorded, so it cannot keep such a message from the DLQ; the redrive
/// brings it back and it completes as a duplicate, which the checks after
/// the redrive require. One delivery that learned of the record (`completed`
/// or `duplicate`) and still let the message reach the DLQ is a violation.
pub fn unconfirmed(e: &Evidence<'_>) -> BTreeSet<String> {
    e.dlq_before
        .iter()
        .filter(|m| moved_by_sqs(m))
        .map(origin)
        .filter(|from| e.completed_by.contains(from) && !e.confirmed.contains(from))
        .collect()
}

/// A DLQ message SQS's redrive policy moved (not a copy sqs-once parked).
fn moved_by_sqs(m: &StoredMessage) -> bool {
    !m.attributes.contains_key(REASON_ATTRIBUTE) && !m.attributes.contains_key(MESSAGE_ID_ATTRIBUTE)
}

/// A Lambda invocation's process pause: its tasks not polled meanwhile.
#[derive(Debug, Clone, Default)]
pub struct Pause {
    /// Its host.
    pub host: String,
    /// The messages of the invocation.
    pub messages: BTreeSet<String>,
    /// From and until when, ms from the run's start.
    pub from_ms: u128,
    /// Until when.
    pub until_ms: u128,
}

/// A record left `IN_PROGRESS`.
#[derive(Debug, Clone, Default)]
pub struct Unfinished {
    /// The record, described.
    pub what: String,
    /// Released (lease 0).
    pub released: bool,
    /// Its lease over when the hosts stopped.
    pub lease_ended: bool,
    /// The message whose delivery claimed it.
    pub message: String,
}

impl Unfinished {
    /// Claimable by anyone: released, or its lease over.
    fn blocks_no_one(&self) -> bool {
        self.released || self.lease_ended
    }
}

/// Every violation found, in words.
pub fn check(e: &Evidence<'_>) -> Vec<String> {
    let mut v = Vec::new();
    let effects = effects(e);
    let first = first_applications(e, &effects, &mut v);
    order(e, &first, &mut v);
    parked_or_applied(e, &effects, &mut v);
    in_dlq_with_effect(e, &mut v);
    deleted_through_the_newest(e, &mut v);
    if e.scenario.calls() {
        // Under a skew beyond the margin the skewed host's attempts may
        // overlap another's: counted apart ([`overlapping`]); every other
        // overlap, fencing, exactly-once of staged effects, nothing lost and
        // FIFO order are still required.
        overlaps(&unskewed_calls(e), &mut v);
        skewed_overlaps(e, &mut v);
        external_calls(e, &mut v);
        past_lease(e, &mut v);
    }
    reruns(e, &mut v);
    downstream(e, &mut v);
    v.extend(unexplained_receives(e));
    // Fencing: a write sent under a lease that another attempt has since
    // taken over never applies, however late it lands.
    for breach in &e.fencing_breaches {
        v.push(format!("fencing broken: {breach}"));
    }
    // The TTL excuses (an application after it, a record it ended or
    // deleted) hold only for records written with the configured TTL.
    for breach in &e.ttl_breaches {
        v.push(format!("TTL not as configured: {breach}"));
    }
    for (event, left) in &e.unfinished {
        let (what, released) = (&left.what, &left.released);
        if *released && parked_permanent(e, event) && delivered_twice_at_once(e, event) {
            // A permanent event's copy SQS delivered twice at once (two live
            // receipts): one copy was parked and its delete removed the
            // message, the other ran meanwhile (its key FAILED by another
            // delivery is claimable), failed transiently and released its
            // claim; no message is left to mark the record FAILED again.
            // A released record blocks no one, and the event is parked
            // (seed 156).
            continue;
        }
        if *released && ended_since_applied(e, event) && delivered_twice_at_once(e, event) {
            // The same with a copy that came after its record's TTL (the
            // documented limit): the event applied and its record
            // `COMPLETED`, a copy delivered twice at once ran on both
            // receipts; one found the record still alive and deleted the
            // message as a duplicate, the other found it expired, claimed
            // it too late to run (a claim that lands late is released) and
            // answered retry, with no message left to come back. A released
            // record blocks no one (seed 3355).
            continue;
        }
        if later_copy_left(e, event) {
            // The same where the copy that claimed after the TTL ran its
            // handler (an application after TTL: the documented limit,
            // counted), and its release was lost: the record left is that
            // copy's, its lease over, and its message gone, deleted as a
            // duplicate through its twin's receipt while the `COMPLETED`
            // record was still alive (seed 567396).
            continue;
        }
        v.push(format!("{event}: record left IN_PROGRESS ({what})"));
    }
    for (i, host) in e.hosts.iter().enumerate() {
        for (peak, bound) in &host.peaks {
            if peak > bound {
                v.push(format!(
                    "c{i}: {peak} handler calls at once, above its bound {bound}"
                ));
            }
        }
    }
    v
}

/// A chained run's second stage (the outbox): nothing sent before its
/// effect committed; every committed event's message sent, always with its
/// one stable id, and applied exactly once by the second stage's consumer
/// however often it was sent; nothing for an event whose effect never
/// committed.
fn downstream(e: &Evidence<'_>, v: &mut Vec<String>) {
    for early in &e.early_sends {
        v.push(format!("outbox: {early}"));
    }
    let Some(SecondStage {
        sent: next,
        applied,
        left,
    }) = &e.next
    else {
        return;
    };
    if *left > 0 {
        v.push(format!(
            "outbox: the second stage left {left} messages unprocessed"
        ));
    }
    for (event, status) in &e.records {
        let n = applied.get(event).copied().unwrap_or(0);
        if *status == Status::Completed && n != 1 {
            v.push(format!("{event}: applied {n} times by the second stage"));
        }
    }
    for event in applied.keys() {
        if !committed(e, event) {
            v.push(format!(
                "{event}: applied by the second stage, its upstream effect never committed"
            ));
        }
    }
    // On the fast path each event's one ledger row names the message whose
    // run committed: what the outbox sent must be that run's message (a
    // duplicate that sent its own would name another message of the event).
    // (An event applied again after its record's TTL has one row per
    // committing run, each of which sends its own.) Where the paths mix,
    // only for events the claim path never ran: its runs stage no row, so
    // the rows cannot name every committing run of an event it ran too
    // (TTL may let both commit, each sending its own); as in a claim-path
    // run, the checks below still hold for those.
    let committed_by = committed_by(e);
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for m in next {
        let body: serde_json::Value = serde_json::from_str(&m.body).unwrap_or_default();
        if let (Some(event), Some(by)) = (body["id"].as_str(), body["by"].as_str())
            && let Some(committed) = committed_by.get(event)
            && !committed.contains(by)
        {
            v.push(format!(
                "{event}: the outbox sent the message of {by}'s run, but {committed:?}'s committed"
            ));
        }
        let Some(event) = event_of(&m.body) else {
            v.push(format!("outbox: a message without an event: {}", m.body));
            continue;
        };
        let id = match m.attributes.get(sqs_once::outbox::OUTBOX_ID_ATTRIBUTE) {
            Some(a) => format!("{:?}", a.value),
            None => "none".to_owned(),
        };
        ids.entry(event).or_default().insert(id);
    }
    for (event, status) in &e.records {
        if *status == Status::Completed && !ids.contains_key(event) {
            v.push(format!(
                "{event}: its effect committed but its outgoing message was never sent"
            ));
        }
    }
    for (event, sent) in &ids {
        if !committed(e, event) {
            v.push(format!(
                "{event}: a message was sent downstream for an effect that never committed"
            ));
        }
        if sent.len() != 1 {
            v.push(format!(
                "{event}: sent downstream under {} ids: {sent:?}",
                sent.len()
            ));
        }
    }
}

/// The messages whose fast-path runs committed each event, by its ledger
/// rows: only where the run stages rows, and only for events the claim
/// path never ran (see [`downstream`]).
fn committed_by<'e>(e: &'e Evidence<'_>) -> BTreeMap<&'e str, BTreeSet<&'e str>> {
    let charged: BTreeSet<&str> = e.calls.iter().map(|c| c.event.as_str()).collect();
    let mut committed_by: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    if e.scenario.stages() {
        for r in e
            .rows
            .iter()
            .filter(|r| !charged.contains(r.event.as_str()))
        {
            committed_by
                .entry(r.event.as_str())
                .or_default()
                .insert(r.message.as_str());
        }
    }
    committed_by
}

/// Whether SQS delivered a message of `event` while another receipt of it
/// was valid (a twin delivery: the documented "might").
fn delivered_twice_at_once(e: &Evidence<'_>, event: &str) -> bool {
    e.sent.get(event).is_some_and(|messages| {
        messages.iter().any(|m| {
            e.deliveries
                .all_of(m)
                .iter()
                .any(|d| e.twins.contains(&d.receipt))
        })
    })
}

/// The effect of `event` committed: its record says `COMPLETED`, or a
/// `COMPLETED` record of it ended by TTL (only those are logged as ended),
/// the record left then being a later copy's.
fn committed(e: &Evidence<'_>, event: &str) -> bool {
    e.records.get(event) == Some(&Status::Completed)
        || e.ended_by_ttl
            .get(event)
            .is_some_and(|ends| !ends.is_empty())
}

/// TTL ended a `COMPLETED` record of `event` after its first application:
/// a record of it left now is a later claim's, of a copy that came after
/// the TTL (the documented limit), not the first application's.
fn claimed_after_ttl(e: &Evidence<'_>, event: &str) -> bool {
    let ends = e.ended_by_ttl.get(event).map_or(&[][..], Vec::as_slice);
    application_times(e, event)
        .first()
        .is_some_and(|&first| ends.iter().any(|&t| t >= first))
}

/// The record of `event` left `IN_PROGRESS` is a copy's that came after
/// TTL ended the first application's `COMPLETED` record, it blocks no one
/// (released, or its lease over when the hosts stopped), and that copy's
/// message was delivered twice at once: its twin, finding the record still
/// alive, deleted the message as a duplicate, and nothing is left to come
/// back and finish it (seed 567396).
fn later_copy_left(e: &Evidence<'_>, event: &str) -> bool {
    let Some(left) = e.unfinished.get(event) else {
        return false;
    };
    let deliveries = e.deliveries.all_of(&left.message);
    let twin = deliveries.iter().any(|d| e.twins.contains(&d.receipt));
    // The message was deleted (not lost): a delete of it reached SQS.
    let deleted = deliveries.iter().any(|d| d.delete_reached);
    left.blocks_no_one() && twin && deleted && claimed_after_ttl(e, event)
}

/// TTL ended a `COMPLETED` record of `event` at or after its last
/// application, and no API call or row of it came after that end: the
/// record left at the end (if any) is a later copy's, which made no effect,
/// not the one that application completed (a copy that came after its record's
/// TTL: the documented limit). Only `COMPLETED` records are logged as ended
/// by TTL, so an application never committed has no such end.
fn ended_since_applied(e: &Evidence<'_>, event: &str) -> bool {
    let ends = e.ended_by_ttl.get(event).map_or(&[][..], Vec::as_slice);
    // Every call counts here, not only the first of its idempotency key
    // (a copy after TTL calls again with the same key): none may start at
    // or after the end, nor a row commit.
    let called_since = |t: u128| {
        e.calls.iter().any(|c| c.event == event && c.start_ms >= t)
            || e.rows.iter().any(|r| r.event == event && r.at_ms >= t)
    };
    application_times(e, event)
        .last()
        .is_some_and(|&last| ends.iter().any(|&t| t >= last && !called_since(t)))
}

/// A permanent event with a copy parked with its reason in the DLQ at the end.
fn parked_permanent(e: &Evidence<'_>, event: &str) -> bool {
    let permanent = e
        .scenario
        .events
        .iter()
        .any(|ev| ev.id == event && ev.permanent);
    permanent
        && e.dlq
            .iter()
            .any(|m| event_of(&m.body).as_deref() == Some(event) && parked_with_reason(m))
}

/// Every effect in the order made: ledger rows in commit order, or API
/// calls in start order.
fn effects(e: &Evidence<'_>) -> Vec<Effect> {
    if e.scenario.mixed() {
        // Both kinds: rows at their commits, calls at their starts.
        let mut all = e.rows.clone();
        all.extend(e.calls.iter().map(|c| Effect {
            event: c.event.clone(),
            message: c.message.clone(),
            at_ms: c.start_ms,
            by: c.consumer.clone(),
        }));
        all.sort_by_key(|fx| fx.at_ms);
        return all;
    }
    match e.scenario.kind {
        Kind::Staged => e.rows.clone(),
        Kind::External => {
            let mut calls: Vec<&ApiCall> = e.calls.iter().collect();
            calls.sort_by_key(|c| c.start_ms);
            calls
                .into_iter()
                .map(|c| Effect {
                    event: c.event.clone(),
                    message: c.message.clone(),
                    at_ms: c.start_ms,
                    by: c.consumer.clone(),
                })
                .collect()
        }
    }
}

/// The first effect of each event, in order; flags an effect applied more
/// than once, and a charge whose record does not say `COMPLETED`.
fn first_applications(e: &Evidence<'_>, effects: &[Effect], v: &mut Vec<String>) -> Vec<Effect> {
    let mut first: Vec<Effect> = Vec::new();
    for fx in effects {
        if !first.iter().any(|f| f.event == fx.event) {
            first.push(fx.clone());
        }
    }
    for f in &first {
        let times = application_times(e, &f.event);
        if let Some(at) = applied_again_while_alive(e, &f.event, &times) {
            v.push(format!(
                "{}: effect applied {} times{}",
                f.event,
                times.len(),
                ttl_note(e, &f.event, at)
            ));
        }
        let status = e.records.get(&f.event);
        // The first application's record is judged as TTL ended it, where
        // the record left is a later copy's that blocks no one, its message
        // gone through its twin (seed 567396).
        if e.scenario.calls()
            && status != Some(&Status::Completed)
            && !ended_since_applied(e, &f.event)
            && !later_copy_left(e, &f.event)
        {
            v.push(format!("{}: charged but its record is {status:?}", f.event));
        }
    }
    // Claim-path handlers that stage a row: the row commits with the
    // completion, so at most once per event.
    if !e.scenario.stages() {
        for (event, times) in row_times(e) {
            if let Some(at) = applied_again_while_alive(e, event, &times) {
                v.push(format!(
                    "{event}: staged row committed {} times{}",
                    times.len(),
                    ttl_note(e, event, at)
                ));
            }
        }
    }
    first
}

/// When each ledger row was committed (ms from the start), by event.
fn row_times<'e>(e: &'e Evidence<'_>) -> BTreeMap<&'e str, Vec<u128>> {
    let mut times: BTreeMap<&str, Vec<u128>> = BTreeMap::new();
    for r in &e.rows {
        times.entry(r.event.as_str()).or_default().push(r.at_ms);
    }
    for t in times.values_mut() {
        t.sort_unstable();
    }
    times
}

/// When `event`'s effect was applied, in order: its ledger rows' commits
/// (fast path), or the first call of each idempotency key at the API (each
/// key is charged once).
///
/// Where the kinds mix, both: a row and a charge are two applications,
/// except a charge of a claim that lost its key before the fast path
/// committed (the documented limit: [`claim_then_fast`]).
fn application_times(e: &Evidence<'_>, event: &str) -> Vec<u128> {
    let rows = || e.rows.iter().filter(|r| r.event == event).map(|r| r.at_ms);
    let mut times: Vec<u128> = match e.scenario.kind {
        _ if e.scenario.mixed() => {
            let mut times: Vec<u128> = rows().collect();
            if !skewed_cross_path(e).contains(event) {
                let abandoned = abandoned_charges(e, event);
                // A charge a pause stopped, where every row of its event
                // was committed after the pause began, is counted apart
                // ([`stopped_by`]): its lease ended under it. A row before
                // the pause still makes two applications.
                let rows_after = |from: u128| rows().all(|at| at >= from);
                times.extend(
                    first_calls(e, event)
                        .into_iter()
                        .filter(|c| !abandoned.iter().any(|a| std::ptr::eq(*a, *c)))
                        .filter(|c| !stopped_by(e, c).is_some_and(rows_after))
                        .map(|c| c.start_ms),
                );
            }
            times
        }
        Kind::Staged => rows().collect(),
        Kind::External => charge_times(e, event),
    };
    times.sort_unstable();
    times
}

/// When each idempotency key of `event` was first called at the API (each
/// key is charged once).
fn charge_times(e: &Evidence<'_>, event: &str) -> Vec<u128> {
    first_calls(e, event).iter().map(|c| c.start_ms).collect()
}

/// The first API call of each idempotency key of `event`.
fn first_calls<'e>(e: &'e Evidence<'_>, event: &str) -> Vec<&'e ApiCall> {
    let mut first: BTreeMap<&str, &ApiCall> = BTreeMap::new();
    for c in e.calls.iter().filter(|c| c.event == event) {
        let f = first.entry(c.key.as_str()).or_insert(c);
        if c.start_ms < f.start_ms {
            *f = c;
        }
    }
    first.into_values().collect()
}

/// Where the kinds mix, the charges of `event` (first calls of their keys)
/// made by a claim-path attempt that then lost its claim, followed by a
/// fast-path commit: made under an attempt before the one that completed
/// the record (so that claim was released or expired, never completed), the
/// call ended before the event's next row committed. The documented limit
/// of sharing records between the paths (docs/DESIGN.md, "The fast path"):
/// an abandoned claim's effect is covered by its idempotency key on the
/// claim path only, and a fast-path handler has none. Each charge is judged
/// against the row that follows it, so a row committed before TTL ended the
/// record and a later claim of a copy do not hide the case (seeds 124792
/// and 5002223). A charge of the attempt that completed the record, one
/// still open at the next row's commit, or one no row follows still counts.
fn abandoned_charges<'e>(e: &'e Evidence<'_>, event: &str) -> Vec<&'e ApiCall> {
    if !e.scenario.mixed() {
        return Vec::new();
    }
    let Some(&attempts) = e.attempts.get(event) else {
        return Vec::new();
    };
    let rows = row_times(e).remove(event).unwrap_or_default();
    let ends = e.ended_by_ttl.get(event).map_or(&[][..], Vec::as_slice);
    first_calls(e, event)
        .into_iter()
        .filter(|c| {
            let next_row = rows.iter().copied().filter(|&r| r >= c.start_ms).min();
            next_row.is_some_and(|r| {
                // The row completed the record the charge's claim held (no
                // TTL end between them); the final attempt count speaks of
                // that record only where no TTL end came after the row (a
                // later record's count starts again: seed 126305), and a
                // fast-path commit after a claim is a later attempt. A
                // claim whose record TTL deleted unfinished before the row
                // was lost too: the row's record is a new one, its count
                // started again (seed 5536: the claiming host crashed after
                // its charge).
                let same_record = !ends.iter().any(|&t| c.start_ms < t && t <= r);
                let deleted_unfinished = e
                    .unfinished_deleted_by_ttl
                    .get(event)
                    .is_some_and(|ts| ts.iter().any(|&t| c.start_ms < t && t <= r));
                let lost =
                    c.attempt < attempts || ends.iter().any(|&t| t > r) || deleted_unfinished;
                same_record && lost && c.end_ms.is_some_and(|end| end <= r)
            })
        })
        .collect()
}

/// Events applied by a claim-path attempt that lost its claim and then by a
/// fast-path commit, where the kinds mix (see [`abandoned_charges`]).
/// Counted, not violations.
pub fn claim_then_fast(e: &Evidence<'_>) -> BTreeSet<String> {
    if !e.scenario.mixed() {
        return BTreeSet::new();
    }
    row_times(e)
        .into_keys()
        .filter(|event| !abandoned_charges(e, event).is_empty())
        .map(str::to_owned)
        .collect()
}

/// The documented limit (docs/DESIGN.md, "Parking"): a copy that comes
/// after its record's TTL ended it runs again. So an application after the
/// first is allowed only where TTL ended the event's `COMPLETED` record
/// after the application before it and no later than this one (a claim or
/// a fast-path commit that replaced an expired record ends it in the same
/// write). Answers the first application (ms) that no such end allows.
fn applied_again_while_alive(e: &Evidence<'_>, event: &str, times: &[u128]) -> Option<u128> {
    let ends = e.ended_by_ttl.get(event).map_or(&[][..], Vec::as_slice);
    times
        .windows(2)
        .find(|w| !ends.iter().any(|t| w[0] < *t && *t <= w[1]))
        .map(|w| w[1])
}

/// What a violation of exactly-once says about TTL, where it ended the
/// record: the application at `at` came with no end since the one before.
fn ttl_note(e: &Evidence<'_>, event: &str, at: u128) -> String {
    match e.ended_by_ttl.get(event).map_or(0, Vec::len) {
        0 => String::new(),
        n => format!(
            " (its record ended by TTL {n} times, none between the application at {at}ms and the one before)"
        ),
    }
}

/// Events applied more than once, each time after TTL ended the record of
/// the application before (a copy that came after its record's TTL: the
/// documented limit). Counted, not violations.
pub fn after_ttl(e: &Evidence<'_>) -> BTreeSet<String> {
    row_times(e)
        .into_iter()
        .filter(|(event, times)| {
            times.len() > 1 && applied_again_while_alive(e, event, times).is_none()
        })
        .map(|(event, _)| event.to_owned())
        .collect()
}

/// FIFO: within each group, events first applied in the order their
/// messages were sent.
fn order(e: &Evidence<'_>, first: &[Effect], v: &mut Vec<String>) {
    if !e.scenario.fifo {
        return;
    }
    let groups: BTreeMap<&str, &str> = e
        .scenario
        .events
        .iter()
        .map(|ev| (ev.id.as_str(), ev.group.as_str()))
        .collect();
    let mut last: BTreeMap<&str, &Effect> = BTreeMap::new();
    for f in first {
        let Some(group) = groups.get(f.event.as_str()) else {
            continue;
        };
        if let Some(prev) = last.insert(group, f)
            && sent_order(&prev.message) > sent_order(&f.message)
            && !moved_before(e, f, prev)
        {
            v.push(format!(
                "{} ({}): applied after {} ({}), sent later in group {group} (FIFO order)",
                f.event, f.message, prev.event, prev.message
            ));
        }
    }
}

/// Whether `earlier` (sent first in its FIFO group, applied after `later`)
/// had left the source queue for the DLQ by SQS's redrive policy before the
/// delivery that applied `later`: SQS then hands out the rest of the group,
/// and the earlier message comes back only with the redrive, after them.
/// The documented limit of a FIFO queue with a redrive policy (docs/DESIGN.md,
/// "What ends in the DLQ"), judged from evidence: the earlier message is
/// among those SQS moved (not parked), its last delivery spent the last
/// allowed receive, and `later`'s applying delivery (its last delivery
/// before the application) came after that delivery's visibility ended,
/// when the next receive of the group moved it. While a message of the
/// group is in the queue, SQS delivers none after it, so any other
/// out-of-order application stays a violation. The earlier message's effect
/// must be a ledger row's commit: a commit sent before its visibility ended
/// may land after (the fast path does not stop at its visibility end); an
/// external call that starts after it is a handler run on past its
/// delivery, a violation.
fn moved_before(e: &Evidence<'_>, earlier: &Effect, later: &Effect) -> bool {
    let committed = e.rows.iter().any(|r| {
        r.event == earlier.event && r.message == earlier.message && r.at_ms == earlier.at_ms
    });
    if !committed {
        return false;
    }
    let moved = e
        .dlq_before
        .iter()
        .any(|m| m.id == earlier.message && moved_by_sqs(m));
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
    let Some(last) = e.deliveries.last_of(&earlier.message) else {
        return false;
    };
    let applying = e
        .deliveries
        .all_of(&later.message)
        .into_iter()
        .filter(|d| ms(d.at) <= later.at_ms)
        .last();
    moved
        && last.count >= e.scenario.max_receive_count
        && applying.is_some_and(|d| ms(d.at) >= ms(last.held_until))
}

/// FIFO pairs applied out of send order because SQS moved the earlier
/// message to the DLQ before the later one was delivered ([`moved_before`]):
/// the documented limit, counted, not violations. Each as "earlier event
/// before later event".
pub fn fifo_after_dlq(e: &Evidence<'_>) -> BTreeSet<String> {
    if !e.scenario.fifo {
        return BTreeSet::new();
    }
    let groups: BTreeMap<&str, &str> = e
        .scenario
        .events
        .iter()
        .map(|ev| (ev.id.as_str(), ev.group.as_str()))
        .collect();
    let mut first: Vec<Effect> = Vec::new();
    for fx in effects(e) {
        if !first.iter().any(|f| f.event == fx.event) {
            first.push(fx);
        }
    }
    let mut last: BTreeMap<&str, &Effect> = BTreeMap::new();
    let mut found = BTreeSet::new();
    for f in &first {
        let Some(group) = groups.get(f.event.as_str()) else {
            continue;
        };
        if let Some(prev) = last.insert(group, f)
            && sent_order(&prev.message) > sent_order(&f.message)
            && moved_before(e, f, prev)
        {
            found.insert(format!("{} before {}", f.event, prev.event));
        }
    }
    found
}

/// The message a DLQ copy stands for: the original delivery for a copy
/// sqs-once parked, the message itself for one SQS's redrive policy moved.
fn origin(m: &StoredMessage) -> String {
    m.attributes
        .get(MESSAGE_ID_ATTRIBUTE)
        .and_then(|a| match &a.value {
            sqs_once::AttributeValue::Text(t) => Some(t.clone()),
            sqs_once::AttributeValue::Binary(_) => None,
        })
        .unwrap_or_else(|| m.id.clone())
}

/// Whether a DLQ copy is one sqs-once parked, with its reason.
fn parked_with_reason(m: &StoredMessage) -> bool {
    m.attributes.contains_key(REASON_ATTRIBUTE)
}

/// After the redrive: every accepted valid event applied (a valid event left
/// in the DLQ or nowhere is lost), never a valid event parked (handler panics
/// and transient errors are retries by contract), every permanent failure
/// parked with its reason (where it fits) and never applied, nothing refused
/// applied, nothing left in the queue.
fn parked_or_applied(e: &Evidence<'_>, effects: &[Effect], v: &mut Vec<String>) {
    let applied: BTreeSet<&str> = effects.iter().map(|f| f.event.as_str()).collect();
    let gone = payload_gone(e);
    let back = stranded_after_redrive(e);
    // A copy parked for its missing payload after its event's effect was
    // recorded is the documented limit ([`payload_gone`]), not a valid event
    // kept from its effect, and so is one SQS brought back after its delete
    // ([`stranded_after_redrive`]); any other copy of the event still counts.
    let in_dlq: BTreeSet<String> = e
        .dlq
        .iter()
        .filter(|m| {
            !(parked_for_missing_payload(m)
                && event_of(&m.body).is_some_and(|ev| gone.contains(&ev)))
        })
        .filter(|m| !back.contains(&m.id))
        .filter_map(|m| event_of(&m.body))
        .collect();
    for ev in &e.scenario.events {
        let id = ev.id.as_str();
        let is_applied = applied.contains(id);
        let copies = || {
            e.dlq_before
                .iter()
                .chain(&e.dlq)
                .filter(|m| event_of(&m.body).as_deref() == Some(id))
        };
        match (e.accepted.contains(id), ev.permanent) {
            (false, _) if is_applied => v.push(format!("{id}: applied but never accepted by SQS")),
            (false, _) => {}
            // Faults are off after the redrive: a valid event's copy there
            // is a violation whether or not the event was applied.
            (true, false) if in_dlq.contains(id) => {
                let applied = if is_applied {
                    "applied"
                } else {
                    "never applied"
                };
                v.push(format!(
                    "{id}: a valid event is still in the DLQ after the redrive ({applied})"
                ));
            }
            (true, false) if !is_applied => {
                v.push(format!("{id}: lost (neither applied nor parked)"))
            }
            (true, true) if !in_dlq.contains(id) => {
                v.push(format!(
                    "{id}: a permanent failure neither parked nor kept in the DLQ"
                ));
            }
            _ => {}
        }
        if ev.permanent && is_applied {
            v.push(format!("{id}: a permanent failure was applied"));
        }
        if !ev.permanent {
            let excused = |m: &&StoredMessage| gone.contains(id) && parked_for_missing_payload(m);
            if let Some(m) = copies().find(|m| parked_with_reason(m) && !excused(m)) {
                let reason = m
                    .attributes
                    .get(REASON_ATTRIBUTE)
                    .map(|a| format!("{:?}", a.value))
                    .unwrap_or_default();
                v.push(format!("{id}: a valid event was parked ({reason})"));
            }
            if e.records.get(id) == Some(&Status::Failed) {
                v.push(format!("{id}: a valid event's record says FAILED"));
            }
        }
        // A copy near the DLQ's size limit keeps its dedup key first and has
        // no room left for the reason (DESIGN.md, "Parking"): not a violation.
        // (Sent through S3, the body in SQS is a pointer, far below it.)
        let room = ev.through_s3 || ev.body.len() + 512 <= crate::world::MAX_MESSAGE_BYTES;
        if ev.permanent && in_dlq.contains(id) && room && !copies().any(parked_with_reason) {
            v.push(format!("{id}: parked without its reason"));
        }
    }
    for m in &e.left {
        v.push(format!(
            "{}: still in the source queue ({:?})",
            m.id, m.state
        ));
    }
}

/// A poller that deletes a finished message deletes it through the newest
/// receipt handle of it that it received too. The SQS Developer Guide: a
/// delete must name the most recently received handle, else "the request
/// succeeds, but the message might not be deleted". A newer delivery that
/// reached the same poller and ended before the finished one's delete
/// without a delete of its own (it came back: its key was held by the older
/// one) leaves only its handle to delete the message by; a delete through
/// the older one alone counts as done while the message comes back,
/// spending a receive (on its last allowed receive, into the DLQ with its
/// effect recorded: seed 269966). Lambda's event source mapping deletes
/// each record's own handle and is not judged here.
fn deleted_through_the_newest(e: &Evidence<'_>, v: &mut Vec<String>) {
    let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
    let mut by_host: BTreeMap<(String, String, String), Vec<crate::deliveries::Delivery>> =
        BTreeMap::new();
    for d in e.deliveries.every() {
        if d.consumer.ends_with("-esm") {
            continue;
        }
        by_host
            .entry((d.consumer.clone(), d.queue.clone(), d.message.clone()))
            .or_default()
            .push(d);
    }
    for ((consumer, _, message), ds) in &by_host {
        for done in ds.iter().filter(|d| learned_done(e, d)) {
            if done.first_delete_try().is_none() {
                continue;
            }
            // When it ended: its delete is handed over then, and the
            // runtime picks the receipts to delete through at that moment
            // (the batcher may send it a second later).
            let Some(&(ended, _)) = e.outcome_at.get(&(done.message.clone(), done.count)) else {
                continue;
            };
            // The newest delivery here before then, ended before it to come
            // back (one that learned the message done deletes it itself,
            // and is judged as such).
            let newest = ds
                .iter()
                .filter(|n| ms(n.arrived) < ended)
                .max_by_key(|n| (n.arrived, n.count))
                .filter(|n| n.count > done.count && !learned_done(e, n))
                .filter(|n| {
                    e.outcome_at
                        .get(&(n.message.clone(), n.count))
                        .is_some_and(|(at, _)| *at < ended)
                });
            if let Some(n) = newest
                && n.first_delete_try().is_none()
            {
                v.push(format!(
                    "{message}: {consumer} deleted it, finished, through receive {} only; its newer receive {}, let go at {} ms, was never deleted",
                    done.count,
                    n.count,
                    e.outcome_at[&(n.message.clone(), n.count)].0,
                ));
            }
        }
    }
}

/// No message whose delivery recorded its effect in the DLQ when the run
/// first settled, but where no consumer could have kept it out: its last
/// delivery's delete could not reach SQS (see [`stranded`]), or no consumer
/// ever learned that the effect was recorded (see [`unconfirmed`]).
fn in_dlq_with_effect(e: &Evidence<'_>, v: &mut Vec<String>) {
    let stranded = stranded(e);
    let unconfirmed = unconfirmed(e);
    let gone = payload_gone(e);
    for m in &e.dlq_before {
        let from = origin(m);
        let event = event_of(&m.body).unwrap_or_default();
        if gone.contains(&event) && parked_for_missing_payload(m) {
            continue;
        }
        if e.completed_by.contains(&from)
            && !stranded.contains(&m.id)
            && !unconfirmed.contains(&from)
        {
            let ms = |t: tokio::time::Instant| t.saturating_duration_since(e.start).as_millis();
            let last = match e.deliveries.last_of(&from) {
                Some(d) => format!(
                    "; its last delivery (receive {}, by {}, held until {}ms, delete sent at {:?}ms, reached SQS at {:?}ms) was neither deleted while SQS could be reached nor lost with its consumer",
                    d.count,
                    d.consumer,
                    ms(d.held_until),
                    d.delete_sent.map(ms),
                    d.delete_reached_at.map(ms)
                ),
                None => String::new(),
            };
            v.push(format!(
                "{event}: message {from} recorded its effect and is in the DLQ{last}"
            ));
        }
    }
}

/// No external call open past the lease its attempt held as stored (its
/// claim's and extensions' `lease_until`, until its release): the lease is
/// enforced locally, a margin before the stored end, so a handler whose
/// extensions fail is interrupted before another consumer could take the
/// key (the `lease-not-enforced` mutant). Judged directly rather than by an
/// overlap, which needs a copy of the key to arrive meanwhile.
fn past_lease(e: &Evidence<'_>, v: &mut Vec<String>) {
    let Some(lease_ends) = &e.lease_ends else {
        return;
    };
    // A host that jumped beyond the margin keeps only the fencing promise
    // from its jump on: a lease it wrote before the jump ends, by its
    // clock set back, later than stored (campaign seed 1046660: a clock
    // set back 21 s mid-call). Its calls that ended before the jump are
    // judged as any other's.
    let jumped = jumped_beyond_margin(e);
    let after_jump = |c: &ApiCall| {
        jumped
            .as_ref()
            .is_some_and(|(host, at)| *host == c.consumer && c.end_ms.is_none_or(|end| end >= *at))
    };
    for c in judged_calls(e, &e.calls).iter().filter(|c| !after_jump(c)) {
        let Some(&lease_end) = lease_ends.get(&(c.event.clone(), c.attempt)) else {
            v.push(format!(
                "{}: call by {} under attempt {}, which holds no lease",
                c.event, c.consumer, c.attempt
            ));
            continue;
        };
        let end = c.end_ms.unwrap_or(u128::MAX);
        // (A call a pause stopped is judged until the pause began:
        // [`judged_calls`].)
        if end > lease_end {
            let end = c
                .end_ms
                .map_or("never".to_owned(), |ms| format!("at {ms} ms"));
            v.push(format!(
                "{}: call by {} (attempt {}) ended {end}, past its lease's stored end at {lease_end} ms",
                c.event, c.consumer, c.attempt
            ));
        }
    }
}

/// The host whose clock jumped beyond the margin, and when (ms from the
/// run's start), if one did.
fn jumped_beyond_margin(e: &Evidence<'_>) -> Option<(String, u128)> {
    let skewed = e.scenario.skew_beyond_margin.as_deref()?;
    e.scenario
        .consumers
        .iter()
        .find(|c| c.name == skewed)
        .and_then(|c| c.jump)
        .map(|j| (skewed.to_owned(), j.at.as_millis()))
}

/// A redelivery of a message whose record was `COMPLETED` before it was
/// received reads its record and is let go without running its handler,
/// unless that read failed: a failed read of its record by its consumer
/// between the delivery's arrival and its handler's start (a read that
/// failed before it arrived, or after its handler started, was another
/// delivery's, and excuses nothing here).
fn reruns(e: &Evidence<'_>, v: &mut Vec<String>) {
    // From when the delivery reached its consumer, which reads the record
    // after that (a record completed while a slow answer was on its way is
    // read as such by a correct consumer).
    let ms =
        |d: &crate::deliveries::Delivery| d.arrived.saturating_duration_since(e.start).as_millis();
    for (message, count, consumer, event, done_ms, started_ms) in &e.reruns {
        let Some(d) = e
            .deliveries
            .all_of(message)
            .into_iter()
            .find(|d| d.count == *count && &d.consumer == consumer)
        else {
            continue;
        };
        let pk = e.scenario.record_pk(event);
        let read_failed = e
            .failed_reads
            .iter()
            .any(|(c, p, at)| c == consumer && *p == pk && (ms(&d)..=*started_ms).contains(at));
        if *done_ms < ms(&d) && !read_failed {
            v.push(format!(
                "{event}: {consumer} ran the handler of {message} (receive {count}) again though its record was COMPLETED at {done_ms}ms, before that receive"
            ));
        }
    }
}

/// Every raw call at the API: one idempotency key per event (two keys for
/// one event would charge twice at any API), and no call for an event whose
/// record already said `COMPLETED` when it started.
fn external_calls(e: &Evidence<'_>, v: &mut Vec<String>) {
    let mut keys: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for c in &e.calls {
        keys.entry(c.event.as_str())
            .or_default()
            .insert(c.key.as_str());
        // Counted apart: [`late_skewed_calls`].
        if c.after_completed && !late_skewed(e, c) {
            v.push(format!(
                "{}: API called by {} at {}ms after its record said COMPLETED",
                c.event, c.consumer, c.start_ms
            ));
        }
    }
    // A handler never runs past its delivery: while its call is open, SQS
    // does not hand the same message to anyone (itself included) again.
    // Except where SQS delivers a message twice at once (standard queues
    // may: the model marks such a delivery as a concurrent duplicate): no
    // runtime can keep that from meeting an open call, so it is skipped.
    // (A call a pause stopped is judged until the pause began:
    // [`judged_calls`].)
    for c in &judged_calls(e, &e.calls) {
        let ms =
            |d: &crate::deliveries::Delivery| d.at.saturating_duration_since(e.start).as_millis();
        let again = e
            .deliveries
            .all_of(&c.message)
            .into_iter()
            .filter(|d| !e.twins.contains(&d.receipt))
            .find(|d| ms(d) > c.start_ms && c.end_ms.is_none_or(|end| ms(d) < end));
        if let Some(d) = again {
            v.push(format!(
                "{}: {}'s API call for {} (from {}ms) still open when SQS delivered it again to {} at {}ms (receive {}): a handler ran past its delivery",
                c.event, c.consumer, c.message, c.start_ms, d.consumer, ms(&d), d.count
            ));
        }
    }
    for (event, keys) in keys.into_iter().filter(|(_, k)| k.len() > 1) {
        v.push(format!(
            "{event}: {} different idempotency keys at the API",
            keys.len()
        ));
    }
}

/// The pause of `c`'s invocation that stopped it while it was open: a call
/// for one of a paused invocation's messages, by its host, started no later
/// than the pause began and open then. Its handler's lease and delivery may
/// run out while it cannot run (its heartbeat is paused too), and nothing
/// it does can keep them: as under a skew beyond the margin, the fencing
/// promise is the only one left. Such a call is judged as if it ended when
/// the pause began ([`judged_end`]): whatever it overlapped before that,
/// or a lease or delivery that ended before that, is still a violation;
/// what came after is counted apart ([`paused_calls`]). (No call of the
/// invocation starts inside the pause: one that does is another
/// invocation's, and judged in full.)
fn stopped_by(e: &Evidence<'_>, c: &ApiCall) -> Option<u128> {
    e.pauses
        .iter()
        .filter(|p| p.host == c.consumer && p.messages.contains(&c.message))
        .filter(|p| c.start_ms <= p.from_ms && c.end_ms.is_none_or(|end| end > p.from_ms))
        .map(|p| p.from_ms)
        .min()
}

/// When a call is judged to have ended: when a pause stopped it
/// ([`stopped_by`]), else its end.
fn judged_end(e: &Evidence<'_>, c: &ApiCall) -> Option<u128> {
    stopped_by(e, c).or(c.end_ms)
}

/// The calls judged for overlaps, leases and deliveries: each as
/// [`judged_end`] says. (A call started as the invocation resumed is
/// judged in full: the pause let its lease end, and the runtime must not
/// start one after that.)
fn judged_calls<'c>(
    e: &Evidence<'_>,
    calls: impl IntoIterator<Item = &'c ApiCall>,
) -> Vec<ApiCall> {
    calls
        .into_iter()
        .map(|c| ApiCall {
            end_ms: judged_end(e, c),
            ..c.clone()
        })
        .collect()
}

/// The API calls process pauses stopped, counted apart ([`stopped_by`]).
pub fn paused_calls(e: &Evidence<'_>) -> usize {
    e.calls
        .iter()
        .filter(|c| stopped_by(e, c).is_some())
        .count()
}

/// Overlapping calls of one key at the API, in a run with a host's clock
/// off by more than the lease margin, in the direction that skew can cause
/// ([`skew_explains`]): the lease promises nothing there (two hosts may
/// both take it for theirs), so they are counted, not violations.
pub fn overlapping(e: &Evidence<'_>) -> usize {
    if e.scenario.skew_beyond_margin.is_none() || !e.scenario.calls() {
        return 0;
    }
    let all = judged_calls(e, &e.calls);
    let skewed = overlap_pairs(&all)
        .into_iter()
        .filter(|(o, c)| skewed_call(e, o) || skewed_call(e, c))
        .filter(|(o, c)| skew_explains(e, o, c))
        .count();
    skewed + skewed_cross_path(e).len() + late_skewed_calls(e)
}

/// Overlaps of one key where one call is the skewed host's
/// ([`skewed_call`]) in the direction its skew cannot cause: violations.
/// (Those of two calls within the margin are [`overlaps`]' to report.)
fn skewed_overlaps(e: &Evidence<'_>, v: &mut Vec<String>) {
    if e.scenario.skew_beyond_margin.is_none() {
        return;
    }
    let all = judged_calls(e, &e.calls);
    for (o, c) in overlap_pairs(&all) {
        if (skewed_call(e, o) || skewed_call(e, c)) && !skew_explains(e, o, c) {
            v.push(format!(
                "{}: API called by {} at {}ms while {}'s call (from {}ms) was still open, the other way round from what the skew of {} can cause",
                c.event,
                c.consumer,
                c.start_ms,
                o.consumer,
                o.start_ms,
                e.scenario.skew_beyond_margin.as_deref().unwrap_or_default()
            ));
        }
    }
}

/// A call of the host whose clock is off beyond the margin, made while it
/// was (a host that got there by a jump was within the margin before it:
/// its calls that ended before the jump are judged as any other's).
fn skewed_call(e: &Evidence<'_>, c: &ApiCall) -> bool {
    let Some(skewed) = e.scenario.skew_beyond_margin.as_deref() else {
        return false;
    };
    let jumped_at_ms = e
        .scenario
        .consumers
        .iter()
        .find(|h| h.name == skewed)
        .and_then(|h| h.jump)
        .map(|j| j.at.as_millis());
    c.consumer == skewed && !jumped_at_ms.is_some_and(|at| c.end_ms.is_some_and(|end| end < at))
}

/// Whether the skewed host's clock explains `later` starting while
/// `earlier` was open (one of them the skewed host's, [`skewed_call`]). A
/// clock that runs ahead takes a live lease for over: the skewed host is
/// the one that calls later, over another's open call (or over one of its
/// own from before its jump, its lease written on the clock before).
/// A clock that runs behind writes a lease that ends sooner in true time
/// than by its clock: another host takes the key while the skewed host's
/// call is still open, so the skewed host's call is the earlier one and
/// the later one is another host's. The other way round, the overlap is a
/// lease or fencing bug, and fails.
fn skew_explains(e: &Evidence<'_>, earlier: &ApiCall, later: &ApiCall) -> bool {
    let Some(skewed) = e.scenario.skew_beyond_margin.as_deref() else {
        return false;
    };
    let ahead = e
        .scenario
        .consumers
        .iter()
        .find(|c| c.name == skewed)
        .is_some_and(|c| c.skew_ms > 0);
    if ahead {
        skewed_call(e, later) && !skewed_call(e, earlier)
    } else {
        skewed_call(e, earlier) && later.consumer != skewed
    }
}

/// Every pair of calls of one key where the later-started one started
/// while the earlier one was open: (earlier, later).
fn overlap_pairs(calls: &[ApiCall]) -> Vec<(&ApiCall, &ApiCall)> {
    let mut by_key: BTreeMap<&str, Vec<&ApiCall>> = BTreeMap::new();
    for c in calls {
        by_key.entry(&c.key).or_default().push(c);
    }
    let mut pairs = Vec::new();
    for calls in by_key.values_mut() {
        calls.sort_by_key(|c| c.start_ms);
        for (i, o) in calls.iter().enumerate() {
            for c in &calls[i + 1..] {
                if c.start_ms < o.end_ms.unwrap_or(u128::MAX) {
                    pairs.push((*o, *c));
                }
            }
        }
    }
    pairs
}

/// The host whose clock runs behind by more than the lease margin, if one
/// was drawn: its lease looks alive to it after it ended in true time.
fn skewed_behind<'e>(e: &'e Evidence<'_>) -> Option<&'e str> {
    let skewed = e.scenario.skew_beyond_margin.as_deref()?;
    e.scenario
        .consumers
        .iter()
        .any(|c| c.name == skewed && c.skew_ms < 0)
        .then_some(skewed)
}

/// An API call the host whose clock runs behind beyond the margin started
/// after its event's record said `COMPLETED`, under an attempt that a later
/// one took over (a call of that later attempt started before it, or its
/// lease is in the store's history): the skewed host's lease ended earlier
/// in true time than by its clock, the later attempt completed, and it
/// called on (seed 387760: 25.6 s behind, a call 1.6 s after the other's
/// completion). The lease promises nothing there; the idempotency key is
/// the same (checked), so an API that honours it charges once. A call
/// under the attempt that completed, or from any other host, still fails.
fn late_skewed(e: &Evidence<'_>, c: &ApiCall) -> bool {
    let taken_over = e
        .calls
        .iter()
        .any(|o| o.event == c.event && o.attempt > c.attempt && o.start_ms < c.start_ms)
        || e.lease_ends.as_ref().is_some_and(|l| {
            l.keys()
                .any(|(event, attempt)| *event == c.event && *attempt > c.attempt)
        });
    c.after_completed && skewed_behind(e) == Some(c.consumer.as_str()) && taken_over
}

/// The calls [`late_skewed`] counts.
fn late_skewed_calls(e: &Evidence<'_>) -> usize {
    e.calls.iter().filter(|c| late_skewed(e, c)).count()
}

/// Where fast-path and claim-path consumers share records under a skew
/// beyond the margin: events with a ledger row committed while a claim-path
/// call of the same event by another consumer was open, one of the two the
/// skewed host. The other's lease looked over to one of them while it was
/// not (the lease promise is gone there), so both applied; fencing cannot
/// undo a call already made. Counted with the overlapping calls (the
/// charge is left out of the event's applications); the rows are still
/// required once, like every other check (seed 118691).
pub fn skewed_cross_path(e: &Evidence<'_>) -> BTreeSet<String> {
    let Some(skewed) = e.scenario.skew_beyond_margin.as_deref() else {
        return BTreeSet::new();
    };
    if !e.scenario.mixed() {
        return BTreeSet::new();
    }
    // Only the skew's direction explains it: a fast-path host whose clock
    // runs ahead takes a live lease for over, and a claim-path host whose
    // clock runs behind writes a lease that ends early in true time. The
    // other way round the overlap is a lease or fencing bug, and fails.
    let ahead = e
        .scenario
        .consumers
        .iter()
        .find(|c| c.name == skewed)
        .is_some_and(|c| c.skew_ms > 0);
    e.rows
        .iter()
        .filter(|r| {
            e.calls.iter().any(|c| {
                c.event == r.event
                    && c.consumer != r.by
                    && ((r.by == skewed && ahead) || (c.consumer == skewed && !ahead))
                    && c.start_ms <= r.at_ms
                    && c.end_ms.is_none_or(|end| end > r.at_ms)
            })
        })
        .map(|r| r.event.clone())
        .collect()
}

/// The API calls of every host whose clock is within the margin (all of
/// them unless a host's skew beyond the margin was drawn), judged as
/// [`judged_calls`] says.
fn unskewed_calls(e: &Evidence<'_>) -> Vec<ApiCall> {
    let skewed = e.scenario.skew_beyond_margin.as_deref();
    // A host that got beyond the margin by a jump was within it until then:
    // its calls that ended before the jump are judged as any other's.
    let jumped_at_ms = e
        .scenario
        .consumers
        .iter()
        .find(|c| Some(c.name.as_str()) == skewed)
        .and_then(|c| c.jump)
        .map(|j| j.at.as_millis());
    let calls = e.calls.iter().filter(|c| {
        Some(c.consumer.as_str()) != skewed
            || jumped_at_ms.is_some_and(|at| c.end_ms.is_some_and(|end| end < at))
    });
    judged_calls(e, calls)
}

/// The API never called by two live attempts of one key at once.
fn overlaps(calls: &[ApiCall], v: &mut Vec<String>) {
    let mut by_key: BTreeMap<&str, Vec<&ApiCall>> = BTreeMap::new();
    for c in calls {
        by_key.entry(&c.key).or_default().push(c);
    }
    for calls in by_key.values_mut() {
        calls.sort_by_key(|c| c.start_ms);
        // The open call that ends last so far.
        let mut open: Option<&ApiCall> = None;
        for c in calls.iter() {
            if let Some(o) = open
                && c.start_ms < o.end_ms.unwrap_or(u128::MAX)
            {
                v.push(format!(
                    "{}: API called by {} at {}ms while {}'s call (from {}ms) was still open",
                    c.event, c.consumer, c.start_ms, o.consumer, o.start_ms
                ));
            }
            let ends_later =
                open.is_none_or(|o| c.end_ms.unwrap_or(u128::MAX) > o.end_ms.unwrap_or(u128::MAX));
            if ends_later {
                open = Some(c);
            }
        }
    }
}
