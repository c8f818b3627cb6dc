//! Per-decision diagnostics: why a router loses where it loses.
//!
//! ```text
//! cargo run --release -p kvroute-replay --example decisions -- TRACE_OR_KIND LOAD ROUTER [SEED]
//! ```
//!
//! Wraps the router and records, at every decision, the engines' exact state (cached leading
//! blocks, waiting, running) next to the choice; prints the first decisions that left cache on
//! the table (a replica held a longer prefix than the chosen one) and a summary. Runs 4 replicas
//! of the default engine with a 50 ms KV-event delay, like `kvroute-replay run`'s defaults.
#![allow(
    clippy::print_stdout,
    reason = "a diagnostic tool printing its findings"
)]

use kvroute_replay::routers::{Observed, RouterSpec};
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::trace;
use kvroute_replay::workload;

struct Seen {
    cached: Vec<usize>,
    waiting: Vec<usize>,
    running: Vec<usize>,
    chosen: usize,
    /// Leading blocks the router believed cached on its choice, if it keeps such a belief.
    predicted: Option<u32>,
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let usage = || "usage: decisions TRACE_OR_KIND LOAD ROUTER [SEED]".to_owned();
    let (Some(source), Some(load), Some(router)) = (args.get(1), args.get(2), args.get(3)) else {
        return Err(usage());
    };
    let load: f64 = load.parse().map_err(|_| usage())?;
    let router = RouterSpec::parse(router).ok_or_else(usage)?;
    let seed: u64 = match args.get(4) {
        Some(seed) => seed.parse().map_err(|_| usage())?,
        None => 0,
    };
    let requests = match workload::Kind::parse(source) {
        Some(kind) => trace::prepare_all(&workload::generate(kind, seed))
            .map_err(|(i, reason)| format!("record {i}: {reason}"))?,
        None => trace::read_trace(std::path::Path::new(source)).map_err(|e| e.to_string())?,
    };
    let requests = trace::compress(&requests, load);
    let config = SimConfig::default();
    let mut seen = Vec::new();
    let mut recorder = Observed::new(
        router.build(config.replicas, config.engine.blocks, seed),
        |request, view, decision| {
            seen.push(Seen {
                cached: view
                    .engines
                    .iter()
                    .map(|e| e.cached_prefix(request.keys()))
                    .collect(),
                waiting: view.engines.iter().map(|e| e.waiting()).collect(),
                running: view.engines.iter().map(|e| e.running()).collect(),
                chosen: decision.replica,
                predicted: decision.predicted_blocks,
            });
        },
    );
    let result = sim::run(&requests, &config, &mut recorder).map_err(|e| e.to_string())?;
    drop(recorder);
    let skip = requests.len() / 10;
    let mut lost_blocks = 0usize;
    let mut total_blocks = 0usize;
    let mut lost_decisions = 0usize;
    let mut lost_ttft = Vec::new();
    let mut kept_ttft = Vec::new();
    let mut per_replica = vec![0usize; config.replicas];
    for (i, seen) in seen.iter().enumerate().skip(skip) {
        let best = seen.cached.iter().copied().max().unwrap_or(0);
        let got = seen.cached[seen.chosen];
        total_blocks += requests[i].keys().len();
        per_replica[seen.chosen] += 1;
        let ttft = result.outcomes[i].ttft_us as f64 / 1000.0;
        if got < best {
            lost_blocks += best - got;
            lost_decisions += 1;
            lost_ttft.push(ttft);
            if lost_decisions <= 25 {
                println!(
                    "req {i:5} in={:6} best={best:3} got={got:3} cached={:?} waiting={:?} running={:?} chosen={} believed={:?} ttft={ttft:.0}",
                    requests[i].input_tokens,
                    seen.cached,
                    seen.waiting,
                    seen.running,
                    seen.chosen,
                    seen.predicted
                );
            }
        } else {
            kept_ttft.push(ttft);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "decisions {} left-cache {lost_decisions} lost blocks {lost_blocks} of {total_blocks} keyed; ttft mean lost {:.0} kept {:.0}; per replica {per_replica:?}; busy {:?}",
        seen.len() - skip,
        mean(&lost_ttft),
        mean(&kept_ttft),
        result
            .busy_us
            .iter()
            .map(|b| b / 1_000_000)
            .collect::<Vec<_>>()
    );
    let m = kvroute_replay::metrics::measure(&requests, &result, 0.1);
    println!(
        "hit {:.3} p50 {:.0} p90 {:.0} p99 {:.0} imbalance {:.2}",
        m.hit_rate, m.ttft_p50_ms, m.ttft_p90_ms, m.ttft_p99_ms, m.imbalance
    );
    Ok(())
}
