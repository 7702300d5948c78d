//! Following the primary of a multi-host target: when the fence's statements find the server
//! gone or read-only, or a new connection lands on a standby, look through the hosts again and
//! move the pools to the primary.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio::sync::Notify;

use super::probe::{connect_options, find_primary};
use super::route::{Lane, PrimaryWatch};
use super::target::{PgTarget, Pooler};

/// The shortest pause between two looks through the hosts.
const MIN_PAUSE: Duration = Duration::from_millis(250);

/// After a look that found the primary where the pools already are, how long the locator
/// waits before it looks again.
const QUIET_AFTER_FALSE_ALARM: Duration = Duration::from_secs(2);

/// How long a look at each host may take while following (the target's connect timeout when
/// shorter): a host that does not answer must not hold up finding the one that does.
const PROBE_LIMIT: Duration = Duration::from_secs(3);

/// The task that follows the primary; stopped when the last [`PgFence`](super::PgFence) clone
/// that holds it is dropped (it holds the pools, so it must not outlive the fence).
#[derive(Debug)]
pub(super) struct Locator {
    task: tokio::task::AbortHandle,
}

impl Drop for Locator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Locator {
    /// Starts following from host `current` of `target` (found by the connect), for the pools
    /// `main` and `heartbeat` (in the pooler mode `pooled`).
    pub(super) fn spawn(
        target: PgTarget,
        mut current: usize,
        pooled: bool,
        main: PgPool,
        heartbeat: PgPool,
        watch: Arc<PrimaryWatch>,
        notify: Arc<Notify>,
    ) -> Self {
        let mut target = target.pooler(if pooled { Pooler::Transaction } else { Pooler::None });
        target.connect_timeout = target.connect_timeout.min(PROBE_LIMIT);
        let task = tokio::spawn(async move {
            loop {
                notify.notified().await;
                // Keep looking (at most every MIN_PAUSE, then every second) until a primary
                // answers: the failover may take a while.
                let mut pause = MIN_PAUSE;
                loop {
                    tokio::time::sleep(pause).await;
                    match find_primary(&target).await {
                        Ok((found, _)) => {
                            if found == current {
                                // A false alarm (a slow acquire under load, a blip): look again
                                // at most every QUIET_AFTER_FALSE_ALARM.
                                tokio::time::sleep(QUIET_AFTER_FALSE_ALARM).await;
                            } else {
                                let (host, port) = &target.hosts[found];
                                tracing::warn!(
                                    host = %host,
                                    port,
                                    "following the primary: the fence's pools connect to this host from now on"
                                );
                                main.set_connect_options(connect_options(&target, found, pooled, Lane::Main));
                                heartbeat.set_connect_options(connect_options(&target, found, pooled, Lane::Heartbeat));
                                watch.distrust_open_connections();
                                current = found;
                            }
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "looking for the primary: none answers yet");
                            pause = Duration::from_secs(1);
                        }
                    }
                }
            }
        });
        Self { task: task.abort_handle() }
    }
}
