//! Replicas that come and go only through Kubernetes: real sims behind a real Envoy
//! running the shipped override_host config, kvroute-ext-proc discovering its pool from the API
//! server double (`kvroute_discovery::testing::ApiServer`) over kube-rs. Envoy's cluster holds
//! every sim, as a gateway's endpoints from the InferencePool would; kvroute's routing knows
//! only what discovery tells it. Nothing is restarted: the same ext-proc process sees pods join,
//! become unready and be deleted.
//!
//! Which sim served a request is read from the sims themselves (`vllm:request_success_total`).
//!
//! The index follows the same pods (`pools[].discovery` in kvroute-index): it subscribes to each
//! Ready pod's KV-event port, and a deleted pod leaves it with its blocks. It also reloads its
//! static `replicas:` from its config file.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_ext_proc::server::DECISION_HEADER;
use kvroute_test_support::{deadline, poll_until, try_poll_until};
use kvroute_tests::harness::{
    Envoy, SimProcess, http, metrics, tiny_model_dir, until_ext_proc_sees_replicas_idle,
    workspace_root,
};
use kvroute_tests::stack::{
    ExtProcBudgets, ExtProcProcess, KVROUTE_LISTENER, MODEL, OVERRIDE_HOST_CONFIG, ServerProcess,
    StackOptions, event_topic, pool_schema, render_envoy_config, start_sims,
};
use serde_json::{Value, json};

use super::common::{family_total, metric};

const NS: &str = "llm";
/// A generous bound for a condition; the join latency is measured and printed, not asserted.
fn within() -> Duration {
    deadline(Duration::from_secs(30))
}

fn pod(name: &str, sim: &SimProcess) -> TestPod {
    TestPod::new(name)
        .label("app", "sim")
        .ip("127.0.0.1")
        .ready(true)
        .node("node-0")
        .port("http", sim.ready.http.port())
}

/// A pod whose annotations name sim `replica`'s KV-event PUB and replay ports and topic.
fn indexed_pod(name: &str, sim: &SimProcess, replica: usize) -> TestPod {
    let port = |endpoint: &Option<String>| {
        endpoint
            .as_deref()
            .and_then(|e| e.rsplit(':').next())
            .unwrap_or_default()
            .to_owned()
    };
    pod(name, sim)
        .annotation("kvroute.io/kv-events-port", &port(&sim.ready.kv_events))
        .annotation("kvroute.io/kv-replay-port", &port(&sim.ready.replay))
        .annotation("kvroute.io/kv-events-topic", &event_topic(replica))
}

/// The pool's `discovery:` section: the pods labelled `app: sim`, served on port `http`.
fn discovery_section(api: &ApiServer) -> String {
    format!(
        "discovery: {{kubernetes: {{namespace: {NS}, selector: {{app: sim}}, target_port: http, \
         api_url: \"{}\"}}}}",
        api.url()
    )
}

/// ext-proc discovering its pool; `index`: the kvroute-index gRPC address it asks (else the
/// pool routes without KV events).
fn ext_proc_config(options: &StackOptions, api: &ApiServer, index: Option<SocketAddr>) -> String {
    let budgets = ExtProcBudgets::for_this_build();
    let (index, events) = match index {
        Some(addr) => (
            format!(
                "index: {{addresses: [\"http://{addr}\"], match_timeout: {}ms}}\n",
                budgets.match_timeout.as_millis()
            ),
            "",
        ),
        None => (String::new(), " events: false,"),
    };
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         {index}\
         debug_headers: {{expose: always}}\n\
         budgets: {{decision: {decision}ms, tokenize: {tokenize}ms}}\n\
         scrape: {{interval: 100ms}}\n\
         pools:\n- {{{schema}, tokenizer: {{model_dir: \"{model}\"}},{events}\n   {discovery}}}\n",
        decision = budgets.decision.as_millis(),
        tokenize = budgets.tokenize.as_millis(),
        schema = pool_schema(options),
        model = tiny_model_dir().display(),
        discovery = discovery_section(api),
    )
}

async fn served(sims: &[SimProcess]) -> Vec<u64> {
    let mut counts = Vec::with_capacity(sims.len());
    for sim in sims {
        let text = http::get(&format!("{}/metrics", sim.base_url()))
            .await
            .unwrap()
            .text();
        counts.push(family_total(&text, "vllm:request_success_total") as u64);
    }
    counts
}

/// Waits until ext-proc routes on `n` discovered replicas (the swap is done).
async fn until_routable(ext_proc: &ExtProcProcess, n: usize) {
    let url = format!("{}/metrics", ext_proc.admin_url());
    let series = format!("kvroute_extproc_discovery_routable_replicas{{pool=\"{MODEL}\"}} {n}");
    try_poll_until(
        &format!("ext-proc routing on {n} discovered replicas"),
        within(),
        || async {
            let text = http::get(&url).await.ok()?.text();
            text.lines().any(|line| line == series).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", ext_proc.log()));
}

/// Waits until the load ext-proc weighs is zero everywhere: no request in flight, and the
/// engines' running and waiting counts as last scraped (under load a scrape taken during the
/// previous request can still say it runs, and a decision then prefers an idle replica).
async fn until_idle(ext_proc: &ExtProcProcess) {
    until_ext_proc_sees_replicas_idle(&ext_proc.admin_url(), within())
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
    poll_until("the sims to count the requests", within(), || async {
        let now = served(sims).await;
        let delta: Vec<u64> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
        (delta.iter().sum::<u64>() == count as u64).then_some(delta)
    })
    .await
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
    let ext_proc = ExtProcProcess::start(&ext_proc_config(&options, &api, None), None)
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
    let first_served = try_poll_until("a request served by the new pod", within(), || async {
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
    let deleted = Instant::now();
    assert!(api.delete_pod(NS, "sim-0"));
    until_routable(&ext_proc, 1).await;
    println!(
        "discovery: a deleted pod left ext-proc's routing {:?} after the API server deleted it",
        deleted.elapsed()
    );
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

/// The index's `/v1/replicas`: id → (state, blocks).
async fn index_replicas(index: &ServerProcess) -> Vec<(String, String, u64)> {
    let text = http::get(&format!("{}/v1/replicas", index.admin_url()))
        .await
        .unwrap()
        .text();
    let replicas: Vec<Value> = serde_json::from_str(&text).unwrap();
    replicas
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap_or_default().to_owned(),
                r["state"].as_str().unwrap_or_default().to_owned(),
                r["blocks"].as_u64().unwrap_or_default(),
            )
        })
        .collect()
}

/// Waits until the index's replicas satisfy `done`; returns them.
async fn until_index(
    index: &ServerProcess,
    what: &str,
    done: impl Fn(&[(String, String, u64)]) -> bool,
) -> Vec<(String, String, u64)> {
    try_poll_until(what, within(), || async {
        let replicas = index_replicas(index).await;
        done(&replicas).then_some(replicas)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", index.log()))
}

fn holds_blocks(replicas: &[(String, String, u64)], id: &str) -> bool {
    replicas
        .iter()
        .any(|(name, state, blocks)| name == id && state == "ready" && *blocks > 0)
}

/// Replaces `path` whole (a rename), as a ConfigMap update does: the index never reads half a file.
fn write_atomically(path: &std::path::Path, text: &str) {
    let staged = path.with_extension("staged");
    std::fs::write(&staged, text).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

fn index_config(options: &StackOptions, pool: &str, replicas: &str) -> String {
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         reload_interval: 100ms\n\
         pools:\n- {{{schema}{pool}}}\n{replicas}",
        schema = pool_schema(options),
    )
}

#[tokio::test]
async fn the_index_follows_the_pods_and_drops_a_deleted_pods_blocks() {
    let options = StackOptions {
        replicas: 2,
        ..StackOptions::default()
    };
    let sims = start_sims(&options).await.unwrap();
    let api = ApiServer::start().await.unwrap();
    for (i, sim) in sims.iter().enumerate() {
        api.apply_pod(NS, &indexed_pod(&format!("sim-{i}"), sim, i));
    }
    let pool = format!(", {}", discovery_section(&api));
    let index = ServerProcess::start_index(&index_config(&options, &pool, ""), None)
        .await
        .unwrap();
    let index_pid = index.pid();
    until_index(&index, "the index subscribed to both pods", |r| {
        r.len() == 2 && r.iter().all(|(_, state, _)| state == "ready")
    })
    .await;
    let ext_proc =
        ExtProcProcess::start(&ext_proc_config(&options, &api, Some(index.grpc())), None)
            .await
            .unwrap();
    let production = std::fs::read_to_string(workspace_root().join(OVERRIDE_HOST_CONFIG)).unwrap();
    let addrs: Vec<_> = sims.iter().map(|s| s.ready.http).collect();
    let envoy = Envoy::start(&render_envoy_config(&production, &addrs, ext_proc.grpc()).unwrap())
        .await
        .unwrap();
    until_routable(&ext_proc, 2).await;

    // A long prompt is cached where it was served, and the index learns it from that pod.
    let prompt = "a shared system prompt about discovery and caches ".repeat(30);
    let url = format!(
        "http://{}/v1/completions",
        envoy.listener(KVROUTE_LISTENER).unwrap()
    );
    let serve = |prompt: String| {
        let url = url.clone();
        let sims = &sims;
        async move {
            let before = served(sims).await;
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
            let response = http::post_json(&url, &body).await.unwrap();
            assert_eq!(response.status, 200, "{}", response.text());
            let decision = response.header(DECISION_HEADER);
            let delta = poll_until("the sims to count the request", within(), || async {
                let now = served(sims).await;
                let delta: Vec<u64> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
                (delta.iter().sum::<u64>() == 1).then_some(delta)
            })
            .await;
            (
                delta.iter().position(|&d| d == 1).unwrap_or_default(),
                decision,
            )
        }
    };
    let (holder, _) = serve(format!("{prompt} first")).await;
    let holder_id = format!("sim-{holder}");
    until_index(&index, "the index to hold the prompt's blocks", |r| {
        holds_blocks(r, &holder_id)
    })
    .await;
    until_idle(&ext_proc).await;
    let (second, decision) = serve(format!("{prompt} second")).await;
    assert_eq!(
        (second, decision.as_str()),
        (holder, "precise/cache_hit"),
        "a prompt sharing the cached prefix goes where the index says it is"
    );

    // Deleted: the index drops the pod and its blocks, the router sends the prefix elsewhere.
    let deleted = Instant::now();
    assert!(api.delete_pod(NS, &holder_id));
    let replicas = until_index(&index, "the index to drop the deleted pod", |r| {
        r.len() == 1 && r.iter().all(|(id, _, _)| *id != holder_id)
    })
    .await;
    println!(
        "discovery: the index dropped a deleted pod and its blocks {:?} after the API server deleted it",
        deleted.elapsed()
    );
    until_routable(&ext_proc, 1).await;
    let index_metrics = http::get(&format!("{}/metrics", index.admin_url()))
        .await
        .unwrap()
        .text();
    assert_eq!(
        metric(
            &index_metrics,
            "kvroute_index_replica_changes_total{change=\"removed\"}"
        ),
        1.0,
        "{index_metrics}"
    );
    assert_eq!(
        metric(
            &index_metrics,
            "kvroute_index_replicas{source=\"discovered\"}"
        ),
        1.0
    );
    let other = 1 - holder;
    let (third, decision) = serve(format!("{prompt} third")).await;
    assert_eq!(third, other, "{decision} {replicas:?}");

    // Back (the same engine, still holding its cache): the index catches up from its replay
    // buffer, so both copies of the prefix are known again — still the same index process.
    api.apply_pod(NS, &indexed_pod(&holder_id, &sims[holder], holder));
    let other_id = format!("sim-{other}");
    until_index(&index, "the returning pod's blocks indexed again", |r| {
        r.len() == 2 && holds_blocks(r, &holder_id) && holds_blocks(r, &other_id)
    })
    .await;
    assert_eq!(index.pid(), index_pid, "kvroute-index restarted");
}

#[tokio::test]
async fn the_index_reloads_its_static_replicas() {
    let options = StackOptions {
        replicas: 2,
        ..StackOptions::default()
    };
    let sims = start_sims(&options).await.unwrap();
    let replica = |i: usize| {
        let sim = &sims[i];
        format!(
            "  - {{id: engine-{i}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\", topic: \"{}\"}}}}\n",
            sim.ready.kv_events.as_deref().unwrap_or_default(),
            sim.ready.replay.as_deref().unwrap_or_default(),
            event_topic(i),
        )
    };
    let index = ServerProcess::start_index(
        &index_config(&options, "", &format!("replicas:\n{}", replica(0))),
        None,
    )
    .await
    .unwrap();
    let pid = index.pid();
    until_index(&index, "engine-0 ready", |r| {
        r.len() == 1 && r[0].0 == "engine-0" && r[0].1 == "ready"
    })
    .await;
    let path = index.config_path();
    let running = std::fs::read_to_string(&path).unwrap();

    // Added: subscribed without a restart.
    write_atomically(&path, &format!("{running}{}", replica(1)));
    until_index(&index, "engine-1 added by the reload", |r| {
        r.len() == 2 && r.iter().all(|(_, state, _)| state == "ready")
    })
    .await;

    // A file that does not validate is refused, counted, and the replicas stay.
    write_atomically(
        &path,
        &format!("{running}  - {{id: engine-9, pool: nope}}\n"),
    );
    let reloads = |outcome: &'static str| {
        let url = format!("{}/metrics", index.admin_url());
        async move {
            let text = http::get(&url).await.ok()?.text();
            metrics::sample(
                &text,
                &format!("kvroute_index_config_reloads_total{{outcome=\"{outcome}\"}}"),
            )
        }
    };
    try_poll_until("the bad reload to be refused", within(), || async {
        (reloads("rejected").await? >= 1.0).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", index.log()));
    assert_eq!(index_replicas(&index).await.len(), 2);

    // Removed: its ingest stops and its blocks leave the index.
    write_atomically(&path, &running);
    until_index(&index, "engine-1 removed by the reload", |r| {
        r.len() == 1 && r[0].0 == "engine-0"
    })
    .await;
    assert!(reloads("applied").await.unwrap_or_default() >= 2.0);
    assert_eq!(index.pid(), pid, "kvroute-index restarted");
}
