//! The old home of the table queue, kept for compatibility: use [`crate::table`]
//! (`brokerfence::table::TableQueue`, or `brokerfence::TableQueue`). The table queue runs on
//! PostgreSQL and SQLite alike; this module was named after one of them.

/// Moved to [`crate::table::TableQueue`] (also `brokerfence::TableQueue`).
#[deprecated(
    note = "the table queue runs on PostgreSQL and SQLite: use `brokerfence::TableQueue` (or `brokerfence::table::TableQueue`)"
)]
pub type TableQueue = crate::table::TableQueue;
