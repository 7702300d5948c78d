//! Counters of what the fence did: claims, renewals, losses, fenced rejections, commits.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident => $variant:ident),* $(,)?) => {
        /// One counter of [`Metrics`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Counter {
            $($(#[$doc])* $variant,)*
        }

        const COUNTERS: usize = [$(Counter::$variant),*].len();

        /// Live counters, shared by a supervisor and the runtime around it (cheap atomics).
        ///
        /// ```
        /// use brokerfence::{Counter, Metrics};
        /// let m = Metrics::default();
        /// m.add(Counter::Claims, 3);
        /// assert_eq!(m.snapshot().claims, 3);
        /// ```
        #[derive(Debug, Default)]
        pub struct Metrics {
            values: [AtomicU64; COUNTERS],
        }

        /// A point-in-time copy of [`Metrics`].
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            /// Adds `n` to a counter.
            pub fn add(&self, counter: Counter, n: u64) {
                self.values[counter as usize].fetch_add(n, Ordering::Relaxed);
            }

            /// Adds one to a counter.
            pub fn incr(&self, counter: Counter) {
                self.add(counter, 1);
            }

            /// Reads one counter.
            pub fn get(&self, counter: Counter) -> u64 {
                self.values[counter as usize].load(Ordering::Relaxed)
            }

            /// Copies every counter.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.get(Counter::$variant),)* }
            }
        }

        impl fmt::Display for MetricsSnapshot {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let parts: [(&str, u64); COUNTERS] = [$((stringify!($name), self.$name)),*];
                for (i, (name, value)) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{name}={value}")?;
                }
                Ok(())
            }
        }
    };
}

counters!(
    /// Jobs claimed (new epochs handed out).
    claims => Claims,
    /// Claims refused because another owner held a live lease.
    busy => Busy,
    /// Deliveries of jobs already completed or dead (duplicates).
    duplicates => Duplicates,
    /// Lease renewals the database confirmed.
    renewals => Renewals,
    /// Heartbeat statements sent (one per worker per tick).
    heartbeats => Heartbeats,
    /// Leases found lost (superseded, or unconfirmable before expiry); handler cancelled.
    lease_losses => LeaseLosses,
    /// Writes refused by the compare-and-set (a superseded owner's commit, fail or checkpoint).
    fenced_rejections => FencedRejections,
    /// Results committed (by the runtime's group commit or in the handler's own transaction).
    completions => Completions,
    /// Of [`completions`](MetricsSnapshot::completions), those the handler committed in its own
    /// transaction with [`JobContext::complete_in`](crate::JobContext::complete_in).
    own_commits => OwnCommits,
    /// Group-commit statements sent (each carries one or more completions).
    commit_statements => CommitStatements,
    /// Group-claim statements the consumer runtime sent for broker deliveries (each claims one
    /// or more; a table queue claims in its own receive and counts none).
    claim_statements => ClaimStatements,
    /// Failed attempts recorded (retrying).
    failures => Failures,
    /// Jobs given up (dead) or deliveries dead-lettered.
    dead_letters => DeadLetters,
    /// Broker acknowledgements sent after a committed result.
    acks => Acks,
    /// Leases given back (shutdown).
    releases => Releases,
    /// Broker hook calls ([`LeaseHook`](crate::LeaseHook)) cut by their timeout; the database
    /// lease stands, only the broker hint was missed.
    hook_timeouts => HookTimeouts,
    /// Leases left out of a hook's `confirmed` call because, when the call went out, their attempt
    /// had ended or their worker-side deadline had passed (a stale lease is never extended).
    hook_skips => HookSkips,
);
