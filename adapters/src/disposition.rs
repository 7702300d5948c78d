//! The one mapping from what the fence decided to what the broker is told. Shared by the
//! consumer runtime and the retrofit middleware, so both treat a delivery the same way.

use std::time::Duration;

use fence::{Claim, Outcome};

/// What to do with a delivery at the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Acknowledge (delete) it: its result is committed, or it duplicates a completed job.
    Ack,
    /// Redeliver after the backoff (a fenced failure was recorded).
    RetryLater(Duration),
    /// Move it to the dead-letter destination, with the reason.
    DeadLetter(String),
    /// Another owner holds a live lease: hide it for that long.
    Hold(Duration),
    /// Give it back now (released at shutdown).
    Abandon,
    /// Touch nothing: the lease was lost or the commit was fenced or failed. A stale broker handle
    /// is no fence, so the delivery is left to the broker and to the owner of the newer epoch.
    Leave,
}

impl Disposition {
    /// For a claim that did not hand this worker a lease; `None` when it did.
    pub fn after_claim(claim: &Claim) -> Option<Self> {
        match claim {
            Claim::Claimed(_) => None,
            Claim::Busy { ttl, .. } => Some(Disposition::Hold(*ttl)),
            Claim::Done { .. } => Some(Disposition::Ack),
            Claim::Dead { epoch } => Some(Disposition::DeadLetter(format!("job is dead (buried at epoch {epoch})"))),
            Claim::Backoff { retry_in, .. } => Some(Disposition::RetryLater(*retry_in)),
            // A claim this version does not know handed out no lease it can use: touch nothing.
            _ => Some(Disposition::Leave),
        }
    }

    /// For a finished attempt.
    pub fn after_run(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Completed => Disposition::Ack,
            Outcome::Failed { retry_in, .. } => Disposition::RetryLater(*retry_in),
            Outcome::Dead { error } => Disposition::DeadLetter(error.clone()),
            Outcome::Released => Disposition::Abandon,
            Outcome::LeaseLost { .. } | Outcome::Fenced(_) | Outcome::StoreError(_) => Disposition::Leave,
            _ => Disposition::Leave,
        }
    }

    /// What becomes of a delivery when the broker call that carries this disposition fails,
    /// for logs: each says what happens next and what, if anything, to check.
    pub(crate) fn when_broker_call_fails(&self) -> &'static str {
        match self {
            Disposition::Ack => {
                "the result is committed: the delivery will come back, the fence answers that the job is done, \
                 and it is acknowledged then (check the worker's permission to delete messages)"
            }
            Disposition::RetryLater(_) => {
                "the failure is recorded: the delivery will come back when its broker visibility ends, and the \
                 fence holds it until the rest of its backoff has passed"
            }
            Disposition::DeadLetter(_) => {
                "the job is dead in the database: the delivery will come back and be dead-lettered again; give \
                 the source a dead-letter destination it can write to (SQS: `SqsConfig::dead_letter` or the \
                 queue's RedrivePolicy; Redis: `dead_letter_stream`)"
            }
            Disposition::Hold(_) => {
                "another worker holds the job: the delivery may come back early, and the fence holds it again"
            }
            Disposition::Abandon => {
                "the job is released in the database: the delivery comes back when its broker visibility ends"
            }
            Disposition::Leave => "nothing was to be told",
        }
    }
}
