//! Per burst of siblings: where each router put them and what they got (the fan-out
//! workload's analysis).
//!
//! ```text
//! cargo run --release -p kvroute-replay --example bursts -- LOAD ROUTER[,ROUTER…] SEED [KIND] [SHOW]
//! ```
//!
//! A burst is a session's requests arriving within 50 ms of its first; a session's first burst
//! computes a new context, its later ones extend the context the earlier ones left. For each
//! router prints, for first and for later bursts apart, how many replicas a burst was spread over
//! and its requests' mean TTFT, then hit rate, p50/p90, imbalance and per-replica busy seconds;
//! with `SHOW` (a count) also the first bursts one by one (replicas, hit blocks, TTFT ms). Same
//! engine, delay and replicas as `kvroute-replay run`'s defaults.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    reason = "a diagnostic tool printing its findings; bad arguments panic"
)]

use std::collections::HashMap;

use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::{metrics, trace, workload};

/// Arrivals of one session this close to its burst's first belong to the burst.
const BURST_WINDOW_US: u64 = 50_000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let load: f64 = args[1].parse().unwrap();
    let seed: u64 = args[3].parse().unwrap();
    let kind = workload::Kind::parse(args.get(4).map_or("fan-out", String::as_str)).unwrap();
    let show: usize = args.get(5).map_or(0, |s| s.parse().unwrap());
    let requests = trace::compress(
        &trace::prepare_all(&workload::generate(kind, seed)).unwrap(),
        load,
    );
    let config = SimConfig::default();
    let mut bursts: Vec<Vec<usize>> = Vec::new();
    // Whether each burst is its session's first.
    let mut first: Vec<bool> = Vec::new();
    let mut open: HashMap<u64, (u64, usize)> = HashMap::new();
    for r in &requests {
        match open.get(&r.session) {
            Some(&(t0, b)) if r.arrival_us - t0 < BURST_WINDOW_US => bursts[b].push(r.id),
            earlier => {
                first.push(earlier.is_none());
                open.insert(r.session, (r.arrival_us, bursts.len()));
                bursts.push(vec![r.id]);
            }
        }
    }
    let skip = requests.len() / 10;
    for name in args[2].split(',') {
        let spec = RouterSpec::parse(name).unwrap();
        let mut router = spec.build(config.replicas, config.engine.blocks, seed);
        let result = sim::run(&requests, &config, router.as_mut()).unwrap();
        // [first bursts, later bursts]: bursts, replicas they were spread over, TTFTs (ms).
        let mut spread = [(0usize, 0usize, Vec::new()), (0, 0, Vec::new())];
        let mut total = 0;
        for (b, is_first) in bursts.iter().zip(&first).filter(|(b, _)| b[0] >= skip) {
            total += 1;
            let outcomes: Vec<_> = b.iter().map(|i| result.outcomes[*i]).collect();
            let ttfts: Vec<u64> = outcomes.iter().map(|o| o.ttft_us / 1000).collect();
            let mut replicas: Vec<usize> = outcomes.iter().map(|o| o.replica).collect();
            replicas.sort_unstable();
            replicas.dedup();
            let class = &mut spread[usize::from(!*is_first)];
            class.0 += 1;
            class.1 += replicas.len();
            class.2.extend(&ttfts);
            if total <= show {
                println!(
                    "burst n={} context_blocks={} replicas={:?} hits={:?} ttft_ms={ttfts:?}",
                    b.len(),
                    requests[b[0]].full_blocks,
                    outcomes.iter().map(|o| o.replica).collect::<Vec<_>>(),
                    outcomes.iter().map(|o| o.hit_blocks).collect::<Vec<_>>(),
                );
            }
        }
        let m = metrics::measure(&requests, &result, 0.1);
        let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
        let class = |(bursts, replicas, ttfts): &(usize, usize, Vec<u64>)| {
            format!(
                "{bursts}, over {:.2} replicas, ttft mean {:.1}",
                *replicas as f64 / (*bursts).max(1) as f64,
                mean(ttfts)
            )
        };
        println!(
            "{name}: first bursts {}; later bursts {}; hit {:.3} \
             p50 {:.0} p90 {:.0} imbalance {:.2} busy_s {:?}",
            class(&spread[0]),
            class(&spread[1]),
            m.hit_rate,
            m.ttft_p50_ms,
            m.ttft_p90_ms,
            m.imbalance,
            result
                .busy_us
                .iter()
                .map(|b| b / 1_000_000)
                .collect::<Vec<_>>()
        );
    }
}
