//! The test kit: in-memory models of the services, for testing handlers and
//! runtimes without AWS (feature `testkit`; never in production).
//!
//! - [`MemoryStore`]: the dedup store, with the same conditions as
//!   DynamoDB's, a manual clock and fault hooks.
//! - [`MemoryQueue`]: SQS, standard and FIFO, with visibility, receive
//!   counts, redrive policies and SQS's documented "might"s.
//! - [`MemoryPayloads`]: an object store for large payloads.
//! - [`Faulty`]: slow work, panics and a pause after the effect around any
//!   handler, for tests and chaos runs.
//!
//! The models implement the protocol core's traits; nothing in the core,
//! the adapters or the runtimes imports them.

mod faults;
pub mod payloads;
pub mod queue;
pub mod store;

pub use faults::Faulty;
pub use payloads::MemoryPayloads;
pub use queue::MemoryQueue;
pub use store::MemoryStore;
