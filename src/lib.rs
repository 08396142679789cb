//! sqs-once turns at-least-once SQS delivery into effectively-once processing.
//!
//! A [`Handler`] makes the effect of one [`Message`]. Before it runs, the
//! [`Processor`] *claims* the message's dedup key in a [`DedupStore`] (DynamoDB in
//! production: [`DynamoStore`]) with one conditional write; afterwards it
//! *completes* the claim, committing the DynamoDB writes the handler staged on its
//! [`Context`] in the same transaction. A redelivered or re-sent message finds the
//! key completed and is skipped.
//!
//! # Guarantees
//! - Effects that live in DynamoDB and are staged on the context happen exactly
//!   once: they commit together with the `COMPLETED` record or not at all.
//! - External effects get at most one concurrent attempt per key (a handler
//!   never runs past its lease: it is interrupted when the lease cannot be
//!   extended in time), and a stable [`Context::idempotency_key`] to pass
//!   downstream.
//! - Nothing is lost: a message is deleted only after its effect is recorded, or
//!   after it is parked in a dead-letter queue with its reason.
//!
//! This is not exactly-once *delivery*: SQS still delivers duplicates; they are
//! recognised by key and skipped. The key must be stable: see [`KeySource`].
//!
//! The protocol, and the reasons for it, are in the project's `docs/DESIGN.md`.
//!
//! # Layout
//! - The protocol: [`handler`](Handler) and [`Message`], [`key`] (dedup keys),
//!   [`dedup`] (the record, the store trait, DynamoDB and in-memory stores),
//!   [`processor`] (claim, heartbeat and local lease, complete / release / park).
//! - The runtimes: [`poller`] (long polling, ECS or any host) and [`lambda`]
//!   (SQS events, partial batch responses), sharing [`sqs`] (visibility and
//!   parking) and the lane split.
//! - Settings: [`config`] ([`ProcessorConfig`]), [`cli`] (environment and
//!   flags, choosing the runtime).
//! - Operator tooling: [`setup`], [`ops`], [`local_lambda`], [`calls`],
//!   [`metrics`].
//! - The examples' handlers: [`ledger`] (staged writes, the fast path) and
//!   [`payments`] (an external API with an idempotency key).

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

pub mod aws;
pub mod calls;
pub mod cli;
pub mod clock;
pub mod config;
pub mod dedup;
mod handler;
pub mod key;
pub mod lambda;
pub mod ledger;
pub mod local_lambda;
mod message;
pub mod metrics;
#[doc(hidden)]
pub mod mutants;
pub mod ops;
pub mod payments;
pub mod poller;
pub mod processor;
pub mod queue;
mod runtime;
pub mod setup;

pub use config::ProcessorConfig;
pub use dedup::dynamodb::DynamoStore;
pub use dedup::memory::MemoryStore;
pub use dedup::{Claim, DedupStore, Record, Status, StoreError, StoredResult};
pub use handler::{
    Context, Effects, FailureKind, Handler, HandlerError, HandlerFn, HandlerResult, StagedOnly,
    StagedWrite, handler_fn, staged_only,
};
pub use key::KeySource;
pub use lambda::{LambdaAdapter, LambdaConfig};
pub use message::{Attribute, AttributeValue, Message};
pub use poller::PollerConfig;
pub use processor::{Outcome, Processor};
pub use queue::memory::MemoryQueue;

/// The README's code, compiled as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The DynamoDB types handlers use to stage writes.
pub use aws_sdk_dynamodb::types as dynamodb_types;
