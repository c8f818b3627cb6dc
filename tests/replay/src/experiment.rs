//! The comparison grid: workloads × load points × routers × seeds, run in parallel, averaged
//! over seeds, plus the cache-only bounds.
//!
//! A load point is a time-compression factor: arrivals divided by it (2 = twice the rate).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use crate::bounds;
use crate::metrics::{self, RunMetrics};
use crate::routers::RouterSpec;
use crate::sim::{self, SimConfig, SimError};
use crate::trace::{self, Request};

/// A named request list.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Report name.
    pub name: String,
    /// Requests sorted by arrival.
    pub requests: Vec<Request>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Grid {
    /// Cluster and timing.
    pub sim: SimConfig,
    /// Time-compression factors.
    pub loads: Vec<f64>,
    /// Seeds per point (0, 1, …).
    pub seeds: u64,
    /// Share of requests excluded as warm-up.
    pub warmup: f64,
    /// Routers.
    pub routers: Vec<RouterSpec>,
    /// Worker threads.
    pub threads: usize,
}

/// One table row: a router (or bound) at one load point of one workload, averaged over seeds.
#[derive(Debug, Clone)]
pub struct Row {
    /// Workload name.
    pub workload: String,
    /// Compression factor.
    pub load: f64,
    /// Arrival rate at that factor, requests/s.
    pub rate_rps: f64,
    /// Router or bound name.
    pub router: String,
    /// Whether this is a cache-only bound (hit rate only).
    pub bound: bool,
    /// Mean over seeds.
    pub mean: RunMetrics,
    /// Per seed.
    pub seeds: Vec<RunMetrics>,
}

/// Mean arrival rate of requests, per second.
pub fn arrival_rate(requests: &[Request]) -> f64 {
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return 0.0;
    };
    let span_s = (last.arrival_us.saturating_sub(first.arrival_us)) as f64 / 1e6;
    if span_s > 0.0 {
        requests.len() as f64 / span_s
    } else {
        f64::INFINITY
    }
}

struct Job {
    workload: usize,
    load: usize,
    router: usize,
    seed: u64,
}

/// Runs one router once.
pub fn run_one(
    requests: &[Request],
    sim: &SimConfig,
    router: RouterSpec,
    seed: u64,
    warmup: f64,
) -> Result<RunMetrics, SimError> {
    let mut built = router.build(sim.replicas, sim.engine.blocks, seed);
    let result = sim::run(requests, sim, built.as_mut())?;
    Ok(metrics::measure(requests, &result, warmup))
}

/// Runs the whole grid. Rows come out in (workload, load, router) order, bounds after the
/// routers of each load point.
pub fn run_grid(workloads: &[Workload], grid: &Grid) -> Result<Vec<Row>, SimError> {
    let compressed: Vec<Vec<Vec<Request>>> = workloads
        .iter()
        .map(|w| {
            grid.loads
                .iter()
                .map(|f| trace::compress(&w.requests, *f))
                .collect()
        })
        .collect();
    let mut jobs = Vec::new();
    // Oracle jobs first: they are the slowest, so they should not be left for last.
    let mut order: Vec<usize> = (0..grid.routers.len()).collect();
    order.sort_by_key(|r| !grid.routers[*r].is_oracle());
    for router in order {
        for workload in 0..workloads.len() {
            for load in 0..grid.loads.len() {
                for seed in 0..grid.seeds {
                    jobs.push(Job {
                        workload,
                        load,
                        router,
                        seed,
                    });
                }
            }
        }
    }
    let next = AtomicUsize::new(0);
    let (sender, receiver) = mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..grid.threads.max(1) {
            let sender = sender.clone();
            let (jobs, next, compressed) = (&jobs, &next, &compressed);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else {
                        break;
                    };
                    let result = run_one(
                        &compressed[job.workload][job.load],
                        &grid.sim,
                        grid.routers[job.router],
                        job.seed,
                        grid.warmup,
                    );
                    if sender.send((i, result)).is_err() {
                        break;
                    }
                }
            });
        }
    });
    drop(sender);
    let mut results: Vec<Option<RunMetrics>> = vec![None; jobs.len()];
    for (i, result) in receiver {
        results[i] = Some(result?);
    }
    let mut rows = Vec::new();
    for (w, workload) in workloads.iter().enumerate() {
        let pooled = bounds::lru_hit_blocks(
            &workload.requests,
            grid.sim.replicas * grid.sim.engine.blocks as usize,
        );
        let infinite = bounds::lru_hit_blocks(&workload.requests, usize::MAX);
        for (l, load) in grid.loads.iter().enumerate() {
            let rate_rps = arrival_rate(&compressed[w][l]);
            for (r, router) in grid.routers.iter().enumerate() {
                let seeds: Vec<RunMetrics> = jobs
                    .iter()
                    .zip(&results)
                    .filter(|(j, _)| j.workload == w && j.load == l && j.router == r)
                    .filter_map(|(_, m)| *m)
                    .collect();
                rows.push(Row {
                    workload: workload.name.clone(),
                    load: *load,
                    rate_rps,
                    router: router.name(),
                    bound: false,
                    mean: metrics::mean(&seeds),
                    seeds,
                });
            }
            for (name, hits) in [("bound-pooled-lru", &pooled), ("bound-infinite", &infinite)] {
                let bound = RunMetrics {
                    requests: workload.requests.len(),
                    hit_rate: metrics::hit_rate_of(&workload.requests, hits, grid.warmup),
                    ttft_p50_ms: f64::NAN,
                    ttft_p90_ms: f64::NAN,
                    ttft_p99_ms: f64::NAN,
                    ttft_mean_ms: f64::NAN,
                    imbalance: f64::NAN,
                    predicted_over_actual: f64::NAN,
                    prediction_exact: f64::NAN,
                };
                rows.push(Row {
                    workload: workload.name.clone(),
                    load: *load,
                    rate_rps,
                    router: name.to_owned(),
                    bound: true,
                    mean: bound,
                    seeds: vec![bound],
                });
            }
        }
    }
    Ok(rows)
}

/// Per workload and router, the highest arrival rate whose mean TTFT p90 meets `slo_ms`
/// (`None` when no load point does).
pub fn max_rate_within_slo(rows: &[Row], slo_ms: f64) -> Vec<(String, String, Option<f64>)> {
    let mut out: Vec<(String, String, Option<f64>)> = Vec::new();
    for row in rows.iter().filter(|r| !r.bound) {
        let meets = row.mean.ttft_p90_ms <= slo_ms;
        match out
            .iter_mut()
            .find(|(w, r, _)| *w == row.workload && *r == row.router)
        {
            Some((_, _, best)) => {
                if meets && best.is_none_or(|b| row.rate_rps > b) {
                    *best = Some(row.rate_rps);
                }
            }
            None => out.push((
                row.workload.clone(),
                row.router.clone(),
                meets.then_some(row.rate_rps),
            )),
        }
    }
    out
}
