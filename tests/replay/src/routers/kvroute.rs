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
use kvroute_routing::policy::queue_ms;
use kvroute_routing::{
    Indexed, PeerDecision, PoolSide, PrefillSide, PromptFacts, RouteRequest, Router as RoutingCore,
    ScoringConfig, SplitRule, SplitVerdict,
};
use rand::rngs::StdRng;

use super::{Decision, Pair, Router, View};
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
    /// In-flight accounting of requests not yet at their first token, by request id and
    /// replica (a split request holds one on each of its replicas).
    guards: HashMap<(usize, usize), InflightGuard>,
    /// Disaggregating: the split thresholds.
    split: Option<SplitRule>,
    /// The routing core's predicted cached tokens at the last choice.
    cached_tokens: usize,
    /// Every split verdict so far, in routing order.
    verdicts: Vec<SplitVerdict>,
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
            split: None,
            cached_tokens: 0,
            verdicts: Vec::new(),
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

    /// As ext-proc's disaggregated pool with these thresholds: replicas
    /// `0..View::prefill_replicas` are the prefill pool, the rest the decode pool.
    pub fn disaggregating(mut self, rule: SplitRule) -> Self {
        self.split = Some(rule);
        self
    }

    /// Every split verdict so far, in routing order.
    pub fn verdicts(&self) -> &[SplitVerdict] {
        &self.verdicts
    }

    /// Prompt tokens the last committed choice left to compute (what its replica queues).
    pub fn last_pending_tokens(&self, request: &Request) -> usize {
        (request.input_tokens as usize).saturating_sub(self.cached_tokens)
    }

    /// Another picker sent `request` to `replica` with `pending_tokens` to compute: counted here
    /// as if decided here, until [`Kvroute::peer_answered`].
    pub fn record_peer_decision(
        &mut self,
        request: &Request,
        replica: usize,
        pending_tokens: usize,
        now_us: u64,
    ) {
        let guard = self.core.record_peer_decision(
            &self.names[replica],
            self.approx_capacity_blocks,
            BLOCK_TOKENS,
            PeerDecision {
                keys: request.keys().to_vec(),
                prompt_tokens: request.input_tokens as usize,
                pending_prompt_tokens: pending_tokens,
            },
            self.instant(now_us),
        );
        self.guards.insert((request.id, replica), guard);
    }

    /// The peer's request reached its first token.
    pub fn peer_answered(&mut self, request_id: usize, replica: usize) {
        self.guards.remove(&(request_id, replica));
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

impl Kvroute {
    /// The routing core's choice among `pool` (replica indices, `side` of the fleet's one pool),
    /// committed: what ext-proc's picker does for one pool of candidates. `None` only for an
    /// empty pool.
    fn route_among(
        &mut self,
        request: &Request,
        now_us: u64,
        side: PoolSide<'_>,
        pool: &[usize],
    ) -> Option<Decision> {
        let now = self.instant(now_us);
        let keys = request.keys();
        let mut indexed: Vec<Option<Indexed>> = vec![None; pool.len()];
        if self.events
            && let Ok(matches) = self.index.find_matches(MODEL, keys, None)
        {
            for m in matches.iter().filter(|m| m.precise) {
                let replica = m.replica.0 as usize;
                if let Some(slot) = pool
                    .iter()
                    .position(|r| *r == replica)
                    .and_then(|i| indexed.get_mut(i))
                {
                    *slot = Some(Indexed {
                        matched_blocks: m.matched_blocks,
                        prefix_blocks: m.prefix_blocks,
                    });
                }
            }
        }
        let candidates: Vec<&str> = pool.iter().map(|r| self.names[*r].as_str()).collect();
        let routed = self.core.score_and_commit(RouteRequest {
            pool: side,
            candidates: &candidates,
            handles: None,
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
        })?;
        let replica = pool[routed.choice];
        self.guards.insert((request.id, replica), routed.inflight);
        self.cached_tokens = routed.cached_tokens;
        Some(Decision {
            replica,
            predicted_blocks: Some(routed.matched_blocks),
        })
    }
}

impl Router for Kvroute {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        let all: Vec<usize> = (0..self.names.len()).collect();
        // No replicas: the simulator never builds a fleet without one.
        self.route_among(request, view.now_us, PoolSide::serving(MODEL), &all)
            .unwrap_or(Decision {
                replica: 0,
                predicted_blocks: None,
            })
    }

    fn disaggregated(&self) -> bool {
        self.split.is_some()
    }

    /// ext-proc's disaggregated pool: the decode replica by the routing core, the shared split
    /// verdict on the tokens the core predicts cached there, then the prefill replica by the
    /// routing core on the prefill pool.
    fn route_pair(&mut self, request: &Request, view: &View<'_>) -> Pair {
        let Some(rule) = self.split else {
            return Pair {
                decode: self.route(request, view),
                prefill: None,
            };
        };
        let decode = self
            .route_among(
                request,
                view.now_us,
                PoolSide::serving(MODEL),
                &view.decode_pool(),
            )
            .unwrap_or(Decision {
                replica: 0,
                predicted_blocks: None,
            });
        let prefill_pool = view.prefill_pool();
        // As the picker: prefill replicas whose estimated queue is at the rule's bound take no
        // leg.
        let queue_of = |r: usize| {
            let load = self.loads().replica(&self.names[r]).snapshot();
            queue_ms(&load, &self.scoring)
        };
        let decode_queue_ms = queue_of(decode.replica);
        let admitted: Vec<usize> = prefill_pool
            .iter()
            .copied()
            .filter(|r| rule.admits_prefill_queue(queue_of(*r), decode_queue_ms))
            .collect();
        let verdict = SplitVerdict::of(
            &rule,
            request.input_tokens as usize,
            self.cached_tokens,
            PrefillSide::of(prefill_pool.len(), admitted.len()),
        );
        self.verdicts.push(verdict);
        let prefill = if verdict == SplitVerdict::Split {
            // As the picker: the decode replica no longer queues this prompt's prefill.
            if let Some(guard) = self.guards.get_mut(&(request.id, decode.replica)) {
                guard.prefilled_elsewhere();
            }
            self.route_among(request, view.now_us, PoolSide::prefill(MODEL), &admitted)
                .map(|d| d.replica)
        } else {
            None
        };
        Pair { decode, prefill }
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

    fn on_first_token(&mut self, replica: usize, request: &Request, _now_us: u64) {
        self.guards.remove(&(request.id, replica));
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
