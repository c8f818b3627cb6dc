//! Past saturation, on the Mooncake synthetic trace (`traces/synthetic_trace.jsonl` of the shared
//! third-party folder; skipped, saying so, when it is absent): kvroute keeps the cache as
//! SGLang's cache-aware policy does, rather than giving prefixes away to balance queues.
#![allow(clippy::unwrap_used, reason = "test helpers panic on broken fixtures")]

use kvroute_block_keys::testing::shared_file;
use kvroute_replay::engine::EngineConfig;
use kvroute_replay::metrics::{self, RunMetrics};
use kvroute_replay::routers::RouterSpec;
use kvroute_replay::sim::{self, SimConfig};
use kvroute_replay::timing::MockerFit;
use kvroute_replay::trace;

/// The routing-quality setup (four replicas of 4,096 blocks) at five times the trace's rate,
/// about 1.75 times the highest rate any router serves within a 2 s TTFT p90: every queue grows
/// for the whole run, far past the speculative TTL, so a conversation's next turn arrives while
/// its previous one still waits.
fn overloaded(test: &str) -> Option<(Vec<trace::Request>, SimConfig)> {
    let path = shared_file(test, "traces/synthetic_trace.jsonl")?;
    let mut records = trace::read_records(&path).unwrap();
    records.sort_by_key(|r| r.timestamp);
    let requests = trace::compress(&trace::prepare_all(&records).unwrap(), 5.0);
    let config = SimConfig {
        replicas: 4,
        engine: EngineConfig {
            blocks: 4096,
            ..EngineConfig::default()
        },
        timing: MockerFit::default(),
        kv_delay_us: 50_000,
        prefill_replicas: 0,
    };
    Some((requests, config))
}

fn measure(spec: RouterSpec, requests: &[trace::Request], config: &SimConfig) -> RunMetrics {
    let mut router = spec.build(config.replicas, config.engine.blocks, 1);
    let result = sim::run(requests, config, router.as_mut()).unwrap();
    metrics::measure(requests, &result, 0.1)
}

#[test]
fn past_saturation_kvroute_keeps_the_cache_as_the_cache_aware_anchor_does() {
    let test = "past_saturation_kvroute_keeps_the_cache_as_the_cache_aware_anchor_does";
    let Some((requests, config)) = overloaded(test) else {
        return;
    };
    let kvroute = measure(RouterSpec::Kvroute, &requests, &config);
    let sglang = measure(RouterSpec::Sglang, &requests, &config);
    let balancing = measure(RouterSpec::LeastLoaded, &requests, &config);
    eprintln!("kvroute {kvroute:?}\nsglang {sglang:?}\nleast-loaded {balancing:?}");
    assert!(
        sglang.ttft_p90_ms > 20_000.0,
        "the setup is overloaded: {sglang:?}"
    );
    assert!(
        kvroute.hit_rate >= sglang.hit_rate - 0.02,
        "kvroute {kvroute:?}\nsglang {sglang:?}"
    );
    assert!(
        kvroute.ttft_p90_ms <= sglang.ttft_p90_ms * 1.05,
        "kvroute {kvroute:?}\nsglang {sglang:?}"
    );
}
