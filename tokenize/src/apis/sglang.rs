//! The Responses and Anthropic Messages requests as SGLang 0.5.23 turns them into a chat
//! request (`entrypoints/openai/serving_responses.py` `_make_request`,
//! `entrypoints/anthropic/serving.py` `_convert_to_chat_completion_request`), for a server
//! started without a reasoning parser. The chat request they build is then prepared as any chat
//! request in SGLang's dialect ([`crate::Dialect::Sglang`]), which is why the messages here are
//! the plain dicts SGLang builds, before its request model validates them.

use serde_json::{Map, Value, json};

use super::{invalid, object_kwargs, text_of};
use crate::{ChatOptions, ConvertedChat, Dialect, TokenizeError};

/// SGLang's label for a Responses `developer` message folded into `system`
/// (`responses_adapters.py` `label_developer_content`).
const DEVELOPER_BLOCK_LABEL: &str = "Developer instructions:";
/// The prefix of a reasoning blob SGLang itself encoded (`encode_reasoning_state`).
const REASONING_STATE_PREFIX: &str = "sglang-reasoning-v1.";
/// Responses tool types SGLang's request model accepts (`RESPONSE_TOOL_TYPES`).
const RESPONSE_TOOL_TYPES: [&str; 13] = [
    "function",
    "web_search",
    "web_search_preview",
    "code_interpreter",
    "file_search",
    "image_generation",
    "computer_use_preview",
    "local_shell",
    "shell",
    "mcp",
    "custom",
    "namespace",
    "tool_search",
];
/// Reasoning effort tiers of the Responses request model.
const EFFORT_TIERS: [&str; 8] = [
    "none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max",
];

fn bad_tools(reason: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidTools {
        reason: reason.into(),
    }
}

/// The chat conversation SGLang builds for a `/v1/responses` request body; `inline_system` is
/// [`crate::ChatTemplate::sglang_renders_inline_system`] for the engine's template.
pub fn responses_to_chat(
    request: &Map<String, Value>,
    inline_system: bool,
) -> Result<ConvertedChat, TokenizeError> {
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
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match request.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                let item = item
                    .as_object()
                    .ok_or_else(|| invalid("an input item must be an object"))?;
                if let Some(message) = response_item(item)? {
                    messages.push(message);
                }
            }
        }
        _ => return Err(invalid("input must be a string or a list of items")),
    }
    let mut messages = merge_consecutive_assistants(messages);
    if !inline_system {
        messages = leading_system(messages);
    }
    let tools = responses_tools(request.get("tools"))?;
    let tool_choice = responses_tool_choice(request.get("tool_choice"), request.get("tools"))?;
    let (reasoning_effort, none_requested) = match request.get("reasoning") {
        None | Some(Value::Null) => (None, false),
        Some(Value::Object(reasoning)) => {
            // The request model's default effort is "medium".
            let effort = match reasoning.get("effort") {
                None => Some("medium".to_owned()),
                Some(Value::Null) => None,
                Some(Value::String(tier)) if EFFORT_TIERS.contains(&tier.as_str()) => {
                    Some(tier.clone())
                }
                Some(_) => return Err(invalid("invalid reasoning effort")),
            };
            // Its validator reads the raw dict, with an alias.
            let raw = reasoning
                .get("effort")
                .filter(|e| !e.is_null() && e.as_str() != Some(""))
                .or_else(|| reasoning.get("reasoning_effort"));
            (effort, raw.and_then(Value::as_str) == Some("none"))
        }
        Some(_) => return Err(invalid("reasoning must be an object")),
    };
    let mut chat_template_kwargs = object_kwargs(request)?;
    if none_requested {
        // `normalize_reasoning_to_thinking`: both toggles off, an explicit kwarg winning.
        let mut kwargs = Map::new();
        kwargs.insert("thinking".to_owned(), false.into());
        kwargs.insert("enable_thinking".to_owned(), false.into());
        kwargs.extend(chat_template_kwargs.unwrap_or_default());
        chat_template_kwargs = Some(kwargs);
    }
    let has_tools = tools.is_some();
    Ok(ConvertedChat {
        messages: Value::Array(messages),
        options: ChatOptions {
            dialect: Dialect::Sglang,
            tools: tools.map(std::sync::Arc::new),
            tool_choice: Some(if has_tools {
                tool_choice
            } else {
                "none".into()
            }),
            reasoning_effort,
            chat_template_kwargs,
            ..ChatOptions::default()
        },
    })
}

/// One Responses input item as the chat message SGLang makes of it
/// (`_normalize_response_message_for_chat`; `None`: dropped).
fn response_item(item: &Map<String, Value>) -> Result<Option<Value>, TokenizeError> {
    let call_id = || {
        item.get("call_id")
            .filter(|v| is_truthy(v))
            .or_else(|| item.get("id"))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let tool_call = |name: Value, arguments: String| {
        json!({"role": "assistant", "tool_calls": [{
            "id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments},
        }]})
    };
    match text_of(item.get("type")) {
        Some("function_call") => {
            // Arguments that are not a JSON object become "{}".
            let arguments = match item.get("arguments") {
                Some(Value::String(raw)) => match serde_json::from_str::<Value>(raw) {
                    Ok(Value::Object(_)) => raw.clone(),
                    _ => "{}".to_owned(),
                },
                Some(object @ Value::Object(_)) => object.to_string(),
                _ => "{}".to_owned(),
            };
            let name = item.get("name").cloned().unwrap_or(Value::Null);
            Ok(Some(tool_call(name, arguments)))
        }
        Some("custom_tool_call") => {
            let input = match item.get("input") {
                Some(Value::String(text)) => text.as_str(),
                _ => "",
            };
            let name = item.get("name").cloned().unwrap_or(Value::Null);
            Ok(Some(tool_call(name, json!({"input": input}).to_string())))
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let content = match item.get("output") {
                None => Value::from(""),
                Some(Value::Array(parts)) => Value::from(
                    parts
                        .iter()
                        .filter_map(Value::as_object)
                        .filter_map(|p| text_of(p.get("text")))
                        .collect::<String>(),
                ),
                Some(output) => output.clone(),
            };
            let id = item.get("call_id").cloned().unwrap_or(Value::Null);
            Ok(Some(
                json!({"role": "tool", "tool_call_id": id, "content": content}),
            ))
        }
        Some("reasoning") => {
            let texts = |key: &str| -> Vec<&str> {
                item.get(key)
                    .and_then(Value::as_array)
                    .map(|parts| {
                        parts
                            .iter()
                            .filter_map(|p| text_of(p.get("text")))
                            .filter(|t| !t.is_empty())
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let mut parts = texts("summary");
            if parts.is_empty() {
                parts = texts("content");
            }
            if parts.is_empty() {
                // A blob SGLang encoded itself carries the trace; kvroute does not unpack it.
                if text_of(item.get("encrypted_content"))
                    .is_some_and(|blob| blob.starts_with(REASONING_STATE_PREFIX))
                {
                    return Err(invalid("SGLang's encoded reasoning state is not supported"));
                }
                return Ok(None);
            }
            Ok(Some(
                json!({"role": "assistant", "reasoning_content": parts.join("\n")}),
            ))
        }
        None | Some("message") => {
            let mut message: Map<String, Value> = item
                .iter()
                .filter(|(k, v)| !v.is_null() && !matches!(k.as_str(), "id" | "status" | "type"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if text_of(message.get("role")) == Some("developer") {
                message.insert("role".to_owned(), "system".into());
                if let Some(content) = message.get_mut("content") {
                    *content = label_developer(content);
                }
            }
            if let Some(Value::Array(parts)) = message.get_mut("content") {
                for part in parts.iter_mut() {
                    *part = content_part(part)?;
                }
            }
            Ok(Some(Value::Object(message)))
        }
        Some(other) => Err(invalid(format!(
            "unsupported Responses API input item type {other}"
        ))),
    }
}

/// Python truthiness of a JSON value.
fn is_truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A developer message's content with SGLang's label on its first text.
fn label_developer(content: &Value) -> Value {
    match content {
        Value::String(text) => Value::from(format!("{DEVELOPER_BLOCK_LABEL}\n{text}")),
        Value::Array(parts) => {
            let mut parts = parts.clone();
            let first_text = parts
                .iter()
                .position(|p| p.get("text").is_some_and(Value::is_string));
            match first_text {
                Some(at) => {
                    let text = text_of(parts[at].get("text")).unwrap_or_default();
                    let labelled = format!("{DEVELOPER_BLOCK_LABEL}\n{text}");
                    parts[at]["text"] = labelled.into();
                }
                None => parts.insert(
                    0,
                    json!({"type": "input_text", "text": DEVELOPER_BLOCK_LABEL}),
                ),
            }
            Value::Array(parts)
        }
        other => other.clone(),
    }
}

/// A Responses content part as a chat part (`_normalize_response_content_part_for_chat`).
fn content_part(part: &Value) -> Result<Value, TokenizeError> {
    match text_of(part.get("type")) {
        Some("input_text" | "output_text") => Ok(json!({
            "type": "text",
            "text": part.get("text").cloned().unwrap_or_else(|| "".into()),
        })),
        Some(kind @ ("input_image" | "image_url")) => Err(TokenizeError::MultiModal {
            kind: kind.to_owned(),
        }),
        _ => Ok(part.clone()),
    }
}

/// `_merge_consecutive_assistant_messages`: a run of assistant messages (same `phase`, or after
/// a reasoning-only one) becomes one: contents joined with a blank line (or as parts when either
/// is a list), tool calls concatenated, reasoning joined with a newline.
fn merge_consecutive_assistants(messages: Vec<Value>) -> Vec<Value> {
    let mut merged: Vec<Value> = Vec::with_capacity(messages.len());
    for message in messages {
        let joins = merged.last().is_some_and(|prev| {
            role_of(prev) == Some("assistant")
                && role_of(&message) == Some("assistant")
                && (prev.get("phase") == message.get("phase")
                    || prev.as_object().is_some_and(|p| {
                        p.len() == 2
                            && p.contains_key("role")
                            && p.contains_key("reasoning_content")
                    }))
        });
        let (true, Some(Value::Object(prev))) = (joins, merged.last_mut()) else {
            merged.push(message);
            continue;
        };
        if let Some(phase) = message.get("phase").filter(|p| !p.is_null()) {
            prev.insert("phase".to_owned(), phase.clone());
        }
        let new_content = message
            .get("content")
            .filter(|c| !c.is_null() && c.as_str() != Some(""));
        if let Some(new_content) = new_content {
            let combined = match prev.get("content") {
                None | Some(Value::Null) => new_content.clone(),
                Some(Value::String(p)) if p.is_empty() => new_content.clone(),
                Some(Value::String(p)) if new_content.is_string() => Value::from(format!(
                    "{p}\n\n{}",
                    new_content.as_str().unwrap_or_default()
                )),
                Some(previous) => {
                    let as_parts = |c: &Value| -> Vec<Value> {
                        match c {
                            Value::Array(parts) => parts.clone(),
                            Value::String(text) if !text.is_empty() => {
                                vec![json!({"type": "text", "text": text})]
                            }
                            _ => Vec::new(),
                        }
                    };
                    let mut parts = as_parts(previous);
                    parts.extend(as_parts(new_content));
                    Value::Array(parts)
                }
            };
            prev.insert("content".to_owned(), combined);
        }
        if let Some(Value::Array(calls)) = message.get("tool_calls").filter(|c| is_truthy(c)) {
            let mut all = match prev.get("tool_calls") {
                Some(Value::Array(previous)) => previous.clone(),
                _ => Vec::new(),
            };
            all.extend(calls.iter().cloned());
            prev.insert("tool_calls".to_owned(), Value::Array(all));
        }
        if let Some(reasoning) = text_of(message.get("reasoning_content")).filter(|r| !r.is_empty())
        {
            let joined = match text_of(prev.get("reasoning_content")).filter(|r| !r.is_empty()) {
                Some(previous) => format!("{previous}\n{reasoning}"),
                None => reasoning.to_owned(),
            };
            prev.insert("reasoning_content".to_owned(), joined.into());
        }
    }
    merged
}

fn role_of(message: &Value) -> Option<&str> {
    text_of(message.get("role"))
}

/// Every system message's text merged (a blank line between) into one at the front, for
/// templates that render no inline system message.
fn leading_system(messages: Vec<Value>) -> Vec<Value> {
    let mut chunks: Vec<String> = Vec::new();
    let mut others = Vec::with_capacity(messages.len());
    for message in messages {
        if role_of(&message) != Some("system") {
            others.push(message);
            continue;
        }
        match message.get("content") {
            Some(Value::String(text)) => chunks.push(text.clone()),
            Some(Value::Array(parts)) => chunks.extend(
                parts
                    .iter()
                    .filter_map(|p| text_of(p.get("text")))
                    .map(str::to_owned),
            ),
            _ => {}
        }
    }
    if chunks.is_empty() {
        return others;
    }
    std::iter::once(json!({"role": "system", "content": chunks.join("\n\n")}))
        .chain(others)
        .collect()
}

/// Responses tools as the chat tools SGLang builds (`_response_tools_to_chat_tools`): function
/// tools, and custom tools as a function of one string argument; `strict` defaults to false.
fn responses_tools(tools: Option<&Value>) -> Result<Option<Value>, TokenizeError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| bad_tools("tools must be a list"))?;
    let mut converted = Vec::new();
    for tool in tools {
        let tool = tool
            .as_object()
            .ok_or_else(|| bad_tools("a tool must be an object"))?;
        let kind = text_of(tool.get("type"))
            .filter(|t| RESPONSE_TOOL_TYPES.contains(t))
            .ok_or_else(|| bad_tools("unsupported tool type"))?;
        let name = match tool.get("name") {
            None | Some(Value::Null) => None,
            Some(Value::String(name)) => Some(name.as_str()),
            Some(_) => return Err(bad_tools("a tool's name must be a string")),
        };
        let description = match tool.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => Some(text.as_str()),
            Some(_) => return Err(bad_tools("a tool's description must be a string")),
        };
        let parameters = match tool.get("parameters") {
            None | Some(Value::Null) => Value::Null,
            Some(object @ Value::Object(_)) => object.clone(),
            Some(_) => return Err(bad_tools("a tool's parameters must be an object")),
        };
        let strict = match tool.get("strict") {
            None => false,
            Some(Value::Bool(strict)) => *strict,
            Some(_) => return Err(bad_tools("a tool's strict must be a boolean")),
        };
        let (description, parameters) = match (kind, name) {
            ("function", None) | ("function", Some("")) => {
                return Err(bad_tools("function tools must include a name"));
            }
            ("shell", _) => return Err(bad_tools("shell tools are not supported")),
            ("function", Some(_)) => (
                description.map(Value::from).unwrap_or(Value::Null),
                parameters,
            ),
            ("custom", Some(name)) if !name.is_empty() => (
                custom_tool_description(description, tool.get("format")),
                json!({"type": "object", "properties": {"input": {"type": "string",
                    "description": "The freeform text payload for this tool."}},
                    "required": ["input"], "additionalProperties": false}),
            ),
            _ => continue,
        };
        converted.push(json!({"type": "function", "function": {
            "name": name, "description": description, "parameters": parameters, "strict": strict,
        }}));
    }
    Ok((!converted.is_empty()).then_some(Value::Array(converted)))
}

/// `custom_tool_description`: the description and a grammar format's text, a blank line apart.
fn custom_tool_description(description: Option<&str>, format: Option<&Value>) -> Value {
    let mut parts: Vec<String> = description
        .filter(|d| !d.is_empty())
        .map(str::to_owned)
        .into_iter()
        .collect();
    if let Some(format) = format.filter(|f| text_of(f.get("type")) == Some("grammar")) {
        let syntax = text_of(format.get("syntax"))
            .filter(|s| !s.is_empty())
            .unwrap_or("lark");
        let definition = text_of(format.get("definition")).unwrap_or_default();
        parts.push(format!(
            "The payload must conform to this {syntax} grammar:\n{definition}"
        ));
    }
    if parts.is_empty() {
        Value::Null
    } else {
        Value::from(parts.join("\n\n"))
    }
}

/// The chat `tool_choice` of a Responses request (`effective_tool_choice`, nested for chat).
fn responses_tool_choice(
    choice: Option<&Value>,
    tools: Option<&Value>,
) -> Result<Value, TokenizeError> {
    let declared = |name: &str| {
        tools.and_then(Value::as_array).is_some_and(|tools| {
            tools.iter().any(|t| {
                matches!(text_of(t.get("type")), Some("function" | "custom"))
                    && text_of(t.get("name")) == Some(name)
            })
        })
    };
    match choice {
        None | Some(Value::Null) => Ok("auto".into()),
        Some(Value::String(choice)) if choice == "required" => {
            let forceable = tools.and_then(Value::as_array).is_some_and(|tools| {
                tools
                    .iter()
                    .any(|t| matches!(text_of(t.get("type")), Some("function" | "custom")))
            });
            if !forceable {
                return Err(bad_tools(
                    "tool_choice required needs a function or custom tool",
                ));
            }
            Ok("required".into())
        }
        Some(Value::String(choice)) if matches!(choice.as_str(), "auto" | "none") => {
            Ok(choice.as_str().into())
        }
        Some(Value::Object(choice)) => {
            let name = text_of(choice.get("name"))
                .filter(|n| !n.is_empty())
                .or_else(|| choice.get("function").and_then(|f| text_of(f.get("name"))));
            match (text_of(choice.get("type")), name) {
                (Some("function" | "custom"), Some(name)) if !name.is_empty() => {
                    if !declared(name) {
                        return Err(bad_tools(format!("tool {name} is not declared in tools")));
                    }
                    Ok(json!({"type": "function", "function": {"name": name}}))
                }
                _ => Ok("auto".into()),
            }
        }
        Some(_) => Err(bad_tools("invalid tool_choice")),
    }
}

/// The text of a search result block (`_text_from_search_result`).
fn search_result_text(item: &Map<String, Value>) -> String {
    let mut parts = Vec::new();
    if let Some(title) = text_of(item.get("title")).filter(|t| !t.is_empty()) {
        parts.push(format!("Title: {title}"));
    }
    match item.get("source") {
        Some(Value::Object(source)) => {
            if let Some(text) = text_of(source.get("url"))
                .filter(|t| !t.is_empty())
                .or_else(|| text_of(source.get("text")))
                .filter(|t| !t.is_empty())
            {
                parts.push(format!("Source: {text}"));
            }
        }
        Some(Value::String(source)) if !source.is_empty() => {
            parts.push(format!("Source: {source}"))
        }
        _ => {}
    }
    let content: Vec<&str> = match item.get("content") {
        Some(Value::String(text)) => vec![text.as_str()],
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter(|b| text_of(b.get("type")) == Some("text"))
            .filter_map(|b| text_of(b.get("text")))
            .filter(|t| !t.is_empty())
            .collect(),
        _ => Vec::new(),
    };
    if !content.is_empty() {
        parts.push(format!("Content: {}", content.join("\n")));
    }
    parts.join("\n")
}

/// The text of an Anthropic system message's content, stripped (`_extract_system_text`).
fn extract_system_text(content: &Value) -> Result<Option<String>, TokenizeError> {
    let python_strip = |t: &str| t.trim().to_owned();
    match content {
        Value::String(text) => Ok(Some(python_strip(text)).filter(|t| !t.is_empty())),
        Value::Array(blocks) => {
            let texts: Vec<String> = blocks
                .iter()
                .filter(|b| text_of(b.get("type")) == Some("text"))
                .map(|b| python_strip(text_of(b.get("text")).unwrap_or_default()))
                .filter(|t| !t.is_empty())
                .collect();
            Ok((!texts.is_empty()).then(|| texts.join("\n")))
        }
        _ => Err(invalid("content must be a string or a list of blocks")),
    }
}

/// A tool result's content as SGLang's tool messages (`_convert_tool_result_content`): runs of
/// tool references apart from the rest, a lone text as a string; and its text.
fn tool_result_content(content: Option<&Value>) -> Result<(Vec<Value>, String), TokenizeError> {
    let items = match content {
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) => return Ok((vec!["".into()], String::new())),
        Some(Value::String(text)) => return Ok((vec![text.as_str().into()], text.clone())),
        Some(_) => return Err(invalid("a tool_result's content must be text or blocks")),
    };
    let mut parts: Vec<Value> = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    for item in items.iter().filter_map(Value::as_object) {
        match text_of(item.get("type")) {
            Some("text") => {
                if let Some(text) = text_of(item.get("text")).filter(|t| !t.is_empty()) {
                    texts.push(text.to_owned());
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            // An image without a source is skipped; with one, only the engine places it.
            Some("image") if item.get("source").is_some_and(is_truthy) => {
                return Err(TokenizeError::MultiModal {
                    kind: "image".to_owned(),
                });
            }
            Some("tool_reference") => {
                let name = text_of(item.get("tool_name"))
                    .filter(|n| !n.is_empty())
                    .or_else(|| text_of(item.get("name")))
                    .filter(|n| !n.is_empty());
                if let Some(name) = name {
                    parts.push(json!({"type": "tool_reference", "name": name}));
                }
            }
            Some("search_result") => {
                let text = search_result_text(item);
                if !text.is_empty() {
                    parts.push(json!({"type": "text", "text": text}));
                    texts.push(text);
                }
            }
            _ => {}
        }
    }
    let is_reference = |p: &Value| text_of(p.get("type")) == Some("tool_reference");
    let mut groups: Vec<Vec<Value>> = Vec::new();
    for part in parts {
        match groups.last_mut() {
            Some(group)
                if group
                    .first()
                    .is_some_and(|g| is_reference(g) == is_reference(&part)) =>
            {
                group.push(part);
            }
            _ => groups.push(vec![part]),
        }
    }
    let mut contents: Vec<Value> = groups
        .into_iter()
        .map(|group| match group.as_slice() {
            [only] if text_of(only.get("type")) == Some("text") => {
                only.get("text").cloned().unwrap_or_else(|| "".into())
            }
            _ => Value::Array(group),
        })
        .collect();
    if contents.is_empty() {
        contents.push("".into());
    }
    Ok((contents, texts.join("\n")))
}

/// The chat conversation SGLang builds for a `/v1/messages` request body; `inline_system` is
/// [`crate::ChatTemplate::sglang_renders_inline_system`] for the engine's template (when it is
/// false, system messages merge into the leading one).
pub fn messages_to_chat(
    request: &Map<String, Value>,
    inline_system: bool,
) -> Result<ConvertedChat, TokenizeError> {
    let input = request
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("messages must be a list"))?;
    let mut system: Vec<String> = Vec::new();
    match request.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            if !text.trim().is_empty() {
                system.push(text.clone());
            }
        }
        Some(Value::Array(blocks)) => system.extend(
            blocks
                .iter()
                .filter(|b| text_of(b.get("type")) == Some("text"))
                .filter_map(|b| text_of(b.get("text")))
                .filter(|t| !t.is_empty())
                .map(str::to_owned),
        ),
        Some(_) => return Err(invalid("system must be a string or a list of blocks")),
    }
    let role_of = |m: &Value| text_of(m.get("role")).map(str::to_owned);
    if !inline_system {
        for message in input
            .iter()
            .filter(|m| role_of(m).as_deref() == Some("system"))
        {
            if let Some(text) = extract_system_text(message.get("content").unwrap_or(&Value::Null))?
            {
                system.push(text);
            }
        }
    }
    let mut messages: Vec<Value> = Vec::new();
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system.join("\n")}));
    }
    for message in input {
        let role = role_of(message).ok_or_else(|| invalid("a message needs a role"))?;
        if !matches!(role.as_str(), "user" | "assistant" | "system") {
            return Err(invalid(format!("unsupported role {role}")));
        }
        if role == "system" && !inline_system {
            continue;
        }
        let blocks = match message.get("content") {
            Some(Value::String(text)) => {
                messages.push(json!({"role": role, "content": text}));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => return Err(invalid("content must be a string or a list of blocks")),
        };
        message_blocks(&role, blocks, &mut messages)?;
    }
    let tools = anthropic_tools(request.get("tools"))?;
    let tool_choice = match request.get("tool_choice") {
        None | Some(Value::Null) => {
            if tools.is_some() {
                "auto".into()
            } else {
                "none".into()
            }
        }
        Some(choice) => match (text_of(choice.get("type")), tools.is_some()) {
            (Some("none"), _) => "none".into(),
            (Some("auto"), true) => "auto".into(),
            (Some("any"), true) => "required".into(),
            (Some("tool"), true) => {
                let name = text_of(choice.get("name")).unwrap_or_default();
                let declared = tools
                    .iter()
                    .flat_map(|t| t.as_array().into_iter().flatten())
                    .any(|t| t["function"]["name"].as_str() == Some(name));
                if !declared {
                    return Err(bad_tools(format!(
                        "tool_choice names undeclared tool {name}"
                    )));
                }
                json!({"type": "function", "function": {"name": name}})
            }
            (Some("auto"), false) => "none".into(),
            (Some("any" | "tool"), false) => {
                return Err(bad_tools("tool_choice any or tool needs a custom tool"));
            }
            _ => return Err(bad_tools("invalid tool_choice")),
        },
    };
    // Without a reasoning parser SGLang refuses to switch thinking on.
    if let Some(thinking) = request.get("thinking").filter(|t| !t.is_null())
        && text_of(thinking.get("type")) != Some("disabled")
    {
        return Err(invalid(
            "Anthropic thinking needs a reasoning parser on the SGLang server",
        ));
    }
    // `output_config.effort` is set on the chat request after it was validated: it reaches the
    // template as `reasoning_effort` without toggling `enable_thinking`, as a kwarg does.
    let effort = request
        .get("output_config")
        .and_then(|c| c.get("effort"))
        .and_then(Value::as_str)
        .map(|e| if e == "xhigh" { "max" } else { e });
    let chat_template_kwargs = effort.map(|effort| {
        let mut kwargs = Map::new();
        kwargs.insert("reasoning_effort".to_owned(), effort.into());
        kwargs
    });
    Ok(ConvertedChat {
        messages: Value::Array(messages),
        options: ChatOptions {
            dialect: Dialect::Sglang,
            tools: tools.map(std::sync::Arc::new),
            tool_choice: Some(tool_choice),
            chat_template_kwargs,
            ..ChatOptions::default()
        },
    })
}

/// One Anthropic message of content blocks as SGLang's chat messages.
fn message_blocks(
    role: &str,
    blocks: &[Value],
    messages: &mut Vec<Value>,
) -> Result<(), TokenizeError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut tool_calls: Vec<Value> = Vec::new();
    // Prior-turn thinking is dropped on a server without a reasoning parser.
    if role == "assistant"
        && blocks
            .iter()
            .any(|b| text_of(b.get("type")) == Some("redacted_thinking"))
    {
        return Err(invalid(
            "Anthropic redacted_thinking history is not supported",
        ));
    }
    let flush_user = |parts: &mut Vec<Value>, messages: &mut Vec<Value>| {
        match parts.as_slice() {
            [] => return,
            [only] if text_of(only.get("type")) == Some("text") => {
                messages.push(json!({"role": "user", "content": only["text"].clone()}));
            }
            _ => messages.push(json!({"role": "user", "content": parts.clone()})),
        }
        parts.clear();
    };
    for block in blocks {
        let block = block
            .as_object()
            .ok_or_else(|| invalid("a content block must be an object"))?;
        match text_of(block.get("type")) {
            Some("thinking" | "redacted_thinking") => {}
            Some("text") => {
                let text = text_of(block.get("text"))
                    .ok_or_else(|| invalid("a text block needs its text"))?;
                parts.push(json!({"type": "text", "text": text}));
            }
            Some("image") if block.get("source").is_some_and(is_truthy) => {
                return Err(TokenizeError::MultiModal {
                    kind: "image".to_owned(),
                });
            }
            // An image without a source is skipped, as SGLang skips it.
            Some("image") => {}
            Some("search_result") => {
                let text = search_result_text(block);
                if !text.is_empty() {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            Some("tool_use") => {
                // An empty id would get a random one: no prompt kvroute could predict.
                let id = text_of(block.get("id"))
                    .filter(|id| !id.is_empty())
                    .ok_or_else(|| invalid("a tool_use block needs an id"))?;
                let name = text_of(block.get("name")).unwrap_or_default();
                let input = match block.get("input") {
                    Some(Value::Object(input)) => Value::Object(input.clone()),
                    None | Some(Value::Null) => json!({}),
                    Some(_) => return Err(invalid("a tool_use input must be an object")),
                };
                tool_calls.push(json!({"id": id, "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}}));
            }
            Some("tool_result") => {
                let (contents, text) = tool_result_content(block.get("content"))?;
                let id = text_of(block.get("tool_use_id"))
                    .filter(|id| !id.is_empty())
                    .or_else(|| text_of(block.get("id")))
                    .unwrap_or_default();
                if role == "user" {
                    flush_user(&mut parts, messages);
                    for content in contents {
                        messages
                            .push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                    }
                } else {
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
            }
            Some("tool_reference") => {}
            _ => return Err(invalid("unsupported content block type")),
        }
    }
    let mut converted = Map::new();
    converted.insert("role".to_owned(), role.into());
    let has_calls = !tool_calls.is_empty();
    if has_calls {
        converted.insert("tool_calls".to_owned(), Value::Array(tool_calls));
    }
    match parts.as_slice() {
        [only] if text_of(only.get("type")) == Some("text") => {
            converted.insert("content".to_owned(), only["text"].clone());
        }
        [] if has_calls => {}
        [] if role == "user" => return Ok(()),
        [] => {
            converted.insert("content".to_owned(), "".into());
        }
        _ => {
            converted.insert("content".to_owned(), Value::Array(parts));
        }
    }
    messages.push(Value::Object(converted));
    Ok(())
}

/// Anthropic tools as SGLang's chat tools: custom tools (with `input_schema`, given a
/// `"type": "object"` when it has none) as functions, server tools left out.
fn anthropic_tools(tools: Option<&Value>) -> Result<Option<Value>, TokenizeError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| bad_tools("tools must be a list"))?;
    let server = |kind: &str| {
        ["web_search_", "computer_", "bash_", "text_editor_"]
            .iter()
            .any(|prefix| kind.starts_with(prefix))
    };
    let mut converted = Vec::new();
    for tool in tools {
        let tool = tool
            .as_object()
            .ok_or_else(|| bad_tools("a tool must be an object"))?;
        match text_of(tool.get("type")) {
            None | Some("" | "custom") => {}
            Some(kind) if server(kind) => continue,
            Some(_) => return Err(bad_tools("unsupported tool type")),
        }
        let name = text_of(tool.get("name")).ok_or_else(|| bad_tools("a tool needs a name"))?;
        let mut schema = match tool.get("input_schema") {
            Some(Value::Object(schema)) => schema.clone(),
            _ => return Err(bad_tools("input_schema must be a dictionary")),
        };
        if !schema.contains_key("type") {
            schema.insert("type".to_owned(), "object".into());
        }
        let strict = match tool.get("strict") {
            None => false,
            Some(Value::Bool(strict)) => *strict,
            Some(_) => return Err(bad_tools("strict must be a boolean")),
        };
        let defer = tool.get("defer_loading").cloned().unwrap_or(Value::Null);
        converted.push(
            json!({"type": "function", "defer_loading": defer, "function": {
                "name": name,
                "description": text_of(tool.get("description")).unwrap_or_default(),
                "parameters": schema,
                "strict": strict,
            }}),
        );
    }
    Ok((!converted.is_empty()).then_some(Value::Array(converted)))
}
