//! # brokerfence-testkit — support for brokerfence's own tests and examples
//!
//! Not published, and not part of `brokerfence`'s API. Every helper the integration tests share
//! lives here, once (`tests/` keeps only what must be compiled into a test binary: the zombie
//! worker's entry point, `tests/zombie_support/mod.rs`):
//! - [`services`]: where PostgreSQL, Redis and SQS are (the environment, else `localstack/.env`);
//! - [`localstack`]: the testcontainers fallback that starts LocalStack when no SQS endpoint is
//!   configured and a Docker engine answers (feature `docker`);
//! - [`store`]: fresh PostgreSQL schemas and SQLite files, names, leases, the shared store suite's
//!   backend trait;
//! - [`wait`]: the one polling loop (`wait_for`, `eventually`);
//! - [`pg_topology`]: private PostgreSQL servers on free ports, a primary with a streaming standby
//!   (async or sync), TCP relays (a VIP, the replication link) and PgBouncer, for failover tests;
//! - [`redis_topology`] (feature `redis`): private `redis-server`s on free ports, a Redis Cluster
//!   with slot migrations, a master and replica under sentinels, a primary whose replication link
//!   a relay can cut;
//! - [`process`]: child processes (the test binary re-executed as a worker, signals);
//!   [`programs`]: the examples and the CLI binary a test runs, built by cargo for the test;
//!   [`tree`]: the repository's files, for the layout tests;
//! - [`receiver`] (feature `receiver`): an HTTP receiver that judges epochs with the ledger;
//! - [`otel`] (feature `otel`): spans in the OpenTelemetry SDK's in-memory exporter, a stalled
//!   store, the checks and the picture of a fenced zombie's trace;
//! - [`sqs`] (feature `sqs`), [`redis`] (feature `redis`), [`zombie`] (feature `http`): per
//!   backend. The root package's features of the same names turn these on for its tests.
#![warn(missing_docs)]
// The backend modules came from tests/ as they were: their fields and accessors are named for what
// they hold, and only the items whose use is not obvious carry a doc line.

pub mod localstack;
#[cfg(feature = "otel")]
pub mod otel;
pub mod pg_topology;
pub mod process;
pub mod programs;
#[cfg(feature = "receiver")]
#[allow(missing_docs)]
pub mod receiver;
#[cfg(feature = "redis")]
#[allow(missing_docs)]
pub mod redis;
#[cfg(feature = "redis")]
pub mod redis_topology;
pub mod services;
#[cfg(feature = "sqs")]
#[allow(missing_docs)]
pub mod sqs;
pub mod store;
pub mod tree;
pub mod wait;
#[cfg(feature = "http")]
#[allow(missing_docs)]
pub mod zombie;
