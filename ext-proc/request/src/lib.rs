//! Parsing the OpenAI request body: only what routing needs, borrowing from the body buffer.
//!
//! `model`, the prompt (`prompt` for `/v1/completions`, `messages` for `/v1/chat/completions`),
//! `cache_salt` and every other field that changes the prompt vLLM 0.32 computes are read:
//! `add_special_tokens`, and for chat `add_generation_prompt`, `continue_final_message`,
//! `tools`, `documents`, `chat_template_kwargs`, `reasoning_effort` and whether a request
//! `chat_template` is present (kept raw, borrowed from
//! the body, for the tokenizer and the token-cache key). Every other field is skipped by serde
//! without being materialized. Strings borrow from the body unless they contain escapes.
//!
//! `/v1/responses` and `/v1/messages` keep their prompt-changing fields raw ([`Prompt::Api`]:
//! `input`, `instructions`, `tools`, `reasoning`, `previous_response_id`; `messages`, `system`,
//! `tools`, `thinking`, `output_config`; `chat_template_kwargs`): the tokenizer converts them to
//! the chat vLLM renders (`kvroute_tokenize::apis`). Every prompt keeps the whole body borrowed,
//! for a tokenizer that sends the request to the engine's render endpoint.
//!
//! A `prompt` list (vLLM's batch form) routes on its **first** element: the batch goes to one
//! replica as a whole, and the first prompt is as good a representative as any.

#![deny(missing_docs)]

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

mod error;

pub use error::RequestError;

/// An API vLLM serves by converting its requests into a chat (kvroute-tokenize's `apis`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiKind {
    /// OpenAI's Responses API, `/v1/responses`.
    Responses,
    /// Anthropic's Messages API, `/v1/messages`.
    Messages,
}

/// Which OpenAI endpoint the request targets (from `:path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`: `prompt` required.
    Completions,
    /// `/v1/chat/completions`: `messages` required.
    ChatCompletions,
    /// `/v1/responses` (OpenAI Responses API): `input` required.
    Responses,
    /// `/v1/messages` (Anthropic Messages API): `messages` required.
    Messages,
    /// Anything else: routed on a prompt if one is present, else on load alone.
    Other,
}

impl Endpoint {
    /// Classifies a request path (query string ignored).
    pub fn from_path(path: &str) -> Self {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        match path {
            "/v1/completions" => Self::Completions,
            "/v1/chat/completions" => Self::ChatCompletions,
            "/v1/responses" => Self::Responses,
            "/v1/messages" => Self::Messages,
            _ => Self::Other,
        }
    }

    /// The OpenTelemetry GenAI `gen_ai.operation.name` of a request to this endpoint.
    pub fn gen_ai_operation(self) -> Option<&'static str> {
        match self {
            Self::Completions => Some("text_completion"),
            Self::ChatCompletions | Self::Responses | Self::Messages => Some("chat"),
            Self::Other => None,
        }
    }
}

/// The routing-relevant view of a request body.
#[derive(Debug)]
pub struct ParsedRequest<'a> {
    /// Requested model (base or LoRA adapter name); empty when the request names none (absent,
    /// `null` or `""`), which vLLM serves with its base model.
    pub model: Cow<'a, str>,
    /// What will be tokenized.
    pub prompt: Prompt<'a>,
    /// vLLM's `cache_salt` (isolates prefix-cache entries).
    pub cache_salt: Option<Cow<'a, str>>,
    /// Whether the client sent `kv_transfer_params` (vLLM's KV-connector parameters, which name
    /// the engine a decode pulls its prompt from).
    pub kv_transfer_params: bool,
}

/// The prompt in the form the client sent.
#[derive(Debug)]
pub enum Prompt<'a> {
    /// Completion text.
    Text {
        /// The text.
        text: Cow<'a, str>,
        /// vLLM's flag (default true for completions).
        add_special_tokens: bool,
        /// The whole request body.
        body: &'a [u8],
    },
    /// Pre-tokenized completion prompt.
    Tokens(Vec<u32>),
    /// Chat messages, kept raw: the tokenizer renders them with the model's template.
    Chat {
        /// Each message's JSON text, in order (used for prefix caching and forwarding).
        messages: Vec<&'a str>,
        /// The whole `messages` array as sent.
        raw: &'a RawValue,
        /// vLLM's flag (default true).
        add_generation_prompt: bool,
        /// The request's other prompt-changing fields.
        fields: ChatFields<'a>,
        /// The whole request body.
        body: &'a [u8],
    },
    /// A Responses or Messages API request, converted to a chat by the tokenizer.
    Api {
        /// Which API.
        api: ApiKind,
        /// The conversation's items in order (`input` items, or `input` itself when it is a
        /// string; `messages`), for the conversation-prefix cache keys.
        items: Vec<&'a str>,
        /// Every prompt-changing field that is present, by name, as sent.
        fields: Vec<(&'static str, &'a RawValue)>,
        /// The whole request body.
        body: &'a [u8],
    },
    /// No prompt on an endpoint that does not require one: route on load.
    Absent,
}

/// The fields of a chat request besides `messages` that change vLLM's prompt, as sent.
#[derive(Debug, Clone, Default)]
pub struct ChatFields<'a> {
    /// `continue_final_message` (default false).
    pub continue_final_message: bool,
    /// `add_special_tokens` (default false for chat).
    pub add_special_tokens: bool,
    /// `tools`, raw.
    pub tools: Option<&'a RawValue>,
    /// `documents`, raw.
    pub documents: Option<&'a RawValue>,
    /// `chat_template_kwargs`, raw.
    pub chat_template_kwargs: Option<&'a RawValue>,
    /// `reasoning_effort`.
    pub reasoning_effort: Option<Cow<'a, str>>,
    /// Whether the request carries its own `chat_template`.
    pub request_template: bool,
    /// `tool_choice`, raw: SGLang renders no tools for `"none"` (vLLM ignores it).
    pub tool_choice: Option<&'a RawValue>,
    /// `mm_processor_kwargs` and `media_io_kwargs`, raw: they change how the engine processes
    /// and so identifies a request's images (what render mode's keys are built from).
    pub media_kwargs: [Option<&'a RawValue>; 2],
}

/// The fields routing reads; every other is skipped. A key sent twice keeps its last value, as
/// Python's `json.loads` does for vLLM (serde's derive would refuse the body).
#[derive(Default)]
struct Body<'a> {
    model: Option<Cow<'a, str>>,
    prompt: Option<&'a RawValue>,
    messages: Option<&'a RawValue>,
    cache_salt: Option<Cow<'a, str>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    tools: Option<&'a RawValue>,
    tool_choice: Option<&'a RawValue>,
    documents: Option<&'a RawValue>,
    chat_template_kwargs: Option<&'a RawValue>,
    reasoning_effort: Option<Cow<'a, str>>,
    chat_template: Option<&'a RawValue>,
    input: Option<&'a RawValue>,
    instructions: Option<&'a RawValue>,
    reasoning: Option<&'a RawValue>,
    previous_response_id: Option<&'a RawValue>,
    system: Option<&'a RawValue>,
    thinking: Option<&'a RawValue>,
    output_config: Option<&'a RawValue>,
    kv_transfer_params: Option<&'a RawValue>,
    mm_processor_kwargs: Option<&'a RawValue>,
    media_io_kwargs: Option<&'a RawValue>,
}

impl<'de> Deserialize<'de> for Body<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Body<'de>, A::Error> {
        fn text<'de, A: MapAccess<'de>>(map: &mut A) -> Result<Option<Cow<'de, str>>, A::Error> {
            Ok(map
                .next_value::<Option<Text<'de>>>()?
                .map(|Text(text)| text))
        }
        let mut body = Body::default();
        while let Some(Text(key)) = map.next_key::<Text<'de>>()? {
            match key.as_ref() {
                "model" => body.model = text(&mut map)?,
                "prompt" => body.prompt = map.next_value()?,
                "messages" => body.messages = map.next_value()?,
                "cache_salt" => body.cache_salt = text(&mut map)?,
                "add_special_tokens" => body.add_special_tokens = map.next_value()?,
                "add_generation_prompt" => body.add_generation_prompt = map.next_value()?,
                "continue_final_message" => body.continue_final_message = map.next_value()?,
                "tools" => body.tools = map.next_value()?,
                "tool_choice" => body.tool_choice = map.next_value()?,
                "documents" => body.documents = map.next_value()?,
                "chat_template_kwargs" => body.chat_template_kwargs = map.next_value()?,
                "reasoning_effort" => body.reasoning_effort = text(&mut map)?,
                "chat_template" => body.chat_template = map.next_value()?,
                "input" => body.input = map.next_value()?,
                "instructions" => body.instructions = map.next_value()?,
                "reasoning" => body.reasoning = map.next_value()?,
                "previous_response_id" => body.previous_response_id = map.next_value()?,
                "system" => body.system = map.next_value()?,
                "thinking" => body.thinking = map.next_value()?,
                "output_config" => body.output_config = map.next_value()?,
                "kv_transfer_params" => body.kv_transfer_params = map.next_value()?,
                "mm_processor_kwargs" => body.mm_processor_kwargs = map.next_value()?,
                "media_io_kwargs" => body.media_io_kwargs = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(body)
    }
}

/// A raw JSON value that is `null` counts as absent (vLLM's defaults are `None`).
fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|r| r.get() != "null")
}

/// A string that borrows from the body unless it has escapes.
#[derive(Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

/// Parses a request body.
pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<ParsedRequest<'_>, RequestError> {
    // UTF-8 checked once, by a SIMD validator, for the whole body (JSON text is UTF-8, and vLLM
    // refuses a body that is not): from bytes, serde_json validates every borrowed span again
    // with the standard library's validator, a fifth of a 32k-token chat's decision on mixed
    // scripts (docs/benchmarks-history-2026-12.md, "Latency through Envoy with real tokenizers").
    let text = simdutf8::basic::from_utf8(body).map_err(|_| RequestError::MalformedJson {
        reason: "the body is not UTF-8".to_owned(),
    })?;
    let parsed: Body<'_> = serde_json::from_str(text).map_err(|e| RequestError::MalformedJson {
        reason: e.to_string(),
    })?;
    // vLLM serves a request naming no model (absent, null, "") with its base model.
    let model = parsed.model.unwrap_or_default();
    let prompt = match (endpoint, parsed.prompt, parsed.messages) {
        (Endpoint::Responses, ..) => {
            let input =
                present(parsed.input).ok_or(RequestError::MissingField { field: "input" })?;
            let fields = [
                ("input", Some(input)),
                ("instructions", parsed.instructions),
                ("tools", parsed.tools),
                ("tool_choice", parsed.tool_choice),
                ("reasoning", parsed.reasoning),
                ("previous_response_id", parsed.previous_response_id),
                ("chat_template_kwargs", parsed.chat_template_kwargs),
            ];
            let items = if input.get().starts_with('[') {
                conversation_items(input, "input")?
            } else {
                vec![input.get()]
            };
            api_prompt(ApiKind::Responses, items, &fields, body)
        }
        (Endpoint::Messages, _, messages) => {
            let messages =
                present(messages).ok_or(RequestError::MissingField { field: "messages" })?;
            let fields = [
                ("messages", Some(messages)),
                ("system", parsed.system),
                ("tools", parsed.tools),
                ("tool_choice", parsed.tool_choice),
                ("thinking", parsed.thinking),
                ("output_config", parsed.output_config),
                ("chat_template_kwargs", parsed.chat_template_kwargs),
            ];
            let items = conversation_items(messages, "messages")?;
            api_prompt(ApiKind::Messages, items, &fields, body)
        }
        (Endpoint::ChatCompletions, _, Some(raw)) | (Endpoint::Other, None, Some(raw)) => {
            let fields = ChatFields {
                continue_final_message: parsed.continue_final_message.unwrap_or(false),
                add_special_tokens: parsed.add_special_tokens.unwrap_or(false),
                tools: present(parsed.tools),
                documents: present(parsed.documents),
                chat_template_kwargs: present(parsed.chat_template_kwargs),
                reasoning_effort: parsed.reasoning_effort,
                request_template: present(parsed.chat_template).is_some(),
                tool_choice: present(parsed.tool_choice),
                media_kwargs: [
                    present(parsed.mm_processor_kwargs),
                    present(parsed.media_io_kwargs),
                ],
            };
            chat(
                raw,
                parsed.add_generation_prompt.unwrap_or(true),
                fields,
                body,
            )?
        }
        (Endpoint::Completions, Some(raw), _) | (Endpoint::Other, Some(raw), _) => {
            completion(raw, parsed.add_special_tokens.unwrap_or(true), body)?
        }
        (Endpoint::ChatCompletions, _, None) => {
            return Err(RequestError::MissingField { field: "messages" });
        }
        (Endpoint::Completions, None, _) => {
            return Err(RequestError::MissingField { field: "prompt" });
        }
        (Endpoint::Other, None, None) => Prompt::Absent,
    };
    Ok(ParsedRequest {
        model,
        prompt,
        cache_salt: parsed.cache_salt.filter(|s| !s.is_empty()),
        kv_transfer_params: present(parsed.kv_transfer_params).is_some(),
    })
}

/// A non-empty list of objects (a conversation), each entry kept raw.
fn conversation_items<'a>(
    raw: &'a RawValue,
    field: &'static str,
) -> Result<Vec<&'a str>, RequestError> {
    let items = array_elements(raw).ok_or(RequestError::InvalidField {
        field,
        reason: "expected a list",
    })?;
    if items.is_empty() {
        return Err(RequestError::InvalidField {
            field,
            reason: "empty list",
        });
    }
    if items.iter().any(|m| !m.starts_with('{')) {
        return Err(RequestError::InvalidField {
            field,
            reason: "expected objects",
        });
    }
    Ok(items)
}

/// The JSON text of each element of `raw` when it is an array; `None` otherwise.
///
/// `raw` was validated when the body was parsed, so the elements are found by one scan for
/// the array's own commas (outside strings and nested values) instead of a second parse: in a
/// long conversation nearly every byte is inside a string, which `memchr` skips to its end.
fn array_elements(raw: &RawValue) -> Option<Vec<&str>> {
    let json = raw.get();
    let bytes = json.as_bytes();
    if bytes.first() != Some(&b'[') {
        return None;
    }
    let mut elements = Vec::new();
    let mut depth = 0usize;
    let mut start = None;
    let mut end = 0;
    let mut at = 1;
    while at < bytes.len() {
        match bytes[at] {
            b'"' => {
                start.get_or_insert(at);
                // To the closing quote: the first one after an even run of backslashes (an
                // escaped quote follows an odd one). Text is full of escaped newlines, and
                // stopping at each backslash cost more than looking back from each quote.
                at += 1;
                loop {
                    at += memchr::memchr(b'"', bytes.get(at..)?)?;
                    let escapes = bytes[..at]
                        .iter()
                        .rev()
                        .take_while(|&&b| b == b'\\')
                        .count();
                    if escapes % 2 == 0 {
                        break;
                    }
                    at += 1;
                }
                end = at + 1;
            }
            b'{' | b'[' => {
                start.get_or_insert(at);
                depth += 1;
            }
            b'}' | b']' if depth > 0 => {
                depth -= 1;
                end = at + 1;
            }
            b',' | b']' if depth == 0 => {
                if let Some(first) = start.take() {
                    elements.push(&json[first..end]);
                }
                if bytes[at] == b']' {
                    return Some(elements);
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' => {}
            _ => {
                // A number, true, false or null: one byte at a time to its end.
                start.get_or_insert(at);
                end = at + 1;
            }
        }
        at += 1;
    }
    None
}

fn api_prompt<'a>(
    api: ApiKind,
    items: Vec<&'a str>,
    fields: &[(&'static str, Option<&'a RawValue>)],
    body: &'a [u8],
) -> Prompt<'a> {
    Prompt::Api {
        api,
        items,
        fields: fields
            .iter()
            .filter_map(|&(name, raw)| Some((name, present(raw)?)))
            .collect(),
        body,
    }
}

fn completion<'a>(
    raw: &'a RawValue,
    add_special_tokens: bool,
    body: &'a [u8],
) -> Result<Prompt<'a>, RequestError> {
    let invalid = |reason| RequestError::InvalidField {
        field: "prompt",
        reason,
    };
    let expected = || invalid("expected a string, a list of strings, or token ids");
    // Dispatched on the first bytes: an untagged enum would buffer a copy of the whole prompt
    // before trying each form.
    let json = raw.get();
    let after_bracket = json
        .strip_prefix('[')
        .map(|rest| rest.trim_start().as_bytes().first().copied());
    Ok(match (json.as_bytes().first(), after_bracket) {
        (Some(b'"'), _) => {
            let Text(text) = serde_json::from_str(json).map_err(|_| expected())?;
            Prompt::Text {
                text,
                add_special_tokens,
                body,
            }
        }
        (_, Some(Some(b']'))) => return Err(invalid("empty")),
        (_, Some(Some(b'"'))) => {
            let texts: Vec<Text<'_>> = serde_json::from_str(json).map_err(|_| expected())?;
            Prompt::Text {
                text: texts.into_iter().next().ok_or_else(expected)?.0,
                add_special_tokens,
                body,
            }
        }
        (_, Some(Some(b'['))) => {
            let lists: Vec<Vec<u32>> = serde_json::from_str(json).map_err(|_| expected())?;
            Prompt::Tokens(
                lists
                    .into_iter()
                    .next()
                    .filter(|l| !l.is_empty())
                    .ok_or_else(|| invalid("empty list"))?,
            )
        }
        (_, Some(_)) => Prompt::Tokens(serde_json::from_str(json).map_err(|_| expected())?),
        _ => return Err(expected()),
    })
}

fn chat<'a>(
    raw: &'a RawValue,
    add_generation_prompt: bool,
    fields: ChatFields<'a>,
    body: &'a [u8],
) -> Result<Prompt<'a>, RequestError> {
    let messages = array_elements(raw).ok_or(RequestError::InvalidField {
        field: "messages",
        reason: "expected a list of messages",
    })?;
    if messages.is_empty() {
        return Err(RequestError::InvalidField {
            field: "messages",
            reason: "empty list",
        });
    }
    if messages.iter().any(|m| !m.starts_with('{')) {
        return Err(RequestError::InvalidField {
            field: "messages",
            reason: "expected message objects",
        });
    }
    Ok(Prompt::Chat {
        messages,
        raw,
        add_generation_prompt,
        fields,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(body: &str, endpoint: Endpoint) -> ParsedRequest<'_> {
        parse(body.as_bytes(), endpoint).unwrap()
    }

    #[test]
    fn a_body_that_is_not_utf8_is_malformed_wherever_the_bad_bytes_are() {
        let good = r#"{"model":"m","messages":[{"role":"user","content":"héllo 世界"}],"x":"ü"}"#;
        let parsed = parse_ok(good, Endpoint::ChatCompletions);
        assert!(
            matches!(parsed.prompt, Prompt::Chat { raw, .. } if raw.get().contains("héllo 世界")),
            "non-ASCII text kept as sent"
        );
        let at = |needle: &str| good.find(needle).unwrap();
        // In the prompt, in a field kvroute ignores, and a truncated multi-byte char.
        for (start, len) in [(at("llo"), 1), (at("ü"), 2), (at("世"), 1)] {
            let mut bytes = good.as_bytes().to_vec();
            bytes.splice(start..start + len, [0xff]);
            assert!(
                matches!(
                    parse(&bytes, Endpoint::ChatCompletions),
                    Err(RequestError::MalformedJson { .. })
                ),
                "bad byte at {start} accepted"
            );
        }
    }

    #[test]
    fn completion_forms() {
        let r = parse_ok(
            r#"{"model":"m","prompt":"hi","max_tokens":5,"cache_salt":"s"}"#,
            Endpoint::Completions,
        );
        assert_eq!(r.model, "m");
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert!(
            matches!(r.prompt, Prompt::Text { ref text, add_special_tokens: true, .. } if text == "hi")
        );
        assert!(
            matches!(
                r.prompt,
                Prompt::Text {
                    text: Cow::Borrowed(_),
                    ..
                }
            ),
            "borrowed, not copied"
        );
        let r = parse_ok(
            r#"{"model":"m","prompt":["a\nb","c"]}"#,
            Endpoint::Completions,
        );
        assert!(matches!(r.prompt, Prompt::Text { ref text, .. } if text == "a\nb"));
        let r = parse_ok(r#"{"model":"m","prompt":[1,2,3]}"#, Endpoint::Completions);
        assert!(matches!(r.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        let r = parse_ok(
            r#"{"model":"m","prompt":[[4,5],[6]],"add_special_tokens":false}"#,
            Endpoint::Completions,
        );
        assert!(matches!(r.prompt, Prompt::Tokens(ref t) if t == &[4, 5]));
        let r = parse_ok(
            r#"{"model":"m","prompt": "a\"b\u00e9" , "max_tokens":1}"#,
            Endpoint::Completions,
        );
        assert!(matches!(r.prompt, Prompt::Text { ref text, .. } if text == "a\"b\u{e9}"));
        let r = parse_ok(r#"{"model":"m","prompt":[ 7 , 8 ]}"#, Endpoint::Completions);
        assert!(matches!(r.prompt, Prompt::Tokens(ref t) if t == &[7, 8]));
        let r = parse_ok(r#"{"model":"m","prompt":[ "x" ]}"#, Endpoint::Completions);
        assert!(matches!(r.prompt, Prompt::Text { ref text, .. } if text == "x"));
    }

    #[test]
    fn chat_form() {
        let body = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"q"}]}],"stream":true}"#;
        let r = parse_ok(body, Endpoint::ChatCompletions);
        let Prompt::Chat {
            messages,
            add_generation_prompt,
            ..
        } = r.prompt
        else {
            panic!("not chat")
        };
        assert_eq!(messages.len(), 2);
        assert!(add_generation_prompt);
        assert_eq!(messages[0], r#"{"role":"system","content":"s"}"#);
    }

    #[test]
    fn chat_fields_that_change_the_prompt() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"enable_thinking":false},"reasoning_effort":"low","documents":null,"continue_final_message":true,"add_generation_prompt":false,"add_special_tokens":true}"#;
        let Prompt::Chat {
            fields,
            add_generation_prompt,
            ..
        } = parse_ok(body, Endpoint::ChatCompletions).prompt
        else {
            panic!("not chat")
        };
        assert!(!add_generation_prompt);
        assert!(fields.continue_final_message && fields.add_special_tokens);
        assert_eq!(
            fields.tools.map(RawValue::get),
            Some(r#"[{"type":"function","function":{"name":"f"}}]"#)
        );
        assert_eq!(
            fields.chat_template_kwargs.map(RawValue::get),
            Some(r#"{"enable_thinking":false}"#)
        );
        assert_eq!(fields.reasoning_effort.as_deref(), Some("low"));
        assert!(fields.documents.is_none(), "null is absent");
        let Prompt::Chat { fields, .. } = parse_ok(
            r#"{"model":"m","messages":[{"role":"user","content":"q"}]}"#,
            Endpoint::ChatCompletions,
        )
        .prompt
        else {
            panic!("not chat")
        };
        assert!(!fields.continue_final_message && !fields.add_special_tokens);
        assert!(fields.tools.is_none() && fields.chat_template_kwargs.is_none());
        assert!(fields.reasoning_effort.is_none());
    }

    #[test]
    fn responses_and_messages_keep_their_prompt_fields_raw() {
        assert_eq!(
            Endpoint::from_path("/v1/responses?x=1"),
            Endpoint::Responses
        );
        assert_eq!(Endpoint::from_path("/v1/messages/"), Endpoint::Messages);
        let body = r#"{"model":"m","input":[{"role":"user","content":"q"},{"type":"function_call_output","call_id":"c","output":"o"}],"instructions":"be brief","tools":[],"reasoning":null,"temperature":0.2}"#;
        let r = parse_ok(body, Endpoint::Responses);
        let Prompt::Api {
            api,
            items,
            fields,
            body: whole,
        } = r.prompt
        else {
            panic!("not an API prompt")
        };
        assert_eq!(api, ApiKind::Responses);
        assert_eq!(items.len(), 2);
        assert_eq!(whole, body.as_bytes());
        let names: Vec<&str> = fields.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["input", "instructions", "tools"], "null is absent");
        let r = parse_ok(r#"{"model":"m","input":"just text"}"#, Endpoint::Responses);
        assert!(matches!(r.prompt, Prompt::Api { ref items, .. } if items[0] == r#""just text""#));

        let body = r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":"q"}],"thinking":{"type":"disabled"},"cache_salt":"c"}"#;
        let r = parse_ok(body, Endpoint::Messages);
        assert_eq!(r.cache_salt.as_deref(), Some("c"));
        let Prompt::Api {
            api, items, fields, ..
        } = r.prompt
        else {
            panic!("not an API prompt")
        };
        assert_eq!(api, ApiKind::Messages);
        assert_eq!(items.len(), 1);
        let names: Vec<&str> = fields.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["messages", "system", "thinking"]);

        let status = |body: &str, e| parse(body.as_bytes(), e).unwrap_err().http_status();
        assert_eq!(status(r#"{"model":"m"}"#, Endpoint::Responses), 400);
        assert_eq!(
            status(r#"{"model":"m","input":[]}"#, Endpoint::Responses),
            400
        );
        assert_eq!(
            status(r#"{"model":"m","input":[1]}"#, Endpoint::Responses),
            400
        );
        assert_eq!(
            status(r#"{"model":"m","system":"s"}"#, Endpoint::Messages),
            400
        );
        assert_eq!(
            status(r#"{"model":"m","messages":{}}"#, Endpoint::Messages),
            400
        );
    }

    /// vLLM serves a request naming no model with its base model (`_is_model_supported`: a
    /// falsy name is supported), so absent, `null` and `""` all parse, as "no model".
    #[test]
    fn a_request_without_model_parses_as_naming_none() {
        for body in [
            r#"{"prompt":"x"}"#,
            r#"{"model":null,"prompt":"x"}"#,
            r#"{"model":"","prompt":"x"}"#,
        ] {
            let r = parse_ok(body, Endpoint::Completions);
            assert_eq!(r.model, "", "{body}");
            assert!(matches!(r.prompt, Prompt::Text { ref text, .. } if text == "x"));
        }
    }

    /// FastAPI hands vLLM the body through Python's `json.loads`, which keeps the last of a
    /// duplicated key; so does the parser, for every field (serde's derive refused the body).
    #[test]
    fn a_duplicated_key_keeps_its_last_value() {
        let r = parse_ok(
            r#"{"model":"a","prompt":"first","model":"m","prompt":"second","cache_salt":"s","cache_salt":"t"}"#,
            Endpoint::Completions,
        );
        assert_eq!(r.model, "m");
        assert!(matches!(r.prompt, Prompt::Text { ref text, .. } if text == "second"));
        assert_eq!(r.cache_salt.as_deref(), Some("t"));
        // An escaped key is the same key.
        let r = parse_ok(
            r#"{"model":"a","mod\u0065l":"m","messages":[{"role":"user","content":"q"}]}"#,
            Endpoint::ChatCompletions,
        );
        assert_eq!(r.model, "m");
        // The last value decides even when it is null (None in Python, then vLLM's default).
        let r = parse_ok(
            r#"{"model":"m","prompt":"x","model":null}"#,
            Endpoint::Completions,
        );
        assert_eq!(r.model, "");
    }

    #[test]
    fn errors_map_to_statuses() {
        let status = |body: &str, e| parse(body.as_bytes(), e).unwrap_err().http_status();
        assert_eq!(status("{not json", Endpoint::Completions), 400);
        assert_eq!(status(r#"{"model":"m"}"#, Endpoint::Completions), 400);
        assert_eq!(
            status(r#"{"model":5,"prompt":"x"}"#, Endpoint::Completions),
            400
        );
        assert_eq!(
            status(r#"{"model":"m","prompt":"x"}"#, Endpoint::ChatCompletions),
            400
        );
        assert_eq!(
            status(r#"{"model":"m","prompt":[]}"#, Endpoint::Completions),
            400
        );
        for prompt in [
            "[-1]",
            "[ ]",
            "[[]]",
            "[\"a\",1]",
            "[1,\"a\"]",
            "7",
            "{}",
            "null",
            "true",
            "[",
        ] {
            let body = format!(r#"{{"model":"m","prompt":{prompt}}}"#);
            assert_eq!(status(&body, Endpoint::Completions), 400, "{prompt}");
        }
        assert_eq!(
            status(r#"{"model":"m","messages":[]}"#, Endpoint::ChatCompletions),
            400
        );
        assert_eq!(status(r#"[1,2]"#, Endpoint::ChatCompletions), 400);
        assert!(matches!(
            parse_ok(r#"{"model":"m"}"#, Endpoint::Other).prompt,
            Prompt::Absent
        ));
    }

    /// Arrays of every JSON shape (nested values, escapes, unicode, odd whitespace): the
    /// one-scan split equals serde's own element by element, and non-arrays are refused.
    #[test]
    fn array_elements_split_as_serde_does() {
        const VALUES: &[&str] = &[
            r#"{"role":"user","content":"a, b] c"}"#,
            r#"{"content":"quote \" comma , bracket ] brace }"}"#,
            r#"{"content":"backslash at the end \\"}"#,
            r#"{"content":"\\\" both","n":[1,[2,{"x":"]"}]]}"#,
            r#""text, \u005d \ud83d\ude00 ünïcødé 🙂""#,
            "-12.5e+3",
            "0",
            "true",
            "null",
            "[]",
            "{}",
            r#"[ "nested" , [ ] , { } ]"#,
            r#"{ "spaced" :	"tab"	}"#,
        ];
        const SPACES: &[&str] = &["", " ", "\n", "\t \r\n "];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..2_000 {
            let len = next(6);
            let mut json = format!("[{}", SPACES[next(SPACES.len())]);
            for i in 0..len {
                if i > 0 {
                    json.push_str(SPACES[next(SPACES.len())]);
                    json.push(',');
                    json.push_str(SPACES[next(SPACES.len())]);
                }
                json.push_str(VALUES[next(VALUES.len())]);
            }
            json.push_str(SPACES[next(SPACES.len())]);
            json.push(']');
            let raw: &RawValue = serde_json::from_str(&json).unwrap();
            let by_serde: Vec<&str> = serde_json::from_str::<Vec<&RawValue>>(&json)
                .unwrap()
                .iter()
                .map(|v| v.get())
                .collect();
            assert_eq!(array_elements(raw).unwrap(), by_serde, "{json}");
        }
        for not_an_array in [r#"{"a":[1]}"#, r#""[1]""#, "7", "null"] {
            let raw: &RawValue = serde_json::from_str(not_an_array).unwrap();
            assert_eq!(array_elements(raw), None, "{not_an_array}");
        }
    }
}
