//! The heartbeat: one renewal statement per tick for every in-flight lease, and the tick loop.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::outcome::LossReason;
use super::registry::{Inner, SlotState};
use crate::lease::Lease;
use crate::metrics::{Counter, Distribution};

impl Inner {
    /// One heartbeat: renews every in-flight lease in one statement. Returns false when the
    /// database could not confirm (so the next tick comes sooner).
    async fn tick(self: &Arc<Self>) -> bool {
        let snapshot: Vec<(u64, Lease, Arc<SlotState>)> = match self.inflight.lock() {
            // A result committed in the handler's own transaction needs no lease any more.
            Ok(map) => map
                .iter()
                .filter(|(_, s)| !s.state.committed.load(Ordering::Acquire))
                .map(|(id, s)| (*id, s.lease.clone(), Arc::clone(&s.state)))
                .collect(),
            Err(_) => return false,
        };
        if snapshot.is_empty() {
            return true;
        }
        // Attempts awaiting their verdict are renewed by a statement of their own, in a task of
        // its own. Their rows may be locked by this worker's own commit statement (which may
        // itself wait on a lock held elsewhere): a renewal that waits on those locks must never
        // hold up, or delay the answer of, the renewal of the attempts still running, or one
        // stuck commit would cost every other lease of the worker.
        let (settling, running): (Vec<_>, Vec<_>) =
            snapshot.into_iter().partition(|(_, _, s)| s.settling.load(Ordering::Acquire));
        if !settling.is_empty() && !self.renewing_settling.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            tokio::spawn(async move {
                let sent = Instant::now();
                let leases: Vec<Lease> = settling.iter().map(|(_, l, _)| l.clone()).collect();
                match me.renew(&leases, true).await {
                    Some(Ok(hb)) => me.apply_renewals(&settling, sent, hb.renewed, Vec::new()),
                    Some(Err(e)) => {
                        // Nothing to cancel: the verdict decides; the next tick tries again.
                        tracing::debug!(error = %e, leases = leases.len(), "renewal of attempts awaiting their verdict failed");
                    }
                    None => {}
                }
                me.renewing_settling.store(false, Ordering::Release);
            });
        }
        if running.is_empty() {
            return true;
        }
        let leases: Vec<Lease> = running.iter().map(|(_, l, _)| l.clone()).collect();
        let beats = beat_spans(&running);
        let sent = Instant::now();
        match self.renew(&leases, false).await {
            Some(Ok(hb)) => {
                if !beats.is_empty() {
                    let renewed: std::collections::HashSet<(&str, &str, i64)> =
                        hb.renewed.iter().map(|l| (l.queue.as_str(), l.key.as_str(), l.epoch)).collect();
                    for (beat, l) in beats.iter().zip(&leases) {
                        let kept = renewed.contains(&(l.queue.as_str(), l.key.as_str(), l.epoch));
                        beat.record("answer", if kept { "renewed" } else { "lost" });
                    }
                }
                self.apply_renewals(&running, sent, hb.renewed, hb.lost);
                true
            }
            Some(Err(e)) => {
                for beat in &beats {
                    beat.record("answer", "unconfirmed");
                }
                tracing::warn!(error = %e, leases = leases.len(), "heartbeat failed; leases unconfirmed");
                false
            }
            None => true,
        }
    }

    /// Applies one renewal statement's answer for the attempts of `snapshot`: moves the
    /// deadlines of the renewed, cancels the lost that still run, and posts both to the hooks.
    fn apply_renewals(
        self: &Arc<Self>,
        snapshot: &[(u64, Lease, Arc<SlotState>)],
        sent: Instant,
        renewed: Vec<Lease>,
        lost: Vec<Lease>,
    ) {
        // (queue, key, epoch) → the slot's id and state, for the answers of this heartbeat.
        let by_id: HashMap<(&str, &str, i64), (u64, &Arc<SlotState>)> =
            snapshot.iter().map(|(id, l, s)| ((l.queue.as_str(), l.key.as_str(), l.epoch), (*id, s))).collect();
        let margin = self.config.safety_margin();
        for l in &renewed {
            if let Some((_, s)) = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch)) {
                let deadline = sent + l.ttl.saturating_sub(margin);
                s.deadline.fetch_max(self.nanos(deadline), Ordering::AcqRel);
            }
        }
        self.metrics.add(Counter::Renewals, renewed.len() as u64);
        let mut gone = Vec::with_capacity(lost.len());
        let mut own = Vec::new();
        for l in lost {
            if let Some((_, s)) = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch)) {
                if s.settling.load(Ordering::Acquire) {
                    // Usually its own commit landed first; otherwise the commit is fenced. Either
                    // way the verdict decides, and the source hears of it through the outcome.
                    tracing::debug!(queue = %l.queue, key = %l.key, epoch = l.epoch, "lease ended while its verdict was pending");
                    continue;
                }
                if s.own_commit.load(Ordering::Acquire) {
                    // The handler sent its own completion: the row is gone from `running`
                    // because its transaction committed, or because a newer epoch took over
                    // after it rolled back. The row tells which, before anything is cancelled.
                    own.push((l.clone(), Arc::clone(s)));
                    continue;
                }
                tracing::warn!(queue = %l.queue, key = %l.key, epoch = l.epoch, "heartbeat found lease lost; cancelling");
                if self.config.cancel_on_loss {
                    s.lose(LossReason::Superseded);
                }
            }
            gone.push(l);
        }
        if let Ok(mut map) = self.inflight.lock() {
            for l in &renewed {
                let found = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch));
                if let Some(slot) = found.and_then(|(id, _)| map.get_mut(id)) {
                    slot.lease.lease_until = l.lease_until;
                    slot.lease.ttl = l.ttl;
                }
            }
        }
        // The broker hooks run in tasks of their own: posting never waits on a broker.
        if let Ok(hooks) = self.hooks.read() {
            for hook in hooks.iter() {
                hook.submit(sent, &renewed, &gone);
            }
        }
        if !own.is_empty() {
            let me = Arc::clone(self);
            tokio::spawn(async move { me.settle_own_commits(sent, own).await });
        }
    }

    /// Attempts whose handler committed in its own transaction and whose lease a heartbeat found
    /// gone: completed under their lease means the commit landed — the handler runs on, no
    /// longer fenced, and its return is acknowledged once (issue #30, item 5); otherwise a newer
    /// epoch holds the job, and the attempt is cancelled like any superseded one. No answer
    /// within the heartbeat interval decides nothing: the next tick asks again.
    async fn settle_own_commits(self: Arc<Self>, sent: Instant, own: Vec<(Lease, Arc<SlotState>)>) {
        let leases: Vec<Lease> = own.iter().map(|(l, _)| l.clone()).collect();
        let interval = self.config.lease.heartbeat_interval();
        let answer = match tokio::time::timeout(interval, self.store.completed_under(&leases)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, leases = leases.len(), "could not read the rows of handlers that committed on their own; the next heartbeat asks again");
                return;
            }
            Err(_) => {
                tracing::warn!(leases = leases.len(), timeout = ?interval, "no answer reading the rows of handlers that committed on their own; the next heartbeat asks again");
                return;
            }
        };
        let mut gone = Vec::new();
        for ((l, s), committed) in own.into_iter().zip(answer.into_iter().chain(std::iter::repeat(false))) {
            if committed {
                s.committed.store(true, Ordering::Release);
                tracing::debug!(queue = %l.queue, key = %l.key, epoch = l.epoch, "result committed in the handler's transaction; the handler runs on unfenced");
                continue;
            }
            tracing::warn!(queue = %l.queue, key = %l.key, epoch = l.epoch, "heartbeat found lease lost; cancelling");
            if self.config.cancel_on_loss {
                s.lose(LossReason::Superseded);
            }
            gone.push(l);
        }
        if gone.is_empty() {
            return;
        }
        if let Ok(hooks) = self.hooks.read() {
            for hook in hooks.iter() {
                hook.submit(sent, &[], &gone);
            }
        }
    }

    /// One renewal statement for `leases` (none when there are none), bounded by the heartbeat
    /// interval; `unless_locked`: skip rows another transaction holds locked.
    async fn renew(
        &self,
        leases: &[Lease],
        unless_locked: bool,
    ) -> Option<std::result::Result<crate::lease::Heartbeat, String>> {
        if leases.is_empty() {
            return None;
        }
        self.metrics.incr(Counter::Heartbeats);
        let interval = self.config.lease.heartbeat_interval();
        let statement = async {
            if unless_locked {
                self.store.heartbeat_unless_locked(leases, self.config.lease).await
            } else {
                self.store.heartbeat(leases, self.config.lease).await
            }
        };
        let sent = Instant::now();
        let answer = tokio::time::timeout(interval, statement).await;
        self.metrics.observe_duration(Distribution::HeartbeatDuration, sent.elapsed());
        Some(match answer {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {interval:?}")),
        })
    }
}

/// At debug level only: a `heartbeat` span for each running attempt, a child of its attempt's
/// span, open while the renewal statement (one for all of them) is out; its `answer` says what
/// the database answered for that lease. None when debug spans are off.
fn beat_spans(running: &[(u64, Lease, Arc<SlotState>)]) -> Vec<tracing::Span> {
    if !tracing::span_enabled!(tracing::Level::DEBUG) {
        return Vec::new();
    }
    let n = running.len();
    running
        .iter()
        .map(|(_, _, s)| {
            let attempt = s.attempt_span();
            if attempt.is_none() {
                // The attempt ended meanwhile: no span without its parent.
                return tracing::Span::none();
            }
            tracing::debug_span!(parent: &attempt, "heartbeat", leases = n, answer = tracing::field::Empty)
        })
        .collect()
}

pub(super) async fn heartbeat_loop(inner: Weak<Inner>, stop: CancellationToken, interval: Duration) {
    let retry = interval.min(Duration::from_millis(250));
    let mut wait = interval;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        wait = if Inner::tick(&inner).await { interval } else { retry };
        inner.expire_overdue();
    }
}
