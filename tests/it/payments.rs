//! The external-effect example: the real `payments` binary against a stub
//! payment API that honours `Idempotency-Key` (as Stripe does) and counts
//! requests and charges.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use sqs_once::{DedupStore, DynamoStore, Status, StoredResult};

use crate::common::{Ledger, ddb, depth, run_until_drained_with, send_all, sqs};

const PAYMENTS: &str = env!("CARGO_BIN_EXE_payments");

#[derive(Default)]
struct Api {
    /// Every request: (idempotency key, body).
    requests: Vec<(String, Value)>,
    /// Responses by idempotency key, with the body that made them.
    by_key: HashMap<String, (Value, Value)>,
    /// Charges made.
    charges: u64,
}

/// A payment API on 127.0.0.1: `POST /charges` charges once per idempotency
/// key; a repeated key with the same body gets the first response, with another
/// body a 422; customer `cus_declined` gets a 402, `cus_verbose` a 400 with a
/// 1 MB body.
struct StubApi {
    url: String,
    state: Arc<Mutex<Api>>,
}

impl StubApi {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state: Arc<Mutex<Api>> = Default::default();
        let s = state.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let s = s.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| charge(req, s.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { url, state }
    }

    fn requests(&self) -> Vec<(String, Value)> {
        self.state.lock().unwrap().requests.clone()
    }

    fn charges(&self) -> u64 {
        self.state.lock().unwrap().charges
    }
}

async fn charge(
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<Api>>,
) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
    let reply = |status: u16, body: Value| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(body.to_string())));
        *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
        Ok(r)
    };
    if req.uri().path() != "/charges" || req.method() != hyper::Method::POST {
        return reply(404, json!({"error": "not found"}));
    }
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body: Value =
        serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let Some(key) = key else {
        return reply(400, json!({"error": "Idempotency-Key required"}));
    };
    let mut api = state.lock().unwrap();
    api.requests.push((key.clone(), body.clone()));
    if body["customer"] == "cus_declined" {
        return reply(402, json!({"error": "card_declined"}));
    }
    if body["customer"] == "cus_verbose" {
        // A 1 MB error answer with a forged log line in it.
        let noise = format!(
            "\n2026-01-01T00:00:00Z  INFO all good{}",
            "x".repeat(1 << 20)
        );
        return reply(400, json!({"error": noise}));
    }
    if let Some((first_body, response)) = api.by_key.get(&key) {
        if *first_body != body {
            return reply(422, json!({"error": "key reused with other parameters"}));
        }
        return reply(200, response.clone());
    }
    api.charges += 1;
    let response =
        json!({"charge_id": format!("ch_{}", api.charges), "amount_cents": body["amount_cents"]});
    api.by_key.insert(key, (body, response.clone()));
    reply(200, response)
}

fn payment(id: &str, amount: i64) -> String {
    payment_by(id, "cus_1", amount)
}

fn payment_by(id: &str, customer: &str, amount: i64) -> String {
    json!({"id": id, "customer": customer, "amount_cents": amount}).to_string()
}

#[tokio::test]
async fn kill_between_the_charge_and_its_completion_charges_once() {
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::with_visibility(&sqs, &ddb, 3).await;
    send_all(&sqs, &l.queues.queue_url, &[payment("pay-1", 500)]).await;
    let env = [
        ("PAYMENTS_URL", api.url.as_str()),
        ("SQS_ONCE_LEASE", "3s"),
        ("SQS_ONCE_HEARTBEAT", "1s"),
    ];
    let mut slow = env.to_vec();
    slow.push(("PAYMENTS_PAUSE_AFTER_CALL", "60s"));
    let mut first = l.command_for(PAYMENTS, &slow).spawn().unwrap();

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
    run_until_drained_with(&l, &sqs, 1, PAYMENTS, &env).await;
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
    let env = [("PAYMENTS_URL", api.url.as_str())];
    run_until_drained_with(&l, &sqs, 2, PAYMENTS, &env).await;
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
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::new(&sqs, &ddb).await;
    let env = [("PAYMENTS_URL", api.url.as_str())];
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
    run_until_drained_with(&l, &sqs, 1, PAYMENTS, &env).await;
    // The same payment id again with another amount: a producer bug. The key is
    // completed, so it is a duplicate (and reported); the API is not called.
    send_all(&sqs, &l.queues.queue_url, &[payment("pay-x", 999)]).await;
    run_until_drained_with(&l, &sqs, 1, PAYMENTS, &env).await;

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
async fn a_huge_api_answer_is_parked_with_a_bounded_reason() {
    let (sqs, ddb) = (sqs().await, ddb().await);
    let api = StubApi::start().await;
    let l = Ledger::new(&sqs, &ddb).await;
    let env = [("PAYMENTS_URL", api.url.as_str())];
    send_all(
        &sqs,
        &l.queues.queue_url,
        &[payment_by("pay-v", "cus_verbose", 100)],
    )
    .await;
    run_until_drained_with(&l, &sqs, 1, PAYMENTS, &env).await;

    let parked = crate::common::bodies_with_reasons(&sqs, &l.queues.dlq_url).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    let reason = &parked[0].1;
    assert!(
        reason.contains("400") && reason.contains("(cut; over 65536 bytes)"),
        "{reason}"
    );
    assert!(reason.len() < 1024, "bounded: {} bytes", reason.len());
    let record = DynamoStore::new(ddb.clone(), l.dedup.clone())
        .get(&sqs_once::key::record_key("ledger", "pay-v"))
        .await
        .unwrap()
        .unwrap();
    assert!(
        record.error.as_deref().is_some_and(|e| e.len() < 1024),
        "the record's error is bounded: {:?}",
        record.error.map(|e| e.len())
    );
}
