//! The chat template: compiled once, rendered with the context `transformers` gives HF templates.
//!
//! transformers renders with Jinja2 `trim_blocks` + `lstrip_blocks`, loop controls, a
//! `raise_exception` function and a `tojson` filter that is Python's `json.dumps` (no HTML
//! escaping, `", "`/`": "` separators); templates also call Python string methods, which
//! minijinja-contrib's `pycompat` provides. vLLM flattens text content parts into one string
//! joined with `"\n"` before rendering (its "string" content format), and so do we.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value, context};

use crate::TokenizeError;

const TEMPLATE_NAME: &str = "chat";

/// Special tokens exposed to the template by name, as transformers does.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpecialTokens {
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) pad_token: Option<String>,
    pub(crate) unk_token: Option<String>,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special: SpecialTokens,
}

impl ChatTemplate {
    pub(crate) fn new(source: String, special: SpecialTokens) -> Result<Self, TokenizeError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|source| TokenizeError::TemplateSyntax { source })?;
        Ok(Self { env, special })
    }

    /// Renders OpenAI `messages` (a JSON array of message objects).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizeError> {
        let messages = normalize_messages(messages)?;
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|source| TokenizeError::TemplateRender { source })?;
        let special = &self.special;
        template
            .render(context! {
                messages => Value::from_serialize(&messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => special.bos_token,
                eos_token => special.eos_token,
                pad_token => special.pad_token,
                unk_token => special.unk_token,
            })
            .map_err(|source| TokenizeError::TemplateRender { source })
    }
}

/// Checks the message shapes and flattens list content into text, as vLLM does before rendering.
fn normalize_messages(
    messages: &serde_json::Value,
) -> Result<Vec<serde_json::Value>, TokenizeError> {
    let invalid = |reason: &str| TokenizeError::InvalidMessages {
        reason: reason.to_owned(),
    };
    let list = messages
        .as_array()
        .ok_or_else(|| invalid("messages must be an array"))?;
    list.iter()
        .map(|message| {
            let mut message = message
                .as_object()
                .ok_or_else(|| invalid("a message must be an object"))?
                .clone();
            if !message
                .get("role")
                .is_some_and(serde_json::Value::is_string)
            {
                return Err(invalid("a message needs a string role"));
            }
            if let Some(content) = message.get_mut("content") {
                *content = match content.take() {
                    serde_json::Value::Array(parts) => {
                        serde_json::Value::String(join_text_parts(&parts)?)
                    }
                    text @ (serde_json::Value::String(_) | serde_json::Value::Null) => text,
                    _ => return Err(invalid("content must be a string or a list of parts")),
                };
            }
            Ok(serde_json::Value::Object(message))
        })
        .collect()
}

fn join_text_parts(parts: &[serde_json::Value]) -> Result<String, TokenizeError> {
    let texts = parts
        .iter()
        .map(|part| match part {
            serde_json::Value::String(text) => Ok(text.as_str()),
            serde_json::Value::Object(part)
                if part.get("type").and_then(|t| t.as_str()) == Some("text") =>
            {
                part.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                    TokenizeError::InvalidMessages {
                        reason: "a text part needs text".to_owned(),
                    }
                })
            }
            _ => Err(TokenizeError::InvalidMessages {
                reason: "only text content parts are supported".to_owned(),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(texts.join("\n"))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn python_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_python_json(value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn write_python_json(
    value: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width * depth));
        }
    };
    let item_separator = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            out.push_str(&i128::try_from(value.clone())?.to_string());
        }
        ValueKind::Number => {
            let float = f64::try_from(value.clone())?;
            // Python prints integral floats with a trailing ".0".
            if float.is_finite() && float.fract() == 0.0 && float.abs() < 1e16 {
                out.push_str(&format!("{float:.1}"));
            } else {
                out.push_str(&float.to_string());
            }
        }
        ValueKind::String | ValueKind::Bytes => out.push_str(&json_string(&value.to_string())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_python_json(item, indent, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = value.try_iter()?.collect();
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                let name = key.as_str().map_or_else(|| key.to_string(), str::to_owned);
                out.push_str(&json_string(&name));
                out.push_str(": ");
                write_python_json(&value.get_item(key)?, indent, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => out.push_str(&json_string(&value.to_string())),
    }
    Ok(())
}

/// A JSON string literal with Python's `ensure_ascii=False` escaping (which is serde_json's).
fn json_string(text: &str) -> String {
    serde_json::Value::String(text.to_owned()).to_string()
}
