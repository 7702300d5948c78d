//! Issue #31: Redis as it runs in production — a Redis Cluster, a master under Sentinel, and
//! failovers that lose writes. One test binary; every test is named with `cluster`
//! (`cargo test --workspace --all-features cluster`). Each test starts its own topology from
//! real `redis-server` processes on free ports (`brokerfence_testkit::redis_topology`) and tears
//! it down afterwards; the fence is the shared PostgreSQL, as everywhere in this repository.
//!
//! | module | what |
//! |---|---|
//! | [`start`] | URL forms, a cluster or sentinels that are down, cross-slot configurations refused at start |
//! | [`sources`] | each Redis source and the retrofits end to end on a 3-primary cluster; a slot migrated mid-run |
//! | [`reaper`] | a defect found on the way: two list reapers put one orphan back twice |
//! | [`failover`] | a Sentinel failover mid-run; a replica promoted after a partition while workers kept writing to the old primary |
#![cfg(all(feature = "redis", feature = "postgres"))]

mod failover;
mod reaper;
mod sources;
mod start;
