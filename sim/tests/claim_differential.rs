//! The claim condition twice: `Record::claimable_by` (what `MemoryStore`
//! decides by) and DynamoDB's `CLAIM_CONDITION` (what `DynamoStore` sends),
//! evaluated by the wire model's evaluator, agree on random records, as do
//! the fast path's (`FastCommit::may_replace`, `FAST_COMMIT_CONDITION`);
//! and a claim through the real `DynamoStore` and SDK over the wire answers
//! as the memory store's rule says (its fence included), on the same records.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use proptest::prelude::*;
use sqs_once::aws::dynamodb::{CLAIM_CONDITION, FAST_COMMIT_CONDITION, record_from_item};
use sqs_once::clock::ManualClock;
use sqs_once::store::{ClaimRequest, FastCommit, clock_fence, decide_conflict, next_fence};
use sqs_once::{Claim, DedupStore, DynamoStore};
use sqs_once_sim::faults::Life;
use sqs_once_sim::wire::expr::{self, Av, Item, Placeholders};
use sqs_once_sim::wire::{self, Service, Wire};

/// The claim's time, in ms (a whole second plus a part, so that the second
/// and millisecond comparisons both have edges).
const NOW_MS: i64 = 1_800_000_000_500;

fn offset_ms() -> impl Strategy<Value = i64> {
    prop_oneof![
        Just(0),
        Just(-1),
        Just(1),
        Just(-1_000),
        Just(1_000),
        -100_000i64..100_000
    ]
}

/// A fence around the clock's at the claim's time (as every fence written is
/// near a writer's clock), never 0.
fn fence_near_now() -> impl Strategy<Value = u64> {
    let now = clock_fence(NOW_MS);
    prop_oneof![
        Just(now - 1),
        Just(now),
        Just(now + 1),
        (-3_000i64..3_000).prop_map(move |o| now.saturating_add_signed(o * 1_000)),
    ]
}

fn maybe<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<T>> {
    prop_oneof![1 => Just(None), 3 => s.prop_map(Some)]
}

/// An item as `DynamoStore` leaves one: every status, each attribute present
/// or not, times near the claim's. An `IN_PROGRESS` record always has its
/// lease (every write that sets that status sets `lease_until`).
fn item() -> impl Strategy<Value = Item> {
    (
        prop_oneof![Just("IN_PROGRESS"), Just("COMPLETED"), Just("FAILED")],
        maybe(prop_oneof![Just("o1"), Just("o2")]),
        maybe(prop_oneof![
            Just(0i64),
            offset_ms().prop_map(|o| NOW_MS + o)
        ]),
        maybe(prop_oneof![-2i64..=2].prop_map(|o| NOW_MS / 1000 + o)),
        maybe(prop_oneof![Just("m1"), Just("m2")]),
        maybe(offset_ms().prop_map(|o| NOW_MS + o)),
        0u32..4,
        maybe(prop_oneof![Just("p1"), Just("p2")]),
        maybe(fence_near_now()),
    )
        .prop_map(
            |(status, owner, lease, expires, mid, claimed, attempts, payload, fence)| {
                let mut it = Item::new();
                it.insert("pk".into(), Av::S("sim#e".into()));
                it.insert("status".into(), Av::S(status.into()));
                let n = |v: i64| Av::N(v.to_string());
                let lease = if status == "IN_PROGRESS" {
                    lease.or(Some(0))
                } else {
                    lease
                };
                let fields = [
                    ("owner", owner.map(|o| Av::S(o.into()))),
                    ("lease_until", lease.map(n)),
                    ("expires_at", expires.map(n)),
                    ("message_id", mid.map(|m| Av::S(m.into()))),
                    ("claimed_at", claimed.map(n)),
                    ("attempts", Some(n(i64::from(attempts)))),
                    ("payload_sha256", payload.map(|p| Av::S(p.into()))),
                    ("fence", fence.map(|f| Av::N(f.to_string()))),
                ];
                for (k, v) in fields {
                    if let Some(v) = v {
                        it.insert(k.into(), v);
                    }
                }
                it
            },
        )
}

fn sdk_item(item: &Item) -> HashMap<String, aws_sdk_dynamodb::types::AttributeValue> {
    use aws_sdk_dynamodb::types::AttributeValue as A;
    item.iter()
        .map(|(k, v)| {
            let v = match v {
                Av::S(s) => A::S(s.clone()),
                Av::N(n) => A::N(n.clone()),
                other => panic!("the generator writes only S and N, not {other:?}"),
            };
            (k.clone(), v)
        })
        .collect()
}

/// `CLAIM_CONDITION` on `item`, by the evaluator, with the values the claim sends.
fn condition_holds(item: &Item, now_ms: i64, mid: &str) -> bool {
    evaluate(CLAIM_CONDITION, item, now_ms, mid, None)
}

/// `condition` on `item`, by the evaluator, with the values a claim sends
/// (and a fast-path commit's `:fence`).
fn evaluate(condition: &str, item: &Item, now_ms: i64, mid: &str, fence: Option<u64>) -> bool {
    let names = HashMap::from([("#status".to_owned(), "status".to_owned())]);
    let values = HashMap::from([
        (
            ":now_s".to_owned(),
            Av::N(now_ms.div_euclid(1000).to_string()),
        ),
        (":now_ms".to_owned(), Av::N(now_ms.to_string())),
        (":failed".to_owned(), Av::S("FAILED".into())),
        (":in_progress".to_owned(), Av::S("IN_PROGRESS".into())),
        (":mid".to_owned(), Av::S(mid.into())),
        // The format this build writes: the generator's records carry none.
        (
            ":fmt".to_owned(),
            Av::N(sqs_once::aws::dynamodb::RECORD_FORMAT.to_string()),
        ),
    ]);
    let mut values = values;
    if let Some(fence) = fence {
        values.insert(":fence".to_owned(), Av::N(fence.to_string()));
    }
    let mut ph = Placeholders::new(&names, &values);
    let cond = expr::parse_condition(condition, &mut ph)
        .unwrap_or_else(|e| panic!("{condition} parses: {e:?}"));
    ph.check_all_used().unwrap_or_else(|e| panic!("{e:?}"));
    expr::eval(&cond, item).unwrap_or_else(|e| panic!("{e:?}"))
}

proptest! {
    #[test]
    fn the_rust_claim_rule_and_the_dynamodb_condition_agree(
        item in item(),
        mid in prop_oneof![Just("m1"), Just("m2")],
    ) {
        let record = record_from_item(&sdk_item(&item)).unwrap_or_else(|e| panic!("{e}"));
        prop_assert_eq!(
            record.claimable_by(NOW_MS, mid),
            condition_holds(&item, NOW_MS, mid),
            "record {:?}", record
        );
    }

    #[test]
    fn the_rust_fast_commit_rule_and_the_dynamodb_condition_agree(
        item in item(),
        mid in prop_oneof![Just("m1"), Just("m2")],
        fence in fence_near_now(),
    ) {
        let record = record_from_item(&sdk_item(&item)).unwrap_or_else(|e| panic!("{e}"));
        let commit = FastCommit {
            pk: "sim#e".into(),
            owner: "o3".into(),
            message_id: mid.into(),
            payload_sha256: "p1".into(),
            fence,
            result: None,
            ttl: Duration::from_secs(3600),
            writes: Vec::new(),
            outbox: Vec::new(),
        };
        prop_assert_eq!(
            commit.may_replace(&record, NOW_MS),
            evaluate(FAST_COMMIT_CONDITION, &item, NOW_MS, mid, Some(fence)),
            "record {:?}", record
        );
    }
}

/// The claim the memory store's rule gives on `item`.
fn memory_rule(item: &Item, req: &ClaimRequest) -> Claim {
    let record = record_from_item(&sdk_item(item)).unwrap_or_else(|e| panic!("{e}"));
    if record.claimable_by(NOW_MS, &req.message_id) {
        Claim::Acquired {
            attempt: record.attempts + 1,
            fence: next_fence((record.fence > 0).then_some(record.fence), NOW_MS),
        }
    } else {
        decide_conflict(&record, req, NOW_MS)
    }
}

/// The claim `DynamoStore` makes on `item`, over the wire to the model.
fn wire_claim(item: &Item, req: &ClaimRequest) -> Claim {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    runtime.block_on(async {
        let model = wire::dynamo_model();
        let put = serde_json::json!({ "TableName": wire::TABLE, "Item": expr::item_to_json(item) });
        assert_eq!(model.handle("PutItem", &put).status, 200);
        let clock = ManualClock::starting_now();
        clock.set(UNIX_EPOCH + Duration::from_millis(NOW_MS as u64));
        let clock: Arc<dyn sqs_once::clock::Clock> = Arc::new(clock);
        let wire = Wire::new(Service::Dynamo(model), None, Life::default());
        let store = DynamoStore::with_clock(
            wire::dynamodb_client(wire, clock.clone()),
            wire::TABLE,
            clock,
        );
        store.claim(req).await.unwrap_or_else(|e| panic!("{e}"))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn a_claim_through_the_sdk_answers_as_the_memory_stores_rule(
        item in item(),
        owner in prop_oneof![Just("o1"), Just("o3")],
        mid in prop_oneof![Just("m1"), Just("m2")],
        payload in prop_oneof![Just("p1"), Just("p2")],
    ) {
        let req = ClaimRequest {
            pk: "sim#e".into(),
            owner: owner.into(),
            message_id: mid.into(),
            payload_sha256: payload.into(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
        };
        prop_assert_eq!(wire_claim(&item, &req), memory_rule(&item, &req));
    }
}

#[test]
fn an_in_progress_record_without_a_lease_is_where_the_two_would_differ() {
    // Rust reads a missing `lease_until` as 0 (ran out); DynamoDB's
    // `lease_until < :now_ms` is false on a missing attribute. No write of
    // `DynamoStore` leaves an IN_PROGRESS record without a lease, so the
    // generator above never draws one; this pins the difference down.
    let mut item = Item::new();
    item.insert("pk".into(), Av::S("sim#e".into()));
    item.insert("status".into(), Av::S("IN_PROGRESS".into()));
    let record = record_from_item(&sdk_item(&item)).unwrap_or_else(|e| panic!("{e}"));
    assert!(record.claimable_by(NOW_MS, "m1"));
    assert!(!condition_holds(&item, NOW_MS, "m1"));
}
