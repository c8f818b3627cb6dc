//! Rate limiting of repeated warnings: one line per interval, with how many were held back.
//! What a warning reports is counted in a metric either way; this only bounds the log.

use std::time::{Duration, Instant};

/// Lets one warning through per `interval` and counts the ones held back.
#[derive(Debug)]
pub(crate) struct WarnLimiter {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl WarnLimiter {
    pub(crate) const fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(warnings suppressed since the last one)` if a warning may be logged now.
    pub(crate) fn allow(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < self.interval)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_interval_with_the_count_held_back() {
        let mut limiter = WarnLimiter::new(Duration::from_secs(3600));
        assert_eq!(limiter.allow(), Some(0));
        assert_eq!(limiter.allow(), None);
        assert_eq!(limiter.allow(), None);
        limiter.last = Instant::now().checked_sub(Duration::from_secs(3601));
        assert_eq!(limiter.allow(), Some(2));
    }
}
