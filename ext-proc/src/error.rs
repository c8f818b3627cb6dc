//! Errors at the crate's boundaries, each with a stable `as_label` for metrics.
//!
//! [`RequestError`] is what the client sees (an OpenAI-style JSON error through Envoy's
//! `ImmediateResponse`); everything else fails *inside* kvroute and only degrades the routing tier.

use std::time::Duration;

/// Why a request is refused. The only errors a client ever sees from kvroute.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON, or not the shape of an OpenAI request.
    #[error("malformed request body: {reason}")]
    MalformedJson {
        /// What the JSON parser said.
        reason: String,
    },
    /// A field routing needs is absent (`model`, `prompt`, `messages`).
    #[error("missing required field '{field}'")]
    MissingField {
        /// The missing field's name.
        field: &'static str,
    },
    /// A field is present but unusable (e.g. an empty prompt list).
    #[error("invalid value for '{field}': {reason}")]
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// Why it is unusable.
        reason: &'static str,
    },
    /// No pool serves this model or adapter.
    #[error("the model '{model}' does not exist")]
    UnknownModel {
        /// The requested model name.
        model: String,
    },
    /// The body exceeds the configured limit.
    #[error("request body of at least {size} bytes exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// Bytes received so far.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Every candidate replica is unready, or the subset hint left none.
    #[error("no ready replica for model '{model}'")]
    NoReadyReplica {
        /// The requested model name.
        model: String,
    },
    /// `epp.shedding`: every ready replica of the pool is saturated (GIE's 429).
    #[error("every replica for model '{model}' is saturated; retry later")]
    Saturated {
        /// The requested model name.
        model: String,
    },
}

impl RequestError {
    /// HTTP status Envoy sends to the client.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::MalformedJson { .. } | Self::MissingField { .. } | Self::InvalidField { .. } => {
                400
            }
            Self::UnknownModel { .. } => 404,
            Self::BodyTooLarge { .. } => 413,
            Self::NoReadyReplica { .. } => 503,
            Self::Saturated { .. } => 429,
        }
    }

    /// Metric label.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::MalformedJson { .. } => "malformed_json",
            Self::MissingField { .. } => "missing_field",
            Self::InvalidField { .. } => "invalid_field",
            Self::UnknownModel { .. } => "unknown_model",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::NoReadyReplica { .. } => "no_ready_replica",
            Self::Saturated { .. } => "saturated",
        }
    }

    /// The OpenAI error body: `{"error":{"message","type","param","code"}}`.
    pub fn to_openai_json(&self) -> Vec<u8> {
        let (kind, param) = match self {
            Self::MalformedJson { .. } => ("invalid_request_error", None),
            Self::MissingField { field } | Self::InvalidField { field, .. } => {
                ("invalid_request_error", Some(*field))
            }
            Self::UnknownModel { .. } => ("NotFoundError", Some("model")),
            Self::BodyTooLarge { .. } => ("invalid_request_error", None),
            Self::NoReadyReplica { .. } => ("ServiceUnavailableError", None),
            Self::Saturated { .. } => ("RateLimitError", None),
        };
        let body = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": kind,
                "param": param,
                "code": self.http_status(),
            }
        });
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
    }
}

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
