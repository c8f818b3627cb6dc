//! ext-proc's render tokenizer mode (`tokenizer: {render: URL}`) through real Envoy, in front of
//! `kvroute-engine-sim` replicas whose `/v1/.../render` endpoints speak vLLM 0.32's protocol:
//! chat completions, Responses and Anthropic Messages requests that share a prefix land on the
//! replica holding it, decided on the precise tier, with no tokenizer fallback; and when the
//! render endpoint fails or stays silent, each decision falls back to load, counted by cause,
//! and every request is still served.
//!
//! Which replica served is read from the sims (`vllm:request_success_total`); the tier from the
//! `x-kvroute-decision` response header.
//!
//! Needs the binaries: `cargo build --bins` before `cargo nextest run -p kvroute-tests render`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvroute_ext_proc::server::DECISION_HEADER;
use kvroute_test_support::{deadline, poll_until};
use kvroute_tests::harness::metrics;
use kvroute_tests::stack::{DebugHeaders, MODEL, Stack, StackOptions, StackTokenizer};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::common::index_blocks;
use super::routing::{ext_proc_metrics, route_response, text};

/// How long a test waits for the index to hold a warmed prefix.
fn settle() -> Duration {
    deadline(Duration::from_secs(20))
}

/// The three request shapes vLLM renders as a chat, each with `prefix` as its system prompt.
#[derive(Debug, Clone, Copy)]
enum Api {
    Chat,
    Responses,
    Messages,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    fn body(self, prefix: &str, question: &str) -> Value {
        match self {
            Api::Chat => json!({"model": MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": prefix}, {"role": "user", "content": question}]}),
            Api::Responses => json!({"model": MODEL, "max_output_tokens": 2,
                "instructions": prefix, "input": [{"role": "user", "content": question}]}),
            Api::Messages => json!({"model": MODEL, "max_tokens": 2,
                "system": [{"type": "text", "text": prefix}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}),
        }
    }

    /// Prompt tokens the engine found cached, from each API's usage shape.
    fn cached_tokens(self, answer: &Value) -> u64 {
        let usage = &answer["usage"];
        match self {
            Api::Chat => usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Api::Responses => usage["input_tokens_details"]["cached_tokens"].as_u64(),
            Api::Messages => usage["cache_read_input_tokens"].as_u64(),
        }
        .unwrap_or(0)
    }
}

struct Routed {
    replica: usize,
    decision: String,
    cached_tokens: u64,
}

async fn route(stack: &Stack, api: Api, prefix: &str, question: &str) -> Routed {
    let (replica, response) =
        route_response(stack, api.path(), &api.body(prefix, question), &[]).await;
    let decision = response.header(DECISION_HEADER);
    let answer: Value = response.json().unwrap();
    Routed {
        replica,
        decision,
        cached_tokens: api.cached_tokens(&answer),
    }
}

async fn start(tokenizer: StackTokenizer) -> Stack {
    Stack::start(StackOptions {
        replicas: 3,
        debug_headers: DebugHeaders::Always,
        tokenizer,
        ..StackOptions::default()
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn render_mode_sends_chat_responses_and_messages_siblings_to_their_prefix() {
    let options = StackOptions::default();
    let stack = start(StackTokenizer::RenderSim {
        sim: 0,
        timeout: options.budgets.tokenize,
    })
    .await;
    let admin = stack.index_admin_url().unwrap();
    let ids = stack.replica_ids();
    for (seed, api) in [(51, Api::Chat), (52, Api::Responses), (53, Api::Messages)] {
        let prefix = text(seed, 150);
        let first = route(&stack, api, &prefix, "question zero").await;
        assert_eq!(first.cached_tokens, 0, "{api:?}");
        // ~1k tokens of prefix are 30+ blocks: wait for the index to hold them.
        let id = &ids[first.replica];
        poll_until(&format!("{api:?}: {id} indexed"), settle(), || async {
            (index_blocks(&admin, id).await?.len() >= 8).then_some(())
        })
        .await;
        for i in 1..=3 {
            let sibling = route(&stack, api, &prefix, &format!("question {i}")).await;
            let what = format!("{api:?} sibling {i} ({})", sibling.decision);
            assert_eq!(sibling.replica, first.replica, "{what}\n{}", stack.logs());
            assert!(sibling.decision.starts_with("precise/"), "{what}");
            assert!(sibling.cached_tokens > 0, "{what} found nothing cached");
        }
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert_eq!(
        metrics::sum(
            &metrics,
            "kvroute_extproc_fallbacks_total",
            &["stage=\"tokenize\""]
        ),
        0.0,
        "{metrics}"
    );
}

/// A render endpoint that answers 500 while `failing`, else reads the request and never answers.
async fn broken_render_server(
    tasks: &TaskTracker,
    stop: CancellationToken,
    failing: Arc<AtomicBool>,
) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = tasks.clone();
    tasks.spawn(async move {
        loop {
            let (mut socket, _) = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(_) => continue,
                },
            };
            let (stop, failing) = (stop.clone(), Arc::clone(&failing));
            connections.spawn(async move {
                let mut buffer = vec![0u8; 64 * 1024];
                while let Ok(n) = socket.read(&mut buffer).await {
                    if n == 0 {
                        return;
                    }
                    if failing.load(Ordering::SeqCst) {
                        let answer = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: \
                                      application/json\r\ncontent-length: 2\r\n\r\n{}";
                        if socket.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    } else {
                        // Silent: hold the connection until the test ends.
                        stop.cancelled().await;
                        return;
                    }
                }
            });
        }
    });
    url
}

#[tokio::test]
async fn failing_or_silent_render_endpoint_falls_back_on_load_counted() {
    let (tasks, stop) = (TaskTracker::new(), CancellationToken::new());
    let failing = Arc::new(AtomicBool::new(true));
    let url = broken_render_server(&tasks, stop.clone(), Arc::clone(&failing)).await;
    let timeout = Duration::from_millis(20);
    let stack = start(StackTokenizer::RenderUrl { url, timeout }).await;
    let prefix = text(61, 60);
    let fallbacks = |metrics: &str, cause: &str| {
        metrics::sum(
            metrics,
            "kvroute_extproc_fallbacks_total",
            &["stage=\"tokenize\"", &format!("cause=\"{cause}\"")],
        )
    };
    for (i, api) in [Api::Chat, Api::Responses, Api::Messages]
        .into_iter()
        .enumerate()
    {
        let routed = route(&stack, api, &prefix, &format!("failing {i}")).await;
        assert!(
            routed.decision.starts_with("load/"),
            "{api:?}: {}",
            routed.decision
        );
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert_eq!(fallbacks(&metrics, "render_error"), 3.0, "{metrics}");

    failing.store(false, Ordering::SeqCst);
    for (i, api) in [Api::Chat, Api::Responses, Api::Messages]
        .into_iter()
        .enumerate()
    {
        let routed = route(&stack, api, &prefix, &format!("silent {i}")).await;
        assert!(
            routed.decision.starts_with("load/"),
            "{api:?}: {}",
            routed.decision
        );
    }
    let metrics = ext_proc_metrics(&stack).await;
    assert_eq!(fallbacks(&metrics, "timeout"), 3.0, "{metrics}");
    stop.cancel();
    tasks.close();
    tasks.wait().await;
}
