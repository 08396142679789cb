//! What failed in an operation, for the operator.

use aws_sdk_dynamodb::error::SdkError;
use aws_smithy_types::error::display::DisplayErrorContext;

pub(super) type GetItemError = aws_sdk_dynamodb::operation::get_item::GetItemError;
pub(super) type DeleteItemError = aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
pub(super) type ScanError = aws_sdk_dynamodb::operation::scan::ScanError;
pub(super) type GetQueueAttributesError =
    aws_sdk_sqs::operation::get_queue_attributes::GetQueueAttributesError;
pub(super) type ReceiveMessageError = aws_sdk_sqs::operation::receive_message::ReceiveMessageError;
pub(super) type SendMessageBatchError =
    aws_sdk_sqs::operation::send_message_batch::SendMessageBatchError;
pub(super) type DeleteMessageBatchError =
    aws_sdk_sqs::operation::delete_message_batch::DeleteMessageBatchError;
pub(super) type StartMoveTaskError =
    aws_sdk_sqs::operation::start_message_move_task::StartMessageMoveTaskError;
pub(super) type ListMoveTasksError =
    aws_sdk_sqs::operation::list_message_move_tasks::ListMessageMoveTasksError;

/// An operation that failed: what was being done, to what, and the AWS error
/// (its source) where a call failed. The message is for the operator.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// `GetItem` of a record failed.
    #[error("reading {pk} from {table}: {}", DisplayErrorContext(.source))]
    ReadRecord {
        /// The record's key.
        pk: String,
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetItemError>>,
    },
    /// `DeleteItem` of a record failed.
    #[error("deleting {pk} from {table}: {}", DisplayErrorContext(.source))]
    DeleteRecord {
        /// The record's key.
        pk: String,
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DeleteItemError>>,
    },
    /// A record read from the table is not one sqs-once wrote.
    #[error("record {pk} is malformed: {reason}")]
    MalformedRecord {
        /// The record's key.
        pk: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A `Scan` page failed.
    #[error("scanning {table}: {}", DisplayErrorContext(.source))]
    Scan {
        /// The dedup table.
        table: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ScanError>>,
    },
    /// `GetQueueAttributes` failed.
    #[error("reading queue {queue}: {}", DisplayErrorContext(.source))]
    ReadQueue {
        /// The queue's URL.
        queue: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<GetQueueAttributesError>>,
    },
    /// A queue's attributes came back without its ARN.
    #[error("queue {queue} has no QueueArn")]
    NoQueueArn {
        /// The queue's URL.
        queue: String,
    },
    /// The source queue's redrive policy does not name the DLQ: nothing moved.
    #[error(
        "refusing to move: the redrive policy of {source_url} {}, not {dlq_arn} ({dlq_url}); \
         with swapped URLs live messages would move into the DLQ unprocessed. Check \
         --dlq-url and --queue-url, or pass --skip-redrive-check to move anyway",
        .found.as_ref().map_or("is not set".to_owned(), |t| format!("sends to {t}"))
    )]
    NotItsDlq {
        /// The source queue's URL.
        source_url: String,
        /// Where its redrive policy sends messages, if it has one.
        found: Option<String>,
        /// The DLQ's URL.
        dlq_url: String,
        /// The DLQ's ARN.
        dlq_arn: String,
    },
    /// `ReceiveMessage` from the DLQ failed.
    #[error("receiving from {queue}: {}", DisplayErrorContext(.source))]
    Receive {
        /// The DLQ's URL.
        queue: String,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ReceiveMessageError>>,
    },
    /// `SendMessageBatch` to the source queue failed; the batch stays in the DLQ.
    #[error(
        "sending to {queue} ({moved} moved so far; this batch stays in the DLQ): {}",
        DisplayErrorContext(.source)
    )]
    Send {
        /// The source queue's URL.
        queue: String,
        /// Messages moved before this batch.
        moved: u64,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<SendMessageBatchError>>,
    },
    /// `DeleteMessageBatch` from the DLQ failed after the batch was sent: its
    /// messages are in both queues.
    #[error(
        "deleting from {queue} after sending; {in_both} message(s) are now in both queues (the DLQ's copies come back in 60 s; their dedup keys make a second copy a duplicate): {}",
        DisplayErrorContext(.source)
    )]
    DeleteAfterSend {
        /// The DLQ's URL.
        queue: String,
        /// Messages now in both queues.
        in_both: usize,
        /// The SDK's error.
        #[source]
        source: Box<SdkError<DeleteMessageBatchError>>,
    },
    /// `StartMessageMoveTask` failed (other than for an endpoint without it).
    #[error("starting the message move task: {}", DisplayErrorContext(.source))]
    StartMoveTask {
        /// The SDK's error.
        #[source]
        source: Box<SdkError<StartMoveTaskError>>,
    },
    /// `ListMessageMoveTasks` failed while waiting for the task.
    #[error("reading the message move task: {}", DisplayErrorContext(.source))]
    ReadMoveTask {
        /// The SDK's error.
        #[source]
        source: Box<SdkError<ListMoveTasksError>>,
    },
    /// The message move task ended `FAILED` or `CANCELLED`.
    #[error("the message move task ended {status} after {moved} message(s): {reason}")]
    MoveTaskEnded {
        /// `FAILED` or `CANCELLED`.
        status: String,
        /// Messages it moved.
        moved: u64,
        /// Its failure reason.
        reason: String,
    },
    /// The message move task was still running after 15 minutes.
    #[error(
        "the message move task {handle} is still running after 15 minutes; check it with `aws sqs list-message-move-tasks`"
    )]
    MoveTaskStillRunning {
        /// The task's handle.
        handle: String,
    },
}

/// [`OpsError::MalformedRecord`] for `pk`.
pub(super) fn malformed(pk: &str, reason: impl ToString) -> OpsError {
    OpsError::MalformedRecord {
        pk: pk.to_owned(),
        reason: reason.to_string(),
    }
}
