//! One received message, the newest receipt handle of each message, and FIFO group order.
//!
//! SQS hands out a new receipt handle on every receive, and only the newest one is sure to act on
//! the message. Every delivery registers its handle here; broker calls on behalf of a live lease
//! use the newest handle of the message this process holds. A delivery deregisters itself when the
//! runtime drops its last clone, so nothing leaks whatever path the delivery took.
//!
//! A handle is also used only while it is sure to be the newest anywhere: while the visibility this
//! process last set with it (at receive, or by a visibility change whose answer came back) has not
//! run out. Once it has, another receiver may hold a newer handle of the message, and this one is
//! never used again (to delete, extend, re-hide or dead-letter): the message comes back, and its
//! redelivery is settled by what the database says.
//!
//! On a FIFO queue one receive may return several messages of one group, which must be handled in
//! order, whatever the broker does (LocalStack hands out later messages of a group while an earlier
//! one is in flight). The registry orders each receive by `SequenceNumber`, hands out one message
//! per group at a time and parks the rest; a parked message's visibility is extended together with
//! its group's running head, and the next one is handed out once the head is deleted (acked or
//! dead-lettered). If the head is kept in the queue (busy elsewhere, retry later), the messages
//! parked behind it are hidden at least as long as it is; if the head's lease is lost, they keep
//! the visibility they shared with it. Every such message (the head and those behind it) is
//! remembered as *unfinished* ([`Unfinished`]): a later message of the group received before it
//! is back is hidden again instead of being started, whatever the broker hands out.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::error::SqsError;
use super::order::{FOLLOWER_LAG, Unfinished};

/// The broker's handle on one received message: what the runtime passes back to the source to
/// extend, delete, re-hide or dead-letter it. Cheap to clone.
///
/// ```no_run
/// # fn demo(d: brokerfence::sqs::SqsDelivery) {
/// println!("{} received {} times", d.message_id(), d.receive_count());
/// # }
/// ```
#[derive(Clone)]
pub struct SqsDelivery(pub(crate) Arc<Received>);

impl std::fmt::Debug for SqsDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsDelivery")
            .field("message_id", &self.0.message_id)
            .field("group", &self.0.group)
            .field("receive_count", &self.0.receive_count)
            .finish()
    }
}

impl SqsDelivery {
    /// The SQS message id.
    pub fn message_id(&self) -> &str {
        &self.0.message_id
    }

    /// The receipt handle of this receive (broker calls use the newest one of the message).
    pub fn receipt_handle(&self) -> &str {
        &self.0.receipt_handle
    }

    /// The FIFO message group, if any.
    pub fn group(&self) -> Option<&str> {
        self.0.group.as_deref()
    }

    /// `ApproximateReceiveCount` at this receive (0 if SQS did not say).
    pub fn receive_count(&self) -> u32 {
        self.0.receive_count
    }

    /// The FIFO `SequenceNumber`, if SQS sent one.
    pub fn sequence_number(&self) -> Option<u128> {
        self.0.sequence_number
    }

    /// The message as received.
    pub fn message(&self) -> &Message {
        &self.0.message
    }

    pub(crate) fn mark(&self, settled: Settled) {
        self.0.settled.store(settled as u8, Ordering::Release);
    }
}

/// How the runtime finished with a delivery (decides what its FIFO group does next).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Settled {
    /// Nothing said (lease lost, fenced commit: the message is left to SQS).
    Untouched = 0,
    /// Deleted: acknowledged or moved to the dead-letter queue.
    Removed = 1,
    /// Kept in the queue, hidden for a while (retry later, busy elsewhere).
    Kept = 2,
    /// Made visible again (shutdown).
    Abandoned = 3,
}

pub(crate) struct Received {
    pub(crate) message: Message,
    pub(crate) message_id: String,
    pub(crate) receipt_handle: String,
    pub(crate) group: Option<String>,
    pub(crate) receive_count: u32,
    pub(crate) sequence_number: Option<u128>,
    seq: u64,
    settled: AtomicU8,
    registry: Weak<Registry>,
}

impl Drop for Received {
    fn drop(&mut self) {
        if let Some(registry) = self.registry.upgrade() {
            registry.release(self);
        }
    }
}

struct HandleEntry {
    seq: u64,
    handle: String,
    refs: usize,
    /// Until when the message stays hidden under `handle` (what this process last set, counted
    /// from before the call was sent); `None` when unknown (a message received by your own loop).
    valid_until: Option<Instant>,
}

/// How long a handle must still be good for when a call is sent with it.
const HANDLE_MARGIN: Duration = Duration::from_millis(250);

#[derive(Default)]
struct Group {
    /// The delivery (by sequence number) handed out and not yet finished.
    active: Option<u64>,
    /// Later messages of the group, in order, waiting for the active one.
    parked: VecDeque<SqsDelivery>,
}

#[derive(Default)]
struct State {
    handles: HashMap<String, HandleEntry>,
    groups: HashMap<String, Group>,
    /// FIFO messages seen here and still in the queue unfinished: later ones wait for them.
    unfinished: Unfinished,
}

/// The newest receipt handle per message, and FIFO group state, of one source.
#[derive(Default)]
pub(crate) struct Registry {
    state: Mutex<State>,
    next_seq: AtomicU64,
    /// Fires when a parked message becomes ready.
    pub(crate) ready: Notify,
    /// The lease length (milliseconds) the runtime last said, 0 before the first receive.
    lease_ms: AtomicU64,
}

/// Whole seconds from now until `until`, rounded up, at least 1.
pub(crate) fn secs_until(until: Instant, now: Instant) -> i32 {
    super::config::visibility_secs(until.saturating_duration_since(now)).max(1)
}

impl Registry {
    /// Wraps a received message, registering its receipt handle as the newest of the message.
    /// `hidden` is when the receive was sent and the visibility it asked for, when known.
    pub(crate) fn register(
        self: &Arc<Self>,
        message: Message,
        hidden: Option<(Instant, i32)>,
    ) -> Result<SqsDelivery, SqsError> {
        let message_id = message.message_id().ok_or(SqsError::Incomplete { what: "MessageId" })?.to_owned();
        let receipt_handle = message.receipt_handle().ok_or(SqsError::Incomplete { what: "ReceiptHandle" })?.to_owned();
        let attrs = message.attributes();
        let group = attrs.and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId)).cloned();
        let receive_count = attrs
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let sequence_number =
            attrs.and_then(|a| a.get(&MessageSystemAttributeName::SequenceNumber)).and_then(|n| n.parse().ok());
        let valid_until = hidden.map(|(sent, secs)| sent + Duration::from_secs(u64::try_from(secs).unwrap_or(0)));
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut state) = self.state.lock() {
            let entry = state.handles.entry(message_id.clone()).or_insert_with(|| HandleEntry {
                seq,
                handle: receipt_handle.clone(),
                refs: 0,
                valid_until,
            });
            entry.refs += 1;
            if entry.seq <= seq {
                entry.seq = seq;
                entry.handle.clone_from(&receipt_handle);
                entry.valid_until = valid_until;
            }
        }
        Ok(SqsDelivery(Arc::new(Received {
            message,
            message_id,
            receipt_handle,
            group,
            receive_count,
            sequence_number,
            seq,
            settled: AtomicU8::new(Settled::Untouched as u8),
            registry: Arc::downgrade(self),
        })))
    }

    /// The newest receipt handle this process holds for the message, when it is still ours: the
    /// visibility last set with it has at least [`HANDLE_MARGIN`] to run (or is unknown). `None`
    /// when it ran out: another receiver may hold a newer handle, so this one must not be used.
    pub(crate) fn usable_handle(&self, message_id: &str) -> Option<String> {
        let state = self.state.lock().ok()?;
        let e = state.handles.get(message_id)?;
        match e.valid_until {
            Some(until) if Instant::now() + HANDLE_MARGIN >= until => {
                tracing::debug!(%message_id, "receipt handle no longer ours (visibility ran out); not used");
                None
            }
            _ => Some(e.handle.clone()),
        }
    }

    /// A visibility change to `secs`, sent at `sent` with `handle`, succeeded: the handle is good
    /// until then (if it is still the newest).
    pub(crate) fn hidden(&self, message_id: &str, handle: &str, sent: Instant, secs: i32) {
        if let Ok(mut state) = self.state.lock()
            && let Some(e) = state.handles.get_mut(message_id)
            && e.handle == handle
        {
            e.valid_until = Some(sent + Duration::from_secs(u64::try_from(secs).unwrap_or(0)));
        }
    }

    /// The lease length the runtime uses (for how long a group stays blocked after a lost lease).
    pub(crate) fn set_lease(&self, lease: Duration) {
        self.lease_ms.store(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn lease(&self) -> Duration {
        match self.lease_ms.load(Ordering::Relaxed) {
            0 => Duration::from_secs(30),
            ms => Duration::from_millis(ms),
        }
    }

    /// FIFO: of freshly received deliveries (ordered by `SequenceNumber`), hands out the first of
    /// each idle group and parks the rest behind their group's running or parked messages, in
    /// sequence order. Those that an earlier unfinished message of their group holds back come
    /// back second, each with the seconds to hide it: they must not start before it.
    pub(crate) fn admit(&self, mut deliveries: Vec<SqsDelivery>) -> (Vec<SqsDelivery>, Vec<(SqsDelivery, i32)>) {
        deliveries.sort_by_key(|d| d.0.sequence_number);
        let lease = self.lease();
        let Ok(mut guard) = self.state.lock() else { return (deliveries, Vec::new()) };
        let state = &mut *guard;
        let now = Instant::now();
        state.unfinished.prune(now);
        let mut out = Vec::with_capacity(deliveries.len());
        let mut blocked = Vec::new();
        for d in deliveries {
            let Some(group) = d.0.group.clone() else {
                out.push(d);
                continue;
            };
            // Back with this worker: from here the group's state below keeps its order.
            state.unfinished.forget(&group, &d.0.message_id);
            if let Some(until) = state.unfinished.hold_back(&group, &d.0.message_id, d.0.sequence_number, now) {
                tracing::debug!(%group, message_id = %d.0.message_id, "an earlier message of the group is unfinished: hidden again");
                state.unfinished.remember(&group, &d.0.message_id, d.0.sequence_number, false, until, lease);
                blocked.push((d, secs_until(until, now)));
                continue;
            }
            let g = state.groups.entry(group).or_default();
            if g.active.is_none() && g.parked.is_empty() {
                g.active = Some(d.0.seq);
                out.push(d);
            } else {
                // In sequence order, whatever order the receives brought them in.
                let at = g.parked.partition_point(|p| p.0.sequence_number <= d.0.sequence_number);
                g.parked.insert(at, d);
            }
        }
        (out, blocked)
    }

    /// FIFO: `d`, its group's running head, stays in the queue hidden until `until` (busy
    /// elsewhere, retry later): it is remembered as unfinished (its group's later messages wait
    /// for it in this worker), and the messages parked behind it are taken out, remembered too,
    /// to be hidden a little longer (returned with their seconds; keep them until the call that
    /// hides them has been answered: a dropped delivery's receipt handle is forgotten).
    pub(crate) fn keep_head(&self, d: &SqsDelivery, until: Instant) -> Vec<(SqsDelivery, i32)> {
        let Some(group) = &d.0.group else { return Vec::new() };
        let lease = self.lease();
        let Ok(mut guard) = self.state.lock() else { return Vec::new() };
        let state = &mut *guard;
        let now = Instant::now();
        let followers: Vec<SqsDelivery> = match state.groups.get_mut(group) {
            Some(g) if g.active == Some(d.0.seq) => g.parked.drain(..).collect(),
            _ => Vec::new(),
        };
        state.unfinished.remember(group, &d.0.message_id, d.0.sequence_number, true, until, lease);
        for f in &followers {
            state.unfinished.remember(group, &f.0.message_id, f.0.sequence_number, false, until + FOLLOWER_LAG, lease);
        }
        let secs = secs_until(until + FOLLOWER_LAG, now);
        followers.into_iter().map(|f| (f, secs)).collect()
    }

    /// FIFO: up to `max` parked messages whose group has nothing running, one per group.
    pub(crate) fn take_ready(&self, max: usize) -> Vec<SqsDelivery> {
        let Ok(mut state) = self.state.lock() else { return Vec::new() };
        let mut out = Vec::new();
        for g in state.groups.values_mut() {
            if out.len() >= max {
                break;
            }
            if g.active.is_none()
                && let Some(d) = g.parked.pop_front()
            {
                g.active = Some(d.0.seq);
                out.push(d);
            }
        }
        out
    }

    /// FIFO: whether any message waits behind its group.
    pub(crate) fn has_parked(&self) -> bool {
        self.state.lock().map(|s| s.groups.values().any(|g| !g.parked.is_empty())).unwrap_or(false)
    }

    /// FIFO: the message ids of the messages parked behind `d`, when `d` is its group's running
    /// head: their visibility follows the head's.
    pub(crate) fn parked_behind(&self, d: &SqsDelivery) -> Vec<String> {
        let Some(group) = &d.0.group else { return Vec::new() };
        let Ok(state) = self.state.lock() else { return Vec::new() };
        match state.groups.get(group) {
            Some(g) if g.active == Some(d.0.seq) => g.parked.iter().map(|p| p.0.message_id.clone()).collect(),
            _ => Vec::new(),
        }
    }

    /// FIFO: takes the messages parked behind `d` (its group's running head) out of the registry.
    pub(crate) fn take_parked_behind(&self, d: &SqsDelivery) -> Vec<SqsDelivery> {
        let Some(group) = &d.0.group else { return Vec::new() };
        let Ok(mut state) = self.state.lock() else { return Vec::new() };
        match state.groups.get_mut(group) {
            Some(g) if g.active == Some(d.0.seq) => g.parked.drain(..).collect(),
            _ => Vec::new(),
        }
    }

    /// FIFO: takes every parked message out of the registry (shutdown).
    pub(crate) fn drain_parked(&self) -> Vec<SqsDelivery> {
        let Ok(mut state) = self.state.lock() else { return Vec::new() };
        state.groups.values_mut().flat_map(|g| g.parked.drain(..)).collect()
    }

    fn release(&self, r: &Received) {
        let mut forgotten = Vec::new();
        let lease = self.lease();
        {
            let Ok(mut guard) = self.state.lock() else { return };
            let state = &mut *guard;
            if let Some(e) = state.handles.get_mut(&r.message_id) {
                e.refs = e.refs.saturating_sub(1);
                if e.refs == 0 {
                    state.handles.remove(&r.message_id);
                }
            }
            if let Some(group) = &r.group
                && let Some(g) = state.groups.get_mut(group)
            {
                if g.active == Some(r.seq) {
                    g.active = None;
                    let settled = r.settled.load(Ordering::Acquire);
                    if settled == Settled::Removed as u8 {
                        if !g.parked.is_empty() {
                            self.ready.notify_one();
                        }
                    } else {
                        // The head stays in the queue: the rest of the group must not overtake
                        // it. Kept, it and its followers are remembered already (`keep_head`);
                        // lease lost (untouched), they are remembered here, hidden for at most a
                        // lease (the parked ones keep the visibility they shared with the head).
                        forgotten.extend(g.parked.drain(..));
                        if settled == Settled::Untouched as u8 {
                            let until = Instant::now() + lease;
                            let unfinished = &mut state.unfinished;
                            unfinished.remember(group, &r.message_id, r.sequence_number, true, until, lease);
                            for f in &forgotten {
                                unfinished.remember(group, &f.0.message_id, f.0.sequence_number, false, until, lease);
                            }
                        }
                    }
                }
                if g.active.is_none() && g.parked.is_empty() {
                    state.groups.remove(group);
                }
            }
        }
        // Dropped outside the lock: their own release takes it again.
        drop(forgotten);
    }

    /// Messages registered and not yet released (for tests and metrics).
    #[cfg(test)]
    pub(crate) fn live_messages(&self) -> usize {
        self.state.lock().map(|s| s.handles.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(id: &str, handle: &str, group: Option<&str>) -> Message {
        let mut b = Message::builder().message_id(id).receipt_handle(handle).body("b");
        if let Some(g) = group {
            b = b.attributes(MessageSystemAttributeName::MessageGroupId, g);
        }
        b.build()
    }

    #[test]
    fn newest_handle_wins_and_registry_empties() {
        let reg = Arc::new(Registry::default());
        let first = reg.register(msg("m1", "h1", None), None).unwrap();
        let second = reg.register(msg("m1", "h2", None), None).unwrap();
        assert_eq!(reg.usable_handle(first.message_id()).as_deref(), Some("h2"));
        drop(second);
        assert_eq!(reg.live_messages(), 1, "first still alive");
        drop(first);
        assert_eq!(reg.live_messages(), 0);
    }

    #[test]
    fn fifo_group_hands_out_one_at_a_time() {
        let reg = Arc::new(Registry::default());
        let batch: Vec<_> = ["a1", "a2", "b1", "a3"]
            .iter()
            .map(|id| reg.register(msg(id, &format!("h-{id}"), Some(&id[..1])), None).unwrap())
            .collect();
        let (out, blocked) = reg.admit(batch);
        assert!(blocked.is_empty());
        let ids: Vec<_> = out.iter().map(|d| d.message_id().to_owned()).collect();
        assert_eq!(ids, ["a1", "b1"]);
        assert!(reg.has_parked());
        assert!(reg.take_ready(10).is_empty(), "a1 still running");
        assert_eq!(reg.parked_behind(&out[0]).len(), 2);
        let mut out = out.into_iter();
        let a1 = out.next().unwrap();
        a1.mark(Settled::Removed);
        drop(a1);
        let next = reg.take_ready(10);
        assert_eq!(next.iter().map(|d| d.message_id()).collect::<Vec<_>>(), ["a2"]);
        // a2 is retried later: a3 must not overtake it, it is forgotten.
        next[0].mark(Settled::Kept);
        drop(next);
        assert!(!reg.has_parked());
        assert!(reg.take_ready(10).is_empty());
        drop(out);
        assert_eq!(reg.live_messages(), 0);
    }

    fn fifo_msg(id: &str, seq: u128) -> Message {
        Message::builder()
            .message_id(id)
            .receipt_handle(format!("h-{id}"))
            .body("b")
            .attributes(MessageSystemAttributeName::MessageGroupId, "g")
            .attributes(MessageSystemAttributeName::SequenceNumber, seq.to_string())
            .build()
    }

    /// §4 bullet 1: a head kept in the queue blocks its group in this worker; a later message
    /// of the group received meanwhile is handed back to be hidden (at least as long as the
    /// head), never handed out; the head itself (or an earlier message) clears the block.
    #[tokio::test]
    async fn edges_kept_head_blocks_its_group() {
        let reg = Arc::new(Registry::default());
        reg.set_lease(Duration::from_secs(3));
        // Out of order in one receive: ordered by SequenceNumber.
        let batch = vec![
            reg.register(fifo_msg("b", 20), None).unwrap(),
            reg.register(fifo_msg("a", 10), None).unwrap(),
            reg.register(fifo_msg("c", 30), None).unwrap(),
        ];
        let (out, blocked) = reg.admit(batch);
        assert!(blocked.is_empty());
        assert_eq!(out.iter().map(|d| d.message_id()).collect::<Vec<_>>(), ["a"]);
        let head = out.into_iter().next().unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        let followers = reg.keep_head(&head, until);
        assert_eq!(followers.iter().map(|(d, _)| d.message_id()).collect::<Vec<_>>(), ["b", "c"]);
        assert!(followers.iter().all(|(_, s)| *s >= 6), "followers hidden longer than the head: {followers:?}");
        head.mark(Settled::Kept);
        drop((head, followers));
        // The broker hands out a follower while the head is hidden: blocked, not handed out.
        let (out, blocked) = reg.admit(vec![reg.register(fifo_msg("b", 20), None).unwrap()]);
        assert!(out.is_empty());
        assert_eq!(blocked.len(), 1);
        assert!(blocked[0].1 >= 6, "{:?}", blocked[0].1);
        drop(blocked);
        // The head comes back: handed out, the block is gone, followers park behind it.
        let (out, blocked) = reg.admit(vec![
            reg.register(fifo_msg("b", 20), None).unwrap(),
            reg.register(fifo_msg("a", 10), None).unwrap(),
        ]);
        assert!(blocked.is_empty());
        assert_eq!(out.iter().map(|d| d.message_id()).collect::<Vec<_>>(), ["a"]);
        assert!(reg.has_parked());
        // The head's lease is lost (dropped untouched): the group stays blocked here for a lease.
        drop(out);
        assert!(!reg.has_parked());
        let (out, blocked) = reg.admit(vec![reg.register(fifo_msg("c", 30), None).unwrap()]);
        assert!(out.is_empty() && blocked.len() == 1);
        drop(blocked);
        assert_eq!(reg.live_messages(), 0);
    }
}
