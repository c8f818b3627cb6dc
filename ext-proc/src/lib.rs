//! kvroute-ext-proc: Envoy `ext_proc` v3 endpoint picker that routes OpenAI-style LLM requests to
//! the vLLM replica holding the KV cache of their prompt prefix, unless that replica is too busy.
//!
//! Lifecycle: [`ExtProc::builder`] validates and builds the runtime (tokenizers, index client),
//! [`ExtProcBuilder::bind`] binds the gRPC and admin listeners (so tests can use port 0 and read
//! [`ExtProc::grpc_addr`]), and [`ExtProc::serve`] runs until the shutdown future resolves:
//! gRPC health goes NOT_SERVING, the listener stops accepting, open streams drain (bounded by
//! `budgets.drain`), background tasks (metrics scraping, config reload) stop, and it returns.
//!
//! Public modules, for the binaries and embedders: [`cli`] (the `kvroute-ext-proc` command line
//! and process, run by `kvroute_runtime::main`), [`config`] (YAML → validated config),
//! [`request`] (body parsing), [`tokenizer`] (token ids + cache; the [`Tokenizer`] trait an
//! embedder can supply), [`picker`] (the tiered decision: tokens, keys and the index's answer,
//! then `kvroute_routing`'s score-and-commit step), [`metrics`] (what a [`Picker`] records),
//! [`index_client`] (kvroute-index with fail-over), [`server`] (the ext_proc stream protocol and
//! the routing headers it sets), [`check`] (what a decision computes for one body: the
//! `kvroute-check` command), [`error`]. Internal: `scrape` (engine load and drift from each
//! replica's `/metrics`), `drift` (predicted vs engine-reported cached tokens), `embedded`
//! (the in-process index of `index.embedded`), `discovery` (pools whose replicas come from
//! Kubernetes, `pools[].discovery`: each snapshot swaps the pool's replicas in, as a reload does).
//! The admin HTTP server is `kvroute_runtime::admin`'s.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let config = kvroute_ext_proc::config::Config::from_file("kvroute.yaml".as_ref())?;
//! let server = kvroute_ext_proc::ExtProc::builder(config).bind().await?;
//! server.serve(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod check;
pub mod cli;
pub mod config;
mod discovery;
mod drift;
mod embedded;
pub mod error;
pub mod index_client;
mod lru;
pub mod metrics;
pub mod peers;
pub mod picker;
pub mod prefill;
pub mod records;
/// Request parsing and the errors a client is told: kvroute-request, I/O-free beside the routing
/// core (the fuzz targets reach it without the server).
pub use kvroute_request as request;
mod scrape;
pub mod server;
pub mod shadow;
pub mod tokenizer;

/// Opts this process out of transparent huge pages (`prctl(PR_SET_THP_DISABLE)`), for the
/// binaries that host decisions (kvroute-ext-proc, the latency bench). mimalloc asks for huge
/// pages on its arenas, so a decision that allocated from fresh memory took the page fault that
/// zeroes a 2 MiB page — or first compacts memory for one, where the kernel's THP `defrag` is
/// `madvise` — and waited milliseconds, where ordinary 4 KiB faults cost it microseconds (the
/// long-prompt hit's tail latency with and without: docs/benchmarks-history-2026-12.md,
/// latency through Envoy with real tokenizers). Logs the outcome; a kernel that refuses leaves the process as
/// it was.
pub fn disable_transparent_huge_pages() {
    match rustix::thread::disable_transparent_huge_pages(true) {
        Ok(()) => tracing::info!("transparent huge pages disabled for this process"),
        Err(error) => tracing::warn!(
            %error,
            "cannot disable transparent huge pages; a decision may wait for a huge page's fault"
        ),
    }
}

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use embedded::IndexServer;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use kvroute_runtime::admin::{AdminListener, AdminServer, Readiness};
use kvroute_runtime::config_file::ConfigFileWatch;
use kvroute_runtime::listener::bind;
use prometheus_client::registry::Registry;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;
pub use error::RequestError;
pub use picker::{Decision, Picker, Runtime};
pub use server::ExtProcService;
pub use tokenizer::Tokenizer;

use metrics::{KindLabel, Metrics};

/// How long background tasks get to stop after cancellation.
const BACKGROUND_STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// gRPC health service names GIE gateways and charts probe besides the ext_proc service itself
/// (`inference-extension`: GIE's and llm-d's manifests; liveness/readiness: the EPP protocol).
const GIE_HEALTH_SERVICES: [&str; 4] = ["", "liveness", "readiness", "inference-extension"];

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration was rejected (exit code 64).
    #[error(transparent)]
    Config(#[from] kvroute_config::ConfigError),
    /// A listener could not be bound.
    #[error(transparent)]
    Bind(#[from] kvroute_runtime::listener::BindError),
    /// The gRPC server failed.
    #[error("gRPC server failed")]
    Grpc(#[source] tonic::transport::Error),
    /// The gRPC listener's TLS settings were refused (`listen.tls`).
    #[error("cannot set up TLS on the grpc listener")]
    Tls(#[source] tonic::transport::Error),
    /// `listen.secure_serving`: no self-signed certificate could be made.
    #[error("cannot make a self-signed certificate for secure serving")]
    SelfSigned(#[source] rcgen::Error),
    /// The embedded index (`index.embedded`) could not start.
    #[error("embedded kvroute-index failed to start")]
    EmbeddedIndex(#[source] embedded::ServeError),
    /// Kubernetes discovery (`pools[].discovery`) could not connect to the API server.
    #[error("kubernetes discovery failed to start")]
    Discovery(#[source] kvroute_discovery::StartError),
}

impl ServeError {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::Config(_) => "config",
            Self::Bind(_) => "bind",
            Self::Grpc(_) => "grpc",
            Self::Tls(_) | Self::SelfSigned(_) => "tls",
            Self::EmbeddedIndex(_) => "embedded_index",
            Self::Discovery(_) => "discovery",
        }
    }
}

/// Builds an [`ExtProc`].
#[derive(Debug)]
pub struct ExtProcBuilder {
    config: Config,
    config_path: Option<PathBuf>,
    overrides: config::Overrides,
    tokenizers: Vec<(usize, Arc<dyn Tokenizer>)>,
}

impl ExtProcBuilder {
    /// Watches `path` (mtime) and reloads the config when it changes.
    pub fn config_path(mut self, path: PathBuf) -> Self {
        self.config_path = Some(path);
        self
    }

    /// Command-line settings re-applied to the file on every reload.
    pub fn overrides(mut self, overrides: config::Overrides) -> Self {
        self.overrides = overrides;
        self
    }

    /// Uses `tokenizer` for pool `pool` instead of the configured source (tests, embedders).
    pub fn tokenizer(mut self, pool: usize, tokenizer: Arc<dyn Tokenizer>) -> Self {
        self.tokenizers.push((pool, tokenizer));
        self
    }

    /// Builds the runtime and binds both listeners.
    pub async fn bind(self) -> Result<ExtProc, ServeError> {
        let tasks = TaskTracker::new();
        let mut runtime = Runtime::build(self.config, None, &tasks)?;
        for (pool, tokenizer) in self.tokenizers {
            runtime = runtime.with_tokenizer(pool, tokenizer);
        }
        let (grpc, _) = bind("grpc", runtime.config.grpc_addr).await?;
        let admin = AdminListener::bind(runtime.config.admin_addr).await?;
        let health = match runtime.config.health_addr {
            Some(addr) => Some(bind("health", addr).await?.0),
            None => None,
        };
        let embedded_index = match &runtime.config.embedded_index {
            Some(embedded) => {
                // Without the feature `index` is uninhabited and what follows unreachable.
                #[cfg_attr(not(feature = "embedded-index"), allow(unused_variables))]
                let index = IndexServer::start(embedded.config.clone())
                    .await
                    .map_err(ServeError::EmbeddedIndex)?;
                tracing::info!(
                    config = %embedded.path.display(),
                    grpc = %index.grpc_addr(),
                    admin = %index.admin_addr(),
                    "embedded kvroute-index serving; Match is answered in process"
                );
                runtime = runtime.with_local_index(index.matcher());
                Some(index)
            }
            None => None,
        };
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let picker = Arc::new(Picker::new(runtime, metrics, tasks.clone()));
        let discovery =
            discovery::ReplicaDiscovery::new(Arc::clone(&picker), &mut registry, tasks.clone());
        discovery.reconcile().await.map_err(ServeError::Discovery)?;
        // Followed from bind on, so a change before `serve` runs is not lost.
        let reload_interval = picker.runtime().config.reload_interval;
        let config_file = self
            .config_path
            .map(|path| ConfigFileWatch::new(path, reload_interval));
        Ok(ExtProc {
            picker,
            grpc,
            admin,
            health,
            registry: Arc::new(registry),
            tasks,
            config_file,
            overrides: self.overrides,
            embedded_index,
            discovery,
        })
    }
}

/// A bound, not yet serving, ext_proc server.
#[derive(Debug)]
pub struct ExtProc {
    picker: Arc<Picker>,
    grpc: TcpListener,
    admin: AdminListener,
    /// `listen.health`: gRPC health only, plaintext (for probes).
    health: Option<TcpListener>,
    registry: Arc<Registry>,
    tasks: TaskTracker,
    /// The config file followed by reloads (`ExtProcBuilder::config_path`).
    config_file: Option<ConfigFileWatch>,
    overrides: config::Overrides,
    /// `index.embedded`: stopped after the gRPC server has drained.
    embedded_index: Option<IndexServer>,
    /// `pools[].discovery`: stopped with the background tasks.
    discovery: Arc<discovery::ReplicaDiscovery>,
}

impl ExtProc {
    /// Starts building a server for `config`.
    pub fn builder(config: Config) -> ExtProcBuilder {
        ExtProcBuilder {
            config,
            config_path: None,
            overrides: config::Overrides::default(),
            tokenizers: Vec::new(),
        }
    }

    /// The bound gRPC address.
    pub fn grpc_addr(&self) -> std::io::Result<SocketAddr> {
        self.grpc.local_addr()
    }

    /// The bound admin address.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.admin.local_addr())
    }

    /// The bound gRPC health address (`listen.health`).
    pub fn health_addr(&self) -> Option<std::io::Result<SocketAddr>> {
        self.health.as_ref().map(TcpListener::local_addr)
    }

    /// The embedded index's gRPC and admin addresses (`index.embedded`).
    pub fn embedded_index_addrs(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.embedded_index
            .as_ref()
            .map(|index| (index.grpc_addr(), index.admin_addr()))
    }

    /// The picker (decisions, load records).
    pub fn picker(&self) -> Arc<Picker> {
        Arc::clone(&self.picker)
    }

    /// Serves until `shutdown` resolves, then drains and returns.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
        let Self {
            picker,
            grpc,
            admin,
            health: health_listener,
            registry,
            tasks,
            config_file,
            overrides,
            embedded_index,
            discovery,
        } = self;
        let config = picker.runtime().config.clone();
        // Before any task starts, so a refused TLS setup leaves nothing running.
        let mut builder = tonic::transport::Server::builder().tcp_nodelay(true);
        if let Some(tls) = &config.grpc_tls {
            builder = builder
                .tls_config(tls.tonic_config())
                .map_err(ServeError::Tls)?;
            tracing::info!(
                client_cert_required = tls.requires_client_cert(),
                "ext_proc listener uses TLS"
            );
        } else if config.secure_serving {
            let identity = self_signed_identity().map_err(ServeError::SelfSigned)?;
            builder = builder
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .map_err(ServeError::Tls)?;
            tracing::info!("ext_proc listener uses TLS with a self-signed certificate");
        }
        let background = CancellationToken::new();
        let stop_accepting = CancellationToken::new();
        let ready = Arc::new(AtomicBool::new(true));

        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<ExternalProcessorServer<ExtProcService>>()
            .await;
        for name in GIE_HEALTH_SERVICES {
            health
                .set_service_status(name, tonic_health::ServingStatus::Serving)
                .await;
        }

        if let Some(listener) = health_listener {
            let health_stop = background.clone();
            let probes = health_service.clone();
            tasks.spawn(async move {
                let served = tonic::transport::Server::builder()
                    .add_service(probes)
                    .serve_with_incoming_shutdown(
                        tonic::transport::server::TcpIncoming::from(listener),
                        health_stop.cancelled_owned(),
                    )
                    .await;
                if let Err(error) = served {
                    tracing::error!(%error, "gRPC health server failed");
                }
            });
        }
        tasks.spawn(scrape_loop(Arc::clone(&picker), background.clone()));
        tasks.spawn(peers::share_loop(Arc::clone(&picker), background.clone()));
        if let Some(watch) = config_file {
            tasks.spawn(reload_loop(
                Arc::clone(&picker),
                Arc::clone(&discovery),
                watch,
                overrides,
                tasks.clone(),
                background.clone(),
            ));
        }
        let admin_server = AdminServer::new(registry)
            .routes(admin_routes(Arc::clone(&picker)))
            .readiness({
                let ready = Arc::clone(&ready);
                move || {
                    if ready.load(Ordering::Relaxed) {
                        Readiness::ready("ready\n")
                    } else {
                        Readiness::not_ready("draining\n")
                    }
                }
            });
        let admin_stop = background.clone();
        tasks.spawn(async move {
            if let Err(error) = admin_server
                .serve(admin, admin_stop.cancelled_owned())
                .await
            {
                tracing::error!(%error, "admin server failed");
            }
        });

        let service = ExtProcService::new(Arc::clone(&picker));
        let grpc_stop = stop_accepting.clone();
        let grpc_server = builder
            .add_service(health_service)
            .add_service(ExternalProcessorServer::new(service))
            .serve_with_incoming_shutdown(
                // `Server::tcp_nodelay` does not apply to an incoming stream we pass in: set it here,
                // or every reply waits ~40 ms for a delayed ACK (Nagle).
                tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)),
                grpc_stop.cancelled_owned(),
            );
        tracing::info!(grpc = ?config.grpc_addr, admin = ?config.admin_addr, "kvroute-ext-proc serving");

        tokio::pin!(grpc_server);
        let early = tokio::select! {
            result = &mut grpc_server => Some(result),
            () = shutdown => None,
        };
        let result = match early {
            Some(result) => result.map_err(ServeError::Grpc),
            None => {
                tracing::info!("shutdown: health NOT_SERVING, draining");
                ready.store(false, Ordering::Relaxed);
                health
                    .set_not_serving::<ExternalProcessorServer<ExtProcService>>()
                    .await;
                for name in GIE_HEALTH_SERVICES {
                    health
                        .set_service_status(name, tonic_health::ServingStatus::NotServing)
                        .await;
                }
                stop_accepting.cancel();
                let drain_timeout = picker.runtime().config.drain_timeout;
                match tokio::time::timeout(drain_timeout, &mut grpc_server).await {
                    Ok(result) => result.map_err(ServeError::Grpc),
                    Err(_) => {
                        tracing::warn!(?drain_timeout, "drain timed out; closing open streams");
                        Ok(())
                    }
                }
            }
        };
        background.cancel();
        discovery.stop();
        tasks.close();
        if tokio::time::timeout(BACKGROUND_STOP_TIMEOUT, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("background tasks did not stop in time");
        }
        if let Some(index) = embedded_index {
            index.shutdown().await;
        }
        tracing::info!("kvroute-ext-proc stopped");
        result
    }
}

async fn scrape_loop(picker: Arc<Picker>, cancel: CancellationToken) {
    loop {
        let runtime = picker.runtime();
        let interval = runtime.config.scrape.interval;
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = picker.scrape_all(&runtime.config) => {}
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = tokio::time::sleep(interval) => {}
        }
    }
    tracing::debug!(exit_reason = "cancelled", "metrics scraper stopped");
}

/// A fresh self-signed certificate for `listen.secure_serving` (what GIE's `--secure-serving`
/// does): encryption without identity, for gateways configured not to verify the EPP.
fn self_signed_identity() -> Result<tonic::transport::Identity, rcgen::Error> {
    let mut names = vec!["localhost".to_owned(), "kvroute-ext-proc".to_owned()];
    if let Ok(host) = std::env::var("HOSTNAME")
        && !host.is_empty()
    {
        names.push(host);
    }
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "kvroute-ext-proc (self-signed)");
    let cert = params.self_signed(&key)?;
    Ok(tonic::transport::Identity::from_pem(
        cert.pem(),
        key.serialize_pem(),
    ))
}

async fn reload_loop(
    picker: Arc<Picker>,
    discovery: Arc<discovery::ReplicaDiscovery>,
    mut watch: ConfigFileWatch,
    overrides: config::Overrides,
    tasks: TaskTracker,
    cancel: CancellationToken,
) {
    loop {
        // A reload may change the period.
        watch.set_interval(picker.runtime().config.reload_interval);
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = watch.changed() => {}
        }
        let path = watch.path();
        let count = |kind| {
            picker
                .metrics()
                .config_reloads
                .get_or_create(&KindLabel { kind })
                .inc();
        };
        let current = picker.runtime();
        let built = Config::from_file_with(path, &overrides)
            .map(|mut config| {
                // The file has no discovered replicas: keep the current ones.
                discovery.merge_into(&mut config);
                config
            })
            .and_then(|config| Runtime::build(config, Some(&current), &tasks));
        match built {
            Ok(runtime) if *runtime.config == *current.config => count("unchanged"),
            Ok(runtime) => {
                if runtime.config.grpc_addr != current.config.grpc_addr
                    || runtime.config.admin_addr != current.config.admin_addr
                    || runtime.config.health_addr != current.config.health_addr
                    || runtime.config.grpc_tls != current.config.grpc_tls
                    || runtime.config.secure_serving != current.config.secure_serving
                {
                    tracing::warn!(
                        "listen addresses or TLS changed in config; they apply after a restart"
                    );
                }
                picker.replace_runtime(runtime);
                // Sources whose section changed restart; snapshots newer than the merge apply.
                if let Err(error) = discovery.reconcile().await {
                    tracing::error!(error = %error, "discovery after reload failed to start; those pools keep no replicas");
                }
                count("applied");
                tracing::info!(path = %path.display(), "config reloaded");
            }
            Err(error) => {
                count("rejected");
                tracing::error!(error = %error, path = %path.display(), "config reload rejected; keeping the previous config");
            }
        }
    }
}

/// Most records one `/v1/decisions` answer lists (`?limit=`, default all kept up to this).
const MAX_RECORDS_LISTED: usize = 1000;

/// The API path `/v1/explain` assumes when its `?path=` names none.
const DEFAULT_EXPLAIN_PATH: &str = "/v1/chat/completions";

/// ext-proc's own admin routes: `/v1/decisions` (the most recent decision records, newest first;
/// `?limit=N`), `/v1/shadow` (every pool's shadow-mode summary) and `POST /v1/explain` (a request
/// body, for the API path in `?path=`, default chat completions: the record of deciding it now,
/// routing nothing; a refused body answers its OpenAI-style error and status).
fn admin_routes(picker: Arc<Picker>) -> axum::Router {
    #[derive(serde::Deserialize)]
    struct Listing {
        limit: Option<usize>,
    }
    #[derive(serde::Deserialize)]
    struct ExplainPath {
        path: Option<String>,
    }
    let records = Arc::clone(&picker);
    let explainer = Arc::clone(&picker);
    axum::Router::new()
        .route(
            "/v1/explain",
            axum::routing::post(
                move |axum::extract::Query(at): axum::extract::Query<ExplainPath>,
                      body: axum::body::Bytes| {
                    let picker = Arc::clone(&explainer);
                    async move {
                        use axum::response::IntoResponse as _;
                        let path = at.path.as_deref().unwrap_or(DEFAULT_EXPLAIN_PATH);
                        let explained =
                            match request::parse(&body, request::Endpoint::from_path(path)) {
                                Ok(parsed) => picker.explain(&parsed).await,
                                Err(error) => Err(error),
                            };
                        match explained {
                            Ok(record) => axum::Json(record).into_response(),
                            Err(error) => (
                                axum::http::StatusCode::from_u16(error.http_status())
                                    .unwrap_or(axum::http::StatusCode::BAD_REQUEST),
                                [(axum::http::header::CONTENT_TYPE, "application/json")],
                                error.to_openai_json(),
                            )
                                .into_response(),
                        }
                    }
                },
            ),
        )
        .route(
            "/v1/decisions",
            axum::routing::get(
                move |axum::extract::Query(listing): axum::extract::Query<Listing>| {
                    let picker = Arc::clone(&records);
                    async move {
                        let limit = listing
                            .limit
                            .unwrap_or(MAX_RECORDS_LISTED)
                            .min(MAX_RECORDS_LISTED);
                        let latest = picker.records().latest(limit);
                        let decisions: Vec<&records::DecisionRecord> =
                            latest.iter().map(|record| &**record).collect();
                        axum::Json(serde_json::json!({ "decisions": decisions }))
                    }
                },
            ),
        )
        .route(
            "/v1/shadow",
            axum::routing::get(move || {
                let picker = Arc::clone(&picker);
                async move {
                    let runtime = picker.runtime();
                    axum::Json(serde_json::json!({
                        "pools": picker.shadow().summaries(&runtime.config),
                    }))
                }
            }),
        )
}
