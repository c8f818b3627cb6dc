//! The filter's Envoy counters. Defined once per VM at configure time and recorded by handle; Envoy
//! shows them as `wasmcustom.<name>`, summed over the worker VMs.

/// Every counter the filter records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stat {
    /// Requests the fast path routed (any reason); they skip ext_proc.
    FastPathHits,
    /// Of those, routed to a learned session replica.
    FastPathSessionHits,
    /// Of those, routed by the model header to a pool.
    FastPathModelRoutes,
    /// Requests the fast path left to ext_proc.
    FastPathMisses,
    /// Pins from trusted callers that were honoured.
    PinsHonoured,
    /// Pin headers ignored (untrusted caller or unknown replica).
    PinsIgnored,
    /// Sessions added to the learned table.
    AffinityLearned,
    /// Learned entries extended or moved to another replica.
    AffinityUpdated,
    /// Live entries dropped to make room (the table is full in that bucket).
    AffinityEvictions,
    /// Shared-data problems: unreadable bucket, host error, or a write lost to contention.
    AffinityErrors,
    /// ext_proc decisions seen by the fallback instance (ext_proc answered).
    ExtProcDecisions,
    /// Requests the fallback routed because ext_proc made no decision.
    FallbackDecisions,
    /// Requests without decision nor hash key, left to Envoy's own balancing.
    FallbackUnkeyed,
    /// `clear_route_cache` calls the host refused.
    RouteCacheClearErrors,
}

impl Stat {
    /// All counters, for defining them at configure time.
    pub const ALL: [Stat; 14] = [
        Stat::FastPathHits,
        Stat::FastPathSessionHits,
        Stat::FastPathModelRoutes,
        Stat::FastPathMisses,
        Stat::PinsHonoured,
        Stat::PinsIgnored,
        Stat::AffinityLearned,
        Stat::AffinityUpdated,
        Stat::AffinityEvictions,
        Stat::AffinityErrors,
        Stat::ExtProcDecisions,
        Stat::FallbackDecisions,
        Stat::FallbackUnkeyed,
        Stat::RouteCacheClearErrors,
    ];

    /// Position in [`Stat::ALL`], used to index handle arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The Envoy stat name (without the `wasmcustom.` prefix Envoy adds).
    pub fn name(self) -> &'static str {
        match self {
            Stat::FastPathHits => "kvroute_wasm_fast_path_hits_total",
            Stat::FastPathSessionHits => "kvroute_wasm_fast_path_session_hits_total",
            Stat::FastPathModelRoutes => "kvroute_wasm_fast_path_model_routes_total",
            Stat::FastPathMisses => "kvroute_wasm_fast_path_misses_total",
            Stat::PinsHonoured => "kvroute_wasm_pins_honoured_total",
            Stat::PinsIgnored => "kvroute_wasm_pins_ignored_total",
            Stat::AffinityLearned => "kvroute_wasm_affinity_learned_total",
            Stat::AffinityUpdated => "kvroute_wasm_affinity_updated_total",
            Stat::AffinityEvictions => "kvroute_wasm_affinity_evictions_total",
            Stat::AffinityErrors => "kvroute_wasm_affinity_errors_total",
            Stat::ExtProcDecisions => "kvroute_wasm_extproc_decisions_total",
            Stat::FallbackDecisions => "kvroute_wasm_fallback_decisions_total",
            Stat::FallbackUnkeyed => "kvroute_wasm_fallback_unkeyed_total",
            Stat::RouteCacheClearErrors => "kvroute_wasm_route_cache_clear_errors_total",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_complete_ordered_and_uniquely_named() {
        for (i, stat) in Stat::ALL.iter().enumerate() {
            assert_eq!(stat.index(), i);
            assert!(stat.name().starts_with("kvroute_wasm_") && stat.name().ends_with("_total"));
        }
        let mut names: Vec<_> = Stat::ALL.iter().map(|s| s.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Stat::ALL.len());
    }
}
