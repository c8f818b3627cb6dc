//! `kvroute-latency-bench`: request latency through a real Envoy, every case in the same run.
//!
//! - `extproc` (issue 4): one Envoy, three listeners that differ only in their ext_proc filter —
//!   `plain` (none), `noop` (a no-op `ExternalProcessor`: an empty `CommonResponse` per message) and
//!   `kvroute` (kvroute-ext-proc with a kvroute-index and the in-process tokenizer of
//!   `tests/fixtures/tiny-model`), both ext_procs in BUFFERED mode with the shipped settings.
//! - `wasm` (issue 6): the shipped `envoy/kvroute-full-chain.yaml` (addresses substituted, one plain
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
//! Code: this file (flags, prompts, in-process upstreams / index / ext_procs, the client and its
//! statistics), one module per bench (`extproc`, `wasm`, `stages`, `picker`).
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
use kvroute_index::event::{BlockStored, EventBatch, KvEvent, Medium};
use kvroute_index::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_index::wire::{self, Encoding};
use kvroute_tests::harness::ext_proc::{FakeExtProc, FakeRouting};
use kvroute_tests::harness::{Envoy, tiny_model_dir, wait_until, workspace_root};
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
/// ext-proc's inline-tokenization limit.
const LEADING_BYTES: usize = 16 * 1024;
/// How long the index may take to apply a published turn.
const INDEX_SETTLE: Duration = Duration::from_secs(20);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// Issue 4: plain vs no-op ext_proc vs kvroute-ext-proc.
    Extproc,
    /// Issue 6: wasm fast path vs ext_proc path vs plain (shipped full chain).
    Wasm,
    /// Picker decisions per CPU second.
    Picker,
    /// Where one chat decision's time goes (parse, render, encode, keys), in-process.
    Stages,
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
    /// Measured requests per case per repetition, 1k-token prompts (0: skip this size).
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
    /// Extproc bench: measure only these cases (`plain`, `noop-ext-proc`, `fixed-picker`,
    /// `kvroute-ext-proc`, `kvroute-embedded`; default all). `plain` is always measured (the
    /// baseline). The others still run, idle: a case left out sends no traffic, so its
    /// ext-proc does no tokenization of its own (a 32k prompt's whole tokenization for the
    /// next turn runs in the background, ≈ 3–10 ms of CPU on this 2-core host).
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
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

/// Same allocator as the `kvroute-ext-proc` binary, so the in-process picker costs what it does there.
mod extproc;
mod picker;
mod stages;
mod wasm;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
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
        picker::picker_bench(&prompts, args.picker_decisions, args.cold_caches)?;
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

// ---------------------------------------------------------------------------------------------
// Prompts

/// Unique chat conversations of a given token length, cut from seeded mixed text
/// (`kvroute_tokenize::testing::mixed_text`: prose, code, JSON, several scripts, emoji), with the
/// model whose tokens and block keys kvroute-ext-proc computes.
struct PromptSource {
    /// The mixed text twice over, so a prompt can start anywhere in the first copy.
    text: String,
    /// Length of one copy.
    period: usize,
    bytes_per_token: f64,
    model_dir: std::path::PathBuf,
    block_size: u32,
    tokenizer: ModelTokenizer,
    /// kvroute-ext-proc's config for this model: its pool computes the block keys an engine
    /// reports for a served turn.
    keys: kvroute_ext_proc::Config,
    next: std::sync::atomic::AtomicU64,
}

/// A conversation's first turn and its next turn (the first plus an answer and a follow-up).
struct Conversation {
    first: serde_json::Value,
    next: serde_json::Value,
}

/// Seed of the mixed text every prompt is cut from.
const PROMPT_SEED: u64 = 0x006b_7672_6f75_7465;
/// Bytes of mixed text generated; more than the longest prompt measured.
const MIXED_TEXT_BYTES: usize = 4 << 20;
/// The system message of every conversation.
const SYSTEM_PROMPT: &str = "You are a careful assistant. Answer from the material the user gives.";
/// The user's second message.
const FOLLOW_UP: &str = "Thanks. Now list the three points of the text above that matter most, one line each, and say why.";

impl PromptSource {
    fn load(model_dir: &std::path::Path, block_size: u32) -> anyhow::Result<Self> {
        let mixed = kvroute_tokenize::testing::mixed_text(PROMPT_SEED, MIXED_TEXT_BYTES, &[]);
        let tokenizer = ModelTokenizer::from_dir(model_dir)
            .with_context(|| format!("loading {}", model_dir.display()))?;
        ensure!(
            tokenizer.has_chat_template(),
            "{} has no chat template",
            model_dir.display()
        );
        let sample = &mixed[..mixed.floor_char_boundary(256 << 10)];
        let tokens = tokenizer.encode_prompt(sample, false)?.len();
        ensure!(tokens > 0, "empty sample");
        let bytes_per_token = sample.len() as f64 / tokens as f64;
        let longest = (STAGE_SIZES[STAGE_SIZES.len() - 1] as f64 * bytes_per_token * 1.1) as usize;
        ensure!(
            longest < mixed.len(),
            "{} bytes of mixed text cannot hold a {longest}-byte prompt",
            mixed.len()
        );
        let keys = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
            &["127.0.0.1:1".parse()?],
            &IndexMode::None,
            model_dir,
            block_size,
        ))?;
        Ok(Self {
            period: mixed.len(),
            text: mixed.repeat(2),
            bytes_per_token,
            model_dir: model_dir.to_owned(),
            block_size,
            tokenizer,
            keys,
            next: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// User text of about `tokens` tokens that no earlier prompt shares a prefix with.
    fn user_text(&self, tokens: usize) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let len = (tokens as f64 * self.bytes_per_token) as usize;
        let start = self
            .text
            .floor_char_boundary((n as usize).wrapping_mul(7919) % self.period);
        let end = self.text.floor_char_boundary(start + len);
        format!("request {n}: {}", &self.text[start..end])
    }

    /// A new conversation whose first turn is about `tokens` tokens.
    fn conversation(&self, tokens: usize) -> Conversation {
        let first = serde_json::json!([
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.user_text(tokens)},
        ]);
        let mut next = first.clone();
        if let Some(messages) = next.as_array_mut() {
            messages.push(serde_json::json!({"role": "assistant", "content": self.user_text(60)}));
            messages.push(serde_json::json!({"role": "user", "content": FOLLOW_UP}));
        }
        Conversation { first, next }
    }

    /// A `/v1/chat/completions` body for `messages`.
    fn body(messages: &serde_json::Value) -> Bytes {
        let body = serde_json::json!({"model": MODEL, "messages": messages, "max_tokens": 1});
        Bytes::from(body.to_string())
    }

    /// A new conversation's first turn, as a body.
    fn miss_body(&self, tokens: usize) -> Bytes {
        Self::body(&self.conversation(tokens).first)
    }

    /// The prompt tokens vLLM computes for `messages` (the request's defaults).
    fn chat_tokens(&self, messages: &serde_json::Value) -> anyhow::Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode_chat_with(messages, &kvroute_tokenize::ChatOptions::default())?)
    }

    /// The block keys an engine publishes for the full blocks of `messages`' prompt.
    fn block_keys(&self, messages: &serde_json::Value) -> anyhow::Result<(Vec<u32>, Vec<u64>)> {
        let tokens = self.chat_tokens(messages)?;
        let pool = self.keys.pools.first().context("no pool")?;
        let keys = pool.prompt_keys(&tokens, None, None)?;
        Ok((tokens, keys))
    }
}

// ---------------------------------------------------------------------------------------------
// Upstreams, index, ext_procs

/// Everything in-process besides Envoy; stopped on drop.
struct Backends {
    upstreams: Vec<SocketAddr>,
    /// The harness's fake ext_procs: an empty answer to every message, and the upstreams in turn
    /// in kvroute-ext-proc's shapes (what Envoy spends obeying an endpoint picker, so
    /// `kvroute / fixed` is the cost of kvroute's decision alone).
    noop: FakeExtProc,
    fixed: FakeExtProc,
    /// kvroute-ext-proc as `ExtProc::serve` runs it.
    kvroute: SocketAddr,
    kvroute_admin: SocketAddr,
    kvroute_embedded: SocketAddr,
    kvroute_embedded_admin: SocketAddr,
    /// Admin address of the index each kvroute-ext-proc asks: the in-process kvroute-index
    /// (gRPC variant) and the embedded one.
    index_admin: SocketAddr,
    embedded_index_admin: SocketAddr,
    stop: CancellationToken,
    tasks: TaskTracker,
    /// The engines' KV-event publishers (both indexes subscribe to them).
    publishers: Vec<MockVllmPublisher>,
    _index: kvroute_index::server::IndexServer,
    _dir: tempfile::TempDir,
}

impl Drop for Backends {
    fn drop(&mut self) {
        self.stop.cancel();
        self.tasks.close();
    }
}

impl Backends {
    /// The engine doubles on this runtime; the ext_procs and kvroute-index on `ext_procs`.
    async fn start(
        with_index: bool,
        prompts: &PromptSource,
        ext_procs: &tokio::runtime::Handle,
    ) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let mut upstreams = Vec::new();
        for i in 0..2 {
            upstreams.push(start_upstream(i, &tasks, &stop).await?);
        }
        // Started on `ext_procs`, so the tasks they spawn live there.
        let noop = ext_procs
            .spawn(FakeExtProc::start(FakeRouting::Noop))
            .await
            .context("the no-op ext_proc's start task")??;
        let fixed_turns =
            FakeRouting::RoundRobin(upstreams.iter().map(ToString::to_string).collect());
        let fixed = ext_procs
            .spawn(FakeExtProc::start(fixed_turns))
            .await
            .context("the fixed ext_proc's start task")??;

        // The index follows two (silent) engines; kvroute-ext-proc asks it on every decision.
        let mut publishers = Vec::new();
        let mut index_replicas = String::new();
        for i in 0..2 {
            let publisher = MockVllmPublisher::start(MockPublisherConfig {
                topic: "kv@".to_owned(),
                ..MockPublisherConfig::loopback()
            })
            .await?;
            index_replicas.push_str(&format!(
                "  - {{id: engine-{i}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\", topic: \"kv@\"}}}}\n",
                publisher.pub_endpoint().context("publisher endpoint")?,
                publisher.replay_endpoint().context("replay endpoint")?,
            ));
            publishers.push(publisher);
        }
        let index_yaml = index_yaml(&index_replicas, prompts.block_size);
        let index_config = kvroute_index::config::Config::from_yaml(&index_yaml)?;
        let index = ext_procs
            .spawn(kvroute_index::server::IndexServer::start(index_config))
            .await
            .context("kvroute-index's start task")??;
        // The embedded variant runs the same index config inside kvroute-ext-proc.
        let dir = tempfile::tempdir()?;
        let index_file = dir.path().join("index.yaml");
        std::fs::write(&index_file, &index_yaml)?;

        let remote = if with_index {
            IndexMode::Remote(index.grpc_addr())
        } else {
            IndexMode::None
        };
        let kvroute_on_ext_procs = async |index: IndexMode| {
            let (u, t, s) = (upstreams.clone(), tasks.clone(), stop.clone());
            let (model_dir, block_size) = (prompts.model_dir.clone(), prompts.block_size);
            ext_procs
                .spawn(
                    async move { start_kvroute(&u, &index, &model_dir, block_size, &t, &s).await },
                )
                .await
                .context("kvroute-ext-proc's start task")?
        };
        let (kvroute, kvroute_admin, _) = kvroute_on_ext_procs(remote).await?;
        let (kvroute_embedded, kvroute_embedded_admin, embedded_index_admin) =
            kvroute_on_ext_procs(IndexMode::Embedded(index_file)).await?;
        Ok(Self {
            upstreams,
            noop,
            fixed,
            kvroute,
            kvroute_admin,
            kvroute_embedded,
            kvroute_embedded_admin,
            index_admin: index.admin_addr(),
            embedded_index_admin: embedded_index_admin.context("embedded index not running")?,
            stop,
            tasks,
            publishers,
            _index: index,
            _dir: dir,
        })
    }
}

/// Where a kvroute-ext-proc finds its index.
enum IndexMode {
    /// kvroute-index over gRPC.
    Remote(SocketAddr),
    /// `index.embedded` with this kvroute-index config file.
    Embedded(std::path::PathBuf),
    /// None: the approximate tier only.
    None,
}

/// kvroute-index YAML: one pool of the bench's model, `replicas` (YAML list items).
fn index_yaml(replicas: &str, block_size: u32) -> String {
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         pools:\n  - {{name: {MODEL}, models: [{MODEL}], block_size: {block_size}, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}}}\n\
         replicas:\n{replicas}"
    )
}

/// Starts kvroute-ext-proc in this process; its gRPC and admin addresses, and its embedded
/// index's admin address.
async fn start_kvroute(
    upstreams: &[SocketAddr],
    index: &IndexMode,
    model_dir: &std::path::Path,
    block_size: u32,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<(SocketAddr, SocketAddr, Option<SocketAddr>)> {
    let config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
        upstreams, index, model_dir, block_size,
    ))?;
    let server = kvroute_ext_proc::ExtProc::builder(config).bind().await?;
    let addrs = (
        server.grpc_addr()?,
        server.admin_addr()?,
        server.embedded_index_addrs().map(|(_, admin)| admin),
    );
    let shutdown = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = server.serve(shutdown).await {
            eprintln!("kvroute-ext-proc stopped: {error}");
        }
    });
    Ok(addrs)
}

/// kvroute-ext-proc YAML: one pool (in-process tokenizer of `model_dir`), replicas `engine-i` at
/// `upstreams`, production budgets; with `index`, the precise tier asks it.
fn ext_proc_config(
    upstreams: &[SocketAddr],
    index: &IndexMode,
    model_dir: &std::path::Path,
    block_size: u32,
) -> String {
    let replicas: String = upstreams
        .iter()
        .enumerate()
        .map(|(i, addr)| format!("- {{id: engine-{i}, pool: {MODEL}, address: \"{addr}\"}}\n"))
        .collect();
    let (index, events) = match index {
        IndexMode::Remote(addr) => (format!("index: {{addresses: [\"http://{addr}\"]}}\n"), true),
        IndexMode::Embedded(path) => (
            format!("index: {{embedded: \"{}\"}}\n", path.display()),
            true,
        ),
        IndexMode::None => (String::new(), false),
    };
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n{index}\
         pools:\n- name: {MODEL}\n  models: [{MODEL}]\n  block_size: {block_size}\n  \
         key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n  events: {events}\n  \
         tokenizer: {{model_dir: \"{}\"}}\n\
         replicas:\n{replicas}",
        model_dir.display()
    )
}

/// A fixed responder: reads the whole request, answers [`UPSTREAM_BODY`] with its `index` in
/// [`UPSTREAM_HEADER`], echoes kvroute's decision header. TCP_NODELAY on every accepted connection.
async fn start_upstream(
    index: usize,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .fallback(
            move |headers: axum::http::HeaderMap, _body: Bytes| async move {
                let mut response =
                    axum::response::Response::new(axum::body::Body::from(UPSTREAM_BODY));
                response.headers_mut().insert(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("application/json"),
                );
                response
                    .headers_mut()
                    .insert(UPSTREAM_HEADER, axum::http::HeaderValue::from(index));
                // Echoed back: kvroute's `tier/reason` on the upstream request. ext-proc runs with
                // `debug_headers` off (the production default), so it adds no response headers.
                if let Some(decision) = headers.get(DECISION_HEADER) {
                    response
                        .headers_mut()
                        .insert(DECISION_HEADER, decision.clone());
                }
                response
            },
        )
        .layer(axum::extract::DefaultBodyLimit::max(8 * 1024 * 1024));
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let shutdown = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            eprintln!("upstream {addr} failed: {error}");
        }
    });
    Ok(addr)
}

// ---------------------------------------------------------------------------------------------
// Client and statistics

/// One measured case: a listener plus the headers each request carries.
struct Case {
    name: &'static str,
    url: String,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Extra headers for request `i` of this case.
    headers: Box<dyn Fn(u64) -> Vec<(String, String)> + Send + Sync>,
    /// Latencies per repetition.
    samples: Vec<Vec<Duration>>,
    /// `tier/reason` the upstream echoed → count.
    decisions: BTreeMap<String, usize>,
    failures: usize,
    sent: u64,
    /// For a kvroute-ext-proc listener: its admin address (decision tally) and its index's
    /// admin address (to wait until the index holds a hit's first turn).
    kvroute: Option<KvrouteAdmin>,
}

/// Where a kvroute case's ext-proc and index answer admin requests.
#[derive(Debug, Clone, Copy)]
struct KvrouteAdmin {
    ext_proc: SocketAddr,
    index: SocketAddr,
}

impl Case {
    fn new(
        name: &'static str,
        listener: SocketAddr,
        headers: impl Fn(u64) -> Vec<(String, String)> + Send + Sync + 'static,
    ) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            name,
            url: format!("http://{listener}/v1/chat/completions"),
            client: Client::builder(TokioExecutor::new()).build(connector),
            headers: Box::new(headers),
            samples: Vec::new(),
            decisions: BTreeMap::new(),
            failures: 0,
            sent: 0,
            kvroute: None,
        }
    }

    /// This case is a kvroute-ext-proc listener with these admin addresses.
    fn kvroute(mut self, ext_proc: SocketAddr, index: SocketAddr) -> Self {
        self.kvroute = Some(KvrouteAdmin { ext_proc, index });
        self
    }

    /// Sends one request; returns its latency (request start → whole response body).
    async fn send(&mut self, body: Bytes) -> anyhow::Result<Duration> {
        Ok(self.send_to(body).await?.0)
    }

    /// Sends one request; returns its latency and the upstream that answered.
    async fn send_to(&mut self, body: Bytes) -> anyhow::Result<(Duration, Option<usize>)> {
        let mut request =
            hyper::Request::post(&self.url).header("content-type", "application/json");
        for (name, value) in (self.headers)(self.sent) {
            request = request.header(name, value);
        }
        self.sent += 1;
        let request = request.body(Full::new(body))?;
        let started = Instant::now();
        let response = tokio::time::timeout(Duration::from_secs(10), self.client.request(request))
            .await
            .context("no answer within 10 s")??;
        let status = response.status();
        let decision = response
            .headers()
            .get(DECISION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let upstream = response
            .headers()
            .get(UPSTREAM_HEADER)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        let body = response.into_body().collect().await?.to_bytes();
        let elapsed = started.elapsed();
        if !status.is_success() {
            self.failures += 1;
            bail!(
                "{}: status {status}: {}",
                self.name,
                String::from_utf8_lossy(&body)
            );
        }
        if let Some(decision) = decision {
            *self.decisions.entry(decision).or_default() += 1;
        }
        Ok((elapsed, upstream))
    }
}

/// Sends `samples` requests per case per repetition, interleaved request by request with the
/// case order rotating, after a warm-up (cache misses). For [`Workload::Hit`] each repetition first
/// sends every kvroute case's conversations' first turns through that case (not measured), has the
/// engine that served each one publish its blocks, waits until the index holds them, and then
/// measures the conversations' next turns. Returns the kvroute cases' decision tally over the
/// measured requests only.
async fn measure(
    cases: &mut [Case],
    engines: Option<&[MockVllmPublisher]>,
    prompts: &PromptSource,
    tokens: usize,
    workload: Workload,
    reps: usize,
    samples: usize,
) -> anyhow::Result<BTreeMap<String, Tally>> {
    for _ in 0..WARMUP_PER_CASE {
        for case in cases.iter_mut() {
            case.send(prompts.miss_body(tokens)).await?;
        }
    }
    for case in cases.iter_mut() {
        case.decisions.clear();
        case.samples = vec![Vec::with_capacity(samples); reps];
    }
    let mut tallies: BTreeMap<String, Tally> = BTreeMap::new();
    let n = cases.len();
    for rep in 0..reps {
        // The measured bodies of this repetition, per case.
        let mut bodies: Vec<Vec<Bytes>> = Vec::with_capacity(n);
        for case in cases.iter_mut() {
            // The first turns are not measured: their decisions are not counted.
            let measured_decisions = case.decisions.clone();
            let mut case_bodies = Vec::with_capacity(samples);
            for _ in 0..samples {
                let conversation = prompts.conversation(tokens);
                if workload == Workload::Miss {
                    case_bodies.push(PromptSource::body(&conversation.first));
                    continue;
                }
                if let (Some(admin), Some(engines)) = (case.kvroute, engines) {
                    let (_, served) = case
                        .send_to(PromptSource::body(&conversation.first))
                        .await?;
                    let served = served.context("upstream did not say who it is")?;
                    let engine = engines.get(served).context("no such engine")?;
                    let keys = publish_stored(engine, prompts, &conversation.first).await?;
                    wait_indexed(admin.index, served, &keys).await?;
                }
                case_bodies.push(PromptSource::body(&conversation.next));
            }
            case.decisions = measured_decisions;
            bodies.push(case_bodies);
        }
        let mut before = Vec::new();
        for case in cases.iter() {
            before.push(match case.kvroute {
                Some(admin) => Some(Tally::scrape(admin.ext_proc).await?),
                None => None,
            });
        }
        let mut queues: Vec<_> = bodies.into_iter().map(Vec::into_iter).collect();
        for i in 0..samples {
            for k in 0..n {
                let c = (i + k) % n;
                let body = queues[c].next().context("a case ran out of bodies")?;
                let latency = cases[c].send(body).await?;
                cases[c].samples[rep].push(latency);
            }
        }
        for (case, before) in cases.iter().zip(before) {
            if let (Some(admin), Some(before)) = (case.kvroute, before) {
                let delta = Tally::scrape(admin.ext_proc).await?.minus(&before);
                tallies.entry(case.name.to_owned()).or_default().add(&delta);
            }
        }
    }
    Ok(tallies)
}

/// Publishes, as `engine`'s vLLM would after prefilling `messages`, one `BlockStored` with the
/// prompt's full blocks; returns their keys.
async fn publish_stored(
    engine: &MockVllmPublisher,
    prompts: &PromptSource,
    messages: &serde_json::Value,
) -> anyhow::Result<Vec<u64>> {
    let (tokens, keys) = prompts.block_keys(messages)?;
    let block_size = prompts.block_size as usize;
    let stored = BlockStored {
        block_hashes: keys.clone(),
        parent_block_hash: None,
        token_ids: tokens[..keys.len() * block_size].to_vec(),
        block_size: prompts.block_size,
        medium: Medium::Gpu,
        extra_keys: Some(vec![None; keys.len()]),
        group_idx: Some(0),
        ..BlockStored::default()
    };
    let batch = EventBatch {
        ts: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs_f64(),
        dp_rank: Some(0),
        events: vec![KvEvent::BlockStored(stored)],
    };
    engine
        .publish(wire::encode_batch(&batch, Encoding::V0_32))
        .await?;
    Ok(keys)
}

/// Waits until the index at `admin` says `engine-{engine}` holds every block of `keys`.
async fn wait_indexed(admin: SocketAddr, engine: usize, keys: &[u64]) -> anyhow::Result<()> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let body = Bytes::from(serde_json::json!({"model": MODEL, "prompt_keys": keys}).to_string());
    let id = format!("engine-{engine}");
    let url: hyper::Uri = format!("http://{admin}/v1/match").parse()?;
    wait_until(
        &format!("{id} holds a published turn"),
        INDEX_SETTLE,
        || {
            let request = hyper::Request::post(url.clone())
                .header("content-type", "application/json")
                .body(Full::new(body.clone()));
            let client = client.clone();
            let id = id.clone();
            async move {
                let response = client.request(request.ok()?).await.ok()?;
                let bytes = response.into_body().collect().await.ok()?.to_bytes();
                let answer: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
                answer["replicas"]
                    .as_array()?
                    .iter()
                    .any(|r| {
                        r["id"] == id.as_str()
                            && r["matched_blocks"].as_u64() == Some(keys.len() as u64)
                    })
                    .then_some(())
            }
        },
    )
    .await?;
    Ok(())
}

/// kvroute-ext-proc's decision and fallback counters (`/metrics`), by label set.
#[derive(Debug, Clone, Default)]
struct Tally {
    /// `tier/reason` → decisions.
    decisions: BTreeMap<String, f64>,
    /// `stage/cause` → fallbacks.
    fallbacks: BTreeMap<String, f64>,
    /// Token source (`tokenize_duration_seconds{kind}`: `leading`, `tokenizer`, `cache`, …) →
    /// tokenizations; a decision that needed the whole prompt after its leading part counts twice.
    sources: BTreeMap<String, f64>,
}

impl Tally {
    async fn scrape(admin: SocketAddr) -> anyhow::Result<Self> {
        let text = metrics_text(admin).await?;
        let mut tally = Self::default();
        for line in text.lines() {
            let (series, into, labels) =
                if let Some(rest) = line.strip_prefix("kvroute_extproc_decisions_total{") {
                    (rest, &mut tally.decisions, ["tier", "reason"])
                } else if let Some(rest) = line.strip_prefix("kvroute_extproc_fallbacks_total{") {
                    (rest, &mut tally.fallbacks, ["stage", "cause"])
                } else if let Some(rest) =
                    line.strip_prefix("kvroute_extproc_tokenize_duration_seconds_count{")
                {
                    (rest, &mut tally.sources, ["kind", ""])
                } else {
                    continue;
                };
            let Some((label_text, value)) = series.rsplit_once("} ") else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let label = |name: &str| {
                label_text
                    .split(',')
                    .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                    .map(|v| v.trim_end_matches('"').to_owned())
                    .unwrap_or_default()
            };
            let key = match labels[1] {
                "" => label(labels[0]),
                second => format!("{}/{}", label(labels[0]), label(second)),
            };
            *into.entry(key).or_default() += value;
        }
        Ok(tally)
    }

    fn minus(&self, before: &Self) -> Self {
        let diff = |after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>| {
            after
                .iter()
                .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
                .filter(|(_, v)| *v > 0.0)
                .collect()
        };
        Self {
            decisions: diff(&self.decisions, &before.decisions),
            fallbacks: diff(&self.fallbacks, &before.fallbacks),
            sources: diff(&self.sources, &before.sources),
        }
    }

    fn add(&mut self, other: &Self) {
        for (k, v) in &other.decisions {
            *self.decisions.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.fallbacks {
            *self.fallbacks.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.sources {
            *self.sources.entry(k.clone()).or_default() += v;
        }
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |map: &BTreeMap<String, f64>| {
            if map.is_empty() {
                return "none".to_owned();
            }
            map.iter()
                .map(|(k, v)| format!("{k} {v:.0}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        write!(
            f,
            "decisions (tier/reason): {}; fallbacks (stage/cause): {}; tokens from: {}",
            list(&self.decisions),
            list(&self.fallbacks),
            list(&self.sources)
        )
    }
}

/// The text of kvroute-ext-proc's `/metrics`.
async fn metrics_text(admin: SocketAddr) -> anyhow::Result<String> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let response = client
        .get(format!("http://{admin}/metrics").parse()?)
        .await?;
    Ok(String::from_utf8(
        response.into_body().collect().await?.to_bytes().to_vec(),
    )?)
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// p50 and p99 of `samples`.
fn quantiles(samples: &[Duration]) -> (Duration, Duration) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    (percentile(&sorted, 0.50), percentile(&sorted, 0.99))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Prints per-case p50/p99 (all repetitions pooled), added latency over `baseline`, and the
/// per-repetition ratios `numerator / denominator`, of the totals and of the added latency.
fn report(cases: &[Case], baseline: &str, ratios: &[(&str, &str)]) {
    let find = |name: &str| cases.iter().find(|c| c.name == name);
    let pooled = |case: &Case| quantiles(&case.samples.concat());
    let Some(base) = find(baseline) else { return };
    let (base50, base99) = pooled(base);
    println!("| case | n | p50 ms | p99 ms | added p50 ms | added p99 ms | p50 per rep (ms) |");
    println!("|---|---:|---:|---:|---:|---:|---|");
    for case in cases {
        let (p50, p99) = pooled(case);
        let per_rep: Vec<String> = case
            .samples
            .iter()
            .map(|s| format!("{:.3}", ms(quantiles(s).0)))
            .collect();
        println!(
            "| {} | {} | {:.3} | {:.3} | {:+.3} | {:+.3} | {} |",
            case.name,
            case.samples.iter().map(Vec::len).sum::<usize>(),
            ms(p50),
            ms(p99),
            ms(p50) - ms(base50),
            ms(p99) - ms(base99),
            per_rep.join(", ")
        );
    }
    println!();
    for (num, den) in ratios {
        let (Some(num_case), Some(den_case)) = (find(num), find(den)) else {
            continue;
        };
        let ratio_of = |q: usize| {
            let per_rep: Vec<String> = num_case
                .samples
                .iter()
                .zip(&den_case.samples)
                .zip(&base.samples)
                .map(|((n, d), b)| {
                    let pick = |s: &[Duration]| {
                        let (p50, p99) = quantiles(s);
                        ms(if q == 50 { p50 } else { p99 })
                    };
                    format!(
                        "{:.2}× (added {:.2}×)",
                        pick(n) / pick(d),
                        (pick(n) - pick(b)) / (pick(d) - pick(b))
                    )
                })
                .collect();
            per_rep.join(", ")
        };
        let (n50, n99) = pooled(num_case);
        let (d50, d99) = pooled(den_case);
        println!(
            "- {num}/{den}: p50 {:.2}× (added {:.2}×), p99 {:.2}× (added {:.2}×) pooled; per rep p50: {}; per rep p99: {}",
            ms(n50) / ms(d50),
            (ms(n50) - ms(base50)) / (ms(d50) - ms(base50)),
            ms(n99) / ms(d99),
            (ms(n99) - ms(base99)) / (ms(d99) - ms(base99)),
            ratio_of(50),
            ratio_of(99),
        );
    }
    for case in cases.iter().filter(|c| !c.decisions.is_empty()) {
        println!(
            "- {} decisions (tier/reason): {:?}",
            case.name, case.decisions
        );
    }
    println!();
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}
