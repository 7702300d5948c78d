//! Retry pauses: exponential backoff with jitter ([`Backoff`]).

use std::time::Duration;

/// Exponential backoff with jitter (backon), within 100 ms..5 s: the step doubles from 100 ms
/// up to 2.5 s and each pause is between the step and twice it, so that the workers a database
/// or broker outage failed together do not all retry at the same moments.
#[derive(Debug)]
pub(super) struct Backoff(backon::ExponentialBackoff);

/// The longest pause of a [`Backoff`].
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Default for Backoff {
    fn default() -> Self {
        use backon::BackoffBuilder as _;
        Self(
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(BACKOFF_MAX / 2)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
        )
    }
}

impl Backoff {
    /// The pause after failure number `n + 1` of a run of failures.
    pub(super) fn nth(n: u32) -> Duration {
        // The step stops growing after 5 doublings.
        Self::default().0.nth(n.min(8) as usize).unwrap_or(BACKOFF_MAX).min(BACKOFF_MAX)
    }
    pub(super) fn next(&mut self) -> Duration {
        self.0.next().unwrap_or(BACKOFF_MAX).min(BACKOFF_MAX)
    }
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    /// The pauses stay within 100 ms..5 s, grow with the step, and start over after a reset.
    #[test]
    fn ergonomics_runtime_backoff_stays_within_its_bounds() {
        for _ in 0..50 {
            let mut b = Backoff::default();
            let pauses: Vec<Duration> = (0..12).map(|_| b.next()).collect();
            for (i, p) in pauses.iter().enumerate() {
                let step = Duration::from_millis(100 << i.min(5)).min(BACKOFF_MAX / 2);
                assert!(*p >= step && *p <= (step * 2).min(BACKOFF_MAX), "pause {i}: {p:?} (step {step:?})");
            }
            b.reset();
            assert!(b.next() < Duration::from_millis(200));
            assert!(Backoff::nth(0) < Duration::from_millis(200));
            assert!((BACKOFF_MAX / 2..=BACKOFF_MAX).contains(&Backoff::nth(u32::MAX)));
        }
    }
}
