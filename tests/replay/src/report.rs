//! Output: markdown tables, CSV and SVG plots (hand-written SVG: no fonts or system libraries
//! needed, any browser renders it).

use std::fmt::Write as _;
use std::path::Path;

use crate::experiment::{Row, max_rate_within_slo};

fn cell(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "—".to_owned()
    } else {
        format!("{value:.decimals$}")
    }
}

/// One markdown table per workload × load point, then the SLO table.
pub fn markdown(rows: &[Row], slo_ms: f64) -> String {
    let mut out = String::new();
    let mut last: Option<(String, u64)> = None;
    for row in rows {
        let point = (row.workload.clone(), row.load.to_bits());
        if last.as_ref() != Some(&point) {
            let _ = write!(
                out,
                "\n### {} — load ×{} ({:.2} req/s)\n\n\
                 | router | hit rate | TTFT p50 ms | p90 ms | p99 ms | mean ms | imbalance | predicted/actual blocks | prediction exact |\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
                row.workload, row.load, row.rate_rps
            );
            last = Some(point);
        }
        let m = &row.mean;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.router,
            cell(m.hit_rate, 3),
            cell(m.ttft_p50_ms, 0),
            cell(m.ttft_p90_ms, 0),
            cell(m.ttft_p99_ms, 0),
            cell(m.ttft_mean_ms, 0),
            cell(m.imbalance, 2),
            cell(m.predicted_over_actual, 2),
            cell(m.prediction_exact, 2),
        );
    }
    let slo = max_rate_within_slo(rows, slo_ms);
    let mut workloads: Vec<&String> = Vec::new();
    for (w, _, _) in &slo {
        if !workloads.contains(&w) {
            workloads.push(w);
        }
    }
    let mut routers: Vec<&String> = Vec::new();
    for (_, r, _) in &slo {
        if !routers.contains(&r) {
            routers.push(r);
        }
    }
    let _ = write!(
        out,
        "\n### Highest tested arrival rate (req/s) with TTFT p90 ≤ {slo_ms} ms\n\n| router |"
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
            let best = slo
                .iter()
                .find(|(sw, sr, _)| sw == *w && sr == *r)
                .and_then(|(_, _, b)| *b);
            let _ = write!(
                out,
                " {} |",
                best.map_or("none".to_owned(), |b| format!("{b:.2}"))
            );
        }
        out.push('\n');
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

/// One plotted line: name, (x, y) points, dashed (a bound).
type Series = (String, Vec<(f64, f64)>, bool);

const PALETTE: [&str; 16] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#000000",
];

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
) {
    let (x0, y0) = origin;
    let (w, h) = size;
    let xs = Axis::new(
        series.iter().flat_map(|s| s.1.iter().map(|p| p.0)),
        false,
        x0 + 60.0,
        x0 + w - 10.0,
    );
    let ys = Axis::new(
        series.iter().flat_map(|s| s.1.iter().map(|p| p.1)),
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
    for (i, (_, points, dashed)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let path: Vec<String> = points
            .iter()
            .filter(|p| p.1.is_finite() && (!log_y || p.1 > 0.0))
            .map(|(x, y)| format!("{:.1},{:.1}", xs.map(*x), ys.map(*y)))
            .collect();
        if path.is_empty() {
            continue;
        }
        let dash = if *dashed {
            " stroke-dasharray=\"6,4\""
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>",
            path.join(" ")
        );
        for p in &path {
            let mut xy = p.split(',');
            if let (Some(x), Some(y)) = (xy.next(), xy.next()) {
                let _ = writeln!(
                    svg,
                    "<circle cx=\"{x}\" cy=\"{y}\" r=\"2.5\" fill=\"{color}\"/>"
                );
            }
        }
    }
}

/// An SVG with TTFT p90 vs rate (log scale) and hit rate vs rate for one workload.
pub fn svg_plot(rows: &[Row], workload: &str) -> String {
    let mut names: Vec<(String, bool)> = Vec::new();
    for row in rows.iter().filter(|r| r.workload == workload) {
        if !names.iter().any(|(n, _)| *n == row.router) {
            names.push((row.router.clone(), row.bound));
        }
    }
    let series = |metric: fn(&Row) -> f64, with_bounds: bool| -> Vec<Series> {
        names
            .iter()
            .map(|(name, bound)| {
                let points = if *bound && !with_bounds {
                    Vec::new()
                } else {
                    rows.iter()
                        .filter(|r| r.workload == workload && r.router == *name)
                        .map(|r| (r.rate_rps, metric(r)))
                        .collect()
                };
                (name.clone(), points, *bound)
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
        &format!("{workload}: TTFT p90 (ms, log)"),
        &series(|r| r.mean.ttft_p90_ms, false),
        true,
    );
    panel(
        &mut svg,
        (480.0, 0.0),
        (480.0, height),
        &format!("{workload}: token hit rate"),
        &series(|r| r.mean.hit_rate, true),
        false,
    );
    for (i, (name, bound)) in names.iter().enumerate() {
        let y = 40.0 + 18.0 * i as f64;
        let color = PALETTE[i % PALETTE.len()];
        let dash = if *bound {
            " stroke-dasharray=\"6,4\""
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            "<line x1=\"975\" y1=\"{y}\" x2=\"1000\" y2=\"{y}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
             <text x=\"1006\" y=\"{}\" font-size=\"12\">{name}</text>",
            y + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Writes `results.csv`, `results.md` and one `plot-<workload>.svg` per workload into `dir`.
pub fn write_all(dir: &Path, rows: &[Row], slo_ms: f64) -> std::io::Result<Vec<String>> {
    std::fs::create_dir_all(dir)?;
    let mut written = vec!["results.csv".to_owned(), "results.md".to_owned()];
    std::fs::write(dir.join("results.csv"), csv(rows))?;
    std::fs::write(dir.join("results.md"), markdown(rows, slo_ms))?;
    let mut workloads: Vec<&str> = Vec::new();
    for row in rows {
        if !workloads.contains(&row.workload.as_str()) {
            workloads.push(&row.workload);
        }
    }
    for workload in workloads {
        let name = format!("plot-{workload}.svg");
        std::fs::write(dir.join(&name), svg_plot(rows, workload))?;
        written.push(name);
    }
    Ok(written)
}
