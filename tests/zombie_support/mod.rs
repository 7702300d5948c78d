//! The one piece of test support that must be compiled into the test binary: the zombie worker's
//! entry point. `brokerfence_testkit::zombie` (where all the rest lives) re-executes the test
//! binary with only the test `zombie_support::worker_entry` ([`WORKER_ENTRY`]) and the worker's
//! arguments in [`WORKER_ENV`]; that test then runs `examples/zombie_worker.rs`, compiled in here,
//! so a test run never runs a stale or missing example binary.

pub use brokerfence_testkit::zombie::*;

#[path = "../../examples/zombie_worker.rs"]
#[allow(dead_code)] // its `main` is the example's; this binary enters through `worker::run`
pub mod worker;

/// Not a test: the entry point of the worker process. In a normal test run it returns at once.
#[test]
fn worker_entry() {
    if let Some(args) = brokerfence_testkit::process::reexec_args(WORKER_ENV) {
        std::process::exit(worker::run(args));
    }
}
