//! The `kvroute.index.v1.KvIndex` gRPC service, and the match logic the admin API shares.

use std::{sync::Arc, time::Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::{Shared, agent_stream::AgentFeed};
use crate::{
    api::{self, kv_index_server::KvIndexServer},
    index::{FlagReason, KvIndex, ReplicaId},
    ingest::ReplicaIngestSnapshot,
};

/// Largest prompt a match accepts, in blocks (1M tokens at block size 16 is 65,536 blocks).
pub const MAX_MATCH_KEYS: usize = 1 << 17;

/// Why a match query was refused; mapped to gRPC / HTTP status in one place each.
#[derive(Debug, thiserror::Error)]
pub enum MatchError {
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    #[error("block size {asked} does not match the pool's {pool}")]
    BlockSize { asked: u32, pool: u32 },
    #[error("too many keys: {0} (limit {MAX_MATCH_KEYS})")]
    TooManyKeys(usize),
    #[error("cannot compute keys: {0}")]
    Keys(String),
    #[error("index error: {0}")]
    Index(#[from] crate::index::IndexError),
}

impl MatchError {
    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            MatchError::UnknownModel(_) => "unknown_model",
            MatchError::BlockSize { .. } => "block_size_mismatch",
            MatchError::TooManyKeys(_) => "too_many_keys",
            MatchError::Keys(_) => "bad_tokens",
            MatchError::Index(_) => "index_error",
        }
    }
}

impl From<MatchError> for Status {
    fn from(error: MatchError) -> Self {
        match error {
            MatchError::UnknownModel(_) => Status::not_found(error.to_string()),
            MatchError::Index(_) => Status::internal(error.to_string()),
            _ => Status::invalid_argument(error.to_string()),
        }
    }
}

/// Leading blocks held per replica, for the gRPC and HTTP APIs alike.
pub(crate) fn match_keys(
    shared: &Shared,
    api_name: &'static str,
    model: &str,
    block_size: Option<u32>,
    keys: &[u64],
    candidates: &[String],
) -> Result<api::MatchResponse, MatchError> {
    let result = match_keys_inner(shared, model, block_size, keys, candidates);
    if let Err(error) = &result {
        shared.metrics.match_error(api_name, error.as_label());
    }
    result
}

fn match_keys_inner(
    shared: &Shared,
    model: &str,
    block_size: Option<u32>,
    keys: &[u64],
    candidates: &[String],
) -> Result<api::MatchResponse, MatchError> {
    let pool = shared
        .directory
        .pool(model)
        .ok_or_else(|| MatchError::UnknownModel(model.to_owned()))?;
    if let Some(asked) = block_size.filter(|&size| size != pool.block_size) {
        return Err(MatchError::BlockSize {
            asked,
            pool: pool.block_size,
        });
    }
    if keys.len() > MAX_MATCH_KEYS {
        return Err(MatchError::TooManyKeys(keys.len()));
    }
    // Unknown candidate ids are left out: the caller's replica list may be newer than ours.
    let candidate_ids: Vec<ReplicaId> = candidates
        .iter()
        .filter_map(|name| shared.directory.replica_id(name))
        .collect();
    let candidates = (!candidates.is_empty()).then_some(candidate_ids.as_slice());

    let started = Instant::now();
    let matches = shared.index.find_matches(model, keys, candidates)?;
    shared
        .metrics
        .observe_match("index", started.elapsed().as_secs_f64());

    let replicas = matches
        .into_iter()
        .filter_map(|m| {
            let name = shared.directory.replica_name(m.replica)?;
            Some(api::ReplicaMatch {
                replica_id: name.to_string(),
                matched_blocks: m.matched_blocks,
                gpu_blocks: m.gpu_blocks,
                precise: m.precise,
            })
        })
        .collect();
    Ok(api::MatchResponse {
        block_size: pool.block_size,
        total_blocks: u32::try_from(keys.len()).unwrap_or(u32::MAX),
        replicas,
    })
}

/// Ingest and index state of every replica, joined for operators.
pub(crate) fn replica_states(shared: &Shared, model: Option<&str>) -> Vec<api::ReplicaState> {
    let ingest: Vec<ReplicaIngestSnapshot> = shared.ingest.snapshot();
    shared
        .index
        .replica_statuses(model)
        .into_iter()
        .map(|status| {
            let socket = ingest
                .iter()
                .find(|s| *s.replica.replica_id == *status.name);
            let agent = shared.agents.feed(status.replica);
            let (state, problem) = replica_state(status.flag, socket, agent);
            api::ReplicaState {
                replica_id: status.name,
                model: status.model,
                state: state.to_owned(),
                blocks: status.blocks as u64,
                last_sequence: socket.and_then(|s| s.last_seq).unwrap_or(0),
                problem,
            }
        })
        .collect()
}

/// A replica's state from its flag and its event sources (a ZMQ socket, an agent, or both).
fn replica_state(
    flag: Option<FlagReason>,
    socket: Option<&ReplicaIngestSnapshot>,
    agent: Option<AgentFeed>,
) -> (&'static str, String) {
    if let Some(flag) = flag {
        return ("flagged", flag.as_label().to_owned());
    }
    let socket_state = socket.map(socket_state);
    let agent_state = agent.map(agent_state);
    match (socket_state, agent_state) {
        (None, None) => ("stale", "no event source configured".to_owned()),
        (Some(one), None) | (None, Some(one)) => one,
        // Both configured: either source keeping the replica current is enough.
        (Some(socket), Some(agent)) => {
            let rank = |state: &str| match state {
                "ready" => 2,
                "syncing" => 1,
                _ => 0,
            };
            if rank(agent.0) > rank(socket.0) {
                agent
            } else {
                socket
            }
        }
    }
}

/// Agent-fed: ready once the connected agent's snapshot is complete.
fn agent_state(feed: AgentFeed) -> (&'static str, String) {
    match feed {
        AgentFeed {
            connected: false, ..
        } => ("stale", "agent not connected".to_owned()),
        AgentFeed {
            snapshot_done: false,
            ..
        } => ("syncing", "agent snapshot in progress".to_owned()),
        _ => ("ready", String::new()),
    }
}

/// ZMQ-fed: ready once connected and an event arrived.
fn socket_state(socket: &ReplicaIngestSnapshot) -> (&'static str, String) {
    if !socket.connected {
        let problem = socket
            .last_error
            .as_ref()
            .map_or_else(|| "not connected".to_owned(), |(_, e)| e.clone());
        ("stale", problem)
    } else if socket.last_seq.is_none() {
        ("syncing", "no events received yet".to_owned())
    } else {
        ("ready", String::new())
    }
}

/// The gRPC service.
#[derive(Debug, Clone)]
pub struct MatchService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl api::kv_index_server::KvIndex for MatchService {
    async fn r#match(
        &self,
        request: Request<api::MatchRequest>,
    ) -> Result<Response<api::MatchResponse>, Status> {
        let request = request.into_inner();
        let block_size = (request.block_size != 0).then_some(request.block_size);
        match_keys(
            &self.shared,
            "grpc",
            &request.model,
            block_size,
            &request.keys,
            &request.candidates,
        )
        .map(Response::new)
        .map_err(Status::from)
    }

    async fn replica_state(
        &self,
        request: Request<api::ReplicaStateRequest>,
    ) -> Result<Response<api::ReplicaStateResponse>, Status> {
        let request = request.into_inner();
        let model = (!request.model.is_empty()).then_some(request.model.as_str());
        Ok(Response::new(api::ReplicaStateResponse {
            replicas: replica_states(&self.shared, model),
        }))
    }
}

/// Serves gRPC (with `grpc.health.v1`) until `cancel`.
pub(crate) async fn serve(
    mut server: tonic::transport::Server,
    listener: TcpListener,
    shared: Arc<Shared>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    cancel: CancellationToken,
) {
    let agents = shared.agents.service();
    let auth = Arc::clone(&shared);
    // `query_auth`: Match and ReplicaState need the token; health and the agent stream do not.
    let service =
        KvIndexServer::with_interceptor(MatchService { shared }, move |request: Request<()>| {
            let presented = request
                .metadata()
                .get(super::auth::AUTHORIZATION)
                .map(|value| value.as_bytes());
            match auth.query_auth.check("grpc", presented) {
                Ok(()) => Ok(request),
                Err(refusal) => Err(Status::unauthenticated(format!(
                    "query_auth token required ({})",
                    refusal.as_label()
                ))),
            }
        });
    let result = server
        .add_service(health)
        .add_service(service)
        .add_service(agents)
        // `Server::tcp_nodelay` does not apply to an incoming stream we pass in: set it here.
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            cancel.cancelled_owned(),
        )
        .await;
    match result {
        Ok(()) => tracing::debug!(exit_reason = "shutdown", "grpc server stopped"),
        Err(error) => tracing::error!(%error, exit_reason = "error", "grpc server failed"),
    }
}
