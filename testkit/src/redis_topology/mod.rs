//! Production Redis topologies from real `redis-server` processes on free ports, for the tests of
//! the Redis adapter against what runs in production: single servers ([`RedisNode`]), a Redis
//! Cluster with slot migrations a test drives mid-run and killed nodes ([`RedisCluster`]), a
//! master with a replica under three sentinels ([`RedisSentinels`]), and a primary whose replica
//! replicates through a [`Relay`] that a test can cut, with a second relay as the clients' VIP
//! ([`RedisPair`]). No Docker, no mocks.
//!
//! Everything lives in a fresh `/tmp/brokerfence-redis-<pid>-<random>/` (one dir per node:
//! its log `redis.log`, a cluster node's `nodes.conf`, a sentinel's config) and is torn down on
//! drop: the servers are SIGKILLed and the dir removed. Servers keep nothing else on disk
//! (`--save "" --appendonly no`), listen on 127.0.0.1 only and run as children of the test
//! process. A test process killed before its drops ran leaves dirs and servers behind; the next
//! test process that starts a topology kills those servers (found by their working dir) and
//! removes the dirs. `redis-server` and `redis-cli` come from the Debian packages `redis-server`
//! and `redis-tools` (`bash localstack/up` installs them).
//!
//! ```no_run
//! # async fn demo() {
//! use brokerfence_testkit::redis_topology::{RedisCluster, RedisPair};
//! let cluster = RedisCluster::start(3, 1).await;
//! let slot = cluster.slot_of("{job}:1").await;
//! let migration = cluster.begin_migration(slot, 1).await; // the source answers ASK from here
//! cluster.move_keys(&migration).await;
//! cluster.finish_migration(&migration).await; // every node agrees: node1 serves the slot
//!
//! let pair = RedisPair::start().await;
//! pair.wait_caught_up().await;
//! pair.cut_link(); // writes through pair.client_url() stay on the primary
//! pair.kill_primary().await;
//! pair.promote_replica().await;
//! pair.repoint_clients_to_replica();
//! # }
//! ```

mod cluster;
mod node;
mod pair;
mod sentinel;
mod sys;
#[cfg(test)]
mod tests;

pub use crate::pg_topology::Relay;
pub use cluster::{Migration, RedisCluster, SlotRange};
pub use node::RedisNode;
pub use pair::RedisPair;
pub use sentinel::RedisSentinels;
