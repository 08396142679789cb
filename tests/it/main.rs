//! Integration tests against LocalStack (SQS + DynamoDB) on this machine, with the
//! real SDK clients. Start it with `localstack/up` (the test script does).

// A test reads as one story from set-up to assertions; the 80-line limit is
// for the library and the binaries.
#![allow(clippy::too_many_lines)]

mod common;
mod contract;
mod delivery_edges;
mod dynamodb;
mod emulator;
mod envelopes;
mod front_door;
mod insert;
mod lambda;
mod large_payloads;
mod outbox;
mod payments;
mod poller;
mod queue_contract;
mod security;
mod trace;
