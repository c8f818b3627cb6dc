//! Routers: one interface, every policy.
//!
//! A router sees each request when it arrives with a [`View`] of the cluster (live engines; a
//! router decides for itself what it may read, as documented on each), and hears back what a
//! real router would hear: first tokens, completions, the engines' KV events after the
//! configured delay, and periodic ticks (for metric scraping).

mod basic;
mod chwbl;
mod dynamo;
mod kvroute;
mod llmd;
mod observed;
mod oracle;
mod pd;
mod pickers;
mod regret;
mod sglang;

use kvroute_index_core::event::KvEvent;
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::engine::Engine;
use crate::trace::Request;
use kvroute_engine_model::TimingModel;
use kvroute_routing::{ScoringConfig, SplitRule};

pub use basic::{LeastLoaded, Random, RoundRobin, SessionHash};
pub use chwbl::ConsistentHashBoundedLoad;
pub use dynamo::DynamoCost;
pub use kvroute::Kvroute;
pub use llmd::LlmdPrecise;
pub use observed::Observed;
pub use oracle::TtftOracle;
pub use pd::{PdDynamo, PdLlmd};
pub use pickers::Pickers;
pub use regret::{OFF_BY, Off, Regret, RegretStats};
pub use sglang::SglangApprox;

/// The cluster at a decision.
#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    /// Virtual time, µs.
    pub now_us: u64,
    /// Every replica's live state.
    pub engines: &'a [Engine],
    /// All requests of the run (by id).
    pub requests: &'a [Request],
    /// The engines' timing model.
    pub timing: &'a dyn TimingModel,
    /// Replicas `0..prefill_replicas` are prefill-only, the rest decode (0: all serve whole).
    pub prefill_replicas: usize,
}

impl View<'_> {
    /// The prefill-only replicas.
    pub fn prefill_pool(&self) -> Vec<usize> {
        (0..self.prefill_replicas.min(self.engines.len())).collect()
    }

    /// The replicas that serve requests (decode-only, or all when none is prefill-only).
    pub fn decode_pool(&self) -> Vec<usize> {
        (self.prefill_replicas.min(self.engines.len())..self.engines.len()).collect()
    }
}

/// A disaggregated routing decision: the replica that serves the request and, when its prompt
/// is computed elsewhere, the prefill replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pair {
    /// The replica that serves it (decodes; computes the prompt too when not split).
    pub decode: Decision,
    /// The prefill replica, when split.
    pub prefill: Option<usize>,
}

/// A routing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Chosen replica.
    pub replica: usize,
    /// Leading prompt blocks the router believes cached there, if it keeps such a belief.
    pub predicted_blocks: Option<u32>,
}

impl Decision {
    /// A decision without a cache belief.
    pub fn to(replica: usize) -> Self {
        Decision {
            replica,
            predicted_blocks: None,
        }
    }
}

/// A routing policy.
pub trait Router {
    /// Picks a replica for `request`.
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision;
    /// Whether this router runs a prefill/decode split (then the fleet's first
    /// `prefill_replicas` are prefill-only).
    fn disaggregated(&self) -> bool {
        false
    }
    /// Picks the serving replica and, for a disaggregating router, maybe a prefill replica.
    fn route_pair(&mut self, request: &Request, view: &View<'_>) -> Pair {
        Pair {
            decode: self.route(request, view),
            prefill: None,
        }
    }
    /// KV events a replica published, delivered after the configured delay.
    fn on_kv_events(&mut self, _replica: usize, _events: &[KvEvent], _now_us: u64) {}
    /// A request emitted its first token.
    fn on_first_token(&mut self, _replica: usize, _request: &Request, _now_us: u64) {}
    /// A request finished.
    fn on_finish(&mut self, _replica: usize, _request: &Request, _now_us: u64) {}
    /// How often [`Router::on_tick`] runs, if at all.
    fn tick_interval_us(&self) -> Option<u64> {
        None
    }
    /// Periodic hook (metric scrapes).
    fn on_tick(&mut self, _view: &View<'_>) {}
}

/// Every router the comparison runs, by name.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterSpec {
    /// Uniformly random.
    Random,
    /// Round-robin.
    RoundRobin,
    /// Fewest in-flight requests.
    LeastLoaded,
    /// Hash of the session id (or of the first blocks when the trace has none).
    SessionHash,
    /// Consistent hashing with bounded loads on the first two blocks.
    Chwbl,
    /// SGLang's cache-aware router (approximate tree).
    Sglang,
    /// llm-d precise prefix scoring; `speculative` adds routed prefixes before events land.
    Llmd {
        /// Speculative indexing on.
        speculative: bool,
    },
    /// Dynamo's KV router cost with this overlap weight.
    Dynamo {
        /// `overlap_score_weight`.
        overlap_weight: f64,
    },
    /// kvroute: the real index and ext-proc policy with default scoring.
    Kvroute,
    /// kvroute on a fleet whose engines publish no KV events (ext-proc's `events: false` pool):
    /// its approximate tier, its own routing memory and the loads.
    KvrouteApprox,
    /// kvroute with its overload rule set otherwise: `queue_ms` 0 is off.
    KvrouteOverload {
        /// `scoring.overload_queue_ms`.
        queue_ms: u32,
        /// `scoring.overload_imbalance`, in percent.
        imbalance_pct: u32,
    },
    /// `count` kvroute pickers behind round robin, sharing the index and, with `share_us`, every
    /// decision and answer that late.
    Pickers {
        /// How many.
        count: usize,
        /// Sharing staleness, µs (`None`: nothing shared but the index); named in ms.
        share_us: Option<u64>,
    },
    /// TTFT-greedy oracle with exact engine state.
    Oracle,
    /// Disaggregated: kvroute's routing core on the decode pool, the shared split verdict on
    /// the chosen replica's cached tokens, its routing core on the prefill pool.
    PdKvroute {
        /// The split thresholds.
        rule: SplitRule,
    },
    /// Disaggregated: llm-d's decode-first profile with its prefix-based decider.
    PdLlmd {
        /// `promptTokens` / `nonCachedTokens`.
        rule: SplitRule,
    },
    /// Disaggregated: Dynamo's (every request through a prefill worker chosen by KV overlap and
    /// load; decode on load).
    PdDynamo,
}

/// The split thresholds ext-proc ships by default.
pub const DEFAULT_SPLIT_RULE: SplitRule = SplitRule {
    min_prompt_tokens: kvroute_routing::split::DEFAULT_MIN_PROMPT_TOKENS,
    min_uncached_tokens: kvroute_routing::split::DEFAULT_MIN_UNCACHED_TOKENS,
    max_prefill_queue: Some(kvroute_routing::split::DEFAULT_MAX_PREFILL_QUEUE),
};

/// `-p<prompt>-u<uncached>` when the thresholds are not the default, then `-q<ms>` (or `-qoff`)
/// when the prefill queue bound is not.
fn rule_suffix(rule: &SplitRule) -> String {
    let mut suffix = String::new();
    if (rule.min_prompt_tokens, rule.min_uncached_tokens)
        != (
            DEFAULT_SPLIT_RULE.min_prompt_tokens,
            DEFAULT_SPLIT_RULE.min_uncached_tokens,
        )
    {
        suffix += &format!("-p{}-u{}", rule.min_prompt_tokens, rule.min_uncached_tokens);
    }
    if rule.max_prefill_queue != DEFAULT_SPLIT_RULE.max_prefill_queue {
        match rule.max_prefill_queue {
            Some(max) => suffix += &format!("-q{}", max.as_millis()),
            None => suffix += "-qoff",
        }
    }
    suffix
}

/// Parses what [`rule_suffix`] writes: `[-p<prompt>-u<uncached>][-q<ms>|-qoff]`.
fn parse_rule(suffix: &str) -> Option<SplitRule> {
    let mut rule = DEFAULT_SPLIT_RULE;
    let (thresholds, queue) = match suffix.find("-q") {
        Some(at) => (&suffix[..at], Some(&suffix[at + 2..])),
        None => (suffix, None),
    };
    if !thresholds.is_empty() {
        let (prompt, uncached) = thresholds.strip_prefix("-p")?.split_once("-u")?;
        rule.min_prompt_tokens = prompt.parse().ok()?;
        rule.min_uncached_tokens = uncached.parse().ok()?;
    }
    match queue {
        None => {}
        Some("off") => rule.max_prefill_queue = None,
        Some(ms) => {
            rule.max_prefill_queue = Some(std::time::Duration::from_millis(ms.parse().ok()?));
        }
    }
    Some(rule)
}

impl RouterSpec {
    /// Every router, in report order.
    pub fn all() -> Vec<RouterSpec> {
        vec![
            RouterSpec::Random,
            RouterSpec::RoundRobin,
            RouterSpec::LeastLoaded,
            RouterSpec::SessionHash,
            RouterSpec::Chwbl,
            RouterSpec::Sglang,
            RouterSpec::Llmd { speculative: false },
            RouterSpec::Llmd { speculative: true },
            RouterSpec::Dynamo {
                overlap_weight: 0.5,
            },
            RouterSpec::Dynamo {
                overlap_weight: 1.0,
            },
            RouterSpec::Dynamo {
                overlap_weight: 2.0,
            },
            RouterSpec::Kvroute,
            RouterSpec::Oracle,
        ]
    }

    /// Report name (also accepted by [`RouterSpec::parse`]).
    pub fn name(&self) -> String {
        match self {
            RouterSpec::Random => "random".to_owned(),
            RouterSpec::RoundRobin => "round-robin".to_owned(),
            RouterSpec::LeastLoaded => "least-loaded".to_owned(),
            RouterSpec::SessionHash => "session-hash".to_owned(),
            RouterSpec::Chwbl => "chwbl".to_owned(),
            RouterSpec::Sglang => "sglang".to_owned(),
            RouterSpec::Llmd { speculative: false } => "llmd".to_owned(),
            RouterSpec::Llmd { speculative: true } => "llmd-spec".to_owned(),
            RouterSpec::Dynamo { overlap_weight } => format!("dynamo-w{overlap_weight}"),
            RouterSpec::Kvroute => "kvroute".to_owned(),
            RouterSpec::KvrouteApprox => "kvroute-approx".to_owned(),
            RouterSpec::KvrouteOverload {
                queue_ms,
                imbalance_pct,
            } => format!("kvroute-o{queue_ms}-i{imbalance_pct}"),
            RouterSpec::Pickers { count, share_us } => match share_us {
                None => format!("kvroute-x{count}"),
                Some(us) => format!("kvroute-x{count}-s{}", *us as f64 / 1000.0),
            },
            RouterSpec::Oracle => "oracle".to_owned(),
            RouterSpec::PdKvroute { rule } => format!("pd-kvroute{}", rule_suffix(rule)),
            RouterSpec::PdLlmd { rule } => format!("pd-llmd{}", rule_suffix(rule)),
            RouterSpec::PdDynamo => "pd-dynamo".to_owned(),
        }
    }

    /// Looks a router up by its report name.
    pub fn parse(name: &str) -> Option<RouterSpec> {
        if let Some(rest) = name.strip_prefix("pd-kvroute") {
            return parse_rule(rest).map(|rule| RouterSpec::PdKvroute { rule });
        }
        if let Some(rest) = name.strip_prefix("pd-llmd") {
            return parse_rule(rest).map(|rule| RouterSpec::PdLlmd { rule });
        }
        if let Some(rest) = name.strip_prefix("kvroute-x") {
            let (count, share_us) = match rest.split_once("-s") {
                Some((count, ms)) => {
                    let ms: f64 = ms
                        .parse()
                        .ok()
                        .filter(|ms: &f64| ms.is_finite() && *ms >= 0.0)?;
                    (count, Some((ms * 1000.0).round() as u64))
                }
                None => (rest, None),
            };
            return count
                .parse()
                .ok()
                .filter(|&count: &usize| count >= 1)
                .map(|count| RouterSpec::Pickers { count, share_us });
        }
        if let Some(rest) = name.strip_prefix("kvroute-o") {
            let (queue_ms, imbalance_pct) = rest.split_once("-i")?;
            return Some(RouterSpec::KvrouteOverload {
                queue_ms: queue_ms.parse().ok()?,
                imbalance_pct: imbalance_pct.parse().ok().filter(|&p: &u32| p >= 100)?,
            });
        }
        if name == "kvroute-approx" {
            return Some(RouterSpec::KvrouteApprox);
        }
        if name == "pd-dynamo" {
            return Some(RouterSpec::PdDynamo);
        }
        if let Some(weight) = name.strip_prefix("dynamo-w") {
            return weight
                .parse()
                .ok()
                .filter(|w: &f64| w.is_finite() && *w >= 0.0)
                .map(|overlap_weight| RouterSpec::Dynamo { overlap_weight });
        }
        RouterSpec::all().into_iter().find(|s| s.name() == name)
    }

    /// Whether this is one of the anchor policies (llm-d precise, Dynamo cost, SGLang
    /// approximate, any variant): the systems kvroute's default should beat.
    pub fn is_anchor(&self) -> bool {
        matches!(
            self,
            RouterSpec::Sglang | RouterSpec::Llmd { .. } | RouterSpec::Dynamo { .. }
        )
    }

    /// Whether this router splits prefill from decode (its decisions are pairs).
    pub fn disaggregates(&self) -> bool {
        matches!(
            self,
            RouterSpec::PdKvroute { .. } | RouterSpec::PdLlmd { .. } | RouterSpec::PdDynamo
        )
    }

    /// Whether this router's decisions are expensive (it simulates every replica).
    pub fn is_oracle(&self) -> bool {
        matches!(self, RouterSpec::Oracle)
    }

    /// Builds the router for `replicas` replicas of `blocks` blocks each.
    pub fn build(&self, replicas: usize, blocks: u32, seed: u64) -> Box<dyn Router> {
        let rng = StdRng::seed_from_u64(seed);
        match *self {
            RouterSpec::Random => Box::new(Random::new(rng)),
            RouterSpec::RoundRobin => Box::new(RoundRobin::default()),
            RouterSpec::LeastLoaded => Box::new(LeastLoaded::new(replicas, rng)),
            RouterSpec::SessionHash => Box::new(SessionHash),
            RouterSpec::Chwbl => Box::new(ConsistentHashBoundedLoad::new(replicas)),
            RouterSpec::Sglang => Box::new(SglangApprox::new(
                replicas,
                sglang::SglangConfig::default(),
                rng,
            )),
            RouterSpec::Llmd { speculative } => {
                Box::new(LlmdPrecise::new(replicas, speculative, rng))
            }
            RouterSpec::Dynamo { overlap_weight } => {
                Box::new(DynamoCost::new(replicas, overlap_weight, rng))
            }
            RouterSpec::Kvroute => Box::new(Kvroute::new(replicas, blocks, rng)),
            RouterSpec::KvrouteApprox => {
                Box::new(Kvroute::new(replicas, blocks, rng).without_events())
            }
            RouterSpec::KvrouteOverload {
                queue_ms,
                imbalance_pct,
            } => {
                let scoring = ScoringConfig {
                    overload_queue_ms: f64::from(queue_ms),
                    overload_imbalance: f64::from(imbalance_pct) / 100.0,
                    ..ScoringConfig::default()
                };
                Box::new(Kvroute::with_scoring(replicas, blocks, scoring, rng))
            }
            RouterSpec::Pickers { count, share_us } => {
                let pickers = Pickers::new(count, replicas, blocks, rng);
                Box::new(match share_us {
                    Some(us) => pickers.sharing(us),
                    None => pickers,
                })
            }
            RouterSpec::Oracle => Box::new(TtftOracle::new(rng)),
            RouterSpec::PdKvroute { rule } => {
                Box::new(Kvroute::new(replicas, blocks, rng).disaggregating(rule))
            }
            RouterSpec::PdLlmd { rule } => Box::new(PdLlmd::new(replicas, rule, rng)),
            RouterSpec::PdDynamo => Box::new(PdDynamo::new(replicas, rng)),
        }
    }
}

/// Requests routed to each replica and not finished (what a proxy's least-request counts).
#[derive(Debug, Clone, Default)]
pub(crate) struct InFlight {
    counts: Vec<u32>,
}

impl InFlight {
    pub(crate) fn new(replicas: usize) -> Self {
        InFlight {
            counts: vec![0; replicas],
        }
    }

    pub(crate) fn get(&self, replica: usize) -> u32 {
        self.counts.get(replica).copied().unwrap_or(0)
    }

    pub(crate) fn total(&self) -> u32 {
        self.counts.iter().sum()
    }

    pub(crate) fn add(&mut self, replica: usize) {
        if let Some(c) = self.counts.get_mut(replica) {
            *c += 1;
        }
    }

    pub(crate) fn remove(&mut self, replica: usize) {
        if let Some(c) = self.counts.get_mut(replica) {
            *c = c.saturating_sub(1);
        }
    }
}

/// Index of the lowest `score` (ties broken by `rng`); `None` only for `n == 0`.
pub(crate) fn argmin_random(
    n: usize,
    score: impl Fn(usize) -> f64,
    rng: &mut impl rand::Rng,
) -> Option<usize> {
    let scores: Vec<f64> = (0..n).map(score).collect();
    let best = scores.iter().copied().fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..n)
        .filter(|i| scores[*i] <= best + 1e-9 * best.abs().max(1.0))
        .collect();
    if ties.is_empty() {
        return None;
    }
    Some(ties[rng.random_range(0..ties.len())])
}

/// Leading blocks of `keys` a predicate holds.
/// A baseline router's own index of the engines' KV events (as llm-d's and Dynamo's indexers
/// keep one): block key → bitmask of the replicas holding it. kvroute uses the real
/// `kvroute-index` instead.
#[derive(Debug, Default)]
pub(crate) struct EventIndex {
    holders: std::collections::HashMap<u64, u64>,
}

impl EventIndex {
    /// Applies one replica's events (replica ids beyond 63 share a bit; the simulator runs fewer).
    pub(crate) fn apply(&mut self, replica: usize, events: &[KvEvent]) {
        let bit = 1u64 << (replica % 64);
        for event in events {
            match event {
                KvEvent::BlockStored(stored) => {
                    for key in &stored.block_hashes {
                        *self.holders.entry(*key).or_insert(0) |= bit;
                    }
                }
                KvEvent::BlockRemoved(removed) => {
                    for key in &removed.block_hashes {
                        if let Some(mask) = self.holders.get_mut(key) {
                            *mask &= !bit;
                            if *mask == 0 {
                                self.holders.remove(key);
                            }
                        }
                    }
                }
                KvEvent::AllBlocksCleared => self.holders.retain(|_, mask| {
                    *mask &= !bit;
                    *mask != 0
                }),
            }
        }
    }

    /// Whether `replica` holds block `key`.
    pub(crate) fn holds(&self, replica: usize, key: u64) -> bool {
        self.holders
            .get(&key)
            .is_some_and(|mask| mask & (1u64 << (replica % 64)) != 0)
    }
}

pub(crate) fn leading(keys: &[u64], held: impl Fn(u64) -> bool) -> u32 {
    keys.iter().take_while(|k| held(**k)).count() as u32
}
