//! What an epoch (the fencing token) is made of, and why it never repeats across a promotion.
//!
//! An epoch is one `i64`, compared by magnitude everywhere (the job row, the receivers' ledger,
//! the `Fence-Epoch` header): a claim hands out the job's epoch plus one. On PostgreSQL a claim
//! also starts it at least at its server's **timeline base**:
//!
//! ```text
//! epoch = (timeline - 1) × 2^32 + n        n = 1, 2, … claims of the job on that timeline
//! ```
//!
//! PostgreSQL gives a promoted standby a new timeline, one above the highest it knows of. So the
//! first claim of a job on the promoted server jumps to `(timeline - 1) × 2^32 + 1`, above every
//! epoch the old primary handed out on the timeline it was on, including the claims that were
//! lost with it (asynchronous replication) and those an old primary that is still running (cut
//! off, not yet shut down) goes on handing out: a receiver that keeps the newest epoch per job
//! then refuses the old primary's tokens once it has seen the new one's. A server that was never
//! promoted is on timeline 1, where the base is 0: its epochs are 1, 2, 3, … as they always were,
//! and rows claimed before this encoding keep working (nothing to migrate).
//!
//! Bounds (where the guarantee ends):
//! - a job claimed 2^32 (4,294,967,296) times on one timeline overflows into the next
//!   timeline's range: its epochs still grow, but a later promotion may repeat them;
//! - timelines up to 2^31: past that a claim fails ("bigint out of range") rather than wrap;
//! - two servers promoted from the same timeline (two standbys promoted at once: split brain)
//!   both take the same next timeline and hand out the same tokens: keeping one primary is the
//!   HA manager's job (Patroni's DCS lock, a cloud's fencing). The ledger refuses an equal
//!   epoch from a different owner ([`Verdict::Conflict`](crate::ledger::Verdict::Conflict)), so a
//!   receiver that records owners still applies one effect per token;
//! - a server whose timeline went back (a database copied with `pg_dump` into a new cluster)
//!   keeps each job's epochs growing, but only promotions from then on are covered;
//! - failovers that keep the timeline (storage-level replication, logical replication) are not
//!   told apart: storage-level HA loses no acknowledged write, so nothing repeats; a logical
//!   replica promoted after losing writes can repeat tokens.
//!
//! SQLite has one host and no standby: its epochs are the row's plus one.
//!
//! ```
//! use brokerfence::epoch::{EPOCHS_PER_TIMELINE, timeline_of};
//! assert_eq!(timeline_of(7), 1); // a server never promoted
//! assert_eq!(timeline_of(EPOCHS_PER_TIMELINE + 1), 2); // the first claim after one promotion
//! assert!(EPOCHS_PER_TIMELINE + 1 > EPOCHS_PER_TIMELINE - 5); // beats every timeline-1 epoch
//! ```

/// How many epochs one timeline spans: 2^32.
pub const EPOCHS_PER_TIMELINE: i64 = 1 << 32;

/// The PostgreSQL timeline an epoch was handed out on (1 for epochs below 2^32 + 1, and for 0,
/// the epoch of a job never claimed).
///
/// ```
/// assert_eq!(brokerfence::epoch::timeline_of(3 * brokerfence::epoch::EPOCHS_PER_TIMELINE + 9), 4);
/// ```
pub fn timeline_of(epoch: i64) -> u32 {
    u32::try_from((epoch.max(1) - 1) / EPOCHS_PER_TIMELINE + 1).unwrap_or(u32::MAX)
}

/// The first epoch a claim hands out on `timeline`: `(timeline - 1) × 2^32 + 1`.
///
/// ```
/// assert_eq!(brokerfence::epoch::first_on_timeline(1), 1);
/// assert_eq!(brokerfence::epoch::first_on_timeline(2), (1 << 32) + 1);
/// ```
pub fn first_on_timeline(timeline: u32) -> i64 {
    (i64::from(timeline.max(1)) - 1) * EPOCHS_PER_TIMELINE + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failover_epoch_timelines_round_trip() {
        for tl in [1u32, 2, 3, 1000, i32::MAX as u32] {
            let first = first_on_timeline(tl);
            assert_eq!(timeline_of(first), tl);
            assert_eq!(timeline_of(first + EPOCHS_PER_TIMELINE - 1), tl, "the last epoch of timeline {tl}");
            if tl > 1 {
                assert_eq!(timeline_of(first - 1), tl - 1);
            }
        }
        assert_eq!(timeline_of(0), 1);
    }
}
