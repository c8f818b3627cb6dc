//! The simulated engine: the shared vLLM-style engine model
//! ([`kvroute_engine_model::Scheduler`]: block pool with prefix caching and LRU eviction,
//! continuous batching with chunked prefill, preemption) stepped in real time by
//! [`Engine::run`], with its [`Linear`] timing model, and vLLM's scheduler counters.
//!
//! - A request is queued with its prompt and its (known in advance) output tokens, so every
//!   full block — decoded ones too — is hashed with vLLM's chain and cached as vLLM would.
//! - Each step's KV events (evictions, stores) go out as one batch through the event sink, under
//!   the state lock, when the step is scheduled: the blocks `/debug/blocks` lists are always
//!   what the published batches describe. (vLLM publishes the same batch one forward pass later,
//!   when the step's output is processed.)
//! - A client that leaves aborts its request (blocks freed), as vLLM does on disconnect.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_block_keys::{Digest, ExtraKeys, ExtraKeysEra, HashValue, MultiModalItem, VllmHasher};
use kvroute_engine_model::{HeldBlock, Linear, NewSeq, Scheduler, SchedulerConfig, SeqId};
use kvroute_index_core::event::KvEvent;
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use super::config::CacheGeometry;
use super::media::PlacedImage;

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

/// What a request's client has been told so far.
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    /// Output tokens produced.
    emitted: usize,
    /// Leading prompt blocks found cached (set with the first token).
    hit_blocks: usize,
    /// All its tokens are out.
    finished: bool,
}

#[derive(Debug)]
struct Tracked {
    prompt_len: usize,
    progress: watch::Sender<Progress>,
}

struct State {
    scheduler: Scheduler<Digest>,
    tracked: HashMap<SeqId, Tracked>,
    next_id: SeqId,
    shut_down: bool,
}

/// The engine shared by all requests.
pub struct Engine {
    state: Mutex<State>,
    geometry: CacheGeometry,
    timing: Linear,
    hasher: VllmHasher,
    sink: Option<EventSink>,
    /// Wakes [`Engine::run`] when a request is queued.
    work: Notify,
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
    /// An idle engine; [`Engine::run`] steps it.
    pub fn new(
        geometry: CacheGeometry,
        timing: Linear,
        hasher: VllmHasher,
        sink: Option<EventSink>,
    ) -> Self {
        let scheduler = Scheduler::new(SchedulerConfig {
            num_blocks: geometry.num_blocks,
            block_size: geometry.block_size,
            token_budget: u32::try_from(geometry.max_num_batched_tokens).unwrap_or(u32::MAX),
            max_seqs: geometry.max_num_seqs,
        });
        Self {
            state: Mutex::new(State {
                scheduler,
                tracked: HashMap::new(),
                next_id: 0,
                shut_down: false,
            }),
            geometry,
            timing,
            hasher,
            sink,
            work: Notify::new(),
            published_batches: AtomicU64::new(0),
            counters: EngineCounters::default(),
        }
    }

    /// The engine loop: schedules a step, waits its duration, completes it, until `cancel`.
    /// Then every request still queued or running ends ([`EngineError::ShuttingDown`], or a
    /// stream cut short).
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let duration = {
                let mut state = self.state.lock();
                let duration = state.scheduler.start_step(&self.timing);
                let events = state.scheduler.take_events();
                self.publish(events);
                duration
            };
            let Some(duration) = duration else {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = self.work.notified() => continue,
                }
            };
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(duration) => {}
            }
            self.finish_step();
        }
        let mut state = self.state.lock();
        state.shut_down = true;
        state.tracked.clear();
    }

    fn finish_step(&self) {
        let mut state = self.state.lock();
        let outcome = state.scheduler.finish_step();
        self.publish(outcome.events);
        let bs = self.geometry.block_size;
        let add = |counter: &AtomicU64, n: usize| {
            counter.fetch_add(n as u64, Ordering::Relaxed);
        };
        for first in &outcome.first_tokens {
            let Some(tracked) = state.tracked.get(&first.id) else {
                continue;
            };
            let hit_tokens = first.hit_blocks as usize * bs;
            add(&self.counters.prefix_cache_queries, tracked.prompt_len);
            add(&self.counters.prefix_cache_hits, hit_tokens);
            add(&self.counters.prompt_tokens, tracked.prompt_len);
            tracked
                .progress
                .send_modify(|p| p.hit_blocks = first.hit_blocks as usize);
        }
        add(&self.counters.generation_tokens, outcome.emitted.len());
        for id in &outcome.emitted {
            if let Some(tracked) = state.tracked.get(id) {
                tracked.progress.send_modify(|p| p.emitted += 1);
            }
        }
        add(&self.counters.requests_finished, outcome.finished.len());
        for id in &outcome.finished {
            if let Some(tracked) = state.tracked.remove(id) {
                tracked.progress.send_modify(|p| p.finished = true);
            }
        }
    }

    /// Queues a request and waits until its first output token: the caller then holds the
    /// first token's moment. `images` are placed in the prompt (hashed into the blocks they
    /// overlap, as vLLM 0.32 does); `output` are the token ids it will generate (`max_tokens`
    /// of them). Dropping the future (client gone) aborts the request.
    pub(crate) async fn start(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        images: &[PlacedImage],
        output: Vec<u32>,
    ) -> Result<Sequence, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let max_tokens = output.len();
        let prompt_len = prompt.len();
        let needed = prompt_len + max_tokens;
        let bs = self.geometry.block_size;
        // KV slots for every computed token; the last sampled token is never computed.
        let computed = needed.saturating_sub(1).max(prompt_len);
        let total_blocks = computed.div_ceil(bs);
        let max = self
            .geometry
            .max_model_len
            .min(self.geometry.num_blocks * bs);
        if needed > self.geometry.max_model_len || total_blocks > self.geometry.num_blocks {
            return Err(EngineError::TooLong { needed, max });
        }
        let mut tokens = prompt;
        tokens.extend(output);
        let (keys, extra_keys) = self.hash_blocks(&tokens[..computed], images);
        let (progress, mut watched) = watch::channel(Progress::default());
        let id = {
            let mut state = self.state.lock();
            if state.shut_down {
                return Err(EngineError::ShuttingDown);
            }
            let id = state.next_id;
            state.next_id += 1;
            state.scheduler.enqueue(NewSeq {
                id,
                prompt_len: prompt_len as u32,
                output_len: max_tokens.max(1) as u32,
                keys: keys.into(),
                tokens: Some(tokens.into()),
                extra_keys,
            });
            state.tracked.insert(
                id,
                Tracked {
                    prompt_len,
                    progress,
                },
            );
            id
        };
        self.work.notify_one();
        // Built before the wait so a client leaving during it aborts the request.
        let mut sequence = Sequence {
            engine: Arc::clone(self),
            id,
            prompt_len,
            max_tokens,
            consumed: 0,
            hit_blocks: 0,
            finished: false,
            progress: watched.clone(),
        };
        let first = watched
            .wait_for(|p| p.emitted > 0)
            .await
            .map_err(|_| EngineError::ShuttingDown)?;
        sequence.hit_blocks = first.hit_blocks;
        drop(first);
        Ok(sequence)
    }

    /// The chained block keys of `tokens` with `images` hashed in (vLLM 0.32's extra keys), and
    /// the blocks' extra keys as its `BlockStored` events publish them (`None` for text).
    #[expect(
        clippy::type_complexity,
        reason = "the keys and the published extra keys, per block"
    )]
    fn hash_blocks(
        &self,
        tokens: &[u32],
        images: &[PlacedImage],
    ) -> (Vec<Digest>, Option<Arc<[Option<HashValue>]>>) {
        let bs = self.geometry.block_size;
        let items: Vec<MultiModalItem<'_>> = images
            .iter()
            .map(|image| MultiModalItem {
                identifier: &image.identifier,
                offset: image.offset,
                length: image.length,
            })
            .collect();
        // Only fails for a zero block size, which the config rejects.
        let extra = ExtraKeys::with_multimodal(ExtraKeysEra::From0_31, None, None, &items, bs)
            .unwrap_or_default();
        let mut digests = Vec::new();
        let _ = self
            .hasher
            .chain_into(None, tokens, bs, |i| extra.for_block(i), &mut digests);
        let published = (!images.is_empty()).then(|| {
            (0..digests.len())
                .map(|i| extra.published_for_block(i))
                .collect()
        });
        (digests, published)
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
        let done = state.scheduler.reset_prefix_cache();
        let events = state.scheduler.take_events();
        self.publish(events);
        done
    }

    /// Blocks carrying a hash (`GET /debug/blocks`).
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        self.state.lock().scheduler.held_blocks()
    }

    /// [`Engine::held_blocks`] with the number of event batches published so far, read together
    /// under the state lock: the blocks are what those batches describe.
    pub fn held_blocks_at(&self) -> (u64, Vec<HeldBlock>) {
        let state = self.state.lock();
        let published = self.published_batches.load(Ordering::Relaxed);
        (published, state.scheduler.held_blocks())
    }

    /// Scheduler gauges.
    pub fn gauges(&self) -> EngineGauges {
        let state = self.state.lock();
        EngineGauges {
            waiting: state.scheduler.waiting(),
            running: state.scheduler.running(),
            kv_cache_usage: state.scheduler.kv_usage(),
        }
    }

    /// Cache geometry.
    pub fn geometry(&self) -> CacheGeometry {
        self.geometry
    }

    fn abort(&self, id: SeqId) {
        let mut state = self.state.lock();
        state.tracked.remove(&id);
        if state.scheduler.abort(id) {
            // Freed blocks may let a waiting request in.
            self.work.notify_one();
        }
    }
}

/// A running request, after its first token. Dropping it (finished or client gone) ends it.
pub struct Sequence {
    engine: Arc<Engine>,
    id: SeqId,
    prompt_len: usize,
    max_tokens: usize,
    consumed: usize,
    hit_blocks: usize,
    finished: bool,
    progress: watch::Receiver<Progress>,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sequence")
            .field("prompt_len", &self.prompt_len)
            .field("generated", &self.consumed)
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

    /// Output tokens handed out so far.
    pub fn generated(&self) -> usize {
        self.consumed
    }

    /// Output tokens still to come.
    pub fn remaining(&self) -> usize {
        self.max_tokens - self.consumed
    }

    /// Waits for the next output token; its position in the output. `None` once `max_tokens`
    /// are out, or if the engine shut down (the request then ends).
    pub async fn next_token(&mut self) -> Option<usize> {
        if self.consumed >= self.max_tokens {
            self.finish();
            return None;
        }
        let consumed = self.consumed;
        let produced = self
            .progress
            .wait_for(|p| p.emitted > consumed)
            .await
            .is_ok();
        if !produced {
            self.finish();
            return None;
        }
        self.consumed += 1;
        Some(consumed)
    }

    /// Ends the request (idempotent; also done on drop): a request still running is aborted and
    /// its blocks freed.
    pub fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        self.engine.abort(self.id);
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.finish();
    }
}
