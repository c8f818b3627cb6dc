//! `--outcomes`: every load-point run's requests written out, one CSV per run, agreeing with the
//! run's reported metrics.
#![allow(clippy::unwrap_used, reason = "test code")]

use kvroute_replay::engine::EngineConfig;
use kvroute_replay::experiment::{self, Grid, Workload};
use kvroute_replay::metrics;
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::SimConfig;
use kvroute_replay::timing::MockerFit;
use kvroute_replay::trace;
use kvroute_replay::workload::{self, Kind};

#[test]
fn every_run_writes_its_requests_as_its_metrics_count_them() {
    let dir = tempfile::tempdir().unwrap();
    let per_seed = (0..2)
        .map(|seed| {
            let mut requests =
                trace::prepare_all(&workload::generate(Kind::SharedPrefix, seed)).unwrap();
            requests.truncate(400);
            requests
        })
        .collect();
    let workload = Workload {
        name: "shared-prefix".to_owned(),
        per_seed,
    };
    let grid = Grid {
        sim: SimConfig {
            replicas: 2,
            engine: EngineConfig::default(),
            timing: MockerFit::default(),
            kv_delay_us: 50_000,
            prefill_replicas: 0,
        },
        loads: vec![2.0],
        seeds: 2,
        warmup: 0.1,
        routers: vec![RouterSpec::Kvroute, RouterSpec::RoundRobin],
        threads: 2,
        progress: false,
        outcomes: Some(dir.path().to_owned()),
    };
    let rows = experiment::run_grid(std::slice::from_ref(&workload), &grid).unwrap();
    for row in rows.iter().filter(|row| !row.bound) {
        for (seed, measured) in row.seeds.iter().enumerate() {
            let path = dir
                .path()
                .join(format!("shared-prefix-x2-{}-seed{seed}.csv", row.router));
            let text = std::fs::read_to_string(&path).unwrap();
            let mut lines = text.lines();
            assert_eq!(
                lines.next(),
                Some(
                    "id,arrival_us,session,prompt_tokens,replica,ttft_us,hit_blocks,\
                     predicted_blocks,measured"
                )
            );
            let records: Vec<Vec<&str>> = lines.map(|line| line.split(',').collect()).collect();
            let requests = workload.requests(seed as u64);
            assert_eq!(records.len(), requests.len(), "{}", path.display());
            let skip = metrics::warmup_skip(requests.len(), grid.warmup);
            let ttfts: Vec<f64> = records
                .iter()
                .filter(|r| r[8] == "true")
                .map(|r| r[5].parse::<f64>().unwrap() / 1000.0)
                .collect();
            assert_eq!(ttfts.len(), requests.len() - skip);
            assert_eq!(ttfts.len(), measured.requests);
            let mean = ttfts.iter().sum::<f64>() / ttfts.len() as f64;
            assert!(
                (mean - measured.ttft_mean_ms).abs() < 1e-6,
                "{}: {mean} against {}",
                path.display(),
                measured.ttft_mean_ms
            );
            // kvroute says what it believed cached; round robin keeps no belief.
            let believed = records.iter().filter(|r| !r[7].is_empty()).count();
            match row.router.as_str() {
                "kvroute" => assert_eq!(believed, records.len()),
                _ => assert_eq!(believed, 0),
            }
        }
    }
}
