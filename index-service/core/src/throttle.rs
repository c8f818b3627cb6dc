//! [`LogThrottle`]: at most one log line per interval for a repeated event (a refusal, an
//! expiry), with how many were left out since the last one. The event is still counted in its
//! metric every time; only the log is throttled.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Default interval between two log lines of one throttled event.
pub const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one log line through per interval.
#[derive(Debug)]
pub struct LogThrottle {
    interval: Duration,
    /// When the last line was let through, and events suppressed since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(DEFAULT_LOG_INTERVAL)
    }
}

impl LogThrottle {
    /// A throttle letting one line through per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` when this event should be logged (with the number of events left
    /// unlogged since the last line), `None` when it should not.
    pub fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut state = self.state.lock();
        let (last, suppressed) = &mut *state;
        if last.is_some_and(|at| now.duration_since(at) < self.interval) {
            *suppressed += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lets_one_line_through_per_interval_and_counts_the_rest() {
        let throttle = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(throttle.allow(), Some(0));
        assert_eq!(throttle.allow(), None);
        assert_eq!(throttle.allow(), None);
        let open = LogThrottle::new(Duration::ZERO);
        assert_eq!(open.allow(), Some(0));
        assert_eq!(open.allow(), Some(0));
    }
}
