//! brokerfence's harness programs, one module each, and what they share. Not teaching examples
//! (those are in `examples/`): these measure the fence (`bench`, `bench_sqs`, `bench_redis`,
//! `soak`) and break it on purpose (`chaos`). Each program is a `[[bin]]` of this package:
//!
//! ```text
//! cargo run --release -p brokerfence-bench --bin bench -- --quick
//! cargo run --release -p brokerfence-bench --features sqs,redis --bin chaos -- --source redis
//! ```
//!
//! [`args`] is the one argument parser their shared flags come from; [`counters`] the one set of
//! counters (statements per job, rates, percentiles, medians of paired rounds, process and
//! PostgreSQL readings). The chaos test (`tests/processes/fault_runs.rs`) runs [`chaos`] from
//! this library.

pub mod args;
pub mod counters;

pub mod bench;
pub mod bench_redis;
#[cfg(feature = "sqs")]
pub mod bench_sqs;
pub mod chaos;
pub mod failover;
pub mod soak;
