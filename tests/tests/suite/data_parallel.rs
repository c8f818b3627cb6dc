//! Data-parallel engines through a real Envoy: each `kvroute-engine-sim` serves two engine ranks
//! behind its one API server, as vLLM's `--data-parallel-size 2` does (each rank its own KV cache
//! and KV-event publisher on rank 0's ports offset by the rank; `x-data-parallel-rank` picks the
//! rank). The index subscribes to every rank (`data_parallel_size: 2`) and keeps their blocks
//! apart; ext-proc scores each rank as a target and sends the chosen one in the header.
//!
//! Where a request went is read from the engine side: the sim that finished it (its
//! `vllm:request_success_total`), the rank that served it (the sim's `x-sim-served-dp-rank`), and
//! what that rank found cached (`usage.prompt_tokens_details.cached_tokens`).

use std::collections::{BTreeMap, BTreeSet};

use kvroute_ext_proc::server::PREDICTED_CACHED_HEADER;
use kvroute_tests::sim::SERVED_DP_RANK_HEADER;
use kvroute_tests::stack::{DebugHeaders, MODEL, Stack, StackOptions};
use serde_json::{Value, json};

use super::routing::{route_response, text};

/// Conversations, and the turns of each.
const CONVERSATIONS: usize = 8;
const TURNS: usize = 4;
/// Tokens per KV block of the stack.
const BLOCK_SIZE: u32 = 16;

/// The target ext-proc chose (`sim-<i>@dp<rank>`), from the `x-kvroute-explain` record: the
/// candidate marked `*`.
pub(super) fn chosen_target(explain: &str) -> String {
    let (_, candidates) = explain.split_once(';').unwrap_or(("", explain));
    candidates
        .split_whitespace()
        .find_map(|candidate| candidate.strip_prefix('*'))
        .and_then(|candidate| candidate.split(':').next())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn a_conversation_stays_on_the_data_parallel_rank_that_holds_it() {
    conversations_stay_on_their_rank(StackOptions::default()).await;
}

/// The agent mirrors each rank of sim 1 (its `engines[]` entry declares the ranks) and streams
/// them to the index as the rank replicas the index owns it for; sim 0 stays subscribed directly.
#[tokio::test]
async fn ranks_fed_through_the_agent_route_the_same() {
    conversations_stay_on_their_rank(StackOptions {
        agent_replicas: vec![1],
        ..StackOptions::default()
    })
    .await;
}

/// Multi-turn chats through two sims of two ranks each: every later turn goes to the rank that
/// served the first (and reuses its cache there), the engine serves on the rank ext-proc chose,
/// and kvroute's predicted cached tokens are within one block of the rank's own for ≥ 95 %.
async fn conversations_stay_on_their_rank(options: StackOptions) {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        data_parallel_size: 2,
        block_size: BLOCK_SIZE,
        kv_blocks_per_replica: 1024,
        debug_headers: DebugHeaders::Always,
        ..options
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| {
            vec![json!({"role": "system", "content": format!("You are agent {c}. {}", text(c as u64, 40))})]
        })
        .collect();
    // Where each conversation's first turn was served: (sim, rank).
    let mut home: BTreeMap<usize, (usize, u64)> = BTreeMap::new();
    let mut within_one_block = 0;
    let mut requests = 0;
    let mut reused = 0;
    for turn in 0..TURNS {
        for (c, history) in histories.iter_mut().enumerate() {
            history
                .push(json!({"role": "user", "content": text((c * 100 + turn) as u64 + 1000, 25)}));
            let body = json!({"model": MODEL, "messages": history, "max_tokens": 4});
            let (sim, response) = route_response(&stack, "/v1/chat/completions", &body, &[]).await;
            let rank: u64 = response
                .header(SERVED_DP_RANK_HEADER)
                .parse()
                .unwrap_or_else(|_| panic!("no served rank header\n{}", stack.logs()));
            let explain = response.header("x-kvroute-explain");
            assert_eq!(
                chosen_target(&explain),
                format!("sim-{sim}@dp{rank}"),
                "the engine served on the rank ext-proc chose (x-data-parallel-rank): {explain}"
            );
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
                    home.insert(c, (sim, rank));
                }
                Some(&holder) => {
                    assert_eq!(
                        (sim, rank),
                        holder,
                        "conversation {c} turn {turn} left the rank holding it ({explain})"
                    );
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
        "every later turn reused its conversation's cache on the rank it went to"
    );
    assert!(
        within_one_block * 100 >= requests * 95,
        "predicted cached tokens within one block of the rank's own for {within_one_block} of \
         {requests} requests"
    );
    let targets: BTreeSet<_> = home.values().collect();
    assert!(
        targets.len() >= 2,
        "new conversations spread over the ranks: {home:?}"
    );
}
