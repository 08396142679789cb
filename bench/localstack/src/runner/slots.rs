//! Section 6: slot use with uneven handlers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqs_once::aws::calls::CallCounter;
use sqs_once::config::ProcessorConfig;
use sqs_once::poller::PollerConfig;

use sqs_once::{MemoryStore, Processor, handler_fn, staged_only};
use sqs_once_cli::setup::ensure_queue_with_dlq;
use tokio_util::sync::CancellationToken;

use crate::*;

/// Log-normal handler durations, from the event's number (a fixed seed):
/// median 150 ms, sigma 1, clipped to 20 ms .. 2 s.
pub(crate) fn uneven_duration(n: u64) -> Duration {
    // splitmix64, then Box-Muller.
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let unit = |z: u64| ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u1, u2) = (unit(mix(n * 2 + 16)), unit(mix(n * 2 + 17)));
    let normal = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
    let ms = (150f64.ln() + normal).exp().clamp(20.0, 2000.0);
    Duration::from_secs_f64(ms / 1000.0)
}

/// Section 6, slot use: concurrency 32, handlers of uneven durations (and fast
/// ones), the library poller with an in-memory dedup store on LocalStack's
/// SQS. Busy slot-seconds / (32 x the time until the last message started:
/// after that no work is left to start), and receives per message.
pub(crate) async fn slot_use(bench: &Bench, r: &mut Report) {
    let label = std::env::var("BENCH_RECEIVE_LABEL").unwrap_or_else(|_| "this build".into());
    let rounds: usize = env_or("BENCH_SLOT_ROUNDS", 1);
    let concurrency = 32usize;
    r.say(String::new());
    r.say(format!(
        "## 6. Slot use, receive strategy: {label} (concurrency {concurrency}, in-memory dedup store, LocalStack SQS)"
    ));
    r.say("| handlers | messages | slot use until the last start | slot use, whole run | receives per message | messages/s |".into());
    r.say("|---|---|---|---|---|---|".into());
    for (name, n, uneven) in [
        (
            "log-normal 20 ms - 2 s (median 150 ms)",
            env_or("BENCH_SLOT_MESSAGES", 1500u64),
            true,
        ),
        ("fast (5 ms)", 2000, false),
    ] {
        for _ in 0..rounds {
            let (window_use, whole_use, receives, rate) =
                slot_run(bench, n, uneven, concurrency).await;
            r.say(format!(
                "| {name} | {n} | {window_use:.3} | {whole_use:.3} | {receives:.3} | {rate:.1} |"
            ));
        }
    }
}

/// Busy handler time / (slots x time): until the last message started, and
/// over the whole run (`wall` from `t0`).
pub(crate) fn slot_use_of(
    spans: &[(Instant, Instant)],
    t0: Instant,
    wall: f64,
    concurrency: usize,
) -> (f64, f64) {
    let last_start = spans.iter().map(|s| s.0).max().unwrap();
    let window = last_start.duration_since(t0).as_secs_f64();
    let busy_window: f64 = spans
        .iter()
        .map(|(a, b)| {
            (*b.min(&last_start))
                .saturating_duration_since(*a)
                .as_secs_f64()
        })
        .sum();
    let busy: f64 = spans
        .iter()
        .map(|(a, b)| b.duration_since(*a).as_secs_f64())
        .sum();
    (
        busy_window / (concurrency as f64 * window),
        busy / (concurrency as f64 * wall),
    )
}

/// One slot-use run: slot use until the last start and over the whole run,
/// receives per message, messages/s.
pub(crate) async fn slot_run(
    bench: &Bench,
    n: u64,
    uneven: bool,
    concurrency: usize,
) -> (f64, f64, f64, f64) {
    let Bench { sdk, sqs, .. } = bench;
    let queues = ensure_queue_with_dlq(
        sqs,
        &unique("bench-slots"),
        false,
        Duration::from_secs(30),
        5,
    )
    .await
    .unwrap();
    let bodies: Vec<String> = (0..n)
        .map(|i| json!({"id": format!("evt-{i}"), "n": i}).to_string())
        .collect();
    send_all(sqs, &queues.queue_url, &bodies).await;
    let spans: Arc<std::sync::Mutex<Vec<(Instant, Instant)>>> = Arc::default();
    let seen = spans.clone();
    let handler = staged_only(handler_fn(move |m: sqs_once::Message, _ctx| {
        let seen = seen.clone();
        async move {
            let started = Instant::now();
            let v: Value = serde_json::from_str(m.body()).unwrap();
            tokio::time::sleep(if uneven {
                uneven_duration(v["n"].as_u64().unwrap())
            } else {
                Duration::from_millis(5)
            })
            .await;
            seen.lock().unwrap().push((started, Instant::now()));
            Ok(None)
        }
    }));
    let calls = CallCounter::default();
    let sqs_counted = aws_sdk_sqs::Client::from_conf(calls.sqs_config(sdk));
    let processor = Processor::new(
        MemoryStore::default(),
        handler,
        ProcessorConfig::new("bench"),
    )
    .unwrap();
    let mut pc = PollerConfig::new(&queues.queue_url);
    pc.concurrency = concurrency;
    pc.wait_time = Duration::from_secs(1);
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let task = tokio::spawn(sqs_once::poller::run(
        sqs_counted,
        processor,
        pc,
        stop.clone(),
    ));
    drained(sqs, &queues.queue_url, Duration::from_secs(1800)).await;
    let wall = t0.elapsed().as_secs_f64();
    stop.cancel();
    let stats = task.await.unwrap();
    let spans = spans.lock().unwrap().clone();
    assert_eq!(
        spans.len() as u64,
        n,
        "every message handled once: {stats:?}"
    );
    assert_eq!(stats.received, n, "{stats:?}");
    let (window_use, whole_use) = slot_use_of(&spans, t0, wall, concurrency);
    let receives = calls
        .snapshot()
        .get("SQS.ReceiveMessage")
        .copied()
        .unwrap_or(0)
        - stats.empty_receives;
    (
        window_use,
        whole_use,
        receives as f64 / n as f64,
        n as f64 / wall,
    )
}
