//! Discovery through kube-rs against the API server double: the scenarios a cluster produces.
//! Every wait is a condition on the published snapshots with a deadline.

// Helpers outside `#[test]` fns fail the test by panicking, exactly like the tests themselves.
#![allow(clippy::unwrap_used, reason = "test code: a panic is a failure")]

use std::sync::Arc;
use std::time::Duration;

use kvroute_discovery::testing::{ApiServer, Resource, TestPod};
use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, RawKubernetes, Snapshot};
use kvroute_test_support::{deadline, poll_until};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;

const NS: &str = "llm";

/// How long a test waits for discovery or the double to reach a state.
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
    async fn start(section: &str) -> Self {
        Self::start_with(ApiServer::start().await.unwrap(), section).await
    }

    async fn start_with(server: ApiServer, section: &str) -> Self {
        let yaml = format!(
            "{{namespace: {NS}, api_url: \"{}\", {section}}}",
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

    /// Waits until the published snapshot satisfies `condition`.
    async fn until(&mut self, what: &str, condition: impl Fn(&Snapshot) -> bool) -> Arc<Snapshot> {
        let after = within();
        match tokio::time::timeout(after, self.snapshots.wait_for(|s| condition(s))).await {
            Ok(Ok(snapshot)) => Arc::clone(&snapshot),
            _ => panic!(
                "timed out after {after:?} waiting for {what}; last snapshot: {:?}\nrequests: {:?}",
                self.discovery.current(),
                self.server.requests()
            ),
        }
    }

    async fn until_ids(&mut self, ids: &[&str]) -> Arc<Snapshot> {
        self.until(&format!("replicas {ids:?}"), |s| s.synced && s.ids() == ids)
            .await
    }

    fn metrics(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        text
    }

    async fn shutdown(self) {
        self.discovery.stop();
        self.tasks.close();
        tokio::time::timeout(within(), self.tasks.wait())
            .await
            .unwrap();
    }
}

fn engine(name: &str, ip: &str) -> TestPod {
    TestPod::new(name)
        .label("app", "vllm")
        .ip(ip)
        .ready(true)
        .port("http", 8000)
}

#[tokio::test]
async fn pods_join_when_ready_and_leave_when_unready_terminating_or_deleted() {
    let mut f = Fixture::start("selector: {app: vllm}, target_port: http").await;
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.server
        .apply_pod(NS, &engine("other", "10.0.0.9").label("app", "other"));
    f.server
        .apply_pod("elsewhere", &engine("vllm-z", "10.0.0.8"));
    let first = f.until_ids(&["vllm-a"]).await;
    let a = first.get("vllm-a").unwrap();
    assert_eq!(a.address, "10.0.0.1:8000".parse().unwrap());
    assert_eq!(a.metrics_url, "http://10.0.0.1:8000/metrics");
    assert_eq!(a.kv_events, "tcp://10.0.0.1:5557");

    // Pending (no IP, not Ready) → nothing; Ready → joins.
    f.server.apply_pod(
        NS,
        &TestPod::new("vllm-b")
            .label("app", "vllm")
            .port("http", 8000),
    );
    f.server.apply_pod(NS, &engine("vllm-c", "10.0.0.3"));
    f.until_ids(&["vllm-a", "vllm-c"]).await;
    f.server.apply_pod(NS, &engine("vllm-b", "10.0.0.2"));
    f.until_ids(&["vllm-a", "vllm-b", "vllm-c"]).await;

    // Unready leaves; terminating leaves; deleted leaves.
    f.server
        .apply_pod(NS, &engine("vllm-a", "10.0.0.1").ready(false));
    f.until_ids(&["vllm-b", "vllm-c"]).await;
    f.server
        .apply_pod(NS, &engine("vllm-b", "10.0.0.2").terminating());
    f.until_ids(&["vllm-c"]).await;
    assert!(f.server.delete_pod(NS, "vllm-b"));
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.until_ids(&["vllm-a", "vllm-c"]).await;
    assert!(f.server.delete_pod(NS, "vllm-c"));
    f.until_ids(&["vllm-a"]).await;

    // A label change moves a pod out of the selection (the watch sees DELETED).
    f.server
        .apply_pod(NS, &engine("vllm-a", "10.0.0.1").label("app", "retired"));
    f.until_ids(&[]).await;

    // The watch asked for bookmarks and selected by label, in the namespace.
    let watches: Vec<_> = f
        .server
        .requests()
        .into_iter()
        .filter(|r| r.watch)
        .collect();
    assert!(!watches.is_empty());
    assert!(
        watches
            .iter()
            .all(|r| r.label_selector.as_deref() == Some("app=vllm"))
    );
    let metrics = f.metrics();
    assert!(
        metrics.contains(
            r#"discovery_watch_restarts_total{source="pool-a",watch="pods",reason="start"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"discovery_replicas{source="pool-a"} 0"#),
        "{metrics}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn an_edited_inference_pool_retargets_the_pod_watch() {
    let server = ApiServer::start().await.unwrap();
    server.apply_inference_pool(NS, "llama", &[("app", "vllm")], &[8000]);
    server.apply_inference_pool(NS, "other-pool", &[("app", "other")], &[9000]);
    server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    server.apply_pod(NS, &engine("blue-a", "10.0.0.2").label("app", "blue"));
    let mut f = Fixture::start_with(server, "inference_pool: llama").await;
    let first = f.until_ids(&["vllm-a"]).await;
    assert_eq!(first.replicas[0].address, "10.0.0.1:8000".parse().unwrap());

    // The selector moves to the blue pods, with two ranks: ids and ports follow.
    f.server
        .apply_inference_pool(NS, "llama", &[("app", "blue")], &[8000, 8001]);
    let blue = f.until_ids(&["blue-a-rank0", "blue-a-rank1"]).await;
    assert_eq!(blue.replicas[1].address, "10.0.0.2:8001".parse().unwrap());
    assert_eq!(blue.replicas[1].kv_events, "tcp://10.0.0.2:5558");
    assert_eq!(
        blue.replicas[1].kv_replay.as_deref(),
        Some("tcp://10.0.0.2:5559")
    );
    let pod_watches: Vec<_> = f
        .server
        .requests()
        .into_iter()
        .filter(|r| r.resource == Resource::Pods && !r.watch)
        .map(|r| r.label_selector)
        .collect();
    assert!(
        pod_watches.contains(&Some("app=blue".to_owned())),
        "{pod_watches:?}"
    );

    // An invalid edit keeps the selection; deleting the pool empties the snapshot.
    f.server.apply(
        Resource::InferencePools,
        NS,
        serde_json::json!({"metadata": {"name": "llama"}, "spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}}),
    );
    f.server
        .apply_pod(NS, &engine("blue-b", "10.0.0.3").label("app", "blue"));
    f.until_ids(&[
        "blue-a-rank0",
        "blue-a-rank1",
        "blue-b-rank0",
        "blue-b-rank1",
    ])
    .await;
    assert!(f.metrics().contains(r#"discovery_invalid_pools_total{source="pool-a",watch="inference_pool",reason="empty_selector"} 1"#));
    f.server.delete(Resource::InferencePools, NS, "llama");
    f.until_ids(&[]).await;
    f.server
        .apply_inference_pool(NS, "llama", &[("app", "vllm")], &[8000]);
    f.until_ids(&["vllm-a"]).await;
    f.shutdown().await;
}

#[tokio::test]
async fn a_restarted_api_server_is_resumed_from_the_last_version() {
    let mut f = Fixture::start("selector: {app: vllm}, target_port: 8000").await;
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.until_ids(&["vllm-a"]).await;
    let seen = f.server.resource_version();

    // Down mid-watch; pods change meanwhile; back on the same port with history kept.
    f.server.stop().await;
    assert_eq!(f.server.open_watches(), 0);
    f.server.apply_pod(NS, &engine("vllm-b", "10.0.0.2"));
    f.server.delete_pod(NS, "vllm-a");
    f.server.resume(false).await.unwrap();
    f.until_ids(&["vllm-b"]).await;
    // Resumed with a watch from a version it had seen, not a relist.
    let after: Vec<_> = f
        .server
        .requests()
        .into_iter()
        .filter(|r| r.resource == Resource::Pods)
        .collect();
    let lists = after.iter().filter(|r| !r.watch).count();
    assert_eq!(lists, 1, "{after:?}");
    assert!(after.iter().any(|r| {
        r.watch
            && r.resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v >= seen)
    }));
    assert_eq!(f.server.gone_sent(), 0);
    // No error count is asserted: a stop can end the watch as a clean end of stream (kube-rs then
    // just watches again) or, if the client reconnects before the resume, as refused connects —
    // which one depends on timing (it flaked 3 in 5 runs).
    f.shutdown().await;
}

#[tokio::test]
async fn a_compacted_history_answers_410_and_the_watch_relists() {
    let mut f = Fixture::start("selector: {app: vllm}, target_port: 8000").await;
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.server.apply_pod(NS, &engine("vllm-b", "10.0.0.2"));
    f.until_ids(&["vllm-a", "vllm-b"]).await;

    f.server.stop().await;
    // Deleted while the watch was down and the history compacted: only a relist can tell.
    f.server.delete_pod(NS, "vllm-a");
    f.server.apply_pod(NS, &engine("vllm-c", "10.0.0.3"));
    f.server.resume(true).await.unwrap();
    f.until_ids(&["vllm-b", "vllm-c"]).await;
    assert!(f.server.gone_sent() >= 1);
    let metrics = f.metrics();
    assert!(
        metrics.contains(
            r#"discovery_watch_errors_total{source="pool-a",watch="pods",reason="gone"}"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"discovery_watch_restarts_total{source="pool-a",watch="pods",reason="relist"}"#
        ),
        "{metrics}"
    );

    // An open watch ended with 410 (a watcher too far behind) relists as well.
    // Once the relisted watch is open (the last request), so the expiry ends it.
    poll_until("the watch after the relist", within(), || async {
        f.server.requests().last().is_some_and(|r| r.watch)
    })
    .await;
    let lists_before = f.server.requests().iter().filter(|r| !r.watch).count();
    f.server.expire_watches();
    f.server.apply_pod(NS, &engine("vllm-d", "10.0.0.4"));
    f.until_ids(&["vllm-b", "vllm-c", "vllm-d"]).await;
    let lists_after = f.server.requests().iter().filter(|r| !r.watch).count();
    assert!(lists_after > lists_before);
    f.shutdown().await;
}

#[tokio::test]
async fn bookmarks_carry_the_version_a_resumed_watch_starts_from() {
    let server = ApiServer::with_bookmark_interval(Duration::from_millis(50))
        .await
        .unwrap();
    let mut f = Fixture::start_with(server, "selector: {app: vllm}, target_port: 8000").await;
    f.server.apply_pod(NS, &engine("vllm-a", "10.0.0.1"));
    f.until_ids(&["vllm-a"]).await;
    // Changes this watch does not see move the store's version on; only bookmarks tell the
    // client about them.
    for i in 0..5 {
        f.server
            .apply_pod("elsewhere", &engine(&format!("x{i}"), "10.0.1.1"));
    }
    let latest = f.server.resource_version();
    poll_until("a bookmark at the latest version", within(), || async {
        f.server.last_bookmark() >= latest
    })
    .await;
    f.server.restart(false).await.unwrap();
    f.server.apply_pod(NS, &engine("vllm-b", "10.0.0.2"));
    f.until_ids(&["vllm-a", "vllm-b"]).await;
    let resumed_from: Vec<u64> = f
        .server
        .requests()
        .into_iter()
        .filter(|r| r.watch)
        .filter_map(|r| r.resource_version?.parse().ok())
        .collect();
    // Resumed after the bookmark, not from its own pod's older version.
    assert!(
        resumed_from.iter().any(|&v| v >= latest),
        "{resumed_from:?} vs {latest}"
    );
    f.shutdown().await;
}

#[tokio::test]
async fn the_agent_sees_only_its_own_node() {
    let mut f = Fixture::start("selector: {app: vllm}, target_port: 8000, node_name: node-1").await;
    f.server
        .apply_pod(NS, &engine("vllm-a", "10.0.0.1").node("node-1"));
    f.server
        .apply_pod(NS, &engine("vllm-b", "10.0.0.2").node("node-2"));
    f.server
        .apply_pod(NS, &engine("vllm-c", "10.0.0.3").node("node-1"));
    let snapshot = f.until_ids(&["vllm-a", "vllm-c"]).await;
    assert!(
        snapshot
            .replicas
            .iter()
            .all(|r| r.node.as_deref() == Some("node-1"))
    );
    assert!(
        f.server
            .requests()
            .iter()
            .all(|r| r.field_selector.as_deref() == Some("spec.nodeName=node-1"))
    );
    f.shutdown().await;
}

#[tokio::test]
async fn a_pod_with_bad_annotations_is_refused_and_counted() {
    let mut f = Fixture::start("selector: {app: vllm}, target_port: 8000").await;
    f.server.apply_pod(
        NS,
        &engine("bad", "10.0.0.1").annotation("kvroute.io/kv-events-port", "many"),
    );
    f.server.apply_pod(
        NS,
        &engine("good", "10.0.0.2").annotation("kvroute.io/model", "llama"),
    );
    let snapshot = f.until_ids(&["good"]).await;
    assert_eq!(snapshot.replicas[0].model.as_deref(), Some("llama"));
    assert!(f.metrics().contains(
        r#"discovery_pods_refused_total{source="pool-a",watch="pods",reason="bad_annotation"}"#
    ));
    f.shutdown().await;
}
