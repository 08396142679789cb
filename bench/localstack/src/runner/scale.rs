//! Sections 4 and 5: footprint, and scaling with 1, 2 and 4 pollers.

use std::time::{Duration, Instant};

use crate::*;

/// 4. Footprint: binary size, start-up time, idle and peak memory.
pub(crate) async fn footprint(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let tp_events = bench.tp_events;
    r.say(String::new());
    r.say("## 4. Footprint (release `ledger` binary)".into());
    let size = std::fs::metadata(ledger()).map(|m| m.len()).unwrap_or(0);
    r.say(format!("binary size: {:.1} MB", size as f64 / 1e6));
    let s = fresh(sqs, ddb).await;
    let mut starts = Vec::new();
    let mut idle_rss = 0;
    for _ in 0..5 {
        let spawned = Instant::now();
        let mut child = ledger_command(&s, &[], true).spawn().unwrap();
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(
            child.stderr.take().unwrap(),
        ));
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("polling") {
                break;
            }
        }
        starts.push(spawned.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        idle_rss = idle_rss.max(rss_kb(child.id().unwrap(), "VmRSS:"));
        terminate(&child);
        let _ = child.wait().await;
    }
    r.say(format!(
        "start to polling (config, table and queue checks: 3 round trips): median {:.0} ms",
        median(starts)
    ));
    r.say(format!("idle RSS: {:.1} MB", idle_rss as f64 / 1024.0));
    let (bodies, expected) = events(tp_events * 2, 0.3);
    send_all(sqs, &s.queues.queue_url, &bodies).await;
    let child = ledger_command(&s, &[("SQS_ONCE_CONCURRENCY", "20")], false)
        .spawn()
        .unwrap();
    drained(sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
    let peak = rss_kb(child.id().unwrap(), "VmHWM:");
    terminate(&child);
    assert_eq!(ledger_rows(ddb, &s.ledger).await, expected);
    r.say(format!(
        "peak RSS under load ({} messages, concurrency 20): {:.1} MB",
        bodies.len(),
        peak as f64 / 1024.0
    ));
}

/// 5. Scaling: 1, 2, 4 pollers; CPU seconds per process.
pub(crate) async fn scaling(bench: &Bench, r: &mut Report) {
    let Bench { sqs, ddb, .. } = bench;
    let tp_events = bench.tp_events;
    r.say(String::new());
    r.say(format!(
        "## 5. Scaling ({} events + 30% duplicates per run)",
        tp_events * 2
    ));
    r.say("| pollers | messages/s | ratio to 1 | poller CPU s (sum) | LocalStack CPU s |".into());
    r.say("|---|---|---|---|---|".into());
    let mut base = 0.0;
    for k in [1usize, 2, 4] {
        let s = fresh(sqs, ddb).await;
        let (bodies, expected) = events(tp_events * 2, 0.3);
        send_all(sqs, &s.queues.queue_url, &bodies).await;
        let ls_before = localstack_cpu();
        let started = Instant::now();
        let children: Vec<_> = (0..k)
            .map(|_| ledger_command(&s, &[], false).spawn().unwrap())
            .collect();
        drained(sqs, &s.queues.queue_url, Duration::from_secs(1800)).await;
        let rate = bodies.len() as f64 / started.elapsed().as_secs_f64();
        let poller_cpu: f64 = children.iter().map(|c| cpu_secs(c.id().unwrap())).sum();
        let ls_cpu = localstack_cpu() - ls_before;
        for c in &children {
            terminate(c);
        }
        for mut c in children {
            let _ = c.wait().await;
        }
        assert_eq!(ledger_rows(ddb, &s.ledger).await, expected);
        if k == 1 {
            base = rate;
        }
        r.say(format!(
            "| {k} | {rate:.1} | {:.2} | {poller_cpu:.1} | {ls_cpu:.1} |",
            rate / base
        ));
    }
}
