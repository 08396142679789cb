//! The checker: after a run, from the history (staged writes in commit order,
//! the API's calls) and the final state (dedup records, queues), every way the
//! promise can be broken.

use std::collections::{BTreeMap, BTreeSet};

use sqs_once::Status;
use sqs_once::queue::memory::StoredMessage;

use crate::hosts::HostReport;
use crate::world::{ApiCall, Kind, Scenario};

/// What the checker reads.
pub struct Evidence<'a> {
    /// The run's scenario.
    pub scenario: &'a Scenario,
    /// Events some send of which was accepted.
    pub accepted: &'a BTreeSet<String>,
    /// Ledger rows' events in commit order (staged handler).
    pub rows: Vec<String>,
    /// Every API call (external handler).
    pub calls: Vec<ApiCall>,
    /// Times charged, by event.
    pub charged: BTreeMap<String, u32>,
    /// Dedup records: event -> status.
    pub records: BTreeMap<String, Status>,
    /// Records left `IN_PROGRESS`, described.
    pub unfinished: BTreeMap<String, String>,
    /// The DLQ's messages.
    pub dlq: Vec<StoredMessage>,
    /// What is left in the source queue.
    pub left: Vec<StoredMessage>,
    /// The hosts' reports.
    pub hosts: &'a [HostReport],
}

/// The event id in a body.
fn event_of(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get("id")?.as_str().map(str::to_owned)
}

/// Every violation found, in words.
pub fn check(e: &Evidence<'_>) -> Vec<String> {
    let mut v = Vec::new();
    let applied = applied(e, &mut v);
    order(e, &applied, &mut v);
    parked_or_applied(e, &applied, &mut v);
    if e.scenario.kind == Kind::External {
        overlaps(&e.calls, &mut v);
    }
    for (event, what) in &e.unfinished {
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

/// Events applied, in the order of their first application; flags effects
/// applied more than once.
fn applied(e: &Evidence<'_>, v: &mut Vec<String>) -> Vec<String> {
    let mut count: BTreeMap<&str, u32> = BTreeMap::new();
    let mut first = Vec::new();
    match e.scenario.kind {
        Kind::Staged => {
            for row in &e.rows {
                let n = count.entry(row).or_default();
                *n += 1;
                if *n == 1 {
                    first.push(row.clone());
                }
            }
        }
        Kind::External => {
            let mut calls: Vec<&ApiCall> = e.calls.iter().collect();
            calls.sort_by_key(|c| c.start_ms);
            for c in calls {
                if !count.contains_key(c.event.as_str()) {
                    first.push(c.event.clone());
                }
                count.insert(&c.event, e.charged.get(&c.event).copied().unwrap_or(0));
            }
            // A charge is an effect: its record must say so.
            for ev in &first {
                let status = e.records.get(ev);
                if status != Some(&Status::Completed) {
                    v.push(format!("{ev}: charged but its record is {status:?}"));
                }
            }
        }
    }
    for (event, n) in count {
        if n > 1 {
            v.push(format!("{event}: effect applied {n} times"));
        }
    }
    first
}

/// FIFO: within each group, events applied in send order.
fn order(e: &Evidence<'_>, applied: &[String], v: &mut Vec<String>) {
    if !e.scenario.fifo {
        return;
    }
    let spec: BTreeMap<&str, (&str, u64)> = e
        .scenario
        .events
        .iter()
        .map(|ev| (ev.id.as_str(), (ev.group.as_str(), ev.seq)))
        .collect();
    let mut last: BTreeMap<&str, u64> = BTreeMap::new();
    for id in applied {
        let Some((group, seq)) = spec.get(id.as_str()) else {
            continue;
        };
        if let Some(prev) = last.insert(group, *seq)
            && prev > *seq
        {
            v.push(format!(
                "{id}: applied after evt-{prev:04} of group {group} (FIFO order)"
            ));
        }
    }
}

/// Every accepted event applied or parked, never both, never lost; nothing
/// refused applied; nothing left in the queue.
fn parked_or_applied(e: &Evidence<'_>, applied: &[String], v: &mut Vec<String>) {
    let applied: BTreeSet<&str> = applied.iter().map(String::as_str).collect();
    let parked: BTreeSet<String> = e.dlq.iter().filter_map(|m| event_of(&m.body)).collect();
    for ev in &e.scenario.events {
        let id = ev.id.as_str();
        let (is_applied, is_parked) = (applied.contains(id), parked.contains(id));
        match (e.accepted.contains(id), is_applied, is_parked) {
            (false, true, _) => v.push(format!("{id}: applied but never accepted by SQS")),
            (true, false, false) => v.push(format!("{id}: lost (neither applied nor parked)")),
            (true, true, true) => v.push(format!("{id}: applied and in the DLQ")),
            _ => {}
        }
        if is_applied && ev.permanent {
            v.push(format!("{id}: a permanent failure was applied"));
        }
    }
    for m in &e.dlq {
        let Some(id) = event_of(&m.body) else {
            continue;
        };
        let reason = m.attributes.contains_key(sqs_once::queue::REASON_ATTRIBUTE);
        let permanent = e
            .scenario
            .events
            .iter()
            .any(|ev| ev.id == id && ev.permanent);
        // A copy near the DLQ's size limit keeps its dedup key first and has
        // no room left for the reason (DESIGN.md, "Parking"): not a violation.
        let room = m.body.len() + 512 <= crate::world::MAX_MESSAGE_BYTES;
        if permanent && !reason && room {
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
