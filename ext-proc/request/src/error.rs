//! What a client is told when kvroute refuses its request.

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
