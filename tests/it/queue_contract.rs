//! One contract suite for every queue behind [`QueueClient`]: the same tests
//! run on the in-memory SQS model ([`MemoryQueue`], on tokio's paused clock)
//! and on LocalStack's SQS through [`aws_sdk_sqs::Client`] (real time, short
//! timeouts, unique queue names), as `contract.rs` does for the dedup stores.
//!
//! Where LocalStack differs from the SQS documentation the test says so and
//! asserts the documented behaviour on the model only (`Fixture::FOLLOWS_AWS`).
//! The project's LocalStack (`localstack/run.py`) already blocks FIFO groups
//! as SQS does, so the group test runs on both.

use std::collections::BTreeMap;
use std::time::Duration;

use sqs_once::Message;
use sqs_once::queue::{OutgoingMessage, QueueClient, ReceiveRequest};
use tokio::time::Instant;

/// The queue (and DLQ) a test asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct Spec {
    pub fifo: bool,
    /// The queue's `VisibilityTimeout` in seconds (30 when 0).
    pub visibility: u64,
    /// `MaximumMessageSize`.
    pub max_bytes: Option<usize>,
    /// A DLQ with this `maxReceiveCount`.
    pub max_receive_count: Option<u32>,
    /// FIFO `ContentBasedDeduplication`.
    pub content_based: bool,
}

/// A queue service under test.
pub trait Fixture {
    type Q: QueueClient;
    /// Whether failures of documented SQS behaviour are asserted (false for
    /// an emulator where it is known to differ; see each test).
    const FOLLOWS_AWS: bool;
    fn client(&self) -> &Self::Q;
    /// Creates a queue (and its DLQ): (queue URL, DLQ URL).
    async fn queue(&self, spec: Spec) -> (String, Option<String>);
    /// Sends with a per-message delay (standard queues).
    async fn send_delayed(&self, url: &str, body: &str, delay: Duration);
}

fn req(max: usize, wait_secs: u64, visibility_secs: u64) -> ReceiveRequest {
    ReceiveRequest {
        max,
        wait: Duration::from_secs(wait_secs),
        visibility: Duration::from_secs(visibility_secs),
    }
}

fn plain(body: &str) -> OutgoingMessage {
    OutgoingMessage {
        body: body.to_owned(),
        ..Default::default()
    }
}

fn in_group(body: &str, group: &str, dedup: Option<&str>) -> OutgoingMessage {
    OutgoingMessage {
        body: body.to_owned(),
        attributes: BTreeMap::new(),
        group_id: Some(group.to_owned()),
        deduplication_id: dedup.map(str::to_owned),
        ..OutgoingMessage::default()
    }
}

fn bodies(messages: &[Message]) -> Vec<&str> {
    messages.iter().map(Message::body).collect()
}

/// Receives (long polls of 1 s) until something comes or `within` passes.
async fn receive_within<Q: QueueClient>(
    q: &Q,
    url: &str,
    max: usize,
    visibility: u64,
    within: Duration,
) -> Vec<Message> {
    let deadline = Instant::now() + within;
    loop {
        let got = q.receive(url, req(max, 1, visibility)).await.unwrap();
        if !got.is_empty() || Instant::now() >= deadline {
            return got;
        }
    }
}

/// Receives everything that becomes visible within `within` (deleting nothing,
/// holding each for 30 s).
async fn drain_within<Q: QueueClient>(q: &Q, url: &str, within: Duration) -> Vec<Message> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        out.extend(q.receive(url, req(10, 1, 30)).await.unwrap());
    }
    out
}

pub async fn a_received_message_comes_back_after_its_visibility_with_a_new_handle<F: Fixture>(
    f: &F,
) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    q.send(&url, plain("one")).await.unwrap();
    let first = receive_within(q, &url, 10, 2, Duration::from_secs(5)).await;
    assert_eq!(bodies(&first), ["one"]);
    assert_eq!(first[0].receive_count(), 1);
    let hidden = q.receive(&url, req(10, 0, 2)).await.unwrap();
    assert!(hidden.is_empty(), "handed out while in flight: {hidden:?}");
    let again = receive_within(q, &url, 10, 30, Duration::from_secs(10)).await;
    assert_eq!(bodies(&again), ["one"]);
    assert_eq!(again[0].id(), first[0].id(), "the same message");
    assert_eq!(again[0].receive_count(), 2, "ApproximateReceiveCount");
    assert_ne!(
        again[0].receipt_handle(),
        first[0].receipt_handle(),
        "a new receipt handle per receive"
    );
}

pub async fn a_delete_with_the_latest_handle_deletes<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    q.send(&url, plain("gone")).await.unwrap();
    let got = receive_within(q, &url, 10, 1, Duration::from_secs(5)).await;
    let receipt = got[0].receipt_handle().unwrap().to_owned();
    q.delete(&url, &receipt).await.unwrap();
    let after = drain_within(q, &url, Duration::from_secs(3)).await;
    assert!(after.is_empty(), "came back after its delete: {after:?}");
}

/// The API reference: "If you use an old ReceiptHandle, the request will
/// succeed, but the message might not be deleted." The model never deletes
/// with an old handle. LocalStack deletes with any handle the message ever had
/// (checked only on the model).
pub async fn a_delete_with_an_old_handle_succeeds_and_deletes_nothing<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    q.send(&url, plain("kept")).await.unwrap();
    let first = receive_within(q, &url, 10, 1, Duration::from_secs(5)).await;
    let second = receive_within(q, &url, 10, 30, Duration::from_secs(10)).await;
    assert_eq!(second[0].id(), first[0].id());
    q.delete(&url, first[0].receipt_handle().unwrap())
        .await
        .expect("a delete with an old handle succeeds");
    if !F::FOLLOWS_AWS {
        return;
    }
    q.change_visibility(&url, second[0].receipt_handle().unwrap(), Duration::ZERO)
        .await
        .expect("the message is still there, in flight, with its latest handle");
    let third = receive_within(q, &url, 10, 30, Duration::from_secs(5)).await;
    assert_eq!(bodies(&third), ["kept"]);
}

/// Changing the visibility of a message that is not in flight is an error
/// (`MessageNotInflight`). LocalStack accepts it (and hides the message
/// again): checked only on the model.
pub async fn a_visibility_change_needs_the_message_in_flight<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    q.send(&url, plain("v")).await.unwrap();
    let got = receive_within(q, &url, 10, 30, Duration::from_secs(5)).await;
    let receipt = got[0].receipt_handle().unwrap();
    q.change_visibility(&url, receipt, Duration::from_secs(43_200))
        .await
        .expect("43,200 s is the maximum and allowed");
    q.change_visibility(&url, receipt, Duration::ZERO)
        .await
        .expect("made visible");
    if F::FOLLOWS_AWS {
        let err = q
            .change_visibility(&url, receipt, Duration::from_secs(5))
            .await;
        assert!(err.is_err(), "changed the visibility of a visible message");
    }
    let back = receive_within(q, &url, 10, 30, Duration::from_secs(5)).await;
    assert_eq!(
        bodies(&back),
        ["v"],
        "visibility 0 makes it visible at once"
    );
}

pub async fn a_long_poll_returns_as_soon_as_a_message_is_sent<F: Fixture>(f: &F)
where
    F::Q: QueueClient,
{
    let q = f.client().clone();
    let (url, _) = f.queue(Spec::default()).await;
    let started = Instant::now();
    let poll = {
        let (q, url) = (q.clone(), url.clone());
        tokio::spawn(async move { q.receive(&url, req(10, 10, 30)).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    q.send(&url, plain("late")).await.unwrap();
    let got = poll.await.unwrap().unwrap();
    assert_eq!(bodies(&got), ["late"]);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "waited out the poll"
    );
}

pub async fn a_delayed_message_is_hidden_until_its_delay_ends<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    let sent = Instant::now();
    f.send_delayed(&url, "later", Duration::from_secs(2)).await;
    let early = q.receive(&url, req(10, 0, 30)).await.unwrap();
    assert!(early.is_empty(), "delivered during its delay: {early:?}");
    let got = receive_within(q, &url, 10, 30, Duration::from_secs(10)).await;
    assert_eq!(bodies(&got), ["later"]);
    assert!(sent.elapsed() >= Duration::from_secs(1), "too early");
}

/// The delay a client's send carries (a copy of a key in flight sent again
/// by the Lambda runtime): a part-second delay rounds up, not down to none.
pub async fn a_send_with_a_delay_is_hidden_until_it_ends<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    let sent = Instant::now();
    let later = OutgoingMessage {
        delay: Some(Duration::from_millis(1500)),
        ..plain("later")
    };
    q.send(&url, later).await.unwrap();
    let early = q.receive(&url, req(10, 0, 30)).await.unwrap();
    assert!(early.is_empty(), "delivered during its delay: {early:?}");
    let got = receive_within(q, &url, 10, 30, Duration::from_secs(10)).await;
    assert_eq!(bodies(&got), ["later"]);
    assert!(sent.elapsed() >= Duration::from_secs(1), "too early");
}

pub async fn a_send_above_the_maximum_size_fails<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            max_bytes: Some(1024),
            ..Spec::default()
        })
        .await;
    q.send(&url, plain(&"x".repeat(1024)))
        .await
        .expect("exactly the maximum is accepted");
    let err = q.send(&url, plain(&"x".repeat(1025))).await;
    assert!(err.is_err(), "a body over MaximumMessageSize was accepted");
}

pub async fn a_message_received_max_receive_count_times_moves_to_the_dlq<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, dlq) = f
        .queue(Spec {
            max_receive_count: Some(1),
            ..Spec::default()
        })
        .await;
    let dlq = dlq.unwrap();
    q.send(&url, plain("poison")).await.unwrap();
    let first = receive_within(q, &url, 10, 1, Duration::from_secs(5)).await;
    assert_eq!(bodies(&first), ["poison"]);
    // After its visibility runs out the next receive moves it instead.
    let again = drain_within(q, &url, Duration::from_secs(4)).await;
    assert!(
        again.is_empty(),
        "received beyond maxReceiveCount: {again:?}"
    );
    let parked = receive_within(q, &dlq, 10, 30, Duration::from_secs(5)).await;
    assert_eq!(bodies(&parked), ["poison"]);
    assert_eq!(parked[0].id(), first[0].id(), "moved with its id");
}

pub async fn a_batch_takes_at_most_ten_entries<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    for i in 0..11 {
        q.send(&url, plain(&format!("b{i}"))).await.unwrap();
    }
    let mut receipts = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while receipts.len() < 11 && Instant::now() < deadline {
        let got = q.receive(&url, req(10, 1, 60)).await.unwrap();
        assert!(got.len() <= 10);
        receipts.extend(
            got.iter()
                .filter_map(|m| m.receipt_handle().map(str::to_owned)),
        );
    }
    assert_eq!(receipts.len(), 11);
    assert!(
        q.delete_batch(&url, &receipts).await.is_err(),
        "11 entries accepted"
    );
    let failed = q.delete_batch(&url, &receipts[..10]).await.unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    q.delete(&url, &receipts[10]).await.unwrap();
}

/// `SendMessageBatch`: at most ten entries; an entry SQS refuses (an empty
/// attribute value) fails alone, the others are sent, in their order.
pub async fn a_send_batch_fails_a_refused_entry_alone<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f.queue(Spec::default()).await;
    let eleven: Vec<_> = (0..11).map(|i| plain(&format!("s{i}"))).collect();
    assert!(
        q.send_batch(&url, eleven).await.is_err(),
        "11 entries accepted"
    );
    let mut bad = plain("bad");
    bad.attributes
        .insert("note".into(), sqs_once::Attribute::string(""));
    let batch = vec![plain("s0"), bad, plain("s2")];
    let failed = q.send_batch(&url, batch).await.unwrap();
    assert_eq!(
        failed.iter().map(|f| f.index).collect::<Vec<_>>(),
        [1],
        "{failed:?}"
    );
    let mut bodies = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while bodies.len() < 2 && Instant::now() < deadline {
        let got = q.receive(&url, req(10, 1, 60)).await.unwrap();
        bodies.extend(got.iter().map(|m| m.body().to_owned()));
    }
    bodies.sort();
    assert_eq!(bodies, ["s0", "s2"]);
}

/// SQS: "When you receive a message with a message group ID, no more messages
/// for the same message group ID are returned unless you delete the message,
/// or it becomes visible." Stock LocalStack re-opens the group when a later
/// message reappears; this project's LocalStack is patched to follow SQS.
pub async fn a_fifo_group_stays_blocked_while_any_of_its_messages_is_in_flight<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            fifo: true,
            ..Spec::default()
        })
        .await;
    for i in 0..4 {
        let body = format!("A{i}");
        q.send(&url, in_group(&body, "g", Some(&body)))
            .await
            .unwrap();
    }
    let first = receive_within(q, &url, 3, 30, Duration::from_secs(5)).await;
    assert_eq!(
        bodies(&first),
        ["A0", "A1", "A2"],
        "in order, several of one group"
    );
    for m in &first[1..] {
        q.change_visibility(&url, m.receipt_handle().unwrap(), Duration::ZERO)
            .await
            .unwrap();
    }
    let blocked = q.receive(&url, req(10, 1, 30)).await.unwrap();
    assert!(
        blocked.is_empty(),
        "handed out while A0 was in flight: {blocked:?}"
    );
    q.delete(&url, first[0].receipt_handle().unwrap())
        .await
        .unwrap();
    let next = receive_within(q, &url, 10, 30, Duration::from_secs(5)).await;
    assert_eq!(bodies(&next), ["A1", "A2", "A3"]);
}

pub async fn a_fifo_group_does_not_block_another<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            fifo: true,
            ..Spec::default()
        })
        .await;
    q.send(&url, in_group("g0", "g", Some("g0"))).await.unwrap();
    q.send(&url, in_group("g1", "g", Some("g1"))).await.unwrap();
    let g = receive_within(q, &url, 1, 30, Duration::from_secs(5)).await;
    assert_eq!(bodies(&g), ["g0"]);
    q.send(&url, in_group("h0", "h", Some("h0"))).await.unwrap();
    let h = receive_within(q, &url, 10, 30, Duration::from_secs(5)).await;
    assert_eq!(bodies(&h), ["h0"], "group g is blocked, h is not");
}

pub async fn a_fifo_send_with_a_seen_deduplication_id_is_delivered_once<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            fifo: true,
            ..Spec::default()
        })
        .await;
    q.send(&url, in_group("first", "g", Some("same")))
        .await
        .unwrap();
    q.send(&url, in_group("second", "g", Some("same")))
        .await
        .expect("a duplicate send is accepted");
    let got = drain_within(q, &url, Duration::from_secs(3)).await;
    assert_eq!(bodies(&got), ["first"]);
}

pub async fn content_based_deduplication_uses_the_body<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            fifo: true,
            content_based: true,
            ..Spec::default()
        })
        .await;
    q.send(&url, in_group("same body", "g", None))
        .await
        .unwrap();
    q.send(&url, in_group("same body", "h", None))
        .await
        .unwrap();
    q.send(&url, in_group("other body", "g", None))
        .await
        .unwrap();
    let got = drain_within(q, &url, Duration::from_secs(3)).await;
    assert_eq!(bodies(&got), ["same body", "other body"]);
}

pub async fn a_fifo_send_needs_a_group_and_a_deduplication_id<F: Fixture>(f: &F) {
    let q = f.client();
    let (url, _) = f
        .queue(Spec {
            fifo: true,
            ..Spec::default()
        })
        .await;
    let no_group = OutgoingMessage {
        deduplication_id: Some("d".into()),
        ..plain("x")
    };
    assert!(
        q.send(&url, no_group).await.is_err(),
        "sent without a group"
    );
    assert!(
        q.send(&url, in_group("x", "g", None)).await.is_err(),
        "sent without a deduplication id on a queue without content-based deduplication"
    );
}

macro_rules! queue_contract {
    ($make:path, #[$test:meta]) => {
        queue_contract!(@each $make, #[$test],
            a_received_message_comes_back_after_its_visibility_with_a_new_handle,
            a_delete_with_the_latest_handle_deletes,
            a_delete_with_an_old_handle_succeeds_and_deletes_nothing,
            a_visibility_change_needs_the_message_in_flight,
            a_long_poll_returns_as_soon_as_a_message_is_sent,
            a_delayed_message_is_hidden_until_its_delay_ends,
            a_send_with_a_delay_is_hidden_until_it_ends,
            a_send_above_the_maximum_size_fails,
            a_message_received_max_receive_count_times_moves_to_the_dlq,
            a_batch_takes_at_most_ten_entries,
            a_send_batch_fails_a_refused_entry_alone,
            a_fifo_group_stays_blocked_while_any_of_its_messages_is_in_flight,
            a_fifo_group_does_not_block_another,
            a_fifo_send_with_a_seen_deduplication_id_is_delivered_once,
            content_based_deduplication_uses_the_body,
            a_fifo_send_needs_a_group_and_a_deduplication_id
        );
    };
    (@each $make:path, #[$test:meta], $($name:ident),*) => {
        $(
            #[$test]
            async fn $name() {
                let Some(f) = $make().await else {
                    return;
                };
                super::$name(&f).await;
            }
        )*
    };
}

mod memory {
    use std::time::Duration;

    use sqs_once::MemoryQueue;
    use sqs_once::testkit::queue::{QueueSettings, RedrivePolicy, SendOptions};

    use super::{Fixture, Spec, plain};

    pub struct Model(MemoryQueue, std::cell::Cell<u32>);

    impl Fixture for Model {
        type Q = MemoryQueue;
        const FOLLOWS_AWS: bool = true;

        fn client(&self) -> &MemoryQueue {
            &self.0
        }

        async fn queue(&self, spec: Spec) -> (String, Option<String>) {
            self.1.set(self.1.get() + 1);
            let suffix = if spec.fifo { ".fifo" } else { "" };
            let name = format!("q{}", self.1.get());
            let dlq = spec.max_receive_count.map(|max_receive_count| {
                let url = self
                    .0
                    .create_queue(QueueSettings::new(format!("{name}-dlq{suffix}")))
                    .unwrap();
                RedrivePolicy {
                    dlq_url: url,
                    max_receive_count,
                }
            });
            let mut settings = QueueSettings::new(format!("{name}{suffix}"));
            if spec.visibility > 0 {
                settings.visibility_timeout = Duration::from_secs(spec.visibility);
            }
            if let Some(b) = spec.max_bytes {
                settings.max_message_bytes = b;
            }
            settings.content_based_deduplication = spec.content_based;
            settings.redrive = dlq.clone();
            let url = self.0.create_queue(settings).unwrap();
            (url, dlq.map(|d| d.dlq_url))
        }

        async fn send_delayed(&self, url: &str, body: &str, delay: Duration) {
            let options = SendOptions { delay: Some(delay) };
            self.0.send_with(url, plain(body), options).unwrap();
        }
    }

    async fn make() -> Option<Model> {
        Some(Model(MemoryQueue::new(), std::cell::Cell::new(0)))
    }

    queue_contract!(make, #[tokio::test(start_paused = true)]);
}

mod localstack {
    use std::time::Duration;

    use aws_sdk_sqs::types::QueueAttributeName as A;

    use super::{Fixture, Spec};

    pub struct LocalStack(aws_sdk_sqs::Client);

    impl LocalStack {
        async fn create(&self, name: &str, attrs: Vec<(A, String)>) -> String {
            let mut create = self.0.create_queue().queue_name(name);
            for (k, v) in attrs {
                create = create.attributes(k, v);
            }
            create.send().await.unwrap().queue_url.unwrap()
        }

        async fn arn(&self, url: &str) -> String {
            let out = self
                .0
                .get_queue_attributes()
                .queue_url(url)
                .attribute_names(A::QueueArn)
                .send()
                .await
                .unwrap();
            out.attributes.unwrap()[&A::QueueArn].clone()
        }
    }

    impl Fixture for LocalStack {
        type Q = aws_sdk_sqs::Client;
        /// LocalStack deletes with an old receipt handle and changes the
        /// visibility of a message not in flight (see those tests).
        const FOLLOWS_AWS: bool = false;

        fn client(&self) -> &aws_sdk_sqs::Client {
            &self.0
        }

        async fn queue(&self, spec: Spec) -> (String, Option<String>) {
            let suffix = if spec.fifo { ".fifo" } else { "" };
            let name = crate::common::unique("qc");
            let fifo = |mut attrs: Vec<(A, String)>| {
                if spec.fifo {
                    attrs.push((A::FifoQueue, "true".into()));
                }
                attrs
            };
            let mut dlq = None;
            let mut attrs = fifo(vec![]);
            if let Some(max) = spec.max_receive_count {
                let url = self
                    .create(&format!("{name}-dlq{suffix}"), fifo(vec![]))
                    .await;
                let arn = self.arn(&url).await;
                let policy = serde_json::json!({"deadLetterTargetArn": arn, "maxReceiveCount": max.to_string()});
                attrs.push((A::RedrivePolicy, policy.to_string()));
                dlq = Some(url);
            }
            if spec.visibility > 0 {
                attrs.push((A::VisibilityTimeout, spec.visibility.to_string()));
            }
            if let Some(b) = spec.max_bytes {
                attrs.push((A::MaximumMessageSize, b.to_string()));
            }
            if spec.content_based {
                attrs.push((A::ContentBasedDeduplication, "true".into()));
            }
            (self.create(&format!("{name}{suffix}"), attrs).await, dlq)
        }

        async fn send_delayed(&self, url: &str, body: &str, delay: Duration) {
            let secs = i32::try_from(delay.as_secs()).unwrap();
            self.0
                .send_message()
                .queue_url(url)
                .message_body(body)
                .delay_seconds(secs)
                .send()
                .await
                .unwrap();
        }
    }

    async fn make() -> Option<LocalStack> {
        if !crate::common::localstack_up().await {
            return None;
        }
        Some(LocalStack(crate::common::sqs().await))
    }

    queue_contract!(make, #[tokio::test]);
}
