//! The state an [`SqsSource`](super::SqsSource) keeps for its parts, in one place so that the
//! dependencies run one way: `source` holds these in its `Inner`, and `receive` (read-ahead) and
//! `dead_letter` (the RedrivePolicy, the copies it sent) fill and read them through the source,
//! with no import back from `source` to either.

use std::collections::VecDeque;

use super::delivery::SqsDelivery;
use super::error::SqsError;

/// What one `ReceiveMessage` call returns.
pub(super) type ReceiveResult = Result<Vec<SqsDelivery>, SqsError>;

/// Messages received ahead of demand: while the runtime claims one batch, the next one is already
/// on its way (only while the queue has a backlog, i.e. the last receive came back full).
#[derive(Default)]
pub(super) struct Ahead {
    /// Receives sent ahead, oldest first, with when they were sent.
    pub(super) pending: VecDeque<(tokio::time::Instant, tokio::sync::oneshot::Receiver<ReceiveResult>)>,
    /// Received and not yet handed out, with when they were received.
    pub(super) buffer: VecDeque<(tokio::time::Instant, SqsDelivery)>,
    /// The last answer was a full batch: the queue has more.
    pub(super) backlog: bool,
}

/// The queue's RedrivePolicy, as read once.
#[derive(Debug, Clone, Default)]
pub(crate) struct Redrive {
    pub(crate) dead_letter_arn: Option<String>,
    pub(crate) max_receive_count: Option<u32>,
}

/// At most this many dead-letter copies are remembered; past it the oldest is forgotten.
pub(super) const MAX_SENT_COPIES: usize = 4_096;

/// The messages this source copied to the dead-letter queue (by `MessageId`, stable across
/// receives), oldest first, bounded, each with whether its delete went through: when the delete
/// after a copy fails, the message comes back, and its next move only deletes it instead of
/// sending a second copy.
#[derive(Debug, Default)]
pub(super) struct SentCopies {
    order: VecDeque<String>,
    removed: std::collections::HashMap<String, bool>,
}

impl SentCopies {
    /// `None`: no copy sent; `Some(removed)`: a copy was sent, and its delete went through (or not).
    pub(super) fn get(&self, message_id: &str) -> Option<bool> {
        self.removed.get(message_id).copied()
    }

    /// A copy of `message_id` was sent (`removed`: and the message deleted).
    pub(super) fn insert(&mut self, message_id: &str, removed: bool) {
        match self.removed.get_mut(message_id) {
            Some(r) => *r |= removed,
            None => {
                self.removed.insert(message_id.to_owned(), removed);
                self.order.push_back(message_id.to_owned());
            }
        }
        while self.order.len() > MAX_SENT_COPIES {
            if let Some(oldest) = self.order.pop_front() {
                self.removed.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sent_copies_are_bounded_oldest_out() {
        let mut sent = SentCopies::default();
        for i in 0..=MAX_SENT_COPIES {
            sent.insert(&format!("m{i}"), false);
        }
        sent.insert("m5", true); // again: no second entry, now removed
        assert_eq!((sent.order.len(), sent.removed.len()), (MAX_SENT_COPIES, MAX_SENT_COPIES));
        assert_eq!((sent.get("m0"), sent.get("m1"), sent.get("m5")), (None, Some(false), Some(true)));
    }
}
