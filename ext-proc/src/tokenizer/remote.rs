//! The remote backend: a vLLM-compatible `POST /tokenize`, with the body vLLM's request model
//! takes for each kind of prompt.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_tokenize::ApiKind;
use serde_json::value::RawValue;

use super::http::TokenizeClient;
use super::input::api_request_object;
use super::{ChatInputFields, TokenizeFuture, TokenizeInput, Tokenizer, TokenizerMode};
use crate::error::TokenizeError;

/// A vLLM-compatible `POST /tokenize` endpoint.
#[derive(Debug, Clone)]
pub struct RemoteTokenizer {
    url: http::Uri,
    client: TokenizeClient,
}

impl RemoteTokenizer {
    /// A client for `url` with a per-call `timeout`.
    pub fn new(url: http::Uri, timeout: Duration) -> Self {
        Self {
            url,
            client: TokenizeClient::new(timeout),
        }
    }

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

/// The kind of media `input` carries, if any: `/tokenize` would expand an image's placeholder
/// tokens but say nothing of the image, so its block keys would match any other image of the
/// same size. Such prompts are refused ([`TokenizeError::MultiModal`]) and routed on load, as
/// in process; render mode routes them exactly.
fn media_kind(input: &TokenizeInput) -> Option<String> {
    match input {
        TokenizeInput::Text { .. } => None,
        TokenizeInput::Chat { messages, .. } => {
            let raw = messages.get();
            // Only a conversation naming a media field (or a uuid) can carry one.
            let named = ["\"uuid\"", "image", "audio", "video", "embeds"]
                .iter()
                .any(|field| raw.contains(field));
            if !named {
                return None;
            }
            let parsed: serde_json::Value = serde_json::from_str(raw).ok()?;
            kvroute_tokenize::media_part_kind(&parsed)
        }
        TokenizeInput::Api { api, request } => {
            let request = api_request_object(request).ok()?;
            let converted = match api {
                ApiKind::Responses => kvroute_tokenize::apis::responses_to_chat(&request),
                ApiKind::Messages => kvroute_tokenize::apis::messages_to_chat(&request, false),
            };
            match converted {
                Ok(chat) => kvroute_tokenize::media_part_kind(&chat.messages),
                Err(kvroute_tokenize::TokenizeError::MultiModal { kind }) => Some(kind),
                Err(_) => None,
            }
        }
    }
}

impl Tokenizer for RemoteTokenizer {
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        if let Some(kind) = media_kind(&input) {
            return Box::pin(std::future::ready(Err(TokenizeError::MultiModal { kind })));
        }
        let Some(body) = Self::request_body(model, &input) else {
            return Box::pin(std::future::ready(Err(TokenizeError::Remote {
                url: self.url.to_string(),
                reason: "vLLM would refuse to render the request (its own chat_template, or a \
                         Responses/Messages request that does not convert)"
                    .to_owned(),
            })));
        };
        let body = serde_json::to_vec(&body).unwrap_or_default();
        self.client.post(
            self.url.clone(),
            Bytes::from(body),
            tokenize_token_ids,
            |url, reason| TokenizeError::Remote { url, reason },
        )
    }

    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Remote
    }
}

/// `tokens` of a `/tokenize` answer.
fn tokenize_token_ids(answer: &[u8]) -> Result<Vec<u32>, String> {
    #[derive(serde::Deserialize)]
    struct TokenizeResponse {
        tokens: Vec<u32>,
    }
    let parsed: TokenizeResponse = serde_json::from_slice(answer).map_err(|e| e.to_string())?;
    Ok(parsed.tokens)
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

/// The `/tokenize` body of a chat request. `/tokenize` renders like `/v1/chat/completions` but
/// for two request-model differences in vLLM 0.32, bridged here: it has no `reasoning_effort`
/// or `documents` fields (they are folded into `chat_template_kwargs` as the chat path folds
/// them: `reasoning_effort`, `enable_thinking` unless set, `documents`), and it does not rename
/// a message's `reasoning_content` to `reasoning` (done here).
pub(super) fn remote_chat_body(
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
