//! The broker handles of running attempts, by lease: the supervisor's heartbeats extend the
//! right deliveries at the broker ([`SourceHook`]), and an attempt forgets its own when it ends
//! ([`Untrack`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use fence::{JobKey, Lease, LeaseHook, QueueName};

use crate::source::Source;

/// A lease's identity: the names are shared with the lease (clones are reference counts).
type LeaseId = (QueueName, JobKey, i64);

fn lease_id(l: &Lease) -> LeaseId {
    (l.queue.clone(), l.key.clone(), l.epoch)
}

/// Deliveries of running attempts, by lease, so heartbeats can extend the right broker handle.
pub(super) struct Tracked<D>(pub(super) Mutex<HashMap<LeaseId, D>>);

impl<D: Clone> Tracked<D> {
    pub(super) fn insert(&self, l: &Lease, d: D) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(lease_id(l), d);
        }
    }
    pub(super) fn remove(&self, l: &Lease) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&lease_id(l));
        }
    }
    pub(super) fn pairs(&self, leases: &[Lease]) -> Vec<(Lease, D)> {
        let Ok(m) = self.0.lock() else { return Vec::new() };
        leases.iter().filter_map(|l| m.get(&lease_id(l)).map(|d| (l.clone(), d.clone()))).collect()
    }
}

pub(super) struct SourceHook<S: Source> {
    pub(super) source: Arc<S>,
    pub(super) tracked: Arc<Tracked<S::Delivery>>,
}

#[async_trait]
impl<S: Source> LeaseHook for SourceHook<S> {
    async fn confirmed(&self, leases: &[Lease]) {
        let pairs = self.tracked.pairs(leases);
        if !pairs.is_empty()
            && let Err(e) = self.source.extend(&pairs).await
        {
            tracing::warn!(error = %e, n = pairs.len(), "could not extend broker visibility (the database lease stands)");
        }
    }

    async fn lost(&self, leases: &[Lease]) {
        let pairs = self.tracked.pairs(leases);
        if !pairs.is_empty()
            && let Err(e) = self.source.lost(&pairs).await
        {
            tracing::warn!(error = %e, "source could not drop state of lost leases");
        }
    }
}

/// Forgets a delivery's broker handle when its attempt ends, however it ends.
pub(super) struct Untrack<'a, D: Clone> {
    pub(super) tracked: &'a Tracked<D>,
    pub(super) lease: &'a Lease,
}

impl<D: Clone> Drop for Untrack<'_, D> {
    fn drop(&mut self) {
        self.tracked.remove(self.lease);
    }
}
