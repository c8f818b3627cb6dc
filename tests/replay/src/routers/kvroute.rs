//! kvroute, with its own code: the real index core (`kvroute_index::index::BlockIndex`) fed the
//! engines' KV events after the configured delay, the real per-replica load board
//! (`kvroute_ext_proc::load`), routed-prefix memory (`prefix_memory::PrefixMemory`) and policy
//! (`policy::choose`) with the default `ScoringConfig`.
//!
//! The glue mirrors ext-proc's `Picker::score_prefix` / `score_and_commit` (private there):
//! per replica `matched = max(index, speculative)`, the in-flight shared prefix, the load
//! snapshot; after the choice the speculative insert and the in-flight accounting.
//!
//! Simulation choices:
//! - Scrapes: every `DEFAULT_SCRAPE_INTERVAL` (500 ms) the engines' waiting, running and KV
//!   usage are recorded on the load board (`ReplicaLoad::record_scrape`), as the scrape loop
//!   does from `/metrics`.
//! - In-flight guards are released at the first token (a streamed response's headers).
//! - Keys are the trace's chained keys (the pool is vLLM-exact: the published hash is the key).
//! - `approx_capacity_blocks` is the replica's KV capacity, as the config docs advise.
//! - ext-proc's `Instant`s are virtual: a fixed base plus the simulated time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_ext_proc::config::{
    DEFAULT_HOTSPOT_FACTOR, DEFAULT_HOTSPOT_MIN_MS, DEFAULT_KV_USAGE_MS,
    DEFAULT_PREFILL_MS_PER_TOKEN, DEFAULT_QUEUE_MS_PER_REQUEST, DEFAULT_RUNNING_MS_PER_REQUEST,
    DEFAULT_SCRAPE_INTERVAL, DEFAULT_SPECULATIVE_TTL, ScoringConfig,
};
use kvroute_ext_proc::load::{InflightGuard, LoadBoard, Scraped};
use kvroute_ext_proc::metrics::Metrics;
use kvroute_ext_proc::policy::{self, Candidate};
use kvroute_ext_proc::prefix_memory::PrefixMemory;
use kvroute_index::event::KvEvent;
use kvroute_index::index::{
    BlockIndex, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId,
};
use rand::rngs::StdRng;

use super::{Decision, Router, View};
use crate::BLOCK_TOKENS;
use crate::trace::Request;

/// The index pool's model name.
const MODEL: &str = "replay";

/// ext-proc's default scoring weights.
pub fn default_scoring() -> ScoringConfig {
    ScoringConfig {
        prefill_ms_per_token: DEFAULT_PREFILL_MS_PER_TOKEN,
        queue_ms_per_request: DEFAULT_QUEUE_MS_PER_REQUEST,
        running_ms_per_request: DEFAULT_RUNNING_MS_PER_REQUEST,
        kv_usage_ms: DEFAULT_KV_USAGE_MS,
        hotspot_factor: DEFAULT_HOTSPOT_FACTOR,
        hotspot_min_ms: DEFAULT_HOTSPOT_MIN_MS,
        speculative_ttl: DEFAULT_SPECULATIVE_TTL,
    }
}

/// The router.
#[derive(Debug)]
pub struct Kvroute {
    names: Vec<String>,
    index: BlockIndex,
    loads: LoadBoard,
    memory: PrefixMemory,
    scoring: ScoringConfig,
    approx_capacity_blocks: usize,
    /// In-flight accounting of requests not yet at their first token, by request id.
    guards: HashMap<usize, InflightGuard>,
    base: Instant,
    rng: StdRng,
    /// Events the index refused (should stay 0).
    rejected_blocks: usize,
}

impl Kvroute {
    /// For `replicas` replicas of `blocks` KV blocks each, with ext-proc's default scoring.
    pub fn new(replicas: usize, blocks: u32, rng: StdRng) -> Self {
        Self::with_scoring(replicas, blocks, default_scoring(), rng)
    }

    /// With explicit scoring weights.
    pub fn with_scoring(replicas: usize, blocks: u32, scoring: ScoringConfig, rng: StdRng) -> Self {
        let index = BlockIndex::new(IndexConfig::default(), IndexMetrics::unregistered());
        let names: Vec<String> = (0..replicas).map(|i| format!("r{i}")).collect();
        // Registration cannot fail on a fresh index with distinct ids; a failure would show as
        // replicas the index never matches.
        let _ = index.add_pool(PoolConfig {
            model: MODEL.to_owned(),
            block_size: BLOCK_TOKENS,
            keys: PoolKeys::VllmExact { validator: None },
        });
        for (i, name) in names.iter().enumerate() {
            let _ = index.add_replica(ReplicaId(i as u32), name, MODEL);
        }
        let loads = LoadBoard::new(Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        Kvroute {
            names,
            index,
            loads,
            memory: PrefixMemory::default(),
            scoring,
            approx_capacity_blocks: blocks as usize,
            guards: HashMap::new(),
            base: Instant::now(),
            rng,
            rejected_blocks: 0,
        }
    }

    fn instant(&self, now_us: u64) -> Instant {
        self.base + Duration::from_micros(now_us)
    }

    /// Blocks the index refused so far.
    pub fn rejected_blocks(&self) -> usize {
        self.rejected_blocks
    }
}

impl Router for Kvroute {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let now = self.instant(view.now_us);
        let keys = request.keys();
        let prompt_tokens = request.input_tokens as usize;
        let indexed: Vec<u32> = match self.index.find_matches(MODEL, keys, None) {
            Ok(matches) => {
                let mut by_replica = vec![0; self.names.len()];
                for m in matches.iter().filter(|m| m.precise) {
                    if let Some(slot) = by_replica.get_mut(m.replica.0 as usize) {
                        *slot = m.matched_blocks;
                    }
                }
                by_replica
            }
            Err(_) => vec![0; self.names.len()],
        };
        let candidates: Vec<Candidate> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let remembered = self
                    .memory
                    .lookup(name, keys, now, self.scoring.speculative_ttl);
                let load = self.loads.replica(name);
                let shared_blocks = load.inflight_shared_blocks(keys) as usize;
                Candidate {
                    matched_blocks: indexed[i].max(remembered.speculative),
                    shared_inflight_tokens: (shared_blocks * BLOCK_TOKENS as usize)
                        .min(prompt_tokens),
                    load: load.snapshot(),
                }
            })
            .collect();
        let choice = policy::choose(
            &candidates,
            prompt_tokens,
            BLOCK_TOKENS,
            &self.scoring,
            &mut self.rng,
        );
        let replica = choice.map_or(0, |c| c.index);
        let matched = candidates.get(replica).map_or(0, |c| c.matched_blocks);
        let cached_tokens = (matched as usize * BLOCK_TOKENS as usize).min(prompt_tokens);
        let name = &self.names[replica];
        self.memory
            .record(name, self.approx_capacity_blocks, keys, now);
        let guard = self
            .loads
            .start_request(name, prompt_tokens - cached_tokens, keys.to_vec());
        self.guards.insert(request.id, guard);
        Decision {
            replica,
            predicted_blocks: Some(matched),
        }
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], _now_us: u64) {
        match self.index.apply_events(ReplicaId(replica as u32), events) {
            Ok(outcome) => self.rejected_blocks += outcome.blocks_rejected,
            Err(_) => self.rejected_blocks += events.len(),
        }
    }

    fn on_first_token(&mut self, _replica: usize, request: &Request, _now_us: u64) {
        self.guards.remove(&request.id);
    }

    fn tick_interval_us(&self) -> Option<u64> {
        Some(DEFAULT_SCRAPE_INTERVAL.as_micros() as u64)
    }

    fn on_tick(&mut self, view: &View<'_>) {
        for (name, engine) in self.names.iter().zip(view.engines) {
            self.loads.replica(name).record_scrape(Scraped {
                waiting: engine.waiting() as f64,
                running: engine.running() as f64,
                kv_usage: engine.kv_usage(),
            });
        }
    }
}
