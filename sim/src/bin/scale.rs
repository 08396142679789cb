//! At scale, in virtual time: the library's pollers, the simple
//! hand-written transactional loop and the best-effort hand-written loop (at
//! equal slots and at equal messages held) drain the same messages, one
//! after the other, each on its own paused runtime, every AWS call delayed by the
//! latency model of `sqs_once_sim::latency`. Prints both runs, their ratios
//! and the ledger checks; exits 1 if a ledger check fails.
//!
//! `scale [--pollers N] [--concurrency N] [--prefetch N] [--messages N] [--duplicates RATE]
//! [--handler-ms MS] [--seed S] [--rate PER_S] [--fifo-groups N] [--sqs-ms MEDIAN,P99]
//! [--transaction-ms MEDIAN,P99] [--capacity dynamodb|unlimited] [--table-wcu N]
//! [--item-wcu N] [--hold-ms MS] [--hot-accounts N] [--latency lognormal|quantiles]
//! [--correlation WINDOW_MS,RHO] [--backoff-ms BASE,MAX] [--store-retry fixed|jitter]
//! [--only sqs-once,loop,best,best-held]`
//! (defaults: 100 pollers, concurrency 10, 1,000,000 messages, 10% of events
//! sent twice, 5 ms handlers, seed 1, DynamoDB's capacity unlimited). `--capacity
//! dynamodb` models DynamoDB's per-item limit (1,000 write units a second) and
//! transaction conflicts (a 10 ms hold); `--table-wcu`, `--item-wcu` and
//! `--hold-ms` set its figures (and turn it on). `--hot-accounts N`: each
//! event's transaction also adds its amount to one of N account items.
//! `--latency quantiles` draws DynamoDB's latencies from published quantiles
//! instead of log-normals (it replaces the whole model: give it before
//! `--sqs-ms`/`--transaction-ms`); `--correlation` correlates draws within
//! windows of time.
//! `--backoff-ms` sets sqs-once's retry delay (`ProcessorConfig`'s
//! `backoff_base`, `backoff_max`; default 2 s doubling to 15 min).
//! `--store-retry jitter` is a what-if: the store's retries of a refused
//! write wait a uniform draw below their delay (the library's wait the delay).
//! Build with `--release` for 1M.

use std::process::ExitCode;
use std::time::Duration;

use sqs_once_sim::latency::{Correlation, LatencyModel, LogNormal, Op};
use sqs_once_sim::scale::{CapacityModel, Consumer, RunReport, ScaleConfig, run};

/// The run's capacity model, turned on (DynamoDB's figures) if it was off.
fn capacity(config: &mut ScaleConfig) -> &mut CapacityModel {
    if config.capacity == CapacityModel::unlimited() {
        config.capacity = CapacityModel::dynamodb(None);
    }
    &mut config.capacity
}

/// `MEDIAN,P99` in milliseconds.
fn log_normal(value: &str) -> Result<LogNormal, String> {
    let bad = || format!("{value}: expected MEDIAN,P99 (ms), P99 above MEDIAN");
    let (m, p) = value.split_once(',').ok_or_else(bad)?;
    let (m, p): (f64, f64) = (m.parse().map_err(|_| bad())?, p.parse().map_err(|_| bad())?);
    if !(m > 0.0 && p > m) {
        return Err(bad());
    }
    Ok(LogNormal::new(m, p))
}

/// The latency and capacity flags: whether `flag` was one.
fn model_flag(config: &mut ScaleConfig, flag: &str, value: &str) -> Result<bool, String> {
    let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
    match flag {
        "--latency" => {
            let correlation = config.model.correlation;
            config.model = match value {
                "lognormal" => LatencyModel::aws(),
                "quantiles" => LatencyModel::aws_quantiles(),
                _ => return Err(bad(&"lognormal or quantiles")),
            };
            config.model.correlation = correlation;
        }
        "--correlation" => {
            let (w, r) = value.split_once(',').ok_or_else(|| bad(&"WINDOW_MS,RHO"))?;
            let window = Duration::from_millis(w.parse().map_err(|e| bad(&e))?);
            let rho: f64 = r.parse().map_err(|e| bad(&e))?;
            if !(0.0..=1.0).contains(&rho) || window.is_zero() {
                return Err(bad(&"a window above 0 ms and RHO from 0 to 1"));
            }
            config.model = config
                .model
                .clone()
                .with_correlation(Correlation { window, rho });
        }
        "--capacity" => {
            config.capacity = match value {
                "dynamodb" => CapacityModel::dynamodb(None),
                "unlimited" => CapacityModel::unlimited(),
                _ => return Err(bad(&"dynamodb or unlimited")),
            }
        }
        "--table-wcu" => {
            capacity(config).table_wcu = Some(value.parse().map_err(|e| bad(&e))?);
        }
        "--item-wcu" => capacity(config).item_wcu = value.parse().map_err(|e| bad(&e))?,
        "--hold-ms" => {
            capacity(config).hold = Duration::from_millis(value.parse().map_err(|e| bad(&e))?);
        }
        "--backoff-ms" => {
            let (b, m) = value.split_once(',').ok_or_else(|| bad(&"BASE,MAX"))?;
            let base = Duration::from_millis(b.parse().map_err(|e| bad(&e))?);
            let max = Duration::from_millis(m.parse().map_err(|e| bad(&e))?);
            if base.is_zero() || max < base {
                return Err(bad(&"BASE above 0 and MAX at least BASE"));
            }
            config.backoff = Some((base, max));
        }
        "--store-retry" => {
            capacity(config).jittered_store_retries = match value {
                "fixed" => false,
                "jitter" => true,
                _ => return Err(bad(&"fixed or jitter")),
            }
        }
        "--hot-accounts" => config.hot_accounts = Some(value.parse().map_err(|e| bad(&e))?),
        _ => return Ok(false),
    }
    Ok(true)
}

fn parse() -> Result<(ScaleConfig, Vec<Consumer>), String> {
    let mut config = ScaleConfig::default();
    let mut consumers = vec![
        Consumer::SqsOnce,
        Consumer::Loop,
        Consumer::BestLoop,
        Consumer::BestLoopHeld,
    ];
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--pollers" => config.pollers = value.parse().map_err(|e| bad(&e))?,
            "--concurrency" => config.concurrency = value.parse().map_err(|e| bad(&e))?,
            "--prefetch" => config.prefetch = value.parse().map_err(|e| bad(&e))?,
            "--messages" => config.messages = value.parse().map_err(|e| bad(&e))?,
            "--duplicates" => config.duplicate_rate = value.parse().map_err(|e| bad(&e))?,
            "--handler-ms" => {
                config.handler = Duration::from_millis(value.parse().map_err(|e| bad(&e))?);
            }
            "--seed" => config.seed = value.parse().map_err(|e| bad(&e))?,
            "--sqs-ms" => config.model = config.model.clone().with_sqs(log_normal(&value)?),
            "--transaction-ms" => {
                config.model = config.model.clone().with_transaction(log_normal(&value)?);
            }
            "--fifo-groups" => config.fifo_groups = Some(value.parse().map_err(|e| bad(&e))?),
            "--rate" => config.rate = Some(value.parse().map_err(|e| bad(&e))?),
            "--only" => {
                consumers = value
                    .split(',')
                    .map(|c| match c {
                        "sqs-once" => Ok(Consumer::SqsOnce),
                        "loop" => Ok(Consumer::Loop),
                        "best" => Ok(Consumer::BestLoop),
                        "best-held" => Ok(Consumer::BestLoopHeld),
                        _ => Err(bad(&"sqs-once, loop, best or best-held (comma-separated)")),
                    })
                    .collect::<Result<_, _>>()?;
            }
            other => {
                if !model_flag(&mut config, other, &value)? {
                    return Err(format!("unknown argument {other}"));
                }
            }
        }
    }
    if config.fifo_groups.is_some() && consumers != [Consumer::SqsOnce] {
        return Err("--fifo-groups needs --only sqs-once (the loops keep no group order)".into());
    }
    if config.pollers == 0 || config.concurrency == 0 || config.messages == 0 {
        return Err("pollers, concurrency and messages must be above 0".into());
    }
    Ok((config, consumers))
}

fn print_model(model: &sqs_once_sim::latency::LatencyModel) {
    println!("latency model (ms):");
    for op in Op::ALL {
        let d = model.of(op);
        let kind = match d {
            sqs_once_sim::latency::Dist::LogNormal(_) => "log-normal",
            sqs_once_sim::latency::Dist::Quantiles(_) => "published quantiles",
        };
        println!(
            "  {:<36} median {:>6.2}  p99 {:>6.2}  mean {:>6.2}  ({kind})",
            op.name(),
            d.median_ms(),
            d.p99_ms(),
            d.mean_ms()
        );
    }
    match model.correlation {
        Some(c) => println!(
            "  draws correlated: window {:?}, rho {} (per service)",
            c.window, c.rho
        ),
        None => println!("  draws independent"),
    }
}

fn print_run(r: &RunReport) {
    let c = &r.config;
    println!(
        "{}: {} messages ({} events), {} slots; {:.1} virtual s, {:.1} wall s",
        r.consumer.name(),
        c.messages,
        c.events(),
        r.slots,
        r.virtual_secs,
        r.wall_secs
    );
    println!(
        "  throughput {:.0} messages per virtual second; slot use {:.3} (handler), {:.3} (handler + DynamoDB)",
        r.throughput(),
        r.slot_use(),
        r.work_slot_use()
    );
    println!(
        "  calls per message {:.3} (empty receives apart); duplicates skipped {}",
        r.calls_per_message(),
        r.duplicates
    );
    for (op, n) in &r.calls {
        println!(
            "    {:<36} {:>9} {:.4}/message",
            op.name(),
            n,
            r.per_message(*op)
        );
    }
    println!(
        "  receives per message {:.3} ({} deliveries; most receives of a message {}; messages received over 5 times {}); deletes SQS ignored (visibility ran out first) {}",
        r.receives_per_message(),
        r.deliveries,
        r.max_receive_count,
        r.over_five_receives,
        r.stale_deletes
    );
    let f = &r.refusals;
    println!(
        "  DynamoDB refused: {} item throttles, {} table throttles, {} transaction conflicts; {} attempts sent again, {} calls given up",
        f.item_throttled, f.table_throttled, f.conflicts, f.retries, f.gave_up
    );
    if let Some(m) = &r.metrics {
        println!(
            "  library metrics: processed {}, duplicates {}, retries {}, in flight {}, lease lost {}, heartbeat extensions {}, permanent failures {}",
            m.processed,
            m.duplicates,
            m.retries,
            m.in_flight,
            m.lease_lost,
            m.heartbeat_extensions,
            m.permanent_failures
        );
    }
    let [p50, p99, max] = r.commit_latency_ms;
    println!("  first send to commit: p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms");
    let l = &r.ledger;
    println!(
        "  ledger: {} of {} events applied exactly once, {} missing, {} more than once, {} foreign rows, {} accounts wrong, {} messages left in the queue: {}",
        l.applied_once,
        l.events,
        l.missing,
        l.applied_more,
        l.foreign,
        l.accounts_wrong,
        l.left_in_queue,
        if l.ok() { "OK" } else { "FAILED" }
    );
}

fn main() -> ExitCode {
    let (config, consumers) = match parse() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("scale: {e}");
            return ExitCode::from(2);
        }
    };
    print_model(&config.model);
    let c = &config.capacity;
    println!(
        "DynamoDB capacity: item {} WCU/s, table {}, transaction hold {:?}; hot accounts {}",
        c.item_wcu,
        c.table_wcu
            .map_or("unlimited".into(), |t| format!("{t} WCU/s")),
        c.hold,
        config.hot_accounts.map_or("none".into(), |n| n.to_string())
    );
    println!(
        "{} pollers x concurrency {} (prefetch {}), {} messages, {:.0}% of events sent twice, handler {:?}, seed {}, {}",
        config.pollers,
        config.concurrency,
        config.prefetch,
        config.messages,
        config.duplicate_rate * 100.0,
        config.handler,
        config.seed,
        config
            .rate
            .map_or("all queued at the start".into(), |r| format!(
                "sent at {r} per second"
            ))
    );
    let mut reports = Vec::new();
    for consumer in consumers {
        match run(&config, consumer) {
            Ok(r) => {
                print_run(&r);
                reports.push(r);
            }
            Err(e) => {
                eprintln!("scale: cannot start a runtime: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if let Some(ours) = reports.iter().find(|r| r.consumer == Consumer::SqsOnce) {
        for theirs in reports.iter().filter(|r| r.consumer != Consumer::SqsOnce) {
            println!(
                "sqs-once / {}: throughput {:.3}x, calls per message {:.3}x, slot use {:.3}x",
                theirs.consumer.name(),
                ours.throughput() / theirs.throughput(),
                ours.calls_per_message() / theirs.calls_per_message(),
                ours.slot_use() / theirs.slot_use()
            );
        }
    }
    if reports.iter().all(|r| r.ledger.ok()) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
