//! Every `SQS_ONCE_*` variable the project names (in its docs, templates,
//! error messages and code) is one that something reads: a flag's variable
//! of the consumers (`sqs_once::env::RuntimeArgs`) or of this tool, or one of
//! the few read directly (listed below with their reader).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory};

use crate::args::Cli;

/// Variables read without a flag, and who reads them.
const READ_DIRECTLY: &[(&str, &str)] = &[
    ("SQS_ONCE_LOG_FORMAT", "sqs_once::env::init_logging"),
    ("SQS_ONCE_TRACE_FILTER", "sqs_once::env::init_logging"),
    (
        "SQS_ONCE_MUTANT",
        "sqs_once::mutants (test builds with the deliberate bugs)",
    ),
    (
        "SQS_ONCE_MUTANTS",
        "build.rs (at build time: compiles the deliberate bugs in)",
    ),
    (
        "SQS_ONCE_LOCALSTACK",
        "tests/it/common.rs (`required`: a LocalStack suite fails, not skips, without it)",
    ),
    (
        "SQS_ONCE_TOOLS",
        "scripts/deny (where cargo-deny is installed)",
    ),
];

/// The `SQS_ONCE_*` variables of every argument of `command` and its subcommands.
fn variables(command: &clap::Command, into: &mut BTreeSet<String>) {
    for arg in command.get_arguments() {
        if let Some(env) = arg.get_env() {
            into.insert(env.to_string_lossy().into_owned());
        }
    }
    for sub in command.get_subcommands() {
        variables(sub, into);
    }
}

fn files(dir: &Path, into: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" && name != "node_modules" {
                files(&path, into);
            }
        } else if [".rs", ".md", ".yaml", ".yml", ".json", ".toml"]
            .iter()
            .any(|ext| name.ends_with(ext))
            || path.parent().is_some_and(|p| p.ends_with("scripts"))
        {
            into.push(path);
        }
    }
}

/// `SQS_ONCE_[A-Z0-9_]+` tokens in `text` (whole words: not `BENCH_SQS_ONCE_ENV`).
fn named(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("SQS_ONCE_") {
        let word_start = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        let tail = &rest[at..];
        if !word_start {
            rest = &tail["SQS_ONCE_".len()..];
            continue;
        }
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let token = tail[..len].trim_end_matches('_');
        if token.len() > "SQS_ONCE_".len() {
            found.push(token.to_owned());
        }
        rest = &tail[len..];
    }
    found
}

#[test]
fn every_setting_the_project_names_exists() {
    let mut known = BTreeSet::new();
    variables(&Cli::command(), &mut known);
    let consumers = sqs_once::env::RuntimeArgs::augment_args(clap::Command::new("consumer"));
    variables(&consumers, &mut known);
    assert!(
        known.contains("SQS_ONCE_LEASE"),
        "the consumers' variables: {known:?}"
    );
    known.extend(READ_DIRECTLY.iter().map(|(name, _)| (*name).to_owned()));

    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut paths = Vec::new();
    for dir in [
        "src",
        "cli",
        "examples",
        "docs",
        "infra",
        "scripts",
        "localstack",
        "sim",
        "tests",
        "bench",
        "benches",
        "tools",
    ] {
        files(&root.join(dir), &mut paths);
    }
    paths.extend(["README.md", "template.yaml"].map(|f| root.join(f)));
    let mut unknown = Vec::new();
    let mut seen = 0;
    for path in &paths {
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        for token in named(&text) {
            seen += 1;
            if !known.contains(&token) {
                unknown.push(format!(
                    "{token} in {}",
                    path.strip_prefix(&root).unwrap_or(path).display()
                ));
            }
        }
    }
    assert!(
        seen > 100,
        "the scan found the project's files ({seen} names)"
    );
    unknown.sort();
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "settings named but read by nothing: {unknown:#?}"
    );
}

#[test]
fn the_scan_finds_names_in_text() {
    assert_eq!(
        named("set `SQS_ONCE_LEASE=60s` or SQS_ONCE_DRAIN, not BENCH_SQS_ONCE_ENV or SQS_ONCE_"),
        ["SQS_ONCE_LEASE", "SQS_ONCE_DRAIN"]
    );
}
