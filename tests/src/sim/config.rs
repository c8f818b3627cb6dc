//! Simulator configuration: command-line flags named like `vllm serve`'s, validated into [`SimConfig`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use kvroute_block_keys::HashAlgo;
use kvroute_engine_model::Linear;
use kvroute_index_core::wire::{Encoding, HashForm, Schema, SglangLayout};

const DEFAULT_MODEL_NAME: &str = "tiny";
const DEFAULT_HOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const DEFAULT_BLOCK_SIZE: usize = 32;
const DEFAULT_NUM_BLOCKS: usize = 128;
const DEFAULT_MAX_MODEL_LEN: usize = 2048;
const DEFAULT_MAX_NUM_SEQS: usize = 256;
const DEFAULT_MAX_TOKENS: usize = 16;
const DEFAULT_TTFT_OVERHEAD_MS: f64 = 5.0;
const DEFAULT_PREFILL_US_PER_TOKEN: f64 = 50.0;
const DEFAULT_DECODE_MS_PER_TOKEN: f64 = 10.0;
const DEFAULT_KV_EVENTS_BUFFER_STEPS: usize = 10_000;
const DEFAULT_KV_EVENTS_QUEUE: usize = 100_000;
const DEFAULT_KV_TRANSFER_US_PER_BLOCK: f64 = 20.0;
/// vLLM's `kv_lease_duration` default (seconds a prefill holds its blocks for the decode).
const DEFAULT_KV_LEASE_SECONDS: f64 = 30.0;

/// Command-line flags (`kvroute-engine-sim --help`).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kvroute-engine-sim",
    about = "A vLLM-compatible engine simulator (one replica)"
)]
pub struct SimArgs {
    /// Model folder with tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    pub model: PathBuf,
    /// Name served in the OpenAI API (`model` of requests).
    #[arg(long, default_value = DEFAULT_MODEL_NAME)]
    pub served_model_name: String,
    /// HTTP listen address (also used for `*` in ZMQ endpoints).
    #[arg(long, default_value_t = DEFAULT_HOST)]
    pub host: IpAddr,
    /// HTTP port; 0 picks a free one (see `--ready-file`).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Tokens per KV block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Usable KV blocks (vLLM's `--num-gpu-blocks-override` minus its null block).
    #[arg(long, default_value_t = DEFAULT_NUM_BLOCKS)]
    pub num_blocks: usize,
    /// Longest prompt plus output accepted.
    #[arg(long, default_value_t = DEFAULT_MAX_MODEL_LEN)]
    pub max_model_len: usize,
    /// Most requests running at once; more wait in FIFO order.
    #[arg(long, default_value_t = DEFAULT_MAX_NUM_SEQS)]
    pub max_num_seqs: usize,
    /// Tokens computed per engine step (prefill chunks plus one per decoding request); longer
    /// prompts prefill in chunks. Default: `--max-model-len` (any accepted prompt in one step).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// `--prefix-caching-hash-algo`.
    #[arg(long, default_value = "sha256")]
    pub prefix_caching_hash_algo: String,
    /// vLLM's `PYTHONHASHSEED` (unset: vLLM 0.29+'s fixed default for sha256 algorithms).
    #[arg(long)]
    pub python_hash_seed: Option<String>,
    /// vLLM's `--kv-events-config` JSON (`enable_kv_cache_events`, `endpoint`, `replay_endpoint`,
    /// `topic`, `buffer_steps`, ...). Endpoint `*` means `--host`.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// Event encoding: `map` (vLLM 0.30–0.32, the default) or `array` (tagged arrays, 0.22–0.23).
    #[arg(long, default_value = "map")]
    pub kv_events_encoding: String,
    /// Publish full digests as bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    #[arg(long)]
    pub kv_events_bytes_hashes: bool,
    /// Data-parallel rank carried in every batch (an engine serving one rank behind its own API
    /// server, vLLM's external load balancing).
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,
    /// Data-parallel ranks behind this one API server (vLLM's internal load balancing): each
    /// rank its own engine (KV cache, scheduler, KV-event publisher on rank 0's ports offset by
    /// the rank), a request served on the rank its `x-data-parallel-rank` header names, else on
    /// the least loaded (vLLM's `DPLBAsyncMPClient` rule).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
    /// `max_tokens` when a request gives none.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS)]
    pub default_max_tokens: usize,
    /// Fixed cost of an engine step that prefills, milliseconds (part of every TTFT).
    #[arg(long, default_value_t = DEFAULT_TTFT_OVERHEAD_MS)]
    pub ttft_overhead_ms: f64,
    /// Prefill cost per uncached prompt token in a step, microseconds.
    #[arg(long, default_value_t = DEFAULT_PREFILL_US_PER_TOKEN)]
    pub prefill_us_per_token: f64,
    /// Duration of a decode-only step (one token for every running request), milliseconds.
    #[arg(long, default_value_t = DEFAULT_DECODE_MS_PER_TOKEN)]
    pub decode_ms_per_token: f64,
    /// vLLM's `--kv-transfer-config` JSON: `kv_connector` (`NixlConnector`, the only one
    /// simulated), `kv_role` (required with a connector), `engine_id` (default: random),
    /// `kv_load_failure_policy` (`fail`, the default, or `recompute`), and
    /// `kv_connector_extra_config.kv_lease_duration` (seconds a finished prefill holds its
    /// blocks for the decode, default 30). Without it, requests' `kv_transfer_params` are
    /// ignored, as vLLM ignores them without a connector.
    #[arg(long)]
    pub kv_transfer_config: Option<String>,
    /// KV transfer cost per block a decode reads from a prefill engine, microseconds.
    #[arg(long, default_value_t = DEFAULT_KV_TRANSFER_US_PER_BLOCK)]
    pub kv_transfer_us_per_block: f64,
    /// Multiplies every modelled duration (0 = instant; tests use small values).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// vLLM's `--chat-template`: a file, or the template itself (a value with `{`, `}` or a
    /// newline that is no file), rendering chat instead of the model folder's template.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Where to write `{"http": ..., "kv_events": ..., "replay": ...}` once bound.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// The engine simulated on the wire: `vllm`, or `sglang` (SGLang's metric names and labels,
    /// its `GET /server_info` and `POST /flush_cache`; `--kv-events-config` then needs
    /// `"publisher": "zmq"`, SGLang's switch, as `--enable-metrics` is assumed).
    #[arg(long, default_value = "vllm")]
    pub engine: String,
}

/// vLLM's `KVEventsConfig` fields the simulator honours.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default)]
struct RawKvEventsConfig {
    enable_kv_cache_events: bool,
    publisher: Option<String>,
    endpoint: String,
    replay_endpoint: Option<String>,
    buffer_steps: usize,
    hwm: usize,
    max_queue_size: usize,
    topic: String,
}

impl Default for RawKvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".to_owned(),
            replay_endpoint: None,
            buffer_steps: DEFAULT_KV_EVENTS_BUFFER_STEPS,
            hwm: 100_000,
            max_queue_size: DEFAULT_KV_EVENTS_QUEUE,
            topic: String::new(),
        }
    }
}

/// Validated simulator configuration.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Model folder.
    pub model_dir: PathBuf,
    /// Served model name.
    pub model_name: String,
    /// HTTP listen address.
    pub http_addr: SocketAddr,
    /// KV cache geometry and scheduling limits.
    pub cache: CacheGeometry,
    /// Hash algorithm and seed.
    pub hash_algo: HashAlgo,
    /// `PYTHONHASHSEED`.
    pub python_hash_seed: Option<String>,
    /// KV event publishing, when enabled.
    pub kv_events: Option<KvEventsConfig>,
    /// Step timing model.
    pub timing: Linear,
    /// `max_tokens` default.
    pub default_max_tokens: usize,
    /// `--chat-template`'s text, replacing the model folder's template.
    pub chat_template: Option<String>,
    /// Data-parallel ranks behind the API server (1: no data parallelism).
    pub data_parallel_size: u32,
    /// Prefill/decode disaggregation (`--kv-transfer-config`), when a connector is configured.
    pub kv_transfer: Option<KvTransferConfig>,
    /// Ready file.
    pub ready_file: Option<PathBuf>,
    /// The engine family simulated on the wire.
    pub engine: kvroute_config::Engine,
}

/// Blocks and admission limits.
#[derive(Debug, Clone, Copy)]
pub struct CacheGeometry {
    /// Tokens per block.
    pub block_size: usize,
    /// Usable blocks.
    pub num_blocks: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// Most running requests.
    pub max_num_seqs: usize,
    /// Tokens computed per step.
    pub max_num_batched_tokens: usize,
}

/// Where and how KV events are published.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// PUB endpoint (`*` already replaced by the host).
    pub endpoint: String,
    /// Bind the PUB socket (vLLM's rule, [`binds`]) rather than connect it.
    pub bind_pub: bool,
    /// ROUTER replay endpoint, always bound.
    pub replay_endpoint: Option<String>,
    /// Frame-0 topic.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches queued for the publisher before new ones are dropped (and counted).
    pub max_queue_size: usize,
    /// Payload encoding.
    pub encoding: EventEncoding,
    /// `data_parallel_rank` of every batch.
    pub dp_rank: u32,
}

/// The wire format of the simulated engine's KV events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventEncoding {
    /// A vLLM release's.
    Vllm(Encoding),
    /// An SGLang release's (`map`: 0.5.20 on, `array`: up to 0.5.19).
    Sglang(SglangLayout),
}

impl EventEncoding {
    /// Events are maps, so the replay replies carry a topic frame (vLLM 0.26+, SGLang 0.5.22+;
    /// the simulator's SGLang maps are 0.5.23's).
    pub fn uses_maps(self) -> bool {
        match self {
            EventEncoding::Vllm(encoding) => encoding.schema.uses_maps(),
            EventEncoding::Sglang(layout) => layout == SglangLayout::Maps,
        }
    }
}

/// vLLM's `KVTransferConfig` as the simulator honours it (`NixlConnector`).
#[derive(Debug, Clone)]
pub struct KvTransferConfig {
    /// `engine_id`: names this engine in the `kv_transfer_params` its prefills answer.
    pub engine_id: String,
    /// `kv_role` (NixlConnector serves both legs whatever it says; the proxy sets the roles).
    pub kv_role: String,
    /// `kv_load_failure_policy`.
    pub failure_policy: KvLoadFailurePolicy,
    /// `kv_connector_extra_config.kv_lease_duration`: how long a finished prefill holds its
    /// blocks for the decode to read (real time, not scaled).
    pub lease: Duration,
}

/// What a decode does when its KV cannot be loaded (vLLM's `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLoadFailurePolicy {
    /// The request ends with an error (vLLM's default).
    Fail,
    /// The request computes its prompt itself.
    Recompute,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct RawKvTransferConfig {
    kv_connector: Option<String>,
    kv_role: Option<String>,
    engine_id: Option<String>,
    kv_load_failure_policy: Option<String>,
    kv_connector_extra_config: serde_json::Map<String, serde_json::Value>,
}

/// The roles vLLM's `KVTransferConfig` accepts.
const KV_ROLES: [&str; 3] = ["kv_producer", "kv_consumer", "kv_both"];

/// Parses `--kv-transfer-config`; `None` when it names no connector (vLLM then serves every
/// request whole).
fn kv_transfer_config(json: &str) -> Result<Option<KvTransferConfig>, ConfigError> {
    let flag = "kv-transfer-config";
    let raw: RawKvTransferConfig =
        serde_json::from_str(json).map_err(|e| ConfigError::new(flag, json, e))?;
    let Some(connector) = raw.kv_connector else {
        return Ok(None);
    };
    if connector != "NixlConnector" {
        return Err(ConfigError::new(
            flag,
            json,
            format!("kv_connector {connector:?}: the simulator models NixlConnector only"),
        ));
    }
    // vLLM's rule: a connector needs a role.
    let kv_role = raw
        .kv_role
        .ok_or_else(|| ConfigError::new(flag, json, "kv_role is required with kv_connector"))?;
    if !KV_ROLES.contains(&kv_role.as_str()) {
        return Err(ConfigError::new(
            flag,
            json,
            format!("kv_role {kv_role:?}: expected one of {KV_ROLES:?}"),
        ));
    }
    let failure_policy = match raw.kv_load_failure_policy.as_deref() {
        None | Some("fail") => KvLoadFailurePolicy::Fail,
        Some("recompute") => KvLoadFailurePolicy::Recompute,
        Some(other) => {
            return Err(ConfigError::new(
                flag,
                json,
                format!("kv_load_failure_policy {other:?}: expected fail or recompute"),
            ));
        }
    };
    let lease_seconds = match raw.kv_connector_extra_config.get("kv_lease_duration") {
        None => DEFAULT_KV_LEASE_SECONDS,
        Some(value) => value
            .as_f64()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| {
                ConfigError::new(flag, json, "kv_lease_duration must be a number >= 0")
            })?,
    };
    let lease =
        Duration::try_from_secs_f64(lease_seconds).map_err(|e| ConfigError::new(flag, json, e))?;
    Ok(Some(KvTransferConfig {
        engine_id: raw.engine_id.unwrap_or_else(random_engine_id),
        kv_role,
        failure_policy,
        lease,
    }))
}

/// vLLM's default `engine_id` is a random UUID; a UUID-shaped random id.
fn random_engine_id() -> String {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut words = [0u64; 2];
    for (i, word) in words.iter_mut().enumerate() {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_usize(i);
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        *word = hasher.finish();
    }
    let hex = format!("{:016x}{:016x}", words[0], words[1]);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// A flag value that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid --{flag} {value:?}: {reason}")]
pub struct ConfigError {
    /// The flag.
    pub flag: &'static str,
    /// Its value.
    pub value: String,
    /// Why.
    pub reason: String,
}

impl ConfigError {
    fn new(flag: &'static str, value: impl ToString, reason: impl ToString) -> Self {
        Self {
            flag,
            value: value.to_string(),
            reason: reason.to_string(),
        }
    }

    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        "invalid_flag"
    }
}

impl TryFrom<SimArgs> for SimConfig {
    type Error = ConfigError;

    fn try_from(args: SimArgs) -> Result<Self, ConfigError> {
        let positive = |flag: &'static str, value: usize| {
            if value == 0 {
                Err(ConfigError::new(flag, value, "must be > 0"))
            } else {
                Ok(value)
            }
        };
        let cache = CacheGeometry {
            block_size: positive("block-size", args.block_size)?,
            num_blocks: positive("num-blocks", args.num_blocks)?,
            max_model_len: positive("max-model-len", args.max_model_len)?,
            max_num_seqs: positive("max-num-seqs", args.max_num_seqs)?,
            max_num_batched_tokens: positive(
                "max-num-batched-tokens",
                args.max_num_batched_tokens.unwrap_or(args.max_model_len),
            )?,
        };
        let hash_algo: HashAlgo = args.prefix_caching_hash_algo.parse().map_err(|e| {
            ConfigError::new(
                "prefix-caching-hash-algo",
                &args.prefix_caching_hash_algo,
                e,
            )
        })?;
        let duration = |flag: &'static str, value: f64, unit: f64| {
            let seconds = value * unit * args.time_scale;
            Duration::try_from_secs_f64(seconds).map_err(|e| ConfigError::new(flag, value, e))
        };
        if !(args.time_scale.is_finite() && args.time_scale >= 0.0) {
            return Err(ConfigError::new(
                "time-scale",
                args.time_scale,
                "must be >= 0",
            ));
        }
        let timing = Linear {
            prefill_overhead: duration("ttft-overhead-ms", args.ttft_overhead_ms, 1e-3)?,
            prefill_per_token: duration("prefill-us-per-token", args.prefill_us_per_token, 1e-6)?,
            decode: duration("decode-ms-per-token", args.decode_ms_per_token, 1e-3)?,
            kv_transfer_per_block: duration(
                "kv-transfer-us-per-block",
                args.kv_transfer_us_per_block,
                1e-6,
            )?,
        };
        let kv_transfer = args
            .kv_transfer_config
            .as_deref()
            .map(kv_transfer_config)
            .transpose()?
            .flatten();
        if kv_transfer.is_some() && args.data_parallel_size > 1 {
            return Err(ConfigError::new(
                "kv-transfer-config",
                args.kv_transfer_config.as_deref().unwrap_or_default(),
                "the simulator serves disaggregation on one data-parallel rank only",
            ));
        }
        let kv_events = args
            .kv_events_config
            .as_deref()
            .map(|json| kv_events_config(json, &args))
            .transpose()?
            .flatten();
        let chat_template = args
            .chat_template
            .as_deref()
            .map(chat_template)
            .transpose()?;
        kvroute_config::check_data_parallel_size(args.data_parallel_size).map_err(|reason| {
            ConfigError::new("data-parallel-size", args.data_parallel_size, reason)
        })?;
        if args.data_parallel_size > 1 && args.data_parallel_rank != 0 {
            return Err(ConfigError::new(
                "data-parallel-rank",
                args.data_parallel_rank,
                "one API server in front of several ranks serves them all from rank 0",
            ));
        }
        let engine = kvroute_config::Engine::from_annotation(&args.engine)
            .ok_or_else(|| ConfigError::new("engine", &args.engine, "expected vllm or sglang"))?;
        Ok(SimConfig {
            engine,
            model_dir: args.model,
            model_name: args.served_model_name,
            http_addr: SocketAddr::new(args.host, args.port),
            cache,
            hash_algo,
            python_hash_seed: args.python_hash_seed,
            kv_events,
            timing,
            default_max_tokens: args.default_max_tokens,
            chat_template,
            data_parallel_size: args.data_parallel_size,
            kv_transfer,
            ready_file: args.ready_file,
        })
    }
}

/// vLLM's `load_chat_template`: the file's text if `value` opens as a file, else `value` itself
/// when it looks like a template (has `{`, `}` or a newline). vLLM's built-in template names are
/// not served.
fn chat_template(value: &str) -> Result<String, ConfigError> {
    match std::fs::read_to_string(value) {
        Ok(text) => Ok(text),
        Err(_) if value.contains(['{', '}', '\n']) => Ok(value.to_owned()),
        Err(e) => Err(ConfigError::new("chat-template", value, e)),
    }
}

fn kv_events_config(json: &str, args: &SimArgs) -> Result<Option<KvEventsConfig>, ConfigError> {
    let raw: RawKvEventsConfig =
        serde_json::from_str(json).map_err(|e| ConfigError::new("kv-events-config", json, e))?;
    // vLLM publishes with `enable_kv_cache_events` (a null publisher turns it off); SGLang only
    // with `"publisher": "zmq"` (its default is null, and it has no enable flag).
    let enabled = match args.engine.as_str() {
        "sglang" => raw.publisher.as_deref() == Some("zmq"),
        _ => raw.enable_kv_cache_events && raw.publisher.as_deref() != Some("null"),
    };
    if !enabled {
        return Ok(None);
    }
    let _ = raw.hwm; // accepted for vLLM compatibility; the PUB socket has its own queue
    let host = args.host.to_string();
    let resolve = |endpoint: &str| endpoint.replacen('*', &host, 1);
    let schema = match args.kv_events_encoding.as_str() {
        "map" => Schema::S11,
        "array" => Schema::S7,
        other => {
            return Err(ConfigError::new(
                "kv-events-encoding",
                other,
                "expected map or array",
            ));
        }
    };
    let hashes = if args.kv_events_bytes_hashes {
        HashForm::Bytes
    } else {
        HashForm::Uint
    };
    Ok(Some(KvEventsConfig {
        endpoint: resolve(&raw.endpoint),
        bind_pub: binds(&raw.endpoint),
        replay_endpoint: raw.replay_endpoint.as_deref().map(resolve),
        topic: raw.topic,
        buffer_steps: raw.buffer_steps.max(1),
        max_queue_size: raw.max_queue_size.max(1),
        encoding: match args.engine.as_str() {
            "sglang" if schema.uses_maps() => EventEncoding::Sglang(SglangLayout::Maps),
            "sglang" => EventEncoding::Sglang(SglangLayout::Positional),
            _ => EventEncoding::Vllm(Encoding { schema, hashes }),
        },
        dp_rank: args.data_parallel_rank,
    }))
}

/// vLLM's rule (`ZmqEventPublisher._socket_setup`): bind on wildcards and local transports.
pub fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}
