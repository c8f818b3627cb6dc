//! The simulated engine: FIFO admission under `max_num_seqs` and free KV blocks, the timing model,
//! block bookkeeping as tokens are computed, and vLLM's scheduler counters.
//!
//! Timing: a request waits for admission, then its prefill takes `ttft_overhead + uncached prompt
//! tokens × prefill_per_token`, run one prefill at a time (a later prefill queues behind earlier
//! ones, as in a token-budgeted engine step); each further output token takes `decode_per_token`.
//!
//! Every cache operation's events go out as one batch (one "engine step"), in order, through the
//! event sink, under the state lock so batches are sequenced exactly as they happened.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_block_keys::{Digest, VllmHasher};
use kvroute_index::event::KvEvent;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::cache::{BlockId, HeldBlock, KvCache};
use super::config::{CacheGeometry, Timing};

/// Receives each step's events (the publisher); `None` when events are off.
pub type EventSink = Box<dyn Fn(Vec<KvEvent>) + Send + Sync>;

/// Why a request cannot run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Prompt plus output exceed `max_model_len` or the whole KV cache.
    #[error("this model's maximum context length is {max} tokens; the request needs {needed}")]
    TooLong {
        /// Tokens needed.
        needed: usize,
        /// Limit.
        max: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

impl EngineError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            EngineError::TooLong { .. } => "too_long",
            EngineError::EmptyPrompt => "empty_prompt",
            EngineError::ShuttingDown => "shutting_down",
        }
    }
}

/// Counters scraped by `/metrics` (vLLM's names in comments).
#[derive(Debug, Default)]
pub struct EngineCounters {
    /// `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: AtomicU64,
    /// `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: AtomicU64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: AtomicU64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: AtomicU64,
    /// `vllm:request_success_total`.
    pub requests_finished: AtomicU64,
}

/// A point-in-time view for `/metrics`.
#[derive(Debug, Clone, Copy)]
pub struct EngineGauges {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests admitted and not finished.
    pub running: usize,
    /// Fraction of blocks in use.
    pub kv_cache_usage: f64,
}

struct Waiting {
    digests: Vec<Digest>,
    prompt_len: usize,
    total_blocks: usize,
    admit: oneshot::Sender<Admitted>,
}

struct Admitted {
    blocks: Vec<BlockId>,
    hit_blocks: usize,
}

struct State {
    cache: KvCache,
    waiting: VecDeque<Waiting>,
    running: usize,
    prefill_free_at: Instant,
}

/// The engine shared by all requests.
pub struct Engine {
    state: Mutex<State>,
    geometry: CacheGeometry,
    timing: Timing,
    hasher: VllmHasher,
    sink: Option<EventSink>,
    /// Event batches handed to the sink; changes under the state lock with every cache change
    /// that publishes, so two equal readings bracket a moment the block set did not change.
    published_batches: AtomicU64,
    /// Scheduler counters.
    pub counters: EngineCounters,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("geometry", &self.geometry)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An idle engine.
    pub fn new(
        geometry: CacheGeometry,
        timing: Timing,
        hasher: VllmHasher,
        sink: Option<EventSink>,
    ) -> Self {
        Self {
            state: Mutex::new(State {
                cache: KvCache::new(geometry.num_blocks, geometry.block_size),
                waiting: VecDeque::new(),
                running: 0,
                prefill_free_at: Instant::now(),
            }),
            geometry,
            timing,
            hasher,
            sink,
            published_batches: AtomicU64::new(0),
            counters: EngineCounters::default(),
        }
    }

    /// Queues a request and waits until it is admitted and its prefill is done: the caller then
    /// holds the first output token's moment. Dropping the future (client gone) gives up its slot.
    pub async fn start(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> Result<Sequence, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let needed = prompt.len() + max_tokens;
        let bs = self.geometry.block_size;
        // KV slots for every computed token; the last sampled token is never computed.
        let total_blocks = (needed - 1).div_ceil(bs);
        let max = self
            .geometry
            .max_model_len
            .min(self.geometry.num_blocks * bs);
        if needed > self.geometry.max_model_len || total_blocks > self.geometry.num_blocks {
            return Err(EngineError::TooLong { needed, max });
        }
        let digests = self.hash_blocks(None, &prompt);
        let (admit, admitted) = oneshot::channel();
        {
            let mut state = self.state.lock();
            state.waiting.push_back(Waiting {
                digests: digests.clone(),
                prompt_len: prompt.len(),
                total_blocks,
                admit,
            });
            self.admit_waiting(&mut state);
        }
        // The sender lives in the queue until admission; it is only dropped with the engine.
        let Admitted { blocks, hit_blocks } =
            admitted.await.map_err(|_| EngineError::ShuttingDown)?;
        let prompt_len = prompt.len();
        // Built before the prefill wait so a client leaving during it frees the blocks.
        let sequence = Sequence {
            engine: Arc::clone(self),
            tokens: prompt,
            prompt_len,
            digests,
            blocks,
            hit_blocks,
            cached_blocks: hit_blocks,
            generated: 0,
            max_tokens,
            finished: false,
        };
        let uncached = prompt_len - hit_blocks * bs;
        let prefill_done = {
            let mut state = self.state.lock();
            let start = state.prefill_free_at.max(Instant::now());
            let done =
                start + self.timing.ttft_overhead + self.timing.prefill_per_token * uncached as u32;
            state.prefill_free_at = done;
            done
        };
        tokio::time::sleep_until(prefill_done).await;
        Ok(sequence)
    }

    /// Admits waiting requests in FIFO order while a slot and enough blocks are free.
    fn admit_waiting(&self, state: &mut State) {
        let mut events = Vec::new();
        while let Some(front) = state.waiting.front() {
            if front.admit.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            if state.running >= self.geometry.max_num_seqs {
                break;
            }
            let Some(allocation) = state.cache.allocate(
                &front.digests,
                front.prompt_len,
                front.total_blocks,
                &mut events,
            ) else {
                break;
            };
            let Some(waiting) = state.waiting.pop_front() else {
                break;
            };
            let bs = self.geometry.block_size as u64;
            self.counters
                .prefix_cache_queries
                .fetch_add(waiting.prompt_len as u64, Ordering::Relaxed);
            self.counters
                .prefix_cache_hits
                .fetch_add(allocation.hit_blocks as u64 * bs, Ordering::Relaxed);
            self.counters
                .prompt_tokens
                .fetch_add(waiting.prompt_len as u64, Ordering::Relaxed);
            let admitted = Admitted {
                blocks: allocation.blocks,
                hit_blocks: allocation.hit_blocks,
            };
            match waiting.admit.send(admitted) {
                Ok(()) => state.running += 1,
                // The client left between the check above and now.
                Err(admitted) => state.cache.free(&admitted.blocks),
            }
        }
        self.publish(events);
    }

    fn hash_blocks(&self, parent: Option<&Digest>, tokens: &[u32]) -> Vec<Digest> {
        let mut digests = Vec::new();
        // Only fails for a zero block size, which the config rejects.
        let _ = self.hasher.chain_into(
            parent,
            tokens,
            self.geometry.block_size,
            |_| None,
            &mut digests,
        );
        digests
    }

    fn publish(&self, events: Vec<KvEvent>) {
        if let (false, Some(sink)) = (events.is_empty(), &self.sink) {
            self.published_batches.fetch_add(1, Ordering::Relaxed);
            sink(events);
        }
    }

    /// `POST /reset_prefix_cache`.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut state = self.state.lock();
        let mut events = Vec::new();
        let done = state.cache.reset(&mut events);
        self.publish(events);
        done
    }

    /// Blocks carrying a hash (`GET /debug/blocks`).
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        self.state.lock().cache.held_blocks()
    }

    /// [`Engine::held_blocks`] with the number of event batches published so far, read together
    /// under the state lock: the blocks are what those batches describe.
    pub fn held_blocks_at(&self) -> (u64, Vec<HeldBlock>) {
        let state = self.state.lock();
        let published = self.published_batches.load(Ordering::Relaxed);
        (published, state.cache.held_blocks())
    }

    /// Scheduler gauges.
    pub fn gauges(&self) -> EngineGauges {
        let state = self.state.lock();
        EngineGauges {
            waiting: state
                .waiting
                .iter()
                .filter(|w| !w.admit.is_closed())
                .count(),
            running: state.running,
            kv_cache_usage: state.cache.usage(),
        }
    }

    /// Cache geometry.
    pub fn geometry(&self) -> CacheGeometry {
        self.geometry
    }
}

/// A running request, after prefill. Dropping it (finished or client gone) frees its blocks.
pub struct Sequence {
    engine: Arc<Engine>,
    tokens: Vec<u32>,
    prompt_len: usize,
    digests: Vec<Digest>,
    blocks: Vec<BlockId>,
    hit_blocks: usize,
    cached_blocks: usize,
    generated: usize,
    max_tokens: usize,
    finished: bool,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("prompt_len", &self.prompt_len)
            .field("generated", &self.generated)
            .finish_non_exhaustive()
    }
}

impl Sequence {
    /// Prompt tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`).
    pub fn cached_tokens(&self) -> usize {
        self.hit_blocks * self.engine.geometry.block_size
    }

    /// Prompt length.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Output tokens so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Output tokens still to come.
    pub fn remaining(&self) -> usize {
        self.max_tokens - self.generated
    }

    /// Records the next output token, waiting the decode time for every token after the first.
    /// `None` once `max_tokens` are out (the request then finishes and frees its blocks).
    pub async fn next_token(&mut self, token: u32) -> Option<u32> {
        if self.generated >= self.max_tokens {
            self.finish();
            return None;
        }
        if self.generated > 0 {
            tokio::time::sleep(self.engine.timing.decode_per_token).await;
        }
        self.generated += 1;
        self.tokens.push(token);
        self.engine
            .counters
            .generation_tokens
            .fetch_add(1, Ordering::Relaxed);
        self.cache_computed_blocks();
        Some(token)
    }

    /// Caches blocks that became full: the prompt at the first token, then one block every
    /// `block_size` decoded tokens. The newest sampled token has no KV yet, so it is excluded.
    fn cache_computed_blocks(&mut self) {
        let bs = self.engine.geometry.block_size;
        let computed = self.tokens.len() - 1;
        let full = (computed / bs).min(self.blocks.len());
        if full <= self.cached_blocks {
            return;
        }
        if self.digests.len() < full {
            let start = self.digests.len();
            let parent = self.digests.last().copied();
            let more = self
                .engine
                .hash_blocks(parent.as_ref(), &self.tokens[start * bs..full * bs]);
            self.digests.extend(more);
        }
        let mut events = Vec::new();
        let mut state = self.engine.state.lock();
        state.cache.cache_blocks(
            &self.blocks,
            &self.digests,
            self.cached_blocks,
            full,
            &self.tokens,
            &mut events,
        );
        self.engine.publish(events);
        drop(state);
        self.cached_blocks = full;
    }

    /// Ends the request and frees its blocks (idempotent; also done on drop).
    pub fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let mut state = self.engine.state.lock();
        state.cache.free(&self.blocks);
        state.running = state.running.saturating_sub(1);
        self.engine
            .counters
            .requests_finished
            .fetch_add(1, Ordering::Relaxed);
        self.engine.admit_waiting(&mut state);
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.finish();
    }
}
