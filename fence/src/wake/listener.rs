//! The listener task of a PostgreSQL hub: `LISTEN` on the schema's channel over a connection
//! of its own (a one-connection pool made from the fence pool's current connect options, so
//! it takes no place in the fence's pool and follows the primary the pool follows), checked
//! when quiet, reconnected with backoff when lost.

use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::Hub;

/// The bound on connecting, on `LISTEN`, and on a ping's round trip.
const CONNECT_LIMIT: Duration = Duration::from_secs(10);
/// After this long without a notification the listener pings itself: a notification sent
/// through the fence's pool must come back within [`PING_LIMIT`], or the connection is
/// taken for dead (a peer gone without a word, a network path that dropped the idle
/// connection, a primary the fence's pool no longer uses) and replaced.
const QUIET: Duration = Duration::from_secs(15);
const PING_LIMIT: Duration = Duration::from_secs(5);
/// A connection that lasted this long resets the reconnect backoff; one cut sooner (an idle
/// session killer) is reconnected after a growing pause, so resyncs do not come in a storm.
const STABLE: Duration = Duration::from_secs(30);
/// The payload of a ping (ignored by [`Hub::deliver`]).
pub(super) const PING: &str = "ping";

/// Marks the hub as not listening (and the listener as not started) when the task ends,
/// however it ends: the next subscription starts another.
struct Ended(Weak<Hub>);

impl Drop for Ended {
    fn drop(&mut self) {
        if let Some(h) = self.0.upgrade() {
            h.listening.store(false, Ordering::Release);
            h.started.store(false, Ordering::Release);
        }
    }
}

pub(super) async fn run(hub: Weak<Hub>, stop: CancellationToken) {
    let _ended = Ended(hub.clone());
    let mut failures = 0u32;
    loop {
        if failures > 0 {
            let wait = Duration::from_millis(100u64 << failures.min(6)).min(Duration::from_secs(5));
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        let Some((pool, channel)) =
            hub.upgrade().and_then(|h| h.listen.as_ref().map(|l| (l.pool.clone(), l.channel.clone())))
        else {
            return;
        };
        if pool.is_closed() {
            return;
        }
        let connected = tokio::select! {
            () = stop.cancelled() => return,
            c = tokio::time::timeout(CONNECT_LIMIT, connect(&pool, &channel)) => c,
        };
        let mut listener = match connected {
            Ok(Ok(l)) => l,
            other => {
                failures = failures.saturating_add(1);
                let why = match other {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {CONNECT_LIMIT:?}"),
                };
                tracing::warn!(channel, error = why, "wake-up listener: cannot listen; consumers poll meanwhile");
                continue;
            }
        };
        let connected_at = Instant::now();
        match hub.upgrade() {
            Some(h) => {
                h.listening.store(true, Ordering::Release);
                // Whatever was committed while nobody listened is claimed now.
                h.resync();
            }
            None => return,
        }
        tracing::debug!(channel, "wake-up listener: listening");
        let lost = loop {
            let next = tokio::select! {
                () = stop.cancelled() => {
                    let _ = tokio::time::timeout(CONNECT_LIMIT, listener.unlisten_all()).await;
                    return;
                }
                n = tokio::time::timeout(QUIET, listener.try_recv()) => n,
            };
            let next = match next {
                Ok(n) => n,
                Err(_quiet) => match ping(&pool, &channel, &mut listener).await {
                    Ok(n) => n,
                    Err(why) => break why,
                },
            };
            let Some(h) = hub.upgrade() else { return };
            match next {
                Ok(Some(n)) => h.deliver(n.payload()),
                Ok(None) => break "connection lost".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        if let Some(h) = hub.upgrade() {
            h.listening.store(false, Ordering::Release);
        }
        failures = if connected_at.elapsed() >= STABLE { 1 } else { failures.saturating_add(1) };
        tracing::warn!(channel, error = lost, "wake-up listener: reconnecting (consumers poll meanwhile)");
    }
}

/// A quiet listener's check: a notification sent through the fence's pool must arrive.
async fn ping(
    pool: &sqlx::PgPool,
    channel: &str,
    listener: &mut PgListener,
) -> Result<Result<Option<sqlx::postgres::PgNotification>, sqlx::Error>, String> {
    let sent = tokio::time::timeout(
        PING_LIMIT,
        sqlx::query("SELECT pg_notify($1, $2)").persistent(false).bind(channel).bind(PING).execute(pool),
    )
    .await;
    match sent {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(format!("ping not sent: {e}")),
        Err(_) => return Err(format!("ping not sent within {PING_LIMIT:?}")),
    }
    tokio::time::timeout(PING_LIMIT, listener.try_recv())
        .await
        .map_err(|_| format!("no notification within {PING_LIMIT:?} of a ping"))
}

async fn connect(pool: &sqlx::PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let own = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(CONNECT_LIMIT)
        .connect_lazy_with((*pool.connect_options()).clone());
    let mut listener = PgListener::connect_with(&own).await?;
    // A lost connection comes back as `Ok(None)` from `try_recv`, and this task connects
    // again itself (after a pause, with a resync).
    listener.eager_reconnect(false);
    listener.listen(channel).await?;
    Ok(listener)
}
