//! The generated configuration reference: a raw config's JSON schema (`schemars`, from the
//! `///` docs of its fields) rendered as markdown, one table per section with each key's path,
//! type, default and description. `docs/configuration.md` is made of one [`render`] chapter per
//! component; a test regenerates it and fails when the checked-in file differs.

use std::collections::VecDeque;

use schemars::Schema;
use serde_json::{Map, Value};

/// The JSON schema of a raw config type, as the reference reads it.
pub fn schema_of<T: schemars::JsonSchema>() -> Schema {
    schemars::SchemaGenerator::default().into_root_schema_for::<T>()
}

/// One chapter of the reference: `## {title}`, the config's description, then one table per
/// section (the top level first, then each nested section in the order its key appears).
pub fn render(title: &str, schema: &Schema) -> String {
    let root = schema.as_value();
    let defs = root
        .get("$defs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let mut out = format!("## {title}\n\n");
    if let Some(description) = root.get("description").and_then(Value::as_str) {
        out.push_str(&paragraphs(description));
        out.push_str("\n\n");
    }
    let mut sections = VecDeque::from([(String::new(), root.clone())]);
    while let Some((path, section)) = sections.pop_front() {
        let Some(properties) = section.get("properties").and_then(Value::as_object) else {
            continue;
        };
        let heading = if path.is_empty() {
            "Top level".to_owned()
        } else {
            format!("`{path}`")
        };
        out.push_str(&format!("### {heading}\n\n"));
        if !path.is_empty()
            && let Some(description) = section.get("description").and_then(Value::as_str)
        {
            out.push_str(&paragraphs(description));
            out.push_str("\n\n");
        }
        out.push_str("| key | type | default | description |\n|---|---|---|---|\n");
        for (key, property) in properties {
            let key_path = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            let (kind, nested) = describe(property, &defs);
            let default = property
                .get("default")
                .filter(|d| !d.is_null())
                .map_or_else(|| "—".to_owned(), |d| format!("`{}`", inline(d)));
            let description = property
                .get("description")
                .and_then(Value::as_str)
                .or_else(|| {
                    nested
                        .as_ref()
                        .and_then(|n| n.1.get("description")?.as_str())
                })
                .map_or_else(String::new, one_line);
            out.push_str(&format!(
                "| `{key_path}` | {} | {} | {} |\n",
                cell(&kind),
                cell(&default),
                cell(&description)
            ));
            if let Some((suffix, nested)) = nested {
                sections.push_back((format!("{key_path}{suffix}"), nested));
            }
        }
        out.push('\n');
    }
    out
}

/// A property's type as the reference writes it, and the section it opens (an object with
/// keys, directly or as the items of a list: path suffix `[]`).
fn describe(property: &Value, defs: &Map<String, Value>) -> (String, Option<(String, Value)>) {
    let property = resolve(non_null(property), defs);
    if property.get("properties").is_some() {
        return ("section".to_owned(), Some((String::new(), property)));
    }
    if let Some(values) = enum_values(&property) {
        return (values, None);
    }
    if let Some(variants) = property.get("anyOf").and_then(Value::as_array) {
        let kinds: Vec<String> = variants.iter().map(|v| describe(v, defs).0).collect();
        return (kinds.join(" or "), None);
    }
    match property.get("type").and_then(Value::as_str) {
        Some("array") => {
            let items = property.get("items").cloned().unwrap_or(Value::Null);
            let (kind, nested) = describe(&items, defs);
            match nested {
                Some((_, section)) => (
                    "list of sections".to_owned(),
                    Some(("[]".to_owned(), section)),
                ),
                None => (format!("list of {kind}"), None),
            }
        }
        Some("object") => {
            let values = property
                .get("additionalProperties")
                .map_or_else(|| "any".to_owned(), |v| describe(v, defs).0);
            (format!("map of {values}"), None)
        }
        Some("integer") => {
            let minimum = property.get("minimum").and_then(Value::as_u64);
            (
                if minimum == Some(1) {
                    "integer ≥ 1"
                } else {
                    "integer"
                }
                .to_owned(),
                None,
            )
        }
        Some(kind) => (
            property
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or(kind)
                .to_owned(),
            None,
        ),
        None => ("any".to_owned(), None),
    }
}

/// `X` of an `Option<X>` (`anyOf: [X, null]`, `type: [X, "null"]`); anything else as is.
fn non_null(property: &Value) -> &Value {
    if let Some(variants) = property.get("anyOf").and_then(Value::as_array) {
        let not_null: Vec<&Value> = variants
            .iter()
            .filter(|v| v.get("type").and_then(Value::as_str) != Some("null"))
            .collect();
        if let [only] = not_null.as_slice() {
            return non_null(only);
        }
    }
    property
}

/// The schema a `$ref` names (`#/$defs/Name`), keeping the name as its title (how a leaf type
/// shows: `Duration`, `ZmqEndpoint`); without `$ref`, a copy with `["X", "null"]` made `X`.
fn resolve(property: &Value, defs: &Map<String, Value>) -> Value {
    if let Some(name) = property
        .get("$ref")
        .and_then(Value::as_str)
        .and_then(|r| r.strip_prefix("#/$defs/"))
        && let Some(def) = defs.get(name)
    {
        let mut def = resolve(def, defs);
        if let Some(object) = def.as_object_mut() {
            object
                .entry("title")
                .or_insert_with(|| Value::String(name.to_owned()));
        }
        return def;
    }
    let mut property = property.clone();
    if let Some(Value::Array(kinds)) = property.get("type").cloned() {
        let kinds: Vec<Value> = kinds
            .into_iter()
            .filter(|k| k.as_str() != Some("null"))
            .collect();
        if let ([only], Some(object)) = (kinds.as_slice(), property.as_object_mut()) {
            object.insert("type".to_owned(), only.clone());
        }
    }
    property
}

/// The values of an enum of strings (`enum: [...]`, or `oneOf` of `const`s), as `a` \| `b`.
fn enum_values(property: &Value) -> Option<String> {
    let values: Vec<&Value> = match (property.get("enum"), property.get("oneOf")) {
        (Some(Value::Array(values)), _) => values.iter().collect(),
        (_, Some(Value::Array(variants))) => variants
            .iter()
            .map(|v| v.get("const").or_else(|| v.get("enum")?.get(0)))
            .collect::<Option<_>>()?,
        _ => return None,
    };
    let values: Vec<String> = values.iter().map(|v| format!("`{}`", inline(v))).collect();
    Some(values.join(" \\| "))
}

/// A JSON value inline: strings bare, everything else as JSON.
fn inline(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// A doc comment as one table cell line: its paragraphs joined.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A doc comment as markdown paragraphs (line breaks inside a paragraph joined).
fn paragraphs(text: &str) -> String {
    text.split("\n\n")
        .map(one_line)
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// Text safe inside a table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace("\\\\|", "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A section.
    #[derive(schemars::JsonSchema, serde::Deserialize, Default)]
    #[serde(default)]
    #[allow(dead_code)]
    struct Raw {
        /// How long.
        #[schemars(extend("default" = "2s"))]
        wait: Option<crate::ConfigDuration>,
        /// The mode.
        mode: crate::SocketMode,
        /// Entries.
        entries: Vec<Entry>,
    }

    /// One entry.
    #[derive(schemars::JsonSchema, serde::Deserialize, Default)]
    #[allow(dead_code)]
    struct Entry {
        /// Its name.
        name: String,
    }

    #[test]
    fn renders_one_table_per_section() {
        let text = render("demo", &schema_of::<Raw>());
        assert!(
            text.starts_with("## demo\n\nA section.\n\n### Top level\n"),
            "{text}"
        );
        assert!(
            text.contains("| `wait` | Duration | `2s` | How long. |"),
            "{text}"
        );
        assert!(
            text.contains("| `mode` | `connect` \\| `bind` | `connect` | The mode. |"),
            "{text}"
        );
        assert!(
            text.contains("| `entries` | list of sections | — | Entries. |"),
            "{text}"
        );
        assert!(text.contains("### `entries[]`\n\nOne entry.\n\n"), "{text}");
        assert!(
            text.contains("| `entries[].name` | string | — | Its name. |"),
            "{text}"
        );
    }
}
