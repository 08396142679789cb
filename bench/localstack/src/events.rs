//! The ledger events every benchmark sends, shared by the runner and the
//! stub (`#[path]`-included by both binaries).

use std::collections::HashMap;

use serde_json::json;

/// Ledger events: `n` distinct over 10 accounts (each with a distinct amount),
/// `floor(n x dup_rate)` of them sent twice (spread evenly over the events).
/// Returns the bodies, shuffled with a generator seeded from `n` (the same
/// order every run, copies apart from their originals), and the expected sums.
/// Ten accounts make every account a hot item under concurrency 10, but the
/// emulator's DynamoDB runs one request at a time, so its runs never see a
/// `TransactionConflict` (the scale model's hot-account run does).
pub fn events(n: usize, dup_rate: f64) -> (Vec<String>, HashMap<String, (i64, i64)>) {
    let mut bodies = Vec::new();
    let mut expected: HashMap<String, (i64, i64)> = HashMap::new();
    let copies = |i: usize| (i as f64 * dup_rate).floor() as usize;
    for i in 0..n {
        let account = format!("acct-{}", i % 10);
        // Every event its own amount: one lost and one doubled event of an
        // account cannot cancel out in its sum.
        let amount = i as i64 + 1;
        let e = expected.entry(account.clone()).or_default();
        e.0 += amount;
        e.1 += 1;
        let body = json!({"id": format!("evt-{i}"), "account": account, "amount_cents": amount})
            .to_string();
        if copies(i + 1) > copies(i) {
            bodies.push(body.clone());
        }
        bodies.push(body);
    }
    shuffle(&mut bodies, n as u64);
    (bodies, expected)
}

/// Fisher-Yates with SplitMix64 seeded by `seed`: deterministic, no
/// dependency.
pub fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}
