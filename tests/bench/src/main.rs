//! `kvroute-latency-bench`: request latency through a real Envoy, every case in the same run.
//!
//! - `extproc`: one Envoy, three listeners that differ only in their ext_proc filter —
//!   `plain` (none), `noop` (a no-op `ExternalProcessor`: an empty `CommonResponse` per message) and
//!   `kvroute` (kvroute-ext-proc with a kvroute-index and the in-process tokenizer of
//!   `tests/fixtures/tiny-model`), both ext_procs in BUFFERED mode with the shipped settings.
//! - `wasm`: the shipped `envoy/kvroute-full-chain.yaml` (addresses substituted, one plain
//!   listener added): later turns of a session (wasm fast path, ext_proc skipped) vs first turns
//!   (ext_proc = kvroute-ext-proc) vs the plain listener.
//! - `picker`: the picker's decide path looped in-process on one thread, decisions per CPU second.
//!
//! Upstreams are two tiny in-process HTTP servers (TCP_NODELAY) that answer a fixed body, so the
//! upstream cost is constant. The client is sequential over one keep-alive connection per listener
//! and interleaves the cases request by request (rotating the order), so machine noise hits every
//! case alike; every prompt is unique (a numbered prefix over text from `tests/fixtures/corpus`),
//! so tokenization really runs. Envoy runs with one worker. Results print as Markdown.
//!
//! Code: this file (flags, where the ext_procs run, the run), `prompts`, `backends` (in-process
//! upstreams, index and ext_procs), `client` (the client and its statistics), and one module per
//! bench (`extproc`, `wasm`, `stages`, `picker`).
//!
//! Build first: `cargo build --release --bins` (the kvroute binaries it starts) and, for `wasm`,
//! `cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter`; then
//! `cargo run --release -p kvroute-latency-bench -- --bench ...`.
#![allow(
    clippy::print_stdout,
    reason = "the benchmark's report is its output on stdout"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use axum::serve::ListenerExt as _;
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_ext_proc::request::{self, Endpoint};
use kvroute_ext_proc::server::DECISION_HEADER;
use kvroute_index_core::event::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index_core::wire::{self, Encoding};
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_test_support::try_poll_until;
use kvroute_tests::harness::ext_proc::{FakeExtProc, FakeRouting};
use kvroute_tests::harness::{Envoy, metrics, tiny_model_dir, workspace_root};
use kvroute_tokenize::ModelTokenizer;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Prompt sizes of the Envoy benches, in tokens of the model.
const SIZES: [usize; 3] = [1024, 8 * 1024, 32 * 1024];
/// Prompt sizes of the `stages` bench.
const STAGE_SIZES: [usize; 4] = [1024, 8 * 1024, 32 * 1024, 128 * 1024];
/// Requests per case sent before measuring (connections, caches, the wasm VM).
const WARMUP_PER_CASE: usize = 10;
/// Header each upstream adds to its answers: its index, so the bench knows which engine served.
const UPSTREAM_HEADER: &str = "x-bench-upstream";
/// The model every pool serves.
const MODEL: &str = "bench";
/// The fixed upstream answer.
const UPSTREAM_BODY: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
/// Where the `stages` bench cuts a prompt's leading part (at the first exact cut from here):
/// ext-proc's first leading part (`LEADING_BYTES` in `ext-proc/src/picker.rs`).
const LEADING_BYTES: usize = 1024;
/// How long the index may take to apply a published turn.
const INDEX_SETTLE: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// Plain vs no-op ext_proc vs kvroute-ext-proc.
    Extproc,
    /// Wasm fast path vs ext_proc path vs plain (shipped full chain).
    Wasm,
    /// Picker decisions per CPU second.
    Picker,
    /// Where one chat decision's time goes (parse, render, encode, keys), in-process.
    Stages,
    /// Decision latency and memory over pools of 16, 256 and 1,024 replicas, in-process.
    Fleet,
    /// Extproc, wasm and picker.
    All,
}

#[derive(Debug, Parser)]
#[command(about = "kvroute latency through a real Envoy, cases interleaved in one run")]
struct Args {
    /// Which benchmark to run.
    #[arg(long, value_enum, default_value = "all")]
    bench: Which,
    /// Hugging Face model folder whose tokenizer and chat template kvroute-ext-proc (and the
    /// prompt generator) use; default `tests/fixtures/tiny-model`.
    #[arg(long)]
    model_dir: Option<std::path::PathBuf>,
    /// Tokens per KV block (vLLM's default is 16).
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Repetitions (each one sends every case `samples` times, interleaved).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Measured requests per case per repetition, 1k-token prompts (0: skip this size, in the
    /// picker bench too).
    #[arg(long, default_value_t = 200)]
    samples_1k: usize,
    /// Measured requests per case per repetition, 8k-token prompts (0: skip this size).
    #[arg(long, default_value_t = 80)]
    samples_8k: usize,
    /// Measured requests per case per repetition, 32k-token prompts (0: skip this size).
    #[arg(long, default_value_t = 40)]
    samples_32k: usize,
    /// Extproc bench: which workloads (a cache miss: a new conversation; a hit: the next turn
    /// of a conversation whose first turn the chosen engine holds).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "miss,hit")]
    workloads: Vec<Workload>,
    /// Decisions per picker measurement, 1k-token prompts (longer prompts: proportionally fewer).
    #[arg(long, default_value_t = 2000)]
    picker_decisions: usize,
    /// Prompts per size in the `stages` bench.
    #[arg(long, default_value_t = 20)]
    stage_prompts: usize,
    /// Run kvroute-ext-proc without kvroute-index (approximate tier only) in the Envoy benches.
    #[arg(long)]
    without_index: bool,
    /// Extproc bench: start a second kvroute-ext-proc on the same kvroute-index, on no
    /// listener, so the `kvroute-ext-proc` case (index over gRPC) shares every decision with a
    /// peer (`peers`) as one of several pickers does; the peer's news counters are printed.
    #[arg(long)]
    peer: bool,
    /// Extproc bench: measure only these cases (`plain`, `noop-ext-proc`, `fixed-picker`,
    /// `kvroute-ext-proc`, `kvroute-embedded`; default all). `plain` is always measured (the
    /// baseline). The others still run, idle: a case left out sends no traffic, so its
    /// ext-proc does no tokenization of its own (a 32k prompt's whole tokenization for the
    /// next turn runs in the background, ≈ 3–10 ms of CPU on this 2-core host).
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// Picker bench: the requests (chat streams with reuse, or every request a new conversation).
    #[arg(long, value_enum, default_value = "reuse")]
    picker_stream: picker::PickerStream,
    /// Picker bench: which index setups to measure.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "none,grpc,embedded"
    )]
    picker_indexes: Vec<picker::PickerIndex>,
    /// Picker bench: evict the CPU caches (write 32 MiB) before every decision, as a router's
    /// decision runs between the proxy's and the client's turns. Only the µs / decision column
    /// (timed around the decision alone) is meaningful then.
    #[arg(long)]
    cold_caches: bool,
    /// Envoy benches: run the ext_procs (no-op, fixed, kvroute-ext-proc and its kvroute-index)
    /// on a runtime of their own pinned to the last CPU, and Envoy, the client and the engine
    /// doubles on the other CPUs — as an endpoint picker runs in a Deployment of its own, where
    /// Envoy's and the client's work does not evict its caches between decisions. Default: all
    /// share every CPU.
    #[arg(long)]
    pin_ext_procs: bool,
    /// Keep transparent huge pages for this process. By default the bench opts out of them as
    /// kvroute-ext-proc does (`kvroute_ext_proc::disable_transparent_huge_pages`), since it
    /// hosts the ext_procs; this flag measures what they cost.
    #[arg(long)]
    transparent_huge_pages: bool,
    /// Fleet bench, internal: measure these pool sizes in this process, interleaved, and print
    /// one `fleet-one` line each (the bench runs them together for latency, and each alone in a
    /// fresh process for memory).
    #[arg(long, hide = true, value_delimiter = ',')]
    fleet_replicas: Vec<usize>,
}

impl Args {
    /// `(tokens, samples)` per prompt size measured through Envoy.
    fn sizes(&self) -> Vec<(usize, usize)> {
        SIZES
            .into_iter()
            .zip([self.samples_1k, self.samples_8k, self.samples_32k])
            .filter(|&(_, samples)| samples > 0)
            .collect()
    }
}

/// What the measured request of a case is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// A new conversation: nothing cached anywhere.
    Miss,
    /// Turn 2 of a conversation whose turn 1 went through the same listener and whose engine
    /// then reported turn 1's blocks stored (the index holds them).
    Hit,
}

mod backends;
mod client;
mod extproc;
mod picker;
mod prompts;
mod stages;
mod wasm;

use backends::*;
use client::*;
use prompts::*;

/// Same allocator as the `kvroute-ext-proc` binary, so the in-process picker costs what it does there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.transparent_huge_pages {
        kvroute_ext_proc::disable_transparent_huge_pages();
    }
    let placement = match Placement::new(args.pin_ext_procs) {
        Ok(placement) => placement,
        Err(error) => {
            eprintln!("cannot place the bench: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("cannot start tokio: {error}");
            return ExitCode::FAILURE;
        }
    };
    let ext_procs = placement
        .runtime
        .as_ref()
        .map_or_else(|| runtime.handle().clone(), |r| r.handle().clone());
    match runtime.block_on(run(args, ext_procs, placement.description)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-latency-bench failed: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Where the ext_procs run (`--pin-ext-procs`).
struct Placement {
    /// Their own runtime, its threads on the last CPU; `None`: the bench's runtime.
    runtime: Option<tokio::runtime::Runtime>,
    description: String,
}

impl Placement {
    /// Pinned: this thread — and so every thread and process it starts later (the bench's
    /// runtime, Envoy) — moves to all CPUs but the last; the ext_procs' runtime (one worker, and
    /// its blocking threads) to the last.
    fn new(pinned: bool) -> anyhow::Result<Self> {
        use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
        use nix::unistd::Pid;
        if !pinned {
            return Ok(Self {
                runtime: None,
                description: "every process and thread shares every CPU".to_owned(),
            });
        }
        let allowed = sched_getaffinity(Pid::from_raw(0))?;
        let cpus: Vec<usize> = (0..CpuSet::count())
            .filter(|&cpu| allowed.is_set(cpu).unwrap_or(false))
            .collect();
        let [others @ .., own] = cpus.as_slice() else {
            bail!("no CPU allowed");
        };
        ensure!(!others.is_empty(), "--pin-ext-procs needs at least 2 CPUs");
        let mut rest = CpuSet::new();
        for &cpu in others {
            rest.set(cpu)?;
        }
        let mut alone = CpuSet::new();
        alone.set(*own)?;
        sched_setaffinity(Pid::from_raw(0), &rest)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ext-procs")
            .on_thread_start(move || {
                if let Err(error) = sched_setaffinity(Pid::from_raw(0), &alone) {
                    eprintln!("cannot pin an ext_proc thread: {error}");
                }
            })
            .enable_all()
            .build()?;
        Ok(Self {
            runtime: Some(runtime),
            description: format!(
                "ext_procs and kvroute-index pinned to CPU {own} (one runtime worker); Envoy, client and engine doubles to CPUs {others:?}"
            ),
        })
    }
}

async fn run(
    args: Args,
    ext_procs: tokio::runtime::Handle,
    placement: String,
) -> anyhow::Result<()> {
    let model_dir = args.model_dir.clone().unwrap_or_else(tiny_model_dir);
    let prompts = PromptSource::load(&model_dir, args.block_size)?;
    println!(
        "machine: {} cores, load average at start {}; {placement}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    let measured: Vec<String> = SIZES
        .iter()
        .map(|&tokens| {
            let turn = prompts.conversation(tokens);
            Ok(format!(
                "{tokens} → turn 1 {} tokens, turn 2 {} tokens",
                prompts.chat_tokens(&turn.first)?.len(),
                prompts.chat_tokens(&turn.next)?.len()
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    println!(
        "model {} (fast encoder: {}), block size {}; chat prompts of seeded mixed text, {:.2} bytes/token; {} (measured)\n",
        model_dir.display(),
        prompts.tokenizer.uses_fast_path(),
        args.block_size,
        prompts.bytes_per_token,
        measured.join("; "),
    );
    if args.bench == Which::Stages {
        stages::stages_bench(&prompts, args.stage_prompts)?;
    }
    if matches!(args.bench, Which::Picker | Which::All) {
        let sizes: Vec<usize> = args.sizes().into_iter().map(|(tokens, _)| tokens).collect();
        picker::picker_bench(
            &prompts,
            &sizes,
            &args.picker_indexes,
            args.picker_decisions,
            args.picker_stream,
            args.cold_caches,
        )?;
    }
    if matches!(args.bench, Which::Fleet) {
        if args.fleet_replicas.is_empty() {
            picker::fleet_bench(&model_dir, args.block_size, args.picker_decisions)?;
        } else {
            picker::fleet_one(&prompts, args.picker_decisions, &args.fleet_replicas)?;
        }
    }
    if matches!(args.bench, Which::Extproc | Which::All) {
        extproc::extproc_bench(&args, &prompts, &ext_procs).await?;
    }
    if matches!(args.bench, Which::Wasm | Which::All) {
        wasm::wasm_bench(&args, &prompts, &ext_procs).await?;
    }
    println!("load average at end {}", load_average());
    Ok(())
}
