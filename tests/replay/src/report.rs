//! Output: markdown tables, CSV and SVG plots (hand-written SVG: no fonts or system libraries
//! needed, any browser renders it).

use std::fmt::Write as _;
use std::path::Path;

use crate::experiment::{RegretRow, Row, SloBound, SloRate};
use crate::metrics::RunMetrics;
use crate::routers::RouterSpec;

fn cell(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "—".to_owned()
    } else {
        format!("{value:.decimals$}")
    }
}

/// Milliseconds: one decimal below 100 ms (where routers differ by fractions), whole above.
fn ms(value: f64) -> String {
    cell(value, if value < 100.0 { 1 } else { 0 })
}

/// A load factor as written: whole factors as given, the others (points past saturation) to two
/// decimals.
fn factor(load: f64) -> String {
    if load.fract() == 0.0 {
        format!("{load}")
    } else {
        format!("{load:.2}")
    }
}

/// The (workload, load) points of `rows`, in order.
fn points(rows: &[Row]) -> Vec<(String, f64)> {
    let mut points: Vec<(String, f64)> = Vec::new();
    for row in rows {
        if !points
            .iter()
            .any(|(w, l)| *w == row.workload && l.to_bits() == row.load.to_bits())
        {
            points.push((row.workload.clone(), row.load));
        }
    }
    points
}

/// The rows of one (workload, load) point.
fn rows_at<'a>(rows: &'a [Row], workload: &'a str, load: f64) -> impl Iterator<Item = &'a Row> {
    rows.iter()
        .filter(move |r| r.workload == workload && r.load.to_bits() == load.to_bits())
}

fn is_anchor(router: &str) -> bool {
    RouterSpec::parse(router).is_some_and(|spec| spec.is_anchor())
}

/// Whether a row of `workload` at `load` begins a new load point after `last` (which it becomes):
/// each point's rows get one heading.
fn starts_a_point(last: &mut Option<(String, u64)>, workload: &str, load: f64) -> bool {
    let point = (workload, load.to_bits());
    if last
        .as_ref()
        .is_some_and(|(w, l)| (w.as_str(), *l) == point)
    {
        return false;
    }
    *last = Some((workload.to_owned(), point.1));
    true
}

/// One markdown table per workload × load point: each router's decisions against the exact
/// simulation of every replica ([`crate::routers::Regret`]).
pub fn regret_markdown(rows: &[RegretRow]) -> String {
    let mut out = String::new();
    let mut last = None;
    for row in rows {
        if starts_a_point(&mut last, &row.workload, row.load) {
            let _ = write!(
                out,
                "\n### {} — load ×{}: decisions against the soonest first token\n\n\
                 | router | decisions | within {:.0} % | mean delay ms | off, more cached: share / mean ms | off, less cached | off, same cached |\n\
                 |---|---:|---:|---:|---:|---:|---:|\n",
                row.workload,
                factor(row.load),
                crate::routers::OFF_BY * 100.0
            );
        }
        let s = &row.stats;
        let share = |n: usize| {
            if s.decisions == 0 {
                0.0
            } else {
                100.0 * n as f64 / s.decisions as f64
            }
        };
        let class = |off: &crate::routers::Off| {
            format!("{:.1} % / {:.1}", share(off.decisions), off.mean_ms())
        };
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} % | {:.1} | {} | {} | {} |",
            row.router,
            s.decisions,
            share(s.within()),
            s.all.mean_ms(),
            class(&s.more_cached),
            class(&s.less_cached),
            class(&s.same_cached),
        );
    }
    out
}

/// One markdown table per workload × load point, the verdict against the aim, then the
/// max-rate table.
pub fn markdown(rows: &[Row], slo: &[SloRate], slo_ms: f64) -> String {
    let mut out = String::new();
    let mut last = None;
    for row in rows {
        if starts_a_point(&mut last, &row.workload, row.load) {
            let _ = write!(
                out,
                "\n### {} — load ×{} ({:.2} req/s)\n\n\
                 | router | hit rate | TTFT p50 ms | p90 ms | p99 ms | mean ms | imbalance | predicted/actual blocks | prediction exact |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
                row.workload,
                factor(row.load),
                row.rate_rps
            );
        }
        let m = &row.mean;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.router,
            cell(m.hit_rate, 3),
            ms(m.ttft_p50_ms),
            ms(m.ttft_p90_ms),
            ms(m.ttft_p99_ms),
            ms(m.ttft_mean_ms),
            cell(m.imbalance, 2),
            cell(m.predicted_over_actual, 2),
            cell(m.prediction_exact, 2),
        );
    }
    out.push_str(&verdict(rows));
    out.push_str(&same_bar(rows));
    out.push_str(&slo_table(slo, slo_ms));
    out
}

/// kvroute against the aim at every point: TTFT p90 below every anchor (llm-d, SGLang,
/// Dynamo, every variant), within 1.2× the oracle, hit rate ≥ 0.9× pooled LRU, imbalance ≤ 1.2.
/// Beside the means, the same seeds compared pairwise ([`PairedRatio`]): how many seeds kvroute's
/// p90 is at or below the best anchor's, and the per-seed ratio's mean with its 95 % interval —
/// a mean ratio whose interval spans 1 is within what the seeds' own spread can tell apart.
fn verdict(rows: &[Row]) -> String {
    let mut out = String::from(
        "\n### kvroute against the aim\n\n\
         | workload | load | kvroute p90 ms | best anchor (p90 ms) | p90 < every anchor | seeds at or below it | per-seed ratio (95 % interval) | p90 / oracle | hit / pooled LRU | imbalance |\n\
         |---|---:|---:|---|:---:|---:|---:|---:|---:|---:|\n",
    );
    for (workload, load) in points(rows) {
        let at: Vec<&Row> = rows_at(rows, &workload, load).collect();
        let find = |name: &str| at.iter().find(|r| r.router == name).map(|r| r.mean);
        let Some(kvroute) = find("kvroute") else {
            continue;
        };
        let anchor = at
            .iter()
            .filter(|r| is_anchor(&r.router))
            .min_by(|a, b| a.mean.ttft_p90_ms.total_cmp(&b.mean.ttft_p90_ms));
        let oracle = find("oracle").map_or(f64::NAN, |m| m.ttft_p90_ms);
        let pooled = find("bound-pooled-lru").map_or(f64::NAN, |m| m.hit_rate);
        let (anchor_cell, wins) = match anchor {
            Some(a) => (
                format!("{} ({})", a.router, ms(a.mean.ttft_p90_ms)),
                if kvroute.ttft_p90_ms < a.mean.ttft_p90_ms {
                    "yes"
                } else {
                    "no"
                },
            ),
            None => ("—".to_owned(), "—"),
        };
        let kvroute_seeds = at
            .iter()
            .find(|r| r.router == "kvroute")
            .map_or(&[][..], |r| &r.seeds[..]);
        let paired = anchor.and_then(|a| PairedRatio::of(kvroute_seeds, &a.seeds));
        let (seeds_cell, ratio_cell) = paired.map_or(("—".to_owned(), "—".to_owned()), |p| {
            (
                format!("{} of {}", p.at_or_below, p.seeds),
                format!("{:.3} ({:.3}–{:.3})", p.mean, p.low, p.high),
            )
        });
        let _ = writeln!(
            out,
            "| {workload} | ×{} | {} | {anchor_cell} | {wins} | {seeds_cell} | {ratio_cell} | {} | {} | {} |",
            factor(load),
            ms(kvroute.ttft_p90_ms),
            cell(kvroute.ttft_p90_ms / oracle, 2),
            cell(kvroute.hit_rate / pooled, 2),
            cell(kvroute.imbalance, 2),
        );
    }
    out
}

/// Every router held to the bar [`verdict`] holds kvroute to: at how many points its mean TTFT
/// p90 is at or below the lowest of the anchors other than itself, and which points it misses.
/// Where several routers tie (every cache-aware one at a cache bound, the oracle included), the
/// lowest of the others is the luckiest draw among equals and each of them misses about half
/// the points: the bar there says nothing about routing.
fn same_bar(rows: &[Row]) -> String {
    let points = points(rows);
    let mut routers: Vec<&str> = Vec::new();
    for row in rows.iter().filter(|r| !r.bound) {
        if !routers.contains(&row.router.as_str()) {
            routers.push(&row.router);
        }
    }
    let mut out = String::from(
        "\n### Every router against the best of the anchors other than itself\n\n\
         | router | points at or below it | points above it (its p90 over the best other anchor's) |\n\
         |---|---:|---|\n",
    );
    for router in routers {
        let (mut met, mut held) = (0, 0);
        let mut missed = Vec::new();
        for (workload, load) in &points {
            let at = || rows_at(rows, workload, *load);
            let Some(own) = at().find(|r| r.router == router) else {
                continue;
            };
            let Some(best) = at()
                .filter(|r| r.router != router && is_anchor(&r.router))
                .map(|r| r.mean.ttft_p90_ms)
                .min_by(f64::total_cmp)
            else {
                continue;
            };
            held += 1;
            if own.mean.ttft_p90_ms <= best {
                met += 1;
            } else {
                missed.push(format!(
                    "{workload} ×{} ({:.3})",
                    factor(*load),
                    own.mean.ttft_p90_ms / best
                ));
            }
        }
        if held > 0 {
            let _ = writeln!(
                out,
                "| {router} | {met} of {held} | {} |",
                missed.join(", ")
            );
        }
    }
    out
}

/// kvroute's TTFT p90 over another router's, seed by seed (the same seed replays the same
/// arrivals and draws the same generated workload for both, so the pairs share their luck).
#[derive(Debug, Clone, Copy, PartialEq)]
struct PairedRatio {
    seeds: usize,
    /// Seeds where kvroute's p90 is at or below the other's.
    at_or_below: usize,
    /// Mean of the per-seed ratios.
    mean: f64,
    /// Two-sided 95 % interval of that mean (Student's t over the seeds).
    low: f64,
    high: f64,
}

impl PairedRatio {
    /// `None` without two comparable seeds.
    fn of(kvroute: &[RunMetrics], other: &[RunMetrics]) -> Option<Self> {
        let ratios: Vec<f64> = kvroute
            .iter()
            .zip(other)
            .map(|(k, o)| k.ttft_p90_ms / o.ttft_p90_ms)
            .filter(|r| r.is_finite())
            .collect();
        let seeds = ratios.len();
        if seeds < 2 {
            return None;
        }
        let n = seeds as f64;
        let mean = ratios.iter().sum::<f64>() / n;
        let variance = ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0);
        let half = student_t_975(seeds - 1) * (variance / n).sqrt();
        Some(Self {
            seeds,
            at_or_below: ratios.iter().filter(|&&r| r <= 1.0).count(),
            mean,
            low: mean - half,
            high: mean + half,
        })
    }
}

/// Student's t distribution's 97.5th percentile for `df` degrees of freedom (two-sided 95 %);
/// the normal's 1.96 past 30.
fn student_t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    df.checked_sub(1)
        .and_then(|i| TABLE.get(i))
        .copied()
        .unwrap_or(1.96)
}

/// The max-rate table: router rows, workload columns.
fn slo_table(slo: &[SloRate], slo_ms: f64) -> String {
    let mut workloads: Vec<&str> = Vec::new();
    let mut routers: Vec<&str> = Vec::new();
    for rate in slo {
        if !workloads.contains(&rate.workload.as_str()) {
            workloads.push(&rate.workload);
        }
        if !routers.contains(&rate.router.as_str()) {
            routers.push(&rate.router);
        }
    }
    let mut out = format!(
        "\n### Highest arrival rate (req/s) with TTFT p90 ≤ {slo_ms} ms in every seed\n\n\
         Bisected between load points to within {:.0}%; `<` = missed already at the lowest load \
         point, `≥` = still met at the search's ceiling.\n\n| router |",
        (crate::experiment::SLO_SEARCH_PRECISION - 1.0) * 100.0
    );
    for w in &workloads {
        let _ = write!(out, " {w} |");
    }
    out.push_str("\n|---|");
    for _ in &workloads {
        out.push_str("---:|");
    }
    out.push('\n');
    for r in &routers {
        let _ = write!(out, "| {r} |");
        for w in &workloads {
            let text = slo
                .iter()
                .find(|s| s.workload == *w && s.router == *r)
                .map_or("—".to_owned(), |s| match s.rate {
                    SloBound::Between { met_at, .. } => format!("{met_at:.1}"),
                    SloBound::Below(rate) => format!("< {rate:.1}"),
                    SloBound::Above(rate) => format!("≥ {rate:.1}"),
                });
            let _ = write!(out, " {text} |");
        }
        out.push('\n');
    }
    out
}

/// The max-rate search as CSV.
pub fn slo_csv(slo: &[SloRate]) -> String {
    let mut out = String::from("workload,router,met_at_rps,missed_at_rps\n");
    for rate in slo {
        let (met, missed) = match rate.rate {
            SloBound::Between { met_at, missed_at } => (met_at, missed_at),
            SloBound::Below(rate) => (f64::NAN, rate),
            SloBound::Above(rate) => (rate, f64::NAN),
        };
        let _ = writeln!(
            out,
            "{},{},{met:.3},{missed:.3}",
            rate.workload, rate.router
        );
    }
    out
}

/// Per-seed and mean rows as CSV.
pub fn csv(rows: &[Row]) -> String {
    let mut out = String::from(
        "workload,load,rate_rps,router,seed,requests,hit_rate,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,ttft_mean_ms,imbalance,predicted_over_actual,prediction_exact\n",
    );
    for row in rows {
        let seeds = row
            .seeds
            .iter()
            .enumerate()
            .map(|(i, m)| (i.to_string(), m))
            .chain(std::iter::once(("mean".to_owned(), &row.mean)));
        for (seed, m) in seeds {
            let _ = writeln!(
                out,
                "{},{},{:.4},{},{},{},{:.5},{:.2},{:.2},{:.2},{:.2},{:.4},{:.4},{:.4}",
                row.workload,
                row.load,
                row.rate_rps,
                row.router,
                seed,
                m.requests,
                m.hit_rate,
                m.ttft_p50_ms,
                m.ttft_p90_ms,
                m.ttft_p99_ms,
                m.ttft_mean_ms,
                m.imbalance,
                m.predicted_over_actual,
                m.prediction_exact
            );
        }
    }
    out
}

/// A point marker's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Marker {
    Circle,
    Square,
    TriangleUp,
    TriangleDown,
    Diamond,
    Cross,
    Plus,
}

impl Marker {
    /// Every shape, for routers without a fixed style.
    const ALL: [Marker; 7] = [
        Marker::Circle,
        Marker::Square,
        Marker::TriangleUp,
        Marker::TriangleDown,
        Marker::Diamond,
        Marker::Cross,
        Marker::Plus,
    ];

    /// The marker at (x, y), filled or hollow (hollow: the value is beyond the axis cap).
    fn svg(self, x: f64, y: f64, color: &str, hollow: bool) -> String {
        let r = 4.0;
        let paint = if hollow {
            format!("fill=\"white\" stroke=\"{color}\" stroke-width=\"1.5\"")
        } else {
            format!("fill=\"{color}\" stroke=\"{color}\"")
        };
        let polygon = |points: &[(f64, f64)]| {
            let points: Vec<String> = points
                .iter()
                .map(|(dx, dy)| format!("{:.1},{:.1}", x + dx, y + dy))
                .collect();
            format!("<polygon points=\"{}\" {paint}/>", points.join(" "))
        };
        match self {
            Marker::Circle => format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{r}\" {paint}/>"),
            Marker::Square => polygon(&[(-r, -r), (r, -r), (r, r), (-r, r)]),
            Marker::TriangleUp => polygon(&[(0.0, -r - 1.0), (r + 1.0, r), (-r - 1.0, r)]),
            Marker::TriangleDown => polygon(&[(0.0, r + 1.0), (r + 1.0, -r), (-r - 1.0, -r)]),
            Marker::Diamond => polygon(&[
                (0.0, -r - 1.0),
                (r + 1.0, 0.0),
                (0.0, r + 1.0),
                (-r - 1.0, 0.0),
            ]),
            Marker::Cross | Marker::Plus => {
                let (a, b) = if self == Marker::Cross {
                    ((-r, -r, r, r), (-r, r, r, -r))
                } else {
                    ((-r - 1.0, 0.0, r + 1.0, 0.0), (0.0, -r - 1.0, 0.0, r + 1.0))
                };
                let width = if hollow { 1.5 } else { 2.5 };
                [a, b]
                    .iter()
                    .map(|(x1, y1, x2, y2)| {
                        format!(
                            "<line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{color}\" stroke-width=\"{width}\"/>",
                            x + x1,
                            y + y1,
                            x + x2,
                            y + y2
                        )
                    })
                    .collect()
            }
        }
    }
}

/// How a line is drawn.
#[derive(Debug, Clone, Copy)]
struct Style {
    color: &'static str,
    width: f64,
    /// SVG `stroke-dasharray`, if any.
    dash: Option<&'static str>,
    marker: Marker,
}

/// One plotted line: name, (x, y) points, style.
type Series = (String, Vec<(f64, f64)>, Style);

/// Colours for routers without a fixed style (distinct from every fixed one).
const SPARE_COLORS: [&str; 4] = ["#ad494a", "#e7969c", "#8ca252", "#de9ed6"];

/// Each router's own colour and marker, no two alike: kvroute thick black, the oracle dotted
/// grey, the bounds dashed light grey; a router not listed (another Dynamo weight) gets a spare
/// colour and a marker by position.
fn style(name: &str, index: usize) -> Style {
    let fixed = |color, marker| Style {
        color,
        width: 2.0,
        dash: None,
        marker,
    };
    match name {
        "random" => fixed("#1f77b4", Marker::Circle),
        "round-robin" => fixed("#ff7f0e", Marker::Square),
        "least-loaded" => fixed("#2ca02c", Marker::TriangleUp),
        "session-hash" => fixed("#d62728", Marker::Diamond),
        "chwbl" => fixed("#9467bd", Marker::TriangleDown),
        "sglang" => fixed("#8c564b", Marker::Square),
        "llmd" => fixed("#e377c2", Marker::Circle),
        "llmd-spec" => fixed("#17becf", Marker::TriangleUp),
        "dynamo-w0.5" => fixed("#bcbd22", Marker::Diamond),
        "dynamo-w1" => fixed("#637939", Marker::Cross),
        "dynamo-w2" => fixed("#393b79", Marker::Plus),
        "kvroute" => Style {
            color: "#000000",
            width: 3.5,
            dash: None,
            marker: Marker::Circle,
        },
        "oracle" => Style {
            color: "#555555",
            width: 2.0,
            dash: Some("2,3"),
            marker: Marker::Square,
        },
        "bound-pooled-lru" => Style {
            color: "#999999",
            width: 2.0,
            dash: Some("8,4"),
            marker: Marker::TriangleDown,
        },
        "bound-infinite" => Style {
            color: "#bbbbbb",
            width: 2.0,
            dash: Some("8,4"),
            marker: Marker::Diamond,
        },
        _ => Style {
            color: SPARE_COLORS[index % SPARE_COLORS.len()],
            width: 2.0,
            dash: Some("5,2"),
            marker: Marker::ALL[index % Marker::ALL.len()],
        },
    }
}

fn stroke(style: Style) -> String {
    let dash = style
        .dash
        .map_or(String::new(), |d| format!(" stroke-dasharray=\"{d}\""));
    format!(
        "stroke=\"{}\" stroke-width=\"{}\"{dash}",
        style.color, style.width
    )
}

/// A linear or log axis mapping data to pixels.
struct Axis {
    min: f64,
    max: f64,
    log: bool,
    from: f64,
    to: f64,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: bool, from: f64, to: f64) -> Axis {
        let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
            min = min.min(v);
            max = max.max(v);
        }
        if !min.is_finite() {
            (min, max) = (if log { 1.0 } else { 0.0 }, 1.0);
        }
        if log {
            min = 10f64.powf(min.log10().floor());
            max = 10f64.powf(max.log10().ceil().max(min.log10() + 1.0));
        } else if max - min < 1e-9 {
            max = min + 1.0;
        }
        Axis {
            min,
            max,
            log,
            from,
            to,
        }
    }

    fn map(&self, v: f64) -> f64 {
        let t = if self.log {
            (v.max(self.min).log10() - self.min.log10()) / (self.max.log10() - self.min.log10())
        } else {
            (v - self.min) / (self.max - self.min)
        };
        self.from + t * (self.to - self.from)
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut ticks = Vec::new();
            let mut t = self.min;
            while t <= self.max * 1.0001 {
                ticks.push(t);
                t *= 10.0;
            }
            ticks
        } else {
            (0..=5)
                .map(|i| self.min + (self.max - self.min) * f64::from(i) / 5.0)
                .collect()
        }
    }
}

/// One panel: series of (x, y) per router.
fn panel(
    svg: &mut String,
    origin: (f64, f64),
    size: (f64, f64),
    title: &str,
    series: &[Series],
    log_y: bool,
    cap: Option<f64>,
) {
    let (x0, y0) = origin;
    let capped = |v: f64| cap.map_or(v, |c| v.min(c));
    let (w, h) = size;
    let xs = Axis::new(
        series.iter().flat_map(|s| s.1.iter().map(|p| p.0)),
        false,
        x0 + 60.0,
        x0 + w - 10.0,
    );
    let ys = Axis::new(
        series
            .iter()
            .flat_map(|s| s.1.iter().map(|p| capped(p.1)))
            .chain(cap),
        log_y,
        y0 + h - 40.0,
        y0 + 30.0,
    );
    let _ = write!(
        svg,
        "<text x=\"{}\" y=\"{}\" font-size=\"14\" text-anchor=\"middle\">{title}</text>\n\
         <rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>\n",
        x0 + w / 2.0,
        y0 + 18.0,
        xs.from,
        ys.to,
        xs.to - xs.from,
        ys.from - ys.to
    );
    for t in xs.ticks() {
        let x = xs.map(t);
        let _ = writeln!(
            svg,
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{t:.1}</text>",
            ys.to,
            ys.from,
            ys.from + 14.0
        );
    }
    for t in ys.ticks() {
        let y = ys.map(t);
        let label = if log_y {
            format!("{t}")
        } else {
            format!("{t:.2}")
        };
        let _ = writeln!(
            svg,
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"end\">{label}</text>",
            xs.from,
            xs.to,
            xs.from - 4.0,
            y + 3.0
        );
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">arrival rate (req/s)</text>",
        (xs.from + xs.to) / 2.0,
        ys.from + 30.0
    );
    if let Some(cap) = cap {
        let y = ys.map(cap);
        let _ = writeln!(
            svg,
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#c00\" stroke-dasharray=\"4,4\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" fill=\"#c00\" text-anchor=\"end\">cap (hollow: beyond)</text>",
            xs.from,
            xs.to,
            xs.to - 4.0,
            y - 4.0
        );
    }
    for (_, points, style) in series {
        let shown: Vec<(f64, f64, bool)> = points
            .iter()
            .filter(|p| p.1.is_finite() && (!log_y || p.1 > 0.0))
            .map(|(x, y)| {
                let beyond = cap.is_some_and(|c| *y > c);
                (xs.map(*x), ys.map(capped(*y)), beyond)
            })
            .collect();
        if shown.is_empty() {
            continue;
        }
        let path: Vec<String> = shown
            .iter()
            .map(|(x, y, _)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            svg,
            "<polyline points=\"{}\" fill=\"none\" {}/>",
            path.join(" "),
            stroke(*style)
        );
        for (x, y, beyond) in &shown {
            let _ = writeln!(svg, "{}", style.marker.svg(*x, *y, style.color, *beyond));
        }
    }
}

/// How far above the objective the TTFT axis reaches: a baseline beyond it is drawn on the cap
/// (hollow markers) instead of stretching the log axis over everyone else.
pub const TTFT_AXIS_CAP_OVER_SLO: f64 = 4.0;

/// An SVG with TTFT p90 vs rate (log scale, capped at [`TTFT_AXIS_CAP_OVER_SLO`] × the
/// objective) and hit rate vs rate for one workload; every router has its own colour and
/// marker.
pub fn svg_plot(rows: &[Row], workload: &str, slo_ms: f64) -> String {
    let mut names: Vec<(String, bool)> = Vec::new();
    for row in rows.iter().filter(|r| r.workload == workload) {
        if !names.iter().any(|(n, _)| *n == row.router) {
            names.push((row.router.clone(), row.bound));
        }
    }
    let styles: Vec<Style> = names
        .iter()
        .enumerate()
        .map(|(i, (name, _))| style(name, i))
        .collect();
    let series = |metric: fn(&Row) -> f64, with_bounds: bool| -> Vec<Series> {
        names
            .iter()
            .zip(&styles)
            .map(|((name, bound), style)| {
                let points = if *bound && !with_bounds {
                    Vec::new()
                } else {
                    rows.iter()
                        .filter(|r| r.workload == workload && r.router == *name)
                        .map(|r| (r.rate_rps, metric(r)))
                        .collect()
                };
                (name.clone(), points, *style)
            })
            .collect()
    };
    let (width, height) = (1200.0, 480.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    panel(
        &mut svg,
        (0.0, 0.0),
        (480.0, height),
        &format!(
            "{workload}: TTFT p90 (ms, log, capped at {:.0})",
            slo_ms * TTFT_AXIS_CAP_OVER_SLO
        ),
        &series(|r| r.mean.ttft_p90_ms, false),
        true,
        (slo_ms.is_finite() && slo_ms > 0.0).then_some(slo_ms * TTFT_AXIS_CAP_OVER_SLO),
    );
    panel(
        &mut svg,
        (480.0, 0.0),
        (480.0, height),
        &format!("{workload}: token hit rate"),
        &series(|r| r.mean.hit_rate, true),
        false,
        None,
    );
    for (i, ((name, _), style)) in names.iter().zip(&styles).enumerate() {
        let y = 40.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"975\" y1=\"{y}\" x2=\"1000\" y2=\"{y}\" {}/>{}\
             <text x=\"1006\" y=\"{}\" font-size=\"12\">{name}</text>",
            stroke(*style),
            style.marker.svg(987.5, y, style.color, false),
            y + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Writes `results.csv`, `slo.csv`, `results.md` and one `plot-<workload>.svg` per workload
/// into `dir`.
pub fn write_all(
    dir: &Path,
    rows: &[Row],
    slo: &[SloRate],
    slo_ms: f64,
) -> std::io::Result<Vec<String>> {
    std::fs::create_dir_all(dir)?;
    let mut written = vec![
        "results.csv".to_owned(),
        "slo.csv".to_owned(),
        "results.md".to_owned(),
    ];
    std::fs::write(dir.join("results.csv"), csv(rows))?;
    std::fs::write(dir.join("slo.csv"), slo_csv(slo))?;
    std::fs::write(dir.join("results.md"), markdown(rows, slo, slo_ms))?;
    let mut workloads: Vec<&str> = Vec::new();
    for row in rows {
        if !workloads.contains(&row.workload.as_str()) {
            workloads.push(&row.workload);
        }
    }
    for workload in workloads {
        let name = format!("plot-{workload}.svg");
        std::fs::write(dir.join(&name), svg_plot(rows, workload, slo_ms))?;
        written.push(name);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_seeds_tell_a_tie_from_a_loss() {
        let p90 = |values: &[f64]| -> Vec<RunMetrics> {
            values
                .iter()
                .map(|&ttft_p90_ms| RunMetrics {
                    ttft_p90_ms,
                    ..RunMetrics::default()
                })
                .collect()
        };
        // Ahead in half the seeds, behind in the others: the interval spans 1.
        let tie = PairedRatio::of(&p90(&[99.0, 102.0, 98.0, 103.0]), &p90(&[100.0; 4]));
        let tie = tie.expect("four seeds");
        assert_eq!((tie.seeds, tie.at_or_below), (4, 2));
        assert!(tie.low < 1.0 && tie.high > 1.0, "{tie:?}");
        // Behind in every seed by about the same: the interval is above 1.
        let loss = PairedRatio::of(&p90(&[105.0, 104.0, 106.0, 105.0]), &p90(&[100.0; 4]));
        let loss = loss.expect("four seeds");
        assert_eq!(loss.at_or_below, 0);
        assert!(loss.low > 1.0, "{loss:?}");
        assert!((loss.mean - 1.05).abs() < 1e-9);
        assert_eq!(
            PairedRatio::of(&p90(&[1.0]), &p90(&[1.0])),
            None,
            "one seed"
        );
        assert_eq!(student_t_975(5), 2.571);
        assert_eq!(student_t_975(100), 1.96);
    }

    #[test]
    fn every_router_is_held_to_the_best_of_the_other_anchors() {
        let row = |router: &str, load: f64, ttft_p90_ms: f64| Row {
            workload: "w".to_owned(),
            load,
            rate_rps: load,
            router: router.to_owned(),
            bound: false,
            mean: RunMetrics {
                ttft_p90_ms,
                ..RunMetrics::default()
            },
            seeds: Vec::new(),
        };
        // At ×1 three routers tie but for the seeds' luck; at ×2 kvroute is clearly ahead.
        let rows = [
            row("kvroute", 1.0, 100.2),
            row("sglang", 1.0, 100.0),
            row("llmd", 1.0, 100.1),
            row("round-robin", 1.0, 300.0),
            row("kvroute", 2.0, 90.0),
            row("sglang", 2.0, 120.0),
            row("llmd", 2.0, 110.0),
            row("round-robin", 2.0, 400.0),
        ];
        let table = same_bar(&rows);
        assert!(
            table.contains("| kvroute | 1 of 2 | w ×1 (1.002) |"),
            "{table}"
        );
        assert!(
            table.contains("| sglang | 1 of 2 | w ×2 (1.091) |"),
            "{table}"
        );
        assert!(
            table.contains("| llmd | 1 of 2 | w ×1 (1.001) |"),
            "{table}"
        );
        assert!(table.contains("| round-robin | 0 of 2 |"), "{table}");
    }

    #[test]
    fn every_router_and_bound_has_its_own_colour_and_marker() {
        let mut names: Vec<String> = RouterSpec::all().iter().map(RouterSpec::name).collect();
        names.extend(["bound-pooled-lru".to_owned(), "bound-infinite".to_owned()]);
        let styles: Vec<Style> = names.iter().enumerate().map(|(i, n)| style(n, i)).collect();
        for (i, a) in styles.iter().enumerate() {
            for (j, b) in styles.iter().enumerate().skip(i + 1) {
                assert_ne!(a.color, b.color, "{} and {}", names[i], names[j]);
            }
        }
        // Markers repeat only across clearly different colours; no two routers share both.
        let pairs: std::collections::HashSet<(&str, Marker)> =
            styles.iter().map(|s| (s.color, s.marker)).collect();
        assert_eq!(pairs.len(), styles.len());
    }

    #[test]
    fn ttft_axis_is_capped_and_beyond_points_are_hollow() {
        let row = |router: &str, rate_rps: f64, p90: f64| Row {
            workload: "w".to_owned(),
            load: 1.0,
            rate_rps,
            router: router.to_owned(),
            bound: false,
            mean: RunMetrics {
                requests: 1,
                hit_rate: 0.5,
                ttft_p50_ms: p90,
                ttft_p90_ms: p90,
                ttft_p99_ms: p90,
                ttft_mean_ms: p90,
                imbalance: 1.0,
                predicted_over_actual: f64::NAN,
                prediction_exact: f64::NAN,
            },
            seeds: Vec::new(),
        };
        let rows = [
            row("kvroute", 1.0, 300.0),
            row("kvroute", 2.0, 500.0),
            row("session-hash", 1.0, 900_000.0),
            row("session-hash", 2.0, 2_000_000.0),
        ];
        let svg = svg_plot(&rows, "w", 2000.0);
        assert!(
            svg.contains("capped at 8000"),
            "the title says the axis is capped"
        );
        // The top tick is the cap's decade, not the outlier's.
        assert!(svg.contains(">10000<") && !svg.contains(">1000000<"));
        assert!(
            svg.contains("fill=\"white\" stroke=\"#d62728\""),
            "outliers drawn hollow"
        );
        assert!(!svg.contains("fill=\"white\" stroke=\"#000000\""));
    }
}
