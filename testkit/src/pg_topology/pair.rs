//! [`PgPair`]: a primary and one streaming standby whose replication runs through a [`Relay`].

use std::time::Duration;

use super::relay::Relay;
use super::server::PgServer;
use super::sys::TempRoot;

/// How long [`PgPair::start`] waits for the standby to stream (and to be the synchronous one).
const STREAMING_LIMIT: Duration = Duration::from_secs(30);

/// How long [`PgPair::wait_caught_up`] waits for the standby's replay.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(30);

/// Whether the standby is asynchronous or synchronous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// Commits return after the primary's own WAL flush (`synchronous_standby_names` empty).
    Async,
    /// `synchronous_standby_names = 'standby'`, `synchronous_commit = on`: a commit returns once the standby has flushed it.
    Sync,
    /// `synchronous_standby_names = 'standby'`, `synchronous_commit = remote_apply`: a commit returns once the standby has replayed it (visible there).
    SyncRemoteApply,
}

impl Replication {
    /// The primary's own settings for this mode (its `postgresql.auto.conf`, which the standby's
    /// copy drops, so a promoted standby commits without waiting).
    fn primary_settings(self) -> &'static str {
        match self {
            Replication::Async => "",
            Replication::Sync => "synchronous_standby_names = 'standby'\nsynchronous_commit = 'on'\n",
            Replication::SyncRemoteApply => {
                "synchronous_standby_names = 'standby'\nsynchronous_commit = 'remote_apply'\n"
            }
        }
    }
}

/// A primary and one streaming standby whose replication goes through `link` (cut it to cut replication).
pub struct PgPair {
    /// The primary (its name `primary`).
    pub primary: PgServer,
    /// The standby (its name and `application_name` `standby`), hot: it answers read-only queries.
    pub standby: PgServer,
    /// The relay the standby's `primary_conninfo` points at, forwarding to the primary.
    pub link: Relay,
    replication: Replication,
}

impl PgPair {
    /// A primary, the link relay in front of it, and a standby made by `pg_basebackup` through the link; returns once the standby streams (for a synchronous pair: is the `sync` one).
    pub async fn start(replication: Replication) -> PgPair {
        let root = TempRoot::new();
        let primary = PgServer::primary_in(root.clone(), "primary", replication.primary_settings()).await;
        let link = Relay::start(primary.addr()).await;
        let standby = PgServer::standby_in(root, "standby", link.port()).await;
        let pair = PgPair { primary, standby, link, replication };
        pair.wait_streaming().await;
        pair
    }

    /// The replication mode the pair was started with.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// Waits (up to 30 s) until the primary's `pg_stat_replication` shows the standby `streaming` (and, for a synchronous pair, `sync`): after `start`, or after the link heals.
    pub async fn wait_streaming(&self) {
        let sync = if self.replication == Replication::Async { "" } else { " AND sync_state = 'sync'" };
        let sql = format!(
            "SELECT count(*) FROM pg_stat_replication \
             WHERE application_name = 'standby' AND state = 'streaming'{sync}"
        );
        let check = || async { (self.primary.psql("postgres", &sql).await != "0").then_some(()) };
        let failure = || {
            format!(
                "pg_topology: the standby is not streaming ({:?}) within {STREAMING_LIMIT:?}\n\
                 primary: {}\nstandby: {}",
                self.replication,
                self.primary.log_tail(),
                self.standby.log_tail()
            )
        };
        crate::wait::until(STREAMING_LIMIT, check, failure).await;
    }

    /// Waits (up to 30 s) until the standby has replayed everything the primary has written so far.
    pub async fn wait_caught_up(&self) {
        let target = self.primary.psql("postgres", "SELECT pg_current_wal_lsn()").await;
        let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{target}'::pg_lsn");
        let check = || async { (self.standby.psql("postgres", &sql).await == "t").then_some(()) };
        let failure = || {
            format!(
                "pg_topology: the standby has not replayed up to {target} within {CATCH_UP_LIMIT:?}\n\
                 primary: {}\nstandby: {}",
                self.primary.log_tail(),
                self.standby.log_tail()
            )
        };
        crate::wait::until(CATCH_UP_LIMIT, check, failure).await;
    }
}
