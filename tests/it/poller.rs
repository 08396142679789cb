//! The long-polling runtime against LocalStack: the real `ledger` binary for the
//! end-to-end cases, the library's `run` with counting handlers for timing cases.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqs_once::config::ProcessorConfig;
use sqs_once::poller::{PollerConfig, run};
use sqs_once::{DedupStore, DynamoStore, HandlerError, Message, Processor, handler_fn};
use tokio_util::sync::CancellationToken;

use crate::common::{
    Ledger, bodies_with_reasons, ddb, dedup_table, depth, ledger_rows, queues, run_until_drained,
    sdk_config, send_all, sqs,
};

/// Events for 5 accounts; every third sent twice. Returns bodies and expected rows.
fn events(n: usize) -> (Vec<String>, HashMap<String, (i64, i64)>) {
    let mut bodies = Vec::new();
    let mut expected: HashMap<String, (i64, i64)> = HashMap::new();
    for i in 0..n {
        let account = format!("acct-{}", i % 5);
        let amount = 100 + i as i64;
        let e = expected.entry(account.clone()).or_default();
        e.0 += amount;
        e.1 += 1;
        let body = serde_json::json!({"id": format!("evt-{i}"), "account": account, "amount_cents": amount}).to_string();
        if i % 3 == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    (bodies, expected)
}

/// `k` pollers on 60 events of which every third is sent twice (33%).
async fn pollers_apply_each_event_once(k: usize, env: &[(&str, &str)]) {
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let (bodies, expected) = events(60);
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let received: u64 = run_until_drained(&l, &sqs, k, env)
        .await
        .iter()
        .map(|s| s["received"].as_u64().unwrap())
        .sum();
    assert!(
        received >= bodies.len() as u64,
        "received {received} of {}",
        bodies.len()
    );
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        expected,
        "every event applied exactly once"
    );
    assert_eq!(
        depth(&sqs, &l.queues.queue_url).await,
        0,
        "every message deleted"
    );
    assert_eq!(depth(&sqs, &l.queues.dlq_url).await, 0, "nothing parked");
}

#[tokio::test]
async fn two_pollers_apply_every_event_exactly_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    pollers_apply_each_event_once(2, &[]).await;
}

#[tokio::test]
async fn four_pollers_on_the_fast_path_apply_every_event_exactly_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    pollers_apply_each_event_once(4, &[]).await;
}

#[tokio::test]
async fn four_pollers_on_the_general_path_apply_every_event_exactly_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    pollers_apply_each_event_once(4, &[("SQS_ONCE_FAST_PATH", "false")]).await;
}

#[tokio::test]
async fn malformed_bodies_end_in_the_dlq_with_a_reason() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let bodies = vec![
        "not json".to_owned(),
        r#"{"id":"e-1","account":"a"}"#.to_owned(),
        r#"{"id":"e-2","account":"a","amount_cents":5}"#.to_owned(),
    ];
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let out = l
        .command(&[("SQS_ONCE_EXIT_WHEN_IDLE", "2s")])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let reasons = bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].0 == "not json" && reasons[0].1.contains("not valid JSON"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].1.contains("missing field `amount_cents`"),
        "{reasons:?}"
    );
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([("a".to_owned(), (5, 1))])
    );
    assert_eq!(depth(&sqs, &l.queues.queue_url).await, 0);
}

/// Waits until some handler holds a claim (a record is `IN_PROGRESS`).
async fn until_a_handler_runs(ddb: &aws_sdk_dynamodb::Client, dedup: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let items = ddb
            .scan()
            .table_name(dedup)
            .consistent_read(true)
            .send()
            .await
            .unwrap()
            .items
            .unwrap_or_default();
        if items.iter().any(|i| {
            i.get("status")
                .and_then(|v| v.as_s().ok())
                .is_some_and(|s| s == "IN_PROGRESS")
        }) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no handler started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SIGTERM while handlers run; returns the stopped poller's counts after
/// checking it exited 0 within `within`.
async fn stop_mid_work(
    l: &Ledger,
    ddb: &aws_sdk_dynamodb::Client,
    env: &[(&str, &str)],
    within: Duration,
) -> serde_json::Value {
    let child = l.command(env).spawn().unwrap();
    until_a_handler_runs(ddb, &l.dedup).await;
    let pid = child.id().unwrap();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = tokio::time::timeout(within, child.wait_with_output())
        .await
        .expect("exits within the drain deadline")
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    crate::common::stats_line(&out.stdout)
}

/// Runs a fresh poller until the queue is drained and checks every event
/// applied exactly once.
async fn finish_and_check(
    l: &Ledger,
    sqs: &aws_sdk_sqs::Client,
    ddb: &aws_sdk_dynamodb::Client,
    expected: &HashMap<String, (i64, i64)>,
) {
    run_until_drained(l, sqs, 1, &[]).await;
    assert_eq!(
        &ledger_rows(ddb, &l.ledger).await,
        expected,
        "nothing lost, nothing doubled"
    );
    assert_eq!(depth(sqs, &l.queues.dlq_url).await, 0);
}

#[tokio::test]
async fn sigterm_drains_in_flight_work_and_exits_zero() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let (bodies, expected) = events(12);
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    // Handlers take 1 s; the drain deadline of 8 s lets the running ones finish.
    // The general path: the test watches for a claim to know a handler runs.
    let env = [
        ("LEDGER_WORK", "1s"),
        ("SQS_ONCE_DRAIN", "8s"),
        ("SQS_ONCE_FAST_PATH", "false"),
    ];
    let stats = stop_mid_work(&l, &ddb, &env, Duration::from_secs(12)).await;
    let finished = stats["completed"].as_u64().unwrap() + stats["duplicates"].as_u64().unwrap();
    assert!(
        finished >= 1,
        "running handlers were drained, not dropped: {stats}"
    );
    assert_eq!(
        stats["retried"], 0,
        "nothing interrupted within the deadline: {stats}"
    );
    // Drained work was deleted before exit; the rest is still in the queue.
    finish_and_check(&l, &sqs, &ddb, &expected).await;
}

#[tokio::test]
async fn sigterm_past_the_drain_deadline_releases_unfinished_work() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let (bodies, expected) = events(6);
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    // Handlers take 30 s; the drain deadline is 1 s: they are interrupted and released.
    let env = [
        ("LEDGER_WORK", "30s"),
        ("SQS_ONCE_DRAIN", "1s"),
        ("SQS_ONCE_FAST_PATH", "false"),
    ];
    let stats = stop_mid_work(&l, &ddb, &env, Duration::from_secs(10)).await;
    assert_eq!(stats["completed"], 0, "{stats}");
    let retried = stats["retried"].as_u64().unwrap();
    assert!(retried >= 1, "interrupted work is given back: {stats}");
    // Released, not left to expire: every claim the poller held has its lease
    // end moved to the past (the lease is 60 s) with the reason recorded, and
    // every event is visible again at once (the visibility timeout is 30 s).
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let store = DynamoStore::new(ddb.clone(), l.dedup.clone());
    let mut released = 0;
    for i in 0..6 {
        let pk = sqs_once::key::record_key("ledger", &format!("evt-{i}"));
        if let Some(r) = store.get(&pk).await.unwrap() {
            assert_eq!(r.status, sqs_once::Status::InProgress, "{r:?}");
            assert!(
                r.lease_until_ms <= now_ms && r.error.is_some(),
                "claim released with its reason: {r:?}"
            );
            released += 1;
        }
    }
    assert!(released >= 1, "the running handlers' claims exist");
    let visible = sqs
        .get_queue_attributes()
        .queue_url(&l.queues.queue_url)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default()
        .values()
        .map(|v| v.parse::<u64>().unwrap())
        .sum::<u64>();
    assert_eq!(
        visible,
        bodies.len() as u64,
        "every message (copies included) visible again at once"
    );
    // So a new poller applies them without waiting for a lease or a visibility
    // timeout to run out.
    let started = std::time::Instant::now();
    finish_and_check(&l, &sqs, &ddb, &expected).await;
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "taken over at once, not after the 30 s visibility: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn start_up_rejects_a_bad_setting_naming_it() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let run = |env: Vec<(&'static str, String)>| {
        let mut c = l.command(&[]);
        for (k, v) in env {
            c.env(k, v);
        }
        async move { c.stderr(Stdio::piped()).output().await }
    };
    let out = run(vec![("SQS_ONCE_HEARTBEAT", "90s".into())])
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("SQS_ONCE_HEARTBEAT") && stderr.contains("below the lease"),
        "{stderr}"
    );
    let out = run(vec![("SQS_ONCE_TABLE", l.ledger.clone())])
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("expires_at") && stderr.contains("SQS_ONCE_TABLE"),
        "{stderr}"
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "a table without TTL is rejected at start-up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_a_slow_handler_from_redelivery() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 2).await; // visibility 2 s, handler takes 6 s
    send_all(&sqs, &q.queue_url, &["slow".to_owned()]).await;
    let calls = Arc::new(Mutex::new(0));
    let c = calls.clone();
    let handler = handler_fn(move |_m, _ctx| {
        let c = c.clone();
        async move {
            *c.lock().unwrap() += 1;
            tokio::time::sleep(Duration::from_secs(6)).await;
            Ok(None)
        }
    });
    let mut pc = ProcessorConfig::new("slow");
    pc.lease = Duration::from_secs(2);
    pc.heartbeat = Duration::from_millis(500);
    let processor = Processor::new(
        DynamoStore::new(ddb.clone(), dedup_table(&ddb).await),
        handler,
        pc,
    )
    .unwrap();
    let mut qc = PollerConfig::new(&q.queue_url);
    qc.wait_time = Duration::from_secs(1);
    qc.exit_when_idle = Some(Duration::from_secs(4));
    let stats = run(sqs.clone(), processor, qc, CancellationToken::new()).await;
    assert_eq!(*calls.lock().unwrap(), 1, "not redelivered while running");
    assert_eq!(
        (stats.received, stats.completed, stats.in_flight),
        (1, 1, 0),
        "{stats:?}"
    );
    assert_eq!(depth(&sqs, &q.queue_url).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_keeps_group_order_and_a_failure_holds_only_its_group() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, true, 30).await;
    for i in 0..5 {
        for g in ["A", "B"] {
            sqs.send_message()
                .queue_url(&q.queue_url)
                .message_body(format!("{g}{i}"))
                .message_group_id(g)
                .message_deduplication_id(format!("{g}{i}"))
                .send()
                .await
                .unwrap();
        }
    }
    let calls: Arc<Mutex<Vec<String>>> = Arc::default();
    let c = calls.clone();
    let failed_once = Arc::new(Mutex::new(false));
    let handler = handler_fn(move |m: Message, _ctx| {
        let (c, failed_once) = (c.clone(), failed_once.clone());
        async move {
            c.lock().unwrap().push(m.body().to_owned());
            let mut f = failed_once.lock().unwrap();
            if m.body() == "A2" && !*f {
                *f = true;
                return Err(HandlerError::retry_after(
                    Duration::from_secs(1),
                    "A2 fails once",
                ));
            }
            Ok(None)
        }
    });
    let processor = Processor::new(
        DynamoStore::new(ddb.clone(), dedup_table(&ddb).await),
        handler,
        ProcessorConfig::new("fifo"),
    )
    .unwrap();
    let mut qc = PollerConfig::new(&q.queue_url);
    qc.wait_time = Duration::from_secs(1);
    // The group is held ~2 s after A2's failure: the idle exit must not come
    // first, even on a loaded machine (a run once exited before A2 was back).
    qc.exit_when_idle = Some(Duration::from_secs(8));
    let stats = run(sqs.clone(), processor, qc, CancellationToken::new()).await;
    let calls = calls.lock().unwrap().clone();
    let of = |g: char| {
        calls
            .iter()
            .filter(|b| b.starts_with(g))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of('A'),
        ["A0", "A1", "A2", "A2", "A3", "A4"],
        "A's order kept across its failure"
    );
    assert_eq!(of('B'), ["B0", "B1", "B2", "B3", "B4"], "B unaffected");
    // A is held for 1 s after its failure; B moved on meanwhile: all of B ran
    // before A2's retry.
    let a2_retry = calls.iter().rposition(|b| b == "A2").unwrap();
    let b4 = calls.iter().position(|b| b == "B4").unwrap();
    assert!(
        b4 < a2_retry,
        "B went on while A was held, not after it: {calls:?}"
    );
    assert_eq!(stats.completed, 10, "{stats:?}");
    assert_eq!(depth(&sqs, &q.queue_url).await, 0);
}

/// Issue 57: on a FIFO queue whose redrive policy allows 3 receives, the
/// first of three messages of one group fails transiently every time (it
/// would five times). It runs again in place after its own retry delay
/// (1 s), its group kept invisible, and its third attempt's failure parks
/// it alone: the other two never reach the DLQ, each applies once, in
/// order. Before, they were handed back with it at each failure, spent
/// their three receives with it and reached the DLQ unrun. The
/// `maxReceiveCount` is read from the queue as the binaries read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fifo_head_is_parked_alone_and_its_group_runs_in_order() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = sqs_once_cli::setup::ensure_queue_with_dlq(
        &sqs,
        &crate::common::unique("inplace"),
        true,
        Duration::from_secs(30),
        3,
    )
    .await
    .unwrap();
    for body in ["m1", "m2", "m3"] {
        sqs.send_message()
            .queue_url(&q.queue_url)
            .message_body(body)
            .message_group_id("g")
            .message_deduplication_id(body)
            .send()
            .await
            .unwrap();
    }
    // Every run: (body, receive count, when); every effect, in order.
    type Runs = Arc<Mutex<Vec<(String, u32, tokio::time::Instant)>>>;
    let runs: Runs = Arc::default();
    let effects: Arc<Mutex<Vec<String>>> = Arc::default();
    let (r, e) = (runs.clone(), effects.clone());
    let handler = handler_fn(move |m: Message, ctx: sqs_once::Context| {
        let (r, e) = (r.clone(), e.clone());
        async move {
            let mut r = r.lock().unwrap();
            r.push((
                m.body().to_owned(),
                ctx.receive_count(),
                tokio::time::Instant::now(),
            ));
            let m1_runs = r.iter().filter(|(b, _, _)| b == "m1").count();
            if m.body() == "m1" && m1_runs <= 5 {
                return Err(HandlerError::retry_after(
                    Duration::from_secs(1),
                    "m1 fails",
                ));
            }
            e.lock().unwrap().push(m.body().to_owned());
            Ok(None)
        }
    });
    let config = ProcessorConfig::new("inplace");
    let (heartbeat, ttl) = (config.heartbeat, config.ttl);
    let processor = Processor::new(
        DynamoStore::new(ddb.clone(), dedup_table(&ddb).await),
        handler,
        config,
    )
    .unwrap();
    let attributes = sqs_once::poller::check_queue(&sqs, &q.queue_url, heartbeat, ttl)
        .await
        .unwrap();
    assert_eq!(attributes.max_receive_count, Some(3));
    let mut qc = PollerConfig::new(&q.queue_url);
    qc.dlq_url = Some(q.dlq_url.clone());
    qc.max_receive_count = attributes.max_receive_count;
    qc.wait_time = Duration::from_secs(1);
    qc.exit_when_idle = Some(Duration::from_secs(8));
    let stats = run(sqs.clone(), processor, qc, CancellationToken::new()).await;
    let runs = runs.lock().unwrap().clone();
    let effects = effects.lock().unwrap().clone();
    assert_eq!(
        effects,
        ["m2", "m3"],
        "each once, in order: {runs:?} {stats:?}"
    );
    let seen: Vec<(&str, u32)> = runs.iter().map(|(b, n, _)| (b.as_str(), *n)).collect();
    assert_eq!(
        seen,
        [("m1", 1), ("m1", 2), ("m1", 3), ("m2", 1), ("m3", 1)],
        "m1 three attempts, m2 and m3 on their first receive: {stats:?}"
    );
    // Its own retry delay between m1's attempts.
    for pair in runs[..3].windows(2) {
        let gap = pair[1].2 - pair[0].2;
        assert!(gap >= Duration::from_secs(1), "m1 ran again after {gap:?}");
    }
    let parked = bodies_with_reasons(&sqs, &q.dlq_url).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].0, "m1", "{parked:?}");
    assert!(parked[0].1.contains("maxReceiveCount"), "{parked:?}");
    assert_eq!(
        (stats.received, stats.parked, stats.completed),
        (3, 1, 2),
        "{stats:?}"
    );
    assert_eq!(depth(&sqs, &q.queue_url).await, 0);
}

#[tokio::test]
async fn sigkill_mid_handler_loses_nothing_and_applies_once_after_restart() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::with_visibility(&sqs, &ddb, 3).await;
    let slow = [
        ("LEDGER_WORK", "4s"),
        ("SQS_ONCE_LEASE", "3s"),
        ("SQS_ONCE_HEARTBEAT", "1s"),
        ("SQS_ONCE_FAST_PATH", "false"),
    ];
    let mut first = l.command(&slow).spawn().unwrap();
    let body = r#"{"id":"evt-kill","account":"k","amount_cents":42}"#.to_owned();
    send_all(&sqs, &l.queues.queue_url, &[body]).await;

    // Kill the poller while its handler runs (the claim is held, nothing applied).
    let store = DynamoStore::new(ddb.clone(), l.dedup.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        use sqs_once::DedupStore;
        let rec = store.get("ledger#evt-kill").await.unwrap();
        if rec.is_some_and(|r| r.status == sqs_once::Status::InProgress) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handler never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.kill().await.unwrap();
    assert!(
        ledger_rows(&ddb, &l.ledger).await.is_empty(),
        "killed before the effect"
    );

    // A restarted poller takes over once the dead owner's lease and the message's
    // visibility run out, and applies the event exactly once.
    let mut fast = slow.to_vec();
    fast[0] = ("LEDGER_WORK", "0s");
    run_until_drained(&l, &sqs, 1, &fast).await;
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([("k".to_owned(), (42, 1))])
    );
    assert_eq!(
        depth(&sqs, &l.queues.queue_url).await,
        0,
        "nothing left behind"
    );
    use sqs_once::DedupStore;
    let rec = store.get("ledger#evt-kill").await.unwrap().unwrap();
    assert_eq!((rec.status, rec.attempts), (sqs_once::Status::Completed, 2));
}

#[tokio::test]
async fn fast_path_sigkill_before_the_commit_loses_nothing_and_applies_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::with_visibility(&sqs, &ddb, 3).await;
    // Visibility is extended by the lease each heartbeat: keep both short so the
    // killed poller's message comes back soon.
    let slow = [
        ("LEDGER_WORK", "30s"),
        ("SQS_ONCE_LEASE", "3s"),
        ("SQS_ONCE_HEARTBEAT", "1s"),
    ];
    let mut first = l.command(&slow).spawn().unwrap();
    let body = r#"{"id":"evt-kill","account":"k","amount_cents":42}"#.to_owned();
    send_all(&sqs, &l.queues.queue_url, &[body]).await;
    // Received (in flight) means its handler runs: nothing is recorded before the commit.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while in_flight(&sqs, &l.queues.queue_url).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never received");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    first.kill().await.unwrap();
    // Records only: the table also keeps the consumer's stamp (and may keep
    // the carry secret), whose keys hold no `#`.
    let scan = ddb.scan().table_name(&l.dedup).send().await.unwrap();
    let records: Vec<_> = scan
        .items()
        .iter()
        .filter_map(|item| item.get("pk")?.as_s().ok())
        .filter(|pk| pk.contains('#'))
        .collect();
    assert!(
        records.is_empty(),
        "no record before the commit: {records:?}"
    );
    assert!(ledger_rows(&ddb, &l.ledger).await.is_empty());

    run_until_drained(&l, &sqs, 1, &[]).await;
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([("k".to_owned(), (42, 1))])
    );
    let store = DynamoStore::new(ddb.clone(), l.dedup.clone());
    use sqs_once::DedupStore;
    let rec = store.get("ledger#evt-kill").await.unwrap().unwrap();
    assert_eq!(rec.status, sqs_once::Status::Completed);
}

/// Messages received and not yet deleted or made visible.
async fn in_flight(sqs: &aws_sdk_sqs::Client, url: &str) -> u64 {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(
            aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        )
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default()
        .values()
        .map(|v| v.parse::<u64>().unwrap())
        .sum()
}

#[tokio::test]
async fn emf_lines_count_what_the_poller_did() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let (mut bodies, _) = events(30);
    bodies.push("not json".into());
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let runs = run_until_drained(&l, &sqs, 1, &[("SQS_ONCE_METRICS_INTERVAL", "1s")]).await;
    let (stats, emf) = (&runs[0], runs[0]["emf"].as_array().unwrap());
    assert!(!emf.is_empty(), "no EMF line printed");
    let sum = |name: &str| -> u64 { emf.iter().map(|l| l[name].as_u64().unwrap_or(0)).sum() };
    for line in emf {
        let directive = &line["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "sqs-once");
        assert_eq!(directive["Dimensions"], serde_json::json!([["Consumer"]]));
        assert_eq!(line["Consumer"], "ledger");
        assert!(line["_aws"]["Timestamp"].as_i64().unwrap() > 1_700_000_000_000);
        for def in directive["Metrics"].as_array().unwrap() {
            assert!(
                !line[def["Name"].as_str().unwrap()].is_null(),
                "{def} missing"
            );
        }
    }
    assert_eq!(sum("Processed"), 30, "{emf:?}");
    assert_eq!(sum("DuplicatesSkipped"), 10);
    assert_eq!(sum("PermanentFailures"), 1);
    assert_eq!(sum("Processed"), stats["completed"].as_u64().unwrap());
    assert_eq!(
        sum("DuplicatesSkipped"),
        stats["duplicates"].as_u64().unwrap()
    );
    // The latencies are a histogram: bucket values and their counts.
    let latencies: u64 = emf
        .iter()
        .filter_map(|l| l["HandlerLatency"]["Counts"].as_array())
        .flatten()
        .map(|c| c.as_u64().unwrap())
        .sum();
    // The fast path runs the handler for duplicates too; the keyless body never
    // reaches it.
    assert_eq!(latencies, 40, "one handler run per keyed message");
}

/// Regression (found by the chaos harness): a poller sent SIGTERM while still
/// starting up was killed by the signal (exit by signal 15) instead of stopping
/// cleanly, because its handler was installed only once polling began.
#[tokio::test]
async fn sigterm_during_start_up_exits_zero() {
    if !crate::common::localstack_up().await {
        return;
    }
    // An endpoint that accepts connections and never answers: the start-up
    // checks hang there.
    let blackhole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", blackhole.local_addr().unwrap());
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let child = l
        .command(&[("AWS_ENDPOINT_URL", endpoint.as_str())])
        .spawn()
        .unwrap();
    // It is in its start-up checks once it has connected.
    let (_held, _) = tokio::time::timeout(Duration::from_secs(10), blackhole.accept())
        .await
        .expect("the poller never connected")
        .unwrap();
    let pid = child.id().unwrap().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let out = tokio::time::timeout(Duration::from_secs(5), child.wait_with_output())
        .await
        .expect("stops at once")
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{:?}", out.status);
    assert_eq!(crate::common::stats_line(&out.stdout)["received"], 0);
}

/// A poller that starts while AWS is unreachable keeps trying its start-up
/// checks (a transient failure is not a misconfiguration) and starts once the
/// endpoint answers. Found by the chaos harness: restarted pollers exited 2
/// during its connection-refusal windows.
#[tokio::test]
async fn start_up_waits_out_an_unreachable_endpoint() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    send_all(
        &sqs,
        &l.queues.queue_url,
        &[r#"{"id":"e-late","account":"late","amount_cents":9}"#.to_owned()],
    )
    .await;
    // A port nothing listens on yet: connections are refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = l
        .command(&[("AWS_ENDPOINT_URL", &format!("http://127.0.0.1:{port}"))])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = tokio::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::io::AsyncBufReadExt::read_line(&mut stderr, &mut line),
        )
        .await
        .expect("no retry reported")
        .unwrap();
        assert!(n > 0, "the poller exited instead of retrying");
        if line.contains("trying again") {
            break;
        }
    }
    // Now the endpoint answers: forward the port to LocalStack.
    let _forwarder = crate::common::Forwarder::start(port).await;
    tokio::spawn(async move {
        let mut sink = String::new();
        while tokio::io::AsyncBufReadExt::read_line(&mut stderr, &mut sink)
            .await
            .is_ok_and(|n| n > 0)
        {
            sink.clear();
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while depth(&sqs, &l.queues.queue_url).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "never processed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(
        ledger_rows(&ddb, &l.ledger).await,
        HashMap::from([("late".to_owned(), (9, 1))])
    );
}

#[tokio::test]
async fn sigterm_stops_within_drain_and_cleanup_even_when_aws_stops_answering() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let aws = crate::common::Forwarder::start(0).await;
    let child = l
        .command(&[
            ("AWS_ENDPOINT_URL", aws.url.as_str()),
            ("LEDGER_WORK", "60s"),
            ("SQS_ONCE_DRAIN", "1s"),
            ("SQS_ONCE_FAST_PATH", "false"),
        ])
        .spawn()
        .unwrap();
    send_all(
        &sqs,
        &l.queues.queue_url,
        &[r#"{"id":"e-stuck","account":"s","amount_cents":1}"#.to_owned()],
    )
    .await;
    until_a_handler_runs(&ddb, &l.dedup).await;
    // AWS goes quiet: the release after the drain cannot get an answer.
    aws.hold();
    let stopping = tokio::time::Instant::now();
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .expect("stops even though AWS does not answer")
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let took = stopping.elapsed();
    assert!(
        took < Duration::from_secs(1) + sqs_once::poller::CLEANUP + Duration::from_secs(3),
        "took {took:?}: drain (1 s) + cleanup ({:?}) is the bound",
        sqs_once::poller::CLEANUP
    );
    assert!(
        ledger_rows(&ddb, &l.ledger).await.is_empty(),
        "nothing applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_ahead_receives_ten_at_a_time_with_uneven_handlers() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let q = queues(&sqs, false, 30).await;
    let bodies: Vec<String> = (0..100).map(|i| i.to_string()).collect();
    send_all(&sqs, &q.queue_url, &bodies).await;
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = runs.clone();
    // From 10 ms to 300 ms, unevenly: with concurrency 4, never ten slots
    // free at once.
    let handler = handler_fn(move |m: Message, _ctx| {
        let seen = seen.clone();
        async move {
            let i: u64 = m.body().parse().unwrap();
            tokio::time::sleep(Duration::from_millis(10 + (i * 37) % 290)).await;
            *seen.lock().unwrap().entry(m.body().to_owned()).or_default() += 1;
            Ok(None)
        }
    });
    let processor = Processor::new(
        DynamoStore::new(ddb.clone(), dedup_table(&ddb).await),
        handler,
        ProcessorConfig::new("ahead"),
    )
    .unwrap();
    let calls = sqs_once::aws::calls::CallCounter::default();
    let counted = aws_sdk_sqs::Client::from_conf(calls.sqs_config(&sdk_config().await));
    let mut qc = PollerConfig::new(&q.queue_url);
    qc.concurrency = 4;
    qc.batch_wait = Duration::from_secs(10);
    qc.wait_time = Duration::from_secs(1);
    qc.exit_when_idle = Some(Duration::from_secs(3));
    let stats = run(counted, processor, qc, CancellationToken::new()).await;
    assert_eq!((stats.received, stats.completed), (100, 100), "{stats:?}");
    assert!(runs.lock().unwrap().values().all(|&n| n == 1));
    let receives = calls.snapshot()["SQS.ReceiveMessage"] - stats.empty_receives;
    assert_eq!(receives, 10, "receives that returned messages");
    assert_eq!(depth(&sqs, &q.queue_url).await, 0);
}

/// `ledger --health`, with the poller's settings: its exit code.
async fn health(l: &Ledger, port: &str) -> Option<i32> {
    let out = l
        .command(&[("SQS_ONCE_HEALTH_PORT", port)])
        .arg("--health")
        .output()
        .await
        .unwrap();
    out.status.code()
}

#[tokio::test]
async fn the_health_check_answers_for_a_receiving_poller_and_fails_once_it_stops() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let l = Ledger::new(&sqs, &ddb).await;
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = free.local_addr().unwrap().port().to_string();
    drop(free);
    assert_eq!(health(&l, &port).await, Some(1), "no poller yet: unhealthy");
    let (bodies, _) = events(3);
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let child = l
        .command(&[("SQS_ONCE_HEALTH_PORT", &port), ("LEDGER_WORK", "1s")])
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while health(&l, &port).await != Some(0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the poller never reported healthy"
        );
    }
    let pid = child.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("exits after the drain")
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        health(&l, &port).await,
        Some(1),
        "a stopped poller: unhealthy"
    );
}
