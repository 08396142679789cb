//! Where this project's LocalStack is made to follow SQS's documented
//! semantics (see `localstack/run.py`), a test that it does.

use std::time::Duration;

use aws_sdk_sqs::types::{MessageSystemAttributeName, SendMessageBatchRequestEntry};

use crate::common::{queues, sqs};

/// SQS: "When you receive a message with a message group ID, no more messages
/// for the same message group ID are returned unless you delete the message,
/// or it becomes visible." Stock LocalStack hands out A1 and A2 again (and A3)
/// as soon as A1 and A2 reappear, while A0 is still in flight.
#[tokio::test]
async fn a_fifo_group_stays_blocked_while_any_of_its_messages_is_in_flight() {
    if !crate::common::localstack_up().await {
        return;
    }
    let sqs = sqs().await;
    let q = queues(&sqs, true, 30).await;
    let entries: Vec<_> = (0..4)
        .map(|i| {
            SendMessageBatchRequestEntry::builder()
                .id(format!("a{i}"))
                .message_body(format!("A{i}"))
                .message_group_id("g")
                .message_deduplication_id(format!("a{i}"))
                .build()
                .unwrap()
        })
        .collect();
    sqs.send_message_batch()
        .queue_url(&q.queue_url)
        .set_entries(Some(entries))
        .send()
        .await
        .unwrap();
    let receive = |max: i32| {
        sqs.receive_message()
            .queue_url(&q.queue_url)
            .max_number_of_messages(max)
            .wait_time_seconds(1)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .send()
    };
    let first = receive(3).await.unwrap().messages.unwrap_or_default();
    let bodies: Vec<_> = first.iter().map(|m| m.body().unwrap()).collect();
    assert_eq!(bodies, ["A0", "A1", "A2"]);
    // A1 and A2 reappear; A0 is still in flight.
    for m in &first[1..] {
        sqs.change_message_visibility()
            .queue_url(&q.queue_url)
            .receipt_handle(m.receipt_handle().unwrap())
            .visibility_timeout(0)
            .send()
            .await
            .unwrap();
    }
    let blocked = receive(10).await.unwrap().messages.unwrap_or_default();
    assert!(
        blocked.is_empty(),
        "handed out while A0 was in flight: {:?}",
        blocked
            .iter()
            .map(|m| m.body().unwrap())
            .collect::<Vec<_>>()
    );
    // Deleting A0 opens the group again, in order.
    sqs.delete_message()
        .queue_url(&q.queue_url)
        .receipt_handle(first[0].receipt_handle().unwrap())
        .send()
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let next = loop {
        let got = receive(10).await.unwrap().messages.unwrap_or_default();
        if !got.is_empty() || tokio::time::Instant::now() > deadline {
            break got;
        }
    };
    let bodies: Vec<_> = next.iter().map(|m| m.body().unwrap()).collect();
    assert_eq!(bodies, ["A1", "A2", "A3"]);
}
