//! Section 1: AWS calls per message, by path.

use crate::*;

/// 1. AWS calls per message.
pub(crate) async fn calls_per_message(bench: &Bench, r: &mut Report) {
    let Bench { sdk, sqs, ddb, .. } = bench;
    let calls_events = bench.calls_events;
    r.say(String::new());
    r.say(format!(
        "## 1. AWS calls per message ({calls_events} events, 30% sent twice, concurrency 10)"
    ));
    r.say("| path | per message | by operation | messages/s (in-process poller) |".into());
    r.say("|---|---|---|---|".into());
    for fast in [true, false] {
        let s = fresh(sqs, ddb).await;
        let (bodies, expected) = events(calls_events, 0.3);
        send_all(sqs, &s.queues.queue_url, &bodies).await;
        let (rate, per_op) = run_sqs_once(sdk, &s, fast, 10, bodies.len()).await;
        assert_eq!(ledger_rows(ddb, &s.ledger).await, expected, "ledger sums");
        {
            let path = if fast { "fast" } else { "claim" };
            let record = largest_item(ddb, &s.dedup).await;
            let ledger = largest_item(ddb, &s.ledger).await;
            let mut f = bench.findings.lock().unwrap();
            f.calls.insert(
                path.into(),
                per_op
                    .iter()
                    .map(|(op, n)| (op.clone(), *n as f64 / bodies.len() as f64))
                    .collect(),
            );
            f.record_bytes.insert(path.into(), record);
            f.ledger_bytes = f.ledger_bytes.max(ledger);
        }
        report_calls(
            r,
            if fast {
                "fast (one transaction)"
            } else {
                "general (claim, then complete)"
            },
            &per_op,
            bodies.len(),
            rate,
        );
    }
    // The insert path: each event one new item keyed by its id (the
    // ledger's event as an item: `Effects::Insert`), one PutItem per
    // message.
    let s = fresh(sqs, ddb).await;
    let (bodies, expected) = events(calls_events, 0.3);
    send_all(sqs, &s.queues.queue_url, &bodies).await;
    let handler = sqs_once::insert_once(&["pk"], EventItem(s.ledger.clone()));
    let (rate, per_op) = run_sqs_once_with(sdk, &s, true, handler, (10, bodies.len())).await;
    assert_eq!(
        event_item_sums(ddb, &s.ledger).await,
        expected,
        "insert path: each event once"
    );
    {
        let item = largest_item(ddb, &s.ledger).await;
        let mut f = bench.findings.lock().unwrap();
        f.calls.insert(
            "insert".into(),
            per_op
                .iter()
                .map(|(op, n)| (op.clone(), *n as f64 / bodies.len() as f64))
                .collect(),
        );
        // The item is the record: its size is what a put writes.
        f.record_bytes.insert("insert".into(), item);
    }
    report_calls(
        r,
        "insert (one PutItem, the item is the record)",
        &per_op,
        bodies.len(),
        rate,
    );
}

/// One row of section 1.
fn report_calls(
    r: &mut Report,
    path: &str,
    per_op: &std::collections::BTreeMap<String, u64>,
    messages: usize,
    rate: f64,
) {
    {
        let total: u64 = per_op.values().sum();
        let detail: Vec<String> = per_op
            .iter()
            .map(|(op, n)| format!("{op} {:.3}", *n as f64 / messages as f64))
            .collect();
        r.say(format!(
            "| {path} | {:.3} | {} | {rate:.1} |",
            total as f64 / messages as f64,
            detail.join(", ")
        ));
    }
}
