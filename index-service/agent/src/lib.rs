//! kvroute-agent: mirrors the KV blocks of the engines beside it and streams them to one or
//! more kvroute-index instances.
//!
//! - **Engine side**: the existing ZMQ [`Ingest`](kvroute_ingest::Ingest) (sequence checks, replay of gaps, resets on
//!   engine restart) feeding a [`Hub`] instead of an index.
//! - **Mirror** ([`mirror`]): per replica, the held blocks with what is needed to re-emit them.
//! - **Index side** ([`client`]): per index address one gRPC `AgentStream`: `Hello` (agent id,
//!   token, replicas), a snapshot per replica on every (re)connect, then deltas flushed every
//!   `batch_delay` (or sooner past `max_batch_bytes`). Reconnects with capped backoff.
//!
//! - **Engines** ([`engines`]): `engines:` from the config plus, with `discovery:`, the Ready
//!   pods on the agent's node, learned from Kubernetes; the set follows the pods and, with
//!   [`Agent::start_reloading`], the config file, without a restart.
//!
//! Lifecycle: [`Agent::start`] (or [`Agent::start_reloading`]) → serving → [`Agent::shutdown`];
//! the binary runs it through `kvroute_runtime::main` ([`cli`]). Its admin server
//! (`kvroute_runtime::admin`) serves `/metrics`, `/healthz` and `/debug/replicas/{id}/blocks`.
//!
//! TLS to the indexes is optional (`tls:` in the config, `https://` index addresses).

#![deny(missing_docs)]

pub mod cli;
pub mod client;
pub mod config;
pub mod engines;
pub mod hub;
pub mod metrics;
pub mod mirror;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::{Router, extract::State, response::IntoResponse, routing::get};
use kvroute_runtime::admin::{AdminListener, AdminServer};
use prometheus_client::registry::Registry;
use tokio_util::{sync::CancellationToken, task::TaskTracker};

pub use config::AgentConfig;
pub use hub::{Hub, HubLimits};
pub use metrics::AgentMetrics;

use kvroute_ingest::IngestMetrics;

/// Why the agent cannot start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The admin listener cannot be bound.
    #[error(transparent)]
    Bind(#[from] kvroute_runtime::listener::BindError),
    /// `discovery.kubernetes` cannot reach the API server (no in-cluster credentials, a bad
    /// kubeconfig).
    #[error("cannot start engine discovery")]
    Discovery(#[from] kvroute_discovery::StartError),
}

impl AgentError {
    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            AgentError::Bind(_) => "bind",
            AgentError::Discovery(_) => "discovery",
        }
    }
}

/// A running agent.
pub struct Agent {
    admin_addr: SocketAddr,
    hub: Arc<Hub>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Starts ingest, the index streams, the delta flusher and the admin server.
    pub async fn start(config: AgentConfig) -> Result<Self, AgentError> {
        Self::start_with(config, None).await
    }

    /// [`Agent::start`], and reloads `path` (the file `config` was read from) when its mtime
    /// changes: `engines` and `discovery` apply at once, other changed keys are reported and
    /// kept ([`config::AgentConfig::reload_from_yaml`]).
    pub async fn start_reloading(config: AgentConfig, path: PathBuf) -> Result<Self, AgentError> {
        Self::start_with(config, Some(path)).await
    }

    async fn start_with(config: AgentConfig, path: Option<PathBuf>) -> Result<Self, AgentError> {
        let admin_listener = AdminListener::bind(config.admin_addr).await?;
        let admin_addr = admin_listener.local_addr();

        let mut registry = Registry::with_prefix("kvroute_agent");
        let metrics = AgentMetrics::register(&mut registry);
        let ingest_metrics = IngestMetrics::register(&mut registry);
        let discovery_metrics = kvroute_discovery::DiscoveryMetrics::register(&mut registry);
        // Mirrors come with the engines (the supervisor adds them).
        let hub = Arc::new(Hub::new(
            &[],
            HubLimits {
                max_blocks_per_replica: config.max_blocks_per_replica,
                max_batch_bytes: config.max_batch_bytes,
                subscriber_queue: config.subscriber_queue,
            },
            metrics.clone(),
        ));
        let admin = AdminServer::new(Arc::new(registry)).routes(admin_routes(Arc::clone(&hub)));
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        let engines = engines::Engines::new(
            Arc::clone(&hub),
            ingest_metrics,
            metrics.clone(),
            cancel.child_token(),
        );
        // The static engines are in the hub before the first Hello claims them.
        let supervisor = match engines::Supervisor::start(
            engines,
            config.clone(),
            path,
            discovery_metrics,
            tasks.clone(),
        )
        .await
        {
            Ok(supervisor) => supervisor,
            Err(error) => {
                cancel.cancel();
                tasks.close();
                tasks.wait().await;
                return Err(error.into());
            }
        };
        spawn_tracked(&tasks, supervisor.run(cancel.clone()));

        for index in &config.indexes {
            let settings = client::StreamSettings {
                index: index.clone(),
                agent_id: config.agent_id.clone(),
                token: config.token.clone(),
                backoff_min: config.reconnect_backoff_min,
                backoff_max: config.reconnect_backoff_max,
                tls: config.tls.clone(),
            };
            spawn_tracked(
                &tasks,
                client::run(settings, Arc::clone(&hub), metrics.clone(), cancel.clone()),
            );
        }
        spawn_tracked(
            &tasks,
            flush_loop(Arc::clone(&hub), config.batch_delay, cancel.clone()),
        );
        spawn_tracked(&tasks, serve_admin(admin, admin_listener, cancel.clone()));
        tracing::info!(agent_id = %config.agent_id, %admin_addr, engines = config.engines.len(),
            discovery = config.discovery.is_some(), indexes = config.indexes.len(),
            "kvroute-agent running");
        Ok(Agent {
            admin_addr,
            hub,
            cancel,
            tasks,
        })
    }

    /// Address of `/metrics` and `/healthz`.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The mirrors (tests, debugging).
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Stops the streams, the flusher, the admin server, discovery and ingest.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// The agent's one spawn site: every task is tracked and watches the agent's token.
fn spawn_tracked<F>(tasks: &TaskTracker, future: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    tasks.spawn(future);
}

async fn flush_loop(hub: Arc<Hub>, delay: std::time::Duration, cancel: CancellationToken) {
    let mut ticker = tokio::time::interval(delay);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            _ = ticker.tick() => hub.flush(),
        }
    }
}

/// The agent's own admin route, beside `/metrics` and `/healthz`: a replica's mirrored blocks.
fn admin_routes(hub: Arc<Hub>) -> Router {
    Router::new()
        .route("/debug/replicas/{replica}/blocks", get(blocks))
        .with_state(hub)
}

/// Serves until `cancel`. The agent goes on without its admin server (it only observes).
async fn serve_admin(admin: AdminServer, listener: AdminListener, cancel: CancellationToken) {
    if let Err(error) = admin.serve(listener, cancel.cancelled_owned()).await {
        tracing::error!(%error, "agent admin server failed");
    }
}

async fn blocks(
    State(hub): State<Arc<Hub>>,
    axum::extract::Path(replica): axum::extract::Path<String>,
) -> axum::response::Response {
    match hub.block_hashes(&replica) {
        Some(hashes) => {
            axum::Json(serde_json::json!({ "replica": replica, "blocks": hashes })).into_response()
        }
        None => (axum::http::StatusCode::NOT_FOUND, "unknown replica\n").into_response(),
    }
}
