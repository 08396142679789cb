//! What the two runtimes share: the lane split ([`lanes`]), visibility through
//! the [`QueueClient`], and turning an [`Outcome`] into what happens to the
//! message ([`Settler::settle`]: finished, parked, or back after a delay).
//!
//! The poller deletes what is finished and parked itself; the Lambda adapter
//! leaves it out of the batch's failures and Lambda deletes it. Either way a
//! message is let go only after its effect is recorded or its copy parked.
//!
//! See the project's `docs/DESIGN.md` ("The runtimes").

#[cfg(feature = "lambda")]
pub mod lambda;
pub(crate) mod lanes;
#[cfg(feature = "poller")]
pub mod poller;

#[cfg(feature = "poller")]
pub(crate) mod health;

mod settle;
mod visibility;

#[cfg(all(test, feature = "poller"))]
mod payload_tests;

#[cfg(feature = "poller")]
pub(crate) use settle::Holding;
pub(crate) use settle::{Delivery, OnRetry, Settled, Settler, hold_group};
#[cfg(feature = "poller")]
pub(crate) use visibility::extend_many;
#[cfg(feature = "lambda")]
pub(crate) use visibility::retry_later;

/// Exports the spans ended so far when an OTLP exporter was installed
/// (feature `otel`); returns at once otherwise. Lambda flushes after every
/// invocation (the environment may be frozen until the next), the poller
/// when it stops.
pub(crate) async fn flush_spans() {
    #[cfg(feature = "otel")]
    crate::protocol::otel::flush().await;
}
