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
    // `Prepend`s wait here until the next step that copies the text anyway (Llama 2's
    // `Replace`), so the text is copied once, not once per step.
    let mut prefix = String::new();
    let mut text = Cow::Borrowed(text);
    let join = |prefix: &mut String, text: &mut Cow<'t, str>| {
        if !prefix.is_empty() {
            prefix.push_str(text);
            *text = Cow::Owned(std::mem::take(prefix));
        }
    };
    for step in steps {
        match step {
            Step::Nfc => {
                join(&mut prefix, &mut text);
                if let Cow::Owned(normalized) = super::nfc(&text) {
                    text = Cow::Owned(normalized);
                }
            }
            Step::Prepend(prepend) => {
                if !(prefix.is_empty() && text.is_empty()) {
                    prefix.insert_str(0, prepend);
                }
            }
            Step::Replace { pattern, content } => match pattern.as_bytes() {
                [byte] if byte.is_ascii() => {
                    if let Some(replaced) = replace_ascii(&prefix, &text, *byte, content) {
                        text = Cow::Owned(replaced);
                        prefix.clear();
                    }
                }
                _ => {
                    join(&mut prefix, &mut text);
                    if text.contains(pattern.as_str()) {
                        text = Cow::Owned(text.replace(pattern.as_str(), content));
                    }
                }
            },
        }
    }
    join(&mut prefix, &mut text);
    text
}

/// `prefix` + `text` with every `byte` (ASCII) replaced by `content`, if either has one. A
/// byte loop copying the runs between matches: the pattern is a space in every real pipeline,
/// and `str::replace` searched for each one anew (`memchr` per space was a tenth of an encode).
fn replace_ascii(prefix: &str, text: &str, byte: u8, content: &str) -> Option<String> {
    let found = |s: &str| s.as_bytes().contains(&byte);
    if !found(prefix) && !found(text) {
        return None;
    }
    let mut out = String::with_capacity(prefix.len() + text.len() + text.len() / 4 * content.len());
    for part in [prefix, text] {
        // `byte` is ASCII, so each of its positions is a char boundary.
        let mut start = 0;
        for (i, &b) in part.as_bytes().iter().enumerate() {
            if b == byte {
                out.push_str(part.get(start..i)?);
                out.push_str(content);
                start = i + 1;
            }
        }
        out.push_str(part.get(start..)?);
    }
    Some(out)
}
