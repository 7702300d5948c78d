//! The claim cursor: where in `run_at` order this store's last claims of a queue ended, so that
//! the next claim starts there instead of reading past every job it already handed out.
//!
//! A claimed job stays in the `jobs_open` index while it runs (its claim is a HOT update,
//! migration 8), and it sits at the front of the queue's `run_at` order. A claim that scans from
//! the start reads past each of them before it finds a due job: at concurrency 128 with 256
//! jobs claimed ahead, 384 rows per claim statement, about 2 µs of PostgreSQL CPU per job
//! claimed (issue #18). With the cursor a claim starts at the newest `run_at` the store's claims
//! of that queue handed out.
//!
//! Jobs behind the cursor are not lost, only found later: a job whose lease ran out, a job that
//! another transaction held locked when a claim went past it (a claim that then rolled back), a
//! job whose enqueue committed after a claim went past its `run_at` (an enqueue in a long
//! transaction). A released, retried or requeued job is not behind it: those set `run_at` to
//! the database clock's now (a retry: later still), past every job handed out. Three rules find
//! them:
//! - a claim from the cursor that finds fewer jobs than it asked for is followed, in the same
//!   `claim_next` call, by one from the start for the rest: `claim_next` answers fewer than asked
//!   only when a scan of the whole queue found no more;
//! - while scans from the start come back short (the queue's due jobs fit in one claim), claims
//!   keep scanning from the start, one statement each;
//! - at least every rescan interval ([`PgFence::claim_rescan`](super::PgFence::claim_rescan),
//!   1 s by default) a claim scans from the start even while claims from the cursor come back
//!   full.
//!
//! So a job behind the cursor waits at most the rescan interval, and only while a backlog ahead
//! of it keeps every claim full. The cursor is a hint for where to read: which jobs are due,
//! whose lease ran out and who holds what is still decided by the claim statement on the
//! database clock, so a wrong cursor can delay a job, never hand it out twice.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Queues whose cursors one store keeps; past it the map is cleared (a process that claims
/// from that many queues loses only the cursors' head start).
const MAX_QUEUES: usize = 1024;

/// The default interval between claims that scan a queue from the start.
pub(super) const DEFAULT_RESCAN: Duration = Duration::from_secs(1);

/// One queue's cursor.
#[derive(Debug, Clone, Copy)]
struct Cursor {
    /// Claims read from this `run_at` on (microseconds since the Unix epoch); `None` until a
    /// claim of the queue handed out a job.
    from_us: Option<i64>,
    /// When the next claim scans from the start at the latest (`None`: an interval too long to
    /// add to the clock, never by time).
    rescan_at: Option<Instant>,
    /// The last scan from the start found fewer jobs than it asked for: the next claim scans
    /// from the start too.
    scan_from_start: bool,
}

/// The claim cursors of one [`PgFence`](super::PgFence), per queue.
#[derive(Debug)]
pub(super) struct ClaimCursors {
    queues: Mutex<HashMap<String, Cursor>>,
    rescan: Duration,
}

impl ClaimCursors {
    pub(super) fn new(rescan: Duration) -> Self {
        Self { queues: Mutex::new(HashMap::new()), rescan }
    }

    pub(super) fn rescan(&self) -> Duration {
        self.rescan
    }

    /// Where the next claim of `queue` starts: `None` scans from the start.
    pub(super) fn start(&self, queue: &str) -> Option<i64> {
        let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        let cursor = queues.get(queue)?;
        if cursor.scan_from_start || cursor.rescan_at.is_some_and(|at| Instant::now() >= at) {
            return None;
        }
        cursor.from_us
    }

    /// Records a claim of `queue` that started at `from` (as [`start`](Self::start) said), asked
    /// for `asked` jobs and got rows whose `run_at` are `run_at_us`.
    pub(super) fn claimed(&self, queue: &str, from: Option<i64>, asked: u32, run_at_us: &[i64]) {
        let now = Instant::now();
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if queues.len() >= MAX_QUEUES && !queues.contains_key(queue) {
            queues.clear();
        }
        let cursor = queues.entry(queue.to_owned()).or_insert(Cursor {
            from_us: None,
            rescan_at: now.checked_add(self.rescan),
            scan_from_start: false,
        });
        // One microsecond back: the answer is rounded down, and rows may share a `run_at`.
        if let Some(newest) = run_at_us.iter().max().map(|us| us.saturating_sub(1)) {
            cursor.from_us = Some(cursor.from_us.map_or(newest, |from| from.max(newest)));
        }
        // A scan from the start that found fewer than asked: the queue's due jobs fit in one
        // claim, so there is nothing to skip; claims keep scanning from the start (one statement
        // each) until one comes back full.
        if from.is_none() {
            cursor.rescan_at = now.checked_add(self.rescan);
            cursor.scan_from_start = run_at_us.len() < asked as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_cursor_a_new_queue_is_scanned_from_the_start_then_from_its_newest_claim() {
        let c = ClaimCursors::new(Duration::from_secs(60));
        assert_eq!(c.start("q"), None);
        c.claimed("q", None, 3, &[10, 30, 20]);
        assert_eq!(c.start("q"), Some(29));
        c.claimed("q", Some(29), 2, &[40, 35]);
        assert_eq!(c.start("q"), Some(39));
        c.claimed("q", Some(39), 5, &[50]);
        assert_eq!(
            c.start("q"),
            Some(49),
            "a short claim from the cursor keeps the cursor (the caller scans from the start for the rest in the same call)"
        );
        assert_eq!(c.start("other"), None, "cursors are per queue");
    }

    /// Covers the defect where a queue's first claim found nothing: the cursor was the smallest
    /// `i64`, and the next claim's lower bound overflowed the timestamp range (the statement
    /// failed with "timestamp out of range", seen in `edges_a_cancelled_attempt_prints_lease_lost_and_dropped`).
    #[test]
    fn throughput_cursor_a_queue_that_gave_nothing_yet_is_scanned_from_the_start() {
        let c = ClaimCursors::new(Duration::from_secs(60));
        c.claimed("q", None, 0, &[]);
        assert_eq!(c.start("q"), None, "a claim of 0 found nothing and was not short");
        c.claimed("q", None, 1, &[]);
        assert_eq!(c.start("q"), None);
        c.claimed("q", None, 1, &[7]);
        assert_eq!(c.start("q"), Some(6));
    }

    #[test]
    fn throughput_cursor_claims_scan_from_the_start_until_such_a_scan_comes_back_full() {
        let c = ClaimCursors::new(Duration::from_secs(60));
        c.claimed("q", None, 5, &[10, 20]);
        assert_eq!(c.start("q"), None, "short: the due jobs fit in one claim, nothing to skip");
        c.claimed("q", None, 2, &[30, 40]);
        assert_eq!(c.start("q"), Some(39));
    }

    #[test]
    fn throughput_cursor_the_cursor_never_moves_back_and_the_rescan_interval_forces_a_scan_from_the_start() {
        let c = ClaimCursors::new(Duration::ZERO);
        c.claimed("q", None, 1, &[50]);
        assert_eq!(c.start("q"), None, "rescan interval 0: every claim scans from the start");
        let c = ClaimCursors::new(Duration::from_secs(60));
        c.claimed("q", None, 1, &[50]);
        c.claimed("q", None, 1, &[5]);
        assert_eq!(c.start("q"), Some(49));
        let c = ClaimCursors::new(Duration::MAX);
        c.claimed("q", None, 1, &[50]);
        assert_eq!(c.start("q"), Some(49), "an interval past the clock's range: never by time, no panic");
    }
}
