//! ext-proc's memory under huge prompts: the real kvroute-ext-proc binary, driven over
//! ext_proc as Envoy's BUFFERED mode drives it, with the tiny model in process; its memory read
//! from `/proc/<pid>/status` (VmHWM: the peak resident set over the whole run).
//!
//! The bound: `baseline + token_cache_bytes + slots × per-tokenization + in-flight × per-request`,
//! where a blocking tokenization of a prompt of `tokenize_max_prompt_bytes` is charged
//! [`TOKENIZATION_BYTES_PER_PROMPT_BYTE`] per prompt byte, and each request ext-proc holds at once
//! [`REQUEST_BYTES_PER_BODY_BYTE`] per body byte (the buffered body, its owned prompt and the
//! leading part's rendering).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute_ext_proc::server::DECISION_HEADER;
use kvroute_tests::harness::ext_proc::{ExtProcAnswer, ExtProcClient};
use kvroute_tests::harness::{http, metrics, tiny_model_dir};
use kvroute_tests::stack::{ExtProcBudgets, ExtProcProcess};

use super::common::metric;

const MIB: usize = 1024 * 1024;
/// The prompts' size.
const PROMPT_BYTES: usize = MIB;
/// Distinct completions are sent this many at a time.
const SEQUENTIAL_CONCURRENCY: usize = 4;
/// Chats sent at once.
const CONCURRENT_CHATS: usize = 50;
/// ext-proc's bounds in this test: a cache of three 1 MiB prompts' tokens (≈ 2.4 MB each with
/// the tiny model), so that it evicts.
const CACHE_BYTES: usize = 8 * MIB;
const SLOTS: usize = 2;
const MAX_PROMPT_BYTES: usize = 2 * MIB;
/// Charged per prompt byte of a blocking tokenization: `kvroute-check` on a 1 MiB prompt (its
/// 610k tokens printed as JSON included) peaks at 32 MiB, model and runtime included.
const TOKENIZATION_BYTES_PER_PROMPT_BYTE: usize = 8;
/// Charged per body byte of a request held at once (gRPC message, body, owned prompt).
const REQUEST_BYTES_PER_BODY_BYTE: usize = 3;

/// The tokenize budget: short, so that the many decisions finding every slot taken fall back
/// quickly (what production's 30 ms budget does), and the test's run time stays bounded.
const TOKENIZE_BUDGET_MS: u64 = 50;

fn config() -> String {
    let budgets = ExtProcBudgets::for_this_build();
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         budgets: {{decision: {decision}ms, tokenize: {TOKENIZE_BUDGET_MS}ms}}\n\
         token_cache_bytes: {CACHE_BYTES}\n\
         limits: {{tokenize_concurrency: {SLOTS}, tokenize_max_prompt_bytes: {MAX_PROMPT_BYTES}}}\n\
         pools:\n- name: tiny\n  models: [tiny]\n  block_size: 16\n  \
         key_scheme: {{kind: token-chain}}\n  tokenizer: {{model_dir: \"{model}\"}}\n\
         replicas:\n- {{id: r0, pool: tiny, address: \"127.0.0.1:1\"}}\n\
         - {{id: r1, pool: tiny, address: \"127.0.0.1:2\"}}\n",
        decision = budgets.decision.as_millis(),
        model = tiny_model_dir().display(),
    )
}

/// `VmHWM` or `VmRSS` of `pid`, in bytes.
fn memory(pid: u32, field: &str) -> usize {
    let kib = metrics::proc_status_kib(pid, field).unwrap_or_else(|| panic!("no {field} of {pid}"));
    usize::try_from(kib).unwrap() * 1024
}

/// `PROMPT_BYTES` of text, distinct per `i`: a shared leading part (a system prompt, the same
/// for every request), then `i`, then the rest.
fn prompt(shared: &str, i: usize) -> String {
    let mut text = String::with_capacity(PROMPT_BYTES + 32);
    text.push_str(&shared[..64 * 1024]);
    text.push_str(&format!(" request {i} "));
    text.push_str(&shared[64 * 1024..PROMPT_BYTES - text.len()]);
    text
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 1}))
        .unwrap()
}

fn chat(content: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
    }))
    .unwrap()
}

/// The tier of a routed answer (`precise`, `approximate`, `load`).
fn tier(answer: &ExtProcAnswer) -> String {
    let decision = answer
        .header(DECISION_HEADER)
        .unwrap_or_else(|| panic!("not routed: {answer:?}"));
    decision.split('/').next().unwrap_or_default().to_owned()
}

/// The figures asked for: 1,000 distinct 1 MiB completions, then 50 concurrent 1 MiB chats, while
/// small chats keep being decided (measured: peak 173 MiB over a 46 MiB baseline, bound 252 MiB;
/// ≈ 75 s with debug binaries, most of it the 1 GiB of bodies).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn huge_prompts_leave_ext_proc_bounded_and_small_requests_decided() {
    huge_prompts(1000).await;
}

async fn huge_prompts(distinct_prompts: usize) {
    let ext_proc = ExtProcProcess::start(&config(), None).await.unwrap();
    let pid = ext_proc.pid().unwrap();
    let client = ExtProcClient::connect(ext_proc.grpc(), Duration::from_secs(30))
        .await
        .unwrap();
    let small = chat("What is the capital of France?");
    // Warm: the model's tables and the runtime's threads are part of the baseline.
    for _ in 0..3 {
        let answer = client
            .buffered("/v1/chat/completions", small.clone())
            .await
            .unwrap();
        assert_eq!(tier(&answer), "approximate", "{answer:?}");
    }
    let baseline = memory(pid, "VmRSS");
    let started = Instant::now();

    // Small requests decided all along, each within its budget on the tokenizer's tiers.
    let stop = tokio_util::sync::CancellationToken::new();
    let probe = async {
        let mut tiers = Vec::new();
        while !stop.is_cancelled() {
            let answer = client
                .buffered("/v1/chat/completions", small.clone())
                .await
                .unwrap();
            tiers.push(tier(&answer));
            tokio::select! {
                () = stop.cancelled() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
        tiers
    };
    let shared = kvroute_tokenize::testing::mixed_text(7, PROMPT_BYTES, &[]);
    let load = async {
        let next = AtomicUsize::new(0);
        let worker = || async {
            let mut tiers = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= distinct_prompts {
                    return tiers;
                }
                let answer = client
                    .buffered("/v1/completions", completion(&prompt(&shared, i)))
                    .await
                    .unwrap();
                tiers.push(tier(&answer));
            }
        };
        let sequential: Vec<String> =
            futures::future::join_all((0..SEQUENTIAL_CONCURRENCY).map(|_| worker()))
                .await
                .into_iter()
                .flatten()
                .collect();
        let after_sequential = started.elapsed();
        let chats = futures::future::join_all((0..CONCURRENT_CHATS).map(|i| {
            let body = chat(&prompt(&shared, distinct_prompts + i));
            client.buffered("/v1/chat/completions", body)
        }))
        .await;
        stop.cancel();
        (sequential, after_sequential, chats)
    };
    let (probe_tiers, (sequential_tiers, after_sequential, chats)) = tokio::join!(probe, load);
    let peak = memory(pid, "VmHWM");
    let metrics = http::get(&format!("{}/metrics", ext_proc.admin_url()))
        .await
        .unwrap()
        .body;
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    let value = |name: &str| metric(&metrics, name);
    eprintln!(
        "baseline {} MiB, peak {} MiB, {} sequential in {after_sequential:?}, all in {:?}; \
         cache {} MiB; fallbacks busy {}, timeout {}, too large {}; abandoned {}; \
         sequential tiers {:?}; probes {}",
        baseline / MIB,
        peak / MIB,
        distinct_prompts,
        started.elapsed(),
        value("kvroute_extproc_token_cache_bytes") as usize / MIB,
        fallbacks(&metrics, "busy"),
        fallbacks(&metrics, "timeout"),
        fallbacks(&metrics, "prompt_too_large"),
        value("kvroute_extproc_tokenize_abandoned_total"),
        count(&sequential_tiers),
        probe_tiers.len(),
    );

    for answer in chats {
        tier(&answer.unwrap());
    }
    assert_eq!(sequential_tiers.len(), distinct_prompts);
    assert!(!probe_tiers.is_empty());
    for t in &probe_tiers {
        assert!(
            t == "precise" || t == "approximate",
            "a small request fell back: {probe_tiers:?}"
        );
    }
    assert!(value("kvroute_extproc_token_cache_bytes") as usize <= CACHE_BYTES);
    assert!(value("kvroute_extproc_tokenize_blocking_in_flight") as usize <= SLOTS);
    let bound = baseline
        + CACHE_BYTES
        + SLOTS * TOKENIZATION_BYTES_PER_PROMPT_BYTE * MAX_PROMPT_BYTES
        + (SEQUENTIAL_CONCURRENCY + CONCURRENT_CHATS + 1)
            * REQUEST_BYTES_PER_BODY_BYTE
            * PROMPT_BYTES;
    assert!(
        peak <= bound,
        "peak {} MiB over the bound {} MiB\n{}",
        peak / MIB,
        bound / MIB,
        ext_proc.log()
    );
}

fn fallbacks(text: &str, cause: &str) -> f64 {
    metrics::sum(
        text,
        "kvroute_extproc_fallbacks_total",
        &["stage=\"tokenize\"", &format!("cause=\"{cause}\"")],
    )
}

fn count(tiers: &[String]) -> std::collections::BTreeMap<&str, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for t in tiers {
        *counts.entry(t.as_str()).or_default() += 1;
    }
    counts
}
