//! The `kvroute-index` service: wires config → index → ingest tasks → gRPC and admin servers.
//!
//! Lifecycle: [`IndexServer::start`] binds both listeners (port 0 allowed; the bound addresses
//! are reported), registers pools and replicas, starts one ingest task per replica socket and
//! serves. gRPC health (`grpc.health.v1`, service `""` and `kvroute.index.v1.KvIndex`) and
//! admin `/readyz` say SERVING only while every pool has enough ready replicas
//! (`readiness:`). A failing server resolves [`IndexServer::failed`] (the binary exits
//! non-zero). [`IndexServer::shutdown`] is phased: not ready, stop accepting and drain
//! in-flight queries, then stop ingest and agent streams. Nothing here blocks a query on ingest: the index is read
//! concurrently with writes.

mod admin;
mod agent_stream;
mod auth;
mod directory;
mod grpc;
mod metrics;
mod peers;
mod readiness;
mod replicas;

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use kvroute_runtime::admin::{AdminListener, AdminServer};
use kvroute_runtime::config_file::ConfigFileWatch;
use kvroute_runtime::listener::{BindError, bind};
use prometheus_client::registry::Registry;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::config::Config;
#[cfg(any(test, feature = "fuzzing"))]
pub use agent_stream::fuzzing;
pub use agent_stream::{MAX_QUEUED_REFUSALS, MAX_STREAMS_PER_AGENT};
pub use auth::AUTHORIZATION;
pub use directory::Directory;
pub use grpc::MatchError;
use kvroute_index_core::index::{BlockIndex, IndexConfig, IndexMetrics};
use kvroute_ingest::{Ingest, IngestMetrics};
use metrics::ServerMetrics;
pub use readiness::{PoolReadiness, ReadinessReport};

/// How long in-flight requests may take to finish after shutdown starts.
pub const SHUTDOWN_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors starting the service.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The gRPC listener's TLS settings were refused.
    #[error("cannot set up TLS on the grpc listener")]
    Tls(#[source] tonic::transport::Error),
    /// A pool's Kubernetes discovery could not start (no credentials, bad kubeconfig).
    #[error("cannot start replica discovery")]
    Discovery(#[source] kvroute_discovery::StartError),
    /// Config and index disagree (should have been caught by config validation).
    #[error("cannot register {what}")]
    Register {
        /// What failed to register.
        what: String,
        /// The cause.
        #[source]
        source: kvroute_index_core::index::IndexError,
    },
}

/// State shared by the gRPC and admin handlers.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) index: Arc<BlockIndex>,
    pub(crate) directory: Directory,
    pub(crate) ingest: Ingest,
    pub(crate) metrics: ServerMetrics,
    pub(crate) agents: Arc<agent_stream::AgentStreams>,
    /// Relays pickers' decisions to each other (`ShareDecisions`).
    pub(crate) peers: Arc<peers::PeerRelay>,
    /// `query_auth`: the token gRPC `Match`/`ReplicaState` and admin `/v1/*` require.
    pub(crate) query_auth: auth::QueryAuth,
    /// When a pool is ready (`readiness:`).
    pub(crate) readiness: crate::config::Readiness,
    /// Set when shutdown starts: not ready from then on.
    pub(crate) draining: AtomicBool,
    /// In-flight queries (Match, ReplicaState, `/v1/*`), drained before ingest stops.
    pub(crate) inflight: TaskTracker,
    /// The replicas as discovery and reloads change them.
    pub(crate) replicas: replicas::ReplicaSet,
}

/// `Match` without the transport: the gRPC handler's code called in process by a router that
/// embeds the index (kvroute-ext-proc's `index.embedded`), so a decision skips a network round
/// trip. Counted under `api="local"`.
#[derive(Debug, Clone)]
pub struct LocalMatcher {
    shared: Arc<Shared>,
}

impl LocalMatcher {
    /// Leading blocks held per replica, exactly as the gRPC `Match` answers.
    pub fn r#match(
        &self,
        request: &kvroute_index_api::api::MatchRequest,
    ) -> Result<kvroute_index_api::api::MatchResponse, MatchError> {
        let block_size = (request.block_size != 0).then_some(request.block_size);
        grpc::match_keys(
            &self.shared,
            "local",
            &request.model,
            block_size,
            &request.keys,
            &request.candidates,
        )
    }
}

/// A running index service.
#[derive(Debug)]
pub struct IndexServer {
    grpc_addr: SocketAddr,
    admin_addr: SocketAddr,
    /// Stops the listeners accepting (shutdown's first phase).
    accept: CancellationToken,
    /// Stops ingest, agent streams and the background tasks (the last phase).
    cancel: CancellationToken,
    /// Cancelled when a server (gRPC, admin) failed; the reason is in `failure`.
    failed: CancellationToken,
    failure: Arc<parking_lot::Mutex<Option<String>>>,
    tasks: TaskTracker,
    shared: Arc<Shared>,
    health: tonic_health::server::HealthReporter,
}

impl IndexServer {
    /// Binds the listeners, starts ingest and serves until [`shutdown`](Self::shutdown).
    pub async fn start(config: Config) -> Result<Self, ServeError> {
        let (grpc_listener, grpc_addr) = bind("grpc", config.grpc_addr).await?;
        let admin_listener = AdminListener::bind(config.admin_addr).await?;
        let mut grpc_server = tonic::transport::Server::builder().tcp_nodelay(true);
        if let Some(tls) = &config.tls {
            grpc_server = grpc_server
                .tls_config(tls.tonic_config())
                .map_err(ServeError::Tls)?;
            tracing::info!(
                client_cert_required = tls.requires_client_cert(),
                "grpc listener uses TLS"
            );
        }
        let admin_addr = admin_listener.local_addr();

        let mut registry = Registry::with_prefix("kvroute_index");
        let index_metrics = IndexMetrics::register(&mut registry);
        let ingest_metrics = IngestMetrics::register(&mut registry);
        let metrics = ServerMetrics::register(&mut registry);
        let query_auth = auth::QueryAuth::register(config.query_token.clone(), &mut registry);
        if query_auth.is_required() {
            tracing::info!("query API (Match, ReplicaState, /v1/*) requires the query_auth token");
        } else {
            // A caller's keys may then be anyone's, and runs trust that keys are chains.
            tracing::warn!(
                "query API open (no query_auth): Match answers there build no runs of prompt \
                 keys, so repeated prompts are matched key by key; set query_auth to speed them up"
            );
        }

        let index = Arc::new(BlockIndex::new(
            IndexConfig {
                max_blocks_per_replica: config.max_blocks_per_replica,
                ..IndexConfig::default()
            },
            index_metrics,
        ));
        let directory = Directory::register(&config, &index)?;
        let cancel = CancellationToken::new();
        let ingest = Ingest::new(
            Arc::new(directory.sink(Arc::clone(&index))),
            ingest_metrics,
            cancel.child_token(),
        );
        for replica in &config.replicas {
            if let Some(socket) = Directory::ingest_config(&config, replica) {
                ingest.spawn(socket);
            }
        }
        let replica_set = replicas::ReplicaSet::new(Arc::new(config.clone()), &mut registry);

        let agents = agent_stream::AgentStreams::new(
            &config,
            Arc::clone(&index),
            directory.clone(),
            &mut registry,
            cancel.child_token(),
        );
        let peers = peers::PeerRelay::new(&mut registry, cancel.child_token());
        let shared = Arc::new(Shared {
            index,
            directory,
            ingest,
            metrics,
            agents,
            peers,
            query_auth,
            readiness: config.readiness,
            draining: AtomicBool::new(false),
            inflight: TaskTracker::new(),
            replicas: replica_set,
        });
        if let Err(error) = replicas::ReplicaSet::start(&shared).await {
            cancel.cancel();
            shared.replicas.shutdown().await;
            return Err(ServeError::Discovery(error));
        }
        let (health, health_service) = tonic_health::server::health_reporter();
        // Not serving until the pools are ready (the reporter starts "" as SERVING).
        readiness::set_health(&health, false).await;

        let tasks = TaskTracker::new();
        let accept = CancellationToken::new();
        let failed = CancellationToken::new();
        let failure = Arc::new(parking_lot::Mutex::new(None));
        let on_failure = |what: &'static str| {
            let failed = failed.clone();
            let failure = Arc::clone(&failure);
            move |result: Result<(), String>| {
                if let Err(error) = result {
                    tracing::error!(server = what, %error, "server failed; the process stops");
                    failure
                        .lock()
                        .get_or_insert(format!("{what} server failed: {error}"));
                    failed.cancel();
                }
            }
        };
        let grpc_failed = on_failure("grpc");
        let grpc = grpc::serve(
            grpc_server,
            grpc_listener,
            Arc::clone(&shared),
            health_service,
            accept.clone(),
        );
        spawn_tracked(&tasks, async move { grpc_failed(grpc.await) });
        let admin_failed = on_failure("admin");
        let admin = AdminServer::new(Arc::new(registry))
            .readiness({
                let shared = Arc::clone(&shared);
                move || admin::readiness(&shared)
            })
            .routes(admin::routes(Arc::clone(&shared)))
            .serve(admin_listener, accept.clone().cancelled_owned());
        spawn_tracked(&tasks, async move {
            admin_failed(admin.await.map_err(|error| error.to_string()))
        });
        spawn_tracked(
            &tasks,
            readiness::follow(Arc::clone(&shared), health.clone(), cancel.clone()),
        );
        spawn_tracked(
            &tasks,
            agent_stream::sweep_stale(Arc::clone(&shared.agents), cancel.clone()),
        );
        tracing::info!(%grpc_addr, %admin_addr, replicas = config.replicas.len(), "kvroute-index serving");
        Ok(IndexServer {
            grpc_addr,
            admin_addr,
            accept,
            cancel,
            failed,
            failure,
            tasks,
            shared,
            health,
        })
    }

    /// Address the gRPC API listens on.
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    /// Address the admin HTTP server listens on.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Answers `Match` in this process, for a router embedding the index.
    pub fn matcher(&self) -> LocalMatcher {
        LocalMatcher {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Whether every pool has enough ready replicas, and why not (what `/readyz` answers).
    pub fn readiness(&self) -> ReadinessReport {
        readiness::report(&self.shared)
    }

    /// Follows the config file at `path`: when its modification time changes (checked every
    /// `interval`) it is read again and its static `replicas:` replace the running ones (pools,
    /// listeners, agents, limits and discovery sections apply after a restart: a change there is
    /// logged). A file that does not parse or validate is refused, logged and counted
    /// (`kvroute_index_config_reloads_total{outcome}`); the running replicas stay.
    pub fn watch_config(&self, path: std::path::PathBuf, interval: Duration) {
        let shared = Arc::clone(&self.shared);
        let cancel = self.cancel.clone();
        // Made here, not in the task, so a change before the task first runs is not lost.
        let watch = ConfigFileWatch::new(path, interval);
        spawn_tracked(&self.tasks, async move {
            replicas::follow_config_file(shared, watch, cancel).await;
        });
    }

    /// Resolves when the gRPC or admin server failed (with why): the process must stop and exit
    /// non-zero rather than run half-dead. Pending forever while both serve.
    pub async fn failed(&self) -> String {
        self.failed.cancelled().await;
        self.failure
            .lock()
            .clone()
            .unwrap_or_else(|| "a server failed".to_owned())
    }

    /// Phased: not ready (health NOT_SERVING, `/readyz` 503) → stop accepting and drain
    /// in-flight queries (bounded by [`SHUTDOWN_DRAIN_TIMEOUT`]) → stop ingest and agent
    /// streams (the index stays current while queries drain) → wait for every task.
    pub async fn shutdown(mut self) {
        self.shared
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        readiness::set_health(&self.health, false).await;
        self.accept.cancel();
        self.shared.inflight.close();
        let drained = tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, self.shared.inflight.wait())
            .await
            .is_ok();
        if !drained {
            tracing::warn!(
                timeout_ms = SHUTDOWN_DRAIN_TIMEOUT.as_millis() as u64,
                "in-flight queries did not drain in time"
            );
        }
        tracing::info!(
            drained,
            "listeners closed; stopping ingest and agent streams"
        );
        self.shared.replicas.shutdown().await;
        self.cancel.cancel();
        self.tasks.close();
        if tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                timeout_ms = SHUTDOWN_DRAIN_TIMEOUT.as_millis() as u64,
                "servers did not stop in time"
            );
        }
        match Arc::try_unwrap(self.shared) {
            Ok(shared) => shared.ingest.shutdown().await,
            Err(shared) => {
                // A handler still holds the state (drain timed out): ingest tasks stop with
                // the cancelled token anyway.
                self.shared = shared;
            }
        }
        tracing::info!(exit_reason = "shutdown", "kvroute-index stopped");
    }
}

/// The service's one spawn site: every task is tracked and watches the service's token.
fn spawn_tracked<F>(tasks: &TaskTracker, future: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tasks.spawn(future);
}
