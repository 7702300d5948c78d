//! The outbox relay (PostgreSQL only): publishes the rows handlers wrote with
//! [`PgFence::outbox_in`](fence::PgFence::outbox_in) to brokers, with the fence stamp on every
//! message, and marks each row sent only after its broker accepted it.
//!
//! One round ([`OutboxRelay::relay_once`]) runs in one transaction: claim up to `batch` unsent
//! rows in id order with `FOR UPDATE SKIP LOCKED` (so relays can run side by side, each on rows
//! the others do not hold), publish them through the [`Publisher`] that serves each row's
//! destination, mark the accepted ones sent, commit. A row a broker refused, or one no publisher
//! serves, stays unsent and is tried again next round. Every database and broker call is bounded
//! ([`RelayConfig`]); [`OutboxRelay::run`] repeats rounds, backing off after errors.
//!
//! Delivery is **at least once**: a relay that dies after the broker accepted a batch but before
//! its commit publishes that batch again. Consumers apply each message with
//! [`PgLedger::accept_in`](fence::ledger::PgLedger::accept_in) and an idempotent effect (keyed by the
//! [`OUTBOX_ID`] attribute, or by job and epoch) in one transaction of their own.
//!
//! Publishers: `sqs::SqsPublisher` (feature `sqs`), `redis::RedisPublisher` (feature `redis`),
//! or your own.
//!
//! ```no_run
//! # async fn demo(fence: brokerfence::PgFence, sqs: std::sync::Arc<dyn brokerfence::outbox::Publisher>)
//! # -> Result<(), brokerfence::outbox::RelayError> {
//! use brokerfence::outbox::{OutboxRelay, RelayConfig};
//! let relay = OutboxRelay::new(fence, RelayConfig::default()).publisher(sqs);
//! relay.run(brokerfence::shutdown_signal()).await?;
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::builder::{debug_some, setters};
use async_trait::async_trait;
use fence::outbox::OutboxRow;
use fence::{FenceError, PgFence};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The message attribute / stream field that carries the outbox row id (a decimal integer):
/// a key for consumers that deduplicate by message.
pub const OUTBOX_ID: &str = "Outbox-Id";

/// Why a row (or a whole publish call) was not accepted.
///
/// ```
/// let e = brokerfence::outbox::PublishError::NoRoute("nowhere".into());
/// assert_eq!(e.to_string(), "no publisher serves destination \"nowhere\"");
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// No publisher serves the row's destination.
    #[error("no publisher serves destination {0:?}")]
    NoRoute(String),
    /// The broker refused the message or the call failed.
    #[error("broker refused: {0}")]
    Broker(String),
    /// The broker did not answer in time.
    #[error("publish did not answer within {0:?}")]
    Timeout(Duration),
    /// The row cannot be sent to this broker as it is (e.g. a body the broker does not accept).
    #[error("cannot encode row: {0}")]
    Encode(String),
}

/// What a publisher did with a batch: the ids the broker accepted and the rows it did not.
///
/// ```
/// let p = brokerfence::outbox::Published { accepted: vec![1, 2], failed: vec![] };
/// assert_eq!(p.accepted.len(), 2);
/// ```
#[derive(Debug, Default, Clone)]
pub struct Published {
    /// Row ids the broker accepted.
    pub accepted: Vec<i64>,
    /// Row ids it did not accept, and why.
    pub failed: Vec<(i64, PublishError)>,
}

/// Sends outbox rows to one broker.
///
/// ```
/// use brokerfence::outbox::{Publisher, Published, PublishError};
/// struct Stdout;
/// #[async_trait::async_trait]
/// impl Publisher for Stdout {
///     fn serves(&self, destination: &str) -> bool { destination == "stdout" }
///     async fn publish(&self, rows: &[brokerfence::outbox::OutboxRow]) -> Result<Published, PublishError> {
///         for r in rows { println!("{} {:?}", r.stamp(), r.payload); }
///         Ok(Published { accepted: rows.iter().map(|r| r.id).collect(), failed: vec![] })
///     }
/// }
/// ```
#[async_trait]
pub trait Publisher: Send + Sync {
    /// True when this publisher sends rows of `destination`.
    fn serves(&self, destination: &str) -> bool;

    /// Publishes `rows` (all of destinations it serves). `Err`: nothing was accepted. A row is
    /// listed as accepted only once the broker confirmed it.
    async fn publish(&self, rows: &[OutboxRow]) -> Result<Published, PublishError>;
}

/// Limits of the relay.
///
/// ```
/// use std::time::Duration;
/// let c = brokerfence::outbox::RelayConfig::default().batch(50).idle_wait(Duration::from_millis(20));
/// assert_eq!(c.get_batch(), 50);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct RelayConfig {
    batch: u32,
    idle_wait: Duration,
    db_timeout: Duration,
    publish_timeout: Duration,
    backoff_min: Duration,
    backoff_max: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            batch: 100,
            idle_wait: Duration::from_millis(200),
            db_timeout: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(10),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

impl RelayConfig {
    setters! {
        /// Rows per round (default 100, at least 1).
        pub fn batch(n: u32) { batch = n.max(1) }
    }
    /// Rows per round.
    ///
    /// ```
    /// assert_eq!(brokerfence::outbox::RelayConfig::default().get_batch(), 100);
    /// ```
    pub fn get_batch(&self) -> u32 {
        self.batch
    }
    setters! {
        /// After a round that found fewer rows than a batch, how long the relay waits for the
        /// notification a new row sends when its transaction commits before it looks again
        /// anyway (default 200 ms; with the fence listening, rows are relayed at once).
        pub fn idle_wait(d: Duration) { idle_wait = d }

        /// Bound of each database call: begin, claim, mark, commit (default 5 s).
        pub fn db_timeout(d: Duration) { db_timeout = d.max(Duration::from_millis(1)) }

        /// Bound of each publisher call (default 10 s). The claimed rows stay locked meanwhile.
        pub fn publish_timeout(d: Duration) { publish_timeout = d.max(Duration::from_millis(1)) }
    }
    /// Backoff after a failed round: from `min` doubling up to `max`, with jitter; every pause
    /// lies between `min` and `max` (default 100 ms .. 5 s).
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.backoff_min = min.max(Duration::from_millis(1));
        self.backoff_max = max.max(self.backoff_min);
        self
    }
}

/// Why a round failed as a whole (nothing was marked sent).
///
/// ```
/// let e = brokerfence::outbox::RelayError::Timeout { op: "claim", after: std::time::Duration::from_secs(5) };
/// assert_eq!(e.to_string(), "outbox claim did not answer within 5s");
/// ```
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The database failed a statement.
    #[error("outbox database error: {0}")]
    Database(#[from] FenceError),
    /// A database call did not answer within [`RelayConfig::db_timeout`].
    #[error("outbox {op} did not answer within {after:?}")]
    Timeout {
        /// Which call (`begin`, `claim`, `mark_sent`, `commit`).
        op: &'static str,
        /// The bound.
        after: Duration,
    },
}

/// What one round did.
///
/// ```
/// let r = brokerfence::outbox::RelayRound::default();
/// assert_eq!((r.claimed, r.sent.len(), r.failed.len()), (0, 0, 0));
/// ```
#[derive(Debug, Default, Clone)]
pub struct RelayRound {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows published and marked sent (committed).
    pub sent: Vec<OutboxRow>,
    /// Rows left unsent, and why.
    pub failed: Vec<(OutboxRow, PublishError)>,
}

/// Called after every committed round (e.g. to print what was sent).
pub type RoundObserver = Arc<dyn Fn(&RelayRound) + Send + Sync>;

/// The relay: a library type; see the [module docs](self).
///
/// ```no_run
/// # async fn demo(fence: brokerfence::PgFence, redis: std::sync::Arc<dyn brokerfence::outbox::Publisher>)
/// # -> Result<(), brokerfence::outbox::RelayError> {
/// let relay = brokerfence::outbox::OutboxRelay::new(fence, Default::default()).publisher(redis);
/// let round = relay.relay_once().await?;
/// println!("sent {} of {}", round.sent.len(), round.claimed);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct OutboxRelay {
    fence: PgFence,
    publishers: Vec<Arc<dyn Publisher>>,
    config: RelayConfig,
    observer: Option<RoundObserver>,
}

impl std::fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_some!(f, self: "OutboxRelay" { fence, publishers = self.publishers.len(), config })
    }
}

async fn db<T>(
    op: &'static str,
    after: Duration,
    call: impl Future<Output = Result<T, FenceError>>,
) -> Result<T, RelayError> {
    match tokio::time::timeout(after, call).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(RelayError::Timeout { op, after }),
    }
}

impl OutboxRelay {
    /// A relay over `fence`'s outbox, with no publishers yet.
    pub fn new(fence: PgFence, config: RelayConfig) -> Self {
        Self { fence, publishers: Vec::new(), config, observer: None }
    }

    /// Adds a publisher; a row goes to the first one that [`serves`](Publisher::serves) its
    /// destination.
    pub fn publisher(mut self, p: Arc<dyn Publisher>) -> Self {
        self.publishers.push(p);
        self
    }

    setters! {
        /// Calls `observer` after every committed round.
        pub fn observe(observer: RoundObserver) { observer = Some(observer) }
    }

    /// One round: claim, publish, mark the accepted rows sent, commit. An `Err` marked nothing:
    /// the claimed rows stay unsent (some may have reached their broker; they are sent again).
    pub async fn relay_once(&self) -> Result<RelayRound, RelayError> {
        let span = tracing::info_span!("outbox_round", claimed = tracing::field::Empty, sent = tracing::field::Empty);
        let round = self.round(&span).instrument(span.clone()).await?;
        if let Some(observer) = &self.observer {
            observer(&round);
        }
        Ok(round)
    }

    async fn round(&self, span: &tracing::Span) -> Result<RelayRound, RelayError> {
        let c = self.config;
        let mut tx = db("begin", c.db_timeout, self.fence.begin()).await?;
        let rows = match db("claim", c.db_timeout, self.fence.outbox_claim_in(&mut tx, c.batch)).await {
            Ok(rows) => rows,
            Err(RelayError::Database(e)) => return Err(RelayError::Database(self.name_old_schema(e).await)),
            Err(e) => return Err(e),
        };
        span.record("claimed", rows.len());
        let mut round = RelayRound { claimed: rows.len(), ..RelayRound::default() };
        if rows.is_empty() {
            db("commit", c.db_timeout, async { Ok(tx.commit().await?) }).await?;
            return Ok(round);
        }
        // Group by publisher (first that serves the destination), keeping id order in each group.
        let mut groups: Vec<Vec<OutboxRow>> = vec![Vec::new(); self.publishers.len()];
        let mut no_route = Vec::new();
        for row in rows {
            match self.publishers.iter().position(|p| p.serves(&row.destination)) {
                Some(i) => groups[i].push(row),
                None => no_route.push(row),
            }
        }
        let calls = self.publishers.iter().zip(&groups).filter(|(_, rows)| !rows.is_empty()).map(|(p, rows)| {
            let bound = c.publish_timeout;
            async move {
                let answer = match tokio::time::timeout(bound, p.publish(rows)).await {
                    Ok(Ok(published)) => published,
                    Ok(Err(e)) => {
                        Published { accepted: Vec::new(), failed: rows.iter().map(|r| (r.id, e.clone())).collect() }
                    }
                    Err(_) => Published {
                        accepted: Vec::new(),
                        failed: rows.iter().map(|r| (r.id, PublishError::Timeout(bound))).collect(),
                    },
                };
                (rows, answer)
            }
        });
        let answers = futures::future::join_all(calls).await;
        let mut accepted_ids = Vec::new();
        let mut accepted_set = HashSet::new();
        let mut accepted_rows = Vec::new();
        for (rows, answer) in answers {
            let by_id: HashMap<i64, &OutboxRow> = rows.iter().map(|r| (r.id, r)).collect();
            let failed: HashMap<i64, PublishError> = answer.failed.into_iter().collect();
            for id in answer.accepted {
                if let Some(row) = by_id.get(&id)
                    && !failed.contains_key(&id)
                    && accepted_set.insert(id)
                {
                    accepted_ids.push(id);
                    accepted_rows.push((*row).clone());
                }
            }
            for row in rows {
                if !accepted_set.contains(&row.id) {
                    let why = failed
                        .get(&row.id)
                        .cloned()
                        .unwrap_or_else(|| PublishError::Broker("the publisher did not report this row".into()));
                    round.failed.push((row.clone(), why));
                }
            }
        }
        for row in no_route {
            let why = PublishError::NoRoute(row.destination.clone());
            round.failed.push((row, why));
        }
        db("mark_sent", c.db_timeout, self.fence.outbox_mark_sent_in(&mut tx, &accepted_ids)).await?;
        db("commit", c.db_timeout, async { Ok(tx.commit().await?) }).await?;
        span.record("sent", accepted_rows.len());
        for row in &accepted_rows {
            let _row =
                tracing::debug_span!("outbox_row", id = row.id, queue = %row.queue, job = %row.key, epoch = row.epoch)
                    .entered();
            tracing::debug!(destination = %row.destination, "published");
        }
        for (row, why) in &round.failed {
            let _row =
                tracing::warn_span!("outbox_row", id = row.id, queue = %row.queue, job = %row.key, epoch = row.epoch)
                    .entered();
            tracing::warn!(destination = %row.destination, error = %why, "not published; stays unsent");
        }
        round.sent = accepted_rows;
        Ok(round)
    }

    /// A claim that failed on a schema older than this build (an outbox without the columns
    /// of migration 14, say) is named as [`FenceError::SchemaTooOld`] rather than the SQL error.
    async fn name_old_schema(&self, error: FenceError) -> FenceError {
        let check = tokio::time::timeout(self.config.db_timeout, fence::FenceStore::check_schema(&self.fence)).await;
        match check {
            Ok(Err(too_old @ FenceError::SchemaTooOld { .. })) => too_old,
            _ => error,
        }
    }

    /// Runs rounds until `shutdown` fires: at once again after a full batch, after
    /// [`RelayConfig::idle_wait`] otherwise, after a backoff when a round failed or sent none of
    /// the rows it claimed. Returns the number of rows sent. A round in progress at shutdown finishes first
    /// (it is bounded by the timeouts).
    pub async fn run(&self, shutdown: CancellationToken) -> Result<u64, RelayError> {
        let c = self.config;
        let mut backoff = relay_backoff(c);
        let mut sent = 0u64;
        // An idle relay waits for a row's notification, polling every `idle_wait`.
        let wakeups = self.fence.outbox_wakeups();
        while !shutdown.is_cancelled() {
            let pause = match self.relay_once().await {
                Ok(round) => {
                    sent += round.sent.len() as u64;
                    if round.sent.is_empty() && !round.failed.is_empty() {
                        // Nothing went through: the broker is down, or the whole batch is rows
                        // nobody can send (they stay at the head until they are fixed).
                        next_backoff(&mut backoff, c)
                    } else {
                        backoff = relay_backoff(c);
                        if round.claimed >= c.batch as usize {
                            Duration::ZERO
                        } else {
                            tokio::select! {
                                _ = shutdown.cancelled() => {}
                                _ = wakeups.wait(tokio::time::Instant::now() + c.idle_wait) => {}
                            }
                            Duration::ZERO
                        }
                    }
                }
                Err(e) => {
                    let pause = next_backoff(&mut backoff, c);
                    tracing::warn!(error = %e, retry_in = ?pause, "outbox round failed");
                    pause
                }
            };
            if !pause.is_zero() {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
        Ok(sent)
    }
}

/// The pauses after failed rounds (backon): the step doubles from `backoff_min` up to half of
/// `backoff_max`, and each pause is between the step and twice it (jitter, so that relays a
/// broker outage stopped together do not retry together), never longer than `backoff_max`.
fn relay_backoff(c: RelayConfig) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder as _;
    backon::ExponentialBuilder::default()
        .with_min_delay(c.backoff_min)
        .with_max_delay((c.backoff_max / 2).max(c.backoff_min))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// The pause to take now.
fn next_backoff(backoff: &mut backon::ExponentialBackoff, c: RelayConfig) -> Duration {
    backoff.next().unwrap_or(c.backoff_max).min(c.backoff_max)
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    /// Every pause lies between the configured minimum and maximum, also when they are equal.
    #[test]
    fn ergonomics_relay_backoff_stays_between_min_and_max() {
        for (min, max) in [(100, 5_000), (250, 250), (10, 15)] {
            let c = RelayConfig::default().backoff(Duration::from_millis(min), Duration::from_millis(max));
            let mut b = relay_backoff(c);
            let pauses: Vec<Duration> = (0..20).map(|_| next_backoff(&mut b, c)).collect();
            assert!(
                pauses.iter().all(|p| (Duration::from_millis(min)..=Duration::from_millis(max)).contains(p)),
                "{min}..{max}: {pauses:?}"
            );
            assert!(pauses[19] >= Duration::from_millis(max) / 2, "reaches the cap's half: {pauses:?}");
        }
    }
}
