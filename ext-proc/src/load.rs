//! Replica load: scraped engine metrics plus kvroute's own in-flight accounting.
//!
//! [`LoadBoard::scrape_all`] reads each replica's vLLM `/metrics` (`vllm:num_requests_waiting`,
//! `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, falling back to the older
//! `vllm:gpu_cache_usage_perc`); a background loop calls it every `scrape.interval`. Between
//! scrapes, requests kvroute routed count as queued (`routed_since_scrape`), and every routed
//! request holds an [`InflightGuard`] (requests + prompt tokens) until its response headers.
//!
//! The same scrape reads the engine's prefix-cache counters (`vllm:prefix_cache_hits_total`,
//! `vllm:prefix_cache_queries_total`) for drift detection ([`crate::drift`]): a routed request's
//! [`InflightGuard`] carries kvroute's prediction of its cached tokens and adds it to the
//! replica's predicted side when it is released; each scrape compares both sides over the window,
//! and [`LoadBoard::pool_degraded`] says which pools route on the approximate tier because of it.
//!
//! Each replica also keeps the block keys of its in-flight requests ([`ReplicaLoad::inflight_shared_blocks`]):
//! a sibling sent while its shared prefix is still being prefilled joins that prefill (the engine
//! batches them) instead of queueing behind it, so scoring must not count that work against it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_block_keys::KeyHasherBuilder;
use kvroute_index::throttle::LogThrottle;
use parking_lot::{Mutex, RwLock};

use crate::config::{Config, DriftAction, Replica};
use crate::drift::{DriftWindow, EngineCounters, Prediction, Transition};
use crate::metrics::{Metrics, PoolLabel, ReplicaLabel};

/// Largest accepted `/metrics` body.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// Engine-reported load from the last successful scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scraped {
    /// Requests waiting in the engine's queue.
    pub waiting: f64,
    /// Requests running in the engine's batch.
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
}

/// Live load of one replica.
#[derive(Debug, Default)]
pub struct ReplicaLoad {
    scraped: Mutex<Scraped>,
    consecutive_failures: AtomicU32,
    inflight_requests: AtomicI64,
    inflight_prompt_tokens: AtomicI64,
    routed_since_scrape: AtomicI64,
    /// Block key → in-flight requests carrying it. Bounded by the in-flight requests' prompts.
    /// Block keys are hashes already: a seeded multiply mix, not SipHash (two lookups per key per
    /// request, on the request and the response path).
    inflight_keys: Mutex<HashMap<u64, u32, KeyHasherBuilder>>,
    /// Predicted cached tokens of answered requests (the drift's predicted side).
    predicted_cached_tokens: AtomicU64,
    /// Prompt tokens of those requests.
    predicted_prompt_tokens: AtomicU64,
    drift: Mutex<DriftWindow>,
    /// The "drift past the bound" warning of this replica.
    drift_log: LogThrottle,
}

/// A point-in-time view used for scoring.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LoadSnapshot {
    /// Last scraped engine load.
    pub scraped: Scraped,
    /// Routed since the last scrape (not yet visible in `scraped`).
    pub routed_since_scrape: f64,
    /// Routed by kvroute and not yet answered.
    pub inflight_requests: f64,
    /// Prompt tokens of those requests.
    pub inflight_prompt_tokens: f64,
}

impl ReplicaLoad {
    /// Current view.
    pub fn snapshot(&self) -> LoadSnapshot {
        let inflight = self.inflight_requests.load(Ordering::Relaxed).max(0);
        LoadSnapshot {
            scraped: *self.scraped.lock(),
            // A routed request the engine already answered no longer adds load the last scrape
            // missed: only the unanswered ones count.
            routed_since_scrape: self
                .routed_since_scrape
                .load(Ordering::Relaxed)
                .clamp(0, inflight) as f64,
            inflight_requests: inflight as f64,
            inflight_prompt_tokens: self.inflight_prompt_tokens.load(Ordering::Relaxed).max(0)
                as f64,
        }
    }

    /// How many leading `keys` some request in flight on this replica also carries (its prefill
    /// computes them, or did).
    pub fn inflight_shared_blocks(&self, keys: &[u64]) -> u32 {
        let inflight = self.inflight_keys.lock();
        if inflight.is_empty() {
            return 0;
        }
        // Keys are chained, so a request carrying `keys[i]` carries every key before it: the
        // in-flight ones form a leading run and a binary search finds its end.
        let shared = keys.partition_point(|key| inflight.contains_key(key));
        u32::try_from(shared).unwrap_or(u32::MAX)
    }

    /// Records a successful scrape's result, as the scrape loop does (for embedders that read the
    /// engine's load some other way, e.g. a simulator).
    pub fn record_scrape(&self, scraped: Scraped) {
        *self.scraped.lock() = scraped;
        self.routed_since_scrape.store(0, Ordering::Relaxed);
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// kvroute's side of the drift so far: the predictions of the replica's answered requests.
    pub fn predicted(&self) -> Prediction {
        Prediction {
            cached_tokens: self.predicted_cached_tokens.load(Ordering::Relaxed),
            prompt_tokens: self.predicted_prompt_tokens.load(Ordering::Relaxed),
        }
    }

    /// Whether the last drift verdict says kvroute's predictions do not match this engine.
    pub fn is_drifting(&self) -> bool {
        self.drift.lock().is_drifting()
    }

    /// Whether the replica counts as ready (scrapes have not failed too often in a row).
    pub fn is_ready(&self, unready_after_failures: u32) -> bool {
        unready_after_failures == 0
            || self.consecutive_failures.load(Ordering::Relaxed) < unready_after_failures
    }
}

/// Counts a routed request on its replica until released or dropped.
#[derive(Debug)]
pub struct InflightGuard {
    load: Arc<ReplicaLoad>,
    prompt_tokens: i64,
    keys: Vec<u64>,
    /// kvroute's prediction for the request, added to the drift's predicted side on release.
    prediction: Option<Prediction>,
    gauge: prometheus_client::metrics::gauge::Gauge,
    released: bool,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.release();
    }
}

impl InflightGuard {
    /// Whether the request still counts on its replica.
    pub fn is_held(&self) -> bool {
        !self.released
    }

    /// Counts `prediction` on the replica's predicted side once the request is answered
    /// (released): by then the engine has scheduled it and counted its prefix-cache hits.
    pub fn with_prediction(mut self, prediction: Prediction) -> Self {
        self.prediction = Some(prediction);
        self
    }

    /// Stops counting the request (idempotent; dropping the guard does the same).
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        if let Some(prediction) = self.prediction {
            self.load
                .predicted_cached_tokens
                .fetch_add(prediction.cached_tokens, Ordering::Relaxed);
            self.load
                .predicted_prompt_tokens
                .fetch_add(prediction.prompt_tokens, Ordering::Relaxed);
        }
        self.load.inflight_requests.fetch_sub(1, Ordering::Relaxed);
        self.load
            .inflight_prompt_tokens
            .fetch_sub(self.prompt_tokens, Ordering::Relaxed);
        if !self.keys.is_empty() {
            let mut inflight = self.load.inflight_keys.lock();
            for key in &self.keys {
                if let Some(count) = inflight.get_mut(key) {
                    *count -= 1;
                    if *count == 0 {
                        inflight.remove(key);
                    }
                }
            }
        }
        self.gauge.dec();
    }
}

/// Load of every configured replica.
#[derive(Debug)]
pub struct LoadBoard {
    replicas: RwLock<HashMap<String, Arc<ReplicaLoad>>>,
    /// Pools routing on the approximate tier because a replica drifts (`drift.action: approximate`).
    degraded_pools: RwLock<HashSet<String>>,
    client: Client<HttpConnector, Empty<Bytes>>,
    metrics: Metrics,
}

impl LoadBoard {
    /// An empty board.
    pub fn new(metrics: Metrics) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            replicas: RwLock::default(),
            degraded_pools: RwLock::default(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            metrics,
        }
    }

    /// The load record of `replica` (created on first use).
    pub fn replica(&self, replica: &str) -> Arc<ReplicaLoad> {
        if let Some(load) = self.replicas.read().get(replica) {
            return Arc::clone(load);
        }
        Arc::clone(self.replicas.write().entry(replica.to_owned()).or_default())
    }

    /// Starts counting a request routed to `replica`: `prompt_tokens` of prefill work it adds,
    /// `keys` the block keys of its prompt (empty when unknown).
    pub fn start_request(
        &self,
        replica: &str,
        prompt_tokens: usize,
        keys: Vec<u64>,
    ) -> InflightGuard {
        let load = self.replica(replica);
        let prompt_tokens = i64::try_from(prompt_tokens).unwrap_or(i64::MAX);
        if !keys.is_empty() {
            let mut inflight = load.inflight_keys.lock();
            for key in &keys {
                *inflight.entry(*key).or_insert(0) += 1;
            }
        }
        load.inflight_requests.fetch_add(1, Ordering::Relaxed);
        load.inflight_prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        load.routed_since_scrape.fetch_add(1, Ordering::Relaxed);
        let gauge = self
            .metrics
            .replica_inflight
            .get_or_create(&ReplicaLabel {
                replica: replica.to_owned(),
            })
            .clone();
        gauge.inc();
        InflightGuard {
            load,
            prompt_tokens,
            keys,
            prediction: None,
            gauge,
            released: false,
        }
    }

    /// Forgets replicas no longer configured.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.replicas.write().retain(|id, _| keep(id));
    }

    /// Whether `pool`'s decisions skip the index because one of its replicas drifts.
    pub fn pool_degraded(&self, pool: &str) -> bool {
        let degraded = self.degraded_pools.read();
        !degraded.is_empty() && degraded.contains(pool)
    }

    /// Scrapes every replica with a `metrics_url` once, concurrently, then updates which pools
    /// are degraded by drift.
    pub async fn scrape_all(&self, config: &Config) {
        let scrapes = config.replicas.iter().filter_map(|replica| {
            let url = replica.metrics_url.clone()?;
            Some(self.scrape_one(replica, url, config))
        });
        futures::future::join_all(scrapes).await;
        self.update_degraded_pools(config);
    }

    /// A pool is degraded while any of its replicas drifts, with `drift.action: approximate`.
    fn update_degraded_pools(&self, config: &Config) {
        let approximate = config.drift.action == DriftAction::Approximate;
        let mut degraded = HashSet::new();
        for (i, pool) in config.pools.iter().enumerate() {
            let drifting: Vec<&str> = config
                .replicas
                .iter()
                .filter(|r| r.pool == i && self.replica(&r.id).is_drifting())
                .map(|r| r.id.as_str())
                .collect();
            let is_degraded = approximate && !drifting.is_empty();
            let label = PoolLabel {
                pool: pool.name.clone(),
            };
            self.metrics
                .drift_degraded
                .get_or_create(&label)
                .set(i64::from(is_degraded));
            let was_degraded = self.pool_degraded(&pool.name);
            if is_degraded && !was_degraded {
                self.metrics.drift_degradations.get_or_create(&label).inc();
                tracing::warn!(
                    pool = %pool.name,
                    drifting_replicas = ?drifting,
                    "pool routes on the approximate tier: kvroute's cached-token predictions \
                     drift from its engines' (drift.action: approximate)"
                );
            } else if was_degraded && !is_degraded {
                tracing::info!(pool = %pool.name, "pool routes on the index again: drift cleared");
            }
            if is_degraded {
                degraded.insert(pool.name.clone());
            }
        }
        let mut current = self.degraded_pools.write();
        if *current != degraded {
            *current = degraded;
        }
    }

    /// Compares the replica's predicted side with the engine's counters from this scrape.
    fn observe_drift(
        &self,
        replica: &Replica,
        load: &ReplicaLoad,
        engine: EngineCounters,
        predicted: Prediction,
        config: &Config,
        label: &ReplicaLabel,
    ) {
        let drift_config = &config.drift;
        let observation =
            load.drift
                .lock()
                .observe(Instant::now(), engine, predicted, drift_config);
        let metrics = &self.metrics;
        metrics
            .drift_predicted_cached_tokens
            .get_or_create(label)
            .inc_by(observation.predicted.cached_tokens);
        metrics
            .drift_predicted_prompt_tokens
            .get_or_create(label)
            .inc_by(observation.predicted.prompt_tokens);
        metrics
            .drift_observed_cached_tokens
            .get_or_create(label)
            .inc_by(observation.observed_hits);
        metrics
            .drift_observed_queried_tokens
            .get_or_create(label)
            .inc_by(observation.observed_queries);
        if observation.reset {
            metrics.drift_counter_resets.get_or_create(label).inc();
            tracing::info!(replica_id = %replica.id, "engine prefix-cache counters went down: engine restarted");
        }
        let pool = config
            .pools
            .get(replica.pool)
            .map_or("", |p| p.name.as_str());
        match observation.transition {
            Some(Transition::Started) => tracing::warn!(
                replica_id = %replica.id,
                pool,
                "replica drifting: its engine hits fewer cached tokens than kvroute predicts"
            ),
            Some(Transition::Cleared) => {
                tracing::info!(replica_id = %replica.id, pool, "replica no longer drifting");
            }
            None => {}
        }
        let Some(drift) = observation.drift else {
            return;
        };
        metrics.drift.get_or_create(label).set(drift);
        if drift > drift_config.bound {
            metrics.drift_warnings.get_or_create(label).inc();
            if let Some(suppressed) = load.drift_log.allow() {
                tracing::warn!(
                    replica_id = %replica.id,
                    pool,
                    drift,
                    bound = drift_config.bound,
                    window_predicted_cached_tokens = observation.window_predicted,
                    window_observed_cached_tokens = observation.window_observed,
                    action = drift_config.action.as_label(),
                    suppressed,
                    "kvroute's predicted cached tokens drift from what the engine hits: check \
                     that the engine's chat template, tokenizer and template kwargs are the pool's"
                );
            }
        }
    }

    async fn scrape_one(&self, replica: &Replica, url: http::Uri, config: &Config) {
        let timeout: Duration = config.scrape.timeout;
        let load = self.replica(&replica.id);
        let label = ReplicaLabel {
            replica: replica.id.clone(),
        };
        // kvroute's side is read before the engine's: every request it counts was answered, so
        // the engine counted its hits before this scrape reads them (drift can only read low).
        let predicted = load.predicted();
        let result = tokio::time::timeout(timeout, fetch(&self.client, url)).await;
        match result.map_err(|_| "timeout".to_owned()).and_then(|r| r) {
            Ok(text) => {
                let (scraped, prefix_cache) = parse_exposition(&text);
                if let Some(engine) = prefix_cache {
                    self.observe_drift(replica, &load, engine, predicted, config, &label);
                }
                *load.scraped.lock() = scraped;
                load.routed_since_scrape.store(0, Ordering::Relaxed);
                load.consecutive_failures.store(0, Ordering::Relaxed);
                self.metrics
                    .replica_waiting
                    .get_or_create(&label)
                    .set(scraped.waiting);
                self.metrics
                    .replica_running
                    .get_or_create(&label)
                    .set(scraped.running);
                self.metrics
                    .replica_kv_usage
                    .get_or_create(&label)
                    .set(scraped.kv_usage);
                self.metrics.replica_ready.get_or_create(&label).set(1);
            }
            Err(error) => {
                let failures = load.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
                self.metrics.scrape_failures.get_or_create(&label).inc();
                let ready = load.is_ready(config.scrape.unready_after_failures);
                self.metrics
                    .replica_ready
                    .get_or_create(&label)
                    .set(i64::from(ready));
                if failures == config.scrape.unready_after_failures {
                    tracing::warn!(replica_id = %replica.id, %error, failures, "replica not ready: metrics scrapes failing");
                } else {
                    tracing::debug!(replica_id = %replica.id, %error, failures, "metrics scrape failed");
                }
            }
        }
    }
}

async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: http::Uri,
) -> Result<String, String> {
    let response = client.get(url).await.map_err(|e| format!("{e:#}"))?;
    let status = response.status();
    if !status.is_success() {
        return Err(format!("status {status}"));
    }
    let body = http_body_util::Limited::new(response.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    String::from_utf8(body.to_vec()).map_err(|e| e.to_string())
}

/// Reads the load gauges from Prometheus text. Series with several label sets (several models or
/// engines behind one server) are summed; KV usage takes the maximum.
pub fn parse_vllm_metrics(text: &str) -> Scraped {
    parse_exposition(text).0
}

/// The load gauges and, when the engine exports both, its prefix-cache counters (summed over
/// label sets).
pub fn parse_exposition(text: &str) -> (Scraped, Option<EngineCounters>) {
    let mut scraped = Scraped::default();
    let mut hits: Option<f64> = None;
    let mut queries: Option<f64> = None;
    let mut kv_usage: Option<f64> = None;
    let mut gpu_usage: Option<f64> = None;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let value_text = match line.rfind('}') {
            Some(close) => &line[close + 1..],
            None => &line[name_end..],
        };
        // `value [timestamp]`
        let Some(value) = value_text
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        match name {
            "vllm:num_requests_waiting" => scraped.waiting += value,
            "vllm:num_requests_running" => scraped.running += value,
            "vllm:kv_cache_usage_perc" => kv_usage = Some(kv_usage.unwrap_or(0.0).max(value)),
            "vllm:gpu_cache_usage_perc" => gpu_usage = Some(gpu_usage.unwrap_or(0.0).max(value)),
            "vllm:prefix_cache_hits_total" => hits = Some(hits.unwrap_or(0.0) + value),
            "vllm:prefix_cache_queries_total" => queries = Some(queries.unwrap_or(0.0) + value),
            _ => {}
        }
    }
    scraped.kv_usage = kv_usage.or(gpu_usage).unwrap_or(0.0).clamp(0.0, 1.0);
    let prefix_cache = hits
        .zip(queries)
        .map(|(hits, queries)| EngineCounters { hits, queries });
    (scraped, prefix_cache)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inflight_keys_live_as_long_as_their_requests() {
        let board = LoadBoard::new(Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let first = board.start_request("r0", 48, vec![1, 2, 3]);
        let sibling = board.start_request("r0", 16, vec![1, 2, 4]);
        let load = board.replica("r0");
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3, 9]), 3);
        assert_eq!(board.replica("r1").inflight_shared_blocks(&[1]), 0);
        drop(first);
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3]), 2);
        let mut sibling = sibling;
        sibling.release();
        assert!(!sibling.is_held());
        assert_eq!(load.inflight_shared_blocks(&[1, 2, 3]), 0);
        assert_eq!(load.snapshot().inflight_requests, 0.0);
        drop(sibling);
        assert_eq!(load.snapshot().inflight_requests, 0.0, "released once");
        assert!(load.inflight_keys.lock().is_empty());
    }

    #[test]
    fn drift_degrades_the_pool_of_a_drifting_replica_until_it_clears() {
        let config = Config::from_yaml(
            "drift: {bound: 0.5, clear_below: 0.2, window: 1m, min_tokens: 100, action: approximate}\n\
             pools:\n\
             - {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
             - {name: q, models: [n], block_size: 16, key_scheme: {kind: token-chain}}\n\
             replicas:\n\
             - {id: r0, pool: p, address: \"127.0.0.1:8000\"}\n\
             - {id: r1, pool: p, address: \"127.0.0.1:8001\"}\n\
             - {id: r2, pool: q, address: \"127.0.0.1:8002\"}\n",
        )
        .unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let board = LoadBoard::new(Metrics::register(&mut registry));
        let scrape = |replica: usize, hits: f64| {
            let replica = &config.replicas[replica];
            let label = ReplicaLabel {
                replica: replica.id.clone(),
            };
            let engine = EngineCounters {
                hits,
                queries: hits * 2.0 + 1000.0,
            };
            let load = board.replica(&replica.id);
            board.observe_drift(replica, &load, engine, load.predicted(), &config, &label);
        };
        let route = |replica: &str, cached_tokens: u64| {
            let before = board.replica(replica).predicted();
            let guard = board.start_request(replica, 10, Vec::new());
            let guard = guard.with_prediction(Prediction {
                cached_tokens,
                prompt_tokens: cached_tokens * 2,
            });
            assert_eq!(
                board.replica(replica).predicted(),
                before,
                "counted once answered"
            );
            drop(guard);
            assert_eq!(
                board.replica(replica).predicted().cached_tokens,
                before.cached_tokens + cached_tokens
            );
        };
        for replica in 0..3 {
            scrape(replica, 0.0); // baselines
        }
        route("r0", 1000);
        route("r1", 1000);
        route("r2", 1000);
        scrape(0, 50.0); // r0's engine hit 50 of 1000: drift 0.95
        scrape(1, 1000.0);
        scrape(2, 1000.0);
        board.update_degraded_pools(&config);
        assert!(board.replica("r0").is_drifting());
        assert!(!board.replica("r1").is_drifting());
        assert!(board.pool_degraded("p") && !board.pool_degraded("q"));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "kvroute_extproc_drift_ratio{replica=\"r0\"} 0.95",
            "kvroute_extproc_drift_ratio{replica=\"r1\"} 0.0",
            "kvroute_extproc_drift_predicted_cached_tokens_total{replica=\"r0\"} 1000",
            "kvroute_extproc_drift_observed_cached_tokens_total{replica=\"r0\"} 50",
            "kvroute_extproc_drift_warnings_total{replica=\"r0\"} 1",
            "kvroute_extproc_drift_degraded{pool=\"p\"} 1",
            "kvroute_extproc_drift_degraded{pool=\"q\"} 0",
            "kvroute_extproc_drift_degradations_total{pool=\"p\"} 1",
        ] {
            assert!(text.contains(line), "{line} in\n{text}");
        }
        assert!(!text.contains("drift_warnings_total{replica=\"r1\"}"));

        // r0's engine restarts: its counters start from zero (a reset, not negative drift) and
        // it hits what kvroute predicts from then on. The window holds 10000 predicted and
        // 50 + 30 + 9000 hit tokens: drift 0.092, under clear_below, and the pool recovers.
        scrape(0, 30.0);
        board.update_degraded_pools(&config);
        assert!(
            board.pool_degraded("p"),
            "still drifting: 1000 predicted, 80 hit"
        );
        route("r0", 9000);
        scrape(0, 9030.0);
        board.update_degraded_pools(&config);
        assert!(!board.replica("r0").is_drifting());
        assert!(!board.pool_degraded("p"));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("kvroute_extproc_drift_counter_resets_total{replica=\"r0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_extproc_drift_degraded{pool=\"p\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn parses_vllm_exposition() {
        let text = "# HELP vllm:num_requests_waiting x\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_running{model_name=\"m\"} 7 1712000000000\n\
            vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n\
            vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
            vllm:num_requests_waiting_total 100\n";
        assert_eq!(
            parse_vllm_metrics(text),
            Scraped {
                waiting: 5.0,
                running: 7.0,
                kv_usage: 0.25
            }
        );
        assert_eq!(parse_exposition(text).1, None, "no prefix-cache counters");
        let counters = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 100.0\n\
            vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"m\"} 1712000000.5\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 64.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 16.0\n\
            vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 20.0\n\
            vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 999.0\n";
        assert_eq!(
            parse_exposition(counters).1,
            Some(EngineCounters {
                hits: 80.0,
                queries: 120.0
            })
        );
        let old = "vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_running NaN\n";
        assert_eq!(
            parse_vllm_metrics(old),
            Scraped {
                waiting: 0.0,
                running: 0.0,
                kv_usage: 0.5
            }
        );
    }
}
