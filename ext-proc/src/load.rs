//! Replica load: scraped engine metrics plus kvroute's own in-flight accounting.
//!
//! [`LoadBoard::scrape_all`] reads each replica's vLLM `/metrics` (`vllm:num_requests_waiting`,
//! `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, falling back to the older
//! `vllm:gpu_cache_usage_perc`); a background loop calls it every `scrape.interval`. Between
//! scrapes, requests kvroute routed count as queued (`routed_since_scrape`), and every routed
//! request holds an [`InflightGuard`] (requests + prompt tokens) until its response headers.
//!
//! Each replica also keeps the block keys of its in-flight requests ([`ReplicaLoad::inflight_shared_blocks`]):
//! a sibling sent while its shared prefix is still being prefilled joins that prefill (the engine
//! batches them) instead of queueing behind it, so scoring must not count that work against it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_block_keys::KeyHasherBuilder;
use parking_lot::{Mutex, RwLock};

use crate::config::{Config, Replica};
use crate::metrics::{Metrics, ReplicaLabel};

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

    /// Stops counting the request (idempotent; dropping the guard does the same).
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
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
            gauge,
            released: false,
        }
    }

    /// Forgets replicas no longer configured.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.replicas.write().retain(|id, _| keep(id));
    }

    /// Scrapes every replica with a `metrics_url` once, concurrently.
    pub async fn scrape_all(&self, config: &Config) {
        let scrapes = config.replicas.iter().filter_map(|replica| {
            let url = replica.metrics_url.clone()?;
            Some(self.scrape_one(replica, url, config))
        });
        futures::future::join_all(scrapes).await;
    }

    async fn scrape_one(&self, replica: &Replica, url: http::Uri, config: &Config) {
        let timeout: Duration = config.scrape.timeout;
        let load = self.replica(&replica.id);
        let label = ReplicaLabel {
            replica: replica.id.clone(),
        };
        let result = tokio::time::timeout(timeout, fetch(&self.client, url)).await;
        match result.map_err(|_| "timeout".to_owned()).and_then(|r| r) {
            Ok(text) => {
                let scraped = parse_vllm_metrics(&text);
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
    let mut scraped = Scraped::default();
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
            _ => {}
        }
    }
    scraped.kv_usage = kv_usage.or(gpu_usage).unwrap_or(0.0).clamp(0.0, 1.0);
    scraped
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
