//! kvroute-agent ↔ kvroute-index over real sockets: an in-process engine simulator publishes
//! KV events, an in-process agent mirrors them and streams to a `kvroute-index` *process*
//! through a TCP proxy the test can cut. After every fault the index's blocks for the replica
//! must equal the simulator's own `/debug/blocks`.
//!
//! The index binary must be built (`cargo build -p kvroute-index --bins`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute_agent::{Agent, AgentConfig};
use kvroute_index::config::Config;
use kvroute_index::server::IndexServer;
use kvroute_index_api::api::{self, agent_ingest_client::AgentIngestClient};
use kvroute_index_core::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{Encoding, encode_batch};
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{TcpProxy, http, metrics};
use kvroute_tests::stack::ServerProcess;
use serde_json::{Value, json};
use tokio::net::TcpStream;

use super::common::{self, start_sim};

const TOKEN: &str = "agent-a-secret";
/// How long a test waits for the index or the agent to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(10))
}

fn index_yaml(grpc: &str, token_dir: &Path) -> String {
    let token_a = token_dir.join("a");
    let token_b = token_dir.join("b");
    std::fs::write(&token_a, format!("{TOKEN}\n")).unwrap();
    std::fs::write(&token_b, "other-secret").unwrap();
    format!(
        r#"
listen: {{grpc: "{grpc}", admin: "127.0.0.1:0"}}
limits: {{agent_stale_grace: 300ms}}
pools:
  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}}}
replicas:
  - {{id: engine-a, pool: tiny}}
  - {{id: engine-b, pool: tiny}}
agents:
  - {{id: node-a, token_file: "{}", replicas: [engine-a]}}
  - {{id: node-b, token_file: "{}", replicas: [engine-b]}}
"#,
        token_a.display(),
        token_b.display()
    )
}

/// [`index_yaml`] for tests whose blocks are synthetic hashes, not vLLM's: hash validation off.
fn index_yaml_synthetic_hashes(grpc: &str, token_dir: &Path) -> String {
    index_yaml(grpc, token_dir).replace("seed: \"0\"}}", "seed: \"0\"}, verify_hashes: off}")
}

fn agent_config(index: SocketAddr, kv_events: &str, replay: &str) -> AgentConfig {
    let yaml = format!(
        r#"
agent_id: node-a
token_env: UNUSED
indexes: ["http://{index}"]
admin: 127.0.0.1:0
batch_delay: 10ms
reconnect_backoff_max: 200ms
engines:
  - {{replica: engine-a, endpoint: "{kv_events}", replay_endpoint: "{replay}"}}
"#
    );
    let raw = serde_yaml::from_str(&yaml).unwrap();
    AgentConfig::validate(raw, kvroute_runtime::token::AgentToken::from_literal(TOKEN)).unwrap()
}

/// A `kvroute-index` process, restartable on the same ports; it returns once listening (its
/// replicas become ready as the tests' agents connect).
pub(super) async fn index_process(yaml: &str) -> ServerProcess {
    ServerProcess::start_index_listening(yaml, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The hashes a sim holds; the sim is local and up, so failing to read it is a test failure.
async fn sim_blocks(base: &str) -> BTreeSet<u64> {
    common::sim_blocks(base).await.unwrap()
}

pub(super) async fn index_blocks(admin: SocketAddr, replica: &str) -> Option<BTreeSet<u64>> {
    common::index_blocks(&format!("http://{admin}"), replica).await
}

pub(super) async fn replica_state(admin: SocketAddr, replica: &str) -> Option<(String, String)> {
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
    let result = try_poll_until(what, within, || async {
        let expected = sim_blocks(sim).await;
        let held = index_blocks(admin, "engine-a").await?;
        let (state, _) = replica_state(admin, "engine-a").await?;
        (held == expected && state == "ready").then_some(())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_converges_to_the_engine_after_every_fault() {
    let dir = tempfile::tempdir().unwrap();
    let sim = start_sim(&[]).await;
    let base = sim.base_url();
    let kv = sim.ready_info().kv_events.clone().unwrap();
    let replay = sim.ready_info().replay.clone().unwrap();

    let mut index = index_process(&index_yaml("127.0.0.1:0", dir.path())).await;
    let grpc = index.grpc();
    let proxy = TcpProxy::start(grpc).await.unwrap();
    // The engine is busy before the agent exists: the agent catches up from its replay buffer.
    traffic(&base, 0).await;
    let mut agent = Agent::start(agent_config(proxy.addr(), &kv, &replay))
        .await
        .unwrap();
    assert!(!sim_blocks(&base).await.is_empty());
    converge("initial convergence", index.admin(), &base, within()).await;

    // SIGKILL the index, restart it on the same port: the agent's snapshot alone must rebuild
    // the replica (no engine traffic) within 2 s of the restart.
    index.kill();
    index.restart().await.unwrap();
    let restarted = Instant::now();
    converge(
        "after index SIGKILL + restart",
        index.admin(),
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
    converge("after a cut connection", index.admin(), &base, within()).await;

    // AllBlocksCleared, then new traffic.
    let reset = http::post_json(&format!("{base}/reset_prefix_cache"), &json!({}))
        .await
        .unwrap();
    assert!(reset.status.is_success());
    converge("after AllBlocksCleared", index.admin(), &base, within()).await;
    traffic(&base, 2).await;
    converge(
        "after traffic following the clear",
        index.admin(),
        &base,
        within(),
    )
    .await;

    // Agent gone: the replica leaves precise scoring after the grace period...
    agent.shutdown().await;
    poll_until("replica stale", within(), || async {
        let (state, problem) = replica_state(index.admin(), "engine-a").await?;
        (state == "stale" && problem == "agent not connected past its grace period").then_some(())
    })
    .await;
    // ...the engine keeps working meanwhile, and a restarted agent brings the replica back with
    // everything the engine stored, before and while it was down, with no new engine traffic.
    traffic(&base, 3).await;
    agent = Agent::start(agent_config(proxy.addr(), &kv, &replay))
        .await
        .unwrap();
    converge("after an agent restart", index.admin(), &base, within()).await;
    traffic(&base, 4).await;
    converge(
        "after traffic following the agent restart",
        index.admin(),
        &base,
        within(),
    )
    .await;

    agent.shutdown().await;
    proxy.shutdown().await;
    drop(index);
    sim.shutdown().await;
}

pub(super) async fn metric(admin: SocketAddr, series: &str) -> u64 {
    let text = http::get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    metrics::sample(&text, series).unwrap_or(0.0) as u64
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
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path());
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
        let message = tokio::time::timeout(within(), inbound.message())
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
    // /v1/replicas reports agent-fed replicas from their stream, not as unconfigured.
    assert_eq!(
        replica_state(admin, "engine-a").await.unwrap(),
        ("ready".to_owned(), String::new())
    );
    // engine-b's agent never streamed it: never connected, or stale once this file's short
    // `agent_stale_grace` (300 ms) has passed on a slow machine; never ready or unconfigured.
    let (state, _) = replica_state(admin, "engine-b").await.unwrap();
    assert!(
        state == "never_connected" || state == "stale",
        "engine-b reported {state}"
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

/// An open agent stream: the sender keeps it open, the receiver reads the index's answers.
struct OpenStream {
    tx: tokio::sync::mpsc::Sender<api::AgentMessage>,
    inbound: tonic::Streaming<api::IndexMessage>,
}

impl OpenStream {
    async fn open(uri: &str, hello: api::AgentMessage) -> Result<Self, tonic::Status> {
        let mut client = AgentIngestClient::connect(uri.to_owned())
            .await
            .unwrap()
            .max_encoding_message_size(kvroute_index_api::agent_protocol::MAX_MESSAGE_BYTES);
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tx.send(hello).await.unwrap();
        let inbound = client
            .agent_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Self { tx, inbound })
    }

    async fn next(&mut self) -> api::index_message::Body {
        tokio::time::timeout(within(), self.inbound.message())
            .await
            .expect("the index answers")
            .expect("the stream is up")
            .and_then(|m| m.body)
            .expect("a message with a body")
    }
}

/// Found by hostile-peer testing: a `Hello` claiming a million replicas queued a million
/// refusals (the per-stream cap did not apply to the `Hello` loop), and an agent could open any
/// number of streams.
#[tokio::test]
async fn hello_claims_refusals_and_streams_per_agent_are_capped() {
    use kvroute_index::server::{MAX_QUEUED_REFUSALS, MAX_STREAMS_PER_AGENT};
    use kvroute_index_api::agent_protocol::MAX_REPLICAS_PER_HELLO;

    let dir = tempfile::tempdir().unwrap();
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path());
    let server = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let admin = server.admin_addr();
    let uri = format!("http://{}", server.grpc_addr());
    let refused = |reason: &str| {
        let series = format!("kvroute_index_agent_refused_total{{reason=\"{reason}\"}}");
        async move { metric(admin, &series).await }
    };

    // A million claimed replicas: refused whole, once, before anything is queued or applied.
    let names: Vec<String> = (0..1_000_000).map(|i| format!("r{i}")).collect();
    let million: Vec<&str> = names.iter().map(String::as_str).collect();
    let status = OpenStream::open(&uri, hello(TOKEN, &million))
        .await
        .err()
        .expect("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert_eq!(refused("too_many_replicas").await, 1);
    assert_eq!(refused("not_owner").await, 0);

    // Within the cap, but mostly unowned (and one name repeated): every distinct name counted,
    // at most MAX_QUEUED_REFUSALS of them answered, and the stream goes on for engine-a.
    let mut claims: Vec<&str> = vec!["engine-a"];
    claims.extend(million[..MAX_REPLICAS_PER_HELLO - 201].iter().copied());
    claims.extend(std::iter::repeat_n("ghost", 200));
    assert_eq!(claims.len(), MAX_REPLICAS_PER_HELLO);
    let mut first = OpenStream::open(&uri, hello(TOKEN, &claims)).await.unwrap();
    let api::index_message::Body::Welcome(welcome) = first.next().await else {
        panic!("expected Welcome first");
    };
    assert_eq!(welcome.accepted, ["engine-a"]);
    for _ in 0..MAX_QUEUED_REFUSALS {
        let api::index_message::Body::Refused(r) = first.next().await else {
            panic!("expected a refusal");
        };
        assert_eq!(r.reason, "not_owner");
    }
    // A marker: a delta before any snapshot. The next answer is its refusal, not another
    // of the Hello's.
    first
        .tx
        .send(api::AgentMessage {
            body: Some(api::agent_message::Body::Delta(api::Delta {
                replica_id: "engine-a".into(),
                reset: false,
                events: Vec::new(),
            })),
        })
        .await
        .unwrap();
    let api::index_message::Body::Refused(marker) = first.next().await else {
        panic!("expected the marker's refusal");
    };
    assert_eq!(
        (marker.replica_id.as_str(), marker.reason.as_str()),
        ("engine-a", "no_snapshot")
    );
    assert_eq!(
        refused("not_owner").await,
        (MAX_REPLICAS_PER_HELLO - 201 + 1) as u64
    );
    first.tx.send(snapshot("engine-a", &[5])).await.unwrap();
    poll_until("engine-a's snapshot applied", within(), || async {
        (index_blocks(admin, "engine-a").await? == BTreeSet::from([5])).then_some(())
    })
    .await;

    // Streams per agent: the first is open; fill the rest, then one more is refused.
    let mut open = vec![first];
    while open.len() < MAX_STREAMS_PER_AGENT {
        let mut stream = OpenStream::open(&uri, hello(TOKEN, &["engine-a"]))
            .await
            .unwrap();
        assert!(matches!(
            stream.next().await,
            api::index_message::Body::Welcome(_)
        ));
        open.push(stream);
    }
    let status = OpenStream::open(&uri, hello(TOKEN, &["engine-a"]))
        .await
        .err()
        .expect("refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(refused("too_many_streams").await, 1);
    // Another agent is not affected.
    let api::index_message::Body::Welcome(_) = OpenStream::open(&uri, {
        let mut other = hello("other-secret", &["engine-b"]);
        if let Some(api::agent_message::Body::Hello(h)) = &mut other.body {
            h.agent_id = "node-b".into();
        }
        other
    })
    .await
    .unwrap()
    .next()
    .await
    else {
        panic!("node-b welcomed");
    };
    // A stream that ends frees its slot.
    drop(open.pop());
    poll_until("a slot freed", within(), || async {
        let mut stream = OpenStream::open(&uri, hello(TOKEN, &["engine-a"]))
            .await
            .ok()?;
        matches!(stream.next().await, api::index_message::Body::Welcome(_)).then_some(stream)
    })
    .await;
    drop(open);
    server.shutdown().await;
}

/// An engine played by [`MockVllmPublisher`], with the block set its events imply.
struct ModelEngine {
    publisher: MockVllmPublisher,
    blocks: BTreeSet<u64>,
}

/// An agent's stream that stays open must not hold the index's shutdown until the drain timeout:
/// the index ends it with UNAVAILABLE (the agent reconnects, elsewhere if it can).
#[tokio::test]
async fn shutdown_ends_open_agent_streams_with_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path());
    let server = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let mut client = AgentIngestClient::connect(format!("http://{}", server.grpc_addr()))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(hello(TOKEN, &["engine-a"])).await.unwrap();
    let mut inbound = client
        .agent_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let welcome = tokio::time::timeout(within(), inbound.message())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        welcome.and_then(|m| m.body),
        Some(api::index_message::Body::Welcome(_))
    ));

    // `tx` stays alive: the agent has more to say. Shutting down ends the stream from the index's
    // side with a status (a drain that timed out would instead drop the connection under it).
    let (shut_down, closing) = tokio::join!(
        tokio::time::timeout(within(), server.shutdown()),
        tokio::time::timeout(within(), inbound.message()),
    );
    shut_down.expect("shutdown returns");
    let status = closing
        .expect("the stream ends")
        .expect_err("ended by a status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(status.message(), "kvroute-index is shutting down");
    drop(tx);
}

pub(super) fn stored(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        token_ids: vec![7; 32 * hashes.len()],
        block_size: 32,
        medium: Medium::Gpu,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
        group_idx: None,
    })
}

pub(super) fn payload(event: KvEvent) -> Vec<u8> {
    encode_batch(
        &EventBatch {
            ts: 1.0,
            dp_rank: Some(0),
            events: vec![event],
        },
        Encoding::V0_32,
    )
}

impl ModelEngine {
    fn track(&mut self, event: &KvEvent) {
        match event {
            KvEvent::BlockStored(s) => self.blocks.extend(&s.block_hashes),
            KvEvent::BlockRemoved(r) => {
                for hash in &r.block_hashes {
                    self.blocks.remove(hash);
                }
            }
            KvEvent::AllBlocksCleared => self.blocks.clear(),
        }
    }

    /// Sent live.
    async fn publish(&mut self, event: KvEvent) {
        self.track(&event);
        self.publisher.publish(payload(event)).await.unwrap();
    }

    /// Kept in the replay buffer but never sent live: a dropped message.
    async fn drop_live(&mut self, event: KvEvent) {
        self.track(&event);
        self.publisher.skip_seq(payload(event)).await;
    }

    /// The engine restarted: empty cache, sequence from 0, empty replay buffer.
    async fn restart(&mut self) {
        self.publisher.restart().await;
        self.blocks.clear();
    }
}

/// Sum of a metric family's series whose labels contain `label`.
async fn metric_sum(admin: SocketAddr, family: &str, label: &str) -> u64 {
    let text = http::get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text();
    metrics::sum(&text, family, &[label]) as u64
}

async fn converge_to_model(what: &str, admin: SocketAddr, engine: &ModelEngine) {
    let expected = engine.blocks.clone();
    let result = try_poll_until(what, within(), || async {
        let held = index_blocks(admin, "engine-a").await?;
        let (state, _) = replica_state(admin, "engine-a").await?;
        (held == expected && state == "ready").then_some(())
    })
    .await;
    if let Err(error) = result {
        panic!(
            "{error}: engine {expected:?} vs index {:?} ({:?})",
            index_blocks(admin, "engine-a").await,
            replica_state(admin, "engine-a").await
        );
    }
}

/// Engine-side faults seen through the agent: messages dropped and repaired by replay, a gap
/// beyond the replay window (mirror reset, rebuilt from what follows), an engine restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_repairs_gaps_and_resets_on_window_overflow_and_engine_restart() {
    const BUFFER_STEPS: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path());
    let server = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let admin = server.admin_addr();
    let publisher = MockVllmPublisher::start(MockPublisherConfig {
        buffer_steps: BUFFER_STEPS,
        ..MockPublisherConfig::loopback()
    })
    .await
    .unwrap();
    let kv = publisher.pub_endpoint().unwrap().to_owned();
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let mut engine = ModelEngine {
        publisher,
        blocks: BTreeSet::new(),
    };
    let agent = Agent::start(agent_config(server.grpc_addr(), &kv, &replay))
        .await
        .unwrap();
    let agent_admin = agent.admin_addr();

    // Wait out the ZMQ subscription handshake with an idempotent clear (a repeated store would
    // be several copies of one block: the index counts them, as vLLM does).
    let mut attempts = 0;
    loop {
        engine.publish(KvEvent::AllBlocksCleared).await;
        let received = metric_sum(
            agent_admin,
            "kvroute_agent_ingest_messages_received_total",
            "",
        )
        .await;
        if received > 0 {
            break;
        }
        attempts += 1;
        assert!(attempts < 200, "the agent never received an event");
        tokio::time::sleep(Duration::from_millis(50)).await; // publish interval, not a synchronisation
    }
    for hash in 1..=8 {
        engine.publish(stored(&[hash])).await;
    }
    converge_to_model("baseline", admin, &engine).await;

    // Dropped live messages (within the replay window) are repaired by replay.
    engine.drop_live(stored(&[10, 11])).await;
    engine.drop_live(removed(&[1])).await;
    engine.publish(stored(&[12])).await;
    converge_to_model("after dropped messages", admin, &engine).await;
    assert!(
        metric_sum(
            agent_admin,
            "kvroute_agent_ingest_replays_total",
            "outcome=\"ok\""
        )
        .await
            >= 1
    );
    assert_eq!(
        metric_sum(agent_admin, "kvroute_agent_ingest_resets_total", "").await,
        0
    );

    // More dropped messages than the replay buffer holds: the agent resets the replica rather
    // than keep blocks the engine evicted meanwhile, and rebuilds from what follows.
    let evicted: Vec<u64> = engine.blocks.iter().copied().collect();
    assert!(evicted.len() > BUFFER_STEPS);
    for hash in evicted {
        engine.drop_live(removed(&[hash])).await;
    }
    engine.publish(stored(&[30, 31])).await;
    converge_to_model("after the replay window was exceeded", admin, &engine).await;
    assert_eq!(
        metric_sum(
            agent_admin,
            "kvroute_agent_ingest_resets_total",
            "reason=\"gap_unrecoverable\""
        )
        .await,
        1
    );
    engine.publish(stored(&[32])).await;
    converge_to_model("rebuilt after the reset", admin, &engine).await;

    // Engine restart: sequence back to 0, cache empty.
    engine.restart().await;
    engine.publish(stored(&[40])).await;
    engine.publish(stored(&[41, 42])).await;
    converge_to_model("after an engine restart", admin, &engine).await;
    assert_eq!(
        metric_sum(
            agent_admin,
            "kvroute_agent_ingest_resets_total",
            "reason=\"engine_restart\""
        )
        .await,
        1
    );

    agent.shutdown().await;
    engine.publisher.shutdown().await;
    server.shutdown().await;
}

/// A CA and a `localhost` / 127.0.0.1 server certificate it signs, as PEM files in `dir`.
struct TestPki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn test_pki(dir: &Path) -> TestPki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let pki = TestPki {
        ca: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server-key.pem"),
    };
    std::fs::write(&pki.ca, ca_cert.pem()).unwrap();
    std::fs::write(&pki.cert, server_cert.pem()).unwrap();
    std::fs::write(&pki.key, server_key.serialize_pem()).unwrap();
    pki
}

/// TLS on the index's gRPC listener: the agent streams over it, a Match over it (through
/// kvroute-ext-proc's index client) sees the streamed blocks, and a plaintext client gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_stream_and_match_work_over_tls_and_plaintext_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = test_pki(dir.path());
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path()).replace(
        "admin: \"127.0.0.1:0\"}",
        &format!(
            "admin: \"127.0.0.1:0\", tls: {{cert: \"{}\", key: \"{}\"}}}}",
            pki.cert.display(),
            pki.key.display()
        ),
    );
    let server = IndexServer::start(Config::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    let admin = server.admin_addr();
    let grpc = server.grpc_addr();

    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let kv = publisher.pub_endpoint().unwrap().to_owned();
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let mut engine = ModelEngine {
        publisher,
        blocks: BTreeSet::new(),
    };
    let tls_yaml = format!(
        "tls: {{ca: \"{}\", server_name: localhost}}\n",
        pki.ca.display()
    );
    let raw: kvroute_agent::config::RawAgentConfig = serde_yaml::from_str(&format!(
        "agent_id: node-a\nindexes: [\"https://{grpc}\"]\nadmin: 127.0.0.1:0\nbatch_delay: 10ms\n\
         engines: [{{replica: engine-a, endpoint: \"{kv}\", replay_endpoint: \"{replay}\"}}]\n{tls_yaml}"
    ))
    .unwrap();
    let agent_config =
        AgentConfig::validate(raw, kvroute_runtime::token::AgentToken::from_literal(TOKEN))
            .unwrap();
    assert!(agent_config.tls.is_some());
    let agent = Agent::start(agent_config).await.unwrap();

    // The agent's stream is the only way blocks reach engine-a: seeing them proves it works.
    let mut attempts = 0;
    while agent
        .hub()
        .block_hashes("engine-a")
        .unwrap_or_default()
        .is_empty()
    {
        engine.publish(stored(&[1, 2, 3])).await;
        attempts += 1;
        assert!(attempts < 200, "the agent never received an event");
        tokio::time::sleep(Duration::from_millis(50)).await; // publish interval, not a synchronisation
    }
    converge_to_model("agent stream over TLS", admin, &engine).await;

    // Match over TLS, with kvroute-ext-proc's own index client and TLS settings.
    let client_tls: kvroute_config::RawClientTls = serde_yaml::from_str(&format!(
        "{{ca: \"{}\", server_name: localhost}}",
        pki.ca.display()
    ))
    .unwrap();
    let client_tls = kvroute_runtime::tls::ClientTls::load(&client_tls, "index.tls").unwrap();
    let https: hyper::Uri = format!("https://{grpc}").parse().unwrap();
    let request = api::MatchRequest {
        model: "tiny".into(),
        block_size: 32,
        keys: vec![1, 2, 3],
        ..Default::default()
    };
    let deadline = || Instant::now() + Duration::from_secs(5);
    let index = kvroute_ext_proc::index_client::IndexClient::new(
        std::slice::from_ref(&https),
        Duration::from_millis(10),
        Some(&client_tls),
    );
    let answer = index
        .match_prefix(request.clone(), deadline())
        .await
        .unwrap();
    let engine_a = answer
        .replicas
        .iter()
        .find(|r| r.replica_id == "engine-a")
        .unwrap();
    assert_eq!(engine_a.matched_blocks, 3);

    // Plaintext to the TLS port: refused (the handshake never completes), for Match and for
    // an agent stream alike; the index keeps serving TLS clients.
    let http_uri: hyper::Uri = format!("http://{grpc}").parse().unwrap();
    let plaintext = kvroute_ext_proc::index_client::IndexClient::new(
        std::slice::from_ref(&http_uri),
        Duration::from_millis(10),
        None,
    );
    let refused = plaintext
        .match_prefix(request.clone(), Instant::now() + Duration::from_secs(2))
        .await;
    assert!(refused.is_err(), "plaintext Match answered: {refused:?}");
    let plain_agent = match AgentIngestClient::connect(format!("http://{grpc}")).await {
        Ok(mut client) => client
            .agent_stream(futures::stream::iter(vec![
                hello(TOKEN, &["engine-a"]),
                snapshot("engine-a", &[99]),
            ]))
            .await
            .map(|_| ())
            .map_err(|status| status.to_string()),
        Err(error) => Err(error.to_string()),
    };
    assert!(plain_agent.is_err(), "plaintext agent stream accepted");
    assert_eq!(
        index_blocks(admin, "engine-a").await.unwrap(),
        BTreeSet::from([1, 2, 3])
    );
    assert!(index.match_prefix(request, deadline()).await.is_ok());

    agent.shutdown().await;
    engine.publisher.shutdown().await;
    server.shutdown().await;
}

#[test]
fn tls_config_errors_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let missing = index_yaml("127.0.0.1:0", dir.path()).replace(
        "admin: \"127.0.0.1:0\"}",
        "admin: \"127.0.0.1:0\", tls: {cert: /nonexistent/cert.pem, key: /nonexistent/key.pem}}",
    );
    let error = Config::from_yaml(&missing).unwrap_err().to_string();
    assert!(error.contains("listen.tls.cert"), "{error}");

    // An agent with `tls` but an http:// index address would silently speak plaintext.
    let pki = test_pki(dir.path());
    let yaml = format!(
        "agent_id: a\nindexes: [\"http://127.0.0.1:1\"]\ntls: {{ca: \"{}\"}}\n\
         engines: [{{replica: r, endpoint: \"tcp://127.0.0.1:5557\"}}]",
        pki.ca.display()
    );
    let error = AgentConfig::validate(
        serde_yaml::from_str(&yaml).unwrap(),
        kvroute_runtime::token::AgentToken::from_literal("t"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("indexes[0]") && error.contains("https"),
        "{error}"
    );
}

async fn held_block_count(admin: SocketAddr) -> Option<u64> {
    let body: Value = http::get(&format!("http://{admin}/v1/replicas"))
        .await
        .ok()?
        .json()
        .ok()?;
    body.as_array()?.iter().find(|r| r["id"] == "engine-a")?["blocks"].as_u64()
}

/// BENCHMARKS.md "Agent event plane". Release mode only:
/// `cargo test --release -p kvroute-tests --test integration agent_path_benchmark -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run in release mode with --ignored --nocapture"]
async fn agent_path_benchmark() {
    const BLOCKS: u64 = 1_000_000;
    const BLOCKS_PER_BATCH: u64 = 64;
    /// Batches published before waiting for the index: keeps the PUB socket under its
    /// high-water mark, so the figure is sustained throughput, not a burst into drops.
    const WINDOW: u64 = 256;
    let slow = deadline(Duration::from_secs(120));
    let dir = tempfile::tempdir().unwrap();
    let yaml = index_yaml_synthetic_hashes("127.0.0.1:0", dir.path());
    // A process, so the restart below is a real SIGKILL (the agent's stream breaks at once).
    let mut index = index_process(&yaml).await;
    let grpc = index.grpc();
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let kv = publisher.pub_endpoint().unwrap().to_owned();
    let replay = publisher.replay_endpoint().unwrap().to_owned();
    let agent = Agent::start(agent_config(grpc, &kv, &replay))
        .await
        .unwrap();
    // Subscription handshake: block 0 published until mirrored.
    while agent
        .hub()
        .block_hashes("engine-a")
        .unwrap_or_default()
        .is_empty()
    {
        publisher.publish(payload(stored(&[0]))).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await; // publish interval
    }
    let admin = index.admin();
    poll_until("block 0 indexed", slow, || async {
        (held_block_count(admin).await? == 1).then_some(())
    })
    .await;

    // 1. Events per second, engine PUB → agent mirror → gRPC stream → index, end to end.
    let started = Instant::now();
    let mut next = 1;
    while next < BLOCKS {
        for _ in 0..WINDOW {
            if next >= BLOCKS {
                break;
            }
            let end = (next + BLOCKS_PER_BATCH).min(BLOCKS);
            let hashes: Vec<u64> = (next..end).collect();
            publisher.publish(payload(stored(&hashes))).await.unwrap();
            next = end;
        }
        let expected = next;
        poll_until("index caught up", slow, || async {
            (held_block_count(admin).await? >= expected).then_some(())
        })
        .await;
    }
    let elapsed = started.elapsed();
    let batches = (BLOCKS - 1).div_ceil(BLOCKS_PER_BATCH);
    eprintln!(
        "agent path: {} blocks in {batches} batches in {elapsed:.2?}: {:.0} block events/s, {:.0} batches/s",
        BLOCKS - 1,
        (BLOCKS - 1) as f64 / elapsed.as_secs_f64(),
        batches as f64 / elapsed.as_secs_f64()
    );

    // 2. Snapshot of 1M blocks: size on the wire and time to build it.
    let started = Instant::now();
    let kvroute_agent::hub::Subscription {
        snapshot, deltas, ..
    } = agent.hub().subscribe();
    let built = started.elapsed();
    drop(deltas);
    let bytes: usize = snapshot
        .iter()
        .map(prost::Message::encoded_len)
        .sum::<usize>();
    eprintln!(
        "snapshot: {BLOCKS} blocks, {} messages, {:.1} MiB encoded ({:.1} B/block, 32 token ids each), built in {built:.2?}",
        snapshot.len(),
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / BLOCKS as f64
    );

    // 3. Index SIGKILLed and restarted on the same port: converges from the agent's snapshot
    // (timed from the restart command: process start, reconnect, transfer, apply).
    index.kill();
    let started = Instant::now();
    index.restart().await.unwrap();
    let admin = index.admin();
    poll_until("restarted index holds every block", slow, || async {
        (held_block_count(admin).await? == BLOCKS).then_some(())
    })
    .await;
    eprintln!(
        "index restart: {BLOCKS} blocks back in {:.2?} (reconnect + snapshot transfer + apply)",
        started.elapsed()
    );

    agent.shutdown().await;
    publisher.shutdown().await;
    drop(index);
}
