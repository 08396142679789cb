//! The scale run (`sqs_once_sim::scale`) at a small size: both consumers
//! drain every message, apply every event exactly once, and make the calls
//! per message their protocols make. Counts, not timings.

use std::time::Duration;

use sqs_once_sim::latency::Op;
use sqs_once_sim::scale::{Consumer, RunReport, ScaleConfig, run};

fn small() -> ScaleConfig {
    ScaleConfig {
        pollers: 5,
        concurrency: 5,
        messages: 5_000,
        duplicate_rate: 0.1,
        handler: Duration::from_millis(5),
        seed: 3,
        ..ScaleConfig::default()
    }
}

/// Receives, batch deletes and transactions only: no claim, no visibility
/// change, no read.
fn assert_only_fast_path_calls(r: &RunReport) {
    for (op, _) in &r.calls {
        assert!(
            matches!(
                op,
                Op::ReceiveMessage
                    | Op::EmptyReceive
                    | Op::DeleteMessageBatch
                    | Op::TransactWriteItems
            ),
            "{} made a {} call",
            r.consumer.name(),
            op.name()
        );
    }
}

#[test]
fn sqs_once_pollers_apply_every_event_once_with_one_transaction_per_message() {
    let r = run(&small(), Consumer::SqsOnce).expect("runtime");
    assert!(r.ledger.ok(), "{:?}", r.ledger);
    assert_eq!(r.ledger.events, 4_545);
    assert_eq!(r.duplicates, 455, "every second copy found done");
    assert_eq!(r.per_message(Op::TransactWriteItems), 1.0);
    let deletes = r.per_message(Op::DeleteMessageBatch);
    assert!(
        (0.1..=0.2).contains(&deletes),
        "{deletes} deletes per message"
    );
    let receives = r.per_message(Op::ReceiveMessage);
    assert!(
        (0.1..=1.0).contains(&receives),
        "{receives} receives per message"
    );
    assert_only_fast_path_calls(&r);
}

#[test]
fn the_hand_written_loop_applies_every_event_once_with_a_tenth_receive_per_message() {
    let r = run(&small(), Consumer::Loop).expect("runtime");
    assert!(r.ledger.ok(), "{:?}", r.ledger);
    assert_eq!(r.duplicates, 455);
    assert_eq!(r.per_message(Op::TransactWriteItems), 1.0);
    for op in [Op::ReceiveMessage, Op::DeleteMessageBatch] {
        let n = r.per_message(op);
        assert!((0.1..=0.11).contains(&n), "{n} {} per message", op.name());
    }
    assert_only_fast_path_calls(&r);
}

#[test]
fn the_best_effort_loop_applies_every_event_once_with_the_fast_path_calls() {
    for consumer in [Consumer::BestLoop, Consumer::BestLoopHeld] {
        let r = run(&small(), consumer).expect("runtime");
        assert!(r.ledger.ok(), "{}: {:?}", consumer.name(), r.ledger);
        assert_eq!(r.duplicates, 455);
        assert_eq!(r.per_message(Op::TransactWriteItems), 1.0);
        for op in [Op::ReceiveMessage, Op::DeleteMessageBatch] {
            let n = r.per_message(op);
            assert!((0.1..=0.2).contains(&n), "{n} {} per message", op.name());
        }
        assert_only_fast_path_calls(&r);
    }
}

#[test]
fn messages_sent_at_a_rate_are_all_applied_and_their_latency_measured() {
    let config = ScaleConfig {
        rate: Some(2_000.0),
        ..small()
    };
    let r = run(&config, Consumer::SqsOnce).expect("runtime");
    assert!(r.ledger.ok(), "{:?}", r.ledger);
    let [p50, p99, max] = r.commit_latency_ms;
    assert!(
        0.0 < p50 && p50 <= p99 && p99 <= max,
        "{:?}",
        r.commit_latency_ms
    );
}

#[test]
fn a_scale_run_is_a_function_of_its_seed() {
    let config = ScaleConfig {
        pollers: 2,
        messages: 600,
        ..small()
    };
    let (a, b) = (
        run(&config, Consumer::SqsOnce).expect("runtime"),
        run(&config, Consumer::SqsOnce).expect("runtime"),
    );
    assert_eq!(a.virtual_secs, b.virtual_secs);
    assert_eq!(a.calls, b.calls);
}
