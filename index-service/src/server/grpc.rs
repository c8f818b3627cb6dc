//! The `kvroute.index.v1.KvIndex` gRPC service, and the match logic the admin API shares.

use std::{sync::Arc, time::Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::Shared;
use kvroute_index_api::api::{self, kv_index_server::KvIndexServer};
use kvroute_index_core::index::{KvIndex, ReplicaId, ReplicaState};
use kvroute_ingest::ReplicaIngestSnapshot;

/// Largest prompt a match accepts, in blocks (1M tokens at block size 16 is 65,536 blocks).
pub const MAX_MATCH_KEYS: usize = 1 << 17;

/// Why a match query was refused; mapped to gRPC / HTTP status in one place each.
#[derive(Debug, thiserror::Error)]
pub enum MatchError {
    /// No pool serves this model.
    #[error("unknown model {0:?}")]
    UnknownModel(String),
    /// The query's keys were computed for another block size than the pool's engines use.
    #[error("block size {asked} does not match the pool's {pool}")]
    BlockSize {
        /// The query's block size.
        asked: u32,
        /// The pool's.
        pool: u32,
    },
    /// More keys than a match accepts (`MAX_MATCH_KEYS`).
    #[error("too many keys: {0} (limit {MAX_MATCH_KEYS})")]
    TooManyKeys(usize),
    /// The keys could not be computed from the request's tokens.
    #[error("cannot compute keys: {0}")]
    Keys(String),
    /// The index refused the query.
    #[error("index error: {0}")]
    Index(#[from] kvroute_index_core::index::IndexError),
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
    let _inflight = shared.inflight.token();
    let result = match_keys_inner(shared, api_name, model, block_size, keys, candidates);
    if let Err(error) = &result {
        shared.metrics.match_error(api_name, error.as_label());
    }
    result
}

fn match_keys_inner(
    shared: &Shared,
    api_name: &'static str,
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
    // Keys from the embedded caller (ext-proc's own) or a caller holding the query token are
    // kvroute's; anyone else's are answered without building runs from them.
    let matches = if api_name == "local" || shared.query_auth.is_required() {
        shared.index.find_matches(&pool.name, keys, candidates)?
    } else {
        shared
            .index
            .find_matches_without_building(&pool.name, keys, candidates)?
    };
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
                prefix_blocks: m.prefix_blocks,
                precise: m.precise,
                state: condition(m.state).into(),
                reason: m.state.reason().to_owned(),
            })
        })
        .collect();
    Ok(api::MatchResponse {
        block_size: pool.block_size,
        total_blocks: u32::try_from(keys.len()).unwrap_or(u32::MAX),
        replicas,
    })
}

/// The proto's form of a replica's state.
pub(crate) fn condition(state: ReplicaState) -> api::ReplicaCondition {
    match state {
        ReplicaState::Ready => api::ReplicaCondition::Ready,
        ReplicaState::Syncing => api::ReplicaCondition::Syncing,
        ReplicaState::Stale => api::ReplicaCondition::Stale,
        ReplicaState::Disconnected => api::ReplicaCondition::Disconnected,
        ReplicaState::NeverConnected => api::ReplicaCondition::NeverConnected,
        ReplicaState::Flagged(_) => api::ReplicaCondition::Flagged,
    }
}

/// Ingest and index state of every replica, joined for operators. The state is the index's
/// own (the one Match answers with); the problem text adds what the feeds know.
pub(crate) fn replica_states(shared: &Shared, model: Option<&str>) -> Vec<api::ReplicaState> {
    let _inflight = shared.inflight.token();
    let ingest: Vec<ReplicaIngestSnapshot> = shared.ingest.snapshot();
    shared
        .index
        .replica_statuses(model.map(|name| shared.directory.pool_key(name)))
        .into_iter()
        .map(|status| {
            let socket = ingest
                .iter()
                .find(|s| *s.replica.replica_id == *status.name);
            api::ReplicaState {
                replica_id: status.name,
                model: status.model,
                state: status.state.as_label().to_owned(),
                blocks: status.blocks as u64,
                last_sequence: socket.and_then(|s| s.last_seq),
                problem: problem(status.state, socket),
            }
        })
        .collect()
}

/// Why a replica is not ready, in words (empty when it is).
fn problem(state: ReplicaState, socket: Option<&ReplicaIngestSnapshot>) -> String {
    let last_error = || socket.and_then(|s| s.last_error.as_ref().map(|(_, e)| e.clone()));
    match state {
        ReplicaState::Ready => String::new(),
        ReplicaState::Flagged(flag) => flag.as_label().to_owned(),
        ReplicaState::Syncing => "catching up with the engine's stream".to_owned(),
        ReplicaState::Stale => "agent not connected past its grace period".to_owned(),
        ReplicaState::Disconnected => {
            last_error().unwrap_or_else(|| "event stream disconnected".to_owned())
        }
        ReplicaState::NeverConnected => {
            last_error().unwrap_or_else(|| "event stream never connected".to_owned())
        }
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
        let span = kvroute_runtime::trace_span!(
            "kvroute.index.v1.KvIndex/Match",
            otel.kind = "server",
            rpc.system = "grpc",
            kvroute.blocks = request.get_ref().keys.len(),
            kvroute.candidates = request.get_ref().candidates.len(),
        );
        kvroute_runtime::telemetry::continue_grpc_trace(&span, request.metadata());
        let _entered = span.enter();
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

    type ShareDecisionsStream = super::peers::NewsStream;

    async fn share_decisions(
        &self,
        request: Request<tonic::Streaming<api::PickerNews>>,
    ) -> Result<Response<Self::ShareDecisionsStream>, Status> {
        Ok(Response::new(self.shared.peers.join(request.into_inner())))
    }

    async fn replica_state(
        &self,
        request: Request<api::ReplicaStateRequest>,
    ) -> Result<Response<api::ReplicaStateResponse>, Status> {
        let span = kvroute_runtime::trace_span!(
            "kvroute.index.v1.KvIndex/ReplicaState",
            otel.kind = "server",
            rpc.system = "grpc",
        );
        kvroute_runtime::telemetry::continue_grpc_trace(&span, request.metadata());
        let _entered = span.enter();
        let request = request.into_inner();
        let model = (!request.model.is_empty()).then_some(request.model.as_str());
        Ok(Response::new(api::ReplicaStateResponse {
            replicas: replica_states(&self.shared, model),
        }))
    }
}

/// Serves gRPC (with `grpc.health.v1`) until `cancel`; an error means the server is gone.
pub(crate) async fn serve(
    mut server: tonic::transport::Server,
    listener: TcpListener,
    shared: Arc<Shared>,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    cancel: CancellationToken,
) -> Result<(), String> {
    let agents = shared.agents.service();
    let auth = Arc::clone(&shared);
    // `query_auth`: Match, ReplicaState and ShareDecisions need the token; health and the agent
    // stream do not.
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
        Ok(()) => {
            tracing::debug!(exit_reason = "shutdown", "grpc server stopped");
            Ok(())
        }
        Err(error) => Err(error.to_string()),
    }
}
