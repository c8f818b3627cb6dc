//! [`FailureLog`]: the log lines of one watch's failures — one when it starts failing, throttled
//! repeats while it keeps failing, one when it recovers — so a list the server keeps refusing (a
//! missing RBAC permission) or an outage does not log every attempt. Every failure is still
//! counted in `discovery_watch_errors_total`.

use std::time::Duration;

use kvroute_index_core::throttle::LogThrottle;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::retry::Failed;

/// Interval between two "still failing" lines of one watch.
pub(crate) const STILL_FAILING_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Since when a watch has been failing.
#[derive(Debug, Clone, Copy)]
struct Failing {
    since: Instant,
    failures: u64,
}

/// The failure state of one watch (`pods` or `inference_pool`) of a source.
#[derive(Debug)]
pub(crate) struct FailureLog {
    source: String,
    watch: &'static str,
    failing: Mutex<Option<Failing>>,
    repeats: LogThrottle,
}

impl FailureLog {
    pub(crate) fn new(source: &str, watch: &'static str) -> Self {
        Self {
            source: source.to_owned(),
            watch,
            failing: Mutex::new(None),
            repeats: LogThrottle::new(STILL_FAILING_LOG_INTERVAL),
        }
    }

    /// A list or watch call failed (`reason`: its metric label).
    pub(crate) fn failed(&self, reason: &'static str, failed: &Failed) {
        let (source, watch, error) = (&self.source, self.watch, &failed.error);
        let retry_in = format!("{:?}", failed.retry_in);
        if reason == "gone" {
            // The resource version expired: routine after a restart or a long disconnect; the
            // relist that follows (at once) is the recovery.
            tracing::info!(
                source,
                watch,
                reason,
                "kubernetes watch expired (410 Gone); relisting"
            );
            return;
        }
        let mut failing = self.failing.lock();
        match &mut *failing {
            None => {
                *failing = Some(Failing {
                    since: Instant::now(),
                    failures: 1,
                });
                drop(failing);
                // The first line of a failure run starts the throttle's interval.
                let _ = self.repeats.allow();
                tracing::warn!(source, watch, reason, error = %error, retry_in, "kubernetes watch failing; retrying");
            }
            Some(state) => {
                state.failures += 1;
                let (failures, failing_for) = (state.failures, state.since.elapsed());
                drop(failing);
                if let Some(unlogged) = self.repeats.allow() {
                    tracing::warn!(
                        source,
                        watch,
                        reason,
                        error = %error,
                        failures,
                        unlogged,
                        failing_for = ?failing_for,
                        retry_in,
                        "kubernetes watch still failing"
                    );
                } else {
                    tracing::debug!(source, watch, reason, error = %error, failures, retry_in, "kubernetes watch failed again");
                }
            }
        }
    }

    /// The watch delivered an event: if it was failing, it has recovered.
    pub(crate) fn succeeded(&self) {
        let Some(Failing { since, failures }) = self.failing.lock().take() else {
            return;
        };
        tracing::info!(
            source = self.source,
            watch = self.watch,
            failures,
            failed_for = ?since.elapsed(),
            "kubernetes watch recovered"
        );
    }

    /// Whether the watch is failing now (no event since its last failure).
    #[cfg(test)]
    fn is_failing(&self) -> bool {
        self.failing.lock().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::watcher;

    fn refused() -> Failed {
        Failed {
            error: watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
                kube::core::Status::failure("forbidden", "Forbidden").with_code(403),
            ))),
            retry_in: Duration::from_secs(1),
        }
    }

    #[test]
    fn a_failure_run_starts_and_ends_once() {
        let log = FailureLog::new("pool", "pods");
        log.failed("list_failed", &refused());
        assert!(log.is_failing());
        log.failed("list_failed", &refused());
        assert_eq!(log.failing.lock().map(|f| f.failures), Some(2));
        log.succeeded();
        assert!(!log.is_failing());
        log.succeeded();
        assert!(!log.is_failing());
    }

    #[test]
    fn a_gone_version_is_not_a_failure_run() {
        let log = FailureLog::new("pool", "pods");
        let gone = Failed {
            error: watcher::Error::WatchError(Box::new(
                kube::core::Status::failure("expired", "Expired").with_code(410),
            )),
            retry_in: Duration::ZERO,
        };
        log.failed("gone", &gone);
        assert!(!log.is_failing());
    }
}
