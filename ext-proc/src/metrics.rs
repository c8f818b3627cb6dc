//! Prometheus metrics of the picker. Labels come from config (replica, pool) and enums only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

/// Labels of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `precise`, `approximate`, `load`.
    pub tier: &'static str,
    /// Why this replica (see `Reason::as_label`).
    pub reason: &'static str,
}

/// Labels of a fallback from one tier to the next.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// `tokenize`, `index`, `keys`, `decision`.
    pub stage: &'static str,
    /// The error's `as_label`.
    pub cause: &'static str,
}

/// A single static-string label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind.
    pub kind: &'static str,
}

/// A replica label (id from config).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabel {
    /// Replica id.
    pub replica: String,
}

/// A replica (id from config) and the state the index reported for it (a fixed enum).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaStateLabels {
    /// Replica id.
    pub replica: String,
    /// `syncing`, `stale`, `disconnected`, `never_connected`, `flagged`, `ready`, `unspecified`.
    pub state: &'static str,
}

/// A pool label (name from config).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabel {
    /// Pool name.
    pub pool: String,
}

/// A pool (name from config) and a disaggregation verdict (a fixed enum).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DisaggregationLabels {
    /// Pool name.
    pub pool: String,
    /// `split`, `short_prompt`, `cached`, `no_prefill_replica`, `prefill_busy` or `no_prompt`.
    pub decision: &'static str,
}

/// A pool (name from config) and how a prefill leg ext-proc ran ended (a fixed enum).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefillLegLabels {
    /// Pool name.
    pub pool: String,
    /// `ok`, or why the request was served whole: `busy`, `connect_error`,
    /// `transport_error`, `status`, `timeout`, `no_kv_transfer_params`, `unsupported_request`.
    pub outcome: &'static str,
}

/// What became of a piece of news shared between pickers (a fixed enum).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `sent`, `send_dropped`, `applied`, `answered`, `stale`, `unknown`, `overflow`,
    /// `expired`.
    pub outcome: &'static str,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// All metric handles, registered once under the `kvroute_extproc` prefix.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Decisions by tier and reason.
    pub decisions: Family<DecisionLabels, Counter>,
    /// Fallbacks by stage and cause.
    pub fallbacks: Family<FallbackLabels, Counter>,
    /// Requests refused, by error.
    pub request_errors: Family<KindLabel, Counter>,
    /// Decision latency.
    pub decision_duration: Histogram,
    /// Tokenization latency, by token source.
    pub tokenize_duration: Family<KindLabel, Histogram>,
    /// Index `Match` latency (successful calls).
    pub match_duration: Histogram,
    /// Bytes the token cache accounts for (tokens at 4 bytes plus a fixed cost per entry).
    pub token_cache_bytes: Gauge,
    /// Entries of the token cache.
    pub token_cache_entries: Gauge,
    /// In-process tokenizations running on blocking threads (at most `limits.tokenize_concurrency`),
    /// those whose decision stopped waiting included.
    pub tokenize_blocking_in_flight: Gauge,
    /// Whole tokenizations for a later turn queued or running on the low-priority lane.
    pub tokenize_background_queued: Gauge,
    /// In-process tokenizations that outlived their decision's wait and finished in the
    /// background (their slot held until then).
    pub tokenize_abandoned: Counter,
    /// Whole tokenizations of a long prompt decided from its leading tokens that were not started
    /// in the background (no free slot, or over the size limit): that conversation's next turn
    /// tokenizes it again.
    pub tokenize_background_skipped: Counter,
    /// Share of the prompt predicted to be cached on the chosen replica.
    pub predicted_cached_share: Histogram,
    /// Open ext_proc streams.
    pub streams_active: Gauge,
    /// Served endpoint differed from the decision and its fallbacks (Envoy balanced it itself).
    pub served_mismatch: Counter,
    /// A fallback endpoint served the request (a retry walked the destination list).
    pub served_fallback: Counter,
    /// Candidates the index answered for without vouching (`precise: false`), by its state:
    /// each was scored on the approximate tier.
    pub nonprecise_replicas: Family<ReplicaStateLabels, Counter>,
    /// Candidates absent from the index's answer (a replica id the index does not know).
    pub unknown_replicas: Family<ReplicaLabel, Counter>,
    /// Config reloads by result.
    pub config_reloads: Family<KindLabel, Counter>,
    /// Router in-flight requests per replica.
    pub replica_inflight: Family<ReplicaLabel, Gauge>,
    /// Scraped waiting requests per replica.
    pub replica_waiting: Family<ReplicaLabel, FloatGauge>,
    /// Scraped running requests per replica.
    pub replica_running: Family<ReplicaLabel, FloatGauge>,
    /// Scraped KV-cache usage (0..1) per replica.
    pub replica_kv_usage: Family<ReplicaLabel, FloatGauge>,
    /// 1 when the replica is ready (scrapes succeed), else 0.
    pub replica_ready: Family<ReplicaLabel, Gauge>,
    /// Failed `/metrics` scrapes per replica.
    pub scrape_failures: Family<ReplicaLabel, Counter>,
    /// `debug_headers.expose: token`: requests by what their token did (`exposed`, `no_token`,
    /// `wrong_token`).
    pub debug_header_requests: Family<KindLabel, Counter>,
    /// In-flight slots released because Envoy never reported the response (`limits.inflight_max_age`).
    pub inflight_expired: Family<ReplicaLabel, Counter>,
    /// ext_proc streams refused, by reason (`max_streams`).
    pub stream_refusals: Family<KindLabel, Counter>,
    /// Prompt tokens predicted cached on the replica, for its answered requests (crate::drift).
    pub drift_predicted_cached_tokens: Family<ReplicaLabel, Counter>,
    /// Prompt tokens of those requests (kvroute's count).
    pub drift_predicted_prompt_tokens: Family<ReplicaLabel, Counter>,
    /// Growth of the engine's `vllm:prefix_cache_hits_total` between scrapes.
    pub drift_observed_cached_tokens: Family<ReplicaLabel, Counter>,
    /// Growth of the engine's `vllm:prefix_cache_queries_total` between scrapes.
    pub drift_observed_queried_tokens: Family<ReplicaLabel, Counter>,
    /// The replica's drift over the window (0..1), at its last verdict.
    pub drift: Family<ReplicaLabel, FloatGauge>,
    /// Verdicts past `drift.bound` (each may log a warning; the lines are rate-limited).
    pub drift_warnings: Family<ReplicaLabel, Counter>,
    /// Engine prefix-cache counters that went down (engine restarts).
    pub drift_counter_resets: Family<ReplicaLabel, Counter>,
    /// 1 while the pool routes on the approximate tier because a replica drifts.
    pub drift_degraded: Family<PoolLabel, Gauge>,
    /// Times the pool started routing on the approximate tier because of drift.
    pub drift_degradations: Family<PoolLabel, Counter>,
    /// Shadow-mode decisions compared with the replica Envoy served them on.
    pub shadow_requests: Family<PoolLabel, Counter>,
    /// Shadow-mode decisions Envoy reported no served replica for (not compared).
    pub shadow_unobserved: Family<PoolLabel, Counter>,
    /// Prompt tokens of compared shadow-mode decisions.
    pub shadow_prompt_tokens: Family<PoolLabel, Counter>,
    /// Shadow mode: cached prompt tokens the best candidate held.
    pub shadow_held_tokens: Family<PoolLabel, Counter>,
    /// Shadow mode: cached prompt tokens kvroute's choice held (what it would have captured).
    pub shadow_captured_tokens: Family<PoolLabel, Counter>,
    /// Shadow mode: cached prompt tokens the replica Envoy chose held, by kvroute's view.
    pub shadow_served_predicted_tokens: Family<PoolLabel, Counter>,
    /// Shadow mode: requests some candidate held a prefix of.
    pub shadow_repeat_requests: Family<PoolLabel, Counter>,
    /// Shadow mode: requests some candidate held a prefix of that Envoy sent to a replica holding none of it.
    pub shadow_repeat_cold_requests: Family<PoolLabel, Counter>,
    /// Prompt tokens the pool's engines served from their prefix caches (deltas of vllm:prefix_cache_hits_total): delivered.
    pub pool_engine_cached_tokens: Family<PoolLabel, Counter>,
    /// Prompt tokens the pool's engines looked up in their prefix caches (deltas of vllm:prefix_cache_queries_total).
    pub pool_engine_prompt_tokens: Family<PoolLabel, Counter>,
    /// Decisions recorded (`decision_records`), by why: `flagged` or `sampled`.
    pub decision_records: Family<KindLabel, Counter>,
    /// Requests of a disaggregated pool, by whether their prompt was split off to a prefill
    /// replica and why not.
    pub disaggregation_decisions: Family<DisaggregationLabels, Counter>,
    /// Prefill legs ext-proc ran itself (`disaggregation.mode: envoy`), by outcome.
    pub disaggregation_prefill_legs: Family<PrefillLegLabels, Counter>,
    /// Prefill-leg attempts repeated after a transient failure.
    pub disaggregation_prefill_retries: Family<PoolLabel, Counter>,
    /// News shared with the other pickers (`peers`), by outcome.
    pub peer_news: Family<OutcomeLabel, Counter>,
    /// 1 while this picker shares decisions with the others through the index.
    pub peer_sharing: Gauge,
    /// How old a peer's news is when it arrives here: how stale the shared view is.
    pub peer_news_age: Histogram,
}

fn latency_histogram() -> Histogram {
    // 10 µs .. ~1.3 s: an in-memory match takes microseconds, a decision well under a millisecond.
    Histogram::new(exponential_buckets(0.000_01, 2.0, 18))
}

impl Metrics {
    /// Creates the handles and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            decisions: Family::default(),
            fallbacks: Family::default(),
            request_errors: Family::default(),
            decision_duration: latency_histogram(),
            tokenize_duration: Family::new_with_constructor(latency_histogram),
            match_duration: latency_histogram(),
            token_cache_bytes: Gauge::default(),
            token_cache_entries: Gauge::default(),
            tokenize_blocking_in_flight: Gauge::default(),
            tokenize_background_queued: Gauge::default(),
            tokenize_abandoned: Counter::default(),
            tokenize_background_skipped: Counter::default(),
            predicted_cached_share: Histogram::new([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0]),
            streams_active: Gauge::default(),
            served_mismatch: Counter::default(),
            served_fallback: Counter::default(),
            nonprecise_replicas: Family::default(),
            unknown_replicas: Family::default(),
            config_reloads: Family::default(),
            replica_inflight: Family::default(),
            replica_waiting: Family::default(),
            replica_running: Family::default(),
            replica_kv_usage: Family::default(),
            replica_ready: Family::default(),
            scrape_failures: Family::default(),
            debug_header_requests: Family::default(),
            inflight_expired: Family::default(),
            stream_refusals: Family::default(),
            drift_predicted_cached_tokens: Family::default(),
            drift_predicted_prompt_tokens: Family::default(),
            drift_observed_cached_tokens: Family::default(),
            drift_observed_queried_tokens: Family::default(),
            drift: Family::default(),
            drift_warnings: Family::default(),
            drift_counter_resets: Family::default(),
            drift_degraded: Family::default(),
            drift_degradations: Family::default(),
            shadow_requests: Family::default(),
            disaggregation_decisions: Family::default(),
            disaggregation_prefill_legs: Family::default(),
            disaggregation_prefill_retries: Family::default(),
            peer_news: Family::default(),
            peer_sharing: Gauge::default(),
            peer_news_age: latency_histogram(),
            shadow_unobserved: Family::default(),
            shadow_prompt_tokens: Family::default(),
            shadow_held_tokens: Family::default(),
            shadow_captured_tokens: Family::default(),
            shadow_served_predicted_tokens: Family::default(),
            shadow_repeat_requests: Family::default(),
            shadow_repeat_cold_requests: Family::default(),
            pool_engine_cached_tokens: Family::default(),
            pool_engine_prompt_tokens: Family::default(),
            decision_records: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("kvroute_extproc");
        r.register(
            "decisions",
            "Routing decisions by tier and reason",
            metrics.decisions.clone(),
        );
        r.register(
            "fallbacks",
            "Fallbacks to a lower routing tier, by stage and cause",
            metrics.fallbacks.clone(),
        );
        r.register(
            "request_errors",
            "Requests refused with an error response",
            metrics.request_errors.clone(),
        );
        r.register(
            "decision_duration_seconds",
            "Time to decide a route",
            metrics.decision_duration.clone(),
        );
        r.register(
            "tokenize_duration_seconds",
            "Time to obtain prompt tokens, by source",
            metrics.tokenize_duration.clone(),
        );
        r.register(
            "match_duration_seconds",
            "Index Match call latency",
            metrics.match_duration.clone(),
        );
        r.register(
            "token_cache_bytes",
            "Bytes the token cache accounts for (4 per token plus a fixed cost per entry)",
            metrics.token_cache_bytes.clone(),
        );
        r.register(
            "token_cache_entries",
            "Entries of the token cache",
            metrics.token_cache_entries.clone(),
        );
        r.register(
            "tokenize_blocking_in_flight",
            "In-process tokenizations running on blocking threads, abandoned ones included",
            metrics.tokenize_blocking_in_flight.clone(),
        );
        r.register(
            "tokenize_abandoned",
            "In-process tokenizations that outlived their decision's wait and finished in the background",
            metrics.tokenize_abandoned.clone(),
        );
        r.register(
            "tokenize_background_queued",
            "Whole tokenizations for a later turn queued or running on the low-priority background thread",
            metrics.tokenize_background_queued.clone(),
        );
        r.register(
            "tokenize_background_skipped",
            "Whole tokenizations for a later turn not started (background queue full, no free slot, too large)",
            metrics.tokenize_background_skipped.clone(),
        );
        r.register(
            "predicted_cached_share",
            "Share of prompt tokens predicted cached on the chosen replica",
            metrics.predicted_cached_share.clone(),
        );
        r.register(
            "streams_active",
            "Open ext_proc streams",
            metrics.streams_active.clone(),
        );
        r.register(
            "served_mismatch",
            "Envoy served another endpoint than decided or listed as a fallback",
            metrics.served_mismatch.clone(),
        );
        r.register(
            "served_fallback",
            "A fallback endpoint of the destination list served the request (a retry)",
            metrics.served_fallback.clone(),
        );
        r.register(
            "nonprecise_replicas",
            "Candidates the index did not vouch for (scored on the approximate tier), by state",
            metrics.nonprecise_replicas.clone(),
        );
        r.register(
            "unknown_replicas",
            "Candidates absent from the index's answer (replica id unknown to the index)",
            metrics.unknown_replicas.clone(),
        );
        r.register(
            "config_reloads",
            "Config reloads by result",
            metrics.config_reloads.clone(),
        );
        r.register(
            "replica_inflight_requests",
            "Requests routed and not yet answered",
            metrics.replica_inflight.clone(),
        );
        r.register(
            "replica_waiting_requests",
            "Scraped vllm:num_requests_waiting",
            metrics.replica_waiting.clone(),
        );
        r.register(
            "replica_running_requests",
            "Scraped vllm:num_requests_running",
            metrics.replica_running.clone(),
        );
        r.register(
            "replica_kv_cache_usage_ratio",
            "Scraped KV-cache usage",
            metrics.replica_kv_usage.clone(),
        );
        r.register(
            "replica_ready",
            "1 when the replica is ready",
            metrics.replica_ready.clone(),
        );
        r.register(
            "replica_scrape_failures",
            "Failed /metrics scrapes",
            metrics.scrape_failures.clone(),
        );
        r.register(
            "debug_header_requests",
            "Requests checked for the debug-header token, by result",
            metrics.debug_header_requests.clone(),
        );
        r.register(
            "replica_inflight_expired",
            "In-flight requests released after limits.inflight_max_age without response headers",
            metrics.inflight_expired.clone(),
        );
        r.register(
            "stream_refusals",
            "ext_proc streams refused, by reason",
            metrics.stream_refusals.clone(),
        );
        r.register(
            "drift_predicted_cached_tokens",
            "Prompt tokens kvroute predicted cached on the replica, for its answered requests",
            metrics.drift_predicted_cached_tokens.clone(),
        );
        r.register(
            "drift_predicted_prompt_tokens",
            "Prompt tokens of the requests whose cached tokens kvroute predicted",
            metrics.drift_predicted_prompt_tokens.clone(),
        );
        r.register(
            "drift_observed_cached_tokens",
            "Growth of the engine's vllm:prefix_cache_hits_total between scrapes",
            metrics.drift_observed_cached_tokens.clone(),
        );
        r.register(
            "drift_observed_queried_tokens",
            "Growth of the engine's vllm:prefix_cache_queries_total between scrapes",
            metrics.drift_observed_queried_tokens.clone(),
        );
        r.register(
            "drift_ratio",
            "Share of predicted cached tokens the engine did not hit over drift.window, at the last verdict",
            metrics.drift.clone(),
        );
        r.register(
            "drift_warnings",
            "Drift verdicts past drift.bound",
            metrics.drift_warnings.clone(),
        );
        r.register(
            "drift_counter_resets",
            "Engine prefix-cache counters that went down (engine restarts)",
            metrics.drift_counter_resets.clone(),
        );
        r.register(
            "drift_degraded",
            "1 while the pool routes on the approximate tier because a replica drifts",
            metrics.drift_degraded.clone(),
        );
        r.register(
            "drift_degradations",
            "Times the pool moved to the approximate tier because of drift",
            metrics.drift_degradations.clone(),
        );
        r.register(
            "disaggregation_decisions",
            "Requests of a disaggregated pool, by decision: split (prompt computed on a prefill \
             replica), or served whole: short_prompt, cached, no_prefill_replica, prefill_busy, no_prompt",
            metrics.disaggregation_decisions.clone(),
        );
        r.register(
            "disaggregation_prefill_legs",
            "Prefill legs ext-proc sent itself (disaggregation mode envoy), by outcome: ok, or \
             served whole on the decode replica: busy, connect_error, transport_error, status, \
             timeout, no_kv_transfer_params, unsupported_request",
            metrics.disaggregation_prefill_legs.clone(),
        );
        r.register(
            "peer_news",
            "Decisions and answers shared with the other pickers through the index, by outcome: \
             sent, send_dropped (queue full); a peer's applied, answered, stale (older than \
             peers.max_staleness), unknown (model or replica not in this config), overflow, \
             expired (no answer within limits.inflight_max_age)",
            metrics.peer_news.clone(),
        );
        r.register(
            "peer_news_age_seconds",
            "Age of a peer's news on arrival here, from its send time (wall clocks: across hosts \
             it includes their offset), late ones included: how stale the shared view is",
            metrics.peer_news_age.clone(),
        );
        r.register(
            "peer_sharing",
            "1 while this picker shares decisions with the others through the index; 0: it \
             routes on its own state",
            metrics.peer_sharing.clone(),
        );
        r.register(
            "disaggregation_prefill_retries",
            "Prefill-leg attempts repeated after a 502, 503 or 504 answer or a refused connection",
            metrics.disaggregation_prefill_retries.clone(),
        );
        r.register(
            "shadow_requests",
            "Shadow-mode decisions compared with the replica Envoy served them on",
            metrics.shadow_requests.clone(),
        );
        r.register(
            "shadow_unobserved",
            "Shadow-mode decisions Envoy reported no served replica for (not compared)",
            metrics.shadow_unobserved.clone(),
        );
        r.register(
            "shadow_prompt_tokens",
            "Prompt tokens of compared shadow-mode decisions",
            metrics.shadow_prompt_tokens.clone(),
        );
        r.register(
            "shadow_held_tokens",
            "Shadow mode: cached prompt tokens the best candidate held",
            metrics.shadow_held_tokens.clone(),
        );
        r.register(
            "shadow_captured_tokens",
            "Shadow mode: cached prompt tokens kvroute's choice held (what it would have captured)",
            metrics.shadow_captured_tokens.clone(),
        );
        r.register(
            "shadow_served_predicted_tokens",
            "Shadow mode: cached prompt tokens the replica Envoy chose held, by kvroute's view",
            metrics.shadow_served_predicted_tokens.clone(),
        );
        r.register(
            "shadow_repeat_requests",
            "Shadow mode: requests some candidate held a prefix of",
            metrics.shadow_repeat_requests.clone(),
        );
        r.register(
            "shadow_repeat_cold_requests",
            "Shadow mode: requests some candidate held a prefix of that Envoy sent to a replica holding none of it",
            metrics.shadow_repeat_cold_requests.clone(),
        );
        r.register(
            "pool_engine_cached_tokens",
            "Prompt tokens the pool's engines served from their prefix caches (deltas of vllm:prefix_cache_hits_total): delivered",
            metrics.pool_engine_cached_tokens.clone(),
        );
        r.register(
            "pool_engine_prompt_tokens",
            "Prompt tokens the pool's engines looked up in their prefix caches (deltas of vllm:prefix_cache_queries_total)",
            metrics.pool_engine_prompt_tokens.clone(),
        );
        r.register(
            "decision_records",
            "Decisions recorded for /v1/decisions, by why (flagged, sampled)",
            metrics.decision_records.clone(),
        );
        metrics
    }
}
