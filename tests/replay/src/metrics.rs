//! What a run measured. The first `warmup` share of requests (by arrival) fill caches and are
//! left out of every request metric; busy time covers the whole run.

use crate::BLOCK_TOKENS;
use crate::sim::RunResult;
use crate::trace::Request;

/// Metrics of one run (or their mean over seeds).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunMetrics {
    /// Requests measured.
    pub requests: usize,
    /// Prompt tokens found cached / prompt tokens.
    pub hit_rate: f64,
    /// TTFT percentiles and mean, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Mean.
    pub ttft_mean_ms: f64,
    /// Max over mean of per-replica busy time (1 = perfectly even).
    pub imbalance: f64,
    /// Σ predicted cached blocks / Σ actual, for routers that predict (NaN otherwise).
    pub predicted_over_actual: f64,
    /// Share of decisions whose predicted cached blocks were exactly right (NaN if none).
    pub prediction_exact: f64,
}

/// 1-based nearest rank of the `p`-th percentile of `n` values.
fn rank(n: usize, p: f64) -> usize {
    (((p / 100.0) * n as f64).ceil() as usize).clamp(1, n.max(1))
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[rank(sorted.len(), p) - 1]
}

/// How many of `n` values may exceed a threshold with their `p`-th percentile still within it.
pub fn allowed_above(n: usize, p: f64) -> usize {
    n.saturating_sub(rank(n, p))
}

/// Requests at the start of a list of `n` left out as warm-up.
pub fn warmup_skip(n: usize, warmup: f64) -> usize {
    ((n as f64) * warmup.clamp(0.0, 0.99)).floor() as usize
}

/// Measures a run.
pub fn measure(requests: &[Request], result: &RunResult, warmup: f64) -> RunMetrics {
    let skip = warmup_skip(requests.len(), warmup);
    let measured: Vec<(&Request, &crate::sim::RequestOutcome)> =
        requests.iter().zip(&result.outcomes).skip(skip).collect();
    let mut ttft: Vec<f64> = measured
        .iter()
        .map(|(_, o)| o.ttft_us as f64 / 1000.0)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let prompt: f64 = measured
        .iter()
        .map(|(r, _)| f64::from(r.input_tokens))
        .sum();
    let cached: f64 = measured
        .iter()
        .map(|(_, o)| f64::from(o.hit_blocks * BLOCK_TOKENS))
        .sum();
    let predictions: Vec<(u32, u32)> = measured
        .iter()
        .filter_map(|(_, o)| o.predicted_blocks.map(|p| (p, o.hit_blocks)))
        .collect();
    let (predicted_over_actual, prediction_exact) = if predictions.is_empty() {
        (f64::NAN, f64::NAN)
    } else {
        let predicted: f64 = predictions.iter().map(|(p, _)| f64::from(*p)).sum();
        let actual: f64 = predictions.iter().map(|(_, a)| f64::from(*a)).sum();
        let exact = predictions.iter().filter(|(p, a)| p == a).count();
        (
            if actual > 0.0 {
                predicted / actual
            } else {
                f64::NAN
            },
            exact as f64 / predictions.len() as f64,
        )
    };
    let busy: Vec<f64> = result.busy_us.iter().map(|b| *b as f64).collect();
    let mean_busy = busy.iter().sum::<f64>() / busy.len().max(1) as f64;
    let max_busy = busy.iter().copied().fold(0.0, f64::max);
    RunMetrics {
        requests: measured.len(),
        hit_rate: if prompt > 0.0 { cached / prompt } else { 0.0 },
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        ttft_mean_ms: ttft.iter().sum::<f64>() / ttft.len().max(1) as f64,
        imbalance: if mean_busy > 0.0 {
            max_busy / mean_busy
        } else {
            1.0
        },
        predicted_over_actual,
        prediction_exact,
    }
}

/// Token hit rate of per-request hit blocks, warm-up excluded.
pub fn hit_rate_of(requests: &[Request], hit_blocks: &[u32], warmup: f64) -> f64 {
    let skip = warmup_skip(requests.len(), warmup);
    let (cached, prompt) =
        requests
            .iter()
            .zip(hit_blocks)
            .skip(skip)
            .fold((0.0, 0.0), |(c, p), (r, h)| {
                (
                    c + f64::from(h * BLOCK_TOKENS),
                    p + f64::from(r.input_tokens),
                )
            });
    if prompt > 0.0 { cached / prompt } else { 0.0 }
}

/// Mean of each metric over runs (seeds).
pub fn mean(runs: &[RunMetrics]) -> RunMetrics {
    let n = runs.len().max(1) as f64;
    let avg = |f: fn(&RunMetrics) -> f64| runs.iter().map(f).sum::<f64>() / n;
    RunMetrics {
        requests: runs.first().map_or(0, |r| r.requests),
        hit_rate: avg(|r| r.hit_rate),
        ttft_p50_ms: avg(|r| r.ttft_p50_ms),
        ttft_p90_ms: avg(|r| r.ttft_p90_ms),
        ttft_p99_ms: avg(|r| r.ttft_p99_ms),
        ttft_mean_ms: avg(|r| r.ttft_mean_ms),
        imbalance: avg(|r| r.imbalance),
        predicted_over_actual: avg(|r| r.predicted_over_actual),
        prediction_exact: avg(|r| r.prediction_exact),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 5.0);
        assert_eq!(percentile(&v, 90.0), 9.0);
        assert_eq!(percentile(&v, 99.0), 10.0);
        assert!(percentile(&[], 50.0).is_nan());
        // p90 of 10 values is the 9th: one value may exceed a threshold the p90 meets.
        assert_eq!(allowed_above(10, 90.0), 1);
        assert_eq!(allowed_above(100, 90.0), 10);
        assert_eq!(allowed_above(0, 90.0), 0);
    }
}
