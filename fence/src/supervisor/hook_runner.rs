//! Runs the broker hooks ([`LeaseHook`]) beside the heartbeat, never inside it.
//!
//! Each hook gets a task of its own. The heartbeat only posts what the database answered (the
//! leases it renewed, the leases it found lost) into the hook's mailbox and goes on: its cadence
//! does not depend on any broker's latency. The task calls the hook with what is pending, one call
//! at a time, each cut after the hook timeout (at most lease/3). While a call is out, newer
//! answers are merged into what waits: per job (queue, key) only the newest confirmed lease waits, so the
//! pending work is bounded by the leases in flight, never by how long a broker hangs.
//!
//! Right before a `confirmed` call goes out, every lease is checked against the supervisor's
//! registry: a lease whose attempt has ended, was cancelled, or whose worker-side deadline has
//! passed is left out, so a stale lease never extends a broker's visibility. Lost leases are
//! always delivered (sources drop their state for them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::key::{JobKey, QueueName};
use crate::lease::Lease;
use crate::metrics::{Counter, Metrics};
use crate::supervisor::LeaseHook;

/// Says, for each lease, whether it may still be extended now (`Some`): its attempt is in the
/// registry, not cancelled, and before its worker-side deadline. With `true`, the `Some` holds
/// the attempt's span (the parent of the call's debug span), else `Span::none()`.
pub(crate) type LiveCheck = Arc<dyn Fn(&[Lease], bool) -> Vec<Option<tracing::Span>> + Send + Sync>;

/// The heartbeat's side of one hook: a mailbox the hook's own task empties.
pub(crate) struct HookRunner {
    mailbox: Arc<Mailbox>,
}

struct Mailbox {
    pending: Mutex<Pending>,
    wake: Notify,
}

/// A confirmed lease waiting for its hook call, and when the heartbeat that renewed it was sent
/// (its `ttl` counts from then).
#[derive(Debug, Clone)]
struct Renewed {
    lease: Lease,
    sent: Instant,
}

#[derive(Default)]
struct Pending {
    /// The newest renewal per job.
    confirmed: HashMap<(QueueName, JobKey), Renewed>,
    /// Lost leases, each once.
    lost: HashMap<(QueueName, JobKey, i64), Lease>,
}

/// What the task's next round calls the hook with.
struct Round {
    lost: Vec<Lease>,
    confirmed: Vec<Renewed>,
}

impl Mailbox {
    fn take(&self) -> Option<Round> {
        let mut pending = self.pending.lock().ok()?;
        if pending.confirmed.is_empty() && pending.lost.is_empty() {
            return None;
        }
        let Pending { confirmed, lost } = std::mem::take(&mut *pending);
        Some(Round { lost: lost.into_values().collect(), confirmed: confirmed.into_values().collect() })
    }
}

/// Which of the two hook calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Confirmed,
    Lost,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Confirmed => "confirmed",
            Call::Lost => "lost",
        }
    }
}

/// Everything a hook's task needs.
struct Task {
    hook: Arc<dyn LeaseHook>,
    index: usize,
    timeout: Duration,
    live: LiveCheck,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
    mailbox: Arc<Mailbox>,
}

impl HookRunner {
    /// Starts the task of hook number `index` on `runtime`. Every call is cut after `timeout`;
    /// the task ends when `stop` fires.
    pub(crate) fn spawn(
        runtime: &tokio::runtime::Handle,
        hook: Arc<dyn LeaseHook>,
        index: usize,
        timeout: Duration,
        live: LiveCheck,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Self {
        let mailbox = Arc::new(Mailbox { pending: Mutex::new(Pending::default()), wake: Notify::new() });
        let task = Task { hook, index, timeout, live, metrics, stop, mailbox: Arc::clone(&mailbox) };
        runtime.spawn(task.run());
        Self { mailbox }
    }

    /// Posts one renewal statement's answer: `confirmed` is every lease it renewed, sent at
    /// `sent`. A heartbeat posts once per statement — the running attempts' and the settling
    /// attempts' renewals arrive as two posts of one tick — so each post is merged into what
    /// waits, never put in its place: per job the newest renewal (highest epoch, then latest
    /// `lease_until`) waits, so what waits is never more than one lease per job in flight (plus
    /// the jobs that ended since the last call went out, which the live check leaves out). Lost
    /// leases wait until delivered. Never blocks on the hook.
    pub(crate) fn submit(&self, sent: Instant, confirmed: &[Lease], lost: &[Lease]) {
        if confirmed.is_empty() && lost.is_empty() {
            return;
        }
        let Ok(mut pending) = self.mailbox.pending.lock() else { return };
        for l in confirmed {
            let id = (l.queue.clone(), l.key.clone());
            let newer = pending
                .confirmed
                .get(&id)
                .is_none_or(|r| (l.epoch, l.lease_until) >= (r.lease.epoch, r.lease.lease_until));
            if newer {
                pending.confirmed.insert(id, Renewed { lease: l.clone(), sent });
            }
        }
        for l in lost {
            let id = (l.queue.clone(), l.key.clone());
            if pending.confirmed.get(&id).is_some_and(|r| r.lease.epoch <= l.epoch) {
                pending.confirmed.remove(&id);
            }
            pending.lost.insert((l.queue.clone(), l.key.clone(), l.epoch), l.clone());
        }
        drop(pending);
        self.mailbox.wake.notify_one();
    }

    /// Requests waiting for the hook: (confirmed, lost).
    #[cfg(test)]
    pub(crate) fn pending(&self) -> (usize, usize) {
        self.mailbox.pending.lock().map(|p| (p.confirmed.len(), p.lost.len())).unwrap_or_default()
    }
}

impl Task {
    async fn run(self) {
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = self.mailbox.wake.notified() => {}
            }
            while let Some(round) = self.mailbox.take() {
                // Lost first: for one job, a lost epoch always precedes a newer one's renewal.
                if !round.lost.is_empty() && !self.call(Call::Lost, round.lost, &[]).await {
                    return;
                }
                let (fresh, attempts) = self.fresh(round.confirmed);
                if !fresh.is_empty() && !self.call(Call::Confirmed, fresh, &attempts).await {
                    return;
                }
            }
        }
    }

    /// The renewals still worth a broker call, right before it goes out: their attempt is still
    /// registered, not cancelled, and before its worker-side deadline. Each lease's `ttl` is what
    /// is left of it now, so a late call never extends a broker past the database lease. With
    /// debug spans on, also each fresh lease's attempt span (else none).
    fn fresh(&self, renewed: Vec<Renewed>) -> (Vec<Lease>, Vec<tracing::Span>) {
        let leases: Vec<Lease> = renewed.iter().map(|r| r.lease.clone()).collect();
        let spans = tracing::span_enabled!(tracing::Level::DEBUG);
        let live = (self.live)(&leases, spans);
        let mut fresh = Vec::with_capacity(renewed.len());
        let mut attempts = Vec::new();
        for (r, live) in renewed.into_iter().zip(live.into_iter().chain(std::iter::repeat(None))) {
            let mut lease = r.lease;
            let left = lease.ttl.saturating_sub(r.sent.elapsed());
            let Some(attempt) = live.filter(|_| !left.is_zero()) else {
                self.metrics.incr(Counter::HookSkips);
                tracing::debug!(
                    hook = self.index,
                    queue = %lease.queue,
                    key = %lease.key,
                    epoch = lease.epoch,
                    "lease ended or past its deadline before the hook call; not extended"
                );
                continue;
            };
            lease.ttl = left;
            fresh.push(lease);
            if spans {
                attempts.push(attempt);
            }
        }
        (fresh, attempts)
    }

    /// One hook call, cut after the timeout. False when the supervisor stopped meanwhile. At
    /// debug level each attempt in `attempts` gets a `broker_call` child span for the call.
    async fn call(&self, call: Call, leases: Vec<Lease>, attempts: &[tracing::Span]) -> bool {
        // Info level, like the attempt span: the hook's own logs and the timeout warning carry
        // the job (queue, key, epoch) or, for a batch, the first few leases.
        let span = tracing::info_span!(
            "lease_hook",
            hook = self.index,
            call = call.name(),
            n = leases.len(),
            queue = tracing::field::Empty,
            key = tracing::field::Empty,
            epoch = tracing::field::Empty,
            leases = tracing::field::Empty,
        );
        if let [one] = leases.as_slice() {
            span.record("queue", tracing::field::display(&one.queue));
            span.record("key", tracing::field::display(&one.key));
            span.record("epoch", one.epoch);
        } else {
            span.record("leases", tracing::field::display(summary(&leases)));
        }
        let work = async {
            match call {
                Call::Confirmed => self.hook.confirmed(&leases).await,
                Call::Lost => self.hook.lost(&leases).await,
            }
        };
        let children: Vec<tracing::Span> = attempts
            .iter()
            .filter(|attempt| !attempt.is_none())
            .map(|attempt| {
                tracing::debug_span!(
                    parent: attempt,
                    "broker_call",
                    hook = self.index,
                    call = call.name(),
                    batch = leases.len(),
                    timed_out = tracing::field::Empty,
                )
            })
            .collect();
        let bounded = tokio::time::timeout(self.timeout, work.instrument(span.clone()));
        tokio::select! {
            _ = self.stop.cancelled() => false,
            answer = bounded => {
                if answer.is_err() {
                    self.metrics.incr(Counter::HookTimeouts);
                    for child in &children {
                        child.record("timed_out", true);
                    }
                    span.in_scope(|| {
                        tracing::warn!(
                            timeout = ?self.timeout,
                            "broker hook call timed out and was dropped (the database lease stands)"
                        );
                    });
                }
                true
            }
        }
    }
}

/// "queue/key@epoch" of the first few leases, for logs.
fn summary(leases: &[Lease]) -> String {
    const SHOWN: usize = 8;
    let mut out: Vec<String> =
        leases.iter().take(SHOWN).map(|l| format!("{}/{}@{}", l.queue, l.key, l.epoch)).collect();
    if leases.len() > SHOWN {
        out.push(format!("+{} more", leases.len() - SHOWN));
    }
    out.join(", ")
}

#[cfg(test)]
mod edges {
    use super::*;
    use crate::{DbTime, Owner};
    use async_trait::async_trait;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn lease(key: &str, epoch: i64, until: i64) -> Lease {
        Lease {
            queue: QueueName::new("q").expect("queue"),
            key: JobKey::new(key).expect("key"),
            epoch,
            owner: Owner::new("w").expect("owner"),
            lease_until: DbTime(until),
            ttl: Duration::from_secs(30),
            attempts: 1,
        }
    }

    /// Records every call; its first `confirmed` call waits for the gate (or, `forever`, every
    /// `confirmed` call hangs).
    struct Recorder {
        confirmed: Mutex<Vec<Vec<Lease>>>,
        lost: Mutex<Vec<Vec<Lease>>>,
        calls: AtomicUsize,
        gate: tokio::sync::Semaphore,
        forever: bool,
    }

    impl Recorder {
        fn new(forever: bool) -> Arc<Self> {
            Arc::new(Self {
                confirmed: Mutex::new(Vec::new()),
                lost: Mutex::new(Vec::new()),
                calls: AtomicUsize::new(0),
                gate: tokio::sync::Semaphore::new(0),
                forever,
            })
        }
    }

    #[async_trait]
    impl LeaseHook for Recorder {
        async fn confirmed(&self, leases: &[Lease]) {
            self.confirmed.lock().expect("lock").push(leases.to_vec());
            let first = self.calls.fetch_add(1, Ordering::SeqCst) == 0;
            if self.forever {
                std::future::pending::<()>().await;
            }
            if first && let Ok(permit) = self.gate.acquire().await {
                permit.forget();
            }
        }
        async fn lost(&self, leases: &[Lease]) {
            self.lost.lock().expect("lock").push(leases.to_vec());
        }
    }

    fn runner(
        hook: &Arc<Recorder>,
        timeout: Duration,
        live: LiveCheck,
    ) -> (HookRunner, Arc<Metrics>, CancellationToken) {
        let metrics = Arc::new(Metrics::default());
        let stop = CancellationToken::new();
        let runner = HookRunner::spawn(
            &tokio::runtime::Handle::current(),
            Arc::clone(hook) as Arc<dyn LeaseHook>,
            0,
            timeout,
            live,
            Arc::clone(&metrics),
            stop.clone(),
        );
        (runner, metrics, stop)
    }

    fn all_live() -> LiveCheck {
        Arc::new(|leases: &[Lease], _| vec![Some(tracing::Span::none()); leases.len()])
    }

    async fn wait_for(mut done: impl FnMut() -> bool) {
        let until = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < until, "condition not reached within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn ids(leases: &[Lease]) -> Vec<(String, i64, i64)> {
        let mut ids: Vec<_> = leases.iter().map(|l| (l.key.to_string(), l.epoch, l.lease_until.0)).collect();
        ids.sort();
        ids
    }

    /// Guard of issue #12 §1, first bullet ("the newest request per delivery wins"): while a hook
    /// call hangs, fifty heartbeats' answers pile up as one pending renewal per job (the newest
    /// epoch, then the newest `lease_until`) and each lost lease once; when the hook answers it
    /// gets exactly those, in one more round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_while_a_hook_hangs_only_the_newest_renewal_per_job_waits() {
        let hook = Recorder::new(false);
        let (runner, _metrics, stop) = runner(&hook, Duration::from_secs(30), all_live());
        runner.submit(Instant::now(), &[lease("a", 1, 100)], &[]);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 1).await;
        for i in 1..=50 {
            let b_epoch = if i >= 25 { 2 } else { 1 };
            let lost = if i % 10 == 0 { vec![lease("c", 1, 90)] } else { Vec::new() };
            runner.submit(Instant::now(), &[lease("a", 1, 100 + i), lease("b", b_epoch, 100 + i)], &lost);
            let (confirmed, lost) = runner.pending();
            assert!(confirmed <= 2 && lost <= 1, "pending grew to {confirmed} renewals and {lost} losses");
        }
        hook.gate.add_permits(1);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 2).await;
        let confirmed = hook.confirmed.lock().expect("lock").clone();
        assert_eq!(confirmed.len(), 2, "{confirmed:?}");
        assert_eq!(ids(&confirmed[1]), vec![("a".into(), 1, 150), ("b".into(), 2, 150)]);
        let lost = hook.lost.lock().expect("lock").clone();
        assert_eq!(lost.iter().map(|l| ids(l)).collect::<Vec<_>>(), vec![vec![("c".to_string(), 1, 90)]]);
        assert_eq!(runner.pending(), (0, 0));
        stop.cancel();
    }

    /// Issue #30, item 1 ("broker extensions dropped under a slow broker"): a tick renews the
    /// running attempts and the settling attempts with two statements, and each posts its answer.
    /// Both posts land while a hook call is out (a slow broker): the next call must extend both
    /// sets. Fails without the merge in `submit` (the second post replaced the first: the call
    /// carried only the settling attempt, "running" got no extension that tick).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hardening_item1_two_posts_of_one_tick_both_reach_a_slow_hook() {
        let hook = Recorder::new(false);
        let (runner, _metrics, stop) = runner(&hook, Duration::from_secs(30), all_live());
        runner.submit(Instant::now(), &[lease("first", 1, 100)], &[]);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 1).await;
        // One tick while that call is out: the running attempts' statement, then the settling's.
        runner.submit(Instant::now(), &[lease("running", 1, 110), lease("first", 1, 110)], &[]);
        runner.submit(Instant::now(), &[lease("settling", 3, 110)], &[lease("gone", 1, 90)]);
        // An older answer for a job never replaces a newer one already waiting.
        runner.submit(Instant::now(), &[lease("running", 1, 105)], &[]);
        hook.gate.add_permits(1);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 2).await;
        let confirmed = hook.confirmed.lock().expect("lock").clone();
        assert_eq!(
            ids(&confirmed[1]),
            vec![("first".into(), 1, 110), ("running".into(), 1, 110), ("settling".into(), 3, 110)],
            "the second call must extend every lease renewed while the first was out"
        );
        assert_eq!(runner.pending(), (0, 0));
        stop.cancel();
    }

    /// Guard of issue #12 §1, first bullet ("each call bounded by a timeout"): a hook call that
    /// never returns is dropped at the timeout and counted, and the next heartbeat's renewal
    /// still reaches the hook.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_a_hung_hook_call_is_cut_at_its_timeout() {
        let hook = Recorder::new(true);
        let (runner, metrics, stop) = runner(&hook, Duration::from_millis(200), all_live());
        let started = Instant::now();
        runner.submit(Instant::now(), &[lease("a", 1, 100)], &[]);
        wait_for(|| metrics.get(Counter::HookTimeouts) == 1).await;
        assert!(started.elapsed() < Duration::from_secs(2), "cut after {:?}", started.elapsed());
        runner.submit(Instant::now(), &[lease("a", 1, 101)], &[]);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 2).await;
        stop.cancel();
    }

    /// Guard of issue #12 §4, second bullet ("before every broker call, check the lease's own
    /// deadline"): renewals the registry no longer vouches for when the call goes out are left
    /// out and counted, and the `ttl` a hook sees is what is left of the lease at the call.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_a_hook_gets_only_live_leases_with_the_time_left() {
        let hook = Recorder::new(false);
        hook.gate.add_permits(1);
        let live: LiveCheck = Arc::new(|leases: &[Lease], _| {
            leases.iter().map(|l| (l.key.as_str() != "gone").then(tracing::Span::none)).collect()
        });
        let (runner, metrics, stop) = runner(&hook, Duration::from_secs(5), live);
        let sent = Instant::now().checked_sub(Duration::from_secs(10)).expect("ten seconds of uptime");
        runner.submit(sent, &[lease("kept", 1, 100), lease("gone", 1, 100)], &[]);
        wait_for(|| hook.calls.load(Ordering::SeqCst) == 1).await;
        let confirmed = hook.confirmed.lock().expect("lock").clone();
        assert_eq!(ids(&confirmed[0]), vec![("kept".into(), 1, 100)]);
        let ttl = confirmed[0][0].ttl;
        assert!(ttl <= Duration::from_secs(20), "a renewal sent 10 s ago with 30 s left still said {ttl:?}");
        assert_eq!(metrics.get(Counter::HookSkips), 1);
        stop.cancel();
    }
}
