//! Temporary: kvroute variants over the workloads.
#![allow(clippy::all, clippy::print_stdout, clippy::unwrap_used, missing_docs)]
use kvroute_replay::engine::EngineConfig;
use kvroute_replay::experiment::run_one;
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::SimConfig;
use kvroute_replay::timing::Timing;
use kvroute_replay::{trace, workload};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let routers: Vec<RouterSpec> = args[1].split(',').map(|n| RouterSpec::parse(n).unwrap()).collect();
    let loads: Vec<f64> = args[2].split(',').map(|l| l.parse().unwrap()).collect();
    let seeds: u64 = args.get(3).map_or(1, |s| s.parse().unwrap());
    let only: Option<String> = args.get(4).cloned();
    let config = SimConfig { replicas: 4, engine: EngineConfig::default(), timing: Timing::default(), kv_delay_us: 50_000 };
    let mut sets: Vec<(String, Vec<Vec<trace::Request>>)> = Vec::new();
    let synth = trace::read_trace(std::path::Path::new("../shared/traces/synthetic_trace.jsonl")).unwrap();
    sets.push(("synthetic".into(), (0..seeds).map(|_| synth.clone()).collect()));
    for kind in workload::Kind::ALL {
        sets.push((kind.name().into(), (0..seeds).map(|s| trace::prepare_all(&workload::generate(kind, s + 1)).unwrap()).collect()));
    }
    for (name, per_seed) in &sets {
        if only.as_ref().is_some_and(|o| !name.starts_with(o.as_str())) { continue; }
        for load in &loads {
            for router in &routers {
                let (mut h, mut p, mut i) = (0.0, 0.0, 0.0);
                for (s, reqs) in per_seed.iter().enumerate() {
                    let reqs = trace::compress(reqs, *load);
                    let m = run_one(&reqs, &config, *router, s as u64, 0.1).unwrap();
                    h += m.hit_rate; p += m.ttft_p90_ms; i += m.imbalance;
                }
                let n = per_seed.len() as f64;
                println!("{name:14} x{load} {:12} hit {:.3} p90 {:7.0} imb {:.2}", router.name(), h / n, p / n, i / n);
            }
        }
    }
}
