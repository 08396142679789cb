//! The scale run with DynamoDB's capacity modelled (`scale::capacity`), at a
//! small size: the model throttles above a table's limit and not below it,
//! hot account items conflict, and through all of it every consumer still
//! applies each event exactly once, every account's balance is the sum of
//! its events, and nothing is left in the queue.

use std::time::Duration;

use sqs_once_sim::scale::{CapacityModel, Consumer, RunReport, ScaleConfig, run};

/// A table limit small enough for a small run: 400 write units a second,
/// 200 two-item transactions (2 units per item, one item per table).
const TABLE_WCU: f64 = 400.0;

fn config(rate: f64, accounts: Option<usize>) -> ScaleConfig {
    ScaleConfig {
        pollers: 4,
        concurrency: 5,
        messages: 2_000,
        duplicate_rate: 0.1,
        handler: Duration::from_millis(5),
        seed: 5,
        rate: Some(rate),
        capacity: CapacityModel::dynamodb(Some(TABLE_WCU)),
        hot_accounts: accounts,
        ..ScaleConfig::default()
    }
}

fn assert_exact(r: &RunReport) {
    assert!(
        r.ledger.ok(),
        "{}: {:?} ({:?})",
        r.consumer.name(),
        r.ledger,
        r.refusals
    );
}

#[test]
fn under_the_table_limit_nothing_is_throttled() {
    // 100 messages a second: 200 units a second per table, half its limit.
    for consumer in [Consumer::SqsOnce, Consumer::BestLoop] {
        let r = run(&config(100.0, None), consumer).expect("runtime");
        assert_exact(&r);
        assert_eq!(r.refusals.table_throttled, 0, "{}", consumer.name());
        assert_eq!(r.refusals.item_throttled, 0, "{}", consumer.name());
        assert_eq!(r.refusals.gave_up, 0, "{}", consumer.name());
    }
}

#[test]
fn at_twice_the_table_limit_writes_are_throttled_and_every_event_applied_once() {
    // 400 messages a second: 800 units a second per table, twice its limit.
    for consumer in [Consumer::SqsOnce, Consumer::BestLoop] {
        let r = run(&config(400.0, None), consumer).expect("runtime");
        assert_exact(&r);
        assert!(
            r.refusals.table_throttled > 0,
            "{}: {:?}",
            consumer.name(),
            r.refusals
        );
        assert!(
            r.refusals.retries > 0,
            "{}: refusals retried",
            consumer.name()
        );
        // The table's units bound the run: 2,000 transactions at 200 a second
        // (the first second's burst apart) take at least 9 s.
        assert!(
            r.virtual_secs >= 9.0,
            "{}: {} s",
            consumer.name(),
            r.virtual_secs
        );
    }
}

#[test]
fn one_hot_account_conflicts_and_its_balance_is_exact() {
    let mut c = config(400.0, Some(1));
    c.capacity = CapacityModel::dynamodb(None);
    for consumer in [Consumer::SqsOnce, Consumer::BestLoop] {
        let r = run(&c, consumer).expect("runtime");
        assert_exact(&r);
        assert!(
            r.refusals.conflicts > 0,
            "{}: {:?}",
            consumer.name(),
            r.refusals
        );
        assert_eq!(r.ledger.accounts_wrong, 0);
    }
}

#[test]
fn the_library_reports_its_retries_under_throttling() {
    let mut c = config(400.0, Some(1));
    c.capacity = CapacityModel::dynamodb(None);
    let r = run(&c, Consumer::SqsOnce).expect("runtime");
    assert_exact(&r);
    let m = r.metrics.expect("sqs-once's metrics");
    // Each event's commit counted once as processed; every commit the
    // client gave up on (its last attempt refused) a retry, its message
    // brought back by SQS.
    assert_eq!(m.processed as usize, r.ledger.events);
    assert_eq!(
        m.retries, r.refusals.gave_up,
        "a given-up commit is a retry"
    );
    assert_eq!(m.lease_lost, 0, "the fast path holds no lease");
    assert_eq!(r.stale_deletes, 0, "no visibility ran out before a delete");
    if r.refusals.gave_up > 0 {
        assert!(
            r.deliveries > r.config.messages as u64,
            "messages came back"
        );
    }
}
