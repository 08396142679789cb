//! Compiles the deliberate bugs of `src/protocol/mutants.rs` in when the
//! crate is built with `SQS_ONCE_MUTANTS=1` (the simulator's and the chaos
//! harness's checks of their checkers). A cfg rather than a feature: no
//! dependent's feature list can switch it on.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(sqs_once_mutants)");
    println!("cargo::rerun-if-env-changed=SQS_ONCE_MUTANTS");
    if std::env::var_os("SQS_ONCE_MUTANTS").is_some_and(|v| v == "1") {
        println!("cargo::rustc-cfg=sqs_once_mutants");
    }
}
