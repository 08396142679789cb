//! Splitting a batch into lanes, shared by both runtimes.
//!
//! The messages of one receive (or one Lambda event) run in lanes: one message
//! at a time within a lane, in the order received, and lanes in parallel. On a
//! FIFO queue a lane is a message group, so order holds within it. On a
//! standard queue a lane is a dedup key, so a second copy of one key in the same
//! batch runs after the first and is skipped as a duplicate instead of being
//! found in flight and sent back.

use std::collections::HashMap;
use std::time::Duration;

use crate::Message;
use crate::protocol::config::ProcessorConfig;

/// The lane a message belongs to: its group on a FIFO queue, else its dedup
/// key (as read by [`with_key`], or read now); `None` when it has none (it then runs in a
/// lane of its own). A batch is split on one kind only (`fifo` is the
/// queue's), so the name needs no prefix to keep groups and keys apart.
pub(crate) fn lane_of(message: &Message, fifo: bool, keys: &ProcessorConfig) -> Option<String> {
    if fifo {
        Some(message.group_id().unwrap_or_default().to_owned())
    } else if let Some(key) = message.pre_read_key(keys.identity()) {
        Some(key.to_owned())
    } else {
        keys.dedup_key(message).ok()
    }
}

/// `message` with its dedup key read (when it has one), for its lane and
/// for the processor, which takes a key already read as is when it would
/// read the same message (no large payload, no envelope to open first).
#[cfg(feature = "poller")]
pub(crate) fn with_key(mut message: Message, keys: &ProcessorConfig) -> Message {
    if let Ok(key) = keys.dedup_key(&message) {
        message.set_pre_read_key(key, keys.identity());
    }
    message
}

/// After a FIFO message failed with a retry delay `after` while more of its
/// group wait behind it: the delay to set again on the failed message (`Some`
/// when its own is too short: it waits at least 2 s), and the delay for the
/// rest, a second less. SQS blocks the group while any of it is in flight;
/// an emulator that re-opens a group whenever one of its messages reappears
/// then still hands the group out in order. Both runtimes, and a receive given
/// back at shutdown (as if its first message had failed with no delay), keep
/// this rule: a held-back message never reappears after an earlier one.
pub(crate) fn hold_behind(after: Duration, more: bool) -> (Option<Duration>, Duration) {
    const AT_LEAST: Duration = Duration::from_secs(2);
    let again = (more && after < AT_LEAST).then_some(AT_LEAST);
    let held = again.unwrap_or(after);
    (again, held.saturating_sub(Duration::from_secs(1)))
}

/// Groups `items` into lanes by `lane` (items without one get a lane each),
/// keeping the order of first appearance and the order within each lane.
pub(crate) fn split<T>(items: Vec<T>, lane: impl Fn(&T) -> Option<String>) -> Vec<Vec<T>> {
    let mut lanes: Vec<Vec<T>> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for item in items {
        match lane(&item) {
            Some(name) => {
                let i = *index.entry(name).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[i].push(item);
            }
            None => lanes.push(vec![item]),
        }
    }
    lanes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_lanes_are_groups_in_order_and_standard_lanes_are_keys() {
        let mut keys = ProcessorConfig::new("c");
        keys.key_source = "json:/id".parse().unwrap();
        let m = |id: &str, body: &str, group: &str| Message::new(id, body).with_group_id(group);
        let batch = vec![
            m("1", r#"{"id":"a"}"#, "g1"),
            m("2", r#"{"id":"b"}"#, "g2"),
            m("3", r#"{"id":"a"}"#, "g2"),
            m("4", "not json", "g1"),
        ];
        let ids = |lanes: Vec<Vec<Message>>| -> Vec<Vec<String>> {
            lanes
                .into_iter()
                .map(|l| l.iter().map(|m| m.id().to_owned()).collect())
                .collect()
        };
        let fifo = split(batch.clone(), |m| lane_of(m, true, &keys));
        assert_eq!(ids(fifo), [vec!["1", "4"], vec!["2", "3"]]);
        let standard = split(batch, |m| lane_of(m, false, &keys));
        assert_eq!(ids(standard), [vec!["1", "3"], vec!["2"], vec!["4"]]);
    }

    #[test]
    fn the_rest_of_a_held_group_comes_back_a_second_before_the_failed_message() {
        let s = Duration::from_secs;
        assert_eq!(hold_behind(Duration::ZERO, true), (Some(s(2)), s(1)));
        assert_eq!(hold_behind(s(8), true), (None, s(7)));
        assert_eq!(hold_behind(Duration::ZERO, false), (None, Duration::ZERO));
    }
}
