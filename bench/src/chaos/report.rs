//! What a chaos run found ([`Report`]) and which of it breaks an invariant.

use super::*;

/// What a chaos run found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Source name.
    pub source: &'static str,
    /// Jobs produced.
    pub jobs: usize,
    /// Worker processes (at once).
    pub workers: usize,
    /// Jobs completed.
    pub completed: usize,
    /// Jobs dead-lettered.
    pub dead: usize,
    /// Jobs neither completed nor dead at the end.
    pub unfinished: usize,
    /// Completed jobs whose committed epoch never reached the receiver, or whose result is not
    /// the one that epoch produced.
    pub effect_missing: usize,
    /// Jobs dead that should have completed (not poison).
    pub unexpected_dead: usize,
    /// Poison jobs that did not end dead, or whose reason was not recorded.
    pub poison_not_dead_lettered: usize,
    /// Jobs with more than one commit in the audit table.
    pub committed_twice: usize,
    /// Receiver accepts of an epoch lower than one already accepted for the job.
    pub stale_accepts: usize,
    /// (job, epoch) pairs the receiver got from more than one owner (accepted or refused): a
    /// fencing token handed out twice.
    pub tokens_handed_out_twice: usize,
    /// A few of them, in words.
    pub tokens_twice_examples: Vec<String>,
    /// Zombie commits refused by the compare-and-set (summed over worker incarnations).
    pub zombie_commits_rejected: u64,
    /// Handlers cancelled after a lease loss.
    pub lease_losses: u64,
    /// Receiver calls.
    pub receiver_calls: u64,
    /// Receiver calls refused as stale (409).
    pub receiver_refused: u64,
    /// Receiver calls refused because another owner had called with the same epoch
    /// (`Verdict::Conflict`, 409).
    pub receiver_conflicts: u64,
    /// Jobs whose final epoch is above 1 (taken over or retried).
    pub jobs_reclaimed: usize,
    /// Highest epoch seen.
    pub max_epoch: i64,
    /// SIGSTOPs sent.
    pub sigstops: u64,
    /// SIGKILLs sent (each followed by a restart).
    pub sigkills: u64,
    /// `pg_terminate_backend` calls that cut worker connections.
    pub connections_terminated: u64,
    /// Redis restarts.
    pub redis_restarts: u64,
    /// Broker stalls (the proxy held every byte for the stall length).
    pub broker_stalls: u64,
    /// `pg-lock` injections that locked at least one running row.
    pub pg_locks: u64,
    /// Rows locked by them in all.
    pub pg_locked_rows: u64,
    /// `pg-pause` injections that paused at least one backend.
    pub pg_pauses: u64,
    /// Backends paused by them (first round of each).
    pub pg_paused_backends: u64,
    /// Failovers (`pg-failover`: cut, primary alone, killed, standby promoted, VIP re-pointed).
    pub pg_failovers: u64,
    /// The failover's figures (informational), when one happened.
    pub failover: Option<FailoverFigures>,
    /// Redis failovers (`redis-failover`: cut, primary alone, killed, replica took over).
    pub redis_failovers: u64,
    /// The Redis failover's figures, when one happened.
    pub redis_failover: Option<RedisFailoverFigures>,
    /// Jobs whose receiver calls span timeline 1 and a later one: work done on the primary that
    /// failed over (lost with it, or cut short) and done again on the promoted standby.
    pub jobs_rerun_after_failover: usize,
    /// Attempts in flight (rows `running` under a live lease) when the stalls began, summed:
    /// a stall that finds none cannot cost a lease.
    pub stalled_attempts: u64,
    /// The faults selected for the run.
    pub faults: Vec<FaultKind>,
    /// Selected faults that do not apply to this source, with the reason.
    pub not_applicable: Vec<String>,
    /// Every fault injected, with its window.
    pub timeline: Vec<faults::FaultRecord>,
    /// The run's start (ms since the Unix epoch): the timeline counts from here.
    pub t0_ms: u64,
    /// How long each stall lasted.
    pub stall_secs: f64,
    /// The lease.
    pub lease_secs: u64,
    /// Faults injected (counting each injection once).
    pub faults_injected: usize,
    /// Lost attempts, judged by the rule of [`faults`].
    pub losses: faults::LossSummary,
    /// Worker incarnations that stopped cleanly whose reported lost attempts do not add up to
    /// their `lease_losses` counter (the loss reports are incomplete).
    pub loss_reports_missing: u64,
    /// Poison deliveries found in the broker's dead-letter destination (SQS DLQ / dead stream).
    pub broker_dead_letters: Option<usize>,
    /// Seconds from the first worker start to the last job finished.
    pub drain_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Seed of the fault schedule.
    pub seed: u64,
    /// Where the workers' logs are (kept on failure or with `--keep-logs`).
    pub log_dir: Option<PathBuf>,
}

/// What the failover took (seconds) and what it lost.
#[derive(Debug, Clone, Default)]
pub struct FailoverFigures {
    /// A synchronous standby.
    pub sync: bool,
    /// The promoted standby's timeline.
    pub timeline: u32,
    /// From the cut of replication to the primary's death.
    pub alone_secs: f64,
    /// From the primary's death to the end of the standby's promotion.
    pub promote_secs: f64,
    /// From the cut of replication until the VIP led to the promoted standby.
    pub cut_to_repoint_secs: f64,
    /// From the end of the promotion to the first commit on the promoted standby (its audit
    /// table); `None` when none came.
    pub promotion_to_first_commit_secs: Option<f64>,
    /// From the end of the promotion to the receiver's first accepted call of a timeline-2 epoch.
    pub promotion_to_first_promoted_accept_secs: Option<f64>,
    /// Commits the old primary had recorded just before it died that the promoted standby does
    /// not have (writes lost with it); `None` when the old primary could not be read.
    pub commits_lost: Option<usize>,
}

/// What the Redis failover did and lost (times in ms since the Unix epoch).
#[derive(Debug, Clone, Default)]
pub struct RedisFailoverFigures {
    /// The primary that failed (`nodeI (port P)`) and the replica that took its slots over.
    pub primary: String,
    pub replica: String,
    /// Replication cut, primary killed, and the replica named the slot's primary.
    pub cut_ms: u64,
    pub killed_ms: u64,
    pub takeover_ms: u64,
    /// Replication bytes the old primary took alone (lost with it).
    pub bytes_not_replicated: Option<i64>,
    /// Entries the old primary had acknowledged that the new one had not.
    pub acks_lost: Option<usize>,
    /// From the end of the drain until the group held nothing unacknowledged.
    pub settle_secs: Option<f64>,
    /// What the group held unacknowledged (pending plus undelivered) when the wait ended.
    pub unsettled_at_end: Option<u64>,
}

impl Report {
    /// Every invariant that does not hold, in words. Empty means the run passed.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let lost = self.unfinished + self.effect_missing + self.unexpected_dead;
        if lost > 0 {
            v.push(format!(
                "jobs lost = {lost} (unfinished {}, effect missing {}, dead unexpectedly {})",
                self.unfinished, self.effect_missing, self.unexpected_dead
            ));
        }
        if self.committed_twice > 0 {
            v.push(format!("results committed twice = {}", self.committed_twice));
        }
        if self.stale_accepts > 0 {
            v.push(format!("receiver accepted a lower epoch {} times", self.stale_accepts));
        }
        if self.tokens_handed_out_twice > 0 {
            v.push(format!(
                "fencing tokens handed out twice = {} ((job, epoch) pairs that reached the receiver from two owners)",
                self.tokens_handed_out_twice
            ));
        }
        if self.faults.contains(&FaultKind::PgFailover) && self.source == "table" && self.pg_failovers < 1 {
            v.push("pg-failover was selected but never injected (the jobs drained first)".into());
        }
        if self.faults.contains(&FaultKind::RedisFailover)
            && !self.not_applicable.iter().any(|n| n.starts_with("redis-failover"))
            && self.redis_failovers < 1
        {
            v.push("redis-failover was selected but never injected (the jobs drained first)".into());
        }
        if self.faults.contains(&FaultKind::SigStop) && self.zombie_commits_rejected < 1 {
            v.push("no zombie commit was rejected: the pauses did not bite".into());
        }
        if self.losses.healthy > 0 {
            v.push(format!(
                "healthy cancellations = {} (leases lost while the database was reachable and the holder running)",
                self.losses.healthy
            ));
        }
        if self.loss_reports_missing > 0 {
            v.push(format!(
                "{} worker runs reported fewer lost attempts than their lease_losses counter",
                self.loss_reports_missing
            ));
        }
        if self.completed + self.dead != self.jobs {
            v.push(format!("completed {} + dead {} != jobs {}", self.completed, self.dead, self.jobs));
        }
        if self.poison_not_dead_lettered > 0 {
            v.push(format!("poison jobs not dead-lettered with their reason = {}", self.poison_not_dead_lettered));
        }
        v
    }

    /// Jobs lost in all.
    pub fn lost(&self) -> usize {
        self.unfinished + self.effect_missing + self.unexpected_dead
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "chaos [{}]: {} jobs, {} worker processes, seed {}",
            self.source, self.jobs, self.workers, self.seed
        )?;
        let names: Vec<&str> = self.faults.iter().map(|k| k.name()).collect();
        writeln!(
            f,
            "  faults selected: {} (lease {} s, stalls {:.1} s)",
            names.join(","),
            self.lease_secs,
            self.stall_secs
        )?;
        for na in &self.not_applicable {
            writeln!(f, "  not applicable: {na}")?;
        }
        writeln!(
            f,
            "  faults: {} SIGSTOP>lease, {} SIGKILL+restart, {} pg_terminate_backend, {} redis restarts, {} failovers, \
             {} redis failovers",
            self.sigstops,
            self.sigkills,
            self.connections_terminated,
            self.redis_restarts,
            self.pg_failovers,
            self.redis_failovers,
        )?;
        let stalls = [FaultKind::BrokerStall, FaultKind::PgLock, FaultKind::PgPause];
        if self.faults.iter().any(|k| stalls.contains(k)) {
            writeln!(
                f,
                "  stalls: {} broker stalls, {} pg row locks ({} rows), {} pg backend pauses ({} backends); \
                 {} attempts in flight when they began",
                self.broker_stalls,
                self.pg_locks,
                self.pg_locked_rows,
                self.pg_pauses,
                self.pg_paused_backends,
                self.stalled_attempts
            )?;
        }
        if let Some(fo) = &self.failover {
            let opt = |v: Option<f64>| v.map_or("none".to_owned(), |s| format!("{s:.1} s"));
            writeln!(
                f,
                "  failover ({} standby): primary alone {:.1} s, promoted in {:.1} s (timeline {}), cut to VIP \
                 re-pointed {:.1} s; promotion to first commit {}, to first timeline-{} accept {}",
                if fo.sync { "synchronous" } else { "asynchronous" },
                fo.alone_secs,
                fo.promote_secs,
                fo.timeline,
                fo.cut_to_repoint_secs,
                opt(fo.promotion_to_first_commit_secs),
                fo.timeline,
                opt(fo.promotion_to_first_promoted_accept_secs),
            )?;
            writeln!(
                f,
                "  failover: {} commits lost with the old primary, {} jobs re-run after it (calls on timelines 1 and 2)",
                fo.commits_lost.map_or("?".to_owned(), |n| n.to_string()),
                self.jobs_rerun_after_failover
            )?;
        }
        if let Some(fo) = &self.redis_failover {
            let secs = |a: u64, b: u64| b.saturating_sub(a) as f64 / 1000.0;
            let opt = |v: Option<String>| v.unwrap_or_else(|| "?".to_owned());
            writeln!(
                f,
                "  redis failover: {} alone {:.1} s, killed; {} took its slots over {:.2} s later; {} bytes never \
                 replicated, {} acks lost",
                fo.primary,
                secs(fo.cut_ms, fo.killed_ms),
                fo.replica,
                secs(fo.killed_ms, fo.takeover_ms),
                opt(fo.bytes_not_replicated.map(|n| n.to_string())),
                opt(fo.acks_lost.map(|n| n.to_string())),
            )?;
            writeln!(
                f,
                "  redis failover: the group settled (nothing unacknowledged) {} after the drain",
                fo.settle_secs.map_or_else(
                    || format!("not within the wait ({} left)", opt(fo.unsettled_at_end.map(|n| n.to_string()))),
                    |s| format!("{s:.1} s")
                )
            )?;
        }
        if !self.timeline.is_empty() {
            writeln!(f, "  timeline (s after start):")?;
            for r in &self.timeline {
                let end = r.end_ms.unwrap_or(r.start_ms);
                writeln!(
                    f,
                    "    {:>6.1} +{:>4.1} s  {:<13} {:<12} {}",
                    faults::secs_after(self.t0_ms, r.start_ms),
                    end.saturating_sub(r.start_ms) as f64 / 1000.0,
                    r.kind.name(),
                    r.target.to_string(),
                    r.detail
                )?;
            }
        }
        writeln!(f, "  jobs lost                          = {}", self.lost())?;
        writeln!(f, "  results committed twice            = {}", self.committed_twice)?;
        writeln!(f, "  receiver accepts of a lower epoch  = {}", self.stale_accepts)?;
        writeln!(f, "  tokens handed out twice            = {}", self.tokens_handed_out_twice)?;
        for e in &self.tokens_twice_examples {
            writeln!(f, "    e.g. {e}")?;
        }
        writeln!(f, "  healthy cancellations              = {}", self.losses.healthy)?;
        let excused: Vec<String> = self.losses.excused.iter().map(|(k, n)| format!("{k} {n}")).collect();
        writeln!(
            f,
            "  attempts lost (lease)              = {} (excused: {})",
            self.losses.lost_attempts,
            if excused.is_empty() { "none".into() } else { excused.join(", ") }
        )?;
        for (during, n) in &self.losses.healthy_during {
            writeln!(f, "    healthy cancellations during {during}: {n}")?;
        }
        for e in &self.losses.healthy_examples {
            writeln!(f, "    e.g. {e}")?;
        }
        writeln!(f, "  zombie commits rejected            = {}", self.zombie_commits_rejected)?;
        writeln!(f, "  completed + dead-lettered          = {} + {} of {}", self.completed, self.dead, self.jobs)?;
        if let Some(n) = self.broker_dead_letters {
            writeln!(f, "  in the broker's dead-letter place  = {n}")?;
        }
        writeln!(
            f,
            "  lease losses {}, receiver calls {} ({} refused as stale, {} as another owner's epoch), jobs \
             reclaimed {}, max epoch {}",
            self.lease_losses,
            self.receiver_calls,
            self.receiver_refused,
            self.receiver_conflicts,
            self.jobs_reclaimed,
            self.max_epoch
        )?;
        write!(f, "  drained in {:.1} s, {:.1} s in all", self.drain_secs, self.total_secs)?;
        if let Some(dir) = &self.log_dir {
            write!(f, "\n  worker logs: {}", dir.display())?;
        }
        let violations = self.violations();
        if violations.is_empty() {
            write!(f, "\n  PASS: every invariant holds")
        } else {
            for v in violations {
                write!(f, "\n  FAIL: {v}")?;
            }
            Ok(())
        }
    }
}
