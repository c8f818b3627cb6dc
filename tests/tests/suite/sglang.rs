//! SGLang fleets through a real Envoy: `kvroute-engine-sim --engine sglang` serves as SGLang
//! 0.5.23 does on the wire (its KV events byte for byte — `wire::sglang_tests` — its page hash,
//! its metric names, `/server_info`), beside vLLM sims in one pool.
//!
//! Where a request went and what it found cached is read from the engine side: the sim that
//! finished it and its `usage.prompt_tokens_details.cached_tokens`.

use std::collections::{BTreeMap, HashSet};

use kvroute_config::Engine;
use kvroute_ext_proc::server::PREDICTED_CACHED_HEADER;
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{DebugHeaders, MODEL, Stack, StackOptions};
use serde_json::{Value, json};

use super::routing::{route_response, text};

const CONVERSATIONS: usize = 8;
const TURNS: usize = 4;
const BLOCK_SIZE: u32 = 16;

/// Multi-turn chats over `engines`: every later turn goes back to the replica that served the
/// first and reuses its cache there, conversations spread over both kinds, and kvroute's
/// predicted cached tokens are within one block of the engine's own for ≥ 95 %.
async fn conversations_stay_home(engines: Vec<Option<Engine>>) {
    let stack = Stack::start(StackOptions {
        replicas: engines.len(),
        sim_engines: engines.clone(),
        block_size: BLOCK_SIZE,
        kv_blocks_per_replica: 1024,
        debug_headers: DebugHeaders::Always,
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| {
            vec![json!({"role": "system", "content": format!("You are agent {c}. {}", text(c as u64 + 70, 40))})]
        })
        .collect();
    let mut home: BTreeMap<usize, usize> = BTreeMap::new();
    let (mut requests, mut within_one_block, mut reused) = (0, 0, 0);
    for turn in 0..TURNS {
        for (c, history) in histories.iter_mut().enumerate() {
            history
                .push(json!({"role": "user", "content": text((c * 100 + turn) as u64 + 7000, 25)}));
            let body = json!({"model": MODEL, "messages": history, "max_tokens": 4});
            let (sim, response) = route_response(&stack, "/v1/chat/completions", &body, &[]).await;
            let predicted: i64 = response.header(PREDICTED_CACHED_HEADER).parse().unwrap();
            let answer: Value = response.json().unwrap();
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_i64()
                .unwrap_or(0);
            requests += 1;
            if (predicted - cached).abs() <= i64::from(BLOCK_SIZE) {
                within_one_block += 1;
            }
            match home.get(&c) {
                None => {
                    home.insert(c, sim);
                }
                Some(&holder) => {
                    assert_eq!(sim, holder, "conversation {c} turn {turn} left its replica");
                    if cached > 0 {
                        reused += 1;
                    }
                }
            }
            let reply = answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history.push(json!({"role": "assistant", "content": reply}));
        }
    }
    assert_eq!(
        reused,
        CONVERSATIONS * (TURNS - 1),
        "every later turn reused its conversation's cache"
    );
    assert!(
        within_one_block * 100 >= requests * 95,
        "predicted cached tokens within one block of the engine's for {within_one_block} of \
         {requests} requests"
    );
    // Decided on the index's answers (SGLang's events decoded, its hashes matched), not on
    // kvroute's own memory alone.
    let admin = stack.ext_proc_admin_url().unwrap();
    let metrics_text = http::get(&format!("{admin}/metrics")).await.unwrap().text();
    let precise = metrics::sum(
        &metrics_text,
        "kvroute_extproc_decisions_total",
        &["tier=\"precise\""],
    );
    assert_eq!(
        precise as usize, requests,
        "every decision on the precise tier:\n{metrics_text}"
    );
    let index = http::get(&format!("{}/metrics", stack.index_admin_url().unwrap()))
        .await
        .unwrap()
        .text();
    assert_eq!(
        metrics::sum(&index, "kvroute_index_ingest_refused_total", &[]),
        0.0,
        "no event refused:\n{index}"
    );
    let kinds: HashSet<Engine> = home
        .values()
        .map(|&sim| engines.get(sim).copied().flatten().unwrap_or_default())
        .collect();
    assert_eq!(
        kinds.len(),
        engines
            .iter()
            .map(|e| e.unwrap_or_default())
            .collect::<HashSet<_>>()
            .len(),
        "conversations went to every kind of replica: {home:?}"
    );
}

#[tokio::test]
async fn an_sglang_fleet_routes_by_sglangs_own_page_hashes() {
    conversations_stay_home(vec![Some(Engine::Sglang), Some(Engine::Sglang)]).await;
}

#[tokio::test]
async fn a_mixed_vllm_and_sglang_pool_routes_by_prefix_to_either_kind() {
    conversations_stay_home(vec![None, Some(Engine::Sglang), None, Some(Engine::Sglang)]).await;
}

#[tokio::test]
async fn an_sglang_sim_describes_its_publisher_and_exports_sglangs_metrics() {
    let stack = Stack::start(StackOptions {
        replicas: 1,
        sim_engines: vec![Some(Engine::Sglang)],
        ..StackOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let sim = &stack.sim_urls()[0];
    let info: Value = http::get(&format!("{sim}/server_info"))
        .await
        .unwrap()
        .json()
        .unwrap();
    let events = &info["kv_events"];
    assert_eq!(events["publisher"], "zmq");
    assert_eq!(events["block_size"], stack.options().block_size);
    assert!(events["endpoint_port_base"].as_u64().is_some_and(|p| p > 0));
    assert!(events["replay_endpoint_port_base"].as_u64().is_some());
    let metrics = http::get(&format!("{sim}/metrics")).await.unwrap().text();
    for name in [
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
    ] {
        assert!(metrics.contains(name), "{name} missing:\n{metrics}");
    }
    assert!(!metrics.contains("vllm:"), "no vLLM series:\n{metrics}");
    // SGLang's endpoint empties the cache; vLLM's is not served.
    assert_eq!(
        http::post_json(&format!("{sim}/flush_cache"), &json!({}))
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        http::post_json(&format!("{sim}/reset_prefix_cache"), &json!({}))
            .await
            .unwrap()
            .status,
        404
    );
}
