//! What a tokenizer is asked: a request's prompt, owned so that it may be tokenized on another
//! thread.

use std::sync::Arc;

use kvroute_tokenize::ApiKind;
use serde_json::value::RawValue;

use crate::error::TokenizeError;
use crate::lru::Lru;
use crate::request::{ChatFields, Prompt};

/// What a tokenizer is asked to tokenize (owned: it may run on another thread).
#[derive(Debug)]
pub enum TokenizeInput {
    /// Completion text.
    Text {
        /// The text.
        text: String,
        /// vLLM's `add_special_tokens`.
        add_special_tokens: bool,
    },
    /// Chat messages (the raw JSON array), rendered with the model's template.
    Chat {
        /// The `messages` array as sent.
        messages: Box<RawValue>,
        /// vLLM's `add_generation_prompt`.
        add_generation_prompt: bool,
        /// The request's other prompt-changing fields.
        fields: ChatInputFields,
    },
    /// A Responses or Messages API request's prompt-changing fields (a JSON object).
    Api {
        /// Which API.
        api: ApiKind,
        /// The fields, as sent.
        request: Box<RawValue>,
    },
}

/// [`ChatFields`] owned: the chat request's prompt-changing fields besides `messages`.
#[derive(Debug, Clone, Default)]
pub struct ChatInputFields {
    /// `continue_final_message`.
    pub continue_final_message: bool,
    /// `add_special_tokens` (default false for chat).
    pub add_special_tokens: bool,
    /// `tools`, raw.
    pub tools: Option<Box<RawValue>>,
    /// `documents`, raw.
    pub documents: Option<Box<RawValue>>,
    /// `chat_template_kwargs`, raw.
    pub chat_template_kwargs: Option<Box<RawValue>>,
    /// `reasoning_effort`.
    pub reasoning_effort: Option<String>,
    /// Whether the request carries its own `chat_template`.
    pub request_template: bool,
    /// `tool_choice`, raw (SGLang renders the tools it allows).
    pub tool_choice: Option<Box<RawValue>>,
    /// `mm_processor_kwargs` and `media_io_kwargs`, raw (they change the images' identifiers).
    pub media_kwargs: [Option<Box<RawValue>>; 2],
}

impl ChatInputFields {
    /// Copies the borrowed fields.
    pub fn from_request(fields: &ChatFields<'_>) -> Self {
        Self {
            continue_final_message: fields.continue_final_message,
            add_special_tokens: fields.add_special_tokens,
            tools: fields.tools.map(ToOwned::to_owned),
            documents: fields.documents.map(ToOwned::to_owned),
            chat_template_kwargs: fields.chat_template_kwargs.map(ToOwned::to_owned),
            reasoning_effort: fields.reasoning_effort.as_deref().map(str::to_owned),
            request_template: fields.request_template,
            tool_choice: fields.tool_choice.map(ToOwned::to_owned),
            media_kwargs: fields.media_kwargs.map(|raw| raw.map(ToOwned::to_owned)),
        }
    }

    /// The fields of a converted chat's options (raw JSON again, for the `/tokenize` body).
    pub(super) fn from_options(options: &kvroute_tokenize::ChatOptions) -> Self {
        let raw = |value: Option<serde_json::Value>| {
            value.and_then(|v| RawValue::from_string(v.to_string()).ok())
        };
        Self {
            continue_final_message: options.continue_final_message,
            add_special_tokens: options.add_special_tokens,
            tools: raw(options.tools.as_deref().cloned()),
            documents: raw(options.documents.clone()),
            chat_template_kwargs: raw(options
                .chat_template_kwargs
                .clone()
                .map(serde_json::Value::Object)),
            reasoning_effort: options.reasoning_effort.clone(),
            request_template: options.request_template,
            tool_choice: raw(options.tool_choice.clone()),
            media_kwargs: [None, None],
        }
    }

    /// The options `kvroute-tokenize` renders with, as `dialect`'s engine reads the request;
    /// its tools from `parsed` when the same text was parsed before.
    pub(super) fn chat_options(
        &self,
        add_generation_prompt: bool,
        dialect: kvroute_tokenize::Dialect,
        parsed: &ParsedTools,
    ) -> Result<kvroute_tokenize::ChatOptions, TokenizeError> {
        let json =
            |raw: &Option<Box<RawValue>>| -> Result<Option<serde_json::Value>, TokenizeError> {
                raw.as_ref()
                    .map(|r| serde_json::from_str(r.get()))
                    .transpose()
                    .map_err(|e| TokenizeError::InProcess {
                        reason: e.to_string(),
                    })
            };
        let chat_template_kwargs = match json(&self.chat_template_kwargs)? {
            None => None,
            Some(serde_json::Value::Object(map)) => Some(map),
            Some(_) => {
                return Err(TokenizeError::InProcess {
                    reason: "chat_template_kwargs must be an object".to_owned(),
                });
            }
        };
        Ok(kvroute_tokenize::ChatOptions {
            dialect,
            tool_choice: json(&self.tool_choice)?,
            add_generation_prompt,
            continue_final_message: self.continue_final_message,
            add_special_tokens: self.add_special_tokens,
            tools: self
                .tools
                .as_deref()
                .map(|raw| parsed.parse(raw))
                .transpose()
                .map_err(|e| TokenizeError::InProcess {
                    reason: e.to_string(),
                })?,
            documents: json(&self.documents)?,
            reasoning_effort: self.reasoning_effort.clone(),
            chat_template_kwargs,
            request_template: self.request_template,
            messages_validated: true,
        })
    }
}

/// Tool lists parsed from requests, by their raw text (its 128-bit hash, as the token cache keys
/// prompts). An application sends the same tool definitions with every request, and parsing them
/// into a JSON tree was a tenth of a short chat's decision; the same text gets back the same
/// shared list, which the template's kept values then recognise without comparing. Bounded;
/// never waited for (the idle-priority background lane parses too and may be preempted holding
/// the lock).
#[derive(Debug)]
pub(crate) struct ParsedTools {
    kept: parking_lot::Mutex<Lru<u128, Arc<serde_json::Value>>>,
}

/// Distinct tool lists [`ParsedTools`] keeps.
const PARSED_TOOLS_KEPT: usize = 16;
/// Longest tool list [`ParsedTools`] keeps, in bytes of JSON: 1 MiB for all of them.
const PARSED_TOOLS_MAX_BYTES: usize = 64 << 10;

impl Default for ParsedTools {
    fn default() -> Self {
        Self {
            kept: parking_lot::Mutex::new(Lru::new(
                PARSED_TOOLS_KEPT,
                PARSED_TOOLS_KEPT * PARSED_TOOLS_MAX_BYTES,
            )),
        }
    }
}

impl ParsedTools {
    /// `raw` parsed, or the list parsed from the same text before.
    pub(crate) fn parse(
        &self,
        raw: &RawValue,
    ) -> Result<Arc<serde_json::Value>, serde_json::Error> {
        let text = raw.get();
        let key = xxhash_rust::xxh3::xxh3_128(text.as_bytes());
        if let Some(parsed) = self
            .kept
            .try_lock()
            .and_then(|mut kept| kept.get(&key).cloned())
        {
            return Ok(parsed);
        }
        let parsed = Arc::new(serde_json::from_str(text)?);
        if text.len() <= PARSED_TOOLS_MAX_BYTES
            && let Some(mut kept) = self.kept.try_lock()
        {
            kept.insert(key, Arc::clone(&parsed), text.len());
        }
        Ok(parsed)
    }
}

impl TokenizeInput {
    /// What a tokenizer is asked for a request's prompt (`None` for token ids or no prompt).
    pub fn from_prompt(prompt: &Prompt<'_>) -> Option<Self> {
        match prompt {
            Prompt::Tokens(_) | Prompt::Absent => None,
            prompt => Some(owned_input(prompt)),
        }
    }

    /// Size of the text or the raw messages JSON, in bytes.
    pub fn len_bytes(&self) -> usize {
        match self {
            Self::Text { text, .. } => text.len(),
            Self::Api { request, .. } => request.get().len(),
            Self::Chat {
                messages, fields, ..
            } => {
                let raw = [
                    &fields.tools,
                    &fields.documents,
                    &fields.chat_template_kwargs,
                ];
                messages.get().len()
                    + raw
                        .iter()
                        .filter_map(|r| r.as_ref())
                        .map(|r| r.get().len())
                        .sum::<usize>()
            }
        }
    }
}

/// [`TokenizeInput::from_prompt`], with empty text for token ids or no prompt.
pub(super) fn owned_input(prompt: &Prompt<'_>) -> TokenizeInput {
    match prompt {
        Prompt::Text {
            text,
            add_special_tokens,
            ..
        } => TokenizeInput::Text {
            text: text.clone().into_owned(),
            add_special_tokens: *add_special_tokens,
        },
        Prompt::Chat {
            raw,
            add_generation_prompt,
            fields,
            ..
        } => TokenizeInput::Chat {
            messages: (*raw).to_owned(),
            add_generation_prompt: *add_generation_prompt,
            fields: ChatInputFields::from_request(fields),
        },
        Prompt::Api { api, fields, .. } => TokenizeInput::Api {
            api: *api,
            request: api_fields_object(fields),
        },
        Prompt::Tokens(_) | Prompt::Absent => TokenizeInput::Text {
            text: String::new(),
            add_special_tokens: false,
        },
    }
}

/// An API input's fields as a JSON object.
pub(super) fn api_request_object(
    request: &RawValue,
) -> Result<serde_json::Map<String, serde_json::Value>, TokenizeError> {
    serde_json::from_str(request.get()).map_err(|e| TokenizeError::InProcess {
        reason: e.to_string(),
    })
}

/// The fields as one JSON object (the raw values joined: no re-encoding).
fn api_fields_object(fields: &[(&'static str, &RawValue)]) -> Box<RawValue> {
    let mut json = String::from("{");
    for (i, (name, raw)) in fields.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        json.push('"');
        json.push_str(name);
        json.push_str("\":");
        json.push_str(raw.get());
    }
    json.push('}');
    RawValue::from_string(json).unwrap_or_else(|_| empty_object())
}

fn empty_object() -> Box<RawValue> {
    // A literal that is valid JSON; the fallback never happens for raw values serde parsed.
    serde_json::from_str("{}").unwrap_or_else(|_| RawValue::NULL.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    #[test]
    fn the_same_tool_text_gets_the_same_parsed_list() {
        let parsed = ParsedTools::default();
        let tools = r#"[{"type": "function", "function": {"name": "a"}}]"#;
        let first = parsed.parse(&raw(tools)).unwrap();
        let again = parsed.parse(&raw(tools)).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "parsed once, shared");
        let other = parsed
            .parse(&raw(r#"[{"function": {"name": "a"}, "type": "function"}]"#))
            .unwrap();
        assert!(!Arc::ptr_eq(&first, &other), "other text, its own list");
        assert_eq!(
            other.as_array().unwrap()[0]
                .as_object()
                .unwrap()
                .keys()
                .next()
                .unwrap(),
            "function",
            "in the order sent"
        );
        for i in 0..(PARSED_TOOLS_KEPT + 1) {
            parsed.parse(&raw(&format!("[{i}]"))).unwrap();
        }
        assert_eq!(parsed.kept.lock().len(), PARSED_TOOLS_KEPT, "bounded");
        let huge = format!("[\"{}\"]", "x".repeat(PARSED_TOOLS_MAX_BYTES));
        let once = parsed.parse(&raw(&huge)).unwrap();
        assert!(
            !Arc::ptr_eq(&once, &parsed.parse(&raw(&huge)).unwrap()),
            "a list over the size bound is not kept"
        );
    }
}
