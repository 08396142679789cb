//! Helpers shared by the integration tests, the chaos harness and the
//! benchmarks (each includes this file with `#[path]`).
#![allow(dead_code)]

pub mod payments_api;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aws_sdk_sqs::types::{QueueAttributeName, SendMessageBatchRequestEntry};

/// The path of the workspace's binary `name` (`ledger` and `payments` of the
/// example crates, `faulty-ledger` and `faulty-payments` of `tests/consumers`,
/// `sqs-once` of `sqs-once-cli`), built for this test's profile
/// into the test executable's target directory.
///
/// The root package's tests cannot name another package's binary with
/// `CARGO_BIN_EXE_*`, so the first call in a process runs `$CARGO build
/// --workspace --bins` (it inherits `SQS_ONCE_MUTANTS`, so the chaos
/// harness's `faulty-ledger` has the mutants when the harness has); later calls reuse it. Every binary comes from that one build so
/// that they share one feature resolution: `cargo build -p
/// sqs-once-example-ledger` alone resolves `hyper` without the CLI's `server`
/// feature, and so builds the whole AWS SDK a second time. Panics with the
/// build's output when it fails.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let path = built.get_or_insert_with(build_binaries).join(name);
    assert!(
        path.is_file(),
        "`cargo build --workspace --bins` made no {}: not a binary of this workspace",
        path.display()
    );
    path
}

/// Builds every binary of the workspace; the directory they are in.
fn build_binaries() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    // The test runs from <target>/<profile>/deps/; the binaries go to <target>/<profile>/.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable is in <target>/<profile>/deps")
        .to_owned();
    let target_dir = profile_dir.parent().expect("a target directory");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = std::process::Command::new(cargo);
    build
        .args([
            "build",
            "--quiet",
            "--workspace",
            "--bins",
            "--manifest-path",
        ])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir);
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => {}
        Some("release") => {
            build.arg("--release");
        }
        other => panic!("a test in {other:?}: not a debug or release build"),
    }
    let out = build
        .output()
        .unwrap_or_else(|e| panic!("cannot run {build:?}: {e}"));
    assert!(
        out.status.success(),
        "cannot build the workspace's binaries ({build:?}: {}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    profile_dir
}

/// A TLS acceptor for 127.0.0.1 with a fresh self-signed certificate, and
/// that certificate's PEM (what a client must trust).
pub fn self_signed_tls() -> (tokio_rustls::TlsAcceptor, String) {
    let certified = rcgen::generate_simple_self_signed(["127.0.0.1".to_owned()]).unwrap();
    let pem = certified.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![certified.cert.der().clone()], key)
        .unwrap();
    (
        tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)),
        pem,
    )
}

/// An environment variable parsed, or the default.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A name no other test or run against the same LocalStack uses.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Visible, in-flight and delayed messages.
pub async fn depth(sqs: &aws_sdk_sqs::Client, url: &str) -> u64 {
    sqs.get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .unwrap()
        .attributes
        .unwrap_or_default()
        .values()
        .map(|v| v.parse::<u64>().unwrap_or(0))
        .sum()
}

/// The ledger table: account -> (balance_cents, applied_events).
pub async fn ledger_rows(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> HashMap<String, (i64, i64)> {
    let mut out = HashMap::new();
    let mut pages = client
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send();
    while let Some(item) = pages.next().await {
        let item = item.unwrap();
        let n = |k: &str| {
            item.get(k)
                .and_then(|v| v.as_n().ok())
                .map_or(0, |v| v.parse().unwrap())
        };
        out.insert(
            item["pk"].as_s().unwrap().clone(),
            (n("balance_cents"), n("applied_events")),
        );
    }
    out
}

/// Sends the bodies in batches of 10, in order; every entry must be accepted.
pub async fn send_all(sqs: &aws_sdk_sqs::Client, url: &str, bodies: &[String]) {
    for chunk in bodies.chunks(10) {
        let entries = chunk
            .iter()
            .enumerate()
            .map(|(i, b)| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(b)
                    .build()
                    .unwrap()
            })
            .collect();
        let out = sqs
            .send_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .unwrap();
        assert!(out.failed().is_empty(), "{:?}", out.failed());
    }
}
