//! What an operator does to a running system: read a record, forget one, move
//! parked messages back, count records and messages. The `sqs-once` binary is
//! the command line over these.
//!
//! - [`error`]: what failed, for the operator ([`OpsError`]);
//! - [`records`]: read, describe, forget and count dedup records;
//! - [`redrive`]: the DLQ's depth, and moving parked messages back.

pub mod error;
pub mod records;
pub mod redrive;

pub use error::OpsError;
pub use records::*;
pub use redrive::*;

#[cfg(test)]
mod tests;
