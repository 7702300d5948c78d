//! # fence — the epoch authority of brokerfence
//!
//! Every claim of a job increments a monotonic **epoch** (a fencing token) in the database, judged
//! on the database clock. Heartbeats, checkpoints, completion and failure are compare-and-set on
//! (job, owner, epoch): zero rows matched means the caller was superseded, and its write is
//! refused with [`FenceError::Fenced`].
//!
//! ```no_run
//! # async fn demo() -> brokerfence::Result<()> {
//! use brokerfence::{Claim, FenceStore, JobKey, LeaseDuration, Owner, PgFence, QueueName};
//! let store = PgFence::connect("postgres://postgres@127.0.0.1/test").await?;
//! store.migrate().await?;
//! let (q, me) = (QueueName::new("orders")?, Owner::unique("worker"));
//! match store.claim(&q, &JobKey::new("order-1")?, &me, LeaseDuration::from_secs(30)?).await? {
//!     Claim::Claimed(lease) => store.complete(&lease, b"ok").await?,
//!     other => println!("not ours: {other:?}"),
//! }
//! # Ok(()) }
//! ```
//!
//! This is a member of `brokerfence`: depend on `brokerfence`, which re-exports the public items
//! of this crate (`brokerfence::PgFence`, `brokerfence::ledger::Ledger`).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
compile_error!("brokerfence: enable a backend feature, `postgres` or `sqlite` (both are on by default)");

pub mod admin;
pub mod epoch;
mod error;
mod group;
mod guards;
mod job;
mod key;
mod lease;
pub mod ledger;
mod metrics;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(feature = "postgres")]
pub mod outbox;
mod own_tx;
#[cfg(feature = "postgres")]
mod postgres;
pub mod retention;
mod schema;
#[cfg(feature = "sqlite")]
mod sqlite;
mod store;
mod supervisor;
mod wake;
pub mod wire;

// What `brokerfence` re-exports at its root. Items of the public modules (`admin`, `epoch`,
// `ledger`, `outbox`, `retention`, `wire`) stay in their module.
pub use error::{FenceError, Result};
#[cfg(feature = "serde")]
pub use job::Json;
pub use job::{BoxError, IntoJobResult, JobError, JobResultExt};
pub use key::{JobKey, MAX_KEY_BYTES, MAX_NAME_BYTES, Owner, QueueName};
pub use lease::{
    Claim, ClaimedJob, DbTime, FailOutcome, Heartbeat, JobRecord, JobState, Lease, LeaseDuration, MIN_LEASE,
    RetryPolicy,
};
pub use metrics::{Counter, Distribution, Metrics, MetricsSnapshot};
pub use own_tx::FencedConnection;
#[cfg(feature = "postgres")]
pub use postgres::{PgFence, PgTarget, PgTimeouts, Pooler};
pub use schema::{DEFAULT_SCHEMA, SchemaName};
#[cfg(feature = "sqlite")]
pub use sqlite::{ReclaimReport, SqliteDurability, SqliteFence};
pub use store::{Backend, FenceStore};
pub use supervisor::{JobContext, LeaseHook, LossReason, Outcome, Supervisor, SupervisorConfig};
pub use wake::{Wake, Wakeups};

// The modules' items under short paths, for this crate's own code.
pub(crate) use retention::{PruneReport, Retention};

// Plumbing shared with `adapters` and the repository's tests: not part of `brokerfence`'s API.
#[doc(hidden)]
pub use group::Grouper;
#[doc(hidden)]
pub use guards::Guards;
#[doc(hidden)]
pub use supervisor::DEFAULT_COMMIT_WINDOW;
