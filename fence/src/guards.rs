//! The safety guards, and (only with the `guard-switches` feature) a way to turn one off so that
//! the proof tests can show the suite notices a missing guard. Production builds cannot disable any.

/// Which guards are active. All are on by default, and without the `guard-switches` feature there
/// is no way to turn one off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guards {
    pub(crate) epoch_increment: bool,
    pub(crate) commit_cas: bool,
    pub(crate) heartbeat_cas: bool,
    pub(crate) ledger_check: bool,
    pub(crate) fenced_tx_rollback: bool,
    pub(crate) receiver_ledger_lock: bool,
    pub(crate) timeline_epochs: bool,
    pub(crate) ledger_owner_check: bool,
    pub(crate) own_tx_depth_check: bool,
}

impl Default for Guards {
    fn default() -> Self {
        Self {
            epoch_increment: true,
            commit_cas: true,
            heartbeat_cas: true,
            ledger_check: true,
            fenced_tx_rollback: true,
            receiver_ledger_lock: true,
            timeline_epochs: true,
            ledger_owner_check: true,
            own_tx_depth_check: true,
        }
    }
}

impl Guards {
    /// Whether the claim increments the epoch.
    pub fn epoch_increment(&self) -> bool {
        self.epoch_increment
    }
    /// Whether complete/fail/checkpoint/release compare (owner, epoch, state).
    pub fn commit_cas(&self) -> bool {
        self.commit_cas
    }
    /// Whether the heartbeat compares (owner, epoch, state).
    pub fn heartbeat_cas(&self) -> bool {
        self.heartbeat_cas
    }
    /// Whether the receiver ledger refuses older epochs.
    pub fn ledger_check(&self) -> bool {
        self.ledger_check
    }
    /// Whether a fenced `complete_in` makes the caller's transaction unable to commit its rows.
    pub fn fenced_tx_rollback(&self) -> bool {
        self.fenced_tx_rollback
    }
    /// Whether the atomic receiver locks the ledger row inside the handler's transaction.
    pub fn receiver_ledger_lock(&self) -> bool {
        self.receiver_ledger_lock
    }
    /// Whether a PostgreSQL claim starts the epoch at the server's timeline base, so that the
    /// epochs a promoted standby hands out are above every epoch of the timeline it left (see
    /// [`crate::epoch`]).
    pub fn timeline_epochs(&self) -> bool {
        self.timeline_epochs
    }
    /// Whether the receiver ledger refuses an equal epoch from another owner (a token handed
    /// out twice) instead of taking it for the same attempt retrying.
    pub fn ledger_owner_check(&self) -> bool {
        self.ledger_owner_check
    }
    /// Whether `complete_in` refuses a connection outside one top-level transaction (autocommit,
    /// or a savepoint whose rollback would clear the fenced abort).
    pub fn own_tx_depth_check(&self) -> bool {
        self.own_tx_depth_check
    }
}

#[cfg(feature = "guard-switches")]
#[doc(hidden)]
impl Guards {
    /// TEST ONLY: claims stop incrementing the epoch.
    pub fn without_epoch_increment(mut self) -> Self {
        self.epoch_increment = false;
        self
    }
    /// TEST ONLY: commits stop comparing owner and epoch.
    pub fn without_commit_cas(mut self) -> Self {
        self.commit_cas = false;
        self
    }
    /// TEST ONLY: heartbeats stop comparing owner and epoch.
    pub fn without_heartbeat_cas(mut self) -> Self {
        self.heartbeat_cas = false;
        self
    }
    /// TEST ONLY: the receiver ledger accepts any epoch.
    pub fn without_ledger_check(mut self) -> Self {
        self.ledger_check = false;
        self
    }
    /// TEST ONLY: a fenced `complete_in` leaves the caller's transaction able to commit.
    pub fn without_fenced_tx_rollback(mut self) -> Self {
        self.fenced_tx_rollback = false;
        self
    }
    /// TEST ONLY: the atomic receiver accepts the epoch outside the handler's transaction
    /// (check-then-act, like the check-only guard).
    pub fn without_receiver_ledger_lock(mut self) -> Self {
        self.receiver_ledger_lock = false;
        self
    }
    /// TEST ONLY: PostgreSQL claims increment the epoch whatever the timeline (the fence before
    /// it survived promotions: a promoted standby hands out epochs the old primary gave already).
    pub fn without_timeline_epochs(mut self) -> Self {
        self.timeline_epochs = false;
        self
    }
    /// TEST ONLY: the receiver ledger accepts an equal epoch whoever sends it.
    pub fn without_ledger_owner_check(mut self) -> Self {
        self.ledger_owner_check = false;
        self
    }
    /// TEST ONLY: `complete_in` takes any connection, in a savepoint or in autocommit too (the
    /// fence before issue #30, item 6).
    pub fn without_own_tx_depth_check(mut self) -> Self {
        self.own_tx_depth_check = false;
        self
    }
}
