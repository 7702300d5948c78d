//! The state an [`SqsSource`](super::SqsSource) keeps for its parts, in one place so that the
//! dependencies run one way: `source` holds these in its `Inner`, and `receive` (read-ahead) and
//! `dead_letter` (the RedrivePolicy) fill and read them through the source, with no import back
//! from `source` to either.

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
