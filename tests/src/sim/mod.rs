//! `kvroute-engine-sim`: one simulated vLLM replica, faithful on the wire.
//!
//! - OpenAI API, `/tokenize`, `/metrics`, `/health`, `/reset_prefix_cache` in vLLM's shapes
//!   (`api`), tokenizing with the shared [`kvroute_tokenize`] exactly as vLLM does.
//! - vLLM's block pool and step scheduler: the shared [`kvroute_engine_model`] (prefix caching,
//!   LRU eviction, continuous batching, chunked prefill), stepped in real time (`engine`), block
//!   keys hashed with vLLM's chain ([`kvroute_block_keys::VllmHasher`], same algorithm/seed
//!   options as the index).
//! - KV events encoded by [`kvroute_index_core::wire::encode_batch`] (vLLM 0.32 `type` maps, or the
//!   older tagged arrays) and published by [`kvroute_ingest::testing::MockVllmPublisher`]
//!   (PUB bind/connect by vLLM's rule, 3 frames, seq from 0, ROUTER replay).
//! - A step timing model ([`kvroute_engine_model::Linear`]) with a time-scale knob.
//! - `--chat-template` (vLLM's flag: a file or the template text) renders chat with another
//!   template than the model folder's, e.g. to serve a replica kvroute tokenizes differently.
//! - `--data-parallel-size N`: N engine ranks behind the one API server, as vLLM's internal
//!   load balancing serves them (each rank its own cache, scheduler and publisher on rank 0's
//!   ports offset by the rank; `x-data-parallel-rank` picks the rank, else the least loaded);
//!   each response names its rank in [`SERVED_DP_RANK_HEADER`] (the simulator's own header:
//!   vLLM does not say).
//! - `GET /debug/blocks`: the blocks it holds, as published u64 hashes, to compare with an index,
//!   and `published_batches` (event batches so far, read with the blocks under one lock).
//! - Prefill/decode disaggregation as vLLM 0.32's `NixlConnector` serves it, with
//!   `--kv-transfer-config`: a request with `kv_transfer_params.do_remote_decode` is a prefill
//!   leg whose blocks are held and whose answer carries the parameters a decode needs; one with
//!   `do_remote_prefill` is a decode leg that reads those blocks from the prefill simulator
//!   named by `remote_host`/`remote_port` over the simulator's own side channel
//!   (`POST /sim/nixl/read`, its stand-in for NIXL's handshake, read and notification) and
//!   loads them instead of computing its prompt. `GET /debug/requests` lists the generation
//!   requests received (headers and body as sent, what the engine computed, loaded and hit);
//!   `GET /debug/kv_transfer` the held blocks and the reads.
//!
//! Lifecycle: [`EngineSim::start`] binds everything (port 0 allowed) and returns the real
//! addresses; [`EngineSim::shutdown`] stops serving. The binary prints them as one JSON line and
//! writes them to `--ready-file` ([`ReadyInfo`]) for process harnesses.

mod api;
mod config;
mod engine;
mod media;
mod metrics;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute_block_keys::VllmHasher;
use kvroute_index_core::event::EventBatch;
use kvroute_index_core::wire;
use kvroute_ingest::testing::{MockPublisherConfig, MockVllmPublisher, PubMode, ReplayLayout};
use kvroute_tokenize::ModelTokenizer;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use api::{RECEIVED_TRACEPARENT_HEADER, SERVED_DP_RANK_HEADER};
pub use config::{
    CacheGeometry, ConfigError, EventEncoding, KvEventsConfig, KvLoadFailurePolicy,
    KvTransferConfig, SimArgs, SimConfig, binds,
};
pub use engine::{Engine, EngineError, EventSink, Sequence, SimHasher, SimKey};

/// Why the simulator could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Bad flags.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model folder cannot be loaded.
    #[error("cannot load the tokenizer")]
    Tokenizer(#[from] kvroute_tokenize::TokenizeError),
    /// Hash settings rejected.
    #[error("invalid hash settings")]
    Hash(#[from] kvroute_block_keys::KeyError),
    /// The HTTP listener could not bind.
    #[error("cannot bind {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The ZMQ sockets could not be opened.
    #[error("cannot open the KV event sockets")]
    Zmq(#[from] zeromq::ZmqError),
}

impl SimError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            SimError::Config(_) => "config",
            SimError::Tokenizer(_) => "tokenizer",
            SimError::Hash(_) => "hash",
            SimError::Bind { .. } => "bind",
            SimError::Zmq(_) => "zmq",
        }
    }
}

/// The bound addresses, as printed and written to `--ready-file`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadyInfo {
    /// HTTP address (`host:port`).
    pub http: SocketAddr,
    /// Bound PUB endpoint with its real port (`None` when events are off or the PUB connects);
    /// rank 0's with several data-parallel ranks.
    pub kv_events: Option<String>,
    /// Bound replay ROUTER endpoint (rank 0's).
    pub replay: Option<String>,
    /// Every data-parallel rank's endpoints, rank 0 first (empty without data parallelism).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankReady>,
}

/// One data-parallel rank's bound event endpoints.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankReady {
    /// Bound PUB endpoint.
    pub kv_events: Option<String>,
    /// Bound replay ROUTER endpoint.
    pub replay: Option<String>,
}

/// A running simulator.
#[derive(Debug)]
pub struct EngineSim {
    ready: ReadyInfo,
    cancel: CancellationToken,
    tasks: TaskTracker,
    dropped_batches: Arc<AtomicU64>,
}

impl EngineSim {
    /// Loads the model, opens the event sockets and the HTTP listener, and starts serving.
    pub async fn start(config: SimConfig) -> Result<Self, SimError> {
        let mut tokenizer = ModelTokenizer::from_dir(&config.model_dir)?;
        if let Some(template) = &config.chat_template {
            tokenizer = tokenizer.with_chat_template(template.clone())?;
        }
        let tokenizer = Arc::new(tokenizer);
        let hasher = match config.engine {
            kvroute_config::Engine::Vllm => SimHasher::Vllm(VllmHasher::new(
                config.hash_algo,
                config.python_hash_seed.as_deref(),
            )?),
            kvroute_config::Engine::Sglang => SimHasher::Sglang,
        };
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let dropped_batches = Arc::new(AtomicU64::new(0));

        let mut engines = Vec::with_capacity(config.data_parallel_size as usize);
        let mut ranks = Vec::with_capacity(config.data_parallel_size as usize);
        for rank in 0..config.data_parallel_size {
            let (sink, kv_events, replay) = match &config.kv_events {
                Some(events) => {
                    let (endpoint, replay_endpoint) = rank_endpoints(events, rank)?;
                    let publisher = MockVllmPublisher::start(MockPublisherConfig {
                        endpoint,
                        mode: if events.bind_pub {
                            PubMode::Bind
                        } else {
                            PubMode::Connect
                        },
                        replay_endpoint,
                        topic: events.topic.clone(),
                        buffer_steps: events.buffer_steps,
                        replay_layout: if events.encoding.uses_maps() {
                            ReplayLayout::Current
                        } else {
                            ReplayLayout::Legacy
                        },
                    })
                    .await?;
                    let kv = publisher.pub_endpoint().map(str::to_owned);
                    let replay = publisher.replay_endpoint().map(str::to_owned);
                    let (tx, rx) = mpsc::channel(events.max_queue_size);
                    tasks.spawn(publish_loop(publisher, rx, cancel.clone()));
                    let sink = event_sink(
                        tx,
                        events.encoding,
                        events.dp_rank + rank,
                        Arc::clone(&dropped_batches),
                    );
                    (Some(sink), kv, replay)
                }
                None => (None, None, None),
            };
            let engine = Arc::new(Engine::new(
                config.cache,
                config.timing,
                hasher.clone(),
                sink,
                config.kv_transfer.as_ref().map(|kv| kv.lease),
            ));
            tasks.spawn(Arc::clone(&engine).run(cancel.clone()));
            engines.push(engine);
            ranks.push(RankReady { kv_events, replay });
        }
        let (kv_events, replay) = ranks
            .first()
            .map(|rank| (rank.kv_events.clone(), rank.replay.clone()))
            .unwrap_or_default();
        if ranks.len() == 1 {
            ranks.clear();
        }
        let info = metrics::MetricsInfo {
            hash_algo: config.hash_algo.to_string(),
            created: unix_now(),
            engine: config.engine,
        };
        let listener = tokio::net::TcpListener::bind(config.http_addr)
            .await
            .map_err(|source| SimError::Bind {
                addr: config.http_addr,
                source,
            })?;
        let http = listener.local_addr().map_err(|source| SimError::Bind {
            addr: config.http_addr,
            source,
        })?;
        let state = api::AppState::new(
            engines,
            tokenizer,
            config.model_name.clone(),
            config.model_dir.display().to_string(),
            config.default_max_tokens,
            info,
        )?
        .with_kv_transfer(config.kv_transfer.clone(), http)
        .with_server_info(server_info(
            &config,
            kv_events.as_deref(),
            replay.as_deref(),
        ));
        let app = api::router(Arc::new(state));
        let shutdown = cancel.clone();
        tasks.spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(error) = served {
                tracing::error!(%error, "http server failed");
            }
        });
        tasks.close();
        Ok(Self {
            ready: ReadyInfo {
                http,
                kv_events,
                replay,
                ranks,
            },
            cancel,
            tasks,
            dropped_batches,
        })
    }

    /// The bound addresses.
    pub fn ready_info(&self) -> &ReadyInfo {
        &self.ready
    }

    /// Base URL of the HTTP API.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.ready.http)
    }

    /// Event batches dropped because the publisher fell `max_queue_size` behind.
    pub fn dropped_batches(&self) -> u64 {
        self.dropped_batches.load(Ordering::Relaxed)
    }

    /// Resolves when shutdown was requested.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }

    /// Stops accepting, lets in-flight responses finish and closes the sockets.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.wait().await;
    }
}

impl Drop for EngineSim {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Rank `rank`'s publisher and replay endpoints: rank 0's offset by the rank, as vLLM does.
fn rank_endpoints(
    events: &KvEventsConfig,
    rank: u32,
) -> Result<(String, Option<String>), ConfigError> {
    let offset = |flag: &'static str, endpoint: &str| {
        endpoint
            .parse::<kvroute_config::ZmqEndpoint>()
            .and_then(|e| e.for_data_parallel_rank(rank))
            .map(String::from)
            .map_err(|reason| ConfigError {
                flag,
                value: endpoint.to_owned(),
                reason: reason.to_owned(),
            })
    };
    if rank == 0 {
        return Ok((events.endpoint.clone(), events.replay_endpoint.clone()));
    }
    Ok((
        offset("kv-events-config", &events.endpoint)?,
        events
            .replay_endpoint
            .as_deref()
            .map(|replay| offset("kv-events-config", replay))
            .transpose()?,
    ))
}

/// Encodes each step's events at once (so `ts` is the step time) and queues them in order.
fn event_sink(
    tx: mpsc::Sender<Bytes>,
    encoding: EventEncoding,
    dp_rank: u32,
    dropped: Arc<AtomicU64>,
) -> EventSink {
    Box::new(move |events| {
        let batch = EventBatch {
            ts: unix_now(),
            dp_rank: Some(dp_rank),
            events,
        };
        let payload = Bytes::from(match encoding {
            EventEncoding::Vllm(encoding) => wire::encode_batch(&batch, encoding),
            EventEncoding::Sglang(layout) => wire::encode_sglang_batch(&batch, layout),
        });
        if tx.try_send(payload).is_err() {
            dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("kv event queue full or closed; batch dropped");
        }
    })
}

async fn publish_loop(
    publisher: MockVllmPublisher,
    mut batches: mpsc::Receiver<Bytes>,
    cancel: CancellationToken,
) {
    loop {
        let payload = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            payload = batches.recv() => match payload {
                Some(payload) => payload,
                None => break,
            },
        };
        if let Err(error) = publisher.publish(payload).await {
            tracing::warn!(%error, "kv event publish failed");
        }
    }
    publisher.shutdown().await;
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// SGLang's `GET /server_info` as far as routers read it: the served model, page size, data
/// parallelism and `kv_events`, the publisher's description (`describe_kv_events_publisher`:
/// rank `r` publishes on `endpoint_port_base + r`, replays on `replay_endpoint_port_base + r`;
/// null when it does not publish). `None` for a vLLM simulator (vLLM has no such endpoint).
fn server_info(
    config: &SimConfig,
    kv_events: Option<&str>,
    replay: Option<&str>,
) -> Option<serde_json::Value> {
    if config.engine != kvroute_config::Engine::Sglang {
        return None;
    }
    let host_and_port = |endpoint: &str| {
        let address = endpoint.strip_prefix("tcp://")?;
        let (host, port) = address.rsplit_once(':')?;
        Some((host.to_owned(), port.parse::<u16>().ok()?))
    };
    let descriptor = config.kv_events.as_ref().and_then(|events| {
        let (host, port) = host_and_port(kv_events?)?;
        let mut descriptor = serde_json::json!({
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": port,
            "topic": events.topic,
            "block_size": config.cache.block_size,
            "dp_size": config.data_parallel_size,
        });
        if let Some((_, replay_port)) = replay.and_then(host_and_port) {
            descriptor["replay_endpoint_port_base"] = replay_port.into();
        }
        Some(descriptor)
    });
    Some(serde_json::json!({
        "model_path": config.model_dir.display().to_string(),
        "served_model_name": config.model_name,
        "page_size": config.cache.block_size,
        "dp_size": config.data_parallel_size,
        "enable_metrics": true,
        "enable_cache_report": true,
        "kv_events": descriptor,
        "version": SIMULATED_SGLANG_VERSION,
    }))
}

/// The SGLang release whose wire format and endpoints the simulator follows.
pub const SIMULATED_SGLANG_VERSION: &str = "0.5.23";
