//! Replicas that come and go only through Kubernetes (issue 18): real sims behind a real Envoy
//! running the shipped override_host config, kvroute-ext-proc discovering its pool from the API
//! server double (`kvroute_discovery::testing::ApiServer`) over kube-rs. Envoy's cluster holds
//! every sim, as a gateway's endpoints from the InferencePool would; kvroute's routing knows
//! only what discovery tells it. Nothing is restarted: the same ext-proc process sees pods join,
//! become unready and be deleted.
//!
//! Which sim served a request is read from the sims themselves (`vllm:request_success_total`).

use std::time::{Duration, Instant};

use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_tests::harness::{Envoy, SimProcess, http, tiny_model_dir, wait_until, workspace_root};
use kvroute_tests::stack::{
    ExtProcBudgets, ExtProcProcess, KVROUTE_LISTENER, MODEL, OVERRIDE_HOST_CONFIG, StackOptions,
    pool_schema, render_envoy_config, start_sims,
};
use serde_json::json;

use super::common::metric;

const NS: &str = "llm";
/// A generous bound for a condition; the join latency is measured and printed, not asserted.
const DEADLINE: Duration = Duration::from_secs(30);

fn pod(name: &str, sim: &SimProcess) -> TestPod {
    TestPod::new(name)
        .label("app", "sim")
        .ip("127.0.0.1")
        .ready(true)
        .node("node-0")
        .port("http", sim.ready.http.port())
}

fn ext_proc_config(options: &StackOptions, api: &ApiServer) -> String {
    let budgets = ExtProcBudgets::for_this_build();
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         budgets: {{decision: {decision}ms, tokenize: {tokenize}ms}}\n\
         scrape: {{interval: 100ms}}\n\
         pools:\n- {{{schema}, tokenizer: {{model_dir: \"{model}\"}}, events: false,\n   \
         discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, target_port: http, \
         api_url: \"{api}\"}}}}}}\n",
        decision = budgets.decision.as_millis(),
        tokenize = budgets.tokenize.as_millis(),
        schema = pool_schema(options),
        model = tiny_model_dir().display(),
        api = api.url(),
    )
}

async fn served(sims: &[SimProcess]) -> Vec<u64> {
    let mut counts = Vec::with_capacity(sims.len());
    for sim in sims {
        let text = http::get(&format!("{}/metrics", sim.base_url()))
            .await
            .unwrap()
            .text();
        counts.push(metric(&text, "vllm:request_success_total{") as u64);
    }
    counts
}

/// Waits until ext-proc routes on `n` discovered replicas (the swap is done).
async fn until_routable(ext_proc: &ExtProcProcess, n: usize) {
    let url = format!("{}/metrics", ext_proc.admin_url());
    let series = format!("kvroute_extproc_discovery_routable_replicas{{pool=\"{MODEL}\"}} {n}");
    wait_until(
        &format!("ext-proc routing on {n} discovered replicas"),
        DEADLINE,
        || async {
            let text = http::get(&url).await.ok()?.text();
            text.lines().any(|line| line == series).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", ext_proc.log()));
}

/// Sends `count` completions with distinct prompts, each answered 200; returns how many more
/// requests each sim finished (waiting until all `count` are counted).
async fn send(envoy: &Envoy, sims: &[SimProcess], tag: &str, count: usize) -> Vec<u64> {
    let before = served(sims).await;
    let url = format!(
        "http://{}/v1/completions",
        envoy.listener(KVROUTE_LISTENER).unwrap()
    );
    for i in 0..count {
        let body = json!({"model": MODEL, "prompt": format!("{tag} request {i}: tell me something new"), "max_tokens": 2});
        let response = http::post_json(&url, &body).await.unwrap();
        assert_eq!(response.status, 200, "{}", response.text());
    }
    wait_until("the sims to count the requests", DEADLINE, || async {
        let now = served(sims).await;
        let delta: Vec<u64> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
        (delta.iter().sum::<u64>() == count as u64).then_some(delta)
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn replicas_join_and_leave_routing_through_the_api_server_alone() {
    let options = StackOptions {
        replicas: 3,
        ..StackOptions::default()
    };
    let sims = start_sims(&options).await.unwrap();
    let api = ApiServer::start().await.unwrap();
    // Sims 0 and 1 are Ready pods; sim 2 runs but is not (yet) a pod of the pool.
    api.apply_pod(NS, &pod("sim-0", &sims[0]));
    api.apply_pod(NS, &pod("sim-1", &sims[1]));
    let ext_proc = ExtProcProcess::start(&ext_proc_config(&options, &api), None)
        .await
        .unwrap();
    let pid = ext_proc.pid();
    let production = std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG)).unwrap();
    let addrs: Vec<_> = sims.iter().map(|s| s.ready.http).collect();
    let envoy = Envoy::start(&render_envoy_config(&production, &addrs, ext_proc.grpc()).unwrap())
        .await
        .unwrap();
    until_routable(&ext_proc, 2).await;

    let delta = send(&envoy, &sims, "before", 20).await;
    assert_eq!(delta[2], 0, "sim-2 is no pod of the pool yet: {delta:?}");

    // A new Ready pod: routable within a bound we measure.
    let joined = Instant::now();
    api.apply_pod(NS, &pod("sim-2", &sims[2]));
    let url = format!(
        "http://{}/v1/completions",
        envoy.listener(KVROUTE_LISTENER).unwrap()
    );
    let first_served = wait_until("a request served by the new pod", DEADLINE, || async {
        let before = served(&sims).await[2];
        let body = json!({"model": MODEL, "prompt": format!("join probe {:?}", joined.elapsed()), "max_tokens": 2});
        let response = http::post_json(&url, &body).await.ok()?;
        assert_eq!(response.status, 200, "{}", response.text());
        (served(&sims).await[2] > before).then(|| joined.elapsed())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", ext_proc.log()));
    println!(
        "discovery: a new Ready pod served its first request {first_served:?} after the API server had it"
    );

    // Unready: out of routing once ext-proc has the snapshot.
    api.apply_pod(NS, &pod("sim-1", &sims[1]).ready(false));
    until_routable(&ext_proc, 2).await;
    let delta = send(&envoy, &sims, "unready", 20).await;
    assert_eq!(delta[1], 0, "the unready pod still got requests: {delta:?}");

    // Deleted: after the deletion is observed, no request goes to it (the sim still runs, so a
    // request sent there would be served and counted).
    assert!(api.delete_pod(NS, "sim-0"));
    until_routable(&ext_proc, 1).await;
    let delta = send(&envoy, &sims, "deleted", 20).await;
    assert_eq!(delta, vec![0, 0, 20], "only sim-2 is a Ready pod now");

    // Back: Ready again, routable again — still the same process.
    api.apply_pod(NS, &pod("sim-1", &sims[1]));
    until_routable(&ext_proc, 2).await;
    let delta = send(&envoy, &sims, "back", 30).await;
    assert_eq!(delta[0], 0, "{delta:?}");
    assert!(
        delta[1] > 0,
        "sim-1 is Ready again but got nothing: {delta:?}"
    );
    assert_eq!(ext_proc.pid(), pid, "ext-proc restarted");
    let metrics = http::get(&format!("{}/metrics", ext_proc.admin_url()))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("kvroute_extproc_discovery_snapshots_total{source=\"tiny\"}"),
        "{metrics}"
    );
}
