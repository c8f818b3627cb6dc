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

use minijinja::Value as J;
use minijinja::value::ValueKind;
use serde_json::{Map, Value};

use crate::TokenizeError;
use crate::content_format::ContentFormat;

/// Content-part fields vLLM knows (`_KNOWN_CONTENT_PART_FIELDS`); any other key of a text part
/// is kept on the part in the "openai" format.
pub(crate) const KNOWN_CONTENT_PART_FIELDS: [&str; 18] = [
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
pub(crate) const TEXT_PART_TYPES: [(&str, &str); 5] = [
    ("text", "text"),
    ("input_text", "text"),
    ("output_text", "text"),
    ("refusal", "refusal"),
    ("thinking", "thinking"),
];

/// Part types and keys that carry media (vLLM's other `MM_PARSER_MAP` entries).
pub(crate) const MEDIA_PARTS: [&str; 10] = [
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
pub(crate) const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";

fn invalid(reason: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidMessages {
        reason: reason.into(),
    }
}

/// A media content part of type `kind`: not tokenizable here.
fn multimodal(kind: &str) -> TokenizeError {
    TokenizeError::MultiModal {
        kind: kind.to_owned(),
    }
}

/// The kind of the first media content part of `messages` (a chat's array as sent), as vLLM's
/// part parser tells media from text: a part of a media type, a part without a type that holds
/// a media field, or any part with a `uuid`. `None` for text-only conversations (and for
/// anything that is not a list of messages: rendering refuses those).
pub fn media_part_kind(messages: &Value) -> Option<String> {
    let parts = messages
        .as_array()?
        .iter()
        .filter_map(|message| message.get("content")?.as_array())
        .flatten()
        .filter_map(Value::as_object);
    for part in parts {
        if part.get("uuid").is_some_and(|uuid| !uuid.is_null()) {
            return Some("media".to_owned());
        }
        match part.get("type") {
            Some(Value::String(kind)) if MEDIA_PARTS.contains(&kind.as_str()) => {
                return Some(kind.clone());
            }
            None | Some(Value::Null) => {
                if let Some(kind) = MEDIA_PARTS.iter().find(|k| part.contains_key(**k)) {
                    return Some((*kind).to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

/// A content part after parsing: text (borrowed from the request), or a tool reference.
enum Part<'a> {
    Text {
        text: &'a str,
        extra: Vec<(&'a str, &'a Value)>,
    },
    ToolReference(Option<&'a Value>),
}

/// One prepared message: its keys in the order vLLM's dict has them, values already the
/// template's (each string copied once, from the parsed request).
pub(crate) struct Message {
    pub(crate) entries: Vec<(&'static str, J)>,
}

impl Message {
    fn with_capacity(capacity: usize) -> Self {
        Self {
            entries: Vec::with_capacity(capacity),
        }
    }

    /// `{"role": "user", "content": text}`.
    pub(crate) fn user(text: String) -> Self {
        Self {
            entries: vec![("role", J::from("user")), ("content", J::from(text))],
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&J> {
        self.entries.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    pub(crate) fn get_mut(&mut self, key: &str) -> Option<&mut J> {
        self.entries
            .iter_mut()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }

    /// A dict's `d[key] = value`: an existing key keeps its place.
    fn set(&mut self, key: &'static str, value: J) {
        match self.get_mut(key) {
            Some(slot) => *slot = value,
            None => self.entries.push((key, value)),
        }
    }

    fn remove(&mut self, key: &str) {
        self.entries.retain(|(k, _)| *k != key);
    }

    fn role(&self) -> Option<&str> {
        self.get("role").and_then(J::as_str)
    }

    /// The dict the template sees (the map `Value::from_serialize` builds for a JSON object).
    pub(crate) fn into_value(self) -> J {
        J::from_iter(self.entries.into_iter().map(|(k, v)| (J::from(k), v)))
    }
}

/// A JSON value as the template sees it: what `Value::from_serialize` makes of it (numbers
/// as serde_json serializes them, objects as ordered maps, arrays as sequences), built
/// directly so no serializer runs and no intermediate tree is made.
pub(crate) fn jinja(value: &Value) -> J {
    match value {
        Value::Null => J::from(()),
        Value::Bool(b) => J::from(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => J::from(u),
            (None, Some(i)) => J::from(i),
            (None, None) => J::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => J::from(s.as_str()),
        Value::Array(items) => J::from_object(items.iter().map(jinja).collect::<Vec<J>>()),
        Value::Object(map) => jinja_map(map.iter().map(|(k, v)| (k.as_str(), v))),
    }
}

/// An ordered map of borrowed JSON values as the template sees it.
fn jinja_map<'a>(entries: impl Iterator<Item = (&'a str, &'a Value)>) -> J {
    J::from_iter(entries.map(|(k, v)| (J::from(k), jinja(v))))
}

/// The conversation the template renders, from the request's `messages`.
pub(crate) fn prepare(
    messages: &Value,
    format: ContentFormat,
    template_names_developer: bool,
    validated: bool,
) -> Result<Vec<Message>, TokenizeError> {
    let list = messages
        .as_array()
        .ok_or_else(|| invalid("messages must be an array"))?;
    let mut conversation = list
        .iter()
        .map(|message| prepare_message(message, format, validated))
        .collect::<Result<Vec<_>, _>>()?;
    let has_developer = conversation.iter().any(|m| m.role() == Some("developer"));
    if has_developer && !template_names_developer {
        for message in &mut conversation {
            if message.role() == Some("developer") {
                message.set("role", J::from("system"));
                message.remove("tools");
            }
        }
        conversation = consolidate_system_messages(conversation)?;
    }
    Ok(conversation)
}

fn prepare_message(
    message: &Value,
    format: ContentFormat,
    validated: bool,
) -> Result<Message, TokenizeError> {
    let message = message
        .as_object()
        .ok_or_else(|| invalid("a message must be an object"))?;
    let role = message
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("a message needs a string role"))?;
    // A string content is one text part (vLLM wraps it so).
    let parts: &[Value] = match message.get("content") {
        // The request model allows a null content on assistant messages only.
        Some(Value::Null) if role != "assistant" => {
            return Err(invalid("content may be null only on assistant messages"));
        }
        None | Some(Value::Null) => &[],
        Some(text @ Value::String(_)) => std::slice::from_ref(text),
        Some(Value::Array(parts)) => parts,
        Some(_) => return Err(invalid("content must be a string or a list of parts")),
    };
    let mut parsed = Vec::with_capacity(parts.len());
    for part in parts {
        // Claude Code's attribution line is dropped from system text before parsing.
        let text = match role {
            "system" => match strip_billing_header(part) {
                Stripped::Drop => continue,
                Stripped::Keep => None,
                Stripped::Text(rest) => Some(rest),
            },
            _ => None,
        };
        if let Some(part) = parse_part(part, text)? {
            parsed.push(part);
        }
    }
    let content = match format {
        // Tool results sent as text parts become one string, whatever the format.
        ContentFormat::OpenAi
            if role == "tool" && parsed.iter().all(|p| matches!(p, Part::Text { .. })) =>
        {
            let texts = parsed.iter().map(|part| match part {
                Part::Text { text, .. } => *text,
                Part::ToolReference(_) => "",
            });
            join_texts(texts, parsed.len())
        }
        ContentFormat::OpenAi => J::from_object(
            parsed
                .into_iter()
                .map(|part| match part {
                    Part::Text { text, extra } => J::from_iter(
                        [("type", J::from("text")), ("text", J::from(text))]
                            .into_iter()
                            .map(|(k, v)| (J::from(k), v))
                            .chain(extra.into_iter().map(|(k, v)| (J::from(k), jinja(v)))),
                    ),
                    Part::ToolReference(name) => J::from_iter([
                        (J::from("type"), J::from("tool_reference")),
                        (J::from("name"), name.map_or(J::from(()), jinja)),
                    ]),
                })
                .collect::<Vec<J>>(),
        ),
        ContentFormat::String => {
            let mut texts = Vec::with_capacity(parsed.len());
            for part in parsed {
                // vLLM keeps a parsed part only if it is truthy: empty texts vanish here (in
                // the "openai" format the part is a non-empty dict and stays).
                match part {
                    Part::Text { text: "", .. } => {}
                    Part::ToolReference(Some(Value::String(name))) if name.is_empty() => {}
                    Part::Text { text, .. } => texts.push(text),
                    Part::ToolReference(Some(Value::String(name))) => texts.push(name.as_str()),
                    // vLLM's "\n".join fails on a missing name (a 500 there).
                    Part::ToolReference(_) => return Err(invalid("tool_reference needs a name")),
                }
            }
            let count = texts.len();
            join_texts(texts.into_iter(), count)
        }
    };
    let mut out = Message::with_capacity(4);
    out.set("role", J::from(role));
    out.set("content", content);
    match role {
        "assistant" => {
            // An empty list is dropped (`_postprocess_messages`), so templates take the plain path.
            if let Some(calls) = message.get("tool_calls").filter(|c| !c.is_null()) {
                let calls = tool_calls(calls, validated)?;
                if !calls.is_empty() {
                    out.set("tool_calls", J::from_object(calls));
                }
            }
            // ChatCompletionRequest renames `reasoning_content` to `reasoning` when unset.
            let reasoning = message
                .get("reasoning")
                .filter(|r| !r.is_null())
                .or_else(|| message.get("reasoning_content").filter(|r| !r.is_null()));
            if let Some(reasoning) = reasoning {
                let value = jinja(reasoning);
                // Two converted copies of a dict or list (`is sameas` tells shared objects
                // apart); a string is shared, which no template can observe.
                let again = match reasoning {
                    Value::Array(_) | Value::Object(_) => jinja(reasoning),
                    _ => value.clone(),
                };
                out.set("reasoning", value);
                out.set("reasoning_content", again);
            }
        }
        "tool" => {
            if let Some(id) = message.get("tool_call_id") {
                out.set("tool_call_id", jinja(id));
            }
        }
        _ => {}
    }
    if let Some(name) = message.get("name").filter(|n| n.is_string()) {
        out.set("name", jinja(name));
    }
    if let Some(task) = message.get("task").filter(|t| t.is_string()) {
        out.set("task", jinja(task));
    }
    if role == "developer" {
        let tools = message.get("tools").map_or(J::from(()), jinja);
        out.set("tools", tools);
    }
    Ok(out)
}

/// `"\n".join(texts)` as one template string, without an intermediate copy for one text.
fn join_texts<'a>(mut texts: impl Iterator<Item = &'a str>, count: usize) -> J {
    match count {
        0 => J::from(""),
        1 => J::from(texts.next().unwrap_or_default()),
        _ => J::from(texts.collect::<Vec<_>>().join("\n")),
    }
}

/// vLLM's `_parse_chat_message_content_part` for text-only content; `text` replaces the
/// part's text (a system part whose billing line was dropped).
fn parse_part<'a>(
    part: &'a Value,
    text: Option<&'a str>,
) -> Result<Option<Part<'a>>, TokenizeError> {
    let part = match part {
        Value::String(own) => {
            return Ok(Some(Part::Text {
                text: text.unwrap_or(own),
                extra: Vec::new(),
            }));
        }
        Value::Object(part) => part,
        _ => return Err(invalid("a content part must be a string or an object")),
    };
    let has_uuid = part.get("uuid").is_some_and(|u| !u.is_null());
    let part_type = match part.get("type") {
        Some(Value::String(t)) if !has_uuid => t.as_str(),
        None | Some(Value::Null) => {
            if let Some(kind) = MEDIA_PARTS.iter().find(|k| part.contains_key(**k)) {
                return Err(multimodal(kind));
            }
            if part.contains_key("tool_reference") {
                return Ok(Some(Part::ToolReference(part.get("name"))));
            }
            return Err(invalid("missing 'type' field in a content part"));
        }
        Some(Value::String(_)) => return Err(multimodal("media")),
        Some(_) => return Err(invalid("invalid 'type' field in a content part")),
    };
    if let Some((_, key)) = TEXT_PART_TYPES.iter().find(|(t, _)| *t == part_type) {
        let own = match part.get(*key) {
            None | Some(Value::Null) if matches!(part_type, "text" | "refusal") => {
                return Ok(None);
            }
            Some(Value::String(own)) => own.as_str(),
            _ => return Err(invalid("a text part needs its text")),
        };
        // Only a "text" part's billing line is ever replaced (see `strip_billing_header`).
        let text = match part_type {
            "text" => text.unwrap_or(own),
            _ => own,
        };
        let extra = part
            .iter()
            .filter(|(k, _)| !KNOWN_CONTENT_PART_FIELDS.contains(&k.as_str()))
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        return Ok(Some(Part::Text { text, extra }));
    }
    if part_type == "tool_reference" {
        return Ok(Some(Part::ToolReference(part.get("name"))));
    }
    if MEDIA_PARTS.contains(&part_type) {
        return Err(multimodal(part_type));
    }
    Err(invalid("unsupported content part type"))
}

/// What dropping Claude Code's attribution line does to one system content part.
enum Stripped<'a> {
    /// No such line: the part as sent.
    Keep,
    /// The line was all of its text: the part is dropped.
    Drop,
    /// Its text after the line.
    Text(&'a str),
}

/// Drops Claude Code's attribution line from a system text part, as vLLM does: a string part
/// or a `type: "text"` part whose text starts with it keeps what follows its first newline.
fn strip_billing_header(part: &Value) -> Stripped<'_> {
    let text = match part {
        Value::String(text) => Some(text.as_str()),
        Value::Object(p) if p.get("type").and_then(Value::as_str) == Some("text") => {
            p.get("text").and_then(Value::as_str)
        }
        _ => None,
    };
    let Some(text) = text.filter(|t| t.starts_with(CLAUDE_CODE_BILLING_HEADER)) else {
        return Stripped::Keep;
    };
    match text.split_once('\n').map_or("", |(_, rest)| rest) {
        "" => Stripped::Drop,
        rest => Stripped::Text(rest),
    }
}

/// Assistant tool calls as vLLM validates and post-processes them: each entry needs an `id`,
/// `type: "function"` and a `function` with `name` and `arguments`; keys in the TypedDicts'
/// order (`id`, `function`, `type`, then any others; `arguments`, `name`, then others);
/// `arguments` parsed into an object (`{}` when empty, invalid or not an object). Calls vLLM
/// built itself and never validated (`validated` false: the Responses API's) keep `name` before
/// `arguments`, the order it builds them in.
fn tool_calls(calls: &Value, validated: bool) -> Result<Vec<J>, TokenizeError> {
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
            Ok(Value::Object(map)) if !arguments.is_empty() => {
                jinja_map(map.iter().map(|(k, v)| (k.as_str(), v)))
            }
            _ => jinja_map(std::iter::empty()),
        };
        let (first, second) = if validated {
            (("arguments", parsed), ("name", jinja(name)))
        } else {
            (("name", jinja(name)), ("arguments", parsed))
        };
        let f = J::from_iter(
            [first, second]
                .into_iter()
                .map(|(k, v)| (J::from(k), v))
                .chain(
                    function
                        .iter()
                        .filter(|(k, _)| *k != "arguments" && *k != "name")
                        .map(|(k, v)| (J::from(k.as_str()), jinja(v))),
                ),
        );
        let entry = J::from_iter(
            [
                ("id", jinja(id)),
                ("function", f),
                ("type", J::from("function")),
            ]
            .into_iter()
            .map(|(k, v)| (J::from(k), v))
            .chain(
                call.iter()
                    .filter(|(k, _)| !matches!(k.as_str(), "id" | "function" | "type"))
                    .map(|(k, v)| (J::from(k.as_str()), jinja(v))),
            ),
        );
        out.push(entry);
    }
    Ok(out)
}

/// vLLM's `_consolidate_system_messages`: all system messages merged (text joined with
/// `"\n\n"`, empty ones dropped) into one at the front, when there is one not at the front or
/// more than one.
fn consolidate_system_messages(conversation: Vec<Message>) -> Result<Vec<Message>, TokenizeError> {
    let mut system = Vec::new();
    let mut needed = false;
    for (i, message) in conversation.iter().enumerate() {
        if message.role() != Some("system") {
            continue;
        }
        if i > 0 || !system.is_empty() {
            needed = true;
        }
        let text = match message.get("content") {
            Some(content) if content.kind() == ValueKind::Seq => {
                let mut texts = Vec::new();
                for part in content.try_iter().map_err(|e| invalid(e.to_string()))? {
                    if let Some(text) = part_text(&part)? {
                        texts.push(text);
                    }
                }
                texts.join("\n")
            }
            Some(content) => content.as_str().unwrap_or_default().to_owned(),
            None => String::new(),
        };
        if !text.is_empty() {
            system.push(text);
        }
    }
    if !needed {
        return Ok(conversation);
    }
    let mut merged = Message::with_capacity(2);
    merged.set("role", J::from("system"));
    merged.set("content", J::from(system.join("\n\n")));
    Ok(std::iter::once(merged)
        .chain(
            conversation
                .into_iter()
                .filter(|m| m.role() != Some("system")),
        )
        .collect())
}

/// A prepared content part's `text` as vLLM's consolidation reads it (a string part is its
/// own text; a non-string text is printed as JSON).
fn part_text(part: &J) -> Result<Option<String>, TokenizeError> {
    if let Some(s) = part.as_str() {
        return Ok(Some(s.to_owned()));
    }
    if part.kind() != ValueKind::Map {
        return Ok(None);
    }
    let text = part
        .get_item(&J::from("text"))
        .map_err(|e| invalid(e.to_string()))?;
    if text.is_undefined() {
        return Ok(None);
    }
    match text.as_str() {
        Some(s) => Ok(Some(s.to_owned())),
        None => serde_json::to_string(&text)
            .map(Some)
            .map_err(|e| invalid(e.to_string())),
    }
}

/// A tool's optional field: absent or null is `None`; present, it must pass `ok`.
fn optional(
    map: &Map<String, Value>,
    key: &str,
    ok: fn(&Value) -> bool,
) -> Result<Option<Value>, TokenizeError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) if ok(v) => Ok(Some(v.clone())),
        Some(_) => Err(TokenizeError::InvalidTools {
            reason: format!("invalid {key}"),
        }),
    }
}

/// A tool object, its `function` object and the function's string `name`.
type ToolParts<'a> = (&'a Map<String, Value>, &'a Map<String, Value>, &'a Value);

/// A tool's parts as every engine's request model requires them.
fn tool_function(tool: &Value) -> Result<ToolParts<'_>, TokenizeError> {
    let bad = |reason: &str| TokenizeError::InvalidTools {
        reason: reason.to_owned(),
    };
    let tool = tool
        .as_object()
        .ok_or_else(|| bad("a tool must be an object"))?;
    let function = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("a tool needs a function"))?;
    let name = function
        .get("name")
        .filter(|n| n.is_string())
        .ok_or_else(|| bad("a tool's function needs a string name"))?;
    Ok((tool, function, name))
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
    tools
        .iter()
        .map(|tool| {
            let (tool, function, name) = tool_function(tool)?;
            match tool.get("type") {
                None => {}
                Some(Value::String(t)) if t == "function" => {}
                Some(_) => return Err(bad("only tools of type 'function' are supported")),
            }
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

/// The roles of SGLang's `ChatCompletionMessageGenericParam` (`protocol.py`); `user` messages
/// are its `ChatCompletionMessageUserParam`.
const SGLANG_GENERIC_ROLES: [&str; 7] = [
    "system",
    "assistant",
    "tool",
    "function",
    "developer",
    "latest_reminder",
    "root",
];

/// An optional string field of a message or part: `None` when absent or null.
fn optional_str<'a>(
    map: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a str>, TokenizeError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("{key} must be a string"))),
    }
}

/// A content part as SGLang's request model reads it (`ChatCompletionMessageContentPart`).
enum SglangPart<'a> {
    Text(&'a str),
    /// A `thinking`/`reasoning` part: validated, then never rendered (neither content format
    /// keeps it).
    Thinking,
    ToolReference(&'a str),
}

fn sglang_part<'a>(part: &'a Value, assistant: bool) -> Result<SglangPart<'a>, TokenizeError> {
    let part = part
        .as_object()
        .ok_or_else(|| invalid("a content part must be an object"))?;
    match part.get("type").and_then(Value::as_str) {
        Some("text") => match part.get("text") {
            Some(Value::String(text)) => Ok(SglangPart::Text(text)),
            _ => Err(invalid("a text part needs a string text")),
        },
        Some("thinking" | "reasoning") => {
            let thinking = optional_str(part, "thinking")?;
            let text = optional_str(part, "text")?;
            if thinking.is_some() == text.is_some() {
                return Err(invalid(
                    "thinking parts require exactly one of 'thinking' or 'text'",
                ));
            }
            if !assistant {
                return Err(invalid(
                    "thinking content parts are only valid in assistant messages",
                ));
            }
            Ok(SglangPart::Thinking)
        }
        Some("tool_reference") => match part.get("name") {
            Some(Value::String(name)) => Ok(SglangPart::ToolReference(name)),
            _ => Err(invalid("a tool_reference part needs a string name")),
        },
        Some(kind @ ("image_url" | "video_url" | "audio_url" | "input_audio")) => {
            Err(multimodal(kind))
        }
        _ => Err(invalid("unsupported content part type")),
    }
}

/// SGLang 0.5.23's conversation for a chat template (`serving_chat.py`
/// `_apply_jinja_template`): each message validated by its request model and dumped
/// (`model_dump`: a `user` message keeps only `role` and `content`; other roles keep
/// `tool_call_id`, `name`, `phase`, `reasoning_content`, `tool_calls`, `tools` and `prefix`, in
/// that order, when set; an assistant's `reasoning` is not a field and is dropped), history
/// tool-call arguments parsed into objects (a string that is not a JSON object is refused, as
/// SGLang answers 400), a null content made `""`, and a content list made what the template's
/// [`ContentFormat`] (SGLang's detection) wants: its text parts joined with a space ("string"),
/// or text and tool-reference parts kept ("openai", where a tool message of text parts alone is
/// joined with a space again). Roles are lowercased except `user`, which must be exact.
pub(crate) fn prepare_sglang(
    messages: &Value,
    format: ContentFormat,
) -> Result<Vec<Message>, TokenizeError> {
    messages
        .as_array()
        .ok_or_else(|| invalid("messages must be an array"))?
        .iter()
        .map(|message| prepare_sglang_message(message, format))
        .collect()
}

fn prepare_sglang_message(
    message: &Value,
    format: ContentFormat,
) -> Result<Message, TokenizeError> {
    let message = message
        .as_object()
        .ok_or_else(|| invalid("a message must be an object"))?;
    let sent = message
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("a message needs a string role"))?;
    let user = sent == "user";
    let role = if user {
        "user".to_owned()
    } else {
        let lower = sent.to_lowercase();
        if !SGLANG_GENERIC_ROLES.contains(&lower.as_str()) {
            return Err(invalid(format!("unsupported role {sent}")));
        }
        lower
    };
    let assistant = role == "assistant";
    let content = match message.get("content") {
        None | Some(Value::Null) if user => {
            return Err(invalid("a user message needs content"));
        }
        None | Some(Value::Null) => J::from(""),
        Some(Value::String(text)) => J::from(text.as_str()),
        Some(Value::Array(parts)) => {
            let parts = parts
                .iter()
                .map(|part| sglang_part(part, assistant))
                .collect::<Result<Vec<_>, _>>()?;
            sglang_content(&parts, format, role == "tool")
        }
        Some(_) => return Err(invalid("content must be a string or a list of parts")),
    };
    let mut out = Message::with_capacity(4);
    out.set("role", J::from(role.as_str()));
    out.set("content", content);
    if user {
        return Ok(out);
    }
    for key in ["tool_call_id", "name"] {
        if let Some(text) = optional_str(message, key)? {
            out.set(key, J::from(text));
        }
    }
    match optional_str(message, "phase")? {
        None => {}
        Some(phase @ ("commentary" | "final_answer")) => out.set("phase", J::from(phase)),
        Some(_) => return Err(invalid("phase must be commentary or final_answer")),
    }
    if let Some(reasoning) = optional_str(message, "reasoning_content")? {
        out.set("reasoning_content", J::from(reasoning));
    }
    match message.get("tool_calls") {
        None | Some(Value::Null) => {}
        Some(calls) => out.set("tool_calls", J::from_object(sglang_tool_calls(calls)?)),
    }
    match message.get("tools") {
        None | Some(Value::Null) => {}
        Some(tools) => out.set("tools", jinja(&canonical_tools_sglang(tools)?)),
    }
    match message.get("prefix") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(prefix)) => out.set("prefix", J::from(*prefix)),
        Some(_) => return Err(invalid("prefix must be a boolean")),
    }
    Ok(out)
}

/// A content list as SGLang's `process_content_for_template_format` (and, for tool messages,
/// `normalize_tool_content`) leaves it.
fn sglang_content(parts: &[SglangPart<'_>], format: ContentFormat, tool: bool) -> J {
    let texts = || {
        parts.iter().filter_map(|part| match part {
            SglangPart::Text(text) => Some(*text),
            _ => None,
        })
    };
    match format {
        // Every text joined, empty ones too (vLLM drops those and joins with "\n").
        ContentFormat::String => J::from(texts().collect::<Vec<_>>().join(" ")),
        // Thinking parts are refused outside assistant messages: a tool message's parts are
        // texts and tool references.
        ContentFormat::OpenAi
            if tool
                && !parts
                    .iter()
                    .any(|p| matches!(p, SglangPart::ToolReference(_))) =>
        {
            J::from(texts().collect::<Vec<_>>().join(" "))
        }
        ContentFormat::OpenAi => J::from_object(
            parts
                .iter()
                .filter_map(|part| match part {
                    SglangPart::Text(text) => Some(J::from_iter([
                        (J::from("type"), J::from("text")),
                        (J::from("text"), J::from(*text)),
                    ])),
                    SglangPart::ToolReference(name) => Some(J::from_iter([
                        (J::from("type"), J::from("tool_reference")),
                        (J::from("name"), J::from(*name)),
                    ])),
                    SglangPart::Thinking => None,
                })
                .collect::<Vec<J>>(),
        ),
    }
}

/// History tool calls as SGLang dumps its `ToolCall` model (`id`, `index`, `type`, `function:
/// {name, arguments}`, nulls kept) after `normalize_assistant_tool_call_arguments`: string
/// arguments must parse to a JSON object (SGLang refuses others with 400), an object is kept.
fn sglang_tool_calls(calls: &Value) -> Result<Vec<J>, TokenizeError> {
    let calls = calls
        .as_array()
        .ok_or_else(|| invalid("tool_calls must be a list"))?;
    calls
        .iter()
        .map(|call| {
            let call = call
                .as_object()
                .ok_or_else(|| invalid("assistant tool_calls entries must be objects"))?;
            let id = optional_str(call, "id")?;
            let index = match call.get("index") {
                None | Some(Value::Null) => J::from(()),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                    jinja(&Value::Number(n.clone()))
                }
                Some(_) => return Err(invalid("a tool call's index must be an integer")),
            };
            match call.get("type") {
                None => {}
                Some(Value::String(t)) if t == "function" => {}
                Some(_) => return Err(invalid("only tool calls of type 'function' are supported")),
            }
            let function = call
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| invalid("a tool call needs a function"))?;
            let name = optional_str(function, "name")?;
            let arguments = match function.get("arguments") {
                None | Some(Value::Null) => J::from(()),
                Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                    Ok(Value::Object(map)) => jinja_map(map.iter().map(|(k, v)| (k.as_str(), v))),
                    Ok(_) => {
                        return Err(invalid(
                            "assistant tool call function.arguments must be a JSON object",
                        ));
                    }
                    Err(_) => {
                        return Err(invalid(
                            "assistant tool call function.arguments must be valid JSON",
                        ));
                    }
                },
                Some(object @ Value::Object(_)) => jinja(object),
                Some(_) => {
                    return Err(invalid(
                        "a tool call's arguments must be a string or an object",
                    ));
                }
            };
            let function = J::from_iter([
                (J::from("name"), name.map_or(J::from(()), J::from)),
                (J::from("arguments"), arguments),
            ]);
            Ok(J::from_iter([
                (J::from("id"), id.map_or(J::from(()), J::from)),
                (J::from("index"), index),
                (J::from("type"), J::from("function")),
                (J::from("function"), function),
            ]))
        })
        .collect()
}

/// `tools` as SGLang hands them to the template: `Tool.model_dump()` of each (`protocol.py`).
/// The tool keeps `type` (any string), `function` and `defer_loading` (null when unset); the
/// function keeps the keys the client sent among `description`, `name`, `parameters`, `strict`
/// and `defer_loading`, in the client's order, then `description` and `parameters` (null) when
/// missing; `strict` and `defer_loading` only when set, the tool's `defer_loading` copied in when
/// the function has none. An empty list is no tools.
pub(crate) fn canonical_tools_sglang(tools: &Value) -> Result<Value, TokenizeError> {
    let bad = |reason: &str| TokenizeError::InvalidTools {
        reason: reason.to_owned(),
    };
    // SGLang's request model dumps an unset optional field as null.
    let optional = |map: &Map<String, Value>, key: &str, ok: fn(&Value) -> bool| {
        optional(map, key, ok).map(|value| value.unwrap_or(Value::Null))
    };
    let tools = tools
        .as_array()
        .ok_or_else(|| bad("tools must be a list"))?;
    tools
        .iter()
        .map(|tool| {
            let (tool, function, name) = tool_function(tool)?;
            let kind = match tool.get("type") {
                None => Value::from("function"),
                Some(kind @ Value::String(_)) => kind.clone(),
                Some(_) => return Err(bad("a tool's type must be a string")),
            };
            let tool_defer = optional(tool, "defer_loading", Value::is_boolean)?;
            let mut defer = optional(function, "defer_loading", Value::is_boolean)?;
            if defer.is_null() {
                defer = tool_defer.clone();
            }
            let fields = [
                (
                    "description",
                    optional(function, "description", Value::is_string)?,
                ),
                ("name", name.clone()),
                // `Optional[object]`: any JSON value.
                (
                    "parameters",
                    function.get("parameters").cloned().unwrap_or(Value::Null),
                ),
                ("strict", optional(function, "strict", Value::is_boolean)?),
                ("defer_loading", defer),
            ];
            let dumped = |key: &str| {
                fields
                    .iter()
                    .find(|(k, _)| *k == key)
                    .filter(|(k, v)| !(matches!(*k, "strict" | "defer_loading") && v.is_null()))
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
            };
            let mut f = Map::new();
            for key in function.keys() {
                if let Some((k, v)) = dumped(key) {
                    f.insert(k, v);
                }
            }
            for (key, _) in &fields {
                if !f.contains_key(*key)
                    && let Some((k, v)) = dumped(key)
                {
                    f.insert(k, v);
                }
            }
            let mut out = Map::new();
            out.insert("type".to_owned(), kind);
            out.insert("function".to_owned(), Value::Object(f));
            out.insert("defer_loading".to_owned(), tool_defer);
            Ok(Value::Object(out))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}
