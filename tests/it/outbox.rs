//! The outbox on LocalStack: a two-stage pipeline (consumer A sends to
//! consumer B's queue with `Context::send`) under both runtimes, with the
//! process killed between A's commit and its send, and a send whose answer
//! is lost (so B receives the message twice).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::json;
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::outbox::OUTBOX_ID_ATTRIBUTE;
use sqs_once::payloads::{LargePayloads, PayloadLocation};
use sqs_once::poller::{PollerConfig, run};
use sqs_once::queue::{EntryFailure, OutgoingMessage, QueueError};
use sqs_once::{
    Context, DedupStore, Dispatcher, DynamoStore, Handler, Message, Processor, QueueClient,
    handler_fn, staged_only,
};
use tokio_util::sync::CancellationToken;

use crate::common::{carry_secret, ddb, dedup_table, depth, queues, send_all, sqs};
use sqs_once_cli::setup::QueuePair;

type Counts = Arc<Mutex<HashMap<String, u32>>>;

fn id_of(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["id"].as_str().unwrap().to_owned()
}

/// Stage A: on the fast path, counts its runs and sends "paid" to `b_url`.
fn stage_a(b_url: String, runs: Counts) -> impl Handler {
    staged_only(handler_fn(move |m: Message, ctx: Context| {
        let (b_url, runs) = (b_url.clone(), runs.clone());
        async move {
            let id = id_of(m.body());
            *runs.lock().unwrap().entry(id.clone()).or_default() += 1;
            ctx.send(&b_url, json!({"id": id, "paid": true}).to_string())?;
            Ok(None)
        }
    }))
}

/// Stage B: its effect, counted per event (the claim path: an external
/// effect).
fn stage_b(applied: Counts) -> impl Handler {
    handler_fn(move |m: Message, _ctx| {
        let applied = applied.clone();
        async move {
            *applied.lock().unwrap().entry(id_of(m.body())).or_default() += 1;
            Ok(None)
        }
    })
}

fn a_config() -> ProcessorConfig {
    let mut c = ProcessorConfig::new("stage-a");
    // Received for this long (a killed poller's message comes back after it).
    c.lease = Duration::from_secs(6);
    c.heartbeat = Duration::from_secs(2);
    c.key_source = "json:/id".parse().unwrap();
    c.carry_secret = Some(carry_secret());
    c
}

/// B keys on the message id (the default) and shares A's secret, so the
/// sealed outbox id each message carries is its key.
fn b_config() -> ProcessorConfig {
    let mut c = ProcessorConfig::new("stage-b");
    c.carry_secret = Some(carry_secret());
    c
}

fn poller_config(url: &str) -> PollerConfig {
    let mut c = PollerConfig::new(url);
    c.wait_time = Duration::from_secs(1);
    c.drain = Duration::from_secs(2);
    c
}

/// Sends through SQS, except that while `stuck` a send never answers
/// (the process is killed there) and while `lose` it is made and its
/// answer lost.
#[derive(Clone)]
struct Faulty {
    sqs: aws_sdk_sqs::Client,
    stuck: Arc<AtomicBool>,
    reached: Arc<tokio::sync::Notify>,
    lose: Arc<AtomicBool>,
}

impl Faulty {
    async fn new() -> Self {
        Self {
            sqs: sqs().await,
            stuck: Arc::default(),
            reached: Arc::default(),
            lose: Arc::default(),
        }
    }
}

impl Dispatcher for Faulty {
    fn send_batch<'a>(
        &'a self,
        queue: &'a str,
        messages: Vec<OutgoingMessage>,
    ) -> BoxFuture<'a, Result<Vec<EntryFailure>, QueueError>> {
        Box::pin(async move {
            if self.stuck.load(Ordering::SeqCst) {
                self.reached.notify_one();
                std::future::pending::<()>().await;
            }
            let sent = QueueClient::send_batch(&self.sqs, queue, messages).await;
            if self.lose.swap(false, Ordering::SeqCst) {
                return Err(QueueError::new(
                    "SendMessageBatch",
                    queue,
                    "timed out (the send landed)",
                    true,
                ));
            }
            sent
        })
    }
}

/// Waits with a deadline until `done` holds.
async fn until(what: &str, secs: u64, mut done: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !done().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn events(n: usize) -> Vec<String> {
    let mut bodies = Vec::new();
    for i in 0..n {
        let body = json!({"id": format!("order-{i}")}).to_string();
        if i % 3 == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    bodies
}

fn exactly_once(counts: &Counts, n: usize) {
    let counts = counts.lock().unwrap();
    assert_eq!(counts.len(), n, "every event reached stage B: {counts:?}");
    assert!(
        counts.values().all(|c| *c == 1),
        "applied more than once at B: {counts:?}"
    );
}

/// Two stages on LocalStack: A's queue, B's queue, one dedup table, and
/// the counts of A's handler runs and B's effects.
struct Pipeline {
    sqs: aws_sdk_sqs::Client,
    ddb: aws_sdk_dynamodb::Client,
    a: QueuePair,
    b: QueuePair,
    table: String,
    runs: Counts,
    applied: Counts,
}

impl Pipeline {
    /// Fresh resources (A's queue with this visibility), `bodies` sent to A.
    async fn new(a_visibility: u64, bodies: &[String]) -> Self {
        let (sqs, ddb) = (sqs().await, ddb().await);
        let a = queues(&sqs, false, a_visibility).await;
        let b = queues(&sqs, false, 5).await;
        let table = dedup_table(&ddb).await;
        send_all(&sqs, &a.queue_url, bodies).await;
        Self {
            sqs,
            ddb,
            a,
            b,
            table,
            runs: Counts::default(),
            applied: Counts::default(),
        }
    }

    fn store(&self) -> DynamoStore {
        DynamoStore::new(self.ddb.clone(), self.table.as_str())
    }

    fn stage_a(&self) -> impl Handler + use<> {
        stage_a(self.b.queue_url.clone(), self.runs.clone())
    }

    /// Runs `a` on A's queue and stage B on B's until `n` events reached B
    /// and both queues are empty (within `secs`); A's run.
    async fn run_until_drained<H: Handler>(
        &self,
        a: Processor<DynamoStore, H>,
        n: usize,
        secs: u64,
    ) -> sqs_once::poller::RunStats {
        let pb = Processor::new(self.store(), stage_b(self.applied.clone()), b_config()).unwrap();
        let stop = CancellationToken::new();
        let (sqs, a_url, b_url) = (&self.sqs, &self.a.queue_url, &self.b.queue_url);
        let ra = tokio::spawn(run(sqs.clone(), a, poller_config(a_url), stop.clone()));
        let rb = tokio::spawn(run(sqs.clone(), pb, poller_config(b_url), stop.clone()));
        until(
            "the events reached B and both queues drained",
            secs,
            async || {
                self.applied.lock().unwrap().len() == n
                    && depth(sqs, a_url).await == 0
                    && depth(sqs, b_url).await == 0
            },
        )
        .await;
        stop.cancel();
        let stats = ra.await.unwrap();
        rb.await.unwrap();
        stats
    }
}

#[tokio::test]
async fn a_two_stage_pipeline_of_pollers_applies_each_event_once_downstream() {
    if !crate::common::localstack_up().await {
        return;
    }
    let p = Pipeline::new(5, &events(30)).await;
    let pa = Processor::new(p.store(), p.stage_a(), a_config()).unwrap();
    let sa = p.run_until_drained(pa, 30, 90).await;
    exactly_once(&p.applied, 30);
    assert_eq!(sa.parked, 0, "{sa:?}");
    assert_eq!(
        depth(&p.sqs, &p.a.dlq_url).await + depth(&p.sqs, &p.b.dlq_url).await,
        0
    );
}

#[tokio::test]
async fn a_poller_killed_between_commit_and_send_sends_on_the_redelivery() {
    if !crate::common::localstack_up().await {
        return;
    }
    let p = Pipeline::new(2, &events(1)[..1]).await;
    let (sqs, b, table) = (&p.sqs, &p.b, &p.table);

    // The first poller commits, then hangs in its send and is killed there:
    // it runs on a runtime of its own (with its own clients), shut down with
    // every task on it, as a process that dies.
    let reached = Arc::new(tokio::sync::Notify::new());
    let (kill, killed) = tokio::sync::oneshot::channel::<()>();
    let process = {
        let (reached, runs) = (reached.clone(), p.runs.clone());
        let (b_url, a_url, table) = (b.queue_url.clone(), p.a.queue_url.clone(), table.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut faulty = Faulty::new().await;
                faulty.stuck.store(true, Ordering::SeqCst);
                faulty.reached = reached;
                let store = DynamoStore::new(crate::common::ddb().await, table.as_str());
                let processor = Processor::new(store, stage_a(b_url, runs), a_config())
                    .unwrap()
                    .with_dispatcher(faulty);
                let queue = crate::common::sqs().await;
                let config = poller_config(&a_url);
                tokio::spawn(run(queue, processor, config, CancellationToken::new()));
                let _ = killed.await;
            });
            runtime.shutdown_background();
        })
    };
    tokio::time::timeout(Duration::from_secs(30), reached.notified())
        .await
        .expect("the send after the commit is reached");
    kill.send(()).unwrap();
    process.join().unwrap();
    let record = p.store().get("stage-a#order-0").await.unwrap().unwrap();
    assert_eq!(record.status, sqs_once::Status::Completed);
    assert_eq!(record.outbox.len(), 1, "recorded, not sent");
    assert_eq!(
        depth(sqs, &b.queue_url).await,
        0,
        "nothing sent before the kill"
    );

    // A new poller (the runtime's own SQS client sends) and stage B.
    let second = Processor::new(p.store(), p.stage_a(), a_config()).unwrap();
    let metrics = second.clone();
    p.run_until_drained(second, 1, 60).await;
    exactly_once(&p.applied, 1);
    assert_eq!(
        p.runs.lock().unwrap()["order-0"],
        1,
        "stage A's handler ran once"
    );
    assert_eq!(metrics.metrics().take().outbox_recovered, 1);
    let record = p.store().get("stage-a#order-0").await.unwrap().unwrap();
    assert!(record.outbox.is_empty(), "marked dispatched");
}

async fn lambda<H: Handler>(
    table: &str,
    handler: H,
    config: ProcessorConfig,
    dispatcher: Option<Faulty>,
) -> LambdaAdapter<DynamoStore, H> {
    let mut processor =
        Processor::new(DynamoStore::new(ddb().await, table), handler, config).unwrap();
    if let Some(d) = dispatcher {
        processor = processor.with_dispatcher(d);
    }
    let config = {
        let mut c = LambdaConfig::default();
        c.error_on_full_failure = false;
        c
    };
    LambdaAdapter::new(sqs().await, processor, config)
}

/// A send made with its answer lost is sent again at once (a whole call
/// that failed for a cause that passes: `outbox::CALL_RETRY_PAUSE`), so the
/// record is not listed to come back; the target gets the message twice,
/// with one outbox id, and applies it once.
#[tokio::test]
async fn in_lambda_a_send_whose_answer_is_lost_is_sent_again_at_once_and_applied_once_downstream() {
    if !crate::common::localstack_up().await {
        return;
    }
    let p = Pipeline::new(5, &events(1)[..1]).await;
    let (sqs, a, b, table) = (&p.sqs, &p.a, &p.b, &p.table);
    let (runs, applied) = (&p.runs, &p.applied);
    let faulty = Faulty::new().await;
    faulty.lose.store(true, Ordering::SeqCst);
    let la = lambda(table, p.stage_a(), a_config(), Some(faulty.clone())).await;
    let deadline = || std::time::SystemTime::now() + Duration::from_secs(60);

    // Committed and sent, the answer lost, sent again: nothing listed.
    let event = crate::lambda::receive_event(sqs, &a.queue_url, 1).await;
    let first = la.handle(event, deadline()).await.unwrap();
    assert!(first.batch_item_failures.is_empty(), "{first:?}");
    assert!(!faulty.lose.load(Ordering::SeqCst), "the answer was lost");
    assert_eq!(
        runs.lock().unwrap()["order-0"],
        1,
        "stage A's handler ran once"
    );

    // B receives the message twice, with one outbox id, and applies it once.
    let event = crate::lambda::receive_event(sqs, &b.queue_url, 2).await;
    let ids: Vec<&str> = event["Records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["messageAttributes"][OUTBOX_ID_ATTRIBUTE]["stringValue"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(ids, ["stage-a#order-0#out-0"; 2]);
    let lb = lambda(table, stage_b(applied.clone()), b_config(), None).await;
    let answer = lb.handle(event, deadline()).await.unwrap();
    assert!(answer.batch_item_failures.is_empty());
    exactly_once(applied, 1);
    // (The event source mapping, not the function, deletes what succeeded.)
}

/// Stage A sending a body too large for SQS (300 KiB: JSON whitespace pads it).
fn stage_a_large(b_url: String, runs: Counts) -> impl Handler {
    staged_only(handler_fn(move |m: Message, ctx: Context| {
        let (b_url, runs) = (b_url.clone(), runs.clone());
        async move {
            let id = id_of(m.body());
            *runs.lock().unwrap().entry(id.clone()).or_default() += 1;
            ctx.send(&b_url, large_paid(&id))?;
            Ok(None)
        }
    }))
}

fn large_paid(id: &str) -> String {
    let pad = " ".repeat(300 * 1024);
    format!(r#"{{"id":"{id}",{pad}"paid":true}}"#)
}

/// A's processor, storing large outgoing bodies under `out/` in `bucket`.
async fn a_sending_large(p: &Pipeline, bucket: &str) -> Processor<DynamoStore, impl Handler> {
    let payloads =
        LargePayloads::new(crate::large_payloads::s3().await).sending_large_to(PayloadLocation {
            bucket: bucket.to_owned(),
            prefix: "out/".to_owned(),
        });
    Processor::new(
        p.store(),
        stage_a_large(p.b.queue_url.clone(), p.runs.clone()),
        a_config(),
    )
    .unwrap()
    .with_large_payloads(payloads)
}

#[tokio::test]
async fn a_large_outgoing_body_goes_through_s3_and_is_applied_once_downstream() {
    if !crate::common::localstack_up().await {
        return;
    }
    let s3 = crate::large_payloads::s3().await;
    let bucket = crate::large_payloads::bucket(&s3).await;
    let p = Pipeline::new(5, &events(6)).await;
    let pa = a_sending_large(&p, &bucket).await;
    // B reads payloads from the bucket A stores them in; its handler parses
    // the body (a pointer would not parse as an order).
    let seen = Arc::new(Mutex::new(Vec::new()));
    let keep = seen.clone();
    let pb = Processor::new(
        p.store(),
        handler_fn(move |m: Message, _ctx| {
            let keep = keep.clone();
            async move {
                keep.lock().unwrap().push(m.body().to_owned());
                Ok(None)
            }
        }),
        b_config(),
    )
    .unwrap()
    .with_large_payloads(
        LargePayloads::new(s3.clone()).only_from(vec![PayloadLocation {
            bucket: bucket.clone(),
            prefix: "out/".to_owned(),
        }]),
    );
    let stop = CancellationToken::new();
    let (sqs, a_url, b_url) = (&p.sqs, &p.a.queue_url, &p.b.queue_url);
    let ra = tokio::spawn(run(sqs.clone(), pa, poller_config(a_url), stop.clone()));
    let rb = tokio::spawn(run(sqs.clone(), pb, poller_config(b_url), stop.clone()));
    until(
        "six large messages reached B and both queues drained",
        90,
        async || {
            seen.lock().unwrap().len() >= 6
                && depth(sqs, a_url).await == 0
                && depth(sqs, b_url).await == 0
        },
    )
    .await;
    stop.cancel();
    let (sa, sb) = (ra.await.unwrap(), rb.await.unwrap());
    assert_eq!((sa.parked, sb.parked), (0, 0), "{sa:?} {sb:?}");
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    let mut expected: Vec<String> = (0..6).map(|i| large_paid(&format!("order-{i}"))).collect();
    expected.sort();
    assert!(seen == expected, "each large body applied once at B, whole");
    let stored = crate::large_payloads::objects(&s3, &bucket).await;
    assert!(
        stored.len() >= 6 && stored.iter().all(|k| k.starts_with("out/")),
        "{stored:?}"
    );
}

#[tokio::test]
async fn a_large_outgoing_body_is_read_by_the_sqs_extended_client() {
    if !crate::common::localstack_up().await {
        return;
    }
    let s3 = crate::large_payloads::s3().await;
    let bucket = crate::large_payloads::bucket(&s3).await;
    let p = Pipeline::new(5, &events(2)[..2]).await;
    let pa = a_sending_large(&p, &bucket).await;
    let stop = CancellationToken::new();
    let (sqs, a_url, b_url) = (&p.sqs, &p.a.queue_url, &p.b.queue_url);
    let ra = tokio::spawn(run(sqs.clone(), pa, poller_config(a_url), stop.clone()));
    until("A sent its message", 60, async || {
        depth(sqs, a_url).await == 0 && depth(sqs, b_url).await >= 1
    })
    .await;
    stop.cancel();
    ra.await.unwrap();
    // The Amazon SQS Extended Client Library for Python, receiving from B's
    // queue, reads the body from S3.
    let bodies = crate::large_payloads::receive_extended(b_url, &bucket, 1).await;
    assert_eq!(bodies, [large_paid("order-0")]);
}

/// Stage B keyed on the outbox id (`attribute:sqs_once_outbox_id`, as a
/// second stage that shares no secret with the first is set up), failing
/// permanently while `failing`: its effects counted per event.
fn stage_b_on_outbox_ids(applied: Counts, failing: Arc<AtomicBool>) -> impl Handler {
    handler_fn(move |m: Message, _ctx| {
        let (applied, failing) = (applied.clone(), failing.clone());
        async move {
            if failing.load(Ordering::SeqCst) {
                return Err(sqs_once::HandlerError::permanent("rejected until fixed"));
            }
            *applied.lock().unwrap().entry(id_of(m.body())).or_default() += 1;
            Ok(None)
        }
    })
}

#[tokio::test]
async fn a_stage_keyed_on_the_outbox_id_runs_a_redriven_copy_once_and_skips_a_resend() {
    if !crate::common::localstack_up().await {
        return;
    }
    let p = Pipeline::new(5, &events(1)[..1]).await;
    let (sqs, b) = (&p.sqs, &p.b);
    let mut b_config = ProcessorConfig::new("stage-b");
    b_config.key_source = format!("attribute:{OUTBOX_ID_ATTRIBUTE}").parse().unwrap();
    let failing = Arc::new(AtomicBool::new(true));
    let stop = CancellationToken::new();
    let mut b_poller = poller_config(&b.queue_url);
    b_poller.dlq_url = Some(b.dlq_url.clone());
    let b_processor = |failing: Arc<AtomicBool>| {
        let handler = stage_b_on_outbox_ids(p.applied.clone(), failing);
        Processor::new(p.store(), handler, b_config.clone()).unwrap()
    };
    let a = Processor::new(p.store(), p.stage_a(), a_config()).unwrap();
    let ra = tokio::spawn(run(
        sqs.clone(),
        a,
        poller_config(&p.a.queue_url),
        stop.clone(),
    ));
    let rb = tokio::spawn(run(
        sqs.clone(),
        b_processor(failing.clone()),
        b_poller.clone(),
        stop.clone(),
    ));
    until("B parked the event", 60, async || {
        depth(sqs, &b.dlq_url).await == 1 && depth(sqs, &b.queue_url).await == 0
    })
    .await;
    stop.cancel();
    ra.await.unwrap();
    rb.await.unwrap();
    assert!(p.applied.lock().unwrap().is_empty(), "nothing applied yet");

    // The parked copy keeps the outbox id B keys on.
    let parked = sqs
        .receive_message()
        .queue_url(&b.dlq_url)
        .message_attribute_names("All")
        .visibility_timeout(0)
        .wait_time_seconds(1)
        .send()
        .await
        .unwrap()
        .messages
        .unwrap_or_default();
    assert_eq!(parked.len(), 1);
    let attributes = parked[0].message_attributes().unwrap();
    let outbox_id = attributes
        .get(OUTBOX_ID_ATTRIBUTE)
        .and_then(|a| a.string_value())
        .expect("the parked copy keeps sqs_once_outbox_id")
        .to_owned();
    let body = parked[0].body().unwrap().to_owned();

    // The handler is fixed, and the DLQ redriven as `sqs-once redrive` does.
    let options = sqs_once_cli::ops::RedriveOptions::default();
    let report = sqs_once_cli::ops::redrive(sqs, &b.dlq_url, &b.queue_url, &options, |_| {})
        .await
        .unwrap();
    assert_eq!(report.moved, 1, "{report:?}");
    let run_b = |stop: CancellationToken| {
        tokio::spawn(run(
            sqs.clone(),
            b_processor(Arc::new(AtomicBool::new(false))),
            b_poller.clone(),
            stop,
        ))
    };
    let stop = CancellationToken::new();
    let rb = run_b(stop.clone());
    until("the redriven copy applied", 60, async || {
        p.applied.lock().unwrap().len() == 1 && depth(sqs, &b.queue_url).await == 0
    })
    .await;
    stop.cancel();
    let first = rb.await.unwrap();
    assert_eq!(first.parked, 0, "{first:?}");

    // The same outgoing message sent again (an outbox re-send): skipped.
    sqs.send_message()
        .queue_url(&b.queue_url)
        .message_body(&body)
        .message_attributes(
            OUTBOX_ID_ATTRIBUTE,
            aws_sdk_sqs::types::MessageAttributeValue::builder()
                .data_type("String")
                .string_value(&outbox_id)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let rb = run_b(stop.clone());
    until("the resend settled", 60, async || {
        depth(sqs, &b.queue_url).await == 0
    })
    .await;
    stop.cancel();
    let second = rb.await.unwrap();
    assert_eq!(second.duplicates, 1, "{second:?}");
    assert_eq!(second.parked, 0, "{second:?}");
    exactly_once(&p.applied, 1);
    assert_eq!(depth(sqs, &b.dlq_url).await, 0, "nothing parked again");
}
