//! The Redis lease key: a hint of who holds a job, following the database lease.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use fence::{JobKey, Lease, LeaseHook, Owner, QueueName};

use super::conn::RedisConnections;
use super::error::RedisError;
use super::handle::RedisConn;
use super::keys;
use super::reply;
use super::scripts::SCRIPTS;
use super::timeouts::{RedisTimeouts, bounded, bounded_op};

/// What acquiring one lease key did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquired {
    /// Set with `SET NX PX` (or it already held this very token and was refreshed).
    Set,
    /// It held an older epoch (a lapsed holder's hint, or a reservation): replaced.
    TookOver,
    /// It holds the same or a newer epoch of another token: untouched.
    Refused,
}

impl Acquired {
    /// True when the key now holds the caller's token.
    pub fn is_held(self) -> bool {
        !matches!(self, Acquired::Refused)
    }
}

/// What renewing one lease key did.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// It held the token; its expiry was pushed out.
    Renewed,
    /// The key does not exist (expired, released, or the server lost it).
    Missing,
    /// It holds another token: untouched.
    HeldByOther,
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Lease keys in the cluster slot of one anchor key (a stream or a list), with the tokens this
/// process set, so that a settled delivery can release its key by compare-and-set.
///
/// Every method is one round trip however many keys it is given, and sends nothing for none.
/// Each call gives up after the [`get_timeout`](Self::get_timeout) with [`RedisError::Timeout`];
/// [`confirm`](Self::confirm), made for the heartbeat, within a quarter of the lease at most.
///
/// ```no_run
/// # async fn demo(redis: brokerfence::redis::RedisConnections) -> Result<(), brokerfence::redis::RedisError> {
/// use std::time::Duration;
/// use brokerfence::redis::{LeaseKeys, Renewed};
/// let leases = LeaseKeys::new(redis.commands(), "orders");
/// let key = "{orders}:lease:6:orders:42".to_owned();
/// leases.acquire(&[(key.clone(), "w1:1".into(), 1)], Duration::from_secs(30)).await?;
/// // a stale holder can neither renew nor release:
/// assert_eq!(leases.renew(&[(key.clone(), "w0:0".into())], Duration::from_secs(30)).await?, [Renewed::HeldByOther]);
/// assert_eq!(leases.release(&[(key, "w0:0".into())]).await?, [false]);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct LeaseKeys {
    conn: RedisConn,
    anchor: Arc<str>,
    /// The response timeout in milliseconds, shared by every clone (a hook holds one).
    timeout_ms: Arc<AtomicU64>,
    /// Lease key → (token this process set, when it last set or renewed it).
    held: Arc<Mutex<HashMap<String, (String, Instant)>>>,
}

impl std::fmt::Debug for LeaseKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseKeys").field("anchor", &self.anchor).field("held", &self.held_count()).finish()
    }
}

impl LeaseKeys {
    /// Lease keys named after `anchor` (they share its cluster slot), on `conn` (a
    /// [`RedisConn`], or a `ConnectionManager` of your own).
    pub fn new(conn: impl Into<RedisConn>, anchor: impl Into<String>) -> Self {
        let timeout = millis(RedisTimeouts::default().get_response());
        Self {
            conn: conn.into(),
            anchor: Arc::from(anchor.into()),
            timeout_ms: Arc::new(AtomicU64::new(timeout)),
            held: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The lease keys of a source on `conns`, anchored on `anchor` (the key it reads) and bounded
    /// by the connections' response timeout.
    pub(crate) fn of_source(conns: &RedisConnections, anchor: &str) -> Self {
        Self::new(conns.commands(), anchor).timeout(conns.get_timeouts().get_response())
    }

    /// Sets the response timeout of every call (default 2 s, the default
    /// [`RedisTimeouts::get_response`]), for this value and every clone of it (a
    /// [`LeaseKeyHook`] built from it included).
    ///
    /// ```
    /// # fn demo(redis: brokerfence::redis::RedisConnections) {
    /// use std::time::Duration;
    /// use brokerfence::redis::LeaseKeys;
    /// let leases = LeaseKeys::new(redis.commands(), "orders").timeout(Duration::from_millis(500));
    /// assert_eq!(leases.get_timeout(), Duration::from_millis(500));
    /// # }
    /// ```
    pub fn timeout(self, timeout: Duration) -> Self {
        self.set_timeout(timeout);
        self
    }

    /// Like [`timeout`](Self::timeout), through a shared reference.
    pub(crate) fn set_timeout(&self, timeout: Duration) {
        self.timeout_ms.store(millis(timeout), Ordering::Relaxed);
    }

    /// The response timeout of every call (2 s unless [`timeout`](Self::timeout) set another).
    ///
    /// ```
    /// # fn demo(redis: brokerfence::redis::RedisConnections) {
    /// use std::time::Duration;
    /// let leases = brokerfence::redis::LeaseKeys::new(redis.commands(), "orders");
    /// assert_eq!(leases.get_timeout(), Duration::from_secs(2));
    /// # }
    /// ```
    pub fn get_timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// The bound of a call made for the heartbeat of leases of `lease`: the timeout, at most a
    /// quarter of the lease ([`RedisTimeouts::hint`]).
    pub(crate) fn hint_timeout(&self, lease: Duration) -> Duration {
        RedisTimeouts::default().response(self.get_timeout()).hint(lease)
    }

    /// The anchor key.
    pub fn anchor(&self) -> &str {
        &self.anchor
    }

    /// The lease key of job `key` of `queue`.
    pub fn key(&self, queue: &QueueName, key: &JobKey) -> String {
        keys::lease_key(&self.anchor, queue, key)
    }

    /// How many keys this process holds a token for.
    pub(crate) fn held_count(&self) -> usize {
        self.held.lock().map(|h| h.len()).unwrap_or(0)
    }

    /// The token this process set in `key`, if any.
    pub fn held_token(&self, key: &str) -> Option<String> {
        self.held.lock().ok()?.get(key).map(|(t, _)| t.clone())
    }

    pub(crate) fn remember(&self, key: &str, token: &str) {
        if let Ok(mut h) = self.held.lock() {
            h.insert(key.to_owned(), (token.to_owned(), Instant::now()));
        }
    }

    pub(crate) fn forget(&self, key: &str) -> Option<String> {
        self.held.lock().ok()?.remove(key).map(|(t, _)| t)
    }

    /// Forgets tokens not set or renewed for `age`: their keys expired in Redis long ago (an
    /// attempt whose commit was fenced or failed is never settled with the broker, so nothing
    /// else would remove them).
    pub(crate) fn prune(&self, age: Duration) {
        if let Ok(mut h) = self.held.lock() {
            h.retain(|_, (_, at)| at.elapsed() < age);
        }
    }

    /// The value of `key` (its holder's token), for inspection.
    pub async fn holder(&self, key: &str) -> Result<Option<String>, RedisError> {
        let mut conn = self.conn.clone();
        bounded("GET", self.get_timeout(), ::redis::cmd("GET").arg(key).query_async::<Option<String>>(&mut conn)).await
    }

    /// Acquires lease keys: `(key, token, epoch)` each, expiring after `ttl`. A key held by an older
    /// epoch is taken over; one held by the same or a newer epoch is refused.
    pub async fn acquire(&self, items: &[(String, String, i64)], ttl: Duration) -> Result<Vec<Acquired>, RedisError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = SCRIPTS.acquire.prepare_invoke();
        inv.arg(millis(ttl));
        for (k, t, _) in items {
            inv.key(k.as_str()).arg(t.as_str());
        }
        for (_, _, e) in items {
            inv.arg(*e);
        }
        let mut conn = self.conn.clone();
        let v: ::redis::Value = bounded("EVALSHA acquire", self.get_timeout(), inv.invoke_async(&mut conn)).await?;
        let codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA acquire", e))?;
        let out: Vec<Acquired> = codes
            .into_iter()
            .map(|c| match c {
                1 => Acquired::Set,
                2 => Acquired::TookOver,
                _ => Acquired::Refused,
            })
            .collect();
        for ((k, t, _), a) in items.iter().zip(&out) {
            if a.is_held() {
                self.remember(k, t);
            } else {
                self.forget(k);
            }
        }
        Ok(out)
    }

    /// Renews lease keys `(key, token)` to `ttl` where they still hold the token
    /// (`GET == token → PEXPIRE`). Nothing else is touched.
    pub async fn renew(&self, items: &[(String, String)], ttl: Duration) -> Result<Vec<Renewed>, RedisError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = SCRIPTS.renew.prepare_invoke();
        inv.arg(millis(ttl));
        for (k, t) in items {
            inv.key(k.as_str()).arg(t.as_str());
        }
        let mut conn = self.conn.clone();
        let v: ::redis::Value = bounded("EVALSHA renew", self.get_timeout(), inv.invoke_async(&mut conn)).await?;
        let codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA renew", e))?;
        Ok(codes
            .into_iter()
            .map(|c| match c {
                1 => Renewed::Renewed,
                0 => Renewed::Missing,
                _ => Renewed::HeldByOther,
            })
            .collect())
    }

    /// Releases lease keys `(key, token)` where they still hold the token (`GET == token → DEL`).
    /// True per key that was deleted.
    pub async fn release(&self, items: &[(String, String)]) -> Result<Vec<bool>, RedisError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        for (k, t) in items {
            if self.held_token(k).as_deref() == Some(t.as_str()) {
                self.forget(k);
            }
        }
        let mut inv = SCRIPTS.release.prepare_invoke();
        for (k, t) in items {
            inv.key(k.as_str()).arg(t.as_str());
        }
        let mut conn = self.conn.clone();
        let v: ::redis::Value = bounded("EVALSHA release", self.get_timeout(), inv.invoke_async(&mut conn)).await?;
        let codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA release", e))?;
        Ok(codes.into_iter().map(|c| c == 1).collect())
    }

    /// Reserves lease keys before the database claim (epoch 0, `SET NX PX`): a reservation never
    /// displaces a holder, and any claimed epoch takes it over.
    pub async fn reserve(&self, keys: &[String], owner: &Owner, ttl: Duration) -> Result<Vec<Acquired>, RedisError> {
        let tok = keys::token(owner, 0);
        let items: Vec<(String, String, i64)> = keys.iter().map(|k| (k.clone(), tok.clone(), 0)).collect();
        self.acquire(&items, ttl).await
    }

    /// The database just confirmed these leases (`(lease key, lease)`): renew the keys this process
    /// already holds with the same token, and acquire the rest (first confirmation, a key that
    /// vanished with a server restart, a reservation to upgrade). Each key expires after its
    /// lease's remaining time on the database clock. At most two round trips; one in steady state.
    ///
    /// Made for the heartbeat: the whole call gives up after the
    /// [`get_timeout`](Self::get_timeout), at most a quarter of the longest lease
    /// ([`RedisTimeouts::hint`]), with [`RedisError::Timeout`]; the next confirmed heartbeat sends the newest renewal.
    pub async fn confirm(&self, leases: &[(String, &Lease)]) -> Result<(), RedisError> {
        let longest = leases.iter().map(|(_, l)| l.ttl).max().unwrap_or_default();
        bounded_op("lease key renewal", self.hint_timeout(longest), self.confirm_unbounded(leases)).await
    }

    async fn confirm_unbounded(&self, leases: &[(String, &Lease)]) -> Result<(), RedisError> {
        let mut renew = Vec::new();
        let mut renew_meta = Vec::new();
        let mut acquire = Vec::new();
        let mut ttl = Duration::ZERO;
        for (k, l) in leases {
            let tok = keys::token(&l.owner, l.epoch);
            ttl = ttl.max(l.ttl);
            if self.held_token(k).as_deref() == Some(tok.as_str()) {
                renew.push((k.clone(), tok));
                renew_meta.push(l.epoch);
            } else {
                acquire.push((k.clone(), tok, l.epoch));
            }
        }
        // One ttl per call: the longest remaining lease of the batch (they were renewed together).
        let ttl = ttl.max(Duration::from_millis(1));
        let (renewed, acquired) = tokio::join!(self.renew(&renew, ttl), self.acquire(&acquire, ttl));
        let renewed = renewed?;
        let mut again = Vec::new();
        for (((k, t), e), r) in renew.into_iter().zip(renew_meta).zip(renewed) {
            if r == Renewed::Renewed {
                self.remember(&k, &t);
            } else {
                tracing::debug!(key = %k, result = ?r, "lease key not renewed; acquiring it again");
                again.push((k, t, e));
            }
        }
        let refused = acquired?.iter().filter(|a| !a.is_held()).count()
            + self.acquire(&again, ttl).await?.iter().filter(|a| !a.is_held()).count();
        if refused > 0 {
            // The database decides; a newer epoch in Redis means this worker is about to learn it lost.
            tracing::warn!(refused, "lease keys held by a newer epoch although the database confirmed this worker");
        }
        self.prune(ttl.saturating_mul(4).max(Duration::from_secs(60)));
        Ok(())
    }

    /// Releases the keys this process holds among `keys` (compare-and-set on its own token).
    pub async fn release_held(&self, keys: &[String]) -> Result<(), RedisError> {
        let items: Vec<(String, String)> = keys.iter().filter_map(|k| self.forget(k).map(|t| (k.clone(), t))).collect();
        self.release(&items).await.map(|_| ())
    }

    /// Shortens a held key to `ttl` (compare-and-set) and stops tracking it: the item it guards
    /// becomes reclaimable when it expires.
    pub async fn shorten(&self, key: &str, ttl: Duration) -> Result<bool, RedisError> {
        let Some(tok) = self.forget(key) else { return Ok(false) };
        let r = self.renew(&[(key.to_owned(), tok)], ttl).await?;
        Ok(r.first() == Some(&Renewed::Renewed))
    }

    /// Releases the keys of leases the database found lost (compare-and-set on their own tokens,
    /// so a newer holder's key is never touched).
    /// Made for the heartbeat: bounded like [`confirm`](Self::confirm).
    pub async fn release_lost(&self, leases: &[(String, &Lease)]) -> Result<(), RedisError> {
        let items: Vec<(String, String)> =
            leases.iter().map(|(k, l)| (k.clone(), keys::token(&l.owner, l.epoch))).collect();
        let longest = leases.iter().map(|(_, l)| l.ttl).max().unwrap_or_default();
        bounded_op("lease key release", self.hint_timeout(longest), self.release(&items)).await.map(|_| ())
    }
}

/// A [`LeaseHook`] that keeps lease keys in step with the database: on every confirmed heartbeat
/// it renews (or acquires) the keys of the confirmed leases in one script call, and releases the
/// keys of lost leases by compare-and-set.
///
/// ```no_run
/// # fn demo(retrofit: &brokerfence::Retrofit, redis: &brokerfence::redis::RedisConnections) {
/// use std::sync::Arc;
/// use brokerfence::redis::{LeaseKeyHook, LeaseKeys};
/// let hook = LeaseKeyHook::new(LeaseKeys::new(redis.commands(), "jobs"));
/// retrofit.supervisor().add_hook(Arc::new(hook));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct LeaseKeyHook {
    keys: LeaseKeys,
}

impl LeaseKeyHook {
    /// A hook over `keys`.
    pub fn new(keys: LeaseKeys) -> Self {
        Self { keys }
    }
}

#[async_trait]
impl LeaseHook for LeaseKeyHook {
    async fn confirmed(&self, leases: &[Lease]) {
        let pairs: Vec<(String, &Lease)> = leases.iter().map(|l| (self.keys.key(&l.queue, &l.key), l)).collect();
        if let Err(e) = self.keys.confirm(&pairs).await {
            tracing::warn!(error = %e, n = pairs.len(), "could not renew lease keys (the database lease stands)");
        }
    }

    async fn lost(&self, leases: &[Lease]) {
        let pairs: Vec<(String, &Lease)> = leases.iter().map(|l| (self.keys.key(&l.queue, &l.key), l)).collect();
        if let Err(e) = self.keys.release_lost(&pairs).await {
            tracing::warn!(error = %e, "could not release lease keys of lost leases (they expire)");
        }
    }
}
