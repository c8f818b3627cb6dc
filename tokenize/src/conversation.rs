//! vLLM's conversation preparation: OpenAI `messages` and `tools` → what the template sees.
//!
//! Mirrors vLLM 0.32 for text-only models: the request's pydantic validation
//! (`ChatCompletionRequest`: `reasoning_content` renamed to `reasoning`, tool-call entries
//! reordered as their TypedDict declares them), `_parse_chat_message_content` (only the fields
//! it keeps, content as a string or a parts list by the template's [`ContentFormat`]),
//! `_postprocess_messages` (tool-call `arguments` strings parsed into objects, `{}` when empty,
//! invalid or not an object; empty `tool_calls` dropped), `developer` → `system` (merged) for
//! templates that do not name the role, and the canonical tool model
//! (`ChatCompletionToolsParam.model_dump()`).
//!
//! Everything vLLM answers with 400 is an [`TokenizeError::InvalidMessages`] here, and so is
//! multimodal content (kvroute routes text only; such requests fall back).

use serde_json::{Map, Value};

use crate::TokenizeError;
use crate::content_format::ContentFormat;

/// Content-part fields vLLM knows (`_KNOWN_CONTENT_PART_FIELDS`); any other key of a text part
/// is kept on the part in the "openai" format.
const KNOWN_CONTENT_PART_FIELDS: [&str; 18] = [
    "audio_embeds",
    "audio_url",
    "closed",
    "data",
    "file",
    "image_embeds",
    "image_pil",
    "image_url",
    "input_audio",
    "name",
    "prompt_cache_breakpoint",
    "refusal",
    "text",
    "thinking",
    "type",
    "uuid",
    "video_embeds",
    "video_url",
];

/// Part types read as text, with the key that holds the text.
const TEXT_PART_TYPES: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// Part types and keys that carry media (vLLM's other `MM_PARSER_MAP` entries).
const MEDIA_PARTS: [&str; 10] = [
    "image_url",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// Claude Code's per-request attribution line, which vLLM drops from system text.
const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";

fn invalid(reason: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidMessages {
        reason: reason.into(),
    }
}

/// A content part after parsing: text, or a tool reference.
enum Part {
    Text {
        text: String,
        extra: Map<String, Value>,
    },
    ToolReference(Value),
}

/// The conversation the template renders, from the request's `messages`.
pub(crate) fn prepare(
    messages: &Value,
    format: ContentFormat,
    template_names_developer: bool,
    validated: bool,
) -> Result<Vec<Value>, TokenizeError> {
    let list = messages
        .as_array()
        .ok_or_else(|| invalid("messages must be an array"))?;
    let mut conversation = list
        .iter()
        .map(|message| prepare_message(message, format, validated))
        .collect::<Result<Vec<_>, _>>()?;
    let has_developer = conversation
        .iter()
        .any(|m| m.get("role").and_then(Value::as_str) == Some("developer"));
    if has_developer && !template_names_developer {
        for message in &mut conversation {
            if message.get("role").and_then(Value::as_str) == Some("developer") {
                message.insert("role".to_owned(), Value::from("system"));
                message.shift_remove("tools");
            }
        }
        conversation = consolidate_system_messages(conversation);
    }
    Ok(conversation.into_iter().map(Value::Object).collect())
}

fn prepare_message(
    message: &Value,
    format: ContentFormat,
    validated: bool,
) -> Result<Map<String, Value>, TokenizeError> {
    let message = message
        .as_object()
        .ok_or_else(|| invalid("a message must be an object"))?;
    let role = message
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("a message needs a string role"))?;
    let parts: Vec<Value> = match message.get("content") {
        // The request model allows a null content on assistant messages only.
        Some(Value::Null) if role != "assistant" => {
            return Err(invalid("content may be null only on assistant messages"));
        }
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(text)) => vec![serde_json::json!({"type": "text", "text": text})],
        Some(Value::Array(parts)) => parts.clone(),
        Some(_) => return Err(invalid("content must be a string or a list of parts")),
    };
    let parts = if role == "system" {
        strip_billing_header(parts)
    } else {
        parts
    };
    let mut parsed = Vec::with_capacity(parts.len());
    for part in &parts {
        if let Some(part) = parse_part(part)? {
            parsed.push(part);
        }
    }
    let content = match format {
        ContentFormat::OpenAi => Value::Array(
            parsed
                .into_iter()
                .map(|part| match part {
                    Part::Text { text, extra } => {
                        let mut out = Map::new();
                        out.insert("type".to_owned(), Value::from("text"));
                        out.insert("text".to_owned(), Value::from(text));
                        out.extend(extra);
                        Value::Object(out)
                    }
                    Part::ToolReference(name) => {
                        serde_json::json!({"type": "tool_reference", "name": name})
                    }
                })
                .collect(),
        ),
        ContentFormat::String => {
            let mut texts = Vec::with_capacity(parsed.len());
            for part in parsed {
                // vLLM keeps a parsed part only if it is truthy: empty texts vanish here (in
                // the "openai" format the part is a non-empty dict and stays).
                match part {
                    Part::Text { text, .. } if text.is_empty() => {}
                    Part::ToolReference(Value::String(name)) if name.is_empty() => {}
                    Part::Text { text, .. } => texts.push(text),
                    Part::ToolReference(Value::String(name)) => texts.push(name),
                    // vLLM's "\n".join fails on a missing name (a 500 there).
                    Part::ToolReference(_) => return Err(invalid("tool_reference needs a name")),
                }
            }
            Value::from(texts.join("\n"))
        }
    };
    let mut out = Map::new();
    out.insert("role".to_owned(), Value::from(role));
    out.insert("content".to_owned(), content);
    match role {
        "assistant" => {
            // An empty list is dropped (`_postprocess_messages`), so templates take the plain path.
            if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
                let calls = tool_calls(calls, validated)?;
                if calls.as_array().is_some_and(|c| !c.is_empty()) {
                    out.insert("tool_calls".to_owned(), calls);
                }
            }
            // ChatCompletionRequest renames `reasoning_content` to `reasoning` when unset.
            let reasoning = message
                .get("reasoning")
                .filter(|r| !r.is_null())
                .or_else(|| message.get("reasoning_content").filter(|r| !r.is_null()));
            if let Some(reasoning) = reasoning {
                out.insert("reasoning".to_owned(), reasoning.clone());
                out.insert("reasoning_content".to_owned(), reasoning.clone());
            }
        }
        "tool" => {
            if let Some(id) = message.get("tool_call_id") {
                out.insert("tool_call_id".to_owned(), id.clone());
            }
            // Tool results sent as text parts become one string, whatever the format.
            if let Some(Value::Array(items)) = out.get("content") {
                let all_text = items
                    .iter()
                    .all(|item| item.get("type").and_then(Value::as_str) == Some("text"));
                if all_text {
                    let texts: Vec<&str> = items
                        .iter()
                        .map(|item| item.get("text").and_then(Value::as_str).unwrap_or(""))
                        .collect();
                    let joined = Value::from(texts.join("\n"));
                    out.insert("content".to_owned(), joined);
                }
            }
        }
        _ => {}
    }
    if let Some(name) = message.get("name").filter(|n| n.is_string()) {
        out.insert("name".to_owned(), name.clone());
    }
    if let Some(task) = message.get("task").filter(|t| t.is_string()) {
        out.insert("task".to_owned(), task.clone());
    }
    if role == "developer" {
        let tools = message.get("tools").cloned().unwrap_or(Value::Null);
        out.insert("tools".to_owned(), tools);
    }
    Ok(out)
}

/// vLLM's `_parse_chat_message_content_part` for text-only content.
fn parse_part(part: &Value) -> Result<Option<Part>, TokenizeError> {
    let part = match part {
        Value::String(text) => {
            return Ok(Some(Part::Text {
                text: text.clone(),
                extra: Map::new(),
            }));
        }
        Value::Object(part) => part,
        _ => return Err(invalid("a content part must be a string or an object")),
    };
    let has_uuid = part.get("uuid").is_some_and(|u| !u.is_null());
    let part_type = match part.get("type") {
        Some(Value::String(t)) if !has_uuid => t.as_str(),
        None | Some(Value::Null) => {
            if MEDIA_PARTS.iter().any(|k| part.contains_key(*k)) {
                return Err(invalid("multimodal content is not supported"));
            }
            if part.contains_key("tool_reference") {
                return Ok(Some(Part::ToolReference(
                    part.get("name").cloned().unwrap_or(Value::Null),
                )));
            }
            return Err(invalid("missing 'type' field in a content part"));
        }
        Some(Value::String(_)) => return Err(invalid("multimodal content is not supported")),
        Some(_) => return Err(invalid("invalid 'type' field in a content part")),
    };
    if let Some((_, key)) = TEXT_PART_TYPES.iter().find(|(t, _)| *t == part_type) {
        let text = match part.get(*key) {
            None | Some(Value::Null) if matches!(part_type, "text" | "refusal") => {
                return Ok(None);
            }
            Some(Value::String(text)) => text.clone(),
            _ => return Err(invalid("a text part needs its text")),
        };
        let extra = part
            .iter()
            .filter(|(k, _)| !KNOWN_CONTENT_PART_FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        return Ok(Some(Part::Text { text, extra }));
    }
    if part_type == "tool_reference" {
        return Ok(Some(Part::ToolReference(
            part.get("name").cloned().unwrap_or(Value::Null),
        )));
    }
    if MEDIA_PARTS.contains(&part_type) {
        return Err(invalid("multimodal content is not supported"));
    }
    Err(invalid("unsupported content part type"))
}

/// Drops Claude Code's attribution line from system text parts, as vLLM does.
fn strip_billing_header(parts: Vec<Value>) -> Vec<Value> {
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        let text = match &part {
            Value::String(text) => Some(text.as_str()),
            Value::Object(p) if p.get("type").and_then(Value::as_str) == Some("text") => {
                p.get("text").and_then(Value::as_str)
            }
            _ => None,
        };
        let Some(text) = text.filter(|t| t.starts_with(CLAUDE_CODE_BILLING_HEADER)) else {
            out.push(part);
            continue;
        };
        let rest = text
            .split_once('\n')
            .map_or("", |(_, rest)| rest)
            .to_owned();
        if rest.is_empty() {
            continue;
        }
        out.push(match part {
            Value::Object(mut p) => {
                p.insert("text".to_owned(), Value::from(rest));
                Value::Object(p)
            }
            _ => Value::from(rest),
        });
    }
    out
}

/// Assistant tool calls as vLLM validates and post-processes them: each entry needs an `id`,
/// `type: "function"` and a `function` with `name` and `arguments`; keys in the TypedDicts'
/// order (`id`, `function`, `type`, then any others; `arguments`, `name`, then others);
/// `arguments` parsed into an object (`{}` when empty, invalid or not an object). Calls vLLM
/// built itself and never validated (`validated` false: the Responses API's) keep `name` before
/// `arguments`, the order it builds them in.
fn tool_calls(calls: &Value, validated: bool) -> Result<Value, TokenizeError> {
    let calls = calls
        .as_array()
        .ok_or_else(|| invalid("tool_calls must be a list"))?;
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let call = call
            .as_object()
            .ok_or_else(|| invalid("assistant tool_calls entries must be objects"))?;
        let id = call
            .get("id")
            .filter(|v| v.is_string())
            .ok_or_else(|| invalid("a tool call needs a string id"))?;
        if call.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid("only tool calls of type 'function' are supported"));
        }
        let function = call
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("a tool call needs a function"))?;
        let name = function
            .get("name")
            .filter(|v| v.is_string())
            .ok_or_else(|| invalid("a tool call's function needs a string name"))?;
        let arguments = function
            .get("arguments")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("a tool call's function needs string arguments"))?;
        let parsed = match serde_json::from_str::<Value>(arguments) {
            Ok(Value::Object(map)) if !arguments.is_empty() => Value::Object(map),
            _ => Value::Object(Map::new()),
        };
        let mut f = Map::new();
        if validated {
            f.insert("arguments".to_owned(), parsed);
            f.insert("name".to_owned(), name.clone());
        } else {
            f.insert("name".to_owned(), name.clone());
            f.insert("arguments".to_owned(), parsed);
        }
        for (k, v) in function {
            if k != "arguments" && k != "name" {
                f.insert(k.clone(), v.clone());
            }
        }
        let mut entry = Map::new();
        entry.insert("id".to_owned(), id.clone());
        entry.insert("function".to_owned(), Value::Object(f));
        entry.insert("type".to_owned(), Value::from("function"));
        for (k, v) in call {
            if !matches!(k.as_str(), "id" | "function" | "type") {
                entry.insert(k.clone(), v.clone());
            }
        }
        out.push(Value::Object(entry));
    }
    Ok(Value::Array(out))
}

/// vLLM's `_consolidate_system_messages`: all system messages merged (text joined with
/// `"\n\n"`, empty ones dropped) into one at the front, when there is one not at the front or
/// more than one.
fn consolidate_system_messages(conversation: Vec<Map<String, Value>>) -> Vec<Map<String, Value>> {
    let mut system = Vec::new();
    let mut others = Vec::new();
    let mut needed = false;
    for (i, message) in conversation.iter().enumerate() {
        if message.get("role").and_then(Value::as_str) != Some("system") {
            others.push(message.clone());
            continue;
        }
        if i > 0 || !system.is_empty() {
            needed = true;
        }
        let text = match message.get("content") {
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|part| match part {
                    Value::Object(p) => p.get("text").map(|t| match t {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    }),
                    Value::String(s) => Some(s.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        if !text.is_empty() {
            system.push(text);
        }
    }
    if !needed {
        return conversation;
    }
    let mut merged = Map::new();
    merged.insert("role".to_owned(), Value::from("system"));
    merged.insert("content".to_owned(), Value::from(system.join("\n\n")));
    std::iter::once(merged).chain(others).collect()
}

/// `tools` as vLLM hands them to the template: `ChatCompletionToolsParam.model_dump()` of each
/// (`type`, `function: {name, description, parameters, [strict], [defer_loading]}`,
/// `[defer_loading]`; other keys dropped; `description`/`parameters` null when unset).
pub(crate) fn canonical_tools(tools: &Value) -> Result<Value, TokenizeError> {
    let bad = |reason: &str| TokenizeError::InvalidTools {
        reason: reason.to_owned(),
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| bad("tools must be a list"))?;
    if tools.is_empty() {
        return Err(bad("tools must not be an empty list"));
    }
    let optional = |map: &Map<String, Value>, key: &str, ok: fn(&Value) -> bool| match map.get(key)
    {
        None | Some(Value::Null) => Ok(None),
        Some(v) if ok(v) => Ok(Some(v.clone())),
        Some(_) => Err(TokenizeError::InvalidTools {
            reason: format!("invalid {key}"),
        }),
    };
    tools
        .iter()
        .map(|tool| {
            let tool = tool
                .as_object()
                .ok_or_else(|| bad("a tool must be an object"))?;
            match tool.get("type") {
                None => {}
                Some(Value::String(t)) if t == "function" => {}
                Some(_) => return Err(bad("only tools of type 'function' are supported")),
            }
            let function = tool
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("a tool needs a function"))?;
            let name = function
                .get("name")
                .filter(|n| n.is_string())
                .ok_or_else(|| bad("a tool's function needs a string name"))?;
            let description = optional(function, "description", Value::is_string)?;
            let parameters = optional(function, "parameters", Value::is_object)?;
            let strict = optional(function, "strict", Value::is_boolean)?;
            let tool_defer = optional(tool, "defer_loading", Value::is_boolean)?;
            let function_defer =
                optional(function, "defer_loading", Value::is_boolean)?.or(tool_defer.clone());
            let mut f = Map::new();
            f.insert("name".to_owned(), name.clone());
            f.insert("description".to_owned(), description.unwrap_or(Value::Null));
            f.insert("parameters".to_owned(), parameters.unwrap_or(Value::Null));
            if let Some(strict) = strict {
                f.insert("strict".to_owned(), strict);
            }
            if let Some(defer) = function_defer {
                f.insert("defer_loading".to_owned(), defer);
            }
            let mut out = Map::new();
            out.insert("type".to_owned(), Value::from("function"));
            out.insert("function".to_owned(), Value::Object(f));
            if let Some(defer) = tool_defer {
                out.insert("defer_loading".to_owned(), defer);
            }
            Ok(Value::Object(out))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}
