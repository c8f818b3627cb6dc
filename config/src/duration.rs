//! The one duration format of every kvroute config: `250ms`, `1.5s`, `500us`, `1m`.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Why a duration string is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected a duration such as 50ms, 2s, 1m")]
pub struct DurationError;

/// Parses a duration as every kvroute config writes it: a non-negative number and a unit, `us`
/// (or `µs`), `ms`, `s` or `m` — `250ms`, `1.5s`, `500us`, `1m`. A bare number is refused (its
/// unit would be a guess).
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or(DurationError)?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| DurationError)?;
    let seconds = match unit.trim() {
        "us" | "µs" => number / 1e6,
        "ms" => number / 1e3,
        "s" => number,
        "m" => number * 60.0,
        _ => return Err(DurationError),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| DurationError)
}

/// A duration in the config format, in the largest unit that writes it exactly (`10m`, `2s`,
/// `20ms`, `500us`): how the reference shows defaults, and what [`parse_duration`] reads back.
pub fn format_duration(duration: Duration) -> String {
    let micros = duration.as_micros();
    if micros.is_multiple_of(60_000_000) && micros > 0 {
        format!("{}m", micros / 60_000_000)
    } else if micros.is_multiple_of(1_000_000) {
        format!("{}s", micros / 1_000_000)
    } else if micros.is_multiple_of(1_000) {
        format!("{}ms", micros / 1_000)
    } else {
        format!("{micros}us")
    }
}

/// A duration key's value: written as text (`250ms`, `2s`), validated while deserializing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConfigDuration(pub Duration);

impl ConfigDuration {
    /// The duration.
    pub fn get(self) -> Duration {
        self.0
    }
}

impl From<Duration> for ConfigDuration {
    fn from(duration: Duration) -> Self {
        Self(duration)
    }
}

impl From<ConfigDuration> for Duration {
    fn from(duration: ConfigDuration) -> Self {
        duration.0
    }
}

impl<'de> Deserialize<'de> for ConfigDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = ConfigDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as 50ms, 2s, 1m")
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                parse_duration(text)
                    .map(ConfigDuration)
                    .map_err(|error| E::custom(format_args!("{error} (got {text:?})")))
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

impl Serialize for ConfigDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&format_duration(self.0))
    }
}

impl schemars::JsonSchema for ConfigDuration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "format": "duration",
            "description": "A number and a unit: us, ms, s or m (250ms, 1.5s, 1m).",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_the_one_format() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500us"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        for bad in ["5", "-1s", "1h", "", "ms", "1.2.3s"] {
            assert_eq!(parse_duration(bad), Err(DurationError), "{bad}");
        }
        for (duration, text) in [
            (Duration::from_secs(600), "10m"),
            (Duration::from_secs(2), "2s"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_micros(5), "5us"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(format_duration(duration), text);
            assert_eq!(parse_duration(text), Ok(duration));
        }
    }
}
