//! A stub payment API on 127.0.0.1, over HTTPS with a fresh self-signed
//! certificate (its PEM in a file the consumer is told to trust:
//! [`StubApi::env`]), that honours `Idempotency-Key` (as Stripe
//! does) and records every call: `POST /charges` charges once per key; a
//! repeated key with the same body gets the first response, with another body a
//! 422; a call whose `Fencing-Token` is below the highest seen for its key is
//! refused with a 409 before anything else (the late call of an older
//! holder); customer `cus_declined` gets a 402, `cus_verbose` a 400 with a 1 MB
//! body. It also counts calls that were open
//! at the same time for one key, and can hold calls and lose responses after
//! the charge (faults for the chaos harness).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

/// Faults the stub injects.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiFaults {
    /// Each call is held up to this long (uniformly by call number) before it is
    /// answered, so calls overlap.
    pub hold_max: Duration,
    /// Per mille of successful calls whose response is lost after the charge.
    pub lose_permille: u64,
}

#[derive(Default)]
pub struct Api {
    /// Every request: (idempotency key, body).
    pub requests: Vec<(String, Value)>,
    /// Every request's `traceparent` header, in the same order.
    pub traceparents: Vec<Option<String>>,
    /// Responses by idempotency key, with the body that made them.
    pub by_key: HashMap<String, (Value, Value)>,
    /// Charges made, in order: (key, body).
    pub charged: Vec<(String, Value)>,
    /// Calls open right now, by key.
    pub open: HashMap<String, u32>,
    /// Calls that started while another call with the same key was open.
    pub overlapping: Vec<String>,
    /// Responses lost after the charge.
    pub lost_responses: u64,
    /// The highest `Fencing-Token` seen, by key.
    pub fences: HashMap<String, u64>,
    /// Calls refused for a `Fencing-Token` below the highest: (key, token).
    pub stale: Vec<(String, u64)>,
}

pub struct StubApi {
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// The PEM file of the stub's certificate.
    pub ca_file: PathBuf,
    pub state: Arc<Mutex<Api>>,
}

impl StubApi {
    pub async fn start() -> Self {
        Self::start_with(ApiFaults::default()).await
    }

    pub async fn start_with(faults: ApiFaults) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let (tls, pem) = super::self_signed_tls();
        let ca_file =
            std::env::temp_dir().join(format!("sqs-once-api-{}.pem", uuid::Uuid::new_v4()));
        std::fs::write(&ca_file, pem).unwrap();
        let state: Arc<Mutex<Api>> = Default::default();
        let s = state.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (s, tls) = (s.clone(), tls.clone());
                tokio::spawn(async move {
                    let Ok(stream) = tls.accept(stream).await else {
                        return;
                    };
                    let service =
                        hyper::service::service_fn(move |req| charge(req, s.clone(), faults));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            url,
            ca_file,
            state,
        }
    }

    /// What a payments consumer needs to call this stub: `PAYMENTS_URL` and
    /// `PAYMENTS_CA_FILE`.
    pub fn env(&self) -> [(&'static str, &str); 2] {
        [
            ("PAYMENTS_URL", self.url.as_str()),
            (
                "PAYMENTS_CA_FILE",
                self.ca_file.to_str().expect("a UTF-8 temp path"),
            ),
        ]
    }

    pub fn requests(&self) -> Vec<(String, Value)> {
        self.state.lock().unwrap().requests.clone()
    }

    pub fn traceparents(&self) -> Vec<Option<String>> {
        self.state.lock().unwrap().traceparents.clone()
    }

    pub fn charges(&self) -> u64 {
        self.state.lock().unwrap().charged.len() as u64
    }

    /// Calls refused for a `Fencing-Token` below the highest: (key, token).
    pub fn stale(&self) -> Vec<(String, u64)> {
        self.state.lock().unwrap().stale.clone()
    }

    /// The highest `Fencing-Token` seen for `key`.
    pub fn fence(&self, key: &str) -> Option<u64> {
        self.state.lock().unwrap().fences.get(key).copied()
    }
}

/// Marks a call open for its key until dropped (also when the caller hangs up).
struct Open {
    state: Arc<Mutex<Api>>,
    key: String,
}

impl Open {
    fn new(state: &Arc<Mutex<Api>>, key: &str) -> Self {
        let mut api = state.lock().unwrap();
        let open = api.open.entry(key.to_owned()).or_default();
        *open += 1;
        if *open > 1 {
            api.overlapping.push(key.to_owned());
        }
        Self {
            state: state.clone(),
            key: key.to_owned(),
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(n) = self.state.lock().unwrap().open.get_mut(&self.key) {
            *n -= 1;
        }
    }
}

#[derive(Debug)]
pub struct ResponseLost;

impl std::fmt::Display for ResponseLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("response lost by the stub payment API after the charge")
    }
}

impl std::error::Error for ResponseLost {}

fn reply(status: u16, body: Value) -> Result<hyper::Response<Full<Bytes>>, ResponseLost> {
    let mut r = hyper::Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    Ok(r)
}

async fn charge(
    req: hyper::Request<hyper::body::Incoming>,
    state: Arc<Mutex<Api>>,
    faults: ApiFaults,
) -> Result<hyper::Response<Full<Bytes>>, ResponseLost> {
    if req.uri().path() != "/charges" || req.method() != hyper::Method::POST {
        return reply(404, json!({"error": "not found"}));
    }
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let traceparent = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let fence = req
        .headers()
        .get("fencing-token")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Ok(body) = req.into_body().collect().await else {
        return Err(ResponseLost);
    };
    let body: Value = serde_json::from_slice(&body.to_bytes()).unwrap_or(Value::Null);
    let Some(key) = key else {
        return reply(400, json!({"error": "Idempotency-Key required"}));
    };
    let _open = Open::new(&state, &key);
    let call = {
        let mut api = state.lock().unwrap();
        api.requests.push((key.clone(), body.clone()));
        api.traceparents.push(traceparent);
        api.requests.len() as u64
    };
    if !faults.hold_max.is_zero() {
        let hold = faults.hold_max.as_millis() as u64 * (call * 7919 % 101) / 100;
        tokio::time::sleep(Duration::from_millis(hold)).await;
    }
    let mut api = state.lock().unwrap();
    if let Some(fence) = fence {
        let highest = api.fences.entry(key.clone()).or_default();
        if fence < *highest {
            let highest = *highest;
            api.stale.push((key, fence));
            return reply(
                409,
                json!({"error": "stale fencing token", "fence": fence, "highest": highest}),
            );
        }
        *highest = fence;
    }
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
    api.charged.push((key.clone(), body.clone()));
    let n = api.charged.len();
    let response = json!({"charge_id": format!("ch_{n}"), "amount_cents": body["amount_cents"]});
    api.by_key.insert(key, (body, response.clone()));
    if faults.lose_permille > 0 && (call * 2_654_435_761) % 1000 < faults.lose_permille {
        api.lost_responses += 1;
        return Err(ResponseLost);
    }
    reply(200, response)
}
