//! The token cache: lookups, the steps of a miss, blocking slots and the background lane, with
//! the tiny test model and gated test tokenizers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute_tokenize::ModelTokenizer;
use tokio_util::task::TaskTracker;

use super::blocking::record_rate;
use super::schedule::PREFIX_HIT_WAIT;
use super::{PromptTokens, TokenCache, TokenLimits, TokenSource, TokensRequest, cache_entry_bytes};
use crate::error::TokenizeError;
use crate::metrics::Metrics;
use crate::request::{Endpoint, parse};
use crate::tokenizer::input::owned_input;
use crate::tokenizer::tests::{TINY_MODEL, TURN1, TURN2, TURN3};
use crate::tokenizer::{
    InProcess, InProcessTokenizer, KeysJob, LeadingFuture, TokenizeFuture, TokenizeInput,
    Tokenizer, TokenizerMode,
};

#[test]
fn the_expected_cost_of_a_blocking_tokenization_follows_recent_ones() {
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    assert_eq!(
        cache.expected_blocking(100_000),
        Duration::ZERO,
        "nothing measured yet"
    );
    // 10 ms for 100 kB: 100 ns per byte.
    record_rate(
        &cache.blocking_ps_per_byte,
        Duration::from_millis(10),
        100_000,
    );
    assert_eq!(cache.expected_blocking(100_000), Duration::from_millis(10));
    assert_eq!(cache.expected_blocking(50_000), Duration::from_millis(5));
    // One faster sample moves the average an eighth of the way.
    record_rate(
        &cache.blocking_ps_per_byte,
        Duration::from_millis(2),
        100_000,
    );
    assert_eq!(cache.expected_blocking(100_000), Duration::from_millis(9));
}

/// The in-process tokenizer behind a gate: answers only while the gate is open.
#[derive(Debug)]
struct GatedTokenizer {
    inner: InProcessTokenizer,
    open: tokio::sync::watch::Sender<bool>,
}

impl Tokenizer for GatedTokenizer {
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let tokens = self.inner.tokenize(model, input);
        let mut open = self.open.subscribe();
        Box::pin(async move {
            let _ = open.wait_for(|open| *open).await;
            tokens.await
        })
    }
}

/// The in-process tokenizer answering after `delay`, waited for like a network tokenizer.
#[derive(Debug)]
struct SlowExactTokenizer {
    inner: InProcessTokenizer,
    delay: Duration,
}

impl Tokenizer for SlowExactTokenizer {
    fn tokenize(&self, model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        let tokens = self.inner.tokenize(model, input);
        let delay = self.delay;
        Box::pin(async move {
            tokio::time::sleep(delay).await; // the engine's round trip (the workload)
            tokens.await
        })
    }

    /// Reported as a remote `/tokenize`: a prefix hit waits for it as for a network tokenizer.
    fn mode(&self) -> TokenizerMode {
        TokenizerMode::Remote
    }
}

#[tokio::test]
async fn a_network_tokenizer_is_waited_for_on_a_prefix_hit() {
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(SlowExactTokenizer {
        inner: InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap(),
        delay: PREFIX_HIT_WAIT * 10,
    });
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    let budget = Duration::from_secs(5);
    let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
    cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    // Turn 1 is a cached prefix of turn 2, yet the answer is turn 2's exact tokens.
    let second = parse(TURN2.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let t2 = cache
        .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!((t2.source, t2.exact), (TokenSource::Tokenizer, true));
    let messages: serde_json::Value = serde_json::from_str(TURN2).unwrap();
    let expected = ModelTokenizer::from_dir(TINY_MODEL)
        .unwrap()
        .encode_chat(&messages["messages"], true)
        .unwrap();
    assert_eq!(&*t2.tokens, expected.as_slice());
}

#[tokio::test]
async fn next_turn_gets_exact_tokens_and_the_cache_serves_repeats() {
    let in_process = InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap();
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    let tokenizer: Arc<dyn Tokenizer> = Arc::new(in_process);
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    let budget = Duration::from_secs(5);
    let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let t1 = cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!((t1.source, t1.exact), (TokenSource::Tokenizer, true));
    let again = cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!(again.source, TokenSource::Cache);
    // The next turn's prefix is cached with its resume point: the turn is tokenized from
    // there (its new text only), exactly; and so is the turn after it.
    for turn in [TURN2, TURN3] {
        let next = parse(turn.as_bytes(), Endpoint::ChatCompletions).unwrap();
        let tokens = cache
            .tokens(0, "m", &next.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        assert_eq!((tokens.source, tokens.exact), (TokenSource::Resumed, true));
        let messages: serde_json::Value = serde_json::from_str(turn).unwrap();
        let expected = direct.encode_chat(&messages["messages"], true).unwrap();
        assert_eq!(&*tokens.tokens, expected.as_slice());
    }
    // Another pool never sees pool 0's entries.
    let other = cache
        .tokens(1, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!(other.source, TokenSource::Tokenizer);
}

#[tokio::test]
async fn a_hit_too_long_to_wait_for_routes_at_once_and_the_lane_caches_the_whole_turn() {
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    let budget = Duration::from_secs(5);
    // Longer than INLINE_MAX_BYTES: both turns run blocking.
    let story = "Once upon a time, in a land of long prompts, ".repeat(500);
    let turn1 = serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": story}]})
    .to_string();
    let turn2 = serde_json::json!({"model": "m", "messages": [
        {"role": "user", "content": story},
        {"role": "assistant", "content": "And then?"},
        {"role": "user", "content": "More"}]})
    .to_string();
    let first = parse(turn1.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let t1 = cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!(t1.source, TokenSource::Tokenizer);
    // Recent blocking tokenizations say this prompt takes far over PREFIX_HIT_MAX_EXPECTED.
    cache
        .blocking_ps_per_byte
        .store(1_000_000, std::sync::atomic::Ordering::Relaxed);
    let second = parse(turn2.as_bytes(), Endpoint::ChatCompletions).unwrap();
    // The decision's key function: the lane caches its keys with the whole tokens.
    let (keys_job, _) = chain_keys_job();
    // Turn 2 as a decision asks for it (never a leading part), with the key function.
    let turn2_tokens = || {
        cache.tokens_for(TokensRequest {
            pool: 0,
            model: "m",
            prompt: &second.prompt,
            tokenizer: Some(&tokenizer),
            budget,
            leading_from: Some(usize::MAX / 2),
            keys_job: Some(&keys_job),
            leading_steps: None,
        })
    };
    let t2 = turn2_tokens().await.unwrap();
    assert_eq!((t2.source, t2.exact), (TokenSource::PrefixCache, false));
    assert!(t2.keys.is_none(), "turn 1 was cached without keys");
    assert_eq!(t2.tokens, t1.tokens);
    assert_eq!(
        cache.gauges.blocking_in_flight.get(),
        0,
        "no blocking slot taken"
    );
    // The lane tokenizes turn 2 whole and caches it, exactly.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let cached = loop {
        let t = turn2_tokens().await.unwrap();
        if t.source == TokenSource::Cache {
            break t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lane never cached turn 2"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let messages: serde_json::Value = serde_json::from_str(&turn2).unwrap();
    let expected = direct.encode_chat(&messages["messages"], true).unwrap();
    assert_eq!(&*cached.tokens, expected.as_slice());
    let keys = cached.keys.expect("cached with its keys");
    assert_eq!(keys.fingerprint, 42);
    assert_eq!(&*keys.keys, chain_keys(&expected).as_slice());
    wait_for("the lane's jobs all ended", || {
        cache.gauges.background_queued.get() == 0
    })
    .await;
}

#[tokio::test]
async fn the_lane_resumes_a_leading_miss_and_the_next_turn_resumes_from_it() {
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
    let direct = ModelTokenizer::from_dir(TINY_MODEL).unwrap();
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    let budget = Duration::from_secs(5);
    let story = "Once upon a time, in a land of long prompts, a router met a cache. ".repeat(60);
    let turn1 = serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": story}]});
    let mut turn2 = turn1.clone();
    if let Some(messages) = turn2["messages"].as_array_mut() {
        messages.push(serde_json::json!({"role": "assistant", "content": "And then?"}));
        messages.push(serde_json::json!({"role": "user", "content": "Tell me more"}));
    }
    let expected = |turn: &serde_json::Value| direct.encode_chat(&turn["messages"], true).unwrap();
    // Turn 1 as a decision asks for it: only its leading part now.
    let body1 = turn1.to_string();
    let first = parse(body1.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let (keys_job, hashed) = chain_keys_job();
    // A turn as a decision asks for it, leading parts from 1 KiB, with the key function.
    let decide = |prompt| {
        cache.tokens_for(TokensRequest {
            pool: 0,
            model: "m",
            prompt,
            tokenizer: Some(&tokenizer),
            budget,
            leading_from: Some(1024),
            keys_job: Some(&keys_job),
            leading_steps: None,
        })
    };
    let t1 = decide(&first.prompt).await.unwrap();
    assert_eq!((t1.source, t1.exact), (TokenSource::Leading, false));
    let whole1 = expected(&turn1);
    assert!(t1.tokens.len() < whole1.len() && whole1.starts_with(&t1.tokens));
    // The lane encodes the rest from the leading part's cut; the cache then holds all of it.
    wait_for("the lane cached turn 1", || {
        cache.gauges.background_queued.get() == 0
    })
    .await;
    let cached = cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!(cached.source, TokenSource::Cache);
    assert_eq!(&*cached.tokens, whole1.as_slice());
    // With its keys, and the chain's point at its resume point's last full block.
    let keys1 = cached.keys.expect("the lane cached turn 1's keys");
    assert_eq!(&*keys1.keys, chain_keys(&whole1).as_slice());
    let point = keys1.point.expect("a chain point");
    assert!(point.blocks() > 0 && point.blocks() <= keys1.keys.len());
    // Turn 2 takes over turn 1's tokens before its last cut and encodes the rest: exact.
    let body2 = turn2.to_string();
    let second = parse(body2.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let before = hashed.load(Ordering::Relaxed);
    let t2 = decide(&second.prompt).await.unwrap();
    assert_eq!((t2.source, t2.exact), (TokenSource::Resumed, true));
    let whole2 = expected(&turn2);
    assert_eq!(&*t2.tokens, whole2.as_slice());
    // Its keys are exact, and only the blocks after turn 1's chain point were hashed.
    let keys2 = t2.keys.expect("turn 2's keys");
    let all2 = chain_keys(&whole2);
    assert_eq!(&*keys2.keys, all2.as_slice());
    assert_eq!(
        hashed.load(Ordering::Relaxed) - before,
        all2.len() - point.blocks()
    );
    // A foreign turn's keys are not extended: its tokens differ before the point.
    let mut foreign = whole2.clone();
    foreign[0] ^= 1;
    let refused = keys_job
        .keys_for(&foreign, Some((&whole1, &keys1)), foreign.len())
        .expect("keys");
    assert_eq!(&*refused.keys, chain_keys(&foreign).as_slice());
}

/// Token-chain keys of 16-token blocks, as a pool's decision computes them.
fn chain_keys(tokens: &[u32]) -> Vec<u64> {
    kvroute_block_keys::KeyScheme::TokenChain
        .prompt_keys(tokens, 16, None, None)
        .unwrap()
}

/// A decision's key function for token-chain keys of 16-token blocks, and how many blocks
/// it has hashed.
fn chain_keys_job() -> (KeysJob, Arc<AtomicUsize>) {
    let hashed = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hashed);
    let job = KeysJob {
        fingerprint: 42,
        block_size: 16,
        compute: Arc::new(move |from, tokens, mark, out| {
            let before = out.len();
            let point = kvroute_block_keys::KeyScheme::TokenChain
                .extend_prompt_keys(from, tokens, 16, None, None, mark, out)?;
            counted.fetch_add(out.len() - before, Ordering::Relaxed);
            Ok(point)
        }),
    };
    (job, hashed)
}

#[tokio::test]
async fn slow_tokenizer_routes_on_the_cached_prefix_and_fills_the_cache_later() {
    let (open, _) = tokio::sync::watch::channel(true);
    let gated = Arc::new(GatedTokenizer {
        inner: InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap(),
        open,
    });
    let tokenizer: Arc<dyn Tokenizer> = Arc::clone(&gated) as Arc<dyn Tokenizer>;
    let cache = TokenCache::new(TokenLimits::default(), TaskTracker::new());
    let budget = Duration::from_secs(5);
    let first = parse(TURN1.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let t1 = cache
        .tokens(0, "m", &first.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();

    gated.open.send_replace(false);
    let second = parse(TURN2.as_bytes(), Endpoint::ChatCompletions).unwrap();
    let t2 = cache
        .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
        .await
        .unwrap();
    assert_eq!((t2.source, t2.exact), (TokenSource::PrefixCache, false));
    assert_eq!(t2.tokens, t1.tokens);
    assert!(t2.estimated_len > t1.tokens.len());

    // The tokenization left running in the background fills the cache for the next call.
    gated.open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        gated.open.send_replace(false);
        let t = cache
            .tokens(0, "m", &second.prompt, Some(&tokenizer), budget)
            .await
            .unwrap();
        gated.open.send_replace(true);
        if t.source == TokenSource::Cache {
            assert!(t.exact && t.tokens.len() > t1.tokens.len());
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "cache never filled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One token per byte, on a blocking thread (`runs_blocking`) that waits until the gate is
/// open; counts the calls that started.
#[derive(Debug)]
struct GatedBlocking {
    open: tokio::sync::watch::Sender<bool>,
    started: Arc<std::sync::atomic::AtomicUsize>,
}

impl GatedBlocking {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            open: tokio::sync::watch::channel(false).0,
            started: Arc::default(),
        })
    }
}

/// One token per byte of a completion's text.
fn byte_tokens(input: &TokenizeInput) -> Vec<u32> {
    match input {
        TokenizeInput::Text { text, .. } => text.bytes().map(u32::from).collect(),
        _ => Vec::new(),
    }
}

impl Tokenizer for GatedBlocking {
    fn tokenize(&self, _model: &str, input: Arc<TokenizeInput>) -> TokenizeFuture {
        if !self.runs_blocking(&input, false) {
            return Box::pin(std::future::ready(Ok(byte_tokens(&input))));
        }
        let mut open = self.open.subscribe();
        let started = Arc::clone(&self.started);
        let work = tokio::task::spawn_blocking(move || {
            started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let gate = open.wait_for(|open| *open);
            let _ = tokio::runtime::Handle::current().block_on(gate);
            byte_tokens(&input)
        });
        Box::pin(async move {
            work.await.map_err(|e| TokenizeError::InProcess {
                reason: e.to_string(),
            })
        })
    }

    fn in_process(&self) -> Option<&dyn InProcess> {
        Some(self)
    }
}

impl InProcess for GatedBlocking {
    fn runs_blocking(&self, input: &TokenizeInput, _leading: bool) -> bool {
        input.len_bytes() > 8
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
    ) -> Option<Result<kvroute_tokenize::ResumableTokens, TokenizeError>> {
        None
    }

    fn tokenize_now(&self, input: &TokenizeInput) -> Result<Vec<u32>, TokenizeError> {
        Ok(byte_tokens(input))
    }
}

fn completion(text: &str) -> String {
    serde_json::json!({"model": "m", "prompt": text}).to_string()
}

async fn tokens_of(
    cache: &TokenCache,
    tokenizer: &Arc<dyn Tokenizer>,
    body: &str,
    budget: Duration,
) -> Result<PromptTokens, TokenizeError> {
    let parsed = parse(body.as_bytes(), Endpoint::Completions).unwrap();
    cache
        .tokens(0, "m", &parsed.prompt, Some(tokenizer), budget)
        .await
}

async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
    let within = kvroute_test_support::deadline(Duration::from_secs(10));
    kvroute_test_support::poll_until(what, within, || std::future::ready(condition())).await;
}

#[tokio::test]
async fn the_cache_is_bounded_by_bytes_and_counts_every_entry() {
    let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
    let limits = TokenLimits {
        cache_bytes: 64 * 1024,
        ..TokenLimits::default()
    };
    let cache = TokenCache::new(limits, TaskTracker::new()).with_metrics(&metrics);
    let gated = GatedBlocking::new();
    gated.open.send_replace(true);
    let tokenizer: Arc<dyn Tokenizer> = gated;
    let budget = Duration::from_secs(10);
    // 100 distinct prompts of 1000 tokens: 100 × (4000 + overhead) bytes, far over the bound.
    for i in 0..100 {
        let text = format!("{i:04}{}", "x".repeat(996));
        let tokens = tokens_of(&cache, &tokenizer, &completion(&text), budget)
            .await
            .unwrap();
        assert_eq!(tokens.tokens.len(), 1000);
        assert!(cache.bytes() <= limits.cache_bytes, "{}", cache.bytes());
    }
    let entry = cache_entry_bytes(&[0; 1000]);
    assert_eq!(
        cache.bytes(),
        limits.cache_bytes / entry * entry,
        "kept full"
    );
    assert_eq!(metrics.token_cache_bytes.get(), cache.bytes() as i64);
    assert_eq!(
        metrics.token_cache_entries.get(),
        (limits.cache_bytes / entry) as i64
    );
    // The most recent ones stay; the oldest went.
    let last = completion(&format!("0099{}", "x".repeat(996)));
    let first = completion(&format!("0000{}", "x".repeat(996)));
    assert_eq!(
        tokens_of(&cache, &tokenizer, &last, budget)
            .await
            .unwrap()
            .source,
        TokenSource::Cache
    );
    assert_eq!(
        tokens_of(&cache, &tokenizer, &first, budget)
            .await
            .unwrap()
            .source,
        TokenSource::Tokenizer
    );
}

#[tokio::test]
async fn blocking_tokenizations_are_capped_and_a_late_one_finishes_holding_its_slot() {
    let metrics = Metrics::register(&mut prometheus_client::registry::Registry::default());
    let limits = TokenLimits {
        concurrency: 1,
        max_prompt_bytes: 1000,
        ..TokenLimits::default()
    };
    let tasks = TaskTracker::new();
    let cache = TokenCache::new(limits, tasks.clone()).with_metrics(&metrics);
    let gated = GatedBlocking::new();
    let tokenizer: Arc<dyn Tokenizer> = Arc::clone(&gated) as Arc<dyn Tokenizer>;
    let short = Duration::from_millis(20);
    let long_prompt = completion(&"a".repeat(900));
    // Its decision stops waiting; the work goes on, holding the only slot.
    let late = tokens_of(&cache, &tokenizer, &long_prompt, short).await;
    assert!(
        matches!(late, Err(TokenizeError::Timeout { .. })),
        "{late:?}"
    );
    let started = || gated.started.load(std::sync::atomic::Ordering::SeqCst);
    wait_for("the late work started", || started() == 1).await;
    assert_eq!(metrics.tokenize_blocking_in_flight.get(), 1);
    assert_eq!(metrics.tokenize_abandoned.get(), 1);
    // The next blocking one gets no slot within its budget and does not start.
    let busy = tokens_of(&cache, &tokenizer, &completion(&"b".repeat(900)), short).await;
    assert!(matches!(busy, Err(TokenizeError::Busy { .. })), "{busy:?}");
    assert_eq!(started(), 1);
    // Work that does not block needs no slot.
    let small = tokens_of(&cache, &tokenizer, &completion("hi"), short).await;
    assert_eq!(small.unwrap().tokens.len(), 2);
    // Too large for in-process tokenization: refused at once, before any slot.
    let huge = tokens_of(&cache, &tokenizer, &completion(&"c".repeat(1001)), short).await;
    assert!(
        matches!(
            huge,
            Err(TokenizeError::PromptTooLarge {
                bytes: 1001,
                limit: 1000
            })
        ),
        "{huge:?}"
    );
    // The abandoned work ends, frees its slot and leaves its (bounded) result in the cache.
    gated.open.send_replace(true);
    wait_for("the slot is freed", || {
        metrics.tokenize_blocking_in_flight.get() == 0
    })
    .await;
    let again = tokens_of(&cache, &tokenizer, &long_prompt, short).await;
    assert_eq!(again.unwrap().source, TokenSource::Cache);
    let next = tokens_of(&cache, &tokenizer, &completion(&"b".repeat(900)), short).await;
    assert_eq!(next.unwrap().source, TokenSource::Tokenizer);
    tasks.close();
    tasks.wait().await;
}

#[tokio::test]
async fn in_process_tokenizer_refuses_prompts_over_the_limit_and_inlines_small_ones() {
    let tokenizer: Arc<dyn Tokenizer> =
        Arc::new(InProcessTokenizer::load(TINY_MODEL.as_ref(), TaskTracker::new()).unwrap());
    let limits = TokenLimits {
        concurrency: 1,
        max_prompt_bytes: 64 * 1024,
        ..TokenLimits::default()
    };
    let cache = TokenCache::new(limits, TaskTracker::new());
    let budget = Duration::from_secs(10);
    let over = completion(&"word ".repeat(13 * 1024 + 1));
    let refused = tokens_of(&cache, &tokenizer, &over, budget).await;
    assert!(
        matches!(refused, Err(TokenizeError::PromptTooLarge { .. })),
        "{refused:?}"
    );
    // Its leading tokens are still computed (bounded work: a cut from the leading part).
    let parsed = parse(over.as_bytes(), Endpoint::Completions).unwrap();
    let leading = cache
        .tokens_for(TokensRequest {
            pool: 0,
            model: "m",
            prompt: &parsed.prompt,
            tokenizer: Some(&tokenizer),
            budget,
            leading_from: Some(16 * 1024),
            keys_job: None,
            leading_steps: None,
        })
        .await
        .unwrap();
    assert_eq!(leading.source, TokenSource::Leading);
    let small = completion("Hello world");
    let in_process = tokenizer.in_process().expect("in process");
    assert!(
        !in_process.runs_blocking(
            &owned_input(
                &parse(small.as_bytes(), Endpoint::Completions)
                    .unwrap()
                    .prompt
            ),
            false
        )
    );
    assert!(in_process.runs_blocking(&owned_input(&parsed.prompt), false));
}
