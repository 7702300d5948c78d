//! Gathering requests into group statements: one statement carries every request that queued up
//! meanwhile, and under load statements leave at most once per window.
//!
//! The supervisor's group commit and the consumer runtime's group claim both use it. A statement
//! costs the database far more than a row does (PostgreSQL 15 here: a claim and a commit of one
//! job took 0.8 ms of its CPU together, of ten jobs 0.63 ms), so fewer, larger statements leave
//! more of the machine to everything else.

use std::time::Duration;

use tokio::sync::mpsc::{Receiver, UnboundedReceiver};
use tokio::time::Instant;

/// Hands out the requests a channel delivers in groups, one statement's worth each.
///
/// A request that finds the grouper idle (no group handed out within the last `window`) leaves
/// at once, with whatever else is queued. One that arrives less than `window` after the previous
/// group left waits until the window has passed, together with every request arriving meanwhile,
/// so under load there is about one group per `window` whatever the rate, and at rest nothing
/// waits. Waiting only pays while more requests can come: with a [`busy`](Self::busy) probe, a
/// request waits only while the probe says so (attempts still running whose completions could
/// join it, a consumer with room to receive more), so requests that come one at a time wait for
/// nothing. A group holds at most `max` requests; a full one never waits.
///
/// Not cancellation-safe: dropping [`next`](Self::next) while it waits out the window drops the
/// requests it has gathered. Run it in a loop of its own.
///
/// Reads an unbounded channel ([`new`](Self::new)) or a bounded one ([`bounded`](Self::bounded)):
/// with a bounded channel, senders wait while it is full, so requests pile up in the senders
/// (backpressure) and never without limit in the channel.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::time::Duration;
/// let more_coming = Arc::new(AtomicBool::new(true));
/// let probe = Arc::clone(&more_coming);
/// let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
/// let mut groups =
///     brokerfence_fence::Grouper::new(rx, 100, Duration::from_millis(20)).busy(move || probe.load(Ordering::Relaxed));
/// for i in 0..3 {
///     tx.send(i).unwrap();
/// }
/// assert_eq!(groups.next().await, Some(vec![0, 1, 2])); // idle: leaves at once, with what is queued
/// tx.send(3).unwrap();
/// let asked = tokio::time::Instant::now();
/// assert_eq!(groups.next().await, Some(vec![3])); // right behind a group, more coming: waits the window out
/// assert!(asked.elapsed() >= Duration::from_millis(15));
/// more_coming.store(false, Ordering::Relaxed);
/// tx.send(4).unwrap();
/// let asked = tokio::time::Instant::now();
/// assert_eq!(groups.next().await, Some(vec![4])); // right behind a group, nothing more coming: at once
/// assert!(asked.elapsed() < Duration::from_millis(15));
/// drop(tx);
/// assert_eq!(groups.next().await, None);
/// # }
/// ```
pub struct Grouper<T> {
    rx: Inbox<T>,
    max: usize,
    window: Duration,
    busy: Option<Box<dyn Fn() -> bool + Send + Sync>>,
    /// When the previous group left.
    last: Option<Instant>,
}

impl<T> std::fmt::Debug for Grouper<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grouper")
            .field("max", &self.max)
            .field("window", &self.window)
            .field("busy_probe", &self.busy.is_some())
            .finish_non_exhaustive()
    }
}

/// The channel a [`Grouper`] reads.
enum Inbox<T> {
    Unbounded(UnboundedReceiver<T>),
    Bounded(Receiver<T>),
}

impl<T> Inbox<T> {
    async fn recv(&mut self) -> Option<T> {
        match self {
            Inbox::Unbounded(rx) => rx.recv().await,
            Inbox::Bounded(rx) => rx.recv().await,
        }
    }

    fn try_recv(&mut self) -> Option<T> {
        match self {
            Inbox::Unbounded(rx) => rx.try_recv().ok(),
            Inbox::Bounded(rx) => rx.try_recv().ok(),
        }
    }

    /// Requests queued now.
    fn len(&self) -> usize {
        match self {
            Inbox::Unbounded(rx) => rx.len(),
            Inbox::Bounded(rx) => rx.len(),
        }
    }
}

impl<T> Grouper<T> {
    /// Groups of at most `max` (at least one) requests from `rx`, at most one per `window` while
    /// busy.
    pub fn new(rx: UnboundedReceiver<T>, max: usize, window: Duration) -> Self {
        Self { rx: Inbox::Unbounded(rx), max: max.max(1), window, busy: None, last: None }
    }

    /// [`new`](Self::new) over a bounded channel: its senders wait while `capacity` requests are
    /// queued, so the requests waiting for a group stay bounded.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// use std::time::Duration;
    /// let (tx, rx) = tokio::sync::mpsc::channel(2);
    /// let mut groups = brokerfence_fence::Grouper::bounded(rx, 100, Duration::from_millis(20));
    /// tx.send(1).await.unwrap();
    /// tx.send(2).await.unwrap();
    /// assert!(tx.try_send(3).is_err()); // full: a sender waits (backpressure), nothing is dropped
    /// assert_eq!(groups.next().await, Some(vec![1, 2]));
    /// tx.send(3).await.unwrap();
    /// # }
    /// ```
    pub fn bounded(rx: Receiver<T>, max: usize, window: Duration) -> Self {
        Self { rx: Inbox::Bounded(rx), max: max.max(1), window, busy: None, last: None }
    }

    /// Tells the grouper whether more requests can come within the window: a request behind a
    /// recent group waits the window out only while `probe` answers true (asked once, when the
    /// request would start waiting). Without a probe it always does.
    pub fn busy(mut self, probe: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.busy = Some(Box::new(probe));
        self
    }

    /// The next group: waits for a request, then takes what is queued, first waiting out the
    /// window if the previous group left less than `window` ago and more requests can come (the
    /// [`busy`](Self::busy) probe). `None` once every sender is gone and the channel is drained.
    pub async fn next(&mut self) -> Option<Vec<T>> {
        let first = self.rx.recv().await?;
        // Room for what is queued already: growing it request by request would copy it at
        // every doubling (a group taken while busy is near its `max`).
        let mut group = Vec::with_capacity(self.rx.len().saturating_add(1).min(self.max));
        group.push(first);
        self.take_queued(&mut group);
        if let Some(left) = self.last
            && group.len() < self.max
            && Instant::now() < left + self.window
            && self.busy.as_ref().is_none_or(|busy| busy())
        {
            tokio::time::sleep_until(left + self.window).await;
            self.take_queued(&mut group);
        }
        self.last = Some(Instant::now());
        Some(group)
    }

    fn take_queued(&mut self, group: &mut Vec<T>) {
        while group.len() < self.max {
            match self.rx.try_recv() {
                Some(request) => group.push(request),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The delay `next` adds for one request sent right after a group of `before` requests, with
    /// a probe answering `busy` (or none).
    async fn wait_behind(before: usize, busy: Option<bool>) -> Duration {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut groups = Grouper::new(rx, 100, Duration::from_millis(50));
        if let Some(answer) = busy {
            let flag = Arc::new(AtomicBool::new(answer));
            groups = groups.busy(move || flag.load(Ordering::Relaxed));
        }
        for i in 0..before {
            tx.send(i).unwrap();
        }
        assert_eq!(groups.next().await.map(|g| g.len()), Some(before));
        tx.send(before).unwrap();
        let asked = Instant::now();
        assert_eq!(groups.next().await, Some(vec![before]));
        asked.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn waits_behind_a_recent_group_only_while_more_can_come() {
        let window = Duration::from_millis(50);
        assert!(wait_behind(3, Some(true)).await >= window, "behind a group of three, more coming");
        assert!(wait_behind(1, Some(true)).await >= window, "behind a group of one, more coming");
        assert!(wait_behind(1, None).await >= window, "behind a group of one, without a probe");
        assert_eq!(wait_behind(3, Some(false)).await, Duration::ZERO, "behind a group of three, nothing more coming");
        assert_eq!(wait_behind(1, Some(false)).await, Duration::ZERO, "behind a group of one, nothing more coming");
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_grouper_and_a_full_group_never_wait() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut groups = Grouper::new(rx, 2, Duration::from_millis(50));
        for i in 0..5 {
            tx.send(i).unwrap();
        }
        let asked = Instant::now();
        assert_eq!(groups.next().await, Some(vec![0, 1]));
        assert_eq!(groups.next().await, Some(vec![2, 3]), "a full group leaves at once");
        assert_eq!(asked.elapsed(), Duration::ZERO);
        assert_eq!(groups.next().await, Some(vec![4]), "behind a full group the window applies");
        assert!(asked.elapsed() >= Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(60)).await;
        tx.send(5).unwrap();
        let asked = Instant::now();
        assert_eq!(groups.next().await, Some(vec![5]), "the window has passed: at once");
        assert_eq!(asked.elapsed(), Duration::ZERO);
    }
}
