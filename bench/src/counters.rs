//! The shared counters.
