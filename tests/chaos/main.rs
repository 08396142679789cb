//! The chaos harness: events with duplicates (and some malformed ones) through
//! the real binaries while faults are injected, then a check of the whole
//! history. It runs several modes, one after the other (`CHAOS_MODES`, a comma
//! list; default all of them):
//!
//! - `fast`: `faulty-ledger` pollers (the ledger example with the fault
//!   knobs of `tests/consumers`) on the one-transaction fast path.
//! - `claim`: `faulty-ledger` pollers on the claim path (`SQS_ONCE_FAST_PATH=false`)
//!   with handler work above the heartbeat on 30% of events, so leases are
//!   extended, lost (a DynamoDB response held past the lease) and taken over.
//! - `payments`: `payments` pollers against a stub payment API that honours
//!   idempotency keys, holds calls and loses responses after charging; checked
//!   for one charge per payment and never two open calls for one key.
//! - `lambda`: the `faulty-ledger` function behind `sqs-once local-lambda` (the local
//!   Runtime API as the event source), the function SIGKILLed mid-batch and
//!   frozen past its timeout so invocations time out.
//! - `mutant-lost`, `mutant-doubled`, `mutant-reordered`: the fast mode with a
//!   deliberate bug (a delete before the effect, a dedup key re-sent events do
//!   not share, FIFO messages run in parallel); each must FAIL with the right
//!   check, or the harness fails. `mutant-reordered` needs a build with `SQS_ONCE_MUTANTS=1`.
//!
//! Each mode sends `CHAOS_EVENTS` events (default: a quick size per mode; half
//! to a standard queue, half to a FIFO queue in `CHAOS_FIFO_GROUPS` groups,
//! default 5; every 50th malformed), of which `CHAOS_DUPLICATES` (0.3) are sent
//! again, half at once and half `CHAOS_LATE_SECS` later. AWS traffic goes through
//! a fault-injecting proxy (lost responses after writes, slow responses, late
//! requests, refused and cut connections); processes are SIGKILLed and
//! SIGTERMed on their own clocks; handlers panic on 1% of attempts. When both
//! queues are drained it checks: every valid event applied exactly once and
//! never parked, every malformed one parked with a reason and never applied,
//! FIFO order kept within each group, no dedup record left unfinished, no
//! process exited on its own or uncleanly after SIGTERM. One line of figures per
//! mode; the binary fails on any violation (or on a mutant not caught).
//!
//! To look into a run: `CHAOS_LOG_DIR=<dir>` keeps every process's stderr (a
//! file per process id) and `CHAOS_RUST_LOG` sets their `RUST_LOG` (default
//! errors only); `CHAOS_SEED` moves the fault schedule and the duplicates.

mod check;
mod proxy;
mod workers;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use serde_json::json;

#[path = "../support/mod.rs"]
mod support;
use support::payments_api::{ApiFaults, StubApi};
use support::{depth, env_or};

/// A binary of the workspace (built once: [`support::binary`]).
fn binary(name: &str) -> String {
    support::binary(name).to_string_lossy().into_owned()
}

/// A small deterministic generator (xorshift64*), so a run can be repeated.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() % 1_000_000) as f64 / 1_000_000.0 < p
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

// ------------------------------------------------------------------ modes

#[derive(Clone, Copy, PartialEq, Eq)]
enum Consumer {
    Ledger,
    Payments,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    Lost,
    Doubled,
    Reordered,
}

struct Mode {
    name: &'static str,
    consumer: Consumer,
    lambda: bool,
    /// Events at the quick size and at the nightly size (`CHAOS_SIZE=nightly`).
    events: (usize, usize),
    env: Vec<(&'static str, &'static str)>,
    /// A mutant: the check that must fail.
    expect: Option<Expect>,
}

/// Lease and heartbeat for the claim path: handler work (1.5 s) outlasts the
/// heartbeat, and a held DynamoDB response (6 s) outlasts the lease.
const CLAIM_ENV: &[(&str, &str)] = &[
    ("SQS_ONCE_FAST_PATH", "false"),
    ("SQS_ONCE_LEASE", "4s"),
    ("SQS_ONCE_HEARTBEAT", "1s"),
];

fn modes() -> Vec<Mode> {
    let slow = [("LEDGER_WORK", "1500ms"), ("LEDGER_SLOW_PERCENT", "30")];
    let mode = |name, consumer, lambda, events, env: Vec<_>, expect| Mode {
        name,
        consumer,
        lambda,
        events,
        env,
        expect,
    };
    let claim: Vec<_> = CLAIM_ENV.iter().copied().chain(slow).collect();
    vec![
        mode("fast", Consumer::Ledger, false, (400, 20_000), vec![], None),
        mode(
            "claim",
            Consumer::Ledger,
            false,
            (300, 5_000),
            claim.clone(),
            None,
        ),
        mode(
            "payments",
            Consumer::Payments,
            false,
            (200, 5_000),
            CLAIM_ENV[1..].to_vec(),
            None,
        ),
        mode("lambda", Consumer::Ledger, true, (200, 5_000), claim, None),
        mode(
            "mutant-lost",
            Consumer::Ledger,
            false,
            (200, 200),
            // 5% of attempts panic after the early delete: several valid
            // events are lost in every run, not only when a kill lands there.
            vec![
                ("LEDGER_MUTANT", "delete-first"),
                ("LEDGER_PANIC_PERCENT", "5"),
            ],
            Some(Expect::Lost),
        ),
        mode(
            "mutant-doubled",
            Consumer::Ledger,
            false,
            (200, 200),
            vec![("SQS_ONCE_DEDUP_KEY", "message-id")],
            Some(Expect::Doubled),
        ),
        mode(
            "mutant-reordered",
            Consumer::Ledger,
            false,
            (200, 200),
            vec![
                ("SQS_ONCE_MUTANT", "fifo-parallel"),
                ("LEDGER_WORK", "300ms"),
                ("LEDGER_SLOW_PERCENT", "30"),
            ],
            Some(Expect::Reordered),
        ),
    ]
}

// ----------------------------------------------------------------- events

#[derive(Clone)]
pub struct Event {
    pub seq: u64,
    pub account: String,
    pub amount: i64,
    pub fifo: bool,
    pub valid: bool,
    pub body: String,
}

/// Events: the first half for the standard queue (7 accounts), the second for
/// the FIFO queue (`groups` groups, one account each); every 50th malformed
/// (one of three ways); every amount distinct.
fn events(n: usize, groups: usize, consumer: Consumer) -> Vec<Event> {
    (0..n)
        .map(|i| {
            let fifo = i >= n / 2;
            let account = if fifo {
                format!("group-{}", i % groups)
            } else {
                format!("acct-{}", i % 7)
            };
            let amount = i as i64 + 1;
            let id = format!("evt-{i}");
            let malformed = (i % 50 == 17).then_some((i / 50) % 3);
            let body = match (consumer, malformed) {
                (_, Some(2)) => json!(format!("not JSON: {id}")),
                (Consumer::Ledger, None) => {
                    json!({"id": id, "account": account, "amount_cents": amount, "seq": i})
                }
                (Consumer::Ledger, Some(0)) => {
                    json!({"id": id, "account": "", "amount_cents": amount, "seq": i})
                }
                (Consumer::Ledger, Some(_)) => {
                    json!({"id": id, "account": account, "amount_cents": amount, "currency": "EUR"})
                }
                (Consumer::Payments, None) => {
                    json!({"id": id, "customer": account, "amount_cents": amount})
                }
                (Consumer::Payments, Some(0)) => {
                    json!({"id": id, "customer": account, "amount_cents": -amount})
                }
                (Consumer::Payments, Some(_)) => {
                    json!({"id": id, "customer": account, "amount_cents": amount, "seq": i})
                }
            };
            let body = match body {
                serde_json::Value::String(text) => text,
                object => object.to_string(),
            };
            Event {
                seq: i as u64,
                account,
                amount,
                fifo,
                valid: malformed.is_none(),
                body,
            }
        })
        .collect()
}

async fn send(sqs: &aws_sdk_sqs::Client, url: &str, fifo: bool, batch: &[&Event]) {
    for chunk in batch.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut b = SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(&e.body);
                if fifo {
                    // A fresh deduplication id per send: SQS must not drop the
                    // copy, so that sqs-once's own dedup is what is tested.
                    b = b
                        .message_group_id(&e.account)
                        .message_deduplication_id(uuid::Uuid::new_v4().simple().to_string());
                }
                b.build().unwrap()
            })
            .collect();
        let out = sqs
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(out.failed().is_empty(), "send failed: {:?}", out.failed());
    }
}

// ------------------------------------------------------------------ a run

struct Aws {
    sqs: aws_sdk_sqs::Client,
    ddb: aws_sdk_dynamodb::Client,
    endpoint: String,
}

/// Queues, tables and the stub API of one mode's run.
struct Setup {
    dedup: String,
    queues: HashMap<bool, sqs_once_cli::setup::QueuePair>,
    ledgers: HashMap<bool, String>,
    api: Option<StubApi>,
}

async fn setup(aws: &Aws, mode: &Mode) -> Setup {
    let run_id = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let dedup = format!("chaos-dedup-{run_id}");
    sqs_once_cli::setup::ensure_dedup_table(&aws.ddb, &dedup)
        .await
        .unwrap();
    let (mut queues, mut ledgers) = (HashMap::new(), HashMap::new());
    for fifo in [false, true] {
        let name = format!("chaos-{run_id}-{}", if fifo { "fifo" } else { "std" });
        let pair = sqs_once_cli::setup::ensure_queue_with_dlq(
            &aws.sqs,
            &name,
            fifo,
            Duration::from_secs(10),
            50,
        )
        .await
        .unwrap();
        queues.insert(fifo, pair);
        if mode.consumer == Consumer::Ledger {
            let table = format!("{name}-ledger");
            sqs_once_cli::setup::ensure_table(&aws.ddb, &table)
                .await
                .unwrap();
            ledgers.insert(fifo, table);
        }
    }
    let api = match mode.consumer {
        Consumer::Payments => Some(
            StubApi::start_with(ApiFaults {
                hold_max: Duration::from_millis(1500),
                lose_permille: 20,
            })
            .await,
        ),
        Consumer::Ledger => None,
    };
    Setup {
        dedup,
        queues,
        ledgers,
        api,
    }
}

fn consumer_name(fifo: bool) -> &'static str {
    if fifo { "chaos-fifo" } else { "chaos-std" }
}

/// The processes of a mode: `pollers` per run, half per queue.
fn slots(mode: &Mode, s: &Setup, proxy_url: &str, pollers: usize) -> Vec<workers::Slot> {
    (0..pollers)
        .map(|i| {
            let fifo = i % 2 == 1;
            let q = &s.queues[&fifo];
            let mut env: Vec<(String, String)> = [
                ("AWS_ENDPOINT_URL", proxy_url),
                ("AWS_REGION", "us-east-1"),
                ("AWS_ACCESS_KEY_ID", "test"),
                ("AWS_SECRET_ACCESS_KEY", "test"),
                ("SQS_ONCE_QUEUE_URL", &q.queue_url),
                ("SQS_ONCE_DLQ_URL", &q.dlq_url),
                ("SQS_ONCE_TABLE", &s.dedup),
                ("SQS_ONCE_CONSUMER", consumer_name(fifo)),
                ("SQS_ONCE_DEDUP_KEY", "json:/id"),
                ("SQS_ONCE_LEASE", "10s"),
                ("SQS_ONCE_HEARTBEAT", "3s"),
                ("SQS_ONCE_BACKOFF", "1s"),
                // Bounded well within the drain deadline: receives spent by
                // kills, timed-out invocations and FIFO group-mates double
                // the delay too, and a transient error on a ninth receive
                // (a refusal window) would otherwise hold its message back
                // 256 s, past the deadline, to be reported lost.
                ("SQS_ONCE_BACKOFF_MAX", "30s"),
                ("SQS_ONCE_WAIT", "2s"),
                ("SQS_ONCE_DRAIN", "5s"),
                ("SQS_ONCE_BATCH_WAIT", "200ms"),
                ("SQS_ONCE_METRICS_INTERVAL", "0s"),
                ("SQS_ONCE_LAMBDA_MARGIN", "2s"),
                ("LEDGER_PANIC_PERCENT", "1"),
            ]
            .into_iter()
            .chain(mode.env.iter().copied())
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
            // `CHAOS_RUST_LOG` (with `CHAOS_LOG_DIR`) to see more of a run.
            let log = std::env::var("CHAOS_RUST_LOG")
                .unwrap_or_else(|_| "error,sqs_once_cli::local_lambda=warn".to_owned());
            env.push(("RUST_LOG".to_owned(), log));
            match (&s.api, s.ledgers.get(&fifo)) {
                (Some(api), _) => env.extend(
                    api.env()
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v.to_owned())),
                ),
                (None, Some(table)) => env.push(("LEDGER_TABLE".into(), table.clone())),
                (None, None) => unreachable!("a ledger mode has ledger tables"),
            }
            // The ledger with its fault knobs (`LEDGER_PANIC_PERCENT`, work,
            // the `delete-first` mutant); the payments example as it is.
            let program = binary(if mode.consumer == Consumer::Payments {
                "payments"
            } else {
                "faulty-ledger"
            });
            if mode.lambda {
                let args = [
                    "local-lambda",
                    "--function",
                    &program,
                    "--queue-url",
                    &q.queue_url,
                ]
                .into_iter()
                .chain(["--timeout", "6s", "--exit-when-idle", "3600s"])
                .map(str::to_owned)
                .collect();
                workers::Slot::new(&binary("sqs-once"), args, env)
            } else {
                workers::Slot::new(&program, Vec::new(), env)
            }
        })
        .collect()
}

fn plan(mode: &Mode) -> workers::Schedule {
    if mode.lambda {
        workers::Schedule {
            kill: None,
            term: None,
            refuse: (15, 30),
            refuse_for: Duration::from_secs(3),
            function_kill: Some((3, 8)),
            freeze: Some(((4, 10), Duration::from_secs(8))),
        }
    } else {
        workers::Schedule {
            kill: Some((4, 10)),
            term: Some((8, 14)),
            refuse: (15, 30),
            refuse_for: Duration::from_secs(3),
            function_kill: None,
            freeze: None,
        }
    }
}

/// Sends the first wave (every event, some twice), waits, sends the late copies.
async fn send_waves(aws: &Aws, s: &Setup, events: &[Event], rng: &mut Rng) -> (u64, u64) {
    let dup_rate: f64 = env_or("CHAOS_DUPLICATES", 0.3);
    let late_secs: u64 = env_or("CHAOS_LATE_SECS", 10);
    let mut first: HashMap<bool, Vec<&Event>> = HashMap::new();
    let mut late: HashMap<bool, Vec<&Event>> = HashMap::new();
    let (mut immediate, mut later) = (0, 0);
    for e in events {
        first.entry(e.fifo).or_default().push(e);
        if rng.chance(dup_rate) {
            if rng.chance(0.5) {
                first.entry(e.fifo).or_default().push(e);
                immediate += 1;
            } else {
                late.entry(e.fifo).or_default().push(e);
                later += 1;
            }
        }
    }
    for fifo in [false, true] {
        send(&aws.sqs, &s.queues[&fifo].queue_url, fifo, &first[&fifo]).await;
    }
    tokio::time::sleep(Duration::from_secs(late_secs)).await;
    for fifo in [false, true] {
        if let Some(batch) = late.get(&fifo) {
            send(&aws.sqs, &s.queues[&fifo].queue_url, fifo, batch).await;
        }
    }
    (immediate, later)
}

/// Both queues empty on three reads in a row, within the deadline.
async fn drained(aws: &Aws, s: &Setup, deadline: Instant) -> bool {
    let mut empty_reads = 0;
    while Instant::now() < deadline {
        let total = depth(&aws.sqs, &s.queues[&false].queue_url).await
            + depth(&aws.sqs, &s.queues[&true].queue_url).await;
        empty_reads = if total == 0 { empty_reads + 1 } else { 0 };
        if empty_reads >= 3 {
            return true;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    false
}

/// What is still in each queue: visible, in flight and delayed messages.
async fn left_in(aws: &Aws, s: &Setup) -> String {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let mut parts = Vec::new();
    for fifo in [false, true] {
        let got = aws
            .sqs
            .get_queue_attributes()
            .queue_url(&s.queues[&fifo].queue_url)
            .attribute_names(A::ApproximateNumberOfMessages)
            .attribute_names(A::ApproximateNumberOfMessagesNotVisible)
            .attribute_names(A::ApproximateNumberOfMessagesDelayed)
            .send()
            .await
            .ok()
            .and_then(|o| o.attributes)
            .unwrap_or_default();
        let n = |a: A| got.get(&a).map_or("?", String::as_str).to_owned();
        parts.push(format!(
            "{}: {} visible, {} in flight, {} delayed",
            if fifo { "FIFO" } else { "standard" },
            n(A::ApproximateNumberOfMessages),
            n(A::ApproximateNumberOfMessagesNotVisible),
            n(A::ApproximateNumberOfMessagesDelayed)
        ));
    }
    parts.join("; ")
}

/// What the dedup record of FIFO event `seq` says (attempts, last error): a
/// clue to why it was applied late.
async fn record_of(aws: &Aws, s: &Setup, seq: u64) -> String {
    use sqs_once::DedupStore;
    let store = sqs_once::DynamoStore::new(aws.ddb.clone(), s.dedup.clone());
    let pk = sqs_once::key::record_key(consumer_name(true), &format!("evt-{seq}"));
    match store.get(&pk).await {
        Ok(Some(r)) => format!(
            " [{} attempts, last error {:?}]",
            r.attempts,
            r.error.unwrap_or_default()
        ),
        _ => String::new(),
    }
}

/// How many times each seq was applied, and FIFO order or bookkeeping
/// violations, from the ledger tables (or the payment API's charges: the
/// amount is the seq + 1).
async fn applications(aws: &Aws, s: &Setup) -> (HashMap<u64, u64>, Vec<String>) {
    let mut problems = Vec::new();
    let mut per_account: HashMap<String, Vec<u64>> = HashMap::new();
    if let Some(api) = &s.api {
        for (_, body) in api.state.lock().unwrap().charged.iter() {
            let seq = body["amount_cents"].as_u64().unwrap_or(0).wrapping_sub(1);
            let customer = body["customer"].as_str().unwrap_or_default().to_owned();
            per_account.entry(customer).or_default().push(seq);
        }
    }
    for table in s.ledgers.values() {
        for (account, (balance, count, seqs)) in check::ledger(&aws.ddb, table).await {
            let sum: i64 = seqs.iter().map(|s| *s as i64 + 1).sum();
            if count as usize != seqs.len() || balance != sum {
                problems.push(format!(
                    "{account}: balance {balance} and applied_events {count} disagree with its {} applied seqs (sum {sum})",
                    seqs.len()
                ));
            }
            per_account.insert(account, seqs);
        }
    }
    let mut applied: HashMap<u64, u64> = HashMap::new();
    for (account, seqs) in &per_account {
        for s in seqs {
            *applied.entry(*s).or_default() += 1;
        }
        // A seq applied again is a double (counted as such), not a reorder.
        let mut seen = std::collections::HashSet::new();
        let mut inversions = Vec::new();
        for w in seqs.windows(2) {
            seen.insert(w[0]);
            if w[0] > w[1] && !seen.contains(&w[1]) {
                inversions.push(format!(
                    "{} before {}{}",
                    w[0],
                    w[1],
                    record_of(aws, s, w[1]).await
                ));
            }
        }
        if account.starts_with("group-") && !inversions.is_empty() {
            problems.push(format!(
                "FIFO group {account} applied out of order ({})",
                inversions.join(", ")
            ));
        }
    }
    (applied, problems)
}

/// One mode's outcome.
struct Report {
    line: String,
    violations: Vec<String>,
    lost: u64,
    doubled: u64,
    reordered: u64,
}

async fn run_mode(aws: &Aws, mode: &Mode) -> Report {
    let started = Instant::now();
    let nightly = std::env::var("CHAOS_SIZE").is_ok_and(|v| v == "nightly");
    let n: usize = env_or(
        "CHAOS_EVENTS",
        if nightly {
            mode.events.1
        } else {
            mode.events.0
        },
    );
    let pollers: usize = env_or("CHAOS_POLLERS", 4).max(2);
    let groups: usize = env_or("CHAOS_FIFO_GROUPS", 5usize).max(1);
    let mut rng = Rng(env_or("CHAOS_SEED", 0x5EED_u64) | 1);
    let s = setup(aws, mode).await;
    let events = events(n, groups, mode.consumer);

    let faults = Arc::new(proxy::Faults::default());
    faults.lose_permille.store(20, Ordering::Relaxed);
    faults.slow_permille.store(3, Ordering::Relaxed);
    faults.late_permille.store(3, Ordering::Relaxed);
    let proxy_url = proxy::start(aws.endpoint.clone(), faults.clone()).await;
    let workers = workers::Workers::new(slots(mode, &s, &proxy_url, pollers), mode.lambda);
    workers.start_all().await;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = workers::schedule(&workers, &faults, plan(mode), rng.next_u64(), &stop);

    let (immediate, late) = send_waves(aws, &s, &events, &mut rng).await;
    let deadline = Instant::now() + Duration::from_secs(300 + n as u64 / 5);
    let drained = drained(aws, &s, deadline).await;
    let left = if drained {
        String::new()
    } else {
        left_in(aws, &s).await
    };
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    faults.accept();
    workers.stop_all().await;

    let mut violations = Vec::new();
    if !drained {
        violations.push(format!(
            "the queues did not drain before the deadline ({left})"
        ));
    }
    let k = check_run(aws, &s, &events, &workers, &mut violations).await;
    let (verdict, reordered) = (&k.verdict, k.reordered);
    let c = &workers.counts;
    let figures = Figures {
        n,
        groups,
        malformed: events.iter().filter(|e| !e.valid).count(),
        immediate,
        late,
        pollers,
        unfinished: k.unfinished,
        reclaimed: k.reclaimed,
        overlapping: k.overlapping,
        api_lost: k.api_lost,
        reordered,
        unexpected: k.unexpected,
        secs: started.elapsed().as_secs_f64(),
    };
    let line = summary(mode, &figures, &faults, c, verdict);
    Report {
        line,
        violations,
        lost: verdict.lost,
        doubled: verdict.doubled,
        reordered,
    }
}

/// What the checks found beyond the verdict, for the summary.
struct Checked {
    verdict: check::Verdict,
    reordered: u64,
    unfinished: u64,
    reclaimed: u64,
    overlapping: u64,
    api_lost: u64,
    unexpected: usize,
}

/// Runs every check of a finished run, adding what is wrong to `violations`.
async fn check_run(
    aws: &Aws,
    s: &Setup,
    events: &[Event],
    workers: &workers::Workers,
    violations: &mut Vec<String>,
) -> Checked {
    let mut parked = Vec::new();
    for fifo in [false, true] {
        parked.extend(check::parked(&aws.sqs, &s.queues[&fifo].dlq_url).await);
    }
    let (applied, problems) = applications(aws, s).await;
    let reordered = problems
        .iter()
        .filter(|p| p.contains("out of order"))
        .count() as u64;
    violations.extend(problems);
    let verdict = check::judge(events, &applied, &parked);
    violations.extend(verdict.violations.iter().cloned());
    let (unfinished, reclaimed) = check::records(&aws.ddb, &s.dedup).await;
    if !unfinished.is_empty() {
        violations.push(format!(
            "{} dedup record(s) left unfinished: {}",
            unfinished.len(),
            unfinished.join(", ")
        ));
    }
    let unfinished = unfinished.len() as u64;
    let c = &workers.counts;
    let unclean = c.unclean_terms.load(Ordering::Relaxed);
    if unclean > 0 {
        violations.push(format!(
            "{unclean} process(es) did not exit 0 after SIGTERM"
        ));
    }
    let unexpected = c.unexpected_exits.lock().unwrap().clone();
    violations.extend(unexpected.iter().cloned());
    let (overlapping, api_lost) = s.api.as_ref().map_or((0, 0), |api| {
        let a = api.state.lock().unwrap();
        (a.overlapping.len() as u64, a.lost_responses)
    });
    if overlapping > 0 {
        violations.push(format!(
            "{overlapping} payment API call(s) started while another with the same key was open"
        ));
    }
    Checked {
        verdict,
        reordered,
        unfinished,
        reclaimed,
        overlapping,
        api_lost,
        unexpected: unexpected.len(),
    }
}

struct Figures {
    n: usize,
    groups: usize,
    malformed: usize,
    immediate: u64,
    late: u64,
    pollers: usize,
    unfinished: u64,
    reclaimed: u64,
    overlapping: u64,
    api_lost: u64,
    reordered: u64,
    unexpected: usize,
    secs: f64,
}

fn summary(
    mode: &Mode,
    f: &Figures,
    faults: &proxy::Faults,
    c: &workers::Counts,
    v: &check::Verdict,
) -> String {
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (lost_total, lost_ops) = faults.lost_summary();
    let processes = if mode.lambda {
        format!(
            "{} event sources; faults: {} function SIGKILLs, {} function freezes ({} invocations timed out)",
            f.pollers,
            get(&c.function_kills),
            get(&c.freezes),
            get(&c.timeouts)
        )
    } else {
        format!(
            "{} pollers; faults: {} SIGKILL ({} during another's drain, {} during a refusal), {} SIGTERM",
            f.pollers,
            get(&c.kills),
            get(&c.kills_during_drain),
            get(&c.kills_during_refusal),
            get(&c.terms)
        )
    };
    let api = if mode.consumer == Consumer::Payments {
        format!(
            ", {} API responses lost after charging, {} overlapping calls for one key",
            f.api_lost, f.overlapping
        )
    } else {
        String::new()
    };
    format!(
        "chaos {}: {} events ({} standard, {} FIFO in {} groups; {} malformed), {} duplicates ({} immediate, {} late), \
         {processes}, {lost_total} lost responses ({lost_ops}), {} slow responses, {} late requests, \
         {} refusal windows ({} refused, {} cut connections), {} handler panics{api}, \
         {} records claimed more than once; applied {}, parked {} (malformed {}, valid {}), lost {}, doubled {}, applied and parked {}, \
         FIFO order violations {}, unfinished records {}, unexpected exits {}; {:.0} s",
        mode.name,
        f.n,
        f.n / 2,
        f.n - f.n / 2,
        f.groups,
        f.malformed,
        f.immediate + f.late,
        f.immediate,
        f.late,
        get(&faults.slowed),
        get(&faults.late),
        get(&c.refusals),
        get(&faults.refused),
        get(&faults.cut_connections),
        get(&c.panics),
        f.reclaimed,
        v.applied_once,
        v.parked_malformed + v.parked_valid,
        v.parked_malformed,
        v.parked_valid,
        v.lost,
        v.doubled,
        v.applied_and_parked,
        f.reordered,
        f.unfinished,
        f.unexpected,
        f.secs,
    )
}

// ------------------------------------------------------------------- main

fn skip_for_filter() -> bool {
    // `cargo test <filter>` passes the filter to every test binary: run only
    // when no filter is given or it names this harness.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    !filters.is_empty() && !filters.iter().any(|f| "chaos".contains(f.as_str()))
}

fn main() {
    if skip_for_filter() {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if !runtime.block_on(run()) {
        std::process::exit(1);
    }
}

/// Whether a mutant's run failed with the check it must fail.
fn caught(expect: Expect, r: &Report) -> bool {
    !r.violations.is_empty()
        && match expect {
            Expect::Lost => r.lost > 0,
            Expect::Doubled => r.doubled > 0,
            Expect::Reordered => r.reordered > 0,
        }
}

async fn run() -> bool {
    let wanted: Option<Vec<String>> = std::env::var("CHAOS_MODES")
        .ok()
        .map(|m| m.split(',').map(|s| s.trim().to_owned()).collect());
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(&endpoint)
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "chaos",
        ))
        .load()
        .await;
    let aws = Aws {
        sqs: aws_sdk_sqs::Client::new(&sdk),
        ddb: aws_sdk_dynamodb::Client::new(&sdk),
        endpoint,
    };
    if !cfg!(sqs_once_mutants) && wanted.is_none() {
        println!(
            "chaos: not run here: every mode and mutant runs with `SQS_ONCE_MUTANTS=1 cargo test --features testkit --test chaos` \
             (scripts/test, scripts/chaos); CHAOS_MODES=... runs some without the feature"
        );
        return true;
    }
    let mut ok = true;
    for mode in modes() {
        if wanted
            .as_ref()
            .is_some_and(|w| !w.iter().any(|m| m == mode.name))
        {
            continue;
        }
        if mode.name == "mutant-reordered" && !cfg!(sqs_once_mutants) {
            println!(
                "chaos {}: NOT RUN: it needs a build with SQS_ONCE_MUTANTS=1",
                mode.name
            );
            ok = false;
            continue;
        }
        let r = run_mode(&aws, &mode).await;
        println!("{}", r.line);
        for v in &r.violations {
            println!("  VIOLATION: {v}");
        }
        match mode.expect {
            None => ok &= r.violations.is_empty(),
            Some(expect) if caught(expect, &r) => {
                println!("chaos {}: caught (the run failed as it must)", mode.name)
            }
            Some(_) => {
                println!("chaos {}: NOT CAUGHT by the check it must fail", mode.name);
                ok = false;
            }
        }
    }
    ok
}
