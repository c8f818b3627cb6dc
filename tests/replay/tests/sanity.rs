//! Sanity checks of the simulator against independent computations, on the Mooncake synthetic
//! trace (`traces/synthetic_trace.jsonl` of the shared third-party folder; every test is skipped,
//! saying so, when it is absent — see `kvroute_block_keys::testing`).
#![allow(clippy::unwrap_used, reason = "test helpers panic on broken fixtures")]

use std::collections::HashSet;

use kvroute_block_keys::testing::shared_file;
use kvroute_replay::BLOCK_TOKENS;
use kvroute_replay::bounds::lru_hit_blocks;
use kvroute_replay::engine::EngineConfig;
use kvroute_replay::metrics;
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::{self, Checked, SimConfig, SloCheck};
use kvroute_replay::timing::MockerFit;
use kvroute_replay::trace::{self, Request, TraceRecord};

/// The trace's first `n` records by time, or `None` (and a SKIP line) without the shared folder.
fn records(test: &str, n: usize) -> Option<Vec<TraceRecord>> {
    let path = shared_file(test, "traces/synthetic_trace.jsonl")?;
    let mut records = trace::read_records(&path).unwrap();
    records.sort_by_key(|r| r.timestamp);
    records.truncate(n);
    Some(records)
}

/// The requests one at a time: each arrives long after the previous one finished.
fn sequential(records: &[TraceRecord]) -> Vec<Request> {
    let mut requests = trace::prepare_all(records).unwrap();
    for (i, r) in requests.iter_mut().enumerate() {
        r.arrival_us = i as u64 * 1_000_000_000;
    }
    requests
}

fn hit_blocks(requests: &[Request], config: &SimConfig, router: RouterSpec, seed: u64) -> Vec<u32> {
    let mut router = router.build(config.replicas, config.engine.blocks, seed);
    let result = sim::run(requests, config, router.as_mut()).unwrap();
    result.outcomes.iter().map(|o| o.hit_blocks).collect()
}

#[test]
fn one_replica_matches_a_single_lru() {
    let Some(records) = records("one_replica_matches_a_single_lru", 1200) else {
        return;
    };
    let requests = sequential(&records);
    let blocks = 1024;
    let simulated = hit_blocks(
        &requests,
        &SimConfig::one_replica(blocks),
        RouterSpec::RoundRobin,
        0,
    );
    let lru = lru_hit_blocks(&requests, blocks as usize);
    let total: u32 = lru.iter().sum();
    assert!(
        total > 300,
        "the trace reuses blocks under this cache size ({total})"
    );
    assert!(
        lru_hit_blocks(&requests, usize::MAX).iter().sum::<u32>() > total,
        "the cache is small enough to evict"
    );
    assert_eq!(simulated, lru);
}

#[test]
fn infinite_cache_reproduces_the_traces_reuse() {
    let Some(records) = records("infinite_cache_reproduces_the_traces_reuse", 1200) else {
        return;
    };
    let requests = sequential(&records);
    let blocks: u32 = requests.iter().map(Request::peak_blocks).sum::<u32>() + 1;
    let simulated = hit_blocks(
        &requests,
        &SimConfig::one_replica(blocks),
        RouterSpec::Random,
        0,
    );
    // Straight from the file: full-block hash ids seen before (in full blocks), never counting
    // the last block of a prompt that is an exact multiple of the block size (always computed).
    let mut seen: HashSet<u64> = HashSet::new();
    let reused: Vec<u32> = records
        .iter()
        .map(|r| {
            let full = (r.input_length / BLOCK_TOKENS) as usize;
            let hittable = ((r.input_length - 1) / BLOCK_TOKENS) as usize;
            let n = r.hash_ids[..hittable]
                .iter()
                .filter(|id| seen.contains(*id))
                .count();
            seen.extend(r.hash_ids[..full].iter().copied());
            n as u32
        })
        .collect();
    assert!(reused.iter().sum::<u32>() > 5000);
    assert_eq!(simulated, reused);
}

#[test]
fn identical_seeds_give_identical_results() {
    let Some(records) = records("identical_seeds_give_identical_results", 800) else {
        return;
    };
    let requests = trace::compress(&trace::prepare_all(&records).unwrap(), 4.0);
    let config = SimConfig {
        replicas: 4,
        engine: EngineConfig {
            blocks: 1024,
            ..EngineConfig::default()
        },
        timing: MockerFit::default(),
        kv_delay_us: 50_000,
        prefill_replicas: 0,
    };
    for spec in [
        RouterSpec::Random,
        RouterSpec::Kvroute,
        RouterSpec::Llmd { speculative: true },
        RouterSpec::Sglang,
    ] {
        let run = |seed| {
            let mut router = spec.build(4, 1024, seed);
            sim::run(&requests, &config, router.as_mut()).unwrap()
        };
        assert_eq!(run(3), run(3), "{}", spec.name());
    }
    let mut a = RouterSpec::Random.build(4, 1024, 1);
    let mut b = RouterSpec::Random.build(4, 1024, 2);
    assert_ne!(
        sim::run(&requests, &config, a.as_mut()).unwrap(),
        sim::run(&requests, &config, b.as_mut()).unwrap()
    );
}

#[test]
fn a_checked_run_stops_only_when_the_objective_is_missed_for_certain() {
    let test = "a_checked_run_stops_only_when_the_objective_is_missed_for_certain";
    let Some(records) = records(test, 600) else {
        return;
    };
    let requests = trace::compress(&trace::prepare_all(&records).unwrap(), 8.0);
    let config = SimConfig {
        replicas: 2,
        engine: EngineConfig::default(),
        timing: MockerFit::default(),
        kv_delay_us: 50_000,
        prefill_replicas: 0,
    };
    let skip = metrics::warmup_skip(requests.len(), 0.1);
    let max_late = metrics::allowed_above(requests.len() - skip, 90.0);
    let full = {
        let mut router = RouterSpec::RoundRobin.build(2, config.engine.blocks, 0);
        sim::run(&requests, &config, router.as_mut()).unwrap()
    };
    let p90 = metrics::measure(&requests, &full, 0.1).ttft_p90_ms;
    // An objective just above the p90 is met (and the run is the full one); just below, missed.
    for (slo_ms, met) in [(p90 + 1.0, true), (p90 - 1.0, false)] {
        let check = SloCheck {
            ttft_us: (slo_ms * 1000.0) as u64,
            skip,
            max_late,
        };
        let mut router = RouterSpec::RoundRobin.build(2, config.engine.blocks, 0);
        let checked = sim::run_checked(&requests, &config, router.as_mut(), Some(check)).unwrap();
        match checked {
            Checked::Done(result) => {
                assert!(met, "p90 {p90} ms missed {slo_ms} ms but the run finished");
                assert_eq!(result, full);
            }
            Checked::MissedSlo => assert!(!met, "p90 {p90} ms meets {slo_ms} ms"),
        }
    }
}
