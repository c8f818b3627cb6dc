//! The render backend: the whole request to the engine's render endpoint matching its own, the
//! answer's `token_ids` being the engine's prompt and its `features` where the engine placed the
//! request's images (and other media).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_tokenize::ApiKind;

use super::http::TokenizeClient;
use super::input::api_request_object;
use super::multimodal::{MultiModalPlaces, RenderedFeatures};
use super::{
    RemoteTokenizer, RequestFuture, TokenizeFuture, TokenizeInput, Tokenized, Tokenizer,
    TokenizerMode,
};
use crate::error::TokenizeError;

/// The engine's render endpoints (vLLM 0.32 `--enable-scale-out`): the request goes to the one
/// matching its own endpoint (`/v1/completions/render`, `/v1/chat/completions/render`,
/// `/v1/responses/render`, `/v1/messages/render` under the configured base URL) and the answer's
/// `token_ids` are the engine's prompt (a completion's list answers with its first prompt's).
/// Only the body and `content-type` are sent: no client header (authorization, cookies) leaves.
///
/// Every body goes with `"mm_payload": "none"` (a client's own value is overridden): the
/// answer's `features` then carry the media items' identifiers and placeholders, which routing
/// hashes, and no processed tensors (vLLM's option "for cache-aware routers"). A client's
/// per-part `uuid` goes along as sent, so the engine reports it as the item's identifier.
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
        let mut body = serde_json::to_vec(&body).ok()?;
        with_no_media_payload(&mut body).then_some(body)
    }

    /// Sends `body` (`None`: one vLLM would refuse) to `input`'s render endpoint: the prompt's
    /// tokens and media items, or why not (malformed `features`:
    /// [`TokenizeError::MultiModalFeatures`]).
    fn post(&self, input: &TokenizeInput, body: Option<Bytes>) -> RequestFuture {
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
        let answer = self
            .client
            .post(url.clone(), body, render_answer, |url, reason| {
                TokenizeError::Render { url, reason }
            });
        Box::pin(async move {
            let answer = answer.await?;
            let multimodal =
                answer
                    .multimodal
                    .map_err(|reason| TokenizeError::MultiModalFeatures {
                        url: url.to_string(),
                        reason,
                    })?;
            Ok(Tokenized {
                tokens: answer.tokens,
                multimodal: multimodal.map(Arc::new),
            })
        })
    }
}

impl Tokenizer for RenderTokenizer {
    /// The prompt's tokens alone: a prompt with media items is refused
    /// ([`TokenizeError::MultiModal`]), as its tokens without the items' keys would match
    /// other images.
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let body = Self::body_from_input(model, &input).map(Bytes::from);
        let rendering = self.post(&input, body);
        Box::pin(async move {
            let rendered = rendering.await?;
            match rendered.multimodal {
                None => Ok(rendered.tokens),
                Some(_) => Err(TokenizeError::MultiModal {
                    kind: "media".to_owned(),
                }),
            }
        })
    }

    fn tokenize_request(
        &self,
        _model: &str,
        input: Arc<TokenizeInput>,
        body: &[u8],
    ) -> RequestFuture {
        // vLLM refuses an untrusted request template; never ask it to render one.
        let refused =
            matches!(&*input, TokenizeInput::Chat { fields, .. } if fields.request_template);
        let body = (!refused)
            .then(|| {
                let mut body = body.to_vec();
                with_no_media_payload(&mut body).then(|| Bytes::from(body))
            })
            .flatten();
        self.post(&input, body)
    }

    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Render
    }
}

/// Adds `"mm_payload": "none"` to a JSON object's body, as its last member (a client's own
/// `mm_payload` earlier in it is overridden: Python's `json.loads` keeps a repeated key's last
/// value). `false` when `body` is not an object.
pub(super) fn with_no_media_payload(body: &mut Vec<u8>) -> bool {
    const MEMBER: &[u8] = br#""mm_payload":"none"}"#;
    let content_end = body
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(0, |last| last + 1);
    let content = &body[..content_end];
    let Some(opening) = content.iter().position(|b| !b.is_ascii_whitespace()) else {
        return false;
    };
    if content[opening] != b'{' || content.last() != Some(&b'}') || content_end - opening < 2 {
        return false;
    }
    let empty = content[opening + 1..content_end - 1]
        .iter()
        .all(u8::is_ascii_whitespace);
    body.truncate(content_end - 1);
    if !empty {
        body.push(b',');
    }
    body.extend_from_slice(MEMBER);
    true
}

/// What a render answer tells routing: the prompt's tokens and, apart (malformed features are
/// their own error), its media items.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct RenderAnswer {
    pub(super) tokens: Vec<u32>,
    pub(super) multimodal: Result<Option<MultiModalPlaces>, String>,
}

/// `token_ids` of a render answer: vLLM's `GenerateRequest` (chat, responses, messages) or a
/// list of them (completions; the first, as routing takes a batch's first prompt).
#[cfg(test)]
pub(super) fn render_token_ids(answer: &[u8]) -> Result<Vec<u32>, String> {
    render_answer(answer).map(|answer| answer.tokens)
}

/// The tokens and media items of a render answer (vLLM's `GenerateRequest`, or a list of them
/// for completions: the first).
pub(super) fn render_answer(answer: &[u8]) -> Result<RenderAnswer, String> {
    #[derive(serde::Deserialize)]
    struct Rendered {
        token_ids: Vec<u32>,
        #[serde(default)]
        features: Option<serde_json::Value>,
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
    let multimodal = match rendered.features {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(features) => serde_json::from_value::<RenderedFeatures>(features)
            .map_err(|e| format!("features: {e}"))
            .and_then(|features| {
                MultiModalPlaces::from_features(&features, rendered.token_ids.len())
            }),
    };
    Ok(RenderAnswer {
        tokens: rendered.token_ids,
        multimodal,
    })
}
