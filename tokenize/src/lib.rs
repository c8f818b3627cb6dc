//! Tokenizes prompts exactly as vLLM does, so block keys computed outside the engine equal its own.
//!
//! A model folder (Hugging Face layout) holds `tokenizer.json` and `tokenizer_config.json` (bos/eos
//! tokens and the Jinja chat template, or a separate `chat_template.jinja`). [`ModelTokenizer`]
//! loads it once — the tokenizer is parsed and the template compiled at load — and then:
//!
//! - [`ModelTokenizer::encode_prompt`]: what vLLM does for `/v1/completions` and `/tokenize
//!   {"prompt"}` (`add_special_tokens=true` by default, so a Llama-style post-processor adds bos);
//! - [`ModelTokenizer::encode_chat`]: what vLLM does for `/v1/chat/completions` and `/tokenize
//!   {"messages"}`; [`ModelTokenizer::encode_chat_with`] takes every other field that changes
//!   the prompt ([`ChatOptions`]: `tools`, `chat_template_kwargs`, `reasoning_effort`,
//!   `documents`, `continue_final_message`, `add_special_tokens`). The messages are prepared as
//!   vLLM 0.32 prepares them (null content → `""`, tool-call arguments parsed into objects,
//!   only the fields vLLM keeps, `developer` → `system` where the template lacks the role,
//!   content as a string or a parts list by vLLM's detection of the template's
//!   [`ContentFormat`]), the template is rendered in transformers' environment (`tojson` as
//!   Python's `json.dumps` with insertion order, `strftime_now`, `raise_exception`, Python
//!   string methods and whitespace), and the text is encoded with the request's
//!   `add_special_tokens` (default false: the template writes bos itself).
//!
//! SGLang 0.5.23 builds the prompt of the same request differently (its request models, content
//! flattening, tools, kwargs and final-message handling): [`ChatOptions::dialect`] set to
//! [`Dialect::Sglang`] reproduces it, through the same template rendering, and
//! [`ModelTokenizer::convert_api_request_for`] converts Responses and Messages requests as it does.
//!
//! Encoding uses [`FastBpe`], an exact re-implementation of the byte-level BPE pipelines
//! (GPT-2 style, Llama 3, Qwen2/3, o200k, Tekken, DeepSeek-V3) and of SentencePiece-style BPE
//! (Llama 2, Gemma; speeds against `tokenizers` in BENCHMARKS.md), whenever the `tokenizer.json`
//! is one it models and it agrees with `tokenizers` on a self-check sample at load; otherwise
//! (and for decoding) the `tokenizers` crate does the work. [`ModelTokenizer::fast_encoder_kind`]
//! tells which.
//!
//! ```
//! # fn main() -> Result<(), kvroute_tokenize::TokenizeError> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");
//! let tokenizer = kvroute_tokenize::ModelTokenizer::from_dir(dir)?;
//! let prompt = tokenizer.encode_prompt("Hello world", true)?;
//! assert_eq!(prompt[0], 0); // <s>
//! let messages = serde_json::json!([{"role": "user", "content": "Hello world"}]);
//! let chat = tokenizer.encode_chat(&messages, true)?;
//! assert_eq!(chat[0], 0);
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod apis;
pub mod byte_bpe;
mod chat;
mod content_format;
mod conversation;
mod error;
mod pyjson;
mod pytime;
pub mod testing;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use apis::ConvertedChat;
pub use byte_bpe::{FastBpe, FastEncoderKind};
pub use chat::ChatTemplate;
pub use content_format::ContentFormat;
pub use conversation::media_part_kind;
pub use error::TokenizeError;

/// Whose prompt construction to reproduce: engines build a chat request's prompt from the same
/// template differently (which fields they read, how they prepare messages and tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Dialect {
    /// vLLM 0.32 (the default).
    #[default]
    Vllm,
    /// SGLang 0.5.23's `/v1/chat/completions` (and the APIs it serves through it), started
    /// without a reasoning parser: see `conversation::prepare_sglang` and
    /// `ChatTemplate::context`.
    Sglang,
}

impl Dialect {
    /// The `add_special_tokens` a completion prompt is encoded with when the request asks for
    /// `requested`: SGLang's `CompletionRequest` has no such field (its tokenizer manager always
    /// encodes with the tokenizer's default, true).
    pub fn completion_special_tokens(self, requested: bool) -> bool {
        match self {
            Self::Vllm => requested,
            Self::Sglang => true,
        }
    }
}

/// The fields of a chat request that change its prompt besides `messages` (vLLM 0.32's
/// `ChatCompletionRequest`; `/tokenize` and `/v1/chat/completions/render` take the same).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Whose prompt construction to reproduce (default vLLM's).
    pub dialect: Dialect,
    /// `tool_choice` as sent (SGLang renders no tools for `"none"` and only the named one for a
    /// specific function; vLLM's template always sees every tool).
    pub tool_choice: Option<serde_json::Value>,
    /// `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false; not with `add_generation_prompt`).
    pub continue_final_message: bool,
    /// `add_special_tokens` for encoding the rendered text (default false for chat).
    pub add_special_tokens: bool,
    /// `tools` as sent (a list of function tools). Shared: a caller that keeps the tool lists
    /// it parsed hands the same list again to a request sending the same text, and the
    /// template's kept values (built once per list) recognise it without comparing.
    pub tools: Option<Arc<serde_json::Value>>,
    /// `documents` as sent (a list of objects).
    pub documents: Option<serde_json::Value>,
    /// `reasoning_effort` (vLLM also sets `enable_thinking` from it).
    pub reasoning_effort: Option<String>,
    /// `chat_template_kwargs` as sent.
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Whether the request carries its own `chat_template` (vLLM refuses it unless started with
    /// `--trust-request-chat-template`; kvroute never renders one).
    pub request_template: bool,
    /// Whether vLLM validated `messages` through its chat request model (chat completions and
    /// the Messages API, default): tool calls then come in its TypedDicts' key order. The
    /// Responses API's converted messages are built by vLLM and never validated.
    pub messages_validated: bool,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            dialect: Dialect::Vllm,
            tool_choice: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            tools: None,
            documents: None,
            reasoning_effort: None,
            chat_template_kwargs: None,
            request_template: false,
            messages_validated: true,
        }
    }
}

/// An API vLLM serves by converting its requests into a chat ([`apis`]); named by the request
/// parser, which tells them apart.
pub use kvroute_request::ApiKind;

/// A model's tokenizer and chat template, loaded once and shared (`Send + Sync`, `&self` calls).
#[derive(Debug)]
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The exact fast encoder, when the pipeline is supported and passed the self-check.
    fast: Option<FastBpe>,
    chat: Option<ChatTemplate>,
    /// What templates see by name (kept for [`Self::with_chat_template`]).
    special: chat::SpecialTokens,
    eos_token_id: Option<u32>,
    /// Id of the bos token named in `tokenizer_config.json`, if any.
    bos_token_id: Option<u32>,
    /// Whether encoding the empty text with special tokens gives any (SGLang's probe of whether
    /// the tokenizer adds them by itself).
    specials_on_empty: bool,
    /// Whether [`leading_cut`] offsets are token boundaries for this model: the fast encoder
    /// serves it with one of the byte-level pipelines it models and no added token's content
    /// has ASCII whitespace (so none can span a cut).
    leading_cuts: bool,
}

/// The leading tokens of a prompt ([`ModelTokenizer::encode_prompt_leading`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeadingTokens {
    /// The first tokens of the prompt, exactly as the whole prompt's encoding begins.
    pub tokens: Vec<u32>,
    /// Whether these are all of the prompt's tokens.
    pub complete: bool,
    /// Bytes of the (rendered) prompt text the tokens cover.
    pub text_bytes: usize,
    /// Bytes of the whole (rendered) prompt text; `None` when a chat's rendering stopped at the
    /// leading part (see [`RenderedChat`]).
    pub total_bytes: Option<usize>,
    /// Where a later turn (or the rest of this prompt) can take over these tokens: the leading
    /// cut, or the last cut when the tokens are complete (`None`: no cut, or none allowed).
    pub resume: Option<ResumePoint>,
    /// The rendered chat these tokens lead, when they are not complete: a longer leading part
    /// ([`ModelTokenizer::encode_rendered_leading`]) and its whole tokens
    /// ([`ModelTokenizer::encode_rendered_chat_resumable`]) need no second parse.
    pub rendered: Option<Arc<RenderedChat>>,
}

/// A chat rendered for encoding, kept to encode more of it later without parsing it again: its
/// rendered text, whole or (a chat's leading part, when the model allows cuts) only up to a
/// little past the first cut the part needed, with the template's context to render the rest.
/// Rendering the whole of a long chat for its first few hundred tokens cost more than encoding
/// them: the templates join every message's text into new strings.
#[derive(Debug)]
pub struct RenderedChat {
    text: String,
    add_special_tokens: bool,
    /// The template's context when `text` is only the start of the rendering.
    rest: Option<chat::Context>,
}

impl PartialEq for RenderedChat {
    fn eq(&self, other: &Self) -> bool {
        (&self.text, self.add_special_tokens, self.rest.is_some())
            == (&other.text, other.add_special_tokens, other.rest.is_some())
    }
}

impl Eq for RenderedChat {}

impl RenderedChat {
    /// Whether `text` is the whole rendering.
    pub fn is_whole(&self) -> bool {
        self.rest.is_none()
    }

    /// Whether the text holds a leading part from `min_bytes`: it is whole, or it has a
    /// [`leading_cut`] from there.
    fn reaches(&self, min_bytes: usize) -> bool {
        self.rest.is_none() || leading_cut(&self.text, min_bytes).is_some()
    }
}

/// The first byte offset at or after `min_bytes` where `text` can be cut without changing the
/// tokens before it, for the byte-level BPE pipelines the fast encoder models (GPT-2, Llama 3,
/// Qwen2/3, o200k): right after a `\n` followed by an ASCII letter, or right before a space
/// between two ASCII letters. No `Split` pattern of those pipelines lets a piece run across
/// either spot (a letter piece never starts with `\n` or ends before a letter; a newline piece
/// never swallows a letter), and NFC cannot compose across them (the next char is a starter
/// that composes with nothing before it). `None` if there is no such offset before the end.
pub fn leading_cut(text: &str, min_bytes: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    (min_bytes.max(1)..bytes.len().saturating_sub(1)).find(|&at| is_cut(bytes, at))
}

/// The last [`leading_cut`] offset of `text`, if any.
pub fn last_cut(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    (1..bytes.len().saturating_sub(1))
        .rev()
        .find(|&at| is_cut(bytes, at))
}

/// Whether `at` is a [`leading_cut`] spot of `bytes` (`0 < at < len - 1`).
fn is_cut(bytes: &[u8], at: usize) -> bool {
    let (Some(&before), Some(&here), Some(&after)) = (
        at.checked_sub(1).and_then(|b| bytes.get(b)),
        bytes.get(at),
        bytes.get(at + 1),
    ) else {
        return false;
    };
    (before == b'\n' && here.is_ascii_alphabetic())
        || (before.is_ascii_alphabetic() && here == b' ' && after.is_ascii_alphabetic())
}

/// `prior` (an earlier encoding's resume point and tokens) when `text`, encoded with `add`,
/// starts with the same bytes up to its cut, and that cut is a cut of `text` at or before `cut`.
fn prior_applying<'p>(
    text: &str,
    add: bool,
    cut: usize,
    prior: Option<(&'p ResumePoint, &'p [u32])>,
) -> Option<(&'p ResumePoint, &'p [u32])> {
    prior.filter(|(point, ids)| {
        point.tokens <= ids.len()
            && point.text_bytes <= cut
            && is_cut(text.as_bytes(), point.text_bytes)
            && ResumePoint::fingerprint(add, &text.as_bytes()[..point.text_bytes])
                == point.fingerprint
    })
}

/// The tokens of `text` up to `cut` (a cut) and the resume point there, the first ones taken
/// over from `prior` when it applies; with the bytes taken over (`None`: none). The buffer has
/// room for the tokens of `room` bytes of text, so a caller encoding on to there does not regrow
/// it.
fn encode_to_cut(
    fast: &FastBpe,
    text: &str,
    add: bool,
    cut: usize,
    prior: Option<(&ResumePoint, &[u32])>,
    room: usize,
) -> (Vec<u32>, ResumePoint, Option<usize>) {
    let taken = prior_applying(text, add, cut, prior);
    let (prior_ids, from) = match taken {
        Some((point, ids)) => (&ids[..point.tokens], point.text_bytes),
        None => (&[][..], 0),
    };
    // At most one token per two bytes but in rare text (see `FastBpe::encode_parts_into`).
    let mut tokens = Vec::with_capacity(prior_ids.len() + room.saturating_sub(from) / 2 + 8);
    tokens.extend_from_slice(prior_ids);
    // Cuts are ASCII positions, so char boundaries.
    if from < cut {
        fast.encode_parts_into(&text[from..cut], from == 0 && add, false, &mut tokens);
    }
    let resume = ResumePoint {
        text_bytes: cut,
        tokens: tokens.len(),
        fingerprint: ResumePoint::fingerprint(add, &text.as_bytes()[..cut]),
    };
    (tokens, resume, taken.map(|_| from))
}

/// Where a later turn of a conversation can take over a chat's tokens: the chat's rendered text
/// up to `text_bytes` (a [`leading_cut`] spot) encodes to its first `tokens` ids, whatever
/// follows. A later turn whose rendered text starts with the same bytes (checked by a 128-bit
/// fingerprint) and has a cut at the same spot keeps those ids and encodes only what follows
/// ([`ModelTokenizer::encode_chat_resumable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePoint {
    /// Bytes of rendered text before the cut.
    pub text_bytes: usize,
    /// Ids those bytes encode to (the post-processor's leading special tokens included).
    pub tokens: usize,
    /// xxh3-128 of `add_special_tokens` and the rendered text's first `text_bytes` bytes.
    fingerprint: u128,
}

impl ResumePoint {
    fn fingerprint(add_special_tokens: bool, text: &[u8]) -> u128 {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&[u8::from(add_special_tokens)]);
        hasher.update(text);
        hasher.digest128()
    }
}

/// A chat's tokens and where a later turn can take them over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumableTokens {
    /// The chat's token ids, equal to [`ModelTokenizer::encode_chat_with`]'s.
    pub tokens: Vec<u32>,
    /// The last cut of its rendered text (`None`: no cut, or the model allows none).
    pub resume: Option<ResumePoint>,
    /// Bytes of rendered text encoded now (all of it unless a prior turn was taken over).
    pub encoded_bytes: usize,
    /// Whether the prior turn's tokens were taken over.
    pub prior_taken: bool,
}

impl ModelTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` (plus `chat_template.jinja` when the
    /// config has no template) from a Hugging Face model folder.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizeError> {
        let dir = dir.as_ref();
        let tokenizer_json = read(&dir.join("tokenizer.json"))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => text,
            // Some folders ship only tokenizer.json: no template, no named special tokens.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => "{}".to_owned(),
            Err(source) => {
                return Err(TokenizeError::Io {
                    path: config_path,
                    source,
                });
            }
        };
        let template_path = dir.join("chat_template.jinja");
        let template_file = match std::fs::read_to_string(&template_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(TokenizeError::Io {
                    path: template_path,
                    source,
                });
            }
        };
        Self::from_parts(&tokenizer_json, &config, template_file.as_deref())
    }

    /// Builds from file contents: `tokenizer.json` bytes, `tokenizer_config.json` text and an
    /// optional separate chat template (used only when the config has none).
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config: &str,
        chat_template_file: Option<&str>,
    ) -> Result<Self, TokenizeError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(tokenizer_json)
            .map_err(|source| TokenizeError::TokenizerJson { source })?;
        let fast = fast_encoder(&tokenizer, tokenizer_json);
        let config: serde_json::Value =
            serde_json::from_str(tokenizer_config).map_err(|e| TokenizeError::Config {
                field: "tokenizer_config.json",
                reason: e.to_string(),
            })?;
        let special = |name: &str| special_token(&config, name);
        let eos_token = special("eos_token");
        let named = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|&name| Some((name, special(name)?)))
            .collect();
        let eos_token_id = eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let bos_token_id = special("bos_token").and_then(|t| tokenizer.token_to_id(&t));
        let specials_on_empty = tokenizer
            .encode_fast("", true)
            .is_ok_and(|encoding| !encoding.get_ids().is_empty());
        let template_source =
            chat_template_source(&config)?.or(chat_template_file.map(str::to_owned));
        let special = chat::SpecialTokens { named };
        let chat = template_source
            .map(|source| ChatTemplate::new(source, special.clone()))
            .transpose()?;
        let leading_cuts = fast.as_ref().is_some_and(FastBpe::allows_leading_cuts)
            && tokenizer
                .get_added_tokens_decoder()
                .values()
                .all(|token| !token.content.bytes().any(|b| b.is_ascii_whitespace()));
        Ok(Self {
            tokenizer,
            fast,
            chat,
            special,
            eos_token_id,
            bos_token_id,
            specials_on_empty,
            leading_cuts,
        })
    }

    /// Renders chat with `source` instead of the folder's template, as vLLM's `--chat-template`
    /// does (same special tokens).
    pub fn with_chat_template(mut self, source: String) -> Result<Self, TokenizeError> {
        self.chat = Some(ChatTemplate::new(source, self.special.clone())?);
        Ok(self)
    }

    /// Token ids of a completion prompt; `add_special_tokens` is vLLM's flag of the same name
    /// (default true for completions and `/tokenize {"prompt"}`).
    pub fn encode_prompt(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        if let Some(fast) = &self.fast {
            return Ok(fast.encode(text, add_special_tokens));
        }
        self.encode_with_tokenizers(text, add_special_tokens)
    }

    /// [`Self::encode_prompt`] by the `tokenizers` crate alone (the reference implementation).
    pub fn encode_with_tokenizers(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|source| TokenizeError::Encode { source })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Renders OpenAI `messages` (a JSON array) with the chat template, as text.
    pub fn render_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let options = ChatOptions {
            add_generation_prompt,
            ..ChatOptions::default()
        };
        self.render_chat_with(messages, &options)
    }

    /// Renders `messages` with every prompt-changing field of the request.
    pub fn render_chat_with(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<String, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        chat.render(messages, options)
    }

    /// Token ids of a chat prompt: the rendered template encoded without special tokens.
    pub fn encode_chat(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        self.encode_prompt(&text, false)
    }

    /// Token ids of a chat request as vLLM computes them: [`Self::render_chat_with`], then the
    /// text encoded with the request's `add_special_tokens`.
    pub fn encode_chat_with(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        let rendered = chat.render_for_encoding(messages, options)?;
        self.encode_rendered(
            &rendered,
            self.chat_special_tokens(options, rendered.tokenized_by_template),
        )
    }

    /// A rendered chat's ids, whole: its text, then (SGLang's continued message) the
    /// continuation's.
    fn encode_rendered(
        &self,
        rendered: &chat::Rendered,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = self.encode_prompt(&rendered.text, add_special_tokens)?;
        if let Some(text) = &rendered.continuation {
            tokens.extend(self.continuation_tokens(text)?);
        }
        Ok(tokens)
    }

    /// The `add_special_tokens` a rendered chat is encoded with. vLLM: the request's flag, unless
    /// the template's kwargs had transformers encode it. SGLang: its chat request has no such
    /// field; it encodes with the tokenizer's default (true) unless that adds tokens to an empty
    /// text, then without (the template writes bos itself).
    fn chat_special_tokens(&self, options: &ChatOptions, tokenized_by_template: bool) -> bool {
        match options.dialect {
            Dialect::Vllm => options.add_special_tokens && !tokenized_by_template,
            Dialect::Sglang => !self.specials_on_empty,
        }
    }

    /// The ids SGLang appends for a continued final assistant message
    /// (`_append_assistant_prefix_to_prompt_ids`): the text encoded with the tokenizer's default
    /// special tokens, a leading bos dropped.
    fn continuation_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut tokens = self.encode_prompt(text, true)?;
        if tokens
            .first()
            .is_some_and(|&first| Some(first) == self.bos_token_id)
        {
            tokens.remove(0);
        }
        Ok(tokens)
    }

    /// A `/v1/responses` or `/v1/messages` request body as the chat vLLM renders for this
    /// model ([`apis`]).
    pub fn convert_api_request(
        &self,
        api: ApiKind,
        request: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<ConvertedChat, TokenizeError> {
        self.convert_api_request_for(Dialect::Vllm, api, request)
    }

    /// A `/v1/responses` or `/v1/messages` request body as the chat `dialect`'s engine renders
    /// for this model ([`apis`], [`apis::sglang`]).
    pub fn convert_api_request_for(
        &self,
        dialect: Dialect,
        api: ApiKind,
        request: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<ConvertedChat, TokenizeError> {
        let chat = || self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate);
        match (dialect, api) {
            (Dialect::Vllm, ApiKind::Responses) => apis::responses_to_chat(request),
            (Dialect::Vllm, ApiKind::Messages) => {
                apis::messages_to_chat(request, chat()?.merges_inline_system())
            }
            (Dialect::Sglang, ApiKind::Responses) => {
                apis::sglang::responses_to_chat(request, chat()?.sglang_renders_inline_system())
            }
            (Dialect::Sglang, ApiKind::Messages) => {
                apis::sglang::messages_to_chat(request, chat()?.sglang_renders_inline_system())
            }
        }
    }

    /// Token ids of a `/v1/responses` or `/v1/messages` request, as vLLM renders them.
    pub fn encode_api_request(
        &self,
        api: ApiKind,
        request: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>, TokenizeError> {
        self.encode_api_request_for(Dialect::Vllm, api, request)
    }

    /// Token ids of a `/v1/responses` or `/v1/messages` request, as `dialect`'s engine
    /// renders them.
    pub fn encode_api_request_for(
        &self,
        dialect: Dialect,
        api: ApiKind,
        request: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>, TokenizeError> {
        let chat = self.convert_api_request_for(dialect, api, request)?;
        self.encode_chat_with(&chat.messages, &chat.options)
    }

    /// The leading tokens of a completion prompt: the tokens of `text` up to the first
    /// [`leading_cut`] at or after `min_bytes`, which are exactly the first tokens of
    /// [`Self::encode_prompt`]`(text, ..)`. All of them (`complete`) when the text has no cut
    /// there or the model's pipeline does not allow cuts. With the cut (or, when complete, the
    /// text's last cut) as the resume point.
    pub fn encode_prompt_leading(
        &self,
        text: &str,
        add_special_tokens: bool,
        min_bytes: usize,
    ) -> Result<LeadingTokens, TokenizeError> {
        self.leading_of(text, add_special_tokens, min_bytes, None)
    }

    /// [`Self::encode_prompt_leading`] of a chat an earlier, shorter leading part rendered
    /// ([`LeadingTokens::rendered`]), taking over that part's tokens when `prior` (its resume
    /// point and tokens) still applies: only the text between its cut and this one's is
    /// encoded (and rendered, when the earlier rendering stopped short of it). The same tokens
    /// as a fresh render and encoding.
    pub fn encode_rendered_leading(
        &self,
        rendered: &Arc<RenderedChat>,
        min_bytes: usize,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Result<LeadingTokens, TokenizeError> {
        let rendered = match &rendered.rest {
            Some(context) if !rendered.reaches(min_bytes) => Arc::new(self.render_leading(
                context.clone(),
                rendered.add_special_tokens,
                min_bytes,
            )?),
            _ => Arc::clone(rendered),
        };
        let mut leading = self.leading_of(
            &rendered.text,
            rendered.add_special_tokens,
            min_bytes,
            prior,
        )?;
        if !rendered.is_whole() {
            leading.total_bytes = None;
        }
        if !leading.complete {
            leading.rendered = Some(rendered);
        }
        Ok(leading)
    }

    /// A chat's `context` rendered up to a little past its first [`leading_cut`] from
    /// `min_bytes`, when the model allows cuts (whole otherwise, or when it has none there):
    /// rendering stops once the piece that ends the cut's next byte is written.
    fn render_leading(
        &self,
        context: chat::Context,
        add_special_tokens: bool,
        min_bytes: usize,
    ) -> Result<RenderedChat, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        if self.fast.is_none() || !self.leading_cuts {
            return Ok(RenderedChat {
                text: chat.render_context(context)?,
                add_special_tokens,
                rest: None,
            });
        }
        // Spots before `scanned` were looked at: each piece is scanned once.
        let mut scanned = min_bytes.max(1);
        let (text, whole) = chat.render_context_until(&context, &mut |text| {
            let text = text.as_bytes();
            let end = text.len().saturating_sub(1);
            let found = (scanned..end).any(|at| is_cut(text, at));
            scanned = scanned.max(end);
            found
        })?;
        Ok(RenderedChat {
            text,
            add_special_tokens,
            rest: (!whole).then_some(context),
        })
    }

    /// The leading tokens of the rendered `text` from `min_bytes` on, the first ones taken over
    /// from `prior` when it applies (see [`Self::encode_prompt_leading`]).
    fn leading_of(
        &self,
        text: &str,
        add: bool,
        min_bytes: usize,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Result<LeadingTokens, TokenizeError> {
        if let (Some(fast), true, Some(cut)) =
            (&self.fast, self.leading_cuts, leading_cut(text, min_bytes))
        {
            let (tokens, resume, _) = encode_to_cut(fast, text, add, cut, prior, cut);
            return Ok(LeadingTokens {
                resume: Some(resume),
                tokens,
                complete: false,
                text_bytes: cut,
                total_bytes: Some(text.len()),
                rendered: None,
            });
        }
        let whole = self.encode_rendered_resumable(text, add, prior)?;
        Ok(LeadingTokens {
            tokens: whole.tokens,
            complete: true,
            text_bytes: text.len(),
            total_bytes: Some(text.len()),
            resume: whole.resume,
            rendered: None,
        })
    }

    /// [`Self::encode_prompt_leading`] of a chat request's rendered prompt, rendered only up to
    /// a little past the leading part when the model allows cuts (see [`RenderedChat`]).
    pub fn encode_chat_leading(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
        min_bytes: usize,
    ) -> Result<LeadingTokens, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        let context = chat.context(messages, options)?;
        let add_special_tokens = self.chat_special_tokens(options, context.tokenized_by_template);
        if context.continuation.is_none() {
            let rendered = Arc::new(self.render_leading(context, add_special_tokens, min_bytes)?);
            return self.encode_rendered_leading(&rendered, min_bytes, None);
        }
        // Rare (SGLang's continued message): the whole prompt, with no cut to resume from.
        let rendered = chat.render_whole(context)?;
        Ok(LeadingTokens {
            tokens: self.encode_rendered(&rendered, add_special_tokens)?,
            complete: true,
            text_bytes: rendered.text.len(),
            total_bytes: Some(rendered.text.len()),
            resume: None,
            rendered: None,
        })
    }

    /// [`Self::encode_chat_resumable`] of a chat already rendered (in part) by
    /// [`Self::encode_chat_leading`]: the same tokens, without parsing it again, and without
    /// rendering it again when it was rendered whole.
    pub fn encode_rendered_chat_resumable(
        &self,
        rendered: &RenderedChat,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Result<ResumableTokens, TokenizeError> {
        let Some(context) = &rendered.rest else {
            return self.encode_rendered_resumable(
                &rendered.text,
                rendered.add_special_tokens,
                prior,
            );
        };
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        let text = chat.render_context(context.clone())?;
        self.encode_rendered_resumable(&text, rendered.add_special_tokens, prior)
    }

    /// [`Self::encode_chat_with`], taking over the first tokens of an earlier turn of the same
    /// conversation when `prior` (that turn's resume point and tokens) still applies: its
    /// rendered text is then encoded only from the prior's cut on. Exact either way: a cut
    /// splits the encoding in two (see [`leading_cut`]), so the tokens are those of the text
    /// before the prior's cut (the same bytes, so the prior's ids), then of the text between
    /// it and this text's last cut, then of the rest. The result names this text's last cut,
    /// for the turn after.
    pub fn encode_chat_resumable(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Result<ResumableTokens, TokenizeError> {
        let chat = self.chat.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        let rendered = chat.render_for_encoding(messages, options)?;
        let add = self.chat_special_tokens(options, rendered.tokenized_by_template);
        if rendered.continuation.is_none() {
            return self.encode_rendered_resumable(&rendered.text, add, prior);
        }
        // Rare (SGLang's continued message): encoded whole, and no later turn resumes from it.
        Ok(ResumableTokens {
            tokens: self.encode_rendered(&rendered, add)?,
            resume: None,
            encoded_bytes: rendered.text.len(),
            prior_taken: false,
        })
    }

    /// [`Self::encode_chat_resumable`] of the rendered `text`.
    fn encode_rendered_resumable(
        &self,
        text: &str,
        add: bool,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Result<ResumableTokens, TokenizeError> {
        let (Some(fast), true, Some(cut)) = (&self.fast, self.leading_cuts, last_cut(text)) else {
            return Ok(ResumableTokens {
                tokens: self.encode_prompt(text, add)?,
                resume: None,
                encoded_bytes: text.len(),
                prior_taken: false,
            });
        };
        // Room for the text after the cut too: one buffer for the whole prompt.
        let (mut tokens, resume, taken) = encode_to_cut(fast, text, add, cut, prior, text.len());
        fast.encode_parts_into(&text[cut..], false, add, &mut tokens);
        Ok(ResumableTokens {
            tokens,
            resume: Some(resume),
            encoded_bytes: text.len() - taken.unwrap_or(0),
            prior_taken: taken.is_some(),
        })
    }

    /// The chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// Text of token ids (`skip_special_tokens` as in vLLM's sampling params).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizeError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|source| TokenizeError::Decode { source })
    }

    /// The string of one token id (its vocabulary form, e.g. `Ġthe` for byte-level BPE).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Id of the eos token named in `tokenizer_config.json`, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// Whether encoding uses the fast [`FastBpe`] (else the `tokenizers` crate).
    pub fn uses_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// Which fast encoder serves this model (`None`: the `tokenizers` crate does).
    pub fn fast_encoder_kind(&self) -> Option<FastEncoderKind> {
        self.fast.as_ref().map(FastBpe::kind)
    }

    /// Whether the model has a chat template (chat requests fail without one, as in vLLM).
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }
}

/// Text the fast encoder must encode exactly as `tokenizers` before it is used: ASCII with
/// contractions (any case), unicode letters/digits/marks/symbols, every kind of whitespace run,
/// text NFC changes, camel case and digit runs (the `Split` patterns' edges), kana and digits
/// against letters (DeepSeek-V3's stages), `▁` itself and private-use chars (SentencePiece's
/// replacement and byte fallback).
const SELF_CHECK_SAMPLE: &str = "Hello, world! It's 9:41 -- we'll SEE what's up; I'd've said \
    'quoted' \"double\"  two  spaces   three\tTab\t\tTabs\n\nNew paragraph\r\n\
    caf\u{e9} na\u{ef}ve \u{c9}t\u{e9} Stra\u{df}e \u{3a9}mega \u{4e2d}\u{6587}\u{5b57} \
    \u{645}\u{631}\u{62d}\u{628}\u{627} \u{663}\u{664}\u{665} \u{2167} \u{bd} e\u{301}e\u{308} \
    \u{1f600}\u{1f44d}\u{1f3fd} \u{a0}nbsp\u{a0} \u{2028}ls\u{2029} \u{3000}wide \u{85}nel \
    \u{1c}ctl\u{7f} __init__() x=[1,2]; a->b {k: v} #tag @user $5.00 100% ~/path.rs   \n \n  \
    DON'T it'\u{17f} 'tis HTTPServer getJSON 1234567 \u{212b}\u{f900} a\u{323}\u{301} \u{1100}\u{1161}\u{11a8} \
    \u{928}\u{92e}\u{938}\u{94d}\u{924}\u{947} \u{e2a}\u{e27}\u{e31} \u{1f468}\u{200d}\u{1f469} a/b!!\n/c\r\n\r\n \t\n  \
    \u{3072}\u{3089}\u{304c}\u{306a}\u{30ab}\u{30bf}\u{30ab}\u{30ca}x12ab3 (abc .foo \u{2581}a \u{2581}\u{2581} \u{e000}\u{10fffd} ";

/// The fast encoder if the pipeline is supported and it agrees with `tokenizers` on a sample.
fn fast_encoder(tokenizer: &tokenizers::Tokenizer, tokenizer_json: &[u8]) -> Option<FastBpe> {
    let json: serde_json::Value = serde_json::from_slice(tokenizer_json).ok()?;
    let fast = match FastBpe::from_tokenizer_json(&json) {
        Ok(fast) => fast?,
        Err(error) => {
            tracing::warn!(%error, "fast tokenizer not built; using tokenizers");
            return None;
        }
    };
    let mut added: Vec<_> = tokenizer.get_added_tokens_decoder().into_iter().collect();
    added.sort_unstable_by_key(|(id, _)| *id);
    let mut sample = SELF_CHECK_SAMPLE.to_owned();
    for (_, token) in &added {
        sample.push_str(&format!("{0}x{0} {0}\n", token.content));
    }
    for add_special_tokens in [true, false] {
        let reference = tokenizer
            .encode_fast(sample.as_str(), add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec());
        let agrees = reference
            .as_ref()
            .is_ok_and(|ids| *ids == fast.encode(&sample, add_special_tokens));
        if !agrees {
            tracing::warn!(
                add_special_tokens,
                "fast tokenizer disagrees with tokenizers on the self-check; using tokenizers"
            );
            return None;
        }
    }
    Some(fast)
}

fn read(path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|source| TokenizeError::Io {
        path: PathBuf::from(path),
        source,
    })
}

/// transformers' `SPECIAL_TOKENS_ATTRIBUTES`: the special tokens templates see by name.
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A special token from the config: a plain string or an `AddedToken` object with `content`.
fn special_token(config: &serde_json::Value, name: &str) -> Option<String> {
    match config.get(name)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(token) => token.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of `{name, template}` of which vLLM uses `default`.
fn chat_template_source(config: &serde_json::Value) -> Result<Option<String>, TokenizeError> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => Ok(named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned))),
        Some(_) => Err(TokenizeError::Config {
            field: "chat_template",
            reason: "expected a string or a list of {name, template}".to_owned(),
        }),
    }
}

#[cfg(test)]
mod fast_tests;
#[cfg(test)]
mod real_tests;
#[cfg(test)]
mod tests;
