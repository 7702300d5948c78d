//! The supervisor: the lease, the heartbeat and what happens to a worker that stalls past its
//! lease. The stalled worker is a real second OS process (this binary re-executed as
//! `examples/zombie_worker.rs`, see `zombie_support`), frozen with SIGSTOP.
//!
//! | module | what |
//! |---|---|
//! | [`edge_cases`] | the heartbeat never waits on a broker hook; a lease is renewed until its commit is confirmed |
//! | [`proof`] | the two-process zombie proof, PostgreSQL and SQLite |
//! | [`guard_switches`] | each safety guard switched off shows the violation it prevents |
//! | [`stalled_own_tx`] | a handler's own transaction in a stalled process |

mod edge_cases;
mod guard_switches;
mod proof;
mod stalled_own_tx;
#[cfg(feature = "http")]
#[path = "../zombie_support/mod.rs"]
mod zombie_support;
