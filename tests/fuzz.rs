//! Property tests of the input side: arbitrary bodies, attributes, keys and SQS
//! event records never panic; every message ends completed, duplicate or
//! parked exactly as its key and body decide (an oracle written apart from the
//! processor), and a Lambda batch lists exactly its failing records. In memory
//! (no LocalStack): these are about parsing.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use proptest::prelude::*;
use sqs_once::config::ProcessorConfig;
use sqs_once::lambda::{LambdaAdapter, LambdaConfig};
use sqs_once::{KeySource, MemoryStore, Message, Outcome, Processor};
use sqs_once_example_ledger::{LedgerEvent, LedgerHandler};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Bodies: arbitrary text, arbitrary JSON, and near-valid ledger events.
fn body() -> impl Strategy<Value = String> {
    let json_leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<f64>().prop_map(|f| serde_json::json!(f)),
        ".{0,20}".prop_map(serde_json::Value::String),
    ];
    let json = json_leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("id|account|amount_cents|seq|.{0,6}", inner, 0..5)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![
        ".{0,200}",
        json.prop_map(|v| v.to_string()),
        ("[a-z0-9-]{0,12}", "[a-z]{0,6}", any::<i64>()).prop_map(|(id, account, amount)| {
            serde_json::json!({"id": id, "account": account, "amount_cents": amount}).to_string()
        }),
    ]
}

fn key_source() -> impl Strategy<Value = KeySource> {
    let single = prop_oneof![
        Just(KeySource::MessageId),
        Just(KeySource::DeduplicationId),
        Just(KeySource::BodySha256),
        "[a-z_]{1,8}".prop_map(KeySource::Attribute),
        "(/[a-z0-9~]{0,5}){1,3}(>/[a-z0-9]{0,5}){0,2}".prop_map(KeySource::JsonPointer),
    ];
    // A compound's parts read no message or dedup id (refused at start-up).
    let part = prop_oneof![
        Just(KeySource::BodySha256),
        "[a-z_]{1,8}".prop_map(KeySource::Attribute),
        "(/[a-z0-9~]{0,5}){1,3}(>/[a-z0-9]{0,5}){0,2}".prop_map(KeySource::JsonPointer),
    ];
    prop_oneof![
        4 => single,
        1 => prop::collection::vec(part, 2..4).prop_map(KeySource::Compound),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    (
        ".{0,40}",
        body(),
        prop::collection::btree_map("[a-z_]{1,8}", ".{0,30}", 0..4),
        proptest::option::of(".{0,20}"),
        proptest::option::of(".{0,20}"),
        1u32..10,
    )
        .prop_map(|(id, body, attrs, group, dedup, count)| {
            let mut m = Message::new(id, body).with_receive_count(count);
            for (k, v) in attrs {
                m = m.with_attribute(k, v);
            }
            if let Some(g) = group {
                m = m.with_group_id(g);
            }
            if let Some(d) = dedup {
                m = m.with_deduplication_id(d);
            }
            m
        })
}

/// What the processor must answer for a message, decided independently of it:
/// no key is a permanent failure naming the key problem; a completed key is a
/// duplicate; otherwise a ledger event with an account completes and anything
/// else is a permanent failure saying it is not a ledger event.
#[derive(Debug, PartialEq, Eq)]
enum Expected {
    Completed,
    Duplicate,
    Park(String),
}

fn expected(
    source: &KeySource,
    m: &Message,
    completed: &std::collections::HashSet<String>,
) -> Expected {
    let key = match source.extract(m) {
        Ok(key) => key,
        Err(e) => return Expected::Park(e.to_string()),
    };
    if completed.contains(&key) {
        return Expected::Duplicate;
    }
    match serde_json::from_str::<LedgerEvent>(m.body()) {
        Ok(e) if !e.account.is_empty() => Expected::Completed,
        _ => Expected::Park("not a ledger event".into()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn key_sources_parse_or_say_why(text in ".{0,40}") {
        match text.parse::<KeySource>() {
            Ok(source) => prop_assert_eq!(source.to_string().parse::<KeySource>().unwrap(), source),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn key_extraction_never_panics_and_keys_fit_dynamodb(source in key_source(), m in message()) {
        match source.extract(&m) {
            Ok(key) => {
                prop_assert!(!key.trim().is_empty());
                let pk = sqs_once::key::record_key("consumer", &key);
                prop_assert!(pk.len() <= 1024, "record key of {} bytes", pk.len());
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn every_message_ends_as_its_key_and_body_decide(
        source in key_source(),
        messages in prop::collection::vec(message(), 1..6),
    ) {
        let mut config = ProcessorConfig::new("fuzz");
        config.key_source = source.clone();
        let p = Processor::new(MemoryStore::default(), LedgerHandler::new("ledger"), config).unwrap();
        let mut completed = std::collections::HashSet::new();
        runtime().block_on(async {
            for m in messages {
                let want = expected(&source, &m, &completed);
                let got = p.process(m.clone()).await;
                match (&want, &got) {
                    (Expected::Completed, Outcome::Completed { .. })
                    | (Expected::Duplicate, Outcome::Duplicate { .. }) => {}
                    (Expected::Park(why), Outcome::Park { reason }) => {
                        prop_assert!(reason.contains(why.as_str()), "{reason:?} does not say {why:?}");
                    }
                    _ => prop_assert!(false, "{m:?}: expected {want:?}, got {got:?}"),
                }
                if want == Expected::Completed {
                    completed.insert(source.extract(&m).unwrap());
                }
            }
            Ok(())
        })?;
    }

    #[test]
    fn lambda_events_of_any_shape_fail_only_their_own_records(
        records in prop::collection::vec(
            (
                proptest::option::of("[a-z0-9-]{0,12}"),
                prop_oneof![body().prop_map(serde_json::Value::String), Just(serde_json::json!(42)), Just(serde_json::Value::Null)],
                prop::collection::btree_map("[A-Za-z]{1,24}", prop_oneof![".{0,8}".prop_map(serde_json::Value::String), Just(serde_json::json!(7))], 0..3),
            ),
            0..8,
        ),
    ) {
        let events: Vec<serde_json::Value> = records
            .iter()
            .map(|(id, body, attrs)| {
                let mut r = serde_json::json!({"body": body, "attributes": attrs, "messageAttributes": {}});
                if let Some(id) = id {
                    r["messageId"] = serde_json::json!(id);
                }
                r
            })
            .collect();
        let mut config = ProcessorConfig::new("fuzz");
        config.key_source = "json:/id".parse().unwrap();
        let processor = Processor::new(MemoryStore::default(), LedgerHandler::new("ledger"), config).unwrap();
        // No eventSourceARN and no DLQ: nothing is sent anywhere.
        let sqs = aws_sdk_sqs::Client::from_conf(
            aws_sdk_sqs::Config::builder()
                .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
                .region(aws_sdk_sqs::config::Region::new("us-east-1"))
                .build(),
        );
        // The full list even when every record fails: which ones is the point.
        let listing = { let mut c = LambdaConfig::default(); c.error_on_full_failure = false; c };
        let adapter = LambdaAdapter::new(sqs, processor, listing);
        let answer = runtime().block_on(adapter.handle(
            serde_json::json!({"Records": events}),
            SystemTime::now() + Duration::from_secs(60),
        ));
        let ids: BTreeMap<String, usize> = records
            .iter()
            .filter_map(|(id, ..)| id.clone())
            .fold(BTreeMap::new(), |mut m, id| { *m.entry(id).or_default() += 1; m });
        let all_identified = records.iter().all(|(id, ..)| id.as_deref().is_some_and(|s| !s.is_empty()));
        match answer {
            Ok(response) => {
                prop_assert!(all_identified, "a record without messageId must fail the invocation");
                let listed: std::collections::BTreeSet<&str> = response
                    .batch_item_failures
                    .iter()
                    .map(|f| f.item_identifier.as_str())
                    .collect();
                for id in &listed {
                    prop_assert!(ids.contains_key(*id), "listed a record not in the batch");
                }
                // Records whose outcome their own body decides (a unique id and
                // key, a text body, text attributes): listed exactly when they
                // fail (no DLQ here, so a permanent failure is listed too).
                let source: KeySource = "json:/id".parse().unwrap();
                let keys: Vec<Option<String>> = records
                    .iter()
                    .map(|(id, body, _)| {
                        let text = body.as_str()?;
                        source.extract(&Message::new(id.clone().unwrap_or_default(), text)).ok()
                    })
                    .collect();
                for (i, (id, body, attrs)) in records.iter().enumerate() {
                    let (Some(id), Some(text)) = (id, body.as_str()) else { continue };
                    if !attrs.values().all(serde_json::Value::is_string) {
                        continue; // malformed attributes: may fail, on its own
                    }
                    let shared_key = keys[i].is_some()
                        && keys.iter().filter(|k| **k == keys[i]).count() > 1;
                    if ids[id] > 1 || shared_key {
                        continue;
                    }
                    let fails = matches!(
                        expected(&source, &Message::new(id.clone(), text), &Default::default()),
                        Expected::Park(_)
                    );
                    prop_assert_eq!(
                        listed.contains(id.as_str()),
                        fails,
                        "record {} with body {:?}: failed {}, listed {}",
                        id, text, fails, listed.contains(id.as_str())
                    );
                }
            }
            Err(e) => {
                prop_assert!(!all_identified, "failed a well-identified batch: {e}");
                prop_assert!(e.to_string().contains("messageId"));
            }
        }
    }
}
