//! Shadow mode: what kvroute would gain on a pool's traffic, before it routes it.
//!
//! A pool with `mode: shadow` is decided exactly as a routed one (tokens, keys, index, scores,
//! the commit that later decisions see), but the answer to Envoy names no destination, so
//! Envoy's own load balancing picks the replica. When the response begins, Envoy reports the
//! replica it served (override_host's `selected_host_key`, which it writes for its fallback
//! policy's choice too) and the decision is compared with it, per pool:
//!
//! - **held**: prompt tokens the best candidate would have served from its prefix cache;
//! - **captured**: what kvroute's choice would have served (its prediction);
//! - **served, predicted**: what the replica Envoy chose would serve, by kvroute's view;
//! - **delivered**: what the engines actually served from their prefix caches — the deltas of
//!   their own `vllm:prefix_cache_hits_total`, read by the scrape (so every request the pool's
//!   engines served, kvroute-decided or not);
//! - **repeat / repeat, cold**: requests some candidate held a prefix of, and of those the ones
//!   Envoy sent to a replica holding none of it.
//!
//! The projected gain is captured − delivered tokens of prefill, and that times
//! `scoring.prefill_ms_per_token` in time. Exported as `kvroute_extproc_shadow_*` and
//! `kvroute_extproc_pool_engine_*` metrics, summarised at the admin port's `/v1/shadow`, and
//! logged once a minute per shadow pool with traffic. Shadow decisions cost no engine work and
//! change neither the request nor the response.
//!
//! Since the request goes where Envoy sends it, kvroute's in-flight accounting counts it on its
//! own choice until the response begins; then the prefix memory learns the replica that served it
//! and its prediction stays out of the chosen replica's drift (as for a retried request).

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::Serialize;

use crate::config::{Config, PoolMode};
use crate::metrics::{Metrics, PoolLabel};
use crate::records::Explained;

/// How often a shadow pool's summary is logged.
pub const LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// One shadow decision compared with the replica that served it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Comparison {
    /// The prompt's length in tokens.
    pub prompt_tokens: u64,
    /// The most any candidate would have served from cache.
    pub held_tokens: u64,
    /// What kvroute's choice would have served from cache.
    pub captured_tokens: u64,
    /// What the serving replica would serve from cache, by kvroute's view.
    pub served_predicted_tokens: u64,
}

/// Per-pool totals since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Tally {
    /// Shadow decisions whose serving replica Envoy reported.
    pub requests: u64,
    /// Shadow decisions Envoy reported no serving replica for (not compared).
    pub unobserved: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Cached prompt tokens the best candidate held.
    pub held_tokens: u64,
    /// Cached prompt tokens kvroute's choice held.
    pub captured_tokens: u64,
    /// Cached prompt tokens the replica Envoy chose held, by kvroute's view.
    pub served_predicted_tokens: u64,
    /// Requests some candidate held a prefix of.
    pub repeat_requests: u64,
    /// Of those, requests Envoy sent to a replica holding none of it.
    pub repeat_cold_requests: u64,
    /// Prompt tokens the pool's engines served from their prefix caches (their counters).
    pub delivered_tokens: u64,
    /// Prompt tokens the pool's engines were asked about (their counters).
    pub engine_prompt_tokens: u64,
}

impl Tally {
    fn since(&self, earlier: &Tally) -> Tally {
        Tally {
            requests: self.requests - earlier.requests,
            unobserved: self.unobserved - earlier.unobserved,
            prompt_tokens: self.prompt_tokens - earlier.prompt_tokens,
            held_tokens: self.held_tokens - earlier.held_tokens,
            captured_tokens: self.captured_tokens - earlier.captured_tokens,
            served_predicted_tokens: self.served_predicted_tokens - earlier.served_predicted_tokens,
            repeat_requests: self.repeat_requests - earlier.repeat_requests,
            repeat_cold_requests: self.repeat_cold_requests - earlier.repeat_cold_requests,
            delivered_tokens: self.delivered_tokens - earlier.delivered_tokens,
            engine_prompt_tokens: self.engine_prompt_tokens - earlier.engine_prompt_tokens,
        }
    }
}

/// A pool's summary at `/v1/shadow`.
#[derive(Debug, Clone, Serialize)]
pub struct PoolSummary {
    /// Pool name.
    pub pool: String,
    /// Its current mode.
    pub mode: &'static str,
    /// Totals since start.
    #[serde(flatten)]
    pub tally: Tally,
    /// Captured − delivered: prefill tokens kvroute's choices would have saved (negative when
    /// Envoy's choices were served more from cache than kvroute's would have been).
    pub projected_gain_tokens: i64,
    /// The same in prefill time, seconds (`scoring.prefill_ms_per_token`).
    pub projected_prefill_saving_seconds: f64,
    /// Repeat requests sent to a replica holding none of their prefix, over repeat requests.
    pub repeat_cold_share: Option<f64>,
}

/// Counts shadow comparisons and the engines' delivered tokens into the metrics, which are the
/// only tally (`/v1/shadow` and the log read them back).
#[derive(Debug)]
pub struct ShadowBook {
    metrics: Metrics,
    log: Mutex<LogState>,
}

/// What the last log line covered.
#[derive(Debug)]
struct LogState {
    /// The totals at the last log line, per pool.
    logged: HashMap<String, Tally>,
    last_log: Instant,
}

impl ShadowBook {
    /// An empty book counting into `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            log: Mutex::new(LogState {
                logged: HashMap::new(),
                last_log: Instant::now(),
            }),
        }
    }

    /// A shadow decision of `pool` and the replica that served it.
    pub fn compare(&self, pool: &str, comparison: Comparison) {
        let label = PoolLabel {
            pool: pool.to_owned(),
        };
        let m = &self.metrics;
        m.shadow_requests.get_or_create(&label).inc();
        m.shadow_prompt_tokens
            .get_or_create(&label)
            .inc_by(comparison.prompt_tokens);
        m.shadow_held_tokens
            .get_or_create(&label)
            .inc_by(comparison.held_tokens);
        m.shadow_captured_tokens
            .get_or_create(&label)
            .inc_by(comparison.captured_tokens);
        m.shadow_served_predicted_tokens
            .get_or_create(&label)
            .inc_by(comparison.served_predicted_tokens);
        // Both counted (by 0 when not) so the pool's series exist from its first comparison.
        let repeat = comparison.held_tokens > 0;
        m.shadow_repeat_requests
            .get_or_create(&label)
            .inc_by(u64::from(repeat));
        m.shadow_repeat_cold_requests
            .get_or_create(&label)
            .inc_by(u64::from(repeat && comparison.served_predicted_tokens == 0));
    }

    /// A shadow decision `explained` and the replica Envoy reported it served on, if it did: what
    /// kvroute's choice was believed to hold (its own earlier choices included) against what
    /// the serving replica held.
    pub fn compare_decision(&self, explained: &Explained, served: Option<std::net::SocketAddr>) {
        let pool = &explained.config.pools[explained.pool].name;
        let Some(at) = served.and_then(|address| explained.candidate_at(address)) else {
            self.unobserved(pool);
            return;
        };
        let scored = &explained.scored;
        self.compare(
            pool,
            Comparison {
                prompt_tokens: scored.prompt_tokens as u64,
                held_tokens: scored.held_tokens() as u64,
                captured_tokens: scored.believed_tokens(explained.chosen) as u64,
                served_predicted_tokens: scored.reusable_tokens(at) as u64,
            },
        );
    }

    /// A shadow decision of `pool` whose serving replica Envoy did not report.
    pub fn unobserved(&self, pool: &str) {
        self.metrics
            .shadow_unobserved
            .get_or_create(&PoolLabel {
                pool: pool.to_owned(),
            })
            .inc();
    }

    /// One scrape's deltas of an engine of `pool`: prompt tokens served from its prefix cache,
    /// and asked about.
    pub fn delivered(&self, pool: &str, hits: u64, queries: u64) {
        let label = PoolLabel {
            pool: pool.to_owned(),
        };
        self.metrics
            .pool_engine_cached_tokens
            .get_or_create(&label)
            .inc_by(hits);
        self.metrics
            .pool_engine_prompt_tokens
            .get_or_create(&label)
            .inc_by(queries);
    }

    /// `pool`'s totals since start, read from the metrics (a series not yet created reads 0).
    pub fn tally(&self, pool: &str) -> Tally {
        let label = PoolLabel {
            pool: pool.to_owned(),
        };
        let read = |family: &Family<PoolLabel, Counter>| {
            family.get(&label).map_or(0, |counter| counter.get())
        };
        let m = &self.metrics;
        Tally {
            requests: read(&m.shadow_requests),
            unobserved: read(&m.shadow_unobserved),
            prompt_tokens: read(&m.shadow_prompt_tokens),
            held_tokens: read(&m.shadow_held_tokens),
            captured_tokens: read(&m.shadow_captured_tokens),
            served_predicted_tokens: read(&m.shadow_served_predicted_tokens),
            repeat_requests: read(&m.shadow_repeat_requests),
            repeat_cold_requests: read(&m.shadow_repeat_cold_requests),
            delivered_tokens: read(&m.pool_engine_cached_tokens),
            engine_prompt_tokens: read(&m.pool_engine_prompt_tokens),
        }
    }

    /// Every configured pool's summary (pools without traffic show zeros).
    pub fn summaries(&self, config: &Config) -> Vec<PoolSummary> {
        config
            .pools
            .iter()
            .map(|pool| summary(&pool.name, pool.mode, self.tally(&pool.name), config))
            .collect()
    }

    /// Logs each shadow pool's last interval, at most once per [`LOG_INTERVAL`] (the scrape loop
    /// calls it; a pool without shadow traffic in the interval logs nothing).
    pub fn log_if_due(&self, config: &Config) {
        let mut state = self.log.lock();
        if state.last_log.elapsed() < LOG_INTERVAL {
            return;
        }
        state.last_log = Instant::now();
        for pool in config.pools.iter().filter(|p| p.mode == PoolMode::Shadow) {
            let total = self.tally(&pool.name);
            let before = state.logged.insert(pool.name.clone(), total);
            let interval = total.since(&before.unwrap_or_default());
            if interval.requests + interval.unobserved == 0 {
                continue;
            }
            let summary = summary(&pool.name, pool.mode, interval, config);
            tracing::info!(
                pool = %pool.name,
                requests = interval.requests,
                unobserved = interval.unobserved,
                held_tokens = interval.held_tokens,
                captured_tokens = interval.captured_tokens,
                delivered_tokens = interval.delivered_tokens,
                projected_gain_tokens = summary.projected_gain_tokens,
                projected_prefill_saving_seconds = summary.projected_prefill_saving_seconds,
                repeat_cold_share = summary.repeat_cold_share.unwrap_or(0.0),
                "shadow mode, last minute: what kvroute's choices would have served from cache \
                 against what the engines Envoy chose did"
            );
        }
    }
}

fn summary(name: &str, mode: PoolMode, tally: Tally, config: &Config) -> PoolSummary {
    let gain = i64::try_from(tally.captured_tokens).unwrap_or(i64::MAX)
        - i64::try_from(tally.delivered_tokens).unwrap_or(i64::MAX);
    PoolSummary {
        pool: name.to_owned(),
        mode: mode.as_label(),
        tally,
        projected_gain_tokens: gain,
        projected_prefill_saving_seconds: gain as f64 * config.scoring.prefill_ms_per_token
            / 1000.0,
        repeat_cold_share: (tally.repeat_requests > 0)
            .then(|| tally.repeat_cold_requests as f64 / tally.repeat_requests as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_prefix_sent_to_a_replica_holding_none_of_it_is_a_cold_repeat() {
        let book = ShadowBook::new(Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        let cold = Comparison {
            prompt_tokens: 100,
            held_tokens: 64,
            captured_tokens: 64,
            served_predicted_tokens: 0,
        };
        let warm = Comparison {
            served_predicted_tokens: 64,
            ..cold
        };
        let first_seen = Comparison {
            held_tokens: 0,
            captured_tokens: 0,
            served_predicted_tokens: 0,
            ..cold
        };
        for comparison in [cold, warm, first_seen] {
            book.compare("p", comparison);
        }
        book.delivered("p", 64, 300);
        let tally = book.tally("p");
        assert_eq!(
            (
                tally.requests,
                tally.repeat_requests,
                tally.repeat_cold_requests
            ),
            (3, 2, 1)
        );
        assert_eq!(
            (
                tally.held_tokens,
                tally.captured_tokens,
                tally.served_predicted_tokens,
                tally.delivered_tokens
            ),
            (128, 128, 64, 64)
        );
        assert_eq!(book.tally("other"), Tally::default(), "another pool");
        let later = Tally {
            requests: 5,
            ..tally
        };
        assert_eq!(later.since(&tally).requests, 2);
    }
}
