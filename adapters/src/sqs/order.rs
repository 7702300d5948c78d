//! FIFO group order across receives: the messages of each group this worker has seen and that
//! are still in the queue unfinished (hidden behind a held head, a head kept for a retry or held
//! by another worker, a head whose lease was lost, a later message hidden again). A later message
//! of the group must not start before them, whatever the broker hands out: LocalStack hands out a
//! group's later messages while an earlier one is hidden, and a worker that handed out what it
//! was given committed C before B (issue #30, item 10).
//!
//! The memory is bounded: an entry lasts until the time it was hidden for plus a lease (after
//! that the message went elsewhere, or is gone), and at most [`MAX_REMEMBERED`] entries are kept.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// At most this many messages are remembered, over all groups; past it, the ones that would be
/// forgotten first go first.
pub(crate) const MAX_REMEMBERED: usize = 10_000;

/// A message that waits behind an earlier one comes back this much after it.
pub(crate) const FOLLOWER_LAG: Duration = Duration::from_secs(1);

/// One unfinished message of a group.
#[derive(Debug, Clone)]
struct Earlier {
    message_id: String,
    sequence_number: Option<u128>,
    /// A head kept in the queue: where sequence numbers are unknown (a message received by your
    /// own loop without them), it holds back every other message of its group.
    head: bool,
    /// Hidden until then, as far as this worker knows.
    until: Instant,
    /// Forgotten after this.
    expires: Instant,
}

impl Earlier {
    /// Whether a message with `sequence_number` must wait for this one.
    fn precedes(&self, sequence_number: Option<u128>) -> bool {
        match (self.sequence_number, sequence_number) {
            (Some(mine), Some(theirs)) => mine < theirs,
            _ => self.head,
        }
    }
}

/// The unfinished messages of every group, bounded.
#[derive(Debug, Default)]
pub(crate) struct Unfinished {
    groups: HashMap<String, Vec<Earlier>>,
    len: usize,
}

impl Unfinished {
    /// Remembers a message of `group` hidden until `until`, for `keep_for` after that (a message
    /// remembered already keeps the later of both times).
    pub(crate) fn remember(
        &mut self,
        group: &str,
        message_id: &str,
        sequence_number: Option<u128>,
        head: bool,
        until: Instant,
        keep_for: Duration,
    ) {
        let expires = until + keep_for;
        let entries = self.groups.entry(group.to_owned()).or_default();
        if let Some(e) = entries.iter_mut().find(|e| e.message_id == message_id) {
            e.head |= head;
            e.until = e.until.max(until);
            e.expires = e.expires.max(expires);
            return;
        }
        entries.push(Earlier { message_id: message_id.to_owned(), sequence_number, head, until, expires });
        self.len += 1;
        if self.len > MAX_REMEMBERED {
            self.evict_soonest();
        }
    }

    /// The message is back with this worker (received again): the registry keeps its order now.
    pub(crate) fn forget(&mut self, group: &str, message_id: &str) {
        if let Some(entries) = self.groups.get_mut(group) {
            let before = entries.len();
            entries.retain(|e| e.message_id != message_id);
            self.len -= before - entries.len();
            if entries.is_empty() {
                self.groups.remove(group);
            }
        }
    }

    /// Forgets what expired.
    pub(crate) fn prune(&mut self, now: Instant) {
        let mut len = 0;
        self.groups.retain(|_, entries| {
            entries.retain(|e| e.expires > now);
            len += entries.len();
            !entries.is_empty()
        });
        self.len = len;
    }

    /// Until when a message of `group` must stay hidden because an earlier message of the group is
    /// unfinished; `None` when nothing holds it back. While the earlier ones are hidden, until
    /// [`FOLLOWER_LAG`] after them; once they are visible again (and the broker still handed out
    /// this one instead), until they are forgotten: one more receive of it, not one per second.
    pub(crate) fn hold_back(
        &self,
        group: &str,
        message_id: &str,
        sequence_number: Option<u128>,
        now: Instant,
    ) -> Option<Instant> {
        let earlier: Vec<&Earlier> = self
            .groups
            .get(group)?
            .iter()
            .filter(|e| e.message_id != message_id && e.precedes(sequence_number))
            .collect();
        let until = earlier.iter().map(|e| e.until).max()?;
        let until = if until > now { until } else { earlier.iter().map(|e| e.expires).max().unwrap_or(now) };
        Some(until.max(now) + FOLLOWER_LAG)
    }

    /// Messages remembered.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn evict_soonest(&mut self) {
        let soonest = self
            .groups
            .iter()
            .flat_map(|(g, entries)| entries.iter().map(move |e| (e.expires, g, &e.message_id)))
            .min_by_key(|(expires, _, _)| *expires)
            .map(|(_, g, id)| (g.clone(), id.clone()));
        if let Some((group, id)) = soonest {
            self.forget(&group, &id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(5);

    #[test]
    fn a_later_message_waits_for_an_earlier_unfinished_one() {
        let now = Instant::now();
        let mut u = Unfinished::default();
        u.remember("g", "b", Some(20), false, now + Duration::from_secs(3), LEASE);
        assert_eq!(u.hold_back("g", "c", Some(30), now), Some(now + Duration::from_secs(3) + FOLLOWER_LAG));
        assert_eq!(u.hold_back("g", "a", Some(10), now), None, "an earlier message never waits");
        assert_eq!(u.hold_back("g", "b", Some(20), now), None, "nor the message itself");
        assert_eq!(u.hold_back("other", "c", Some(30), now), None, "nor another group");
        // B hidden no more, yet the broker hands out C: C waits until B is forgotten.
        let later = now + Duration::from_secs(4);
        assert_eq!(u.hold_back("g", "c", Some(30), later), Some(now + Duration::from_secs(3) + LEASE + FOLLOWER_LAG));
        u.forget("g", "b");
        assert_eq!((u.hold_back("g", "c", Some(30), now), u.len()), (None, 0));
    }

    #[test]
    fn unknown_sequence_numbers_wait_only_for_a_kept_head() {
        let now = Instant::now();
        let mut u = Unfinished::default();
        u.remember("g", "follower", None, false, now + Duration::from_secs(3), LEASE);
        assert_eq!(u.hold_back("g", "x", None, now), None);
        u.remember("g", "head", None, true, now + Duration::from_secs(2), LEASE);
        assert!(u.hold_back("g", "x", None, now).is_some());
        assert_eq!(u.hold_back("g", "head", None, now), None);
    }

    #[test]
    fn memory_is_bounded_in_time_and_size() {
        let now = Instant::now();
        let mut u = Unfinished::default();
        for i in 0..MAX_REMEMBERED + 5 {
            let until = now + Duration::from_millis(i as u64);
            u.remember(&format!("g{}", i % 7), &format!("m{i}"), Some(i as u128), false, until, LEASE);
        }
        assert_eq!(u.len(), MAX_REMEMBERED);
        assert!(u.hold_back("g0", "late", Some(u128::MAX), now).is_some());
        // The soonest to expire went first.
        assert!(u.groups.values().flatten().all(|e| e.message_id != "m0" && e.message_id != "m4"));
        u.prune(now + Duration::from_secs(3600));
        assert_eq!((u.len(), u.groups.len()), (0, 0));
    }
}
