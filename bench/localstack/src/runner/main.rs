//! Side-by-side benchmarks on the same LocalStack, in one run: `bench/localstack/run`.
//!
//! Absolute times on a shared 2-core machine are noise; what is reported is
//! ratios of runs made alternately, and counts that do not depend on speed
//! (AWS calls per message, bytes). Every throughput run checks the ledger
//! sums, so a fast wrong run cannot count.

use std::time::SystemTime;

#[path = "../../../../tests/support/mod.rs"]
mod support;
use support::{depth, env_or, ledger_rows, send_all, unique};

mod calls;
mod common;
mod consumers;
#[path = "../events.rs"]
mod events;
mod lambda;
mod prices;
mod proc;
mod scale;
mod slots;
use calls::*;
use common::*;
use consumers::*;
use events::events;
use lambda::*;
use prices::*;
use proc::*;
use scale::*;
use slots::*;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list" || a == "--test") {
        return;
    }
    let sdk = sdk().await;
    let bench = Bench {
        sqs: aws_sdk_sqs::Client::new(&sdk),
        ddb: aws_sdk_dynamodb::Client::new(&sdk),
        sdk,
        calls_events: env_or("BENCH_CALLS_EVENTS", 2000),
        tp_events: env_or("BENCH_THROUGHPUT_EVENTS", 400),
        rounds: env_or("BENCH_ROUNDS", 3),
        python: std::env::var("BENCH_PYTHON").ok(),
        findings: Default::default(),
    };
    let sections: String = env_or("BENCH_SECTIONS", "12345678".to_owned());
    let run = |n: char| sections.contains(n);
    let mut r = Report::default();
    r.say(format!(
        "# sqs-once benchmarks, {}",
        humantime::format_rfc3339_seconds(SystemTime::now())
    ));
    if run('1') {
        calls_per_message(&bench, &mut r).await;
    }
    if run('2') {
        consumers(&bench, &mut r).await;
    }
    if run('3') {
        lambda_latency(&bench, &mut r).await;
    }
    if run('4') {
        footprint(&bench, &mut r).await;
    }
    if run('5') {
        scaling(&bench, &mut r).await;
    }
    if run('6') {
        slot_use(&bench, &mut r).await;
    }
    if run('7') {
        dollars(&bench, &mut r).await;
    }
    if run('8') {
        lambda_footprint(&bench, &mut r).await;
    }
    if let Ok(path) = std::env::var("BENCH_REPORT") {
        std::fs::write(path, r.0.join("\n") + "\n").unwrap();
    }
}
