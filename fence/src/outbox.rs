//! The transactional outbox (PostgreSQL only): effects that must leave the database exactly when
//! the job's result commits.
//!
//! A handler writes its business rows, one outbox row per message it wants sent
//! ([`PgFence::outbox_in`]) and its fenced completion ([`PgFence::complete_in`]) in **one**
//! transaction. The completion is a compare-and-set on (job, owner, epoch): when a newer epoch
//! has taken the job over it fails with [`FenceError::Fenced`], the transaction rolls back, and
//! the zombie's outbox row never exists. A committed outbox row therefore always carries the
//! epoch of the attempt whose result committed.
//!
//! A relay (`brokerfence::outbox::OutboxRelay`, or your own loop on
//! [`PgFence::outbox_claim_in`] and [`PgFence::outbox_mark_sent_in`]) publishes the rows with
//! their [`FenceStamp`] and marks each sent only after the broker accepted it. A relay that
//! crashes between the broker's answer and its own commit publishes those rows again: delivery is
//! at least once, so the consumer applies each message with
//! [`PgLedger::accept_in`](crate::ledger::PgLedger::accept_in) and an idempotent effect in one
//! transaction of its own.
//!
//! The table is `{schema}.outbox` (migration 4):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `id` | `bigserial` | order of writing; the relay claims in id order |
//! | `queue`, `key`, `epoch`, `owner` | | the stamp of the attempt that wrote the row |
//! | `destination` | `text` | where the relay sends it (a name the relay maps to a queue or stream) |
//! | `payload` | `bytea` | the message body |
//! | `created_at` | `timestamptz` | when the row was written |
//! | `sent_at` | `timestamptz NULL` | when a broker accepted it (NULL: not yet) |
//! | `traceparent`, `tracestate` | `text NULL` | the W3C trace context of the attempt that wrote it (feature `otel`; migration 14) |
//!
//! There is no SQLite outbox.

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use crate::error::{FenceError, Result};
use crate::lease::Lease;
use crate::postgres::PgFence;
use crate::wire::FenceStamp;

/// Longest destination name, in bytes.
pub const MAX_DESTINATION_BYTES: usize = 256;

/// Migration 4: the outbox table and its "unsent in id order" index.
pub(crate) const MIGRATION: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {s}.outbox (
            id          bigserial   PRIMARY KEY,
            queue       text        COLLATE \"C\" NOT NULL,
            key         text        COLLATE \"C\" NOT NULL,
            epoch       bigint      NOT NULL CHECK (epoch >= 1),
            owner       text        NOT NULL,
            destination text        COLLATE \"C\" NOT NULL,
            payload     bytea       NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            sent_at     timestamptz
        )",
    "CREATE INDEX IF NOT EXISTS outbox_unsent ON {s}.outbox (id) WHERE sent_at IS NULL",
];

/// One outbox row, as the relay claims it.
///
/// ```
/// let row = brokerfence::outbox::OutboxRow {
///     id: 7,
///     queue: "orders".into(),
///     key: "order-1".into(),
///     epoch: 2,
///     owner: "w1".into(),
///     destination: "billing".into(),
///     payload: b"charge 5".to_vec(),
///     traceparent: None,
///     tracestate: None,
/// };
/// assert_eq!(row.stamp().to_string(), "orders/order-1@2");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The row id (increasing in the order rows were written).
    pub id: i64,
    /// The queue of the job that wrote it.
    pub queue: String,
    /// The job key.
    pub key: String,
    /// The epoch of the attempt that wrote it (the attempt whose result committed).
    pub epoch: i64,
    /// The worker that held the lease.
    pub owner: String,
    /// Where it goes.
    pub destination: String,
    /// The message body.
    pub payload: Vec<u8>,
    /// The W3C `traceparent` of the attempt that wrote the row (written with the feature `otel`
    /// inside a traced span; at most 64 characters as read back, so a longer value written
    /// around the fence is cut, then refused with a warning when it is published).
    pub traceparent: Option<String>,
    /// Its `tracestate` (at most 513 characters as read back).
    pub tracestate: Option<String>,
}

impl OutboxRow {
    /// The fence stamp to send with the message (see [`crate::wire`]).
    ///
    /// ```
    /// # let row = brokerfence::outbox::OutboxRow { id: 1, queue: "q".into(), key: "k".into(), epoch: 3, owner: "w".into(),
    /// #     destination: "d".into(), payload: vec![], traceparent: None, tracestate: None };
    /// let headers = row.stamp().to_headers();
    /// assert_eq!(headers[2], ("Fence-Epoch", "3".to_string()));
    /// ```
    pub fn stamp(&self) -> FenceStamp {
        FenceStamp::new(self.queue.clone(), self.key.clone(), self.epoch).with_owner(self.owner.clone())
    }

    /// The (name, value) pairs a publisher sends with the message: the [stamp](Self::stamp)'s,
    /// and with the feature `otel` the trace context of the attempt that wrote the row, so the
    /// consumer's first attempt is a child of that attempt's span. A row without a usable
    /// context (written outside a traced span, before migration 14, or malformed: a warning
    /// names the outbox row) gets the current span's context instead, as
    /// [`FenceStamp::to_headers`] gives it.
    ///
    /// ```
    /// # let row = brokerfence::outbox::OutboxRow { id: 1, queue: "q".into(), key: "k".into(), epoch: 3, owner: "w".into(),
    /// #     destination: "d".into(), payload: vec![], traceparent: None, tracestate: None };
    /// let pairs = row.to_headers();
    /// assert_eq!(pairs[..4], row.stamp().to_headers()[..4]);
    /// ```
    pub fn to_headers(&self) -> Vec<(&'static str, String)> {
        #[cfg(feature = "otel")]
        if let Some(tc) =
            crate::otel::TraceContext::read(self.traceparent.as_deref(), self.tracestate.as_deref(), "outbox row")
        {
            let mut out = self.stamp().stamp_headers();
            out.extend(tc.to_headers());
            return out;
        }
        self.stamp().to_headers()
    }
}

type Row = (i64, String, String, i64, String, String, Vec<u8>, Option<String>, Option<String>);

fn table(fence: &PgFence) -> String {
    format!("{}.outbox", fence.get_schema().as_str())
}

impl PgFence {
    /// Writes an outbox row under `lease`'s stamp on `conn` (inside the caller's transaction);
    /// returns its id.
    ///
    /// It checks nothing itself: it **must** run in the same transaction as
    /// [`complete_in`](Self::complete_in) for the same lease, whose fenced compare-and-set decides
    /// for both. When `complete_in` answers [`FenceError::Fenced`], roll the transaction back (or
    /// drop it): the outbox row goes with it. Written in any other transaction, a superseded
    /// attempt's row would be published.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence, lease: brokerfence::Lease) -> brokerfence::Result<()> {
    /// let mut tx = fence.pool().begin().await?;
    /// sqlx::query("INSERT INTO shop.orders (id, state) VALUES ($1, 'paid')").bind(7_i64).execute(&mut *tx).await?;
    /// fence.outbox_in(&mut tx, &lease, "billing", b"charge order 7").await?;
    /// fence.complete_in(&mut tx, &lease, b"paid").await?; // Fenced: `tx` drops, nothing is kept
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn outbox_in(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        destination: &str,
        payload: &[u8],
    ) -> Result<i64> {
        if destination.is_empty() || destination.contains('\0') || destination.len() > MAX_DESTINATION_BYTES {
            return Err(FenceError::invalid(
                "destination",
                format!("must be 1..={MAX_DESTINATION_BYTES} bytes without NUL"),
            ));
        }
        // The relays listening are woken when the caller's transaction commits (`crate::wake`).
        // Feature `otel`: the current span's context (the attempt's) goes with the row.
        let (traceparent, tracestate) = crate::store::producer_trace();
        let sql = format!(
            "WITH ins AS (INSERT INTO {} (queue, key, epoch, owner, destination, payload, traceparent, tracestate) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id), \
             woke AS (SELECT pg_notify('{}', '{}') FROM ins WHERE {}) \
             SELECT (SELECT id FROM ins) WHERE (SELECT count(*) FROM woke) >= 0",
            table(self),
            crate::wake::channel(self.get_schema().as_str()),
            crate::wake::OUTBOX_PAYLOAD,
            self.get_notify(),
        );
        Ok(sqlx::query_scalar(AssertSqlSafe(sql))
            .persistent(self.persistent())
            .bind(lease.queue.as_str().to_owned())
            .bind(lease.key.as_str().to_owned())
            .bind(lease.epoch)
            .bind(lease.owner.as_str().to_owned())
            .bind(destination.to_owned())
            .bind(payload.to_vec())
            .bind(traceparent)
            .bind(tracestate)
            .fetch_one(&mut *conn)
            .await?)
    }

    /// Claims up to `limit` unsent outbox rows, oldest first, with `FOR UPDATE SKIP LOCKED`: call
    /// it inside a transaction, which then holds the rows until it ends. Rows another relay's
    /// transaction holds are skipped, so relays running side by side never publish the same row
    /// at the same time. Publish them, [`outbox_mark_sent_in`](Self::outbox_mark_sent_in) those
    /// the broker accepted, commit.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// let mut tx = fence.pool().begin().await?;
    /// let rows = fence.outbox_claim_in(&mut tx, 100).await?;
    /// let accepted: Vec<i64> = rows.iter().map(|r| r.id).collect(); // what the broker accepted
    /// fence.outbox_mark_sent_in(&mut tx, &accepted).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn outbox_claim_in(&self, conn: &mut PgConnection, limit: u32) -> Result<Vec<OutboxRow>> {
        let sql = format!(
            "SELECT id, queue COLLATE \"C\", key COLLATE \"C\", epoch, owner, destination COLLATE \"C\", payload, \
                    left(traceparent, 64), left(tracestate, 513) \
             FROM {} WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED",
            table(self)
        );
        let rows: Vec<Row> = sqlx::query_as(AssertSqlSafe(sql))
            .persistent(self.persistent())
            .bind(i64::from(limit.max(1)))
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(id, queue, key, epoch, owner, destination, payload, traceparent, tracestate)| OutboxRow {
                id,
                queue,
                key,
                epoch,
                owner,
                destination,
                payload,
                traceparent,
                tracestate,
            })
            .collect())
    }

    /// Marks rows sent (now); returns how many were still unsent. Call it in the transaction that
    /// claimed them, after the broker accepted them, and only for those.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence, tx: &mut sqlx::PgConnection) -> brokerfence::Result<()> {
    /// let marked = fence.outbox_mark_sent_in(tx, &[1, 2, 3]).await?;
    /// assert!(marked <= 3);
    /// # Ok(()) }
    /// ```
    pub async fn outbox_mark_sent_in(&self, conn: &mut PgConnection, ids: &[i64]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql =
            format!("UPDATE {} SET sent_at = clock_timestamp() WHERE id = ANY($1) AND sent_at IS NULL", table(self));
        Ok(sqlx::query(AssertSqlSafe(sql))
            .persistent(self.persistent())
            .bind(ids.to_vec())
            .execute(&mut *conn)
            .await?
            .rows_affected())
    }

    /// How many outbox rows are unsent (the relay's backlog).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// println!("backlog: {}", fence.outbox_unsent().await?);
    /// # Ok(()) }
    /// ```
    pub async fn outbox_unsent(&self) -> Result<i64> {
        let sql = format!("SELECT count(*)::bigint FROM {} WHERE sent_at IS NULL", table(self));
        let mut session = self.session(crate::postgres::Lane::Main).await?;
        let unsent =
            sqlx::query_scalar(AssertSqlSafe(sql)).persistent(self.persistent()).fetch_one(&mut *session).await?;
        session.done().await?;
        Ok(unsent)
    }
}
