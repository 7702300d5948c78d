//! An executable model of the brokerfence protocol (issue #17), checked with
//! [stateright](https://docs.rs/stateright).
//!
//! One job, 2–3 workers that may pause at any step (zombies), the job's database row, the
//! broker of one kind of source (table queue, SQS, Redis streams), a receiver with the epoch
//! ledger, and time as discrete ticks. Each step is named after the function it models, and its
//! transition is that function's statement: the WHERE of the SQL decides whether it applies, the
//! SET what it writes (see [`db`]).
//!
//! Time is kept relative: every deadline in the state is "ticks left" (lease end on the database
//! clock minus now, and so on), clamped where further ticks change no comparison. Every statement
//! compares a stored time with `clock_timestamp()` only, so this loses nothing and keeps the state
//! space finite without a bound on time; [`Action::Tick`] is always enabled.
//!
//! What it leaves out: several jobs and batches (one job, one key per statement), checkpoints,
//! `complete_in` and the outbox, retention and epoch floors, SQLite, FIFO groups, Redis lists,
//! broker counters (SQS receive count, stream delivery count: hints only), failures and timeouts
//! of the database or broker calls themselves, clock drift (every clock ticks at the rate of the
//! database's; the safety margin is 0 ticks), and row locks (each statement is one atomic step).
//!
//! ```
//! use brokerfence_model::{Bounds, ProtocolModel, Source};
//! use stateright::{Checker, Model};
//! let model = ProtocolModel::new(Source::Table, 2);
//! let model = model.with_bounds(Bounds { errors: 0, releases: 0, ..model.bounds });
//! let checker = model.checker().spawn_bfs().join();
//! checker.assert_properties();
//! assert!(checker.unique_state_count() > 1000);
//! ```

use std::fmt;

use stateright::{Model, Property};

pub mod db;
pub mod liveness;

pub use db::{Answer, JobState, Row};

/// Worker number (also its owner id: one owner per worker process).
pub type W = u8;

/// The kind of source the workers read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// The table queue: `claim_next` is the receive; no broker.
    Table,
    /// SQS: a message with visibility and receipt handles (LocalStack: stale handles accepted).
    Sqs,
    /// Redis streams: a consumer group's pending list, XAUTOCLAIM, XACK, and the lease key.
    RedisStream,
}

/// The safety guards. All on is the real code; each off is a negative control.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Guards {
    /// The claim increments the epoch (`epoch = t.epoch + 1`).
    pub epoch_increment: bool,
    /// complete/fail/release compare (owner, epoch, state = 'running') (`CAS`).
    pub commit_cas: bool,
    /// The heartbeat compares (owner, epoch, state = 'running').
    pub heartbeat_cas: bool,
    /// The supervisor cancels a handler on a lost lease or a passed deadline (`Guarded`).
    pub cancel_on_loss: bool,
    /// The receiver refuses epochs below its ledger's (`WHERE l.epoch <= EXCLUDED.epoch`).
    pub receiver_ledger: bool,
    /// The broker is told (delete, XACK) only after the database answered the commit.
    pub ack_after_commit: bool,
}

impl Default for Guards {
    fn default() -> Self {
        Self {
            epoch_increment: true,
            commit_cas: true,
            heartbeat_cas: true,
            cancel_on_loss: true,
            receiver_ledger: true,
            ack_after_commit: true,
        }
    }
}

/// The bounds of a check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// Workers (owners).
    pub workers: u8,
    /// Lease length in ticks; the heartbeat interval (lease/3) is one tick.
    pub lease: i8,
    /// Backoff of a failed attempt, in ticks (`RetryPolicy` with base = max).
    pub backoff: i8,
    /// Pauses in all (a pause lasts any number of steps of the others and any number of ticks).
    pub pauses: u8,
    /// Handler errors in all (each a `fail`).
    pub errors: u8,
    /// Shutdowns in all (each a `release` of a claimed job whose handler has not started).
    pub releases: u8,
    /// `max_attempts` of the retry policy (failures before dead).
    pub max_attempts: u8,
    /// `max_claims` of the store (claims before dead).
    pub max_claims: u8,
    /// SQS: a stale receipt handle still deletes or re-hides the message (LocalStack does this).
    pub stale_handles: bool,
    /// Handlers send their effect to the receiver (`HandlerSend`, `Accept`).
    pub effects: bool,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            workers: 2,
            lease: 3,
            backoff: 1,
            pauses: 1,
            errors: 1,
            releases: 1,
            max_attempts: 2,
            max_claims: 3,
            stale_handles: true,
            effects: true,
        }
    }
}

/// The model: one source kind, the guards, the bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProtocolModel {
    /// Source kind.
    pub source: Source,
    /// Guards (all on by default).
    pub guards: Guards,
    /// Bounds.
    pub bounds: Bounds,
}

/// What a worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// Nothing in hand.
    Idle,
    /// Holds a broker delivery it has not claimed yet.
    Received,
    /// Its handler runs under the lease.
    Running,
    /// The handler returned Ok but (guard off) the broker was told first: the ack step is next.
    EarlyAck,
    /// The handler returned (Ok = true, Err = false): the commit statement is next.
    Returned(bool),
    /// The database answered; the broker is told next.
    Settle(Disposition),
}

/// What the broker is told (the runtime's `Disposition`), times in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Disposition {
    /// Delete / XACK.
    Ack,
    /// Redeliver after the backoff.
    RetryLater(i8),
    /// Dead-letter (only when the database says dead).
    DeadLetter,
    /// Another owner holds a live lease: hide it this long.
    Hold(i8),
    /// Give it back now.
    Abandon,
    /// Touch nothing.
    Leave,
}

/// A worker's lease as the worker knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HeldLease {
    /// The fencing token.
    pub epoch: u8,
    /// Ghost: which claim of the job this is (1, 2, …), to tell attempts apart even when the
    /// epoch does not (guard off).
    pub serial: u8,
    /// Ticks left before the worker's own deadline (`claimed_at + ttl - margin`).
    pub deadline: i8,
    /// Ghost: ticks left of this epoch's lease on the database clock (the last `lease_until` the
    /// database wrote for this epoch), clamped at -1.
    pub granted: i8,
    /// The heartbeat found it lost.
    pub lost: bool,
    /// The handler sent its effect to the receiver.
    pub sent: bool,
    /// A confirmed renewal whose broker hint (`extend`) has not run yet.
    pub hint_due: bool,
}

/// One worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Worker {
    /// What it does.
    pub phase: Phase,
    /// Stalled (a GC pause, SIGSTOP): takes no step until resumed.
    pub paused: bool,
    /// The lease of its current attempt.
    pub lease: Option<HeldLease>,
}

/// The broker of the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Broker {
    /// No broker (table queue).
    None,
    /// One SQS message.
    Sqs {
        /// Not deleted yet.
        present: bool,
        /// Ticks until visible again (0: visible).
        hidden: i8,
        /// Who received it last (holds the newest receipt handle).
        newest: Option<W>,
    },
    /// One stream entry of a consumer group, and the job's lease key.
    Stream {
        /// Delivered by XREADGROUP at least once.
        delivered: bool,
        /// In the pending list, and whose (None once acknowledged).
        pending: Option<W>,
        /// Ticks until its idle time passes the visibility hint (XAUTOCLAIM may take it).
        reclaim_in: i8,
        /// The lease key: token (owner, epoch) and ticks left.
        lease_key: Option<(W, u8, i8)>,
    },
}

/// The receiver and the effects in flight to it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Receiver {
    /// The ledger's epoch of the job (`ledger.accept`).
    pub ledger: Option<u8>,
    /// Effects sent and not yet delivered: (epoch, serial), sorted.
    pub in_flight: Vec<(u8, u8)>,
    /// Highest epoch accepted so far.
    pub max_epoch: Option<u8>,
    /// Highest attempt serial accepted so far.
    pub max_serial: Option<u8>,
    /// Ghost: an accepted epoch was lower than one accepted before.
    pub epoch_went_back: bool,
    /// Ghost: an accepted effect came from an older attempt than one accepted before.
    pub attempt_went_back: bool,
}

/// The whole state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// The job's row (None: not inserted yet).
    pub row: Option<Row>,
    /// The workers.
    pub workers: Vec<Worker>,
    /// The broker.
    pub broker: Broker,
    /// The receiver.
    pub receiver: Receiver,
    /// Pauses left.
    pub pauses_left: u8,
    /// Handler errors left.
    pub errors_left: u8,
    /// Shutdown releases left.
    pub releases_left: u8,
    /// Ghost: claims so far (the serial of the newest attempt).
    pub claims: u8,
    /// Ghost: results committed so far.
    pub commits: u8,
    /// Ghost: a result committed by an attempt that was not the current one.
    pub foreign_commit: bool,
    /// Ghost: a handler took a step after its lease ended on the database clock.
    pub ran_past_lease: bool,
}

/// A step, named after the function it models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// One tick of the database clock (everyone's clock runs at the same rate).
    Tick,
    /// The worker stalls.
    Pause(W),
    /// The worker resumes.
    Resume(W),
    /// Table queue: `claim_next`.
    ClaimNext(W),
    /// SQS `ReceiveMessage` (visibility = the lease).
    SqsReceive(W),
    /// Redis `XREADGROUP >`.
    XReadGroup(W),
    /// Redis `XAUTOCLAIM` of an entry idle past the visibility hint.
    XAutoClaim(W),
    /// `claim_batch` of the delivery in hand.
    ClaimBatch(W),
    /// `heartbeat` (the supervisor's tick, every lease/3).
    Heartbeat(W),
    /// The source hook after a confirmed renewal: SQS `ChangeMessageVisibility`, Redis `STREAM_EXTEND`.
    Extend(W),
    /// The supervisor's `Guarded` check: the lease is lost or the deadline passed; the handler is dropped.
    Cancel(W),
    /// The handler sends its effect to the receiver (`Ledger` convention: job + epoch).
    HandlerSend(W),
    /// The handler returns Ok.
    HandlerOk(W),
    /// The handler returns Err.
    HandlerErr(W),
    /// `complete` (the fenced commit).
    Complete(W),
    /// `fail` (the fenced failure record).
    Fail(W),
    /// `release` of a claimed job whose handler has not started (shutdown).
    Release(W),
    /// The broker is told the worker's disposition (`ack`, `retry_later`, `hold`, `abandon`,
    /// `dead_letter` of the source).
    Settle(W),
    /// The receiver's `accept` of the i-th effect in flight.
    Accept(u8),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

impl ProtocolModel {
    /// The correct model (all guards on) of `source` with `workers` workers and default bounds.
    ///
    /// The receiver's effects are modelled with the table queue only (they do not depend on the
    /// source, and they multiply the state space of the broker sources by about 15).
    ///
    /// ```
    /// use brokerfence_model::{ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Sqs, 2);
    /// assert!(model.guards.commit_cas && !model.bounds.effects);
    /// ```
    pub fn new(source: Source, workers: u8) -> Self {
        let effects = source == Source::Table;
        Self { source, guards: Guards::default(), bounds: Bounds { workers, effects, ..Bounds::default() } }
    }

    /// The same model with other guards: a negative control.
    ///
    /// ```
    /// use brokerfence_model::{Guards, ProtocolModel, SAFETY, Source};
    /// let broken = ProtocolModel::new(Source::Table, 2)
    ///     .with_guards(Guards { commit_cas: false, ..Guards::default() });
    /// let report = broken.check_safety(1);
    /// assert!(report.counterexamples.contains_key(SAFETY[0]));
    /// ```
    pub fn with_guards(mut self, guards: Guards) -> Self {
        self.guards = guards;
        self
    }

    /// The same model with other bounds.
    ///
    /// ```
    /// use brokerfence_model::{Bounds, ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let model = model.with_bounds(Bounds { errors: 0, releases: 0, ..model.bounds });
    /// assert_eq!(model.bounds.errors, 0);
    /// ```
    pub fn with_bounds(mut self, bounds: Bounds) -> Self {
        self.bounds = bounds;
        self
    }

    /// The database's answer to a store step in `s`, and the row after it (None when `a` is no
    /// store step or is not enabled). Shared by the transition and the replay against the real store.
    ///
    /// ```
    /// use brokerfence_model::{Action, Answer, ProtocolModel, Source};
    /// use stateright::Model;
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let init = &model.init_states()[0];
    /// let (_, answer) = model.store_step(init, Action::ClaimNext(0)).unwrap();
    /// assert_eq!(answer, Answer::Claimed { epoch: 1 });
    /// ```
    pub fn store_step(&self, s: &State, a: Action) -> Option<(Option<Row>, Answer)> {
        let g = &self.guards;
        let b = &self.bounds;
        match a {
            Action::ClaimNext(w) => {
                let wk = s.workers.get(usize::from(w))?;
                (self.source == Source::Table && wk.phase == Phase::Idle && !wk.paused)
                    .then(|| db::claim_next(s.row, w, b, g))
            }
            Action::ClaimBatch(w) => {
                let wk = s.workers.get(usize::from(w))?;
                (wk.phase == Phase::Received && !wk.paused).then(|| db::claim_batch(s.row, w, b, g))
            }
            Action::Heartbeat(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && matches!(wk.phase, Phase::Running | Phase::Returned(_) | Phase::EarlyAck))
                    .then(|| db::heartbeat(s.row, w, l.epoch, b, g))
            }
            Action::Complete(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Returned(true)).then(|| db::complete(s.row, w, l.epoch, g))
            }
            Action::Fail(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Returned(false)).then(|| db::fail(s.row, w, l.epoch, b, g))
            }
            Action::Release(w) => {
                let wk = s.workers.get(usize::from(w))?;
                let l = wk.lease?;
                (!wk.paused && wk.phase == Phase::Running && !l.sent && s.releases_left > 0)
                    .then(|| db::release(s.row, w, l.epoch, g))
            }
            _ => None,
        }
    }

    /// Whether the handler of `w` may take a step now (the supervisor's `Guarded` poll check).
    fn handler_may_run(&self, wk: &Worker) -> bool {
        match wk.lease {
            Some(l) if wk.phase == Phase::Running && !wk.paused => {
                !self.guards.cancel_on_loss || (!l.lost && l.deadline > 0)
            }
            _ => false,
        }
    }

    /// A handler step: notes whether it runs past its lease on the database clock.
    fn handler_step(s: &mut State, w: usize) {
        if let Some(l) = s.workers[w].lease
            && l.granted < 0
        {
            s.ran_past_lease = true;
        }
    }

    /// Whether the message or entry of the job has been deleted or acknowledged at the broker.
    pub fn broker_done(&self, s: &State) -> bool {
        match s.broker {
            Broker::None => false,
            Broker::Sqs { present, .. } => !present,
            Broker::Stream { delivered, pending, .. } => delivered && pending.is_none(),
        }
    }

    /// Every job completed or dead.
    pub fn all_done(&self, s: &State) -> bool {
        matches!(s.row, Some(r) if matches!(r.state, JobState::Completed | JobState::Dead))
    }

    fn settle(&self, s: &mut State, w: W, d: Disposition) {
        let wi = usize::from(w);
        let lease = s.workers[wi].lease;
        let stale_ok = self.bounds.stale_handles;
        match &mut s.broker {
            Broker::None => {}
            Broker::Sqs { present, hidden, newest } => {
                // Every call with a receipt handle: accepted with the newest one, and (LocalStack)
                // with a stale one too.
                let accepted = *present && (stale_ok || *newest == Some(w));
                if accepted {
                    match d {
                        // DeleteMessage; dead-letter = SendMessage to the DLQ, then DeleteMessage.
                        Disposition::Ack | Disposition::DeadLetter => *present = false,
                        Disposition::RetryLater(t) | Disposition::Hold(t) => *hidden = t.max(0),
                        Disposition::Abandon => *hidden = 0,
                        Disposition::Leave => {}
                    }
                }
            }
            Broker::Stream { pending, reclaim_in, lease_key, .. } => {
                let ours = |k: &Option<(W, u8, i8)>| matches!((k, lease), (Some((o, e, _)), Some(l)) if *o == w && *e == l.epoch);
                match d {
                    // XACK (it does not check the consumer); the lease key released by compare-and-set.
                    // STREAM_DEAD: XACK, and the copy to the dead stream only if that acknowledged it.
                    Disposition::Ack | Disposition::DeadLetter => {
                        *pending = None;
                        if ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                    // reclaim_after: XCLAIM … IDLE so that XAUTOCLAIM takes it after the delay;
                    // retry_later and abandon also release the lease key if ours.
                    Disposition::RetryLater(_) | Disposition::Hold(_) | Disposition::Abandon => {
                        if pending.is_some() {
                            *pending = Some(w);
                            *reclaim_in = match d {
                                Disposition::RetryLater(t) | Disposition::Hold(t) => t.max(0),
                                _ => 0,
                            };
                        }
                        if !matches!(d, Disposition::Hold(_)) && ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                    Disposition::Leave => {
                        // The `lost` hook: release_lost, by compare-and-set.
                        if ours(lease_key) {
                            *lease_key = None;
                        }
                    }
                }
            }
        }
    }

    fn after_claim(&self, s: &mut State, w: W, answer: Answer) {
        let wi = usize::from(w);
        let lease = self.bounds.lease;
        match answer {
            Answer::Claimed { epoch } => {
                s.claims += 1;
                s.workers[wi].phase = Phase::Running;
                s.workers[wi].lease = Some(HeldLease {
                    epoch,
                    serial: s.claims,
                    deadline: lease,
                    granted: lease,
                    lost: false,
                    sent: false,
                    hint_due: false,
                });
                if let Some(r) = s.row.as_mut() {
                    r.serial = s.claims;
                }
            }
            other => {
                let d = match other {
                    Answer::Busy { ttl } => Disposition::Hold(ttl),
                    Answer::Done => Disposition::Ack,
                    Answer::Dead => Disposition::DeadLetter,
                    Answer::Backoff { retry_in } => Disposition::RetryLater(retry_in),
                    _ => Disposition::Leave,
                };
                s.workers[wi].phase = if self.source == Source::Table { Phase::Idle } else { Phase::Settle(d) };
            }
        }
    }
}

impl Model for ProtocolModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = &self.bounds;
        let (row, broker) = match self.source {
            // enqueue: the row exists, pending, at the queue's epoch floor (0).
            Source::Table => (Some(Row::pending()), Broker::None),
            // The producer sent the message; the row is inserted by the first claim.
            Source::Sqs => (None, Broker::Sqs { present: true, hidden: 0, newest: None }),
            Source::RedisStream => {
                (None, Broker::Stream { delivered: false, pending: None, reclaim_in: 0, lease_key: None })
            }
        };
        vec![State {
            row,
            workers: vec![Worker { phase: Phase::Idle, paused: false, lease: None }; usize::from(b.workers)],
            broker,
            receiver: Receiver::default(),
            pauses_left: b.pauses,
            errors_left: b.errors,
            releases_left: b.releases,
            claims: 0,
            commits: 0,
            foreign_commit: false,
            ran_past_lease: false,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        out.push(Action::Tick);
        for (i, wk) in s.workers.iter().enumerate() {
            let w = i as W;
            if wk.paused {
                out.push(Action::Resume(w));
                continue;
            }
            if s.pauses_left > 0 {
                out.push(Action::Pause(w));
            }
            match wk.phase {
                Phase::Idle => match (self.source, s.broker) {
                    (Source::Table, _) => out.push(Action::ClaimNext(w)),
                    (Source::Sqs, Broker::Sqs { present: true, hidden: 0, .. }) => out.push(Action::SqsReceive(w)),
                    (Source::RedisStream, Broker::Stream { delivered, pending, reclaim_in, .. }) => {
                        if !delivered {
                            out.push(Action::XReadGroup(w));
                        } else if pending.is_some() && reclaim_in == 0 {
                            out.push(Action::XAutoClaim(w));
                        }
                    }
                    _ => {}
                },
                Phase::Received => out.push(Action::ClaimBatch(w)),
                Phase::Running => {
                    out.push(Action::Heartbeat(w));
                    let l = wk.lease;
                    if l.is_some_and(|l| l.hint_due) {
                        out.push(Action::Extend(w));
                    }
                    if self.handler_may_run(wk) {
                        if self.bounds.effects && l.is_some_and(|l| !l.sent) {
                            out.push(Action::HandlerSend(w));
                        }
                        out.push(Action::HandlerOk(w));
                        if s.errors_left > 0 {
                            out.push(Action::HandlerErr(w));
                        }
                    } else if self.guards.cancel_on_loss {
                        out.push(Action::Cancel(w));
                    }
                    if s.releases_left > 0 && l.is_some_and(|l| !l.sent) {
                        out.push(Action::Release(w));
                    }
                }
                Phase::EarlyAck => {
                    out.push(Action::Heartbeat(w));
                    out.push(Action::Settle(w));
                }
                Phase::Returned(ok) => {
                    out.push(Action::Heartbeat(w));
                    if wk.lease.is_some_and(|l| l.hint_due) {
                        out.push(Action::Extend(w));
                    }
                    out.push(if ok { Action::Complete(w) } else { Action::Fail(w) });
                }
                Phase::Settle(_) => out.push(Action::Settle(w)),
            }
        }
        for i in 0..s.receiver.in_flight.len() {
            out.push(Action::Accept(i as u8));
        }
    }

    fn next_state(&self, last: &State, a: Action) -> Option<State> {
        let mut s = last.clone();
        let lease_len = self.bounds.lease;
        match a {
            Action::Tick => {
                if let Some(r) = s.row.as_mut() {
                    r.tick();
                }
                for wk in &mut s.workers {
                    if let Some(l) = wk.lease.as_mut() {
                        l.deadline = (l.deadline - 1).max(-1);
                        l.granted = (l.granted - 1).max(-1);
                    }
                }
                match &mut s.broker {
                    Broker::None => {}
                    Broker::Sqs { hidden, .. } => *hidden = (*hidden - 1).max(0),
                    Broker::Stream { reclaim_in, lease_key, .. } => {
                        *reclaim_in = (*reclaim_in - 1).max(0);
                        if let Some((_, _, ttl)) = lease_key.as_mut() {
                            *ttl -= 1;
                        }
                        if matches!(lease_key, Some((_, _, t)) if *t <= 0) {
                            *lease_key = None;
                        }
                    }
                }
            }
            Action::Pause(w) => {
                s.workers[usize::from(w)].paused = true;
                s.pauses_left -= 1;
            }
            Action::Resume(w) => s.workers[usize::from(w)].paused = false,
            Action::SqsReceive(w) => {
                if let Broker::Sqs { hidden, newest, .. } = &mut s.broker {
                    *hidden = lease_len;
                    *newest = Some(w);
                }
                s.workers[usize::from(w)].phase = Phase::Received;
            }
            Action::XReadGroup(w) | Action::XAutoClaim(w) => {
                if let Broker::Stream { delivered, pending, reclaim_in, .. } = &mut s.broker {
                    *delivered = true;
                    *pending = Some(w);
                    *reclaim_in = lease_len;
                }
                s.workers[usize::from(w)].phase = Phase::Received;
            }
            Action::ClaimNext(w) | Action::ClaimBatch(w) => {
                let (row, answer) = self.store_step(last, a)?;
                if answer == Answer::Nothing {
                    return None;
                }
                s.row = row;
                self.after_claim(&mut s, w, answer);
            }
            Action::Heartbeat(w) => {
                let (row, answer) = self.store_step(last, a)?;
                s.row = row;
                let wi = usize::from(w);
                match answer {
                    Answer::Renewed => {
                        if let Some(l) = s.workers[wi].lease.as_mut() {
                            l.deadline = lease_len;
                            l.hint_due = self.source != Source::Table;
                        }
                    }
                    _ => {
                        if let Some(l) = s.workers[wi].lease.as_mut() {
                            l.lost = true;
                        }
                    }
                }
                // The lease end the database now holds belongs to the row's current epoch.
                if let Some(r) = s.row
                    && r.state == JobState::Running
                {
                    for (i, wk) in s.workers.iter_mut().enumerate() {
                        if let Some(l) = wk.lease.as_mut()
                            && r.owner == Some(i as W)
                            && r.epoch == l.epoch
                            && l.serial == r.serial
                        {
                            l.granted = l.granted.max(r.lease_left);
                        }
                    }
                }
            }
            Action::Extend(w) => {
                let wi = usize::from(w);
                let l = s.workers[wi].lease?;
                s.workers[wi].lease = Some(HeldLease { hint_due: false, ..l });
                let stale_ok = self.bounds.stale_handles;
                match &mut s.broker {
                    Broker::Sqs { present, hidden, newest } => {
                        // ChangeMessageVisibility to the time left on the database lease.
                        if *present && (stale_ok || *newest == Some(w)) {
                            *hidden = l.deadline.max(0);
                        }
                    }
                    Broker::Stream { pending, reclaim_in, lease_key, .. } => {
                        // STREAM_EXTEND.
                        let held = matches!(lease_key, Some((o, e, _)) if *o == w && *e == l.epoch);
                        let take = held || lease_key.is_none() || matches!(lease_key, Some((_, e, _)) if *e < l.epoch);
                        if take {
                            *lease_key = Some((w, l.epoch, lease_len));
                            if pending.is_some() && (held || *pending == Some(w)) {
                                *pending = Some(w);
                                *reclaim_in = lease_len;
                            }
                        }
                    }
                    Broker::None => {}
                }
            }
            Action::Cancel(w) => {
                let wi = usize::from(w);
                s.workers[wi].phase = Phase::Settle(Disposition::Leave);
            }
            Action::HandlerSend(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                let l = s.workers[wi].lease.as_mut()?;
                l.sent = true;
                let m = (l.epoch, l.serial);
                if let Err(i) = s.receiver.in_flight.binary_search(&m) {
                    s.receiver.in_flight.insert(i, m);
                }
            }
            Action::HandlerOk(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                s.workers[wi].phase = if self.guards.ack_after_commit || self.source == Source::Table {
                    Phase::Returned(true)
                } else {
                    Phase::EarlyAck
                };
            }
            Action::HandlerErr(w) => {
                let wi = usize::from(w);
                Self::handler_step(&mut s, wi);
                s.errors_left -= 1;
                s.workers[wi].phase = Phase::Returned(false);
            }
            Action::Complete(w) | Action::Fail(w) | Action::Release(w) => {
                let (row, answer) = self.store_step(last, a)?;
                let wi = usize::from(w);
                let l = s.workers[wi].lease?;
                if matches!(a, Action::Complete(_)) && answer == Answer::Ok {
                    s.commits += 1;
                    let current = last.row.is_some_and(|r| r.epoch == l.epoch && r.serial == l.serial);
                    if !current {
                        s.foreign_commit = true;
                    }
                }
                if matches!(a, Action::Release(_)) {
                    s.releases_left -= 1;
                }
                s.row = row;
                let d = match answer {
                    Answer::Ok if matches!(a, Action::Complete(_)) => Disposition::Ack,
                    Answer::Ok => Disposition::Abandon,
                    Answer::Retry { retry_in } => Disposition::RetryLater(retry_in),
                    Answer::Dead => Disposition::DeadLetter,
                    _ => Disposition::Leave,
                };
                s.workers[wi].phase = if self.source == Source::Table { Phase::Idle } else { Phase::Settle(d) };
                if self.source == Source::Table {
                    s.workers[wi].lease = None;
                }
            }
            Action::Settle(w) => {
                let wi = usize::from(w);
                match last.workers[wi].phase {
                    Phase::EarlyAck => {
                        self.settle(&mut s, w, Disposition::Ack);
                        s.workers[wi].phase = Phase::Returned(true);
                        return Some(s);
                    }
                    Phase::Settle(d) => self.settle(&mut s, w, d),
                    _ => return None,
                }
                s.workers[wi].phase = Phase::Idle;
                s.workers[wi].lease = None;
            }
            Action::Accept(i) => {
                let (epoch, serial) = s.receiver.in_flight.remove(usize::from(i));
                let r = &mut s.receiver;
                // ledger.accept: INSERT … ON CONFLICT DO UPDATE SET epoch = EXCLUDED.epoch
                // WHERE l.epoch <= EXCLUDED.epoch — no row back: refused.
                let accepted = !self.guards.receiver_ledger || r.ledger.is_none_or(|e| e <= epoch);
                if accepted {
                    r.ledger = Some(epoch);
                    if r.max_epoch.is_some_and(|e| epoch < e) {
                        r.epoch_went_back = true;
                    }
                    if r.max_serial.is_some_and(|x| serial < x) {
                        r.attempt_went_back = true;
                    }
                    r.max_epoch = Some(r.max_epoch.map_or(epoch, |e| e.max(epoch)));
                    r.max_serial = Some(r.max_serial.map_or(serial, |x| x.max(serial)));
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one committed result, by the current attempt", |_: &ProtocolModel, s: &State| {
                s.commits <= 1 && !s.foreign_commit
            }),
            Property::always(
                "the receiver never accepts a lower epoch (or an older attempt)",
                |_: &ProtocolModel, s: &State| !s.receiver.epoch_went_back && !s.receiver.attempt_went_back,
            ),
            Property::always(
                "no broker delete or ack before the job is committed or dead",
                |m: &ProtocolModel, s: &State| !m.broker_done(s) || m.all_done(s),
            ),
            Property::always("no handler runs past its lease on the database clock", |_: &ProtocolModel, s: &State| {
                !s.ran_past_lease
            }),
        ]
    }
}

/// The names of the four safety properties, in the order of [`Model::properties`].
pub const SAFETY: [&str; 4] = [
    "at most one committed result, by the current attempt",
    "the receiver never accepts a lower epoch (or an older attempt)",
    "no broker delete or ack before the job is committed or dead",
    "no handler runs past its lease on the database clock",
];

/// What a bounded safety check found.
#[derive(Debug)]
pub struct SafetyReport {
    /// Distinct states explored.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// Longest path explored.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: std::time::Duration,
    /// Counterexamples by property name: the shortest path of steps to a violation (BFS).
    pub counterexamples: std::collections::BTreeMap<&'static str, Vec<Action>>,
}

impl ProtocolModel {
    /// Checks the four safety properties on every state reachable within the bounds
    /// (breadth-first, `threads` threads). Stops at the first counterexample.
    ///
    /// ```
    /// use brokerfence_model::{Bounds, ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let model = model.with_bounds(Bounds { errors: 0, releases: 0, ..model.bounds });
    /// let report = model.check_safety(1);
    /// assert!(report.counterexamples.is_empty());
    /// println!("{} states", report.unique_states);
    /// ```
    pub fn check_safety(self, threads: usize) -> SafetyReport {
        use stateright::Checker;
        let started = std::time::Instant::now();
        let checker =
            self.checker().threads(threads).finish_when(stateright::HasDiscoveries::AnyFailures).spawn_bfs().join();
        // Each path cut at the first state that breaks its property (a discovery's path can run
        // a step past it).
        let properties = self.properties();
        let counterexamples = checker
            .discoveries()
            .into_iter()
            .map(|(name, path)| {
                let mut path = path.into_actions();
                let holds = properties.iter().find(|p| p.name == name).map(|p| p.condition);
                if let (Some(holds), Some(states)) = (holds, self.states_along(&path))
                    && let Some(first) = states.iter().position(|s| !holds(&self, s))
                {
                    path.truncate(first);
                }
                (name, path)
            })
            .collect();
        SafetyReport {
            unique_states: checker.unique_state_count(),
            states: checker.state_count(),
            max_depth: checker.max_depth(),
            elapsed: started.elapsed(),
            counterexamples,
        }
    }

    /// The states along `path` from the initial state (None if a step is not enabled).
    ///
    /// ```
    /// use brokerfence_model::{Action, JobState, ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let states = model.states_along(&[Action::ClaimNext(0), Action::HandlerOk(0), Action::Complete(0)]).unwrap();
    /// assert_eq!(states.last().unwrap().row.unwrap().state, JobState::Completed);
    /// assert!(model.states_along(&[Action::Complete(0)]).is_none()); // nothing to complete yet
    /// ```
    pub fn states_along(&self, path: &[Action]) -> Option<Vec<State>> {
        let mut out = self.init_states();
        out.truncate(1);
        for &a in path {
            let last = out.last()?;
            let mut enabled = Vec::new();
            self.actions(last, &mut enabled);
            if !enabled.contains(&a) {
                return None;
            }
            let next = self.next_state(last, a)?;
            out.push(next);
        }
        Some(out)
    }
}
