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
//!
//! The crate's files: this one holds the model's parameters ([`ProtocolModel`], [`Source`],
//! [`Guards`], [`Bounds`]); `state` the state and the actions; `steps` the transitions (the
//! stateright [`Model`](stateright::Model) and the store statements they apply); `check` the bounded
//! safety check; [`db`] the row and its statements; [`liveness`] the liveness check.

mod check;
pub mod db;
pub mod liveness;
mod state;
mod steps;

pub use check::{SAFETY, SafetyReport};
pub use db::{Answer, JobState, Row};
pub use state::{Action, Broker, Disposition, HeldLease, Phase, Receiver, State, Worker};

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
    ///     .guards(Guards { commit_cas: false, ..Guards::default() });
    /// let report = broken.check_safety(1);
    /// assert!(report.counterexamples.contains_key(SAFETY[0]));
    /// ```
    pub fn guards(mut self, guards: Guards) -> Self {
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
}
