//! The one polling loop of the tests ([`until`]) and its forms: [`wait_for`] a value,
//! [`eventually`] a condition, [`wait_for_completions`] of a consumer's counters.

use std::future::Future;
use std::time::Duration;

use brokerfence::Metrics;

/// How often the loop checks again.
const POLL: Duration = Duration::from_millis(25);

/// Polls `check` every 25 ms until it returns `Some`; after `within`, panics with `failure()`.
pub async fn until<T, F, Fut>(within: Duration, mut check: F, failure: impl FnOnce() -> String) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("{}", failure());
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it returns `Some`, or panics after `within` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    until(within, check, || format!("timed out after {within:?} waiting for {what}")).await
}

/// Polls `cond` until it holds, or panics after `within` naming `what`.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let check = || {
        let holds = cond();
        async move { holds.await.then_some(()) }
    };
    wait_for(what, within, check).await;
}

/// Waits until `metrics` count `n` completions; fails the test, with the counters, after `within`.
pub async fn wait_for_completions(metrics: &Metrics, n: u64, within: Duration) {
    let check = || async { (metrics.snapshot().completions >= n).then_some(()) };
    until(within, check, || format!("{n} completions not reached: {}", metrics.snapshot())).await;
}
