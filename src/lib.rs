//! # brokerfence
//!
//! Makes message consumers safe against zombie workers: every claim of a job increments a
//! monotonic epoch (a fencing token) in the database, and every later write on behalf of that
//! claim is a compare-and-set on (job, owner, epoch). A worker that stalls past its lease and wakes
//! up after another worker took the job over finds its heartbeats, checkpoints and commit refused:
//! its late work counts for nothing.
//!
//! This crate re-exports the members: [`fence`] (the epoch authority) and [`adapters`] (sources
//! and the consumer runtime).
//!
//! ```no_run
//! # async fn demo() -> brokerfence::fence::Result<()> {
//! use brokerfence::fence::{FenceStore, SqliteFence};
//! let store = SqliteFence::open("sqlite:brokerfence.db").await?;
//! store.migrate().await?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]

pub use adapters;
pub use fence;
