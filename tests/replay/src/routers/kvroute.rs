//! kvroute, with its own code: the real index core (`kvroute_index_core::index::BlockIndex`) fed the
//! engines' KV events after the configured delay, and the routing core ext-proc's picker runs
//! (`kvroute_routing::Router`: policy, load board, routed-prefix memory, the score-and-commit
//! step) with the default `ScoringConfig`. This file is only the glue the picker's I/O would be:
//! the index's answer per replica (`precise` ones only, as the picker trusts them) and scrapes.
//!
//! Simulation choices:
//! - Scrapes: every `DEFAULT_SCRAPE_INTERVAL` (500 ms) the engines' waiting, running and KV
//!   usage are recorded on the load board (`ReplicaLoad::record_scrape`), as the scrape loop
//!   does from `/metrics`.
//! - In-flight guards are released at the first token (a streamed response's headers).
//! - Keys are the trace's chained keys (the pool is vLLM-exact: the published hash is the key).
//! - `approx_capacity_blocks` is the replica's KV capacity, as the config docs advise.
//! - The router's `Instant`s are virtual: a fixed base plus the simulated time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_index_core::event::KvEvent;
use kvroute_index_core::index::{
    BlockIndex, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId,
};
use kvroute_routing::load::{DEFAULT_SCRAPE_INTERVAL, InflightGuard, LoadBoard, Scraped};
use kvroute_routing::{Indexed, PromptFacts, RouteRequest, Router as RoutingCore, ScoringConfig};
use rand::rngs::StdRng;

use super::{Decision, Router, View};
use crate::BLOCK_TOKENS;
use crate::trace::Request;

/// The index pool's model name.
const MODEL: &str = "replay";

/// The router.
#[derive(Debug)]
pub struct Kvroute {
    names: Vec<String>,
    index: BlockIndex,
    core: RoutingCore,
    scoring: ScoringConfig,
    approx_capacity_blocks: usize,
    /// In-flight accounting of requests not yet at their first token, by request id.
    guards: HashMap<usize, InflightGuard>,
    /// Whether the engines' KV events reach the index (otherwise: the approximate tier only).
    events: bool,
    base: Instant,
    /// Events the index refused (should stay 0).
    rejected_blocks: usize,
}

impl Kvroute {
    /// For `replicas` replicas of `blocks` KV blocks each, with ext-proc's default scoring.
    pub fn new(replicas: usize, blocks: u32, rng: StdRng) -> Self {
        Self::with_scoring(replicas, blocks, ScoringConfig::default(), rng)
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
            attention_chunk_size: None,
        });
        for (i, name) in names.iter().enumerate() {
            let _ = index.add_replica(ReplicaId(i as u32), name, MODEL);
        }
        Kvroute {
            names,
            index,
            core: RoutingCore::with_rng(LoadBoard::default(), rng),
            scoring,
            approx_capacity_blocks: blocks as usize,
            guards: HashMap::new(),
            events: true,
            base: Instant::now(),
            rejected_blocks: 0,
        }
    }

    fn instant(&self, now_us: u64) -> Instant {
        self.base + Duration::from_micros(now_us)
    }

    /// As a fleet whose engines publish no KV events (ext-proc's `events: false` pool): every
    /// decision comes from kvroute's own routing memory and the loads.
    pub fn without_events(mut self) -> Self {
        self.events = false;
        self
    }

    /// The routing core's load board (scrapes are recorded there).
    pub fn loads(&self) -> &LoadBoard {
        self.core.loads()
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
        let mut indexed: Vec<Option<Indexed>> = vec![None; self.names.len()];
        if self.events
            && let Ok(matches) = self.index.find_matches(MODEL, keys, None)
        {
            for m in matches.iter().filter(|m| m.precise) {
                if let Some(slot) = indexed.get_mut(m.replica.0 as usize) {
                    *slot = Some(Indexed {
                        matched_blocks: m.matched_blocks,
                        prefix_blocks: m.prefix_blocks,
                    });
                }
            }
        }
        let candidates: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let routed = self.core.score_and_commit(RouteRequest {
            candidates: &candidates,
            prompt: Some(PromptFacts {
                keys: keys.to_vec(),
                prompt_tokens: request.input_tokens as usize,
                indexed,
            }),
            block_size: BLOCK_TOKENS,
            capacity_blocks: self.approx_capacity_blocks,
            scoring: &self.scoring,
            now,
            commit: true,
        });
        let Some(routed) = routed else {
            // No replicas: the simulator never builds a fleet without one.
            return Decision {
                replica: 0,
                predicted_blocks: None,
            };
        };
        self.guards.insert(request.id, routed.inflight);
        Decision {
            replica: routed.choice,
            predicted_blocks: Some(routed.matched_blocks),
        }
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], _now_us: u64) {
        if !self.events {
            return;
        }
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
            self.loads().replica(name).record_scrape(Scraped {
                waiting: engine.waiting() as f64,
                running: engine.running() as f64,
                kv_usage: engine.kv_usage(),
            });
        }
    }
}
