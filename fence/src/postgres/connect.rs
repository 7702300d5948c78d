//! Connecting: the constructors and accessors of [`PgFence`], and the pool of reserved heartbeat
//! connections.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::cursor::{ClaimCursors, DEFAULT_RESCAN};
use super::locate::Locator;
use super::probe::{connect_options, find_primary};
use super::route::{self, Lane, PrimaryWatch, Route};
use super::session::PgTimeouts;
use super::target::{PgTarget, Pooler};
use super::{MigrationLimits, PgFence, Statements};
use crate::error::Result;
use crate::guards::Guards;
use crate::schema::SchemaName;
use crate::store::default_max_claims;
use crate::wake::{Hub, ListenSpec};

impl PgTimeouts {
    /// The pool of reserved heartbeat connections: opened on first use (then kept while in use, like any pool's), each with
    /// the fence's planner settings and the heartbeat limits.
    fn heartbeat_pool(&self, options: sqlx::postgres::PgConnectOptions, watch: &Arc<PrimaryWatch>) -> PgPool {
        route::pool_options(false, watch)
            .max_connections(self.heartbeat_connections.max(1))
            .connect_lazy_with(self.apply_heartbeat(options))
    }
}

impl PgFence {
    /// The pool options [`connect`](Self::connect) and [`connect_with`](Self::connect_with) use:
    /// up to 16 connections, 10 s to acquire one, and the fence's planner settings on each new connection.
    /// Build your own pool from them (then [`PgFence::new`]) to change the limits and keep the rest.
    ///
    /// Planning is the larger part of a fence statement's cost (a batch claim of ten keys: 0.27 ms
    /// to plan, 0.18 ms to run), so the setup has each connection plan each statement once and
    /// keep that generic plan. A generic plan is only as good as the table it was made for, though:
    /// made while the jobs table was small and freshly analyzed, it is a sequential scan (or a hash
    /// join over the whole table), and every later call reads the whole table until the next
    /// `ANALYZE` (up to a minute of autovacuum's nap, while a burst grows the table). Measured: one
    /// round of every fence statement read 1,006,059 rows of a 20,000-row table. The setup's other
    /// three settings leave the planner index lookups in nested loops only, which is what each
    /// fence statement wants (each looks rows up by key or reads an index in order): the same
    /// round reads about 40 rows. The settings only price the other plans out; a query with no
    /// index to use still runs. Queries of another kind (reports, large joins) belong on a pool of
    /// their own.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), sqlx::Error> {
    /// let pool = brokerfence::PgFence::pool_options().max_connections(4).connect("postgres://127.0.0.1/jobs").await?;
    /// let fence = brokerfence::PgFence::new(pool);
    /// # let _ = fence; Ok(()) }
    /// ```
    ///
    /// A connection that opens on a standby or a read-only server is closed (the pool connects
    /// again), so a pool behind an address that an HA manager re-points only ever hands out
    /// sessions of the primary.
    pub fn pool_options() -> PgPoolOptions {
        route::pool_options(false, &PrimaryWatch::new(None))
    }

    /// Connects a pool of up to 16 connections to `url` ([`pool_options`](Self::pool_options)),
    /// with the default [`PgTimeouts`] and their reserved heartbeat connections.
    ///
    /// `url` must be a PostgreSQL URL (`postgres://` or `postgresql://`): any other scheme fails
    /// at once with [`FenceError::UnsupportedScheme`](crate::FenceError::UnsupportedScheme). A server that cannot be reached fails
    /// with [`FenceError::Unreachable`](crate::FenceError::Unreachable) (host, port and cause), one that refuses the user or
    /// database with [`FenceError::ConnectRejected`](crate::FenceError::ConnectRejected); see [`connect_with`](Self::connect_with).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let err = brokerfence::PgFence::connect("mysql://root@127.0.0.1/jobs").await.unwrap_err();
    /// assert!(matches!(err, brokerfence::FenceError::UnsupportedScheme { ref scheme, .. } if scheme == "mysql"));
    /// # }
    /// ```
    ///
    /// `url` may list several hosts (`postgres://app@db1:5432,db2:5432/jobs`): the fence uses
    /// the first that is a primary and follows the primary when it moves; and it may go through
    /// a transaction-mode pooler such as PgBouncer (found out when connecting, or
    /// `?pooler=transaction`). See [`PgTarget`] and [`Pooler`].
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_to(PgTarget::parse(url)?).await
    }

    /// [`connect_with`](Self::connect_with) with other time limits (see [`PgTimeouts`]).
    pub async fn connect_with_timeouts(
        options: sqlx::postgres::PgConnectOptions,
        timeouts: PgTimeouts,
    ) -> Result<Self> {
        Self::connect_to(PgTarget::from_options(options).timeouts(timeouts)).await
    }

    /// Connects to `target`: the first of its hosts that is a primary (one direct connection
    /// attempt per host, each bounded by the target's connect timeout, 10 s by default), through
    /// a transaction-mode pooler or not ([`Pooler`]), with the target's [`PgTimeouts`] and their
    /// reserved heartbeat connections. With several hosts, a task follows the primary: when a
    /// statement finds the server gone or read-only, or a new connection lands on a standby, it
    /// looks through the hosts again and moves both pools to the primary it finds.
    ///
    /// Errors as [`connect_with`](Self::connect_with); with every host a standby,
    /// [`FenceError::NotPrimary`](crate::FenceError::NotPrimary).
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use brokerfence::{PgFence, PgTarget};
    /// let target = PgTarget::parse("postgres://app@db1:5432,db2:5432/jobs?target_session_attrs=read-write")?
    ///     .application_name("billing-worker");
    /// let fence = PgFence::connect_to(target).await?;
    /// # let _ = fence; Ok(()) }
    /// ```
    pub async fn connect_to(target: PgTarget) -> Result<Self> {
        let (host, pooled) = find_primary(&target).await?;
        let notify = (target.hosts.len() > 1).then(|| Arc::new(tokio::sync::Notify::new()));
        let watch = PrimaryWatch::new(notify.clone());
        let route = if pooled {
            Route::pooled(&target.timeouts, Arc::clone(&watch))
        } else {
            Route::direct(Arc::clone(&watch))
        };
        let pool = route::pool_options(pooled, &watch)
            .connect_with(connect_options(&target, host, pooled, Lane::Main))
            .await?;
        let heartbeat_pool = route::pool_options(pooled, &watch)
            .max_connections(target.timeouts.heartbeat_connections.max(1))
            .connect_lazy_with(connect_options(&target, host, pooled, Lane::Heartbeat));
        let locator = notify.map(|notify| {
            Arc::new(Locator::spawn(target, host, pooled, pool.clone(), heartbeat_pool.clone(), watch, notify))
        });
        let mut fence = Self::new(pool).heartbeat_pool(heartbeat_pool);
        fence.route = route;
        fence.locator = locator;
        Ok(fence.with_new_hub())
    }

    /// Tells a fence built on your own pool ([`new`](Self::new)) that a transaction-mode pooler
    /// is in front of PostgreSQL ([`Pooler::Transaction`]): its statements then run in
    /// transactions that carry the default [`PgTimeouts`] and the planner settings, and prepare
    /// no named statements. (Give the pool's connect options `extra_float_digits(None)` for
    /// PgBouncer.) [`Pooler::None`] and [`Pooler::Auto`] leave the pool's sessions as they are.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use brokerfence::{PgFence, Pooler};
    /// let options: sqlx::postgres::PgConnectOptions = "postgres://app@pgbouncer:6432/jobs".parse()?;
    /// let pool = sqlx::postgres::PgPoolOptions::new().connect_with(options.extra_float_digits(None)).await?;
    /// let fence = PgFence::new(pool).pooler(Pooler::Transaction);
    /// # let _ = fence; Ok(()) }
    /// ```
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        let watch = Arc::clone(&self.route.watch);
        self.route = match pooler {
            Pooler::Transaction => Route::pooled(&PgTimeouts::default(), watch),
            _ => Route::direct(watch),
        };
        self.with_new_hub()
    }

    /// Whether consumers of this fence's table queues are woken by PostgreSQL notifications
    /// (default `true`): one connection of the pool (shared by this fence's clones) listens
    /// (`LISTEN`) for the notifications every enqueue, release and retry sends when its
    /// transaction commits, so an idle consumer claims within milliseconds instead of at its
    /// next poll. Behind a transaction-mode pooler ([`Pooler::Transaction`]) nothing listens,
    /// whatever this says: `LISTEN` does not work there. With `false` (or behind a pooler) only
    /// enqueues through this process's fence wake its consumers; the others wait for their poll
    /// (`TableQueue::idle_wait`, 1 s by default). Notifications are sent either way.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// let fence = brokerfence::PgFence::connect("postgres://postgres@127.0.0.1/test").await?.listen(false);
    /// assert!(!fence.get_listen());
    /// # Ok(()) }
    /// ```
    pub fn listen(mut self, on: bool) -> Self {
        self.listen = on;
        self.with_new_hub()
    }

    /// Whether this fence's consumers listen for notifications (see [`listen`](Self::listen)):
    /// `false` when told so or behind a transaction-mode pooler.
    pub fn get_listen(&self) -> bool {
        self.listen && !self.route.is_pooled()
    }

    /// Whether the fence's writes that make a job due send a notification (default `true`; see
    /// [`listen`](Self::listen)). The fence's own `enqueue`, `enqueue_many`, retries and
    /// releases announce their jobs after their commit, from a task of their own that gathers
    /// them into one statement committed without waiting for its flush. The transactional forms
    /// ([`enqueue_in`](Self::enqueue_in), [`enqueue_many_in`](Self::enqueue_many_in),
    /// `outbox_in`) call `pg_notify` inside the caller's transaction, which costs that
    /// transaction PostgreSQL's notification lock: from its commit until it ends, which
    /// includes the commit's flush, no other notifying transaction of the cluster commits, and
    /// such a transaction cannot `PREPARE TRANSACTION`. `false` sends nothing: consumers in
    /// other processes then find jobs at their poll; this process's consumers are still woken.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// let fence = brokerfence::PgFence::connect("postgres://postgres@127.0.0.1/test").await?.notify(false);
    /// assert!(!fence.get_notify());
    /// # Ok(()) }
    /// ```
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self.with_new_hub()
    }

    /// Whether the fence's writes send notifications (see [`notify`](Self::notify)).
    pub fn get_notify(&self) -> bool {
        self.notify
    }

    /// A wake-up hub for the current schema, pool and route (clones made after this share it).
    fn with_new_hub(mut self) -> Self {
        let channel = crate::wake::channel(self.schema.as_str());
        let listen = self.get_listen().then(|| ListenSpec { pool: self.pool.clone(), channel: channel.clone() });
        let announce = self.notify.then(|| (self.pool.clone(), channel, self.route.is_pooled()));
        self.wake = Hub::postgres(listen, announce);
        self
    }

    /// Whether statements run behind a transaction-mode pooler ([`Pooler::Transaction`]: found
    /// out when connecting, or asked for).
    pub fn get_pooler(&self) -> Pooler {
        if self.route.is_pooled() { Pooler::Transaction } else { Pooler::None }
    }

    /// Connects a pool of up to 16 connections ([`pool_options`](Self::pool_options)) with options
    /// you built: TLS (`ssl_mode`, root and client certificates), credentials kept out of URLs, an
    /// `application_name` that shows in `pg_stat_activity`.
    ///
    /// TLS needs the `tls` feature (rustls on *ring*, the system's root certificates). A mode that
    /// insists on TLS (`Require`, `VerifyCa`, `VerifyFull`) fails with
    /// [`FenceError::Database`](crate::FenceError::Database)`(sqlx::Error::Tls(..))` when the server offers no TLS, or when the
    /// crate was built without the feature; a certificate that does not verify (`VerifyCa`,
    /// `VerifyFull`) fails with `FenceError::Database(sqlx::Error::Io(..))` of kind `InvalidData`
    /// naming the certificate problem. `Prefer` falls back to plain TCP.
    ///
    /// Before the pool is built, one direct connection is opened (and closed) with a bound of
    /// 10 s: a server that cannot be reached fails at once with
    /// [`FenceError::Unreachable`](crate::FenceError::Unreachable) naming the host, port and cause (connection refused, a name
    /// that does not resolve, no answer in time), and one that answers but refuses the user or
    /// database fails with [`FenceError::ConnectRejected`](crate::FenceError::ConnectRejected) and the server's message, rather
    /// than the pool's "timed out while waiting for an open connection" after its acquire timeout.
    ///
    /// Note: sqlx's `PgConnectOptions` prints its password in `Debug`; never log the options.
    /// [`PgFence`]'s own `Debug` shows neither the options nor the credentials.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use sqlx::postgres::{PgConnectOptions, PgSslMode};
    /// let password = std::env::var("PGPASSWORD").unwrap_or_default();
    /// let options = PgConnectOptions::new()
    ///     .host("db.internal")
    ///     .username("billing")
    ///     .password(&password)
    ///     .database("jobs")
    ///     .ssl_mode(PgSslMode::VerifyFull)
    ///     .ssl_root_cert("/etc/ssl/certs/db-ca.pem")
    ///     .application_name("billing-worker");
    /// let fence = brokerfence::PgFence::connect_with(options).await?;
    /// # let _ = fence; Ok(()) }
    /// ```
    pub async fn connect_with(options: sqlx::postgres::PgConnectOptions) -> Result<Self> {
        Self::connect_with_timeouts(options, PgTimeouts::default()).await
    }

    /// Uses an existing pool, with the default schema. Build it from
    /// [`pool_options`](Self::pool_options), or run the fence's planner settings on its connections; add
    /// [`PgTimeouts::apply`] to its connect options for the fence's time limits (a pool built
    /// without them keeps whatever limits its connections have).
    ///
    /// Heartbeats get their own connections (up to two, opened on first use with the pool's
    /// connect options, the fence's planner settings and the default heartbeat limits of [`PgTimeouts`]),
    /// so a pool kept busy by claims and commits never delays a renewal. Outside a tokio runtime
    /// there is no such pool to open: heartbeats then share `pool`.
    /// [`heartbeat_pool`](Self::heartbeat_pool) supplies another.
    pub fn new(pool: PgPool) -> Self {
        let schema = SchemaName::default();
        let guards = Guards::default();
        let stmts = Arc::new(Statements::new(&schema, guards));
        let watch = PrimaryWatch::new(None);
        let heartbeat_pool = if tokio::runtime::Handle::try_current().is_ok() {
            PgTimeouts::default().heartbeat_pool((*pool.connect_options()).clone(), &watch)
        } else {
            pool.clone()
        };
        Self {
            pool,
            heartbeat_pool,
            schema,
            guards,
            stmts,
            max_claims: default_max_claims(),
            migration: MigrationLimits::default(),
            cursors: Arc::new(ClaimCursors::new(DEFAULT_RESCAN)),
            route: Route::direct(watch),
            locator: None,
            listen: true,
            notify: true,
            wake: Hub::local(),
        }
        .with_new_hub()
    }

    /// Caps the claims of one job at `n` (at least 1; default 20,
    /// [`RetryPolicy::max_claims`](crate::RetryPolicy::max_claims) of the default policy): a claim that would exceed it makes
    /// the job dead, with the last error "claimed N times without finishing (max_claims = M)",
    /// and answers [`Claim::Dead`](crate::Claim::Dead). Claims count takeovers of stalled or killed holders, which
    /// are not the job's fault and do not count against [`RetryPolicy::max_attempts`](crate::RetryPolicy::max_attempts): this is
    /// the cap against a job that kills every worker that runs it. Keep it well above
    /// `max_attempts` (`policy.max_claims()` suggests a value).
    pub fn max_claims(mut self, n: i64) -> Self {
        self.max_claims = n.max(1);
        self
    }

    /// How often [`claim_next`](crate::FenceStore::claim_next) of a queue scans the queue from
    /// the start at the latest (default 1 s). Otherwise, while claims come back full, a claim
    /// starts where this store's previous claims of the queue ended in `run_at` order (its claim
    /// cursor) instead of reading past every job it already handed out; a claim from the cursor
    /// that finds fewer jobs than asked scans from the start for the rest in the same call. So a
    /// job behind the cursor (a lease that ran out, a job skipped while another transaction held
    /// it locked, an enqueue that committed late) waits at most this long, and only while a
    /// backlog keeps every claim full. The cursor only says where to read: which jobs are due and
    /// whose lease ran out is still judged by the claim statement on the database clock.
    /// `Duration::ZERO` scans from the start every time (every claim then reads past the queue's
    /// running jobs).
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use std::time::Duration;
    /// let fence = brokerfence::PgFence::connect("postgres://postgres@127.0.0.1/test").await?
    ///     .claim_rescan(Duration::from_millis(250));
    /// # let _ = fence; Ok(()) }
    /// ```
    pub fn claim_rescan(mut self, every: Duration) -> Self {
        self.cursors = Arc::new(ClaimCursors::new(every));
        self
    }

    /// The cap on claims of one job (see [`max_claims`](Self::max_claims)).
    pub fn get_max_claims(&self) -> i64 {
        self.max_claims
    }

    /// How long each migration step waits for its table locks before it lets go and retries
    /// (default 200 ms). A schema change needs an exclusive lock on the table it changes; while
    /// it waits for one, every statement on that table queues behind it, heartbeats included.
    /// So [`migrate`](crate::FenceStore::migrate) waits at most this long, gives the lock up (the queue
    /// moves on), backs off (200 ms doubling to 5 s, with jitter) and tries again, for at most
    /// `give_up_after` (default 10 min) before it fails with the lock timeout. `give_up_after`
    /// also bounds each migration statement (its `statement_timeout`), the index builds
    /// (`CREATE INDEX CONCURRENTLY`, which wait for the transactions using the table but block
    /// no claim, heartbeat or commit) included: raise it for tables that take longer to index.
    pub fn migration_lock_timeout(mut self, lock_timeout: Duration, give_up_after: Duration) -> Self {
        self.migration = MigrationLimits { lock_timeout: lock_timeout.max(Duration::from_millis(1)), give_up_after };
        self
    }

    /// Renews leases on `pool` (reserved capacity: give it connections the main pool cannot use
    /// up, with the fence's planner settings and time limits that fit the lease, see
    /// [`PgTimeouts::heartbeat_statement`] and [`PgTimeouts::heartbeat_lock`]).
    pub fn heartbeat_pool(mut self, pool: PgPool) -> Self {
        self.heartbeat_pool = pool;
        self
    }

    /// Uses another schema (created by [`migrate`](crate::FenceStore::migrate)).
    pub fn schema(mut self, schema: SchemaName) -> Self {
        self.stmts = Arc::new(Statements::new(&schema, self.guards));
        self.cursors = Arc::new(ClaimCursors::new(self.cursors.rescan()));
        self.schema = schema;
        self.with_new_hub()
    }

    /// TEST ONLY (feature `guard-switches`): runs with some guards switched off.
    #[cfg(feature = "guard-switches")]
    #[doc(hidden)]
    pub fn guards(mut self, guards: Guards) -> Self {
        self.stmts = Arc::new(Statements::new(&self.schema, guards));
        self.guards = guards;
        self
    }

    /// The guards in force.
    #[doc(hidden)]
    pub fn get_guards(&self) -> Guards {
        self.guards
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The connections reserved for heartbeats.
    pub fn get_heartbeat_pool(&self) -> &PgPool {
        &self.heartbeat_pool
    }

    /// The schema.
    pub fn get_schema(&self) -> &SchemaName {
        &self.schema
    }
}
