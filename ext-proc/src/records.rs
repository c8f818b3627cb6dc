//! Decision records: "why this replica".
//!
//! A record is what a decision saw and concluded: every candidate's matched blocks (the index's
//! answer and what scoring believed), its load and estimated time to first token, the tier and
//! reason, where the tokens came from and how long they took. Decisions are recorded when the
//! request carries the debug token (or `debug_headers.expose: always`) and for a sampled share
//! (`decision_records.sample`); the most recent `decision_records.keep` are served as JSON at
//! the admin port's `/v1/decisions`, and a flagged request's own record comes back compact in
//! the `x-kvroute-explain` response header.
//!
//! Records hold replica ids and addresses (config), the model name and counts — never prompt
//! text or tokens.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_routing::Scored;
use parking_lot::Mutex;
use serde::Serialize;

use crate::config::Config;
use crate::picker::Decision;
use crate::request::ParsedRequest;

/// Response header carrying a flagged request's record, compact.
pub const EXPLAIN_HEADER: &str = "x-kvroute-explain";

/// What one decision saw and concluded.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// When it was decided, ms since the Unix epoch.
    pub at_unix_ms: u64,
    /// The pool's name.
    pub pool: String,
    /// The pool's mode (`route` or `shadow`).
    pub mode: &'static str,
    /// The model the request named (empty: the pool's base model).
    pub model: String,
    /// The tier that decided (`precise`, `approximate`, `load`).
    pub tier: &'static str,
    /// Why the chosen replica won, or why no prefix information was used.
    pub reason: &'static str,
    /// The chosen replica's id.
    pub chosen: String,
    /// Prompt tokens predicted cached on the chosen replica.
    pub predicted_cached_tokens: usize,
    /// The prefill replica's id, when a disaggregated pool split the request.
    pub prefill: Option<String>,
    /// The prompt's tokens, when it had any.
    pub tokens: Option<TokenFacts>,
    /// How long the decision took, ms.
    pub decision_ms: f64,
    /// Every candidate, in the pool's order.
    pub candidates: Vec<CandidateRecord>,
}

/// Where a decision's tokens came from.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TokenFacts {
    /// The token source (`cache`, `tokenizer`, `leading`, `resumed`, `prefix_cache`, `client`).
    pub source: &'static str,
    /// Prompt length in tokens (estimated when only a leading part was tokenized).
    pub prompt_tokens: usize,
    /// Full blocks whose keys were asked about.
    pub blocks: usize,
    /// Time spent getting the tokens, ms.
    pub tokenize_ms: f64,
}

/// One candidate as the decision saw it.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateRecord {
    /// Replica id.
    pub replica: String,
    /// Its `ip:port`.
    pub address: String,
    /// Whether it was chosen.
    pub chosen: bool,
    /// The index's precise answer (leading blocks the engine would reuse), when it vouched for
    /// the replica; `None` when it did not, was not asked or did not answer.
    pub indexed_blocks: Option<u32>,
    /// Leading blocks scoring believed held (index, kvroute's recent inserts, or the approximate
    /// memory).
    pub matched_blocks: u32,
    /// Prompt tokens it would serve from its prefix cache now.
    pub reusable_tokens: usize,
    /// Requests the engine reported waiting at the last scrape.
    pub waiting: f64,
    /// Requests the engine reported running at the last scrape.
    pub running: f64,
    /// KV-cache usage the engine reported, 0 to 1.
    pub kv_usage: f64,
    /// Requests kvroute routed there and not yet answered.
    pub inflight_requests: f64,
    /// Of those, the ones that carry as much of this prompt as the replica holds or computes for
    /// it (`InflightOverlap::siblings`): the pile-up the hotspot guard counts. `None` without the
    /// prompt (the load tier).
    pub inflight_siblings: Option<u32>,
    /// Estimated time to first token there, ms.
    pub estimated_ttft_ms: f64,
}

impl DecisionRecord {
    /// The record in one header value: tier, reason and tokens, then each candidate as
    /// `id:matched blocks/indexed blocks (or -)/waiting/estimated TTFT ms`, the chosen one
    /// marked `*` (and `prefill=<id>` before them when the request was split). E.g.
    /// `precise/cache_hit tokens=612 src=cache; *r0:37/37/0/4.1 r1:0/0/2/190.3`.
    pub fn compact(&self) -> String {
        let mut out = format!("{}/{}", self.tier, self.reason);
        if let Some(tokens) = &self.tokens {
            let _ = write!(
                out,
                " tokens={} src={} tokenize_ms={:.2}",
                tokens.prompt_tokens, tokens.source, tokens.tokenize_ms
            );
        }
        if let Some(prefill) = &self.prefill {
            let _ = write!(out, " prefill={prefill}");
        }
        out.push(';');
        for candidate in &self.candidates {
            let indexed = candidate
                .indexed_blocks
                .map_or_else(|| "-".to_owned(), |blocks| blocks.to_string());
            let _ = write!(
                out,
                " {}{}:{}/{}/{}/{:.1}",
                if candidate.chosen { "*" } else { "" },
                candidate.replica,
                candidate.matched_blocks,
                indexed,
                candidate.waiting,
                candidate.estimated_ttft_ms
            );
        }
        out
    }
}

/// The most recent records, bounded.
#[derive(Debug, Default)]
pub struct DecisionRecords {
    kept: Mutex<VecDeque<Arc<DecisionRecord>>>,
}

impl DecisionRecords {
    /// Keeps `record`, dropping the oldest beyond `keep`.
    pub fn push(&self, record: Arc<DecisionRecord>, keep: usize) {
        if keep == 0 {
            return;
        }
        let mut kept = self.kept.lock();
        while kept.len() >= keep {
            kept.pop_front();
        }
        kept.push_back(record);
    }

    /// The most recent `limit` records, newest first.
    pub fn latest(&self, limit: usize) -> Vec<Arc<DecisionRecord>> {
        self.kept.lock().iter().rev().take(limit).cloned().collect()
    }
}

/// What a decision saw of its candidates: what a record explains and shadow mode compares.
#[derive(Debug)]
pub struct Explained {
    /// The config the decision used.
    pub config: Arc<Config>,
    /// Its pool.
    pub pool: usize,
    /// The candidates, as indices into `config.replicas`.
    pub candidates: Vec<usize>,
    /// Each candidate as scored.
    pub scored: Scored,
    /// The chosen candidate's position.
    pub chosen: usize,
    /// The prompt's tokens, when it had any.
    pub tokens: Option<TokenFacts>,
}

impl Explained {
    /// The candidate serving on `address`, if exactly one does (several data-parallel ranks
    /// behind one address do not say which of them served).
    pub fn candidate_at(&self, address: SocketAddr) -> Option<usize> {
        let mut at = self
            .candidates
            .iter()
            .enumerate()
            .filter(|&(_, &r)| self.config.replicas[r].address == address);
        match (at.next(), at.next()) {
            (Some((position, _)), None) => Some(position),
            _ => None,
        }
    }
}

impl Decision {
    /// The GIE destination value: the chosen `ip:port`, then the fallbacks, comma-separated
    /// (the same string goes in the header and in `envoy.lb` metadata).
    pub fn destination(&self) -> String {
        let mut value = self.address.to_string();
        for fallback in &self.fallbacks {
            value.push(',');
            value.push_str(&fallback.to_string());
        }
        value
    }
}

impl DecisionRecord {
    /// The record of `decision` for `request`, decided in `elapsed` (its candidates, when they
    /// were kept: `explained`).
    pub fn of(
        decision: &Decision,
        request: &ParsedRequest<'_>,
        elapsed: std::time::Duration,
    ) -> Self {
        let mut record = DecisionRecord {
            at_unix_ms: unix_ms(),
            pool: String::new(),
            mode: decision.mode.as_label(),
            model: request.model.to_string(),
            tier: decision.tier.as_label(),
            reason: decision.reason,
            chosen: decision.replica_id.clone(),
            predicted_cached_tokens: decision.predicted_cached_tokens,
            prefill: decision.prefill.as_ref().map(|leg| leg.replica_id.clone()),
            tokens: None,
            decision_ms: elapsed.as_secs_f64() * 1000.0,
            candidates: Vec::new(),
        };
        let Some(explained) = decision.explained.as_deref() else {
            return record;
        };
        let config = &explained.config;
        let scored = &explained.scored;
        record.pool.clone_from(&config.pools[explained.pool].name);
        record.tokens = explained.tokens;
        record.candidates = explained
            .candidates
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let replica = &config.replicas[r];
                let view = scored.views.get(i);
                let load = view.map(|v| v.load).unwrap_or_default();
                CandidateRecord {
                    replica: replica.id.clone(),
                    address: replica.address.to_string(),
                    chosen: i == explained.chosen,
                    indexed_blocks: scored
                        .indexed
                        .get(i)
                        .copied()
                        .flatten()
                        .map(|found| found.matched_blocks),
                    matched_blocks: view.map_or(0, |v| v.matched_blocks),
                    reusable_tokens: scored.reusable_tokens(i),
                    waiting: load.scraped.waiting,
                    running: load.scraped.running,
                    kv_usage: load.scraped.kv_usage,
                    inflight_requests: load.inflight_requests,
                    inflight_siblings: view.and_then(|v| v.inflight_siblings),
                    estimated_ttft_ms: scored.estimated_ttft_ms(i, &config.scoring).unwrap_or(0.0),
                }
            })
            .collect();
        record
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(chosen: &str) -> DecisionRecord {
        DecisionRecord {
            at_unix_ms: 1,
            pool: "p".into(),
            mode: "route",
            model: "m".into(),
            tier: "precise",
            reason: "cache_hit",
            chosen: chosen.into(),
            predicted_cached_tokens: 592,
            prefill: None,
            tokens: Some(TokenFacts {
                source: "cache",
                prompt_tokens: 612,
                blocks: 38,
                tokenize_ms: 0.012,
            }),
            decision_ms: 0.2,
            candidates: vec![
                CandidateRecord {
                    replica: "r0".into(),
                    address: "10.0.0.1:8000".into(),
                    chosen: chosen == "r0",
                    indexed_blocks: Some(37),
                    matched_blocks: 37,
                    reusable_tokens: 592,
                    waiting: 0.0,
                    running: 1.0,
                    kv_usage: 0.1,
                    inflight_requests: 0.0,
                    inflight_siblings: Some(0),
                    estimated_ttft_ms: 4.12,
                },
                CandidateRecord {
                    replica: "r1".into(),
                    address: "10.0.0.2:8000".into(),
                    chosen: chosen == "r1",
                    indexed_blocks: None,
                    matched_blocks: 0,
                    reusable_tokens: 0,
                    waiting: 2.0,
                    running: 4.0,
                    kv_usage: 0.7,
                    inflight_requests: 3.0,
                    inflight_siblings: Some(1),
                    estimated_ttft_ms: 190.34,
                },
            ],
        }
    }

    #[test]
    fn the_compact_form_names_every_candidate_and_marks_the_chosen_one() {
        assert_eq!(
            record("r0").compact(),
            "precise/cache_hit tokens=612 src=cache tokenize_ms=0.01; *r0:37/37/0/4.1 r1:0/-/2/190.3"
        );
    }

    #[test]
    fn only_the_most_recent_records_are_kept_newest_first() {
        let records = DecisionRecords::default();
        for chosen in ["a", "b", "c"] {
            records.push(Arc::new(record(chosen)), 2);
        }
        let latest: Vec<String> = records
            .latest(10)
            .iter()
            .map(|r| r.chosen.clone())
            .collect();
        assert_eq!(latest, ["c", "b"]);
        assert_eq!(records.latest(1).len(), 1);
        records.push(Arc::new(record("d")), 0);
        assert_eq!(records.latest(10).len(), 2, "keep 0 records nothing");
    }
}
