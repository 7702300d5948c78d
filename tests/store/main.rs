//! The stores: every statement of `FenceStore` on PostgreSQL and SQLite, the schema and its online
//! migrations, timeouts and reserved capacity, retention and pruning. Real PostgreSQL (a fresh
//! schema per test) and real SQLite files.
//!
//! | module | what |
//! |---|---|
//! | [`suite`] | the shared store suite: each test written once, generic over the backend |
//! | [`edge_cases`] | the schema check at start, the heartbeat's reserved capacity, statement and lock timeouts, SQLite's durable default |
//! | [`migrations`] | online migrations under load; a bad key row does not poison a claim batch |
//! | [`retention`] | pruning finished jobs and ledger rows; epochs that never repeat after a prune |
//! | [`prune_lock`] | pruning under steady business transactions |

mod edge_cases;
mod migrations;
mod prune_lock;
mod retention;
mod suite;
