//! The one duration format of every kvroute config (index, agent, ext-proc): `250ms`, `1.5s`,
//! `500us`, `1m`.

use std::time::Duration;

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
