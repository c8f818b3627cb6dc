//! Engine scrapes: each replica's `/metrics` read every `scrape.interval` into the routing core's
//! load board, and drift detection on the same read.
//!
//! [`Scraper::scrape_all`] reads, from vLLM, `vllm:num_requests_waiting`,
//! `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (falling back to the older
//! `vllm:gpu_cache_usage_perc`), from SGLang `sglang:num_queue_reqs`, `sglang:num_running_reqs`,
//! `sglang:token_usage`, and records them with [`ReplicaLoad::record_scrape`]; failures in a row
//! make a replica unready.
//!
//! The same scrape reads the engine's prefix-cache counters (`vllm:prefix_cache_hits_total` and
//! `vllm:prefix_cache_queries_total`, or `sglang:cached_tokens_total` and
//! `sglang:prompt_tokens_total`) for drift detection ([`crate::drift`]): a routed request's
//! in-flight guard carries kvroute's prediction of its cached tokens and adds it to the replica's
//! predicted side when it is released; each scrape compares both sides over the window, and
//! [`Scraper::pool_degraded`] says which pools route on the approximate tier because of it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_index_core::throttle::LogThrottle;
use kvroute_routing::load::{LoadBoard, Prediction, ReplicaLoad, Scraped};
use parking_lot::{Mutex, RwLock};

use crate::config::{Config, DriftAction, Engine, Replica};
use crate::drift::{DriftWindow, EngineCounters, Transition};
use crate::metrics::{Metrics, PoolLabel, ReplicaLabel};
use crate::shadow::ShadowBook;

/// Largest accepted `/metrics` body.
const MAX_METRICS_BYTES: usize = 4 * 1024 * 1024;

/// One replica's drift state.
#[derive(Debug, Default)]
struct ReplicaDrift {
    window: Mutex<DriftWindow>,
    /// The "drift past the bound" warning of this replica.
    log: LogThrottle,
}

/// Scrapes every configured replica's engine and tracks drift.
#[derive(Debug)]
pub struct Scraper {
    drift: RwLock<HashMap<String, Arc<ReplicaDrift>>>,
    /// Pools routing on the approximate tier because a replica drifts (`drift.action: approximate`).
    degraded_pools: RwLock<HashSet<String>>,
    client: Client<HttpConnector, Empty<Bytes>>,
    metrics: Metrics,
}

impl Scraper {
    /// A scraper with no history.
    pub fn new(metrics: Metrics) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            drift: RwLock::default(),
            degraded_pools: RwLock::default(),
            client: Client::builder(TokioExecutor::new()).build(connector),
            metrics,
        }
    }

    /// The load board the picker routes on, its in-flight counts mirrored to `metrics`.
    pub fn load_board(metrics: &Metrics) -> LoadBoard {
        let gauges = metrics.replica_inflight.clone();
        LoadBoard::with_inflight_gauges(Box::new(move |replica| {
            gauges
                .get_or_create(&ReplicaLabel {
                    replica: replica.to_owned(),
                })
                .clone()
        }))
    }

    fn replica_drift(&self, replica: &str) -> Arc<ReplicaDrift> {
        if let Some(drift) = self.drift.read().get(replica) {
            return Arc::clone(drift);
        }
        Arc::clone(self.drift.write().entry(replica.to_owned()).or_default())
    }

    /// Whether the last drift verdict says kvroute's predictions do not match this engine.
    pub fn is_drifting(&self, replica: &str) -> bool {
        self.drift
            .read()
            .get(replica)
            .is_some_and(|drift| drift.window.lock().is_drifting())
    }

    /// Forgets replicas no longer configured.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.drift.write().retain(|id, _| keep(id));
    }

    /// Whether `pool`'s decisions skip the index because one of its replicas drifts.
    pub fn pool_degraded(&self, pool: &str) -> bool {
        let degraded = self.degraded_pools.read();
        !degraded.is_empty() && degraded.contains(pool)
    }

    /// Scrapes every replica with a `metrics_url` once, concurrently, then updates which pools
    /// are degraded by drift.
    /// The engines' prefix-cache deltas also go to `shadow`, per pool (what they delivered).
    /// Data-parallel ranks behind one API server share its endpoint: it is read once, and each
    /// rank takes its own `engine="<rank>"` series.
    pub async fn scrape_all(&self, loads: &LoadBoard, config: &Config, shadow: &ShadowBook) {
        let mut by_url: Vec<(&http::Uri, Vec<&Replica>)> = Vec::new();
        for replica in &config.replicas {
            let Some(url) = &replica.metrics_url else {
                continue;
            };
            match by_url.iter_mut().find(|(u, _)| *u == url) {
                Some((_, replicas)) => replicas.push(replica),
                None => by_url.push((url, vec![replica])),
            }
        }
        let scrapes = by_url
            .into_iter()
            .map(|(url, replicas)| self.scrape_endpoint(loads, url, replicas, config, shadow));
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
                .filter(|r| r.pool == i && self.is_drifting(&r.id))
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
        engine: EngineCounters,
        predicted: Prediction,
        config: &Config,
        label: &ReplicaLabel,
        shadow: &ShadowBook,
    ) {
        let drift_config = &config.drift;
        let drift_state = self.replica_drift(&replica.id);
        let observation =
            drift_state
                .window
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
        if let Some(pool) = config.pools.get(replica.pool) {
            shadow.delivered(
                &pool.name,
                observation.observed_hits,
                observation.observed_queries,
            );
        }
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
            if let Some(suppressed) = drift_state.log.allow() {
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

    /// Reads one metrics endpoint and records it for each replica it serves.
    async fn scrape_endpoint(
        &self,
        loads: &LoadBoard,
        url: &http::Uri,
        replicas: Vec<&Replica>,
        config: &Config,
        shadow: &ShadowBook,
    ) {
        let replicas: Vec<(&Replica, Arc<ReplicaLoad>)> = replicas
            .into_iter()
            .map(|replica| (replica, loads.replica(&replica.id)))
            .collect();
        // kvroute's side is read before the engine's: every request it counts was answered, so
        // the engine counted its hits before this scrape reads them (drift can only read low).
        let predicted: Vec<Prediction> =
            replicas.iter().map(|(_, load)| load.predicted()).collect();
        let result = tokio::time::timeout(config.scrape.timeout, fetch(&self.client, url.clone()))
            .await
            .map_err(|_| "timeout".to_owned())
            .and_then(|r| r);
        for ((replica, load), predicted) in replicas.into_iter().zip(predicted) {
            let read = result.as_deref().map_err(String::as_str);
            self.record(load, replica, predicted, read, config, shadow);
        }
    }

    /// Records one replica's share of a scrape (its rank's series when it is one of several).
    fn record(
        &self,
        load: Arc<ReplicaLoad>,
        replica: &Replica,
        predicted: Prediction,
        result: Result<&str, &str>,
        config: &Config,
        shadow: &ShadowBook,
    ) {
        let label = ReplicaLabel {
            replica: replica.id.clone(),
        };
        match result {
            Ok(text) => {
                let (scraped, prefix_cache) =
                    parse_exposition(text, replica.engine, replica.dp_rank);
                if let Some(engine) = prefix_cache {
                    self.observe_drift(replica, engine, predicted, config, &label, shadow);
                }
                load.record_scrape(scraped);
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
                let failures = load.record_scrape_failure();
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
#[cfg(test)]
fn parse_vllm_metrics(text: &str) -> Scraped {
    parse_exposition(text, Engine::Vllm, None).0
}

/// Where an engine family exports what a scrape reads.
struct SeriesNames {
    waiting: &'static str,
    running: &'static str,
    /// KV-cache usage, 0..1, and an older name for it.
    kv_usage: &'static str,
    kv_usage_old: Option<&'static str>,
    /// Prefix-cache hits and lookups, in prompt tokens.
    hit_tokens: &'static str,
    queried_tokens: &'static str,
    /// The label naming a data-parallel rank's series.
    rank_label: &'static str,
}

impl SeriesNames {
    fn of(engine: Engine) -> &'static Self {
        match engine {
            Engine::Vllm => &VLLM_SERIES,
            Engine::Sglang => &SGLANG_SERIES,
        }
    }
}

const VLLM_SERIES: SeriesNames = SeriesNames {
    waiting: "vllm:num_requests_waiting",
    running: "vllm:num_requests_running",
    kv_usage: "vllm:kv_cache_usage_perc",
    kv_usage_old: Some("vllm:gpu_cache_usage_perc"),
    hit_tokens: "vllm:prefix_cache_hits_total",
    queried_tokens: "vllm:prefix_cache_queries_total",
    rank_label: "engine",
};

/// SGLang's scheduler metrics (`--enable-metrics`; GIE's model-server protocol maps its queue
/// and KV utilisation to the first and third). Its cached-token counter is labelled by cache
/// source (device, host, storage) and appears with the first hit; its prompt-token counter
/// counts every prompt, so together they are vLLM's hits and queries.
const SGLANG_SERIES: SeriesNames = SeriesNames {
    waiting: "sglang:num_queue_reqs",
    running: "sglang:num_running_reqs",
    kv_usage: "sglang:token_usage",
    kv_usage_old: None,
    hit_tokens: "sglang:cached_tokens_total",
    queried_tokens: "sglang:prompt_tokens_total",
    rank_label: "dp_rank",
};

/// The load gauges and, when the engine exports them, its prefix-cache counters (summed over
/// label sets), as `engine` names them: of data-parallel rank `rank` alone when given (vLLM
/// labels each rank's series `engine="<rank>"`, SGLang `dp_rank="<rank>"`), else of every
/// series.
pub fn parse_exposition(
    text: &str,
    engine: Engine,
    rank: Option<u32>,
) -> (Scraped, Option<EngineCounters>) {
    let names = SeriesNames::of(engine);
    let rank_label = rank.map(|rank| format!("{}=\"{rank}\"", names.rank_label));
    let mut scraped = Scraped::default();
    let mut hits: Option<f64> = None;
    let mut queries: Option<f64> = None;
    let mut kv_usage: Option<f64> = None;
    let mut kv_usage_old: Option<f64> = None;
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let (labels, value_text) = match line.rfind('}') {
            Some(close) => (
                line.get(name_end + 1..close).unwrap_or(""),
                &line[close + 1..],
            ),
            None => ("", &line[name_end..]),
        };
        if let Some(wanted) = &rank_label
            && !labels.split(',').any(|label| label.trim() == wanted)
        {
            continue;
        }
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
        let add = |sum: &mut Option<f64>| *sum = Some(sum.unwrap_or(0.0) + value);
        let max = |most: &mut Option<f64>| *most = Some(most.unwrap_or(0.0).max(value));
        if name == names.waiting {
            scraped.waiting += value;
        } else if name == names.running {
            scraped.running += value;
        } else if name == names.kv_usage {
            max(&mut kv_usage);
        } else if Some(name) == names.kv_usage_old {
            max(&mut kv_usage_old);
        } else if name == names.hit_tokens {
            add(&mut hits);
        } else if name == names.queried_tokens {
            add(&mut queries);
        }
    }
    scraped.kv_usage = kv_usage.or(kv_usage_old).unwrap_or(0.0).clamp(0.0, 1.0);
    // SGLang exports no cached-token series before its first hit: none then.
    if engine == Engine::Sglang && queries.is_some() {
        hits = hits.or(Some(0.0));
    }
    let prefix_cache = hits
        .zip(queries)
        .map(|(hits, queries)| EngineCounters { hits, queries });
    (scraped, prefix_cache)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let metrics = Metrics::register(&mut registry);
        let scraper = Scraper::new(metrics.clone());
        let board = Scraper::load_board(&metrics);
        let shadow = ShadowBook::new(metrics.clone());
        let scrape = |replica: usize, hits: f64| {
            let replica = &config.replicas[replica];
            let label = ReplicaLabel {
                replica: replica.id.clone(),
            };
            let engine = EngineCounters {
                hits,
                queries: hits * 2.0 + 1000.0,
            };
            let predicted = board.replica(&replica.id).predicted();
            scraper.observe_drift(replica, engine, predicted, &config, &label, &shadow);
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
        scraper.update_degraded_pools(&config);
        assert!(scraper.is_drifting("r0"));
        assert!(!scraper.is_drifting("r1"));
        assert!(scraper.pool_degraded("p") && !scraper.pool_degraded("q"));
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
        scraper.update_degraded_pools(&config);
        assert!(
            scraper.pool_degraded("p"),
            "still drifting: 1000 predicted, 80 hit"
        );
        route("r0", 9000);
        scrape(0, 9030.0);
        scraper.update_degraded_pools(&config);
        assert!(!scraper.is_drifting("r0"));
        assert!(!scraper.pool_degraded("p"));
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
    fn a_data_parallel_rank_reads_its_own_engine_series() {
        let text = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 4\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25\n\
            vllm:kv_cache_usage_perc{engine=\"10\",model_name=\"m\"} 0.75\n\
            vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 100.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 40.0\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 7.0\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 1.0\n";
        let (rank1, counters1) = parse_exposition(text, Engine::Vllm, Some(1));
        assert_eq!(
            rank1,
            Scraped {
                waiting: 2.0,
                running: 4.0,
                kv_usage: 0.25
            }
        );
        assert_eq!(
            counters1,
            Some(EngineCounters {
                hits: 40.0,
                queries: 100.0
            })
        );
        let (rank0, counters0) = parse_exposition(text, Engine::Vllm, Some(0));
        assert_eq!(
            (rank0.waiting, rank0.running, rank0.kv_usage),
            (3.0, 0.0, 0.5)
        );
        assert_eq!(counters0.map(|c| c.queries), Some(7.0));
        assert_eq!(
            parse_exposition(text, Engine::Vllm, Some(2)).0,
            Scraped::default(),
            "no such rank"
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
        assert_eq!(
            parse_exposition(text, Engine::Vllm, None).1,
            None,
            "no prefix-cache counters"
        );
        let counters = "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 100.0\n\
            vllm:prefix_cache_queries_created{engine=\"0\",model_name=\"m\"} 1712000000.5\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 64.0\n\
            vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 16.0\n\
            vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 20.0\n\
            vllm:external_prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 999.0\n";
        assert_eq!(
            parse_exposition(counters, Engine::Vllm, None).1,
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

    #[test]
    fn sglang_exposition_reads_its_own_names_and_dp_rank_series() {
        // As SGLang 0.5.23's metrics collector labels them (its scheduler gauges per rank; the
        // cached-token counter by cache source, absent before the first hit).
        let labels = |rank: u32| {
            format!(
                "model_name=\"m\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",moe_ep_rank=\"0\",dp_rank=\"{rank}\""
            )
        };
        let text = format!(
            "# TYPE sglang:num_queue_reqs gauge\n\
             sglang:num_queue_reqs{{{r0}}} 3.0\n\
             sglang:num_queue_reqs{{{r1}}} 1.0\n\
             sglang:num_running_reqs{{{r0}}} 5.0\n\
             sglang:token_usage{{{r0}}} 0.25\n\
             sglang:token_usage{{{r1}}} 0.5\n\
             vllm:num_requests_waiting{{engine=\"0\"}} 40.0\n\
             sglang:prompt_tokens_total{{{r0},is_streaming=\"false\"}} 100.0\n\
             sglang:prompt_tokens_total{{{r0},is_streaming=\"true\"}} 20.0\n\
             sglang:cached_tokens_total{{{r0},cache_source=\"device\"}} 48.0\n\
             sglang:cached_tokens_total{{{r0},cache_source=\"host\"}} 16.0\n\
             sglang:prompt_tokens_total{{{r1},is_streaming=\"false\"}} 7.0\n",
            r0 = labels(0),
            r1 = labels(1)
        );
        let (rank0, counters0) = parse_exposition(&text, Engine::Sglang, Some(0));
        assert_eq!(
            rank0,
            Scraped {
                waiting: 3.0,
                running: 5.0,
                kv_usage: 0.25
            }
        );
        assert_eq!(
            counters0,
            Some(EngineCounters {
                hits: 64.0,
                queries: 120.0
            })
        );
        let (rank1, counters1) = parse_exposition(&text, Engine::Sglang, Some(1));
        assert_eq!((rank1.waiting, rank1.kv_usage), (1.0, 0.5));
        assert_eq!(
            counters1,
            Some(EngineCounters {
                hits: 0.0,
                queries: 7.0
            }),
            "no hit yet: no cached-token series"
        );
        // Read as vLLM, the same page has only the stray vLLM gauge.
        assert_eq!(parse_exposition(&text, Engine::Vllm, None).0.waiting, 40.0);
    }
}
