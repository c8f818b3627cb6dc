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
//!
//! Files: `input` (what a tokenizer is asked), `in_process`, `remote` and `render` (the
//! backends; the last two share `http`), `cache` (the token cache and how it schedules a
//! decision's tokenization), `cache_keys` (its prompt hashes), `block_keys` (block keys cached
//! with the tokens), `background` (the idle-priority lane for work no decision waits for).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvroute_tokenize::{LeadingTokens, ResumableTokens, ResumePoint};
use tokio_util::task::TaskTracker;

use crate::config::{Engine, TokenizerSource};
use crate::error::TokenizeError;
use kvroute_config::ConfigError;

mod background;
mod block_keys;
mod cache;
mod cache_keys;
pub(crate) mod http;
mod in_process;
mod input;
mod multimodal;
mod remote;
mod render;

#[cfg(test)]
mod goldens_tests;
#[cfg(test)]
mod sglang_goldens_tests;
#[cfg(test)]
mod tests;

pub use block_keys::{CachedKeys, ComputeKeys, KeysJob};
pub use cache::{
    LeadingSteps, PromptTokens, TokenCache, TokenLimits, TokenSource, TokensRequest,
    cache_entry_bytes,
};
pub use in_process::InProcessTokenizer;
pub use input::{ChatInputFields, TokenizeInput};
pub use multimodal::{MultiModalPlaces, PlacedItem, block_key_items};
pub use remote::RemoteTokenizer;
pub use render::RenderTokenizer;

/// Boxed future returned by [`Tokenizer::tokenize`].
pub type TokenizeFuture = Pin<Box<dyn Future<Output = Result<Vec<u32>, TokenizeError>> + Send>>;

/// A prompt's token ids with the media items the engine placed in them (render mode; `None`
/// for text, and from every tokenizer that only routes text).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// Its images (and other media) in the order vLLM hashes them.
    pub multimodal: Option<Arc<MultiModalPlaces>>,
}

impl Tokenized {
    /// Text tokens.
    pub fn text(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            multimodal: None,
        }
    }
}

/// Boxed future returned by [`Tokenizer::tokenize_request`].
pub type RequestFuture = Pin<Box<dyn Future<Output = Result<Tokenized, TokenizeError>> + Send>>;

/// Boxed future returned by [`InProcess::tokenize_leading`].
pub type LeadingFuture = Pin<Box<dyn Future<Output = Result<LeadingTokens, TokenizeError>> + Send>>;

/// A leading part of a chat as one step of a decision left it, for its next, longer step:
/// the chat as rendered, the part's tokens and where they end.
#[derive(Debug, Clone)]
pub struct LeadingStep {
    /// The chat as rendered for encoding.
    pub rendered: Arc<kvroute_tokenize::RenderedChat>,
    /// The part's tokens.
    pub tokens: Arc<[u32]>,
    /// The part's cut, where a longer part takes its tokens over.
    pub resume: ResumePoint,
}

/// A source of token ids for one pool.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    /// Token ids of `input` for `model` (base or adapter name, as the client sent it).
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture;

    /// Token ids of a request whose whole `body` is at hand: [`Self::tokenize`] of its prompt
    /// unless the tokenizer sends the request itself somewhere ([`RenderTokenizer`], which also
    /// tells where the engine placed the request's images).
    fn tokenize_request(
        &self,
        model: &str,
        input: Arc<TokenizeInput>,
        _body: &[u8],
    ) -> RequestFuture {
        let tokenizing = self.tokenize(model, input);
        Box::pin(async move { tokenizing.await.map(Tokenized::text) })
    }

    /// How it computes them: what `kvroute-check` reports, and whether a conversation-prefix
    /// hit waits for them like for an engine's answer ([`TokenizerMode::is_network`]).
    /// [`TokenizerMode::Other`] unless overridden.
    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Other
    }

    /// What it offers the token cache as a tokenizer running on this process's threads: the
    /// work is then bounded by the cache's blocking slots and prompt-size limit, and it can give
    /// leading parts, resume a conversation's earlier turn and fill the cache from the
    /// background lane. `None` (the default) for tokenizers that run elsewhere.
    fn in_process(&self) -> Option<&dyn InProcess> {
        None
    }
}

/// A tokenizer that computes token ids on this process's threads, as the token cache schedules
/// it ([`Tokenizer::in_process`]).
pub trait InProcess: Send + Sync {
    /// Whether tokenizing `input` (only its leading tokens when `leading`) runs on a blocking
    /// thread of this process. [`TokenCache`] then takes one of its slots first, within the
    /// decision's budget, and holds it until the work ends, even once the decision stopped
    /// waiting; such work is also subject to its prompt-size limit.
    fn runs_blocking(&self, input: &TokenizeInput, leading: bool) -> bool;

    /// The exact first tokens of `input`'s prompt from its (rendered) text up to the first exact
    /// cut at or after `min_bytes` ([`kvroute_tokenize::leading_cut`]); `None` for inputs it
    /// cannot cut (HF-only models, API requests). With `shorter`, the same decision's previous,
    /// shorter leading part of this input: its rendered chat is not rendered again and its tokens
    /// are taken over (a tokenizer may ignore it).
    fn tokenize_leading(
        &self,
        input: Arc<TokenizeInput>,
        min_bytes: usize,
        shorter: Option<LeadingStep>,
    ) -> Option<LeadingFuture>;

    /// A chat's tokens computed on the calling thread, taking over the first tokens of an
    /// earlier turn of the conversation when `prior` (its resume point and tokens) applies, and
    /// naming where the turn after can take over this one's
    /// ([`kvroute_tokenize::ModelTokenizer::encode_chat_resumable`]); `None` for inputs other
    /// than chats and for models it cannot resume on.
    fn tokenize_resumable(
        &self,
        input: &TokenizeInput,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Option<Result<ResumableTokens, TokenizeError>>;

    /// [`Self::tokenize_resumable`] of a chat its leading tokens already rendered
    /// ([`kvroute_tokenize::LeadingTokens::rendered`]): the same tokens without rendering it
    /// again; `None` when this tokenizer does not take rendered chats.
    fn tokenize_rendered_resumable(
        &self,
        _rendered: &kvroute_tokenize::RenderedChat,
        _prior: Option<(&ResumePoint, &[u32])>,
    ) -> Option<Result<ResumableTokens, TokenizeError>> {
        None
    }

    /// `input`'s tokens computed on the calling thread: what [`TokenCache`]'s low-priority lane
    /// runs to fill the cache for a conversation's next turn.
    fn tokenize_now(&self, input: &TokenizeInput) -> Result<Vec<u32>, TokenizeError>;
}

/// How a [`Tokenizer`] computes token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerMode {
    /// In process, with one of `kvroute-tokenize`'s fast exact encoders (checked against HF at
    /// load).
    InProcessFast(kvroute_tokenize::FastEncoderKind),
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
            Self::InProcessFast(_) | Self::InProcessHf => "in_process",
            Self::Remote => "remote",
            Self::Render => "render",
            Self::Other => "other",
        }
    }

    /// The in-process encoder, `fast-byte-bpe`, `fast-sentencepiece-bpe` or `hf` (`None`
    /// elsewhere).
    pub fn encoder(self) -> Option<&'static str> {
        match self {
            Self::InProcessFast(kind) => Some(kind.name()),
            Self::InProcessHf => Some("hf"),
            Self::Remote | Self::Render | Self::Other => None,
        }
    }

    /// Whether an engine is asked for the tokens over the network (remote, render): the mode
    /// exists to be exact, and its round trip alone outlasts the in-process wait, so a
    /// conversation-prefix hit waits for them its whole budget (routing on an older turn's
    /// prefix under-predicts every next turn).
    pub fn is_network(self) -> bool {
        matches!(self, Self::Remote | Self::Render)
    }
}

/// The prompt construction of an engine family.
pub fn dialect_of(engine: Engine) -> kvroute_tokenize::Dialect {
    match engine {
        Engine::Vllm => kvroute_tokenize::Dialect::Vllm,
        Engine::Sglang => kvroute_tokenize::Dialect::Sglang,
    }
}

/// Builds the tokenizer a pool's `source` names (`None` for [`TokenizerSource::None`]); `pool`
/// is the pool's index, for the error's field name. An in-process tokenizer builds prompts as
/// the pool's `engine` family does (vLLM and SGLang render the same chat differently). Loading a
/// model folder is slow (it checks the fast encoder against HF).
pub fn from_source(
    source: &TokenizerSource,
    engine: Engine,
    pool: usize,
    tasks: &TaskTracker,
) -> Result<Option<Arc<dyn Tokenizer>>, ConfigError> {
    Ok(match source {
        TokenizerSource::None => None,
        TokenizerSource::ModelDir(dir) => {
            let loaded = InProcessTokenizer::load(dir, tasks.clone()).map_err(|e| {
                ConfigError::load(
                    format!("pools[{pool}].tokenizer.model_dir"),
                    format_args!("cannot load tokenizer from '{}': {e}", dir.display()),
                )
            })?;
            Some(Arc::new(loaded.with_dialect(dialect_of(engine))))
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
