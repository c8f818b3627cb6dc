//! The Responses API (`/v1/responses`) and Anthropic Messages API (`/v1/messages`) requests as
//! the chat conversation vLLM 0.32 renders for them, so their prompts tokenize like a chat's.
//!
//! Responses: `construct_input_messages` and `construct_tool_dicts`
//! (`vllm/entrypoints/openai/responses/utils.py`) and `ResponsesRequest.build_chat_params`:
//! `instructions` → a leading system message; `input` a string (one user message) or items
//! (messages as sent; assistant output messages, `reasoning`, `function_call` and
//! `custom_tool_call` items folded into one assistant message as vLLM folds them;
//! `function_call_output` → a `tool` message); flat function `tools` → chat tools; a last
//! `in_progress`/`incomplete` assistant item continues that message. `previous_response_id` needs
//! the engine's stored history, which kvroute cannot know: refused here (the caller routes on load).
//!
//! Messages: `AnthropicServingMessages.to_chat_completion_request`
//! (`vllm/entrypoints/anthropic/serving.py`): `system` (string or text blocks, joined without a
//! separator) → a system message; blocks `text`, `thinking` (→ `reasoning`), `tool_use`
//! (→ `tool_calls`), `tool_result` (a user's → `tool` messages ahead of the rest), inline system
//! messages kept in place or merged into the leading one when the template requires system
//! first ([`crate::ChatTemplate::merges_inline_system`]); `tools` with `input_schema` → chat
//! tools; `thinking: {type: disabled}` → `reasoning_effort: none` (what the render endpoint does),
//! `output_config.effort` → `reasoning_effort`.
//!
//! Images (Messages `image` blocks, in content and in tool results) are refused as
//! [`TokenizeError::MultiModal`]: only the engine's processor places their tokens. Documents and
//! other blocks are refused as invalid (text only, as for chat).

use serde_json::{Map, Value};

use crate::{ChatOptions, TokenizeError};

pub mod sglang;

/// A converted request: the chat messages and options vLLM renders.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertedChat {
    /// The chat `messages` (a JSON array).
    pub messages: Value,
    /// The chat request's prompt-changing fields.
    pub options: ChatOptions,
}

fn invalid(reason: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidMessages {
        reason: reason.into(),
    }
}

fn object_kwargs(
    request: &Map<String, Value>,
) -> Result<Option<Map<String, Value>>, TokenizeError> {
    match request.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(map.clone())),
        Some(_) => Err(TokenizeError::InvalidKwargs {
            reason: "chat_template_kwargs must be an object".to_owned(),
        }),
    }
}

fn text_of(value: Option<&Value>) -> Option<&str> {
    value.and_then(Value::as_str)
}

/// The chat conversation of a `/v1/responses` request body.
pub fn responses_to_chat(request: &Map<String, Value>) -> Result<ConvertedChat, TokenizeError> {
    if request
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(invalid(
            "previous_response_id needs the engine's stored conversation",
        ));
    }
    let mut messages: Vec<Value> = Vec::new();
    if let Some(instructions) = text_of(request.get("instructions")).filter(|s| !s.is_empty()) {
        messages.push(serde_json::json!({"role": "system", "content": instructions}));
    }
    let mut continue_final = false;
    match request.get("input") {
        Some(Value::String(text)) => {
            messages.push(serde_json::json!({"role": "user", "content": text}));
        }
        Some(Value::Array(items)) => {
            for item in items {
                let item = item
                    .as_object()
                    .ok_or_else(|| invalid("an input item must be an object"))?;
                response_item(item, &mut messages)?;
            }
            continue_final = items.last().and_then(Value::as_object).is_some_and(|last| {
                matches!(
                    text_of(last.get("type")).unwrap_or("message"),
                    "message" | "reasoning"
                ) && matches!(
                    text_of(last.get("status")),
                    Some("in_progress" | "incomplete")
                )
            });
        }
        _ => return Err(invalid("input must be a string or a list of items")),
    }
    let tools = responses_tools(request.get("tools"))?;
    let reasoning_effort = match request.get("reasoning") {
        None | Some(Value::Null) => None,
        Some(Value::Object(reasoning)) => text_of(reasoning.get("effort")).map(str::to_owned),
        Some(_) => return Err(invalid("reasoning must be an object")),
    };
    Ok(ConvertedChat {
        messages: Value::Array(messages),
        options: ChatOptions {
            add_generation_prompt: !continue_final,
            continue_final_message: continue_final,
            tools: tools.map(std::sync::Arc::new),
            reasoning_effort,
            chat_template_kwargs: object_kwargs(request)?,
            // `ResponsesRequest.build_tok_params` leaves TokenizeParams' default (true), where a
            // chat request's is false.
            add_special_tokens: true,
            messages_validated: false,
            ..ChatOptions::default()
        },
    })
}

/// The last message, when it is the assistant's (vLLM folds calls and reasoning into it).
fn previous_assistant(messages: &mut [Value]) -> Option<&mut Map<String, Value>> {
    messages
        .last_mut()
        .and_then(Value::as_object_mut)
        .filter(|m| text_of(m.get("role")) == Some("assistant"))
}

fn response_item(
    item: &Map<String, Value>,
    messages: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let field = |key: &str| -> Result<&Value, TokenizeError> {
        item.get(key)
            .ok_or_else(|| invalid(format!("an input item lacks {key}")))
    };
    let string = |key: &str| -> Result<&str, TokenizeError> {
        field(key)?
            .as_str()
            .ok_or_else(|| invalid(format!("an input item's {key} must be a string")))
    };
    let kind = text_of(item.get("type"));
    let tool_call = match kind {
        Some("function_call") => {
            let name = match text_of(item.get("namespace")) {
                Some(namespace) => format!("{namespace}__{}", string("name")?),
                None => string("name")?.to_owned(),
            };
            Some(serde_json::json!({
                "id": string("call_id")?,
                "function": {"name": name, "arguments": string("arguments")?},
                "type": "function",
            }))
        }
        Some("custom_tool_call") => {
            let input = text_of(item.get("input")).unwrap_or("");
            Some(serde_json::json!({
                "id": string("call_id")?,
                "function": {
                    "name": string("name")?,
                    "arguments": serde_json::json!({"input": input}).to_string(),
                },
                "type": "function",
            }))
        }
        _ => None,
    };
    if let Some(call) = tool_call {
        if let Some(previous) = previous_assistant(messages) {
            match previous.get_mut("tool_calls") {
                None | Some(Value::Null) => {
                    previous.insert("tool_calls".to_owned(), Value::Array(vec![call]));
                    return Ok(());
                }
                Some(Value::Array(calls)) => {
                    calls.push(call);
                    return Ok(());
                }
                Some(_) => {}
            }
        }
        messages.push(serde_json::json!({"role": "assistant", "tool_calls": [call]}));
        return Ok(());
    }
    match kind {
        Some("reasoning") => {
            if item.get("encrypted_content").is_some_and(|v| !v.is_null()) {
                return Err(invalid("encrypted reasoning content is not supported"));
            }
            let first_text = |key: &str| {
                item.get(key)
                    .and_then(Value::as_array)
                    .and_then(|parts| parts.first())
                    .and_then(|part| text_of(part.get("text")))
            };
            let reasoning = first_text("content")
                .or_else(|| first_text("summary"))
                .unwrap_or("")
                .to_owned();
            if let Some(previous) = previous_assistant(messages)
                && previous.get("reasoning").is_none_or(Value::is_null)
            {
                previous.insert("reasoning".to_owned(), reasoning.into());
                return Ok(());
            }
            messages.push(serde_json::json!({"role": "assistant", "reasoning": reasoning}));
            return Ok(());
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            messages.push(serde_json::json!({
                "role": "tool",
                "content": item.get("output").cloned().unwrap_or(Value::Null),
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
            }));
            return Ok(());
        }
        _ => {}
    }
    if text_of(item.get("role")) == Some("assistant") {
        let text = match item.get("content") {
            Some(Value::String(text)) => Some(text.as_str()),
            Some(Value::Array(parts)) => parts.first().and_then(|p| text_of(p.get("text"))),
            _ => None,
        };
        if let Some(text) = text {
            if let Some(previous) = previous_assistant(messages)
                && previous.get("content").is_none_or(Value::is_null)
            {
                previous.insert("content".to_owned(), text.into());
                return Ok(());
            }
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
            return Ok(());
        }
    }
    if item.contains_key("role") {
        messages.push(Value::Object(item.clone()));
        return Ok(());
    }
    Err(invalid(format!(
        "unsupported input item type {}",
        kind.unwrap_or("(none)")
    )))
}

/// Flat Responses function tools as chat tools (`construct_tool_dicts`); other tool types
/// (built-in tools) do not reach a chat template and are left out.
fn responses_tools(tools: Option<&Value>) -> Result<Option<Value>, TokenizeError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| TokenizeError::InvalidTools {
            reason: "tools must be a list".to_owned(),
        })?;
    if tools.is_empty() {
        return Ok(None);
    }
    let mut converted = Vec::new();
    for tool in tools {
        let tool = tool
            .as_object()
            .ok_or_else(|| TokenizeError::InvalidTools {
                reason: "a tool must be an object".to_owned(),
            })?;
        match text_of(tool.get("type")) {
            Some("function") => {
                let function: Map<String, Value> = tool
                    .iter()
                    .filter(|(key, _)| *key != "type")
                    .map(|(key, value)| (key.clone(), value.clone()))
                    .collect();
                converted.push(serde_json::json!({"type": "function", "function": function}));
            }
            Some("namespace") => {
                return Err(TokenizeError::InvalidTools {
                    reason: "namespace tools are not supported".to_owned(),
                });
            }
            _ => {}
        }
    }
    Ok(Some(Value::Array(converted)))
}

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The text of an Anthropic system field or system message (billing headers dropped).
fn system_text(content: &Value) -> Result<Option<String>, TokenizeError> {
    match content {
        Value::String(text) if text.starts_with(BILLING_HEADER) => Ok(None),
        Value::String(text) => Ok(Some(text.clone())),
        Value::Array(blocks) => {
            let mut parts = String::new();
            for block in blocks {
                let block = block
                    .as_object()
                    .ok_or_else(|| invalid("a content block must be an object"))?;
                if text_of(block.get("type")) == Some("text")
                    && let Some(text) = text_of(block.get("text"))
                    && !text.is_empty()
                    && !text.starts_with(BILLING_HEADER)
                {
                    parts.push_str(text);
                }
            }
            Ok((!parts.is_empty()).then_some(parts))
        }
        _ => Err(invalid("system must be a string or a list of text blocks")),
    }
}

/// The chat conversation of a `/v1/messages` request body; `merge_inline_system` as the
/// engine's template requires ([`crate::ChatTemplate::merges_inline_system`]).
pub fn messages_to_chat(
    request: &Map<String, Value>,
    merge_inline_system: bool,
) -> Result<ConvertedChat, TokenizeError> {
    let input = request
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("messages must be a list"))?;
    let mut messages: Vec<Value> = Vec::new();
    let mut system = String::new();
    if let Some(top) = request.get("system").filter(|s| !s.is_null())
        && let Some(text) = system_text(top)?
    {
        system.push_str(&text);
    }
    let role_of = |m: &Value| text_of(m.get("role")).map(str::to_owned);
    if merge_inline_system {
        for message in input
            .iter()
            .filter(|m| role_of(m).as_deref() == Some("system"))
        {
            if let Some(text) = system_text(message.get("content").unwrap_or(&Value::Null))? {
                system.push_str(&text);
            }
        }
    }
    if !system.is_empty() {
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    for message in input {
        let role = role_of(message).ok_or_else(|| invalid("a message needs a role"))?;
        let content = message.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            if !merge_inline_system && let Some(text) = system_text(content)? {
                messages.push(serde_json::json!({"role": "system", "content": text}));
            }
            continue;
        }
        let mut converted = Map::new();
        converted.insert("role".to_owned(), Value::from(role.as_str()));
        match content {
            Value::String(text) => {
                converted.insert("content".to_owned(), text.as_str().into());
            }
            Value::Array(blocks) => content_blocks(blocks, &role, &mut converted, &mut messages)?,
            _ => return Err(invalid("content must be a string or a list of blocks")),
        }
        // A user message of tool results alone became tool messages.
        if role != "user" || converted.contains_key("content") {
            messages.push(Value::Object(converted));
        }
    }
    let mut reasoning_effort = request
        .get("output_config")
        .and_then(|c| text_of(c.get("effort")))
        .map(str::to_owned);
    if let Some(thinking) = request.get("thinking").filter(|t| !t.is_null())
        && text_of(thinking.get("type")) == Some("disabled")
    {
        reasoning_effort = Some("none".to_owned());
    }
    Ok(ConvertedChat {
        messages: Value::Array(messages),
        options: ChatOptions {
            tools: anthropic_tools(request.get("tools"))?.map(std::sync::Arc::new),
            reasoning_effort,
            chat_template_kwargs: object_kwargs(request)?,
            ..ChatOptions::default()
        },
    })
}

fn content_blocks(
    blocks: &[Value],
    role: &str,
    converted: &mut Map<String, Value>,
    messages: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    let mut reasoning = String::new();
    let mut has_reasoning = false;
    for block in blocks {
        let block = block
            .as_object()
            .ok_or_else(|| invalid("a content block must be an object"))?;
        match text_of(block.get("type")) {
            Some("text") => {
                if let Some(text) = text_of(block.get("text")).filter(|t| !t.is_empty()) {
                    parts.push(serde_json::json!({"type": "text", "text": text}));
                }
            }
            Some("thinking") => {
                if let Some(thinking) = text_of(block.get("thinking")) {
                    reasoning.push_str(thinking);
                    has_reasoning = true;
                }
            }
            Some("redacted_thinking" | "tool_reference") => {}
            Some("tool_use") => {
                // vLLM invents an id from the clock when there is none: no stable prompt.
                let id = text_of(block.get("id"))
                    .filter(|id| !id.is_empty())
                    .ok_or_else(|| invalid("a tool_use block without an id"))?;
                let input = match block.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(input) => input.clone(),
                };
                tool_calls.push(serde_json::json!({
                    "id": id,
                    "type": "function",
                    "function": {
                        "name": text_of(block.get("name")).unwrap_or(""),
                        "arguments": input.to_string(),
                    },
                }));
            }
            Some("tool_result") if role == "user" => {
                let text = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(text)) => text.clone(),
                    Some(Value::Array(items)) => {
                        let mut texts = Vec::new();
                        for item in items.iter().filter_map(Value::as_object) {
                            match text_of(item.get("type")) {
                                Some("text") => texts.push(text_of(item.get("text")).unwrap_or("")),
                                Some("image") => {
                                    return Err(TokenizeError::MultiModal {
                                        kind: "image".to_owned(),
                                    });
                                }
                                Some("tool_reference") => {
                                    return Err(invalid(
                                        "tool references in tool results are not supported",
                                    ));
                                }
                                _ => {}
                            }
                        }
                        texts.join("\n")
                    }
                    Some(_) => {
                        return Err(invalid("a tool_result's content must be text or blocks"));
                    }
                };
                messages.push(serde_json::json!({
                    "role": "tool",
                    "tool_call_id": text_of(block.get("tool_use_id")).unwrap_or(""),
                    "content": text,
                }));
            }
            Some("tool_result") => match block.get("content") {
                // vLLM prints Python's str() of the content: only a string prints the same here.
                None | Some(Value::Null) => {
                    parts.push(serde_json::json!({"type": "text", "text": "Tool result: "}))
                }
                Some(Value::String(text)) => parts.push(serde_json::json!({
                    "type": "text",
                    "text": format!("Tool result: {text}"),
                })),
                Some(_) => return Err(invalid("an assistant tool_result with block content")),
            },
            // Only the engine's processor places an image's tokens.
            Some("image") => {
                return Err(TokenizeError::MultiModal {
                    kind: "image".to_owned(),
                });
            }
            Some(other) => {
                return Err(invalid(format!("unsupported content block type {other}")));
            }
            None => return Err(invalid("a content block needs a type")),
        }
    }
    if has_reasoning {
        converted.insert("reasoning".to_owned(), reasoning.into());
    }
    if !tool_calls.is_empty() {
        converted.insert("tool_calls".to_owned(), Value::Array(tool_calls));
    }
    if parts.len() == 1
        && let Some(text) = parts[0].get("text")
    {
        converted.insert("content".to_owned(), text.clone());
    } else if !parts.is_empty() {
        converted.insert("content".to_owned(), Value::Array(parts));
    }
    Ok(())
}

/// Anthropic tools (`name`, `description`, `input_schema`) as chat tools.
fn anthropic_tools(tools: Option<&Value>) -> Result<Option<Value>, TokenizeError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| TokenizeError::InvalidTools {
            reason: "tools must be a list".to_owned(),
        })?;
    let converted = tools
        .iter()
        .map(|tool| {
            let field = |key: &str| tool.get(key).cloned().unwrap_or(Value::Null);
            serde_json::json!({
                "type": "function",
                "function": {
                    "name": field("name"),
                    "description": field("description"),
                    "parameters": field("input_schema"),
                    "strict": field("strict"),
                    "defer_loading": field("defer_loading"),
                },
            })
        })
        .collect();
    Ok(Some(Value::Array(converted)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn responses_items_fold_as_vllm_folds_them() {
        // The expected conversation is what vLLM 0.32's construct_input_messages returned for
        // this input (run in its venv).
        let request = object(json!({
            "model": "m", "instructions": "be nice",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
                 "content": [{"type": "output_text", "text": "ans", "annotations": []}]},
                {"type": "reasoning", "id": "r1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"x\": 1}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "out"},
            ],
            "tools": [{"type": "function", "name": "f", "description": "d",
                       "parameters": {"type": "object"}}, {"type": "web_search"}],
            "reasoning": {"effort": "low"},
        }));
        let chat = responses_to_chat(&request).unwrap();
        assert_eq!(
            chat.messages,
            json!([
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ans", "reasoning": "think", "tool_calls": [
                    {"id": "c1", "function": {"name": "f", "arguments": "{\"x\": 1}"}, "type": "function"},
                    {"id": "c2", "function": {"name": "g", "arguments": "{}"}, "type": "function"}]},
                {"role": "tool", "content": "out", "tool_call_id": "c1"},
            ])
        );
        assert_eq!(
            chat.options.tools.as_deref(),
            Some(
                &json!([{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}}}])
            )
        );
        assert_eq!(chat.options.reasoning_effort.as_deref(), Some("low"));
        assert!(chat.options.add_generation_prompt && !chat.options.continue_final_message);
    }

    #[test]
    fn responses_string_input_partial_message_and_refusals() {
        let chat = responses_to_chat(&object(json!({"input": "q"}))).unwrap();
        assert_eq!(chat.messages, json!([{"role": "user", "content": "q"}]));
        let partial = object(json!({"input": [
            {"role": "user", "content": "q"},
            {"type": "message", "role": "assistant", "id": "m", "status": "incomplete",
             "content": [{"type": "output_text", "text": "part", "annotations": []}]}]}));
        let chat = responses_to_chat(&partial).unwrap();
        assert!(chat.options.continue_final_message && !chat.options.add_generation_prompt);
        assert!(
            responses_to_chat(&object(json!({"input": "q", "previous_response_id": "r"}))).is_err()
        );
        assert!(
            responses_to_chat(&object(
                json!({"input": [{"type": "item_reference", "id": "x"}]})
            ))
            .is_err()
        );
        assert!(responses_to_chat(&object(json!({"input": 3}))).is_err());
    }

    #[test]
    fn anthropic_messages_convert_as_vllm_converts_them() {
        let request = object(json!({
            "model": "m", "max_tokens": 5,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                       {"type": "text", "text": "x-anthropic-billing-header: 1"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q1"}, {"type": "text", "text": "q2"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": 2}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
                    {"type": "text", "text": "next"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "only"}]},
            ],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "thinking": {"type": "disabled"},
        }));
        let chat = messages_to_chat(&request, false).unwrap();
        assert_eq!(
            chat.messages,
            json!([
                {"role": "system", "content": "ab"},
                {"role": "user", "content": [{"type": "text", "text": "q1"}, {"type": "text", "text": "q2"}]},
                {"role": "assistant", "reasoning": "hmm", "tool_calls": [{"id": "t1", "type": "function",
                    "function": {"name": "f", "arguments": "{\"b\":1,\"a\":2}"}}], "content": "calling"},
                {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
                {"role": "user", "content": "next"},
                {"role": "tool", "tool_call_id": "t2", "content": "only"},
            ])
        );
        assert_eq!(chat.options.reasoning_effort.as_deref(), Some("none"));
        assert_eq!(
            chat.options.tools.as_deref(),
            Some(
                &json!([{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}, "strict": null, "defer_loading": null}}])
            )
        );
    }

    #[test]
    fn templates_that_need_system_first_merge_inline_system_messages() {
        let template = |source: &str| {
            crate::ChatTemplate::new(source.to_owned(), crate::chat::SpecialTokens::default())
                .unwrap()
        };
        let lenient = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
        assert!(!template(lenient).merges_inline_system());
        // Qwen-style guard: a system message after the first raises.
        let guarded = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
            {{ raise_exception('System message must be first') }}{% endif %}{{ m.content }}{% endfor %}";
        assert!(template(guarded).merges_inline_system());
        // vLLM probes in a bare Jinja sandbox: transformers' helpers are missing there.
        let clock = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}";
        assert!(template(clock).merges_inline_system());
        // Python string methods are Jinja2's own.
        let methods = "{% for m in messages %}{{ m.content.strip() }}{% endfor %}";
        assert!(!template(methods).merges_inline_system());
    }

    #[test]
    fn anthropic_inline_system_kept_or_merged() {
        let request = object(json!({"system": "s", "messages": [
            {"role": "user", "content": "a"},
            {"role": "system", "content": "t"},
            {"role": "user", "content": "b"}]}));
        let kept = messages_to_chat(&request, false).unwrap();
        assert_eq!(kept.messages[2], json!({"role": "system", "content": "t"}));
        let merged = messages_to_chat(&request, true).unwrap();
        assert_eq!(
            merged.messages[0],
            json!({"role": "system", "content": "st"})
        );
        assert_eq!(merged.messages.as_array().map(Vec::len), Some(3));
        let no_id = object(json!({"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "name": "f", "input": {}}]}]}));
        assert!(messages_to_chat(&no_id, false).is_err());
        let image = object(json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}));
        assert!(matches!(
            messages_to_chat(&image, false),
            Err(TokenizeError::MultiModal { .. })
        ));
    }
}
