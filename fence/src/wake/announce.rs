//! The notifications of the fence's own writes (enqueue, retry, release), sent after their
//! transaction committed, by one task per fence that gathers what is queued into one
//! statement. That statement commits with `synchronous_commit` off: PostgreSQL holds a lock
//! of the whole cluster from a notifying transaction's commit until it ends, and a commit
//! that waits for its flush would hold it for the flush (and make the fence's writes wait
//! on each other's flushes). A notification is a hint: one lost to a crash is covered by the
//! consumers' poll.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::Connection as _;
use tokio::sync::mpsc;

/// Announcements waiting to be sent; past this many, more are dropped (the poll covers them).
const QUEUED: usize = 1024;
/// The bound on one statement of notifications.
const SEND_LIMIT: Duration = Duration::from_secs(5);
const NOTIFY: &str = "SELECT set_config('synchronous_commit', 'off', true), \
    (SELECT count(*) FROM (SELECT pg_notify($1, p) FROM unnest($2::text[]) AS u(p)) n)";

pub(super) struct Announcer {
    tx: Mutex<Option<mpsc::Sender<(String, u64)>>>,
    pool: sqlx::PgPool,
    channel: String,
    /// Behind a transaction-mode pooler: the statement runs in a transaction of its own.
    pooled: bool,
}

impl Announcer {
    pub(super) fn new(pool: sqlx::PgPool, channel: String, pooled: bool) -> Self {
        Self { tx: Mutex::new(None), pool, channel, pooled }
    }

    /// Queues the announcement of `queue` (due after `delay`); starts the task on first use.
    pub(super) fn send(&self, queue: &str, delay: Duration) {
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            if tokio::runtime::Handle::try_current().is_err() {
                return;
            }
            let (sender, receiver) = mpsc::channel(QUEUED);
            tokio::spawn(run(receiver, self.pool.clone(), self.channel.clone(), self.pooled));
            *tx = Some(sender);
        }
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        if let Some(sender) = tx.as_ref()
            && sender.try_send((queue.to_owned(), ms)).is_err()
        {
            tracing::debug!(queue, "wake-up announcements queue full: consumers elsewhere find the job at their poll");
        }
    }
}

/// Sends what is queued, one statement per batch, until the fence is gone.
async fn run(mut rx: mpsc::Receiver<(String, u64)>, pool: sqlx::PgPool, channel: String, pooled: bool) {
    while let Some((queue, ms)) = rx.recv().await {
        // Per queue the earliest due time: one notification each.
        let mut batch = BTreeMap::from([(queue, ms)]);
        while let Ok((queue, ms)) = rx.try_recv() {
            let at = batch.entry(queue).or_insert(ms);
            *at = (*at).min(ms);
        }
        let payloads: Vec<String> = batch.iter().map(|(q, ms)| format!("{ms}:{q}")).collect();
        match tokio::time::timeout(SEND_LIMIT, send(&pool, &channel, pooled, payloads)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "wake-up notifications not sent; consumers elsewhere poll"),
            Err(_) => tracing::debug!("wake-up notifications not sent in time; consumers elsewhere poll"),
        }
    }
}

async fn send(pool: &sqlx::PgPool, channel: &str, pooled: bool, payloads: Vec<String>) -> Result<(), sqlx::Error> {
    let query = sqlx::query(NOTIFY).bind(channel).bind(payloads);
    if pooled {
        // Parse and bind in one transaction: behind the pooler it stays on one server session.
        let mut conn = pool.acquire().await?;
        let mut tx = conn.begin().await?;
        query.persistent(false).execute(&mut *tx).await?;
        tx.commit().await
    } else {
        query.execute(pool).await.map(drop)
    }
}
