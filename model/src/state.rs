//! The state of the model (the job's row, the workers, the broker, the receiver, the ghosts the
//! properties read) and the actions that move it.

use std::fmt;

use crate::W;
use crate::db::Row;

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
