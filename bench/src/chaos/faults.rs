//! The faults of a chaos run, their timeline, and the rule that decides which lost leases they
//! excuse.
//!
//! # Healthy cancellations
//!
//! Every worker reports each attempt that ended `LeaseLost` (reason `Unconfirmed` or
//! `Superseded`: the supervisor's "lease lost" record) with the wall-clock time it was
//! reported. The runner keeps a timeline of every fault it injected: kind, target (one worker
//! or all of them) and the window `[start, end]` in which it was in force. A lost attempt of
//! worker `w` at time `t` is **excused** when a fault of an excusing kind targeted `w` (or every
//! worker) with `start ≤ t ≤ end + slack`, where `slack` = lease + 1 s (a loss shows up when the
//! worker next looks: its heartbeat tick after the fault ends, or the attempt's own deadline
//! timer; both come within a lease of the end). Otherwise it is a **healthy cancellation**:
//! the database was reachable for that worker and the worker was running, and the lease was lost
//! all the same. The run asserts there are none.
//!
//! | fault | excuses a loss of | why |
//! |---|---|---|
//! | `sigstop` | the paused worker | its holder was not running |
//! | `pg-terminate` | the workers whose connections were cut (every worker behind PgBouncer: the server connections it cuts are shared) | the database was unreachable for them |
//! | `pg-lock` | the worker whose running rows were locked, and any worker seen waiting on that lock (`pg_blocking_pids`, from when it was seen) | the heartbeat renews all of a worker's leases in one statement, so one locked row stalls every renewal of that worker until the lock goes; another worker's claim of a locked job whose lease ran out waits on the lock too. Workers not seen waiting are not excused |
//! | `pg-pause` | the worker whose idle PostgreSQL backends were SIGSTOPped (every worker behind PgBouncer, whose server connections all workers share) | the database was unreachable for it |
//! | `pg-failover` | every worker, from the cut of replication until the address (the VIP) leads to the promoted standby | writes the primary took alone are lost with it, and the database is unreachable while the standby is promoted: a lease confirmed by the old primary may not exist on the new one |
//! | `broker-stall` | nobody | a slow broker may cost a visibility hint, never a healthy lease (issue #12, item 1) |
//! | `redis-restart` | nobody | the same: the broker is not the authority |
//! | `redis-failover` | nobody | the same: the writes the old primary took alone (reads of the group, acks, lease keys, dead letters) are lost with it, which costs deliveries again, never a lease: the heartbeat renews in PostgreSQL only, which the failover does not touch |
//! | `sigkill` | nobody (the killed worker reports nothing any more) | |
//!
//! A loss that the rule does not excuse is named in the report with the faults that were in
//! force (for example "during broker-stall"), so a healthy cancellation points at its cause.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A kind of fault the runner injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// SIGSTOP a worker for longer than the lease, then SIGCONT.
    SigStop,
    /// SIGKILL a worker and start it again.
    SigKill,
    /// `pg_terminate_backend` of the connections of one worker or of all.
    PgTerminate,
    /// Kill and restart the run's private redis-server (Redis only).
    RedisRestart,
    /// The TCP proxy between the workers and the broker holds every byte for longer than the
    /// lease (SQS and Redis; the table queue has no broker).
    BrokerStall,
    /// A transaction of the runner holds `FOR UPDATE` locks on the running rows of one worker
    /// for longer than the lease.
    PgLock,
    /// The idle PostgreSQL backends of one worker are SIGSTOPped for longer than the lease.
    PgPause,
    /// The database fails over (table source only): replication to the standby is cut, the
    /// primary works alone for a while, dies, the standby is promoted and the address the
    /// workers use (a VIP, behind PgBouncer) is re-pointed to it. Once per run.
    PgFailover,
    /// The Redis Cluster primary of the stream fails over (Redis source on a cluster only):
    /// replication to its replica is cut, the primary works alone for a while, dies, and the
    /// replica takes its slots over (`CLUSTER FAILOVER TAKEOVER`); the workers' cluster clients
    /// follow the slot map. Once per run.
    RedisFailover,
}

impl FaultKind {
    /// Every kind, in the order a run injects its first round.
    pub const ALL: [FaultKind; 9] = [
        FaultKind::SigStop,
        FaultKind::PgTerminate,
        FaultKind::SigKill,
        FaultKind::RedisRestart,
        FaultKind::BrokerStall,
        FaultKind::PgLock,
        FaultKind::PgPause,
        FaultKind::PgFailover,
        FaultKind::RedisFailover,
    ];

    /// The faults a run injects when none are named: the four of the original chaos run.
    pub const CLASSIC: [FaultKind; 4] =
        [FaultKind::SigStop, FaultKind::PgTerminate, FaultKind::SigKill, FaultKind::RedisRestart];

    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::SigStop => "sigstop",
            FaultKind::SigKill => "sigkill",
            FaultKind::PgTerminate => "pg-terminate",
            FaultKind::RedisRestart => "redis-restart",
            FaultKind::BrokerStall => "broker-stall",
            FaultKind::PgLock => "pg-lock",
            FaultKind::PgPause => "pg-pause",
            FaultKind::PgFailover => "pg-failover",
            FaultKind::RedisFailover => "redis-failover",
        }
    }

    /// Parses a comma-separated list: the names above, `pg-stall` (= `pg-lock,pg-pause`),
    /// `classic` (the original four) or `all`.
    pub fn parse_list(s: &str) -> Result<Vec<FaultKind>, String> {
        let mut out: Vec<FaultKind> = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let kinds: Vec<FaultKind> = match name {
                "all" => Self::ALL.to_vec(),
                "classic" => Self::CLASSIC.to_vec(),
                "pg-stall" => vec![FaultKind::PgLock, FaultKind::PgPause],
                other => match Self::ALL.iter().find(|k| k.name() == other) {
                    Some(k) => vec![*k],
                    None => {
                        return Err(format!(
                            "unknown fault {other:?} (sigstop, sigkill, pg-terminate, redis-restart, broker-stall, \
                             pg-lock, pg-pause, pg-failover, redis-failover, pg-stall, classic, all)"
                        ));
                    }
                },
            };
            for k in kinds {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        if out.is_empty() {
            return Err("--faults names no fault".into());
        }
        Ok(out)
    }

    /// Whether a lease lost by a worker this fault targeted (within its window) is excused.
    pub fn excuses(self) -> bool {
        matches!(
            self,
            FaultKind::SigStop
                | FaultKind::PgTerminate
                | FaultKind::PgLock
                | FaultKind::PgPause
                | FaultKind::PgFailover
        )
    }
}

/// Whom a fault hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Every worker.
    All,
    /// One worker (by index).
    Worker(usize),
}

impl Target {
    fn hits(self, worker: usize) -> bool {
        match self {
            Target::All => true,
            Target::Worker(w) => w == worker,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::All => f.write_str("all workers"),
            Target::Worker(w) => write!(f, "worker {w}"),
        }
    }
}

/// One injected fault.
#[derive(Debug, Clone)]
pub struct FaultRecord {
    /// The kind.
    pub kind: FaultKind,
    /// Whom it hit.
    pub target: Target,
    /// When it began (ms since the Unix epoch).
    pub start_ms: u64,
    /// When it ended (ms since the Unix epoch); `None` while in force.
    pub end_ms: Option<u64>,
    /// What it did, in words (pid, rows locked, backends paused …).
    pub detail: String,
}

/// The timeline of a run, shared with the tasks that end stalls.
#[derive(Debug, Clone, Default)]
pub struct FaultLog(Arc<Mutex<Vec<FaultRecord>>>);

impl FaultLog {
    /// Records a fault that is in force from now until [`close`](Self::close); returns its id.
    pub fn open(&self, kind: FaultKind, target: Target, detail: String) -> usize {
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        log.push(FaultRecord { kind, target, start_ms: now_ms(), end_ms: None, detail });
        log.len() - 1
    }

    /// Records a fault whose window is known in advance.
    pub fn record(&self, kind: FaultKind, target: Target, start_ms: u64, end_ms: u64, detail: String) {
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        log.push(FaultRecord { kind, target, start_ms, end_ms: Some(end_ms), detail });
    }

    /// Ends fault `id` now.
    pub fn close(&self, id: usize) {
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = log.get_mut(id) {
            r.end_ms.get_or_insert(now_ms());
        }
    }

    /// Ends every fault of `kind` still in force now.
    pub fn cut_short(&self, kind: FaultKind) {
        let now = now_ms();
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for r in log.iter_mut().filter(|r| r.kind == kind) {
            if r.end_ms.is_none_or(|e| e > now) {
                r.end_ms = Some(now);
                r.detail.push_str(" (ended early: the jobs were drained)");
            }
        }
    }

    /// Adds to a fault's description.
    pub fn annotate(&self, id: usize, more: &str) {
        let mut log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = log.get_mut(id) {
            r.detail.push_str(more);
        }
    }

    /// Every record so far (open ones end now).
    pub fn snapshot(&self) -> Vec<FaultRecord> {
        let now = now_ms();
        let log = self.0.lock().unwrap_or_else(|p| p.into_inner());
        log.iter().map(|r| FaultRecord { end_ms: Some(r.end_ms.unwrap_or(now)), ..r.clone() }).collect()
    }

    /// True while some fault is in force (open, or recorded with an end still to come).
    pub fn any_open(&self) -> bool {
        let now = now_ms();
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|r| r.end_ms.is_none_or(|e| e > now))
    }

    /// True while a fault of `kinds` is in force on `worker` (or on all).
    pub fn open_on(&self, worker: usize, kinds: &[FaultKind]) -> bool {
        let now = now_ms();
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|r| r.end_ms.is_none_or(|e| e > now) && kinds.contains(&r.kind) && r.target.hits(worker))
    }
}

/// Milliseconds since the Unix epoch (the clock the runner and its workers share).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// An attempt a worker lost (its lease), as the worker reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LossEvent {
    /// Worker index.
    pub worker: usize,
    /// Which start of that worker (0, then +1 per SIGKILL).
    pub incarnation: u32,
    /// Job key.
    pub key: String,
    /// Epoch of the attempt.
    pub epoch: i64,
    /// `Unconfirmed` or `Superseded`.
    pub reason: String,
    /// When it was reported (ms since the Unix epoch).
    pub at_ms: u64,
}

impl LossEvent {
    /// Parses the fields of an `EVENT lost key=K epoch=E reason=R at_ms=T` line.
    pub fn parse(worker: usize, incarnation: u32, fields: &str) -> Option<Self> {
        let mut key = None;
        let mut epoch = None;
        let mut reason = None;
        let mut at_ms = None;
        for kv in fields.split_whitespace() {
            match kv.split_once('=') {
                Some(("key", v)) => key = Some(v.to_owned()),
                Some(("epoch", v)) => epoch = v.parse().ok(),
                Some(("reason", v)) => reason = Some(v.to_owned()),
                Some(("at_ms", v)) => at_ms = v.parse().ok(),
                _ => {}
            }
        }
        Some(Self { worker, incarnation, key: key?, epoch: epoch?, reason: reason?, at_ms: at_ms? })
    }
}

/// How the rule judged one lost attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// A fault of this kind targeted the worker within the window.
    Excused(FaultKind),
    /// Nothing excuses it; the faults (of any kind, on any worker) in force at the time.
    Healthy(Vec<FaultKind>),
}

/// Applies the rule of this module to one lost attempt.
pub fn judge(loss: &LossEvent, faults: &[FaultRecord], slack: Duration) -> Judgement {
    let slack = slack.as_millis() as u64;
    let within = |r: &FaultRecord| {
        let end = r.end_ms.unwrap_or(u64::MAX).saturating_add(slack);
        r.start_ms <= loss.at_ms && loss.at_ms <= end
    };
    if let Some(r) = faults.iter().find(|r| r.kind.excuses() && r.target.hits(loss.worker) && within(r)) {
        return Judgement::Excused(r.kind);
    }
    let mut during: Vec<FaultKind> = faults.iter().filter(|r| within(r)).map(|r| r.kind).collect();
    during.sort();
    during.dedup();
    Judgement::Healthy(during)
}

/// What the rule found over a whole run.
#[derive(Debug, Clone, Default)]
pub struct LossSummary {
    /// Lost attempts reported by the workers.
    pub lost_attempts: usize,
    /// Excused, by the fault that excused them.
    pub excused: BTreeMap<&'static str, usize>,
    /// Healthy cancellations.
    pub healthy: usize,
    /// Healthy cancellations by the faults in force ("none" when none was).
    pub healthy_during: BTreeMap<String, usize>,
    /// A few healthy cancellations, in words.
    pub healthy_examples: Vec<String>,
}

/// Judges every lost attempt; times in the examples are seconds after `t0_ms`.
pub fn summarize(losses: &[LossEvent], faults: &[FaultRecord], slack: Duration, t0_ms: u64) -> LossSummary {
    let mut s = LossSummary { lost_attempts: losses.len(), ..Default::default() };
    for loss in losses {
        match judge(loss, faults, slack) {
            Judgement::Excused(kind) => *s.excused.entry(kind.name()).or_default() += 1,
            Judgement::Healthy(during) => {
                s.healthy += 1;
                let names: Vec<&str> = during.iter().map(|k| k.name()).collect();
                let during = if names.is_empty() { "no fault".to_owned() } else { names.join("+") };
                if s.healthy_examples.len() < 8 {
                    s.healthy_examples.push(format!(
                        "worker {} lost {} epoch {} ({}) at {:.1} s, during {during}",
                        loss.worker,
                        loss.key,
                        loss.epoch,
                        loss.reason,
                        secs_after(t0_ms, loss.at_ms)
                    ));
                }
                *s.healthy_during.entry(during).or_default() += 1;
            }
        }
    }
    s
}

/// Seconds from `t0_ms` to `at_ms` (negative before).
pub fn secs_after(t0_ms: u64, at_ms: u64) -> f64 {
    (at_ms as f64 - t0_ms as f64) / 1000.0
}

// ------------------------------------------------------------------------------------------------
// Worker side: the supervisor's "lease lost" records, as EVENT lines
// ------------------------------------------------------------------------------------------------

/// A tracing layer for the worker processes: every event that carries the fields `reason`,
/// `key` and `epoch` (the supervisor's "lease lost: handler cancelled, nothing committed"
/// record, logged once per attempt that ended `LeaseLost`) is passed to `emit` as
/// `lost key=K epoch=E reason=R at_ms=T`. The runner checks that these lines add up to the
/// worker's `lease_losses` counter, so a renamed field cannot hide a loss.
pub struct LossLayer {
    /// Writes one EVENT line.
    pub emit: fn(String),
}

#[derive(Default)]
struct LossFields {
    reason: Option<String>,
    key: Option<String>,
    epoch: Option<i64>,
}

impl tracing::field::Visit for LossFields {
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        if field.name() == "epoch" {
            self.epoch = Some(value);
        }
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "epoch" {
            self.epoch = i64::try_from(value).ok();
        }
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.record_debug(field, &value);
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let text = || format!("{value:?}").trim_matches('"').replace(char::is_whitespace, "_");
        match field.name() {
            "reason" => self.reason = Some(text()),
            "key" => self.key = Some(text()),
            "epoch" => self.epoch = text().parse().ok(),
            _ => {}
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LossLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut f = LossFields::default();
        event.record(&mut f);
        if let (Some(reason), Some(key), Some(epoch)) = (f.reason, f.key, f.epoch) {
            (self.emit)(format!("lost key={key} epoch={epoch} reason={reason} at_ms={}", now_ms()));
        }
    }
}
