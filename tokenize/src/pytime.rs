//! `strftime_now` as transformers defines it: `datetime.now().strftime(format)`.
//!
//! kvroute renders in UTC: it equals the engine's rendering when the engine's local time zone is
//! UTC (the default in containers). The directives are glibc's for the C locale.

use std::sync::atomic::{AtomicI64, Ordering};

use minijinja::{Error, ErrorKind};

/// Sentinel for "not fixed: read the system clock".
const UNFIXED: i64 = i64::MIN;

/// The system clock, or a fixed time.
#[derive(Debug)]
pub(crate) struct Clock {
    fixed: AtomicI64,
}

impl Default for Clock {
    fn default() -> Self {
        Self {
            fixed: AtomicI64::new(UNFIXED),
        }
    }
}

impl Clock {
    pub(crate) fn fix(&self, unix_seconds: i64) {
        self.fixed.store(unix_seconds, Ordering::Relaxed);
    }

    /// Seconds since the Unix epoch.
    pub(crate) fn now(&self) -> i64 {
        match self.fixed.load(Ordering::Relaxed) {
            UNFIXED => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
            fixed => fixed,
        }
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A UTC calendar time.
struct Civil {
    year: i64,
    month: usize,
    day: i64,
    hour: i64,
    minute: i64,
    second: i64,
    /// 0 = Monday.
    weekday: usize,
    /// 1-based.
    yearday: i64,
}

fn civil(unix_seconds: i64) -> Civil {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    // Days to civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const BEFORE_MONTH: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let month_index = usize::try_from(month - 1).unwrap_or(0);
    let yearday = BEFORE_MONTH[month_index] + day + i64::from(leap && month > 2);
    Civil {
        year,
        month: month_index,
        day,
        hour: secs / 3600,
        minute: secs % 3600 / 60,
        second: secs % 60,
        // 1970-01-01 was a Thursday (3).
        weekday: usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0),
        yearday,
    }
}

/// Formats `unix_seconds` (UTC) with a C `strftime` format.
pub(crate) fn strftime(format: &str, unix_seconds: i64) -> Result<String, Error> {
    let t = civil(unix_seconds);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // glibc's `-` flag: no padding.
        let mut directive = chars.next();
        let unpadded = directive == Some('-');
        if unpadded {
            directive = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
        let text = match directive {
            Some('Y') => t.year.to_string(),
            Some('y') => num(t.year.rem_euclid(100), 2),
            Some('m') => num(t.month as i64 + 1, 2),
            Some('d') => num(t.day, 2),
            Some('e') => format!("{:>2}", t.day),
            Some('H') => num(t.hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(t.minute, 2),
            Some('S') => num(t.second, 2),
            Some('j') => num(t.yearday, 3),
            Some('p') => (if t.hour < 12 { "AM" } else { "PM" }).to_owned(),
            Some('B') => MONTHS[t.month].to_owned(),
            Some('b' | 'h') => MONTHS[t.month][..3].to_owned(),
            Some('A') => WEEKDAYS[t.weekday].to_owned(),
            Some('a') => WEEKDAYS[t.weekday][..3].to_owned(),
            Some('u') => (t.weekday + 1).to_string(),
            Some('w') => ((t.weekday + 1) % 7).to_string(),
            Some('F') => format!("{}-{:02}-{:02}", t.year, t.month + 1, t.day),
            Some('D') => format!(
                "{:02}/{:02}/{:02}",
                t.month + 1,
                t.day,
                t.year.rem_euclid(100)
            ),
            Some('T') => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
            Some('R') => format!("{:02}:{:02}", t.hour, t.minute),
            Some('Z') => "UTC".to_owned(),
            Some('z') => "+0000".to_owned(),
            Some('%') => "%".to_owned(),
            Some('n') => "\n".to_owned(),
            Some('t') => "\t".to_owned(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ));
            }
        };
        out.push_str(&text);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_python() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_309;
        assert_eq!(strftime("%Y-%m-%d", t).unwrap(), "2024-07-26");
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d %H:%M:%S %j %p %I", t).unwrap(),
            "Friday July 26 13:25:09 208 PM 01"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert!(strftime("%Q", t).is_err());
    }
}
