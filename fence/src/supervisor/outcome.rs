//! How an attempt ends ([`Outcome`], [`LossReason`]) and the broker-side [`LeaseHook`].

use std::time::Duration;

use async_trait::async_trait;

use crate::error::FenceError;
use crate::lease::Lease;

/// Why a handler was stopped before it finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// The database says another owner holds a newer epoch (or the job is no longer running).
    Superseded,
    /// No heartbeat could confirm the lease before the worker's monotonic deadline: it may have
    /// expired, so the worker stops before anyone else could take over.
    Unconfirmed,
    /// The supervisor is shutting down and the grace period ran out.
    Shutdown,
}

/// How one attempt ended. Only `Completed` may be acknowledged to a broker.
#[non_exhaustive]
#[derive(Debug)]
pub enum Outcome {
    /// The result is committed under this epoch.
    Completed,
    /// The attempt failed and was recorded; the job may run again after `retry_in`.
    Failed {
        /// The backoff.
        retry_in: Duration,
        /// The handler's message.
        error: String,
    },
    /// The attempt failed for good; the job is dead.
    Dead {
        /// The handler's message.
        error: String,
    },
    /// The lease was lost while the handler ran; it was cancelled and nothing was committed.
    LeaseLost {
        /// Why.
        reason: LossReason,
    },
    /// The handler finished but its commit was refused: another owner superseded it.
    Fenced(FenceError),
    /// The attempt was given back without spending an attempt (shutdown).
    Released,
    /// The commit could not be made (database error): its fate is unknown to this worker, so the
    /// delivery must not be acknowledged; a redelivery finds the job completed or claimable.
    StoreError(FenceError),
}

impl Outcome {
    /// True for [`Outcome::Completed`].
    pub fn is_completed(&self) -> bool {
        matches!(self, Outcome::Completed)
    }
}

/// Broker-side follow-up of the heartbeat, e.g. extending SQS visibility or a Redis lease key.
/// Called only with leases the database has just confirmed (or found lost).
///
/// Hooks never hold up the heartbeat: each runs in a task of its own, one call at a time, and a
/// call is dropped after [`SupervisorConfig::hook_timeout`](crate::SupervisorConfig::hook_timeout) (at most lease/3). While a call is
/// out, later heartbeats' answers replace the waiting ones, so the next call carries only the
/// newest lease per job. Right before a `confirmed` call goes out, leases whose attempt has ended
/// or whose worker-side deadline has passed are left out, and each lease's `ttl` is what is left
/// of it at that moment: extend the broker by `ttl`, never by the full lease length. A lease whose
/// handler has returned keeps being confirmed until its commit has a verdict.
///
/// ```
/// use async_trait::async_trait;
/// use brokerfence::{Lease, LeaseHook};
/// struct Visibility;
/// #[async_trait]
/// impl LeaseHook for Visibility {
///     async fn confirmed(&self, leases: &[Lease]) {
///         for l in leases {
///             // e.g. ChangeMessageVisibility(handle of l, l.ttl), with the client's own timeout
///             println!("extend {} epoch {} by {:?}", l.key, l.epoch, l.ttl);
///         }
///     }
/// }
/// ```
#[async_trait]
pub trait LeaseHook: Send + Sync + 'static {
    /// The database confirmed and extended these leases (`ttl`: the time left now).
    async fn confirmed(&self, leases: &[Lease]);
    /// The database found these leases lost.
    async fn lost(&self, _leases: &[Lease]) {}
}
