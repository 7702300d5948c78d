//! The one direct connection per host that a connect makes before it builds its pools: whether
//! the host answers, whether it is a primary, and whether a transaction-mode pooler sits in
//! front of it ([`find_primary`]); and the connect options of each pool ([`connect_options`]).

use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use super::route::Lane;
use super::target::{PgTarget, Pooler};
use crate::error::{FenceError, Result};

/// What one direct connection attempt found out about a host.
struct Probed {
    /// The server applied the startup `options` the probe sent (false: something between
    /// dropped them, as a pooler does).
    options_applied: bool,
    /// The server takes writes (not in recovery, not read-only).
    primary: bool,
}

/// The startup option the probe sends to find out whether startup options reach PostgreSQL: a
/// custom setting the probe reads back.
const PROBE_MARK: (&str, &str) = ("brokerfence.startup_options", "applied");

/// One direct connection to host `i` of `target`, closed at once: whether it is a primary, and
/// (straight to PostgreSQL: `pooled` false) whether the startup options arrived. The real cause
/// when the server cannot be reached or refuses the connection (a pool only says that it timed
/// out).
async fn probe(target: &PgTarget, i: usize, pooled: bool) -> Result<Probed> {
    let options = if pooled {
        connect_options(target, i, true, Lane::Main)
    } else {
        connect_options(target, i, false, Lane::Main).options([PROBE_MARK])
    };
    let unreachable = |cause: String| FenceError::Unreachable {
        host: options.get_host().to_owned(),
        port: options.get_port(),
        cause,
    };
    let limit = target.connect_timeout;
    let mut conn = match tokio::time::timeout(limit, PgConnection::connect_with(&options)).await {
        Err(_) => return Err(unreachable(format!("no answer within {} s", limit.as_secs()))),
        Ok(Ok(conn)) => conn,
        // A certificate that does not verify is an I/O error of kind InvalidData: keep it as it
        // is (`FenceError::Database`), like every TLS failure.
        Ok(Err(sqlx::Error::Io(io))) if io.kind() != std::io::ErrorKind::InvalidData => {
            return Err(unreachable(lowercase_first(&io.to_string())));
        }
        // 28xxx: authentication; 3D000: no such database; 53300: too many connections.
        Ok(Err(sqlx::Error::Database(db)))
            if db.code().is_some_and(|c| c.starts_with("28") || c == "3D000" || c == "53300") =>
        {
            return Err(FenceError::ConnectRejected {
                host: options.get_host().to_owned(),
                port: options.get_port(),
                user: options.get_username().to_owned(),
                database: options.get_database().unwrap_or(options.get_username()).to_owned(),
                cause: db.message().to_owned(),
            });
        }
        // PgBouncer: "unsupported startup parameter: options" (or another parameter).
        Ok(Err(sqlx::Error::Database(db))) if db.message().contains("unsupported startup parameter") => {
            let parameter = db.message().rsplit(':').next().unwrap_or("options").trim().to_owned();
            return Err(FenceError::PoolerRefused {
                host: options.get_host().to_owned(),
                port: options.get_port(),
                parameter,
                cause: db.message().to_owned(),
            });
        }
        Ok(Err(e)) => return Err(e.into()),
    };
    // A simple query: one message, so one server session even behind a transaction pooler (an
    // extended-protocol statement outside a transaction may be parsed on one server session and
    // run on another there).
    let found = sqlx::raw_sql(
        "SELECT current_setting('brokerfence.startup_options', true), \
         NOT (pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on')",
    )
    .fetch_one(&mut conn)
    .await
    .and_then(|row| {
        use sqlx::Row as _;
        Ok((row.try_get::<Option<String>, _>(0)?, row.try_get::<bool, _>(1)?))
    });
    // Terminate politely, but never wait long for it.
    let _ = tokio::time::timeout(Duration::from_secs(1), conn.close()).await;
    let (mark, primary) = found?;
    Ok(Probed { options_applied: mark.as_deref() == Some(PROBE_MARK.1), primary })
}

/// The connect options of a `lane` pool on host `i`: straight to PostgreSQL with the lane's
/// time limits as startup options; behind a pooler with no startup options of the fence's and
/// without `extra_float_digits` (PgBouncer refuses both unless told to ignore them; the fence
/// reads no floating-point values).
pub(super) fn connect_options(target: &PgTarget, i: usize, pooled: bool, lane: Lane) -> PgConnectOptions {
    let options = target.options_for(i);
    match (pooled, lane) {
        (true, _) => options.extra_float_digits(None),
        (false, Lane::Main) => target.timeouts.apply(options),
        (false, Lane::Heartbeat) => target.timeouts.apply_heartbeat(options),
    }
}

/// Finds the host to connect to and how: the first host of `target` (in order) that is a
/// primary, and whether a transaction-mode pooler is in front of it ([`Pooler::Auto`] probes).
/// Errors: the first host's when none answered; [`FenceError::NotPrimary`] when every host that
/// answered is a standby.
pub(super) async fn find_primary(target: &PgTarget) -> Result<(usize, bool)> {
    let mut first_error = None;
    let mut answered = false;
    for i in 0..target.hosts.len() {
        match probe_host(target, i).await {
            Ok((probed, pooled)) if probed.primary => return Ok((i, pooled)),
            Ok(_) => answered = true,
            Err(e) => {
                tracing::debug!(error = %e, host = %target.hosts[i].0, port = target.hosts[i].1, "host did not answer");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if !answered => Err(e),
        _ => Err(FenceError::NotPrimary {
            hosts: target.hosts.iter().map(|(h, p)| format!("{h}:{p}")).collect::<Vec<_>>().join(", "),
        }),
    }
}

/// Probes host `i` in the pooler mode `target` asks for (finding it out for `Auto`).
async fn probe_host(target: &PgTarget, i: usize) -> Result<(Probed, bool)> {
    match target.pooler {
        Pooler::Transaction => Ok((probe(target, i, true).await?, true)),
        Pooler::None => Ok((probe(target, i, false).await?, false)),
        _ => match probe(target, i, false).await {
            Ok(probed) if probed.options_applied => Ok((probed, false)),
            Ok(_) => {
                tracing::info!(
                    host = %target.hosts[i].0,
                    port = target.hosts[i].1,
                    "startup options do not reach PostgreSQL (a connection pooler drops them): \
                     settings per transaction, no named prepared statements"
                );
                Ok((probe(target, i, true).await?, true))
            }
            Err(FenceError::PoolerRefused { parameter, .. }) => {
                tracing::info!(
                    host = %target.hosts[i].0,
                    port = target.hosts[i].1,
                    parameter,
                    "a connection pooler refused the startup options: settings per transaction, no named \
                     prepared statements"
                );
                Ok((probe(target, i, true).await?, true))
            }
            Err(e) => Err(e),
        },
    }
}

/// `s` with its first letter in lower case ("Connection refused" reads as a cause in a sentence).
fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}
