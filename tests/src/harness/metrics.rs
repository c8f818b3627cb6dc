//! Reading what processes expose: Prometheus/OpenMetrics text (`/metrics` of kvroute, the sims
//! and vLLM) and `/proc/<pid>/status` — one parser of each for every test and bench.
//!
//! A sample line is `name{labels} value` or `name value`; comment lines (`#`) are skipped.
//! Families are matched by exact name (so `x_total` does not match `x_total_bytes`), labels by
//! substring (`reason="gap"`), which is how the tests name them.

/// The samples of `family` whose label set contains every one of `labels`, as
/// `(line, value)`.
pub fn samples<'a>(
    text: &'a str,
    family: &'a str,
    labels: &'a [&'a str],
) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(move |line| {
            line.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(move |line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| Some((line, line.rsplit(' ').next()?.parse::<f64>().ok()?)))
}

/// Sum of the samples of `family` whose labels contain every one of `labels` (0 when none).
pub fn sum(text: &str, family: &str, labels: &[&str]) -> f64 {
    samples(text, family, labels).map(|(_, value)| value).sum()
}

/// The value of the one sample written exactly `series` (`name{labels}` as exposed, or a bare
/// name); `None` when it is absent.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

/// The value of label `name` in a sample `line` as [`samples`] yields it (`family{a="x"} 1`);
/// `None` when the line has no such label. Values are kvroute's and the engines' label values:
/// no escaped quotes or commas.
pub fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let (_, labels) = line.split_once('{')?;
    let (labels, _) = labels.rsplit_once('}')?;
    labels.split(',').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key.trim() == name).then(|| value.trim().trim_matches('"'))
    })
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`), in KiB; `None` when the process or
/// the field is gone.
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x_total things\n\
        x_total{reason=\"gap\",replica=\"a\"} 2\n\
        x_total{reason=\"reset\",replica=\"a\"} 3\n\
        x_total_bytes 100\n\
        y 1.5\n";

    #[test]
    fn families_match_whole_names_and_labels_by_substring() {
        assert_eq!(sum(TEXT, "x_total", &[]), 5.0);
        assert_eq!(sum(TEXT, "x_total", &["reason=\"gap\""]), 2.0);
        assert_eq!(sum(TEXT, "x_total", &["replica=\"b\""]), 0.0);
        assert_eq!(sum(TEXT, "x_total_bytes", &[]), 100.0);
        assert_eq!(sample(TEXT, "y"), Some(1.5));
        assert_eq!(
            sample(TEXT, "x_total{reason=\"gap\",replica=\"a\"}"),
            Some(2.0)
        );
        assert_eq!(sample(TEXT, "x_total"), None);
    }

    #[test]
    fn labels_are_read_by_name() {
        let lines: Vec<&str> = samples(TEXT, "x_total", &[])
            .map(|(line, _)| line)
            .collect();
        assert_eq!(label(lines[0], "reason"), Some("gap"));
        assert_eq!(label(lines[1], "replica"), Some("a"));
        assert_eq!(label(lines[1], "replica_id"), None);
        assert_eq!(label("y 1.5", "reason"), None);
    }

    #[test]
    fn this_process_has_a_resident_set() {
        assert!(proc_status_kib(std::process::id(), "VmRSS").is_some_and(|kib| kib > 0));
        assert_eq!(proc_status_kib(std::process::id(), "NoSuchField"), None);
    }
}
