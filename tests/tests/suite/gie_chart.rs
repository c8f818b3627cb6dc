//! kvroute-ext-proc started as GIE's and llm-d's `inferencepool` charts start their endpoint
//! picker: `--pool-name`, `--pool-namespace`, their plugin `--config-file`, `--zap-encoder`, and
//! no kvroute config. It discovers the named InferencePool from the API server double
//! (`kvroute_discovery::testing::ApiServer`, reached through a kubeconfig as a pod reaches the
//! API server through its service account) and routes a request to one of its pods, with the
//! decision's tier what the flags allow: load without a tokenizer, approximate with one, precise
//! with a tokenizer and an index address (a kvroute-index following the same pool).

use std::path::Path;
use std::time::Duration;

use kvroute_discovery::testing::{ApiServer, TestPod};
use kvroute_ext_proc::server::DESTINATION_HEADER;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::ext_proc::{ExtProcAnswer, ExtProcClient};
use kvroute_tests::harness::{ChildGuard, http, metrics, tiny_model_dir};
use kvroute_tests::stack::{
    MODEL, ServerProcess, StackOptions, binary_dir, event_topic, pool_schema, start_sims,
};
use serde_json::json;

const NS: &str = "llm";
const POOL: &str = "llama";

fn within() -> Duration {
    deadline(Duration::from_secs(30))
}

/// A kubeconfig naming the double, without credentials (it checks none).
fn kubeconfig(dir: &Path, api: &ApiServer) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: double, cluster: {{server: \"{}\"}}}}]\n\
             users: [{{name: anonymous, user: {{}}}}]\n\
             contexts: [{{name: double, context: {{cluster: double, user: anonymous, namespace: elsewhere}}}}]\n\
             current-context: double\n",
            api.url()
        ),
    )
    .unwrap();
    path
}

/// The `key=ADDR` lines of the ready file, once written.
async fn ready_lines(
    ready: &Path,
    process: &mut ChildGuard,
) -> Vec<(String, std::net::SocketAddr)> {
    let written = try_poll_until("ext-proc writes its ready file", within(), || async {
        std::fs::read_to_string(ready).ok()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}\n{}", process.exited(), process.log()));
    written
        .lines()
        .filter_map(|line| {
            let (key, addr) = line.split_once('=')?;
            let addr: std::net::SocketAddr = addr.parse().ok()?;
            // Chart ports listen on all interfaces; the test reaches them on loopback.
            Some((key.to_owned(), ([127, 0, 0, 1], addr.port()).into()))
        })
        .collect()
}

/// Starts kvroute-ext-proc with the chart's flags (plus `extra`), waits until it routes on
/// `replicas` discovered replicas, sends one completion and returns the destination it chose
/// and its metrics.
async fn route_once_with_chart_flags(
    api: &ApiServer,
    replicas: usize,
    extra: &[&str],
) -> (String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let mut command = std::process::Command::new(binary_dir(None).join("kvroute-ext-proc"));
    command
        .args(["--pool-name", POOL, "--pool-namespace", NS])
        .arg("--kubeconfig")
        .arg(kubeconfig(dir.path(), api))
        // GIE's plugin configuration: accepted, never read as kvroute's (it does not exist).
        .args([
            "--config-file",
            "/config/default-plugins.yaml",
            "--zap-encoder",
            "json",
        ])
        .args([
            "--grpc-port",
            "0",
            "--grpc-health-port",
            "0",
            "--metrics-port",
            "0",
        ])
        .arg("--secure-serving=false")
        .arg("--ready-file")
        .arg(&ready)
        .args(extra)
        .env_remove("KVROUTE_INDEX_ADDRESS")
        .env_remove("KVROUTE_POOL_MODELS")
        .env_remove("KVROUTE_TOKENIZER_MODEL_DIR")
        .env_remove("KVROUTE_TOKENIZER_RENDER");
    let mut process =
        ChildGuard::spawn("kvroute-ext-proc", command, dir.path().join("ext-proc.log")).unwrap();
    let lines = ready_lines(&ready, &mut process).await;
    let addr = |key: &str| {
        lines
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, addr)| *addr)
            .unwrap_or_else(|| panic!("no {key} in the ready file: {lines:?}"))
    };
    let metrics_url = format!("http://{}/metrics", addr("admin"));
    let routable = format!("kvroute_extproc_discovery_routable_replicas{{pool=\"{POOL}\"}}");
    try_poll_until("ext-proc routing on the pool's pods", within(), || async {
        let text = http::get(&metrics_url).await.ok()?.text();
        (metrics::sample(&text, &routable)? == replicas as f64).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", process.log()));

    let client = ExtProcClient::connect(addr("grpc"), within())
        .await
        .unwrap();
    let body = json!({"model": MODEL, "prompt": "the drop-in ".repeat(40), "max_tokens": 1});
    let answer = client
        .buffered("/v1/completions", body.to_string().into_bytes())
        .await
        .unwrap();
    let ExtProcAnswer::Routed(_) = &answer else {
        panic!("refused: {answer:?}\n{}", process.log());
    };
    let destination = answer.header(DESTINATION_HEADER).unwrap().to_owned();
    let text = http::get(&metrics_url).await.unwrap().text();
    let log = process.log();
    (destination, text, log)
}

fn first(list: &str) -> &str {
    list.split(',').next().unwrap_or_default()
}

#[tokio::test]
async fn the_gie_chart_flags_alone_discover_the_pool_and_route() {
    let options = StackOptions {
        replicas: 2,
        ..StackOptions::default()
    };
    let sims = start_sims(&options).await.unwrap();
    let ports: Vec<u16> = sims.iter().map(|s| s.ready.http.port()).collect();
    let api = ApiServer::start().await.unwrap();
    // One pod serving on both ports: the pool's two targetPorts are two replicas of it.
    api.apply_inference_pool(NS, POOL, &[("app", "sim")], &ports);
    api.apply_pod(
        NS,
        &TestPod::new("sim-0")
            .label("app", "sim")
            .ip("127.0.0.1")
            .ready(true),
    );
    // A pool of the same name elsewhere, which the namespace flag keeps out.
    api.apply_inference_pool("elsewhere", POOL, &[("app", "other")], &[1]);
    let endpoints: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();

    // No tokenizer flag: routed on load, and labelled so.
    let (destination, text, log) = route_once_with_chart_flags(&api, 2, &[]).await;
    assert!(
        endpoints.iter().any(|e| e == first(&destination)),
        "{destination}"
    );
    assert_eq!(
        metrics::sum(
            &text,
            "kvroute_extproc_decisions_total",
            &["tier=\"load\"", "reason=\"no_tokenizer\""]
        ),
        1.0,
        "{text}"
    );
    assert!(
        log.contains("--config-file"),
        "the GIE plugin config is logged as ignored\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("configuration built from the chart flags")
                && l.contains("\"load\"")),
        "the tier the flags allow is logged\n{log}"
    );

    // With a tokenizer: the approximate tier (no index address given).
    let model_dir = tiny_model_dir().display().to_string();
    let (destination, text, _) =
        route_once_with_chart_flags(&api, 2, &["--tokenizer-model-dir", &model_dir]).await;
    assert!(
        endpoints.iter().any(|e| e == first(&destination)),
        "{destination}"
    );
    assert_eq!(
        metrics::sum(
            &text,
            "kvroute_extproc_decisions_total",
            &["tier=\"approximate\""]
        ),
        1.0,
        "{text}"
    );
}

/// Flags kvroute cannot honour are refused before anything starts (exit 64), naming the flag:
/// an InferencePool API group other than GIE v1's, and `--config` with a pool the file does not
/// discover.
#[tokio::test]
async fn chart_flags_kvroute_cannot_honour_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let output = std::process::Command::new(binary_dir(None).join("kvroute-ext-proc"))
            .args(args)
            .output()
            .unwrap();
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (code, stderr) = run(&[
        "--pool-name",
        POOL,
        "--pool-group",
        "inference.networking.x-k8s.io",
    ]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--pool-group"), "{stderr}");

    let config = dir.path().join("kvroute.yaml");
    std::fs::write(
        &config,
        "pools:\n- {name: p, models: [m], discovery: {kubernetes: {inference_pool: other, api_url: \"http://127.0.0.1:1\"}}}\n",
    )
    .unwrap();
    let (code, stderr) = run(&["--config", config.to_str().unwrap(), "--pool-name", POOL]);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("--pool-name"), "{stderr}");

    let (code, stderr) = run(&[]);
    assert_eq!(code, Some(2), "clap's usage error: {stderr}");
}

/// With `--index-address` and a tokenizer the decision is precise: the index (its own config,
/// following the same InferencePool) vouches for the pod it subscribed to.
#[tokio::test]
async fn with_an_index_address_the_chart_flags_route_precise() {
    // The chart mode's block size is vLLM's default, 16: the index's pool must agree (it
    // refuses a Match of another block size, and the decision is then approximate).
    let options = StackOptions {
        replicas: 1,
        block_size: 16,
        ..StackOptions::default()
    };
    let sims = start_sims(&options).await.unwrap();
    let sim = &sims[0];
    let port = |endpoint: &Option<String>| {
        endpoint
            .as_deref()
            .and_then(|e| e.rsplit(':').next())
            .unwrap_or_default()
            .to_owned()
    };
    let api = ApiServer::start().await.unwrap();
    api.apply_inference_pool(NS, POOL, &[("app", "sim")], &[sim.ready.http.port()]);
    api.apply_pod(
        NS,
        &TestPod::new("sim-0")
            .label("app", "sim")
            .ip("127.0.0.1")
            .ready(true)
            .annotation("kvroute.io/kv-events-port", &port(&sim.ready.kv_events))
            .annotation("kvroute.io/kv-replay-port", &port(&sim.ready.replay))
            .annotation("kvroute.io/kv-events-topic", &event_topic(0)),
    );
    let index = ServerProcess::start_index(
        &format!(
            "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
             pools:\n- {{{schema}, discovery: {{kubernetes: {{namespace: {NS}, inference_pool: {POOL}, api_url: \"{url}\"}}}}}}\n",
            schema = pool_schema(&options),
            url = api.url(),
        ),
        None,
    )
    .await
    .unwrap();
    let replicas_url = format!("{}/v1/replicas", index.admin_url());
    try_poll_until(
        "the index subscribed to the pool's pod",
        within(),
        || async {
            let text = http::get(&replicas_url).await.ok()?.text();
            let replicas: Vec<serde_json::Value> = serde_json::from_str(&text).ok()?;
            (replicas.len() == 1 && replicas[0]["state"] == "ready").then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", index.log()));

    let model_dir = tiny_model_dir().display().to_string();
    let index_address = format!("http://{}", index.grpc());
    let (destination, text, log) = route_once_with_chart_flags(
        &api,
        1,
        &[
            "--tokenizer-model-dir",
            &model_dir,
            "--index-address",
            &index_address,
        ],
    )
    .await;
    assert_eq!(
        first(&destination),
        format!("127.0.0.1:{}", sim.ready.http.port())
    );
    assert_eq!(
        metrics::sum(
            &text,
            "kvroute_extproc_decisions_total",
            &["tier=\"precise\""]
        ),
        1.0,
        "{text}\n{log}"
    );
}
