//! The Redis sources and retrofit against the real Redis and PostgreSQL, private `redis-server`s
//! this binary starts, and Redis Cluster and Sentinel topologies.
//!
//! | module | what |
//! |---|---|
//! | [`e2e`] | the Streams source, the reliable list and the list retrofit end to end |
//! | [`lease`] | the lease key's compare-and-set scripts |
//! | [`otel`] | one OpenTelemetry trace from a producer through a fenced zombie to the receiver; a malformed context |
//! | [`restart`] | Redis restarted mid-run without persistence |
//! | [`stalled_worker`] | a stalled worker process on Redis Streams, in both orderings at the receiver |
//! | [`edge_cases`] | nothing popped is lost, the database decides dead letters, bounded Redis calls, no stale `XCLAIM` |
//! | [`cluster`] | Redis Cluster and Sentinel: start-up, every source, failovers |

mod cluster;
mod e2e;
mod edge_cases;
mod lease;
#[cfg(feature = "otel")]
mod otel;
mod restart;
mod stalled_worker;
