//! `/metrics` in vLLM's Prometheus text, or SGLang's with `--engine sglang` (the Python client's
//! layout: counters as `_total` plus `_created`, label values from config only).

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::engine::{Engine, EngineCounters, EngineGauges};

/// Reads one gauge of a rank.
type GaugeOf = fn(&EngineGauges) -> f64;
/// Picks one counter of a rank.
type CounterOf = fn(&EngineCounters) -> &AtomicU64;

/// Static facts shown in `vllm:cache_config_info` and on every series.
#[derive(Debug, Clone)]
pub(crate) struct MetricsInfo {
    /// `--prefix-caching-hash-algo`.
    pub(crate) hash_algo: String,
    /// Process start, Unix seconds (the `_created` samples).
    pub(crate) created: f64,
    /// Whose names and labels the series take.
    pub(crate) engine: kvroute_config::Engine,
}

impl MetricsInfo {
    /// Every rank's series in the engine family's layout.
    pub(crate) fn render(&self, engines: &[Arc<Engine>], model_name: &str) -> String {
        match self.engine {
            kvroute_config::Engine::Vllm => self.render_vllm(engines, model_name),
            kvroute_config::Engine::Sglang => self.render_sglang(engines, model_name),
        }
    }

    /// SGLang 0.5.23's scheduler and request series as `--enable-metrics` exports them
    /// (`srt/observability/metrics_collector.py`): labels `model_name`, `engine_type`, `tp_rank`,
    /// `pp_rank`, `moe_ep_rank`, and `dp_rank` under data parallelism; cached prompt tokens by
    /// `cache_source`, a series that appears with the first hit; prompt tokens by
    /// `is_streaming` (all `false` here).
    fn render_sglang(&self, engines: &[Arc<Engine>], model_name: &str) -> String {
        let model = escape(model_name);
        let labels: Vec<String> = (0..engines.len())
            .map(|rank| {
                let dp_rank = if engines.len() > 1 {
                    format!(",dp_rank=\"{rank}\"")
                } else {
                    String::new()
                };
                format!(
                    "model_name=\"{model}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",\
                     moe_ep_rank=\"0\"{dp_rank}"
                )
            })
            .collect();
        let mut out = String::new();
        let gauges: Vec<_> = engines.iter().map(|engine| engine.gauges()).collect();
        let gauge_list: [(&str, &str, GaugeOf); 3] = [
            (
                "sglang:num_running_reqs",
                "The number of running requests.",
                |g| g.running as f64,
            ),
            (
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
                |g| g.waiting as f64,
            ),
            ("sglang:token_usage", "The token usage.", |g| {
                g.kv_cache_usage
            }),
        ];
        write_gauges(&mut out, &gauge_list, &labels, &gauges);
        let counters: [(&str, &str, &str, CounterOf); 4] = [
            (
                "sglang:num_requests",
                "The number of processed requests.",
                "is_streaming=\"false\"",
                |c| &c.requests_finished,
            ),
            (
                "sglang:prompt_tokens",
                "Number of prefill tokens processed.",
                "is_streaming=\"false\"",
                |c| &c.prompt_tokens,
            ),
            (
                "sglang:generation_tokens",
                "Number of generation tokens processed.",
                "is_streaming=\"false\"",
                |c| &c.generation_tokens,
            ),
            (
                "sglang:cached_tokens",
                "Number of cached prompt tokens by source (device/host/storage).",
                "cache_source=\"device\"",
                |c| &c.prefix_cache_hits,
            ),
        ];
        for (name, help, extra, counter) in counters {
            let _ = write!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n"
            );
            for (labels, engine) in labels.iter().zip(engines) {
                let value = counter(&engine.counters).load(Ordering::Relaxed);
                if name == "sglang:cached_tokens" && value == 0 {
                    continue;
                }
                let _ = write!(
                    out,
                    "{name}_total{{{labels},{extra}}} {}\n{name}_created{{{labels},{extra}}} {}\n",
                    float(value as f64),
                    float(self.created),
                );
            }
        }
        out
    }

    /// Every rank's series, each family once with one sample per rank labelled `engine="<rank>"`
    /// (vLLM's data-parallel layout; `engine="0"` alone without data parallelism).
    fn render_vllm(&self, engines: &[Arc<Engine>], model_name: &str) -> String {
        let model = escape(model_name);
        let labels: Vec<String> = (0..engines.len())
            .map(|rank| format!("engine=\"{rank}\",model_name=\"{model}\""))
            .collect();
        let mut out = String::new();
        let gauges: Vec<_> = engines.iter().map(|engine| engine.gauges()).collect();
        let gauge_list: [(&str, &str, GaugeOf); 3] = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                |g| g.running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                |g| g.waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                |g| g.kv_cache_usage,
            ),
        ];
        write_gauges(&mut out, &gauge_list, &labels, &gauges);
        let counter_list: [(&str, &str, CounterOf); 7] = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                |c| &c.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                |c| &c.prefix_cache_hits,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                |c| &c.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                |c| &c.generation_tokens,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, \
                 in terms of number of queried tokens.",
                |c| &c.external_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, \
                 in terms of number of cached tokens.",
                |c| &c.external_hits,
            ),
            (
                "vllm:prompt_tokens_cached",
                "Number of cached prompt tokens (local + external).",
                |c| &c.prompt_cached,
            ),
        ];
        for (name, help, counter) in counter_list {
            let _ = write!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n"
            );
            for (labels, engine) in labels.iter().zip(engines) {
                let _ = write!(
                    out,
                    "{name}_total{{{labels}}} {}\n{name}_created{{{labels}}} {}\n",
                    float(counter(&engine.counters).load(Ordering::Relaxed) as f64),
                    float(self.created),
                );
            }
        }
        let _ = write!(
            out,
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n\
             # TYPE vllm:prompt_tokens_by_source_total counter\n"
        );
        let sources: [(&str, CounterOf); 3] = [
            ("local_compute", |c| &c.prompt_computed),
            ("local_cache_hit", |c| &c.prompt_local_hits),
            ("external_kv_transfer", |c| &c.prompt_external),
        ];
        for (labels, engine) in labels.iter().zip(engines) {
            for (source, counter) in sources {
                let _ = write!(
                    out,
                    "vllm:prompt_tokens_by_source_total{{{labels},source=\"{source}\"}} {}\n\
                     vllm:prompt_tokens_by_source_created{{{labels},source=\"{source}\"}} {}\n",
                    float(counter(&engine.counters).load(Ordering::Relaxed) as f64),
                    float(self.created),
                );
            }
        }
        let _ = write!(
            out,
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n\
             # TYPE vllm:num_preemptions_total counter\n"
        );
        for labels in &labels {
            let _ = writeln!(out, "vllm:num_preemptions_total{{{labels}}} 0.0");
        }
        let _ = write!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n\
             # TYPE vllm:request_success_total counter\n"
        );
        for (labels, engine) in labels.iter().zip(engines) {
            let finished = engine.counters.requests_finished.load(Ordering::Relaxed) as f64;
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{labels},finished_reason=\"length\"}} {}",
                float(finished)
            );
        }
        let _ = write!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n"
        );
        for (rank, engine) in engines.iter().enumerate() {
            let geometry = engine.geometry();
            let _ = writeln!(
                out,
                "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",\
                 enable_prefix_caching=\"True\",engine=\"{rank}\",gpu_memory_utilization=\"0.9\",\
                 model_name=\"{model}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",\
                 prefix_caching_hash_algo=\"{}\"}} 1.0",
                geometry.block_size, geometry.num_blocks, self.hash_algo,
            );
        }
        out
    }
}

/// Each gauge family once, one sample per rank (its labels).
fn write_gauges(
    out: &mut String,
    families: &[(&str, &str, GaugeOf)],
    labels: &[String],
    gauges: &[EngineGauges],
) {
    for (name, help, value) in families {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n");
        for (labels, gauges) in labels.iter().zip(gauges) {
            let _ = writeln!(out, "{name}{{{labels}}} {}", float(value(gauges)));
        }
    }
}

/// Python's `repr(float)` for the values that occur here.
fn float(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        value.to_string()
    }
}

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
