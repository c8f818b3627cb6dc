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
//! Build first: `cargo build --release --bins` and, for `wasm`,
//! `cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter`.
#![allow(
    clippy::print_stdout,
    reason = "the benchmark's report is its output on stdout"
)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use axum::serve::ListenerExt as _;
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Phase;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest,
    ProcessingResponse, TrailersResponse,
};
use futures::{Stream, StreamExt as _};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_ext_proc::request::{self, Endpoint};
use kvroute_ext_proc::server::{destination_metadata, set_header};
use kvroute_index::testing::{MockPublisherConfig, MockVllmPublisher};
use kvroute_tests::harness::{Envoy, tiny_model_dir, workspace_root};
use kvroute_tokenize::ModelTokenizer;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Prompt sizes measured, in tokens of the tiny model.
const SIZES: [usize; 2] = [1024, 32 * 1024];
/// Requests per case sent before measuring (connections, caches, the wasm VM).
const WARMUP_PER_CASE: usize = 10;
/// Header the upstream echoes back: kvroute's `tier/reason` on the upstream request. ext-proc runs
/// with `debug_headers` off (the production default), so it adds no response headers of its own.
const DECISION_HEADER: &str = "x-kvroute-decision";
/// The model every pool serves.
const MODEL: &str = "tiny";
/// The fixed upstream answer.
const UPSTREAM_BODY: &str = r#"{"id":"cmpl-bench","object":"text_completion","model":"tiny","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// Issue 4: plain vs no-op ext_proc vs kvroute-ext-proc.
    Extproc,
    /// Issue 6: wasm fast path vs ext_proc path vs plain (shipped full chain).
    Wasm,
    /// Picker decisions per CPU second.
    Picker,
    /// All three.
    All,
}

#[derive(Debug, Parser)]
#[command(about = "kvroute latency through a real Envoy, cases interleaved in one run")]
struct Args {
    /// Which benchmark to run.
    #[arg(long, value_enum, default_value = "all")]
    bench: Which,
    /// Repetitions (each one sends every case `samples` times, interleaved).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Measured requests per case per repetition, 1k-token prompts (0: skip this size).
    #[arg(long, default_value_t = 200)]
    samples_1k: usize,
    /// Measured requests per case per repetition, 32k-token prompts (0: skip this size).
    #[arg(long, default_value_t = 40)]
    samples_32k: usize,
    /// Decisions per picker measurement, 1k-token prompts (32k: a twentieth).
    #[arg(long, default_value_t = 2000)]
    picker_decisions: usize,
    /// Run kvroute-ext-proc without kvroute-index (approximate tier only) in the Envoy benches.
    #[arg(long)]
    without_index: bool,
    /// Picker bench: evict the CPU caches (write 32 MiB) before every decision, as a router's
    /// decision runs between the proxy's and the client's turns. Only the µs / decision column
    /// (timed around the decision alone) is meaningful then.
    #[arg(long)]
    cold_caches: bool,
}

/// Same allocator as the `kvroute-ext-proc` binary, so the in-process picker costs what it does there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("cannot start tokio: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-latency-bench failed: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let prompts = PromptSource::load()?;
    println!(
        "machine: {} cores, load average at start {}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average()
    );
    println!(
        "prompts: {:.2} chars/token; 1k prompt = {} tokens, 32k prompt = {} tokens (measured)\n",
        prompts.chars_per_token,
        prompts.measured_tokens(SIZES[0])?,
        prompts.measured_tokens(SIZES[1])?,
    );
    if matches!(args.bench, Which::Picker | Which::All) {
        picker_bench(&prompts, args.picker_decisions, args.cold_caches)?;
    }
    if matches!(args.bench, Which::Extproc | Which::All) {
        extproc_bench(&args, &prompts).await?;
    }
    if matches!(args.bench, Which::Wasm | Which::All) {
        wasm_bench(&args, &prompts).await?;
    }
    println!("load average at end {}", load_average());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Prompts

/// Unique prompts of a given token length, cut from the committed corpus.
struct PromptSource {
    /// The corpus (ASCII only, so any byte offset is a char boundary), repeated to cover the
    /// longest prompt from any start offset.
    text: String,
    /// Length of one copy of the corpus.
    period: usize,
    chars_per_token: f64,
    tokenizer: ModelTokenizer,
    next: std::sync::atomic::AtomicU64,
}

impl PromptSource {
    fn load() -> anyhow::Result<Self> {
        let dir = workspace_root().join("tests/fixtures/corpus");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .map(|entry| entry.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        files.sort();
        let mut corpus = String::new();
        for file in files {
            corpus.push_str(&std::fs::read_to_string(&file)?);
            corpus.push('\n');
        }
        corpus.retain(|c| c.is_ascii());
        let tokenizer = ModelTokenizer::from_dir(tiny_model_dir())?;
        let tokens = tokenizer.encode_prompt(&corpus, false)?.len();
        ensure!(tokens > 0, "empty corpus");
        let chars_per_token = corpus.len() as f64 / tokens as f64;
        let longest = (SIZES[1] as f64 * chars_per_token * 1.1) as usize;
        let period = corpus.len();
        let text = corpus.repeat(longest / period + 2);
        Ok(Self {
            text,
            period,
            chars_per_token,
            tokenizer,
            next: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// A prompt of about `tokens` tokens that no earlier prompt shares a prefix with.
    fn prompt(&self, tokens: usize) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let len = (tokens as f64 * self.chars_per_token) as usize;
        let start = (n as usize).wrapping_mul(7919) % self.period;
        format!("request {n}: {}", &self.text[start..start + len])
    }

    /// A `/v1/completions` body with a fresh prompt.
    fn body(&self, tokens: usize) -> Bytes {
        let body =
            serde_json::json!({"model": MODEL, "prompt": self.prompt(tokens), "max_tokens": 1});
        Bytes::from(body.to_string())
    }

    fn measured_tokens(&self, tokens: usize) -> anyhow::Result<usize> {
        Ok(self
            .tokenizer
            .encode_prompt(&self.prompt(tokens), true)?
            .len())
    }
}

// ---------------------------------------------------------------------------------------------
// Upstreams, index, ext_procs

/// Everything in-process besides Envoy; stopped on drop.
struct Backends {
    upstreams: Vec<SocketAddr>,
    noop: SocketAddr,
    fixed: SocketAddr,
    /// kvroute-ext-proc as `ExtProc::serve` runs it.
    kvroute: SocketAddr,
    kvroute_admin: SocketAddr,
    kvroute_embedded: SocketAddr,
    kvroute_embedded_admin: SocketAddr,
    stop: CancellationToken,
    tasks: TaskTracker,
    _publishers: Vec<MockVllmPublisher>,
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
    async fn start(with_index: bool) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let mut upstreams = Vec::new();
        for _ in 0..2 {
            upstreams.push(start_upstream(&tasks, &stop).await?);
        }
        let noop = start_processor(NoopProcessor, &tasks, &stop).await?;
        let fixed = start_processor(FixedPicker::new(&upstreams), &tasks, &stop).await?;

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
        let index_yaml = format!(
            "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
             pools:\n  - {{name: {MODEL}, models: [{MODEL}], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}}}\n\
             replicas:\n{index_replicas}"
        );
        let index_config = kvroute_index::config::Config::from_yaml(&index_yaml)?;
        let index = kvroute_index::server::IndexServer::start(index_config).await?;
        // The embedded variant runs the same index config inside kvroute-ext-proc.
        let dir = tempfile::tempdir()?;
        let index_file = dir.path().join("index.yaml");
        std::fs::write(&index_file, &index_yaml)?;

        let remote = if with_index {
            IndexMode::Remote(index.grpc_addr())
        } else {
            IndexMode::None
        };
        let (kvroute, kvroute_admin) = start_kvroute(&upstreams, &remote, &tasks, &stop).await?;
        let (kvroute_embedded, kvroute_embedded_admin) =
            start_kvroute(&upstreams, &IndexMode::Embedded(index_file), &tasks, &stop).await?;
        Ok(Self {
            upstreams,
            noop,
            fixed,
            kvroute,
            kvroute_admin,
            kvroute_embedded,
            kvroute_embedded_admin,
            stop,
            tasks,
            _publishers: publishers,
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

/// Starts kvroute-ext-proc in this process; its gRPC and admin addresses.
async fn start_kvroute(
    upstreams: &[SocketAddr],
    index: &IndexMode,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<(SocketAddr, SocketAddr)> {
    let config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(upstreams, index))?;
    let server = kvroute_ext_proc::ExtProc::builder(config).bind().await?;
    let addrs = (server.grpc_addr()?, server.admin_addr()?);
    let shutdown = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = server.serve(shutdown).await {
            eprintln!("kvroute-ext-proc stopped: {error}");
        }
    });
    Ok(addrs)
}

/// kvroute-ext-proc YAML: one pool `tiny` (in-process tokenizer), replicas `engine-i` at
/// `upstreams`, production budgets; with `index`, the precise tier asks it.
fn ext_proc_config(upstreams: &[SocketAddr], index: &IndexMode) -> String {
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
         pools:\n- name: {MODEL}\n  models: [{MODEL}]\n  block_size: 32\n  \
         key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n  events: {events}\n  \
         tokenizer: {{model_dir: \"{}\"}}\n\
         replicas:\n{replicas}",
        tiny_model_dir().display()
    )
}

/// A fixed responder: reads the whole request, answers [`UPSTREAM_BODY`], echoes kvroute's
/// decision header. TCP_NODELAY on every accepted connection.
async fn start_upstream(
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .fallback(|headers: axum::http::HeaderMap, _body: Bytes| async move {
            let mut response = axum::response::Response::new(axum::body::Body::from(UPSTREAM_BODY));
            response.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            if let Some(decision) = headers.get(DECISION_HEADER) {
                response
                    .headers_mut()
                    .insert(DECISION_HEADER, decision.clone());
            }
            response
        })
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

/// The no-op ext_proc server: one empty `CommonResponse` per message, nothing decided.
#[derive(Debug)]
struct NoopProcessor;

type ReplyStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for NoopProcessor {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<ReplyStream>, tonic::Status> {
        // BUFFERED: exactly one reply per message.
        let replies = request.into_inner().map(|message| {
            Ok(ProcessingResponse {
                response: Some(noop_reply(message?.request)),
                ..Default::default()
            })
        });
        Ok(tonic::Response::new(Box::pin(replies)))
    }
}

/// The empty answer to one message of `phase`.
fn noop_reply(phase: Option<Phase>) -> Reply {
    let common = || Some(CommonResponse::default());
    match phase {
        Some(Phase::RequestHeaders(_)) => {
            Reply::RequestHeaders(HeadersResponse { response: common() })
        }
        Some(Phase::RequestBody(_)) => Reply::RequestBody(BodyResponse { response: common() }),
        Some(Phase::ResponseHeaders(_)) => {
            Reply::ResponseHeaders(HeadersResponse { response: common() })
        }
        Some(Phase::ResponseBody(_)) => Reply::ResponseBody(BodyResponse { response: common() }),
        Some(Phase::RequestTrailers(_)) => Reply::RequestTrailers(TrailersResponse::default()),
        Some(Phase::ResponseTrailers(_)) | None => {
            Reply::ResponseTrailers(TrailersResponse::default())
        }
    }
}

/// A picker that decides nothing: every request goes to the next upstream in turn, answered in
/// exactly kvroute-ext-proc's shapes (destination header and `envoy.lb` metadata with
/// `clear_route_cache` on the body, decision headers on the response). What Envoy itself spends
/// obeying an endpoint picker, so `kvroute / fixed` is the cost of kvroute's decision alone.
#[derive(Debug)]
struct FixedPicker {
    upstreams: Vec<String>,
    next: std::sync::atomic::AtomicUsize,
}

impl FixedPicker {
    fn new(upstreams: &[SocketAddr]) -> Self {
        Self {
            upstreams: upstreams.iter().map(ToString::to_string).collect(),
            next: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for FixedPicker {
    type ProcessStream = ReplyStream;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<ReplyStream>, tonic::Status> {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let endpoint = self.upstreams[turn % self.upstreams.len()].clone();
        let replies = request.into_inner().map(move |message| {
            let mut dynamic_metadata = None;
            let reply = match message?.request {
                Some(Phase::RequestBody(_)) => {
                    dynamic_metadata = Some(destination_metadata(&endpoint));
                    Reply::RequestBody(BodyResponse {
                        response: Some(CommonResponse {
                            header_mutation: Some(HeaderMutation {
                                set_headers: vec![
                                    set_header("x-gateway-destination-endpoint", &endpoint),
                                    set_header(DECISION_HEADER, "fixed/turn"),
                                ],
                                ..HeaderMutation::default()
                            }),
                            clear_route_cache: true,
                            ..CommonResponse::default()
                        }),
                    })
                }
                Some(Phase::ResponseHeaders(_)) => Reply::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: vec![
                                set_header(DECISION_HEADER, "fixed/turn"),
                                set_header("x-kvroute-predicted-cached-tokens", "0"),
                            ],
                            ..HeaderMutation::default()
                        }),
                        ..CommonResponse::default()
                    }),
                }),
                other => noop_reply(other),
            };
            Ok(ProcessingResponse {
                response: Some(reply),
                dynamic_metadata,
                ..Default::default()
            })
        });
        Ok(tonic::Response::new(Box::pin(replies)))
    }
}

async fn start_processor<P: ExternalProcessor>(
    processor: P,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .add_service(ExternalProcessorServer::new(processor))
        .serve_with_incoming_shutdown(nodelay_incoming(listener), stop.clone().cancelled_owned());
    tasks.spawn(async move {
        if let Err(error) = server.await {
            eprintln!("test ext_proc server failed: {error}");
        }
    });
    Ok(addr)
}

/// Accepted connections with TCP_NODELAY: tonic ignores `Server::tcp_nodelay` for a caller's
/// incoming stream, so it is set here.
fn nodelay_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
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
            url: format!("http://{listener}/v1/completions"),
            client: Client::builder(TokioExecutor::new()).build(connector),
            headers: Box::new(headers),
            samples: Vec::new(),
            decisions: BTreeMap::new(),
            failures: 0,
            sent: 0,
        }
    }

    /// Sends one request; returns its latency (request start → whole response body).
    async fn send(&mut self, body: Bytes) -> anyhow::Result<Duration> {
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
        Ok(elapsed)
    }
}

/// Sends `samples` requests per case per repetition, interleaved request by request with the
/// case order rotating, after a warm-up.
async fn measure(
    cases: &mut [Case],
    prompts: &PromptSource,
    tokens: usize,
    reps: usize,
    samples: usize,
) -> anyhow::Result<()> {
    for _ in 0..WARMUP_PER_CASE {
        for case in cases.iter_mut() {
            case.send(prompts.body(tokens)).await?;
        }
    }
    for case in cases.iter_mut() {
        case.decisions.clear();
        case.samples = vec![Vec::with_capacity(samples); reps];
    }
    let n = cases.len();
    for rep in 0..reps {
        for i in 0..samples {
            for k in 0..n {
                let case = &mut cases[(i + k) % n];
                let latency = case.send(prompts.body(tokens)).await?;
                case.samples[rep].push(latency);
            }
        }
    }
    Ok(())
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

// ---------------------------------------------------------------------------------------------
// Issue 4: plain vs no-op ext_proc vs kvroute-ext-proc

async fn extproc_bench(args: &Args, prompts: &PromptSource) -> anyhow::Result<()> {
    let backends = Backends::start(!args.without_index).await?;
    let config = three_listener_config(&backends);
    let envoy = Envoy::start(&config).await?;
    let listener = |name: &str| {
        envoy
            .listener(name)
            .with_context(|| format!("no listener {name}"))
    };
    let mut cases = vec![
        Case::new("plain", listener("plain")?, |_| Vec::new()),
        Case::new("noop-ext-proc", listener("noop")?, |_| Vec::new()),
        Case::new("fixed-picker", listener("fixed")?, |_| Vec::new()),
        Case::new("kvroute-ext-proc", listener("kvroute")?, |_| Vec::new()),
        Case::new("kvroute-embedded", listener("embedded")?, |_| Vec::new()),
    ];
    println!(
        "## extproc: Envoy {{plain, no-op ext_proc, kvroute-ext-proc}}, load {}\n",
        load_average()
    );
    for (tokens, samples) in [(SIZES[0], args.samples_1k), (SIZES[1], args.samples_32k)] {
        if samples == 0 {
            continue;
        }
        let before = stage_totals(backends.kvroute_admin).await?;
        let before_embedded = stage_totals(backends.kvroute_embedded_admin).await?;
        measure(&mut cases, prompts, tokens, args.reps, samples).await?;
        let stages = stage_means(&before, &stage_totals(backends.kvroute_admin).await?);
        let stages_embedded = stage_means(
            &before_embedded,
            &stage_totals(backends.kvroute_embedded_admin).await?,
        );
        println!(
            "### {tokens}-token prompts, {} reps × {samples} per case (load {})\n",
            args.reps,
            load_average()
        );
        report(
            &cases,
            "plain",
            &[
                ("kvroute-ext-proc", "noop-ext-proc"),
                ("kvroute-embedded", "noop-ext-proc"),
                ("fixed-picker", "noop-ext-proc"),
                ("kvroute-ext-proc", "fixed-picker"),
                ("kvroute-embedded", "fixed-picker"),
            ],
        );
        println!(
            "- own timings (warm-up included): kvroute-ext-proc: {stages}. kvroute-embedded: {stages_embedded}\n"
        );
    }
    let failures: usize = cases.iter().map(|c| c.failures).sum();
    let mut stream_failures = Vec::new();
    for listener in ["noop", "fixed", "kvroute", "embedded"] {
        let stat = format!("http.{listener}.ext_proc.streams_failed");
        stream_failures.push(format!(
            "{listener} {}",
            envoy.stat(&stat).await?.unwrap_or(0)
        ));
    }
    println!(
        "failed requests: {failures}; ext_proc streams_failed: {}\n",
        stream_failures.join(", ")
    );
    drop(envoy);
    drop(backends);
    Ok(())
}

/// One stage's cumulative histogram in kvroute-ext-proc's `/metrics` (label sets summed).
#[derive(Debug, Clone, Default)]
struct StageHistogram {
    sum: f64,
    count: f64,
    /// (upper bound in seconds, cumulative count), ascending.
    buckets: Vec<(f64, f64)>,
}

/// The stages kvroute-ext-proc times itself.
const STAGES: [&str; 3] = ["decision", "tokenize", "match"];

/// kvroute-ext-proc's decision, tokenize and match histograms.
async fn stage_totals(admin: SocketAddr) -> anyhow::Result<Vec<StageHistogram>> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let response = client
        .get(format!("http://{admin}/metrics").parse()?)
        .await?;
    let text = String::from_utf8(response.into_body().collect().await?.to_bytes().to_vec())?;
    let value = |line: &str| line.rsplit(' ').next()?.parse::<f64>().ok();
    Ok(STAGES
        .iter()
        .map(|stage| {
            let name = format!("kvroute_extproc_{stage}_duration_seconds");
            let mut histogram = StageHistogram::default();
            let mut buckets: BTreeMap<u64, f64> = BTreeMap::new();
            for line in text.lines().filter(|l| l.starts_with(&name)) {
                let Some(v) = value(line) else { continue };
                let rest = &line[name.len()..];
                if rest.starts_with("_sum") {
                    histogram.sum += v;
                } else if rest.starts_with("_count") {
                    histogram.count += v;
                } else if let Some(le) = rest
                    .split("le=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .and_then(|le| le.parse::<f64>().ok())
                {
                    *buckets.entry(le.to_bits()).or_default() += v;
                }
            }
            histogram.buckets = buckets
                .into_iter()
                .map(|(bits, n)| (f64::from_bits(bits), n))
                .collect();
            histogram.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            histogram
        })
        .collect())
}

/// Mean and median bucket of each stage between two [`stage_totals`] readings.
fn stage_means(before: &[StageHistogram], after: &[StageHistogram]) -> String {
    STAGES
        .iter()
        .zip(before.iter().zip(after.iter()))
        .filter_map(|(stage, (b, a))| {
            let count = a.count - b.count;
            if count <= 0.0 {
                return None;
            }
            let mean = 1e3 * (a.sum - b.sum) / count;
            let median = a
                .buckets
                .iter()
                .zip(b.buckets.iter().map(|x| x.1).chain(std::iter::repeat(0.0)))
                .find(|((_, n), n0)| n - n0 >= count / 2.0)
                .map(|((le, _), _)| 1e3 * le);
            Some(match median {
                Some(m) => format!("{stage} mean {mean:.3} ms, p50 ≤ {m:.3} ms"),
                None => format!("{stage} mean {mean:.3} ms"),
            })
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One Envoy, listeners `plain`, `noop`, `kvroute` → cluster `replicas` (the shipped
/// override_host pool); the two ext_proc filters use the shipped full chain's ext_proc settings.
fn three_listener_config(backends: &Backends) -> String {
    let listener = |name: &str, ext_proc: Option<&str>| {
        let filter = ext_proc.map_or_else(String::new, |cluster| {
            format!(
                r#"
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: {cluster}}}, timeout: 1s}}
              processing_mode: {{request_header_mode: SEND, request_body_mode: BUFFERED, response_header_mode: SEND, response_body_mode: NONE}}
              message_timeout: 1s
              failure_mode_allow: false
              mutation_rules: {{allow_expression: {{regex: "^(x-gateway-.*|x-kvroute-cluster|x-kvroute-decision|content-length)$"}}}}
              metadata_options:
                receiving_namespaces: {{untyped: ["envoy.lb"]}}
                forwarding_namespaces: {{untyped: ["envoy.lb"]}}"#
            )
        });
        format!(
            r#"
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
    per_connection_buffer_limit_bytes: 4194304
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: replicas, timeout: 0s}}
          http_filters:{filter}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#
        )
    };
    let grpc_cluster = |name: &str, addr: SocketAddr| {
        format!(
            r#"
  - name: {name}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {name}
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}]}}]"#,
            addr.ip(),
            addr.port()
        )
    };
    let endpoints: String = backends
        .upstreams
        .iter()
        .map(|a| {
            format!(
                "\n        - endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}",
                a.ip(),
                a.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}
static_resources:
  listeners:{}{}{}{}{}
  clusters:{}{}{}{}
  - name: replicas
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:{endpoints}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint}}]}}
            - header: x-gateway-destination-endpoint
            selected_host_key: {{key: envoy.lb, path: [{{key: x-gateway-destination-endpoint-served}}]}}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest
"#,
        listener("plain", None),
        listener("noop", Some("noop_ext_proc")),
        listener("fixed", Some("fixed_ext_proc")),
        listener("kvroute", Some("kvroute_ext_proc")),
        listener("embedded", Some("embedded_ext_proc")),
        grpc_cluster("noop_ext_proc", backends.noop),
        grpc_cluster("fixed_ext_proc", backends.fixed),
        grpc_cluster("embedded_ext_proc", backends.kvroute_embedded),
        grpc_cluster("kvroute_ext_proc", backends.kvroute),
    )
}

// ---------------------------------------------------------------------------------------------
// Issue 6: wasm fast path vs ext_proc path vs plain, shipped full chain

async fn wasm_bench(args: &Args, prompts: &PromptSource) -> anyhow::Result<()> {
    let module = std::env::var_os("KVROUTE_WASM")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            workspace_root().join("target/wasm32-wasip1/wasm/kvroute_wasm_filter.wasm")
        });
    ensure!(
        module.is_file(),
        "{} missing: cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter",
        module.display()
    );
    let backends = Backends::start(!args.without_index).await?;
    let config = full_chain_config(&backends, &module)?;
    let envoy = Envoy::start(&config).await?;
    let listener = |name: &str| {
        envoy
            .listener(name)
            .with_context(|| format!("no listener {name}"))
    };
    let kvroute = listener("kvroute")?;
    let session = |value: String| vec![("x-session-id".to_owned(), value)];
    let mut cases = vec![
        Case::new("plain", listener("plain")?, |_| Vec::new()),
        // A new session per request: fast-path miss → ext_proc decides → the fallback filter learns.
        Case::new("ext_proc path (first turns)", kvroute, move |i| {
            session(format!("new-{i}"))
        }),
        // One session, learned during warm-up: every later turn is a fast-path hit.
        Case::new("wasm fast path (later turns)", kvroute, move |_| {
            session("returning".to_owned())
        }),
    ];
    println!(
        "## wasm: shipped envoy/kvroute-full-chain.yaml (+ a plain listener), load {}\n",
        load_average()
    );
    let stat = |name: &str| {
        let envoy = &envoy;
        let name = format!("wasmcustom.kvroute_wasm_{name}");
        async move { envoy.stat(&name).await.map(|v| v.unwrap_or(0)) }
    };
    for (tokens, samples) in [(SIZES[0], args.samples_1k), (SIZES[1], args.samples_32k)] {
        if samples == 0 {
            continue;
        }
        // Fresh session names per size.
        let prefix = format!("{tokens}-");
        cases[1].headers =
            Box::new(move |i| vec![("x-session-id".to_owned(), format!("{prefix}new-{i}"))]);
        let hits_before = stat("fast_path_session_hits_total").await?;
        let decisions_before = stat("extproc_decisions_total").await?;
        measure(&mut cases, prompts, tokens, args.reps, samples).await?;
        let hits = stat("fast_path_session_hits_total").await? - hits_before;
        let decisions = stat("extproc_decisions_total").await? - decisions_before;
        println!(
            "### {tokens}-token prompts, {} reps × {samples} per case (load {})\n",
            args.reps,
            load_average()
        );
        report(
            &cases,
            "plain",
            &[
                (
                    "wasm fast path (later turns)",
                    "ext_proc path (first turns)",
                ),
                ("wasm fast path (later turns)", "plain"),
            ],
        );
        let per_case = (WARMUP_PER_CASE + args.reps * samples) as u64;
        // The returning session's first turn (first size only) also asks ext_proc.
        let learn_turn = u64::from(tokens == SIZES[0]);
        println!(
            "- check: fast-path session hits {hits} (expected ≥ {}), ext_proc decisions {decisions} (expected {})\n",
            per_case - 1,
            per_case + learn_turn
        );
    }
    let failures: usize = cases.iter().map(|c| c.failures).sum();
    println!("failed requests: {failures}\n");
    drop(envoy);
    drop(backends);
    Ok(())
}

/// The shipped full chain with real addresses (as `tests/tests/suite/wasm_filter.rs` renders it)
/// plus a `plain` listener onto the same replica pool.
fn full_chain_config(backends: &Backends, module: &std::path::Path) -> anyhow::Result<String> {
    let shipped = workspace_root().join("envoy/kvroute-full-chain.yaml");
    let mut config = std::fs::read_to_string(&shipped)?;
    let [a, b] = [backends.upstreams[0].port(), backends.upstreams[1].port()];
    let substitutions = [
        ("WASM_FILTER_PATH".to_owned(), module.display().to_string()),
        ("port_value: 9901".to_owned(), "port_value: 0".to_owned()),
        ("port_value: 8080".to_owned(), "port_value: 0".to_owned()),
        ("18001".to_owned(), a.to_string()),
        ("18002".to_owned(), b.to_string()),
        ("18003".to_owned(), a.to_string()),
        ("50051".to_owned(), backends.kvroute.port().to_string()),
    ];
    for (from, to) in substitutions {
        ensure!(
            config.contains(&from),
            "{} no longer contains {from:?}",
            shipped.display()
        );
        config = config.replace(&from, &to);
    }
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(&config)?;
    let plain: serde_yaml::Value = serde_yaml::from_str(
        r#"
name: plain
address: {socket_address: {address: 127.0.0.1, port_value: 0}}
per_connection_buffer_limit_bytes: 1048576
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: plain
      route_config:
        virtual_hosts:
        - name: all
          domains: ["*"]
          routes:
          - match: {prefix: "/"}
            route: {cluster: kvroute_replicas, timeout: 0s}
      http_filters:
      - name: envoy.filters.http.router
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#,
    )?;
    yaml["static_resources"]["listeners"]
        .as_sequence_mut()
        .context("static_resources.listeners is not a list")?
        .push(plain);
    Ok(serde_yaml::to_string(&yaml)?)
}

// ---------------------------------------------------------------------------------------------
// Picker decisions per CPU second

/// Loops `Picker::decide` (body parse → tokenize → keys → [index Match] → score) on a
/// current-thread runtime in a thread of its own, for each prompt size, without and with an
/// in-process kvroute-index. CPU time is the whole process's (`/proc/self/stat`): tokenization runs
/// on the blocking pool and the index serves in-process, and both belong to a decision's cost.
fn picker_bench(prompts: &PromptSource, decisions_1k: usize, cold: bool) -> anyhow::Result<()> {
    println!(
        "## picker: decide() in-process, one thread at a time, caches {}, load {}\n",
        if cold {
            "evicted before each decision"
        } else {
            "warm"
        },
        load_average()
    );
    println!(
        "| prompt | index | decisions | wall s | CPU s | decisions / CPU s | decisions / wall s | µs / decision | tiers |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    for (tokens, count) in [
        (SIZES[0], decisions_1k),
        (SIZES[1], (decisions_1k / 20).max(10)),
    ] {
        for index in [PickerIndex::None, PickerIndex::Grpc, PickerIndex::Embedded] {
            let bodies: Vec<Bytes> = (0..count).map(|_| prompts.body(tokens)).collect();
            let row = std::thread::scope(|scope| {
                scope
                    .spawn(|| picker_run(&bodies, index, cold))
                    .join()
                    .map_err(|_| anyhow::anyhow!("picker thread panicked"))?
            })?;
            println!(
                "| {tokens} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:?} |",
                match index {
                    PickerIndex::None => "none (events: false)",
                    PickerIndex::Grpc => "kvroute-index in-process, Match over gRPC",
                    PickerIndex::Embedded => "embedded (`index.embedded`: Match in memory)",
                },
                row.decisions,
                row.wall.as_secs_f64(),
                row.cpu.as_secs_f64(),
                row.decisions as f64 / row.cpu.as_secs_f64(),
                row.decisions as f64 / row.wall.as_secs_f64(),
                1e6 * row.deciding.as_secs_f64() / row.decisions as f64,
                row.tiers,
            );
        }
    }
    println!();
    Ok(())
}

struct PickerRun {
    decisions: usize,
    wall: Duration,
    /// Time inside parse + `decide` alone.
    deciding: Duration,
    cpu: Duration,
    tiers: BTreeMap<String, usize>,
}

/// How the picker bench's decisions reach the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PickerIndex {
    None,
    Grpc,
    Embedded,
}

fn picker_run(bodies: &[Bytes], mode: PickerIndex, cold: bool) -> anyhow::Result<PickerRun> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()?;
    runtime.block_on(async {
        let upstreams: Vec<SocketAddr> = vec!["127.0.0.1:18001".parse()?, "127.0.0.1:18002".parse()?];
        let mut publishers = Vec::new();
        let mut index = None;
        if mode != PickerIndex::None {
            let mut replicas = String::new();
            for i in 0..2 {
                let publisher = MockVllmPublisher::start(MockPublisherConfig {
                    topic: "kv@".to_owned(),
                    ..MockPublisherConfig::loopback()
                })
                .await?;
                replicas.push_str(&format!(
                    "  - {{id: engine-{i}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\", topic: \"kv@\"}}}}\n",
                    publisher.pub_endpoint().context("publisher endpoint")?,
                    publisher.replay_endpoint().context("replay endpoint")?,
                ));
                publishers.push(publisher);
            }
            let config = kvroute_index::config::Config::from_yaml(&format!(
                "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
                 pools:\n  - {{name: {MODEL}, models: [{MODEL}], block_size: 32, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}}}\n\
                 replicas:\n{replicas}"
            ))?;
            index = Some(kvroute_index::server::IndexServer::start(config).await?);
        }
        let index_mode = match (&index, mode) {
            (Some(index), PickerIndex::Grpc) => IndexMode::Remote(index.grpc_addr()),
            _ => IndexMode::None,
        };
        let mut config =
            kvroute_ext_proc::Config::from_yaml(&ext_proc_config(&upstreams, &index_mode))?;
        let tasks = TaskTracker::new();
        if mode == PickerIndex::Embedded {
            // `ExtProc::bind` does this for `index.embedded`; here the index is already running.
            config.pools[0].events = true;
        }
        let mut runtime = kvroute_ext_proc::Runtime::build(config, None, &tasks)?;
        if let (Some(index), PickerIndex::Embedded) = (&index, mode) {
            runtime = runtime.with_local_index(index.matcher());
        }
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = kvroute_ext_proc::metrics::Metrics::register(&mut registry);
        let picker = kvroute_ext_proc::Picker::new(runtime, metrics, tasks.clone());

        // One untimed decision: connects the index client, starts the blocking pool.
        let mut tiers = BTreeMap::new();
        let warm = request::parse(&bodies[0], Endpoint::Completions)?;
        drop(picker.decide(&warm, None).await?);

        let cpu_before = process_cpu()?;
        let started = Instant::now();
        // Larger than any last-level cache here; one write per cache line evicts the picker's data.
        let mut evictor = if cold { vec![0u8; 32 << 20] } else { Vec::new() };
        let mut deciding = Duration::ZERO;
        for body in &bodies[1..] {
            for line in evictor.iter_mut().step_by(64) {
                *line = line.wrapping_add(1);
            }
            std::hint::black_box(&mut evictor);
            let decision_started = Instant::now();
            let parsed = request::parse(body, Endpoint::Completions)?;
            let decision = picker.decide(&parsed, None).await?;
            deciding += decision_started.elapsed();
            *tiers
                .entry(format!("{}/{}", decision.tier.as_label(), decision.reason))
                .or_insert(0usize) += 1;
        }
        let wall = started.elapsed();
        let cpu = process_cpu()? - cpu_before;
        tasks.close();
        if let Some(index) = index {
            index.shutdown().await;
        }
        for publisher in publishers {
            publisher.shutdown().await;
        }
        Ok(PickerRun {
            decisions: bodies.len() - 1,
            wall,
            deciding,
            cpu,
            tiers,
        })
    })
}

/// User + system CPU time of this process so far (`/proc/self/stat`, in clock ticks of 1/100 s).
fn process_cpu() -> anyhow::Result<Duration> {
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(')')
        .context("malformed /proc/self/stat")?
        .1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .context("short /proc/self/stat")?
            .parse::<f64>()?)
    };
    Ok(Duration::from_secs_f64(
        (ticks(11)? + ticks(12)?) / TICKS_PER_SECOND,
    ))
}
