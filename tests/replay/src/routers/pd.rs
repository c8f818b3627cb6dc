//! The anchors' prefill/decode policies on a disaggregated fleet (replicas
//! `0..View::prefill_replicas` prefill-only, the rest decode).
//!
//! - **llm-d** (`disagg-profile-handler`, `prefix-based-pd-decider`): the decode profile runs
//!   first (its prefix-cache, queue and KV-utilisation scorers over the decode pods, as
//!   [`LlmdPrecise`]); the decider splits a prompt of at least `promptTokens` when at least
//!   `nonCachedTokens` of it are not cached on the chosen decode pod (its indexed leading blocks);
//!   then the prefill profile picks among the prefill pods with the same scorers. The decider's
//!   rule is the one kvroute's picker implements ([`SplitVerdict`]), run here on llm-d's own
//!   prefix facts.
//! - **Dynamo** (disaggregated serving): every request goes through a prefill worker whenever
//!   one exists (the prefill profile runs first and degrades to aggregated only without
//!   prefill workers); KV overlap is scored for prefill only (the default selector's cost,
//!   overlap weight 1) and decode is routed on load (`overlap_score_weight = 0`). Kept
//!   deviation: the decode selector still counts a request's blocks already active on a worker
//!   once (as the aggregated selector does), where Dynamo's decode routing sets
//!   `assume_kv_reuse = false`; with overlap off this only changes how active blocks are
//!   counted, not what is cached.

use kvroute_index_core::event::KvEvent;
use kvroute_routing::{PrefillSide, SplitRule, SplitVerdict};
use rand::rngs::StdRng;

use super::{Decision, DynamoCost, LlmdPrecise, Pair, Router, View};
use crate::BLOCK_TOKENS;
use crate::trace::Request;

/// llm-d's P/D profile handler.
#[derive(Debug)]
pub struct PdLlmd {
    inner: LlmdPrecise,
    rule: SplitRule,
}

impl PdLlmd {
    /// For `replicas` pods with the decider's thresholds.
    pub fn new(replicas: usize, rule: SplitRule, rng: StdRng) -> Self {
        PdLlmd {
            inner: LlmdPrecise::new(replicas, false, rng),
            rule,
        }
    }
}

impl Router for PdLlmd {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        self.route_pair(request, view).decode
    }

    fn disaggregated(&self) -> bool {
        true
    }

    fn route_pair(&mut self, request: &Request, view: &View<'_>) -> Pair {
        let decode = self
            .inner
            .route_among(request, view.now_us, &view.decode_pool());
        let cached = decode.predicted_blocks.unwrap_or(0) as usize * BLOCK_TOKENS as usize;
        let prefill_pool = view.prefill_pool();
        // llm-d's decider does not weigh the prefill pool's load: any ready prefill pod serves.
        let verdict = SplitVerdict::of(
            &self.rule,
            request.input_tokens as usize,
            cached.min(request.input_tokens as usize),
            PrefillSide::of(prefill_pool.len(), prefill_pool.len()),
        );
        let prefill = (verdict == SplitVerdict::Split).then(|| {
            self.inner
                .route_among(request, view.now_us, &prefill_pool)
                .replica
        });
        Pair { decode, prefill }
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_us: u64) {
        self.inner.on_kv_events(replica, events, now_us);
    }

    fn tick_interval_us(&self) -> Option<u64> {
        self.inner.tick_interval_us()
    }

    fn on_tick(&mut self, view: &View<'_>) {
        self.inner.on_tick(view);
    }
}

/// Dynamo's disaggregated router: prefill by KV overlap and load, decode by load.
#[derive(Debug)]
pub struct PdDynamo {
    prefill: DynamoCost,
    decode: DynamoCost,
    /// Replicas below this are prefill workers (learned from the view at routing).
    prefill_replicas: usize,
}

impl PdDynamo {
    /// For `replicas` workers.
    pub fn new(replicas: usize, rng: StdRng) -> Self {
        use rand::SeedableRng;
        let mut rng = rng;
        let decode_rng = StdRng::from_rng(&mut rng);
        PdDynamo {
            prefill: DynamoCost::new(replicas, 1.0, rng),
            decode: DynamoCost::new(replicas, 0.0, decode_rng),
            prefill_replicas: 0,
        }
    }

    fn owner(&mut self, replica: usize) -> &mut DynamoCost {
        if replica < self.prefill_replicas {
            &mut self.prefill
        } else {
            &mut self.decode
        }
    }
}

impl Router for PdDynamo {
    fn route(&mut self, request: &Request, view: &View<'_>) -> Decision {
        self.route_pair(request, view).decode
    }

    fn disaggregated(&self) -> bool {
        true
    }

    fn route_pair(&mut self, request: &Request, view: &View<'_>) -> Pair {
        self.prefill_replicas = view.prefill_replicas;
        let prefill_pool = view.prefill_pool();
        let prefill = (!prefill_pool.is_empty())
            .then(|| self.prefill.route_among(request, &prefill_pool).replica);
        let decode = self.decode.route_among(request, &view.decode_pool());
        Pair { decode, prefill }
    }

    fn on_first_token(&mut self, replica: usize, request: &Request, now_us: u64) {
        self.owner(replica).on_first_token(replica, request, now_us);
    }

    fn on_finish(&mut self, replica: usize, request: &Request, now_us: u64) {
        self.owner(replica).on_finish(replica, request, now_us);
    }

    fn on_kv_events(&mut self, replica: usize, events: &[KvEvent], now_us: u64) {
        self.prefill.on_kv_events(replica, events, now_us);
    }
}
