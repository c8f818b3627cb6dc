//! The real-SGLang tier: two real SGLang 0.5.23 servers on the CPU backend
//! (`tests/sglang/serve.sh`: the zmq publisher, page size 16, a small KV pool, cached-token
//! reports, metrics) on the tiny model, behind kvroute-index (SGLang's events, `sglang-exact`
//! keys), kvroute-ext-proc (in-process tokenizer on the same model folder, SGLang's metric names)
//! and a real Envoy. Judged by SGLang's own counts: each answer's
//! `usage.prompt_tokens_details.cached_tokens` and `sglang:cached_tokens_total`.
//!
//! Ignored in the normal suite; `bash tests/sglang/run.sh` installs SGLang and runs it.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvroute_config::Engine;
use kvroute_ext_proc::server::PREDICTED_CACHED_HEADER;
use kvroute_test_support::{deadline, try_poll_until};
use kvroute_tests::harness::{ChildGuard, http, metrics, reserve_port, workspace_root};
use kvroute_tests::stack::{
    DebugHeaders, EventsMode, ExtProcBudgets, ExternalReplica, Routing, SimTiming, Stack,
    StackOptions,
};
use serde_json::{Value, json};

use super::real_vllm::{cache_dir, model_dir, stop_engine_group, wait_engine_healthy};
use super::routing::text;

const ENGINES: usize = 2;
const MODEL: &str = "tiny";
/// SGLang's page size, the KV-event block size (`serve.sh`).
const BLOCK_SIZE: u32 = 16;
const CONVERSATIONS: usize = 8;
const TURNS: usize = 4;

fn venv_dir() -> PathBuf {
    let version = std::env::var("SGLANG_VERSION").unwrap_or_else(|_| "0.5.23".to_owned());
    cache_dir().join(format!("sglang-venv-{version}"))
}

/// Two servers starting at once on two cores take about a minute; generous on a busy machine.
fn startup_timeout() -> Duration {
    deadline(Duration::from_secs(600))
}

/// One real SGLang server in its own process group.
struct SglangEngine {
    name: String,
    http: SocketAddr,
    external: ExternalReplica,
    guard: ChildGuard,
}

impl SglangEngine {
    /// Starts server `index`; its PUB socket connects to an endpoint kvroute-index binds.
    fn spawn(index: usize, logs: &Path) -> Self {
        let ports = [
            reserve_port().unwrap(),
            reserve_port().unwrap(),
            reserve_port().unwrap(),
        ];
        let http: SocketAddr = ([127, 0, 0, 1], ports[0]).into();
        let events = format!("tcp://127.0.0.1:{}", ports[1]);
        let replay = format!("tcp://127.0.0.1:{}", ports[2]);
        let topic = format!("kv@sglang-{index}@{MODEL}");
        let name = format!("sglang-{index}");
        let mut command = Command::new("bash");
        command
            .arg(workspace_root().join("tests/sglang/serve.sh"))
            .arg(model_dir())
            .arg(ports[0].to_string())
            .arg(&events)
            .arg(ports[2].to_string())
            .arg(&topic)
            // Room for every conversation: the tier checks where turns go and what kvroute
            // predicts, so none of them may lose its prefix to eviction.
            .env("MAX_TOTAL_TOKENS", "16384")
            .process_group(0);
        let guard = ChildGuard::spawn(&name, command, logs.join(format!("{name}.log"))).unwrap();
        Self {
            name,
            http,
            external: ExternalReplica {
                http,
                events,
                events_mode: EventsMode::Bind,
                replay,
                topic,
            },
            guard,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    async fn wait_healthy(&mut self) {
        let url = self.url();
        wait_engine_healthy(&self.name, &url, &mut self.guard).await;
    }
}

impl Drop for SglangEngine {
    fn drop(&mut self) {
        stop_engine_group(&mut self.guard);
    }
}

#[tokio::test]
#[ignore = "real SGLang tier: bash tests/sglang/run.sh"]
async fn real_sglang_multi_turn_through_envoy() {
    assert!(
        venv_dir().join("bin/python").is_file() && model_dir().join("config.json").is_file(),
        "no SGLang venv at {} or model at {}: run `bash tests/sglang/run.sh`",
        venv_dir().display(),
        model_dir().display()
    );
    let logs = tempfile::tempdir().unwrap();
    let mut engines: Vec<SglangEngine> = (0..ENGINES)
        .map(|i| SglangEngine::spawn(i, logs.path()))
        .collect();
    futures::future::join_all(engines.iter_mut().map(SglangEngine::wait_healthy)).await;
    let stack = Stack::start_external(
        StackOptions {
            routing: Routing::Kvroute,
            sim_engines: vec![Some(Engine::Sglang); ENGINES],
            block_size: BLOCK_SIZE,
            // Real milliseconds, the prefill cost of a tiny model on this busy CPU.
            timing: SimTiming {
                time_scale: 1.0,
                prefill_us_per_token: 200.0,
                ..SimTiming::default()
            },
            budgets: ExtProcBudgets::relaxed(),
            debug_headers: DebugHeaders::Always,
            ..StackOptions::default()
        },
        engines.iter().map(|e| e.external.clone()).collect(),
    )
    .await
    .unwrap_or_else(|e| panic!("stack: {e}"));
    let url = format!(
        "{}/v1/chat/completions",
        stack.url(Routing::Kvroute).unwrap()
    );
    let urls: Vec<String> = engines.iter().map(SglangEngine::url).collect();

    let mut histories: Vec<Vec<Value>> = (0..CONVERSATIONS)
        .map(|c| {
            vec![json!({"role": "system", "content": format!("You are agent {c}. {}", text(c as u64 + 500, 60))})]
        })
        .collect();
    let mut home: Vec<Option<usize>> = vec![None; CONVERSATIONS];
    let (mut requests, mut within_one_block, mut reused, mut exact) = (0, 0, 0, 0);
    let mut misses = Vec::new();
    for turn in 0..TURNS {
        for (c, history) in histories.iter_mut().enumerate() {
            history
                .push(json!({"role": "user", "content": text((c * 100 + turn) as u64 + 9000, 30)}));
            let body = json!({"model": MODEL, "messages": history, "max_tokens": 4});
            let before: Vec<f64> = served_counts(&urls).await;
            let response = http::post_json(&url, &body).await.unwrap();
            assert_eq!(response.status, 200, "{}", response.text());
            let predicted: i64 = response.header(PREDICTED_CACHED_HEADER).parse().unwrap();
            let answer: Value = response.json().unwrap();
            let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_i64()
                .unwrap_or(0);
            let served = served_on(&urls, &before).await;
            requests += 1;
            exact += usize::from(predicted == cached);
            if (predicted - cached).abs() <= i64::from(BLOCK_SIZE) {
                within_one_block += 1;
            } else {
                misses.push(format!(
                    "conversation {c} turn {turn}: predicted {predicted}, SGLang {cached}"
                ));
            }
            match home[c] {
                None => home[c] = Some(served),
                Some(holder) => {
                    assert_eq!(
                        served, holder,
                        "conversation {c} turn {turn} left its server"
                    );
                    reused += usize::from(cached > 0);
                }
            }
            let reply = answer["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history.push(json!({"role": "assistant", "content": reply}));
        }
    }
    let admin = stack.ext_proc_admin_url().unwrap();
    let ext_proc = http::get(&format!("{admin}/metrics")).await.unwrap().text();
    let precise = metrics::sum(
        &ext_proc,
        "kvroute_extproc_decisions_total",
        &["tier=\"precise\""],
    );
    let results = json!({
        "requests": requests, "within_one_block": within_one_block, "exact": exact,
        "later_turns_reused": reused, "precise_decisions": precise,
        "servers_used": home.iter().flatten().collect::<std::collections::HashSet<_>>().len(),
    });
    eprintln!("real SGLang tier: {results}");
    if let Ok(path) = std::env::var("KVROUTE_SGLANG_RESULTS") {
        let _ = std::fs::write(path, results.to_string());
    }
    assert_eq!(
        reused,
        CONVERSATIONS * (TURNS - 1),
        "every later turn reused its cache"
    );
    assert!(
        within_one_block * 100 >= requests * 95,
        "predicted cached tokens within one block of SGLang's for {within_one_block} of \
         {requests}: {misses:#?}"
    );
    assert_eq!(
        precise as usize, requests,
        "every decision on the precise tier:\n{ext_proc}"
    );
}

/// Requests each server finished so far (`sglang:num_requests_total`).
async fn served_counts(urls: &[String]) -> Vec<f64> {
    let mut counts = Vec::with_capacity(urls.len());
    for url in urls {
        let text = http::get(&format!("{url}/metrics")).await.unwrap().text();
        counts.push(metrics::sum(&text, "sglang:num_requests_total", &[]));
    }
    counts
}

/// The server whose finished count moved past `before`.
async fn served_on(urls: &[String], before: &[f64]) -> usize {
    try_poll_until(
        "a server to count the request",
        startup_timeout(),
        || async {
            let now = served_counts(urls).await;
            now.iter().zip(before).position(|(n, b)| n > b)
        },
    )
    .await
    .unwrap()
}
