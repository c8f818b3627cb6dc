//! `kvroute-demo`: four simulated vLLM replicas behind Envoy, a shared-prefix multi-turn chat
//! workload replayed with Envoy's round robin, then with kvroute in shadow mode (Envoy places,
//! kvroute projects what it would gain), then with kvroute routing, side by side.
//!
//! Run it with `bash scripts/demo.sh` (builds the binaries it needs, installs Envoy). It exits
//! non-zero if any request failed; Ctrl-C stops every process it started. With `--keep-running`
//! the stack stays up afterwards for curl or an SDK.
#![allow(
    clippy::print_stdout,
    reason = "the demo's output is its report on stdout"
)]

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use kvroute_demo::{self as demo, PhaseReport, WorkloadOptions};
use kvroute_tests::harness::http;
use kvroute_tests::stack::{MODEL, Routing, SimTiming, Stack, StackOptions};

#[derive(Debug, Parser)]
#[command(about = "kvroute vs round robin on a shared-prefix multi-turn chat workload")]
struct Args {
    /// Simulated replicas.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Distinct system prompts.
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// Users per system prompt.
    #[arg(long, default_value_t = 4)]
    users: usize,
    /// Turns per user.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// Users chatting at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seed of the generated conversations.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// KV blocks per replica (32 tokens each).
    #[arg(long, default_value_t = 256)]
    kv_blocks: usize,
    /// Prefill cost per uncached prompt token, µs (the sims run one prefill at a time).
    #[arg(long, default_value_t = 300.0)]
    prefill_us_per_token: f64,
    /// Skip the shadow-mode run.
    #[arg(long)]
    no_shadow: bool,
    /// Leave the stack running after the comparison (Ctrl-C stops it), printing its URLs.
    #[arg(long)]
    keep_running: bool,
}

/// Decision records kept for `/v1/decisions` while the demo runs, and the share recorded.
const DEMO_RECORDS: &str = "decision_records: {sample: 0.05, keep: 500}\nreload_interval: 100ms\n";

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tokio::select! {
        code = run(args) => code,
        _ = tokio::signal::ctrl_c() => {
            // Returning drops the stack, which stops every process.
            eprintln!("\ninterrupted; stopping everything");
            ExitCode::from(130)
        }
    }
}

async fn run(args: Args) -> ExitCode {
    let workload_options = WorkloadOptions {
        groups: args.groups,
        users_per_group: args.users,
        turns: args.turns,
        concurrency: args.concurrency,
        seed: args.seed,
        ..WorkloadOptions::default()
    };
    let stack_options = StackOptions {
        replicas: args.replicas,
        routing: Routing::Kvroute,
        // A mode key to rewrite: the shadow run switches it by a config reload.
        pool_extra_config: "mode: route".to_owned(),
        ext_proc_extra_config: DEMO_RECORDS.to_owned(),
        kv_blocks_per_replica: args.kv_blocks,
        timing: SimTiming {
            ttft_overhead_ms: 10.0,
            prefill_us_per_token: args.prefill_us_per_token,
            decode_ms_per_token: 5.0,
            time_scale: 1.0,
        },
        ..StackOptions::default()
    };
    let conversations = demo::build_workload(&workload_options);
    let requests = conversations.len() * workload_options.turns;
    println!(
        "kvroute demo: {} replicas ({} KV blocks of {} tokens each, prefill {} µs/uncached token), \
         {} system prompts x {} users x {} turns = {requests} chat requests per run, {} users at once",
        stack_options.replicas,
        stack_options.kv_blocks_per_replica,
        stack_options.block_size,
        args.prefill_us_per_token,
        workload_options.groups,
        workload_options.users_per_group,
        workload_options.turns,
        workload_options.concurrency,
    );

    let started = Instant::now();
    let stack = match Stack::start(stack_options).await {
        Ok(stack) => stack,
        Err(error) => {
            eprintln!("kvroute-demo: cannot start the stack: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "started Envoy (kvroute listener {}, round-robin listener {}), kvroute-ext-proc, \
         kvroute-index and {} engine simulators in {:.1} s",
        display(stack.listener(Routing::Kvroute)),
        display(stack.listener(Routing::RoundRobin)),
        stack.sims().len(),
        started.elapsed().as_secs_f64()
    );

    let mut reports: Vec<PhaseReport> = Vec::new();
    let mut shadow = None;
    let mut failed = 0;
    let phases: &[Phase] = if args.no_shadow {
        &[Phase::RoundRobin, Phase::Kvroute]
    } else {
        &[Phase::RoundRobin, Phase::Shadow, Phase::Kvroute]
    };
    for phase in phases {
        if let Err(error) = stack.reset_prefix_caches().await {
            eprintln!("kvroute-demo: cannot reset the prefix caches: {error}");
            stack.print_logs();
            return ExitCode::FAILURE;
        }
        println!(
            "running the workload through Envoy with {} ...",
            phase.label()
        );
        let report = match phase {
            Phase::RoundRobin => {
                demo::run_phase(
                    &stack,
                    Routing::RoundRobin,
                    &conversations,
                    &workload_options,
                )
                .await
            }
            Phase::Kvroute => {
                demo::run_phase(&stack, Routing::Kvroute, &conversations, &workload_options).await
            }
            Phase::Shadow => demo::run_shadow_phase(&stack, &conversations, &workload_options)
                .await
                .map(|report| {
                    let phase = report.phase.clone();
                    shadow = Some(report);
                    phase
                }),
        };
        match report {
            Ok(report) => {
                if let Some(error) = &report.first_error {
                    eprintln!("  {} request(s) failed; first: {error}", report.failed);
                }
                failed += report.failed;
                if *phase != Phase::Shadow {
                    reports.push(report);
                }
            }
            Err(error) => {
                eprintln!("kvroute-demo: {error}");
                stack.print_logs();
                return ExitCode::FAILURE;
            }
        }
    }
    let [baseline, kvroute, ..] = &reports[..] else {
        return ExitCode::FAILURE;
    };
    println!();
    print!("{}", demo::render_table(baseline, kvroute));
    if let Some(shadow) = &shadow {
        println!();
        print!("{}", demo::render_projection(shadow, kvroute));
    }
    if let Ok(admin) = stack.ext_proc_admin_url() {
        print_decisions(&admin).await;
    }
    println!(
        "\nTTFT is measured by the client: request sent until the first streamed token arrives. \
         Hit rate: the sims' vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total."
    );
    println!("total time {:.1} s", started.elapsed().as_secs_f64());

    if failed > 0 {
        eprintln!("kvroute-demo: some requests failed");
        stack.print_logs();
        return ExitCode::FAILURE;
    }
    if args.keep_running {
        print_endpoints(&stack);
        // Ctrl-C (in `main`) ends the wait; returning drops the stack, which stops everything.
        std::future::pending::<()>().await;
    }
    ExitCode::SUCCESS
}

/// The demo's runs, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    RoundRobin,
    Shadow,
    Kvroute,
}

impl Phase {
    fn label(self) -> &'static str {
        match self {
            Self::RoundRobin => "round robin",
            Self::Shadow => "kvroute in shadow mode",
            Self::Kvroute => "kvroute",
        }
    }
}

/// Where to point curl or an SDK at the running stack, and how to look inside.
fn print_endpoints(stack: &Stack) {
    let envoy = display(stack.listener(Routing::Kvroute));
    println!("\nthe stack keeps running (Ctrl-C stops it):");
    println!(
        "  OpenAI API through Envoy + kvroute: http://{envoy}/v1/chat/completions (model \"{MODEL}\")"
    );
    println!(
        "  the same engines with Envoy's round robin alone: http://{}",
        display(stack.listener(Routing::RoundRobin))
    );
    if let Ok(admin) = stack.ext_proc_admin_url() {
        println!(
            "  kvroute-ext-proc: {admin}/metrics, {admin}/v1/decisions (5% of decisions), {admin}/v1/shadow"
        );
    }
    if let Ok(admin) = stack.index_admin_url() {
        println!("  kvroute-index: {admin}/metrics, {admin}/v1/replicas");
    }
    println!("  Envoy admin: {}", stack.envoy_admin_url());
    if let Ok(path) = stack.ext_proc_config_path() {
        println!(
            "  shadow mode: change `mode: route` to `mode: shadow` in {} (reloaded within 100 ms)",
            path.display()
        );
    }
    println!(
        "  try: curl -s http://{envoy}/v1/chat/completions -H 'content-type: application/json' \\\n       -d '{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}],\"max_tokens\":8}}'"
    );
}

/// kvroute's decisions by tier and reason, from its `/metrics`.
async fn print_decisions(admin: &str) {
    let Ok(response) = http::get(&format!("{admin}/metrics")).await else {
        return;
    };
    let lines: Vec<String> = response
        .text()
        .lines()
        .filter(|line| {
            line.starts_with("kvroute_extproc_decisions_total{")
                || line.starts_with("kvroute_extproc_fallbacks_total{")
        })
        .map(|line| format!("  {line}"))
        .collect();
    if !lines.is_empty() {
        println!("\nkvroute decisions and fallbacks:\n{}", lines.join("\n"));
    }
}

fn display(addr: Option<std::net::SocketAddr>) -> String {
    addr.map_or_else(|| "-".to_owned(), |a| a.to_string())
}
