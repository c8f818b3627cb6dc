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
        let mut s = default_scoring();
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = env("W_PREFILL") { s.prefill_ms_per_token = v; }
        if let Some(v) = env("W_QUEUE") { s.queue_ms_per_request = v; }
        if let Some(v) = env("W_RUNNING") { s.running_ms_per_request = v; }
        if let Some(v) = env("W_KV") { s.kv_usage_ms = v; }
        if let Some(v) = env("W_HOTMIN") { s.hotspot_min_ms = v; }
        if let Some(v) = env("W_HOTF") { s.hotspot_factor = v; }
        Self::with_scoring(replicas, blocks, s, rng)
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
        let choice = if std::env::var_os("KVPROTO").is_some() { proto::choose(&candidates, prompt_tokens, BLOCK_TOKENS, &self.scoring, &mut self.rng) } else { policy::choose(
            &candidates,
            prompt_tokens,
            BLOCK_TOKENS,
            &self.scoring,
            &mut self.rng,
        ) };
        let replica = choice.map_or(0, |c| c.index);
        if std::env::var_os("KVROUTE_DEBUG").is_some() {
            let q: Vec<f64> = candidates.iter().map(|c| policy::queue_ms(&c.load, &self.scoring).round()).collect();
            let m: Vec<u32> = candidates.iter().map(|c| c.matched_blocks).collect();
            let it: Vec<f64> = candidates.iter().map(|c| c.load.inflight_prompt_tokens).collect();
            let sc: Vec<(f64,f64,f64)> = candidates.iter().map(|c| (c.load.scraped.waiting, c.load.scraped.running, (c.load.scraped.kv_usage*100.0).round())).collect();
            eprintln!("DBG req {} in={} matched={m:?} queue={q:?} inflight_tok={it:?} scraped={sc:?} chosen={replica} {:?}", request.id, prompt_tokens, choice.map(|c| c.reason));
        }
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

#[allow(clippy::all, missing_docs)]
mod proto {
    use kvroute_ext_proc::config::ScoringConfig;
    use kvroute_ext_proc::load::LoadSnapshot;
    use kvroute_ext_proc::policy::{Candidate, Choice, Reason};
    use rand::Rng;
    fn mode(k: &str) -> String { std::env::var(k).unwrap_or_default() }
    /// (queue for ttft, load for guard)
    fn parts(load: &LoadSnapshot, w: &ScoringConfig) -> (f64, f64, f64) {
        let (uw, ur) = if load.scraped.waiting > 0.0 { (load.routed_since_scrape, 0.0) } else { (0.0, load.routed_since_scrape) };
        let work = w.prefill_ms_per_token * load.inflight_prompt_tokens;
        let waiting = w.queue_ms_per_request * (load.scraped.waiting + uw);
        let batch = w.running_ms_per_request * (load.scraped.running + ur) + w.kv_usage_ms * load.scraped.kv_usage;
        (work, waiting, batch)
    }
    pub fn choose(candidates: &[Candidate], prompt_tokens: usize, block_size: u32, weights: &ScoringConfig, rng: &mut impl Rng) -> Option<Choice> {
        if candidates.is_empty() { return None; }
        let qmode = mode("QMODE"); let gmode = mode("GMODE");
        let shared = |i: usize| { let c = &candidates[i]; (c.shared_inflight_tokens as f64).min(c.load.inflight_prompt_tokens).min(prompt_tokens as f64) };
        let queues: Vec<f64> = candidates.iter().map(|c| { let (wk, wt, b) = parts(&c.load, weights); if qmode == "max" { wk.max(wt) + b } else { wk + wt + b } }).collect();
        let guard_load: Vec<f64> = (0..candidates.len()).map(|i| { let (wk, wt, b) = parts(&candidates[i].load, weights); match gmode.as_str() {
            "crowd" => wt + b,
            "credit" => (queues[i] - weights.prefill_ms_per_token * shared(i)).max(0.0),
            "off" => 0.0,
            _ => { let _ = (wk, wt, b); queues[i] } } }).collect();
        let mean = guard_load.iter().sum::<f64>() / guard_load.len() as f64;
        let hot = |q: f64| q > weights.hotspot_factor * mean && q > weights.hotspot_min_ms;
        let all_hot = guard_load.iter().all(|q| hot(*q));
        let eligible = |i: usize| all_hot || !hot(guard_load[i]);
        let ttft = |i: usize| {
            let c = &candidates[i];
            let cached = (c.matched_blocks as usize).saturating_mul(block_size as usize);
            (queues[i] - weights.prefill_ms_per_token * shared(i)).max(0.0) + weights.prefill_ms_per_token * prompt_tokens.saturating_sub(cached) as f64
        };
        let tie_ms: f64 = std::env::var("TIE_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(1e-6);
        let best = (0..candidates.len()).filter(|i| eligible(*i)).map(ttft).fold(f64::INFINITY, f64::min);
        let ties: Vec<usize> = (0..candidates.len()).filter(|i| eligible(*i) && ttft(*i) <= best + tie_ms).collect();
        let ties: Vec<usize> = if mode("TIEMODE") == "queue" {
            let lq = ties.iter().map(|i| queues[*i]).fold(f64::INFINITY, f64::min);
            ties.into_iter().filter(|i| queues[*i] <= lq + 1e-6).collect()
        } else {
            let longest = ties.iter().map(|i| candidates[*i].matched_blocks).max().unwrap_or(0);
            ties.into_iter().filter(|i| candidates[*i].matched_blocks == longest).collect()
        };
        let index = ties[rng.random_range(0..ties.len())];
        Some(Choice { index, reason: Reason::CacheHit, ttft_ms: ttft(index) })
    }
}
