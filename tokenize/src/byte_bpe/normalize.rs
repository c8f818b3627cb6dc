//! The normalizers the fast encoder models: `NFC`, `Prepend`, `Replace` of a literal string, and
//! `Sequence`s of them (an empty one, as DeepSeek-V3 has, changes nothing).

use std::borrow::Cow;

use serde_json::Value;

use super::Reject;

/// One normalizer step; a pipeline applies its steps in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Unicode NFC, as `tokenizers` computes it (see [`super::nfc`]).
    Nfc,
    /// `Prepend`: this string before any non-empty text.
    Prepend(String),
    /// `Replace { pattern: String }`: every occurrence of `pattern`, left to right and not
    /// overlapping, by `content`.
    Replace { pattern: String, content: String },
}

/// The steps of a `normalizer` field, flattened; unsupported normalizers are rejected.
pub(super) fn parse(normalizer: Option<&Value>, depth: u8) -> Result<Vec<Step>, Reject> {
    let unsupported = Reject::Unsupported("normalizer");
    let Some(normalizer) = normalizer.filter(|n| !n.is_null()) else {
        return Ok(Vec::new());
    };
    let str_of = |field: &str| normalizer.get(field).and_then(Value::as_str);
    match str_of("type") {
        Some("NFC") => Ok(vec![Step::Nfc]),
        Some("Prepend") => {
            let prepend = str_of("prepend").ok_or(unsupported)?;
            Ok(vec![Step::Prepend(prepend.to_owned())])
        }
        Some("Replace") => {
            let pattern = normalizer
                .get("pattern")
                .and_then(|p| p.get("String"))
                .and_then(Value::as_str)
                .filter(|p| !p.is_empty());
            match (pattern, str_of("content")) {
                (Some(pattern), Some(content)) => Ok(vec![Step::Replace {
                    pattern: pattern.to_owned(),
                    content: content.to_owned(),
                }]),
                _ => Err(unsupported),
            }
        }
        Some("Sequence") if depth < 4 => {
            let list = normalizer
                .get("normalizers")
                .and_then(Value::as_array)
                .ok_or(unsupported)?;
            let mut steps = Vec::new();
            for inner in list {
                steps.extend(parse(Some(inner), depth + 1)?);
            }
            Ok(steps)
        }
        _ => Err(unsupported),
    }
}

/// `text` after every step, borrowed when no step changes it.
pub(super) fn apply<'t>(steps: &[Step], text: &'t str) -> Cow<'t, str> {
    let mut text = Cow::Borrowed(text);
    for step in steps {
        match step {
            Step::Nfc => {
                if let Cow::Owned(normalized) = super::nfc(&text) {
                    text = Cow::Owned(normalized);
                }
            }
            Step::Prepend(prepend) => {
                if !text.is_empty() {
                    let mut owned = String::with_capacity(prepend.len() + text.len());
                    owned.push_str(prepend);
                    owned.push_str(&text);
                    text = Cow::Owned(owned);
                }
            }
            Step::Replace { pattern, content } => {
                if text.contains(pattern.as_str()) {
                    text = Cow::Owned(text.replace(pattern.as_str(), content));
                }
            }
        }
    }
    text
}
