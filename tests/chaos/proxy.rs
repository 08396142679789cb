//! An HTTP proxy in front of LocalStack that injects faults into the AWS
//! traffic of the processes under test.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_util::sync::CancellationToken;

use crate::Rng;

/// How long a slow response or a late request is held: past the SDK's 5 s
/// attempt timeout for DynamoDB.
const HOLD: Duration = Duration::from_secs(6);

/// Faults the proxy injects, and how many it did.
#[derive(Default)]
pub struct Faults {
    /// Per mille of write responses lost after the write was applied.
    pub lose_permille: AtomicU32,
    /// Per mille of DynamoDB responses held past the client's timeout.
    pub slow_permille: AtomicU32,
    /// Per mille of DynamoDB write requests held on the way in past the client's
    /// timeout, then applied anyway (after the client gave up).
    pub late_permille: AtomicU32,
    /// Refuse new connections while set.
    refusing: AtomicBool,
    /// Cancelled to cut every open connection (a new token per refusal window).
    cut: Mutex<CancellationToken>,
    /// Lost responses by operation.
    pub lost: Mutex<BTreeMap<String, u64>>,
    pub slowed: AtomicU64,
    pub late: AtomicU64,
    pub refused: AtomicU64,
    pub cut_connections: AtomicU64,
    rng: Mutex<Option<Rng>>,
}

impl Faults {
    fn roll(&self, permille: &AtomicU32) -> bool {
        let p = permille.load(Ordering::Relaxed);
        p > 0
            && self
                .rng
                .lock()
                .unwrap()
                .get_or_insert(Rng(0x9E37_79B9_7F4A_7C15))
                .next_u64()
                % 1000
                < u64::from(p)
    }

    /// Refuses new connections and cuts the open ones (pooled keep-alive
    /// connections included) until [`Faults::accept`].
    pub fn refuse(&self) {
        self.refusing.store(true, Ordering::SeqCst);
        let old = std::mem::take(&mut *self.cut.lock().unwrap());
        old.cancel();
    }

    pub fn accept(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::SeqCst)
    }

    /// "Op 3, Op 1" of the lost responses, or "none".
    pub fn lost_summary(&self) -> (u64, String) {
        let lost = self.lost.lock().unwrap();
        let total = lost.values().sum();
        let list: Vec<String> = lost.iter().map(|(op, n)| format!("{op} {n}")).collect();
        (
            total,
            if list.is_empty() {
                "none".into()
            } else {
                list.join(", ")
            },
        )
    }
}

/// Whether an operation (the `x-amz-target` after the dot) changes state, so a
/// lost response or a late arrival matters. Every write each mode sends is one.
fn is_write(op: &str) -> bool {
    const READS: &[&str] = &[
        "Get",
        "Describe",
        "List",
        "Receive",
        "Query",
        "Scan",
        "BatchGet",
        "TransactGet",
    ];
    !op.is_empty() && !READS.iter().any(|r| op.starts_with(r))
}

type Upstream = HttpClient<HttpConnector, Full<Bytes>>;

/// Starts the proxy; returns its URL.
pub async fn start(upstream: String, faults: Arc<Faults>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let client: Upstream = HttpClient::builder(TokioExecutor::new()).build_http();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            if faults.is_refusing() {
                faults.refused.fetch_add(1, Ordering::Relaxed);
                drop(stream);
                continue;
            }
            let cut = faults.cut.lock().unwrap().clone();
            let (client, upstream, faults) = (client.clone(), upstream.clone(), faults.clone());
            tokio::spawn(async move {
                let f = faults.clone();
                let service = hyper::service::service_fn(move |req| {
                    forward(req, client.clone(), upstream.clone(), f.clone())
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    _ = conn => {}
                    () = cut.cancelled() => {
                        faults.cut_connections.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    addr
}

#[derive(Debug)]
pub struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("response dropped by the chaos proxy")
    }
}

impl std::error::Error for Dropped {}

async fn forward(
    req: hyper::Request<hyper::body::Incoming>,
    client: Upstream,
    upstream: String,
    faults: Arc<Faults>,
) -> Result<hyper::Response<Full<Bytes>>, Dropped> {
    let target = req
        .headers()
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let op = target.rsplit('.').next().unwrap_or_default().to_owned();
    let dynamodb = target.starts_with("DynamoDB_");
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
    let uri = format!(
        "{upstream}{}",
        parts.uri.path_and_query().map_or("/", |p| p.as_str())
    );
    let mut out = hyper::Request::builder().method(parts.method).uri(uri);
    for (k, v) in &parts.headers {
        if k != hyper::header::HOST {
            out = out.header(k, v);
        }
    }
    let out = out.body(Full::new(body)).map_err(|_| Dropped)?;
    let late = dynamodb && is_write(&op) && faults.roll(&faults.late_permille);
    // Sent from its own task, so the request arrives even after the client hung up.
    let sent = tokio::spawn(async move {
        if late {
            tokio::time::sleep(HOLD).await;
        }
        let response = client.request(out).await.map_err(|_| Dropped)?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|_| Dropped)?.to_bytes();
        Ok::<_, Dropped>((parts, body))
    });
    if late {
        faults.late.fetch_add(1, Ordering::Relaxed);
    }
    let (parts, body) = sent.await.map_err(|_| Dropped)??;
    if is_write(&op) && faults.roll(&faults.lose_permille) {
        // Applied upstream; the client sees the connection close instead.
        *faults.lost.lock().unwrap().entry(op).or_default() += 1;
        return Err(Dropped);
    }
    if dynamodb && faults.roll(&faults.slow_permille) {
        faults.slowed.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(HOLD).await;
    }
    Ok(hyper::Response::from_parts(parts, Full::new(body)))
}
