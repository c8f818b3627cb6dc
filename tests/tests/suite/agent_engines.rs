//! kvroute-agent's engine set changing while it runs: engines learned from the API
//! server double (`kvroute_discovery::testing::ApiServer`, the list/watch wire protocol over
//! kube-rs) — only the Ready pods on the agent's node — and engines added or removed by
//! rewriting the config file. Engines are real ZeroMQ publishers ([`MockVllmPublisher`]); the
//! agent streams to an in-process kvroute-index, whose `/v1/replicas` shows what it learned.
//!
//! Each publisher publishes its blocks before the agent meets it: the agent learns them by the
//! replay catch-up on join, so no live message can be lost to ZeroMQ's slow-joiner gap.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kvroute_agent::{Agent, AgentConfig};
use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_index::config::Config;
use kvroute_index::server::IndexServer;
use kvroute_ingest::testing::MockVllmPublisher;
use kvroute_test_support::{deadline, poll_until, try_poll_until};

use super::agent::{index_blocks, metric, payload, replica_state, stored};

const NS: &str = "llm";
const TOKEN: &str = "node-a-secret";
/// How long a test waits for the index or the agent to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(15))
}

/// An index that lets agent `node-a` feed every replica the tests use, so only the agent's
/// own claims decide which it feeds (pod-b on another node included: claiming it would work).
async fn start_index(dir: &Path) -> IndexServer {
    let token = dir.join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let ids = ["pod-a", "pod-b", "engine-x", "engine-y"];
    let replicas: String = ids
        .iter()
        .map(|id| format!("  - {{id: {id}, pool: tiny}}\n"))
        .collect();
    let yaml = format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         limits: {{agent_stale_grace: 300ms}}\n\
         pools:\n  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, \
         hash_algo: sha256_cbor, seed: \"0\"}}, verify_hashes: off}}\n\
         replicas:\n{replicas}\
         agents:\n  - {{id: node-a, token_file: \"{}\", replicas: [{}]}}\n",
        token.display(),
        ids.join(", ")
    );
    IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap()
}

/// A publisher that has already published `hashes` (one batch), kept for replay.
async fn engine_with(hashes: &[u64]) -> MockVllmPublisher {
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    publisher.publish(payload(stored(hashes))).await.unwrap();
    publisher
}

fn port_of(endpoint: &str) -> String {
    endpoint.rsplit(':').next().unwrap().to_owned()
}

/// A Ready pod whose KV-event and replay ports are `engine`'s (annotations), on `node`.
fn pod(name: &str, node: &str, http_port: u16, engine: &MockVllmPublisher) -> TestPod {
    TestPod::new(name)
        .label("app", "vllm")
        .ip("127.0.0.1")
        .ready(true)
        .node(node)
        .port("http", http_port)
        .annotation(
            "kvroute.io/kv-events-port",
            &port_of(engine.pub_endpoint().unwrap()),
        )
        .annotation(
            "kvroute.io/kv-replay-port",
            &port_of(engine.replay_endpoint().unwrap()),
        )
}

fn static_engine(id: &str, engine: &MockVllmPublisher) -> String {
    format!(
        "  - {{replica: {id}, endpoint: \"{}\", replay_endpoint: \"{}\"}}\n",
        engine.pub_endpoint().unwrap(),
        engine.replay_endpoint().unwrap()
    )
}

/// The agent's config file; every write replaces it whole (rename, as a ConfigMap update
/// does) with a new mtime, so the agent sees each version exactly once.
struct ConfigFile {
    path: PathBuf,
    version: u64,
}

impl ConfigFile {
    fn write(&mut self, text: &str) {
        self.version += 1;
        let staged = self.path.with_extension("staged");
        std::fs::write(&staged, text).unwrap();
        let mtime = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 + self.version);
        std::fs::File::options()
            .write(true)
            .open(&staged)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        std::fs::rename(&staged, &self.path).unwrap();
    }
}

fn agent_yaml(dir: &Path, index: SocketAddr, rest: &str) -> String {
    format!(
        "agent_id: node-a\ntoken_file: \"{}\"\nindexes: [\"http://{index}\"]\nadmin: 127.0.0.1:0\n\
         batch_delay: 10ms\nreconnect_backoff_max: 200ms\nreload_interval: 20ms\n{rest}",
        dir.join("token").display()
    )
}

async fn start_agent(file: &mut ConfigFile, yaml: &str) -> Agent {
    file.write(yaml);
    let config = AgentConfig::from_yaml(yaml).unwrap();
    Agent::start_reloading(config, file.path.clone())
        .await
        .unwrap()
}

/// Waits until the index holds exactly `blocks` for `replica` in `state`.
async fn until_index(admin: SocketAddr, replica: &str, blocks: &[u64], state: &str) {
    let expected: BTreeSet<u64> = blocks.iter().copied().collect();
    let result = try_poll_until(
        &format!("index: {replica} {state} with {blocks:?}"),
        within(),
        || async {
            let held = index_blocks(admin, replica).await?;
            let (now, _) = replica_state(admin, replica).await?;
            (held == expected && now == state).then_some(())
        },
    )
    .await;
    if let Err(error) = result {
        panic!(
            "{error}: index has {:?} ({:?})",
            index_blocks(admin, replica).await,
            replica_state(admin, replica).await
        );
    }
}

/// Waits until the agent mirrors exactly `replicas` (what its `Hello` claims).
async fn until_mirrored(agent: &Agent, replicas: &[&str]) {
    try_poll_until(&format!("agent mirrors {replicas:?}"), within(), || async {
        (agent.hub().replicas() == replicas).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: agent mirrors {:?}", agent.hub().replicas()));
}

async fn until_metric(admin: SocketAddr, series: &str, value: u64) {
    let result = try_poll_until(&format!("{series} {value}"), within(), || async {
        (metric(admin, series).await == value).then_some(())
    })
    .await;
    if let Err(error) = result {
        panic!("{error}: it is {}", metric(admin, series).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_mirrors_the_ready_pods_of_its_node_as_they_come_and_go() {
    let dir = tempfile::tempdir().unwrap();
    let index = start_index(dir.path()).await;
    let admin = index.admin_addr();
    let api = ApiServer::start().await.unwrap();
    let engine_a = engine_with(&[1, 2]).await;
    let engine_b = engine_with(&[3]).await;
    api.apply_pod(NS, &pod("pod-a", "node-a", 8001, &engine_a));
    api.apply_pod(NS, &pod("pod-b", "node-b", 8002, &engine_b));

    // No static engines: all of them come from the API server; the node is the agent id.
    let discovery = format!(
        "engines: []\ndiscovery: {{kubernetes: {{namespace: {NS}, selector: {{app: vllm}}, \
         target_port: http, api_url: \"{}\"}}}}\n",
        api.url()
    );
    let mut file = ConfigFile {
        path: dir.path().join("agent.yaml"),
        version: 0,
    };
    let agent = start_agent(
        &mut file,
        &agent_yaml(dir.path(), index.grpc_addr(), &discovery),
    )
    .await;
    let agent_admin = agent.admin_addr();

    until_index(admin, "pod-a", &[1, 2], "ready").await;
    assert_eq!(
        agent.hub().replicas(),
        ["pod-a"],
        "pod-b runs on node-b: not this agent's"
    );
    assert_eq!(agent.hub().block_hashes("pod-b"), None);
    assert_eq!(
        metric(agent_admin, "kvroute_agent_engines{source=\"discovered\"}").await,
        1
    );

    // Unready: its engine leaves, the index forgets its blocks and no stream claims it any
    // more (stale once the grace has passed).
    api.apply_pod(NS, &pod("pod-a", "node-a", 8001, &engine_a).ready(false));
    until_mirrored(&agent, &[]).await;
    until_index(admin, "pod-a", &[], "stale").await;
    assert_eq!(
        metric(agent_admin, "kvroute_agent_engines{source=\"discovered\"}").await,
        0
    );
    let mirror_series = "kvroute_agent_mirror_blocks{replica=\"pod-a\"}";
    let text = kvroute_tests::harness::http::get(&format!("http://{agent_admin}/metrics"))
        .await
        .unwrap()
        .text();
    assert!(
        !text.contains(mirror_series),
        "a removed mirror leaves no series behind:\n{text}"
    );
    assert!(
        !text.contains("kvroute_agent_ingest_connected{replica_id=\"pod-a\""),
        "a stopped ingest leaves no per-replica series behind:\n{text}"
    );

    // Ready again: mirrored from a fresh catch-up, claimed again.
    api.apply_pod(NS, &pod("pod-a", "node-a", 8001, &engine_a));
    until_index(admin, "pod-a", &[1, 2], "ready").await;

    // Deleted: gone from the agent and the index.
    assert!(api.delete_pod(NS, "pod-a"));
    until_mirrored(&agent, &[]).await;
    until_index(admin, "pod-a", &[], "stale").await;
    assert_eq!(
        index_blocks(admin, "pod-b").await,
        Some(BTreeSet::new()),
        "never fed"
    );

    agent.shutdown().await;
    index.shutdown().await;
    engine_a.shutdown().await;
    engine_b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_reload_changes_the_engines_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let index = start_index(dir.path()).await;
    let admin = index.admin_addr();
    let grpc = index.grpc_addr();
    let engine_x = engine_with(&[10]).await;
    let engine_y = engine_with(&[20, 21]).await;
    let mut file = ConfigFile {
        path: dir.path().join("agent.yaml"),
        version: 0,
    };
    let x = static_engine("engine-x", &engine_x);
    let y = static_engine("engine-y", &engine_y);
    let agent = start_agent(
        &mut file,
        &agent_yaml(dir.path(), grpc, &format!("engines:\n{x}")),
    )
    .await;
    let agent_admin = agent.admin_addr();
    until_index(admin, "engine-x", &[10], "ready").await;
    let reloads =
        |outcome: &str| format!("kvroute_agent_config_reloads_total{{outcome=\"{outcome}\"}}");

    // A new engine, without a restart.
    file.write(&agent_yaml(dir.path(), grpc, &format!("engines:\n{x}{y}")));
    until_index(admin, "engine-y", &[20, 21], "ready").await;
    assert_eq!(agent.hub().replicas(), ["engine-x", "engine-y"]);
    assert_eq!(metric(agent_admin, &reloads("applied")).await, 1);
    assert_eq!(
        metric(agent_admin, "kvroute_agent_engines{source=\"static\"}").await,
        2
    );

    // A file that does not validate: counted, the running engines stay.
    file.write(&agent_yaml(
        dir.path(),
        grpc,
        "engines:\n  - {replica: engine-z}\n",
    ));
    until_metric(agent_admin, &reloads("rejected"), 1).await;
    assert_eq!(agent.hub().replicas(), ["engine-x", "engine-y"]);
    assert_eq!(metric(agent_admin, &reloads("applied")).await, 1);
    until_index(admin, "engine-y", &[20, 21], "ready").await;

    // engine-x removed and the index address changed: the removal applies, the address needs
    // a restart (counted) and the stream stays on the running index.
    let moved = agent_yaml(dir.path(), grpc, &format!("engines:\n{y}"))
        .replace(&format!("http://{grpc}"), "http://127.0.0.1:1");
    file.write(&moved);
    until_metric(
        agent_admin,
        "kvroute_agent_config_restart_required_total{key=\"indexes\"}",
        1,
    )
    .await;
    until_mirrored(&agent, &["engine-y"]).await;
    until_index(admin, "engine-x", &[], "stale").await;
    until_index(admin, "engine-y", &[20, 21], "ready").await;
    assert_eq!(metric(agent_admin, &reloads("applied")).await, 2);

    agent.shutdown().await;
    index.shutdown().await;
    engine_x.shutdown().await;
    engine_y.shutdown().await;
}

/// Both sides discover: the index lists the pool's pods itself (`pools[].discovery`) and lets
/// each node's agent feed the pods on its node (`node_agents`); the agent mirrors its node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_agents_feed_a_discovering_index() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, TOKEN).unwrap();
    let api = ApiServer::start().await.unwrap();
    let engine_a = engine_with(&[1, 2]).await;
    let engine_b = engine_with(&[3]).await;
    api.apply_pod(NS, &pod("pod-a", "node-a", 8001, &engine_a));
    api.apply_pod(NS, &pod("pod-b", "node-b", 8002, &engine_b));
    let discovery = format!(
        "discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: vllm}}, target_port: http, \
         api_url: \"{}\"}}}}",
        api.url()
    );
    let yaml = format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         limits: {{agent_stale_grace: 300ms}}\n\
         node_agents: {{token_file: \"{}\"}}\n\
         pools:\n  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, \
         hash_algo: sha256_cbor, seed: \"0\"}}, verify_hashes: off, {discovery}}}\n",
        token.display(),
    );
    let index = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let admin = index.admin_addr();
    let mut file = ConfigFile {
        path: dir.path().join("agent.yaml"),
        version: 0,
    };
    let agent = start_agent(
        &mut file,
        &agent_yaml(
            dir.path(),
            index.grpc_addr(),
            &format!("engines: []\n{discovery}\n"),
        ),
    )
    .await;

    // node-a's pod is fed by node-a's agent; node-b has no agent, so its pod never syncs.
    until_index(admin, "pod-a", &[1, 2], "ready").await;
    let (state, _) = replica_state(admin, "pod-b").await.unwrap();
    assert_ne!(state, "ready", "nobody feeds pod-b");

    // A new pod on node-a: whichever of index and agent sees it first, it ends up fed.
    let engine_c = engine_with(&[5]).await;
    api.apply_pod(NS, &pod("pod-c", "node-a", 8003, &engine_c));
    until_index(admin, "pod-c", &[5], "ready").await;
    until_index(admin, "pod-a", &[1, 2], "ready").await;

    // Deleted: it leaves the index with its blocks; the other pods stay as they were.
    assert!(api.delete_pod(NS, "pod-a"));
    poll_until("pod-a to leave the index", within(), || async {
        replica_state(admin, "pod-a").await.is_none().then_some(())
    })
    .await;
    assert_eq!(index_blocks(admin, "pod-a").await, None);
    until_index(admin, "pod-c", &[5], "ready").await;
    until_mirrored(&agent, &["pod-c"]).await;

    agent.shutdown().await;
    index.shutdown().await;
    engine_a.shutdown().await;
    engine_b.shutdown().await;
    engine_c.shutdown().await;
}
