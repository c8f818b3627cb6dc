//! `kvroute-index` fed by three engine simulators under seeded random traffic.
//!
//! The simulators have small KV caches, so the traffic (shared prefixes, varied lengths, several
//! requests in flight) makes them evict. Once the events have flowed, the index's view of every
//! replica (`GET /v1/replicas/{id}/blocks`) must equal the simulator's own block list
//! (`GET /debug/blocks`): after the eviction phase, and again after one simulator's prefix-cache
//! reset (`AllBlocksCleared`) followed by more traffic.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt as _;
use kvroute_index::config::Config;
use kvroute_index::server::IndexServer;
use kvroute_index_core::event::KvEvent;
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::sim::EngineSim;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::common::{removed_hashes, replay_all, start_sim, stored};

const REPLICAS: usize = 3;
/// Room for about three long requests: every simulator must evict under this traffic.
const NUM_BLOCKS: &str = "24";
const IN_FLIGHT: usize = 8;
const SEED: u64 = 0x5EED_1DE8;
/// How long a test waits for the index to reach a state.
fn within() -> Duration {
    deadline(Duration::from_secs(15))
}
/// Token ids drawn for synthetic prompts (the tiny model's vocabulary has 2000).
const TOKEN_IDS: std::ops::Range<u32> = 3..2000;
const WORDS: &[&str] = &[
    "cache", "block", "prefix", "route", "replica", "token", "engine", "envoy", "index", "event",
    "hash", "chain", "evict", "reset", "queue", "decode", "prefill", "stream", "model", "tiny",
];
const SYSTEM_PROMPTS: &[&str] = &[
    "You are a careful assistant. Answer in full sentences, cite the document you rely on, and \
     say so plainly when the documents do not contain the answer to the question.",
    "You summarise engineering logs for an on-call operator: group related lines, name the \
     failing component first, and keep every summary shorter than the log it describes.",
];

fn replica_id(i: usize) -> String {
    format!("sim-{i}")
}

fn index_config(sims: &[EngineSim]) -> Config {
    let replicas: String = sims
        .iter()
        .enumerate()
        .map(|(i, sim)| {
            let ready = sim.ready_info();
            format!(
                r#"
  - id: {}
    pool: tiny
    events:
      endpoint: "{}"
      replay_endpoint: "{}"
      topic: "kv@sim@tiny""#,
                replica_id(i),
                ready.kv_events.as_deref().unwrap(),
                ready.replay.as_deref().unwrap(),
            )
        })
        .collect();
    Config::from_yaml(&format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [tiny], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}}}
replicas:{replicas}
"#
    ))
    .expect("valid index config")
}

/// Seeded request generator: prompts share a few prefixes and vary in length and output.
struct Traffic {
    rng: StdRng,
    prefixes: Vec<Vec<u32>>,
}

impl Traffic {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let prefixes = (0..4)
            .map(|_| {
                let len = rng.random_range(40..140);
                (0..len).map(|_| rng.random_range(TOKEN_IDS)).collect()
            })
            .collect();
        Self { rng, prefixes }
    }

    /// `count` requests as (replica, path, body).
    fn requests(&mut self, count: usize) -> Vec<(usize, &'static str, Value)> {
        (0..count).map(|_| self.request()).collect()
    }

    fn request(&mut self) -> (usize, &'static str, Value) {
        let replica = self.rng.random_range(0..REPLICAS);
        let max_tokens = self.rng.random_range(1..48);
        if self.rng.random_bool(0.25) {
            let system = *SYSTEM_PROMPTS.choose(&mut self.rng).unwrap();
            let words = self.rng.random_range(5..40);
            let user: Vec<&str> = (0..words)
                .map(|_| *WORDS.choose(&mut self.rng).unwrap())
                .collect();
            let body = json!({"model": "tiny", "max_tokens": max_tokens, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user.join(" ")}]});
            return (replica, "/v1/chat/completions", body);
        }
        let mut prompt = self.prefixes.choose(&mut self.rng).unwrap().clone();
        let suffix = self.rng.random_range(0..80);
        prompt.extend((0..suffix).map(|_| self.rng.random_range(TOKEN_IDS)));
        let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens});
        (replica, "/v1/completions", body)
    }
}

/// Sends the requests with up to [`IN_FLIGHT`] at once; every one must succeed.
async fn send_all(sims: &[EngineSim], requests: Vec<(usize, &'static str, Value)>) {
    futures::stream::iter(requests)
        .map(|(replica, path, body)| {
            let url = format!("{}{path}", sims[replica].base_url());
            async move {
                let response = http::post_json(&url, &body).await.unwrap();
                assert_eq!(response.status, 200, "{url}: {}", response.text());
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<()>>()
        .await;
}

/// The simulator's truth, one entry per block (two blocks can carry the same hash).
async fn sim_block_list(sim: &EngineSim) -> Vec<u64> {
    let answer = http::get(&format!("{}/debug/blocks", sim.base_url()))
        .await
        .unwrap()
        .json()
        .unwrap();
    answer["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["hash"].as_u64().unwrap())
        .collect()
}

/// The hashes the simulator holds, as the index lists them (one entry per hash).
async fn sim_blocks(sim: &EngineSim) -> BTreeSet<u64> {
    sim_block_list(sim).await.into_iter().collect()
}

/// Hashes carried by more than one of the simulator's blocks.
async fn duplicated_hashes(sim: &EngineSim) -> Vec<u64> {
    let mut list = sim_block_list(sim).await;
    list.sort_unstable();
    let mut duplicated: Vec<u64> = list
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    duplicated.dedup();
    duplicated
}

async fn index_blocks(admin: SocketAddr, id: &str) -> BTreeSet<u64> {
    let response = http::get(&format!("http://{admin}/v1/replicas/{id}/blocks"))
        .await
        .unwrap();
    assert_eq!(response.status, 200, "{}", response.text());
    let answer = response.json().unwrap();
    assert_eq!(answer["id"], id);
    answer["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// Polls until the index's view of every replica equals its simulator's block list; returns
/// the block counts. On timeout, fails with the difference.
async fn assert_converged(phase: &str, admin: SocketAddr, sims: &[EngineSim]) -> Vec<usize> {
    let mut counts = Vec::new();
    for (i, sim) in sims.iter().enumerate() {
        let id = replica_id(i);
        let converged =
            try_poll_until(&format!("{id} ({phase}) to converge"), within(), || async {
                let truth = sim_blocks(sim).await;
                (truth == index_blocks(admin, &id).await).then_some(truth.len())
            })
            .await;
        match converged {
            Ok(blocks) => counts.push(blocks),
            Err(timed_out) => {
                let truth = sim_blocks(sim).await;
                let view = index_blocks(admin, &id).await;
                let history = event_history(sim, truth.symmetric_difference(&view)).await;
                panic!(
                    "{id} ({phase}): index diverged from the simulator after {:?}; only \
                     in the simulator: {:?}; only in the index: {:?}; held by several simulator \
                     blocks: {:?}; (stored, removed) per differing hash in the simulator's \
                     events: {history:?}",
                    timed_out.after,
                    truth.difference(&view).collect::<Vec<_>>(),
                    view.difference(&truth).collect::<Vec<_>>(),
                    duplicated_hashes(sim).await,
                );
            }
        }
    }
    let replicas = http::get(&format!("http://{admin}/v1/replicas"))
        .await
        .unwrap()
        .json()
        .unwrap();
    for replica in replicas.as_array().unwrap() {
        assert_eq!(replica["state"], "ready", "{replica}");
    }
    counts
}

/// How often the simulator's event stream (its replay buffer) stored and removed each hash.
async fn event_history(
    sim: &EngineSim,
    hashes: impl Iterator<Item = &u64>,
) -> Vec<(u64, usize, usize)> {
    let events: Vec<KvEvent> = replay_all(sim.ready_info().replay.as_deref().unwrap())
        .await
        .into_iter()
        .flat_map(|(_, batch)| batch.events)
        .collect();
    let stored_hashes: Vec<u64> = stored(&events)
        .iter()
        .flat_map(|s| s.block_hashes.iter().copied())
        .collect();
    let removed = removed_hashes(&events);
    hashes
        .map(|&h| {
            let count = |list: &[u64]| list.iter().filter(|&&x| x == h).count();
            (h, count(&stored_hashes), count(&removed))
        })
        .collect()
}

async fn index_metrics(admin: SocketAddr) -> String {
    http::get(&format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
}

/// Starts the index on `sims` and waits until it follows every replica's event stream.
async fn start_index(sims: &[EngineSim]) -> IndexServer {
    let server = IndexServer::start(index_config(sims))
        .await
        .expect("index starts");
    let admin = server.admin_addr();
    // The index takes the first message it sees as the start of a stream. Resetting an idle
    // simulator publishes AllBlocksCleared and changes nothing, so repeat it until every
    // replica's subscription has delivered one (this also waits out ZMQ's join delay).
    for (i, sim) in sims.iter().enumerate() {
        let id = replica_id(i);
        poll_until(&format!("{id} subscribed"), within(), || async {
            let reset = http::post_json(
                &format!("{}/reset_prefix_cache", sim.base_url()),
                &json!({}),
            )
            .await
            .unwrap();
            assert_eq!(reset.json().unwrap(), json!({"success": true}));
            let replicas = http::get(&format!("http://{admin}/v1/replicas"))
                .await
                .unwrap()
                .json()
                .unwrap();
            replicas
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["id"] == id.as_str() && r["state"] == "ready")
                .then_some(())
        })
        .await;
    }
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_view_of_three_simulators_converges_through_evictions_and_a_reset() {
    let mut sims = Vec::new();
    for _ in 0..REPLICAS {
        sims.push(start_sim(&["--num-blocks", NUM_BLOCKS]).await);
    }
    let server = start_index(&sims).await;
    let admin = server.admin_addr();

    // Phase 1: enough traffic to overflow every cache.
    let mut traffic = Traffic::new(SEED);
    send_all(&sims, traffic.requests(48)).await;
    let counts = assert_converged("after evictions", admin, &sims).await;
    assert!(counts.iter().all(|&n| n > 0), "{counts:?}");
    let metrics = index_metrics(admin).await;
    let removed = metrics::sum(&metrics, "kvroute_index_blocks_removed_total", &[]);
    assert!(
        removed > 0.0,
        "no BlockRemoved reached the index:\n{metrics}"
    );

    // Phase 2: one simulator forgets everything, then traffic resumes.
    let cleared_before = metrics::sum(
        &metrics,
        "kvroute_index_events_applied_total{kind=\"all_blocks_cleared\"}",
        &[],
    );
    let reset_url = format!("{}/reset_prefix_cache", sims[0].base_url());
    // A finished request's blocks are released just after its response; retry until idle.
    poll_until("sim-0 reset", within(), || async {
        let reset = http::post_json(&reset_url, &json!({})).await.unwrap();
        (reset.json().unwrap() == json!({"success": true})).then_some(())
    })
    .await;
    assert!(sim_blocks(&sims[0]).await.is_empty());
    let counts = assert_converged("after the reset", admin, &sims).await;
    assert_eq!(counts[0], 0);
    assert!(counts[1] > 0 && counts[2] > 0, "{counts:?}");
    let cleared_after = metrics::sum(
        &index_metrics(admin).await,
        "kvroute_index_events_applied_total{kind=\"all_blocks_cleared\"}",
        &[],
    );
    assert!(
        cleared_after > cleared_before,
        "{cleared_before} -> {cleared_after}"
    );

    send_all(&sims, traffic.requests(36)).await;
    let counts = assert_converged("after traffic following the reset", admin, &sims).await;
    assert!(counts.iter().all(|&n| n > 0), "{counts:?}");

    server.shutdown().await;
    for sim in sims {
        sim.shutdown().await;
    }
}

/// vLLM never hits a prompt's last token, so repeating a block-aligned prompt computes its last
/// block again: two blocks then carry the same hash (vLLM's `BlockPool` keeps both, and publishes
/// `BlockStored` for each). Evicting one copy publishes `BlockRemoved` for the hash while the
/// other copy stays cached and keeps serving hits, so the index must still list it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_held_by_two_blocks_stays_indexed_until_both_are_evicted() {
    let sims = vec![start_sim(&["--num-blocks", "8"]).await];
    let server = start_index(&sims).await;
    let base = sims[0].base_url();
    let complete = |prompt: Vec<u32>| {
        let url = format!("{base}/v1/completions");
        async move {
            let response = http::post_json(&url, &json!({"prompt": prompt, "max_tokens": 1}))
                .await
                .unwrap();
            assert_eq!(response.status, 200, "{}", response.text());
            response.json().unwrap()
        }
    };
    let aligned: Vec<u32> = (100..164).collect();
    complete(aligned.clone()).await;
    complete(aligned.clone()).await;
    assert_eq!(
        duplicated_hashes(&sims[0]).await.len(),
        1,
        "the second block, twice"
    );
    // Six new blocks: the free queue's head is the first copy, freed before the second.
    complete((1000..1192).collect()).await;
    let longer: Vec<u32> = (100..200).collect();
    let hit = complete(longer).await;
    assert_eq!(
        hit["usage"]["prompt_tokens_details"]["cached_tokens"], 64,
        "the surviving copy still serves hits"
    );
    assert_converged("after evicting one copy", server.admin_addr(), &sims).await;
    server.shutdown().await;
}
