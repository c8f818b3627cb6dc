//! How fast discovery comes back, against the API server double, asserted through the mechanism
//! rather than the clock: the waits the watch chose after each error
//! (`discovery_watch_retry_wait_seconds`, by error reason), the requests the double answered,
//! the relists counted, and the log lines written.
//!
//! The bound these check: a change made while the API server is down is seen once the server is
//! back plus at most 2 s (the longest wait while it is unreachable) plus one list and watch; a
//! `410 Gone` is relisted with no wait at all. A regression to kube-rs's default backoff (800 ms
//! doubling to 30 s) records waits above 2 s and after `410 Gone`, and fails these tests.
//! The catch-up times themselves are measured by `examples/catch_up.rs` (BENCHMARKS.md).

// Helpers outside `#[test]` fns fail the test by panicking, exactly like the tests themselves.
#![allow(clippy::unwrap_used, reason = "test code: a panic is a failure")]

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use kvroute_discovery::testing::{ApiServer, Resource, TestPod};
use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, RawKubernetes, Snapshot};
use kvroute_test_support::{deadline, poll_until};
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;

const NS: &str = "llm";
/// The longest wait while the server is unreachable (`retry::UNREACHABLE_MAX`).
const UNREACHABLE_CAP_SECONDS: &str = "2.0";

fn within() -> Duration {
    deadline(Duration::from_secs(30))
}

struct Fixture {
    server: ApiServer,
    discovery: Discovery,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    registry: Registry,
    tasks: TaskTracker,
}

impl Fixture {
    async fn start(server: ApiServer) -> Self {
        let yaml = format!(
            "{{namespace: {NS}, api_url: \"{}\", selector: {{app: vllm}}, target_port: 8000}}",
            server.url()
        );
        let raw: RawKubernetes = serde_yaml::from_str(&yaml).unwrap();
        let source = KubernetesSource::try_from(raw).unwrap();
        let mut registry = Registry::default();
        let metrics = DiscoveryMetrics::register(&mut registry);
        let tasks = TaskTracker::new();
        let discovery = Discovery::start("pool-a", source, &metrics, &tasks)
            .await
            .unwrap();
        let snapshots = discovery.snapshots();
        Self {
            server,
            discovery,
            snapshots,
            registry,
            tasks,
        }
    }

    async fn until_ids(&mut self, ids: &[&str]) {
        let after = within();
        let seen = tokio::time::timeout(
            after,
            self.snapshots.wait_for(|s| s.synced && s.ids() == ids),
        )
        .await;
        assert!(
            matches!(seen, Ok(Ok(_))),
            "timed out after {after:?} waiting for {ids:?}; last snapshot: {:?}\nrequests: {:?}",
            self.discovery.current(),
            self.server.requests()
        );
    }

    fn metrics(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }

    /// The pod watch's errors so far, every reason.
    fn pod_errors(&self) -> u64 {
        sum(&self.metrics(), "discovery_watch_errors_total{", |labels| {
            labels.contains(r#"watch="pods""#)
        })
    }

    async fn until_pod_errors(&self, at_least: u64) {
        poll_until(
            &format!("{at_least} pod watch errors"),
            within(),
            || async { self.pod_errors() >= at_least },
        )
        .await;
    }

    async fn shutdown(self) {
        self.discovery.stop();
        self.tasks.close();
        tokio::time::timeout(within(), self.tasks.wait())
            .await
            .unwrap();
    }
}

/// The sum of the samples of `prefix` (`name{`) whose labels pass `select`.
fn sum(metrics: &str, prefix: &str, select: impl Fn(&str) -> bool) -> u64 {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix(prefix))
        .filter_map(|rest| rest.rsplit_once("} "))
        .filter(|(labels, _)| select(labels))
        .map(|(_, value)| value.parse::<f64>().unwrap() as u64)
        .sum()
}

/// Waits after the pod watch's errors of a reason `reason` selects: how many, and how many of
/// them were at most `le` seconds.
fn waits(metrics: &str, reason: impl Fn(&str) -> bool, le: &str) -> (u64, u64) {
    let select = |labels: &str| {
        labels.contains(r#"watch="pods""#)
            && labels
                .split(',')
                .find_map(|l| l.strip_prefix("reason=\""))
                .is_some_and(|r| reason(r.trim_end_matches('"')))
    };
    let all = sum(metrics, "discovery_watch_retry_wait_seconds_count{", select);
    let within = sum(metrics, "discovery_watch_retry_wait_seconds_bucket{", |l| {
        select(l) && l.contains(&format!("le=\"{le}\""))
    });
    (all, within)
}

fn engine(name: &str, ip: &str) -> TestPod {
    TestPod::new(name)
        .label("app", "vllm")
        .ip(ip)
        .ready(true)
        .port("http", 8000)
}

/// The API server down long enough for kube-rs's old backoff to pass 2 s (its fifth error waited
/// 12.8 s): every wait stays within the short cap, a change made while it was down is seen after
/// it comes back with its history compacted, and the `410 Gone` that follows is relisted at once.
#[tokio::test]
async fn an_outage_is_retried_within_the_short_cap_and_a_gone_version_at_once() {
    let mut f = Fixture::start(ApiServer::start().await.unwrap()).await;
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.until_ids(&["vllm-a"]).await;

    f.server.stop().await;
    // 100, 200, 400, 800 ms, 1.6 s, then the 2 s cap: six failed attempts pass the old
    // backoff's 2 s mark twice over.
    f.until_pod_errors(6).await;
    f.server.delete_pod(NS, "vllm-a");
    f.server.apply_pod(NS, &engine("vllm-b", "10.0.0.2"));
    f.server.resume(true).await.unwrap();
    f.until_ids(&["vllm-b"]).await;

    let metrics = f.metrics();
    let (unreachable, capped) = waits(&metrics, |r| r != "gone", UNREACHABLE_CAP_SECONDS);
    assert!(unreachable >= 6, "{metrics}");
    assert_eq!(capped, unreachable, "a wait above the cap\n{metrics}");
    // The longest waits reached the cap: the backoff did grow (it is not retrying in a loop).
    let (_, short) = waits(&metrics, |r| r != "gone", "1.0");
    assert!(short < unreachable, "{metrics}");
    let (gone, at_once) = waits(&metrics, |r| r == "gone", "0.0");
    assert!(gone >= 1 && f.server.gone_sent() >= 1, "{metrics}");
    assert_eq!(at_once, gone, "a 410 Gone waited\n{metrics}");
    assert!(
        metrics.contains(
            r#"discovery_watch_restarts_total{source="pool-a",watch="pods",reason="relist"} 1"#
        ),
        "{metrics}"
    );

    // An open watch ended by 410: relisted with no wait, once.
    poll_until("the watch after the relist", within(), || async {
        f.server.requests().last().is_some_and(|r| r.watch)
    })
    .await;
    f.server.expire_watches();
    f.server.apply_pod(NS, &engine("vllm-c", "10.0.0.3"));
    f.until_ids(&["vllm-b", "vllm-c"]).await;
    let metrics = f.metrics();
    let (gone, at_once) = waits(&metrics, |r| r == "gone", "0.0");
    assert!(gone >= 2, "{metrics}");
    assert_eq!(at_once, gone, "{metrics}");
    f.shutdown().await;
}

/// A log sink the test reads: everything logged on this thread while the guard lives.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Discovery's own lines at `level` containing `text`.
    fn lines(&self, level: &str, text: &str) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock())
            .lines()
            .filter(|line| line.contains(&format!(" {level} kvroute_discovery")))
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

/// A list refused with 403 (the service account lacks `list pods`): retried 1 s doubling (never
/// within the short cap), logged once with its reason however often it is retried, counted as
/// errors and not as relists, and logged once more when the permission is granted.
#[tokio::test]
async fn a_refused_list_backs_off_long_logs_once_and_recovers() {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = ApiServer::start().await.unwrap();
    server.forbid(Resource::Pods);
    server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    let mut f = Fixture::start(server).await;
    // Refused at 0, then after 1 s and 2 s.
    f.until_pod_errors(3).await;
    let refused = f.server.requests().len();
    assert!(refused >= 3, "every attempt reached the server");

    let metrics = f.metrics();
    let (failed, short) = waits(&metrics, |r| r == "list_failed", "0.5");
    assert!(failed >= 3, "{metrics}");
    assert_eq!(
        short, 0,
        "a refused list retried within the short backoff\n{metrics}"
    );
    assert!(
        !metrics.contains(r#"reason="relist"} "#),
        "failed lists counted as relists\n{metrics}"
    );
    let failing = captured.lines("WARN", "kubernetes watch failing");
    assert_eq!(failing.len(), 1, "{failing:?}");
    assert!(
        failing[0].contains("Forbidden") || failing[0].contains("forbidden"),
        "{failing:?}"
    );
    assert!(captured.lines("WARN", "still failing").is_empty());
    assert!(captured.lines("ERROR", "").is_empty());

    f.server.allow(Resource::Pods);
    f.until_ids(&["vllm-a"]).await;
    let recovered = captured.lines("INFO", "kubernetes watch recovered");
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    let metrics = f.metrics();
    assert!(
        metrics.contains(
            r#"discovery_watch_restarts_total{source="pool-a",watch="pods",reason="start"} 1"#
        ),
        "{metrics}"
    );
    assert!(!metrics.contains(r#"reason="relist"} "#), "{metrics}");
    f.shutdown().await;
}
