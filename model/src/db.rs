//! The job row and the store's statements, each as the WHERE and SET of its SQL in
//! `fence/src/postgres/statements.rs` (times relative to `clock_timestamp()`, in ticks).

use crate::{Bounds, Guards, W};

/// `jobs.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum JobState {
    /// 'pending'
    Pending,
    /// 'running'
    Running,
    /// 'completed'
    Completed,
    /// 'failed'
    Failed,
    /// 'dead'
    Dead,
}

/// The job's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    /// `state`
    pub state: JobState,
    /// `owner`
    pub owner: Option<W>,
    /// `epoch`
    pub epoch: u8,
    /// `lease_until - clock_timestamp()` in ticks while running, clamped at -1 (expired); 0 otherwise.
    pub lease_left: i8,
    /// `run_at - clock_timestamp()` in ticks while failed, clamped at 0 (due); 0 otherwise.
    pub run_in: i8,
    /// `attempts` (claims, less releases)
    pub attempts: u8,
    /// `failures`
    pub failures: u8,
    /// Ghost (no column): the serial of the claim that set the current epoch.
    pub serial: u8,
}

/// A statement's answer, as the caller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// `Claim::Claimed` under this epoch.
    Claimed {
        /// The new epoch.
        epoch: u8,
    },
    /// `Claim::Busy` with the holder's time left.
    Busy {
        /// Ticks left on the holder's lease.
        ttl: i8,
    },
    /// `Claim::Done`.
    Done,
    /// `Claim::Dead`, or `FailOutcome::Dead`.
    Dead,
    /// `Claim::Backoff`.
    Backoff {
        /// Ticks until due.
        retry_in: i8,
    },
    /// `claim_next`: nothing due.
    Nothing,
    /// Heartbeat: renewed.
    Renewed,
    /// Heartbeat: lost.
    Lost,
    /// complete / release: `Ok(())`.
    Ok,
    /// `FailOutcome::Retry`.
    Retry {
        /// Ticks of backoff.
        retry_in: i8,
    },
    /// `FenceError::Fenced`: zero rows matched, nothing written.
    Fenced,
}

impl Row {
    /// A row as `enqueue` inserts it (at the queue's epoch floor, 0).
    pub fn pending() -> Self {
        Row {
            state: JobState::Pending,
            owner: None,
            epoch: 0,
            lease_left: 0,
            run_in: 0,
            attempts: 0,
            failures: 0,
            serial: 0,
        }
    }

    /// One tick of the database clock.
    pub fn tick(&mut self) {
        match self.state {
            JobState::Running => self.lease_left = (self.lease_left - 1).max(-1),
            JobState::Failed => self.run_in = (self.run_in - 1).max(0),
            _ => {}
        }
    }

    /// The claim statements' WHERE: `t.state = 'pending' OR (t.state = 'failed' AND t.run_at <=
    /// clock_timestamp()) OR (t.state = 'running' AND t.lease_until < clock_timestamp())`.
    pub fn claimable(&self) -> bool {
        match self.state {
            JobState::Pending => true,
            JobState::Failed => self.run_in <= 0,
            JobState::Running => self.lease_left < 0,
            _ => false,
        }
    }

    /// `capped_claim`: the SET of a claim by `w`, or dead when `attempts >= max_claims` (epoch
    /// and owner kept).
    fn capped_claim(mut self, w: W, b: &Bounds, g: &Guards) -> (Row, Answer) {
        if self.attempts >= b.max_claims {
            self.state = JobState::Dead;
            self.lease_left = 0;
            self.run_in = 0;
            return (self, Answer::Dead);
        }
        self.state = JobState::Running;
        self.epoch += u8::from(g.epoch_increment);
        self.owner = Some(w);
        self.lease_left = b.lease;
        self.run_in = 0;
        self.attempts += 1;
        (self, Answer::Claimed { epoch: self.epoch })
    }

    /// The compare-and-set of complete/fail/checkpoint/release (`CAS`, or `NO_CAS` with the guard off).
    fn cas(&self, w: W, epoch: u8, g: &Guards) -> bool {
        !g.commit_cas || (self.owner == Some(w) && self.epoch == epoch && self.state == JobState::Running)
    }
}

/// `claim_batch` of one key: `INSERT … ON CONFLICT DO UPDATE SET {capped} WHERE {claimable}`,
/// else the row as it is.
pub fn claim_batch(row: Option<Row>, w: W, b: &Bounds, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        // INSERT: epoch = epoch_floor + 1 (no floor here: 1), attempts 1.
        None => {
            let r = Row {
                state: JobState::Running,
                owner: Some(w),
                epoch: 1,
                lease_left: b.lease,
                run_in: 0,
                attempts: 1,
                failures: 0,
                serial: 0,
            };
            (Some(r), Answer::Claimed { epoch: 1 })
        }
        Some(r) if r.claimable() => {
            let (r, a) = r.capped_claim(w, b, g);
            (Some(r), a)
        }
        Some(r) => {
            let a = match r.state {
                JobState::Running => Answer::Busy { ttl: r.lease_left },
                JobState::Completed => Answer::Done,
                JobState::Dead => Answer::Dead,
                JobState::Failed => Answer::Backoff { retry_in: r.run_in },
                JobState::Pending => unreachable!("pending rows are claimable"),
            };
            (Some(r), a)
        }
    }
}

/// `claim_next` (table queue): `UPDATE … SET {capped} FROM pick` where pick is an expired
/// running row or a due pending/failed one. A claim that buried the job is left out of the answer.
pub fn claim_next(row: Option<Row>, w: W, b: &Bounds, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        Some(r) if r.claimable() => {
            let (r, a) = r.capped_claim(w, b, g);
            (Some(r), a)
        }
        other => (other, Answer::Nothing),
    }
}

/// `heartbeat`: `UPDATE … SET lease_until = clock_timestamp() + lease FROM cur c WHERE
/// c.cur_epoch = c.epoch AND c.cur_owner = c.owner AND c.cur_state = 'running'` (with the guard
/// off: `WHERE true`, and the answer names the caller's epoch). No condition on `lease_until`: a
/// lease that ran out but that nobody took over is renewed.
pub fn heartbeat(row: Option<Row>, w: W, epoch: u8, b: &Bounds, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        Some(mut r) if !g.heartbeat_cas || (r.epoch == epoch && r.owner == Some(w) && r.state == JobState::Running) => {
            if r.state == JobState::Running {
                r.lease_left = b.lease;
            }
            (Some(r), Answer::Renewed)
        }
        other => (other, Answer::Lost),
    }
}

/// `complete`: `UPDATE … SET state = 'completed', lease_until = NULL WHERE {cas}`. No condition
/// on `lease_until`: an expired lease that nobody took over still commits.
pub fn complete(row: Option<Row>, w: W, epoch: u8, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        Some(mut r) if r.cas(w, epoch, g) => {
            r.state = JobState::Completed;
            r.lease_left = 0;
            r.run_in = 0;
            (Some(r), Answer::Ok)
        }
        other => (other, Answer::Fenced),
    }
}

/// `fail` (retry = true): `UPDATE … SET state = CASE WHEN failures + 1 < max_attempts THEN
/// 'failed' ELSE 'dead' END, failures = failures + 1, run_at = now + backoff, lease_until = NULL
/// WHERE {cas}`.
pub fn fail(row: Option<Row>, w: W, epoch: u8, b: &Bounds, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        Some(mut r) if r.cas(w, epoch, g) => {
            r.failures += 1;
            r.lease_left = 0;
            if r.failures < b.max_attempts {
                r.state = JobState::Failed;
                r.run_in = b.backoff;
                (Some(r), Answer::Retry { retry_in: b.backoff })
            } else {
                r.state = JobState::Dead;
                r.run_in = 0;
                (Some(r), Answer::Dead)
            }
        }
        other => (other, Answer::Fenced),
    }
}

/// `release`: `UPDATE … SET state = 'pending', attempts = greatest(attempts - 1, 0), lease_until
/// = NULL, run_at = clock_timestamp() WHERE {cas}`.
pub fn release(row: Option<Row>, w: W, epoch: u8, g: &Guards) -> (Option<Row>, Answer) {
    match row {
        Some(mut r) if r.cas(w, epoch, g) => {
            r.state = JobState::Pending;
            r.attempts = r.attempts.saturating_sub(1);
            r.lease_left = 0;
            r.run_in = 0;
            (Some(r), Answer::Ok)
        }
        other => (other, Answer::Fenced),
    }
}
