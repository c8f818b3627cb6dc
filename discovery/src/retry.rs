//! How long a Kubernetes watch waits before its next attempt after an error.
//!
//! kube-runtime's default backoff (800 ms doubling to 30 s, reset only after two minutes without
//! an error) made every error of an API-server outage lengthen the wait after it, including the
//! `410 Gone` that follows a restart, so discovery caught up seconds after the server was back.
//! Here the wait depends on what failed, and the next event that shows the server answering (an
//! object listed or watched, a completed list; not the `Init` that precedes a list request)
//! resets it:
//! - `410 Gone` (the resource version expired): no wait, the relist is the recovery;
//! - the server answered a list with an error (a missing RBAC permission, a missing CRD): a long
//!   capped backoff, as retrying soon cannot help;
//! - anything else (the server unreachable, a connection cut): a short capped backoff, so the
//!   watch is back within [`UNREACHABLE_MAX`] of the server.

use std::time::Duration;

use futures::{Stream, StreamExt};
use kube::runtime::watcher;

/// First wait after an error while the server is unreachable.
pub(crate) const UNREACHABLE_MIN: Duration = Duration::from_millis(100);
/// Longest wait while the server is unreachable: how late a watch may come back after it.
pub(crate) const UNREACHABLE_MAX: Duration = Duration::from_secs(2);
/// First wait after the server refused a list.
pub(crate) const REFUSED_MIN: Duration = Duration::from_secs(1);
/// Longest wait after the server refused lists.
pub(crate) const REFUSED_MAX: Duration = Duration::from_secs(60);

/// Consecutive failures since the last event.
#[derive(Debug, Default)]
pub(crate) struct RetryPolicy {
    failures: u32,
}

impl RetryPolicy {
    /// An event arrived: the next error starts from the shortest wait again.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// The wait before the attempt that follows `error`.
    pub(crate) fn wait_after(&mut self, error: &watcher::Error) -> Duration {
        let (min, max) = match error {
            watcher::Error::WatchError(status) if status.code == 410 => return Duration::ZERO,
            watcher::Error::InitialListFailed(kube::Error::Api(_)) => (REFUSED_MIN, REFUSED_MAX),
            _ => (UNREACHABLE_MIN, UNREACHABLE_MAX),
        };
        let wait = min.saturating_mul(1 << self.failures.min(16)).min(max);
        self.failures = self.failures.saturating_add(1);
        wait
    }
}

/// Whether `event` shows the server answering: anything but `Init`, which kube-rs's watcher
/// emits before it even sends its list request (so a list refused every time sees `Init`
/// between its failures, and must not reset the backoff).
pub(crate) fn is_progress<K>(event: &watcher::Event<K>) -> bool {
    !matches!(event, watcher::Event::Init)
}

/// A failed list or watch call, and how long the watch waits before its next attempt.
#[derive(Debug)]
pub(crate) struct Failed {
    pub(crate) error: watcher::Error,
    pub(crate) retry_in: Duration,
}

/// `watch`, waiting after each error as [`RetryPolicy`] says; an error comes out with its wait,
/// before the wait.
pub(crate) fn with_retry<K, S>(
    watch: S,
) -> impl Stream<Item = Result<watcher::Event<K>, Failed>> + Send
where
    K: Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let state = (Box::pin(watch), RetryPolicy::default(), Duration::ZERO);
    futures::stream::unfold(state, |(mut watch, mut policy, wait)| async move {
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let (item, wait) = match watch.next().await? {
            Ok(event) => {
                if is_progress(&event) {
                    policy.succeeded();
                }
                (Ok(event), Duration::ZERO)
            }
            Err(error) => {
                let retry_in = policy.wait_after(&error);
                (Err(Failed { error, retry_in }), retry_in)
            }
        };
        Some((item, (watch, policy, wait)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gone() -> watcher::Error {
        watcher::Error::WatchError(Box::new(
            kube::core::Status::failure("expired", "Expired").with_code(410),
        ))
    }

    fn refused() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            kube::core::Status::failure("forbidden", "Forbidden").with_code(403),
        )))
    }

    fn unreachable() -> watcher::Error {
        watcher::Error::InitialListFailed(kube::Error::Service("connection refused".into()))
    }

    #[test]
    fn a_gone_version_relists_at_once_even_after_an_outage() {
        let mut policy = RetryPolicy::default();
        for _ in 0..10 {
            policy.wait_after(&unreachable());
        }
        assert_eq!(policy.wait_after(&gone()), Duration::ZERO);
    }

    #[test]
    fn an_unreachable_server_is_retried_within_the_short_cap() {
        let mut policy = RetryPolicy::default();
        let waits: Vec<_> = (0..8).map(|_| policy.wait_after(&unreachable())).collect();
        assert_eq!(waits[0], UNREACHABLE_MIN);
        assert_eq!(waits[1], UNREACHABLE_MIN * 2);
        assert!(waits.iter().all(|wait| *wait <= UNREACHABLE_MAX));
        assert_eq!(waits[7], UNREACHABLE_MAX);
    }

    #[test]
    fn refused_lists_back_off_long() {
        let mut policy = RetryPolicy::default();
        let waits: Vec<_> = (0..10).map(|_| policy.wait_after(&refused())).collect();
        assert_eq!(waits[0], REFUSED_MIN);
        assert_eq!(waits[9], REFUSED_MAX);
    }

    /// An API server down for a minute: the watch's attempts come at most [`UNREACHABLE_MAX`]
    /// apart, so the first one after the server is back is no later than that (virtual time).
    #[tokio::test(start_paused = true)]
    async fn an_outage_is_retried_at_most_the_short_cap_apart() {
        let outage = Duration::from_secs(60);
        let started = tokio::time::Instant::now();
        let attempts = futures::stream::poll_fn(move |_| {
            std::task::Poll::Ready(Some(if started.elapsed() < outage {
                Err(unreachable())
            } else {
                Ok(watcher::Event::<()>::Init)
            }))
        });
        let mut watch = Box::pin(with_retry(attempts));
        let mut last_failure = started;
        loop {
            match watch.next().await {
                Some(Err(failed)) => {
                    assert!(failed.retry_in <= UNREACHABLE_MAX, "{failed:?}");
                    last_failure = tokio::time::Instant::now();
                }
                Some(Ok(_)) => break,
                None => panic!("the watch ended"),
            }
        }
        let back = tokio::time::Instant::now();
        assert!(back - started >= outage);
        // The server came back at `started + outage`: the attempt that found it followed the
        // last failed one by at most the cap.
        assert!(back - last_failure <= UNREACHABLE_MAX);
        assert!(back - (started + outage) <= UNREACHABLE_MAX);
    }

    /// `410 Gone` after an outage: the relist is the very next poll, no virtual time passes.
    #[tokio::test(start_paused = true)]
    async fn a_gone_version_is_relisted_without_waiting() {
        let mut errors = (0..10).map(|_| Err(unreachable())).collect::<Vec<_>>();
        errors.push(Err(gone()));
        errors.push(Ok(watcher::Event::<()>::Init));
        let mut watch = Box::pin(with_retry(futures::stream::iter(errors)));
        for _ in 0..10 {
            assert!(matches!(watch.next().await, Some(Err(_))));
        }
        let gone = watch.next().await;
        let at = tokio::time::Instant::now();
        assert!(matches!(gone, Some(Err(Failed { retry_in, .. })) if retry_in.is_zero()));
        assert!(matches!(watch.next().await, Some(Ok(_))));
        assert_eq!(tokio::time::Instant::now(), at);
    }

    /// kube-rs's watcher yields `Init` before each list request: a list refused every time
    /// still backs off.
    #[tokio::test(start_paused = true)]
    async fn the_init_before_a_refused_list_does_not_reset_the_backoff() {
        let attempts = (0..4).flat_map(|_| [Ok(watcher::Event::<()>::Init), Err(refused())]);
        let mut watch = Box::pin(with_retry(futures::stream::iter(attempts)));
        let mut waits = Vec::new();
        while let Some(item) = watch.next().await {
            if let Err(failed) = item {
                waits.push(failed.retry_in);
            }
        }
        assert_eq!(
            waits,
            [1, 2, 4, 8].map(|s| REFUSED_MIN * s).to_vec(),
            "{waits:?}"
        );
    }

    #[test]
    fn an_event_resets_the_backoff() {
        let mut policy = RetryPolicy::default();
        for _ in 0..10 {
            policy.wait_after(&unreachable());
        }
        policy.succeeded();
        assert_eq!(policy.wait_after(&unreachable()), UNREACHABLE_MIN);
    }
}
