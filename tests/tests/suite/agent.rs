//! kvroute-agent ↔ kvroute-index over real sockets: an in-process engine simulator publishes
//! KV events, an in-process agent mirrors them and streams to a `kvroute-index` *process*
//! through a TCP proxy the test can cut. After every fault the index's blocks for the replica
//! must equal the simulator's own `/debug/blocks`.
//!
//! The index binary must be built (`cargo build -p kvroute-index --bins`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_index::agent::{Agent, AgentConfig};
use kvroute_index::api::{self, agent_ingest_client::AgentIngestClient};
use kvroute_index::config::Config;
use kvroute_index::server::IndexServer;
use kvroute_tests::harness::{ChildGuard, http, wait_until};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::common::start_sim;

const TOKEN: &str = "agent-a-secret";
const CONVERGE: Duration = Duration::from_secs(10);

fn index_yaml(grpc: &str, token_dir: &Path) -> String {
    let token_a = token_dir.join("a");
    let token_b = token_dir.join("b");
    std::fs::write(&token_a, format!("{TOKEN}\n")).unwrap();
    std::fs::write(&token_b, "other-secret").unwrap();
    format!(
        r#"
listen: {{grpc: "{grpc}", admin: "127.0.0.1:0"}}
limits: {{agent_stale_grace_ms: 300}}
pools:
  - {{model: tiny, block_size: 32, key_scheme: vllm-exact, hash_algo: sha256_cbor, hash_seed: "0"}}
replicas:
  - {{id: engine-a, model: tiny}}
  - {{id: engine-b, model: tiny}}
agents:
  - {{id: node-a, token_file: "{}", replicas: [engine-a]}}
  - {{id: node-b, token_file: "{}", replicas: [engine-b]}}
"#,
        token_a.display(),
        token_b.display()
    )
}

fn agent_config(index: SocketAddr, kv_events: &str, replay: &str) -> AgentConfig {
    let yaml = format!(
        r#"
agent_id: node-a
token_env: UNUSED
indexes: ["http://{index}"]
admin: 127.0.0.1:0
batch_delay_ms: 10
reconnect_backoff_max_ms: 200
engines:
  - {{replica: engine-a, endpoint: "{kv_events}", replay_endpoint: "{replay}"}}
"#
    );
    let raw = serde_yaml::from_str(&yaml).unwrap();
    AgentConfig::validate(
        raw,
        kvroute_index::agent::token::AgentToken::from_literal(TOKEN),
    )
    .unwrap()
}

fn index_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join("kvroute-index");
    assert!(
        path.is_file(),
        "build it first: cargo build -p kvroute-index --bins ({path:?})"
    );
    path
}

/// A `kvroute-index` process, restartable on the same gRPC port.
struct IndexProcess {
    guard: ChildGuard,
    admin: SocketAddr,
    grpc: SocketAddr,
}

impl IndexProcess {
    async fn start(dir: &Path, grpc: &str) -> Self {
        let config = dir.join("index.yaml");
        let ready = dir.join("index.ready");
        let _ = std::fs::remove_file(&ready);
        std::fs::write(&config, index_yaml(grpc, dir)).unwrap();
        let mut command = Command::new(index_binary());
        command
            .arg("--config")
            .arg(&config)
            .arg("--ready-file")
            .arg(&ready);
        let guard = ChildGuard::spawn("kvroute-index", command, dir.join("index.log")).unwrap();
        let text = wait_until("index ready file", CONVERGE, || async {
            std::fs::read_to_string(&ready)
                .ok()
                .filter(|t| t.contains("admin="))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", guard.log()));
        let addr = |key: &str| -> SocketAddr {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|a| a.parse().ok())
                .unwrap()
        };
        Self {
            admin: addr("admin="),
            grpc: addr("grpc="),
            guard,
        }
    }

    fn kill9(&mut self) {
        let status = Command::new("kill")
            .args(["-KILL", &self.guard.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// TCP forwarder whose open connections can be cut at once.
struct Proxy {
    addr: SocketAddr,
    cut: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let (cut2, stop2, tasks2) = (Arc::clone(&cut), stop.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop2.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut inbound, _)) = accepted else {
                    continue;
                };
                let token = cut2.lock().clone();
                tasks2.spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        () = token.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Self {
            addr,
            cut,
            stop,
            tasks,
        }
    }

    /// Drops every open connection (new ones are accepted again).
    fn cut(&self) {
        let old = std::mem::replace(&mut *self.cut.lock(), CancellationToken::new());
        old.cancel();
    }

    async fn shutdown(self) {
        self.stop.cancel();
        self.cut();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

async fn sim_blocks(base: &str) -> BTreeSet<u64> {
    let body = http::get(&format!("{base}/debug/blocks"))
        .await
        .unwrap()
        .json()
        .unwrap();
    body["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_u64().unwrap())
        .collect()
}

async fn index_blocks(admin: SocketAddr, replica: &str) -> Option<BTreeSet<u64>> {
    let response = http::get(&format!("http://{admin}/v1/replicas/{replica}/blocks"))
        .await
        .ok()?;
    let body: Value = response.json().ok()?;
    Some(
        body["blocks"]
            .as_array()?
            .iter()
            .filter_map(Value::as_u64)
            .collect(),
    )
}

async fn replica_state(admin: SocketAddr, replica: &str) -> Option<(String, String)> {
    let body: Value = http::get(&format!("http://{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    let entry = body.as_array()?.iter().find(|r| r["id"] == replica)?;
    Some((
        entry["state"].as_str()?.to_owned(),
        entry["problem"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// Waits until the index holds exactly the simulator's blocks for engine-a, not flagged.
async fn converge(what: &str, admin: SocketAddr, sim: &str, within: Duration) {
    let result = wait_until(what, within, || async {
        let expected = sim_blocks(sim).await;
        let held = index_blocks(admin, "engine-a").await?;
        let (state, _) = replica_state(admin, "engine-a").await?;
        (held == expected && state != "flagged").then_some(())
    })
    .await;
    if let Err(error) = result {
        panic!(
            "{error}: sim {:?} vs index {:?} ({:?})",
            sim_blocks(sim).await,
            index_blocks(admin, "engine-a").await,
            replica_state(admin, "engine-a").await
        );
    }
}

async fn traffic(base: &str, round: usize) {
    for i in 0..3 {
        let prompt = format!(
            "Round {round} prompt {i}: the agent mirrors every block the engine caches, and the \
             index must agree with it after every fault the test injects. {}",
            "padding words to fill several blocks of thirty-two tokens each. ".repeat(6)
        );
        let response = http::post_json(
            &format!("{base}/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": 4}),
        )
        .await
        .unwrap();
        assert!(response.status.is_success(), "{}", response.text());
    }
}

/// ZMQ subscribers miss what is published before they join: send traffic until the agent's
/// mirror sees some, then clear the engine's cache so the mirror knows everything from here on.
async fn attach(agent: &Agent, base: &str) {
    let mut round = 100;
    wait_until("agent subscribed to the engine", CONVERGE, || {
        round += 1;
        async move {
            traffic(base, round).await;
            let mirrored = agent.hub().block_hashes("engine-a")?;
            (!mirrored.is_empty()).then_some(())
        }
    })
    .await
    .unwrap();
    let reset = http::post_json(&format!("{base}/reset_prefix_cache"), &json!({}))
        .await
        .unwrap();
    assert!(reset.status.is_success());
    wait_until("agent saw the clear", CONVERGE, || async {
        agent
            .hub()
            .block_hashes("engine-a")?
            .is_empty()
            .then_some(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_converges_to_the_engine_after_every_fault() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let kv = sim.ready_info().kv_events.clone().unwrap();
    let replay = sim.ready_info().replay.clone().unwrap();

    let mut index = IndexProcess::start(dir.path(), "127.0.0.1:0").await;
    let grpc = index.grpc;
    let proxy = Proxy::start(grpc).await;
    let mut agent = Agent::start(agent_config(proxy.addr, &kv, &replay))
        .await
        .unwrap();
    attach(&agent, &base).await;

    traffic(&base, 0).await;
    assert!(!sim_blocks(&base).await.is_empty());
    converge("initial convergence", index.admin, &base, CONVERGE).await;

    // SIGKILL the index, restart it on the same port: the agent's snapshot alone must rebuild
    // the replica (no engine traffic) within 2 s of the restart.
    index.kill9();
    index = IndexProcess::start(dir.path(), &grpc.to_string()).await;
    let restarted = Instant::now();
    converge(
        "after index SIGKILL + restart",
        index.admin,
        &base,
        Duration::from_secs(2),
    )
    .await;
    eprintln!(
        "converged {:?} after the index restart",
        restarted.elapsed()
    );

    // Cut the agent↔index connection, keep the engine busy meanwhile.
    proxy.cut();
    traffic(&base, 1).await;
    converge("after a cut connection", index.admin, &base, CONVERGE).await;

    // AllBlocksCleared, then new traffic.
    let reset = http::post_json(&format!("{base}/reset_prefix_cache"), &json!({}))
        .await
        .unwrap();
    assert!(reset.status.is_success());
    converge("after AllBlocksCleared", index.admin, &base, CONVERGE).await;
    traffic(&base, 2).await;
    converge(
        "after traffic following the clear",
        index.admin,
        &base,
        CONVERGE,
    )
    .await;

    // Agent gone: the replica leaves precise scoring after the grace period...
    agent.shutdown().await;
    wait_until("replica flagged stale", CONVERGE, || async {
        let (state, problem) = replica_state(index.admin, "engine-a").await?;
        (state == "flagged" && problem == "stale").then_some(())
    })
    .await
    .unwrap();
    // ...and a restarted agent brings it back with a fresh snapshot.
    agent = Agent::start(agent_config(proxy.addr, &kv, &replay))
        .await
        .unwrap();
    attach(&agent, &base).await;
    traffic(&base, 3).await;
    converge("after an agent restart", index.admin, &base, CONVERGE).await;

    agent.shutdown().await;
    proxy.shutdown().await;
    index.guard.stop();
    sim.shutdown().await;
}

async fn metric(admin: SocketAddr, series: &str) -> u64 {
    let text = http::get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

fn hello(token: &str, replicas: &[&str]) -> api::AgentMessage {
    api::AgentMessage {
        body: Some(api::agent_message::Body::Hello(api::Hello {
            agent_id: "node-a".into(),
            token: token.into(),
            replicas: replicas.iter().map(|r| r.to_string()).collect(),
        })),
    }
}

fn snapshot(replica: &str, hashes: &[u64]) -> api::AgentMessage {
    let events = hashes
        .iter()
        .map(|&h| api::Event {
            kind: Some(api::event::Kind::Stored(api::BlockStored {
                block_hashes: vec![h],
                token_ids: vec![7; 32],
                block_size: 32,
                ..Default::default()
            })),
        })
        .collect();
    api::AgentMessage {
        body: Some(api::agent_message::Body::Snapshot(api::Snapshot {
            replica_id: replica.into(),
            first: true,
            last: true,
            events,
        })),
    }
}

#[tokio::test]
async fn wrong_tokens_unowned_replicas_and_garbage_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = index_yaml("127.0.0.1:0", dir.path()).replace(
        "hash_seed: \"0\"}",
        "hash_seed: \"0\", validate_hashes: false}",
    );
    let server = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let admin = server.admin_addr();
    let uri = format!("http://{}", server.grpc_addr());
    let mut client = AgentIngestClient::connect(uri.clone()).await.unwrap();

    // Wrong token: refused before anything is applied.
    let attempt = client
        .agent_stream(futures::stream::iter(vec![
            hello("wrong", &["engine-a"]),
            snapshot("engine-a", &[1]),
        ]))
        .await;
    assert_eq!(attempt.unwrap_err().code(), tonic::Code::Unauthenticated);
    assert_eq!(
        index_blocks(admin, "engine-a").await.unwrap(),
        BTreeSet::new()
    );

    // Right token; writes for engine-b (owned by node-b) and an absurd event are refused.
    let absurd = api::AgentMessage {
        body: Some(api::agent_message::Body::Delta(api::Delta {
            replica_id: "engine-a".into(),
            reset: false,
            events: vec![api::Event {
                kind: Some(api::event::Kind::Stored(api::BlockStored {
                    block_hashes: vec![9; 200_000],
                    block_size: 32,
                    ..Default::default()
                })),
            }],
        })),
    };
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    for message in [
        hello(TOKEN, &["engine-a", "engine-b"]),
        snapshot("engine-a", &[11, 12]),
        snapshot("engine-b", &[21]),
        absurd,
    ] {
        tx.send(message).await.unwrap();
    }
    let mut inbound = client
        .agent_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut reasons = Vec::new();
    while reasons.len() < 3 {
        let message = tokio::time::timeout(CONVERGE, inbound.message())
            .await
            .unwrap()
            .unwrap();
        match message.and_then(|m| m.body) {
            Some(api::index_message::Body::Welcome(w)) => assert_eq!(w.accepted, vec!["engine-a"]),
            Some(api::index_message::Body::Refused(r)) => reasons.push((r.replica_id, r.reason)),
            None => panic!("stream ended early"),
        }
    }
    assert_eq!(
        reasons,
        [
            ("engine-b".to_owned(), "not_owner".to_owned()),
            ("engine-b".to_owned(), "not_owner".to_owned()),
            ("engine-a".to_owned(), "invalid_event".to_owned()),
        ]
    );
    assert_eq!(
        index_blocks(admin, "engine-a").await.unwrap(),
        BTreeSet::from([11, 12])
    );
    assert_eq!(
        index_blocks(admin, "engine-b").await.unwrap(),
        BTreeSet::new()
    );
    drop(tx);

    // Garbage on the gRPC port: the connection is dropped, the server keeps serving.
    let mut raw = TcpStream::connect(server.grpc_addr()).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut raw, b"\x00\xffthis is not http/2 at all\r\n\r\n")
        .await
        .unwrap();
    drop(raw);

    assert_eq!(
        metric(
            admin,
            "kvroute_index_agent_refused_total{reason=\"unauthenticated\"}"
        )
        .await,
        1
    );
    assert_eq!(
        metric(
            admin,
            "kvroute_index_agent_refused_total{reason=\"not_owner\"}"
        )
        .await,
        2
    );
    assert_eq!(
        metric(
            admin,
            "kvroute_index_agent_refused_total{reason=\"invalid_event\"}"
        )
        .await,
        1
    );
    let mut again = AgentIngestClient::connect(uri).await.unwrap();
    let refused = again
        .agent_stream(futures::stream::iter(vec![hello("nope", &[])]))
        .await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::Unauthenticated);
    server.shutdown().await;
}
