//! The picker's decisions: bursts of siblings, the leading-tokens rule on real tokenizers, the
//! load tier's reasons and the embedded index.

use std::collections::HashMap;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::sync::Barrier;

use super::*;
use crate::request::{Endpoint, parse};
use crate::tokenizer::{InProcess, LeadingFuture, TokenizeFuture, TokenizeInput};

const BURST: usize = 16;

#[test]
fn the_index_is_asked_about_the_blocks_vllm_can_reuse() {
    let tokens = |len: u32, exact| PromptTokens {
        tokens: (0..len).collect(),
        exact,
        estimated_len: len as usize,
        source: TokenSource::Tokenizer,
        keys: None,
        multimodal: None,
    };
    // 64 tokens in blocks of 32: two keys, but vLLM recomputes the last token: one block.
    assert_eq!(match_blocks(&tokens(64, true), 32, 2), 1);
    assert_eq!(match_blocks(&tokens(65, true), 32, 2), 2);
    assert_eq!(match_blocks(&tokens(1, true), 32, 0), 0);
    // A leading part: the whole prompt is longer, every key counts.
    assert_eq!(match_blocks(&tokens(64, false), 32, 2), 2);
}

/// One token per byte; every call waits until `BURST` calls are in flight, so all siblings
/// finish tokenizing together and race to score (the case a burst hits in production).
#[derive(Debug)]
struct LockstepTokenizer(Arc<Barrier>);

impl Tokenizer for LockstepTokenizer {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let barrier = Arc::clone(&self.0);
        Box::pin(async move {
            barrier.wait().await;
            match input.as_ref() {
                TokenizeInput::Text { text, .. } => Ok(text.bytes().map(u32::from).collect()),
                TokenizeInput::Chat { messages, .. } => {
                    Ok(messages.get().bytes().map(u32::from).collect())
                }
                TokenizeInput::Api { request, .. } => {
                    Ok(request.get().bytes().map(u32::from).collect())
                }
            }
        })
    }
}

fn picker(scoring: &str) -> Picker {
    picker_with(scoring, "{}")
}

/// [`picker`] with `decision_records` set.
fn picker_with(scoring: &str, decision_records: &str) -> Picker {
    let yaml = format!(
        "budgets: {{decision: 2s, tokenize: 2s}}\n\
         scoring: {scoring}\n\
         decision_records: {decision_records}\n\
         pools:\n- {{name: p, models: [m], block_size: 16, key_scheme: {{kind: token-chain}}}}\n\
         replicas:\n\
         - {{id: r0, pool: p, address: \"10.0.0.1:8000\"}}\n\
         - {{id: r1, pool: p, address: \"10.0.0.2:8000\"}}\n\
         - {{id: r2, pool: p, address: \"10.0.0.3:8000\"}}\n\
         - {{id: r3, pool: p, address: \"10.0.0.4:8000\"}}\n"
    );
    let config = Config::from_yaml(&yaml).unwrap();
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(config, None, &tasks)
        .unwrap()
        .with_tokenizer(
            0,
            Arc::new(LockstepTokenizer(Arc::new(Barrier::new(BURST)))),
        );
    Picker::new(runtime, Metrics::register(&mut Registry::default()), tasks)
}

/// Decides `BURST` siblings (a 2000-token shared prefix) at once; keeps their in-flight guards.
async fn burst(picker: Arc<Picker>) -> Vec<Decision> {
    let prefix = "ab".repeat(1000);
    let decisions = (0..BURST).map(|i| {
        let picker = Arc::clone(&picker);
        let body = serde_json::json!({"model": "m", "prompt": format!("{prefix} sibling {i}")})
            .to_string();
        async move {
            let request = parse(body.as_bytes(), Endpoint::Completions).unwrap();
            picker.decide(&request, None).await.unwrap()
        }
    });
    #[expect(
        clippy::disallowed_methods,
        reason = "test: decide on several worker threads"
    )]
    let handles: Vec<_> = decisions.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

fn per_replica(decisions: &[Decision]) -> HashMap<&str, usize> {
    let mut counts = HashMap::new();
    for decision in decisions {
        *counts.entry(decision.replica_id.as_str()).or_insert(0) += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_siblings_co_locate() {
    // A busy pool: this is about concurrent decisions seeing each other's commits, not how an
    // idle pool spreads a burst.
    let picker = Arc::new(picker("{idle_pool_ms: 0}"));
    let decisions = burst(Arc::clone(&picker)).await;
    let counts = per_replica(&decisions);
    let most = counts.values().copied().max().unwrap_or(0);
    assert!(most >= 12, "siblings spread: {counts:?}");
    // Only the first sibling found no cached prefix; the others saw its speculative insert.
    let cold = decisions
        .iter()
        .filter(|d| d.reason == "no_cache_match")
        .count();
    assert_eq!(cold, 1, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hotspot_guard_still_spills_a_burst() {
    // A busy pool (an idle one spreads a burst by the queues before any guard is needed) and a
    // guard low enough for this burst: the replica holding the prefix turns hot once its pile
    // passes `hotspot_min_ms`, and the rest of the burst spills.
    let picker = Arc::new(picker_with(
        "{idle_pool_ms: 0, hotspot_factor: 1.1, hotspot_min_ms: 150}",
        "{sample: 1.0}",
    ));
    let decisions = burst(Arc::clone(&picker)).await;
    let counts = per_replica(&decisions);
    let most = counts.values().copied().max().unwrap_or(0);
    assert!(most < BURST, "{counts:?}");
    let spilled: Vec<_> = decisions
        .iter()
        .filter(|d| d.reason == "hotspot_guard")
        .collect();
    assert!(!spilled.is_empty(), "{counts:?}");
    // Each record says why: a replica it skipped had a pile of this prompt's siblings in flight.
    for decision in spilled {
        let record = decision.record.as_ref().unwrap();
        assert!(
            record
                .candidates
                .iter()
                .any(|c| !c.chosen && c.inflight_siblings.is_some_and(|n| n >= 2)),
            "{record:?}"
        );
    }
}

/// A kvroute-index (gRPC on a free port) with pool `p` (model `m`, 16-token blocks) and replica
/// `r0`, whose event source nothing publishes on.
#[cfg(feature = "embedded-index")]
async fn one_replica_index() -> kvroute_index::server::IndexServer {
    kvroute_index::server::IndexServer::start(
        kvroute_index::config::Config::from_yaml(
            "listen: {grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}\n\
             pools:\n  - {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
             replicas:\n  - {id: r0, pool: p, events: {endpoint: \"tcp://127.0.0.1:9\"}}\n",
        )
        .unwrap(),
    )
    .await
    .unwrap()
}

#[cfg(feature = "embedded-index")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_index_answers_in_process_and_survives_a_reload() {
    let index = one_replica_index().await;
    let yaml = "pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                replicas:\n- {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n";
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
        .unwrap()
        .with_local_index(index.matcher());
    async fn ask(runtime: &Runtime) -> Result<MatchResponse, crate::error::IndexError> {
        let request = MatchRequest {
            model: "m".to_owned(),
            block_size: 16,
            keys: vec![1, 2, 3],
            candidates: vec!["r0".to_owned()],
            ..MatchRequest::default()
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(1);
        runtime.index.match_prefix(request, deadline).await
    }
    let answer = ask(&runtime).await.unwrap();
    assert_eq!(answer.replicas.len(), 1, "{answer:?}");
    assert_eq!(answer.replicas[0].matched_blocks, 0);

    // A reload (no index addresses at all) keeps asking the embedded index.
    let reloaded =
        Runtime::build(Config::from_yaml(yaml).unwrap(), Some(&runtime), &tasks).unwrap();
    assert!(reloaded.index.is_configured());
    assert!(ask(&reloaded).await.is_ok());
    // A model the index does not know is refused, not a transport failure.
    let refused = reloaded
        .index
        .match_prefix(
            MatchRequest {
                model: "other".to_owned(),
                ..MatchRequest::default()
            },
            Instant::now() + std::time::Duration::from_secs(1),
        )
        .await;
    assert!(
        matches!(refused, Err(crate::error::IndexError::Refused(_))),
        "{refused:?}"
    );
    index.shutdown().await;
}

#[cfg(feature = "embedded-index")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_refusing_the_query_is_a_config_mismatch_not_an_outage() {
    let index = one_replica_index().await;
    let yaml = format!(
        "index: {{addresses: [\"http://{}\"]}}\n\
         pools:\n- {{name: p, models: [m], block_size: 16, key_scheme: {{kind: token-chain}}}}\n\
         replicas:\n- {{id: r0, pool: p, address: \"10.0.0.1:8000\"}}\n",
        index.grpc_addr()
    );
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(&yaml).unwrap(), None, &tasks).unwrap();
    let ask = |block_size: u32| {
        let request = MatchRequest {
            model: "m".to_owned(),
            block_size,
            keys: vec![1, 2, 3],
            candidates: vec!["r0".to_owned()],
            ..MatchRequest::default()
        };
        runtime
            .index
            .match_prefix(request, Instant::now() + std::time::Duration::from_secs(5))
    };
    // Another block size than the index's pool: refused, counted as such, not as unavailable.
    let refused = ask(32).await;
    assert!(
        matches!(&refused, Err(crate::error::IndexError::Rejected { .. })),
        "{refused:?}"
    );
    assert_eq!(refused.unwrap_err().as_label(), "refused");
    // The address is not marked unhealthy: the next, right query is answered at once.
    let answer = ask(16).await.unwrap();
    assert_eq!(answer.replicas.len(), 1, "{answer:?}");
    index.shutdown().await;
}

const TINY_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny-model");

/// An in-process tokenizer that cannot give leading tokens: every decision tokenizes the
/// whole prompt (the reference the leading rule must agree with).
#[derive(Debug)]
struct WholePromptOnly(Arc<dyn Tokenizer>);

impl Tokenizer for WholePromptOnly {
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        self.0.tokenize(model, input)
    }
}

/// A picker over three replicas (no index: prefix memory and in-flight keys only) with
/// `tokenizer`, and the registry its metrics are in.
fn model_picker(tokenizer: Arc<dyn Tokenizer>) -> (Picker, Registry) {
    let yaml = "budgets: {decision: 5s, tokenize: 5s}\n\
                pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                replicas:\n\
                - {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n\
                - {id: r1, pool: p, address: \"10.0.0.2:8000\"}\n\
                - {id: r2, pool: p, address: \"10.0.0.3:8000\"}\n";
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
        .unwrap()
        .with_tokenizer(0, tokenizer);
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    (Picker::new(runtime, metrics, tasks), registry)
}

/// How many decisions took their tokens from `source` (`tokenize_duration_seconds` count).
fn tokenized_by(registry: &Registry, source: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let prefix = format!("kvroute_extproc_tokenize_duration_seconds_count{{kind=\"{source}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |count| count.parse().unwrap())
}

/// Waits (10 s at most) until the token cache holds `entries` entries.
async fn wait_for_cached_entries(registry: &Registry, entries: i64) {
    let within = kvroute_test_support::deadline(std::time::Duration::from_secs(10));
    kvroute_test_support::poll_until(&format!("{entries} cache entries"), within, || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        let held: i64 = text
            .lines()
            .find_map(|line| line.strip_prefix("kvroute_extproc_token_cache_entries "))
            .map_or(0, |n| n.parse().unwrap());
        std::future::ready(held >= entries)
    })
    .await;
}

/// A long request to `dir`'s model (chat when it has a template) of seeded mixed text.
fn long_body(direct: &kvroute_tokenize::ModelTokenizer, seed: u64, turns: usize) -> String {
    let text = |i: u64| kvroute_tokenize::testing::mixed_text(seed + i, 48 * 1024, &[]);
    if !direct.has_chat_template() {
        let prompt: String = (0..turns as u64).map(text).collect();
        return serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    }
    let mut messages = vec![serde_json::json!({"role": "user", "content": text(0)})];
    for i in 1..turns as u64 {
        messages.push(serde_json::json!({"role": "assistant", "content": "Noted."}));
        messages.push(serde_json::json!({"role": "user", "content": text(i)}));
    }
    serde_json::json!({"model": "m", "messages": messages}).to_string()
}

fn endpoint(body: &str) -> Endpoint {
    if body.contains("\"messages\"") {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    }
}

/// What one decision of `body` shows: replica, predicted cached tokens (header and drift).
async fn decide_body(picker: &Picker, body: &str) -> (String, usize, u64) {
    let request = parse(body.as_bytes(), endpoint(body)).unwrap();
    let decision = picker.decide(&request, None).await.unwrap();
    let (replica, cached) = (
        decision.replica_id.clone(),
        decision.predicted_cached_tokens,
    );
    let before = picker.loads().replica(&replica).predicted().cached_tokens;
    drop(decision);
    let drift = picker.loads().replica(&replica).predicted().cached_tokens - before;
    (replica, cached, drift)
}

/// The leading-tokens rule on `dir`'s model: a long prompt nobody holds whole-leading-part
/// decides from its leading tokens exactly as from all of them; a replica holding all leading
/// blocks (memory or in flight) makes the decision tokenize the whole prompt; the next turn
/// and a repeat still find the conversation and the cache.
async fn leading_rule_on(dir: &std::path::Path) {
    let direct = Arc::new(kvroute_tokenize::ModelTokenizer::from_dir(dir).unwrap());
    assert!(
        direct.uses_fast_path(),
        "{}: no fast encoder",
        dir.display()
    );
    // Loaded once (the fast encoder's self-check is slow in a debug build), shared by all.
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(crate::tokenizer::InProcessTokenizer::new(
        Arc::clone(&direct),
        TaskTracker::new(),
    ));
    let load = || Arc::clone(&tokenizer);
    let body = long_body(&direct, 15, 1);
    let request = parse(body.as_bytes(), endpoint(&body)).unwrap();
    let input = Arc::new(TokenizeInput::from_prompt(&request.prompt).unwrap());
    let whole = load().tokenize("m", Arc::clone(&input)).await.unwrap();
    let leading = load()
        .in_process()
        .expect("in process")
        .tokenize_leading(Arc::clone(&input), LEADING_BYTES, None)
        .unwrap()
        .await
        .unwrap();
    assert!(!leading.complete && leading.tokens.len() < whole.len());
    assert_eq!(
        leading.tokens,
        whole[..leading.tokens.len()],
        "not a prefix"
    );
    let pool_keys = |picker: &Picker, tokens: &[u32]| {
        picker.runtime().config.pools[0]
            .prompt_keys(tokens, None, None)
            .unwrap()
    };
    let leading_blocks = leading.tokens.len() / 16;

    // Nobody holds every leading block: r1 holds a few, r2 all but one.
    let (with_leading, leading_metrics) = model_picker(load());
    let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
    for picker in [&with_leading, &reference] {
        let keys = pool_keys(picker, &whole);
        let now = Instant::now();
        picker
            .router
            .remember_served("r1", 1 << 20, &keys[..3], now);
        picker
            .router
            .remember_served("r2", 1 << 20, &keys[..leading_blocks - 1], now);
    }
    let decided = decide_body(&with_leading, &body).await;
    assert_eq!(decided, decide_body(&reference, &body).await);
    assert_eq!(decided.0, "r2");
    assert_eq!(decided.1, (leading_blocks - 1) * 16);
    assert_eq!(tokenized_by(&leading_metrics, "leading"), 1);
    assert_eq!(tokenized_by(&leading_metrics, "tokenizer"), 0);

    // r2 holds the first leading part whole and a few blocks more, fewer than the next
    // part's: the part grows once, and the decision is still the whole prompt's.
    let second_part = load()
        .in_process()
        .expect("in process")
        .tokenize_leading(Arc::clone(&input), LEADING_BYTES * LEADING_GROWTH, None)
        .unwrap()
        .await
        .unwrap();
    // A decision's second part takes over its first: the chat it rendered, the tokens it has.
    if let (Some(rendered), Some(resume)) = (&leading.rendered, leading.resume) {
        let grown = load()
            .in_process()
            .expect("in process")
            .tokenize_leading(
                Arc::clone(&input),
                LEADING_BYTES * LEADING_GROWTH,
                Some(crate::tokenizer::LeadingStep {
                    rendered: Arc::clone(rendered),
                    tokens: leading.tokens.clone().into(),
                    resume,
                }),
            )
            .unwrap()
            .await
            .unwrap();
        assert_eq!(grown, second_part, "a part grown from the first");
    }
    let second_blocks = second_part.tokens.len() / 16;
    assert!(!second_part.complete && second_blocks > leading_blocks + 2);
    let (growing, growing_metrics) = model_picker(load());
    let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
    for picker in [&growing, &reference] {
        let keys = pool_keys(picker, &whole);
        picker
            .router
            .remember_served("r2", 1 << 20, &keys[..leading_blocks + 2], Instant::now());
    }
    let decided = decide_body(&growing, &body).await;
    assert_eq!(decided, decide_body(&reference, &body).await);
    assert_eq!(
        (decided.0.as_str(), decided.1),
        ("r2", (leading_blocks + 2) * 16)
    );
    // The second part, unless the background job turn 1 left ended first (then: cached).
    assert_eq!(
        tokenized_by(&growing_metrics, "leading") + tokenized_by(&growing_metrics, "cache"),
        2
    );
    assert_eq!(tokenized_by(&growing_metrics, "tokenizer"), 0);

    // Only a chat has message boundaries the token cache can find a cached prefix at (a
    // completion prompt is one text; its next turn tokenizes a leading part again).
    if direct.has_chat_template() {
        // Turn 1 was decided from its leading tokens; its whole tokenization finishes in the
        // background, so turn 2 (same start) finds it as its cached prefix instead of paying
        // for a leading part and then the whole prompt. r2 remembers turn 1's leading blocks.
        wait_for_cached_entries(&leading_metrics, 1).await;
        let turn2 = long_body(&direct, 15, 2);
        let (replica, cached, _) = decide_body(&with_leading, &turn2).await;
        assert_eq!(replica, "r2");
        assert_eq!(cached, leading_blocks * 16, "turn 1's leading blocks on r2");
        assert_eq!(
            tokenized_by(&leading_metrics, "leading"),
            1,
            "turn 2 not leading"
        );
        assert_eq!(
            tokenized_by(&leading_metrics, "tokenizer")
                + tokenized_by(&leading_metrics, "prefix_cache"),
            1
        );
        // A repeat of turn 2 comes from the cache.
        wait_for_cached_entries(&leading_metrics, 2).await;
        let repeat = decide_body(&with_leading, &turn2).await;
        assert_eq!(repeat.0, "r2");
        assert_eq!(tokenized_by(&leading_metrics, "cache"), 1);
    }

    // A replica holding the whole prompt (memory on r1, a request in flight on r2): the
    // decision tokenizes it whole and predicts what the reference does.
    for holds in ["memory", "inflight"] {
        let (with_leading, leading_metrics) = model_picker(load());
        let (reference, _) = model_picker(Arc::new(WholePromptOnly(load())));
        let mut guards = Vec::new();
        for picker in [&with_leading, &reference] {
            let keys = pool_keys(picker, &whole);
            match holds {
                "memory" => picker
                    .router
                    .remember_served("r1", 1 << 20, &keys, Instant::now()),
                _ => guards.push(picker.loads().start_request("r2", 0, keys)),
            }
        }
        let decided = decide_body(&with_leading, &body).await;
        let expected = decide_body(&reference, &body).await;
        assert_eq!((decided.1, decided.2), (expected.1, expected.2), "{holds}");
        // Every leading part is held whole, so it grows until the whole prompt is tokenized
        // — or is found cached, when the background job turn 1's first part left ended
        // before a later step asked.
        let leading_steps = std::iter::successors(Some(LEADING_BYTES), |b| Some(b * LEADING_GROWTH))
            .take_while(|&b| input.len_bytes() >= 2 * b)
            .count() as u64;
        assert!(leading_steps >= 2, "the test prompt grows its leading part");
        let leading = tokenized_by(&leading_metrics, "leading");
        let cached = tokenized_by(&leading_metrics, "cache");
        assert_eq!(
            tokenized_by(&leading_metrics, "tokenizer") + cached,
            1,
            "{holds}: the whole prompt once"
        );
        assert!((1..=leading_steps).contains(&leading), "{holds}: {leading}");
        if cached == 0 {
            assert_eq!(leading, leading_steps, "{holds}");
        }
        if holds == "memory" {
            assert_eq!(
                (&decided.0, &expected.0),
                (&"r1".to_owned(), &"r1".to_owned())
            );
            let keys = pool_keys(&with_leading, &whole);
            // What vLLM reuses of it: at most (tokens - 1) / 16 blocks.
            let reusable =
                kvroute_routing::load::engine_hit_tokens(keys.len() as u32, whole.len(), 16);
            assert_eq!(decided.1, reusable);
        }
    }
}

#[tokio::test]
async fn long_prompts_decide_from_leading_tokens_exactly_on_the_tiny_model() {
    leading_rule_on(TINY_MODEL.as_ref()).await;
}

#[tokio::test]
async fn long_prompts_decide_from_leading_tokens_exactly_on_real_tokenizers() {
    let models = std::env::var_os("KVROUTE_MODELS")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|home| std::path::PathBuf::from(home).join(".cache/kvroute/models"))
        });
    for name in ["qwen3", "llama3_1", "gptoss"] {
        let Some(dir) = models.as_ref().map(|m| m.join(name)) else {
            continue;
        };
        if !dir.join("tokenizer.json").is_file() {
            eprintln!(
                "SKIP leading tokens for {name}: no tokenizer folder; run `bash scripts/models.sh` \
                 (sets KVROUTE_MODELS)"
            );
            continue;
        }
        leading_rule_on(&dir).await;
    }
}

/// One token per byte on a blocking slot; every call but the first returns at once, the first
/// waits until `release` is notified (a long prompt holding the only slot).
#[derive(Debug)]
struct SlotHoldingTokenizer {
    calls: std::sync::atomic::AtomicUsize,
    release: Arc<tokio::sync::Notify>,
}

impl Tokenizer for SlotHoldingTokenizer {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let first = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let release = Arc::clone(&self.release);
        Box::pin(async move {
            if first {
                release.notified().await;
            }
            Ok(one_per_byte(&input))
        })
    }

    fn in_process(&self) -> Option<&dyn InProcess> {
        Some(self)
    }
}

impl InProcess for SlotHoldingTokenizer {
    fn runs_blocking(&self, _input: &TokenizeInput, _leading: bool) -> bool {
        true
    }

    fn tokenize_leading(
        &self,
        _input: Arc<TokenizeInput>,
        _min_bytes: usize,
        _shorter: Option<crate::tokenizer::LeadingStep>,
    ) -> Option<LeadingFuture> {
        None
    }

    fn tokenize_resumable(
        &self,
        _input: &TokenizeInput,
        _prior: Option<(&kvroute_tokenize::ResumePoint, &[u32])>,
    ) -> Option<Result<kvroute_tokenize::ResumableTokens, crate::error::TokenizeError>> {
        None
    }

    fn tokenize_now(&self, input: &TokenizeInput) -> Result<Vec<u32>, crate::error::TokenizeError> {
        Ok(one_per_byte(input))
    }
}

/// One token per byte of a completion's text (zeros for other prompts).
fn one_per_byte(input: &TokenizeInput) -> Vec<u32> {
    match input {
        TokenizeInput::Text { text, .. } => text.bytes().map(u32::from).collect(),
        other => vec![0; other.len_bytes()],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_tokenization_says_why_in_the_load_decision() {
    let yaml = "budgets: {decision: 2s, tokenize: 200ms}\n\
                limits: {tokenize_concurrency: 1, tokenize_max_prompt_bytes: 1024}\n\
                pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
                replicas:\n- {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n";
    let release = Arc::new(tokio::sync::Notify::new());
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(yaml).unwrap(), None, &tasks)
        .unwrap()
        .with_tokenizer(
            0,
            Arc::new(SlotHoldingTokenizer {
                calls: std::sync::atomic::AtomicUsize::new(0),
                release: Arc::clone(&release),
            }),
        );
    let picker = Picker::new(runtime, Metrics::register(&mut Registry::default()), tasks);
    let decide = |prompt: String| {
        let picker = &picker;
        async move {
            let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
            let request = parse(body.as_bytes(), Endpoint::Completions).unwrap();
            let decision = picker.decide(&request, None).await.unwrap();
            (decision.tier, decision.reason)
        }
    };

    assert_eq!(
        decide("x".repeat(2048)).await,
        (Tier::Load, "prompt_too_large")
    );
    // The first prompt outlives its budget on the only slot; the next one finds no slot.
    assert_eq!(
        decide("first ".repeat(20)).await,
        (Tier::Load, "tokenizer_timeout")
    );
    assert_eq!(
        decide("second ".repeat(20)).await,
        (Tier::Load, "tokenizer_busy")
    );
    release.notify_one();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_request_routes_on_load_with_its_own_reason_in_process() {
    let direct = Arc::new(
        kvroute_tokenize::ModelTokenizer::from_dir(std::path::Path::new(TINY_MODEL)).unwrap(),
    );
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(crate::tokenizer::InProcessTokenizer::new(
        direct,
        TaskTracker::new(),
    ));
    let (picker, registry) = model_picker(tokenizer);
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture? ".repeat(80)},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    .to_string();
    let request = parse(body.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let decision = picker.decide(&request, None).await.unwrap();
    assert_eq!((decision.tier, decision.reason), (Tier::Load, "multimodal"));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains("kvroute_extproc_fallbacks_total{stage=\"tokenize\",cause=\"multimodal\"} 1"),
        "{text}"
    );
}

#[test]
fn the_index_holding_every_leading_block_precisely_asks_for_the_whole_prompt() {
    let (picker, _) = model_picker(Arc::new(LockstepTokenizer(Arc::new(Barrier::new(1)))));
    let runtime = picker.runtime();
    let candidates: Vec<&Replica> = runtime.config.replicas.iter().collect();
    let keys = [1, 2, 3];
    let answer = |precise, matched_blocks| MatchResponse {
        replicas: vec![kvroute_index_api::api::ReplicaMatch {
            replica_id: "r1".to_owned(),
            matched_blocks,
            precise,
            ..Default::default()
        }],
        ..Default::default()
    };
    let holds = |answer: Option<MatchResponse>| {
        picker.holds_all(&candidates, &keys, answer.as_ref(), &runtime.config)
    };
    assert!(holds(Some(answer(true, 3))));
    assert!(!holds(Some(answer(true, 2))));
    // An answer the index does not vouch for counts only through kvroute's memory.
    assert!(!holds(Some(answer(false, 3))));
    assert!(!holds(None));
}

/// One token per byte of the prompt, at once.
#[derive(Debug)]
struct BytesTokenizer;

impl Tokenizer for BytesTokenizer {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        Box::pin(std::future::ready(Ok(one_per_byte(&input))))
    }
}

/// A disaggregated pool (split at 1000 prompt tokens, 500 uncached) over decode replicas d0, d1
/// and prefill replicas `prefill` (ids), and the registry its metrics are in.
fn disaggregated_picker(prefill: &[&str]) -> (Picker, Registry) {
    let mut yaml = "budgets: {decision: 5s, tokenize: 5s}\n\
         pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}, \
         disaggregation: {min_prompt_tokens: 1000, min_uncached_tokens: 500}}\n\
         replicas:\n\
         - {id: d0, pool: p, address: \"10.0.0.1:8000\", role: decode}\n\
         - {id: d1, pool: p, address: \"10.0.0.2:8000\", role: decode}\n"
        .to_owned();
    for (i, id) in prefill.iter().enumerate() {
        yaml.push_str(&format!(
            "- {{id: {id}, pool: p, address: \"10.0.1.{i}:8000\", role: prefill}}\n"
        ));
    }
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(Config::from_yaml(&yaml).unwrap(), None, &tasks)
        .unwrap()
        .with_tokenizer(0, Arc::new(BytesTokenizer));
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    (Picker::new(runtime, metrics, tasks), registry)
}

fn disaggregation_count(registry: &Registry, decision: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let prefix = format!(
        "kvroute_extproc_disaggregation_decisions_total{{pool=\"p\",decision=\"{decision}\"}} "
    );
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |count| count.parse().unwrap())
}

async fn decide_prompt(picker: &Picker, prompt: &str) -> Decision {
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    let request = parse(body.as_bytes(), Endpoint::Completions).unwrap();
    picker.decide(&request, None).await.unwrap()
}

#[tokio::test]
async fn long_uncached_prompts_split_off_to_a_prefill_replica_and_short_or_cached_ones_stay() {
    let (picker, registry) = disaggregated_picker(&["p0", "p1"]);
    let document = text_of(1, 3000);

    let short = decide_prompt(&picker, &document[..600]).await;
    assert!(short.prefill.is_none(), "a short prompt is served whole");
    assert!(short.replica_id.starts_with('d'));
    drop(short);

    // A long prompt nobody holds: its decode replica is chosen first, then a prefill replica.
    let first = decide_prompt(&picker, &document).await;
    let decode = first.replica_id.clone();
    let prefill = first.prefill.as_ref().map(|leg| leg.replica_id.clone());
    assert!(
        decode.starts_with('d'),
        "never sent to a prefill replica: {decode}"
    );
    assert!(
        prefill.as_deref().is_some_and(|p| p.starts_with('p')),
        "{prefill:?}"
    );
    drop(first);

    // Again: the decode replica holds it now (kvroute's own memory), so it stays there whole.
    let again = decide_prompt(&picker, &document).await;
    assert_eq!(again.replica_id, decode);
    assert!(again.prefill.is_none(), "a cached prompt is served whole");
    drop(again);

    // A prompt sharing the document's first 2000 tokens but 1000 new ones: split again, its
    // prompt computed where the shared part already is.
    let longer = format!("{}{}", &document[..2000], text_of(2, 1000));
    let split = decide_prompt(&picker, &longer).await;
    assert_eq!(
        split.replica_id, decode,
        "the decode replica holding the prefix"
    );
    assert_eq!(
        split.prefill.as_ref().map(|leg| leg.replica_id.clone()),
        prefill,
        "the prefill replica holding the prefix"
    );
    drop(split);

    for (decision, count) in [("short_prompt", 1), ("split", 2), ("cached", 1)] {
        assert_eq!(
            disaggregation_count(&registry, decision),
            count,
            "{decision}"
        );
    }
}

#[tokio::test]
async fn without_a_prefill_replica_a_long_prompt_is_served_whole_and_counted() {
    let (picker, registry) = disaggregated_picker(&[]);
    let decision = decide_prompt(&picker, &text_of(3, 3000)).await;
    assert!(decision.prefill.is_none());
    assert_eq!(disaggregation_count(&registry, "no_prefill_replica"), 1);
}

#[tokio::test]
async fn a_prefill_pool_queued_past_the_bound_serves_long_prompts_whole() {
    use kvroute_routing::load::Scraped;
    let (picker, registry) = disaggregated_picker(&["p0", "p1"]);
    let queued = |replica: &str, waiting: f64| {
        picker.loads().replica(replica).record_scrape(Scraped {
            waiting,
            ..Scraped::default()
        });
    };
    // 40 waiting requests are 2 s of queue at the default weights, past the 1 s bound; the
    // 3000-token prompt is 150 ms of prefill on an idle decode replica.
    queued("p0", 40.0);
    queued("p1", 40.0);
    let whole = decide_prompt(&picker, &text_of(4, 3000)).await;
    assert!(whole.prefill.is_none(), "every prefill replica is queued");
    drop(whole);
    assert_eq!(disaggregation_count(&registry, "prefill_busy"), 1);

    // One prefill replica drains: it takes the leg, the busy one does not.
    queued("p1", 0.0);
    let split = decide_prompt(&picker, &text_of(5, 3000)).await;
    assert_eq!(
        split.prefill.as_ref().map(|leg| leg.replica_id.as_str()),
        Some("p1")
    );
    drop(split);

    // Decode replicas queued longer than the prefill pool: the leg goes to the busy prefill
    // replica all the same (serving whole would only move the wait onto the decode replica).
    queued("p1", 40.0);
    queued("d0", 60.0);
    queued("d1", 60.0);
    let split = decide_prompt(&picker, &text_of(6, 3000)).await;
    assert!(split.prefill.is_some(), "decode replicas are busier still");
    drop(split);
    assert_eq!(disaggregation_count(&registry, "split"), 2);
    assert_eq!(disaggregation_count(&registry, "prefill_busy"), 1);
}

/// `len` bytes of seeded lower-case text.
fn text_of(seed: u64, len: usize) -> String {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            char::from(b'a' + (state % 26) as u8)
        })
        .collect()
}

/// A decision reads its candidates' load records from a copy resolved by name once per config
/// and board; a new board (a tie seed set after routing began) is read anew, not through the
/// copy of the old one.
#[tokio::test]
async fn load_records_are_read_from_the_board_the_picker_routes_with() {
    let config = Config::from_yaml(
        "pools:\n- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}\n\
         replicas:\n\
         - {id: r0, pool: p, address: \"10.0.0.1:8000\"}\n\
         - {id: r1, pool: p, address: \"10.0.0.2:8000\"}\n",
    )
    .unwrap();
    let tasks = TaskTracker::new();
    let runtime = Runtime::build(config, None, &tasks).unwrap();
    let picker = Picker::new(runtime, Metrics::register(&mut Registry::default()), tasks);
    let request = parse(
        br#"{"model": "m", "prompt": "hello"}"#,
        Endpoint::Completions,
    )
    .unwrap();
    // Resolves the records of the first board.
    drop(picker.decide(&request, None).await.unwrap());
    let picker = picker.with_tie_seed(7);
    let unready = picker.loads().replica("r1");
    for _ in 0..crate::config::DEFAULT_UNREADY_AFTER_FAILURES {
        unready.record_scrape_failure();
    }
    for _ in 0..20 {
        let decision = picker.decide(&request, None).await.unwrap();
        assert_eq!(
            decision.replica_id, "r0",
            "r1 is unready on the board routed with"
        );
    }
}
