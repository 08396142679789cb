//! Deliberate bugs for the chaos harness to catch (the check of the checker).
//! Compiled in only when the crate is built with `SQS_ONCE_MUTANTS=1` in the
//! environment (build.rs sets the cfg `sqs_once_mutants`; no feature can);
//! without it [`active`] is always false and costs nothing.
//!
//! `SQS_ONCE_MUTANT=<name>` switches one on:
//! - `fifo-parallel`: the poller runs each FIFO message in its own lane, so a
//!   group's messages run at once instead of in order.
//! - `no-fencing`: the in-memory store's guarded operations (complete,
//!   release, mark failed, extend) ignore the owner token (the simulator).
//! - `lease-not-enforced`: a claimed handler is never interrupted at its
//!   local lease end (the simulator).
//! - `delete-before-effect`: the poller deletes a message before processing
//!   it (the simulator).
//! - `always-in-flight`: every claim (and fast-path commit) of the in-memory
//!   store answers "held elsewhere": a consumer that processes nothing.
//! - `transient-as-permanent`: every handler or store failure is taken as
//!   permanent, so a panic or an outage parks a valid message.
//! - `rerun-completed`: the in-memory store claims a `COMPLETED` key again.
//! - `duplicate-as-retry`: a delivery that finds its record `COMPLETED`
//!   answers "to come back" instead of "duplicate", so it is never deleted
//!   and its receives run out (the check that the checker's excuses for a
//!   completed message in the DLQ do not hide a consumer that never learns).
//! - `no-redelivery-read`: a redelivery on the fast path runs its handler
//!   without reading its record first, a transient failure there answers
//!   retry without reading it either, and a drain gives back a completed
//!   message instead of deleting it.
//! - `visibility-not-kept`: a handler runs on after its message's visibility
//!   could not be kept (SQS may deliver it to another consumer meanwhile).
//! - `stale-receipt-delete`: a finished delivery's delete goes only through
//!   its own receipt handle, counted done when SQS answers, although a newer
//!   delivery of the message reached the poller and came back: SQS may
//!   answer a delete through the older handle without deleting (the
//!   simulator's twin deliveries).
//! - `bounce-in-flight`: a copy of a key in flight elsewhere comes back at
//!   the holder's lease end instead of waiting for it (and, in Lambda,
//!   instead of being sent again as a new message), spending a receive per
//!   lease (the poller's and the Lambda runtime's unit tests).
//! - `conditional-as-transient`: `DynamoStore` misses a failed condition on
//!   the dedup record (`ConditionalCheckFailedException`, or a cancelled
//!   transaction's first reason) and classifies it as a transient error, so
//!   a duplicate or a key held elsewhere is retried instead of decided (the
//!   simulator's wire path).
//! - `batch-failures-dropped`: the SQS adapter reports a batch call's
//!   failed entries as done (`DeleteMessageBatch`,
//!   `ChangeMessageVisibilityBatch`, `SendMessageBatch`), so a delete that
//!   deleted nothing counts as done and an outbox message SQS refused counts
//!   as sent (the simulator's wire path).
//! - `dispatch-before-commit`: the messages a handler sends
//!   ([`Context::send`](crate::Context::send)) are sent before the commit
//!   of its effect, and not recorded (the simulator's chained consumers).
//! - `outbox-not-recovered`: a duplicate or redelivery that finds its
//!   record's messages unsent lets the message go without sending them.
//! - `send-after-delete`: the messages a handler sent are sent in the
//!   background after the commit, so the incoming message can be deleted
//!   before they are (and a crash then loses them).
//! - `duplicate-sends-own`: a fast-path run that finds its key completed
//!   by another run sends its own messages, not the ones recorded with the
//!   effect that committed.
//! - `payload-deleted-first`: the runtimes delete a finished message's
//!   large-payload object before the message (as the extended clients'
//!   `deleteMessage` does), so a message whose delete then fails comes back
//!   to nothing (the simulator's large-payload runs).
//! - `payload-deleted-on-park`: the poller deletes a parked message's
//!   large-payload object after the message, so its copy in the DLQ points
//!   to nothing (the simulator's large-payload runs).
//! - `pointer-before-object`: the outbox stores a large outgoing body in
//!   S3 in the background without waiting for the put, so its pointer
//!   message can be sent (and read) before the object is stored, or without
//!   it when the put fails (the simulator's large outbox sends).
//! - `short-ttl`: every record write carries a twentieth of the configured
//!   TTL (`ProcessorConfig::record_ttl`), so records expire long before
//!   their copies stop coming (the simulator's check of each write's
//!   `expires_at`, which the excuses of an application after TTL rest on).
//! - `key-per-attempt`: [`Context::idempotency_key`](crate::Context::idempotency_key)
//!   hands each attempt a key of its own (the key and the attempt), so an
//!   API cannot tell a retried call from a new one (the simulator).
//! - `insert-unconditional`: the insert path's `PutItem` (and the
//!   in-memory store's insert) goes without its `attribute_not_exists`
//!   condition, so a copy replaces the item instead of finding it (the
//!   insert path's unit test of copies at once, in `scripts/test`).
//! - `concurrency-unbounded`: the poller lets every message it holds run at
//!   once (`concurrency + prefetch` handlers), above its `concurrency`
//!   (the simulator's per-host bound).
//! - `failed-not-marked`: a permanent failure on the claim path parks its
//!   message without recording `FAILED`, so its claim is left
//!   `IN_PROGRESS` (the simulator).
//! - `release-skipped`: a claim whose run failed for a cause that passes is
//!   not released, so its key stays blocked until its lease ends and the
//!   copies that meet it meanwhile spend their receives (the simulator's
//!   check of each receive).
//! - `outbox-id-per-send`: each send of a record's messages mints their ids
//!   anew (from the sender's clock), so a message sent again (a duplicate
//!   recovering what its record left unsent) carries another id (the
//!   simulator's chained runs).
//! - `owner-not-checked`: `DynamoStore`'s owner-guarded writes (complete,
//!   release, mark failed) hold whoever owns the record, so a late write of
//!   a lease that was taken over applies (the simulator's wire path).
//! - `lease-not-live`: `DynamoStore`'s extension holds a lease already over
//!   by the writer's clock, so a late extension holds the key again (the
//!   simulator's wire path).
//! - `next-by-message-id`: the simulator's second stage keys on the message
//!   id instead of the outbox id each message carries, so a message the
//!   outbox sent twice is applied twice (a check of that check).

/// Whether this build has the mutants in it (built with `SQS_ONCE_MUTANTS=1`).
pub const COMPILED: bool = cfg!(sqs_once_mutants);

/// Whether the mutant `name` is switched on by `SQS_ONCE_MUTANT`.
#[cfg(sqs_once_mutants)]
pub fn active(name: &str) -> bool {
    std::env::var("SQS_ONCE_MUTANT").is_ok_and(|v| v == name)
}

/// Whether the mutant `name` is switched on (never: built without the mutants).
#[cfg(not(sqs_once_mutants))]
#[inline(always)]
pub fn active(_name: &str) -> bool {
    false
}
