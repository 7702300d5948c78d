//! Effects outside the fence's row, from the weakest guarantee to the strongest: a receiver that
//! checks the epoch ledger (atomically with its effect or not), the handler's own transaction
//! with the fenced completion, and the transactional outbox. Real PostgreSQL, LocalStack SQS and
//! Redis.
//!
//! | module | what |
//! |---|---|
//! | [`receiver`] | `AtomicEpochGuard` against the check-only `EpochGuard` |
//! | [`own_tx`] | a handler's rows and the fenced completion in one transaction |
//! | [`own_tx_acks`] | a handler's own commit is one ack; the fenced-rollback guard under a savepoint |
//! | [`outbox`] | the outbox through paused and killed worker and relay processes |

mod outbox;
mod own_tx;
mod own_tx_acks;
mod receiver;
