//! How long discovery takes to see a change after the API server comes back, measured against
//! the API server double (`testing::ApiServer`) over real HTTP on loopback:
//!
//! ```text
//! cargo run --release -p kvroute-discovery --example catch_up [-- ROUNDS OUTAGE_MS]
//! ```
//!
//! Each round, per scenario: the watch is synced on one pod; the fault starts; a pod is added
//! (while the server is down, where it is); the fault ends; the time from the end of the fault
//! to the snapshot that holds the new pod is one sample. Scenarios:
//! - `outage`: the server down for OUTAGE_MS (default 4000), back with its watch history;
//! - `restart`: the same, back with the history compacted (the resumed watch gets `410 Gone`
//!   and relists);
//! - `gone`: open watches ended by `410 Gone` while the server is up (no outage);
//! - `refused`: the list refused with 403 for OUTAGE_MS, then allowed (a missing RBAC
//!   permission granted).
//!
//! Prints min, median and max per scenario (milliseconds). The bound these should meet (README,
//! "Discovery"): back + at most 2 s + one list and watch after an outage or restart, one list
//! and watch after `410 Gone`; after refused lists, up to the refused backoff then reached
//! (1 s doubling to 60 s).

#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    reason = "a measurement tool: prints its results, panics on a broken setup"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_discovery::testing::{ApiServer, Resource, TestPod};
use kvroute_discovery::{Discovery, DiscoveryMetrics, KubernetesSource, RawKubernetes, Snapshot};
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::task::TaskTracker;

const NS: &str = "llm";
/// Longest any one catch-up is waited for before the tool gives up.
const GIVE_UP_AFTER: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy)]
enum Scenario {
    Outage,
    Restart,
    Gone,
    Refused,
}

fn engine(name: &str) -> TestPod {
    TestPod::new(name)
        .label("app", "vllm")
        .ip("10.0.0.1")
        .ready(true)
        .port("http", 8000)
}

async fn until_has(snapshots: &mut watch::Receiver<Arc<Snapshot>>, id: &str) {
    let found = tokio::time::timeout(
        GIVE_UP_AFTER,
        snapshots.wait_for(|s| s.synced && s.get(id).is_some()),
    )
    .await;
    assert!(
        matches!(found, Ok(Ok(_))),
        "{id} not seen within {GIVE_UP_AFTER:?}"
    );
}

/// One sample: the time from the end of the fault to the snapshot with the new pod.
async fn round(scenario: Scenario, outage: Duration) -> Duration {
    let server = ApiServer::start().await.unwrap();
    server.apply_pod(NS, &engine("before"));
    let raw: RawKubernetes = serde_json::from_value(serde_json::json!({
        "namespace": NS, "api_url": server.url(), "selector": {"app": "vllm"}, "target_port": 8000
    }))
    .unwrap();
    let source = KubernetesSource::try_from(raw).unwrap();
    let metrics = DiscoveryMetrics::register(&mut Registry::default());
    let tasks = TaskTracker::new();
    let discovery = Discovery::start("bench", source, &metrics, &tasks)
        .await
        .unwrap();
    let mut snapshots = discovery.snapshots();
    until_has(&mut snapshots, "before").await;
    // The new pod's id: `<pod>` with one target port.
    let ended = match scenario {
        Scenario::Outage | Scenario::Restart => {
            server.stop().await;
            tokio::time::sleep(outage).await;
            server.apply_pod(NS, &engine("after"));
            server
                .resume(matches!(scenario, Scenario::Restart))
                .await
                .unwrap();
            Instant::now()
        }
        Scenario::Gone => {
            // Once the watch is open, so the expiry ends it.
            while server.open_watches() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            server.apply_pod(NS, &engine("after"));
            server.expire_watches();
            Instant::now()
        }
        Scenario::Refused => {
            // A fresh watch whose list is refused from its first attempt.
            discovery.stop();
            let refused = ApiServer::start().await.unwrap();
            refused.forbid(Resource::Pods);
            refused.apply_pod(NS, &engine("after"));
            let raw: RawKubernetes = serde_json::from_value(serde_json::json!({
                "namespace": NS, "api_url": refused.url(), "selector": {"app": "vllm"}, "target_port": 8000
            }))
            .unwrap();
            let source = KubernetesSource::try_from(raw).unwrap();
            let refusing = Discovery::start("bench", source, &metrics, &tasks)
                .await
                .unwrap();
            let mut refusing_snapshots = refusing.snapshots();
            tokio::time::sleep(outage).await;
            refused.allow(Resource::Pods);
            let ended = Instant::now();
            until_has(&mut refusing_snapshots, "after").await;
            let took = ended.elapsed();
            refusing.stop();
            tasks.close();
            tasks.wait().await;
            return took;
        }
    };
    until_has(&mut snapshots, "after").await;
    let took = ended.elapsed();
    discovery.stop();
    tasks.close();
    tasks.wait().await;
    took
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let outage = Duration::from_millis(args.next().and_then(|a| a.parse().ok()).unwrap_or(4000));
    println!("rounds {rounds}, outage {outage:?}");
    println!(
        "{:<10} {:>9} {:>9} {:>9}",
        "scenario", "min ms", "median ms", "max ms"
    );
    for scenario in [
        Scenario::Outage,
        Scenario::Restart,
        Scenario::Gone,
        Scenario::Refused,
    ] {
        let mut samples = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            samples.push(round(scenario, outage).await);
        }
        samples.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>9.1}",
            format!("{scenario:?}").to_lowercase(),
            ms(samples[0]),
            ms(samples[samples.len() / 2]),
            ms(samples[samples.len() - 1]),
        );
    }
}
