//! Integration tests against LocalStack (SQS + DynamoDB) on this machine, with the
//! real SDK clients. Start it with `localstack/up` (the test script does).

mod cli;
mod common;
mod contract;
mod dynamodb;
mod emulator;
mod holes;
mod lambda;
mod payments;
mod poller;
mod queue_contract;
