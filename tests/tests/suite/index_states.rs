//! kvroute-index answers only what it can vouch for, through its own API (gRPC `Match` and
//! health, admin `/v1/match`, `/v1/replicas`, `/readyz`): a replica whose stream never
//! connected, went stale, disconnected, or is misconfigured is not precise; readiness and gRPC
//! health follow the replicas; an engine restarted idle (no traffic, an empty replay buffer) is
//! detected on reconnect and trusted again, with 0 blocks, within a bound measured here.
//!
//! The engines are the test-util publisher (vLLM's wire format on real ZMQ PUB + replay ROUTER
//! sockets); the index runs in process on port 0.

use std::time::{Duration, Instant};

use kvroute_index::config::Config;
use kvroute_index::server::IndexServer;
use kvroute_index_api::api::{
    self, MatchRequest, ReplicaCondition, kv_index_client::KvIndexClient,
};
use kvroute_index_core::event::{
    BlockRemoved, BlockStored, CacheKind, EventBatch, KvEvent, Medium,
};
use kvroute_index_core::wire::{Encoding, encode_batch};
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{http, reserve_port};
use serde_json::{Value, json};
use tonic_health::pb::health_check_response::ServingStatus;

use super::common::until_received_live;

const MODEL: &str = "m";
const BLOCK_SIZE: u32 = 4;
const HASHES: [u64; 3] = [0xA1, 0xA2, 0xA3];
/// How long a test waits for the index to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(20))
}

/// A `BlockStored` batch of `hashes` chained from the root, as vLLM 0.32 publishes it.
fn stored_payload(hashes: &[u64], block_size: u32) -> Vec<u8> {
    let batch = EventBatch {
        ts: 0.0,
        dp_rank: Some(0),
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: None,
            token_ids: (0..hashes.len() as u32 * block_size).collect(),
            block_size,
            lora_id: None,
            lora_name: None,
            medium: Medium::Gpu,
            extra_keys: None,
            group_idx: None,
            block_digests: None,
            parent_digest: None,
            ..BlockStored::default()
        })],
    };
    encode_batch(&batch, Encoding::V0_32)
}

/// One pool (hashes are the keys, not verified: the test picks them) and `replicas` (YAML list
/// items), plus `extra` top-level YAML.
fn config(replicas: &str, extra: &str) -> Config {
    Config::from_yaml(&format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: {MODEL}, models: [{MODEL}], block_size: {BLOCK_SIZE}, key_scheme: {{kind: vllm-exact}}, verify_hashes: "off"}}
replicas:
{replicas}
{extra}
"#
    ))
    .expect("valid index config")
}

fn zmq_replica(id: &str, publisher: &MockVllmPublisher) -> String {
    format!(
        "  - {{id: {id}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\"}}}}\n",
        publisher.pub_endpoint().unwrap(),
        publisher.replay_endpoint().unwrap()
    )
}

/// An endpoint nothing listens on (a reserved port nothing binds).
fn dead_endpoint() -> String {
    format!("tcp://127.0.0.1:{}", reserve_port().unwrap())
}

async fn grpc_match(server: &IndexServer, replica: &str) -> api::ReplicaMatch {
    let mut client = KvIndexClient::connect(format!("http://{}", server.grpc_addr()))
        .await
        .unwrap();
    let response = client
        .r#match(MatchRequest {
            model: MODEL.into(),
            block_size: BLOCK_SIZE,
            keys: HASHES.to_vec(),
            ..MatchRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    response
        .replicas
        .into_iter()
        .find(|m| m.replica_id == replica)
        .unwrap()
}

async fn admin_match(server: &IndexServer, replica: &str) -> Value {
    let url = format!("http://{}/v1/match", server.admin_addr());
    let body = http::post_json(&url, &json!({"model": MODEL, "prompt_keys": HASHES}))
        .await
        .unwrap()
        .json()
        .unwrap();
    body["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == replica)
        .cloned()
        .unwrap()
}

async fn admin_replica(server: &IndexServer, replica: &str) -> Value {
    let url = format!("http://{}/v1/replicas", server.admin_addr());
    let body = http::get(&url).await.unwrap().json().unwrap();
    body.as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == replica)
        .cloned()
        .unwrap()
}

async fn readyz(server: &IndexServer) -> (u16, String) {
    let response = http::get(&format!("http://{}/readyz", server.admin_addr()))
        .await
        .unwrap();
    (response.status.as_u16(), response.text())
}

async fn health(server: &IndexServer, service: &str) -> ServingStatus {
    kvroute_tests::harness::health::check(&format!("http://{}", server.grpc_addr()), service)
        .await
        .unwrap()
}

/// Waits until gRPC `Match` reports `replica` in `state` (returns the answer).
async fn wait_for_state(
    server: &IndexServer,
    replica: &str,
    state: ReplicaCondition,
) -> api::ReplicaMatch {
    poll_until(&format!("{replica} {state:?}"), within(), || async {
        let found = grpc_match(server, replica).await;
        (found.state() == state).then_some(found)
    })
    .await
}

/// Both APIs agree a replica is not precise, in `state` for `reason`, with nothing matched.
async fn assert_not_precise(server: &IndexServer, replica: &str, state: &str, reason: &str) {
    let grpc = grpc_match(server, replica).await;
    assert!(!grpc.precise, "{grpc:?}");
    assert_eq!((grpc.matched_blocks, grpc.reason.as_str()), (0, reason));
    let admin = admin_match(server, replica).await;
    assert_eq!(admin["precise"], false, "{admin}");
    assert_eq!(admin["state"], state, "{admin}");
    assert_eq!(admin["matched_blocks"], 0, "{admin}");
    assert_eq!(admin_replica(server, replica).await["state"], state);
}

#[tokio::test]
async fn a_never_connected_replica_is_not_precise_and_its_pool_not_ready() {
    let server = IndexServer::start(config(
        &format!(
            "  - {{id: lost, pool: {MODEL}, events: {{endpoint: \"{}\"}}}}\n",
            dead_endpoint()
        ),
        "",
    ))
    .await
    .unwrap();
    assert_eq!(
        grpc_match(&server, "lost").await.state(),
        ReplicaCondition::NeverConnected
    );
    assert_not_precise(&server, "lost", "never_connected", "never_connected").await;
    let replica = admin_replica(&server, "lost").await;
    assert!(replica.get("last_sequence").is_none(), "{replica}");
    let (status, body) = readyz(&server).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("pool m: not ready: 0/1 replicas ready, 1 required (lost never_connected)"),
        "{body}"
    );
    assert_eq!(health(&server, "").await, ServingStatus::NotServing);
    assert_eq!(
        health(&server, "kvroute.index.v1.KvIndex").await,
        ServingStatus::NotServing
    );
    server.shutdown().await;
}

#[tokio::test]
async fn an_agent_replica_whose_agent_never_came_goes_stale() {
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), "secret-token-of-the-agent").unwrap();
    let server = IndexServer::start(config(
        &format!("  - {{id: remote, pool: {MODEL}}}\n"),
        &format!(
            "agents:\n  - {{id: node-a, token_file: \"{}\", replicas: [remote]}}\nlimits: {{agent_stale_grace: 200ms}}\nreadiness: {{min_ready_replicas: 0}}",
            token.path().display()
        ),
    ))
    .await
    .unwrap();
    wait_for_state(&server, "remote", ReplicaCondition::Stale).await;
    assert_not_precise(&server, "remote", "stale", "stale").await;
    // min_ready_replicas 0: the pool needs none.
    assert_eq!(readyz(&server).await.0, 200);
    server.shutdown().await;
}

#[tokio::test]
async fn a_replica_publishing_another_block_size_is_flagged() {
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    publisher
        .publish(stored_payload(&HASHES, BLOCK_SIZE * 2))
        .await
        .unwrap();
    let server = IndexServer::start(config(&zmq_replica("wrong", &publisher), ""))
        .await
        .unwrap();
    let found = wait_for_state(&server, "wrong", ReplicaCondition::Flagged).await;
    assert_eq!(found.reason, "block_size_mismatch");
    assert_not_precise(&server, "wrong", "flagged", "block_size_mismatch").await;
    assert_eq!(
        admin_replica(&server, "wrong").await["problem"],
        "block_size_mismatch"
    );
    let metrics = http::get(&format!("http://{}/metrics", server.admin_addr()))
        .await
        .unwrap()
        .text();
    assert!(
        metrics
            .lines()
            .any(|line| line
                == "kvroute_index_replica_flags_total{reason=\"block_size_mismatch\"} 1"),
        "{metrics}"
    );
    assert_eq!(readyz(&server).await.0, 503);
    server.shutdown().await;
}

/// Ready after the catch-up, disconnected when the engine dies, and after an idle restart
/// (counter back to 0, empty replay buffer, no traffic) ready again with 0 blocks — not the
/// old engine's 3 — detected on reconnect within the bound printed here.
#[tokio::test]
async fn an_idle_restarted_engine_is_detected_on_reconnect() {
    let first = MockVllmPublisher::bind_loopback().await.unwrap();
    let (events, replay) = (
        first.pub_endpoint().unwrap().to_owned(),
        first.replay_endpoint().unwrap().to_owned(),
    );
    let server = IndexServer::start(config(&zmq_replica("e", &first), ""))
        .await
        .unwrap();
    // Connected and caught up on an empty buffer: ready, nothing applied yet.
    wait_for_state(&server, "e", ReplicaCondition::Ready).await;
    assert!(
        admin_replica(&server, "e")
            .await
            .get("last_sequence")
            .is_none()
    );
    first
        .publish(stored_payload(&HASHES, BLOCK_SIZE))
        .await
        .unwrap();
    poll_until("3 blocks matched", within(), || async {
        (grpc_match(&server, "e").await.matched_blocks == 3).then_some(())
    })
    .await;
    assert_eq!(admin_replica(&server, "e").await["last_sequence"], 0);
    assert_eq!(admin_match(&server, "e").await["state"], "ready");
    poll_until("ready", within(), || async {
        (readyz(&server).await.0 == 200).then_some(())
    })
    .await;
    poll_until("health SERVING", within(), || async {
        (health(&server, "").await == ServingStatus::Serving).then_some(())
    })
    .await;

    let killed = Instant::now();
    first.shutdown().await;
    wait_for_state(&server, "e", ReplicaCondition::Disconnected).await;
    let to_disconnected = killed.elapsed();
    assert_not_precise(&server, "e", "disconnected", "disconnected").await;
    poll_until("health NOT_SERVING", within(), || async {
        (health(&server, "").await == ServingStatus::NotServing).then_some(())
    })
    .await;
    assert_eq!(readyz(&server).await.0, 503);

    let restarted = MockVllmPublisher::start(MockPublisherConfig {
        endpoint: events,
        replay_endpoint: Some(replay),
        ..MockPublisherConfig::loopback()
    })
    .await
    .unwrap();
    let started = Instant::now();
    let found = wait_for_state(&server, "e", ReplicaCondition::Ready).await;
    let to_resynced = started.elapsed();
    assert!(found.precise);
    assert_eq!(
        found.matched_blocks, 0,
        "the restarted engine holds nothing"
    );
    assert_eq!(admin_replica(&server, "e").await["blocks"], 0);
    eprintln!(
        "idle restart: not precise {to_disconnected:?} after the kill; resynced (precise, 0 \
         blocks) {to_resynced:?} after the restarted engine bound its sockets"
    );
    // And it follows the new stream from 0.
    until_received_live(server.admin_addr(), "e", 0, &restarted).await;
    restarted
        .publish(stored_payload(&HASHES[..1], BLOCK_SIZE))
        .await
        .unwrap();
    poll_until("1 block matched", within(), || async {
        (grpc_match(&server, "e").await.matched_blocks == 1).then_some(())
    })
    .await;
    server.shutdown().await;
}

/// A stream of messages that do not decode (an encoding this index does not know) flags the
/// replica `unknown_encoding` — not precise — and the next message that decodes clears it.
#[tokio::test]
async fn a_replica_whose_messages_do_not_decode_is_flagged_until_one_does() {
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let server = IndexServer::start(config(&zmq_replica("garbled", &publisher), ""))
        .await
        .unwrap();
    wait_for_state(&server, "garbled", ReplicaCondition::Ready).await;
    until_received_live(server.admin_addr(), "garbled", 0, &publisher).await;
    // 0xc1 is the one byte msgpack never uses: no vLLM batch starts with it.
    for _ in 0..4 {
        publisher.publish(vec![0xc1, 0x00]).await.unwrap();
    }
    let found = wait_for_state(&server, "garbled", ReplicaCondition::Flagged).await;
    assert_eq!(found.reason, "unknown_encoding");
    assert_not_precise(&server, "garbled", "flagged", "unknown_encoding").await;
    publisher
        .publish(stored_payload(&HASHES, BLOCK_SIZE))
        .await
        .unwrap();
    poll_until("3 blocks matched, precise again", within(), || async {
        let found = grpc_match(&server, "garbled").await;
        (found.precise && found.matched_blocks == 3).then_some(())
    })
    .await;
    server.shutdown().await;
}

/// A hybrid model's stores in `group` (`window`: a sliding-window group, else full attention),
/// `span` blocks of tokens of which `hashes` are the ones it keeps (a window group's stores are
/// not dense), as vLLM 0.32 publishes them.
fn group_stored(group: u32, window: Option<u32>, hashes: &[u64], span: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        token_ids: (0..span * BLOCK_SIZE).collect(),
        block_size: BLOCK_SIZE,
        medium: Medium::Gpu,
        group_idx: Some(group),
        cache_kind: Some(if window.is_some() {
            CacheKind::SlidingWindow
        } else {
            CacheKind::FullAttention
        }),
        sliding_window: window,
        ..BlockStored::default()
    })
}

/// `GET /v1/replicas/{id}/groups`: each KV-cache group's holdings apart, one entry per copy,
/// sorted; a removal touches its own group only; unknown replicas are 404.
#[tokio::test]
async fn the_admin_api_lists_each_kv_cache_groups_holdings() {
    let publisher = MockVllmPublisher::bind_loopback().await.unwrap();
    let server = IndexServer::start(config(&zmq_replica("hybrid", &publisher), ""))
        .await
        .unwrap();
    wait_for_state(&server, "hybrid", ReplicaCondition::Ready).await;
    until_received_live(server.admin_addr(), "hybrid", 0, &publisher).await;
    let [a1, a2, a3] = HASHES;
    let batch = EventBatch {
        ts: 0.0,
        dp_rank: Some(0),
        events: vec![
            // Group 0 slides over 2 blocks: of the prompt's 3 it keeps the last 2, of a
            // second request with the same prompt another copy of the last one.
            group_stored(0, Some(2 * BLOCK_SIZE), &[a2, a3], 3),
            group_stored(1, None, &[a1, a2, a3], 3),
            group_stored(0, Some(2 * BLOCK_SIZE), &[a3], 3),
            // Evicting a2 from the window group leaves the full group's a2.
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![a2],
                medium: Medium::Gpu,
                group_idx: Some(0),
            }),
        ],
    };
    publisher
        .publish(encode_batch(&batch, Encoding::V0_32))
        .await
        .unwrap();
    let url = format!("http://{}/v1/replicas/hybrid/groups", server.admin_addr());
    let expected = json!({"id": "hybrid", "groups": {"0": [a3, a3], "1": [a1, a2, a3]}});
    let listed = try_poll_until("both groups listed", within(), || async {
        let body: Value = http::get(&url).await.ok()?.json().ok()?;
        (body == expected).then_some(body)
    })
    .await;
    assert!(
        listed.is_ok(),
        "{:?}",
        http::get(&url).await.unwrap().text()
    );
    // The per-replica blocks listing is the full-attention group's.
    let blocks: Value = http::get(&format!(
        "http://{}/v1/replicas/hybrid/blocks",
        server.admin_addr()
    ))
    .await
    .unwrap()
    .json()
    .unwrap();
    assert_eq!(blocks["blocks"], json!([a1, a2, a3]));
    let unknown = http::get(&format!(
        "http://{}/v1/replicas/nobody/groups",
        server.admin_addr()
    ))
    .await
    .unwrap();
    assert_eq!(unknown.status.as_u16(), 404, "{}", unknown.text());
    server.shutdown().await;
}
