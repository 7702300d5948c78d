//! The Redis calls behind [`StreamSource`]: the consumer group, reads of new entries, `XAUTOCLAIM`
//! of stalled ones, decoding, reclaim and release, and the heartbeat's lease-key renewal.

use std::sync::Arc;
use std::time::Duration;

use ::redis::Value;
use fence::{JobKey, Lease};
use tokio::time::Instant;

use crate::redis::error::RedisError;
use crate::redis::keys::token;
use crate::redis::lease::millis;
use crate::redis::reply::{self, RawEntry};
use crate::redis::scripts::SCRIPTS;
use crate::redis::timeouts::bounded;
use crate::source::Incoming;

use super::{KeyFrom, State, StreamDelivery, StreamSource};

impl StreamSource {
    pub(super) fn response(&self) -> Duration {
        self.conns.get_timeouts().get_response()
    }

    pub(super) fn with_state<T>(&self, f: impl FnOnce(&mut State) -> T) -> Option<T> {
        self.state.lock().ok().map(|mut s| f(&mut s))
    }

    pub(super) fn consumer(&self) -> Option<String> {
        self.with_state(|s| s.consumer.clone()).flatten()
    }

    pub(super) fn effective_visibility(&self) -> Duration {
        self.with_state(|s| s.visibility).unwrap_or(Duration::from_secs(30))
    }

    pub(super) async fn ensure_group(&self) -> Result<(), RedisError> {
        if self.with_state(|s| s.group_ready).unwrap_or(false) {
            return Ok(());
        }
        let mut create = ::redis::cmd("XGROUP");
        create.arg("CREATE").arg(&self.stream).arg(&self.group).arg(&self.start_id).arg("MKSTREAM");
        let mut conn = self.conns.commands();
        let r = bounded("XGROUP CREATE", self.response(), create.query_async::<Value>(&mut conn)).await;
        match r {
            Ok(_) => tracing::info!(stream = %self.stream, group = %self.group, "consumer group created"),
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
        self.with_state(|s| s.group_ready = true);
        Ok(())
    }

    pub(super) fn group_lost(&self, e: &RedisError) -> bool {
        if e.code() == Some("NOGROUP") {
            tracing::warn!(stream = %self.stream, group = %self.group, "consumer group is gone; creating it again");
            self.with_state(|s| {
                s.group_ready = false;
                s.cursor = "0-0".into();
            });
            true
        } else {
            false
        }
    }

    /// Entries idle past the visibility hint, with their delivery counts.
    pub(super) async fn autoclaim(
        &self,
        consumer: &str,
        max: usize,
    ) -> Result<Vec<(RawEntry, Option<i64>)>, RedisError> {
        let (cursor, visibility) = match self.with_state(|s| (s.cursor.clone(), s.visibility)) {
            Some(v) => v,
            None => return Ok(Vec::new()),
        };
        let mut cmd = ::redis::cmd("XAUTOCLAIM");
        cmd.arg(&self.stream).arg(&self.group).arg(consumer).arg(millis(visibility)).arg(&cursor).arg("COUNT").arg(max);
        let mut conn = self.conns.commands();
        let v: Value = bounded("XAUTOCLAIM", self.response(), cmd.query_async(&mut conn)).await?;
        let (next, claimed, deleted) = reply::autoclaim(v).map_err(|e| RedisError::reply("XAUTOCLAIM", e))?;
        let every = self.autoclaim_every;
        self.with_state(|s| {
            s.next_autoclaim = Some(if next == "0-0" { Instant::now() + every } else { Instant::now() });
            s.cursor = next;
        });
        if !deleted.is_empty() {
            tracing::info!(n = deleted.len(), "pending entries deleted from the stream were dropped by XAUTOCLAIM");
        }
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        tracing::info!(n = claimed.len(), stream = %self.stream, "auto-claimed idle entries");
        let counts = self.delivery_counts(consumer, &claimed).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "could not read delivery counts; not dead-lettering this batch by count");
            Vec::new()
        });
        Ok(claimed
            .into_iter()
            .map(|e| {
                let count = counts.iter().find(|(id, _, _)| *id == e.id).map(|(_, _, c)| *c);
                (e, count)
            })
            .collect())
    }

    pub(super) async fn delivery_counts(
        &self,
        consumer: &str,
        entries: &[RawEntry],
    ) -> Result<Vec<(String, String, i64)>, RedisError> {
        let ids: Vec<(u64, u64)> = entries.iter().filter_map(|e| parse_id(&e.id)).collect();
        let (Some(lo), Some(hi)) = (ids.iter().min(), ids.iter().max()) else { return Ok(Vec::new()) };
        let mut cmd = ::redis::cmd("XPENDING");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(format!("{}-{}", lo.0, lo.1))
            .arg(format!("{}-{}", hi.0, hi.1))
            .arg(entries.len().saturating_mul(4).max(1000))
            .arg(consumer);
        let mut conn = self.conns.commands();
        let v: Value = bounded("XPENDING", self.response(), cmd.query_async(&mut conn)).await?;
        reply::pending(v).map_err(|e| RedisError::reply("XPENDING", e))
    }

    pub(super) async fn read_new(
        &self,
        consumer: &str,
        count: usize,
        block: bool,
    ) -> Result<Vec<RawEntry>, RedisError> {
        let mut cmd = ::redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.group).arg(consumer).arg("COUNT").arg(count);
        if block {
            cmd.arg("BLOCK").arg(millis(self.block));
        }
        cmd.arg("STREAMS").arg(&self.stream).arg(">");
        let (mut conn, limit) = if block {
            (self.conns.blocking(), self.conns.get_timeouts().blocking(self.block))
        } else {
            (self.conns.commands(), self.response())
        };
        let v: Value = bounded("XREADGROUP", limit, cmd.query_async(&mut conn)).await?;
        reply::read_group(v).map_err(|e| RedisError::reply("XREADGROUP", e))
    }

    pub(super) fn decode(&self, entry: RawEntry, deliveries: Option<i64>) -> Incoming<StreamDelivery> {
        let id: Arc<str> = Arc::from(entry.id.as_str());
        let bad = |reason: String| Incoming::Malformed {
            delivery: StreamDelivery {
                id: id.clone(),
                lease_key: None,
                #[cfg(feature = "otel")]
                trace: None,
            },
            reason,
        };
        if let Some(n) = deliveries.filter(|n| *n > self.max_deliveries) {
            // A hint, like visibility: auto-claims also count a retry backoff longer than the
            // visibility and a live holder's entry. Only the database dead-letters (its claim
            // answers `Dead`, or a fenced failure finds the job out of attempts).
            tracing::warn!(
                id = %entry.id,
                deliveries = n,
                max_deliveries = self.max_deliveries,
                stream = %self.stream,
                "entry delivered more often than expected; the database decides whether it is dead"
            );
        }
        if entry.fields.is_none() {
            return bad("entry has no data (deleted from the stream)".into());
        }
        let key = match &self.key_from {
            KeyFrom::EntryId => JobKey::try_from(entry.id.as_str()),
            KeyFrom::Field(f) => match entry.field(f) {
                Some(v) => JobKey::from_bytes(v),
                None => return bad(format!("entry has no `{f}` field for its job key")),
            },
        };
        let key = match key {
            Ok(k) => k,
            Err(e) => return bad(format!("entry has no usable job key: {e}")),
        };
        let Some(payload) = entry.field(&self.body_field).map(<[u8]>::to_vec) else {
            return bad(format!("entry has no `{}` field", self.body_field));
        };
        let lease_key = Some(Arc::from(self.leases.key(&self.queue, &key)));
        #[cfg(feature = "otel")]
        let trace = {
            let field = |name: &str| entry.field(name).and_then(|v| std::str::from_utf8(v).ok());
            let read = fence::otel::TraceContext::read(
                field(fence::otel::TRACEPARENT),
                field(fence::otel::TRACESTATE),
                "stream entry",
            );
            read.map(Arc::new)
        };
        let delivery = StreamDelivery {
            id,
            lease_key,
            #[cfg(feature = "otel")]
            trace,
        };
        Incoming::Unclaimed { delivery, key, payload }
    }

    /// `XCLAIM` to this consumer without counting a delivery, with the idle time set so that the
    /// entry becomes auto-claimable after `after`.
    pub(super) async fn reclaim_after(&self, d: &StreamDelivery, after: Duration) -> Result<(), RedisError> {
        let Some(consumer) = self.consumer() else { return Ok(()) };
        let idle = self.effective_visibility().saturating_sub(after);
        let mut cmd = ::redis::cmd("XCLAIM");
        cmd.arg(&self.stream)
            .arg(&self.group)
            .arg(consumer)
            .arg(0)
            .arg(d.id())
            .arg("IDLE")
            .arg(u64::try_from(idle.as_millis()).unwrap_or(u64::MAX))
            .arg("JUSTID");
        let mut conn = self.conns.commands();
        let _: Value = bounded("XCLAIM", self.response(), cmd.query_async(&mut conn)).await?;
        Ok(())
    }

    pub(super) async fn release(&self, d: &StreamDelivery) {
        if let Some(k) = d.lease_key()
            && let Err(e) = self.leases.release_held(&[k.to_owned()]).await
        {
            tracing::warn!(error = %e, "could not release a lease key (it expires)");
        }
    }
}

impl StreamSource {
    /// The heartbeat's hint for entries whose leases the database just confirmed: one script
    /// call ([`SCRIPTS.stream_extend`](crate::redis::scripts)) that, per job, takes or renews the lease
    /// key and `XCLAIM`s the entry (`JUSTID`, idle back to 0) only while the lease is still the
    /// newest Redis knows of: a lease key holding a newer epoch, or (for a key this worker did
    /// not hold) an entry another consumer has taken over since, means this renewal is stale and
    /// the entry is left alone. Only the newest lease per job is used (the highest epoch; the last
    /// delivery given for it). Bounded by [`RedisTimeouts::hint`](crate::redis::RedisTimeouts::hint).
    pub(super) async fn extend_newest(&self, leases: &[(Lease, StreamDelivery)]) -> Result<(), RedisError> {
        // The newest (lease, delivery) per lease key.
        let mut newest: Vec<(&str, &Lease, &StreamDelivery)> = Vec::with_capacity(leases.len());
        for (l, d) in leases {
            let Some(k) = d.lease_key() else { continue };
            match newest.iter_mut().find(|(key, _, _)| *key == k) {
                Some(slot) if slot.1.epoch <= l.epoch => *slot = (k, l, d),
                Some(_) => {}
                None => newest.push((k, l, d)),
            }
        }
        let Some((_, first, _)) = newest.first() else { return Ok(()) };
        let consumer = first.owner.as_str().to_owned();
        let longest = newest.iter().map(|(_, l, _)| l.ttl).max().unwrap_or_default();
        let ttl = longest.max(Duration::from_millis(1));
        let mut inv = SCRIPTS.stream_extend.prepare_invoke();
        inv.key(&self.stream).arg(&self.group).arg(&consumer).arg(millis(ttl));
        for (k, _, d) in &newest {
            inv.key(*k).arg(d.id());
        }
        let tokens: Vec<String> = newest.iter().map(|(_, l, _)| token(&l.owner, l.epoch)).collect();
        for t in &tokens {
            inv.arg(t.as_str());
        }
        for (_, l, _) in &newest {
            inv.arg(l.epoch);
        }
        let limit = self.conns.get_timeouts().hint(longest);
        let mut conn = self.conns.commands();
        let v: Value = bounded("EVALSHA stream extend", limit, inv.invoke_async(&mut conn)).await?;
        let codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA stream extend", e))?;
        let (mut stale, mut taken_over, mut gone) = (0, 0, 0);
        for (((k, l, d), t), code) in newest.iter().zip(&tokens).zip(codes) {
            match code {
                0 => {
                    stale += 1;
                    self.leases.forget(k);
                    tracing::warn!(id = d.id(), key = %l.key, epoch = l.epoch, "lease key holds a newer epoch: this renewal is stale, the entry is left alone");
                }
                3 => {
                    taken_over += 1;
                    self.leases.remember(k, t);
                }
                -1 => {
                    gone += 1;
                    self.leases.remember(k, t);
                }
                _ => self.leases.remember(k, t),
            }
        }
        if stale + taken_over + gone > 0 {
            tracing::debug!(
                stale,
                taken_over,
                gone,
                in_flight = newest.len(),
                "some in-flight entries were not claimed"
            );
        }
        self.leases.prune(ttl.saturating_mul(4).max(Duration::from_secs(60)));
        Ok(())
    }
}

fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}
