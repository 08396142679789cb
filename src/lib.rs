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
//! - Messages a handler sends with [`Context::send`] (the [`outbox`]) are
//!   recorded with its effect and sent only after it committed, at least once,
//!   each with a stable id that an sqs-once consumer downstream dedups on.
//! - Nothing is lost: a message is deleted only after its effect is recorded
//!   (and what it sent, sent), or after it is parked in a dead-letter queue
//!   with its reason.
//!
//! This is not exactly-once *delivery*: SQS still delivers duplicates; they are
//! recognised by key and skipped. The key must be stable: see [`KeySource`].
//!
//! The protocol, and the reasons for it, are in the project's `docs/DESIGN.md`.
//!
//! # Start here
//! [`SqsOnce`] is the front door: `SqsOnce::builder(table, consumer)`, a key,
//! a queue, then `run(handler)` (the Lambda function under the Lambda runtime,
//! else a poller until SIGTERM). It loads the AWS configuration, bounds every
//! request's time, checks the table and the queue at start-up and takes the
//! binaries' defaults. The runtimes' own functions ([`poller::run`],
//! [`lambda::run`]) and configs are the layer beneath it, for tests and
//! special hosts.
//!
//! # Layout
//! - The protocol: [`Handler`] and [`Message`], [`key`] (dedup keys),
//!   [`store`] (the record and the store trait; [`DynamoStore`] in
//!   production), [`Processor`] (claim, heartbeat and local lease, complete /
//!   release / park), [`outbox`] (messages sent after the commit).
//! - The runtimes: [`poller`] (long polling, ECS or any host) and [`lambda`]
//!   (SQS events, partial batch responses), sharing one core (the lane split,
//!   and settling an [`Outcome`]: delete, retry later or park) over the
//!   [`queue`] seam: a [`QueueClient`] trait that [`aws_sdk_sqs::Client`]
//!   implements and an in-memory queue can stand behind.
//! - Settings: [`config`] ([`ProcessorConfig`]); counters and their EMF
//!   lines: [`metrics`]; spans and the producer's trace context: [`trace`]
//!   (exported by OTLP with the feature `otel`: `otel`).
//! - The front door: [`SqsOnce`] (clients, start-up checks, either runtime)
//!   and [`calls`](aws::calls) (AWS calls counted by operation, with an SDK interceptor).
//! - Settings from the environment: [`settings`] (every `SQS_ONCE_*`
//!   variable, [`settings::Settings::from_env`], no clap needed).
//! - Process glue, behind the feature `env` (clap, tracing-subscriber):
//!   `env` (the binaries' settings from the environment and flags, logging,
//!   and `env::run`, which hands them to the front door).
//! - Features: `poller` and `lambda` (the runtimes, default), `s3-payloads`,
//!   `env`, `otel`, `metrics` (the counters through the `metrics` facade
//!   too), and `testkit` (the in-memory store and queue, for tests).
//!
//! The project's other crates: the operator tool `sqs-once` (`cli/`: resource
//! setup, inspect / forget / redrive / stats, a local Lambda runtime) and the
//! example consumers `ledger` (staged writes, the fast path) and `payments` (an
//! external API with an idempotency key) in `examples/`.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

// The layers, bottom up (docs/DESIGN.md, "Layers"); `tests/layers.rs`
// fails on an import that runs back up.
#[cfg(any(feature = "poller", feature = "lambda"))]
mod app;
pub mod aws;
#[cfg(feature = "env")]
pub mod env;
mod protocol;
#[cfg(any(feature = "poller", feature = "lambda"))]
mod runtime;
#[cfg(any(feature = "poller", feature = "lambda"))]
pub mod settings;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

#[doc(hidden)]
pub use protocol::mutants;
#[cfg(feature = "otel")]
pub use protocol::otel;
pub use protocol::{
    clock, config, envelope, key, limits, metrics, outbox, parking, payloads, queue, redrive,
    store, trace,
};
#[cfg(feature = "lambda")]
pub use runtime::lambda;
#[cfg(feature = "poller")]
pub use runtime::poller;

#[cfg(feature = "poller")]
pub use app::PollerReport;
#[cfg(any(feature = "poller", feature = "lambda"))]
pub use app::{SqsOnce, StartError, shutdown_on_signals};
pub use aws::dynamodb::DynamoStore;
pub use protocol::config::{MissingKey, PayloadMismatch, ProcessorConfig};
pub use protocol::handler::{
    Context, Effects, Handler, HandlerError, HandlerFn, HandlerResult, InsertOnce, StagedOnly,
    handler_fn, insert_once, staged_only,
};
pub use protocol::key::KeySource;
pub use protocol::message::{Attribute, AttributeValue, Envelope, Message};
pub use protocol::outbox::{Dispatcher, Outgoing};
pub use protocol::outcome::{FailureKind, Outcome, StagedWrite, StoredResult};
pub use protocol::processor::Processor;
pub use protocol::queue::{QueueClient, QueueError};
pub use protocol::store::{Claim, DedupStore, Record, Status, StoreError};
#[cfg(feature = "lambda")]
pub use runtime::lambda::{LambdaAdapter, LambdaConfig};
#[cfg(feature = "poller")]
pub use runtime::poller::PollerConfig;
#[cfg(any(test, feature = "testkit"))]
pub use testkit::{MemoryQueue, MemoryStore};

/// The README's code, compiled as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's code (docs/guide), compiled as doctests as the README's is.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/getting-started.md")]
pub struct GuideGettingStartedDoctests;

/// The guide's handlers (docs/guide), compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../docs/guide/handlers-and-keys.md")]
pub struct GuideHandlersDoctests;

/// The DynamoDB types handlers use to stage writes.
pub use aws_sdk_dynamodb::types as dynamodb_types;
