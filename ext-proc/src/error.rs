//! Errors at the crate's boundaries, each with a stable `as_label` for metrics.
//!
//! [`RequestError`] (kvroute-request's) is what the client sees (an OpenAI-style JSON error through
//! Envoy's `ImmediateResponse`); everything else fails *inside* kvroute and only degrades the
//! routing tier.

use std::time::Duration;

pub use kvroute_request::RequestError;

/// Why tokenization produced no tokens; the decision falls to the load tier.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The pool has no tokenizer configured.
    #[error("no tokenizer configured for pool '{pool}'")]
    NotConfigured {
        /// Pool name (from config).
        pool: String,
    },
    /// The tokenizer did not answer within its budget.
    #[error("tokenizer timed out after {after:?}")]
    Timeout {
        /// The budget that elapsed.
        after: Duration,
    },
    /// Every in-process tokenization slot stayed taken (by longer prompts) for the whole budget.
    #[error("no in-process tokenization slot became free within {waited:?}")]
    Busy {
        /// How long the decision waited for one.
        waited: Duration,
    },
    /// The prompt is larger than in-process tokenization takes whole
    /// (`limits.tokenize_max_prompt_bytes`).
    #[error("prompt of {bytes} bytes exceeds the in-process tokenization limit of {limit} bytes")]
    PromptTooLarge {
        /// The prompt's size (text, or the messages and other prompt fields' JSON).
        bytes: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The remote `/tokenize` call failed.
    #[error("remote tokenizer at {url} failed: {reason}")]
    Remote {
        /// The configured URL.
        url: String,
        /// What went wrong (transport error, status, bad JSON).
        reason: String,
    },
    /// The engine's render endpoint failed (transport error, status, bad JSON, a request vLLM
    /// would refuse).
    #[error("render endpoint {url} failed: {reason}")]
    Render {
        /// The endpoint's URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The engine's render answer described the prompt's media items in a way their block keys
    /// cannot be computed from (`features` malformed: see
    /// [`crate::tokenizer::MultiModalPlaces`]).
    #[error("render endpoint {url} answered malformed multimodal features: {reason}")]
    MultiModalFeatures {
        /// The endpoint's URL.
        url: String,
        /// What is wrong with them.
        reason: String,
    },
    /// The in-process tokenizer failed (template error, bad input).
    #[error("in-process tokenizer failed: {reason}")]
    InProcess {
        /// What the tokenizer said.
        reason: String,
    },
    /// The request carries media (images, audio, video) that only the engine's processor turns
    /// into tokens and hashes; an in-process tokenizer or `/tokenize` cannot place them.
    #[error("the request carries {kind} content; tokenizing it needs the engine (render mode)")]
    MultiModal {
        /// The content part's type.
        kind: String,
    },
}

impl TokenizeError {
    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::NotConfigured { .. } => "not_configured",
            Self::Timeout { .. } => "timeout",
            Self::Busy { .. } => "busy",
            Self::PromptTooLarge { .. } => "prompt_too_large",
            Self::Remote { .. } => "remote_error",
            Self::Render { .. } => "render_error",
            Self::MultiModalFeatures { .. } => "multimodal_features",
            Self::InProcess { .. } => "in_process_error",
            Self::MultiModal { .. } => "multimodal",
        }
    }
}

/// Why the index gave no answer; the decision falls to the approximate tier.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// No index address is configured.
    #[error("no index configured")]
    NotConfigured,
    /// The budget ran out before any index answered.
    #[error("index did not answer within {after:?}")]
    Timeout {
        /// The budget that elapsed.
        after: Duration,
    },
    /// Every index address failed.
    #[error("all index addresses failed, last: {status}")]
    Unavailable {
        /// The last gRPC status.
        status: tonic::Status,
    },
    /// The embedded index refused the query (e.g. a model its config does not know).
    #[error("embedded index refused the match")]
    Refused(#[source] crate::embedded::MatchError),
    /// An index refused the query itself (a model it does not know, another block size): the
    /// two configs disagree, so every address would answer the same.
    #[error("the index refused the match: {status}")]
    Rejected {
        /// Its gRPC status (`NOT_FOUND`, `INVALID_ARGUMENT`).
        status: tonic::Status,
    },
}

impl IndexError {
    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::NotConfigured => "not_configured",
            Self::Timeout { .. } => "timeout",
            Self::Unavailable { .. } => "unavailable",
            Self::Refused(_) | Self::Rejected { .. } => "refused",
        }
    }
}
