//! Errors of loading a model folder, rendering a chat and encoding.

use std::path::PathBuf;

/// Why a tokenizer could not be loaded or an input could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A model-folder file could not be read.
    #[error("cannot read {}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer.json` is not a valid Hugging Face tokenizer.
    #[error("invalid tokenizer.json")]
    TokenizerJson {
        /// The parser's error.
        #[source]
        source: tokenizers::Error,
    },
    /// `tokenizer_config.json` is malformed.
    #[error("invalid tokenizer config field {field}: {reason}")]
    Config {
        /// The field (or file) at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The chat template does not compile.
    #[error("chat template does not compile")]
    TemplateSyntax {
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },
    /// A chat request for a model without a chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// `messages` is not an array of `{role, content}` objects with text content.
    #[error("invalid messages: {reason}")]
    InvalidMessages {
        /// What is wrong (never the message text itself).
        reason: String,
    },
    /// The messages carry media (an image, audio, video or embeddings part): only a multimodal
    /// engine's processor knows their placeholder tokens, so they cannot be tokenized here.
    #[error("the messages carry {kind} content, which only the engine's processor tokenizes")]
    MultiModal {
        /// The content part's type (`image_url`, `input_audio`, …).
        kind: String,
    },
    /// `tools` is not a list of function tools as vLLM accepts them.
    #[error("invalid tools: {reason}")]
    InvalidTools {
        /// What is wrong.
        reason: String,
    },
    /// `chat_template_kwargs` sets a key vLLM refuses.
    #[error("invalid chat_template_kwargs: {reason}")]
    InvalidKwargs {
        /// What is wrong.
        reason: String,
    },
    /// Rendering failed, including the template's own `raise_exception`.
    #[error("chat template rendering failed")]
    TemplateRender {
        /// The template engine's error.
        #[source]
        source: minijinja::Error,
    },
    /// The tokenizer failed to encode.
    #[error("encoding failed")]
    Encode {
        /// The tokenizer's error.
        #[source]
        source: tokenizers::Error,
    },
    /// The tokenizer failed to decode.
    #[error("decoding failed")]
    Decode {
        /// The tokenizer's error.
        #[source]
        source: tokenizers::Error,
    },
}

impl TokenizeError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            TokenizeError::Io { .. } => "io",
            TokenizeError::TokenizerJson { .. } => "tokenizer_json",
            TokenizeError::Config { .. } => "config",
            TokenizeError::TemplateSyntax { .. } => "template_syntax",
            TokenizeError::NoChatTemplate => "no_chat_template",
            TokenizeError::InvalidMessages { .. } => "invalid_messages",
            TokenizeError::MultiModal { .. } => "multimodal",
            TokenizeError::InvalidTools { .. } => "invalid_tools",
            TokenizeError::InvalidKwargs { .. } => "invalid_kwargs",
            TokenizeError::TemplateRender { .. } => "template_render",
            TokenizeError::Encode { .. } => "encode",
            TokenizeError::Decode { .. } => "decode",
        }
    }

    /// Whether the caller's input is at fault (an HTTP 400 in vLLM) rather than the model folder.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            TokenizeError::NoChatTemplate
                | TokenizeError::InvalidMessages { .. }
                | TokenizeError::InvalidTools { .. }
                | TokenizeError::InvalidKwargs { .. }
                | TokenizeError::TemplateRender { .. }
                | TokenizeError::Encode { .. }
        )
    }
}
