//! `EVENT` lines (the format is in `examples/README.md`), and the store wrapper that prints what
//! the fence decided: every fenced write, every commit.

use super::*;

/// Quotes a field value when it is empty or holds whitespace, `"`, `\` or a control character:
/// `"…"` with `\"`, `\\`, `\n`, `\r`, `\t` and `\u{XX}` escapes. Other values are printed as they are.
pub fn quote(value: &str) -> String {
    let plain =
        !value.is_empty() && !value.chars().any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\\');
    if plain {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Prints `EVENT <name> k=v …` on stdout as one write, flushed at once (a driving program reads
/// it through a pipe). Values are [`quote`]d where needed. A closed stdout is ignored.
pub fn event(name: &str, fields: &[(&str, &dyn Display)]) {
    let mut line = format!("EVENT {name}");
    for (k, v) in fields {
        line.push(' ');
        line.push_str(k);
        line.push('=');
        line.push_str(&quote(&v.to_string()));
    }
    line.push('\n');
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// `EVENT <name> queue=… key=… epoch=… owner=… [extra…]` for one lease.
pub fn lease_event(name: &str, lease: &Lease, extra: &[(&str, &dyn Display)]) {
    let mut fields: Vec<(&str, &dyn Display)> =
        vec![("queue", &lease.queue), ("key", &lease.key), ("epoch", &lease.epoch), ("owner", &lease.owner)];
    fields.extend_from_slice(extra);
    event(name, &fields);
}

/// `EVENT ready pid=… owner=… [extra…]`: the worker is connected and about to receive.
pub fn ready(owner: &Owner, extra: &[(&str, &dyn Display)]) {
    let pid = std::process::id();
    let mut fields: Vec<(&str, &dyn Display)> = vec![("pid", &pid), ("owner", owner)];
    fields.extend_from_slice(extra);
    event("ready", &fields);
}

/// A [`FenceStore`] that prints what the database decided about this worker's attempts:
/// `committed`, `fenced` and `fail_recorded`. Everything is delegated unchanged.
pub struct EventStore(pub Arc<dyn FenceStore>);

fn fenced_event(lease: &Lease, op: &str, e: &FenceError) {
    let (current_epoch, current_owner) = match e {
        FenceError::Fenced { current_epoch, current_owner, .. } => {
            (*current_epoch, current_owner.clone().unwrap_or_else(|| "none".into()))
        }
        _ => (0, "none".into()),
    };
    lease_event("fenced", lease, &[("op", &op), ("current_epoch", &current_epoch), ("current_owner", &current_owner)]);
}

fn commit_event(lease: &Lease, result: &fence::Result<()>) {
    match result {
        Ok(()) => lease_event("committed", lease, &[]),
        Err(e) if e.is_fenced() => fenced_event(lease, "commit", e),
        Err(_) => {}
    }
}

#[async_trait]
impl FenceStore for EventStore {
    async fn migrate(&self) -> fence::Result<()> {
        self.0.migrate().await
    }
    async fn check_schema(&self) -> fence::Result<()> {
        self.0.check_schema().await
    }
    async fn claim(&self, q: &QueueName, k: &JobKey, o: &Owner, l: LeaseDuration) -> fence::Result<Claim> {
        self.0.claim(q, k, o, l).await
    }
    async fn claim_batch(
        &self,
        q: &QueueName,
        keys: &[JobKey],
        o: &Owner,
        l: LeaseDuration,
    ) -> fence::Result<Vec<Claim>> {
        self.0.claim_batch(q, keys, o, l).await
    }
    async fn enqueue(&self, q: &QueueName, k: &JobKey, payload: &[u8]) -> fence::Result<bool> {
        self.0.enqueue(q, k, payload).await
    }
    async fn enqueue_many(&self, q: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> fence::Result<u64> {
        self.0.enqueue_many(q, jobs).await
    }
    async fn claim_next(&self, q: &QueueName, o: &Owner, l: LeaseDuration, n: u32) -> fence::Result<Vec<ClaimedJob>> {
        self.0.claim_next(q, o, l, n).await
    }
    async fn heartbeat(&self, leases: &[Lease], l: LeaseDuration) -> fence::Result<Heartbeat> {
        self.0.heartbeat(leases, l).await
    }
    async fn heartbeat_unless_locked(&self, leases: &[Lease], l: LeaseDuration) -> fence::Result<Heartbeat> {
        self.0.heartbeat_unless_locked(leases, l).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> fence::Result<()> {
        let r = self.0.checkpoint(lease, progress).await;
        if let Err(e) = &r
            && e.is_fenced()
        {
            fenced_event(lease, "checkpoint", e);
        }
        r
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> fence::Result<()> {
        let r = self.0.complete(lease, result).await;
        commit_event(lease, &r);
        r
    }
    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> fence::Result<Vec<fence::Result<()>>> {
        let out = self.0.complete_batch(items).await?;
        for ((lease, _), r) in items.iter().zip(&out) {
            commit_event(lease, r);
        }
        Ok(out)
    }
    async fn fail(&self, lease: &Lease, error: &str, retry: bool, p: &RetryPolicy) -> fence::Result<FailOutcome> {
        let r = self.0.fail(lease, error, retry, p).await;
        match &r {
            Ok(FailOutcome::Retry { retry_in }) => {
                let ms = retry_in.as_millis();
                lease_event("fail_recorded", lease, &[("outcome", &"retry"), ("retry_in_ms", &ms)]);
            }
            Ok(FailOutcome::Dead) => lease_event("fail_recorded", lease, &[("outcome", &"dead")]),
            Err(e) if e.is_fenced() => fenced_event(lease, "fail", e),
            Ok(_) | Err(_) => {}
        }
        r
    }
    async fn release(&self, lease: &Lease) -> fence::Result<()> {
        self.0.release(lease).await
    }
    async fn job(&self, q: &QueueName, k: &JobKey) -> fence::Result<Option<JobRecord>> {
        self.0.job(q, k).await
    }
    async fn db_now(&self) -> fence::Result<DbTime> {
        self.0.db_now().await
    }
    fn wakeups(&self, queue: &brokerfence::QueueName) -> brokerfence::Wakeups {
        self.0.wakeups(queue)
    }
    async fn next_due(&self, queue: &brokerfence::QueueName) -> brokerfence::Result<Option<std::time::Duration>> {
        self.0.next_due(queue).await
    }
    async fn record_activity(&self, activity: &brokerfence::admin::Activity) -> brokerfence::Result<()> {
        self.0.record_activity(activity).await
    }

    fn backend(&self) -> brokerfence::Backend<'_> {
        self.0.backend()
    }

    async fn prune(
        &self,
        retention: &brokerfence::retention::Retention,
    ) -> brokerfence::Result<brokerfence::retention::PruneReport> {
        self.0.prune(retention).await
    }
}

/// A supervisor hook printing `lease_lost` for every lease a heartbeat found taken over or
/// expired (add it with `consumer.supervisor().add_hook(Arc::new(LostHook))`).
pub struct LostHook;

#[async_trait]
impl fence::LeaseHook for LostHook {
    async fn confirmed(&self, _leases: &[Lease]) {}

    async fn lost(&self, leases: &[Lease]) {
        for lease in leases {
            lease_event("lease_lost", lease, &[]);
        }
    }
}
