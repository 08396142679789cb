//! The operator tool's commands against LocalStack, as an operator runs them
//! (`inspect`, `forget`, `redrive`, `stats`, `init`, `demo`), with the
//! library's LocalStack helpers (`tests/it/common.rs`).

// A test reads as one story from set-up to assertions.
#![allow(clippy::too_many_lines)]

mod commands;
#[allow(dead_code, unused_imports)]
#[path = "../../../tests/it/common.rs"]
mod common;
