//! Issue #30: what an independent review, a newcomer and chaos runs found — ten defects and six
//! frictions. One test binary; every test is named with `hardening` and says which item it covers
//! (`cargo test --workspace --all-features hardening`). Real PostgreSQL, SQLite, Redis and SQS
//! (LocalStack), as everywhere in this repository.
//!
//! | module | items |
//! |---|---|
//! | `fence` unit test `hook_runner::edges::hardening_item1_…` | 1 broker extensions merged, not replaced, under a slow broker (the hook runner is internal to the fence) |
//! | [`migrations`] | 2 online migrations · 7 a bad key row does not poison a claim batch |
//! | [`retrofits`] | 3 nothing popped is lost · 9 (Redis) dead letters once, `dead requeue` on broker jobs · 11 retrofits check the schema · 12 a panicking handler is a failed attempt |
//! | [`runtime`] | 4 `attempt_timeout` starts with the handler |
//! | [`own_tx`] | 5 a handler's own commit is one ack · 6 the fenced-rollback guard under a savepoint |
//! | [`prune_lock`] | 8 pruning under steady business transactions |
//! | [`sqs`] | 9 (SQS) a dead letter sent once, `dead_letters` counts what was sent · 10 FIFO order under a paused holder |
//! | [`ergonomics`] | 13 `anyhow` · 14 library errors name the API · 15 tests build their programs · 16 small errors |

// A module that needs more features than its line here says gates itself with `#![cfg(…)]`.
mod ergonomics;
mod migrations;
mod own_tx;
mod prune_lock;
#[cfg(all(feature = "redis", feature = "sqs"))]
mod retrofits;
mod runtime;
#[cfg(feature = "sqs")]
mod sqs;
