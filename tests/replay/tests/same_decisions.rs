//! kvroute-replay's kvroute router and ext-proc's picker run the same routing core
//! (`kvroute_routing::Router`): one request sequence through both gets identical decisions.
//!
//! The sequence: conversations and shared system prompts of several lengths (token-id prompts,
//! so the picker needs no tokenizer), requests held in flight and released out of order, and
//! engine load recorded on both sides at the same points. Both run without KV events (the picker's
//! pool has `events: false`; replay's `without_events`), so every decision reads the routed-prefix
//! memory, the in-flight keys and the load — the state the core keeps — and ties are broken by the
//! same seeded generator.
#![allow(clippy::unwrap_used, reason = "test code")]

use std::collections::HashMap;
use std::time::Instant;

use kvroute_ext_proc::metrics::Metrics;
use kvroute_ext_proc::request::{Endpoint, parse};
use kvroute_ext_proc::{Config, Decision as PickerDecision, Picker, Runtime};
use kvroute_replay::BLOCK_TOKENS;
use kvroute_replay::routers::{Kvroute, Router, View};
use kvroute_replay::timing::MockerFit;
use kvroute_replay::trace::Request;
use kvroute_routing::load::Scraped;
use rand::SeedableRng;
use tokio_util::task::TaskTracker;

const REPLICAS: usize = 4;
const CAPACITY_BLOCKS: usize = 65_536;
const SEED: u64 = 20_261_202;

fn picker() -> Picker {
    let mut yaml = format!(
        "pools:\n- {{name: p, models: [m], block_size: {BLOCK_TOKENS}, events: false, \
         approx_capacity_blocks: {CAPACITY_BLOCKS}, key_scheme: {{kind: token-chain}}}}\n\
         replicas:\n"
    );
    for i in 0..REPLICAS {
        yaml.push_str(&format!(
            "- {{id: r{i}, pool: p, address: \"10.0.0.{}:8000\"}}\n",
            i + 1
        ));
    }
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(&yaml).unwrap(), None, &tasks).unwrap();
    let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
    Picker::new(runtime, metrics, tasks).with_tie_seed(SEED)
}

/// Token ids of request `i`: one of a few shared prefixes (system prompts, growing
/// conversations), then a part of its own.
fn prompt(i: u32) -> Vec<u32> {
    let family = i % 5;
    let turn = i / 5;
    let shared = match family {
        0 => 4 * BLOCK_TOKENS,
        1 => 9 * BLOCK_TOKENS + 100,
        // A conversation: every turn extends the previous one.
        2 => (2 + turn) * BLOCK_TOKENS,
        3 => BLOCK_TOKENS / 2,
        _ => 0,
    };
    let own = 1 + (i * 397) % (3 * BLOCK_TOKENS);
    (0..shared)
        .map(|t| family * 100_000 + t)
        .chain((0..own).map(|t| 1_000_000 + i * 10_000 + t))
        .collect()
}

#[tokio::test]
async fn replay_decides_as_the_picker_does() {
    let picker = picker();
    // The picker reads the wall clock; the replay's clock is a base taken at its construction
    // plus the simulated time. Each request's simulated arrival is the wall time elapsed since
    // then, so both fold the pool's recent load and age their memories over the same intervals
    // (a fixed step per request let a loaded host's slower run average the load differently).
    let start = Instant::now();
    let mut replay = Kvroute::new(
        REPLICAS,
        CAPACITY_BLOCKS as u32,
        rand::rngs::StdRng::seed_from_u64(SEED),
    )
    .without_events();
    let timing = MockerFit::default();
    let pool = picker.runtime().config.pools[0].clone();
    let mut held: HashMap<usize, (PickerDecision, Request)> = HashMap::new();
    let mut routed = [0usize; REPLICAS];
    let mut cached_decisions = 0;

    for i in 0..120u32 {
        let tokens = prompt(i);
        let keys = pool.prompt_keys(&tokens, None, None).unwrap();
        let body = serde_json::json!({"model": "m", "prompt": tokens}).to_string();
        let parsed = parse(body.as_bytes(), Endpoint::Completions).unwrap();
        let arrival_us = u64::try_from(start.elapsed().as_micros()).unwrap();
        let decision = picker.decide(&parsed, None).await.unwrap();
        let request = Request {
            id: i as usize,
            arrival_us,
            input_tokens: tokens.len() as u32,
            output_tokens: 1,
            full_blocks: keys.len(),
            session: u64::from(i),
            chain: keys,
        };
        let view = View {
            now_us: request.arrival_us,
            engines: &[],
            requests: &[],
            timing: &timing,
            prefill_replicas: 0,
        };
        let simulated = replay.route(&request, &view);

        let replica = format!("r{}", simulated.replica);
        let simulated_cached =
            (simulated.predicted_blocks.unwrap() * BLOCK_TOKENS).min(request.input_tokens) as usize;
        assert_eq!(
            (
                decision.replica_id.as_str(),
                decision.predicted_cached_tokens
            ),
            (replica.as_str(), simulated_cached),
            "request {i}: picker {} / {} cached tokens ({}), replay {replica} / {simulated_cached}",
            decision.replica_id,
            decision.predicted_cached_tokens,
            decision.reason,
        );
        routed[simulated.replica] += 1;
        cached_decisions += usize::from(simulated_cached > 0);
        held.insert(request.id, (decision, request));

        // Release some requests out of order (their first token), on both sides.
        if i % 3 == 2 {
            for id in [i as usize - 2, i as usize] {
                if let Some((decision, request)) = held.remove(&id) {
                    let replica = decision.replica_id[1..].parse().unwrap();
                    drop(decision);
                    replay.on_first_token(replica, &request, request.arrival_us);
                }
            }
        }
        // Engine load, recorded on both boards as the scrape loop would.
        if i % 7 == 6 {
            for r in 0..REPLICAS {
                let scraped = Scraped {
                    waiting: f64::from((i + r as u32) % 3),
                    running: f64::from((i * 7 + r as u32) % 11),
                    kv_usage: f64::from((i + 3 * r as u32) % 10) / 10.0,
                };
                let id = format!("r{r}");
                picker.loads().replica(&id).record_scrape(scraped);
                replay.loads().replica(&id).record_scrape(scraped);
            }
        }
    }
    // The sequence exercised the core: every replica chosen, most decisions from cached prefixes.
    assert!(routed.iter().all(|&n| n > 0), "{routed:?}");
    assert!(
        cached_decisions > 60,
        "{cached_decisions} of 120 decisions used a cached prefix"
    );
}
