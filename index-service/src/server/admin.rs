//! The index's own admin HTTP routes, served beside `/metrics`, `/healthz` and `/readyz` (those
//! are `kvroute_runtime::admin`'s): `GET /v1/replicas` (and each replica's `/blocks` and
//! per-KV-cache-group `/groups`) and `POST /v1/match` (so operators can ask with curl). With
//! `query_auth` these `/v1/*` endpoints, which reveal what each replica caches, need
//! `authorization: Bearer <token>`; the probes and `/metrics` stay open.

use std::{sync::Arc, time::Instant};

use axum::{
    Json, Router,
    extract::{State, rejection::JsonRejection},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use kvroute_block_keys::LoraRef;
use kvroute_runtime::admin::Readiness;
use serde::{Deserialize, Serialize};

use super::{
    Shared,
    grpc::{MAX_MATCH_KEYS, MatchError, match_keys, replica_states},
};

/// Largest `token_ids` array `/v1/match` hashes.
pub const MAX_MATCH_TOKENS: usize = 1 << 21;

/// The `/v1/*` routes, behind the query token when `query_auth` is set.
pub(crate) fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/replicas", get(replicas))
        .route("/v1/replicas/{id}/blocks", get(replica_blocks))
        .route("/v1/replicas/{id}/groups", get(replica_groups))
        .route("/v1/match", post(match_prompt))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            require_query_token,
        ))
        .with_state(shared)
}

/// `/readyz`: ready when every pool has enough ready replicas, else not; the body says why.
pub(crate) fn readiness(shared: &Shared) -> Readiness {
    let report = super::readiness::report(shared);
    Readiness {
        ready: report.ready,
        body: report.text(),
    }
}

/// `query_auth`: the `/v1/*` endpoints answer only with the token.
async fn require_query_token(
    State(shared): State<Arc<Shared>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(|value| value.as_bytes());
    match shared.query_auth.check("http", presented) {
        Ok(()) => next.run(request).await,
        Err(refusal) => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            Json(serde_json::json!({
                "error": format!("query_auth token required ({})", refusal.as_label())
            })),
        )
            .into_response(),
    }
}

#[derive(Debug, Serialize)]
struct ReplicaJson {
    id: String,
    model: String,
    state: String,
    blocks: u64,
    /// Absent before the first batch is applied.
    #[serde(skip_serializing_if = "Option::is_none")]
    last_sequence: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

async fn replicas(State(shared): State<Arc<Shared>>) -> Json<Vec<ReplicaJson>> {
    Json(
        replica_states(&shared, None)
            .into_iter()
            .map(|state| ReplicaJson {
                id: state.replica_id,
                model: state.model,
                state: state.state,
                blocks: state.blocks,
                last_sequence: state.last_sequence,
                problem: (!state.problem.is_empty()).then_some(state.problem),
            })
            .collect(),
    )
}

/// `GET /v1/replicas/{id}/blocks`: the engine hashes indexed for one replica (debugging and
/// convergence tests; O(its blocks)).
async fn replica_blocks(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    let Some(id) = shared.directory.replica_id(&name) else {
        return error_response(StatusCode::NOT_FOUND, format!("unknown replica {name:?}"));
    };
    match shared.index.replica_block_hashes(id) {
        Ok(blocks) => Json(serde_json::json!({ "id": name, "blocks": blocks })).into_response(),
        Err(error) => error_response(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// `GET /v1/replicas/{id}/groups`: each KV-cache group's held engine hashes for one replica,
/// `{"id": .., "groups": {"<group_idx>": [hash, ..]}}`, one entry per cached copy, sorted (a
/// hybrid model's groups hold different blocks of one prompt; debugging and convergence tests
/// compare them with the engine's block pool; O(its blocks)). Groups whose hit rule is not
/// modelled are not held, so not listed.
async fn replica_groups(
    State(shared): State<Arc<Shared>>,
    axum::extract::Path(name): axum::extract::Path<String>,
) -> Response {
    let Some(id) = shared.directory.replica_id(&name) else {
        return error_response(StatusCode::NOT_FOUND, format!("unknown replica {name:?}"));
    };
    match shared.index.replica_group_hashes(id) {
        Ok(groups) => {
            // JSON object keys are strings: the group index, as vLLM's `group_idx`.
            let groups: serde_json::Map<String, serde_json::Value> = groups
                .into_iter()
                .map(|(group, hashes)| (group.to_string(), serde_json::json!(hashes)))
                .collect();
            Json(serde_json::json!({ "id": name, "groups": groups })).into_response()
        }
        Err(error) => error_response(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// `POST /v1/match` body: a prompt as token ids (hashed with the pool's scheme) or as keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchBody {
    model: String,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    prompt_keys: Option<Vec<u64>>,
    #[serde(default)]
    lora_name: Option<String>,
    #[serde(default)]
    lora_id: Option<i64>,
    #[serde(default)]
    lora_path: Option<String>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    candidates: Vec<String>,
}

#[derive(Debug, Serialize)]
struct MatchJson {
    model: String,
    block_size: u32,
    total_blocks: u32,
    replicas: Vec<ReplicaMatchJson>,
}

#[derive(Debug, Serialize)]
struct ReplicaMatchJson {
    id: String,
    matched_blocks: u32,
    gpu_blocks: u32,
    /// How far a longer prompt with these leading keys could hit (hybrid models: the
    /// full-attention group's leading blocks).
    prefix_blocks: u32,
    precise: bool,
    /// `ready`, `syncing`, `stale`, `disconnected`, `never_connected`, `flagged`.
    state: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    reason: String,
}

fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

async fn match_prompt(
    State(shared): State<Arc<Shared>>,
    body: Result<Json<MatchBody>, JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => {
            shared.metrics.match_error("http", "bad_request");
            return error_response(StatusCode::BAD_REQUEST, rejection.body_text());
        }
    };
    let keys = match (&body.token_ids, &body.prompt_keys) {
        (Some(tokens), None) => match keys_from_tokens(&shared, &body, tokens) {
            Ok(keys) => keys,
            Err(error) => return match_error_response(&shared, error),
        },
        (None, Some(keys)) => keys.clone(),
        _ => {
            shared.metrics.match_error("http", "bad_request");
            return error_response(
                StatusCode::BAD_REQUEST,
                "give exactly one of `token_ids` or `prompt_keys`",
            );
        }
    };
    match match_keys(&shared, "http", &body.model, None, &keys, &body.candidates) {
        Ok(response) => Json(MatchJson {
            model: body.model,
            block_size: response.block_size,
            total_blocks: response.total_blocks,
            replicas: response
                .replicas
                .into_iter()
                .map(|m| ReplicaMatchJson {
                    state: m.state().label(),
                    id: m.replica_id,
                    matched_blocks: m.matched_blocks,
                    gpu_blocks: m.gpu_blocks,
                    prefix_blocks: m.prefix_blocks,
                    precise: m.precise,
                    reason: m.reason,
                })
                .collect(),
        })
        .into_response(),
        Err(error) => error_response(status_of(&error), error.to_string()),
    }
}

fn keys_from_tokens(
    shared: &Shared,
    body: &MatchBody,
    tokens: &[u32],
) -> Result<Vec<u64>, MatchError> {
    let pool = shared
        .directory
        .pool(&body.model)
        .ok_or_else(|| MatchError::UnknownModel(body.model.clone()))?;
    if tokens.len() > MAX_MATCH_TOKENS || tokens.len() / pool.block_size as usize > MAX_MATCH_KEYS {
        return Err(MatchError::TooManyKeys(
            tokens.len() / pool.block_size as usize,
        ));
    }
    let lora = body.lora_name.as_deref().map(|name| LoraRef {
        id: body.lora_id,
        name,
        path: body.lora_path.as_deref(),
    });
    let started = Instant::now();
    let keys = pool
        .scheme
        .prompt_keys(
            tokens,
            pool.block_size as usize,
            lora.as_ref(),
            body.cache_salt.as_deref(),
        )
        .map_err(|e| MatchError::Keys(e.to_string()))?;
    shared
        .metrics
        .observe_match("hash", started.elapsed().as_secs_f64());
    Ok(keys)
}

fn match_error_response(shared: &Shared, error: MatchError) -> Response {
    shared.metrics.match_error("http", error.as_label());
    error_response(status_of(&error), error.to_string())
}

fn status_of(error: &MatchError) -> StatusCode {
    match error {
        MatchError::UnknownModel(_) => StatusCode::NOT_FOUND,
        MatchError::Index(_) => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::BAD_REQUEST,
    }
}
