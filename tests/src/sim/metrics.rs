//! `/metrics` in vLLM's Prometheus text (the Python client's layout: counters as `_total` plus
//! `_created`, label values from config only).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use super::engine::Engine;

/// Static facts shown in `vllm:cache_config_info` and on every series.
#[derive(Debug, Clone)]
pub(crate) struct MetricsInfo {
    /// vLLM's `engine` label (the engine index, "0" for one engine).
    pub(crate) engine: String,
    /// `--prefix-caching-hash-algo`.
    pub(crate) hash_algo: String,
    /// Process start, Unix seconds (the `_created` samples).
    pub(crate) created: f64,
}

impl MetricsInfo {
    pub(crate) fn render(&self, engine: &Engine, model_name: &str) -> String {
        let labels = format!(
            "engine=\"{}\",model_name=\"{}\"",
            self.engine,
            escape(model_name)
        );
        let gauges = engine.gauges();
        let counters = &engine.counters;
        let geometry = engine.geometry();
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, value: f64| {
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {}\n",
                float(value)
            );
        };
        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            gauges.running as f64,
        );
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            gauges.waiting as f64,
        );
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            gauges.kv_cache_usage,
        );
        let counter_list = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                &counters.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                &counters.prefix_cache_hits,
            ),
            (
                "vllm:prompt_tokens",
                "Number of prefill tokens processed.",
                &counters.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                &counters.generation_tokens,
            ),
        ];
        for (name, help, value) in counter_list {
            let _ = write!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter\n\
                 {name}_total{{{labels}}} {}\n{name}_created{{{labels}}} {}\n",
                float(value.load(Ordering::Relaxed) as f64),
                float(self.created),
            );
        }
        let _ = write!(
            out,
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.\n\
             # TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{{{labels}}} 0.0\n"
        );
        let finished = counters.requests_finished.load(Ordering::Relaxed) as f64;
        let _ = write!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n\
             # TYPE vllm:request_success_total counter\n\
             vllm:request_success_total{{{labels},finished_reason=\"length\"}} {}\n",
            float(finished)
        );
        let _ = write!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",\
             enable_prefix_caching=\"True\",engine=\"{}\",gpu_memory_utilization=\"0.9\",\
             model_name=\"{}\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",\
             prefix_caching_hash_algo=\"{}\"}} 1.0\n",
            geometry.block_size,
            self.engine,
            escape(model_name),
            geometry.num_blocks,
            self.hash_algo,
        );
        out
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
