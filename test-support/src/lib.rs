//! Test support shared by every kvroute crate: one wait for a condition with a deadline
//! ([`poll_until`], and [`try_poll_until`] for a caller that adds context to the failure) and one
//! scale for every test deadline ([`deadline`]).
//!
//! Deadlines only bound waits for conditions; nothing is paced by them, so a test that passes
//! takes as long with a larger deadline as with a smaller one. A slow or loaded machine needs
//! larger ones: `KVROUTE_TEST_DEADLINE_SCALE` (a number ≥ 1, default 1) multiplies every
//! deadline that goes through [`deadline`], e.g. `KVROUTE_TEST_DEADLINE_SCALE=3 cargo nextest
//! run --workspace`. The variable is only read, never set: tests do not mutate the environment.
//!
//! This crate depends on no kvroute crate, so every product crate can take it as a
//! dev-dependency (`kvroute-tests` cannot be one: it depends on the product crates).

#![deny(missing_docs)]

use std::fmt;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that scales every test deadline (a number ≥ 1; unset or empty: 1).
pub const DEADLINE_SCALE_VAR: &str = "KVROUTE_TEST_DEADLINE_SCALE";

/// Time between two checks of a condition: small next to deadlines of seconds, large enough that
/// a condition that makes an HTTP request does not load the machine.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// `base` times [`DEADLINE_SCALE_VAR`]'s factor: the deadline a test waits with.
///
/// # Panics
///
/// If the variable is set to anything but a finite number ≥ 1, or the product does not fit in a
/// [`Duration`].
pub fn deadline(base: Duration) -> Duration {
    let factor = scale();
    Duration::try_from_secs_f64(base.as_secs_f64() * factor).unwrap_or_else(|error| {
        panic!("{base:?} × {DEADLINE_SCALE_VAR} {factor} is no deadline: {error}")
    })
}

/// The factor, read once per process.
fn scale() -> f64 {
    static SCALE: OnceLock<f64> = OnceLock::new();
    *SCALE.get_or_init(|| {
        let value = match std::env::var(DEADLINE_SCALE_VAR) {
            Ok(value) => Some(value),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(raw)) => {
                panic!("{DEADLINE_SCALE_VAR}={raw:?} is not a number ≥ 1")
            }
        };
        parse_scale(value.as_deref())
    })
}

/// The factor a value of [`DEADLINE_SCALE_VAR`] means (`None`, or empty as `VAR= cmd` leaves it:
/// 1). A factor below 1 would shrink deadlines tuned for a fast machine, so it is refused.
fn parse_scale(value: Option<&str>) -> f64 {
    let text = value.map(str::trim).unwrap_or_default();
    if text.is_empty() {
        return 1.0;
    }
    match text.parse::<f64>() {
        Ok(factor) if factor.is_finite() && factor >= 1.0 => factor,
        _ => panic!(
            "{DEADLINE_SCALE_VAR}={text:?} is not a number ≥ 1 (the factor on every test deadline)"
        ),
    }
}

/// What a condition answers: a `bool` (whether it holds) or an `Option` (`Some` once it holds,
/// carrying what the wait returns).
pub trait Outcome {
    /// What the wait returns once the condition holds.
    type Value;
    /// `Some` once the condition holds.
    fn into_value(self) -> Option<Self::Value>;
}

impl Outcome for bool {
    type Value = ();
    fn into_value(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Outcome for Option<T> {
    type Value = T;
    fn into_value(self) -> Option<T> {
        self
    }
}

/// A condition did not hold before its deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOut {
    /// What was awaited.
    pub what: String,
    /// The deadline it missed.
    pub after: Duration,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}",
            self.after, self.what
        )
    }
}

impl std::error::Error for TimedOut {}

/// Checks `check` until it holds and returns its value; panics (naming `what` and `within`) if it
/// still does not hold once `within` has passed.
///
/// `within` is taken as given: pass a [`deadline`]. The condition is checked at once, then every
/// few milliseconds, and a last time at the deadline.
///
/// # Panics
///
/// If the condition does not hold within `within`.
pub async fn poll_until<F, Fut>(
    what: &str,
    within: Duration,
    check: F,
) -> <Fut::Output as Outcome>::Value
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Outcome,
{
    match try_poll_until(what, within, check).await {
        Ok(value) => value,
        Err(timed_out) => panic!("{timed_out} (set {DEADLINE_SCALE_VAR} on a slow machine)"),
    }
}

/// [`poll_until`] with the timeout as an error: for a caller that propagates it or adds context
/// (a process log, the last state seen) before failing.
pub async fn try_poll_until<F, Fut>(
    what: &str,
    within: Duration,
    mut check: F,
) -> Result<<Fut::Output as Outcome>::Value, TimedOut>
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Outcome,
{
    let until = tokio::time::Instant::now() + within;
    loop {
        if let Some(value) = check().await.into_value() {
            return Ok(value);
        }
        let now = tokio::time::Instant::now();
        if now >= until {
            return Err(TimedOut {
                what: what.to_owned(),
                after: within,
            });
        }
        tokio::time::sleep(POLL_INTERVAL.min(until - now)).await;
    }
}

/// `GET path` from `addr` over plain HTTP/1.1 (`connection: close`), the whole response as text:
/// status line, headers and body. For admin endpoints in tests, with no HTTP client crate.
///
/// # Panics
/// When the connection or the read fails (test support: the test fails there).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let mut text = String::new();
    let result = async {
        let mut socket = tokio::net::TcpStream::connect(addr).await?;
        socket.write_all(request.as_bytes()).await?;
        socket.read_to_string(&mut text).await
    }
    .await;
    if let Err(error) = result {
        panic!("GET http://{addr}{path}: {error}");
    }
    text
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn the_scale_is_one_unless_set_to_a_number_of_at_least_one() {
        assert_eq!(parse_scale(None), 1.0);
        assert_eq!(parse_scale(Some("")), 1.0);
        assert_eq!(parse_scale(Some(" 2.5 ")), 2.5);
        assert_eq!(parse_scale(Some("1")), 1.0);
        for bad in ["0.5", "0", "-2", "abc", "inf", "NaN"] {
            let refused = std::panic::catch_unwind(|| parse_scale(Some(bad)));
            let message = refused
                .err()
                .and_then(|payload| payload.downcast::<String>().ok());
            assert!(
                message.is_some_and(|message| message.contains(DEADLINE_SCALE_VAR)),
                "{bad:?} accepted or refused without naming the variable"
            );
        }
    }

    #[test]
    fn a_deadline_is_at_least_its_base() {
        let base = Duration::from_secs(10);
        assert!(deadline(base) >= base);
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_returns_the_value_once_the_condition_holds() {
        let checks = Cell::new(0);
        let value = poll_until("the third check", Duration::from_secs(1), || {
            checks.set(checks.get() + 1);
            std::future::ready((checks.get() == 3).then_some(checks.get()))
        })
        .await;
        assert_eq!(value, 3);
        poll_until("a bool condition", Duration::from_secs(1), || async {
            true
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_checks_a_last_time_at_the_deadline_then_times_out() {
        let within = Duration::from_millis(95);
        let start = tokio::time::Instant::now();
        let last_check = Cell::new(start);
        let result = try_poll_until("never", within, || {
            last_check.set(tokio::time::Instant::now());
            async { false }
        })
        .await;
        assert_eq!(
            result,
            Err(TimedOut {
                what: "never".to_owned(),
                after: within
            })
        );
        assert_eq!(last_check.get() - start, within);
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 1s waiting for the impossible")]
    async fn a_poll_that_times_out_panics_naming_what_and_the_deadline() {
        poll_until("the impossible", Duration::from_secs(1), || async { false }).await;
    }
}
