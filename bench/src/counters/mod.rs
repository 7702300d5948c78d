//! The one set of counters of the harness programs: the counting store (statements per job, by
//! method, with their time), figures (percentiles, medians of paired rounds, rates, memory) and
//! readings of the machine (PostgreSQL and LocalStack CPU, WAL bytes).

mod cpu;
mod figures;
mod store;

pub use cpu::*;
pub use figures::*;
pub use store::*;
