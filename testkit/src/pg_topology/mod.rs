//! Production PostgreSQL topologies from real parts on free ports, for failover tests: private
//! servers ([`PgServer`]), a primary with a streaming standby, asynchronous or synchronous
//! ([`PgPair`], [`Replication`]), TCP relays that stand in for a VIP or for the network between
//! standby and primary ([`Relay`]: re-point, drop connections, partition, refuse), and a
//! PgBouncer ([`PgBouncer`]). No Docker, no mocks.
//!
//! Everything lives in a fresh `/tmp/brokerfence-pg-<pid>-<random>/` and is torn down on drop
//! (servers stopped with `pg_ctl -m immediate`, then SIGKILLed if still there; PgBouncer killed;
//! the dir removed); a test process killed before its drops ran leaves dirs (and processes) that
//! the next test process sweeps. When the tests run as root, PostgreSQL's programs and PgBouncer
//! run as the `postgres` OS user (they refuse root). Primaries start from a template data dir
//! `initdb` makes once per test process, so a server is up in well under a second. PgBouncer
//! comes from `bash localstack/up`.
//!
//! ```no_run
//! # async fn demo() {
//! use brokerfence_testkit::pg_topology::{PgPair, Replication};
//! let pair = PgPair::start(Replication::Async).await;
//! pair.primary.psql("postgres", "CREATE TABLE t (id int); INSERT INTO t VALUES (1)").await;
//! pair.wait_caught_up().await;
//! pair.link.partition(); // replication is cut
//! pair.primary.kill().await;
//! pair.standby.promote().await;
//! # }
//! ```

mod bouncer;
mod pair;
mod relay;
mod server;
pub(crate) mod sys;
#[cfg(test)]
mod tests;

pub use bouncer::{PgBouncer, pgbouncer_path};
pub use pair::{PgPair, Replication};
pub use relay::Relay;
pub use server::PgServer;
