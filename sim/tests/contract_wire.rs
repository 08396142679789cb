//! The dedup store contract suite (`tests/it/contract.rs`, the same file the
//! library runs against the memory store and against DynamoDB on LocalStack)
//! pointed at the wire model: its `dynamodb` suite gets a real SDK client
//! over `sqs_once_sim::wire` to a fresh DynamoDB model per test, so the model
//! must answer every call the store makes as LocalStack does.

#[allow(dead_code, clippy::too_many_lines)]
#[path = "../../tests/it/contract.rs"]
mod contract;

/// What the suite's `dynamodb` module asks of `tests/it/common.rs`, answered
/// by the wire model instead of LocalStack.
mod common {
    use std::sync::Arc;

    use sqs_once_sim::faults::Life;
    use sqs_once_sim::wire::{self, Service, Wire};

    /// The model always answers (LocalStack need not).
    pub async fn localstack_up() -> bool {
        true
    }

    /// A client as production builds it, over the wire to a fresh model.
    pub async fn ddb() -> aws_sdk_dynamodb::Client {
        let wire = Wire::new(Service::Dynamo(wire::dynamo_model()), None, Life::default());
        wire::dynamodb_client(wire, Arc::new(sqs_once::clock::SystemClock))
    }

    /// The model's dedup table (made with the model).
    pub async fn dedup_table(_client: &aws_sdk_dynamodb::Client) -> String {
        wire::TABLE.to_owned()
    }
}
