//! The one configuration error, naming the field path in one format: `path: reason`.

use std::fmt;

use serde::de::DeserializeOwned;

/// What went wrong, for a metric or log label ([`ConfigError::as_label`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The document does not have the config's shape: YAML/JSON syntax, an unknown key, a wrong
    /// type, or a leaf value its type refuses (a duration, an address, an endpoint, ...).
    Parse,
    /// A value the component's own rules refuse (cross-field checks, ranges, uniqueness).
    Invalid,
    /// A key of an older schema, refused with the key that replaces it.
    Renamed,
    /// Something the config points to cannot be loaded (a token file, a TLS certificate).
    Load,
}

impl ErrorKind {
    /// Metric/log label.
    pub fn as_label(self) -> &'static str {
        match self {
            ErrorKind::Parse => "parse",
            ErrorKind::Invalid => "invalid_value",
            ErrorKind::Renamed => "renamed",
            ErrorKind::Load => "load",
        }
    }
}

/// A configuration error: the field path (`pools[2].block_size`, empty for the document as a
/// whole) and why. Displayed as `path: reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    path: String,
    reason: String,
    kind: ErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.reason)
        } else {
            write!(f, "{}: {}", self.path, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// A value the component's rules refuse, at `path` (e.g. `pools[2].block_size`).
    pub fn at(path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self::of_kind(ErrorKind::Invalid, path, reason)
    }

    /// A key of an older schema at `path`; `new` says what replaces it.
    pub fn renamed(path: impl Into<String>, new: impl fmt::Display) -> Self {
        Self::of_kind(
            ErrorKind::Renamed,
            path,
            format_args!("this key was renamed: write {new}"),
        )
    }

    /// Something the field at `path` points to cannot be loaded (file, environment variable).
    pub fn load(path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self::of_kind(ErrorKind::Load, path, reason)
    }

    /// A document that does not have the config's shape, at `path`.
    pub fn parse(path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self::of_kind(ErrorKind::Parse, path, reason)
    }

    fn of_kind(kind: ErrorKind, path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self {
            path: path.into(),
            reason: reason.to_string(),
            kind,
        }
    }

    /// The same error inside section `prefix`: a section validated on its own (a pool's
    /// `kubernetes:`, an event source) reports paths relative to itself, and its caller places
    /// them (`pools[2].discovery.kubernetes` + `selector`).
    #[must_use]
    pub fn within(mut self, prefix: &str) -> Self {
        self.path = join_path(prefix, &self.path);
        self
    }

    /// The field path, e.g. `replicas[0].events.mode` (empty: the document as a whole).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Why the value is refused.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// What kind of error this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Metric/log label (the kind's).
    pub fn as_label(&self) -> &'static str {
        self.kind.as_label()
    }
}

/// `prefix` and `field` as one path: `pools[2]` + `block_size` = `pools[2].block_size`,
/// `indexes` + `[0]` = `indexes[0]`; either may be empty.
pub fn join_path(prefix: &str, field: &str) -> String {
    match (prefix.is_empty(), field.is_empty()) {
        (true, _) => field.to_owned(),
        (false, true) => prefix.to_owned(),
        (false, false) if field.starts_with('[') => format!("{prefix}{field}"),
        (false, false) => format!("{prefix}.{field}"),
    }
}

/// A serde error at `path` (serde_path_to_error's rendering, which ends in the unknown key's
/// name for an unknown key): the root `.` becomes empty, and the reason does not repeat the key.
fn serde_error(path: &serde_path_to_error::Path, reason: String) -> ConfigError {
    let mut path = path.to_string();
    // `.` is the root; `?` a key the parser never finished reading (e.g. the input ended).
    while let Some(rest) = path.strip_suffix('?') {
        path = rest.trim_end_matches('.').to_owned();
    }
    if path == "." {
        path.clear();
    }
    // serde_yaml puts its own path (the same format) before a nested error's message: keep one.
    let reason = strip_own_path(&path, &reason).to_owned();
    if let Some(rest) = reason.strip_prefix("unknown field `")
        && let Some((key, rest)) = rest.split_once('`')
    {
        if !(path == key || path.ends_with(&format!(".{key}"))) {
            path = join_path(&path, key);
        }
        return ConfigError::parse(path, format_args!("unknown key{rest}"));
    }
    ConfigError::parse(path, reason)
}

/// `reason` without a leading `p: ` where `p` is `path` or one of its ancestors.
fn strip_own_path<'a>(path: &str, reason: &'a str) -> &'a str {
    let mut candidate = path;
    while !candidate.is_empty() {
        if let Some(rest) = reason
            .strip_prefix(candidate)
            .and_then(|rest| rest.strip_prefix(": "))
        {
            return rest;
        }
        candidate = match candidate.rfind(['.', '[']) {
            Some(cut) => &candidate[..cut],
            None => "",
        };
    }
    reason
}

/// Deserializes a YAML document into a raw config; every error names its field path.
pub fn from_yaml<T: DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(serde_yaml::Deserializer::from_str(text))
        .map_err(|error| serde_error(error.path(), error.inner().to_string()))
}

/// Deserializes a JSON document (the proxy-wasm filter's plugin configuration) into a raw config;
/// every error names its field path.
pub fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ConfigError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer)
        .map_err(|error| serde_error(error.path(), error.inner().to_string()))?;
    // Trailing characters after the document are an error, as in `serde_json::from_slice`.
    deserializer
        .end()
        .map_err(|error| ConfigError::parse("", error))?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Fields only deserialized: the errors are what is tested.
    #[allow(dead_code)]
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[serde(default)]
        pools: Vec<Pool>,
    }

    #[allow(dead_code)]
    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Pool {
        #[serde(default)]
        block_size: u32,
        #[serde(default)]
        timeout: Option<crate::ConfigDuration>,
    }

    #[test]
    fn serde_errors_name_their_path() {
        let error = from_yaml::<Doc>("pools: [{block_size: 1}, {blocksize: 2}]").unwrap_err();
        assert_eq!(error.path(), "pools[1].blocksize");
        assert!(
            error
                .to_string()
                .starts_with("pools[1].blocksize: unknown key, expected"),
            "{error}"
        );
        assert_eq!(error.kind(), ErrorKind::Parse);
        let error = from_yaml::<Doc>("pools: [{block_size: x}]").unwrap_err();
        assert_eq!(error.path(), "pools[0].block_size");
        let error = from_yaml::<Doc>("pools: [{}, {timeout: 5}]").unwrap_err();
        assert_eq!(error.path(), "pools[1].timeout");
        let error = from_yaml::<Doc>("pools: [{}, {timeout: 5h}]").unwrap_err();
        assert!(
            error.to_string().starts_with(
                "pools[1].timeout: expected a duration such as 50ms, 2s, 1m (got \"5h\")"
            ),
            "{error}"
        );
        let error = from_json::<Doc>(br#"{"pools": [{"nope": 1}]}"#).unwrap_err();
        assert_eq!(error.path(), "pools[0].nope");
        assert!(from_json::<Doc>(br#"{"pools": []} x"#).is_err());
    }

    #[test]
    fn component_errors_use_the_same_format() {
        let error = ConfigError::at("block_size", "must be at least 1 (got 0)").within("pools[2]");
        assert_eq!(
            error.to_string(),
            "pools[2].block_size: must be at least 1 (got 0)"
        );
        assert_eq!(error.as_label(), "invalid_value");
        assert_eq!(join_path("indexes", "[0]"), "indexes[0]");
        assert_eq!(ConfigError::at("", "empty").to_string(), "empty");
    }
}
