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
//! - Disaggregation ([`EngineLeg`], vLLM's `NixlConnector` in pull mode): a prefill leg's
//!   blocks are held when it finishes, under its internal request id, until a decode reads them
//!   ([`Engine::read_held`]) or the lease expires (checked by the engine loop); a decode leg
//!   is queued with the prompt tokens its prefill engine handed over, which it loads instead
//!   of computing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_block_keys::{
    Digest, ExtraKeys, ExtraKeysEra, HashValue, MultiModalItem, SglangHasher, VllmHasher,
};
use kvroute_engine_model::{HeldBlock, Leg, Linear, NewSeq, Scheduler, SchedulerConfig, SeqId};
use kvroute_index_core::event::KvEvent;
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
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
    /// `vllm:external_prefix_cache_queries_total` (tokens; with a KV connector only).
    pub external_queries: AtomicU64,
    /// `vllm:external_prefix_cache_hits_total` (tokens loaded from a prefill engine).
    pub external_hits: AtomicU64,
    /// `vllm:prompt_tokens_by_source_total{source="local_compute"}`.
    pub prompt_computed: AtomicU64,
    /// `vllm:prompt_tokens_by_source_total{source="local_cache_hit"}`.
    pub prompt_local_hits: AtomicU64,
    /// `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`.
    pub prompt_external: AtomicU64,
    /// `vllm:prompt_tokens_cached_total` (local + external).
    pub prompt_cached: AtomicU64,
    /// Held prefill blocks a decode read (the simulator's own).
    pub kv_reads_served: AtomicU64,
    /// Reads refused: nothing held under that id (never, or no longer) or other blocks.
    pub kv_reads_refused: AtomicU64,
    /// Holds released because their lease expired before any decode read them.
    pub kv_leases_expired: AtomicU64,
}

/// A request's role in a disaggregated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EngineLeg {
    /// An ordinary request.
    Whole,
    /// `do_remote_decode`: its blocks are held under `request_id` when it finishes.
    Prefill {
        /// vLLM's internal request id (`remote_request_id` of the answer).
        request_id: String,
    },
    /// `do_remote_prefill`: its first `remote_tokens` prompt tokens were handed over by the
    /// prefill engine and are loaded, not computed.
    Decode {
        /// Prompt tokens loaded.
        remote_tokens: usize,
    },
}

/// A finished prefill leg's blocks as its answer names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldReport {
    /// Block ids in vLLM's numbering (block 0 is vLLM's null block, so the pool's first is 1).
    pub block_ids: Vec<usize>,
    /// Tokens with KV in the blocks (`remote_num_tokens`).
    pub computed_tokens: usize,
}

/// Why a decode's read of held blocks was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReadRefusal {
    /// Nothing is held under that request id: never prefilled here, already read, or the
    /// lease expired.
    #[error(
        "no blocks are held for this request (never prefilled here, already read, or the lease expired)"
    )]
    NotHeld,
    /// Blocks are held under that id, but not the ones named.
    #[error("the blocks named are not the ones held for this request")]
    OtherBlocks,
}

impl ReadRefusal {
    /// Label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            ReadRefusal::NotHeld => "not_held",
            ReadRefusal::OtherBlocks => "other_blocks",
        }
    }
}

/// Blocks held for a decode.
#[derive(Debug)]
struct Held {
    seq: SeqId,
    /// The tokens whose KV the blocks hold.
    tokens: Arc<[u32]>,
    block_ids: Vec<usize>,
    expires: Instant,
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
#[derive(Debug, Clone, Default)]
struct Progress {
    /// Output tokens produced.
    emitted: usize,
    /// Leading prompt blocks found cached (set with the first token).
    hit_blocks: usize,
    /// Prompt tokens loaded from a prefill engine (set with the first token).
    external_tokens: usize,
    /// All its tokens are out.
    finished: bool,
    /// A prefill leg's held blocks (set before its last token).
    held: Option<HeldReport>,
}

#[derive(Debug)]
struct Tracked {
    prompt_len: usize,
    progress: watch::Sender<Progress>,
    /// A prefill leg's internal request id and tokens.
    prefill: Option<(String, Arc<[u32]>)>,
}

/// A simulated block's key: its engine family's chained digest, published that family's way
/// (vLLM: the digest's last 8 bytes as u64; SGLang: its first 8, big-endian, as i64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SimKey {
    /// vLLM's block hash.
    Vllm(Digest),
    /// SGLang's page hash.
    Sglang(Digest),
}

impl kvroute_engine_model::pool::BlockKey for SimKey {
    fn published(&self) -> u64 {
        match self {
            SimKey::Vllm(digest) => digest.published_u64(),
            SimKey::Sglang(digest) => SglangHasher::published_u64(digest),
        }
    }
}

/// How the simulated engine chains its blocks.
#[derive(Debug, Clone)]
pub enum SimHasher {
    /// vLLM's prefix-cache hash (its algorithm and seed).
    Vllm(VllmHasher),
    /// SGLang's page hash (SHA-256 over each page's tokens as little-endian u32, chained).
    Sglang,
}

struct State {
    scheduler: Scheduler<SimKey>,
    tracked: HashMap<SeqId, Tracked>,
    /// Finished prefill legs' blocks by internal request id.
    held: HashMap<String, Held>,
    next_id: SeqId,
    shut_down: bool,
}

/// The engine shared by all requests.
pub struct Engine {
    state: Mutex<State>,
    geometry: CacheGeometry,
    timing: Linear,
    hasher: SimHasher,
    sink: Option<EventSink>,
    /// How long a finished prefill holds its blocks (`kv_lease_duration`); `None` without a
    /// KV connector.
    lease: Option<std::time::Duration>,
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
        hasher: SimHasher,
        sink: Option<EventSink>,
        lease: Option<std::time::Duration>,
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
                held: HashMap::new(),
                next_id: 0,
                shut_down: false,
            }),
            geometry,
            timing,
            hasher,
            sink,
            lease,
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
            let (duration, next_expiry) = {
                let mut state = self.state.lock();
                self.expire_leases(&mut state);
                let duration = state.scheduler.start_step(&self.timing);
                let events = state.scheduler.take_events();
                self.publish(events);
                (duration, state.held.values().map(|h| h.expires).min())
            };
            let Some(duration) = duration else {
                let lease_ends = async {
                    match next_expiry {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = self.work.notified() => continue,
                    () = lease_ends => continue,
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

    /// Frees the held blocks whose lease ended (vLLM's `_reap_expired_send_leases`).
    fn expire_leases(&self, state: &mut State) {
        let now = Instant::now();
        let expired: Vec<String> = state
            .held
            .iter()
            .filter(|(_, held)| held.expires <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(held) = state.held.remove(&id) {
                state.scheduler.release_held(held.seq);
                self.counters
                    .kv_leases_expired
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(request_id = %id, "releasing expired KV blocks no decode read");
                self.work.notify_one();
            }
        }
    }

    /// A decode engine reads the blocks held for `request_id` (the simulator's stand-in for
    /// NIXL's read and its completion notification): their tokens, and the hold ends. Block ids
    /// are vLLM's numbering, as the prefill's answer gave them.
    pub fn read_held(
        &self,
        request_id: &str,
        block_ids: &[usize],
    ) -> Result<Arc<[u32]>, ReadRefusal> {
        let mut state = self.state.lock();
        self.expire_leases(&mut state);
        let refused = |reason: ReadRefusal| {
            self.counters
                .kv_reads_refused
                .fetch_add(1, Ordering::Relaxed);
            Err(reason)
        };
        let Some(held) = state.held.get(request_id) else {
            return refused(ReadRefusal::NotHeld);
        };
        if held.block_ids != block_ids {
            return refused(ReadRefusal::OtherBlocks);
        }
        let Some(held) = state.held.remove(request_id) else {
            return refused(ReadRefusal::NotHeld);
        };
        state.scheduler.release_held(held.seq);
        self.counters
            .kv_reads_served
            .fetch_add(1, Ordering::Relaxed);
        // Freed blocks may let a waiting request in.
        self.work.notify_one();
        Ok(held.tokens)
    }

    /// Internal request ids whose blocks are held, with their block ids.
    pub fn held_prefills(&self) -> Vec<(String, Vec<usize>)> {
        let state = self.state.lock();
        let mut held: Vec<_> = state
            .held
            .iter()
            .map(|(id, held)| (id.clone(), held.block_ids.clone()))
            .collect();
        held.sort();
        held
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
            let prompt = tracked.prompt_len;
            let hit_tokens = first.hit_blocks as usize * bs;
            let external = first.external_tokens as usize;
            // vLLM 0.32's accounting: local hits in the prefix-cache counters, the connector's
            // query (what the local cache missed) and hits apart, the prompt split by source.
            add(&self.counters.prefix_cache_queries, prompt);
            add(&self.counters.prefix_cache_hits, hit_tokens);
            if self.lease.is_some() {
                add(&self.counters.external_queries, prompt - hit_tokens);
                add(&self.counters.external_hits, external);
            }
            add(&self.counters.prompt_tokens, prompt);
            add(&self.counters.prompt_local_hits, hit_tokens);
            add(&self.counters.prompt_external, external);
            add(&self.counters.prompt_cached, hit_tokens + external);
            add(
                &self.counters.prompt_computed,
                prompt.saturating_sub(hit_tokens + external),
            );
            tracked.progress.send_modify(|p| {
                p.hit_blocks = first.hit_blocks as usize;
                p.external_tokens = external;
            });
        }
        let expires = Instant::now() + self.lease.unwrap_or_default();
        for leg in &outcome.held {
            let Some((request_id, tokens)) =
                state.tracked.get(&leg.id).and_then(|t| t.prefill.clone())
            else {
                // Not held for anyone: free at once.
                state.scheduler.release_held(leg.id);
                continue;
            };
            let computed = (leg.computed_tokens as usize).min(tokens.len());
            let block_ids: Vec<usize> = leg.blocks.iter().map(|b| b + 1).collect();
            if let Some(tracked) = state.tracked.get(&leg.id) {
                let report = HeldReport {
                    block_ids: block_ids.clone(),
                    computed_tokens: computed,
                };
                tracked.progress.send_modify(|p| p.held = Some(report));
            }
            state.held.insert(
                request_id,
                Held {
                    seq: leg.id,
                    tokens: tokens[..computed].into(),
                    block_ids,
                    expires,
                },
            );
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
        leg: EngineLeg,
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
        let tokens: Arc<[u32]> = tokens.into();
        let (model_leg, prefill) = match leg {
            EngineLeg::Whole => (Leg::Whole, None),
            EngineLeg::Prefill { request_id } => {
                (Leg::Prefill, Some((request_id, Arc::clone(&tokens))))
            }
            EngineLeg::Decode { remote_tokens } => (
                Leg::Decode {
                    remote_tokens: u32::try_from(remote_tokens).unwrap_or(u32::MAX),
                },
                None,
            ),
        };
        let (progress, mut watched) = watch::channel(Progress::default());
        let id = {
            let mut state = self.state.lock();
            if state.shut_down {
                return Err(EngineError::ShuttingDown);
            }
            let id = state.next_id;
            state.next_id += 1;
            state.scheduler.enqueue_leg(
                NewSeq {
                    id,
                    prompt_len: prompt_len as u32,
                    output_len: max_tokens.max(1) as u32,
                    keys: keys.into(),
                    tokens: Some(tokens),
                    extra_keys,
                },
                model_leg,
            );
            state.tracked.insert(
                id,
                Tracked {
                    prompt_len,
                    progress,
                    prefill,
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
            external_tokens: 0,
            finished: false,
            progress: watched.clone(),
        };
        let first = watched
            .wait_for(|p| p.emitted > 0)
            .await
            .map_err(|_| EngineError::ShuttingDown)?;
        sequence.hit_blocks = first.hit_blocks;
        sequence.external_tokens = first.external_tokens;
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
    ) -> (Vec<SimKey>, Option<Arc<[Option<HashValue>]>>) {
        let bs = self.geometry.block_size;
        let hasher = match &self.hasher {
            SimHasher::Vllm(hasher) => hasher,
            SimHasher::Sglang => {
                // SGLang's images are pad tokens in the prompt already: pages hash as text.
                let mut keys = Vec::with_capacity(tokens.len() / bs.max(1));
                let mut prior = None;
                for page in tokens.chunks_exact(bs.max(1)) {
                    let digest = SglangHasher::page_digest(prior.as_ref(), page);
                    keys.push(SimKey::Sglang(digest));
                    prior = Some(digest);
                }
                return (keys, None);
            }
        };
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
        let _ = hasher.chain_into(None, tokens, bs, |i| extra.for_block(i), &mut digests);
        let published = (!images.is_empty()).then(|| {
            (0..digests.len())
                .map(|i| extra.published_for_block(i))
                .collect()
        });
        (digests.into_iter().map(SimKey::Vllm).collect(), published)
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
    external_tokens: usize,
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
    /// Prompt tokens not computed, as vLLM's usage counts them
    /// (`usage.prompt_tokens_details.cached_tokens`): local prefix hits plus tokens loaded from
    /// a prefill engine.
    pub fn cached_tokens(&self) -> usize {
        self.local_cached_tokens() + self.external_tokens
    }

    /// Prompt tokens found in this engine's prefix cache.
    pub fn local_cached_tokens(&self) -> usize {
        self.hit_blocks * self.engine.geometry.block_size
    }

    /// Prompt tokens loaded from a prefill engine.
    pub fn external_tokens(&self) -> usize {
        self.external_tokens
    }

    /// A finished prefill leg's held blocks (once its last token is out).
    pub fn held(&self) -> Option<HeldReport> {
        self.progress.borrow().held.clone()
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
