//! The HTTP surface, in vLLM's shapes: OpenAI completions and chat, the Responses and Anthropic
//! Messages APIs (each as JSON or SSE), `/v1/models`, `/health`, `/tokenize`, the render endpoints
//! of vLLM 0.32's `--enable-scale-out` (`/v1/{completions,chat/completions,responses,messages}/render`),
//! `/metrics`, `/reset_prefix_cache` and the simulator's `/debug/blocks`, `/debug/requests`,
//! `/debug/kv_transfer` and its NIXL side channel (`/sim/nixl/read`).
//!
//! `kv_transfer_params` (chat, completions, Responses, Messages, as vLLM 0.32 accepts them) are
//! served as vLLM's `NixlConnector` (pull mode) serves them when `--kv-transfer-config` names
//! it, and ignored otherwise (vLLM logs "Got kv_transfer_params, but no KVConnector found"):
//! - `do_remote_decode` (a prefill leg): runs as usual; when it finishes its blocks are held
//!   for `kv_lease_duration` and the non-streamed answer carries the parameters
//!   `NixlConnectorScheduler.request_finished` returns (`do_remote_prefill: true`, the blocks,
//!   this engine, its internal request id `<response id>-<8 hex>`, the side channel's host and
//!   port, ...) plus the scheduler's `remote_prefill_cached_tokens`. A streamed answer carries
//!   none (vLLM's stream generators do not), but the blocks are held all the same.
//! - `do_remote_prefill` (a decode leg): the blocks are read from the prefill simulator's side
//!   channel at `remote_host:remote_port` before the request is queued (vLLM reads after
//!   admission; the prefill's hold ends at the read either way) and must hold this prompt;
//!   the engine then loads what its prefix cache misses instead of computing it, paying the
//!   transfer. A read refused (nothing held: unknown, already read, lease expired) or a
//!   prompt that differs is a KV load failure, handled by `kv_load_failure_policy`: `fail`
//!   answers vLLM's 500 (or its error event in a stream), `recompute` computes the prompt.
//!   (Real vLLM cannot tell an expired lease from a live one on the decode side — it reads the
//!   prefill's memory whatever it holds and only the prefill logs "Potentially invalid KV
//!   blocks"; the simulator, which has no tensors to corrupt, reports it as the load failure
//!   it is, so a decode never claims tokens it did not get.) Parameters naming no complete
//!   source (`remote_block_ids` empty or missing, a remote field missing) are refused with a
//!   400; vLLM 0.32 fails its scheduler's assertion or parks the request forever on them.
//!   Usage's `cached_tokens` is vLLM's: the prefill's `remote_prefill_cached_tokens` when the
//!   parameters carry it, else the local hits plus the loaded tokens.
//!
//! Every response carries the `traceparent` its request came with (if any) as
//! [`RECEIVED_TRACEPARENT_HEADER`], so a test reads which span the engine would have continued.
//!
//! The render endpoints are a protocol double: they answer vLLM's `GenerateRequest` shape (a
//! list of them for completions) with token ids computed by kvroute-tokenize, the same code
//! kvroute's in-process tokenizer runs — so they test kvroute's render client and routing, not
//! the tokenization itself (the goldens compare that with real vLLM).
//!
//! Images in chat, Responses and Messages requests go through the simulator's processor
//! (`media`): placeholder runs in the prompt, their identifiers in the render answer's
//! `features` (vLLM's shape; tensors only unless `mm_payload` is `"none"`), and in the engine's
//! block hashes and KV events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_tokenize::{ApiKind, ChatOptions, ModelTokenizer};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{Value, json};

use super::config::{KvLoadFailurePolicy, KvTransferConfig};
use super::engine::{Engine, EngineError, EngineLeg, Sequence};
use super::media::{self, ImageProcessor, PlacedImage};
use super::metrics::MetricsInfo;

/// Response header echoing the `traceparent` header of the request.
pub const RECEIVED_TRACEPARENT_HEADER: &str = "x-sim-received-traceparent";

/// Response header naming the data-parallel rank that served a generation request (the
/// simulator's own: vLLM does not say), so a test sees where `x-data-parallel-rank` sent it.
pub const SERVED_DP_RANK_HEADER: &str = "x-sim-served-dp-rank";

/// The endpoints that generate, the ones a data-parallel rank serves.
const GENERATION_PATHS: [&str; 4] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
];

tokio::task_local! {
    /// The data-parallel rank serving the current generation request, chosen before its handler
    /// runs ([`choose_rank`]).
    static SERVING_RANK: usize;
}

/// Generation requests `/debug/requests` keeps, newest last.
const REQUEST_LOG_CAPACITY: usize = 256;

/// The longest a decode waits for its prefill simulator's side channel.
const SIDE_CHANNEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Text the simulated model "generates", cycled token by token.
const FILLER_TEXT: &str = " the quick brown fox jumps over the lazy dog and keeps running";

/// Shared by all handlers.
#[derive(Debug)]
pub(crate) struct AppState {
    /// One engine per data-parallel rank, rank 0 first.
    pub(crate) engines: Vec<Arc<Engine>>,
    /// Where vLLM's balancer starts its scan next (it rotates, so ties spread).
    next_scan_start: AtomicU64,
    pub(crate) tokenizer: Arc<ModelTokenizer>,
    images: ImageProcessor,
    pub(crate) model_name: String,
    pub(crate) model_root: String,
    pub(crate) default_max_tokens: usize,
    pub(crate) metrics: MetricsInfo,
    filler: Vec<(u32, String)>,
    created: u64,
    next_id: AtomicU64,
    /// `--kv-transfer-config`, when it names a connector.
    kv_transfer: Option<KvTransferConfig>,
    /// Where this simulator's NIXL side channel answers (its HTTP listener).
    side_channel: SocketAddr,
    /// The last generation requests received (`/debug/requests`).
    request_log: Mutex<VecDeque<Value>>,
    /// Requests whose `kv_transfer_params` were ignored (no connector).
    params_ignored: AtomicU64,
    /// Decode legs whose KV could not be loaded.
    load_failures: AtomicU64,
    /// SGLang's `/server_info` (SGLang only).
    server_info: Option<Value>,
}

impl AppState {
    pub(crate) fn new(
        engines: Vec<Arc<Engine>>,
        tokenizer: Arc<ModelTokenizer>,
        model_name: String,
        model_root: String,
        default_max_tokens: usize,
        metrics: MetricsInfo,
    ) -> Result<Self, kvroute_tokenize::TokenizeError> {
        let filler = tokenizer
            .encode_prompt(FILLER_TEXT, false)?
            .into_iter()
            .map(|id| Ok((id, tokenizer.decode(&[id], false)?)))
            .collect::<Result<Vec<_>, kvroute_tokenize::TokenizeError>>()?;
        Ok(Self {
            engines,
            next_scan_start: AtomicU64::new(0),
            images: ImageProcessor::new(&tokenizer, &model_name),
            tokenizer,
            model_name,
            model_root,
            default_max_tokens,
            metrics,
            filler,
            created: unix_seconds(),
            next_id: AtomicU64::new(0),
            kv_transfer: None,
            side_channel: SocketAddr::from(([127, 0, 0, 1], 0)),
            request_log: Mutex::new(VecDeque::new()),
            params_ignored: AtomicU64::new(0),
            load_failures: AtomicU64::new(0),
            server_info: None,
        })
    }

    /// Serves disaggregation with `config` (none: parameters ignored), its side channel on
    /// `side_channel`.
    /// SGLang's `/server_info` answer (`None`: the endpoint is not served, as by vLLM).
    pub(crate) fn with_server_info(mut self, info: Option<Value>) -> Self {
        self.server_info = info;
        self
    }

    pub(crate) fn with_kv_transfer(
        mut self,
        config: Option<KvTransferConfig>,
        side_channel: SocketAddr,
    ) -> Self {
        self.kv_transfer = config;
        self.side_channel = side_channel;
        self
    }

    /// Eight hex digits, unique per call (vLLM's internal ids end with eight random ones).
    fn suffix(&self) -> String {
        use std::hash::{BuildHasher as _, Hasher as _};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(self.next_id.fetch_add(1, Ordering::Relaxed));
        format!("{:08x}", hasher.finish() as u32)
    }

    fn log_request(&self, entry: Value) {
        let mut log = self.request_log.lock();
        if log.len() == REQUEST_LOG_CAPACITY {
            log.pop_front();
        }
        log.push_back(entry);
    }

    fn request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:016x}{n:016x}", self.created)
    }

    fn filler(&self, k: usize) -> &(u32, String) {
        &self.filler[k % self.filler.len()]
    }

    /// Rank 0's engine: the geometry every rank shares.
    fn first_engine(&self) -> &Engine {
        &self.engines[0]
    }

    /// The engine serving the current generation request.
    fn serving_engine(&self) -> &Arc<Engine> {
        let rank = SERVING_RANK.try_with(|rank| *rank).unwrap_or(0);
        &self.engines[rank.min(self.engines.len() - 1)]
    }

    /// vLLM's internal balancer (`DPLBAsyncMPClient.get_core_engine_for_request`): the rank
    /// with the fewest waiting plus running requests, scanning from a rotating start so ties
    /// spread. (vLLM also penalises a queue on a rank whose KV cache is over half full.)
    fn least_loaded_rank(&self) -> usize {
        let ranks = self.engines.len();
        let start = self.next_scan_start.fetch_add(1, Ordering::Relaxed) as usize;
        let mut best = (f64::MAX, 0);
        for i in 0..ranks {
            let rank = (start + i) % ranks;
            let gauges = self.engines[rank].gauges();
            let mut score = (gauges.waiting + gauges.running) as f64;
            if gauges.waiting > 0 {
                score += gauges.waiting as f64 * 6.0 * (gauges.kv_cache_usage - 0.5).max(0.0);
            }
            if score < best.0 {
                best = (score, rank);
            }
        }
        best.1
    }
}

/// The router over `state`.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/responses/render", post(render_responses))
        .route("/v1/messages/render", post(render_messages))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/server_info", get(server_info))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        .route("/debug/blocks", get(debug_blocks))
        .route("/debug/requests", get(debug_requests))
        .route("/debug/kv_transfer", get(debug_kv_transfer))
        .route("/sim/nixl/read", post(nixl_read))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            choose_rank,
        ))
        .layer(axum::middleware::from_fn(echo_traceparent))
        .with_state(state)
}

/// Chooses the data-parallel rank of a generation request as vLLM's API server does: the one
/// its `x-data-parallel-rank` header names (a value that is no integer is ignored; one out of
/// range is refused), else the least loaded; the handler runs with it as [`SERVING_RANK`] and
/// the response names it ([`SERVED_DP_RANK_HEADER`]).
async fn choose_rank(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !GENERATION_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let named = request
        .headers()
        .get(kvroute_config::DATA_PARALLEL_RANK_HEADER)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<i64>().ok());
    let ranks = state.engines.len();
    let rank = match named {
        Some(rank) => match usize::try_from(rank).ok().filter(|&rank| rank < ranks) {
            Some(rank) => rank,
            None => {
                return ApiError::bad_request(format!(
                    "data_parallel_rank {rank} is out of range [0, {ranks})."
                ))
                .into_response();
            }
        },
        None => state.least_loaded_rank(),
    };
    let mut response = SERVING_RANK.scope(rank, next.run(request)).await;
    response
        .headers_mut()
        .insert(SERVED_DP_RANK_HEADER, axum::http::HeaderValue::from(rank));
    response
}

/// Records the request's `traceparent` on its response ([`RECEIVED_TRACEPARENT_HEADER`]).
async fn echo_traceparent(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let received = request.headers().get("traceparent").cloned();
    let mut response = next.run(request).await;
    if let Some(value) = received {
        response
            .headers_mut()
            .insert(RECEIVED_TRACEPARENT_HEADER, value);
    }
    response
}

/// An OpenAI-style error response as vLLM writes it.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// vLLM's answer to a request that finished with an error (`GenerationError`).
    fn generation_failed() -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "Internal server error".to_owned(),
        }
    }

    fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::BAD_REQUEST => "BadRequestError",
            _ => "InternalServerError",
        };
        json!({"error": {"message": self.message, "type": kind, "param": null,
            "code": self.status.as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body();
        (self.status, Json(body)).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::ShuttingDown => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
            },
            _ => Self::bad_request(e.to_string()),
        }
    }
}

impl From<kvroute_tokenize::TokenizeError> for ApiError {
    fn from(e: kvroute_tokenize::TokenizeError) -> Self {
        let status = if e.is_bad_input() {
            StatusCode::BAD_REQUEST
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        // `{:#}`-style chain: the template's own message is in the source.
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(cause) = source {
            message = format!("{message}: {cause}");
            source = cause.source();
        }
        Self { status, message }
    }
}

/// Parses a JSON body ourselves so malformed input gets vLLM's 400 shape, not axum's.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

/// `prompt`: a string or token ids, or a batch of exactly one of those.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl PromptInput {
    fn encode(self, tokenizer: &ModelTokenizer, add_special: bool) -> Result<Vec<u32>, ApiError> {
        match self {
            PromptInput::Text(text) => Ok(tokenizer.encode_prompt(&text, add_special)?),
            PromptInput::Tokens(ids) => Ok(ids),
            PromptInput::Texts(mut texts) if texts.len() == 1 => {
                Ok(tokenizer.encode_prompt(&texts.remove(0), add_special)?)
            }
            PromptInput::TokenLists(mut lists) if lists.len() == 1 => Ok(lists.remove(0)),
            _ => Err(ApiError::bad_request(
                "batched prompts are not supported by the simulator",
            )),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: PromptInput,
    max_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    add_special_tokens: Option<bool>,
    kv_transfer_params: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: Option<String>,
    messages: Value,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    add_generation_prompt: Option<bool>,
    add_special_tokens: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    tools: Option<Value>,
    documents: Option<Value>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    reasoning_effort: Option<String>,
    kv_transfer_params: Option<Value>,
}

impl ChatRequest {
    /// Every prompt-changing field, as vLLM's chat path reads them.
    fn options(&self) -> ChatOptions {
        ChatOptions {
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            continue_final_message: self.continue_final_message,
            add_special_tokens: self.add_special_tokens.unwrap_or(false),
            tools: self
                .tools
                .clone()
                .filter(|t| !t.is_null())
                .map(std::sync::Arc::new),
            documents: self.documents.clone().filter(|d| !d.is_null()),
            reasoning_effort: self.reasoning_effort.clone(),
            chat_template_kwargs: self.chat_template_kwargs.clone(),
            request_template: false,
            messages_validated: true,
            ..ChatOptions::default()
        }
    }
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<PromptInput>,
    messages: Option<Value>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: bool,
    tools: Option<Value>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    return_token_strs: bool,
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if name != state.model_name => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist."),
        }),
        _ => Ok(()),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "vllm",
        "root": state.model_root, "parent": null,
        "max_model_len": state.first_engine().geometry().max_model_len,
        "permission": [],
    }]}))
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: TokenizeRequest = parse(&body)?;
    check_model(&state, request.model.as_deref())?;
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            prompt.encode(&state.tokenizer, request.add_special_tokens.unwrap_or(true))?
        }
        (None, Some(messages)) => {
            // vLLM's TokenizeChatRequest: add_special_tokens defaults to false, and it has no
            // reasoning_effort or documents fields.
            let options = ChatOptions {
                add_generation_prompt: request.add_generation_prompt.unwrap_or(true),
                continue_final_message: request.continue_final_message,
                add_special_tokens: request.add_special_tokens.unwrap_or(false),
                tools: request
                    .tools
                    .filter(|t| !t.is_null())
                    .map(std::sync::Arc::new),
                chat_template_kwargs: request.chat_template_kwargs,
                ..ChatOptions::default()
            };
            let with = state
                .images
                .chat(&messages)
                .map_err(ApiError::bad_request)?;
            let tokens = state.tokenizer.encode_chat_with(&with.request, &options)?;
            with.expand(&state.images, tokens)
                .map_err(ApiError::bad_request)?
                .0
        }
        _ => {
            return Err(ApiError::bad_request(
                "give exactly one of prompt or messages",
            ));
        }
    };
    let token_strs = request.return_token_strs.then(|| {
        tokens
            .iter()
            .map(|&id| state.tokenizer.id_to_token(id).unwrap_or_default())
            .collect::<Vec<_>>()
    });
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.first_engine().geometry().max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    })))
}

/// Which OpenAI endpoint a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
    /// OpenAI Responses API.
    Responses,
    /// Anthropic Messages API (answered by vLLM's chat path, so its ids are chat ids).
    Messages,
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    check_model(&state, request.model.as_deref())?;
    let prompt = request
        .prompt
        .encode(&state.tokenizer, request.add_special_tokens.unwrap_or(true))?;
    let max_tokens = request.max_tokens.unwrap_or(state.default_max_tokens);
    let include_usage = request.stream_options.unwrap_or_default().include_usage;
    let incoming = Incoming::new(
        "/v1/completions",
        &headers,
        &body,
        request.kv_transfer_params,
    );
    generate(
        state,
        Kind::Completion,
        (prompt, Vec::new()),
        max_tokens,
        (request.stream, include_usage),
        incoming,
    )
    .await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(&body)?;
    check_model(&state, request.model.as_deref())?;
    let prompt = chat_prompt(&state, &request)?;
    let max_tokens = request
        .max_completion_tokens
        .or(request.max_tokens)
        .unwrap_or(state.default_max_tokens);
    let include_usage = request.stream_options.unwrap_or_default().include_usage;
    let incoming = Incoming::new(
        "/v1/chat/completions",
        &headers,
        &body,
        request.kv_transfer_params.clone(),
    );
    generate(
        state,
        Kind::Chat,
        prompt,
        max_tokens,
        (request.stream, include_usage),
        incoming,
    )
    .await
}

/// A prompt's tokens and the images placed in them.
type Prompted = (Vec<u32>, Vec<PlacedImage>);

/// A chat request's prompt as vLLM renders and processes it.
fn chat_prompt(state: &AppState, request: &ChatRequest) -> Result<Prompted, ApiError> {
    let with = state
        .images
        .chat(&request.messages)
        .map_err(ApiError::bad_request)?;
    let tokens = state
        .tokenizer
        .encode_chat_with(&with.request, &request.options())?;
    with.expand(&state.images, tokens)
        .map_err(ApiError::bad_request)
}

/// A Responses or Messages request body: its model, its prompt as vLLM renders and processes
/// it, and whether it asks for a stream.
fn api_prompt(
    state: &AppState,
    api: ApiKind,
    body: &Bytes,
) -> Result<(Prompted, Option<usize>, bool), ApiError> {
    let request: serde_json::Map<String, Value> = parse(body)?;
    check_model(state, request.get("model").and_then(Value::as_str))?;
    let with = match api {
        ApiKind::Responses => state.images.responses(&request),
        ApiKind::Messages => state.images.messages(&request),
    }
    .map_err(ApiError::bad_request)?;
    let tokens = state.tokenizer.encode_api_request(api, &with.request)?;
    let prompt = with
        .expand(&state.images, tokens)
        .map_err(ApiError::bad_request)?;
    let max_tokens = ["max_output_tokens", "max_tokens"]
        .iter()
        .find_map(|key| request.get(*key).and_then(Value::as_u64))
        .map(|n| n as usize);
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    Ok((prompt, max_tokens, stream))
}

async fn responses(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (prompt, max_tokens, stream) = api_prompt(&state, ApiKind::Responses, &body)?;
    let max_tokens = max_tokens.unwrap_or(state.default_max_tokens);
    let incoming = Incoming::from_body("/v1/responses", &headers, &body);
    generate(
        state,
        Kind::Responses,
        prompt,
        max_tokens,
        (stream, false),
        incoming,
    )
    .await
}

async fn messages(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let (prompt, max_tokens, stream) = api_prompt(&state, ApiKind::Messages, &body)?;
    let max_tokens = max_tokens.unwrap_or(state.default_max_tokens);
    let incoming = Incoming::from_body("/v1/messages", &headers, &body);
    generate(
        state,
        Kind::Messages,
        prompt,
        max_tokens,
        (stream, false),
        incoming,
    )
    .await
}

/// vLLM's `GenerateRequest` as the render endpoints answer it (the fields routing reads and
/// their neighbours; sampling parameters abbreviated).
fn rendered(state: &AppState, prefix: &str, (token_ids, images): Prompted, body: &Value) -> Value {
    let mm_payload = body.get("mm_payload").and_then(Value::as_str);
    json!({
        "request_id": state.request_id(prefix),
        "token_ids": token_ids,
        "features": media::features(&images, mm_payload),
        "sampling_params": {"max_tokens": body.get("max_tokens").cloned().unwrap_or(Value::Null)},
        "model": state.model_name,
        "stream": body.get("stream").and_then(Value::as_bool).unwrap_or(false),
        "cache_salt": body.get("cache_salt").cloned().unwrap_or(Value::Null),
        "priority": 0,
    })
}

async fn render_completion(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    check_model(&state, request.model.as_deref())?;
    let tokens = request
        .prompt
        .encode(&state.tokenizer, request.add_special_tokens.unwrap_or(true))?;
    let raw: Value = parse(&body)?;
    Ok(Json(json!([rendered(
        &state,
        "cmpl",
        (tokens, Vec::new()),
        &raw
    )])))
}

async fn render_chat(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: ChatRequest = parse(&body)?;
    check_model(&state, request.model.as_deref())?;
    let prompt = chat_prompt(&state, &request)?;
    let raw: Value = parse(&body)?;
    Ok(Json(rendered(&state, "chatcmpl", prompt, &raw)))
}

async fn render_responses(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let (tokens, ..) = api_prompt(&state, ApiKind::Responses, &body)?;
    let raw: Value = parse(&body)?;
    Ok(Json(rendered(&state, "resp", tokens, &raw)))
}

async fn render_messages(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let (tokens, ..) = api_prompt(&state, ApiKind::Messages, &body)?;
    let raw: Value = parse(&body)?;
    Ok(Json(rendered(&state, "chatcmpl", tokens, &raw)))
}

/// A generation request as received: where, its `X-Request-Id`, its body, its transfer
/// parameters.
struct Incoming {
    path: &'static str,
    x_request_id: Option<String>,
    body: Value,
    kv_transfer_params: Option<Value>,
}

impl Incoming {
    fn new(
        path: &'static str,
        headers: &axum::http::HeaderMap,
        body: &Bytes,
        kv_transfer_params: Option<Value>,
    ) -> Self {
        Self {
            path,
            x_request_id: headers
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned),
            body: serde_json::from_slice(body).unwrap_or(Value::Null),
            kv_transfer_params,
        }
    }

    /// For bodies parsed as maps: the parameters read from the body itself.
    fn from_body(path: &'static str, headers: &axum::http::HeaderMap, body: &Bytes) -> Self {
        let mut incoming = Self::new(path, headers, body, None);
        incoming.kv_transfer_params = incoming.body.get("kv_transfer_params").cloned();
        incoming
    }
}

/// What a request's transfer parameters make of it.
struct TransferPlan {
    leg: EngineLeg,
    /// `prefill` or `decode`.
    role: Option<&'static str>,
    /// The prefill's `remote_prefill_cached_tokens`, which vLLM reports as the decode's.
    cached_override: Option<usize>,
    /// Why the KV could not be loaded (the request recomputes).
    load_failure: Option<String>,
}

impl TransferPlan {
    fn whole() -> Self {
        Self {
            leg: EngineLeg::Whole,
            role: None,
            cached_override: None,
            load_failure: None,
        }
    }
}

/// Python's truthiness, as the connector tests its parameters.
fn truthy(value: Option<&Value>) -> bool {
    match value {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// Where a decode leg's KV is, from its parameters.
struct RemoteSource {
    engine_id: String,
    request_id: String,
    host: String,
    port: u16,
    /// The first KV-cache group's block ids.
    block_ids: Vec<usize>,
}

impl RemoteSource {
    fn from_params(params: &serde_json::Map<String, Value>) -> Result<Self, String> {
        let text = |key: &str| {
            params
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("{key} must be a string"))
        };
        let ids = params
            .get("remote_block_ids")
            .and_then(Value::as_array)
            .filter(|ids| !ids.is_empty())
            .ok_or("remote_block_ids must be a non-empty list")?;
        // One list per KV-cache group (vLLM 0.32), or a flat list (older proxies).
        let group = match ids.first() {
            Some(Value::Array(first)) => first,
            _ => ids,
        };
        let block_ids = group
            .iter()
            .map(|id| id.as_u64().map(|id| id as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or("remote_block_ids must hold block numbers")?;
        let port = params
            .get("remote_port")
            .and_then(Value::as_u64)
            .and_then(|p| u16::try_from(p).ok())
            .ok_or("remote_port must be a port number")?;
        Ok(Self {
            engine_id: text("remote_engine_id")?,
            request_id: text("remote_request_id")?,
            host: text("remote_host")?,
            port,
            block_ids,
        })
    }

    /// Reads the held blocks' tokens through the prefill simulator's side channel.
    async fn read(&self) -> Result<Vec<u32>, String> {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        let url = format!("http://{host}:{}/sim/nixl/read", self.port);
        let body = json!({"remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id, "remote_block_ids": [self.block_ids]});
        let response = tokio::time::timeout(
            SIDE_CHANNEL_TIMEOUT,
            crate::harness::http::post_json(&url, &body),
        )
        .await
        .map_err(|_| format!("no answer from {url}"))?
        .map_err(|e| format!("{url}: {e}"))?;
        let answer: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        if !response.status.is_success() {
            let reason = answer
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("refused");
            return Err(format!("{url} answered {}: {reason}", response.status));
        }
        serde_json::from_value(answer.get("token_ids").cloned().unwrap_or(Value::Null))
            .map_err(|e| format!("{url}: {e}"))
    }
}

/// Why a request cannot run as its parameters ask.
enum PlanError {
    /// Parameters naming no complete source.
    Invalid(ApiError),
    /// The KV could not be loaded and the policy is `fail`.
    LoadFailed(String),
}

/// What `params` make of a request whose prompt is `prompt` and whose internal id is
/// `internal_id` (the connector's scheduler side).
async fn plan_transfer(
    state: &AppState,
    params: Option<&Value>,
    prompt: &[u32],
    internal_id: &str,
) -> Result<TransferPlan, PlanError> {
    let Some(config) = &state.kv_transfer else {
        if params.is_some_and(|p| !p.is_null()) {
            state.params_ignored.fetch_add(1, Ordering::Relaxed);
            tracing::warn!("Got kv_transfer_params, but no KVConnector found; ignored");
        }
        return Ok(TransferPlan::whole());
    };
    let Some(params) = params.and_then(Value::as_object).filter(|p| !p.is_empty()) else {
        return Ok(TransferPlan::whole());
    };
    if truthy(params.get("do_remote_prefill")) {
        let source = RemoteSource::from_params(params).map_err(|e| {
            PlanError::Invalid(ApiError::bad_request(format!(
                "invalid kv_transfer_params for a remote prefill: {e}"
            )))
        })?;
        let cached_override = params
            .get("remote_prefill_cached_tokens")
            .and_then(Value::as_u64)
            .map(|n| n as usize);
        let loaded = match source.read().await {
            Ok(tokens) if tokens.len() >= prompt.len() && tokens[..prompt.len()] == *prompt => {
                Ok(prompt.len())
            }
            Ok(_) => Err("the held blocks hold another prompt".to_owned()),
            Err(reason) => Err(reason),
        };
        return match loaded {
            Ok(remote_tokens) => Ok(TransferPlan {
                leg: EngineLeg::Decode { remote_tokens },
                role: Some("decode"),
                cached_override,
                load_failure: None,
            }),
            Err(reason) => {
                state.load_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%reason, "KV load failed");
                match config.failure_policy {
                    KvLoadFailurePolicy::Fail => Err(PlanError::LoadFailed(reason)),
                    KvLoadFailurePolicy::Recompute => Ok(TransferPlan {
                        leg: EngineLeg::Whole,
                        role: Some("decode"),
                        cached_override,
                        load_failure: Some(reason),
                    }),
                }
            }
        };
    }
    if truthy(params.get("do_remote_decode")) {
        return Ok(TransferPlan {
            leg: EngineLeg::Prefill {
                request_id: internal_id.to_owned(),
            },
            role: Some("prefill"),
            cached_override: None,
            load_failure: None,
        });
    }
    Ok(TransferPlan::whole())
}

/// The answer to a request whose KV could not be loaded under `kv_load_failure_policy: fail`:
/// vLLM's 500, or in a chat or completions stream its error event (after the role delta of a
/// chat stream) and `[DONE]`.
fn load_failed_response(kind: Kind, stream: bool, id: &str, model: &str) -> Response {
    let error = ApiError::generation_failed();
    if !stream || matches!(kind, Kind::Responses | Kind::Messages) {
        return error.into_response();
    }
    let mut events = String::new();
    if kind == Kind::Chat {
        let role = json!({"id": id, "object": "chat.completion.chunk", "created": unix_seconds(),
            "model": model, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null}]});
        events += &format!("data: {role}\n\n");
    }
    events += &format!("data: {}\n\ndata: [DONE]\n\n", error.body());
    (
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        events,
    )
        .into_response()
}

async fn generate(
    state: Arc<AppState>,
    kind: Kind,
    (prompt, images): Prompted,
    max_tokens: usize,
    (stream, include_usage): (bool, bool),
    incoming: Incoming,
) -> Result<Response, ApiError> {
    // vLLM names a chat or completion after the request's `X-Request-Id` when it has one; its
    // engine's own id adds eight random hex digits (a completion's, its prompt's index first).
    let prefix = match kind {
        Kind::Chat | Kind::Messages => "chatcmpl",
        Kind::Completion => "cmpl",
        Kind::Responses => "resp",
    };
    let id = match (&incoming.x_request_id, kind) {
        (Some(x_request_id), Kind::Chat | Kind::Completion) => format!("{prefix}-{x_request_id}"),
        _ => state.request_id(prefix),
    };
    let internal_id = match kind {
        Kind::Completion => format!("{id}-0-{}", state.suffix()),
        _ => format!("{id}-{}", state.suffix()),
    };
    let prompt_len = prompt.len();
    let mut entry = json!({"path": incoming.path, "x_request_id": incoming.x_request_id,
        "body": incoming.body, "request_id": internal_id});
    let plan = match plan_transfer(
        &state,
        incoming.kv_transfer_params.as_ref(),
        &prompt,
        &internal_id,
    )
    .await
    {
        Ok(plan) => plan,
        Err(PlanError::Invalid(error)) => return Err(error),
        Err(PlanError::LoadFailed(reason)) => {
            if let Some(map) = entry.as_object_mut() {
                map.insert("kv_transfer_role".to_owned(), "decode".into());
                map.insert("kv_load_failure".to_owned(), reason.into());
                map.insert("prompt_tokens".to_owned(), prompt_len.into());
            }
            state.log_request(entry);
            return Ok(load_failed_response(kind, stream, &id, &state.model_name));
        }
    };
    let output = (0..max_tokens).map(|k| state.filler(k).0).collect();
    let sequence = state
        .serving_engine()
        .start(prompt, &images, output, plan.leg.clone())
        .await?;
    if let Some(map) = entry.as_object_mut() {
        let local = sequence.local_cached_tokens();
        let external = sequence.external_tokens();
        map.insert("kv_transfer_role".to_owned(), plan.role.into());
        map.insert("kv_load_failure".to_owned(), plan.load_failure.into());
        map.insert("prompt_tokens".to_owned(), prompt_len.into());
        map.insert("local_cached_tokens".to_owned(), local.into());
        map.insert("external_tokens".to_owned(), external.into());
        map.insert(
            "computed_tokens".to_owned(),
            prompt_len.saturating_sub(local + external).into(),
        );
    }
    state.log_request(entry);
    let prefill_of = matches!(plan.leg, EngineLeg::Prefill { .. }).then_some(internal_id);
    let mut generation = Generation {
        state,
        kind,
        id,
        sequence,
        include_usage,
        phase: Phase::Start,
        text: String::new(),
        item_id: None,
        sequence_number: 0,
        prefill_of,
        cached_override: plan.cached_override,
    };
    if stream {
        let events = futures::stream::unfold(generation, |mut generation| async move {
            let event = generation.next_event().await?;
            Some((Ok::<_, Infallible>(Bytes::from(event)), generation))
        });
        return Ok((
            [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
            Body::from_stream(events),
        )
            .into_response());
    }
    Ok(Json(generation.run_to_end().await).into_response())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Tokens,
    Usage,
    Done,
    End,
}

/// One request's output, as a whole body or as SSE events.
struct Generation {
    state: Arc<AppState>,
    kind: Kind,
    id: String,
    sequence: Sequence,
    include_usage: bool,
    phase: Phase,
    /// The text streamed so far (Responses and Messages streams repeat it at the end).
    text: String,
    /// The streamed output item (Responses) or content block (Messages), once opened by the
    /// first token.
    item_id: Option<String>,
    /// The next Responses event's `sequence_number`.
    sequence_number: u64,
    /// A prefill leg's internal request id (its blocks are held under it).
    prefill_of: Option<String>,
    /// The prefill's `remote_prefill_cached_tokens`, reported as this request's cached tokens.
    cached_override: Option<usize>,
}

impl Generation {
    async fn next_text(&mut self) -> Option<String> {
        let k = self.sequence.next_token().await?;
        Some(self.state.filler(k).1.clone())
    }

    /// `cached_tokens` as vLLM reports it: a remote prefill's own hits when its parameters
    /// carried them, else the prompt tokens not computed here (hits and loaded).
    fn cached_tokens(&self) -> usize {
        self.cached_override
            .unwrap_or_else(|| self.sequence.cached_tokens())
    }

    /// A finished prefill leg's answer for the decode, as `NixlConnectorScheduler.request_finished`
    /// builds it (pull mode, one KV-cache group, no parallelism) with the scheduler's
    /// `remote_prefill_cached_tokens`; `null` for any other request.
    fn kv_transfer_params(&self) -> Value {
        let (Some(request_id), Some(held), Some(config)) = (
            &self.prefill_of,
            self.sequence.held(),
            &self.state.kv_transfer,
        ) else {
            return Value::Null;
        };
        let side_channel = self.state.side_channel;
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [held.block_ids],
            "remote_engine_id": config.engine_id,
            "remote_request_id": request_id,
            "remote_host": side_channel.ip().to_string(),
            "remote_port": side_channel.port(),
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": held.computed_tokens,
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": self.sequence.cached_tokens(),
        })
    }

    fn usage(&self) -> Value {
        let prompt = self.sequence.prompt_len();
        let completion = self.sequence.generated();
        json!({"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()}})
    }

    /// The Responses API's usage, as vLLM's `responses_full_generator` reports it.
    fn responses_usage(&self) -> Value {
        let prompt = self.sequence.prompt_len();
        let output = self.sequence.generated();
        json!({"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "input_tokens_details": {"cached_tokens": self.cached_tokens()},
            "output_tokens_details": {"reasoning_tokens": 0}})
    }

    /// The Messages API's final usage as vLLM converts the chat usage: Anthropic counts
    /// `input_tokens` beside the cache reads, so the cached tokens are taken out of the prompt.
    fn messages_usage(&self) -> Value {
        let cached = self.cached_tokens();
        json!({"input_tokens": self.sequence.prompt_len().saturating_sub(cached),
            "output_tokens": self.sequence.generated(), "cache_read_input_tokens": cached})
    }

    /// A Responses API body; `output` and `usage` as they stand at `status`.
    fn responses_body(&self, status: &str, output: Value, usage: Value) -> Value {
        let incomplete_details = match status {
            "incomplete" => json!({"reason": "max_output_tokens"}),
            _ => Value::Null,
        };
        json!({"id": self.id, "object": "response", "created_at": unix_seconds(),
            "model": self.state.model_name, "status": status,
            "incomplete_details": incomplete_details, "output": output, "usage": usage})
    }

    async fn run_to_end(&mut self) -> Value {
        let mut text = String::new();
        while let Some(piece) = self.next_text().await {
            text.push_str(&piece);
        }
        let state = &self.state;
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": unix_seconds(),
                "model": state.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length",
                    "stop_reason": null, "prompt_logprobs": null}],
                "usage": self.usage(), "service_tier": null, "system_fingerprint": null,
                "kv_transfer_params": self.kv_transfer_params(),
            }),
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": unix_seconds(),
                "model": state.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                    "refusal": null, "annotations": null, "audio": null, "function_call": null,
                    "tool_calls": [], "reasoning_content": null},
                    "logprobs": null, "finish_reason": "length", "stop_reason": null}],
                "service_tier": null, "system_fingerprint": null, "usage": self.usage(),
                "prompt_logprobs": null, "kv_transfer_params": self.kv_transfer_params(),
            }),
            Kind::Responses => {
                let output = json!([{"type": "message", "id": format!("msg_{}", self.id),
                    "role": "assistant", "status": "incomplete",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}]);
                let mut body = self.responses_body("incomplete", output, self.responses_usage());
                if let Some(map) = body.as_object_mut() {
                    map.insert("kv_transfer_params".to_owned(), self.kv_transfer_params());
                }
                body
            }
            Kind::Messages => {
                let mut body = json!({
                    "id": self.id, "type": "message", "role": "assistant",
                    "model": state.model_name,
                    "content": [{"type": "text", "text": text}],
                    "stop_reason": "max_tokens", "stop_sequence": null,
                    "usage": self.messages_usage(),
                });
                // Dumped without its `None` fields.
                let params = self.kv_transfer_params();
                if let (false, Some(map)) = (params.is_null(), body.as_object_mut()) {
                    map.insert("kv_transfer_params".to_owned(), params);
                }
                body
            }
        }
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat | Kind::Responses | Kind::Messages => "chat.completion.chunk",
        };
        let mut chunk = json!({"id": self.id, "object": object, "created": unix_seconds(),
            "model": self.state.model_name, "choices": choices});
        if let (Some(usage), Some(map)) = (usage, chunk.as_object_mut()) {
            map.insert("usage".to_owned(), usage);
        }
        format!("data: {chunk}\n\n")
    }

    /// An event of a Responses stream: named by its type on an `event:` line, numbered in
    /// stream order from 0 (vLLM's `_convert_stream_to_sse_events`).
    fn responses_event(&mut self, kind: &str, mut fields: Value) -> String {
        if let Some(map) = fields.as_object_mut() {
            map.insert("type".to_owned(), kind.into());
            map.insert("sequence_number".to_owned(), self.sequence_number.into());
        }
        self.sequence_number += 1;
        format!("event: {kind}\ndata: {fields}\n\n")
    }

    /// An event of a Messages stream, as vLLM's `message_stream_converter` wraps it.
    fn messages_event(kind: &str, mut fields: Value) -> String {
        if let Some(map) = fields.as_object_mut() {
            map.insert("type".to_owned(), kind.into());
        }
        format!("event: {kind}\ndata: {fields}\n\n")
    }

    /// The streamed Responses output message; `text` is its content once done.
    fn responses_item(item_id: &str, status: &str, content: Value) -> Value {
        json!({"id": item_id, "content": content, "role": "assistant", "status": status,
            "type": "message", "phase": null})
    }

    /// The events opening a stream: (chat) a role delta; (Responses) `response.created` and
    /// `response.in_progress` with the response as it starts; (Messages) `message_start`, whose
    /// usage is the prompt's length alone, as vLLM takes it from the chat stream's first chunk.
    fn start_events(&mut self) -> Option<String> {
        match self.kind {
            Kind::Completion => None,
            Kind::Chat => {
                let delta = json!([{"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null}]);
                Some(self.chunk(delta, None))
            }
            Kind::Responses => {
                let response = self.responses_body("in_progress", json!([]), Value::Null);
                let created =
                    self.responses_event("response.created", json!({"response": response}));
                let in_progress =
                    self.responses_event("response.in_progress", json!({"response": response}));
                Some(created + &in_progress)
            }
            Kind::Messages => {
                let message = json!({"id": self.id, "type": "message", "role": "assistant",
                    "content": [], "model": self.state.model_name, "stop_reason": null,
                    "stop_sequence": null,
                    "usage": {"input_tokens": self.sequence.prompt_len(), "output_tokens": 0}});
                Some(Self::messages_event(
                    "message_start",
                    json!({"message": message}),
                ))
            }
        }
    }

    /// The events carrying one token's `text`; a Responses or Messages stream opens its
    /// output item or content block with the first.
    fn token_events(&mut self, text: String) -> String {
        let finish = (self.sequence.remaining() == 0).then_some("length");
        match self.kind {
            Kind::Completion => {
                let choice = json!([{"index": 0, "text": text, "logprobs": null,
                    "finish_reason": finish, "stop_reason": null}]);
                self.chunk(choice, None)
            }
            Kind::Chat => {
                let choice = json!([{"index": 0, "delta": {"content": text},
                    "logprobs": null, "finish_reason": finish}]);
                self.chunk(choice, None)
            }
            Kind::Responses => {
                let mut events = String::new();
                let item_id = match &self.item_id {
                    Some(id) => id.clone(),
                    None => {
                        let id = format!("msg_{}", self.id);
                        self.item_id = Some(id.clone());
                        let item = Self::responses_item(&id, "in_progress", json!([]));
                        events += &self.responses_event(
                            "response.output_item.added",
                            json!({"item": item, "output_index": 0}),
                        );
                        events += &self.responses_event(
                            "response.content_part.added",
                            json!({"content_index": 0, "item_id": id, "output_index": 0,
                                "part": {"annotations": [], "text": "", "type": "output_text",
                                    "logprobs": []}}),
                        );
                        id
                    }
                };
                self.text.push_str(&text);
                events += &self.responses_event(
                    "response.output_text.delta",
                    json!({"content_index": 0, "delta": text, "item_id": item_id,
                        "logprobs": [], "output_index": 0}),
                );
                events
            }
            Kind::Messages => {
                let mut events = String::new();
                if self.item_id.is_none() {
                    self.item_id = Some(String::new());
                    events += &Self::messages_event(
                        "content_block_start",
                        json!({"content_block": {"type": "text", "text": ""}, "index": 0}),
                    );
                }
                self.text.push_str(&text);
                events += &Self::messages_event(
                    "content_block_delta",
                    json!({"delta": {"type": "text_delta", "text": text}, "index": 0}),
                );
                events
            }
        }
    }

    /// The events after the last token: (completions, chat) the usage chunk if asked for;
    /// (Responses) the item's done events and `response.completed` with the usage;
    /// (Messages) `content_block_stop` and `message_delta` with the usage.
    fn end_events(&mut self) -> Option<String> {
        match self.kind {
            Kind::Completion | Kind::Chat => self
                .include_usage
                .then(|| self.chunk(json!([]), Some(self.usage()))),
            Kind::Responses => {
                let mut events = String::new();
                let mut output = Vec::new();
                if let Some(item_id) = self.item_id.clone() {
                    let text = std::mem::take(&mut self.text);
                    events += &self.responses_event(
                        "response.output_text.done",
                        json!({"content_index": 0, "item_id": item_id, "logprobs": [],
                            "output_index": 0, "text": text}),
                    );
                    let part = json!({"annotations": [], "text": text, "type": "output_text",
                        "logprobs": null});
                    events += &self.responses_event(
                        "response.content_part.done",
                        json!({"content_index": 0, "item_id": item_id, "output_index": 0,
                            "part": part}),
                    );
                    let item = Self::responses_item(&item_id, "completed", json!([part]));
                    events += &self.responses_event(
                        "response.output_item.done",
                        json!({"item": item, "output_index": 0}),
                    );
                    output.push(item);
                }
                let response =
                    self.responses_body("incomplete", Value::Array(output), self.responses_usage());
                events +=
                    &self.responses_event("response.completed", json!({"response": response}));
                Some(events)
            }
            Kind::Messages => {
                let mut events = String::new();
                if self.item_id.is_some() {
                    events += &Self::messages_event("content_block_stop", json!({"index": 0}));
                }
                events += &Self::messages_event(
                    "message_delta",
                    json!({"delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                        "usage": self.messages_usage()}),
                );
                Some(events)
            }
        }
    }

    /// The next piece of vLLM's stream (one SSE event, or several emitted together): the
    /// opening events, the events of each token (the last with `finish_reason`), the closing
    /// events, then `[DONE]` (completions, chat) or `message_stop` (Messages); a Responses
    /// stream ends with `response.completed`.
    async fn next_event(&mut self) -> Option<String> {
        loop {
            match self.phase {
                Phase::Start => {
                    self.phase = Phase::Tokens;
                    if let Some(events) = self.start_events() {
                        return Some(events);
                    }
                }
                Phase::Tokens => {
                    let Some(text) = self.next_text().await else {
                        self.phase = Phase::Usage;
                        continue;
                    };
                    // vLLM's Responses and Messages converters skip empty deltas.
                    if text.is_empty() && matches!(self.kind, Kind::Responses | Kind::Messages) {
                        continue;
                    }
                    return Some(self.token_events(text));
                }
                Phase::Usage => {
                    self.sequence.finish();
                    self.phase = Phase::Done;
                    if let Some(events) = self.end_events() {
                        return Some(events);
                    }
                }
                Phase::Done => {
                    self.phase = Phase::End;
                    match self.kind {
                        Kind::Completion | Kind::Chat => {
                            return Some("data: [DONE]\n\n".to_owned());
                        }
                        Kind::Messages => {
                            return Some(Self::messages_event("message_stop", json!({})));
                        }
                        Kind::Responses => {}
                    }
                }
                Phase::End => return None,
            }
        }
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(&state.engines, &state.model_name);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// SGLang's `/server_info`; 404 for a vLLM simulator.
async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    match &state.server_info {
        Some(info) => Json(info.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// SGLang's `/flush_cache`: every rank's radix cache emptied, answered in SGLang's words; 404
/// for a vLLM simulator (its endpoint is `/reset_prefix_cache`).
async fn flush_cache(State(state): State<Arc<AppState>>) -> Response {
    if state.server_info.is_none() {
        return StatusCode::NOT_FOUND.into_response();
    }
    let mut success = true;
    for engine in &state.engines {
        success &= engine.reset_prefix_cache();
    }
    if success {
        (
            StatusCode::OK,
            "Cache flushed.\nPlease check backend logs for more details. (When there are running \
             or waiting requests, the operation will not be performed.)\n",
        )
            .into_response()
    } else {
        (StatusCode::BAD_REQUEST, "Flush cache failed.\n").into_response()
    }
}

/// Resets every rank's prefix cache (vLLM's API server asks every engine).
async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Response {
    if state.server_info.is_some() {
        // SGLang's is `/flush_cache`.
        return StatusCode::NOT_FOUND.into_response();
    }
    let mut success = true;
    for engine in &state.engines {
        success &= engine.reset_prefix_cache();
    }
    Json(json!({"success": success})).into_response()
}

/// `?dp_rank=N`: which rank's blocks (default 0).
#[derive(Debug, Default, Deserialize)]
struct DebugBlocksQuery {
    dp_rank: Option<usize>,
}

async fn debug_blocks(
    State(state): State<Arc<AppState>>,
    axum::extract::Query(query): axum::extract::Query<DebugBlocksQuery>,
) -> Result<Json<Value>, ApiError> {
    let rank = query.dp_rank.unwrap_or(0);
    let engine = state
        .engines
        .get(rank)
        .ok_or_else(|| ApiError::bad_request(format!("no data-parallel rank {rank}")))?;
    let geometry = engine.geometry();
    let (published_batches, blocks) = engine.held_blocks_at();
    // Every block is in vLLM's GPU block pool.
    let blocks: Vec<Value> = blocks
        .iter()
        .map(|b| json!({"hash": b.hash, "medium": "GPU", "ref_cnt": b.ref_cnt}))
        .collect();
    Ok(Json(json!({
        "block_size": geometry.block_size,
        "num_blocks": geometry.num_blocks,
        "published_batches": published_batches,
        "blocks": blocks,
    })))
}

/// `GET /debug/requests`: the last generation requests received, oldest first, each with its
/// `X-Request-Id`, its body as sent, its role in a disaggregated request and what the engine
/// made of its prompt (`computed_tokens`, `local_cached_tokens`, `external_tokens`).
async fn debug_requests(State(state): State<Arc<AppState>>) -> Json<Value> {
    let requests: Vec<Value> = state.request_log.lock().iter().cloned().collect();
    Json(json!({"requests": requests}))
}

/// `GET /debug/kv_transfer`: the prefill blocks held for decodes and the transfer counters.
async fn debug_kv_transfer(State(state): State<Arc<AppState>>) -> Json<Value> {
    let engine = state.first_engine();
    let counters = &engine.counters;
    let held: Vec<Value> = engine
        .held_prefills()
        .into_iter()
        .map(|(id, blocks)| json!({"remote_request_id": id, "remote_block_ids": [blocks]}))
        .collect();
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    Json(json!({
        "kv_connector": state.kv_transfer.as_ref().map(|_| "NixlConnector"),
        "engine_id": state.kv_transfer.as_ref().map(|c| c.engine_id.clone()),
        "kv_role": state.kv_transfer.as_ref().map(|c| c.kv_role.clone()),
        "held": held,
        "reads_served": load(&counters.kv_reads_served),
        "reads_refused": load(&counters.kv_reads_refused),
        "leases_expired": load(&counters.kv_leases_expired),
        "params_ignored": load(&state.params_ignored),
        "load_failures": load(&state.load_failures),
    }))
}

/// A decode simulator's read of held blocks.
#[derive(Debug, Deserialize)]
struct NixlRead {
    remote_engine_id: String,
    remote_request_id: String,
    remote_block_ids: Value,
}

/// `POST /sim/nixl/read`: the simulator's stand-in for NIXL's side channel, handshake, read
/// and completion notification in one: the token ids whose KV the blocks held for
/// `remote_request_id` hold, and the hold ends; 404 with the reason when this engine is not
/// `remote_engine_id` or holds nothing under that id (never, already read, lease expired).
async fn nixl_read(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let refuse =
        |reason: String| (StatusCode::NOT_FOUND, Json(json!({"error": reason}))).into_response();
    let read: NixlRead = match parse(&body) {
        Ok(read) => read,
        Err(error) => return error.into_response(),
    };
    let Some(config) = &state.kv_transfer else {
        return refuse("this engine has no KV connector".to_owned());
    };
    if read.remote_engine_id != config.engine_id {
        return refuse(format!("unknown engine {:?}", read.remote_engine_id));
    }
    let Ok(source) = RemoteSource::from_params(&serde_json::Map::from_iter([
        ("remote_block_ids".to_owned(), read.remote_block_ids),
        ("remote_engine_id".to_owned(), read.remote_engine_id.into()),
        (
            "remote_request_id".to_owned(),
            read.remote_request_id.clone().into(),
        ),
        ("remote_host".to_owned(), "".into()),
        ("remote_port".to_owned(), 0.into()),
    ])) else {
        return ApiError::bad_request("remote_block_ids must be a non-empty list of block numbers")
            .into_response();
    };
    match state
        .first_engine()
        .read_held(&read.remote_request_id, &source.block_ids)
    {
        Ok(tokens) => Json(json!({"token_ids": &tokens[..]})).into_response(),
        Err(refusal) => refuse(refusal.to_string()),
    }
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
