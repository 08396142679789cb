//! What the AWS services' errors have in common.

use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_smithy_runtime_api::client::result::SdkError;

/// Whether a failed SQS or DynamoDB call may pass when tried again: no answer
/// (timeout, connection refused or reset), throttling, or a 5xx. A refusal
/// (access denied, no such queue or table, a malformed request) is not.
pub fn is_transient<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    match err {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("");
            code.contains("Throttl")
                || code == "ProvisionedThroughputExceededException"
                || code == "RequestLimitExceeded"
                || code == "RequestThrottled"
                || code == "InternalServerError"
                || code == "InternalError"
                || code == "ServiceUnavailable"
                || code == "KMS.ThrottlingException"
        }
        SdkError::ConstructionFailure(_) => false,
        _ => true,
    }
}

/// A failed call in one line: `Code: message` from the service, else the
/// SDK's own account (timeout, connection, construction).
pub fn error_detail<E, R>(err: &SdkError<E, R>) -> String
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
