//! [`Stack`]: the whole product as real processes on 127.0.0.1 — N `kvroute-engine-sim` replicas,
//! `kvroute-index`, `kvroute-ext-proc` and Envoy — for the demo and end-to-end tests.
//!
//! Every process binds port 0 and reports its real ports (ready files, Envoy's admin); readiness
//! is polled with deadlines. Configs are rendered from what the sims bound: the index subscribes
//! to each sim's KV events (with replay), ext-proc knows each sim's HTTP address and `/metrics`,
//! and Envoy runs `envoy/kvroute-override-host.yaml` itself — the documented production example,
//! loaded and patched with the real addresses (ports, the pool's endpoints, the ext-proc address).
//!
//! Envoy also gets a plain round-robin listener over the same sims (no ext_proc), so one stack
//! can compare both ways of routing. [`Routing::RoundRobin`] starts only that: sims and Envoy.
//!
//! [`IndexPlacement::Embedded`] runs the index inside kvroute-ext-proc (`index.embedded`, the
//! same index config in a file) instead of as its own process.
//!
//! [`Stack::start_external`] puts the same index, ext-proc and Envoy in front of engines the
//! caller runs instead of sims (real vLLM: [`ExternalReplica`]); replica ids stay `sim-<i>`.
//!
//! Faults, for the restart tests and the chaos soak (`suite/soak.rs`): every process can be
//! SIGKILLed and restarted on its own ports — the index ([`Stack::restart_index`]), ext-proc
//! ([`Stack::restart_ext_proc`]), a sim ([`Stack::restart_sim`]: empty cache, sequence from 0)
//! and the agent ([`Stack::restart_agent`]) that [`StackOptions::agent_replicas`] puts between
//! some sims and the index; [`StackOptions::cuttable_event_streams`] runs a sim's KV-event stream
//! through a [`TcpProxy`] that [`Stack::cut_events`] cuts until [`Stack::resume_events`];
//! [`StackOptions::engine_retries`] adds [`ENGINE_RETRY_POLICY`] to Envoy's kvroute route.
//!
//! Binaries are looked up next to the running executable (`target/<profile>/`, also from
//! `target/<profile>/deps/` where test binaries live); build them first with
//! `cargo build --bins` (tests) or `cargo build --release --bins` (the demo).
//!
//! [`StackOptions::events_faults`] breaks one sim's KV-event feed to the index (never connected,
//! or another block size: flagged);
//! [`StackOptions::refusing_replicas`] adds endpoints that refuse connections (Envoy's retries).
//!
//! Dropping the stack stops every process (Envoy first, the sims last); a panicking test gets
//! each process's log printed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_test_support::{deadline, try_poll_until};
use serde_yaml::Value;

use crate::harness::{
    ChildGuard, Envoy, HarnessError, SimProcess, TcpProxy, http, reserve_port, reserve_port_run,
    round_robin_config, startup_timeout, tiny_model_dir, until_ext_proc_sees_replicas_idle,
    workspace_root,
};

/// The Envoy config the kvroute mode runs (relative to the workspace root).
pub const OVERRIDE_HOST_CONFIG: &str = "envoy/kvroute-override-host.yaml";
/// Name of the kvroute listener in [`OVERRIDE_HOST_CONFIG`].
pub const KVROUTE_LISTENER: &str = "kvroute";
/// The shipped Envoy configs' cluster of kvroute-ext-proc (its health check marks it healthy).
pub const EXT_PROC_CLUSTER: &str = "kvroute_ext_proc";
/// Name given to the round-robin listener.
const ROUND_ROBIN_LISTENER: &str = "round_robin";
/// Model name the sims serve and the pools route.
pub const MODEL: &str = "tiny";
/// How long the index gets to see every sim's events after start.
fn event_sync_timeout() -> Duration {
    deadline(Duration::from_secs(30))
}

/// How kvroute-index's SUB socket meets an engine's KV-event PUB socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventsMode {
    /// The engine binds (vLLM endpoint with a wildcard, `tcp://*:P`); the index connects.
    Connect,
    /// The index binds; the engine connects (vLLM endpoint naming a host, `tcp://127.0.0.1:P`).
    Bind,
}

impl EventsMode {
    /// The index config's `events.mode` value.
    pub fn as_label(self) -> &'static str {
        match self {
            EventsMode::Connect => "connect",
            EventsMode::Bind => "bind",
        }
    }
}

/// An engine the caller started and owns (e.g. real vLLM): the stack routes to it and indexes
/// its KV events, but never starts or stops it. With [`StackOptions::data_parallel_size`] N the
/// endpoints are rank 0's: the index (and agent) subscribe to rank r on their ports + r, as vLLM
/// offsets them, so the engine must have those ports free (`reserve_port_run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalReplica {
    /// Its OpenAI-compatible HTTP API.
    pub http: SocketAddr,
    /// The KV-event endpoint of the index's SUB socket (`tcp://127.0.0.1:P`).
    pub events: String,
    /// Whether the index connects to `events` or binds it.
    pub events_mode: EventsMode,
    /// The engine's replay ROUTER endpoint.
    pub replay: String,
    /// The engine's KV-event topic.
    pub topic: String,
}

/// Where the index hears one replica's events (a sim's or an external engine's).
#[derive(Debug, Clone)]
struct EventSource {
    endpoint: String,
    mode: EventsMode,
    replay: String,
    topic: String,
}

/// How Envoy routes requests to the sims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Envoy's round robin alone.
    RoundRobin,
    /// kvroute-ext-proc picks the replica (Envoy override_host), with kvroute-index.
    Kvroute,
}

impl Routing {
    /// A short label.
    pub fn as_label(self) -> &'static str {
        match self {
            Routing::RoundRobin => "round-robin",
            Routing::Kvroute => "kvroute",
        }
    }
}

/// Where kvroute-index runs in a [`Routing::Kvroute`] stack.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IndexPlacement {
    /// Its own `kvroute-index` process(es); ext-proc asks them over gRPC.
    #[default]
    Service,
    /// Inside kvroute-ext-proc (`index: {embedded: <index config file>}`): `Match` is answered
    /// in memory, and the index lives and restarts with ext-proc.
    Embedded,
}

impl IndexPlacement {
    /// A short label.
    pub fn as_label(self) -> &'static str {
        match self {
            IndexPlacement::Service => "service",
            IndexPlacement::Embedded => "embedded",
        }
    }
}

/// The simulators' timing model (the sim's flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimTiming {
    /// Fixed cost of an engine step that prefills, ms.
    pub ttft_overhead_ms: f64,
    /// Prefill per uncached prompt token in a step, µs (prefills batched per step per replica).
    pub prefill_us_per_token: f64,
    /// A decode-only step (one token for every running request), ms.
    pub decode_ms_per_token: f64,
    /// Multiplies every duration above.
    pub time_scale: f64,
}

impl SimTiming {
    /// Effective prefill cost per token in ms (what kvroute's scoring should assume).
    pub fn prefill_ms_per_token(&self) -> f64 {
        self.prefill_us_per_token * self.time_scale / 1000.0
    }
}

impl Default for SimTiming {
    fn default() -> Self {
        Self {
            ttft_overhead_ms: 5.0,
            prefill_us_per_token: 50.0,
            decode_ms_per_token: 10.0,
            time_scale: 0.01,
        }
    }
}

/// kvroute-ext-proc's time budgets (its config's `budgets` and `index.match_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtProcBudgets {
    /// A whole routing decision.
    pub decision: Duration,
    /// Tokenization within it.
    pub tokenize: Duration,
    /// One `Match` on the index.
    pub match_timeout: Duration,
}

impl ExtProcBudgets {
    /// kvroute-ext-proc's own defaults (what production runs).
    pub fn production() -> Self {
        Self {
            decision: Duration::from_millis(50),
            tokenize: Duration::from_millis(30),
            match_timeout: Duration::from_millis(20),
        }
    }

    /// For unoptimised builds on a busy machine: tokenizing a long chat in a debug build can take
    /// longer than the production budget, which would turn every test into a fallback test.
    /// Still below Envoy's 1 s ext_proc message timeout.
    pub fn relaxed() -> Self {
        Self {
            decision: Duration::from_millis(600),
            tokenize: Duration::from_millis(400),
            match_timeout: Duration::from_millis(200),
        }
    }

    /// [`relaxed`](Self::relaxed) in debug builds, else [`production`](Self::production): the
    /// binaries come from the same profile directory as the running executable.
    pub fn for_this_build() -> Self {
        if cfg!(debug_assertions) {
            Self::relaxed()
        } else {
            Self::production()
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Number of engine simulators.
    pub replicas: usize,
    /// Routing mode.
    pub routing: Routing,
    /// Tokens per KV block (sims, index and ext-proc agree).
    pub block_size: u32,
    /// Usable KV blocks per replica.
    pub kv_blocks_per_replica: usize,
    /// Longest prompt plus output a sim accepts.
    pub max_model_len: usize,
    /// Most requests a sim runs at once.
    pub max_num_seqs: usize,
    /// Sim timing.
    pub timing: SimTiming,
    /// `--prefix-caching-hash-algo` (the index and ext-proc use the same).
    pub hash_algo: String,
    /// The engines' `PYTHONHASHSEED`.
    pub hash_seed: String,
    /// kvroute-ext-proc's budgets.
    pub budgets: ExtProcBudgets,
    /// Where the binaries are; default: next to the current executable.
    pub bin_dir: Option<PathBuf>,
    /// kvroute-index instances (1..=[`MAX_INDEX_INSTANCES`]), each subscribed to every sim;
    /// ext-proc lists them all, the first one first (HA). Must be 1 with
    /// [`IndexPlacement::Embedded`].
    pub index_instances: usize,
    /// Whether the index is its own process or runs inside ext-proc.
    pub index_placement: IndexPlacement,
    /// Whether ext-proc adds its debug response headers (off, as in production, unless a test
    /// that reads them opts in).
    pub debug_headers: DebugHeaders,
    /// `--chat-template` of sim `i` (`None`, or no entry: the model folder's template, which
    /// ext-proc tokenizes with): a replica that renders chat unlike kvroute.
    pub sim_chat_templates: Vec<Option<String>>,
    /// Top-level sections appended to ext-proc's config (YAML, e.g. `drift: {...}`); keys the
    /// harness writes itself must not be repeated.
    pub ext_proc_extra_config: String,
    /// Keys added to ext-proc's pool entry (YAML flow-mapping items, e.g. `mode: shadow`).
    pub pool_extra_config: String,
    /// Keys added to ext-proc's `scoring` section (YAML flow-mapping items, e.g.
    /// `idle_pool_ms: 0`); the weights the harness writes must not be repeated.
    pub scoring_extra_config: String,
    /// Envoy's own choice (the override_host fallback, used when kvroute names no destination:
    /// shadow mode, fail-open) is round robin instead of the shipped least-request, so a test
    /// can tell in advance where sequential requests land.
    pub envoy_fallback_round_robin: bool,
    /// Where ext-proc's pool gets its tokens.
    pub tokenizer: StackTokenizer,
    /// Sims whose KV events reach the index through a `kvroute-agent` process (one agent for
    /// all of them, node id [`AGENT_ID`]) instead of the index's own subscription.
    pub agent_replicas: Vec<usize>,
    /// Sims whose KV-event PUB stream runs through a [`TcpProxy`] the caller can cut
    /// ([`Stack::cut_events`]); the replay socket stays direct, as a repair path.
    pub cuttable_event_streams: Vec<usize>,
    /// Envoy retries a request whose engine refused the connection or reset the stream on
    /// another endpoint ([`ENGINE_RETRY_POLICY`]); off keeps the shipped config's route as is.
    pub engine_retries: bool,
    /// A fault in what the index hears of sim `i`'s KV events (`None`, or no entry: none).
    pub events_faults: Vec<Option<EventsFault>>,
    /// Replicas whose address refuses connections (a reserved port nothing binds), in Envoy's
    /// pool and ext-proc's config (ids `refusing-<i>`, kept ready by scraping sim 0's
    /// `/metrics`) but not in the index: what Envoy meets when an engine dies under load.
    pub refusing_replicas: usize,
    /// Environment variables of kvroute-ext-proc (e.g. `OTEL_*`, `RUST_LOG`).
    pub ext_proc_env: Vec<(String, String)>,
    /// Environment variables of every kvroute-index process.
    pub index_env: Vec<(String, String)>,
    /// Environment variables of the kvroute-agent ([`StackOptions::agent_replicas`]).
    pub agent_env: Vec<(String, String)>,
    /// Envoy traces too, exporting to this OTLP/gRPC collector ([`with_envoy_tracing`]).
    pub envoy_tracing: Option<SocketAddr>,
    /// Data-parallel ranks behind each sim's one API server (`--data-parallel-size`); above 1,
    /// the index, the agent and ext-proc declare them (`data_parallel_size`) and route to each
    /// rank as replica `sim-<i>@dp<rank>`.
    pub data_parallel_size: u32,
    /// Sim `i`'s part in prefill/decode disaggregation (`None`, or no entry: `both`, and no KV
    /// connector): ext-proc's `role`, and the sim's NixlConnector (`--kv-transfer-config`,
    /// `kv_producer` or `kv_consumer`). The pool's `disaggregation` goes in
    /// [`StackOptions::pool_extra_config`].
    pub replica_roles: Vec<Option<ReplicaRole>>,
    /// Each sim's engine family on the wire, by replica (`None` and missing: vLLM). With SGLang
    /// sims the pool keys on SGLang's page hash (`sglang-exact`), with both kinds on
    /// `token-chain`; ext-proc, the index and the sims are told each replica's family.
    pub sim_engines: Vec<Option<kvroute_config::Engine>>,
    /// Envoy streams request bodies to ext-proc (FULL_DUPLEX_STREAMED) instead of buffering
    /// them as the shipped config does.
    pub envoy_full_duplex: bool,
    /// kvroute-ext-proc processes behind Envoy's ext_proc cluster (1 to
    /// [`MAX_EXT_PROC_INSTANCES`]), all with the same config: several pickers acting on one
    /// fleet, sharing decisions through the index unless the config says `peers: {share: false}`.
    pub ext_proc_instances: usize,
}

/// A replica's part in a disaggregated pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaRole {
    /// Computes prompts for decode replicas (`role: prefill`, `kv_role: kv_producer`).
    Prefill,
    /// Serves requests, pulling a split prompt's KV (`role: decode`, `kv_role: kv_consumer`).
    Decode,
}

impl ReplicaRole {
    /// ext-proc's `replicas[].role`.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// vLLM's `kv_role` for it.
    pub fn kv_role(self) -> &'static str {
        match self {
            Self::Prefill => "kv_producer",
            Self::Decode => "kv_consumer",
        }
    }
}

/// A fault in one sim's KV-event feed to the index (the sim itself serves normally).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventsFault {
    /// The index's endpoints for it lead nowhere (reserved ports nothing binds): it never
    /// connects.
    Unreachable,
    /// The sim runs with this block size while the pool says [`StackOptions::block_size`]:
    /// every block it stores is refused and the index flags it.
    BlockSize(u32),
}

/// The agent's id in a stack with [`StackOptions::agent_replicas`].
pub const AGENT_ID: &str = "node-0";

/// The cap on the delay before a failed engine event socket is re-opened (index and agent): a
/// stack's engine restarts within a second or two and the fault tests' convergence deadlines
/// start at the restart, which the production default (10s) could outlast.
const RECONNECT_BACKOFF_MAX: &str = "200ms";
/// Process name (and log and config file name) of the stack's agent.
const AGENT_NAME: &str = "kvroute-agent";
/// The retry policy [`StackOptions::engine_retries`] puts on the kvroute route: the shipped one
/// (`connect-failure,refused-stream`) plus `reset`, so a stream an engine reset before answering
/// (a SIGKILL mid-request, as the soak does) is retried on another endpoint too. Completions are stateless on the engine, so a retried POST is safe; a
/// stream already answering is never retried by Envoy (its headers went downstream).
/// `previous_hosts` keeps the retry off the failed endpoint: after the one override host is
/// consumed, override_host's fallback (least-request) picks, and would favour the idle dead one.
pub const ENGINE_RETRY_POLICY: &str = r#"{retry_on: "connect-failure,refused-stream,reset",
  num_retries: 3, host_selection_retry_max_attempts: 5,
  retry_host_predicate: [{name: envoy.retry_host_predicates.previous_hosts, typed_config:
    {"@type": type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate}}]}"#;

/// ext-proc's `tokenizer` in a stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StackTokenizer {
    /// A model folder, in process: the sims' tiny model by default; a stack in front of
    /// external engines names the folder they serve.
    ModelDir(PathBuf),
    /// The render endpoints of sim `n` (`tokenizer: {render: http://<sim n>, timeout}`).
    RenderSim {
        /// Which sim.
        sim: usize,
        /// Per-call timeout.
        timeout: Duration,
    },
    /// Render endpoints at a given base URL (a test's failing or silent server).
    RenderUrl {
        /// `http://host:port`.
        url: String,
        /// Per-call timeout.
        timeout: Duration,
    },
}

impl Default for StackTokenizer {
    fn default() -> Self {
        Self::ModelDir(tiny_model_dir())
    }
}

/// ext-proc's `debug_headers` in a stack: who gets `x-kvroute-decision` and
/// `x-kvroute-predicted-cached-tokens` on responses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DebugHeaders {
    /// Nobody: ext-proc's default, what a production deployment runs.
    #[default]
    Off,
    /// Every response.
    Always,
    /// Requests carrying this token in [`DEBUG_TOKEN_HEADER`].
    Token(String),
}

/// The request header of [`DebugHeaders::Token`] (ext-proc's default).
/// Most ext-proc processes a stack runs ([`StackOptions::ext_proc_instances`]).
pub const MAX_EXT_PROC_INSTANCES: usize = 3;
/// Their service names (their files and logs), the first being the one ext-proc of a stack.
const EXT_PROC_NAMES: [&str; MAX_EXT_PROC_INSTANCES] = [
    "kvroute-ext-proc",
    "kvroute-ext-proc-2",
    "kvroute-ext-proc-3",
];

pub const DEBUG_TOKEN_HEADER: &str = kvroute_ext_proc::config::DEFAULT_DEBUG_TOKEN_HEADER;
/// File name of the debug token ([`DebugHeaders::Token`]).
const DEBUG_TOKEN_FILE: &str = "kvroute-debug-token";

/// Most kvroute-index instances a stack runs.
pub const MAX_INDEX_INSTANCES: usize = 3;
/// Process names of the index instances (also their log and config file names).
const INDEX_NAMES: [&str; MAX_INDEX_INSTANCES] =
    ["kvroute-index", "kvroute-index-2", "kvroute-index-3"];
/// File name of the embedded index's config ([`IndexPlacement::Embedded`]).
const EMBEDDED_INDEX_CONFIG: &str = "kvroute-index-embedded.yaml";
/// File name of the agent's token (the index's `agents[].token_file` and the agent's own).
const AGENT_TOKEN_FILE: &str = "kvroute-agent-token";
/// The agent's token: a test secret.
const AGENT_TOKEN: &str = "stack-agent-token";

impl StackOptions {
    /// Replica `replica`'s engine family.
    pub fn engine_of(&self, replica: usize) -> kvroute_config::Engine {
        self.sim_engines
            .get(replica)
            .copied()
            .flatten()
            .unwrap_or_default()
    }
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            replicas: 4,
            routing: Routing::Kvroute,
            block_size: 32,
            kv_blocks_per_replica: 256,
            max_model_len: 2048,
            max_num_seqs: 256,
            timing: SimTiming::default(),
            hash_algo: "sha256_cbor".to_owned(),
            hash_seed: "0".to_owned(),
            budgets: ExtProcBudgets::for_this_build(),
            bin_dir: None,
            index_instances: 1,
            index_placement: IndexPlacement::Service,
            debug_headers: DebugHeaders::Off,
            sim_chat_templates: Vec::new(),
            ext_proc_extra_config: String::new(),
            pool_extra_config: String::new(),
            scoring_extra_config: String::new(),
            envoy_fallback_round_robin: false,
            tokenizer: StackTokenizer::default(),
            agent_replicas: Vec::new(),
            cuttable_event_streams: Vec::new(),
            engine_retries: false,
            events_faults: Vec::new(),
            refusing_replicas: 0,
            data_parallel_size: 1,
            ext_proc_env: Vec::new(),
            index_env: Vec::new(),
            agent_env: Vec::new(),
            envoy_tracing: None,
            replica_roles: Vec::new(),
            sim_engines: Vec::new(),
            envoy_full_duplex: false,
            ext_proc_instances: 1,
        }
    }
}

/// Why the stack could not start or be driven.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// A process, poll or HTTP step failed.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// A binary is not built.
    #[error("{name} not found in {}: build it first with `{hint}`", dir.display())]
    MissingBinary {
        /// The binary.
        name: &'static str,
        /// Where it was looked for.
        dir: PathBuf,
        /// The command that builds it.
        hint: &'static str,
    },
    /// The Envoy config file does not have the shape this harness patches.
    #[error("cannot render {OVERRIDE_HOST_CONFIG}: {detail}")]
    EnvoyConfig {
        /// What is missing or wrong.
        detail: String,
    },
    /// A component stopped or never became ready.
    #[error("{component} failed: {detail}\n----- {component} log -----\n{log}")]
    Component {
        /// Which process.
        component: &'static str,
        /// What happened.
        detail: String,
        /// Its log.
        log: String,
    },
    /// The operation needs kvroute, but the stack runs round robin only.
    #[error("the stack was started with round-robin routing; {what} is not running")]
    NotRunning {
        /// The component.
        what: &'static str,
    },
    /// No such replica, or it has no cuttable event stream.
    #[error("{operation}: {detail}")]
    NoSuchReplica {
        /// The refused operation.
        operation: &'static str,
        /// What is missing.
        detail: String,
    },
    /// The operation acts on the index process, but the index runs inside kvroute-ext-proc.
    #[error(
        "{operation} needs IndexPlacement::Service: the index is embedded in kvroute-ext-proc \
         (restart_ext_proc restarts both)"
    )]
    IndexEmbedded {
        /// The refused operation.
        operation: &'static str,
    },
}

impl StackError {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            StackError::Harness(e) => e.as_label(),
            StackError::MissingBinary { .. } => "missing_binary",
            StackError::EnvoyConfig { .. } => "envoy_config",
            StackError::Component { .. } => "component",
            StackError::NotRunning { .. } => "not_running",
            StackError::IndexEmbedded { .. } => "index_embedded",
            StackError::NoSuchReplica { .. } => "no_such_replica",
        }
    }
}

mod configs;
mod service;
mod sims;

use configs::*;
pub use configs::{
    pool_schema, render_envoy_config, with_engine_retries, with_envoy_tracing, with_ext_procs,
    with_full_duplex, with_round_robin_fallback,
};
use service::*;
pub use service::{ExtProcProcess, ServerProcess, binary_dir, release_binary_dir};
use sims::*;
pub use sims::{event_topic, start_sims};

/// The running stack. Dropping it stops everything.
#[derive(Debug)]
pub struct Stack {
    // Field order is drop order: Envoy first, the sims last.
    envoy: Envoy,
    ext_proc: Option<Service>,
    /// ext-proc processes beyond the first ([`StackOptions::ext_proc_instances`]).
    more_ext_procs: Vec<Service>,
    /// The kvroute-agent feeding [`StackOptions::agent_replicas`].
    agent: Option<Service>,
    index: Option<Service>,
    /// Index instances beyond the first (`index_instances > 1`).
    more_indexes: Vec<Service>,
    /// The cuttable KV-event links ([`StackOptions::cuttable_event_streams`]), by replica.
    event_proxies: Vec<(usize, TcpProxy)>,
    sims: Vec<SimProcess>,
    /// Killed sims, kept for their logs.
    retired_sims: Vec<SimProcess>,
    sim_binary: PathBuf,
    /// Engines the caller owns ([`Stack::start_external`]); empty when the stack runs sims.
    external: Vec<ExternalReplica>,
    options: StackOptions,
    _dir: tempfile::TempDir,
}

impl Stack {
    /// Starts the sims, then (kvroute mode) the index and ext-proc, then Envoy, each ready
    /// before the next; in kvroute mode also waits until the index has heard from every sim.
    pub async fn start(options: StackOptions) -> Result<Self, StackError> {
        let binaries = locate_all(&options)?;
        let sim_binary = binaries.sim.display().to_string();
        let mut sims = Vec::with_capacity(options.replicas);
        for replica in 0..options.replicas {
            sims.push(SimProcess::spawn(&sim_binary, &sim_args(&options, replica, None)?).await?);
        }
        Self::start_in_front(options, binaries, sims, Vec::new()).await
    }

    /// Like [`Stack::start`], but in front of `engines` (already serving) instead of sims:
    /// replica `sim-<i>` is `engines[i]`; `options.replicas` and the sim settings are unused.
    /// kvroute-engine-sim need not be built. Kvroute mode also waits until the index heard from
    /// every engine, sending each a one-token completion so that an idle vLLM publishes.
    pub async fn start_external(
        options: StackOptions,
        engines: Vec<ExternalReplica>,
    ) -> Result<Self, StackError> {
        let dir = binary_dir(options.bin_dir.as_deref());
        let binaries = Binaries {
            sim: PathBuf::new(),
            index: locate(&dir, "kvroute-index")?,
            ext_proc: locate(&dir, "kvroute-ext-proc")?,
            agent: (!options.agent_replicas.is_empty())
                .then(|| locate(&dir, AGENT_NAME))
                .transpose()?,
        };
        Self::start_in_front(options, binaries, Vec::new(), engines).await
    }

    /// Starts index, ext-proc and Envoy in front of running replicas (sims or external engines).
    async fn start_in_front(
        options: StackOptions,
        binaries: Binaries,
        sims: Vec<SimProcess>,
        external: Vec<ExternalReplica>,
    ) -> Result<Self, StackError> {
        let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
            path: PathBuf::from("tempdir"),
            source,
        })?;
        let sim_addrs: Vec<SocketAddr> = sims
            .iter()
            .map(|s| s.ready.http)
            .chain(external.iter().map(|e| e.http))
            .collect();

        let mut more_indexes = Vec::new();
        let mut more_ext_procs = Vec::new();
        let mut event_proxies = Vec::new();
        let mut agent = None;
        let (index, ext_proc, envoy_config) = match options.routing {
            Routing::RoundRobin => {
                let config = round_robin_config(&sim_addrs);
                (None, None, config)
            }
            Routing::Kvroute => {
                let Some(names) = INDEX_NAMES
                    .get(..options.index_instances)
                    .filter(|n| !n.is_empty())
                else {
                    return Err(StackError::Component {
                        component: "kvroute-index",
                        detail: format!(
                            "index_instances must be 1..={MAX_INDEX_INSTANCES}, not {}",
                            options.index_instances
                        ),
                        log: String::new(),
                    });
                };
                let mut sources = event_sources(&sims, &external)?;
                apply_events_faults(&options, &mut sources)?;
                for &replica in &options.cuttable_event_streams {
                    let source = sources
                        .get_mut(replica)
                        .ok_or_else(|| no_replica(replica))?;
                    let upstream = source
                        .endpoint
                        .strip_prefix("tcp://")
                        .and_then(|addr| addr.parse().ok())
                        .ok_or_else(|| StackError::NoSuchReplica {
                            operation: "cuttable_event_streams",
                            detail: format!("{} is not a tcp:// endpoint", source.endpoint),
                        })?;
                    let proxy = TcpProxy::start(upstream).await?;
                    source.endpoint = format!("tcp://{}", proxy.addr());
                    event_proxies.push((replica, proxy));
                }
                if options.agent_replicas.iter().any(|&r| r >= sources.len()) {
                    return Err(StackError::NoSuchReplica {
                        operation: "agent_replicas",
                        detail: format!(
                            "{:?} for {} replicas",
                            options.agent_replicas,
                            sources.len()
                        ),
                    });
                }
                if !options.agent_replicas.is_empty()
                    && options.index_placement == IndexPlacement::Embedded
                {
                    return Err(StackError::IndexEmbedded {
                        operation: "agent_replicas",
                    });
                }
                let agent_token = (!options.agent_replicas.is_empty())
                    .then(|| {
                        let path = dir.path().join(AGENT_TOKEN_FILE);
                        write_file(&path, AGENT_TOKEN).map(|()| path)
                    })
                    .transpose()?;
                let index_yaml = index_config(&options, &sources, agent_token.as_deref());
                let mut indexes = Vec::with_capacity(names.len());
                // The index processes, or the file ext-proc's embedded index reads.
                let embedded_index_config = match options.index_placement {
                    IndexPlacement::Service => {
                        for name in names {
                            indexes.push(
                                Service::start(
                                    name,
                                    ServiceKind::Server,
                                    binaries.index.clone(),
                                    dir.path(),
                                    index_yaml.clone(),
                                    None,
                                    &options.index_env,
                                )
                                .await?,
                            );
                        }
                        None
                    }
                    IndexPlacement::Embedded => {
                        if options.index_instances != 1 {
                            return Err(StackError::Component {
                                component: "kvroute-index",
                                detail: format!(
                                    "an embedded index is one instance, not {}",
                                    options.index_instances
                                ),
                                log: String::new(),
                            });
                        }
                        let path = dir.path().join(EMBEDDED_INDEX_CONFIG);
                        write_file(&path, &index_yaml)?;
                        Some(path)
                    }
                };
                let index_addrs: Vec<SocketAddr> = indexes.iter().map(|i| i.grpc).collect();
                if let (Some(binary), Some(token)) = (&binaries.agent, &agent_token) {
                    agent = Some(
                        Service::start(
                            AGENT_NAME,
                            ServiceKind::Agent,
                            binary.clone(),
                            dir.path(),
                            agent_config(&options, &sources, &index_addrs, token),
                            None,
                            &options.agent_env,
                        )
                        .await?,
                    );
                }
                let target = match &embedded_index_config {
                    Some(path) => IndexTarget::Embedded(path),
                    None => IndexTarget::Addresses(&index_addrs),
                };
                let debug_headers = match &options.debug_headers {
                    DebugHeaders::Off => String::new(),
                    DebugHeaders::Always => "debug_headers: {expose: always}\n".to_owned(),
                    DebugHeaders::Token(token) => {
                        let path = dir.path().join(DEBUG_TOKEN_FILE);
                        write_file(&path, token)?;
                        format!(
                            "debug_headers: {{expose: token, token_header: {DEBUG_TOKEN_HEADER}, \
                             token_file: \"{}\"}}\n",
                            path.display()
                        )
                    }
                };
                let refusing = (0..options.refusing_replicas)
                    .map(|_| reserve_port().map(|port| SocketAddr::from(([127, 0, 0, 1], port))))
                    .collect::<Result<Vec<_>, _>>()?;
                let instances = options.ext_proc_instances;
                if instances == 0
                    || instances > MAX_EXT_PROC_INSTANCES
                    || (instances > 1 && embedded_index_config.is_some())
                {
                    return Err(StackError::Component {
                        component: "kvroute-ext-proc",
                        detail: format!(
                            "{instances} ext-proc instances: 1 to {MAX_EXT_PROC_INSTANCES}, \
                             several only with a separate index"
                        ),
                        log: String::new(),
                    });
                }
                let ext_proc_yaml = ext_proc_config(&options, &sim_addrs, &refusing, target)
                    + &debug_headers
                    + &options.ext_proc_extra_config;
                let mut ext_procs = Vec::with_capacity(instances);
                for name in &EXT_PROC_NAMES[..instances] {
                    ext_procs.push(
                        Service::start(
                            name,
                            ServiceKind::Server,
                            binaries.ext_proc.clone(),
                            dir.path(),
                            ext_proc_yaml.clone(),
                            embedded_index_config.clone(),
                            &options.ext_proc_env,
                        )
                        .await?,
                    );
                }
                let ext_proc = ext_procs.remove(0);
                more_ext_procs = ext_procs;
                let index = (!indexes.is_empty()).then(|| indexes.remove(0));
                more_indexes = indexes;
                let text = std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG))
                    .map_err(|source| HarnessError::Io {
                        path: workspace_root().join(OVERRIDE_HOST_CONFIG),
                        source,
                    })?;
                let endpoints: Vec<SocketAddr> =
                    sim_addrs.iter().chain(&refusing).copied().collect();
                let mut config = render_envoy_config(&text, &endpoints, ext_proc.grpc)?;
                if !more_ext_procs.is_empty() {
                    let grpcs: Vec<SocketAddr> = std::iter::once(&ext_proc)
                        .chain(&more_ext_procs)
                        .map(|service| service.grpc)
                        .collect();
                    config = with_ext_procs(&config, &grpcs)?;
                }
                if options.engine_retries {
                    config = with_engine_retries(&config)?;
                }
                if options.envoy_full_duplex {
                    config = with_full_duplex(&config)?;
                }
                if options.envoy_fallback_round_robin {
                    config = with_round_robin_fallback(&config)?;
                }
                if let Some(collector) = options.envoy_tracing {
                    config = with_envoy_tracing(&config, collector)?;
                }
                (index, Some(ext_proc), config)
            }
        };
        let envoy = Envoy::start(&envoy_config).await?;
        let stack = Self {
            envoy,
            ext_proc,
            more_ext_procs,
            agent,
            index,
            more_indexes,
            event_proxies,
            sims,
            retired_sims: Vec::new(),
            sim_binary: binaries.sim,
            external,
            options,
            _dir: dir,
        };
        if stack.options.routing == Routing::Kvroute {
            stack.wait_ext_proc_healthy_in_envoy().await?;
            stack.wait_index_synced().await?;
        }
        Ok(stack)
    }

    /// The options it was started with.
    pub fn options(&self) -> &StackOptions {
        &self.options
    }

    /// The Envoy listener that routes the stack's way.
    pub fn envoy_addr(&self) -> SocketAddr {
        let routing = self.options.routing;
        self.listener(routing)
            .or_else(|| self.listener(Routing::RoundRobin))
            .unwrap_or(self.envoy.admin)
    }

    /// The Envoy listener routing `routing`'s way (`None` for kvroute in round-robin mode).
    /// A kvroute stack has both: kvroute, and plain round robin over the same sims.
    pub fn listener(&self, routing: Routing) -> Option<SocketAddr> {
        match routing {
            Routing::Kvroute => self.envoy.listener(KVROUTE_LISTENER),
            Routing::RoundRobin => self
                .envoy
                .listener(ROUND_ROBIN_LISTENER)
                // `round_robin_config`'s own listener name, in round-robin mode.
                .or_else(|| self.envoy.listener("ingress")),
        }
    }

    /// `http://<listener>` for `routing`.
    pub fn url(&self, routing: Routing) -> Option<String> {
        self.listener(routing).map(|addr| format!("http://{addr}"))
    }

    /// The Envoy process (admin stats).
    pub fn envoy(&self) -> &Envoy {
        &self.envoy
    }

    /// Envoy's admin base URL.
    pub fn envoy_admin_url(&self) -> String {
        format!("http://{}", self.envoy.admin)
    }

    /// The sims, in replica order (`sim-0`, `sim-1`, ...).
    pub fn sims(&self) -> &[SimProcess] {
        &self.sims
    }

    /// Base URLs of the replicas' HTTP APIs (sims or external engines), in replica order.
    pub fn sim_urls(&self) -> Vec<String> {
        self.sims
            .iter()
            .map(SimProcess::base_url)
            .chain(self.external.iter().map(|e| format!("http://{}", e.http)))
            .collect()
    }

    /// The replica ids used in the index and ext-proc configs, in replica order.
    pub fn replica_ids(&self) -> Vec<String> {
        (0..self.sims.len() + self.external.len())
            .map(replica_id)
            .collect()
    }

    /// The ids the index and ext-proc know replica `id` by: itself, or each of its
    /// data-parallel ranks ([`StackOptions::data_parallel_size`]).
    pub fn target_ids(&self, id: &str) -> Vec<String> {
        rank_ids(id, self.options.data_parallel_size)
    }

    /// Base URLs of the external engines (empty for sims).
    fn external_urls(&self) -> Vec<String> {
        self.external
            .iter()
            .map(|e| format!("http://{}", e.http))
            .collect()
    }

    /// kvroute-index's admin base URL (the embedded index's with [`IndexPlacement::Embedded`]).
    pub fn index_admin_url(&self) -> Result<String, StackError> {
        self.index_admin_urls()
            .into_iter()
            .next()
            .ok_or(StackError::NotRunning {
                what: "kvroute-index",
            })
    }

    /// The (first) kvroute-index's gRPC base URL, `http://ip:port`.
    pub fn index_grpc_url(&self) -> Result<String, StackError> {
        let index = self.index.as_ref().ok_or(StackError::NotRunning {
            what: "kvroute-index",
        })?;
        Ok(format!("http://{}", index.grpc))
    }

    /// Admin base URLs of every kvroute-index instance (the first is [`Stack::index_admin_url`]);
    /// with [`IndexPlacement::Embedded`], the one inside ext-proc.
    pub fn index_admin_urls(&self) -> Vec<String> {
        self.indexes()
            .map(|index| index.admin)
            .chain(
                self.ext_proc
                    .as_ref()
                    .and_then(Service::embedded_index_admin),
            )
            .map(|admin| format!("http://{admin}"))
            .collect()
    }

    /// The index processes ([`IndexPlacement::Service`]; none when embedded).
    fn indexes(&self) -> impl Iterator<Item = &Service> {
        self.index.iter().chain(&self.more_indexes)
    }

    /// Refuses an operation on the index process when the index is embedded in ext-proc.
    fn index_is_a_process(&self, operation: &'static str) -> Result<(), StackError> {
        match self.options.index_placement {
            IndexPlacement::Service => Ok(()),
            IndexPlacement::Embedded => Err(StackError::IndexEmbedded { operation }),
        }
    }

    /// Kills kvroute-index instance `instance` (0 = the first; SIGKILL).
    pub fn kill_index_instance(&mut self, instance: usize) -> Result<(), StackError> {
        self.index_is_a_process("kill_index_instance")?;
        let index = match instance {
            0 => self.index.as_mut(),
            n => self.more_indexes.get_mut(n - 1),
        };
        index
            .ok_or(StackError::NotRunning {
                what: "kvroute-index",
            })?
            .kill();
        Ok(())
    }

    /// The config file kvroute-ext-proc reads (rewrite it to reload; `reload_interval` is its
    /// default, 2 s, unless the test's extra config sets it).
    pub fn ext_proc_config_path(&self) -> Result<PathBuf, StackError> {
        let ext_proc = self.ext_proc.as_ref().ok_or(StackError::NotRunning {
            what: "kvroute-ext-proc",
        })?;
        Ok(ext_proc.config_path())
    }

    /// Switches ext-proc's pool to `mode` (`route` or `shadow`) by rewriting its config file, and
    /// waits until its `/v1/shadow` reports the new mode. The stack must have started with a
    /// `mode:` key in [`StackOptions::pool_extra_config`] and a short `reload_interval` in
    /// [`StackOptions::ext_proc_extra_config`].
    pub async fn set_pool_mode(&self, mode: &str) -> Result<(), StackError> {
        let path = self.ext_proc_config_path()?;
        let io = |source| HarnessError::Io {
            path: path.clone(),
            source,
        };
        let config = std::fs::read_to_string(&path).map_err(io)?;
        let rewritten = config
            .replace("mode: shadow", &format!("mode: {mode}"))
            .replace("mode: route", &format!("mode: {mode}"));
        std::fs::write(&path, rewritten).map_err(io)?;
        let url = format!("{}/v1/shadow", self.ext_proc_admin_url()?);
        try_poll_until(
            "kvroute-ext-proc to reload its pool's mode",
            deadline(Duration::from_secs(30)),
            || async {
                let summary: serde_json::Value = http::get(&url).await.ok()?.json().ok()?;
                (summary["pools"][0]["mode"] == mode).then_some(())
            },
        )
        .await
        .map_err(|e| StackError::Component {
            component: "kvroute-ext-proc",
            detail: e.to_string(),
            log: self.logs(),
        })
    }

    /// The kvroute-agent's admin base URL ([`StackOptions::agent_replicas`]).
    pub fn agent_admin_url(&self) -> Result<String, StackError> {
        let agent = self.agent.as_ref().ok_or(StackError::NotRunning {
            what: "kvroute-agent",
        })?;
        Ok(format!("http://{}", agent.admin))
    }

    /// kvroute-ext-proc's admin base URL.
    pub fn ext_proc_admin_url(&self) -> Result<String, StackError> {
        let ext_proc = self.ext_proc.as_ref().ok_or(StackError::NotRunning {
            what: "kvroute-ext-proc",
        })?;
        Ok(format!("http://{}", ext_proc.admin))
    }

    /// Waits until kvroute-ext-proc sees every replica idle (nothing in flight, the engines'
    /// running and waiting counts zero as last scraped); at once when ext-proc is not running.
    /// Requests meant to be decided alone wait for this, so that a scrape taken during the
    /// previous one cannot send them away on load.
    pub async fn until_replicas_idle(&self) -> Result<(), StackError> {
        match &self.ext_proc {
            Some(ext_proc) if ext_proc.guard.is_some() => Ok(until_ext_proc_sees_replicas_idle(
                &self.ext_proc_admin_url()?,
                startup_timeout(),
            )
            .await?),
            _ => Ok(()),
        }
    }

    /// Kills kvroute-index (SIGKILL).
    pub fn kill_index(&mut self) -> Result<(), StackError> {
        self.index_is_a_process("kill_index")?;
        self.index
            .as_mut()
            .ok_or(StackError::NotRunning {
                what: "kvroute-index",
            })?
            .kill();
        Ok(())
    }

    /// Starts kvroute-index again on its ports (killing it first if it runs). It resyncs from the
    /// sims' live events and replay buffers; this does not wait for that.
    pub async fn restart_index(&mut self) -> Result<(), StackError> {
        self.index_is_a_process("restart_index")?;
        let index = self.index.as_mut().ok_or(StackError::NotRunning {
            what: "kvroute-index",
        })?;
        index.kill();
        index.spawn().await
    }

    /// Kills kvroute-ext-proc (SIGKILL); Envoy fails open.
    pub fn kill_ext_proc(&mut self) -> Result<(), StackError> {
        self.ext_proc
            .as_mut()
            .ok_or(StackError::NotRunning {
                what: "kvroute-ext-proc",
            })?
            .kill();
        Ok(())
    }

    /// Starts kvroute-ext-proc again on its ports and waits until Envoy's health check sees it.
    /// An embedded index restarts with it, on its own ports too; this does not wait for it to
    /// resync (its replicas' catch-up replay and live events).
    pub async fn restart_ext_proc(&mut self) -> Result<(), StackError> {
        let ext_proc = self.ext_proc.as_mut().ok_or(StackError::NotRunning {
            what: "kvroute-ext-proc",
        })?;
        ext_proc.kill();
        ext_proc.spawn().await?;
        self.wait_ext_proc_healthy_in_envoy().await
    }

    /// Kills sim `replica` (SIGKILL), as an engine crash: its requests in flight are cut and its
    /// KV cache is gone. [`Stack::restart_sim`] brings it back.
    pub fn kill_sim(&mut self, replica: usize) -> Result<(), StackError> {
        self.sims
            .get_mut(replica)
            .ok_or_else(|| StackError::NoSuchReplica {
                operation: "kill_sim",
                detail: format!("no sim {replica}"),
            })?
            .kill();
        Ok(())
    }

    /// Starts sim `replica` again on the ports it had (killed first if it runs): an empty cache
    /// and event sequence numbers from 0, as a restarted vLLM. Returns once it serves `/health`;
    /// the index's resync is not awaited.
    pub async fn restart_sim(&mut self, replica: usize) -> Result<(), StackError> {
        let missing = |detail: String| StackError::NoSuchReplica {
            operation: "restart_sim",
            detail,
        };
        let sim = self
            .sims
            .get_mut(replica)
            .ok_or_else(|| missing(format!("no sim {replica}")))?;
        let ports =
            SimPorts::of(sim).ok_or_else(|| missing(format!("sim {replica} bound no events")))?;
        sim.kill();
        let args = sim_args(&self.options, replica, Some(ports))?;
        let fresh = SimProcess::spawn(&self.sim_binary.display().to_string(), &args).await?;
        let old = std::mem::replace(sim, fresh);
        self.retired_sims.push(old);
        Ok(())
    }

    /// Kills the kvroute-agent (SIGKILL); its replicas go stale in the index after the grace.
    pub fn kill_agent(&mut self) -> Result<(), StackError> {
        self.agent
            .as_mut()
            .ok_or(StackError::NotRunning {
                what: "kvroute-agent",
            })?
            .kill();
        Ok(())
    }

    /// Starts the kvroute-agent again (killed first if it runs); it catches up from its
    /// engines' replay buffers and streams a snapshot. Returns once its admin answers.
    pub async fn restart_agent(&mut self) -> Result<(), StackError> {
        let agent = self.agent.as_mut().ok_or(StackError::NotRunning {
            what: "kvroute-agent",
        })?;
        agent.kill();
        agent.spawn().await
    }

    fn event_proxy(
        &self,
        replica: usize,
        operation: &'static str,
    ) -> Result<&TcpProxy, StackError> {
        self.event_proxies
            .iter()
            .find_map(|(r, proxy)| (*r == replica).then_some(proxy))
            .ok_or_else(|| StackError::NoSuchReplica {
                operation,
                detail: format!("sim {replica} is not in cuttable_event_streams"),
            })
    }

    /// Cuts sim `replica`'s KV-event stream (every subscriber's connection dropped, and new
    /// ones refused) until [`Stack::resume_events`]; what it publishes meanwhile is lost on the
    /// live stream and only in its replay buffer.
    pub fn cut_events(&self, replica: usize) -> Result<(), StackError> {
        self.event_proxy(replica, "cut_events")?.pause();
        Ok(())
    }

    /// Lets subscribers reach sim `replica`'s KV-event stream again.
    pub fn resume_events(&self, replica: usize) -> Result<(), StackError> {
        self.event_proxy(replica, "resume_events")?.resume();
        Ok(())
    }

    /// The running processes by name (`kvroute-index`, `kvroute-ext-proc`, `kvroute-agent`,
    /// `sim-<i>`, `envoy`) and process id, for resource sampling.
    pub fn process_ids(&self) -> Vec<(String, u32)> {
        let services = self
            .indexes()
            .chain(&self.ext_proc)
            .chain(&self.more_ext_procs)
            .chain(&self.agent)
            .filter_map(|service| Some((service.name.to_owned(), service.guard.as_ref()?.id())));
        let sims = self
            .sims
            .iter()
            .enumerate()
            .map(|(i, sim)| (replica_id(i), sim.pid()));
        services
            .chain(sims)
            .chain(std::iter::once(("envoy".to_owned(), self.envoy.pid())))
            .collect()
    }

    /// Every process's log, with headers.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        let mut section = |name: &str, log: String| {
            text.push_str(&format!("----- {name} -----\n{log}\n"));
        };
        for sim in &self.retired_sims {
            section("kvroute-engine-sim (killed)", sim.log());
        }
        for (i, sim) in self.sims.iter().enumerate() {
            section(&format!("kvroute-engine-sim {}", replica_id(i)), sim.log());
        }
        for service in self
            .indexes()
            .chain(&self.ext_proc)
            .chain(&self.more_ext_procs)
            .chain(&self.agent)
        {
            section(service.name, service.log());
        }
        section("envoy", self.envoy.log());
        text
    }

    /// kvroute-ext-proc's log (stdout and stderr) so far.
    pub fn ext_proc_log(&self) -> Result<String, StackError> {
        self.ext_proc
            .as_ref()
            .map(Service::log)
            .ok_or(StackError::NotRunning {
                what: "kvroute-ext-proc",
            })
    }

    /// Prints [`Stack::logs`] to stderr (for a failing run that does not panic).
    pub fn print_logs(&self) {
        eprintln!("{}", self.logs());
    }

    /// Resets every sim's prefix cache (`POST /reset_prefix_cache`), retrying while a sim is
    /// still busy (vLLM refuses while requests run); in kvroute mode also waits until the index
    /// holds no block.
    pub async fn reset_prefix_caches(&self) -> Result<(), StackError> {
        for url in self.sim_urls() {
            let reset = format!("{url}/reset_prefix_cache");
            try_poll_until(&reset, startup_timeout(), || {
                let reset = reset.clone();
                async move {
                    let response = http::post_empty(&reset).await.ok()?;
                    (response.json().ok()?["success"] == true).then_some(())
                }
            })
            .await
            .map_err(HarnessError::from)?;
        }
        let running = self
            .indexes()
            .filter(|index| index.guard.is_some())
            .map(|index| index.admin);
        let embedded = self
            .ext_proc
            .as_ref()
            .filter(|ext_proc| ext_proc.guard.is_some())
            .and_then(Service::embedded_index_admin);
        let external = self.external_urls();
        let ranks = self.options.data_parallel_size;
        for admin in running
            .chain(embedded)
            .map(|admin| format!("http://{admin}"))
        {
            let url = format!("{admin}/v1/replicas");
            try_poll_until(
                "the index to drop every block",
                event_sync_timeout(),
                || {
                    let url = url.clone();
                    let external = external.clone();
                    async move {
                        // vLLM publishes a reset with its next engine step.
                        for engine in &external {
                            nudge_engine(engine, ranks).await;
                        }
                        let replicas = http::get(&url).await.ok()?.json().ok()?;
                        let replicas = replicas.as_array()?;
                        replicas
                            .iter()
                            .all(|r| r["blocks"].as_u64() == Some(0))
                            .then_some(())
                    }
                },
            )
            .await
            .map_err(HarnessError::from)?;
        }
        Ok(())
    }

    /// Waits until the index received events from every sim: each idle sim is asked to reset its
    /// (empty) prefix cache, which publishes one batch, until the index reports it `ready`. This
    /// also waits out ZeroMQ's subscription handshake, where early events would be lost.
    async fn wait_index_synced(&self) -> Result<(), StackError> {
        for admin in self.index_admin_urls() {
            self.wait_one_index_synced(&admin).await?;
        }
        Ok(())
    }

    async fn wait_one_index_synced(&self, admin: &str) -> Result<(), StackError> {
        let url = format!("{admin}/v1/replicas");
        // Replicas whose feed is broken by design are not waited for.
        let (ids, sims): (Vec<String>, Vec<String>) = self
            .replica_ids()
            .into_iter()
            .zip(self.sim_urls())
            .enumerate()
            .filter(|(i, _)| {
                self.options
                    .events_faults
                    .get(*i)
                    .copied()
                    .flatten()
                    .is_none()
            })
            .map(|(_, pair)| pair)
            .unzip();
        let external = self.external_urls();
        let ranks = self.options.data_parallel_size;
        let synced = try_poll_until(
            "the index to hear from every sim",
            event_sync_timeout(),
            || {
                let url = url.clone();
                let ids = ids.clone();
                let sims = sims.clone();
                let external = external.clone();
                async move {
                    let replicas = http::get(&url).await.ok()?.json().ok()?;
                    let ready = |id: &str| {
                        rank_ids(id, ranks).iter().all(|id| {
                            replicas.as_array().is_some_and(|all| {
                                all.iter().any(|r| r["id"] == *id && r["state"] == "ready")
                            })
                        })
                    };
                    let mut all_ready = true;
                    for (id, sim) in ids.iter().zip(&sims) {
                        if !ready(id) {
                            all_ready = false;
                            let _ = http::post_empty(&format!("{sim}/reset_prefix_cache")).await;
                            if external.contains(sim) {
                                nudge_engine(sim, ranks).await;
                            }
                        }
                    }
                    all_ready.then_some(())
                }
            },
        )
        .await;
        synced.map_err(|error| self.component_error("kvroute-index", error.into()))
    }

    /// Waits until Envoy's health check marks the ext-proc endpoint healthy.
    async fn wait_ext_proc_healthy_in_envoy(&self) -> Result<(), StackError> {
        for ext_proc in self.ext_proc.iter().chain(&self.more_ext_procs) {
            let result = self
                .envoy
                .wait_endpoint_healthy(EXT_PROC_CLUSTER, ext_proc.grpc, startup_timeout())
                .await;
            result.map_err(|error| self.component_error("kvroute-ext-proc", error))?;
        }
        Ok(())
    }

    /// Every ext-proc's admin base URL, the first one's first.
    pub fn ext_proc_admin_urls(&self) -> Vec<String> {
        self.ext_proc
            .iter()
            .chain(&self.more_ext_procs)
            .map(|service| format!("http://{}", service.admin))
            .collect()
    }

    fn component_error(&self, component: &'static str, error: HarnessError) -> StackError {
        StackError::Component {
            component,
            detail: error.to_string(),
            log: self.logs(),
        }
    }
}
