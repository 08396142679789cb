//! The `sqs-once` operator tool: setting up the resources a consumer needs,
//! operating a running system, and running a Lambda function locally.
//!
//! - [`setup`]: the dedup table (key `pk`, TTL on `expires_at`) and queues with
//!   their dead-letter queue (`sqs-once init`).
//! - [`ops`]: read or forget a dedup record, move parked messages back, count
//!   records and messages (`inspect`, `forget`, `redrive`, `stats`).
//! - [`local_lambda`]: a local Lambda Runtime API and SQS event source
//!   (`local-lambda`, `demo --runtime lambda`, the tests).
//!
//! The binary's own modules (`src/main.rs`, with `args.rs`, `commands.rs` and
//! `demo.rs`) parse the command line, run one command on these, and print
//! what it did.

#![warn(missing_docs, unreachable_pub)]
#![forbid(unsafe_code)]

pub mod local_lambda;
pub mod ops;
/// The resources' setup lives in the library (`sqs_once::aws::setup`), which
/// [`SqsOnce::ensure_table`](sqs_once::SqsOnce::ensure_table) shares.
pub use sqs_once::aws::setup;
