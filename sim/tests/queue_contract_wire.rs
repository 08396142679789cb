//! The queue contract suite (`tests/it/queue_contract.rs`, the file the
//! library runs against `MemoryQueue` and LocalStack) pointed at the wire:
//! its `localstack` fixture gets a real `aws_sdk_sqs::Client`, built as
//! production builds it, over `sqs_once_sim::wire` to the SQS model (a fresh
//! `MemoryQueue` per test), creating its queues with `CreateQueue` as it does
//! on LocalStack. So `SqsQueue`'s calls and the SDK's parsing of the model's
//! answers run the same checks LocalStack passes.

#[allow(dead_code, clippy::too_many_lines)]
#[path = "../../tests/it/queue_contract.rs"]
mod queue_contract;

/// What the suite's `localstack` module asks of `tests/it/common.rs`,
/// answered by the wire model.
mod common {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use sqs_once::MemoryQueue;
    use sqs_once_sim::faults::Life;
    use sqs_once_sim::wire::sqs::SqsModel;
    use sqs_once_sim::wire::{self, Service, Wire};

    /// A client over the wire to a fresh SQS model. The test's time is
    /// paused from here on, as the model's own suite runs: the model counts
    /// SQS's limits to the millisecond (a 43,200 s visibility change a few
    /// milliseconds after the receive is past the 12 hours), where
    /// LocalStack does not enforce them at all.
    /// The model always answers (LocalStack need not).
    pub async fn localstack_up() -> bool {
        true
    }

    pub async fn sqs() -> aws_sdk_sqs::Client {
        tokio::time::pause();
        let model = SqsModel::new(MemoryQueue::new());
        let wire = Wire::new(Service::Sqs(model), None, Life::default());
        wire::sqs_client(
            wire,
            Arc::new(sqs_once::clock::SystemClock),
            Duration::from_secs(30),
        )
    }

    /// A name no other queue of this process has.
    pub fn unique(prefix: &str) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
    }
}
