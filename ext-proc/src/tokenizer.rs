//! The tokenization tier: prompt → token ids, as the engine computes them.
//!
//! A pool's [`Tokenizer`] is in-process ([`InProcessTokenizer`]: the model folder's HF tokenizer
//! and chat template via `kvroute-tokenize`, run on the blocking pool so a slow encode cannot stall
//! the decision's timer), remote ([`RemoteTokenizer`]: a vLLM-compatible `/tokenize`) or render
//! ([`RenderTokenizer`]: the whole request to the engine's `/v1/.../render` endpoint matching its
//! own, vLLM 0.32 with `--enable-scale-out`: the engine's prompt tokens, exact by construction).
//! `/v1/responses` and `/v1/messages` requests are converted to the chat vLLM renders for them
//! (`kvroute_tokenize::apis`) in process and for `/tokenize`; render mode posts them as sent.
//!
//! [`TokenCache`] keeps recent results keyed by (pool, prompt hash). For chat it also keys every
//! conversation prefix (messages `0..k`), so turn *n+1* of a conversation finds turn *n*'s tokens:
//! the decision routes on those (they are a token prefix of the new prompt for templates that
//! render messages one after another), estimates the tail's length, and the exact tokenization of
//! the whole new conversation is computed off the decision path for the next turn.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_block_keys::{ChainPoint, KeyError};
use kvroute_tokenize::{ApiKind, LeadingTokens, ModelTokenizer, ResumableTokens, ResumePoint};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::value::RawValue;
use tokio_util::task::TaskTracker;
use xxhash_rust::xxh3::Xxh3;

use crate::config::{Config, TokenizerSource};
use crate::error::{ConfigError, TokenizeError};
use crate::lru::Lru;
use crate::metrics::Metrics;
use crate::request::{ChatFields, Prompt};
use background::BackgroundLane;

/// Rough bytes per token, to estimate the length of text that was not tokenized.
const ESTIMATED_BYTES_PER_TOKEN: usize = 4;
/// Largest accepted `/tokenize` or render response body.
const MAX_TOKENIZE_RESPONSE_BYTES: usize = 64 * 1024 * 1024;

/// What a tokenizer is asked to tokenize (owned: it may run on another thread).
#[derive(Debug)]
pub enum TokenizeInput {
    /// Completion text.
    Text {
        /// The text.
        text: String,
        /// vLLM's `add_special_tokens`.
        add_special_tokens: bool,
    },
    /// Chat messages (the raw JSON array), rendered with the model's template.
    Chat {
        /// The `messages` array as sent.
        messages: Box<RawValue>,
        /// vLLM's `add_generation_prompt`.
        add_generation_prompt: bool,
        /// The request's other prompt-changing fields.
        fields: ChatInputFields,
    },
    /// A Responses or Messages API request's prompt-changing fields (a JSON object).
    Api {
        /// Which API.
        api: ApiKind,
        /// The fields, as sent.
        request: Box<RawValue>,
    },
}

/// [`ChatFields`] owned: the chat request's prompt-changing fields besides `messages`.
#[derive(Debug, Clone, Default)]
pub struct ChatInputFields {
    /// `continue_final_message`.
    pub continue_final_message: bool,
    /// `add_special_tokens` (default false for chat).
    pub add_special_tokens: bool,
    /// `tools`, raw.
    pub tools: Option<Box<RawValue>>,
    /// `documents`, raw.
    pub documents: Option<Box<RawValue>>,
    /// `chat_template_kwargs`, raw.
    pub chat_template_kwargs: Option<Box<RawValue>>,
    /// `reasoning_effort`.
    pub reasoning_effort: Option<String>,
    /// Whether the request carries its own `chat_template`.
    pub request_template: bool,
}

impl ChatInputFields {
    /// Copies the borrowed fields.
    pub fn from_request(fields: &ChatFields<'_>) -> Self {
        Self {
            continue_final_message: fields.continue_final_message,
            add_special_tokens: fields.add_special_tokens,
            tools: fields.tools.map(ToOwned::to_owned),
            documents: fields.documents.map(ToOwned::to_owned),
            chat_template_kwargs: fields.chat_template_kwargs.map(ToOwned::to_owned),
            reasoning_effort: fields.reasoning_effort.as_deref().map(str::to_owned),
            request_template: fields.request_template,
        }
    }

    /// The fields of a converted chat's options (raw JSON again, for the `/tokenize` body).
    fn from_options(options: &kvroute_tokenize::ChatOptions) -> Self {
        let raw = |value: Option<serde_json::Value>| {
            value.and_then(|v| RawValue::from_string(v.to_string()).ok())
        };
        Self {
            continue_final_message: options.continue_final_message,
            add_special_tokens: options.add_special_tokens,
            tools: raw(options.tools.clone()),
            documents: raw(options.documents.clone()),
            chat_template_kwargs: raw(options
                .chat_template_kwargs
                .clone()
                .map(serde_json::Value::Object)),
            reasoning_effort: options.reasoning_effort.clone(),
            request_template: options.request_template,
        }
    }

    /// The options `kvroute-tokenize` renders with.
    fn chat_options(
        &self,
        add_generation_prompt: bool,
    ) -> Result<kvroute_tokenize::ChatOptions, TokenizeError> {
        let json =
            |raw: &Option<Box<RawValue>>| -> Result<Option<serde_json::Value>, TokenizeError> {
                raw.as_ref()
                    .map(|r| serde_json::from_str(r.get()))
                    .transpose()
                    .map_err(|e| TokenizeError::InProcess {
                        reason: e.to_string(),
                    })
            };
        let chat_template_kwargs = match json(&self.chat_template_kwargs)? {
            None => None,
            Some(serde_json::Value::Object(map)) => Some(map),
            Some(_) => {
                return Err(TokenizeError::InProcess {
                    reason: "chat_template_kwargs must be an object".to_owned(),
                });
            }
        };
        Ok(kvroute_tokenize::ChatOptions {
            add_generation_prompt,
            continue_final_message: self.continue_final_message,
            add_special_tokens: self.add_special_tokens,
            tools: json(&self.tools)?,
            documents: json(&self.documents)?,
            reasoning_effort: self.reasoning_effort.clone(),
            chat_template_kwargs,
            request_template: self.request_template,
            messages_validated: true,
        })
    }

    /// Feeds every field into a cache key.
    fn hash_into(&self, hasher: &mut Xxh3) {
        hasher.update(&[
            u8::from(self.continue_final_message),
            u8::from(self.add_special_tokens),
            u8::from(self.request_template),
        ]);
        let raw = [&self.tools, &self.documents, &self.chat_template_kwargs];
        for part in raw {
            hash_optional(hasher, part.as_ref().map(|r| r.get().as_bytes()));
        }
        hash_optional(hasher, self.reasoning_effort.as_deref().map(str::as_bytes));
    }
}

fn hash_optional(hasher: &mut Xxh3, part: Option<&[u8]>) {
    match part {
        None => hasher.update(&[0]),
        Some(bytes) => {
            hasher.update(&[1]);
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        }
    }
}

impl TokenizeInput {
    /// Size of the text or the raw messages JSON, in bytes.
    pub fn len_bytes(&self) -> usize {
        match self {
            Self::Text { text, .. } => text.len(),
            Self::Api { request, .. } => request.get().len(),
            Self::Chat {
                messages, fields, ..
            } => {
                let raw = [
                    &fields.tools,
                    &fields.documents,
                    &fields.chat_template_kwargs,
                ];
                messages.get().len()
                    + raw
                        .iter()
                        .filter_map(|r| r.as_ref())
                        .map(|r| r.get().len())
                        .sum::<usize>()
            }
        }
    }
}

/// Boxed future returned by [`Tokenizer::tokenize`].
pub type TokenizeFuture = Pin<Box<dyn Future<Output = Result<Vec<u32>, TokenizeError>> + Send>>;

/// Boxed future returned by [`Tokenizer::tokenize_leading`].
pub type LeadingFuture = Pin<Box<dyn Future<Output = Result<LeadingTokens, TokenizeError>> + Send>>;

/// A source of token ids for one pool.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    /// Token ids of `input` for `model` (base or adapter name, as the client sent it).
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture;

    /// The exact first tokens of `input`'s prompt from its (rendered) text up to the first exact
    /// cut at or after `min_bytes` ([`kvroute_tokenize::leading_cut`]); `None` when this
    /// tokenizer cannot (the default: remote tokenizers, HF-only models, API requests).
    fn tokenize_leading(
        &self,
        _model: &str,
        _input: Arc<TokenizeInput>,
        _min_bytes: usize,
    ) -> Option<LeadingFuture> {
        None
    }

    /// How long a request whose conversation prefix is cached waits for its exact tokens before
    /// it routes on that prefix (within the tokenize budget). In process: `PREFIX_HIT_WAIT` (5 ms).
    fn prefix_hit_wait(&self) -> Duration {
        PREFIX_HIT_WAIT
    }

    /// Token ids of a request whose whole `body` is at hand: [`Self::tokenize`] of its prompt
    /// unless the tokenizer sends the request itself somewhere ([`RenderTokenizer`]).
    fn tokenize_request(
        &self,
        model: &str,
        input: Arc<TokenizeInput>,
        _body: &[u8],
    ) -> TokenizeFuture {
        self.tokenize(model, input)
    }

    /// `input`'s tokens computed on the calling thread, for tokenizers that run in this process
    /// (`None`, the default, elsewhere): what [`TokenCache`]'s low-priority lane runs to fill
    /// the cache for a conversation's next turn.
    fn tokenize_now(&self, _input: &TokenizeInput) -> Option<Result<Vec<u32>, TokenizeError>> {
        None
    }

    /// A chat's tokens computed on the calling thread, taking over the first tokens of an
    /// earlier turn of the conversation when `prior` (its resume point and tokens) applies, and
    /// naming where the turn after can take over this one's
    /// ([`ModelTokenizer::encode_chat_resumable`]); `None` (the default) for tokenizers that do
    /// not run in this process or cannot, and for inputs other than chats.
    fn tokenize_resumable(
        &self,
        _input: &TokenizeInput,
        _prior: Option<(&ResumePoint, &[u32])>,
    ) -> Option<Result<ResumableTokens, TokenizeError>> {
        None
    }

    /// How it computes them (what `kvroute-check` reports); [`TokenizerMode::Other`] unless
    /// overridden.
    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Other
    }

    /// Whether tokenizing `input` (only its leading tokens when `leading`) runs on a blocking
    /// thread of this process. [`TokenCache`] then takes one of its slots first, within the
    /// decision's budget, and holds it until the work ends, even once the decision stopped
    /// waiting; such work is also subject to its prompt-size limit. No, unless overridden.
    fn runs_blocking(&self, _input: &TokenizeInput, _leading: bool) -> bool {
        false
    }
}

/// How a [`Tokenizer`] computes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerMode {
    /// In process, with `kvroute-tokenize`'s fast byte-level BPE encoder (checked against HF at
    /// load).
    InProcessFast,
    /// In process, with the Hugging Face `tokenizers` crate.
    InProcessHf,
    /// A remote vLLM-compatible `/tokenize`.
    Remote,
    /// The engine's render endpoints (`/v1/chat/completions/render` and the like).
    Render,
    /// Another implementation (tests, embedders).
    Other,
}

impl TokenizerMode {
    /// Where the tokens are computed: `in_process`, `remote`, `render` or `other`.
    pub fn location(self) -> &'static str {
        match self {
            Self::InProcessFast | Self::InProcessHf => "in_process",
            Self::Remote => "remote",
            Self::Render => "render",
            Self::Other => "other",
        }
    }

    /// The in-process encoder, `fast` or `hf` (`None` elsewhere).
    pub fn encoder(self) -> Option<&'static str> {
        match self {
            Self::InProcessFast => Some("fast"),
            Self::InProcessHf => Some("hf"),
            Self::Remote | Self::Render | Self::Other => None,
        }
    }
}

/// Builds the tokenizer a pool's `source` names (`None` for [`TokenizerSource::None`]); `pool`
/// is the pool's index, for the error's field name. Loading a model folder is slow (it checks
/// the fast encoder against HF).
pub fn from_source(
    source: &TokenizerSource,
    pool: usize,
    tasks: &TaskTracker,
) -> Result<Option<Arc<dyn Tokenizer>>, ConfigError> {
    Ok(match source {
        TokenizerSource::None => None,
        TokenizerSource::ModelDir(dir) => {
            let loaded = InProcessTokenizer::load(dir, tasks.clone()).map_err(|e| {
                ConfigError::Tokenizer {
                    field: format!("pools[{pool}].tokenizer.model_dir"),
                    path: dir.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
            Some(Arc::new(loaded))
        }
        TokenizerSource::Remote { url, timeout } => {
            Some(Arc::new(RemoteTokenizer::new(url.clone(), *timeout)))
        }
        TokenizerSource::Render { url, timeout } => {
            tracing::info!(pool, %url, ?timeout, "tokens from the engine's render endpoints");
            Some(Arc::new(RenderTokenizer::new(url.clone(), *timeout)))
        }
    })
}

/// Largest input tokenized on the calling task rather than a blocking thread, when the model
/// has the fast encoder: ≈ 4k tokens, ≈ 0.2 ms (`cargo bench -p kvroute-tokenize --bench encode`).
const INLINE_MAX_BYTES: usize = 16 * 1024;

/// The model folder's tokenizer, in this process.
#[derive(Debug, Clone)]
pub struct InProcessTokenizer {
    model: Arc<ModelTokenizer>,
    tasks: TaskTracker,
}

impl InProcessTokenizer {
    /// Wraps an already loaded tokenizer.
    pub fn new(model: Arc<ModelTokenizer>, tasks: TaskTracker) -> Self {
        Self { model, tasks }
    }

    /// Loads a Hugging Face model folder.
    pub fn load(dir: &std::path::Path, tasks: TaskTracker) -> Result<Self, TokenizeError> {
        let model = ModelTokenizer::from_dir(dir).map_err(|e| TokenizeError::InProcess {
            reason: format!("{e:#}"),
        })?;
        Ok(Self::new(Arc::new(model), tasks))
    }
}

impl InProcessTokenizer {
    /// Whether `input` is tokenized whole on the calling task.
    fn inline(&self, input: &TokenizeInput) -> bool {
        self.model.uses_fast_path() && input.len_bytes() <= INLINE_MAX_BYTES
    }

    /// Whether [`Tokenizer::tokenize_leading`] answers for `input`.
    fn gives_leading(&self, input: &TokenizeInput) -> bool {
        self.model.uses_fast_path() && !matches!(input, TokenizeInput::Api { .. })
    }
}

impl Tokenizer for InProcessTokenizer {
    fn mode(&self) -> TokenizerMode {
        if self.model.uses_fast_path() {
            TokenizerMode::InProcessFast
        } else {
            TokenizerMode::InProcessHf
        }
    }

    fn runs_blocking(&self, input: &TokenizeInput, leading: bool) -> bool {
        if leading {
            self.gives_leading(input) && input.len_bytes() > INLINE_LEADING_MAX_BYTES
        } else {
            !self.inline(input)
        }
    }

    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        if self.inline(&input) {
            // Tens of microseconds: cheaper here than the hop to a blocking thread and back.
            let result = encode(&self.model, &input);
            return Box::pin(std::future::ready(result));
        }
        let model = Arc::clone(&self.model);
        let task = self.tasks.spawn_blocking(move || encode(&model, &input));
        Box::pin(async move {
            task.await.map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })?
        })
    }

    fn tokenize_now(&self, input: &TokenizeInput) -> Option<Result<Vec<u32>, TokenizeError>> {
        Some(encode(&self.model, input))
    }

    fn tokenize_resumable(
        &self,
        input: &TokenizeInput,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Option<Result<ResumableTokens, TokenizeError>> {
        let TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            fields,
        } = input
        else {
            return None;
        };
        if !self.model.uses_fast_path() {
            return None;
        }
        Some((|| {
            let messages = chat_messages(messages)?;
            let options = fields.chat_options(*add_generation_prompt)?;
            self.model
                .encode_chat_resumable(&messages, &options, prior)
                .map_err(failed)
        })())
    }

    fn tokenize_leading(
        &self,
        _model: &str,
        input: Arc<TokenizeInput>,
        min_bytes: usize,
    ) -> Option<LeadingFuture> {
        if !self.gives_leading(&input) {
            return None;
        }
        // The whole body is parsed and rendered (cheap), only the leading part encoded: a
        // fraction of a millisecond up to a few hundred KiB, so on the calling task.
        if input.len_bytes() <= INLINE_LEADING_MAX_BYTES {
            return Some(Box::pin(std::future::ready(encode_leading(
                &self.model,
                &input,
                min_bytes,
            ))));
        }
        let model = Arc::clone(&self.model);
        let task = self
            .tasks
            .spawn_blocking(move || encode_leading(&model, &input, min_bytes));
        Some(Box::pin(async move {
            task.await.map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })?
        }))
    }
}

/// Largest chat (bytes of messages) whose next turn is tokenized from the turn before on the
/// calling task ([`Tokenizer::tokenize_resumable`]): past it the parse, render and block keys of
/// the whole chat cost more than routing on the cached turn at once and leaving the exact tokens
/// to the background lane (which resumes too): 32k-token hits measured 2.2× the no-op ext_proc
/// resumed inline against 2.0× so (docs/benchmarks-history-2026-12.md, "Latency through Envoy with real
/// tokenizers").
const RESUME_INLINE_MAX_BYTES: usize = 32 * 1024;

/// Largest input whose leading part is tokenized on the calling task (parse and render of
/// ≈ 256 KiB ≈ 0.5 ms, `kvroute-latency-bench --bench stages`).
const INLINE_LEADING_MAX_BYTES: usize = 256 * 1024;

/// [`encode`]'s leading variant (completion text and chat; API requests are not called here).
fn encode_leading(
    model: &ModelTokenizer,
    input: &TokenizeInput,
    min_bytes: usize,
) -> Result<LeadingTokens, TokenizeError> {
    match input {
        TokenizeInput::Text {
            text,
            add_special_tokens,
        } => model
            .encode_prompt_leading(text, *add_special_tokens, min_bytes)
            .map_err(failed),
        TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            fields,
        } => {
            let messages = chat_messages(messages)?;
            let options = fields.chat_options(*add_generation_prompt)?;
            model
                .encode_chat_leading(&messages, &options, min_bytes)
                .map_err(failed)
        }
        TokenizeInput::Api { .. } => Err(TokenizeError::InProcess {
            reason: "no leading tokens for API requests".to_owned(),
        }),
    }
}

/// An in-process tokenizer's failure as a decision's tokenize error.
fn failed(e: kvroute_tokenize::TokenizeError) -> TokenizeError {
    TokenizeError::InProcess {
        reason: e.to_string(),
    }
}

/// A chat request's `messages`, as the template renders them.
fn chat_messages(messages: &RawValue) -> Result<serde_json::Value, TokenizeError> {
    serde_json::from_str(messages.get()).map_err(|e| TokenizeError::InProcess {
        reason: e.to_string(),
    })
}

fn encode(model: &ModelTokenizer, input: &TokenizeInput) -> Result<Vec<u32>, TokenizeError> {
    match input {
        TokenizeInput::Text {
            text,
            add_special_tokens,
        } => model
            .encode_prompt(text, *add_special_tokens)
            .map_err(failed),
        TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            fields,
        } => {
            let messages = chat_messages(messages)?;
            let options = fields.chat_options(*add_generation_prompt)?;
            model.encode_chat_with(&messages, &options).map_err(failed)
        }
        TokenizeInput::Api { api, request } => {
            let request = api_request_object(request)?;
            model.encode_api_request(*api, &request).map_err(failed)
        }
    }
}

fn api_request_object(
    request: &RawValue,
) -> Result<serde_json::Map<String, serde_json::Value>, TokenizeError> {
    serde_json::from_str(request.get()).map_err(|e| TokenizeError::InProcess {
        reason: e.to_string(),
    })
}

fn http_client() -> Client<HttpConnector, Full<Bytes>> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

/// POSTs a JSON `body` (only `content-type` set: no client header is forwarded) and returns
/// the success response's body, at most [`MAX_TOKENIZE_RESPONSE_BYTES`].
async fn post_json(
    client: Client<HttpConnector, Full<Bytes>>,
    url: http::Uri,
    body: Bytes,
) -> Result<Bytes, String> {
    let request = http::Request::post(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{e:#}"))?;
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), MAX_TOKENIZE_RESPONSE_BYTES)
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("status {status}"));
    }
    Ok(body)
}

/// A vLLM-compatible `POST /tokenize` endpoint.
#[derive(Debug, Clone)]
pub struct RemoteTokenizer {
    url: http::Uri,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl RemoteTokenizer {
    /// A client for `url` with a per-call `timeout`.
    pub fn new(url: http::Uri, timeout: Duration) -> Self {
        Self {
            url,
            timeout,
            client: http_client(),
        }
    }

    async fn call(
        client: Client<HttpConnector, Full<Bytes>>,
        url: http::Uri,
        body: Vec<u8>,
    ) -> Result<Vec<u32>, String> {
        #[derive(serde::Deserialize)]
        struct TokenizeResponse {
            tokens: Vec<u32>,
        }
        let body = post_json(client, url, Bytes::from(body)).await?;
        let parsed: TokenizeResponse = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        Ok(parsed.tokens)
    }
}

impl RemoteTokenizer {
    /// The `/tokenize` body for `input`, or `None` when vLLM would refuse to render it (a
    /// request's own `chat_template`).
    pub fn request_body(model: &str, input: &TokenizeInput) -> Option<serde_json::Value> {
        match input {
            TokenizeInput::Text {
                text,
                add_special_tokens,
            } => Some(serde_json::json!({
                "model": model, "prompt": text, "add_special_tokens": add_special_tokens,
            })),
            // vLLM refuses an untrusted request template; never ask it to render one.
            TokenizeInput::Chat { fields, .. } if fields.request_template => None,
            TokenizeInput::Chat {
                messages,
                add_generation_prompt,
                fields,
            } => Some(remote_chat_body(
                model,
                messages,
                *add_generation_prompt,
                fields,
            )),
            // Converted without the engine's template at hand: inline system messages of a
            // Messages request stay in place (a template requiring system first then fails, a
            // counted fallback; render mode is exact there).
            TokenizeInput::Api { api, request } => {
                let request = api_request_object(request).ok()?;
                let chat = match api {
                    ApiKind::Responses => kvroute_tokenize::apis::responses_to_chat(&request),
                    ApiKind::Messages => kvroute_tokenize::apis::messages_to_chat(&request, false),
                }
                .ok()?;
                let messages = tokenize_chat_messages(chat.messages);
                let messages = RawValue::from_string(messages.to_string()).ok()?;
                let fields = ChatInputFields::from_options(&chat.options);
                Some(remote_chat_body(
                    model,
                    &messages,
                    chat.options.add_generation_prompt,
                    &fields,
                ))
            }
        }
    }
}

impl Tokenizer for RemoteTokenizer {
    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Remote
    }

    /// The whole budget: an engine is asked for exactness, and its round trip alone outlasts
    /// the in-process wait (routing on an older turn's prefix under-predicts every next turn).
    fn prefix_hit_wait(&self) -> Duration {
        Duration::MAX
    }

    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let Some(body) = Self::request_body(model, &input) else {
            return Box::pin(std::future::ready(Err(TokenizeError::Remote {
                url: self.url.to_string(),
                reason: "vLLM would refuse to render the request (its own chat_template, or a \
                         Responses/Messages request that does not convert)"
                    .to_owned(),
            })));
        };
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let (client, url, timeout) = (self.client.clone(), self.url.clone(), self.timeout);
        Box::pin(async move {
            match tokio::time::timeout(timeout, Self::call(client, url.clone(), body)).await {
                Ok(Ok(tokens)) => Ok(tokens),
                Ok(Err(reason)) => Err(TokenizeError::Remote {
                    url: url.to_string(),
                    reason,
                }),
                Err(_) => Err(TokenizeError::Timeout { after: timeout }),
            }
        })
    }
}

/// A converted conversation as `/tokenize`'s request model takes it: Responses' `input_text` /
/// `output_text` parts become `text` parts and an item's `type` goes (the chat path renders
/// both the same; `/tokenize` validates messages as chat messages and refuses them).
fn tokenize_chat_messages(mut messages: serde_json::Value) -> serde_json::Value {
    for message in messages.as_array_mut().into_iter().flatten() {
        let Some(message) = message.as_object_mut() else {
            continue;
        };
        message.shift_remove("type");
        let parts = message
            .get_mut("content")
            .and_then(serde_json::Value::as_array_mut);
        for part in parts.into_iter().flatten() {
            if let Some(kind) = part.get_mut("type")
                && matches!(kind.as_str(), Some("input_text" | "output_text"))
            {
                *kind = "text".into();
            }
        }
    }
    messages
}

/// The engine's render endpoints (vLLM 0.32 `--enable-scale-out`): the request goes to the one
/// matching its own endpoint (`/v1/completions/render`, `/v1/chat/completions/render`,
/// `/v1/responses/render`, `/v1/messages/render` under the configured base URL) and the answer's
/// `token_ids` are the engine's prompt (a completion's list answers with its first prompt's).
/// Only the body and `content-type` are sent: no client header (authorization, cookies) leaves.
#[derive(Debug, Clone)]
pub struct RenderTokenizer {
    base: http::Uri,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl RenderTokenizer {
    /// A client for the engine at `base` (`http://host:port`, optionally with a path prefix)
    /// with a per-call `timeout`.
    pub fn new(base: http::Uri, timeout: Duration) -> Self {
        Self {
            base,
            timeout,
            client: http_client(),
        }
    }

    /// The render endpoint for `input`'s kind of request.
    pub fn endpoint_url(&self, input: &TokenizeInput) -> Result<http::Uri, TokenizeError> {
        let path = match input {
            TokenizeInput::Text { .. } => "/v1/completions/render",
            TokenizeInput::Chat { .. } => "/v1/chat/completions/render",
            TokenizeInput::Api {
                api: ApiKind::Responses,
                ..
            } => "/v1/responses/render",
            TokenizeInput::Api {
                api: ApiKind::Messages,
                ..
            } => "/v1/messages/render",
        };
        let prefix = self.base.path().trim_end_matches('/');
        let mut parts = self.base.clone().into_parts();
        parts.path_and_query = format!("{prefix}{path}").parse().ok();
        http::Uri::from_parts(parts).map_err(|e| TokenizeError::Render {
            url: self.base.to_string(),
            reason: e.to_string(),
        })
    }

    /// A render body built from the prompt alone, for callers without the request body: the
    /// `/tokenize` body (a valid chat or completion request), or the API request's fields.
    fn body_from_input(model: &str, input: &TokenizeInput) -> Option<Vec<u8>> {
        let body = match input {
            TokenizeInput::Api { request, .. } => {
                let mut request = api_request_object(request).ok()?;
                request.insert("model".to_owned(), model.into());
                serde_json::Value::Object(request)
            }
            input => RemoteTokenizer::request_body(model, input)?,
        };
        serde_json::to_vec(&body).ok()
    }

    fn post(&self, input: &TokenizeInput, body: Option<Bytes>) -> TokenizeFuture {
        let url = match self.endpoint_url(input) {
            Ok(url) => url,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let Some(body) = body else {
            return Box::pin(std::future::ready(Err(TokenizeError::Render {
                url: url.to_string(),
                reason: "vLLM would refuse to render the request".to_owned(),
            })));
        };
        let (client, timeout) = (self.client.clone(), self.timeout);
        Box::pin(async move {
            let call = async {
                let answer = post_json(client, url.clone(), body).await?;
                render_token_ids(&answer)
            };
            match tokio::time::timeout(timeout, call).await {
                Ok(Ok(tokens)) => Ok(tokens),
                Ok(Err(reason)) => Err(TokenizeError::Render {
                    url: url.to_string(),
                    reason,
                }),
                Err(_) => Err(TokenizeError::Timeout { after: timeout }),
            }
        })
    }
}

/// `token_ids` of a render answer: vLLM's `GenerateRequest` (chat, responses, messages) or a
/// list of them (completions; the first, as routing takes a batch's first prompt).
fn render_token_ids(answer: &[u8]) -> Result<Vec<u32>, String> {
    #[derive(serde::Deserialize)]
    struct Rendered {
        token_ids: Vec<u32>,
    }
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Answer {
        One(Rendered),
        Many(Vec<Rendered>),
    }
    let rendered = match serde_json::from_slice(answer).map_err(|e| e.to_string())? {
        Answer::One(one) => one,
        Answer::Many(many) => many
            .into_iter()
            .next()
            .ok_or_else(|| "an empty list".to_owned())?,
    };
    if rendered.token_ids.is_empty() {
        return Err("no token_ids".to_owned());
    }
    Ok(rendered.token_ids)
}

impl Tokenizer for RenderTokenizer {
    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Render
    }

    /// The whole budget, as [`RemoteTokenizer`]: the mode exists to be exact.
    fn prefix_hit_wait(&self) -> Duration {
        Duration::MAX
    }

    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let body = Self::body_from_input(model, &input).map(Bytes::from);
        self.post(&input, body)
    }

    fn tokenize_request(
        &self,
        _model: &str,
        input: Arc<TokenizeInput>,
        body: &[u8],
    ) -> TokenizeFuture {
        // vLLM refuses an untrusted request template; never ask it to render one.
        let refused =
            matches!(&*input, TokenizeInput::Chat { fields, .. } if fields.request_template);
        self.post(&input, (!refused).then(|| Bytes::copy_from_slice(body)))
    }
}

/// The `/tokenize` body of a chat request. `/tokenize` renders like `/v1/chat/completions` but
/// for two request-model differences in vLLM 0.32, bridged here: it has no `reasoning_effort`
/// or `documents` fields (they are folded into `chat_template_kwargs` as the chat path folds
/// them: `reasoning_effort`, `enable_thinking` unless set, `documents`), and it does not rename
/// a message's `reasoning_content` to `reasoning` (done here).
fn remote_chat_body(
    model: &str,
    messages: &RawValue,
    add_generation_prompt: bool,
    fields: &ChatInputFields,
) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": model,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": fields.continue_final_message,
        "add_special_tokens": fields.add_special_tokens,
    });
    let messages = if messages.get().contains("reasoning_content") {
        match serde_json::from_str::<serde_json::Value>(messages.get()) {
            Ok(mut parsed) => {
                for message in parsed.as_array_mut().into_iter().flatten() {
                    if let Some(message) = message.as_object_mut()
                        && let Some(reasoning) = message.shift_remove("reasoning_content")
                        && !reasoning.is_null()
                        && message
                            .get("reasoning")
                            .is_none_or(serde_json::Value::is_null)
                    {
                        message.insert("reasoning".to_owned(), reasoning);
                    }
                }
                parsed
            }
            Err(_) => serde_json::Value::String(messages.get().to_owned()),
        }
    } else {
        serde_json::from_str(messages.get()).unwrap_or(serde_json::Value::Null)
    };
    body["messages"] = messages;
    let raw = |r: &Option<Box<RawValue>>| {
        r.as_ref()
            .and_then(|r| serde_json::from_str::<serde_json::Value>(r.get()).ok())
    };
    if let Some(tools) = raw(&fields.tools) {
        body["tools"] = tools;
    }
    let mut kwargs = match raw(&fields.chat_template_kwargs) {
        Some(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    if let Some(documents) = raw(&fields.documents) {
        kwargs.insert("documents".to_owned(), documents);
    }
    if let Some(effort) = &fields.reasoning_effort {
        if !kwargs.contains_key("enable_thinking") {
            kwargs.insert("enable_thinking".to_owned(), (effort != "none").into());
        }
        if effort != "auto" {
            kwargs.insert("reasoning_effort".to_owned(), effort.as_str().into());
        }
    }
    if !kwargs.is_empty() {
        body["chat_template_kwargs"] = serde_json::Value::Object(kwargs);
    }
    body
}

/// Tokens a decision routes on.
#[derive(Debug, Clone)]
pub struct PromptTokens {
    /// Token ids: the whole prompt, or a known prefix of it (see `exact`).
    pub tokens: Arc<[u32]>,
    /// Whether `tokens` is the whole prompt.
    pub exact: bool,
    /// Estimated prompt length in tokens (equals `tokens.len()` when exact).
    pub estimated_len: usize,
    /// Where the tokens came from.
    pub source: TokenSource,
    /// The block keys of `tokens`, when they came from the cache with keys a background
    /// tokenization computed for them (check the fingerprint before use).
    pub keys: Option<CachedKeys>,
}

/// Block keys cached with the tokens they are the keys of.
#[derive(Debug, Clone)]
pub struct CachedKeys {
    /// What the keys depend on besides the tokens ([`KeysJob::fingerprint`]).
    pub fingerprint: u64,
    /// The key of every full block.
    pub keys: Arc<[u64]>,
    /// The key chain at the last full block before the tokens' resume point: the conversation's
    /// next turn, which keeps those tokens, hashes only the blocks after it.
    pub point: Option<ChainPoint>,
}

/// How a decision computes a prompt's block keys: handed to a background whole tokenization so
/// that it caches the keys with the tokens, and the next turn, routed on them, hashes nothing.
#[derive(Clone)]
pub struct KeysJob {
    /// Everything the keys depend on besides the tokens (key scheme, block size, adapter, salt).
    pub fingerprint: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// The pool's [`KeyScheme::extend_prompt_keys`](kvroute_block_keys::KeyScheme::extend_prompt_keys)
    /// with its block size, adapter and salt.
    pub compute: Arc<ComputeKeys>,
}

/// [`KeysJob::compute`]'s function: `(from, tokens, mark, out)`, as
/// [`KeyScheme::extend_prompt_keys`](kvroute_block_keys::KeyScheme::extend_prompt_keys) takes them.
pub type ComputeKeys = dyn Fn(Option<&ChainPoint>, &[u32], usize, &mut Vec<u64>) -> Result<Option<ChainPoint>, KeyError>
    + Send
    + Sync;

impl KeysJob {
    /// The keys of every full block of `tokens` (`None`: they cannot be computed), with the
    /// chain's point at the last full block of the first `resume_tokens` kept for the next turn.
    /// With `prior` (a cached turn and its keys) whose tokens up to its chain point are also
    /// `tokens`' (checked), only the blocks after that point are hashed.
    fn keys_for(
        &self,
        tokens: &[u32],
        prior: Option<(&[u32], &CachedKeys)>,
        resume_tokens: usize,
    ) -> Option<CachedKeys> {
        let block_size = self.block_size.max(1);
        let mut keys = Vec::with_capacity(tokens.len() / block_size);
        let from = prior.and_then(|(prior_tokens, cached)| {
            let point = cached.point?;
            let shared = point.blocks() * block_size;
            let usable = cached.fingerprint == self.fingerprint
                && point.blocks() <= cached.keys.len()
                && tokens.get(..shared)? == prior_tokens.get(..shared)?;
            usable.then(|| {
                keys.extend_from_slice(&cached.keys[..point.blocks()]);
                point
            })
        });
        let point = (self.compute)(from.as_ref(), tokens, resume_tokens / block_size, &mut keys)
            .ok()?
            .or(from.filter(|point| point.blocks() == resume_tokens / block_size));
        Some(CachedKeys {
            fingerprint: self.fingerprint,
            keys: keys.into(),
            point,
        })
    }
}

impl fmt::Debug for KeysJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeysJob")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// A cached tokenization.
#[derive(Debug)]
struct CacheEntry {
    tokens: Arc<[u32]>,
    keys: Option<CachedKeys>,
    /// Where the conversation's next turn can take over these tokens.
    resume: Option<ResumePoint>,
}

/// Where a decision's tokens came from (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenSource {
    /// The client sent token ids.
    Client,
    /// The whole prompt was in the cache.
    Cache,
    /// A conversation prefix was in the cache.
    PrefixCache,
    /// Tokenized now.
    Tokenizer,
    /// Only the prompt's leading part was tokenized now (exact first tokens; not cached).
    Leading,
    /// Tokenized now from a cached earlier turn on: only the new text encoded (exact).
    Resumed,
}

impl TokenSource {
    /// Metric label.
    pub fn as_label(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Cache => "cache",
            Self::PrefixCache => "prefix_cache",
            Self::Tokenizer => "tokenizer",
            Self::Leading => "leading",
            Self::Resumed => "resumed",
        }
    }
}

/// Bounds of a [`TokenCache`] and of the in-process tokenizations it starts (config:
/// `token_cache_entries`, `token_cache_bytes`, `limits.tokenize_concurrency`,
/// `limits.tokenize_max_prompt_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenLimits {
    /// Most cached tokenizations.
    pub cache_entries: usize,
    /// Most bytes the cached tokenizations account for ([`cache_entry_bytes`] each).
    pub cache_bytes: usize,
    /// Most tokenizations on blocking threads at once, abandoned ones included.
    pub concurrency: usize,
    /// Largest prompt tokenized whole on a blocking thread, in bytes.
    pub max_prompt_bytes: usize,
}

impl TokenLimits {
    /// The limits `config` sets.
    pub fn from_config(config: &Config) -> Self {
        Self {
            cache_entries: config.token_cache_entries,
            cache_bytes: config.token_cache_bytes,
            concurrency: config.tokenize_concurrency,
            max_prompt_bytes: config.tokenize_max_prompt_bytes,
        }
    }
}

impl Default for TokenLimits {
    /// The config's defaults.
    fn default() -> Self {
        Self {
            cache_entries: crate::config::DEFAULT_TOKEN_CACHE_ENTRIES,
            cache_bytes: crate::config::DEFAULT_TOKEN_CACHE_BYTES,
            concurrency: crate::config::default_tokenize_concurrency(),
            max_prompt_bytes: crate::config::DEFAULT_TOKENIZE_MAX_PROMPT_BYTES,
        }
    }
}

/// What one cached tokenization accounts for besides its tokens: its 16-byte key, the `Arc`'s
/// counts, its slot in the map (value with its resume point, age, weight; the table at most half
/// empty) and in the age index.
const CACHE_ENTRY_OVERHEAD_BYTES: usize = 256;

/// The bytes a cached tokenization of `tokens` accounts for: 4 per token plus
/// `CACHE_ENTRY_OVERHEAD_BYTES`.
pub fn cache_entry_bytes(tokens: &[u32]) -> usize {
    CACHE_ENTRY_OVERHEAD_BYTES + std::mem::size_of_val(tokens)
}

/// At most one "prompt too large" line per this long (the rest counted in the fallbacks).
const TOO_LARGE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Recent tokenizations, keyed by (pool, prompt or conversation-prefix hash), bounded by entries
/// and bytes; and the slots bounding the blocking tokenizations started for them.
#[derive(Debug)]
pub struct TokenCache {
    entries: Arc<Mutex<Lru<u128, CacheEntry>>>,
    /// Whole tokenizations for a later turn, at low CPU priority (`None`: its thread could not
    /// start; they then run on the blocking pool, bounded by `refills`).
    lane: Option<Arc<BackgroundLane>>,
    /// Cache keys with a lane job queued or running: a prompt is queued once (a decision whose
    /// leading part grows asks again).
    lane_pending: Arc<Mutex<std::collections::HashSet<u128>>>,
    /// Background full tokenizations after a prefix hit; bounded so they never pile up.
    refills: Arc<tokio::sync::Semaphore>,
    /// One permit per tokenization running on a blocking thread.
    blocking: Arc<tokio::sync::Semaphore>,
    max_prompt_bytes: usize,
    /// Recent cost of whole blocking tokenizations, picoseconds per prompt byte (0: none yet).
    blocking_ps_per_byte: Arc<std::sync::atomic::AtomicU64>,
    gauges: CacheGauges,
    last_too_large_log: Mutex<Option<Instant>>,
    tasks: TaskTracker,
}

/// The cache's gauges (unregistered until [`TokenCache::with_metrics`]).
#[derive(Debug, Clone, Default)]
struct CacheGauges {
    bytes: Gauge,
    entries: Gauge,
    blocking_in_flight: Gauge,
    abandoned: Counter,
    /// Whole tokenizations for a later turn not started (lane full, no free slot, too large).
    background_skipped: Counter,
    /// Whole tokenizations for a later turn queued or running on the lane.
    background_queued: Gauge,
}

/// A taken blocking-tokenization slot; counted in flight until dropped.
#[derive(Debug)]
struct BlockingSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for BlockingSlot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

/// One lane job, counted in its gauge and pending under its key until dropped.
struct Queued {
    gauge: Gauge,
    pending: Arc<Mutex<std::collections::HashSet<u128>>>,
    key: u128,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.pending.lock().remove(&self.key);
        self.gauge.dec();
    }
}

/// A whole tokenization that caches its result as it ends.
type CachingFuture = Pin<Box<dyn Future<Output = Result<Arc<[u32]>, TokenizeError>> + Send>>;

/// Concurrent background tokenizations finishing after a conversation-prefix hit.
const MAX_CONCURRENT_REFILLS: usize = 2;
/// How long a request whose conversation prefix is cached waits for its exact tokens.
const PREFIX_HIT_WAIT: Duration = Duration::from_millis(5);
/// A conversation-prefix hit waits for its exact tokens only when a blocking whole tokenization
/// of its size is expected within this (measured: a 32k Qwen3 hit that waited cost 5× the no-op
/// ext_proc's p50, 3.5× routing on its cached prefix; docs/benchmarks-history-2026-12.md, "Latency through Envoy
/// with real tokenizers").
const PREFIX_HIT_MAX_EXPECTED: Duration = Duration::from_millis(1);

impl TokenCache {
    /// A cache within `limits`; refills and blocking tokenizations run on `tasks`.
    pub fn new(limits: TokenLimits, tasks: TaskTracker) -> Self {
        Self {
            entries: Arc::new(Mutex::new(Lru::new(
                limits.cache_entries,
                limits.cache_bytes,
            ))),
            lane: match BackgroundLane::start() {
                Ok(lane) => Some(Arc::new(lane)),
                Err(error) => {
                    tracing::warn!(%error, "no background tokenization thread: later turns' tokenizations share the blocking pool");
                    None
                }
            },
            lane_pending: Arc::default(),
            refills: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_REFILLS)),
            blocking: Arc::new(tokio::sync::Semaphore::new(limits.concurrency.max(1))),
            max_prompt_bytes: limits.max_prompt_bytes,
            blocking_ps_per_byte: Arc::default(),
            gauges: CacheGauges::default(),
            last_too_large_log: Mutex::new(None),
            tasks,
        }
    }

    /// Reports the cache's size and the blocking tokenizations in `metrics`.
    pub fn with_metrics(mut self, metrics: &Metrics) -> Self {
        self.gauges = CacheGauges {
            bytes: metrics.token_cache_bytes.clone(),
            entries: metrics.token_cache_entries.clone(),
            blocking_in_flight: metrics.tokenize_blocking_in_flight.clone(),
            abandoned: metrics.tokenize_abandoned.clone(),
            background_skipped: metrics.tokenize_background_skipped.clone(),
            background_queued: metrics.tokenize_background_queued.clone(),
        };
        self
    }

    /// Bytes the cached tokenizations account for.
    pub fn bytes(&self) -> usize {
        self.entries.lock().bytes()
    }

    /// Tokens of `prompt`, from the client, the cache or `tokenizer` (bounded by `budget`).
    pub async fn tokens(
        &self,
        pool: usize,
        model: &str,
        prompt: &Prompt<'_>,
        tokenizer: Option<&Arc<dyn Tokenizer>>,
        budget: Duration,
    ) -> Result<PromptTokens, TokenizeError> {
        self.tokens_with(pool, model, prompt, tokenizer, budget, None, None)
            .await
    }

    /// [`Self::tokens`], except that a prompt of at least `2 × min_bytes` that neither the cache
    /// nor a cached conversation prefix knows gets only its exact leading tokens
    /// ([`Tokenizer::tokenize_leading`] from `min_bytes`; [`TokenSource::Leading`], `exact`
    /// false, not cached) when the tokenizer can. A whole tokenization left to the background
    /// for the next turn also caches the block keys `keys` computes.
    #[expect(
        clippy::too_many_arguments,
        reason = "the decision's tokenize context, as the picker has it"
    )]
    pub async fn leading_tokens(
        &self,
        pool: usize,
        model: &str,
        prompt: &Prompt<'_>,
        tokenizer: Option<&Arc<dyn Tokenizer>>,
        budget: Duration,
        min_bytes: usize,
        keys: Option<&KeysJob>,
    ) -> Result<PromptTokens, TokenizeError> {
        self.tokens_with(
            pool,
            model,
            prompt,
            tokenizer,
            budget,
            Some(min_bytes),
            keys,
        )
        .await
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "the decision's tokenize context, as the picker has it"
    )]
    async fn tokens_with(
        &self,
        pool: usize,
        model: &str,
        prompt: &Prompt<'_>,
        tokenizer: Option<&Arc<dyn Tokenizer>>,
        budget: Duration,
        leading_from: Option<usize>,
        keys_job: Option<&KeysJob>,
    ) -> Result<PromptTokens, TokenizeError> {
        let deadline = tokio::time::Instant::now() + budget;
        let keys = match prompt {
            Prompt::Tokens(ids) => {
                return Ok(PromptTokens {
                    tokens: ids.as_slice().into(),
                    exact: true,
                    estimated_len: ids.len(),
                    source: TokenSource::Client,
                    keys: None,
                });
            }
            Prompt::Absent => {
                return Ok(PromptTokens {
                    tokens: Arc::from([]),
                    exact: true,
                    estimated_len: 0,
                    source: TokenSource::Client,
                    keys: None,
                });
            }
            Prompt::Text {
                text,
                add_special_tokens,
                ..
            } => {
                vec![(
                    cache_key(pool, b"text", *add_special_tokens, &[text.as_bytes()]),
                    text.len(),
                )]
            }
            Prompt::Api {
                api, items, fields, ..
            } => api_keys(pool, *api, items, fields),
            Prompt::Chat {
                messages,
                add_generation_prompt,
                fields,
                ..
            } => conversation_keys(
                pool,
                messages,
                *add_generation_prompt,
                &ChatInputFields::from_request(fields),
            ),
        };
        let Some(&(full_key, full_bytes)) = keys.last() else {
            return Err(TokenizeError::InProcess {
                reason: "empty prompt".to_owned(),
            });
        };
        let cached_prefix = {
            let mut entries = self.entries.lock();
            if let Some(entry) = entries.get(&full_key) {
                return Ok(PromptTokens {
                    tokens: Arc::clone(&entry.tokens),
                    exact: true,
                    estimated_len: entry.tokens.len(),
                    source: TokenSource::Cache,
                    keys: entry.keys.clone(),
                });
            }
            keys.iter().rev().skip(1).find_map(|(key, bytes)| {
                entries.get(key).map(|entry| {
                    (
                        Arc::clone(&entry.tokens),
                        *bytes,
                        entry.keys.clone(),
                        entry.resume,
                    )
                })
            })
        };
        let tokenizer = tokenizer.ok_or_else(|| TokenizeError::NotConfigured {
            pool: pool.to_string(),
        })?;
        let input = Arc::new(owned_input(prompt));
        // The prior turn whose tokens this one can take over, if it left a resume point.
        let prior = cached_prefix
            .as_ref()
            .and_then(|(tokens, _, _, resume)| Some((resume.as_ref()?, &tokens[..])));
        // Its keys, which this turn's extend.
        let prior_keys = cached_prefix
            .as_ref()
            .and_then(|(tokens, _, keys, _)| Some((&tokens[..], keys.as_ref()?)));
        // A conversation's next turn: only the text it added is encoded, on this task (the whole
        // chat is parsed and rendered: tens of microseconds at this size).
        if prior.is_some()
            && input.len_bytes() <= RESUME_INLINE_MAX_BYTES
            && let Some(Ok(resumed)) = tokenizer.tokenize_resumable(&input, prior)
        {
            return Ok(self.cache_resumed(full_key, resumed, keys_job, prior_keys));
        }
        if let Some(min_bytes) = leading_from
            && cached_prefix.is_none()
            && full_bytes >= 2 * min_bytes
        {
            let slot = if tokenizer.runs_blocking(&input, true) {
                Some(self.blocking_slot(deadline, budget).await?)
            } else {
                None
            };
            if let Some(leading) = tokenizer.tokenize_leading(model, Arc::clone(&input), min_bytes)
            {
                let leading = self.bounded(leading, slot, deadline, budget).await?;
                let tokens: Arc<[u32]> = leading.tokens.into();
                if leading.complete {
                    let keys = keys_job.and_then(|job| {
                        job.keys_for(&tokens, None, mark_at(&tokens, leading.resume))
                    });
                    let entry = CacheEntry {
                        tokens: Arc::clone(&tokens),
                        keys: keys.clone(),
                        resume: leading.resume,
                    };
                    insert_entry(&self.entries, &self.gauges, full_key, entry);
                    return Ok(PromptTokens {
                        keys,
                        ..tokenized(tokens)
                    });
                }
                // The next turn starts with this whole prompt and, were it not cached, would pay
                // for its leading part and then all of it. The lane encodes only the rest.
                let prior = leading
                    .resume
                    .map(|point| (point, Arc::clone(&tokens), None));
                self.complete_later(model, tokenizer, &input, prompt, full_key, keys_job, prior);
                // The rest of the prompt at the leading part's own bytes per token.
                let rest = leading.total_bytes.saturating_sub(leading.text_bytes);
                let estimated_len = tokens.len() + rest * tokens.len() / leading.text_bytes.max(1);
                return Ok(PromptTokens {
                    tokens,
                    exact: false,
                    estimated_len,
                    source: TokenSource::Leading,
                    keys: None,
                });
            }
        }
        if let Some((prefix_tokens, prefix_bytes, prefix_keys, prefix_resume)) = &cached_prefix
            && tokenizer.runs_blocking(&input, false)
            && self.expected_blocking(full_bytes)
                > PREFIX_HIT_MAX_EXPECTED.min(budget.min(tokenizer.prefix_hit_wait()))
        {
            // Its whole tokenization is not expected within `PREFIX_HIT_MAX_EXPECTED`: waiting
            // would add more than the routing path may cost (32k tokens take ≈ 3 ms). The cached
            // prefix is exact; the whole tokens follow in the background for the next turn.
            let prior =
                prefix_resume.map(|point| (point, Arc::clone(prefix_tokens), prefix_keys.clone()));
            self.complete_later(model, tokenizer, &input, prompt, full_key, keys_job, prior);
            return Ok(on_cached_prefix(
                Arc::clone(prefix_tokens),
                *prefix_bytes,
                full_bytes,
                prefix_keys.clone(),
            ));
        }
        let slot = if tokenizer.runs_blocking(&input, false) {
            let bytes = input.len_bytes();
            if bytes > self.max_prompt_bytes {
                self.log_too_large(bytes);
                return Err(TokenizeError::PromptTooLarge {
                    bytes,
                    limit: self.max_prompt_bytes,
                });
            }
            Some(self.blocking_slot(deadline, budget).await?)
        } else {
            None
        };
        if slot.is_none()
            && let Some(Ok(resumed)) = tokenizer.tokenize_resumable(&input, prior)
        {
            return Ok(self.cache_resumed(full_key, resumed, keys_job, prior_keys));
        }
        let tokenizing = start_tokenizing(tokenizer.as_ref(), model, input, prompt);
        let entries = Arc::clone(&self.entries);
        let gauges = self.gauges.clone();
        let rate = slot
            .is_some()
            .then(|| Arc::clone(&self.blocking_ps_per_byte));
        // Whoever finishes the tokenization caches it: this decision, or, once it stopped
        // waiting, the task left running it.
        let caching = async move {
            let started = Instant::now();
            let tokens: Arc<[u32]> = tokenizing.await?.into();
            if let Some(rate) = rate {
                record_rate(&rate, started.elapsed(), full_bytes);
            }
            insert_into(&entries, &gauges, full_key, Arc::clone(&tokens));
            Ok(tokens)
        };
        if let Some((prefix_tokens, prefix_bytes, prefix_keys, _)) = cached_prefix {
            // The exact tokens are worth a short wait (the fast encoder needs well under a
            // millisecond for a long conversation; a network tokenizer gets the whole budget);
            // past it, route on the conversation's cached
            // prefix and let the tokenization finish in the background for the next turn.
            let wait = budget.min(tokenizer.prefix_hit_wait());
            let wait_until = tokio::time::Instant::now() + wait;
            let exact = match slot {
                // Already a task of its own, which finishes (and caches) if this stops waiting.
                Some(slot) => self.bounded(caching, Some(slot), wait_until, wait).await,
                None => {
                    let mut caching = Box::pin(caching);
                    match tokio::time::timeout_at(wait_until, &mut caching).await {
                        Ok(result) => result,
                        Err(_) => {
                            self.finish_in_background(caching);
                            Err(TokenizeError::Timeout { after: wait })
                        }
                    }
                }
            };
            match exact {
                Ok(tokens) => return Ok(tokenized(tokens)),
                Err(TokenizeError::Timeout { .. }) => {}
                Err(error) => {
                    tracing::debug!(%error, "tokenizing a conversation failed; routing on its cached prefix");
                }
            }
            return Ok(on_cached_prefix(
                prefix_tokens,
                prefix_bytes,
                full_bytes,
                prefix_keys,
            ));
        }
        self.bounded(caching, slot, deadline, budget)
            .await
            .map(tokenized)
    }

    /// A free blocking slot by `deadline`, or [`TokenizeError::Busy`]: a decision never queues
    /// past its budget behind longer prompts.
    async fn blocking_slot(
        &self,
        deadline: tokio::time::Instant,
        budget: Duration,
    ) -> Result<BlockingSlot, TokenizeError> {
        let busy = || TokenizeError::Busy { waited: budget };
        let permit = tokio::time::timeout_at(deadline, Arc::clone(&self.blocking).acquire_owned())
            .await
            .map_err(|_| busy())?
            .map_err(|_| busy())?;
        Ok(self.taken_slot(permit))
    }

    /// `permit` as a blocking slot, counted in flight until dropped.
    fn taken_slot(&self, permit: tokio::sync::OwnedSemaphorePermit) -> BlockingSlot {
        self.gauges.blocking_in_flight.inc();
        BlockingSlot {
            _permit: permit,
            in_flight: self.gauges.blocking_in_flight.clone(),
        }
    }

    /// `work`'s result by `deadline` ([`TokenizeError::Timeout`] after `budget` otherwise). Work
    /// holding a blocking `slot` runs as a task of its own that keeps the slot until the work
    /// ends: the blocking thread cannot be stopped, so its slot is what bounds how many
    /// abandoned ones run, and its result is dropped (or cached, by `work`) as it ends.
    async fn bounded<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, TokenizeError>> + Send + 'static,
        slot: Option<BlockingSlot>,
        deadline: tokio::time::Instant,
        budget: Duration,
    ) -> Result<T, TokenizeError> {
        let timeout = || TokenizeError::Timeout { after: budget };
        let Some(slot) = slot else {
            return tokio::time::timeout_at(deadline, work)
                .await
                .map_err(|_| timeout())?;
        };
        let task = self.tasks.spawn(async move {
            let _slot = slot;
            work.await
        });
        match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(TokenizeError::InProcess {
                reason: e.to_string(),
            }),
            Err(_) => {
                self.gauges.abandoned.inc();
                Err(timeout())
            }
        }
    }

    /// What a whole blocking tokenization of `bytes` is expected to take, from recent ones
    /// (zero before any).
    fn expected_blocking(&self, bytes: usize) -> Duration {
        let ps_per_byte = self
            .blocking_ps_per_byte
            .load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_nanos(ps_per_byte.saturating_mul(bytes as u64) / 1000)
    }

    /// Caches a chat's whole tokenization with its resume point, as the decision's tokens.
    /// With `keys_job`, the keys too (extending `prior`'s where they share its blocks), so that
    /// the next turn extends these.
    fn cache_resumed(
        &self,
        key: u128,
        resumed: ResumableTokens,
        keys_job: Option<&KeysJob>,
        prior: Option<(&[u32], &CachedKeys)>,
    ) -> PromptTokens {
        let tokens: Arc<[u32]> = resumed.tokens.into();
        let keys =
            keys_job.and_then(|job| job.keys_for(&tokens, prior, mark_at(&tokens, resumed.resume)));
        let entry = CacheEntry {
            tokens: Arc::clone(&tokens),
            keys: keys.clone(),
            resume: resumed.resume,
        };
        insert_entry(&self.entries, &self.gauges, key, entry);
        PromptTokens {
            source: if resumed.prior_taken {
                TokenSource::Resumed
            } else {
                TokenSource::Tokenizer
            },
            keys,
            ..tokenized(tokens)
        }
    }

    /// One warning per [`TOO_LARGE_LOG_EVERY`]; every such prompt is counted by the caller.
    fn log_too_large(&self, bytes: usize) {
        let now = Instant::now();
        let mut last = self.last_too_large_log.lock();
        if last.is_none_or(|at| now.duration_since(at) >= TOO_LARGE_LOG_EVERY) {
            *last = Some(now);
            tracing::warn!(
                bytes,
                limit = self.max_prompt_bytes,
                "prompt too large to tokenize whole in process (limits.tokenize_max_prompt_bytes); \
                 routing on the next tier (counted in fallbacks_total{{stage=\"tokenize\",cause=\"prompt_too_large\"}})"
            );
        }
    }

    /// Tokenizes a prompt whose decision used only its leading tokens (or its conversation's
    /// cached prefix), whole, in the background, and caches it (with the block keys `keys_job`
    /// computes), so the conversation's next turn finds it as its cached prefix. Within the
    /// prompt-size limit; for in-process tokenizers on the cache's low-priority lane (bounded by
    /// its queue), for others with a free refill slot and, for blocking work, a free blocking
    /// slot taken now (never waited for: decisions come first); otherwise skipped, counted.
    /// With `prior` (the cached turn before, and where it can be taken over) the lane encodes
    /// only what this turn added.
    #[expect(
        clippy::too_many_arguments,
        reason = "the decision's tokenize context, as tokens_with has it"
    )]
    fn complete_later(
        &self,
        model: &str,
        tokenizer: &Arc<dyn Tokenizer>,
        input: &Arc<TokenizeInput>,
        prompt: &Prompt<'_>,
        key: u128,
        keys_job: Option<&KeysJob>,
        prior: Option<(ResumePoint, Arc<[u32]>, Option<CachedKeys>)>,
    ) {
        let skipped = |why: &str| {
            self.gauges.background_skipped.inc();
            tracing::debug!(why, "whole tokenization for a later turn skipped");
        };
        let blocking = tokenizer.runs_blocking(input, false);
        if blocking && input.len_bytes() > self.max_prompt_bytes {
            return skipped("prompt over limits.tokenize_max_prompt_bytes");
        }
        let entries = Arc::clone(&self.entries);
        let gauges = self.gauges.clone();
        if let Some(lane) = &self.lane
            && matches!(
                tokenizer.mode(),
                TokenizerMode::InProcessFast | TokenizerMode::InProcessHf
            )
        {
            let tokenizer = Arc::clone(tokenizer);
            let input = Arc::clone(input);
            let keys_job = keys_job.cloned();
            if !self.lane_pending.lock().insert(key) {
                return;
            }
            // Counted (and pending) from here until the job ends, or is dropped unrun (refused,
            // lane stopped).
            let queued = Queued {
                gauge: self.gauges.background_queued.clone(),
                pending: Arc::clone(&self.lane_pending),
                key,
            };
            queued.gauge.inc();
            // The job caches its result from the runtime: the lane thread may be preempted
            // anywhere, and must never hold a lock (the cache's, the pending set's) a decision
            // then waits for.
            let runtime = tokio::runtime::Handle::try_current().ok();
            let tasks = self.tasks.clone();
            let queued = lane.run(move || {
                // Another request's job for the same prompt may have run first (not known while
                // a decision holds the cache: the work is then done again).
                if entries
                    .try_lock()
                    .is_some_and(|cached| cached.contains(&key))
                {
                    return finish_on(runtime.as_ref(), &tasks, queued, || ());
                }
                let prior_keys = prior
                    .as_ref()
                    .and_then(|(_, tokens, keys)| Some((&tokens[..], keys.as_ref()?)));
                let prior = prior
                    .as_ref()
                    .map(|(point, tokens, _)| (point, &tokens[..]));
                let (result, resume) = match tokenizer.tokenize_resumable(&input, prior) {
                    Some(Ok(resumed)) => (Some(Ok(resumed.tokens)), resumed.resume),
                    Some(Err(error)) => (Some(Err(error)), None),
                    None => (tokenizer.tokenize_now(&input), None),
                };
                let entry = match result {
                    Some(Ok(tokens)) => {
                        let tokens: Arc<[u32]> = tokens.into();
                        let keys = keys_job.and_then(|job| {
                            job.keys_for(&tokens, prior_keys, mark_at(&tokens, resume))
                        });
                        Some(CacheEntry {
                            tokens,
                            keys,
                            resume,
                        })
                    }
                    Some(Err(error)) => {
                        tracing::debug!(%error, "background whole tokenization failed");
                        None
                    }
                    None => None,
                };
                finish_on(runtime.as_ref(), &tasks, queued, move || {
                    if let Some(entry) = entry {
                        insert_entry(&entries, &gauges, key, entry);
                    }
                });
            });
            if !queued {
                skipped("background lane full");
            }
            return;
        }
        let Ok(refill) = Arc::clone(&self.refills).try_acquire_owned() else {
            return skipped("refills busy");
        };
        let slot = if blocking {
            let Ok(permit) = Arc::clone(&self.blocking).try_acquire_owned() else {
                return skipped("blocking slots busy");
            };
            Some(self.taken_slot(permit))
        } else {
            None
        };
        let tokenizing = start_tokenizing(tokenizer.as_ref(), model, Arc::clone(input), prompt);
        self.tasks.spawn(async move {
            let _held = (refill, slot);
            match tokenizing.await {
                Ok(tokens) => insert_into(&entries, &gauges, key, tokens.into()),
                Err(error) => tracing::debug!(%error, "background whole tokenization failed"),
            }
        });
    }

    /// Lets a tokenization that outran the wait finish and fill the cache (bounded: without a
    /// free slot it is dropped, and the next turn tokenizes again).
    fn finish_in_background(&self, caching: CachingFuture) {
        let Ok(permit) = Arc::clone(&self.refills).try_acquire_owned() else {
            return;
        };
        self.tasks.spawn(async move {
            let _permit = permit;
            let _ = caching.await;
        });
    }
}

/// Ends a lane job: runs `cache` (which takes the cache's lock) and drops `queued` (the pending
/// set's) as a task on `runtime`, at the decisions' priority; without a runtime, here. A
/// runtime shutting down drops the task: nothing is cached, the job is still counted out.
fn finish_on(
    runtime: Option<&tokio::runtime::Handle>,
    tasks: &TaskTracker,
    queued: Queued,
    cache: impl FnOnce() + Send + 'static,
) {
    let finish = move || {
        cache();
        drop(queued);
    };
    match runtime {
        Some(runtime) => {
            tasks.spawn_on(async move { finish() }, runtime);
        }
        None => finish(),
    }
}

/// Where cached keys keep their chain point: at the resume point (what the next turn keeps of
/// these tokens), or at the end without one.
fn mark_at(tokens: &[u32], resume: Option<ResumePoint>) -> usize {
    resume.map_or(tokens.len(), |point| point.tokens)
}

/// A prompt of `full_bytes` routed on its conversation's cached prefix (`prefix_bytes` of it);
/// the rest estimated.
fn on_cached_prefix(
    prefix_tokens: Arc<[u32]>,
    prefix_bytes: usize,
    full_bytes: usize,
    keys: Option<CachedKeys>,
) -> PromptTokens {
    let tail = full_bytes.saturating_sub(prefix_bytes) / ESTIMATED_BYTES_PER_TOKEN;
    PromptTokens {
        estimated_len: prefix_tokens.len() + tail,
        tokens: prefix_tokens,
        exact: false,
        source: TokenSource::PrefixCache,
        keys,
    }
}

/// The whole tokenization of `prompt` (`input` is its owned form): the request's own body goes
/// along for tokenizers that send it on (render).
fn start_tokenizing(
    tokenizer: &dyn Tokenizer,
    model: &str,
    input: Arc<TokenizeInput>,
    prompt: &Prompt<'_>,
) -> TokenizeFuture {
    match prompt {
        Prompt::Text { body, .. } | Prompt::Chat { body, .. } | Prompt::Api { body, .. } => {
            tokenizer.tokenize_request(model, input, body)
        }
        Prompt::Tokens(_) | Prompt::Absent => tokenizer.tokenize(model, input),
    }
}

/// Folds one blocking tokenization (`elapsed` for `bytes`) into the recent cost per byte (an
/// exponential average over about eight).
fn record_rate(rate: &std::sync::atomic::AtomicU64, elapsed: Duration, bytes: usize) {
    use std::sync::atomic::Ordering;
    let sample = u64::try_from(elapsed.as_nanos().saturating_mul(1000) / bytes.max(1) as u128)
        .unwrap_or(u64::MAX);
    let _ = rate.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
        Some(if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        })
    });
}

/// Caches `tokens` under `key` (an entry heavier than the whole cache is not kept).
fn insert_into(
    entries: &Mutex<Lru<u128, CacheEntry>>,
    gauges: &CacheGauges,
    key: u128,
    tokens: Arc<[u32]>,
) {
    insert_entry(
        entries,
        gauges,
        key,
        CacheEntry {
            tokens,
            keys: None,
            resume: None,
        },
    );
}

/// Caches `entry` (its keys weigh in beside its tokens).
fn insert_entry(
    entries: &Mutex<Lru<u128, CacheEntry>>,
    gauges: &CacheGauges,
    key: u128,
    entry: CacheEntry,
) {
    let bytes = cache_entry_bytes(&entry.tokens)
        + entry
            .keys
            .as_ref()
            .map_or(0, |k| std::mem::size_of_val(&*k.keys));
    let mut entries = entries.lock();
    entries.insert(key, entry, bytes);
    gauges.bytes.set(entries.bytes() as i64);
    gauges.entries.set(entries.len() as i64);
}

/// A whole tokenization as a decision's tokens.
fn tokenized(tokens: Arc<[u32]>) -> PromptTokens {
    let estimated_len = tokens.len();
    PromptTokens {
        tokens,
        exact: true,
        estimated_len,
        source: TokenSource::Tokenizer,
        keys: None,
    }
}

impl TokenizeInput {
    /// What a tokenizer is asked for a request's prompt (`None` for token ids or no prompt).
    pub fn from_prompt(prompt: &Prompt<'_>) -> Option<Self> {
        match prompt {
            Prompt::Tokens(_) | Prompt::Absent => None,
            prompt => Some(owned_input(prompt)),
        }
    }
}

fn owned_input(prompt: &Prompt<'_>) -> TokenizeInput {
    match prompt {
        Prompt::Text {
            text,
            add_special_tokens,
            ..
        } => TokenizeInput::Text {
            text: text.clone().into_owned(),
            add_special_tokens: *add_special_tokens,
        },
        Prompt::Chat {
            raw,
            add_generation_prompt,
            fields,
            ..
        } => TokenizeInput::Chat {
            messages: (*raw).to_owned(),
            add_generation_prompt: *add_generation_prompt,
            fields: ChatInputFields::from_request(fields),
        },
        Prompt::Api { api, fields, .. } => TokenizeInput::Api {
            api: *api,
            request: api_fields_object(fields),
        },
        Prompt::Tokens(_) | Prompt::Absent => TokenizeInput::Text {
            text: String::new(),
            add_special_tokens: false,
        },
    }
}

/// The fields as one JSON object (the raw values joined: no re-encoding).
fn api_fields_object(fields: &[(&'static str, &RawValue)]) -> Box<RawValue> {
    let mut json = String::from("{");
    for (i, (name, raw)) in fields.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        json.push('"');
        json.push_str(name);
        json.push_str("\":");
        json.push_str(raw.get());
    }
    json.push('}');
    RawValue::from_string(json).unwrap_or_else(|_| empty_object())
}

fn empty_object() -> Box<RawValue> {
    // A literal that is valid JSON; the fallback never happens for raw values serde parsed.
    serde_json::from_str("{}").unwrap_or_else(|_| RawValue::NULL.to_owned())
}

/// Cache keys of a Responses or Messages request's conversation items `0..k` for every k, like
/// [`conversation_keys`]: every other prompt-changing field is part of each key.
fn api_keys(
    pool: usize,
    api: ApiKind,
    items: &[&str],
    fields: &[(&'static str, &RawValue)],
) -> Vec<(u128, usize)> {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(match api {
        ApiKind::Responses => b"responses",
        ApiKind::Messages => b"messages\0",
    });
    for (name, raw) in fields {
        if matches!(*name, "input" | "messages") {
            continue;
        }
        hasher.update(name.as_bytes());
        hash_optional(&mut hasher, Some(raw.get().as_bytes()));
    }
    let mut bytes = 0;
    items
        .iter()
        .map(|item| {
            hasher.update(&(item.len() as u64).to_le_bytes());
            hasher.update(item.as_bytes());
            bytes += item.len();
            (hasher.digest128(), bytes)
        })
        .collect()
}

fn cache_key(pool: usize, kind: &[u8], flag: bool, parts: &[&[u8]]) -> u128 {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(kind);
    hasher.update(&[u8::from(flag)]);
    for part in parts {
        hasher.update(&(part.len() as u64).to_le_bytes());
        hasher.update(part);
    }
    hasher.digest128()
}

/// Cache keys of messages `0..k` for every k (last = whole conversation), with their byte sizes;
/// every prompt-changing field of the request is part of each key.
fn conversation_keys(
    pool: usize,
    messages: &[&str],
    add_generation_prompt: bool,
    fields: &ChatInputFields,
) -> Vec<(u128, usize)> {
    let mut hasher = Xxh3::new();
    hasher.update(&(pool as u64).to_le_bytes());
    hasher.update(b"chat");
    hasher.update(&[u8::from(add_generation_prompt)]);
    fields.hash_into(&mut hasher);
    let mut bytes = 0;
    messages
        .iter()
        .map(|m| {
            hasher.update(&(m.len() as u64).to_le_bytes());
            hasher.update(m.as_bytes());
            bytes += m.len();
            (hasher.digest128(), bytes)
        })
        .collect()
}

mod background;
#[cfg(test)]
mod goldens_tests;

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::request::{Endpoint, parse};

    const TINY_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");

    #[test]
    fn the_expected_cost_of_a_blocking_tokenization_follows_recent_ones() {
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        assert_eq!(
            cache.expected_blocking(100_000),
            Duration::ZERO,
            "nothing measured yet"
        );
        // 10 ms for 100 kB: 100 ns per byte.
        record_rate(
            &cache.blocking_ps_per_byte,
            Duration::from_millis(10),
            100_000,
        );
        assert_eq!(cache.expected_blocking(100_000), Duration::from_millis(10));
        assert_eq!(cache.expected_blocking(50_000), Duration::from_millis(5));
        // One faster sample moves the average an eighth of the way.
        record_rate(
            &cache.blocking_ps_per_byte,
            Duration::from_millis(2),
            100_000,
        );
        assert_eq!(cache.expected_blocking(100_000), Duration::from_millis(9));
    }

    #[tokio::test]
    async fn in_process_equals_the_model_tokenizer() {
        let tokenizer = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
        let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
        let text = Arc::new(TokenizeInput::Text {
            text: "Hello world".into(),
            add_special_tokens: true,
        });
        assert_eq!(
            tokenizer.tokenize("m", text).await.unwrap(),
            direct.encode_prompt("Hello world", true).unwrap()
        );
        let messages = serde_json::json!([{"role": "user", "content": "Hi"}]);
        let chat = Arc::new(TokenizeInput::Chat {
            messages: RawValue::from_string(messages.to_string()).unwrap(),
            add_generation_prompt: true,
            fields: ChatInputFields::default(),
        });
        assert_eq!(
            tokenizer.tokenize("m", chat).await.unwrap(),
            direct.encode_chat(&messages, true).unwrap()
        );
    }

    #[test]
    fn remote_chat_body_carries_every_prompt_field_as_tokenize_takes_them() {
        let body = r#"{"model":"m","messages":[{"role":"assistant","content":"a","reasoning_content":"r"}],"tools":[{"type":"function","function":{"name":"f"}}],"documents":[{"title":"t"}],"reasoning_effort":"low","chat_template_kwargs":{"x":1},"continue_final_message":true,"add_generation_prompt":false,"add_special_tokens":true}"#;
        let parsed = parse(body.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let TokenizeInput::Chat {
            messages,
            add_generation_prompt,
            fields,
        } = owned_input(&parsed.prompt)
        else {
            panic!("not chat")
        };
        let remote = remote_chat_body("m", &messages, add_generation_prompt, &fields);
        assert_eq!(
            remote,
            serde_json::json!({
                "model": "m",
                "add_generation_prompt": false,
                "continue_final_message": true,
                "add_special_tokens": true,
                "messages": [{"role": "assistant", "content": "a", "reasoning": "r"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "chat_template_kwargs": {"x": 1, "documents": [{"title": "t"}],
                    "enable_thinking": true, "reasoning_effort": "low"},
            })
        );
    }

    #[test]
    fn every_prompt_field_is_part_of_the_cache_key() {
        let base = r#"{"model":"m","messages":[{"role":"user","content":"q"}]"#;
        let variants = [
            "",
            r#","tools":[{"type":"function","function":{"name":"f"}}]"#,
            r#","documents":[{"title":"t"}]"#,
            r#","chat_template_kwargs":{"enable_thinking":false}"#,
            r#","reasoning_effort":"low""#,
            r#","continue_final_message":true"#,
            r#","add_special_tokens":true"#,
            r#","add_generation_prompt":false"#,
        ];
        let mut keys = std::collections::HashSet::new();
        for variant in variants {
            let body = format!("{base}{variant}}}");
            let parsed = parse(body.as_bytes(), Endpoint::ChatCompletions).unwrap();
            let Prompt::Chat {
                messages,
                add_generation_prompt,
                fields,
                ..
            } = &parsed.prompt
            else {
                panic!("not chat")
            };
            let key = conversation_keys(
                0,
                messages,
                *add_generation_prompt,
                &ChatInputFields::from_request(fields),
            );
            assert!(keys.insert(key[0].0), "{variant} changes the key");
        }
    }

    #[test]
    fn render_answers_and_endpoints() {
        assert_eq!(
            render_token_ids(br#"{"request_id":"r","token_ids":[1,2,3],"sampling_params":{}}"#),
            Ok(vec![1, 2, 3])
        );
        assert_eq!(
            render_token_ids(br#"[{"token_ids":[4,5]},{"token_ids":[6]}]"#),
            Ok(vec![4, 5])
        );
        for bad in [
            &b"[]"[..],
            br#"{"token_ids":[]}"#,
            br#"{"tokens":[1]}"#,
            b"{",
        ] {
            assert!(render_token_ids(bad).is_err());
        }
        let render = RenderTokenizer::new(
            "http://10.0.0.5:8000/engine/".parse().unwrap(),
            Duration::from_millis(50),
        );
        let url = |body: &str, endpoint| {
            let parsed = parse(body.as_bytes(), endpoint).unwrap();
            let input = owned_input(&parsed.prompt);
            render.endpoint_url(&input).unwrap().to_string()
        };
        let base = "http://10.0.0.5:8000/engine/v1";
        assert_eq!(
            url(r#"{"model":"m","prompt":"p"}"#, Endpoint::Completions),
            format!("{base}/completions/render")
        );
        assert_eq!(
            url(TURN1, Endpoint::ChatCompletions),
            format!("{base}/chat/completions/render")
        );
        assert_eq!(
            url(r#"{"model":"m","input":"q"}"#, Endpoint::Responses),
            format!("{base}/responses/render")
        );
        assert_eq!(
            url(
                r#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#,
                Endpoint::Messages
            ),
            format!("{base}/messages/render")
        );
    }

    #[tokio::test]
    async fn api_requests_tokenize_as_their_chat_and_key_every_prompt_field() {
        let tokenizer = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
        let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
        let chat = serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Hi"}
        ]);
        let as_chat = direct.encode_chat(&chat, true).unwrap();
        // vLLM encodes a Responses prompt with add_special_tokens (a chat's default is off).
        let with_special_tokens = kvroute_tokenize::ChatOptions {
            add_special_tokens: true,
            ..kvroute_tokenize::ChatOptions::default()
        };
        let as_responses = direct
            .encode_chat_with(&chat, &with_special_tokens)
            .unwrap();
        for (body, endpoint, expected) in [
            (
                r#"{"model":"m","instructions":"be brief","input":"Hi"}"#,
                Endpoint::Responses,
                &as_responses,
            ),
            (
                r#"{"model":"m","max_tokens":5,"system":"be brief","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}]}"#,
                Endpoint::Messages,
                &as_chat,
            ),
        ] {
            let parsed = parse(body.as_bytes(), endpoint).unwrap();
            let input = Arc::new(owned_input(&parsed.prompt));
            assert_eq!(
                &tokenizer.tokenize("m", Arc::clone(&input)).await.unwrap(),
                expected,
                "{body}"
            );
            // The /tokenize body is the converted chat.
            let remote = RemoteTokenizer::request_body("m", &input).unwrap();
            assert_eq!(remote["messages"], chat, "{body}");
        }
        let base = r#"{"model":"m","input":[{"role":"user","content":"q"}]"#;
        let mut keys = std::collections::HashSet::new();
        for variant in [
            "",
            r#","instructions":"i""#,
            r#","tools":[{"type":"function","name":"f"}]"#,
            r#","reasoning":{"effort":"low"}"#,
            r#","chat_template_kwargs":{"enable_thinking":false}"#,
            r#","previous_response_id":"r""#,
        ] {
            let body = format!("{base}{variant}}}");
            let parsed = parse(body.as_bytes(), Endpoint::Responses).unwrap();
            let Prompt::Api {
                api, items, fields, ..
            } = &parsed.prompt
            else {
                panic!("not an API prompt")
            };
            let key = api_keys(0, *api, items, fields);
            assert!(keys.insert(key[0].0), "{variant} changes the key");
        }
        let unchanged = format!(r#"{base},"temperature":0.1,"stream":true}}"#);
        let parsed = parse(unchanged.as_bytes(), Endpoint::Responses).unwrap();
        let Prompt::Api {
            api, items, fields, ..
        } = &parsed.prompt
        else {
            panic!("not an API prompt")
        };
        assert!(
            keys.contains(&api_keys(0, *api, items, fields)[0].0),
            "sampling fields are not"
        );
    }

    /// The in-process tokenizer behind a gate: answers only while the gate is open.
    #[derive(Debug)]
    struct GatedTokenizer {
        inner: InProcessTokenizer,
        open: tokio::sync::watch::Sender<bool>,
    }

    impl Tokenizer for GatedTokenizer {
        fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            let tokens = self.inner.tokenize(model, input);
            let mut open = self.open.subscribe();
            Box::pin(async move {
                let _ = open.wait_for(|open| *open).await;
                tokens.await
            })
        }
    }

    /// The in-process tokenizer answering after `delay`, waited for like a network tokenizer.
    #[derive(Debug)]
    struct SlowExactTokenizer {
        inner: InProcessTokenizer,
        delay: Duration,
    }

    impl Tokenizer for SlowExactTokenizer {
        fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            let tokens = self.inner.tokenize(model, input);
            let delay = self.delay;
            Box::pin(async move {
                tokio::time::sleep(delay).await; // the engine's round trip (the workload)
                tokens.await
            })
        }

        fn prefix_hit_wait(&self) -> Duration {
            Duration::MAX
        }
    }

    #[tokio::test]
    async fn a_network_tokenizer_is_waited_for_on_a_prefix_hit() {
        let tokenizer: Arc<dyn Tokenizer> = Arc::new(SlowExactTokenizer {
            inner: InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap(),
            delay: PREFIX_HIT_WAIT * 10,
        });
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        let budget = Duration::from_secs(5);
        let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
        cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        // Turn 1 is a cached prefix of turn 2, yet the answer is turn 2's exact tokens.
        let second = parse(TURN2.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let t2 = cache
            .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!((t2.source, t2.exact), (TokenSource::Tokenizer, true));
        let messages: serde_json::Value = serde_json::from_str(TURN2).unwrap();
        let expected = ModelTokenizer::from_dir(TINY_MODEL)
            .unwrap()
            .encode_chat(&messages["messages"], true)
            .unwrap();
        assert_eq!(&*t2.tokens, expected.as_slice());
    }

    const TURN1: &str = r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"}]}"#;
    const TURN2: &str = r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"},{"role":"assistant","content":"Once upon a time"},{"role":"user","content":"More"}]}"#;
    const TURN3: &str = r#"{"model":"m","messages":[{"role":"user","content":"Tell me a story"},{"role":"assistant","content":"Once upon a time"},{"role":"user","content":"More"},{"role":"assistant","content":"there was a router"},{"role":"user","content":"And then?"}]}"#;

    #[tokio::test]
    async fn next_turn_gets_exact_tokens_and_the_cache_serves_repeats() {
        let in_process = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
        let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
        let tokenizer: Arc<dyn Tokenizer> = Arc::new(in_process);
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        let budget = Duration::from_secs(5);
        let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let t1 = cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!((t1.source, t1.exact), (TokenSource::Tokenizer, true));
        let again = cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!(again.source, TokenSource::Cache);
        // The next turn's prefix is cached with its resume point: the turn is tokenized from
        // there (its new text only), exactly; and so is the turn after it.
        for turn in [TURN2, TURN3] {
            let next = parse(turn.as_bytes(), Endpoint::ChatCompletions).unwrap();
            let tokens = cache
                .tokens(0, "m", &next.prompt, Some(&tokenizer), budget)
                .await
                .unwrap();
            assert_eq!((tokens.source, tokens.exact), (TokenSource::Resumed, true));
            let messages: serde_json::Value = serde_json::from_str(turn).unwrap();
            let expected = direct.encode_chat(&messages["messages"], true).unwrap();
            assert_eq!(&*tokens.tokens, expected.as_slice());
        }
        // Another pool never sees pool 0's entries.
        let other = cache
            .tokens(1, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!(other.source, TokenSource::Tokenizer);
    }

    #[tokio::test]
    async fn a_hit_too_long_to_wait_for_routes_at_once_and_the_lane_caches_the_whole_turn() {
        let tokenizer: Arc<dyn Tokenizer> =
            Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
        let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        let budget = Duration::from_secs(5);
        // Longer than INLINE_MAX_BYTES: both turns run blocking.
        let story = "Once upon a time, in a land of long prompts, ".repeat(500);
        let turn1 = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": story}]})
        .to_string();
        let turn2 = serde_json::json!({"model": "m", "messages": [
            {"role": "user", "content": story},
            {"role": "assistant", "content": "And then?"},
            {"role": "user", "content": "More"}]})
        .to_string();
        let first = parse(turn1.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let t1 = cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!(t1.source, TokenSource::Tokenizer);
        // Recent blocking tokenizations say this prompt takes far over PREFIX_HIT_MAX_EXPECTED.
        cache
            .blocking_ps_per_byte
            .store(1_000_000, std::sync::atomic::Ordering::Relaxed);
        let second = parse(turn2.as_bytes(), Endpoint::ChatCompletions).unwrap();
        // The decision's key function: the lane caches its keys with the whole tokens.
        let (keys_job, _) = chain_keys_job();
        // Turn 2 as a decision asks for it (never a leading part), with the key function.
        let turn2_tokens = || {
            cache.leading_tokens(
                0,
                "m",
                &second.prompt,
                Some(&tokenizer),
                budget,
                usize::MAX / 2,
                Some(&keys_job),
            )
        };
        let t2 = turn2_tokens().await.unwrap();
        assert_eq!((t2.source, t2.exact), (TokenSource::PrefixCache, false));
        assert!(t2.keys.is_none(), "turn 1 was cached without keys");
        assert_eq!(t2.tokens, t1.tokens);
        assert_eq!(
            cache.gauges.blocking_in_flight.get(),
            0,
            "no blocking slot taken"
        );
        // The lane tokenizes turn 2 whole and caches it, exactly.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let cached = loop {
            let t = turn2_tokens().await.unwrap();
            if t.source == TokenSource::Cache {
                break t;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the lane never cached turn 2"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let messages: serde_json::Value = serde_json::from_str(&turn2).unwrap();
        let expected = direct.encode_chat(&messages["messages"], true).unwrap();
        assert_eq!(&*cached.tokens, expected.as_slice());
        let keys = cached.keys.expect("cached with its keys");
        assert_eq!(keys.fingerprint, 42);
        assert_eq!(&*keys.keys, chain_keys(&expected).as_slice());
        wait_for("the lane's jobs all ended", || {
            cache.gauges.background_queued.get() == 0
        })
        .await;
    }

    #[tokio::test]
    async fn the_lane_resumes_a_leading_miss_and_the_next_turn_resumes_from_it() {
        let tokenizer: Arc<dyn Tokenizer> =
            Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
        let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        let budget = Duration::from_secs(5);
        let story =
            "Once upon a time, in a land of long prompts, a router met a cache. ".repeat(60);
        let turn1 = serde_json::json!({"model": "m", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": story}]});
        let mut turn2 = turn1.clone();
        if let Some(messages) = turn2["messages"].as_array_mut() {
            messages.push(serde_json::json!({"role": "assistant", "content": "And then?"}));
            messages.push(serde_json::json!({"role": "user", "content": "Tell me more"}));
        }
        let expected =
            |turn: &serde_json::Value| direct.encode_chat(&turn["messages"], true).unwrap();
        // Turn 1 as a decision asks for it: only its leading part now.
        let body1 = turn1.to_string();
        let first = parse(body1.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let (keys_job, hashed) = chain_keys_job();
        // A turn as a decision asks for it, leading parts from 1 KiB, with the key function.
        let decide = |prompt| {
            cache.leading_tokens(
                0,
                "m",
                prompt,
                Some(&tokenizer),
                budget,
                1024,
                Some(&keys_job),
            )
        };
        let t1 = decide(&first.prompt).await.unwrap();
        assert_eq!((t1.source, t1.exact), (TokenSource::Leading, false));
        let whole1 = expected(&turn1);
        assert!(t1.tokens.len() < whole1.len() && whole1.starts_with(&t1.tokens));
        // The lane encodes the rest from the leading part's cut; the cache then holds all of it.
        wait_for("the lane cached turn 1", || {
            cache.gauges.background_queued.get() == 0
        })
        .await;
        let cached = cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!(cached.source, TokenSource::Cache);
        assert_eq!(&*cached.tokens, whole1.as_slice());
        // With its keys, and the chain's point at its resume point's last full block.
        let keys1 = cached.keys.expect("the lane cached turn 1's keys");
        assert_eq!(&*keys1.keys, chain_keys(&whole1).as_slice());
        let point = keys1.point.expect("a chain point");
        assert!(point.blocks() > 0 && point.blocks() <= keys1.keys.len());
        // Turn 2 takes over turn 1's tokens before its last cut and encodes the rest: exact.
        let body2 = turn2.to_string();
        let second = parse(body2.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let before = hashed.load(Ordering::Relaxed);
        let t2 = decide(&second.prompt).await.unwrap();
        assert_eq!((t2.source, t2.exact), (TokenSource::Resumed, true));
        let whole2 = expected(&turn2);
        assert_eq!(&*t2.tokens, whole2.as_slice());
        // Its keys are exact, and only the blocks after turn 1's chain point were hashed.
        let keys2 = t2.keys.expect("turn 2's keys");
        let all2 = chain_keys(&whole2);
        assert_eq!(&*keys2.keys, all2.as_slice());
        assert_eq!(
            hashed.load(Ordering::Relaxed) - before,
            all2.len() - point.blocks()
        );
        // A foreign turn's keys are not extended: its tokens differ before the point.
        let mut foreign = whole2.clone();
        foreign[0] ^= 1;
        let refused = keys_job
            .keys_for(&foreign, Some((&whole1, &keys1)), foreign.len())
            .expect("keys");
        assert_eq!(&*refused.keys, chain_keys(&foreign).as_slice());
    }

    /// Token-chain keys of 16-token blocks, as a pool's decision computes them.
    fn chain_keys(tokens: &[u32]) -> Vec<u64> {
        kvroute_block_keys::KeyScheme::TokenChain
            .prompt_keys(tokens, 16, None, None)
            .unwrap()
    }

    /// A decision's key function for token-chain keys of 16-token blocks, and how many blocks
    /// it has hashed.
    fn chain_keys_job() -> (KeysJob, Arc<AtomicUsize>) {
        let hashed = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&hashed);
        let job = KeysJob {
            fingerprint: 42,
            block_size: 16,
            compute: Arc::new(move |from, tokens, mark, out| {
                let before = out.len();
                let point = kvroute_block_keys::KeyScheme::TokenChain
                    .extend_prompt_keys(from, tokens, 16, None, None, mark, out)?;
                counted.fetch_add(out.len() - before, Ordering::Relaxed);
                Ok(point)
            }),
        };
        (job, hashed)
    }

    #[tokio::test]
    async fn slow_tokenizer_routes_on_the_cached_prefix_and_fills_the_cache_later() {
        let (open, _) = tokio::sync::watch::channel(true);
        let gated = Arc::new(GatedTokenizer {
            inner: InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap(),
            open,
        });
        let tokenizer: Arc<dyn Tokenizer> = Arc::clone(&gated) as Arc<dyn Tokenizer>;
        let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
        let budget = Duration::from_secs(5);
        let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let t1 = cache
            .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();

        gated.open.send_replace(false);
        let second = parse(TURN2.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let t2 = cache
            .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!((t2.source, t2.exact), (TokenSource::PrefixCache, false));
        assert_eq!(t2.tokens, t1.tokens);
        assert!(t2.estimated_len > t1.tokens.len());

        // The tokenization left running in the background fills the cache for the next call.
        gated.open.send_replace(true);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            gated.open.send_replace(false);
            let t = cache
                .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
                .await
                .unwrap();
            gated.open.send_replace(true);
            if t.source == TokenSource::Cache {
                assert!(t.exact && t.tokens.len() > t1.tokens.len());
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "cache never filled");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// One token per byte, on a blocking thread (`runs_blocking`) that waits until the gate is
    /// open; counts the calls that started.
    #[derive(Debug)]
    struct GatedBlocking {
        open: tokio::sync::watch::Sender<bool>,
        started: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl GatedBlocking {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                open: tokio::sync::watch::channel(false).0,
                started: Arc::default(),
            })
        }
    }

    impl Tokenizer for GatedBlocking {
        fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
            let bytes = |input: &TokenizeInput| match input {
                TokenizeInput::Text { text, .. } => text.bytes().map(u32::from).collect(),
                _ => Vec::new(),
            };
            if !self.runs_blocking(&input, false) {
                return Box::pin(std::future::ready(Ok(bytes(&input))));
            }
            let mut open = self.open.subscribe();
            let started = Arc::clone(&self.started);
            let work = tokio::task::spawn_blocking(move || {
                started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let gate = open.wait_for(|open| *open);
                let _ = tokio::runtime::Handle::current().block_on(gate);
                bytes(&input)
            });
            Box::pin(async move {
                work.await.map_err(|e| TokenizeError::InProcess {
                    reason: e.to_string(),
                })
            })
        }

        fn runs_blocking(&self, input: &TokenizeInput, _leading: bool) -> bool {
            input.len_bytes() > 8
        }
    }

    fn completion(text: &str) -> String {
        serde_json::json!({"model": "m", "prompt": text}).to_string()
    }

    async fn tokens_of(
        cache: &TokenCache,
        tokenizer: &Arc<dyn Tokenizer>,
        body: &str,
        budget: Duration,
    ) -> Result<PromptTokens, TokenizeError> {
        let parsed = parse(body.as_bytes(), Endpoint::Completions).unwrap();
        cache
            .tokens(0, "m", &parsed.prompt, Some(tokenizer), budget)
            .await
    }

    async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn the_cache_is_bounded_by_bytes_and_counts_every_entry() {
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let limits = TokenLimits {
            cache_bytes: 64 * 1024,
            ..TokenLimits::default()
        };
        let cache = TokenCache::new(limits, TaskTracker::new()).with_metrics(&metrics);
        let gated = GatedBlocking::new();
        gated.open.send_replace(true);
        let tokenizer: Arc<dyn Tokenizer> = gated;
        let budget = Duration::from_secs(10);
        // 100 distinct prompts of 1000 tokens: 100 × (4000 + overhead) bytes, far over the bound.
        for i in 0..100 {
            let text = format!("{i:04}{}", "x".repeat(996));
            let tokens = tokens_of(&cache, &tokenizer, &completion(&text), budget)
                .await
                .unwrap();
            assert_eq!(tokens.tokens.len(), 1000);
            assert!(cache.bytes() <= limits.cache_bytes, "{}", cache.bytes());
        }
        let entry = cache_entry_bytes(&[0; 1000]);
        assert_eq!(
            cache.bytes(),
            limits.cache_bytes / entry * entry,
            "kept full"
        );
        assert_eq!(metrics.token_cache_bytes.get(), cache.bytes() as i64);
        assert_eq!(
            metrics.token_cache_entries.get(),
            (limits.cache_bytes / entry) as i64
        );
        // The most recent ones stay; the oldest went.
        let last = completion(&format!("0099{}", "x".repeat(996)));
        let first = completion(&format!("0000{}", "x".repeat(996)));
        assert_eq!(
            tokens_of(&cache, &tokenizer, &last, budget)
                .await
                .unwrap()
                .source,
            TokenSource::Cache
        );
        assert_eq!(
            tokens_of(&cache, &tokenizer, &first, budget)
                .await
                .unwrap()
                .source,
            TokenSource::Tokenizer
        );
    }

    #[tokio::test]
    async fn blocking_tokenizations_are_capped_and_a_late_one_finishes_holding_its_slot() {
        let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
        let limits = TokenLimits {
            concurrency: 1,
            max_prompt_bytes: 1000,
            ..TokenLimits::default()
        };
        let tasks = TaskTracker::new();
        let cache = TokenCache::new(limits, tasks.clone()).with_metrics(&metrics);
        let gated = GatedBlocking::new();
        let tokenizer: Arc<dyn Tokenizer> = Arc::clone(&gated) as Arc<dyn Tokenizer>;
        let short = Duration::from_millis(20);
        let long_prompt = completion(&"a".repeat(900));
        // Its decision stops waiting; the work goes on, holding the only slot.
        let late = tokens_of(&cache, &tokenizer, &long_prompt, short).await;
        assert!(
            matches!(late, Err(TokenizeError::Timeout { .. })),
            "{late:?}"
        );
        let started = || gated.started.load(std::sync::atomic::Ordering::SeqCst);
        wait_for("the late work started", || started() == 1).await;
        assert_eq!(metrics.tokenize_blocking_in_flight.get(), 1);
        assert_eq!(metrics.tokenize_abandoned.get(), 1);
        // The next blocking one gets no slot within its budget and does not start.
        let busy = tokens_of(&cache, &tokenizer, &completion(&"b".repeat(900)), short).await;
        assert!(matches!(busy, Err(TokenizeError::Busy { .. })), "{busy:?}");
        assert_eq!(started(), 1);
        // Work that does not block needs no slot.
        let small = tokens_of(&cache, &tokenizer, &completion("hi"), short).await;
        assert_eq!(small.unwrap().tokens.len(), 2);
        // Too large for in-process tokenization: refused at once, before any slot.
        let huge = tokens_of(&cache, &tokenizer, &completion(&"c".repeat(1001)), short).await;
        assert!(
            matches!(
                huge,
                Err(TokenizeError::PromptTooLarge {
                    bytes: 1001,
                    limit: 1000
                })
            ),
            "{huge:?}"
        );
        // The abandoned work ends, frees its slot and leaves its (bounded) result in the cache.
        gated.open.send_replace(true);
        wait_for("the slot is freed", || {
            metrics.tokenize_blocking_in_flight.get() == 0
        })
        .await;
        let again = tokens_of(&cache, &tokenizer, &long_prompt, short).await;
        assert_eq!(again.unwrap().source, TokenSource::Cache);
        let next = tokens_of(&cache, &tokenizer, &completion(&"b".repeat(900)), short).await;
        assert_eq!(next.unwrap().source, TokenSource::Tokenizer);
        tasks.close();
        tasks.wait().await;
    }

    #[tokio::test]
    async fn in_process_tokenizer_refuses_prompts_over_the_limit_and_inlines_small_ones() {
        let tokenizer: Arc<dyn Tokenizer> =
            Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
        let limits = TokenLimits {
            concurrency: 1,
            max_prompt_bytes: 64 * 1024,
            ..TokenLimits::default()
        };
        let cache = TokenCache::new(limits, TaskTracker::new());
        let budget = Duration::from_secs(10);
        let over = completion(&"word ".repeat(13 * 1024 + 1));
        let refused = tokens_of(&cache, &tokenizer, &over, budget).await;
        assert!(
            matches!(refused, Err(TokenizeError::PromptTooLarge { .. })),
            "{refused:?}"
        );
        // Its leading tokens are still computed (bounded work: a cut from the leading part).
        let parsed = parse(over.as_bytes(), Endpoint::Completions).unwrap();
        let leading = cache
            .leading_tokens(
                0,
                "m",
                &parsed.prompt,
                Some(&tokenizer),
                budget,
                16 * 1024,
                None,
            )
            .await
            .unwrap();
        assert_eq!(leading.source, TokenSource::Leading);
        let small = completion("Hello world");
        assert!(
            !tokenizer.runs_blocking(
                &owned_input(
                    &parse(small.as_bytes(), Endpoint::Completions)
                        .unwrap()
                        .prompt
                ),
                false
            )
        );
        assert!(tokenizer.runs_blocking(&owned_input(&parsed.prompt), false));
    }
}
