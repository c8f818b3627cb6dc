//! The one score-and-commit step: what every kvroute router (ext-proc's picker, kvroute-replay's
//! simulation of it) runs once it knows a request's block keys and the index's answer.
//!
//! Per candidate replica the policy sees:
//! - `matched_blocks`: with a precise index answer for it, the index's, or kvroute's own inserts
//!   of the last `speculative_ttl` past the index's full-attention prefix while a request carrying
//!   them is still in flight there (its events have not landed yet; once it is answered the index
//!   knows better, evictions included);
//!   without one (no index, no events, the index does not vouch for it), the approximate memory
//!   of everything routed there;
//! - the in-flight prompt tokens it shares with a sibling already being prefilled there;
//! - its load snapshot.
//!
//! The choice is then committed before anyone else scores: the chosen replica remembers the keys
//! (speculative insert) and counts the request in flight. Decisions whose first block key is the
//! same (siblings of a burst) take the same commit stripe, so each sees the previous one's
//! commit; nothing here waits on I/O, so the stripe is held for microseconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::load::{
    InflightGuard, LoadBoard, Prediction, RecentAverage, ReplicaLoad, engine_hit_tokens,
};
use crate::policy::{self, Candidate, PoolState, Reason};
use crate::prefix_memory::{MemoryHandle, PrefixMemory};
use crate::scoring::ScoringConfig;

/// Number of stripes of the commit lock (decisions whose prompts start alike share a stripe).
const COMMIT_STRIPES: usize = 16;

/// Which information decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// The index vouched for the chosen replica's cached prefix.
    Precise,
    /// kvroute's own memory of what it routed (no usable events for the chosen replica).
    Approximate,
    /// Load alone (no prefix information).
    Load,
}

impl Tier {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Precise => "precise",
            Self::Approximate => "approximate",
            Self::Load => "load",
        }
    }
}

/// What is known about a request's prompt.
#[derive(Debug, Clone, Default)]
pub struct PromptFacts {
    /// Its block keys (chained).
    pub keys: Vec<u64>,
    /// Its length in tokens (estimated when only a leading part was tokenized).
    pub prompt_tokens: usize,
    /// Per candidate (same order), what the index says of it, when the index answered and
    /// vouches for that replica (`precise`); `None` otherwise. Shorter than the candidates means
    /// `None` for the rest.
    pub indexed: Vec<Option<Indexed>>,
}

/// The index's precise answer for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Indexed {
    /// The leading blocks the engine would reuse there.
    pub matched_blocks: u32,
    /// How far its full-attention KV-cache group holds the prompt (`matched_blocks` for dense
    /// models; more for a hybrid one whose sliding-window blocks before the cut are gone).
    pub prefix_blocks: u32,
}

impl Indexed {
    /// A dense model's answer: what it holds is what it reuses.
    pub fn dense(matched_blocks: u32) -> Self {
        Indexed {
            matched_blocks,
            prefix_blocks: matched_blocks,
        }
    }

    /// The blocks the engine would reuse, given kvroute's own recent inserts there: those count
    /// only past what the index already holds (their events have not landed yet). Below it the
    /// index knows better: a hybrid model can hold a prefix and still reuse less of it.
    fn with_speculative(self, speculative: u32) -> u32 {
        if speculative > self.prefix_blocks {
            self.matched_blocks.max(speculative)
        } else {
            self.matched_blocks
        }
    }
}

/// One request to route.
#[derive(Debug)]
pub struct RouteRequest<'a> {
    /// Whose recent load the decision reads and adds to (`policy` module docs, hotspot guard).
    pub pool: PoolSide<'a>,
    /// Candidate replica ids (non-empty to get a choice).
    pub candidates: &'a [&'a str],
    /// The candidates' state, in the same order, when the caller keeps it resolved
    /// ([`Router::replica_handles`], while [`Router::epoch`] stays the same): a pool of a
    /// thousand is then not looked up by name per decision. `None`, or another length: looked
    /// up here.
    pub handles: Option<&'a [&'a ReplicaHandle]>,
    /// The prompt's facts; `None` routes on load alone.
    pub prompt: Option<PromptFacts>,
    /// The pool's block size in tokens.
    pub block_size: u32,
    /// The pool's approximate memory capacity per replica, in blocks.
    pub capacity_blocks: usize,
    /// The policy's weights.
    pub scoring: &'a ScoringConfig,
    /// The decision's time (a simulator passes its virtual clock).
    pub now: Instant,
    /// Whether the choice is applied, so recorded: the speculative insert and the in-flight load
    /// on the chosen replica. A shadow decision's is not (the proxy places the request; the
    /// replica that served it is remembered once known, [`Router::remember_served`]).
    pub commit: bool,
}

/// A pool, or its prefill side (a disaggregated pool's prefill leg picks among other replicas):
/// each keeps how busy it has been.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSide<'a> {
    /// The pool's name, from configuration (never from a request).
    pub pool: &'a str,
    /// Whether the candidates are the pool's prefill replicas, for a prefill leg.
    pub prefill: bool,
}

impl<'a> PoolSide<'a> {
    /// The replicas that serve a pool's requests.
    pub fn serving(pool: &'a str) -> Self {
        PoolSide {
            pool,
            prefill: false,
        }
    }

    /// A disaggregated pool's prefill replicas.
    pub fn prefill(pool: &'a str) -> Self {
        PoolSide {
            pool,
            prefill: true,
        }
    }
}

/// How busy one [`PoolSide`] has been.
#[derive(Debug)]
struct RecentLoad {
    pool: String,
    prefill: bool,
    /// The candidates' mean queued prefill (ms), over the last seconds.
    queued_prefill_ms: RecentAverage,
}

/// Another picker's decision, as it announced it ([`Router::record_peer_decision`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerDecision {
    /// The prompt's block keys: the replica will hold them.
    pub keys: Vec<u64>,
    /// The prompt's length in tokens; 0 when the peer did not say.
    pub prompt_tokens: usize,
    /// Prompt tokens the deciding picker counted as the replica's work for it (what it saw
    /// the replica not hold).
    pub pending_prompt_tokens: usize,
}

/// A committed choice. Dropping `inflight` ends the replica's in-flight accounting.
#[derive(Debug)]
pub struct Routed {
    /// Index into the candidates.
    pub choice: usize,
    /// Which information decided.
    pub tier: Tier,
    /// The policy's reason; `None` on the load tier (the caller knows why it had no prompt).
    pub reason: Option<Reason>,
    /// Leading blocks believed cached on the chosen replica.
    pub matched_blocks: u32,
    /// Prompt tokens the engine will reuse there, as far as kvroute knows now (what a client is
    /// told): the index's answer, and kvroute's own inserts while their requests are in flight.
    pub cached_tokens: usize,
    /// What the engine should report as its prefix-cache hit, by kvroute's belief
    /// (`matched_blocks`: the drift's expected side, precise and approximate tiers).
    pub prediction: Option<Prediction>,
    /// The request's in-flight accounting on the chosen replica.
    pub inflight: InflightGuard,
    /// The other candidates, best first (`policy::fallback_order`): where a proxy's retries go.
    pub fallbacks: Vec<usize>,
    /// What every candidate looked like when the choice was made (moved here, not copied): what
    /// a decision record explains and what shadow mode compares with the replica that served.
    pub scored: Scored,
}

/// Every candidate as scored, in the candidates' order.
#[derive(Debug, Clone, Default)]
pub struct Scored {
    /// The policy's view of each (blocks believed held, shared in-flight tokens, load).
    pub views: Vec<Candidate>,
    /// The index's precise answer for each, where it vouched for it.
    pub indexed: Vec<Option<Indexed>>,
    /// Leading blocks each would reuse now (what a client would be told had it been chosen).
    pub reusable_blocks: Vec<u32>,
    /// The prompt's length in tokens (0 on the load tier).
    pub prompt_tokens: usize,
    /// The pool's block size.
    pub block_size: u32,
    /// How busy the pool had been (what the policy counted as cached depends on it).
    pub pool: PoolState,
}

impl Scored {
    /// Prompt tokens candidate `i` would serve from its prefix cache now, as vLLM counts a hit:
    /// the index's answer, and kvroute's own inserts only while their requests are in flight.
    pub fn reusable_tokens(&self, i: usize) -> usize {
        self.reusable_blocks.get(i).map_or(0, |&blocks| {
            engine_hit_tokens(blocks, self.prompt_tokens, self.block_size)
        })
    }

    /// Prompt tokens candidate `i` is believed to serve from its prefix cache once the request
    /// is scheduled there: what scoring read (the index, and kvroute's own inserts of the
    /// speculative TTL, answered or not) — the drift's expected side.
    pub fn believed_tokens(&self, i: usize) -> usize {
        self.views.get(i).map_or(0, |view| {
            engine_hit_tokens(view.matched_blocks, self.prompt_tokens, self.block_size)
        })
    }

    /// The most prompt tokens any candidate is believed to serve from its prefix cache.
    pub fn held_tokens(&self) -> usize {
        (0..self.views.len())
            .map(|i| self.believed_tokens(i))
            .max()
            .unwrap_or(0)
    }

    /// Estimated time to first token on candidate `i`, ms (the policy's estimate, without the
    /// recompute penalty and hotspot rule that shape the choice).
    pub fn estimated_ttft_ms(&self, i: usize, weights: &ScoringConfig) -> Option<f64> {
        let view = self.views.get(i)?;
        Some(policy::estimated_ttft_ms(
            view,
            self.pool,
            self.prompt_tokens,
            self.block_size,
            weights,
        ))
    }
}

/// One replica's state as a decision reads it — its load record and routed-prefix memory —
/// resolved by name once ([`Router::replica_handles`]).
#[derive(Debug, Clone)]
pub struct ReplicaHandle {
    load: Arc<ReplicaLoad>,
    memory: MemoryHandle,
}

impl ReplicaHandle {
    /// The replica's load record.
    pub fn load(&self) -> &Arc<ReplicaLoad> {
        &self.load
    }
}

/// The router's per-replica tables' state ([`Router::epoch`]): handles resolved under one
/// epoch are the router's own while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterEpoch {
    loads: u64,
    memory: u64,
}

/// Replica loads, routed-prefix memory and the commit step over them.
#[derive(Debug)]
pub struct Router {
    loads: LoadBoard,
    /// How busy each pool side has been (as many as the pools configured, twice at most).
    recent_loads: Mutex<Vec<RecentLoad>>,
    memory: PrefixMemory,
    commit_locks: [Mutex<()>; COMMIT_STRIPES],
    /// Breaks ties between equal estimates; seeded for reproducible runs.
    rng: Mutex<StdRng>,
}

impl Router {
    /// A router over `loads`, ties broken by an OS-seeded generator.
    pub fn new(loads: LoadBoard) -> Self {
        Self::with_rng(loads, StdRng::from_os_rng())
    }

    /// A router whose ties follow `rng` (simulations, tests).
    pub fn with_rng(loads: LoadBoard, rng: StdRng) -> Self {
        Self {
            loads,
            recent_loads: Mutex::new(Vec::new()),
            memory: PrefixMemory::default(),
            commit_locks: std::array::from_fn(|_| Mutex::new(())),
            rng: Mutex::new(rng),
        }
    }

    /// Replica loads (scrapers record into it; responses release their guards).
    pub fn loads(&self) -> &LoadBoard {
        &self.loads
    }

    /// What kvroute routed where (tests and simulations seed it).
    pub fn memory(&self) -> &PrefixMemory {
        &self.memory
    }

    /// The state of the tables [`Self::replica_handles`] resolves from: it changes when a
    /// replica's record or memory may have been dropped ([`Self::retain`]), after which handles
    /// resolved before may be ones the router no longer updates. Read it before resolving.
    pub fn epoch(&self) -> RouterEpoch {
        RouterEpoch {
            loads: self.loads.epoch(),
            memory: self.memory.epoch(),
        }
    }

    /// The state of `replicas` (id, routed-prefix memory capacity in blocks should it be
    /// created), in order, created where none is yet.
    pub fn replica_handles(&self, replicas: &[(&str, usize)]) -> Vec<ReplicaHandle> {
        let ids: Vec<&str> = replicas.iter().map(|(id, _)| *id).collect();
        self.loads
            .replicas(&ids)
            .into_iter()
            .zip(self.memory.handles(replicas))
            .map(|(load, memory)| ReplicaHandle { load, memory })
            .collect()
    }

    /// Forgets replicas `keep` says no (a reload removed them).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.memory.retain(&keep);
        self.loads.retain(&keep);
    }

    /// A request was served by `replica`, not the one chosen (a retry walked the fallback list):
    /// that replica computed the prompt's blocks, so the approximate tier remembers them there.
    /// (The chosen one keeps its memory of them until it ages out: it may hold them from an
    /// earlier request, and memory is only ever a hint the index overrides.)
    pub fn remember_served(
        &self,
        replica: &str,
        capacity_blocks: usize,
        keys: &[u64],
        now: Instant,
    ) {
        if !keys.is_empty() {
            let memory = self.memory.handle(replica, capacity_blocks);
            memory.record(keys, now);
            memory.mark_computed(keys);
        }
    }

    /// Another picker's committed decision, as this one would have committed it: `replica` will
    /// hold its keys (routed-prefix memory) and has its pending prefill queued until the returned
    /// guard is released (when that picker saw the request's first token). Carries no
    /// prediction: the drift of a replica counts this picker's own.
    ///
    /// The pending prefill counts net of the prefix requests already in flight there compute,
    /// as a decision made here does: siblings of a burst that reach two pickers within the
    /// sharing delay are each decided without the other, and each picker counts the shared
    /// prefix as its own request's work; the engine computes it once. Counted twice, it made the
    /// holder look twice as busy to every later sibling, which then left it (in kvroute-replay,
    /// four pickers sharing 0.1 ms late: fan-out's TTFT p90 11 % above one picker's; counted
    /// net, 1.5 %).
    pub fn record_peer_decision(
        &self,
        replica: &str,
        capacity_blocks: usize,
        block_size: u32,
        decision: PeerDecision,
        now: Instant,
    ) -> InflightGuard {
        let PeerDecision {
            keys,
            prompt_tokens,
            pending_prompt_tokens,
        } = decision;
        let memory = self.memory.handle(replica, capacity_blocks);
        memory.record(&keys, now);
        let pending = match prompt_tokens {
            // A peer that does not say how long the prompt is (an older release): as it counted.
            0 => pending_prompt_tokens,
            _ => {
                let in_flight = self.loads.replica(replica).inflight_shared_blocks(&keys);
                let computed_there = engine_hit_tokens(in_flight, prompt_tokens, block_size);
                pending_prompt_tokens.min(prompt_tokens.saturating_sub(computed_there))
            }
        };
        self.loads
            .start_request(replica, pending, keys)
            .computing_into(memory)
    }

    /// Whether some candidate holds every block of `keys` by kvroute's memory or a request in
    /// flight there (what scoring reads besides the index).
    pub fn remembers_all(
        &self,
        candidates: &[&str],
        keys: &[u64],
        now: Instant,
        ttl: Duration,
    ) -> bool {
        let all = keys.len();
        self.memory
            .lookup_all(candidates, &[], keys, now, ttl)
            .iter()
            .any(|remembered| remembered.approximate as usize >= all)
            || self
                .loads
                .replicas(candidates)
                .iter()
                .any(|load| load.inflight_shared_blocks(keys) as usize >= all)
    }

    /// Scores `request`'s candidates and commits the choice. `None` only without candidates.
    pub fn score_and_commit(&self, request: RouteRequest<'_>) -> Option<Routed> {
        let RouteRequest {
            pool,
            candidates,
            handles,
            prompt,
            block_size,
            capacity_blocks,
            scoring,
            now,
            commit,
        } = request;
        if candidates.is_empty() {
            return None;
        }
        let resolved;
        let by_reference: Vec<&ReplicaHandle>;
        let handles = match handles {
            Some(handles) if handles.len() == candidates.len() => handles,
            _ => {
                let named: Vec<(&str, usize)> =
                    candidates.iter().map(|id| (*id, capacity_blocks)).collect();
                resolved = self.replica_handles(&named);
                by_reference = resolved.iter().collect();
                &by_reference
            }
        };
        let first_key = prompt.as_ref().and_then(|p| p.keys.first().copied());
        let _commit =
            first_key.map(|key| self.commit_locks[(key % COMMIT_STRIPES as u64) as usize].lock());
        let Some(prompt) = prompt else {
            return Some(self.commit_load_only(pool, candidates, handles, scoring, now, commit));
        };
        let PromptFacts {
            keys,
            prompt_tokens,
            indexed,
        } = prompt;
        // Per candidate, what kvroute believes it holds (scored, and the drift's expectation) and
        // what the engine would reuse there now (the prediction a client is told).
        let mut reusable = Vec::with_capacity(candidates.len());
        // Only the speculative count past the index's prefix matters for a candidate it vouches
        // for (`Indexed::with_speculative`): the memory is read from there on.
        let held: Vec<u32> = (0..candidates.len())
            .map(|i| {
                indexed
                    .get(i)
                    .copied()
                    .flatten()
                    .map_or(0, |found| found.prefix_blocks)
            })
            .collect();
        let memories = PrefixMemory::lookup_handles(
            handles.iter().map(|handle| &handle.memory),
            &held,
            &keys,
            now,
            scoring.speculative_ttl,
        );
        let views: Vec<Candidate> = memories
            .into_iter()
            .zip(handles)
            .enumerate()
            .map(|(i, (remembered, handle))| {
                let load = &handle.load;
                let indexed_here = indexed.get(i).copied().flatten();
                let believed = indexed_here.map_or(remembered.approximate, |found| {
                    found.with_speculative(remembered.speculative)
                });
                let overlap = load.inflight_overlap(&keys, believed);
                let shared_blocks = overlap.shared_blocks as usize;
                let (matched_blocks, reused) = match indexed_here {
                    // A recent insert stands for events that have not landed yet. kvroute keeps
                    // believing it for the TTL (a replica whose engine never stores what kvroute
                    // routed there then shows as drift), and for as long as a request carrying
                    // its keys waits there: an overloaded engine may queue it for longer than
                    // the TTL, and its prefix is still coming. It tells what the engine will
                    // reuse only while such a request is in flight: once the engine answered,
                    // its blocks were stored and the index knows better, evictions since
                    // included.
                    Some(found) => (
                        found.with_speculative(remembered.speculative.max(shared_blocks as u32)),
                        found.with_speculative(shared_blocks as u32),
                    ),
                    None => (remembered.approximate, remembered.approximate),
                };
                reusable.push(reused);
                Candidate {
                    matched_blocks,
                    confirmed_blocks: Some(
                        indexed_here.map_or(remembered.computed, |found| found.matched_blocks),
                    ),
                    shared_inflight_tokens: (shared_blocks * block_size as usize)
                        .min(prompt_tokens),
                    inflight_siblings: (!keys.is_empty()).then_some(overlap.siblings),
                    load: load.snapshot(),
                }
            })
            .collect();
        let recent_prefill_ms = self.recent_prefill_ms(pool, &views, scoring, now);
        let choice = policy::choose(
            &views,
            recent_prefill_ms,
            prompt_tokens,
            block_size,
            scoring,
            &mut *self.rng.lock(),
        )?;
        let matched_blocks = views[choice.index].matched_blocks;
        // vLLM recomputes at least the prompt's last token: a prompt of whole blocks reuses one
        // block less than it holds.
        let cached_tokens = engine_hit_tokens(reusable[choice.index], prompt_tokens, block_size);
        let tier = if indexed.get(choice.index).copied().flatten().is_some() {
            Tier::Precise
        } else {
            Tier::Approximate
        };
        let prediction = Prediction {
            cached_tokens: engine_hit_tokens(matched_blocks, prompt_tokens, block_size) as u64,
            prompt_tokens: prompt_tokens as u64,
        };
        let replica = candidates[choice.index];
        let inflight = if commit {
            let memory = &handles[choice.index].memory;
            memory.record(&keys, now);
            // The replica's pending prefill work is what it does not hold (siblings of a burst
            // add little).
            self.loads
                .start_request(replica, prompt_tokens - cached_tokens, keys)
                .with_prediction(prediction)
                .computing_into(memory.clone())
        } else {
            self.loads.untracked(replica, keys)
        };
        Some(Routed {
            choice: choice.index,
            tier,
            reason: Some(choice.reason),
            matched_blocks,
            cached_tokens,
            prediction: Some(prediction),
            inflight,
            fallbacks: choice.fallbacks,
            scored: Scored {
                views,
                indexed,
                reusable_blocks: reusable,
                prompt_tokens,
                block_size,
                pool: PoolState::of(recent_prefill_ms, scoring),
            },
        })
    }

    /// The pool side's queued prefill over the last seconds, `views` (its candidates now)
    /// folded in: their mean [`policy::queued_prefill_ms`].
    fn recent_prefill_ms(
        &self,
        side: PoolSide<'_>,
        views: &[Candidate],
        scoring: &ScoringConfig,
        now: Instant,
    ) -> f64 {
        let queued = views
            .iter()
            .map(|c| policy::queued_prefill_ms(&c.load, scoring))
            .sum::<f64>()
            / views.len().max(1) as f64;
        let mut loads = self.recent_loads.lock();
        let found = loads
            .iter()
            .position(|load| load.pool == side.pool && load.prefill == side.prefill);
        let index = found.unwrap_or_else(|| {
            loads.push(RecentLoad {
                pool: side.pool.to_owned(),
                prefill: side.prefill,
                queued_prefill_ms: RecentAverage::default(),
            });
            loads.len() - 1
        });
        loads[index].queued_prefill_ms.fold(now, queued)
    }

    /// Load tier: no prefix information.
    fn commit_load_only(
        &self,
        pool: PoolSide<'_>,
        candidates: &[&str],
        handles: &[&ReplicaHandle],
        scoring: &ScoringConfig,
        now: Instant,
        commit: bool,
    ) -> Routed {
        let views: Vec<Candidate> = handles
            .iter()
            .map(|ReplicaHandle { load, .. }| Candidate {
                matched_blocks: 0,
                confirmed_blocks: None,
                shared_inflight_tokens: 0,
                inflight_siblings: None,
                load: load.snapshot(),
            })
            .collect();
        let recent_prefill_ms = self.recent_prefill_ms(pool, &views, scoring, now);
        // The block size does not matter with nothing matched.
        let (choice, fallbacks) = policy::choose(
            &views,
            recent_prefill_ms,
            0,
            1,
            scoring,
            &mut *self.rng.lock(),
        )
        .map_or((0, Vec::new()), |c| (c.index, c.fallbacks));
        Routed {
            choice,
            tier: Tier::Load,
            reason: None,
            matched_blocks: 0,
            cached_tokens: 0,
            prediction: None,
            inflight: if commit {
                self.loads.start_request(candidates[choice], 0, Vec::new())
            } else {
                self.loads.untracked(candidates[choice], Vec::new())
            },
            fallbacks,
            scored: Scored {
                reusable_blocks: vec![0; views.len()],
                views,
                indexed: Vec::new(),
                prompt_tokens: 0,
                block_size: 1,
                pool: PoolState::of(recent_prefill_ms, scoring),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>(
        candidates: &'a [&'a str],
        prompt: Option<PromptFacts>,
        scoring: &'a ScoringConfig,
        now: Instant,
    ) -> RouteRequest<'a> {
        RouteRequest {
            pool: PoolSide::serving("p"),
            candidates,
            handles: None,
            prompt,
            block_size: 16,
            capacity_blocks: 1024,
            scoring,
            now,
            commit: true,
        }
    }

    fn prompt(keys: &[u64], indexed: Vec<Option<u32>>) -> Option<PromptFacts> {
        Some(PromptFacts {
            keys: keys.to_vec(),
            prompt_tokens: keys.len() * 16 + 5,
            indexed: indexed.into_iter().map(|m| m.map(Indexed::dense)).collect(),
        })
    }

    #[test]
    fn recent_inserts_count_only_past_what_the_index_holds() {
        // Dense: the larger of the two, as before.
        assert_eq!(Indexed::dense(3).with_speculative(5), 5);
        assert_eq!(Indexed::dense(5).with_speculative(3), 5);
        // Hybrid: full attention holds 8 blocks, the engine would reuse none (the window before
        // the cut was evicted). A recent insert of 8 blocks says nothing new: 0, not 8.
        let hybrid = Indexed {
            matched_blocks: 0,
            prefix_blocks: 8,
        };
        assert_eq!(hybrid.with_speculative(8), 0);
        // Past the full-attention prefix, the insert's events have not landed: it counts.
        assert_eq!(hybrid.with_speculative(10), 10);
    }

    #[test]
    fn the_index_decides_precisely_and_a_commit_is_seen_by_the_next_sibling() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        // A busy pool's belief in inserts (an idle one scores on what the index confirms).
        let scoring = ScoringConfig {
            idle_pool_ms: 0.0,
            ..ScoringConfig::default()
        };
        let now = Instant::now();
        let candidates = ["r0", "r1", "r2"];
        let keys: Vec<u64> = (1..=100).collect();
        let first = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![Some(0), Some(60), Some(10)]),
                &scoring,
                now,
            ))
            .unwrap();
        assert_eq!(
            (first.choice, first.tier, first.reason, first.matched_blocks),
            (1, Tier::Precise, Some(Reason::CacheHit), 60)
        );
        assert_eq!(first.cached_tokens, 960);
        // The index has not seen the first request's blocks: the speculative insert carries it.
        let sibling = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![Some(0), Some(60), Some(10)]),
                &scoring,
                now,
            ))
            .unwrap();
        assert_eq!((sibling.choice, sibling.matched_blocks), (1, 100));
        assert_eq!(
            router.loads().replica("r1").snapshot().inflight_requests,
            2.0
        );
        // Both answered: their blocks were stored, the index knows. It says r1 evicted them
        // since (within the TTL): kvroute still believes its insert (scored, and expected by the
        // drift check) but tells that the engine will reuse nothing.
        drop((first, sibling));
        let after = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![Some(0), Some(0), Some(10)]),
                &scoring,
                now,
            ))
            .unwrap();
        assert_eq!(
            (after.choice, after.matched_blocks, after.cached_tokens),
            (1, 100, 0)
        );
        assert_eq!(after.prediction.map(|p| p.cached_tokens), Some(1600));
    }

    #[test]
    fn a_prefix_queued_past_the_speculative_ttl_is_still_believed_where_it_waits() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let now = Instant::now();
        let candidates = ["r0", "r1"];
        let keys: Vec<u64> = (1..=100).collect();
        // The same prompt (r1's engine holds 60 of its blocks), decided at `at`.
        let decide = |at: Instant, commit: bool| {
            let mut decision = request(
                &candidates,
                prompt(&keys, vec![Some(0), Some(60)]),
                &scoring,
                at,
            );
            decision.commit = commit;
            router.score_and_commit(decision).unwrap()
        };
        let first = decide(now, true);
        assert_eq!(first.choice, 1);
        // Long after the TTL the first request still waits in r1's queue (an overloaded engine):
        // its prefix has not been computed, the index has no events for it, but it is coming.
        let later = now + scoring.speculative_ttl * 10;
        let look_later = || decide(later, false);
        let queued = look_later();
        assert_eq!(queued.scored.views[1].matched_blocks, 100);
        assert_eq!(queued.scored.reusable_blocks[1], 100);
        // Answered: the index knows better from then on.
        drop(first);
        assert_eq!(look_later().scored.views[1].matched_blocks, 60);

        // A request whose prompt is prefilled on another replica (a prefill/decode split) waits
        // on r1 for its blocks, but r1 does not compute them: past the TTL its prefix is not
        // believed there, and a sibling kept whole on r1 would recompute it.
        let mut split = decide(now, true);
        assert_eq!(split.choice, 1);
        split.inflight.prefilled_elsewhere();
        let waiting = look_later();
        assert_eq!(waiting.scored.views[1].matched_blocks, 60);
        assert_eq!(waiting.scored.views[1].shared_inflight_tokens, 0);
    }

    #[test]
    fn a_request_served_on_a_fallback_is_remembered_there_and_predicts_nothing_for_the_chosen() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let now = Instant::now();
        let candidates = ["r0", "r1"];
        let keys: Vec<u64> = (1..=10).collect();
        let mut routed = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![None, None]),
                &scoring,
                now,
            ))
            .unwrap();
        let chosen = candidates[routed.choice];
        let served = candidates[1 - routed.choice];
        let served_keys = routed.inflight.served_elsewhere();
        assert_eq!(served_keys, keys);
        router.remember_served(served, 1024, &served_keys, now);
        routed.inflight.release();
        let ttl = scoring.speculative_ttl;
        assert_eq!(
            router.memory().lookup(served, &keys, now, ttl).approximate,
            10
        );
        assert_eq!(
            router.loads().replica(chosen).predicted().prompt_tokens,
            0,
            "the chosen replica never scheduled it: no prediction counts there"
        );
    }

    #[test]
    fn a_decision_not_committed_leaves_no_trace() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let now = Instant::now();
        let candidates = ["r0", "r1"];
        let keys: Vec<u64> = (1..=10).collect();
        let mut dry = request(
            &candidates,
            prompt(&keys, vec![Some(4), None]),
            &scoring,
            now,
        );
        dry.commit = false;
        let routed = router.score_and_commit(dry).unwrap();
        assert_eq!((routed.choice, routed.cached_tokens), (0, 64));
        assert!(!routed.inflight.is_held(), "nothing counts in flight");
        for replica in candidates {
            assert_eq!(
                router.loads().replica(replica).snapshot().inflight_requests,
                0.0
            );
            assert_eq!(
                router
                    .memory()
                    .lookup(replica, &keys, now, scoring.speculative_ttl),
                Default::default(),
                "no insert on {replica}"
            );
        }
    }

    #[test]
    fn without_the_index_an_idle_pool_counts_only_what_got_its_first_token() {
        let keys: Vec<u64> = (1..=40).collect();
        let candidates = ["r0", "r1"];
        let idle = ScoringConfig::default();
        let busy = ScoringConfig {
            idle_pool_ms: 0.0,
            ..ScoringConfig::default()
        };
        // No index answers: the approximate tier. The first request of a new 645-token prompt
        // goes to either replica.
        let decide = |router: &Router, scoring: &ScoringConfig| {
            router
                .score_and_commit(request(
                    &candidates,
                    prompt(&keys, vec![None, None]),
                    scoring,
                    Instant::now(),
                ))
                .unwrap()
        };

        // Idle, the first still computing the prompt: a sibling computes it beside it.
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let first = decide(&router, &idle);
        let next = decide(&router, &idle);
        assert_ne!(next.choice, first.choice);
        assert_eq!(next.reason, Some(Reason::NoCacheMatch));
        // Busy: it joins the prefill in flight, as kvroute's memory says.
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let first = decide(&router, &idle);
        let next = decide(&router, &busy);
        assert_eq!(
            (next.choice, next.reason),
            (first.choice, Some(Reason::CacheHit))
        );
        // Idle, once the first got its first token: the replica holds the prompt.
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let first = decide(&router, &idle);
        let holder = first.choice;
        drop(first);
        let next = decide(&router, &idle);
        assert_eq!((next.choice, next.reason), (holder, Some(Reason::CacheHit)));
        assert_eq!(next.matched_blocks, 40);
    }

    #[test]
    fn a_peers_decision_counts_as_if_decided_here() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        // A busy pool, where a sibling joins the prefill in flight (an idle one spreads them).
        let scoring = ScoringConfig {
            idle_pool_ms: 0.0,
            ..ScoringConfig::default()
        };
        let now = Instant::now();
        let keys: Vec<u64> = (1..=10).collect();
        let guard = router.record_peer_decision("r1", 1024, 16, peer(&keys, 160), now);
        let load = router.loads().replica("r1");
        assert_eq!(load.snapshot().inflight_requests, 1.0);
        assert_eq!(load.snapshot().inflight_prompt_tokens, 160.0);
        assert_eq!(load.inflight_shared_blocks(&keys), 10);
        assert_eq!(load.predicted(), Prediction::default(), "no drift for it");
        // The next sibling, decided here, finds the prefix where the peer sent it.
        let candidates = ["r0", "r1"];
        let routed = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![None, None]),
                &scoring,
                now,
            ))
            .unwrap();
        assert_eq!(routed.choice, 1);
        assert_eq!(routed.matched_blocks, 10);
        drop(guard);
        assert_eq!(load.snapshot().inflight_requests, 1.0, "the sibling's own");
        assert_eq!(load.snapshot().inflight_prompt_tokens, 5.0);
    }

    /// A peer's decision on a prompt of `keys` (and 5 tokens past its last whole block) that
    /// counted `pending` tokens of work.
    fn peer(keys: &[u64], pending: usize) -> PeerDecision {
        PeerDecision {
            keys: keys.to_vec(),
            prompt_tokens: keys.len() * 16 + 5,
            pending_prompt_tokens: pending,
        }
    }

    #[test]
    fn crossing_decisions_count_a_shared_prefix_once() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let now = Instant::now();
        let context: Vec<u64> = (1..=10).collect();
        let sibling = |tail: u64| [context.clone(), vec![tail]].concat();
        // This picker sent a sibling of a new 10-block context to r1: all of it is r1's work.
        let own = router.record_peer_decision("r1", 1024, 16, peer(&sibling(100), 181), now);
        let load = router.loads().replica("r1");
        assert_eq!(load.snapshot().inflight_prompt_tokens, 181.0);
        // A peer sent another sibling there before either heard of the other: it counted the
        // context too. Here only its own block and tail are more work; the context is in flight.
        let crossed = router.record_peer_decision("r1", 1024, 16, peer(&sibling(200), 181), now);
        assert_eq!(load.snapshot().inflight_prompt_tokens, 181.0 + 21.0);
        // A peer that knew less than that is taken at its word; one that does not say how long
        // its prompt is, too.
        let knew = router.record_peer_decision("r1", 1024, 16, peer(&sibling(300), 10), now);
        let unsaid = PeerDecision {
            prompt_tokens: 0,
            ..peer(&sibling(400), 181)
        };
        let old = router.record_peer_decision("r1", 1024, 16, unsaid, now);
        assert_eq!(
            load.snapshot().inflight_prompt_tokens,
            181.0 + 21.0 + 10.0 + 181.0
        );
        // Another replica computes the context itself.
        let elsewhere = router.record_peer_decision("r2", 1024, 16, peer(&sibling(500), 181), now);
        assert_eq!(
            router
                .loads()
                .replica("r2")
                .snapshot()
                .inflight_prompt_tokens,
            181.0
        );
        drop((own, crossed, knew, old, elsewhere));
        assert_eq!(load.snapshot().inflight_prompt_tokens, 0.0);
    }

    #[test]
    fn every_candidate_is_explained_as_scored() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let now = Instant::now();
        let candidates = ["r0", "r1", "r2"];
        let keys: Vec<u64> = (1..=10).collect();
        let routed = router
            .score_and_commit(request(
                &candidates,
                prompt(&keys, vec![Some(4), Some(0), None]),
                &scoring,
                now,
            ))
            .unwrap();
        assert_eq!((routed.choice, routed.tier), (0, Tier::Precise));
        let scored = &routed.scored;
        assert_eq!(scored.reusable_blocks, [4, 0, 0]);
        assert_eq!(
            scored.indexed,
            [Some(Indexed::dense(4)), Some(Indexed::dense(0)), None]
        );
        assert_eq!((scored.believed_tokens(0), scored.held_tokens()), (64, 64));
        assert_eq!(scored.reusable_tokens(0), routed.cached_tokens);
        // The holder is quicker: its estimate is below the others'.
        let ttft = |i| scored.estimated_ttft_ms(i, &scoring).unwrap();
        assert!(
            ttft(0) < ttft(1) && ttft(0) < ttft(2),
            "{:?}",
            (ttft(0), ttft(1))
        );
    }

    #[test]
    fn a_replica_the_index_does_not_vouch_for_scores_on_memory_alone() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let now = Instant::now();
        let keys = [21, 22, 23];
        drop(router.score_and_commit(request(&["r0"], prompt(&keys, Vec::new()), &scoring, now)));
        // Long after the speculative TTL: r0 still holds the keys by the approximate memory.
        let later = now + scoring.speculative_ttl * 10;
        let routed = router
            .score_and_commit(request(
                &["r1", "r0"],
                prompt(&keys, vec![Some(1)]),
                &scoring,
                later,
            ))
            .unwrap();
        assert_eq!(
            (routed.choice, routed.tier, routed.matched_blocks),
            (1, Tier::Approximate, 3)
        );
        assert!(router.remembers_all(&["r0"], &keys, later, scoring.speculative_ttl));
        assert!(!router.remembers_all(&["r1"], &keys, later, scoring.speculative_ttl));
    }

    #[test]
    fn no_prompt_routes_on_load_and_counts_the_request() {
        let router = Router::with_rng(LoadBoard::default(), StdRng::seed_from_u64(7));
        let scoring = ScoringConfig::default();
        let busy = router.loads().start_request("r0", 4000, Vec::new());
        let routed = router
            .score_and_commit(request(&["r0", "r1"], None, &scoring, Instant::now()))
            .unwrap();
        assert_eq!(
            (routed.choice, routed.tier, routed.reason),
            (1, Tier::Load, None)
        );
        assert_eq!(routed.prediction, None);
        assert_eq!(
            router.loads().replica("r1").snapshot().inflight_requests,
            1.0
        );
        drop(busy);
        assert!(
            router
                .score_and_commit(request(&[], None, &scoring, Instant::now()))
                .is_none()
        );
    }
}
