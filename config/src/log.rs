//! The `log` section every kvroute server's config has: how its log lines are written.

use serde::{Deserialize, Serialize};

/// How log lines are written to stderr.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (tracing's default format).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message`, `fields`, and
    /// `trace_id` (with `span_id` when spans are exported) on a line logged inside a traced
    /// request.
    Json,
}

/// Default `log.format`.
pub const DEFAULT_LOG_FORMAT: LogFormat = LogFormat::Text;

/// The `log` section as written. Read at start: a change takes effect when the process restarts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawLog {
    /// `text` or `json` (one JSON object per line, with the request's trace id). Read at start.
    #[schemars(extend("default" = DEFAULT_LOG_FORMAT))]
    pub format: Option<LogFormat>,
}

impl RawLog {
    /// The format, its default filled in.
    pub fn format(&self) -> LogFormat {
        self.format.unwrap_or(DEFAULT_LOG_FORMAT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_format_is_text_unless_json_is_asked_for() {
        let raw: RawLog = crate::from_yaml("{}").unwrap();
        assert_eq!(raw.format(), LogFormat::Text);
        let raw: RawLog = crate::from_yaml("format: json").unwrap();
        assert_eq!(raw.format(), LogFormat::Json);
        let error = crate::from_yaml::<RawLog>("format: xml").unwrap_err();
        assert!(error.to_string().starts_with("format"), "{error}");
    }
}
