//! The in-process backend: the model folder's tokenizer and chat template (`kvroute-tokenize`),
//! on the calling task when that is cheaper than the hop to a blocking thread.

use std::sync::Arc;

use kvroute_tokenize::{Dialect, LeadingTokens, ModelTokenizer, ResumableTokens, ResumePoint};
use serde_json::value::RawValue;
use tokio_util::task::TaskTracker;

use super::input::{ChatInputFields, ParsedTools, api_request_object};
use super::{
    InProcess, LeadingFuture, LeadingStep, TokenizeFuture, TokenizeInput, Tokenizer, TokenizerMode,
};
use crate::error::TokenizeError;

/// Largest input tokenized on the calling task rather than a blocking thread, when the model
/// has the fast encoder: ≈ 4k tokens, ≈ 0.2 ms (`cargo bench -p kvroute-tokenize --bench encode`).
const INLINE_MAX_BYTES: usize = 16 * 1024;

/// Largest input whose leading part is tokenized on the calling task (parse and render of
/// ≈ 256 KiB ≈ 0.5 ms, `kvroute-latency-bench --bench stages`).
const INLINE_LEADING_MAX_BYTES: usize = 256 * 1024;

/// The model folder's tokenizer, in this process.
#[derive(Debug, Clone)]
pub struct InProcessTokenizer {
    encoder: Encoder,
    tasks: TaskTracker,
}

/// What encodes a prompt as the pool's engines build it, cloned onto a blocking thread.
#[derive(Debug, Clone)]
struct Encoder {
    model: Arc<ModelTokenizer>,
    /// Whose prompt construction the pool's engines follow.
    dialect: Dialect,
    /// Tool lists parsed from earlier requests.
    tools: Arc<ParsedTools>,
}

impl InProcessTokenizer {
    /// Wraps an already loaded tokenizer (vLLM's prompt construction).
    pub fn new(model: Arc<ModelTokenizer>, tasks: TaskTracker) -> Self {
        Self {
            encoder: Encoder {
                model,
                dialect: Dialect::Vllm,
                tools: Arc::default(),
            },
            tasks,
        }
    }

    /// Builds prompts as `dialect`'s engine does.
    pub fn with_dialect(mut self, dialect: Dialect) -> Self {
        self.encoder.dialect = dialect;
        self
    }

    /// Loads a Hugging Face model folder.
    pub fn load(dir: &std::path::Path, tasks: TaskTracker) -> Result<Self, TokenizeError> {
        let model = ModelTokenizer::from_dir(dir).map_err(|e| TokenizeError::InProcess {
            reason: format!("{e:#}"),
        })?;
        Ok(Self::new(Arc::new(model), tasks))
    }

    /// Whether `input` is tokenized whole on the calling task.
    fn inline(&self, input: &TokenizeInput) -> bool {
        self.encoder.model.uses_fast_path() && input.len_bytes() <= INLINE_MAX_BYTES
    }

    /// Whether [`InProcess::tokenize_leading`] answers for `input`.
    fn gives_leading(&self, input: &TokenizeInput) -> bool {
        self.encoder.model.uses_fast_path() && !matches!(input, TokenizeInput::Api { .. })
    }
}

impl Tokenizer for InProcessTokenizer {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        if self.inline(&input) {
            // Tens of microseconds: cheaper here than the hop to a blocking thread and back.
            let result = self.encoder.encode(&input);
            return Box::pin(std::future::ready(result));
        }
        let encoder = self.encoder.clone();
        let task = self.tasks.spawn_blocking(move || encoder.encode(&input));
        Box::pin(async move {
            task.await.map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })?
        })
    }

    fn mode(&self) -> TokenizerMode {
        match self.encoder.model.fast_encoder_kind() {
            Some(kind) => TokenizerMode::InProcessFast(kind),
            None => TokenizerMode::InProcessHf,
        }
    }

    fn in_process(&self) -> Option<&dyn InProcess> {
        Some(self)
    }
}

impl InProcess for InProcessTokenizer {
    fn runs_blocking(&self, input: &TokenizeInput, leading: bool) -> bool {
        if leading {
            self.gives_leading(input) && input.len_bytes() > INLINE_LEADING_MAX_BYTES
        } else {
            !self.inline(input)
        }
    }

    fn tokenize_leading(
        &self,
        input: Arc<TokenizeInput>,
        min_bytes: usize,
        shorter: Option<LeadingStep>,
    ) -> Option<LeadingFuture> {
        if !self.gives_leading(&input) {
            return None;
        }
        // The whole body is parsed and rendered (cheap), only the leading part encoded: a
        // fraction of a millisecond up to a few hundred KiB, so on the calling task.
        if input.len_bytes() <= INLINE_LEADING_MAX_BYTES {
            return Some(Box::pin(std::future::ready(self.encoder.encode_leading(
                &input,
                min_bytes,
                shorter.as_ref(),
            ))));
        }
        let encoder = self.encoder.clone();
        let task = self
            .tasks
            .spawn_blocking(move || encoder.encode_leading(&input, min_bytes, shorter.as_ref()));
        Some(Box::pin(async move {
            task.await.map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })?
        }))
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
        let encoder = &self.encoder;
        if !encoder.model.uses_fast_path() {
            return None;
        }
        Some((|| {
            let (messages, options) = encoder.chat(messages, *add_generation_prompt, fields)?;
            encoder
                .model
                .encode_chat_resumable(&messages, &options, prior)
                .map_err(failed)
        })())
    }

    fn tokenize_rendered_resumable(
        &self,
        rendered: &kvroute_tokenize::RenderedChat,
        prior: Option<(&ResumePoint, &[u32])>,
    ) -> Option<Result<ResumableTokens, TokenizeError>> {
        Some(
            self.encoder
                .model
                .encode_rendered_chat_resumable(rendered, prior)
                .map_err(failed),
        )
    }

    fn tokenize_now(&self, input: &TokenizeInput) -> Result<Vec<u32>, TokenizeError> {
        self.encoder.encode(input)
    }
}

impl Encoder {
    /// A chat input's `messages` (parsed, as the template renders them) and its options, as the
    /// dialect's engine reads the request.
    fn chat(
        &self,
        messages: &RawValue,
        add_generation_prompt: bool,
        fields: &ChatInputFields,
    ) -> Result<(serde_json::Value, kvroute_tokenize::ChatOptions), TokenizeError> {
        let messages =
            serde_json::from_str(messages.get()).map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })?;
        let options = fields.chat_options(add_generation_prompt, self.dialect, &self.tools)?;
        Ok((messages, options))
    }

    /// The whole prompt's tokens, as the dialect's engine builds the prompt.
    fn encode(&self, input: &TokenizeInput) -> Result<Vec<u32>, TokenizeError> {
        let Self { model, dialect, .. } = self;
        match input {
            TokenizeInput::Text {
                text,
                add_special_tokens,
            } => model
                .encode_prompt(text, dialect.completion_special_tokens(*add_special_tokens))
                .map_err(failed),
            TokenizeInput::Chat {
                messages,
                add_generation_prompt,
                fields,
            } => {
                let (messages, options) = self.chat(messages, *add_generation_prompt, fields)?;
                model.encode_chat_with(&messages, &options).map_err(failed)
            }
            TokenizeInput::Api { api, request } => {
                let request = api_request_object(request)?;
                model
                    .encode_api_request_for(*dialect, *api, &request)
                    .map_err(failed)
            }
        }
    }

    /// [`Self::encode`]'s leading variant (completion text and chat; API requests are not
    /// called here), a chat from its `shorter` leading part when the decision has one.
    fn encode_leading(
        &self,
        input: &TokenizeInput,
        min_bytes: usize,
        shorter: Option<&LeadingStep>,
    ) -> Result<LeadingTokens, TokenizeError> {
        let Self { model, dialect, .. } = self;
        if let (Some(shorter), TokenizeInput::Chat { .. }) = (shorter, input) {
            return model
                .encode_rendered_leading(
                    &shorter.rendered,
                    min_bytes,
                    Some((&shorter.resume, &shorter.tokens)),
                )
                .map_err(failed);
        }
        match input {
            TokenizeInput::Text {
                text,
                add_special_tokens,
            } => model
                .encode_prompt_leading(
                    text,
                    dialect.completion_special_tokens(*add_special_tokens),
                    min_bytes,
                )
                .map_err(failed),
            TokenizeInput::Chat {
                messages,
                add_generation_prompt,
                fields,
            } => {
                let (messages, options) = self.chat(messages, *add_generation_prompt, fields)?;
                model
                    .encode_chat_leading(&messages, &options, min_bytes)
                    .map_err(failed)
            }
            TokenizeInput::Api { .. } => Err(TokenizeError::InProcess {
                reason: "no leading tokens for API requests".to_owned(),
            }),
        }
    }
}

/// An in-process tokenizer's failure as a decision's tokenize error.
fn failed(e: kvroute_tokenize::TokenizeError) -> TokenizeError {
    match e {
        kvroute_tokenize::TokenizeError::MultiModal { kind } => TokenizeError::MultiModal { kind },
        e => TokenizeError::InProcess {
            reason: e.to_string(),
        },
    }
}
