//! The chat template: compiled once, rendered as vLLM 0.32 renders it through transformers 5.
//!
//! The environment is transformers' (`utils/chat_template_utils.py`): Jinja `trim_blocks` +
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` and a `tojson` that is
//! Python's `json.dumps` (see [`crate::pyjson`]); `{% generation %}` blocks render their body.
//! Python semantics templates rely on are added: string methods (minijinja-contrib's
//! `pycompat`), `strip`/`lstrip`/`rstrip` and the `trim` filter with Python's whitespace set, and
//! `None`/`True`/`False`/floats printed as Python prints them.
//!
//! The context is transformers' `apply_chat_template`: the named special tokens that are set,
//! then the request's template kwargs (which override them), then `messages`, `tools`,
//! `documents` and `add_generation_prompt`. `continue_final_message` is transformers' tag
//! trick: the final message's text gets a marker, and the rendering is cut at it.

use std::sync::Arc;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, Value};

use crate::content_format::{self, ContentFormat};
use crate::{ChatOptions, Dialect, TokenizeError, conversation, pyjson, pytime};

mod joined_output;
#[cfg(test)]
mod reference;
mod tool_values;

pub(crate) use tool_values::ToolValues;

const TEMPLATE_NAME: &str = "chat";
/// transformers' marker for `continue_final_message`.
const CONTINUE_FINAL_MESSAGE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";
/// Template kwargs a request may not set (vLLM refuses an untrusted request template).
const RESERVED_KWARGS: [&str; 1] = ["chat_template"];
/// Template variables transformers sets itself; a request kwarg of the same name makes
/// `render()` fail with a duplicate keyword in transformers.
const CONTEXT_NAMES: [&str; 1] = ["messages"];
/// `apply_chat_template`'s own parameters (transformers 5.19): kwargs of these names are
/// consumed by it and never reach the template.
const APPLY_CHAT_TEMPLATE_PARAMS: [&str; 11] = [
    "conversation",
    "chat_template",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];
/// `apply_chat_template`'s arguments SGLang passes itself (`serving_chat.py`
/// `_render_and_encode_chat_template`), and the render call's own `messages`: a request kwarg of
/// one of these names makes the call fail (a 500 in SGLang). `continue_final_message` would
/// switch on transformers' own continuation, which kvroute does not render for SGLang.
const SGLANG_FIXED_KWARGS: [&str; 7] = [
    "conversation",
    "messages",
    "tools",
    "add_generation_prompt",
    "tokenize",
    "return_dict",
    "continue_final_message",
];

/// Values vLLM's `merge_kwargs` treats as unset.
fn is_unset(value: &serde_json::Value) -> bool {
    value.is_null() || value.as_str() == Some("auto")
}

/// The keyword arguments vLLM hands `apply_chat_template`, in its merge order
/// (`ChatCompletionRequest.build_chat_params`, `ChatParams.with_defaults`,
/// `OnlineRenderer.preprocess_chat`): `{tools, tokenize}` defaults, overridden by the request's
/// `chat_template_kwargs`, overridden by the request's own fields; unset (`None`/`"auto"`)
/// overrides dropped at each step.
fn template_kwargs(
    options: &ChatOptions,
    tools: Option<serde_json::Value>,
) -> Result<serde_json::Map<String, serde_json::Value>, TokenizeError> {
    let user = options.chat_template_kwargs.clone().unwrap_or_default();
    for key in RESERVED_KWARGS {
        if user.contains_key(key) {
            return Err(TokenizeError::InvalidKwargs {
                reason: format!("chat_template_kwargs may not set {key}"),
            });
        }
    }
    let mut extra = serde_json::Map::new();
    extra.insert(
        "add_generation_prompt".to_owned(),
        options.add_generation_prompt.into(),
    );
    extra.insert(
        "continue_final_message".to_owned(),
        options.continue_final_message.into(),
    );
    extra.insert(
        "documents".to_owned(),
        options.documents.clone().unwrap_or(serde_json::Value::Null),
    );
    extra.insert(
        "reasoning_effort".to_owned(),
        options
            .reasoning_effort
            .clone()
            .map_or(serde_json::Value::Null, Into::into),
    );
    if let Some(effort) = &options.reasoning_effort
        && !user.contains_key("enable_thinking")
    {
        extra.insert("enable_thinking".to_owned(), (effort != "none").into());
    }
    let mut merged = user;
    merged.extend(extra.into_iter().filter(|(_, v)| !is_unset(v)));
    let mut kwargs = serde_json::Map::new();
    if let Some(tools) = tools {
        kwargs.insert("tools".to_owned(), tools);
    }
    kwargs.extend(merged.into_iter().filter(|(_, v)| !is_unset(v)));
    Ok(kwargs)
}

/// The keyword arguments SGLang 0.5.23 hands `apply_chat_template` besides `messages`, in
/// order: `tools` (already filtered by `tool_choice`), `add_generation_prompt` (always true: its
/// chat request has no such field), then `reasoning_effort` and the request's
/// `chat_template_kwargs`. The effort is the request's (`ChatCompletionRequest`'s validator then
/// sets `thinking` and `enable_thinking` to `effort != "none"` unless the kwargs do) or, when the
/// kwargs carry one, theirs (`_convert_to_internal_request` pops it from them).
fn sglang_template_kwargs(
    options: &ChatOptions,
    tools: Option<serde_json::Value>,
) -> Result<serde_json::Map<String, serde_json::Value>, TokenizeError> {
    let mut user = options.chat_template_kwargs.clone().unwrap_or_default();
    for key in RESERVED_KWARGS.iter().chain(&SGLANG_FIXED_KWARGS) {
        if user.contains_key(*key) {
            return Err(TokenizeError::InvalidKwargs {
                reason: format!("chat_template_kwargs may not set {key}"),
            });
        }
    }
    let mut effort = options
        .reasoning_effort
        .clone()
        .map(serde_json::Value::from);
    if let Some(effort) = &options.reasoning_effort {
        let thinking = serde_json::Value::from(effort != "none");
        for key in ["thinking", "enable_thinking"] {
            user.entry(key).or_insert_with(|| thinking.clone());
        }
    }
    if let Some(popped) = user
        .shift_remove("reasoning_effort")
        .filter(|v| !v.is_null())
    {
        effort = Some(popped);
    }
    let mut kwargs = serde_json::Map::new();
    if let Some(tools) = tools {
        kwargs.insert("tools".to_owned(), tools);
    }
    kwargs.insert("add_generation_prompt".to_owned(), true.into());
    if let Some(effort) = effort {
        kwargs.insert("reasoning_effort".to_owned(), effort);
    }
    kwargs.extend(user);
    Ok(kwargs)
}

/// The tools SGLang renders for `tool_choice` (`serving_chat.py` `_process_messages`): none
/// for `"none"` (or no tools), only the named function for a specific choice, else all of them.
fn sglang_tools(options: &ChatOptions) -> Result<Option<serde_json::Value>, TokenizeError> {
    let Some(tools) = &options.tools else {
        return Ok(None);
    };
    let serde_json::Value::Array(tools) = conversation::canonical_tools_sglang(tools)? else {
        return Ok(None);
    };
    let chosen = match &options.tool_choice {
        None | Some(serde_json::Value::Null) => tools,
        Some(serde_json::Value::String(choice)) => match choice.as_str() {
            "none" => return Ok(None),
            "auto" | "required" => tools,
            _ => {
                return Err(TokenizeError::InvalidTools {
                    reason: format!("unsupported tool_choice {choice}"),
                });
            }
        },
        Some(choice) => {
            let name = choice
                .get("function")
                .and_then(|f| f.get("name"))
                .ok_or_else(|| TokenizeError::InvalidTools {
                    reason: "a tool_choice object needs function.name".to_owned(),
                })?;
            tools
                .into_iter()
                .filter(|tool| tool.get("function").and_then(|f| f.get("name")) == Some(name))
                .collect()
        }
    };
    Ok((!chosen.is_empty()).then_some(serde_json::Value::Array(chosen)))
}

/// Special tokens exposed to the template by name, as transformers does
/// (`SPECIAL_TOKENS_ATTRIBUTES`; only those that are set).
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokens {
    pub(crate) named: Vec<(&'static str, String)>,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
    format: ContentFormat,
    /// The content format by SGLang's detection.
    sglang_format: ContentFormat,
    names_developer: bool,
    mentions_content: bool,
    merges_inline_system: bool,
    /// Whether SGLang finds that the template renders a system message after the first.
    sglang_inline_system: bool,
    clock: Arc<pytime::Clock>,
    /// Template values of recently sent tool definitions (and their `tojson` texts).
    tool_values: Arc<ToolValues>,
}

impl ChatTemplate {
    pub(crate) fn new(source: String, special: SpecialTokens) -> Result<Self, TokenizeError> {
        let format = content_format::detect(&source);
        // vLLM's `_detect_developer_role_support`.
        let names_developer = source.contains("\"developer\"") || source.contains("'developer'");
        let mentions_content = source.contains("content");
        // Probed on the template as written: Jinja2 alone does not know `{% generation %}`.
        let merges_inline_system = rejects_inline_system(&source);
        let sglang_inline_system = renders_inline_system(&source);
        let source = rewrite_generation_tags(&source);
        // SGLang parses with transformers' environment, which knows `{% generation %}`.
        let sglang_format = content_format::detect_sglang(&source);
        let joined = joined_output::split_joined_output(&source);
        let clock = Arc::new(pytime::Clock::default());
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(python_methods);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        let now = Arc::clone(&clock);
        env.add_function(
            "strftime_now",
            move |format: String| -> Result<Value, Error> {
                pytime::strftime(&format, now.now()).map(Value::from)
            },
        );
        let tool_values = Arc::new(ToolValues::default());
        let kept = Arc::clone(&tool_values);
        env.add_filter("tojson", move |value: &Value, kwargs: Kwargs| {
            pyjson::tojson(&kept, value, kwargs)
        });
        env.add_filter("trim", python_trim);
        // Should the rewrite not compile (it always has), the template as written renders.
        if env.add_template_owned(TEMPLATE_NAME, joined).is_err() {
            env.add_template_owned(TEMPLATE_NAME, source)
                .map_err(|source| TokenizeError::TemplateSyntax { source })?;
        }
        Ok(Self {
            env,
            special,
            format,
            sglang_format,
            names_developer,
            mentions_content,
            merges_inline_system,
            sglang_inline_system,
            clock,
            tool_values,
        })
    }

    /// Whether vLLM merges a `/v1/messages` request's inline system messages into the leading
    /// one for this template (`AnthropicServingMessages._detect_merge_inline_system`).
    pub fn merges_inline_system(&self) -> bool {
        self.merges_inline_system
    }

    /// Whether SGLang renders a system message after the first in place for this template
    /// (`parser/template_detection.py` `detect_inline_system_support`); when it does not, its
    /// Responses and Messages APIs merge system messages into one at the front.
    pub fn sglang_renders_inline_system(&self) -> bool {
        self.sglang_inline_system
    }

    /// How message content reaches this template (vLLM's detection).
    pub fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Renders `strftime_now` at this fixed time (Unix seconds, UTC) instead of the clock's
    /// (tests replaying a recording).
    pub fn fix_clock(&self, unix_seconds: i64) {
        self.clock.fix(unix_seconds);
    }

    /// Renders OpenAI `messages` (a JSON array of message objects) with the request's options.
    pub fn render(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<String, TokenizeError> {
        self.render_for_encoding(messages, options)
            .map(|rendered| rendered.text)
    }

    /// [`Self::render`], and whether the request's kwargs set `tokenize` (then transformers
    /// encodes the text itself, without special tokens, and vLLM takes those ids as they are).
    pub(crate) fn render_for_encoding(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<Rendered, TokenizeError> {
        self.render_whole(self.context(messages, options)?)
    }

    /// A request's context rendered whole.
    pub(crate) fn render_whole(&self, context: Context) -> Result<Rendered, TokenizeError> {
        let tokenized_by_template = context.tokenized_by_template;
        let continuation = context.continuation.clone();
        Ok(Rendered {
            text: self.render_context(context)?,
            tokenized_by_template,
            continuation,
        })
    }

    /// The template's context for a request: transformers' variables, built straight as the
    /// template's values (one copy of each string from the parsed request, no intermediate
    /// JSON tree and no serializer: `Value::from_serialize` of the same JSON gives equal
    /// values, checked by `chat::reference`'s tests).
    pub(crate) fn context(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<Context, TokenizeError> {
        // vLLM's request tools come as template values (kept for the next request sending the
        // same); SGLang's are among its kwargs.
        let (mut conversation, kwargs, continuation, request_tools) = match options.dialect {
            Dialect::Vllm => {
                let (conversation, kwargs, tools) = self.vllm_conversation(messages, options)?;
                (conversation, kwargs, None, tools)
            }
            Dialect::Sglang => {
                let (conversation, kwargs, continuation) =
                    self.sglang_conversation(messages, options)?;
                (conversation, kwargs, continuation, None)
            }
        };
        let tokenized_by_template = kwargs.get("tokenize").is_some_and(is_truthy);
        let mut context = ContextMap::with_capacity(self.special.named.len() + kwargs.len() + 4);
        for (name, token) in &self.special.named {
            context.set(name, Value::from(token.as_str()));
        }
        let mut tools = None;
        let mut documents = serde_json::Value::Null;
        let mut add_generation_prompt = false;
        for (key, value) in kwargs {
            match key.as_str() {
                "tools" => tools = Some(value),
                "documents" => documents = value,
                "add_generation_prompt" => add_generation_prompt = value.as_bool() == Some(true),
                name if APPLY_CHAT_TEMPLATE_PARAMS.contains(&name) => {}
                name if CONTEXT_NAMES.contains(&name) => {
                    return Err(TokenizeError::InvalidKwargs {
                        reason: format!("chat_template_kwargs may not set {key}"),
                    });
                }
                _ => context.set(&key, conversation::jinja(&value)),
            }
        }
        if let serde_json::Value::Array(docs) = &documents
            && docs.iter().any(|d| !d.is_object())
        {
            return Err(TokenizeError::InvalidMessages {
                reason: "documents must be a list of objects".to_owned(),
            });
        }
        let final_text = if options.continue_final_message && options.dialect == Dialect::Vllm {
            Some(self.mark_final_message(&mut conversation)?)
        } else {
            None
        };
        let messages = conversation
            .into_iter()
            .map(conversation::Message::into_value)
            .collect::<Vec<Value>>();
        context.set("messages", Value::from_object(messages));
        // Tools among the kwargs (SGLang's, or a vLLM request's `chat_template_kwargs`, which
        // override the request's own) come first.
        let tools = match (tools, request_tools) {
            (Some(tools), _) => conversation::jinja(&tools),
            (None, Some(tools)) => tools,
            (None, None) => Value::from(()),
        };
        context.set("tools", tools);
        context.set("documents", conversation::jinja(&documents));
        context.set("add_generation_prompt", Value::from(add_generation_prompt));
        Ok(Context {
            value: context.into_value(),
            final_text,
            tokenized_by_template,
            continuation,
        })
    }

    /// vLLM's conversation, template kwargs and the request's tools as template values (not
    /// among the kwargs) for a request.
    #[allow(clippy::type_complexity)]
    fn vllm_conversation(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<
        (
            Vec<conversation::Message>,
            serde_json::Map<String, serde_json::Value>,
            Option<Value>,
        ),
        TokenizeError,
    > {
        if options.request_template {
            return Err(TokenizeError::InvalidKwargs {
                reason: "the request carries its own chat_template".to_owned(),
            });
        }
        if options.continue_final_message && options.add_generation_prompt {
            return Err(TokenizeError::InvalidMessages {
                reason: "continue_final_message and add_generation_prompt are both set".to_owned(),
            });
        }
        let conversation = conversation::prepare(
            messages,
            self.format,
            self.names_developer,
            options.messages_validated,
        )?;
        if conversation.is_empty() {
            return Err(TokenizeError::InvalidMessages {
                reason: "empty conversation".to_owned(),
            });
        }
        let tools = options
            .tools
            .as_ref()
            .map(|sent| {
                self.tool_values.get_or_build(sent, |sent| {
                    conversation::canonical_tools(sent).map(|tools| conversation::jinja(&tools))
                })
            })
            .transpose()?;
        Ok((conversation, template_kwargs(options, None)?, tools))
    }

    /// SGLang's conversation, template kwargs and the text it appends after the rendered prompt.
    /// Its chat request has no `add_generation_prompt`, `add_special_tokens`, `documents` or
    /// `chat_template` fields (ignored, so a request template is never rendered either), and a
    /// final assistant message with string content is handled before rendering
    /// (`_handle_last_assistant_message`): with `continue_final_message` it is removed and its
    /// text appended to the prompt's ids as its own encoding; otherwise it becomes a user message
    /// of that text.
    #[allow(clippy::type_complexity)]
    fn sglang_conversation(
        &self,
        messages: &serde_json::Value,
        options: &ChatOptions,
    ) -> Result<
        (
            Vec<conversation::Message>,
            serde_json::Map<String, serde_json::Value>,
            Option<String>,
        ),
        TokenizeError,
    > {
        let mut conversation = conversation::prepare_sglang(messages, self.sglang_format)?;
        if conversation.is_empty() {
            return Err(TokenizeError::InvalidMessages {
                reason: "messages cannot be empty".to_owned(),
            });
        }
        let mut continuation = None;
        let final_text = conversation
            .last()
            .filter(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
            .and_then(|m| m.get("content")?.as_str().map(str::to_owned));
        if let Some(text) = final_text {
            if options.continue_final_message {
                conversation.pop();
                // Python's `if assistant_prefix:`: an empty text appends nothing.
                continuation = Some(text).filter(|t| !t.is_empty());
            } else if let Some(last) = conversation.last_mut() {
                *last = conversation::Message::user(text);
            }
        }
        let tools = sglang_tools(options)?;
        let kwargs = sglang_template_kwargs(options, tools)?;
        Ok((conversation, kwargs, continuation))
    }

    /// Renders a [`Context`] (cut at the final message's marker for `continue_final_message`).
    pub(crate) fn render_context(&self, context: Context) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|source| TokenizeError::TemplateRender { source })?;
        let rendered = template
            .render(context.value)
            .map_err(|source| TokenizeError::TemplateRender { source })?;
        match context.final_text {
            Some(final_text) => cut_at_final_message(rendered, &final_text),
            None => Ok(rendered),
        }
    }

    /// Renders `context` no further than `enough` needs: after each piece the template writes,
    /// `enough` is asked with the text so far, and rendering stops once it answers true. The
    /// text and whether it is the whole rendering (a stopped one ends past where `enough`
    /// answered: the piece that satisfied it is kept whole). What a template would have
    /// written or raised after that point is not seen. A context with a final message to
    /// continue is rendered whole: its text is cut at that message's end.
    pub(crate) fn render_context_until(
        &self,
        context: &Context,
        enough: &mut dyn FnMut(&str) -> bool,
    ) -> Result<(String, bool), TokenizeError> {
        if context.final_text.is_some() {
            return Ok((self.render_context(context.clone())?, true));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|source| TokenizeError::TemplateRender { source })?;
        let mut out = UntilEnough {
            text: String::with_capacity(UNTIL_ENOUGH_CAPACITY),
            enough,
            stopped: false,
        };
        let whole = match template.render_captured_to(context.value.clone(), &mut out) {
            Ok(_) => true,
            Err(_) if out.stopped => false,
            Err(source) => return Err(TokenizeError::TemplateRender { source }),
        };
        Ok((out.text, whole))
    }

    /// Appends transformers' marker to the final message's (last) text; returns that text.
    fn mark_final_message(
        &self,
        conversation: &mut [conversation::Message],
    ) -> Result<String, TokenizeError> {
        let invalid = |reason: &str| TokenizeError::InvalidMessages {
            reason: reason.to_owned(),
        };
        if !self.mentions_content {
            return Err(invalid("the chat template does not use message content"));
        }
        let content = conversation
            .last_mut()
            .and_then(|m| m.get_mut("content"))
            .ok_or_else(|| invalid("the final message has no content to continue"))?;
        if let Some(text) = content.as_str() {
            let original = text.to_owned();
            *content = Value::from(format!("{original}{CONTINUE_FINAL_MESSAGE_TAG}"));
            return Ok(original);
        }
        if content.kind() != ValueKind::Seq {
            return Err(invalid("the final message has no content to continue"));
        }
        let render_error = |e: Error| invalid(&e.to_string());
        let mut parts: Vec<Value> = content.try_iter().map_err(render_error)?.collect();
        let text_key = Value::from("text");
        for part in parts.iter_mut().rev() {
            if part.kind() != ValueKind::Map {
                continue;
            }
            let text = part.get_item(&text_key).map_err(render_error)?;
            let Some(original) = text.as_str().map(str::to_owned) else {
                continue;
            };
            // The part again, its keys in order, with the marked text in its place.
            let mut entries = Vec::new();
            for key in part.try_iter().map_err(render_error)? {
                let value = if key.as_str() == Some("text") {
                    Value::from(format!("{original}{CONTINUE_FINAL_MESSAGE_TAG}"))
                } else {
                    part.get_item(&key).map_err(render_error)?
                };
                entries.push((key, value));
            }
            *part = Value::from_iter(entries);
            *content = Value::from_object(parts);
            return Ok(original);
        }
        Err(invalid("the final message has no text to continue"))
    }
}

/// Bytes [`ChatTemplate::render_context_until`] first reserves: a leading part and the piece
/// that ends it, for most prompts.
const UNTIL_ENOUGH_CAPACITY: usize = 8 * 1024;

/// The writer of [`ChatTemplate::render_context_until`]: keeps what the template writes and
/// fails the write (which ends the rendering) once `enough` is satisfied.
struct UntilEnough<'e> {
    text: String,
    enough: &'e mut dyn FnMut(&str) -> bool,
    stopped: bool,
}

impl std::io::Write for UntilEnough<'_> {
    fn write(&mut self, piece: &[u8]) -> std::io::Result<usize> {
        // Each piece is a `str` the template wrote (minijinja writes through `fmt::Write`), so
        // the check never fails; the SIMD one costs a fraction of the standard library's on
        // long texts in other scripts.
        let piece_text = simdutf8::basic::from_utf8(piece)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8"))?;
        self.text.push_str(piece_text);
        if (self.enough)(&self.text) {
            self.stopped = true;
            return Err(std::io::Error::other("rendered far enough"));
        }
        Ok(piece.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A request's template context and what rendering it needs besides.
#[derive(Debug, Clone)]
pub(crate) struct Context {
    /// transformers' variables.
    pub(crate) value: Value,
    /// The final message's text before the marker (`continue_final_message`).
    pub(crate) final_text: Option<String>,
    /// Whether the kwargs set `tokenize`.
    pub(crate) tokenized_by_template: bool,
    /// Text whose own encoding follows the rendered prompt's (SGLang's `continue_final_message`).
    pub(crate) continuation: Option<String>,
}

/// The context's variables in insertion order; setting a name again keeps its place (a
/// Python dict's assignment, which transformers' context is).
struct ContextMap(Vec<(Value, Value)>);

impl ContextMap {
    fn with_capacity(capacity: usize) -> Self {
        Self(Vec::with_capacity(capacity))
    }

    fn set(&mut self, key: &str, value: Value) {
        match self.0.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
            Some((_, slot)) => *slot = value,
            None => self.0.push((Value::from(key), value)),
        }
    }

    fn into_value(self) -> Value {
        Value::from_iter(self.0)
    }
}

/// vLLM's probe of a template for system-first ordering: it renders `[system, user, system,
/// user]` in a bare Jinja sandbox (none of transformers' helpers, so a template calling
/// `raise_exception` or `strftime_now` fails too) and merges inline system messages if it fails.
fn rejects_inline_system(source: &str) -> bool {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Python's string methods are native in Jinja2; transformers' globals are not.
    env.set_unknown_method_callback(python_methods);
    if env.add_template("probe", source).is_err() {
        return true;
    }
    let message = |role: &str| serde_json::json!({"role": role, "content": "t"});
    let context = serde_json::json!({
        "messages": [message("system"), message("user"), message("system"), message("user")],
        "add_generation_prompt": false,
    });
    env.get_template("probe")
        .and_then(|template| template.render(Value::from_serialize(&context)))
        .is_err()
}

/// SGLang's probe of a template for inline system messages: `[system, user, system, user]`
/// rendered in a bare Jinja sandbox (with loop controls, none of transformers' helpers) must
/// succeed and show the second system message's text.
fn renders_inline_system(source: &str) -> bool {
    const SENTINEL: &str = "__sglang_inline_system_sentinel__";
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(python_methods);
    if env.add_template("probe", source).is_err() {
        return false;
    }
    let message = |role: &str, content: &str| serde_json::json!({"role": role, "content": content});
    let context = serde_json::json!({
        "messages": [message("system", "t"), message("user", "t"), message("system", SENTINEL),
            message("user", "t")],
        "add_generation_prompt": false,
    });
    env.get_template("probe")
        .and_then(|template| template.render(Value::from_serialize(&context)))
        .is_ok_and(|rendered| rendered.contains(SENTINEL))
}

/// A rendered chat prompt.
pub(crate) struct Rendered {
    /// The text.
    pub(crate) text: String,
    /// Whether transformers encodes it (kwarg `tokenize`): then without special tokens.
    pub(crate) tokenized_by_template: bool,
    /// Text encoded apart and appended to the prompt's ids (SGLang's `continue_final_message`).
    pub(crate) continuation: Option<String>,
}

/// Python truthiness of a JSON value.
fn is_truthy(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
    }
}

/// transformers' cut after rendering with the marker.
fn cut_at_final_message(rendered: String, final_text: &str) -> Result<String, TokenizeError> {
    let tag = CONTINUE_FINAL_MESSAGE_TAG.trim_end();
    if !rendered.contains(python_strip(final_text, None)) || !rendered.contains(tag) {
        return Err(TokenizeError::InvalidMessages {
            reason: "the final message does not appear in the rendered chat".to_owned(),
        });
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    let kept = &rendered[..at];
    if rendered[at..].starts_with(CONTINUE_FINAL_MESSAGE_TAG) {
        Ok(kept.to_owned())
    } else {
        Ok(python_rstrip(kept, None).to_owned())
    }
}

/// Python's `str.isspace()` set: Unicode White_Space plus the separators U+001C..U+001F.
fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn strip_set(chars: Option<&str>) -> impl Fn(char) -> bool + '_ {
    move |c| match chars {
        Some(set) => set.contains(c),
        None => is_python_space(c),
    }
}

fn python_strip<'s>(s: &'s str, chars: Option<&str>) -> &'s str {
    s.trim_matches(strip_set(chars))
}

fn python_rstrip<'s>(s: &'s str, chars: Option<&str>) -> &'s str {
    s.trim_end_matches(strip_set(chars))
}

fn python_lstrip<'s>(s: &'s str, chars: Option<&str>) -> &'s str {
    s.trim_start_matches(strip_set(chars))
}

/// Jinja's `trim(value, chars=None)`, which is Python's `str.strip(chars)`.
fn python_trim(value: String, chars: Option<String>) -> String {
    python_strip(&value, chars.as_deref()).to_owned()
}

/// Python's `strip`/`lstrip`/`rstrip` (Python whitespace, optional character set); every other
/// method from minijinja-contrib's `pycompat`.
fn python_methods(
    state: &State<'_, '_>,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let (Some(s), "strip" | "lstrip" | "rstrip") = (value.as_str(), method) {
        let chars = match args {
            [] => None,
            [chars] if chars.is_none() => None,
            [chars] => Some(chars.as_str().ok_or_else(|| {
                Error::new(ErrorKind::InvalidOperation, "strip arg must be None or str")
            })?),
            _ => return Err(Error::from(ErrorKind::TooManyArguments)),
        };
        let out = match method {
            "strip" => python_strip(s, chars),
            "lstrip" => python_lstrip(s, chars),
            _ => python_rstrip(s, chars),
        };
        return Ok(Value::from(out));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Prints values as Jinja on Python does (`str()`): `None`, `True`, `False`, floats as `repr`,
/// lists and dicts as Python's `repr` of them.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &State<'_, '_>,
    value: &Value,
) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(value, &mut text)?;
            text
        }
        ValueKind::Number if !value.is_integer() => {
            pyjson::python_float_repr(f64::try_from(value.clone())?)
        }
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text).map_err(Error::from)
}

/// Python's `repr` of a JSON-like value.
fn python_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            out.push_str(&pyjson::python_float_repr(f64::try_from(value.clone())?))
        }
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(&key, out)?;
                out.push_str(": ");
                python_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`; `\\`, the quote,
/// `\n`, `\r`, `\t` and other control characters escaped.
fn python_str_repr(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `{% generation %}…{% endgeneration %}` (transformers' assistant-mask extension, which renders
/// its body unchanged) as `{% if true %}…{% endif %}`, whitespace control kept.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag[2..].find("%}").map(|i| i + 2) else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open_ctl, body) = split_control(inner, true);
        let (body, close_ctl) = split_control(body, false);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(statement) => {
                out.push_str("{%");
                out.push_str(open_ctl);
                out.push(' ');
                out.push_str(statement);
                out.push(' ');
                out.push_str(close_ctl);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Splits a leading (or trailing) `-`/`+` whitespace-control marker off a tag's inside.
fn split_control(inner: &str, leading: bool) -> (&str, &str) {
    let marker = |c: char| c == '-' || c == '+';
    if leading {
        match inner.chars().next() {
            Some(c) if marker(c) => (&inner[..1], &inner[1..]),
            _ => ("", inner),
        }
    } else {
        match inner.chars().last() {
            Some(c) if marker(c) => (&inner[..inner.len() - 1], &inner[inner.len() - 1..]),
            _ => (inner, ""),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_whitespace_and_generation_tags() {
        assert_eq!(python_strip("\u{1c} a \u{a0}\n", None), "a");
        assert_eq!(python_strip("xxaxx", Some("x")), "a");
        assert_eq!(
            rewrite_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}"
        );
        assert_eq!(rewrite_generation_tags("{%}{%"), "{%}{%");
    }

    #[test]
    fn kept_tool_values_render_as_built_ones_and_kwargs_tools_still_override() {
        let template = ChatTemplate::new(
            "{% for tool in tools %}{{ tool | tojson }}|{{ tool.function.name }};{% endfor %}\
             {% for m in messages %}{{ m.content }}{% endfor %}"
                .to_owned(),
            SpecialTokens::default(),
        )
        .unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let tool = |name: &str| serde_json::json!({"type": "function", "function": {"name": name, "parameters": {"type": "object", "b": 1, "a": [1.0, "x"]}}});
        let with = |tools: serde_json::Value, kwargs: Option<serde_json::Value>| ChatOptions {
            tools: Some(Arc::new(tools)),
            chat_template_kwargs: kwargs.and_then(|k| k.as_object().cloned()),
            ..ChatOptions::default()
        };
        let fresh = |options: &ChatOptions| {
            ChatTemplate::new(
                template
                    .env
                    .get_template(TEMPLATE_NAME)
                    .unwrap()
                    .source()
                    .to_owned(),
                SpecialTokens::default(),
            )
            .unwrap()
            .render(&messages, options)
            .unwrap()
        };
        let first = with(serde_json::json!([tool("a"), tool("b")]), None);
        let rendered = template.render(&messages, &first).unwrap();
        assert_eq!(
            rendered,
            "{\"type\": \"function\", \"function\": {\"name\": \"a\", \"description\": null, \"parameters\": {\"type\": \"object\", \"b\": 1, \"a\": [1.0, \"x\"]}}}|a;\
             {\"type\": \"function\", \"function\": {\"name\": \"b\", \"description\": null, \"parameters\": {\"type\": \"object\", \"b\": 1, \"a\": [1.0, \"x\"]}}}|b;hi"
        );
        // The same tools again come from the kept values: the same text.
        assert_eq!(template.render(&messages, &first).unwrap(), rendered);
        // Keys in another order are other tools (rendered in their order).
        let reordered = with(
            serde_json::json!([{"function": {"parameters": {"a": [1.0, "x"], "b": 1, "type": "object"}, "name": "a"}, "type": "function"}, tool("b")]),
            None,
        );
        assert_eq!(
            template.render(&messages, &reordered).unwrap(),
            fresh(&reordered)
        );
        assert_ne!(template.render(&messages, &reordered).unwrap(), rendered);
        // `chat_template_kwargs.tools` overrides the request's (as vLLM merges them), kept or not.
        let overridden = with(
            serde_json::json!([tool("a"), tool("b")]),
            Some(serde_json::json!({"tools": [{"function": {"name": "k"}}]})),
        );
        let text = template.render(&messages, &overridden).unwrap();
        assert_eq!(text, fresh(&overridden));
        assert_eq!(text, "{\"function\": {\"name\": \"k\"}}|k;hi");
        // The tools' texts were written once and reused: the kept value's objects are found.
        assert!(template.tool_values.texts_kept() >= 2);
        // A text per set of options: compact and indented differ, each reused as written.
        let both = ChatTemplate::new(
            "{{ tools[0] | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ tools | tojson(separators=(',', ':')) }}"
                .to_owned(),
            SpecialTokens::default(),
        )
        .unwrap();
        let once = both.render(&messages, &first).unwrap();
        assert!(once.contains("{\n  \"type\": \"function\",\n"), "{once}");
        assert!(once.contains("[{\"type\":\"function\","), "{once}");
        assert_eq!(both.render(&messages, &first).unwrap(), once);
        assert_eq!(both.tool_values.texts_kept(), 3);
        // Invalid tools fail every time, kept values or not.
        let invalid = with(serde_json::json!([{"type": "retrieval"}]), None);
        for _ in 0..2 {
            assert!(template.render(&messages, &invalid).is_err());
        }
    }
}
