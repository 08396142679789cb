//! The AWS adapters: the production implementations of the protocol's
//! seams ([`DynamoStore`](dynamodb::DynamoStore) for the dedup store, the SQS
//! client for the queue, S3 for large payloads), what the services' errors
//! have in common, request time bounds, and call counting ([`calls`]).
//!
//! This layer implements the traits of the protocol core and uses nothing of
//! the runtimes above it.

pub mod calls;
pub mod dynamodb;
#[cfg(feature = "s3-payloads")]
pub mod s3;
pub mod setup;
pub mod sqs;

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_smithy_runtime_api::client::result::SdkError;

use crate::protocol::queue::transient_code;

/// An SDK call's future on the heap. The SDK's send futures are kilobytes
/// each; boxed where they are awaited, they stay out of the state of every
/// future above them (the store's, the processor's, the poller's lane task),
/// which is then allocated and moved at a fraction of that size, and a call
/// made only on a rare path (parking, a visibility change) costs nothing
/// until it is made.
pub(crate) trait OnHeap: std::future::Future + Sized {
    fn on_heap(self) -> std::pin::Pin<Box<Self>> {
        Box::pin(self)
    }
}

impl<F: std::future::Future> OnHeap for F {}

/// The timeouts of every production client: a connect timeout, and `attempt`
/// for one request (the simulator builds its clients with these too).
pub fn attempt_timeouts(attempt: std::time::Duration) -> aws_config::timeout::TimeoutConfig {
    aws_config::timeout::TimeoutConfig::builder()
        .connect_timeout(std::time::Duration::from_secs(3))
        .operation_attempt_timeout(attempt)
        .build()
}

/// Whether a failed SQS or DynamoDB call may pass when tried again: no answer
/// (timeout, connection refused or reset), throttling, or a 5xx
/// ([`transient_code`]). A refusal (access denied, no such queue or table, a
/// malformed request) is not.
pub fn is_transient<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    match err {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("");
            transient_code(code)
        }
        SdkError::ConstructionFailure(_) => false,
        _ => true,
    }
}

/// A failed call in one line: `Code: message` from the service, else the
/// SDK's own account (timeout, connection, construction).
pub(crate) fn error_detail<E, R>(err: &SdkError<E, R>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match err.as_service_error() {
        Some(se) => format!(
            "{}: {}",
            se.code().unwrap_or("Unknown"),
            se.message().unwrap_or_default()
        ),
        None => aws_smithy_types::error::display::DisplayErrorContext(err).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use aws_sdk_sqs::error::ErrorMetadata;
    use aws_sdk_sqs::operation::receive_message::ReceiveMessageError;

    use super::*;

    fn sqs_error(code: &str) -> SdkError<ReceiveMessageError, ()> {
        let meta = ErrorMetadata::builder().code(code).message("test").build();
        SdkError::service_error(ReceiveMessageError::generic(meta), ())
    }

    #[test]
    fn sqs_internal_failures_unavailability_and_throttling_are_transient() {
        for code in [
            "InternalFailure",
            "ServiceUnavailable",
            "RequestThrottled",
            "ThrottlingException",
            "KmsThrottled",
            "KMS.ThrottlingException",
            "AWS.SimpleQueueService.InternalError",
        ] {
            assert!(is_transient(&sqs_error(code)), "{code}");
        }
    }

    #[test]
    fn refusals_are_not_transient() {
        for code in [
            "AccessDeniedException",
            "AWS.SimpleQueueService.NonExistentQueue",
            "QueueDoesNotExist",
            "InvalidParameterValue",
            "ReceiptHandleIsInvalid",
            "",
        ] {
            assert!(!is_transient(&sqs_error(code)), "{code}");
        }
    }
}
