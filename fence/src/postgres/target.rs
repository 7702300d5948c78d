//! Where a [`PgFence`](super::PgFence) connects: one address or several (a libpq multi-host
//! URL), through a connection pooler or not, with which time limits ([`PgTarget`]).

use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

use super::session::PgTimeouts;
use crate::error::{FenceError, Result};

/// Whether a transaction-mode connection pooler (PgBouncer with `pool_mode = transaction`, a
/// cloud's proxy) sits between the fence and PostgreSQL. Behind such a pooler consecutive
/// transactions of one connection may run on different server sessions, so nothing may live in
/// the session: the fence then sends its time limits and planner settings at the start of each
/// transaction (`BEGIN READ WRITE; SET LOCAL …`), runs every statement in a transaction of its
/// own and prepares no named statement (each is parsed again: more round trips per statement).
///
/// Set it in the URL (`?pooler=transaction`, `none` or `auto`) or with
/// [`PgTarget::pooler`]. `Auto`, the default, finds out when connecting: PostgreSQL itself
/// takes the startup parameter `options` (where the fence sends its time limits) and applies
/// it; a pooler refuses it (PgBouncer: "unsupported startup parameter: options") or drops it
/// (PgBouncer with `options` in `ignore_startup_parameters`), and either way the fence switches
/// to `Transaction`.
///
/// ```
/// use brokerfence::{PgTarget, Pooler};
/// let target = PgTarget::parse("postgres://app@pgbouncer:6432/jobs?pooler=transaction")?;
/// assert_eq!(target.get_pooler(), Pooler::Transaction);
/// # Ok::<(), brokerfence::FenceError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Pooler {
    /// Find out when connecting (the default).
    #[default]
    Auto,
    /// Straight to PostgreSQL (or a session-mode pooler that passes `options` through):
    /// settings once per session, statements prepared once per session.
    None,
    /// Behind a transaction-mode pooler: settings per transaction, no named prepared statements.
    Transaction,
}

impl std::str::FromStr for Pooler {
    type Err = FenceError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Pooler::Auto),
            "none" | "off" | "direct" => Ok(Pooler::None),
            "transaction" => Ok(Pooler::Transaction),
            other => Err(FenceError::invalid("pooler", format!("{other:?} is not one of auto, none, transaction"))),
        }
    }
}

/// One host of a [`PgTarget`]: name (or address) and port.
pub(crate) type Host = (String, u16);

/// Where and how a [`PgFence`](super::PgFence) connects: the connect options, every host of a
/// multi-host URL in order, the pooler mode and the time limits.
///
/// A URL may list several hosts, as libpq's do: `postgres://app@db1:5432,db2:5432/jobs`. The
/// fence then connects to the first host that is a primary (accepts writes), and when that one
/// fails or turns out to be a standby it looks through the list again and moves both of its
/// pools to the primary it finds: a failover is followed without a restart. The fence always
/// needs a primary, so `target_session_attrs` may be `read-write`, `primary` or `any` (all
/// meaning "a primary"); `read-only`, `standby` and `prefer-standby` are refused. Through one
/// address (a VIP, a DNS name that an HA manager re-points) the same holds with one host: a
/// session that lands on a standby is closed and the pool connects again until the address
/// leads to the primary.
///
/// The fence's own URL parameters (`pooler`, `target_session_attrs`, `connect_timeout` in
/// seconds for each host's connection attempt, default 10) are taken out before the rest is
/// handed to sqlx.
///
/// ```
/// use brokerfence::PgTarget;
/// let target = PgTarget::parse("postgres://app@db1:5432,db2:5433/jobs?target_session_attrs=read-write")?;
/// assert_eq!(target.hosts(), vec![("db1".to_owned(), 5432), ("db2".to_owned(), 5433)]);
/// # Ok::<(), brokerfence::FenceError>(())
/// ```
#[derive(Clone)]
pub struct PgTarget {
    pub(crate) options: PgConnectOptions,
    pub(crate) hosts: Vec<Host>,
    pub(crate) pooler: Pooler,
    pub(crate) timeouts: PgTimeouts,
    pub(crate) connect_timeout: Duration,
}

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the options: sqlx prints the password in their Debug.
        f.debug_struct("PgTarget")
            .field("hosts", &self.hosts)
            .field("pooler", &self.pooler)
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

/// How long one connection attempt to one host may take (libpq's `connect_timeout`), unless the
/// URL says: 10 s.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = super::session::CONNECT_PROBE_TIMEOUT;

impl PgTarget {
    /// Parses a `postgres://` or `postgresql://` URL, with one host or several
    /// (`postgres://user@h1:5432,h2:5432/db`).
    ///
    /// ```
    /// let err = brokerfence::PgTarget::parse("postgres://a,b/db?target_session_attrs=standby").unwrap_err();
    /// assert!(err.to_string().contains("target_session_attrs"), "{err}");
    /// ```
    pub fn parse(url: &str) -> Result<Self> {
        crate::error::require_scheme(url, &["postgres", "postgresql"], super::session::PG_SCHEMES)?;
        let (scheme, rest) = url.split_once("://").ok_or_else(|| FenceError::invalid("database URL", "no ://"))?;
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        let (userinfo, host_list) = match authority.rfind('@') {
            Some(at) => (&authority[..=at], &authority[at + 1..]),
            None => ("", authority),
        };
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, query),
            None => (tail, ""),
        };
        let mut pooler = Pooler::Auto;
        let mut connect_timeout = DEFAULT_CONNECT_TIMEOUT;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match key {
                "pooler" => pooler = value.parse()?,
                "target_session_attrs" => match value {
                    "read-write" | "primary" | "any" | "" => {}
                    other => {
                        return Err(FenceError::invalid(
                            "target_session_attrs",
                            format!("{other:?}: the fence writes, so it needs a primary (read-write, primary or any)"),
                        ));
                    }
                },
                "connect_timeout" => {
                    let secs: u64 = value.parse().map_err(|_| {
                        FenceError::invalid("connect_timeout", format!("{value:?} is not a number of seconds"))
                    })?;
                    // libpq: 0 means no limit; 1 is taken as 2.
                    connect_timeout = match secs {
                        0 => Duration::from_secs(3600),
                        1 => Duration::from_secs(2),
                        n => Duration::from_secs(n),
                    };
                }
                _ => kept.push(pair),
            }
        }
        let hosts_raw: Vec<&str> = host_list.split(',').collect();
        let first = hosts_raw.first().copied().unwrap_or("");
        let query = if kept.is_empty() { String::new() } else { format!("?{}", kept.join("&")) };
        let single = format!("{scheme}://{userinfo}{first}{path}{query}");
        let options: PgConnectOptions = single.parse()?;
        let mut hosts = Vec::with_capacity(hosts_raw.len());
        for raw in &hosts_raw {
            hosts.push(split_host(raw, options.get_port())?);
        }
        if hosts.len() == 1 {
            // One host: whatever sqlx made of it (a `host=` parameter, a socket path) stands.
            hosts = vec![(options.get_host().to_owned(), options.get_port())];
        }
        Ok(Self { options, hosts, pooler, timeouts: PgTimeouts::default(), connect_timeout })
    }

    /// A target of one host from connect options you built (TLS, credentials kept out of URLs).
    ///
    /// ```
    /// let options = sqlx::postgres::PgConnectOptions::new().host("db.internal").database("jobs");
    /// let target = brokerfence::PgTarget::from_options(options);
    /// assert_eq!(target.hosts(), vec![("db.internal".to_owned(), 5432)]);
    /// ```
    pub fn from_options(options: PgConnectOptions) -> Self {
        let hosts = vec![(options.get_host().to_owned(), options.get_port())];
        Self {
            options,
            hosts,
            pooler: Pooler::Auto,
            timeouts: PgTimeouts::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// Sets the pooler mode (see [`Pooler`]).
    pub fn pooler(mut self, pooler: Pooler) -> Self {
        self.pooler = pooler;
        self
    }

    /// The pooler mode asked for.
    pub fn get_pooler(&self) -> Pooler {
        self.pooler
    }

    /// Sets the time limits (see [`PgTimeouts`]).
    pub fn timeouts(mut self, timeouts: PgTimeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// Sets PostgreSQL's `application_name` of every connection (shown in
    /// `pg_stat_activity`; PostgreSQL keeps its first 63 bytes).
    ///
    /// ```
    /// let target = brokerfence::PgTarget::parse("postgres://db/jobs")?.application_name("billing-worker");
    /// # let _ = target; Ok::<(), brokerfence::FenceError>(())
    /// ```
    pub fn application_name(mut self, name: &str) -> Self {
        self.options = self.options.application_name(name);
        self
    }

    /// The hosts, in the order they are tried.
    pub fn hosts(&self) -> Vec<(String, u16)> {
        self.hosts.clone()
    }

    /// The connect options for host number `i` (the first host for a target of one).
    pub(crate) fn options_for(&self, i: usize) -> PgConnectOptions {
        match self.hosts.get(i) {
            Some((host, port)) if self.hosts.len() > 1 => self.options.clone().host(host).port(*port),
            _ => self.options.clone(),
        }
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`; `default_port` when none is given.
fn split_host(raw: &str, default_port: u16) -> Result<Host> {
    let bad = || FenceError::invalid("database URL host", format!("{raw:?} is not HOST or HOST:PORT"));
    if raw.is_empty() {
        return Err(bad());
    }
    let (host, port) = if let Some(v6) = raw.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').ok_or_else(bad)?;
        (addr, after.strip_prefix(':'))
    } else {
        match raw.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (raw, None),
        }
    };
    let port = match port {
        Some(p) => p.parse().map_err(|_| bad())?,
        None => default_port,
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failover_target_parses_multi_host_urls() {
        let t =
            PgTarget::parse("postgres://u:p@h1:5432,[::1]:6000,h3/db?target_session_attrs=read-write&sslmode=disable")
                .unwrap();
        assert_eq!(t.hosts, vec![("h1".into(), 5432), ("::1".into(), 6000), ("h3".into(), 5432)]);
        assert_eq!(t.options.get_database(), Some("db"));
        assert_eq!(t.options.get_username(), "u");
        assert_eq!(t.options_for(1).get_host(), "::1");
        assert_eq!(t.options_for(1).get_port(), 6000);
        assert_eq!(t.pooler, Pooler::Auto);
        let one = PgTarget::parse("postgresql://h:7000/db?pooler=transaction&connect_timeout=3").unwrap();
        assert_eq!(one.hosts, vec![("h".into(), 7000)]);
        assert_eq!(one.pooler, Pooler::Transaction);
        assert_eq!(one.connect_timeout, Duration::from_secs(3));
        for bad in [
            "postgres://h1,,h2/db",
            "postgres://h1:x/db",
            "postgres://h/db?pooler=sometimes",
            "postgres://h/db?target_session_attrs=read-only",
            "mysql://h/db",
        ] {
            assert!(PgTarget::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
