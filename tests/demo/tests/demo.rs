//! The demo's workload, smaller, through the full stack: kvroute must cache better than Envoy's
//! round robin over the same simulators, shadow mode must project a gain that routing then
//! delivers, and no request may fail.

use kvroute_demo::{self as demo, WorkloadOptions};
use kvroute_tests::harness::http;
use kvroute_tests::stack::{Routing, SimTiming, Stack, StackOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_beats_round_robin_on_the_demo_workload() {
    let workload = WorkloadOptions {
        groups: 4,
        users_per_group: 2,
        turns: 3,
        concurrency: 4,
        ..WorkloadOptions::default()
    };
    let stack = Stack::start(StackOptions {
        routing: Routing::Kvroute,
        timing: SimTiming {
            ttft_overhead_ms: 1.0,
            prefill_us_per_token: 300.0,
            decode_ms_per_token: 2.0,
            time_scale: 0.1,
        },
        pool_extra_config: "mode: route".to_owned(),
        ext_proc_extra_config: "reload_interval: 50ms\n".to_owned(),
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let conversations = demo::build_workload(&workload);

    stack.reset_prefix_caches().await.unwrap();
    let baseline = demo::run_phase(&stack, Routing::RoundRobin, &conversations, &workload)
        .await
        .unwrap();
    stack.reset_prefix_caches().await.unwrap();
    let shadow = demo::run_shadow_phase(&stack, &conversations, &workload)
        .await
        .unwrap();
    stack.reset_prefix_caches().await.unwrap();
    let kvroute = demo::run_phase(&stack, Routing::Kvroute, &conversations, &workload)
        .await
        .unwrap();
    let reports = [baseline, shadow.phase.clone(), kvroute];
    let (baseline, kvroute) = (&reports[0], &reports[2]);
    let projection = demo::render_projection(&shadow, kvroute);
    eprintln!("{projection}");
    assert_eq!(
        (shadow.totals.requests, shadow.totals.unobserved),
        (24.0, 0.0),
        "every shadow decision is compared with the replica Envoy served"
    );
    assert!(
        shadow.projected_gain_tokens() > 0.0 && kvroute.hit_tokens > shadow.phase.hit_tokens,
        "shadow mode projects a gain and routing delivers one:\n{projection}"
    );
    let table = demo::render_table(baseline, kvroute);
    eprintln!("{table}");
    for report in &reports {
        assert_eq!(report.requests, 24);
        assert_eq!(
            report.failed,
            0,
            "{}: {:?}\n{}",
            report.routing.as_label(),
            report.first_error,
            stack.logs()
        );
        assert_eq!(report.per_replica.iter().sum::<u64>(), 24, "{table}");
    }
    let ext_proc_metrics = http::get(&format!("{}/metrics", stack.ext_proc_admin_url().unwrap()))
        .await
        .unwrap()
        .text();
    let decisions: Vec<&str> = ext_proc_metrics
        .lines()
        .filter(|l| {
            l.starts_with("kvroute_extproc_decisions_total{")
                || l.starts_with("kvroute_extproc_fallbacks_total{")
        })
        .collect();
    eprintln!("{}", decisions.join("\n"));
    assert!(
        kvroute.hit_rate > baseline.hit_rate,
        "kvroute should cache better than round robin:\n{table}\n{}",
        decisions.join("\n")
    );
}
