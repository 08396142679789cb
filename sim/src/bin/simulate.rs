//! `simulate`: runs seeds of the deterministic simulation.
//!
//! - `--seeds N [--from S]`: N seeds from S (default 0); prints seeds per
//!   second, faults per run and every failing seed with the command that
//!   replays it. Exits 1 on any failure.
//! - `--minutes M [--from S]`: as many seeds as fit in M minutes.
//! - `--seed S`: one seed with its readable trace, run twice to check that the
//!   trace hash is the same.
//! - `--verbose`: a line per seed (events, faults, redriven, violations, the
//!   cases counted rather than failed).
//! - `--verify`: runs every seed twice and fails one whose trace hash differs.
//! - `--campaign FILE` (with `--minutes`): a long search kept across runs:
//!   starts at the seed after the last one FILE (JSON) says was run, and
//!   adds this run's seeds, faults by class and failures to it.
//! - `--store memory|wire`: every seed on one store path (by default each
//!   seed's path is drawn from it: one in `WIRE_SHARE` runs the real
//!   `DynamoStore` and SDK over the wire; see `sqs_once_sim::stores`).
//! - `--mutant NAME`: with a deliberately broken protocol (see
//!   `sqs_once::mutants`): stops at the first failing seed, and exits 1 if
//!   none fails.
//! - `--jobs N` (with `--seeds` or `--minutes`, not `--mutant`): N seeds
//!   at once, each on its own thread and runtime as always (a run shares
//!   nothing with another); results are taken in seed order, so the output
//!   and a campaign's totals are those of one job, sooner.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use sqs_once_sim::stores::StorePath;
use sqs_once_sim::{Report, run_seed};

/// The command line.
#[derive(Debug, Default)]
struct Args {
    seeds: Option<u64>,
    minutes: Option<f64>,
    seed: Option<u64>,
    from: u64,
    mutant: Option<String>,
    verify: bool,
    verbose: bool,
    campaign: Option<std::path::PathBuf>,
    store: Option<String>,
    jobs: u64,
}

fn parse() -> Result<Args, String> {
    let mut args = Args::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |v: String| v.parse::<u64>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--seeds" => args.seeds = Some(num(value()?)?),
            "--seed" => args.seed = Some(num(value()?)?),
            "--from" => args.from = num(value()?)?,
            "--minutes" => {
                let v = value()?;
                args.minutes = Some(v.parse().map_err(|e| format!("{v}: {e}"))?);
            }
            "--mutant" => args.mutant = Some(value()?),
            "--verify" => args.verify = true,
            "--campaign" => args.campaign = Some(value()?.into()),
            "--verbose" => args.verbose = true,
            "--jobs" => args.jobs = num(value()?)?.max(1),
            "--store" => {
                let v = value()?;
                if v != "memory" && v != "wire" {
                    return Err(format!("--store {v}: memory or wire"));
                }
                args.store = Some(v);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.jobs > 1 && args.mutant.is_some() {
        // A mutant's catch is checked by a run without it, switched off in
        // the environment for that run.
        return Err("--jobs runs without --mutant only".into());
    }
    Ok(args)
}

/// The command that replays `seed`.
fn replay(seed: u64, mutant: Option<&str>) -> String {
    let store = std::env::var("SIM_STORE")
        .map(|s| format!(" --store {s}"))
        .unwrap_or_default();
    let fixed = if sqs_once_sim::draws_max_receive() {
        ""
    } else {
        "SIM_FIXED_MAX_RECEIVE=1 "
    };
    match mutant {
        Some(m) => format!("{fixed}scripts/simulate --seed {seed} --mutant {m}{store}"),
        None => format!("{fixed}scripts/simulate --seed {seed}{store}"),
    }
}

/// One seed, a panic of the simulator itself counted as a failure.
fn run(seed: u64, keep_trace: bool) -> Report {
    let outcome = std::panic::catch_unwind(|| run_seed(seed, keep_trace));
    let failed = |why: String| Report {
        seed,
        trace_hash: String::new(),
        trace_events: 0,
        trace: Vec::new(),
        violations: vec![why],
        faults: 0,
        events: 0,
        exhausted: 0,
        stranded: 0,
        virtual_time: Duration::ZERO,
        fault_classes: Vec::new(),
        redriven: 0,
        path: StorePath::of(seed),
        after_ttl: 0,
        overlapping: 0,
        paused_calls: 0,
        claim_then_fast: 0,
        fifo_after_dlq: 0,
        payload_gone: 0,
    };
    match outcome {
        Ok(Ok(report)) => report,
        Ok(Err(e)) => failed(format!("runtime: {e}")),
        Err(_) => failed("the simulation panicked".into()),
    }
}

/// Replays one seed with its trace; checks the trace hash twice.
fn one(seed: u64, mutant: Option<&str>) -> ExitCode {
    let report = run(seed, true);
    for line in &report.trace {
        println!("{line}");
    }
    let again = run(seed, false);
    println!(
        "seed {seed} ({:?} path): {} events, {} faults, {} redriven by SQS, {} completed but not deletable in time, {:?} virtual, trace {} ({} lines)",
        report.path,
        report.events,
        report.faults,
        report.exhausted,
        report.stranded,
        report.virtual_time,
        report.trace_hash,
        report.trace_events
    );
    let deterministic = again.trace_hash == report.trace_hash;
    if !deterministic {
        println!(
            "NOT DETERMINISTIC: a second run hashed {}",
            again.trace_hash
        );
    }
    if report.claim_then_fast > 0 {
        println!(
            "counted: {} events applied by a claim that lost its key and then by the fast path",
            report.claim_then_fast
        );
    }
    if report.fifo_after_dlq > 0 {
        println!(
            "counted: {} FIFO pairs applied out of send order after SQS moved the earlier message to the DLQ",
            report.fifo_after_dlq
        );
    }
    if report.payload_gone > 0 {
        println!(
            "counted: {} events whose copy was parked for a large payload deleted after an earlier copy finished",
            report.payload_gone
        );
    }
    for v in &report.violations {
        println!("VIOLATION {v}");
    }
    println!("replay: {}", replay(seed, mutant));
    if report.violations.is_empty() && deterministic {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What a search found, kept across runs by `--campaign`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Campaign {
    /// The next seed to run.
    next_seed: u64,
    /// Seeds run in all.
    seeds_run: u64,
    /// Runs of the command that added to it.
    sessions: u64,
    /// Faults drawn, by class.
    faults_by_class: std::collections::BTreeMap<String, u64>,
    /// Events that reached the DLQ under faults and were brought back.
    redriven_events: u64,
    /// Failing seeds, with their first violation.
    failures: Vec<(u64, String)>,
    /// The classes the checker counts instead of failing, totalled per
    /// code version (`git describe --always --dirty` of the run, or
    /// `SIM_VERSION`), with the seeds each version ran.
    #[serde(default)]
    counted_by_version: std::collections::BTreeMap<String, Counted>,
}

/// The classes the checker counts instead of failing (docs/DESIGN.md, "What
/// the simulator's checker counts instead of failing"), over some seeds.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
struct Counted {
    seeds: u64,
    /// Events SQS moved to the DLQ under faults, brought back by the redrive.
    redriven: u64,
    /// Completed messages in the DLQ that no consumer could keep out.
    stranded: u64,
    /// Events applied again after TTL ended their record.
    after_ttl: u64,
    /// Overlapping API calls under a skew beyond the margin.
    overlapping: u64,
    /// API calls a process pause stopped.
    paused_calls: u64,
    /// Events charged by a claim that lost its key, then committed by the fast path.
    claim_then_fast: u64,
    /// FIFO pairs out of order after SQS moved the earlier message.
    fifo_after_dlq: u64,
    /// Completed events whose copy was parked for a payload gone.
    payload_gone: u64,
}

/// The most each counted class may reach per 1,000 seeds in one campaign
/// run (of at least [`BOUND_MIN_SEEDS`] seeds) before `--campaign` fails:
/// about three times what seeds 0..2,500 count (docs/DESIGN.md, "What the
/// simulator's checker counts instead of failing"), so a regression that
/// turns a failure into a counted case shows as a jump.
const BOUNDS_PER_1000: [(&str, u64); 8] = [
    ("redriven", 750),
    ("stranded", 50),
    ("after_ttl", 300),
    ("overlapping", 5),
    ("paused_calls", 160),
    ("claim_then_fast", 330),
    ("fifo_after_dlq", 2),
    ("payload_gone", 100),
];

/// Fewer seeds than this are too few to judge a rate by.
const BOUND_MIN_SEEDS: u64 = 1_000;

impl Counted {
    fn add(&mut self, report: &Report) {
        self.seeds += 1;
        self.redriven += report.exhausted as u64;
        self.stranded += report.stranded as u64;
        self.after_ttl += report.after_ttl as u64;
        self.overlapping += report.overlapping as u64;
        self.paused_calls += report.paused_calls as u64;
        self.claim_then_fast += report.claim_then_fast as u64;
        self.fifo_after_dlq += report.fifo_after_dlq as u64;
        self.payload_gone += report.payload_gone as u64;
    }

    fn class(&self, name: &str) -> u64 {
        match name {
            "redriven" => self.redriven,
            "stranded" => self.stranded,
            "after_ttl" => self.after_ttl,
            "overlapping" => self.overlapping,
            "paused_calls" => self.paused_calls,
            "claim_then_fast" => self.claim_then_fast,
            "fifo_after_dlq" => self.fifo_after_dlq,
            "payload_gone" => self.payload_gone,
            _ => 0,
        }
    }

    /// The classes above their bound: (class, count, bound for these seeds).
    fn beyond_bounds(&self) -> Vec<(&'static str, u64, u64)> {
        if self.seeds < BOUND_MIN_SEEDS {
            return Vec::new();
        }
        BOUNDS_PER_1000
            .iter()
            .map(|&(name, per)| (name, self.class(name), per * self.seeds / 1000))
            .filter(|&(_, n, bound)| n > bound)
            .collect()
    }
}

/// The code version a campaign files its counts under.
fn code_version() -> String {
    if let Ok(v) = std::env::var("SIM_VERSION") {
        return v;
    }
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

impl Campaign {
    fn add(&mut self, seed: u64, report: &Report, version: &str) {
        self.counted_by_version
            .entry(version.to_owned())
            .or_default()
            .add(report);
        self.seeds_run += 1;
        self.next_seed = seed + 1;
        self.redriven_events += report.exhausted as u64;
        for (class, n) in &report.fault_classes {
            *self.faults_by_class.entry((*class).to_owned()).or_default() += n;
        }
        if let Some(first) = report.violations.first() {
            self.failures.push((seed, first.clone()));
        }
    }

    fn load(path: &std::path::Path) -> Result<Self, String> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Counts this run of the command, saves, and prints the totals.
    fn finish(&mut self, path: &std::path::Path) -> Result<(), String> {
        self.sessions += 1;
        self.save(path)?;
        println!(
            "campaign {}: {} seeds in all (next {}), {} failing, faults by class {:?}",
            path.display(),
            self.seeds_run,
            self.next_seed,
            self.failures.len(),
            self.faults_by_class
        );
        Ok(())
    }

    fn save(&self, path: &std::path::Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// One line for a seed (`--verbose`).
fn print_verbose(seed: u64, report: &Report) {
    println!(
        "seed {seed}: {} events, {} faults, {} redriven, {} violations, counted: {} stranded, {} FIFO after DLQ, {} parked for a gone payload, {} claim then fast path; trace {}",
        report.events,
        report.faults,
        report.exhausted,
        report.violations.len(),
        report.stranded,
        report.fifo_after_dlq,
        report.payload_gone,
        report.claim_then_fast,
        report.trace_hash
    );
}

/// Runs seeds from `from` until `count` ran or `until` passed.
fn many(args: &Args, count: Option<u64>, until: Option<Instant>) -> ExitCode {
    let mut campaign = match args.campaign.as_deref().map(Campaign::load).transpose() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("simulate: cannot read the campaign: {e}");
            return ExitCode::from(2);
        }
    };
    let from = campaign
        .as_ref()
        .map_or(args.from, |c| c.next_seed.max(args.from));
    let mutant = args.mutant.as_deref();
    let started = Instant::now();
    let (mut ran, mut failed) = (0u64, 0u64);
    let mut totals = Totals {
        version: code_version(),
        ..Totals::default()
    };
    let mut seed = from;
    let mut paths = Paths::default();
    let end = count.map_or(u64::MAX, |c| from.saturating_add(c));
    let time_left = || until.is_none_or(|u| Instant::now() < u);
    let more = |seed: u64| seed < end && time_left();
    if args.jobs <= 1 {
        while more(seed) {
            let (report, secs) = run_timed(args, seed);
            paths.note(&report, secs);
            ran += 1;
            if take(args, &mut campaign, seed, report, &mut totals, &mut failed) {
                return ExitCode::SUCCESS;
            }
            seed += 1;
        }
    } else {
        // The workers take seeds in turn until the count or the time is
        // up; every seed taken is run to its end, so those run are `from`
        // to the last one taken, with no gap, and they are taken into the
        // totals in seed order.
        let (done, results) = std::sync::mpsc::channel();
        let next = std::sync::atomic::AtomicU64::new(from);
        std::thread::scope(|scope| {
            for _ in 0..args.jobs {
                let (done, next, time_left) = (done.clone(), &next, &time_left);
                scope.spawn(move || {
                    // The time is read before a seed is taken: a seed taken
                    // is run, whoever finds the time up afterwards.
                    while time_left() {
                        let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if seed >= end || done.send((seed, run_timed(args, seed))).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(done);
            let mut early = std::collections::BTreeMap::new();
            for (s, result) in &results {
                early.insert(s, result);
                while let Some((report, secs)) = early.remove(&seed) {
                    paths.note(&report, secs);
                    ran += 1;
                    take(args, &mut campaign, seed, report, &mut totals, &mut failed);
                    seed += 1;
                }
            }
        });
    }
    if let (Some(c), Some(path)) = (campaign.as_mut(), &args.campaign)
        && let Err(e) = c.finish(path)
    {
        eprintln!("simulate: cannot write the campaign: {e}");
        return ExitCode::from(2);
    }
    let secs = started.elapsed().as_secs_f64();
    totals.print((from, seed, ran), failed, secs);
    paths.print(ran);
    // A campaign fails where a counted class jumped beyond its bound.
    let beyond = if args.campaign.is_some() {
        totals.counted.beyond_bounds()
    } else {
        Vec::new()
    };
    for (class, n, bound) in &beyond {
        println!(
            "counted class {class} beyond its bound: {n} in {ran} seeds, at most {bound} ({} per 1,000 seeds) on {}",
            BOUNDS_PER_1000
                .iter()
                .find(|(c, _)| c == class)
                .map_or(0, |(_, b)| *b),
            totals.version
        );
    }
    if !beyond.is_empty() && mutant.is_none() {
        return ExitCode::FAILURE;
    }
    match (mutant, failed) {
        (Some(m), _) => {
            println!("mutant {m} NOT caught in {ran} seeds");
            ExitCode::FAILURE
        }
        (None, 0) => ExitCode::SUCCESS,
        (None, _) => ExitCode::FAILURE,
    }
}

/// Runs `seed` (twice with `--verify`, a differing trace hash then a
/// violation); the report and the first run's wall time.
fn run_timed(args: &Args, seed: u64) -> (Report, f64) {
    let took = Instant::now();
    let mut report = run(seed, false);
    let secs = took.elapsed().as_secs_f64();
    if args.verify {
        let again = run(seed, false).trace_hash;
        if again != report.trace_hash {
            report.violations.push(format!(
                "not deterministic: {} then {again}",
                report.trace_hash
            ));
        }
    }
    (report, secs)
}

/// Takes `seed`'s report into the totals, the campaign and the output;
/// true when a mutant is caught (its seed passes with the protocol intact).
fn take(
    args: &Args,
    campaign: &mut Option<Campaign>,
    seed: u64,
    report: Report,
    totals: &mut Totals,
    failed: &mut u64,
) -> bool {
    let mutant = args.mutant.as_deref();
    if args.verbose {
        print_verbose(seed, &report);
    }
    if let Some(c) = campaign.as_mut() {
        c.add(seed, &report, &totals.version);
    }
    totals.counted.add(&report);
    totals.add(&report);
    if report.violations.is_empty() {
        return false;
    }
    *failed += 1;
    println!(
        "FAIL seed {seed}: {} violation(s), first: {}",
        report.violations.len(),
        report.violations[0]
    );
    println!("  replay: {}", replay(seed, mutant));
    if let Some(m) = mutant {
        // Only a seed that passes with the protocol intact counts.
        if passes_intact(seed) {
            let ran = seed + 1 - args.from;
            println!("mutant {m} caught at seed {seed}, after {ran} seed(s)");
            return true;
        }
        println!("  seed {seed} fails without the mutant too: not counted");
    }
    false
}

/// What the seeds of a search added up to, for the summary.
#[derive(Debug, Default)]
struct Totals {
    /// The code version (for the campaign).
    version: String,
    /// This run's counted classes.
    counted: Counted,
    faults: u64,
    exhausted: u64,
    stranded: u64,
    after_ttl: u64,
    overlapping: u64,
    paused_calls: u64,
    claim_then_fast: u64,
    fifo_after_dlq: u64,
    payload_gone: u64,
}

impl Totals {
    fn add(&mut self, report: &Report) {
        self.faults += report.faults;
        self.exhausted += report.exhausted as u64;
        self.stranded += report.stranded as u64;
        self.after_ttl += report.after_ttl as u64;
        self.overlapping += report.overlapping as u64;
        self.paused_calls += report.paused_calls as u64;
        self.claim_then_fast += report.claim_then_fast as u64;
        self.fifo_after_dlq += report.fifo_after_dlq as u64;
        self.payload_gone += report.payload_gone as u64;
    }

    /// The summary of seeds `from..to` (`ran` of them, `failed` failing).
    fn print(&self, (from, to, ran): (u64, u64, u64), failed: u64, secs: f64) {
        println!(
            "{ran} seeds ({from}..{to}) in {secs:.1}s: {:.1} seeds/s, {:.1} faults per run, {failed} failed ({} events redriven to the DLQ by SQS under faults; {} completed messages redriven because no delete could land in time)",
            ran as f64 / secs.max(1e-9),
            self.faults as f64 / ran.max(1) as f64,
            self.exhausted,
            self.stranded
        );
        println!(
            "counted, not failed: {} events applied again after TTL ended their record; {} overlapping API calls under a skew beyond the margin; {} API calls a process pause stopped; {} events applied by a claim that lost its key and then by the fast path; {} FIFO pairs applied out of send order after SQS moved the earlier message to the DLQ; {} events whose copy was parked for a large payload deleted after an earlier copy finished",
            self.after_ttl,
            self.overlapping,
            self.paused_calls,
            self.claim_then_fast,
            self.fifo_after_dlq,
            self.payload_gone
        );
    }
}

/// Seeds and wall time on the wire path, for the summary.
#[derive(Debug, Default)]
struct Paths {
    on_wire: u64,
    /// Wall time of the seeds on each path, summed (over jobs too).
    wire_secs: f64,
    memory_secs: f64,
}

impl Paths {
    /// Counts a seed's run of `secs` on its path.
    fn note(&mut self, report: &Report, secs: f64) {
        if report.path == StorePath::Wire {
            self.on_wire += 1;
            self.wire_secs += secs;
        } else {
            self.memory_secs += secs;
        }
    }

    /// The share of seeds on each path, and each path's speed (per job),
    /// of `ran` seeds.
    fn print(&self, ran: u64) {
        println!(
            "store paths: {} seeds on the wire path ({:.1} seeds/s a job), {} on the memory path ({:.1} seeds/s a job)",
            self.on_wire,
            self.on_wire as f64 / self.wire_secs.max(1e-9),
            ran - self.on_wire,
            (ran - self.on_wire) as f64 / self.memory_secs.max(1e-9)
        );
    }
}

/// Whether `seed` passes with no mutant switched on (the mutant's variable
/// is cleared for the run, then set again).
fn passes_intact(seed: u64) -> bool {
    let mutant = std::env::var("SQS_ONCE_MUTANT").ok();
    // SAFETY: the simulator is single-threaded: no run is in progress and no
    // other thread reads the environment.
    unsafe { std::env::remove_var("SQS_ONCE_MUTANT") };
    let clean = run(seed, false).violations.is_empty();
    if let Some(m) = mutant {
        // SAFETY: as above.
        unsafe { std::env::set_var("SQS_ONCE_MUTANT", m) };
    }
    clean
}

/// Keeps the simulated handler panics (caught by the processor) off stderr.
fn quiet_simulated_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let simulated = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|s| s.starts_with("simulated"));
        if !simulated {
            default(info);
        }
    }));
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "simulate: {e}\nusage: simulate (--seeds N | --minutes M | --seed S) [--from S] [--mutant NAME | --jobs N]"
            );
            return ExitCode::from(2);
        }
    };
    if let Some(m) = &args.mutant {
        // SAFETY: set once at start, before any other thread exists.
        unsafe { std::env::set_var("SQS_ONCE_MUTANT", m) };
    }
    if let Some(store) = &args.store {
        // SAFETY: as above.
        unsafe { std::env::set_var("SIM_STORE", store) };
    }
    quiet_simulated_panics();
    let mutant = args.mutant.as_deref();
    if let Some(seed) = args.seed {
        return one(seed, mutant);
    }
    let until = args
        .minutes
        .map(|m| Instant::now() + Duration::from_secs_f64(m * 60.0));
    let count = args.seeds.or(until.is_none().then_some(100));
    many(&args, count, until)
}
