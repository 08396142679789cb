//! With `redact_reasons` on, a handler's panic message reaches no panic hook
//! (Rust's default one prints it to stderr, which goes to the logs): the
//! processor's hook prints only where it panicked. Panics elsewhere still
//! reach the hook installed before. Its own test binary: panic hooks are
//! process-wide.

use std::sync::{Arc, Mutex};

use sqs_once::clock::ManualClock;
use sqs_once::{
    HandlerResult, MemoryStore, Message, Outcome, Processor, ProcessorConfig, handler_fn,
};

#[tokio::test]
async fn a_redacting_handler_s_panic_message_reaches_no_panic_hook() {
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let record = seen.clone();
    std::panic::set_hook(Box::new(move |info| {
        record.lock().unwrap().push(info.to_string());
    }));
    let mut config = ProcessorConfig::new("redact");
    config.key_source = "json:/id".parse().unwrap();
    config.redact_reasons = true;
    let store = MemoryStore::new(Arc::new(ManualClock::starting_now()));
    let handler = handler_fn(|_m: Message, _ctx| async move {
        let card = "4111111111111111";
        if card.len() > 1 {
            panic!("card {card} declined");
        }
        HandlerResult::Ok(None)
    });
    let processor = Processor::new(store, handler, config).unwrap();
    let outcome = processor
        .process(Message::new("m1", r#"{"id":"e1"}"#))
        .await;
    assert!(matches!(outcome, Outcome::Retry { .. }), "{outcome:?}");
    let after_handler = seen.lock().unwrap().clone();
    assert!(
        after_handler.iter().all(|line| !line.contains("4111")),
        "the handler's panic message reached a panic hook: {after_handler:?}"
    );
    // A panic outside a handler still goes to the hook installed before.
    let _ = std::panic::catch_unwind(|| panic!("outside any handler"));
    let all = seen.lock().unwrap().clone();
    assert!(
        all.iter().any(|line| line.contains("outside any handler")),
        "other panics no longer reach the earlier hook: {all:?}"
    );
}
