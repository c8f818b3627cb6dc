//! Agent clients' streams through a real Envoy and kvroute: the official OpenAI and Anthropic
//! Python SDKs (`tests/sdk/stream_clients.py`) stream the Responses and Messages APIs from
//! `kvroute-engine-sim` replicas; each stream completes with its text, and a conversation's
//! second turn is decided on the precise tier and lands on the replica holding its first, which
//! reports the prefix cached.
//!
//! Needs `openai` and `anthropic` in `KVROUTE_PYTHON` (`scripts/setup.sh` installs them); skips
//! without them, but fails under CI. Needs the binaries: `cargo build --bins` first.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::{metrics, workspace_root};
use kvroute_tests::stack::{MODEL, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use super::common::index_blocks;
use super::routing::{ext_proc_metrics, finished, served_since, text};

/// How long a test waits for the index to hold a conversation's first turn.
fn settle() -> Duration {
    deadline(Duration::from_secs(20))
}

/// A Python that imports both SDKs: `KVROUTE_PYTHON`, else the repository's `.venv`. `None`
/// (the test skips) when it cannot, unless `CI` is set: CI's setup installs them.
fn python_with_sdks(test: &str) -> Option<PathBuf> {
    let python = std::env::var_os("KVROUTE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    let importable = Command::new(&python)
        .args(["-c", "import openai, anthropic"])
        .output()
        .is_ok_and(|out| out.status.success());
    if importable {
        return Some(python);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: {} cannot import openai and anthropic; scripts/setup.sh installs them",
        python.display()
    );
    eprintln!(
        "SKIP {test}: {} cannot import openai and anthropic (run scripts/setup.sh)",
        python.display()
    );
    None
}

/// What the SDK saw of one streamed turn.
struct Turn {
    /// The replica that served it (from the sims' finished-request counters).
    replica: usize,
    /// Event types in arrival order, as the SDK yields them.
    events: Vec<String>,
    text: String,
    /// The usage the SDK reports at the end of the stream.
    usage: Value,
}

/// Streams one turn through kvroute's listener with the SDK for `api`, sent alone.
async fn stream_turn(
    stack: &Stack,
    python: &Path,
    api: &str,
    system: &str,
    messages: &[Value],
) -> Turn {
    stack
        .until_replicas_idle()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.logs()));
    let before = finished(stack).await;
    let request = json!({"api": api, "base_url": stack.url(Routing::Kvroute).unwrap(),
        "model": MODEL, "system": system, "messages": messages, "max_tokens": 4});
    let python = python.to_path_buf();
    let output = tokio::task::spawn_blocking(move || {
        let script = workspace_root().join("tests/sdk/stream_clients.py");
        let mut child = Command::new(python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(request.to_string().as_bytes()).unwrap();
        drop(stdin);
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{api} client: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        stack.logs()
    );
    let seen: Value = serde_json::from_slice(&output.stdout).unwrap();
    let delta = served_since(stack, &before, 1).await;
    Turn {
        replica: delta.iter().position(|d| *d == 1).unwrap(),
        events: serde_json::from_value(seen["events"].clone()).unwrap(),
        text: seen["text"].as_str().unwrap().to_owned(),
        usage: seen["usage"].clone(),
    }
}

/// Prompt tokens the engine found cached, from each API's usage as its SDK reports it.
fn cached_tokens(api: &str, usage: &Value) -> u64 {
    match api {
        "responses" => usage["input_tokens_details"]["cached_tokens"].as_u64(),
        _ => usage["cache_read_input_tokens"].as_u64(),
    }
    .unwrap_or_else(|| panic!("{api}: no cached tokens in {usage}"))
}

fn precise_decisions(metrics_text: &str) -> f64 {
    metrics::sum(
        metrics_text,
        "kvroute_extproc_decisions_total",
        &["tier=\"precise\""],
    )
}

#[tokio::test]
async fn sdk_streams_of_responses_and_messages_route_to_their_conversation() {
    let test = "sdk_streams_of_responses_and_messages_route_to_their_conversation";
    let Some(python) = python_with_sdks(test) else {
        return;
    };
    let stack = Stack::start(StackOptions {
        replicas: 3,
        ..StackOptions::default()
    })
    .await
    .unwrap();
    let admin = stack.index_admin_url().unwrap();
    let ids = stack.replica_ids();
    for (seed, api, first_event, last_event) in [
        (61, "responses", "response.created", "response.completed"),
        (62, "messages", "message_start", "message_stop"),
    ] {
        let system = text(seed, 150);
        let mut messages = vec![json!({"role": "user", "content": "question zero"})];
        let first = stream_turn(&stack, &python, api, &system, &messages).await;
        assert_eq!(
            first.events.first().map(String::as_str),
            Some(first_event),
            "{api}"
        );
        assert_eq!(
            first.events.last().map(String::as_str),
            Some(last_event),
            "{api}"
        );
        assert!(!first.text.is_empty(), "{api}: no text streamed");
        assert_eq!(
            cached_tokens(api, &first.usage),
            0,
            "{api}: {}",
            first.usage
        );
        // ~1k tokens of system prompt are 30+ blocks: wait for the index to hold them.
        let id = &ids[first.replica];
        poll_until(&format!("{api}: {id} indexed"), settle(), || async {
            (index_blocks(&admin, id).await?.len() >= 8).then_some(())
        })
        .await;

        let precise_before = precise_decisions(&ext_proc_metrics(&stack).await);
        messages.push(json!({"role": "assistant", "content": first.text}));
        messages.push(json!({"role": "user", "content": "question one"}));
        let second = stream_turn(&stack, &python, api, &system, &messages).await;
        assert_eq!(
            second.events.last().map(String::as_str),
            Some(last_event),
            "{api}"
        );
        assert!(!second.text.is_empty(), "{api}: no text streamed");
        assert_eq!(second.replica, first.replica, "{api}\n{}", stack.logs());
        let cached = cached_tokens(api, &second.usage);
        assert!(cached > 0, "{api}: nothing cached: {}", second.usage);
        assert!(
            second.usage["input_tokens"].as_u64().unwrap() > 0,
            "{api}: {}",
            second.usage
        );
        let precise_after = precise_decisions(&ext_proc_metrics(&stack).await);
        assert!(
            precise_after > precise_before,
            "{api}: the second turn was not decided on the precise tier"
        );
    }
}
