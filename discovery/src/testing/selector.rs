//! Label and field selectors as the API server parses them (`labelSelector`, `fieldSelector`).

use std::collections::BTreeSet;

use serde_json::Value;

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
}

/// A parsed `labelSelector` (requirements ANDed; empty: everything).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    /// Parses the query value (`a=b,c!=d,e in (f,g),!h`).
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            requirements.push(requirement(part)?);
        }
        Ok(Self(requirements))
    }

    /// Whether an object with `labels` (its `metadata.labels`) matches.
    pub(crate) fn matches(&self, labels: Option<&Value>) -> bool {
        let get = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.0.iter().all(|requirement| match requirement {
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::In(k, values) => get(k).is_some_and(|v| values.contains(v)),
            Requirement::NotIn(k, values) => get(k).is_none_or(|v| !values.contains(v)),
        })
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn requirement(part: &str) -> Result<Requirement, String> {
    let invalid = || format!("unable to parse requirement: {part}");
    let key = |k: &str| {
        let k = k.trim();
        if k.is_empty() || k.contains(char::is_whitespace) {
            Err(invalid())
        } else {
            Ok(k.to_owned())
        }
    };
    if let Some(k) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(key(k)?));
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Ok(Requirement::NotEquals(key(k)?, v.trim().to_owned()));
    }
    if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(Requirement::Equals(key(k)?, v.trim().to_owned()));
    }
    for (word, negated) in [(" notin ", true), (" in ", false)] {
        if let Some((k, set)) = part.split_once(word) {
            let set = set
                .trim()
                .strip_prefix('(')
                .and_then(|s| s.strip_suffix(')'))
                .ok_or_else(invalid)?;
            let values = set.split(',').map(|v| v.trim().to_owned()).collect();
            let k = key(k)?;
            return Ok(if negated {
                Requirement::NotIn(k, values)
            } else {
                Requirement::In(k, values)
            });
        }
    }
    Ok(Requirement::Exists(key(part)?))
}

/// A parsed `fieldSelector`: `path=value`, `path==value`, `path!=value`, ANDed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses the query value, accepting only `supported` fields (the server's per-resource
    /// list; anything else is `field label not supported`, as the real server answers).
    pub(crate) fn parse(text: &str, supported: &[&str]) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, equal, value) = if let Some((f, v)) = part.split_once("!=") {
                (f, false, v)
            } else if let Some((f, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (f, true, v)
            } else {
                return Err(format!(
                    "invalid selector: '{part}'; can't understand '{part}'"
                ));
            };
            let field = field.trim();
            if !supported.contains(&field) {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field.to_owned(), equal, value.trim().to_owned()));
        }
        Ok(Self(terms))
    }

    /// Whether `object` matches (a missing field is the empty string).
    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(field, equal, value)| {
            let actual = field
                .split('.')
                .try_fold(object, |v, key| v.get(key))
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .unwrap_or_default();
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors_parse_every_operator() {
        let labels = serde_json::json!({"app": "vllm", "tier": "gpu", "zone": "a"});
        for (selector, matches) in [
            ("", true),
            ("app=vllm", true),
            ("app==vllm,tier=gpu", true),
            ("app=other", false),
            ("app!=other", true),
            ("zone in (a,b)", true),
            ("zone notin (a,b)", false),
            ("tier", true),
            ("!tier", false),
            ("!missing,app in (vllm)", true),
        ] {
            let parsed = LabelSelector::parse(selector).unwrap();
            assert_eq!(parsed.matches(Some(&labels)), matches, "{selector}");
        }
        assert!(LabelSelector::parse("a b").is_err());
    }

    #[test]
    fn field_selectors_check_their_fields() {
        let pod = serde_json::json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}});
        let supported = ["metadata.name", "spec.nodeName"];
        assert!(
            FieldSelector::parse("spec.nodeName=n1", &supported)
                .unwrap()
                .matches(&pod)
        );
        assert!(
            !FieldSelector::parse("spec.nodeName!=n1", &supported)
                .unwrap()
                .matches(&pod)
        );
        assert!(
            FieldSelector::parse("metadata.name==p,spec.nodeName=n1", &supported)
                .unwrap()
                .matches(&pod)
        );
        assert_eq!(
            FieldSelector::parse("spec.hostname=x", &supported).unwrap_err(),
            "field label not supported: spec.hostname"
        );
    }
}
