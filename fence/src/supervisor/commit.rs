//! Finishing attempts: the group commit and verify loops, and the commit, failure and release paths.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::outcome::{LossReason, Outcome};
use super::registry::{CommitRequest, Inner, VerifyRequest};
use crate::error::{FenceError, Result};
use crate::group::Grouper;
use crate::job::JobError;
use crate::lease::{FailOutcome, Lease};
use crate::metrics::{Counter, Distribution, Metrics};
use crate::store::FenceStore;

/// How a handler's run ended: stopped (a loss), timed out (`Err(())`), or its own answer.
pub(super) type HandlerResult =
    std::result::Result<std::result::Result<std::result::Result<Vec<u8>, JobError>, ()>, LossReason>;

/// Most completions committed by one statement.
pub(super) const MAX_COMMIT_BATCH: usize = 256;

/// Completions that may wait for a commit statement; past it, a completing attempt waits to
/// enqueue (its lease still renewed) instead of the queue growing.
pub(super) const COMMIT_QUEUE: usize = 4 * MAX_COMMIT_BATCH;

/// Commit statements in flight at once. Two rather than more: completions that arrive while
/// both are busy make the next statement larger, so fewer statements carry the same commits
/// (measured with the table queue: 21 commits per statement at two, 11 at four, and 8 % more
/// throughput), and one slow statement (a row lock held by a claimer) still does not hold up
/// the next group.
pub(super) const COMMITS_IN_FLIGHT: usize = 2;

/// Group commit: commits the queued completions with one `complete_batch` statement (one round
/// trip, one fsync), then answers each; up to [`COMMITS_IN_FLIGHT`] such statements run at once,
/// in the groups `groups` hands out ([`SupervisorConfig::commit_window`]). Each completion is
/// still its own compare-and-set: a fenced one is refused alone.
pub(super) async fn commit_loop(store: Arc<dyn FenceStore>, metrics: Arc<Metrics>, mut groups: Grouper<CommitRequest>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(COMMITS_IN_FLIGHT));
    loop {
        // While every commit slot is busy, completions keep piling up for the next statement.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
        let Some(batch) = groups.next().await else { return };
        metrics.incr(Counter::CommitStatements);
        let (store, metrics) = (Arc::clone(&store), Arc::clone(&metrics));
        tokio::spawn(async move {
            let (n, sent) = (batch.len(), Instant::now());
            commit_batch(&*store, batch).await;
            metrics.observe_duration(Distribution::CommitDuration, sent.elapsed());
            metrics.observe(Distribution::CommitStatementJobs, n as f64);
            drop(permit);
        });
    }
}

/// The first pause before a statement is sent again after its connection failed; it doubles
/// up to [`RESEND_MAX_PAUSE`].
const RESEND_FIRST_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause between two sends of a statement whose connection failed.
const RESEND_MAX_PAUSE: Duration = Duration::from_secs(1);

/// Whether a statement that failed with `e` may be sent again for a verdict: its connection
/// failed (closed, reset, no connection in time: its fate is unknown) or it reached a server
/// that is not the primary (it wrote nothing). A failover looks like that until the new primary
/// answers.
fn worth_resending(e: &FenceError) -> bool {
    e.is_connection_failure() || e.is_not_primary()
}

/// Runs `statement` until it answers, sending it again (after a pause: 100 ms doubling to 1 s)
/// while it fails with [`worth_resending`], for at most `budget` (the attempts' lease: a
/// failover shorter than that costs a delay, not a re-run) and only while `waiting()` says
/// someone still waits for the verdict: nothing is sent once every caller has stopped waiting.
/// A commit may be sent again safely: one whose first send did commit is answered as committed
/// ([`FenceStore::complete`]), and a superseded one is fenced either way.
async fn until_answered<T, F, Fut>(
    what: &str,
    budget: Duration,
    mut statement: F,
    waiting: impl Fn() -> bool,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let started = Instant::now();
    let mut pause = RESEND_FIRST_PAUSE;
    let mut sends = 1u32;
    loop {
        let answer = statement().await;
        match &answer {
            Err(e) if worth_resending(e) && started.elapsed() + pause < budget && waiting() => {
                tracing::warn!(error = %e, sends, retry_in = ?pause, "{what}: no verdict (connection failed or not a primary); sending again");
                tokio::time::sleep(pause).await;
                if !waiting() {
                    return answer;
                }
                pause = (pause * 2).min(RESEND_MAX_PAUSE);
                sends += 1;
            }
            _ => return answer,
        }
    }
}

/// The longest lease among `leases`: how long a statement for them is sent again.
fn resend_budget<'a>(leases: impl Iterator<Item = &'a Lease>) -> Duration {
    leases.map(|l| l.ttl).max().unwrap_or_default()
}

/// Commits one group and answers each of its completions. A statement whose connection failed
/// is sent again for up to a lease while any of its attempts still waits for the verdict (see
/// [`until_answered`]).
async fn commit_batch(store: &dyn FenceStore, batch: Vec<CommitRequest>) {
    let (items, replies): (Vec<(Lease, Vec<u8>)>, Vec<_>) =
        batch.into_iter().map(|(lease, result, reply)| ((lease, result), reply)).unzip();
    let waiting = || replies.iter().any(|r| !r.is_closed());
    let budget = resend_budget(items.iter().map(|(lease, _)| lease));
    match until_answered("batched commit", budget, || store.complete_batch(&items), waiting).await {
        Ok(answers) => {
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
        Err(e) => {
            tracing::error!(error = %e, n = items.len(), "batched commit failed");
            let msg = e.to_string();
            for reply in replies {
                let _ = reply.send(Err(FenceError::CommitUnconfirmed(msg.clone())));
            }
        }
    }
}

/// The group read behind [`JobContext::complete_in`]: one
/// [`completed_under`](FenceStore::completed_under) statement answers every attempt that
/// queued meanwhile, grouped like the commits, up to [`COMMITS_IN_FLIGHT`] statements at once.
pub(super) async fn verify_loop(store: Arc<dyn FenceStore>, mut groups: Grouper<VerifyRequest>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(COMMITS_IN_FLIGHT));
    loop {
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
        let Some(batch) = groups.next().await else { return };
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let (leases, replies): (Vec<Lease>, Vec<_>) = batch.into_iter().unzip();
            let waiting = || replies.iter().any(|r: &tokio::sync::oneshot::Sender<_>| !r.is_closed());
            let budget = resend_budget(leases.iter());
            let read = || store.completed_under(&leases);
            match until_answered("reading the handlers' own commits", budget, read, waiting).await {
                Ok(answers) => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(Ok(answer));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, n = leases.len(), "reading the handlers' own commits failed");
                    let msg = e.to_string();
                    for reply in replies {
                        let _ = reply.send(Err(FenceError::CommitUnconfirmed(msg.clone())));
                    }
                }
            }
            drop(permit);
        });
    }
}

impl Inner {
    /// Finishes an attempt whose handler ended (or was stopped by shutdown) without a commit of
    /// its own: commits its result, records its failure or releases its lease.
    pub(super) async fn finish(&self, lease: &Lease, result: HandlerResult, timeout: Option<Duration>) -> Outcome {
        match result {
            Err(LossReason::Shutdown) => match Box::pin(self.settled(self.store.release(lease))).await {
                Ok(()) => {
                    self.metrics.incr(Counter::Releases);
                    tracing::info!("lease released at shutdown");
                    Outcome::Released
                }
                Err(e) => self.commit_error(e),
            },
            Err(reason) => Outcome::LeaseLost { reason },
            Ok(Err(())) => {
                let msg = format!("attempt timed out after {:?}", timeout.unwrap_or_default());
                Box::pin(self.fail(lease, JobError::retry(msg))).await
            }
            Ok(Ok(Ok(result))) => match self.commit(lease, result).await {
                Ok(()) => {
                    self.metrics.incr(Counter::Completions);
                    tracing::debug!("result committed");
                    Outcome::Completed
                }
                Err(e) => self.commit_error(e),
            },
            Ok(Ok(Err(job_error))) => Box::pin(self.fail(lease, job_error)).await,
        }
    }

    /// Finishes an attempt whose handler sent its own completion ([`JobContext::complete_in`]):
    /// the job row says whether the handler's transaction committed. Completed under this epoch
    /// and owner: done, nothing more to commit. Otherwise the transaction did not commit (rolled
    /// back, dropped, or never committed): the attempt ends as if the handler had not completed,
    /// and a handler that returned `Ok` anyway is recorded as a (retried) failure.
    pub(super) async fn after_own_commit(
        &self,
        lease: &Lease,
        result: HandlerResult,
        timeout: Option<Duration>,
    ) -> Outcome {
        match self.completed_under(lease).await {
            Ok(true) => {
                self.metrics.incr(Counter::Completions);
                self.metrics.incr(Counter::OwnCommits);
                tracing::debug!("result committed in the handler's transaction");
                Outcome::Completed
            }
            Ok(false) => match result {
                Ok(Ok(Ok(_))) => {
                    let error = JobError::retry("the handler called complete_in, but its transaction did not commit");
                    self.fail(lease, error).await
                }
                other => self.finish(lease, other, timeout).await,
            },
            Err(e) => self.commit_error(e),
        }
    }

    /// Whether a handler that sent its own completion and then lost its lease had committed
    /// it: completed under `lease` counts as a completion (and an own commit), like
    /// [`after_own_commit`](Self::after_own_commit). An error reading the row is no: the
    /// attempt ends as lost, and the redelivery finds the job done.
    pub(super) async fn own_commit_landed(&self, lease: &Lease) -> bool {
        match self.completed_under(lease).await {
            Ok(true) => {
                self.metrics.incr(Counter::Completions);
                self.metrics.incr(Counter::OwnCommits);
                tracing::debug!("result committed in the handler's transaction before its lease was found lost");
                true
            }
            Ok(false) => false,
            Err(e) => {
                tracing::warn!(error = %e, "could not read whether the handler's own commit landed; treated as lost");
                false
            }
        }
    }

    /// Whether the job of `lease` is completed under it, through the group read (see
    /// [`verify_loop`]), bounded like a commit's verdict.
    async fn completed_under(&self, lease: &Lease) -> Result<bool> {
        let (reply, verdict) = tokio::sync::oneshot::channel();
        self.settled(async {
            match self.verifier.send((lease.clone(), reply)).await {
                Ok(()) => {
                    verdict.await.unwrap_or_else(|_| Err(FenceError::CommitUnconfirmed("the verifier stopped".into())))
                }
                Err(_) => {
                    Ok(self.store.completed_under(std::slice::from_ref(lease)).await?.first().copied().unwrap_or(false))
                }
            }
        })
        .await
    }

    /// Commits a result through the group commit (the fenced compare-and-set, batched). While
    /// the commit queue is full the attempt waits to enqueue (backpressure; its lease is still
    /// renewed); nothing is dropped.
    ///
    /// A queue with room takes the request at once (`try_send`), and the attempt only waits for
    /// the verdict. A full queue (waited on) and a stopped committer (the commit sent directly)
    /// are rare, so their futures are boxed: inline, they would be most of the size of every
    /// attempt's task.
    async fn commit(&self, lease: &Lease, result: Vec<u8>) -> Result<()> {
        use futures::FutureExt as _;
        use tokio::sync::mpsc::error::{SendError, TrySendError};
        let (reply, verdict) = tokio::sync::oneshot::channel();
        let verdict = verdict.map(|answer| {
            answer.unwrap_or_else(|_| Err(FenceError::CommitUnconfirmed("the committer stopped".into())))
        });
        match self.committer.try_send((lease.clone(), result, reply)) {
            Ok(()) => self.settled(verdict).await,
            Err(TrySendError::Full(request)) => {
                let queued = async move {
                    match self.committer.send(request).await {
                        Ok(()) => verdict.await,
                        Err(SendError((lease, result, _))) => self.store.complete(&lease, &result).await,
                    }
                };
                Box::pin(self.settled(queued)).await
            }
            Err(TrySendError::Closed((_, result, _))) => {
                Box::pin(self.settled(self.store.complete(lease, &result))).await
            }
        }
    }

    /// Waits for the database's verdict on a commit, failure record or release, at most
    /// [`SupervisorConfig::settle_timeout`]: past it the fate is unknown
    /// ([`FenceError::CommitUnconfirmed`]), so the delivery is not acknowledged.
    ///
    /// A combinator rather than an `async fn`: an `async fn` would keep `verdict` twice in its
    /// state (the argument, and the timeout it is moved into).
    fn settled<T>(&self, verdict: impl Future<Output = Result<T>>) -> impl Future<Output = Result<T>> {
        use futures::FutureExt as _;
        let limit = self.config.get_settle_timeout();
        tokio::time::timeout(limit, verdict).map(move |answer| {
            answer.unwrap_or_else(|_| {
                Err(FenceError::CommitUnconfirmed(format!("no verdict from the database within {limit:?}")))
            })
        })
    }

    fn commit_error(&self, e: FenceError) -> Outcome {
        if e.is_fenced() {
            self.metrics.incr(Counter::FencedRejections);
            tracing::warn!(error = %e, "commit fenced: result dropped, delivery not acknowledged");
            Outcome::Fenced(e)
        } else {
            tracing::error!(error = %e, "commit failed: delivery not acknowledged");
            Outcome::StoreError(e)
        }
    }

    async fn fail(&self, lease: &Lease, error: JobError) -> Outcome {
        match self.settled(self.store.fail(lease, &error.message, error.retry, &self.config.retry)).await {
            Ok(FailOutcome::Retry { retry_in }) => {
                self.metrics.incr(Counter::Failures);
                tracing::info!(error = %error.message, ?retry_in, "attempt failed; will retry");
                Outcome::Failed { retry_in, error: error.message }
            }
            Ok(FailOutcome::Dead) => {
                // The job is dead; whether a dead-letter copy is sent is the broker side's to
                // count (`dead_letters`), once it was.
                self.metrics.incr(Counter::DeadJobs);
                tracing::warn!(error = %error.message, "attempt failed for good; job is dead");
                Outcome::Dead { error: error.message }
            }
            Err(e) => self.commit_error(e),
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    //! Guards of the size of the task every consumer spawns per job (issue #33). A task over
    //! about a kilobyte is copied whole on each move and allocated outside glibc's small-size
    //! caches. These two shapes had made it 3.3 KB; without them it is 816 bytes plus the boxed
    //! attempt (1,104). The drain rate did not change measurably (docs/performance.md).
    use crate::JobError;
    use crate::supervisor::JobContext;
    use crate::supervisor::tests::setup;

    /// `run_claimed_at` as an `async fn` kept its arguments beside the attempt they moved into.
    #[tokio::test]
    async fn latency_per_job_task_an_attempt_holds_its_arguments_once() {
        let (sup, lease) = setup().await;
        let handler = |_ctx: JobContext| async move { Ok::<_, JobError>(Vec::new()) };
        let attempt = sup.run_claimed_at(lease.clone(), std::time::Instant::now(), Vec::new(), None, handler);
        let inner = sup.run_inner(lease, tokio::time::Instant::now(), Vec::new(), None, tracing::Span::none(), handler);
        // The attempt is the inner future, its span (twice with `otel`: the layer's end needs it) and a tag.
        let bound = size_of_val(&inner) + 2 * size_of::<tracing::Span>() + 64;
        assert!(size_of_val(&attempt) <= bound, "attempt {} bytes, bound {bound}", size_of_val(&attempt));
    }

    /// A commit that held the queue's `send` future (and, through an `async fn` timeout, the
    /// whole wait twice) on its common path, where the queue has room.
    #[tokio::test]
    async fn latency_per_job_task_a_commit_does_not_hold_the_queue_wait() {
        let (sup, lease) = setup().await;
        let commit = sup.inner.commit(&lease, Vec::new());
        let (reply, _verdict) = tokio::sync::oneshot::channel();
        let send = sup.inner.committer.send((lease.clone(), Vec::new(), reply));
        assert!(
            size_of_val(&commit) < size_of_val(&send),
            "commit {} bytes, the queue's send alone {}",
            size_of_val(&commit),
            size_of_val(&send)
        );
    }
}
