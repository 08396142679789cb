//! The protocol core: what one message goes through, independent of any
//! AWS client or runtime.
//!
//! - The vocabulary: [`message`], [`key`] (dedup keys, carried keys),
//!   [`handler`] (the user's side: `Handler`, `Context`, staged writes, failure
//!   kinds), [`config`], [`clock`].
//! - What is observed: [`metrics`] and [`trace`] (and [`otel`]'s exporter).
//! - The seams the adapters implement: [`store`] (the dedup record and the
//!   `DedupStore` trait), [`queue`] (`QueueClient`), [`payloads`]
//!   (`PayloadStore`, large payloads).
//! - [`outbox`]: messages a handler sends, recorded with its effect and
//!   sent after the commit.
//! - What uses them: [`processor`] (claim, heartbeat, complete, release,
//!   park), [`parking`] (a copy in the DLQ with its reason) and [`redrive`].
//! - [`mutants`]: deliberate-bug hooks, compiled in only for the checks of
//!   the checkers.
//!
//! Nothing here imports the AWS adapters (`crate::aws`), the runtimes
//! (`crate::runtime`), the front door or the test kit: `tests/layers.rs`
//! fails on such an import.

pub mod clock;
pub mod config;
pub mod envelope;
pub(crate) mod handler;
pub mod key;
pub mod limits;
// Re-exported by `env` (the binaries), used by the front door.
#[allow(unreachable_pub)]
#[cfg(all(feature = "logging", any(feature = "poller", feature = "lambda")))]
pub(crate) mod logfmt;
pub(crate) mod message;
pub mod metrics;
pub mod mutants;
#[cfg(feature = "otel")]
pub mod otel;
pub mod outbox;
pub(crate) mod outcome;
pub mod parking;
pub mod payloads;
pub(crate) mod pointer;
pub(crate) mod processor;
pub mod queue;
pub mod redrive;
pub mod store;
pub mod trace;
