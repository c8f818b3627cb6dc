//! The comparison grid: workloads × load points × routers × seeds, run in parallel, averaged
//! over seeds, plus the cache-only bounds; and the search for each router's highest arrival rate
//! meeting a TTFT objective ([`max_rate_within_slo`]).
//!
//! A load point is a time-compression factor: arrivals divided by it (2 = twice the rate).
//! Seed `s` drives the router's randomness and, for a generated workload, the generator: each
//! seed replays its own draw of the workload (a trace file is the same for every seed).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use crate::bounds;
use crate::metrics::{self, RunMetrics};
use crate::routers::{Observed, Regret, RegretStats, RouterSpec};
use crate::sim::{self, Checked, RunResult, SimConfig, SimError, SloCheck};
use crate::trace::{self, Request};

/// A named workload: one request list per seed.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Report name.
    pub name: String,
    /// Requests sorted by arrival, per seed (a trace: the same list for every seed).
    pub per_seed: Vec<Vec<Request>>,
}

impl Workload {
    /// Requests of `seed` (the last list when there are fewer lists than seeds).
    pub fn requests(&self, seed: u64) -> &[Request] {
        let i = (seed as usize).min(self.per_seed.len().saturating_sub(1));
        self.per_seed.get(i).map_or(&[], Vec::as_slice)
    }

    /// Mean arrival rate over the seeds' lists, requests/s (uncompressed).
    pub fn base_rate(&self) -> f64 {
        let rates: Vec<f64> = self.per_seed.iter().map(|r| arrival_rate(r)).collect();
        rates.iter().sum::<f64>() / rates.len().max(1) as f64
    }
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
    /// Report progress on stderr (every 5% of runs, with elapsed time).
    pub progress: bool,
    /// Where to write every load-point run's requests, one CSV per run ([`write_outcomes`]).
    pub outcomes: Option<PathBuf>,
}

/// Progress of a batch of runs, printed to stderr each time another 5% is done.
#[derive(Debug)]
struct Progress {
    label: &'static str,
    total: usize,
    done: AtomicUsize,
    started: std::time::Instant,
    enabled: bool,
}

impl Progress {
    /// Percent between reports.
    const STEP_PERCENT: usize = 5;

    fn new(label: &'static str, total: usize, enabled: bool) -> Self {
        Progress {
            label,
            total,
            done: AtomicUsize::new(0),
            started: std::time::Instant::now(),
            enabled,
        }
    }

    /// Counts one finished run; reports when it crosses a step.
    fn finished_one(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.enabled || self.total == 0 {
            return;
        }
        let step = |n: usize| n * 100 / self.total / Self::STEP_PERCENT;
        if step(done) != step(done - 1) || done == self.total {
            eprintln!(
                "kvroute-replay: {}: {done}/{} ({}%), {:.0} s",
                self.label,
                self.total,
                done * 100 / self.total,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
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
    run_recorded(requests, sim, router, seed, warmup, None)
}

/// [`run_one`], writing the run's requests to `outcomes` when given ([`write_outcomes`]).
fn run_recorded(
    requests: &[Request],
    sim: &SimConfig,
    router: RouterSpec,
    seed: u64,
    warmup: f64,
    outcomes: Option<&Path>,
) -> Result<RunMetrics, SimError> {
    let mut built = router.build(sim.replicas, sim.engine.blocks, seed);
    let result = sim::run(requests, sim, built.as_mut())?;
    if let Some(path) = outcomes {
        write_outcomes(path, requests, &result, warmup)
            .map_err(|e| SimError::Output(format!("{}: {e}", path.display())))?;
    }
    Ok(metrics::measure(requests, &result, warmup))
}

/// Writes one run's requests as CSV, by id: arrival, session, prompt tokens, the replica it was
/// served on, TTFT, blocks found cached, the router's belief, and whether it was measured (past
/// the warm-up). For reading a run request by request (where the slow ones were served).
pub fn write_outcomes(
    path: &Path,
    requests: &[Request],
    result: &RunResult,
    warmup: f64,
) -> std::io::Result<()> {
    use std::io::Write as _;
    let skip = metrics::warmup_skip(requests.len(), warmup);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        out,
        "id,arrival_us,session,prompt_tokens,replica,ttft_us,hit_blocks,predicted_blocks,measured"
    )?;
    for (request, outcome) in requests.iter().zip(&result.outcomes) {
        writeln!(
            out,
            "{},{},{},{},{},{},{},{},{}",
            request.id,
            request.arrival_us,
            request.session,
            request.input_tokens,
            outcome.replica,
            outcome.ttft_us,
            outcome.hit_blocks,
            outcome
                .predicted_blocks
                .map_or(String::new(), |b| b.to_string()),
            request.id >= skip,
        )?;
    }
    out.flush()
}

/// One router's decisions at one load point against the exact simulation of every replica
/// ([`Regret`]), summed over seeds.
#[derive(Debug, Clone)]
pub struct RegretRow {
    /// Workload name.
    pub workload: String,
    /// Compression factor.
    pub load: f64,
    /// Router name.
    pub router: String,
    /// Summed over seeds.
    pub stats: RegretStats,
}

/// Runs every router of the grid once per load point and seed, measuring each decision's
/// regret; no max-rate search. Disaggregating routers are refused (their decisions are pairs).
pub fn run_regret(workloads: &[Workload], grid: &Grid) -> Result<Vec<RegretRow>, String> {
    if let Some(pd) = grid.routers.iter().find(|r| r.disaggregates()) {
        return Err(format!(
            "{}: regret is measured for routers that serve each request whole",
            pd.name()
        ));
    }
    let mut rows = Vec::new();
    for workload in workloads {
        for &load in &grid.loads {
            for router in &grid.routers {
                let mut stats = RegretStats::default();
                for seed in 0..grid.seeds {
                    let requests = trace::compress(workload.requests(seed), load);
                    let skip = metrics::warmup_skip(requests.len(), grid.warmup);
                    let built = router.build(grid.sim.replicas, grid.sim.engine.blocks, seed);
                    let mut regret = Regret::new(skip);
                    let mut observed = Observed::new(built, |request, view, decision| {
                        regret.observe(request, view, decision)
                    });
                    sim::run(&requests, &grid.sim, &mut observed).map_err(|e| e.to_string())?;
                    drop(observed);
                    stats.add(&regret.stats());
                }
                rows.push(RegretRow {
                    workload: workload.name.clone(),
                    load,
                    router: router.name(),
                    stats,
                });
            }
        }
    }
    Ok(rows)
}

/// Runs the whole grid. Rows come out in (workload, load, router) order, bounds after the
/// routers of each load point.
pub fn run_grid(workloads: &[Workload], grid: &Grid) -> Result<Vec<Row>, SimError> {
    // [workload][load][seed]
    let compressed: Vec<Vec<Vec<Vec<Request>>>> = workloads
        .iter()
        .map(|w| {
            grid.loads
                .iter()
                .map(|f| {
                    (0..grid.seeds)
                        .map(|seed| trace::compress(w.requests(seed), *f))
                        .collect()
                })
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
    let progress = Progress::new("load-point runs", jobs.len(), grid.progress);
    let (sender, receiver) = mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..grid.threads.max(1) {
            let sender = sender.clone();
            let (jobs, next, compressed, progress) = (&jobs, &next, &compressed, &progress);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else {
                        break;
                    };
                    let router = grid.routers[job.router];
                    let outcomes = grid.outcomes.as_ref().map(|dir| {
                        dir.join(format!(
                            "{}-x{}-{}-seed{}.csv",
                            workloads[job.workload].name,
                            grid.loads[job.load],
                            router.name(),
                            job.seed
                        ))
                    });
                    let result = run_recorded(
                        &compressed[job.workload][job.load][job.seed as usize],
                        &grid.sim,
                        router,
                        job.seed,
                        grid.warmup,
                        outcomes.as_deref(),
                    );
                    progress.finished_one();
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
        // Cache-only bounds do not depend on time: one per seed's list, at every load point.
        let pooled_blocks = grid.sim.replicas * grid.sim.engine.blocks as usize;
        let bound_runs = |capacity: usize| -> Vec<RunMetrics> {
            (0..grid.seeds)
                .map(|seed| {
                    let requests = workload.requests(seed);
                    let hits = bounds::lru_hit_blocks(requests, capacity);
                    RunMetrics {
                        requests: requests.len(),
                        hit_rate: metrics::hit_rate_of(requests, &hits, grid.warmup),
                        ttft_p50_ms: f64::NAN,
                        ttft_p90_ms: f64::NAN,
                        ttft_p99_ms: f64::NAN,
                        ttft_mean_ms: f64::NAN,
                        imbalance: f64::NAN,
                        predicted_over_actual: f64::NAN,
                        prediction_exact: f64::NAN,
                    }
                })
                .collect()
        };
        let bounds = [
            ("bound-pooled-lru", bound_runs(pooled_blocks)),
            ("bound-infinite", bound_runs(usize::MAX)),
        ];
        for (l, load) in grid.loads.iter().enumerate() {
            let rates: Vec<f64> = compressed[w][l].iter().map(|r| arrival_rate(r)).collect();
            let rate_rps = rates.iter().sum::<f64>() / rates.len().max(1) as f64;
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
            for (name, seeds) in &bounds {
                rows.push(Row {
                    workload: workload.name.clone(),
                    load: *load,
                    rate_rps,
                    router: (*name).to_owned(),
                    bound: true,
                    mean: metrics::mean(seeds),
                    seeds: seeds.clone(),
                });
            }
        }
    }
    Ok(rows)
}

/// A router's highest arrival rate meeting the TTFT objective on one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct SloRate {
    /// Workload name.
    pub workload: String,
    /// Router name.
    pub router: String,
    /// What the search found.
    pub rate: SloBound,
}

/// The result of one max-rate search, in requests/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SloBound {
    /// Met at this rate and missed at `missed_at` (bisected to [`SLO_SEARCH_PRECISION`]).
    Between {
        /// Highest rate found meeting the objective.
        met_at: f64,
        /// Lowest rate found missing it.
        missed_at: f64,
    },
    /// Missed already at the lowest load point, at this rate.
    Below(f64),
    /// Still met at the highest rate probed (the search's ceiling).
    Above(f64),
}

/// The search stops when the bracket's rates are within this ratio.
pub const SLO_SEARCH_PRECISION: f64 = 1.03;

/// How far above the highest load point the search looks for a missing rate (factor).
const SLO_SEARCH_CEILING: f64 = 16.0;

/// Whether every seed meets the objective (TTFT p90 ≤ `slo_ms`) at compression `factor`;
/// overloaded runs stop as soon as the objective is missed for certain.
fn meets_slo(
    workload: &Workload,
    grid: &Grid,
    router: RouterSpec,
    factor: f64,
    slo_ms: f64,
) -> Result<bool, SimError> {
    for seed in 0..grid.seeds {
        let requests = trace::compress(workload.requests(seed), factor);
        let skip = metrics::warmup_skip(requests.len(), grid.warmup);
        let check = SloCheck {
            ttft_us: (slo_ms * 1000.0).round() as u64,
            skip,
            max_late: metrics::allowed_above(requests.len() - skip, 90.0),
        };
        let mut built = router.build(grid.sim.replicas, grid.sim.engine.blocks, seed);
        if sim::run_checked(&requests, &grid.sim, built.as_mut(), Some(check))?
            == Checked::MissedSlo
        {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Searches one router's highest compression factor meeting the objective, starting from the
/// grid's per-seed results: the bracket is the last load point met in every seed before the
/// first one missed (doubling past the grid while still met), then bisected geometrically.
fn search_one(
    workload: &Workload,
    grid: &Grid,
    rows: &[Row],
    router: RouterSpec,
    slo_ms: f64,
) -> Result<SloBound, SimError> {
    let name = router.name();
    let mut points: Vec<(f64, bool)> = rows
        .iter()
        .filter(|r| r.workload == workload.name && r.router == name)
        .map(|r| (r.load, r.seeds.iter().all(|m| m.ttft_p90_ms <= slo_ms)))
        .collect();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    let base = workload.base_rate();
    let Some(&(lowest, lowest_met)) = points.first() else {
        return Ok(SloBound::Below(f64::NAN));
    };
    if !lowest_met {
        return Ok(SloBound::Below(base * lowest));
    }
    let mut met = lowest;
    let mut missed = None;
    for (factor, ok) in &points {
        if *ok {
            met = *factor;
        } else {
            missed = Some(*factor);
            break;
        }
    }
    let ceiling = points.last().map_or(lowest, |p| p.0) * SLO_SEARCH_CEILING;
    let mut missed = match missed {
        Some(m) => m,
        None => loop {
            let next = met * 2.0;
            if next > ceiling {
                return Ok(SloBound::Above(base * met));
            }
            if meets_slo(workload, grid, router, next, slo_ms)? {
                met = next;
            } else {
                break next;
            }
        },
    };
    while missed / met > SLO_SEARCH_PRECISION {
        let mid = (met * missed).sqrt();
        if meets_slo(workload, grid, router, mid, slo_ms)? {
            met = mid;
        } else {
            missed = mid;
        }
    }
    Ok(SloBound::Between {
        met_at: base * met,
        missed_at: base * missed,
    })
}

/// The rate past which none of the run's routers meets the objective on `workload`: the highest
/// rate any of them met (a search still meeting it at its ceiling counts at that ceiling).
/// `None` when every router missed already at the lowest load point.
pub fn saturation_rate(slo: &[SloRate], workload: &str) -> Option<f64> {
    slo.iter()
        .filter(|rate| rate.workload == workload)
        .filter_map(|rate| match rate.rate {
            SloBound::Between { met_at, .. } => Some(met_at),
            SloBound::Above(rate) => Some(rate),
            SloBound::Below(_) => None,
        })
        .filter(|rate| rate.is_finite())
        .max_by(f64::total_cmp)
}

/// Runs `grid`'s routers on each workload at `multiples` of its saturation rate
/// ([`saturation_rate`]): the overload region, where the max-rate search says only that every
/// router missed. Workloads no router saturates within the search are skipped, and so is the
/// oracle: it simulates every replica's queue for each decision, thousands of requests deep
/// past saturation.
pub fn run_past_saturation(
    workloads: &[Workload],
    grid: &Grid,
    slo: &[SloRate],
    multiples: &[f64],
) -> Result<Vec<Row>, SimError> {
    let mut rows = Vec::new();
    for workload in workloads {
        let Some(saturation) = saturation_rate(slo, &workload.name) else {
            continue;
        };
        let base = workload.base_rate();
        if multiples.is_empty() || base.is_nan() || base <= 0.0 {
            continue;
        }
        let past = Grid {
            loads: multiples.iter().map(|m| m * saturation / base).collect(),
            routers: grid
                .routers
                .iter()
                .copied()
                .filter(|router| !router.is_oracle())
                .collect(),
            ..grid.clone()
        };
        rows.extend(run_grid(std::slice::from_ref(workload), &past)?);
    }
    Ok(rows)
}

/// Per workload and router (not bounds), the highest arrival rate at which TTFT p90 meets
/// `slo_ms` in every seed, searched in parallel over (workload, router) pairs.
pub fn max_rate_within_slo(
    workloads: &[Workload],
    grid: &Grid,
    rows: &[Row],
    slo_ms: f64,
) -> Result<Vec<SloRate>, SimError> {
    let mut pairs: Vec<(usize, usize)> = (0..workloads.len())
        .flat_map(|w| (0..grid.routers.len()).map(move |r| (w, r)))
        .collect();
    // Oracle searches first: they are the slowest, so they should not be left for last.
    pairs.sort_by_key(|(_, r)| !grid.routers[*r].is_oracle());
    let next = AtomicUsize::new(0);
    let progress = Progress::new("max-rate searches", pairs.len(), grid.progress);
    let (sender, receiver) = mpsc::channel();
    std::thread::scope(|scope| {
        for _ in 0..grid.threads.max(1) {
            let sender = sender.clone();
            let (pairs, next, progress) = (&pairs, &next, &progress);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(w, r)) = pairs.get(i) else {
                        break;
                    };
                    let found = search_one(&workloads[w], grid, rows, grid.routers[r], slo_ms);
                    progress.finished_one();
                    if sender.send((i, found)).is_err() {
                        break;
                    }
                }
            });
        }
    });
    drop(sender);
    let mut found: Vec<Option<SloBound>> = vec![None; pairs.len()];
    for (i, result) in receiver {
        found[i] = Some(result?);
    }
    let mut rates: Vec<SloRate> = pairs
        .iter()
        .zip(found)
        .filter_map(|(&(w, r), rate)| {
            Some(SloRate {
                workload: workloads[w].name.clone(),
                router: grid.routers[r].name(),
                rate: rate?,
            })
        })
        .collect();
    // Back to workload, then router order.
    let order = |rate: &SloRate| {
        let w = workloads.iter().position(|w| w.name == rate.workload);
        let r = grid.routers.iter().position(|r| r.name() == rate.router);
        (w, r)
    };
    rates.sort_by_key(order);
    Ok(rates)
}
