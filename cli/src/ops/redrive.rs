//! The DLQ's depth, and moving parked messages back to their source queue.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
    SendMessageBatchRequestEntry,
};

use super::error::*;
use sqs_once::key::{CarrySecret, DEDUP_KEY_ATTRIBUTE, SENDER_ATTRIBUTE, carry_key, carry_sender};
use sqs_once::parking::{MESSAGE_ID_ATTRIBUTE, REASON_ATTRIBUTE, SOURCE_QUEUE_ATTRIBUTE};

/// A queue's approximate counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages available.
    pub visible: u64,
    /// Received and not yet deleted or back.
    pub in_flight: u64,
    /// Delayed.
    pub delayed: u64,
}

/// Reads a queue's approximate counts.
pub async fn queue_depth(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<QueueDepth, OpsError> {
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .unwrap_or_default();
    let n = |a: QueueAttributeName| attrs.get(&a).and_then(|v| v.parse().ok()).unwrap_or(0);
    Ok(QueueDepth {
        visible: n(QueueAttributeName::ApproximateNumberOfMessages),
        in_flight: n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        delayed: n(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
    })
}

/// What [`redrive`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Redriven {
    /// Messages sent back to the source queue (and deleted from the DLQ).
    pub moved: u64,
    /// Moved by SQS's own message move task (else by receive/send/delete).
    pub by_move_task: bool,
    /// Dry run: the messages that would move, as (body, reason), at most ten.
    pub preview: Vec<(String, String)>,
    /// The DLQ's approximate depth (`ApproximateNumberOfMessages`) when the
    /// run started (dry run: the messages that would move).
    pub waiting: u64,
    /// The most this run would take from the DLQ: [`Self::waiting`], or
    /// `--max` when smaller. Messages parked again while it runs are left
    /// for the next run rather than moved again and again.
    pub limit: u64,
    /// Sent to the source but not deleted from the DLQ: a copy is in both
    /// queues (the DLQ's comes back after 60 s; its dedup key makes a second
    /// redrive of it a duplicate, not a second effect).
    pub in_both: Vec<String>,
    /// Not sent (left in the DLQ, visible again after 60 s), with the reason.
    pub not_sent: Vec<(String, String)>,
    /// Sent without a carried dedup key, as they had no room for one (10
    /// message attributes already, or the source's size limit) or were
    /// parked without one: under `message-id` keys each runs as a new message.
    pub without_key: Vec<String>,
    /// Left in the DLQ: parked from, or moved by the redrive policy of,
    /// another queue that shares it.
    pub other_queues: Vec<String>,
}

/// How [`redrive`] runs.
#[derive(Debug, Clone, Default)]
pub struct RedriveOptions {
    /// Move at most this many (receive/send/delete; else the move task where available).
    pub max: Option<u64>,
    /// Move nothing; show what would move.
    pub dry_run: bool,
    /// Move even when the source queue's redrive policy does not name the DLQ.
    pub skip_redrive_check: bool,
    /// Use SQS's message move task (standard queues, no `max`): fast, but it
    /// gives every message a new id and adds no attribute, so a message SQS's
    /// redrive policy moved (rather than sqs-once parked) loses its key under
    /// `message-id` keys and runs again.
    pub move_task: bool,
    /// Seals the key each copy carries (`SQS_ONCE_CARRY_SECRET`, the
    /// consumers' secret). Without it copies carry no key: under `message-id`
    /// keys each is processed under a new one.
    pub carry_secret: Option<CarrySecret>,
}

/// The source queue's settings redrive needs: its maximum message size (the
/// cap of a send batch's total), after checking that its redrive policy names
/// `dlq_url` (unless `skip`).
pub(super) async fn source_settings(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    skip: bool,
) -> Result<usize, OpsError> {
    let attrs = sqs
        .get_queue_attributes()
        .queue_url(source_url)
        .attribute_names(QueueAttributeName::RedrivePolicy)
        .attribute_names(QueueAttributeName::MaximumMessageSize)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: source_url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .unwrap_or_default();
    let max_size = attrs
        .get(&QueueAttributeName::MaximumMessageSize)
        .and_then(|v| v.parse().ok())
        .unwrap_or(262_144);
    if skip {
        return Ok(max_size);
    }
    let dlq_arn = queue_arn(sqs, dlq_url).await?;
    let target = attrs
        .get(&QueueAttributeName::RedrivePolicy)
        .and_then(|p| sqs_once::queue::dead_letter_target_arn(p));
    match target {
        Some(t) if t == dlq_arn => Ok(max_size),
        found => Err(OpsError::NotItsDlq {
            source_url: source_url.to_owned(),
            found,
            dlq_url: dlq_url.to_owned(),
            dlq_arn,
        }),
    }
}

/// Moves the messages in `dlq_url` back to `source_url`, after checking that
/// the source's redrive policy names the DLQ: at most as many as the DLQ held
/// when the run started (its approximate depth), and at most `max`
/// ([`redrive_limit`]). Each message is sent
/// to the source with its body and every message attribute as it is (data types
/// included, and the `sqs_once_*` ones parking added: the dedup key among them
/// keeps a copy a duplicate), in batches within the source's maximum message
/// size, and only then deleted from the DLQ: a crash in between leaves a copy
/// in both queues (reported in [`Redriven::in_both`]), never none. `dry_run`
/// moves nothing and shows what would move.
pub async fn redrive(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    options: &RedriveOptions,
    mut progress: impl FnMut(u64),
) -> Result<Redriven, OpsError> {
    let max_size = source_settings(sqs, dlq_url, source_url, options.skip_redrive_check).await?;
    if options.dry_run {
        return preview(sqs, dlq_url).await;
    }
    let mut report = Redriven::default();
    let fifo = source_url.ends_with(".fifo");
    // Only when asked (see `RedriveOptions::move_task`), and where the
    // endpoint offers it; else we move them ourselves.
    if options.move_task
        && options.max.is_none()
        && !fifo
        && let Some(moved) = move_task(sqs, dlq_url, source_url, &mut progress).await?
    {
        report.moved = moved;
        report.by_move_task = true;
        return Ok(report);
    }
    report.waiting = queue_depth(sqs, dlq_url).await?.visible;
    report.limit = redrive_limit(report.waiting, options.max);
    let mut taken = 0;
    let mut left = Vec::new();
    while let Some(want) = next_receive(report.limit, taken) {
        let got = sqs
            .receive_message()
            .queue_url(dlq_url)
            .max_number_of_messages(want)
            .wait_time_seconds(1)
            .visibility_timeout(60)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .map_err(|e| OpsError::Receive {
                queue: dlq_url.to_owned(),
                source: e.into(),
            })?
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            break;
        }
        // Other queues' copies stay invisible while the run goes on and are
        // not counted (a DLQ that holds mostly theirs still gives up all of
        // this queue's in one run), then are made visible again.
        let (got, others): (Vec<Message>, Vec<Message>) = got
            .into_iter()
            .partition(|m| !from_another_queue(m, source_url));
        note_other_queues(&others, &mut report);
        left.extend(others);
        taken += got.len() as u64;
        let got: Vec<Message> = got
            .into_iter()
            .filter_map(|m| carrying_key(m, max_size, options.carry_secret.as_ref(), &mut report))
            .collect();
        for batch in size_batches(&got, max_size) {
            move_batch(sqs, dlq_url, source_url, fifo, batch, &mut report).await?;
            progress(report.moved);
        }
    }
    release(sqs, dlq_url, &left).await;
    Ok(report)
}

/// Whether DLQ message `m` came from a queue other than `source_url`: parked
/// from there (`sqs_once_source_queue`) or moved from there by its redrive
/// policy (SQS's `DeadLetterQueueSourceArn`).
fn from_another_queue(m: &Message, source_url: &str) -> bool {
    let parked_from = m
        .message_attributes()
        .and_then(|a| a.get(SOURCE_QUEUE_ATTRIBUTE))
        .and_then(|v| v.string_value());
    let moved_from = m
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::DeadLetterQueueSourceArn))
        .map(String::as_str);
    sqs_once::parking::from_another_queue(parked_from, moved_from, source_url)
}

/// Makes `messages` visible again in the DLQ at once (a failed change
/// leaves them to their 60 s).
async fn release(sqs: &aws_sdk_sqs::Client, dlq_url: &str, messages: &[Message]) {
    for receipt in messages.iter().filter_map(Message::receipt_handle) {
        let _ = sqs
            .change_message_visibility()
            .queue_url(dlq_url)
            .receipt_handle(receipt)
            .visibility_timeout(0)
            .send()
            .await;
    }
}

/// Notes the messages of other queues, left in the DLQ for a redrive to
/// their own.
fn note_other_queues(others: &[Message], report: &mut Redriven) {
    for m in others {
        let id = m.message_id().unwrap_or_default().to_owned();
        if !report.other_queues.contains(&id) {
            report.other_queues.push(id);
        }
    }
}

/// The most one redrive takes from the DLQ: what was in it when the run
/// started (`depth`, approximate), or `max` when smaller. Without this bound,
/// a message the consumer parks again while the run goes on (still failing)
/// would be received and moved again, about once a second, until the run is
/// stopped.
pub fn redrive_limit(depth: u64, max: Option<u64>) -> u64 {
    max.map_or(depth, |max| max.min(depth))
}

/// How many messages the next receive of a redrive asks for, having taken
/// `taken` of at most `limit` (10 at most); `None` once the limit is reached.
pub fn next_receive(limit: u64, taken: u64) -> Option<i32> {
    let left = limit.saturating_sub(taken);
    (left > 0).then(|| i32::try_from(left.min(10)).unwrap_or(10))
}

/// `m` carrying the dedup key a `message-id` consumer gave it, sealed under
/// `secret` (see [`CarrySecret`]). A copy sqs-once parked carries its key
/// already (or, when it had no room for it, the first delivery's id); a
/// message SQS's redrive policy moved carries nothing but keeps its message
/// id in the DLQ (the key such a consumer used), while the copy sent back
/// gets a new one: without the key its effect, already made or not, would be
/// made again under a new key. A key or first id that does not verify (a
/// producer's) is not honoured: the key is replaced by one from the DLQ
/// message's own id. Other key sources ignore the attribute. A message with
/// no room left for it (10 attributes, or the source's `max_size`), or with
/// no secret to seal it, is sent as it is and reported.
pub(super) fn carrying_key(
    m: Message,
    max_size: usize,
    secret: Option<&CarrySecret>,
    report: &mut Redriven,
) -> Option<Message> {
    let m = carrying_key_alone(m, max_size, secret, report)?;
    Some(match secret {
        Some(secret) => carrying_sender(m, max_size, secret),
        None => m,
    })
}

/// `m` carrying who sent it first, sealed under `secret`: the copy sent back
/// is SQS's from this redrive's identity, so a key scoped to the sender
/// (`SQS_ONCE_KEY_SCOPE=sender`) would change. A sender a parked copy
/// carries that verifies is sealed again under the first secret; else, for
/// a message SQS's redrive policy moved (no parking reason), one is added
/// from its own `SenderId` (SQS keeps the producer's through such a move),
/// where there is room. One that does not verify is left as it is.
fn carrying_sender(mut m: Message, max_size: usize, secret: &CarrySecret) -> Message {
    let body = m.body.clone().unwrap_or_default();
    let carried = m
        .message_attributes
        .as_ref()
        .and_then(|a| a.get(SENDER_ATTRIBUTE))
        .and_then(|v| v.string_value())
        .and_then(|v| secret.open(SENDER_ATTRIBUTE, &body, v))
        .map(str::to_owned);
    let has = |name: &str| {
        m.message_attributes
            .as_ref()
            .is_some_and(|a| a.contains_key(name))
    };
    // One that does not verify under this secret may under the consumers':
    // left as it is. A copy a consumer parked (its reason) is SQS's from
    // that consumer: its own SenderId is not the producer's.
    if carried.is_none() && (has(SENDER_ATTRIBUTE) || has(REASON_ATTRIBUTE)) {
        return m;
    }
    let sender = carried.or_else(|| {
        m.attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::SenderId))
            .cloned()
    });
    let Some(sender) = sender.filter(|s| !s.is_empty()) else {
        return m;
    };
    let sealed = carry_sender(secret, &body, &sender);
    if let Some(attrs) = m.message_attributes.as_mut() {
        attrs.remove(SENDER_ATTRIBUTE);
    }
    let size = message_size(&m);
    let attrs = m.message_attributes.get_or_insert_with(HashMap::new);
    if attrs.len() < 10 && size + SENDER_ATTRIBUTE.len() + "String".len() + sealed.len() <= max_size
    {
        attrs.insert(
            SENDER_ATTRIBUTE.to_owned(),
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(sealed)
                .build()
                .expect("complete attribute"),
        );
    }
    m
}

/// [`carrying_key`]'s key alone.
fn carrying_key_alone(
    mut m: Message,
    max_size: usize,
    secret: Option<&CarrySecret>,
    report: &mut Redriven,
) -> Option<Message> {
    let body = m.body.clone().unwrap_or_default();
    let id = m.message_id.clone().unwrap_or_default();
    let sealed = |name: &str| {
        let value = m.message_attributes.as_ref()?.get(name)?.string_value()?;
        secret?.open(name, &body, value).map(str::to_owned)
    };
    if let (Some(key), Some(secret)) = (sealed(DEDUP_KEY_ATTRIBUTE), secret) {
        // Sealed again under the first secret (the same length), so a copy
        // sealed under a secret being rotated out stays honoured.
        let resealed = carry_key(secret, &body, &key);
        if let Some(attrs) = m.message_attributes.as_mut() {
            attrs.insert(
                DEDUP_KEY_ATTRIBUTE.to_owned(),
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(resealed)
                    .build()
                    .expect("complete attribute"),
            );
        }
        return Some(m);
    }
    if secret.is_some() && parked_under_another_secret(&m) {
        // Replacing its key would run it under a new one: left where it is.
        report.not_sent.push((
            id,
            "parked by sqs-once with a key sealed under another secret than this redrive's (give the consumers' secret: --carry-secret, or --table for the one kept in their table)".into(),
        ));
        return None;
    }
    let original = sealed(MESSAGE_ID_ATTRIBUTE).unwrap_or_else(|| id.clone());
    let Some(secret) = secret else {
        report.without_key.push(id);
        return Some(m);
    };
    if let Some(attrs) = m.message_attributes.as_mut() {
        attrs.remove(DEDUP_KEY_ATTRIBUTE);
    }
    let size = message_size(&m);
    let attrs = m.message_attributes.get_or_insert_with(HashMap::new);
    let key = (!original.is_empty()).then(|| carry_key(secret, &body, &original));
    let fits = |key: &String| {
        attrs.len() < 10
            && size + DEDUP_KEY_ATTRIBUTE.len() + "String".len() + key.len() <= max_size
    };
    match key {
        Some(key) if fits(&key) => {
            attrs.insert(
                DEDUP_KEY_ATTRIBUTE.to_owned(),
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(key)
                    .build()
                    .expect("complete attribute"),
            );
        }
        _ => report.without_key.push(id),
    }
    Some(m)
}

/// Whether `m` is a copy sqs-once parked (its reason, and no SQS move
/// behind it) that carries a sealed key or first id (`{tag}:{value}`, the
/// tag 64 hex digits; a consumer without a secret parks its first id
/// unsealed, for people to read): one that did not verify was sealed under
/// another secret (a producer's forgery cannot be told from it, and is
/// left too, never given a key).
fn parked_under_another_secret(m: &Message) -> bool {
    let attrs = m.message_attributes();
    let sealed = |name: &str| {
        attrs
            .and_then(|a| a.get(name))
            .and_then(|v| v.string_value())
            .and_then(|v| v.split_once(':'))
            .is_some_and(|(tag, _)| tag.len() == 64 && tag.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    let has = |name: &str| attrs.is_some_and(|a| a.contains_key(name));
    let moved_by_sqs = m
        .attributes()
        .is_some_and(|a| a.contains_key(&MessageSystemAttributeName::DeadLetterQueueSourceArn));
    has(REASON_ATTRIBUTE)
        && !moved_by_sqs
        && (sealed(DEDUP_KEY_ATTRIBUTE) || sealed(MESSAGE_ID_ATTRIBUTE))
}

/// The DLQ's depth and its first messages (peeked: visible again at once).
pub(super) async fn preview(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
) -> Result<Redriven, OpsError> {
    let mut report = Redriven {
        waiting: queue_depth(sqs, dlq_url).await?.visible,
        ..Redriven::default()
    };
    let peek = sqs
        .receive_message()
        .queue_url(dlq_url)
        .max_number_of_messages(10)
        .visibility_timeout(0)
        .message_attribute_names("All")
        .send()
        .await
        .map_err(|e| OpsError::Receive {
            queue: dlq_url.to_owned(),
            source: e.into(),
        })?;
    report.preview = peek
        .messages()
        .iter()
        .map(|m| {
            let reason = m
                .message_attributes()
                .and_then(|a| a.get(REASON_ATTRIBUTE))
                .and_then(|v| v.string_value())
                .unwrap_or("(no reason recorded)");
            (m.body().unwrap_or_default().to_owned(), reason.to_owned())
        })
        .collect();
    Ok(report)
}

/// A message's size as SQS counts it against the limit: the body, and each
/// attribute's name, data type and value.
pub fn message_size(m: &Message) -> usize {
    m.body().map_or(0, str::len)
        + m.message_attributes()
            .into_iter()
            .flatten()
            .map(|(k, v)| {
                k.len()
                    + v.data_type().len()
                    + v.string_value().map_or(0, str::len)
                    + v.binary_value().map_or(0, |b| b.as_ref().len())
            })
            .sum::<usize>()
}

/// The messages in order, in batches of at most ten whose total size is at most
/// `max_size` (a message larger than that alone is a batch of one: its send
/// fails and it stays in the DLQ).
pub fn size_batches(messages: &[Message], max_size: usize) -> Vec<&[Message]> {
    let mut out = Vec::new();
    let (mut start, mut total) = (0, 0);
    for (i, m) in messages.iter().enumerate() {
        let size = message_size(m);
        if i > start && (total + size > max_size || i - start == 10) {
            out.push(&messages[start..i]);
            (start, total) = (i, 0);
        }
        total += size;
    }
    if start < messages.len() {
        out.push(&messages[start..]);
    }
    out
}

/// `DeleteMessageBatch` entries for these receipt handles, with ids `m0`, `m1`, ...
/// (unique within the batch; `m{i}` maps a failed entry back to its receipt).
pub(crate) fn delete_entries<'a>(
    receipts: impl IntoIterator<Item = &'a str>,
) -> Vec<aws_sdk_sqs::types::DeleteMessageBatchRequestEntry> {
    receipts
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                .id(format!("m{i}"))
                .receipt_handle(r)
                .build()
                .expect("complete entry")
        })
        .collect()
}

/// The attribute as it was received: data type and value (string or binary).
pub(super) fn same_attribute(v: &MessageAttributeValue) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type(v.data_type())
        .set_string_value(v.string_value().map(str::to_owned))
        .set_binary_value(v.binary_value().cloned())
        .build()
        .expect("complete attribute")
}

pub(super) fn send_entry(i: usize, m: &Message, fifo: bool) -> SendMessageBatchRequestEntry {
    let attrs: HashMap<String, MessageAttributeValue> = m
        .message_attributes()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), same_attribute(v)))
        .collect();
    let mut e = SendMessageBatchRequestEntry::builder()
        .id(format!("m{i}"))
        .message_body(m.body().unwrap_or_default())
        .set_message_attributes((!attrs.is_empty()).then_some(attrs));
    if fifo {
        let group = m
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .map_or("sqs-once-redrive", String::as_str);
        // From the DLQ message id: a resend after a crash is deduplicated by SQS
        // (within its 5-minute window; later, the dedup record catches it).
        e = e
            .message_group_id(group)
            .message_deduplication_id(format!("redrive-{}", m.message_id().unwrap_or_default()));
    }
    e.build().expect("complete entry")
}

/// Sends one batch to the source, then deletes from the DLQ what was sent.
pub(super) async fn move_batch(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    fifo: bool,
    batch: &[Message],
    report: &mut Redriven,
) -> Result<(), OpsError> {
    let id = |m: &Message| m.message_id().unwrap_or_default().to_owned();
    let entries = batch
        .iter()
        .enumerate()
        .map(|(i, m)| send_entry(i, m, fifo))
        .collect();
    let sent = sqs
        .send_message_batch()
        .queue_url(source_url)
        .set_entries(Some(entries))
        .send()
        .await
        .map_err(|e| OpsError::Send {
            queue: source_url.to_owned(),
            moved: report.moved,
            source: e.into(),
        })?;
    let index = |entry_id: &str| entry_id[1..].parse::<usize>().ok();
    for f in sent.failed() {
        if let Some(m) = index(f.id()).and_then(|i| batch.get(i)) {
            let why = format!("{}: {}", f.code(), f.message().unwrap_or(""));
            report.not_sent.push((id(m), why));
        }
    }
    let done: Vec<&Message> = sent
        .successful()
        .iter()
        .filter_map(|s| index(s.id()).and_then(|i| batch.get(i)))
        .collect();
    if done.is_empty() {
        return Ok(());
    }
    let deletes = delete_entries(done.iter().map(|m| m.receipt_handle().unwrap_or_default()));
    match sqs
        .delete_message_batch()
        .queue_url(dlq_url)
        .set_entries(Some(deletes))
        .send()
        .await
    {
        Ok(out) => {
            let failed: Vec<usize> = out.failed().iter().filter_map(|f| index(f.id())).collect();
            for (i, m) in done.iter().enumerate() {
                if failed.contains(&i) {
                    report.in_both.push(id(m));
                } else {
                    report.moved += 1;
                }
            }
        }
        Err(e) => {
            report.in_both.extend(done.iter().map(|m| id(m)));
            return Err(OpsError::DeleteAfterSend {
                queue: dlq_url.to_owned(),
                in_both: done.len(),
                source: e.into(),
            });
        }
    }
    Ok(())
}

pub(super) async fn queue_arn(sqs: &aws_sdk_sqs::Client, url: &str) -> Result<String, OpsError> {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .map_err(|e| OpsError::ReadQueue {
            queue: url.to_owned(),
            source: e.into(),
        })?
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .ok_or_else(|| OpsError::NoQueueArn {
            queue: url.to_owned(),
        })
}

/// Moves every message with SQS's `StartMessageMoveTask` and waits for it;
/// `None` when the endpoint does not offer it.
pub(super) async fn move_task(
    sqs: &aws_sdk_sqs::Client,
    dlq_url: &str,
    source_url: &str,
    progress: &mut impl FnMut(u64),
) -> Result<Option<u64>, OpsError> {
    let (dlq_arn, source_arn) = (
        queue_arn(sqs, dlq_url).await?,
        queue_arn(sqs, source_url).await?,
    );
    let started = sqs
        .start_message_move_task()
        .source_arn(&dlq_arn)
        .destination_arn(&source_arn)
        .send()
        .await;
    let handle = match started {
        Ok(out) => out.task_handle.unwrap_or_default(),
        Err(e) => {
            let unsupported = e
                .as_service_error()
                .is_some_and(|s| s.is_unsupported_operation())
                || e.raw_response().is_some_and(|r| r.status().as_u16() == 501);
            if unsupported {
                return Ok(None);
            }
            return Err(OpsError::StartMoveTask { source: e.into() });
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15 * 60);
    loop {
        let tasks = sqs
            .list_message_move_tasks()
            .source_arn(&dlq_arn)
            .send()
            .await
            .map_err(|e| OpsError::ReadMoveTask { source: e.into() })?;
        let task = tasks
            .results()
            .iter()
            .find(|t| t.task_handle().is_none_or(|h| h == handle) && t.status().is_some());
        if let Some(t) = task {
            let moved = u64::try_from(t.approximate_number_of_messages_moved()).unwrap_or(0);
            progress(moved);
            match t.status() {
                Some("COMPLETED") => return Ok(Some(moved)),
                Some("FAILED") | Some("CANCELLED") => {
                    return Err(OpsError::MoveTaskEnded {
                        status: t.status().unwrap_or_default().to_owned(),
                        moved,
                        reason: t.failure_reason().unwrap_or("no reason given").to_owned(),
                    });
                }
                _ => {}
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(OpsError::MoveTaskStillRunning { handle });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
