//! The external-effect example: the real `payments` binary against the stub
//! payment API of `tests/support/payments_api.rs`, which honours
//! `Idempotency-Key` (as Stripe does) and counts requests and charges.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use sqs_once::{DedupStore, DynamoStore, Status, StoredResult};

use crate::common::{Ledger, StubApi, ddb, depth, run_until_drained_with, send_all, sqs};

fn payments() -> std::path::PathBuf {
    crate::common::binary("payments")
}

/// The payments consumer with `PAYMENTS_PAUSE_AFTER_CALL`.
fn faulty_payments() -> std::path::PathBuf {
    crate::common::binary("faulty-payments")
}

fn payment(id: &str, amount: i64) -> String {
    payment_by(id, "cus_1", amount)
}

fn payment_by(id: &str, customer: &str, amount: i64) -> String {
    json!({"id": id, "customer": customer, "amount_cents": amount}).to_string()
}

#[tokio::test]
async fn kill_between_the_charge_and_its_completion_charges_once() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::with_visibility(&sqs, &ddb, 3).await;
    send_all(&sqs, &l.queues.queue_url, &[payment("pay-1", 500)]).await;
    let mut env = api.env().to_vec();
    env.extend([("SQS_ONCE_LEASE", "3s"), ("SQS_ONCE_HEARTBEAT", "1s")]);
    let mut slow = env.clone();
    slow.push(("PAYMENTS_PAUSE_AFTER_CALL", "60s"));
    let mut first = l.command_for(&faulty_payments(), &slow).spawn().unwrap();

    // The API has charged; the consumer is still before its completion.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while api.requests().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the API was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.kill().await.unwrap();
    let store = DynamoStore::new(ddb.clone(), l.dedup.clone());
    let pk = sqs_once::key::record_key("ledger", "pay-1");
    let record = store.get(&pk).await.unwrap().unwrap();
    assert_eq!(
        record.status,
        Status::InProgress,
        "killed before the completion"
    );
    assert_eq!(api.charges(), 1);

    // The redelivery runs again once the dead claim's lease ends, and calls the
    // API with the same key: the API answers with the first charge.
    run_until_drained_with(&l, &sqs, 1, &payments(), &env).await;
    let requests = api.requests();
    assert_eq!(
        requests.len(),
        2,
        "called again after the crash: {requests:?}"
    );
    assert_eq!(requests[0], requests[1], "same idempotency key and body");
    assert_eq!(
        requests[0].0,
        sqs_once::key::idempotency_key("ledger", "pay-1"),
        "the documented key"
    );
    assert_eq!(api.charges(), 1, "charged once");
    let record = store.get(&pk).await.unwrap().unwrap();
    assert_eq!(record.status, Status::Completed);
    assert_eq!(record.attempts, 2);
    assert_eq!(
        record.result,
        Some(StoredResult::Value(
            json!({"charge_id": "ch_1", "amount_cents": 500})
        )),
        "the first charge is the recorded result"
    );
    assert_eq!(depth(&sqs, &l.queues.queue_url).await, 0);
}

#[tokio::test]
async fn concurrent_duplicates_call_the_api_once_per_payment() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::new(&sqs, &ddb).await;
    let mut bodies = Vec::new();
    for i in 0..20 {
        let body = payment(&format!("pay-{i}"), 100 + i);
        if i % 3 == 0 {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    send_all(&sqs, &l.queues.queue_url, &bodies).await;
    let env = api.env();
    run_until_drained_with(&l, &sqs, 2, &payments(), &env).await;
    let requests = api.requests();
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for (key, _) in &requests {
        *per_key.entry(key.clone()).or_default() += 1;
    }
    assert_eq!(per_key.len(), 20, "every payment charged");
    assert!(
        per_key.values().all(|&n| n == 1),
        "a duplicate never reached the API: {per_key:?}"
    );
    assert_eq!(api.charges(), 20);
}

#[tokio::test]
async fn declined_and_invalid_payments_are_parked_with_the_reason() {
    if !crate::common::localstack_up().await {
        return;
    }
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::new(&sqs, &ddb).await;
    let env = api.env();
    send_all(
        &sqs,
        &l.queues.queue_url,
        &[
            payment_by("pay-d", "cus_declined", 100),
            payment("pay-y", -5),
            payment("pay-x", 100),
        ],
    )
    .await;
    run_until_drained_with(&l, &sqs, 1, &payments(), &env).await;
    // The same payment id again with another amount: a producer bug. The key is
    // completed, so it is a duplicate (and reported); the API is not called.
    send_all(&sqs, &l.queues.queue_url, &[payment("pay-x", 999)]).await;
    run_until_drained_with(&l, &sqs, 1, &payments(), &env).await;

    let parked = crate::common::bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 2, "{parked:?}");
    let reason = |id: &str| {
        parked
            .iter()
            .find(|(body, _)| body.contains(id))
            .map(|(_, r)| r.clone())
            .unwrap()
    };
    assert!(reason("pay-d").contains("402") && reason("pay-d").contains("card_declined"));
    assert!(reason("pay-y").contains("amount must be positive"));
    let mut keys: Vec<String> = api.requests().into_iter().map(|(k, _)| k).collect();
    keys.sort();
    let mut expected = vec![
        sqs_once::key::idempotency_key("ledger", "pay-d"),
        sqs_once::key::idempotency_key("ledger", "pay-x"),
    ];
    expected.sort();
    assert_eq!(
        keys, expected,
        "no call for the invalid one or the duplicate"
    );
    assert_eq!(api.charges(), 1);
    let store = DynamoStore::new(ddb.clone(), l.dedup.clone());
    let declined = store
        .get(&sqs_once::key::record_key("ledger", "pay-d"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(declined.status, Status::Failed, "kept for inspection");
}

#[tokio::test]
async fn the_stub_api_counts_calls_open_at_once_for_one_key() {
    if !crate::common::localstack_up().await {
        return;
    }
    // The chaos harness relies on it to catch two attempts of one payment at once.
    let api = StubApi::start_with(crate::common::ApiFaults {
        hold_max: Duration::from_millis(500),
        lose_permille: 0,
    })
    .await;
    let roots = std::fs::read(&api.ca_file).unwrap();
    let client = reqwest::Client::builder()
        .tls_certs_merge(reqwest::Certificate::from_pem_bundle(&roots).unwrap())
        .build()
        .unwrap();
    let call = |key: &'static str| {
        client
            .post(format!("{}/charges", api.url))
            .header("idempotency-key", key)
            .body(json!({"customer": "cus_1", "amount_cents": 5}).to_string())
            .send()
    };
    // Every call is held a while (up to 500 ms), so calls made at once overlap.
    call("k-0").await.unwrap();
    let (a, b) = tokio::join!(call("k-1"), call("k-1"));
    assert_eq!(
        (a.unwrap().status().as_u16(), b.unwrap().status().as_u16()),
        (200, 200)
    );
    let (c, d) = (call("k-2").await.unwrap(), call("k-2").await.unwrap());
    assert_eq!((c.status().as_u16(), d.status().as_u16()), (200, 200));
    let state = api.state.lock().unwrap();
    assert_eq!(state.overlapping, ["k-1"], "only the concurrent pair");
    assert_eq!(state.charged.len(), 3, "one charge per key");
}

/// The example speaks HTTPS and checks the certificate: a stub whose
/// certificate is not trusted is never called (the charge is retried, not
/// made), and the same call with the stub's CA trusted charges once.
#[tokio::test]
async fn the_payment_client_calls_only_an_api_whose_certificate_it_trusts() {
    use sqs_once::{MemoryStore, Message, Outcome, Processor, ProcessorConfig};
    use sqs_once_example_payments::PaymentHandler;

    let api = StubApi::start().await;
    let processor = |handler| {
        let mut config = ProcessorConfig::new("payments");
        config.key_source = "json:/id".parse().unwrap();
        Processor::new(MemoryStore::default(), handler, config).unwrap()
    };
    let untrusted = processor(PaymentHandler::new(&api.url, None).unwrap());
    let outcome = untrusted
        .process(Message::new("m-1", payment("pay-tls", 100)))
        .await;
    let Outcome::Retry { reason, .. } = &outcome else {
        panic!("an untrusted certificate must be a retry: {outcome:?}");
    };
    assert!(reason.contains("nothing sent"), "{reason}");
    assert!(api.requests().is_empty(), "no request reached the API");

    let roots = std::fs::read(&api.ca_file).unwrap();
    let trusted = processor(PaymentHandler::new(&api.url, Some(&roots)).unwrap());
    let outcome = trusted
        .process(Message::new("m-1", payment("pay-tls", 100)))
        .await;
    assert!(matches!(outcome, Outcome::Completed { .. }), "{outcome:?}");
    assert_eq!(api.charges(), 1);
}

/// The lease does not stop a call its holder's interrupt cannot reach (here a
/// task the handler spawned, sending late): the fence does. The first
/// holder's call goes out after its claim was released and the next holder
/// charged; the stub, keeping the highest `Fencing-Token` per key, refuses it.
#[tokio::test]
async fn an_older_holders_late_call_is_refused_by_its_fencing_token() {
    use sqs_once::{
        Context, Handler, HandlerError, MemoryStore, Message, Outcome, Processor, ProcessorConfig,
        handler_fn,
    };
    use sqs_once_example_payments::PaymentHandler;
    use std::sync::{Arc, Mutex};

    let api = StubApi::start().await;
    let roots = std::fs::read(&api.ca_file).unwrap();
    let payments = PaymentHandler::new(&api.url, Some(&roots)).unwrap();
    let go = Arc::new(tokio::sync::Notify::new());
    let (late_tx, late_rx) = tokio::sync::oneshot::channel();
    let late_tx = Arc::new(Mutex::new(Some(late_tx)));
    let fences = Arc::new(Mutex::new(Vec::new()));
    let (g, f) = (go.clone(), fences.clone());
    let handler = handler_fn(move |message: Message, ctx: Context| {
        let (payments, go, late_tx, fences) =
            (payments.clone(), g.clone(), late_tx.clone(), f.clone());
        async move {
            fences.lock().unwrap().push(ctx.fence());
            let Some(tx) = late_tx.lock().unwrap().take() else {
                return payments.handle(&message, &ctx).await;
            };
            // The first holder: its call is left to a task, which sends it
            // late, and the handler gives up (its claim is released).
            tokio::spawn(async move {
                go.notified().await;
                let _ = tx.send(payments.handle(&message, &ctx).await);
            });
            Err(HandlerError::retry("payment API too slow; given up"))
        }
    });
    let mut config = ProcessorConfig::new("payments");
    config.key_source = "json:/id".parse().unwrap();
    let processor = Processor::new(MemoryStore::default(), handler, config).unwrap();
    let body = payment("pay-late", 700);
    let first = processor.process(Message::new("m-1", body.clone())).await;
    assert!(matches!(first, Outcome::Retry { .. }), "{first:?}");
    let second = processor
        .process(Message::new("m-1", body).with_receive_count(2))
        .await;
    assert!(matches!(second, Outcome::Completed { .. }), "{second:?}");
    assert_eq!(api.charges(), 1);

    // The older holder's call arrives now.
    go.notify_one();
    let late = late_rx.await.unwrap();
    let refused = late.expect_err("the late call must be refused");
    assert!(
        refused.to_string().contains("409") && refused.to_string().contains("stale fencing token"),
        "{refused}"
    );
    let fences = fences.lock().unwrap().clone();
    assert!(fences[1] > fences[0], "{fences:?}");
    let key = sqs_once::key::idempotency_key("payments", "pay-late");
    assert_eq!(api.stale(), [(key.clone(), fences[0])]);
    assert_eq!(
        api.fence(&key),
        Some(fences[1]),
        "the next holder's call set it"
    );
    assert_eq!(api.charges(), 1, "charged once");
}

/// A TLS server on 127.0.0.1 that answers every request with `status` and
/// `Location: target`; its URL and its certificate's PEM.
async fn redirecting(status: u16, target: String) -> (String, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let (tls, pem) = crate::common::self_signed_tls();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (tls, target) = (tls.clone(), target.clone());
            tokio::spawn(async move {
                let Ok(stream) = tls.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |_| {
                    let mut answer = hyper::Response::new(http_body_util::Full::new(
                        bytes::Bytes::from_static(b"moved"),
                    ));
                    *answer.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                    answer
                        .headers_mut()
                        .insert("location", target.parse().unwrap());
                    async move { Ok::<_, std::convert::Infallible>(answer) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, pem)
}

/// A redirect is the API's answer, never followed: a 301 would turn the
/// charge into a GET whose answer would be taken for the charge, a 308 would
/// post it to another host that keeps its own idempotency keys. The message
/// is parked with a reason that says to check the payment by its key.
#[tokio::test]
async fn a_redirect_is_never_followed_and_parks_the_payment() {
    use sqs_once::{MemoryStore, Message, Outcome, Processor, ProcessorConfig};
    use sqs_once_example_payments::PaymentHandler;

    let api = StubApi::start().await;
    let api_pem = std::fs::read_to_string(&api.ca_file).unwrap();
    for status in [301, 308] {
        let (url, pem) = redirecting(status, format!("{}/charges", api.url)).await;
        let roots = format!("{pem}{api_pem}");
        let mut config = ProcessorConfig::new("payments");
        config.key_source = "json:/id".parse().unwrap();
        let handler = PaymentHandler::new(&url, Some(roots.as_bytes())).unwrap();
        let processor = Processor::new(MemoryStore::default(), handler, config).unwrap();
        let outcome = processor
            .process(Message::new("m-1", payment("pay-moved", 100)))
            .await;
        let Outcome::Park { reason, .. } = &outcome else {
            panic!("a {status} must park the payment: {outcome:?}");
        };
        assert!(reason.contains(&format!("answered {status}")), "{reason}");
        assert!(reason.contains("check the payment"), "{reason}");
    }
    assert!(api.requests().is_empty(), "no redirect was followed");
}
