//! Query-side metrics of the service (ingest and index record their own).

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

/// Which API answered a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ApiLabel {
    pub(crate) api: &'static str,
}

/// Why a match was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct MatchErrorLabel {
    pub(crate) api: &'static str,
    pub(crate) reason: &'static str,
}

/// Match API metrics.
#[derive(Debug, Clone)]
pub(crate) struct ServerMetrics {
    match_duration: Family<ApiLabel, Histogram>,
    match_errors: Family<MatchErrorLabel, Counter>,
}

fn match_histogram() -> Histogram {
    // 1 µs .. ~33 ms: matches take microseconds; the tail shows lock contention.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-6, 2.0, 16,
    ))
}

impl ServerMetrics {
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = ServerMetrics {
            match_duration: Family::new_with_constructor(match_histogram),
            match_errors: Family::default(),
        };
        registry.register(
            "match_duration_seconds",
            "Time to compute one match in the index, by API",
            metrics.match_duration.clone(),
        );
        registry.register(
            "match_errors",
            "Match requests refused, by API and reason",
            metrics.match_errors.clone(),
        );
        metrics
    }

    pub(crate) fn observe_match(&self, api: &'static str, seconds: f64) {
        self.match_duration
            .get_or_create(&ApiLabel { api })
            .observe(seconds);
    }

    pub(crate) fn match_error(&self, api: &'static str, reason: &'static str) {
        self.match_errors
            .get_or_create(&MatchErrorLabel { api, reason })
            .inc();
    }
}
