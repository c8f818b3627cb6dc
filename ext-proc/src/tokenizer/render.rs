//! The render backend: the whole request to the engine's render endpoint matching its own, the
//! answer's `token_ids` being the engine's prompt.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_tokenize::ApiKind;

use super::http::TokenizeClient;
use super::input::api_request_object;
use super::{RemoteTokenizer, TokenizeFuture, TokenizeInput, Tokenizer, TokenizerMode};
use crate::error::TokenizeError;

/// The engine's render endpoints (vLLM 0.32 `--enable-scale-out`): the request goes to the one
/// matching its own endpoint (`/v1/completions/render`, `/v1/chat/completions/render`,
/// `/v1/responses/render`, `/v1/messages/render` under the configured base URL) and the answer's
/// `token_ids` are the engine's prompt (a completion's list answers with its first prompt's).
/// Only the body and `content-type` are sent: no client header (authorization, cookies) leaves.
#[derive(Debug, Clone)]
pub struct RenderTokenizer {
    base: http::Uri,
    client: TokenizeClient,
}

impl RenderTokenizer {
    /// A client for the engine at `base` (`http://host:port`, optionally with a path prefix)
    /// with a per-call `timeout`.
    pub fn new(base: http::Uri, timeout: Duration) -> Self {
        Self {
            base,
            client: TokenizeClient::new(timeout),
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

    /// Sends `body` (`None`: one vLLM would refuse) to `input`'s render endpoint.
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
        self.client
            .post(url, body, render_token_ids, |url, reason| {
                TokenizeError::Render { url, reason }
            })
    }
}

impl Tokenizer for RenderTokenizer {
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

    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Render
    }
}

/// `token_ids` of a render answer: vLLM's `GenerateRequest` (chat, responses, messages) or a
/// list of them (completions; the first, as routing takes a batch's first prompt).
pub(super) fn render_token_ids(answer: &[u8]) -> Result<Vec<u32>, String> {
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
