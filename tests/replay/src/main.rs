//! `kvroute-replay`: runs the routing comparison, or writes a synthetic workload.
//!
//! ```text
//! kvroute-replay run --trace ../shared/traces/synthetic_trace.jsonl --generated --arrival-jitter --out DIR
//! kvroute-replay run --trace fan-out.jsonl --loads 1 --seeds 1 --routers kvroute,dynamo-w2 --regret
//! kvroute-replay generate --kind fan-out --out fan-out.jsonl
//! ```
#![allow(
    clippy::print_stdout,
    reason = "a command-line tool printing its report"
)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvroute_replay::engine::EngineConfig;
use kvroute_replay::experiment::{self, Grid, Workload};
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::SimConfig;
use kvroute_replay::timing::MockerFit;
use kvroute_replay::{report, trace, workload};

#[derive(Debug, Parser)]
#[command(about = "Trace-driven routing-quality simulator for kvroute and baseline routers")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replays workloads through every router and reports.
    Run(RunArgs),
    /// Writes a synthetic workload as Mooncake JSONL.
    Generate {
        /// shared-prefix, multi-turn or fan-out.
        #[arg(long)]
        kind: String,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Generator seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Mooncake-format JSONL traces (repeatable).
    #[arg(long)]
    trace: Vec<PathBuf>,
    /// Also run the three generated workloads (shared-prefix, multi-turn, fan-out).
    #[arg(long)]
    generated: bool,
    /// Also run every workload with its arrivals spread uniformly within the trace's timestamp
    /// resolution (seeded by the run's seed; order kept), reported as `<workload>+jitter` beside
    /// the raw arrivals.
    #[arg(long)]
    arrival_jitter: bool,
    /// Replicas.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Of `--replicas`, how many are prefill-only for the disaggregating routers (`pd-*`); the
    /// others serve every replica whole (the aggregated baseline on the same hardware).
    #[arg(long, default_value_t = 0)]
    prefill_replicas: usize,
    /// KV blocks (512 tokens) per replica.
    #[arg(long, default_value_t = 4096)]
    blocks: u32,
    /// Tokens per engine step.
    #[arg(long, default_value_t = 8192)]
    token_budget: u32,
    /// Requests running at once per replica.
    #[arg(long, default_value_t = 256)]
    max_seqs: usize,
    /// Multiplies every step's duration, prefill and decode alike (kept as the one knob it
    /// was; composes with the two below).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Multiplies the prefill part of every step (on top of --time-scale).
    #[arg(long, default_value_t = 1.0)]
    prefill_scale: f64,
    /// Multiplies the decode part of every step (on top of --time-scale).
    #[arg(long, default_value_t = 1.0)]
    decode_scale: f64,
    /// KV-event delivery delay to the routers' indexes, ms.
    #[arg(long, default_value_t = 50.0)]
    kv_delay_ms: f64,
    /// Time-compression factors (load points), comma-separated. The max-rate search starts
    /// from them and goes beyond on its own.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    loads: Vec<f64>,
    /// Extra load points past saturation, as multiples of each workload's saturation rate (the
    /// highest rate any router of the run meets the objective at), comma-separated: e.g. `1.5,2`.
    #[arg(long, value_delimiter = ',')]
    past_saturation: Vec<f64>,
    /// Seeds per point (router randomness, and each generated workload's draw).
    #[arg(long, default_value_t = 3)]
    seeds: u64,
    /// Share of requests (by arrival) excluded as warm-up.
    #[arg(long, default_value_t = 0.1)]
    warmup: f64,
    /// Routers (comma-separated names; default all).
    #[arg(long, value_delimiter = ',')]
    routers: Vec<String>,
    /// TTFT p90 objective for the max-rate table, ms.
    #[arg(long, default_value_t = 2000.0)]
    slo_p90_ms: f64,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Writes results.csv, results.md and plot-*.svg here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also writes every load-point run's requests here, one CSV per run
    /// (`<workload>-x<load>-<router>-seed<seed>.csv`: arrival, session, replica, TTFT, blocks
    /// cached and believed), for reading a run request by request. Created if missing.
    #[arg(long)]
    outcomes: Option<PathBuf>,
    /// Instead of the grid: every decision of every router at each load point set against an
    /// exact simulation of every replica (the greedy oracle's view), and which way the off ones
    /// err; printed as a table (no max-rate search, no files).
    #[arg(long)]
    regret: bool,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-replay: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Generate { kind, out, seed } => {
            let kind = workload::Kind::parse(&kind).ok_or_else(|| {
                format!("unknown kind {kind:?} (shared-prefix, multi-turn, fan-out)")
            })?;
            let records = workload::generate(kind, seed);
            trace::write_records(&out, &records).map_err(|e| e.to_string())?;
            println!("wrote {} requests to {}", records.len(), out.display());
            Ok(())
        }
        Command::Run(args) => run_grid(args),
    }
}

fn run_grid(args: RunArgs) -> Result<(), String> {
    let seeds = args.seeds.max(1);
    let mut workloads = Vec::new();
    for path in &args.trace {
        let requests = trace::read_trace(path).map_err(|e| e.to_string())?;
        let name = path
            .file_stem()
            .map_or("trace".to_owned(), |s| s.to_string_lossy().into_owned());
        workloads.push(Workload {
            name,
            per_seed: vec![requests],
        });
    }
    if args.generated {
        for kind in workload::Kind::ALL {
            let per_seed = (0..seeds)
                .map(|seed| {
                    trace::prepare_all(&workload::generate(kind, seed))
                        .map_err(|(i, reason)| format!("{} record {i}: {reason}", kind.name()))
                })
                .collect::<Result<_, _>>()?;
            workloads.push(Workload {
                name: kind.name().to_owned(),
                per_seed,
            });
        }
    }
    if workloads.is_empty() {
        return Err("nothing to run: give --trace PATH and/or --generated".to_owned());
    }
    if args.arrival_jitter {
        let jittered: Vec<Workload> = workloads
            .iter()
            .map(|raw| {
                let per_seed = (0..seeds)
                    .map(|seed| {
                        let requests = raw.requests(seed);
                        let resolution = trace::timestamp_resolution_us(requests);
                        trace::jitter(requests, resolution, seed)
                    })
                    .collect();
                Workload {
                    name: format!("{}+jitter", raw.name),
                    per_seed,
                }
            })
            .collect();
        workloads.extend(jittered);
    }
    let routers = if args.routers.is_empty() {
        RouterSpec::all()
    } else {
        args.routers
            .iter()
            .map(|name| {
                RouterSpec::parse(name).ok_or_else(|| {
                    let known: Vec<String> = RouterSpec::all().iter().map(|r| r.name()).collect();
                    format!("unknown router {name:?} (known: {})", known.join(", "))
                })
            })
            .collect::<Result<_, _>>()?
    };
    if args.replicas == 0 || args.replicas > 64 {
        return Err("--replicas must be 1..=64".to_owned());
    }
    if args.prefill_replicas >= args.replicas {
        return Err("--prefill-replicas must leave at least one decode replica".to_owned());
    }
    if args.loads.iter().any(|l| !l.is_finite() || *l <= 0.0) {
        return Err("--loads must be positive".to_owned());
    }
    if args
        .past_saturation
        .iter()
        .any(|m| !m.is_finite() || *m <= 1.0)
    {
        return Err("--past-saturation multiples must be above 1".to_owned());
    }
    for (flag, value) in [
        ("--time-scale", args.time_scale),
        ("--prefill-scale", args.prefill_scale),
        ("--decode-scale", args.decode_scale),
    ] {
        if !value.is_finite() || value <= 0.0 {
            return Err(format!("{flag} must be positive, got {value}"));
        }
    }
    if let Some(dir) = &args.outcomes {
        std::fs::create_dir_all(dir).map_err(|e| format!("--outcomes {}: {e}", dir.display()))?;
    }
    let grid = Grid {
        sim: SimConfig {
            replicas: args.replicas,
            engine: EngineConfig {
                blocks: args.blocks,
                token_budget: args.token_budget.max(1),
                max_seqs: args.max_seqs.max(1),
            },
            timing: MockerFit {
                prefill_scale: args.time_scale * args.prefill_scale,
                decode_scale: args.time_scale * args.decode_scale,
            },
            kv_delay_us: (args.kv_delay_ms.max(0.0) * 1000.0).round() as u64,
            prefill_replicas: args.prefill_replicas,
        },
        loads: args.loads,
        seeds,
        warmup: args.warmup,
        routers,
        threads: args.threads,
        progress: true,
        outcomes: args.outcomes,
    };
    let started = std::time::Instant::now();
    if args.regret {
        let rows = experiment::run_regret(&workloads, &grid)?;
        println!("{}", report::regret_markdown(&rows));
        println!("(ran in {:.1} s)", started.elapsed().as_secs_f64());
        return Ok(());
    }
    let mut rows = experiment::run_grid(&workloads, &grid).map_err(|e| e.to_string())?;
    let slo = experiment::max_rate_within_slo(&workloads, &grid, &rows, args.slo_p90_ms)
        .map_err(|e| e.to_string())?;
    rows.extend(
        experiment::run_past_saturation(&workloads, &grid, &slo, &args.past_saturation)
            .map_err(|e| e.to_string())?,
    );
    println!(
        "# kvroute-replay: {} replicas × {} blocks of 512 tokens, token budget {}, prefill × {}, decode × {}, KV-event delay {} ms, {} seeds, warm-up {:.0}%\n",
        grid.sim.replicas,
        grid.sim.engine.blocks,
        grid.sim.engine.token_budget,
        grid.sim.timing.prefill_scale,
        grid.sim.timing.decode_scale,
        args.kv_delay_ms,
        grid.seeds,
        grid.warmup * 100.0
    );
    println!("{}", report::markdown(&rows, &slo, args.slo_p90_ms));
    if let Some(dir) = &args.out {
        let written =
            report::write_all(dir, &rows, &slo, args.slo_p90_ms).map_err(|e| e.to_string())?;
        println!("wrote {} in {}", written.join(", "), dir.display());
    }
    println!("(ran in {:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}
