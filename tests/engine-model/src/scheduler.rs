//! vLLM v1's step scheduler over a [`BlockPool`] (`vllm/v1/core/sched/scheduler.py`).
//!
//! Each step (one forward pass), [`Scheduler::start_step`]:
//! 1. Running requests first, in admission order: one still prefilling gets the next chunk of
//!    its prompt (chunked prefill, at most the remaining token budget), a decoding one one
//!    token. Blocks are allocated for the tokens it will hold; when the pool is full the most
//!    recently admitted request is preempted (its blocks freed, recomputed later).
//! 2. Then waiting requests, first come first served, while the token budget, `max_seqs` and
//!    free blocks allow: leading prompt blocks found in the pool are hits (revived, not
//!    computed), the rest is prefilled in chunks. A request that does not fit waits (no
//!    preemption to admit).
//! 3. Blocks that the scheduled tokens fill are cached at once (vLLM's `allocate_slots` caches
//!    them when it schedules), so a request scheduled later in the same pass hits them.
//!
//! The step lasts what the [`TimingModel`] says; [`Scheduler::finish_step`] then advances every
//! scheduled request: a prompt done emits its first token, a decode one more, and finished
//! requests free their blocks tail first. The step's KV events (evictions and stores, in order)
//! come with its outcome — vLLM publishes one batch per step — or earlier from
//! [`Scheduler::take_events`].
//!
//! A request's `keys` are the chained keys of the blocks that can be cached: the prompt's full
//! blocks, and further ones for output tokens when the driver knows them (vLLM caches decoded
//! blocks too). Simplification: a preempted request recomputes its prompt only (its generated
//! tokens' KV is not recomputed); its first token is the first one it emitted.
//!
//! **Prefill/decode disaggregation** ([`Leg`], vLLM 0.32's `NixlConnector`, pull mode):
//! - A *prefill leg* (`do_remote_decode`) runs as any request, but when it finishes its blocks
//!   stay allocated — held for the decode engine to read — until the driver calls
//!   [`Scheduler::release_held`] (the decode's read notification, or the lease's expiry). While
//!   held they are in use (KV usage) and still cached: another prompt can hit them.
//! - A *decode leg* (`do_remote_prefill`) is admitted like any request: its local prefix hit is
//!   reused, and the rest of its prompt (the connector offers the whole prompt) is loaded: blocks
//!   are allocated for it but not cached, the request leaves the queue without using the step's
//!   token budget or a running slot, and waits out the transfer
//!   ([`TimingModel::kv_transfer_duration`] of the blocks it receives) while other steps run.
//!   When the load is done the loaded blocks are cached (published as `BlockStored` with the
//!   next step's events, as vLLM's `_update_waiting_for_remote_kv` caches them when it promotes
//!   the request) and the request rejoins the head of the queue with its prompt computed but
//!   the last token, which it recomputes to sample its first token. One transfer per request:
//!   a loaded decode leg that is preempted later recomputes (or hits) like any request.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvroute_block_keys::HashValue;
use kvroute_index_core::event::KvEvent;

use crate::pool::{BlockId, BlockKey, BlockPool, HeldBlock};
use crate::timing::{PrefillChunk, StepWork, TimingModel};

/// The driver's id of a request.
pub type SeqId = usize;

/// Engine limits (vLLM's `--num-gpu-blocks-override`, `--block-size`,
/// `--max-num-batched-tokens`, `--max-num-seqs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// KV blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Tokens computed per step (prefill chunks plus one per decode).
    pub token_budget: u32,
    /// Requests running at once.
    pub max_seqs: usize,
}

/// What a request's KV transfer parameters make of it (vLLM's `NixlConnector`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Leg {
    /// An ordinary request.
    #[default]
    Whole,
    /// `do_remote_decode`: computes its prompt; at the end its blocks are held (not freed) for
    /// the decode engine to read, until [`Scheduler::release_held`].
    Prefill,
    /// `do_remote_prefill`: the prompt tokens past the local prefix hit, up to `remote_tokens`,
    /// are loaded from the prefill engine instead of computed.
    Decode {
        /// Leading prompt tokens the prefill engine holds (vLLM's connector offers the whole
        /// prompt).
        remote_tokens: u32,
    },
}

/// A prefill leg that finished, its blocks held for the decode engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLeg {
    /// Its id.
    pub id: SeqId,
    /// Its blocks, in order (vLLM's `remote_block_ids`, before its block-id offset).
    pub blocks: Vec<BlockId>,
    /// Tokens with KV in them (vLLM's `num_computed_tokens` at finish: `remote_num_tokens`).
    pub computed_tokens: u32,
}

/// A request to queue.
#[derive(Debug, Clone)]
pub struct NewSeq<K> {
    /// The driver's id (unique among queued and running requests).
    pub id: SeqId,
    /// Prompt tokens (at least 1).
    pub prompt_len: u32,
    /// Output tokens to generate (at least 1: the first token ends the prefill).
    pub output_len: u32,
    /// Chained keys of the cacheable blocks, in order (see the module docs).
    pub keys: Arc<[K]>,
    /// Token ids (prompt, then output), published in `BlockStored`; `None`: unknown, zeros.
    pub tokens: Option<Arc<[u32]>>,
    /// Per-block extra keys as `BlockStored` publishes them (images), from the first block;
    /// `None` (or past its end): none.
    pub extra_keys: Option<Arc<[Option<HashValue>]>>,
}

#[derive(Debug, Clone)]
struct Seq<K> {
    new: NewSeq<K>,
    /// Prompt tokens whose KV is held (or scheduled this step).
    computed: u32,
    /// Output tokens produced.
    generated: u32,
    /// Held blocks, in sequence order.
    blocks: Vec<BlockId>,
    /// Leading blocks keyed (hits, or cached when scheduled).
    cached: usize,
    /// Tokens scheduled in the current step.
    scheduled: u32,
    /// Whether the first token was emitted.
    first_token_done: bool,
    /// Leading blocks found cached at the first admission.
    hit_blocks: Option<u32>,
    /// Its role in a disaggregated request (a decode leg becomes [`Leg::Whole`] once its one
    /// transfer is planned).
    leg: Leg,
    /// Prompt tokens loaded from a prefill engine instead of computed.
    external_tokens: u32,
}

impl<K: BlockKey> Seq<K> {
    /// Caches the blocks `kv_tokens` fill, as far as its keys go (those not cached yet).
    fn cache_filled(&mut self, pool: &mut BlockPool<K>, kv_tokens: u32, block_size: usize) {
        let full = (kv_tokens as usize / block_size)
            .min(self.new.keys.len())
            .min(self.blocks.len());
        if full > self.cached {
            pool.cache_blocks(
                &self.blocks,
                &self.new.keys,
                self.cached,
                full,
                self.new.tokens.as_deref(),
                self.new.extra_keys.as_deref(),
            );
            self.cached = full;
        }
    }
}

/// A decode leg waiting for its blocks.
#[derive(Debug, Clone)]
struct Loading<K> {
    seq: Seq<K>,
    /// Transfer time still to go.
    remaining: Duration,
}

/// A request that emitted its first token in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstToken {
    /// Its id.
    pub id: SeqId,
    /// Leading prompt blocks it found cached when first admitted.
    pub hit_blocks: u32,
    /// Prompt tokens it loaded from a prefill engine (a decode leg), not computed.
    pub external_tokens: u32,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Requests that emitted their first token.
    pub first_tokens: Vec<FirstToken>,
    /// Requests that emitted a token (first ones included), in running order.
    pub emitted: Vec<SeqId>,
    /// Requests that finished (their last token was emitted), prefill legs included.
    pub finished: Vec<SeqId>,
    /// Prefill legs that finished: their blocks are held until [`Scheduler::release_held`].
    pub held: Vec<HeldLeg>,
    /// KV events of the step not yet taken: evictions and stores, in order.
    pub events: Vec<KvEvent>,
}

/// One replica's scheduler.
#[derive(Debug, Clone)]
pub struct Scheduler<K> {
    config: SchedulerConfig,
    pool: BlockPool<K>,
    waiting: VecDeque<Seq<K>>,
    running: Vec<Seq<K>>,
    in_step: bool,
    busy: Duration,
    chunks: Vec<PrefillChunk>,
    /// Decode legs whose blocks are in transfer.
    loading: Vec<Loading<K>>,
    /// Decode legs whose transfer finished, rejoining the queue at the next step.
    loaded: Vec<Seq<K>>,
    /// Finished prefill legs' blocks, held for the decode engine.
    held: HashMap<SeqId, Vec<BlockId>>,
    /// The step in progress's duration (transfers advance by it).
    step_duration: Duration,
}

impl<K: BlockKey> Scheduler<K> {
    /// An idle replica with an empty cache.
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            config,
            pool: BlockPool::new(config.num_blocks, config.block_size),
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_step: false,
            busy: Duration::ZERO,
            chunks: Vec::new(),
            loading: Vec::new(),
            loaded: Vec::new(),
            held: HashMap::new(),
            step_duration: Duration::ZERO,
        }
    }

    /// Its limits.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Requests waiting to be admitted, decode legs waiting for their blocks included (vLLM
    /// keeps them in its waiting queue).
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.loading.len() + self.loaded.len()
    }

    /// Finished prefill legs whose blocks are still held.
    pub fn held_legs(&self) -> usize {
        self.held.len()
    }

    /// Requests admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Share of KV blocks in use.
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Time spent in steps so far.
    pub fn busy(&self) -> Duration {
        self.busy
    }

    /// Whether a step was started and not finished.
    pub fn in_step(&self) -> bool {
        self.in_step
    }

    /// How many leading `keys` are cached here right now.
    pub fn cached_prefix(&self, keys: &[K]) -> usize {
        keys.iter()
            .take_while(|k| self.pool.lookup(k).is_some())
            .count()
    }

    /// Blocks carrying a key, in block order.
    pub fn held_blocks(&self) -> Vec<HeldBlock> {
        self.pool.held_blocks()
    }

    /// Queues a request.
    pub fn enqueue(&mut self, new: NewSeq<K>) {
        self.enqueue_leg(new, Leg::Whole);
    }

    /// Queues a request in its role of a disaggregated request.
    pub fn enqueue_leg(&mut self, new: NewSeq<K>, leg: Leg) {
        self.waiting.push_back(Seq {
            new,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            cached: 0,
            scheduled: 0,
            first_token_done: false,
            hit_blocks: None,
            leg,
            external_tokens: 0,
        });
    }

    /// Frees a finished prefill leg's held blocks (the decode engine read them, or their lease
    /// expired); false if it holds none.
    pub fn release_held(&mut self, id: SeqId) -> bool {
        match self.held.remove(&id) {
            Some(blocks) => {
                self.pool.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// Drops a request wherever it is (the client left), freeing its blocks; false if unknown
    /// or finished (a finished prefill leg's held blocks stay held).
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.new.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.new.id == id) {
            let seq = self.running.remove(i);
            self.pool.free(&seq.blocks);
            return true;
        }
        if let Some(i) = self.loading.iter().position(|l| l.seq.new.id == id) {
            let loading = self.loading.remove(i);
            self.pool.free(&loading.seq.blocks);
            return true;
        }
        if let Some(i) = self.loaded.iter().position(|s| s.new.id == id) {
            let seq = self.loaded.remove(i);
            self.pool.free(&seq.blocks);
            return true;
        }
        // A finished prefill leg is no longer a request: only its lease ends its hold.
        false
    }

    /// `reset_prefix_cache`: forgets every cached block if none is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset()
    }

    /// The KV events since the last take.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Schedules a step; returns its duration, or `None` when there is nothing to run (or a
    /// step is already in progress).
    pub fn start_step(&mut self, timing: &dyn TimingModel) -> Option<Duration> {
        if self.in_step {
            return None;
        }
        self.promote_loaded();
        let bs = self.config.block_size as u32;
        let mut budget = self.config.token_budget;
        let mut chunks = std::mem::take(&mut self.chunks);
        chunks.clear();
        let mut decodes = 0;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let prompt_len = seq.new.prompt_len;
            let (tokens, kv_tokens) = if seq.computed < prompt_len {
                let tokens = (prompt_len - seq.computed).min(budget);
                (tokens, seq.computed + tokens)
            } else {
                (1, prompt_len + seq.generated)
            };
            let needed = kv_tokens.div_ceil(bs) as usize;
            let mut preempted_self = false;
            while self.running[i].blocks.len() < needed {
                match self.pool.allocate() {
                    Some(block) => self.running[i].blocks.push(block),
                    None => {
                        let victim = self.running.len() - 1;
                        self.preempt(victim);
                        if victim == i {
                            preempted_self = true;
                            break;
                        }
                    }
                }
            }
            if preempted_self {
                break;
            }
            let seq = &mut self.running[i];
            if seq.computed < prompt_len {
                chunks.push(PrefillChunk {
                    tokens,
                    context: seq.computed,
                });
            } else {
                decodes += 1;
            }
            seq.scheduled = tokens;
            budget -= tokens;
            self.cache_scheduled(i, kv_tokens);
            i += 1;
        }
        while budget > 0 && self.running.len() < self.config.max_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let prompt_len = seq.new.prompt_len;
            if !seq.blocks.is_empty() {
                // A decode leg back from its transfer: its blocks are in place, its prompt is
                // computed but the last token.
                let computed = seq.computed;
                let tokens = (prompt_len - computed).min(budget);
                let needed = (computed + tokens).div_ceil(bs) as usize;
                let new_blocks = needed.saturating_sub(seq.blocks.len());
                if self.pool.free_blocks() < new_blocks {
                    break;
                }
                let Some(mut seq) = self.waiting.pop_front() else {
                    break;
                };
                for _ in 0..new_blocks {
                    if let Some(block) = self.pool.allocate() {
                        seq.blocks.push(block);
                    }
                }
                budget -= tokens;
                self.start_chunk(seq, computed, tokens, &mut chunks);
                continue;
            }
            let max_hits = (prompt_len.saturating_sub(1) / bs) as usize;
            let hits = self.pool.prefix_hits(&seq.new.keys, max_hits);
            let local = hits.len() as u32 * bs;
            let external = match seq.leg {
                Leg::Decode { remote_tokens } => {
                    remote_tokens.min(prompt_len).saturating_sub(local)
                }
                Leg::Whole | Leg::Prefill => 0,
            };
            let computed = local + external;
            let tokens = if external > 0 {
                0
            } else {
                (prompt_len - computed).min(budget)
            };
            let new_blocks = (computed + tokens).div_ceil(bs) as usize - hits.len();
            let revived = hits.iter().filter(|b| self.pool.is_free(**b)).count();
            if self.pool.free_blocks() < revived + new_blocks {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            for block in &hits {
                self.pool.touch(*block);
            }
            seq.cached = hits.len();
            seq.hit_blocks.get_or_insert(hits.len() as u32);
            seq.blocks = hits;
            for _ in 0..new_blocks {
                if let Some(block) = self.pool.allocate() {
                    seq.blocks.push(block);
                }
            }
            seq.computed = computed;
            if let Leg::Decode { .. } = seq.leg {
                // One transfer per request, as the connector marks its parameters processed.
                seq.leg = Leg::Whole;
            }
            if external > 0 {
                // The blocks wait, uncached, for the transfer; no compute this step.
                seq.external_tokens = external;
                let remaining = timing.kv_transfer_duration(new_blocks as u32, bs);
                self.loading.push(Loading { seq, remaining });
                continue;
            }
            budget -= tokens;
            self.start_chunk(seq, computed, tokens, &mut chunks);
        }
        let work = StepWork {
            prefill: &chunks,
            decodes,
        };
        let idle = chunks.is_empty() && decodes == 0;
        let duration = if idle {
            // Nothing to compute: wait for the first transfer to finish, if one is running.
            self.loading.iter().map(|l| l.remaining).min()
        } else {
            let duration = timing.step_duration(&work);
            self.busy += duration;
            Some(duration)
        };
        self.chunks = chunks;
        let duration = duration?;
        self.step_duration = duration;
        self.in_step = true;
        Some(duration)
    }

    /// Decode legs whose transfer finished: their loaded blocks are cached now (vLLM caches
    /// them when it promotes the request) and they rejoin the head of the queue, the last prompt
    /// token still to compute.
    fn promote_loaded(&mut self) {
        let bs = self.config.block_size;
        for mut seq in std::mem::take(&mut self.loaded).into_iter().rev() {
            seq.cache_filled(&mut self.pool, seq.computed, bs);
            if seq.computed >= seq.new.prompt_len {
                seq.computed = seq.new.prompt_len - 1;
            }
            self.waiting.push_front(seq);
        }
    }

    /// Completes the step in progress.
    pub fn finish_step(&mut self) -> StepOutcome {
        self.in_step = false;
        let mut outcome = StepOutcome::default();
        for seq in &mut self.running {
            if seq.scheduled == 0 {
                continue;
            }
            let prompt_len = seq.new.prompt_len;
            if seq.computed < prompt_len {
                seq.computed += seq.scheduled;
                if seq.computed >= prompt_len {
                    seq.generated += 1;
                    outcome.emitted.push(seq.new.id);
                    if !seq.first_token_done {
                        seq.first_token_done = true;
                        outcome.first_tokens.push(FirstToken {
                            id: seq.new.id,
                            hit_blocks: seq.hit_blocks.unwrap_or(0),
                            external_tokens: seq.external_tokens,
                        });
                    }
                }
            } else {
                seq.generated += 1;
                outcome.emitted.push(seq.new.id);
            }
            seq.scheduled = 0;
        }
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            if seq.first_token_done && seq.generated >= seq.new.output_len {
                let seq = self.running.remove(i);
                if seq.leg == Leg::Prefill {
                    // The last sampled token is never computed.
                    let computed_tokens = seq.new.prompt_len + seq.generated - 1;
                    outcome.held.push(HeldLeg {
                        id: seq.new.id,
                        blocks: seq.blocks.clone(),
                        computed_tokens,
                    });
                    self.held.insert(seq.new.id, seq.blocks);
                } else {
                    self.pool.free(&seq.blocks);
                }
                outcome.finished.push(seq.new.id);
            } else {
                i += 1;
            }
        }
        let step = self.step_duration;
        let mut j = 0;
        while j < self.loading.len() {
            let loading = &mut self.loading[j];
            loading.remaining = loading.remaining.saturating_sub(step);
            if loading.remaining.is_zero() {
                let done = self.loading.remove(j);
                self.loaded.push(done.seq);
            } else {
                j += 1;
            }
        }
        outcome.events = self.pool.take_events();
        outcome
    }

    /// Runs `tokens` of `seq`'s prompt from `computed` on this step: its chunk, and its blocks
    /// those tokens fill cached.
    fn start_chunk(
        &mut self,
        mut seq: Seq<K>,
        computed: u32,
        tokens: u32,
        chunks: &mut Vec<PrefillChunk>,
    ) {
        chunks.push(PrefillChunk {
            tokens,
            context: computed,
        });
        seq.scheduled = tokens;
        self.running.push(seq);
        self.cache_scheduled(self.running.len() - 1, computed + tokens);
    }

    /// Caches the blocks of running request `index` that `kv_tokens` fill, as far as its keys go.
    fn cache_scheduled(&mut self, index: usize, kv_tokens: u32) {
        self.running[index].cache_filled(&mut self.pool, kv_tokens, self.config.block_size);
    }

    /// Frees a running request's blocks and sends it back to the head of the queue.
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        self.pool.free(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        seq.cached = 0;
        seq.scheduled = 0;
        self.waiting.push_front(seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::MockerFit;

    const BS: usize = 512;

    fn seq(id: SeqId, prompt: u32, output: u32, keys: &[u64]) -> NewSeq<u64> {
        let full = prompt as usize / BS;
        NewSeq {
            id,
            prompt_len: prompt,
            output_len: output,
            keys: keys[..full.min(keys.len())].into(),
            tokens: None,
            extra_keys: None,
        }
    }

    fn config(blocks: usize, budget: u32) -> SchedulerConfig {
        SchedulerConfig {
            num_blocks: blocks,
            block_size: BS,
            token_budget: budget,
            max_seqs: 4,
        }
    }

    fn run_to_idle(s: &mut Scheduler<u64>) -> (Duration, Vec<StepOutcome>) {
        let mut total = Duration::ZERO;
        let mut outcomes = Vec::new();
        while let Some(d) = s.start_step(&MockerFit::default()) {
            total += d;
            outcomes.push(s.finish_step());
        }
        (total, outcomes)
    }

    fn stored_blocks(outcomes: &[StepOutcome]) -> usize {
        outcomes
            .iter()
            .flat_map(|o| &o.events)
            .map(|e| match e {
                KvEvent::BlockStored(s) => s.block_hashes.len(),
                _ => 0,
            })
            .sum()
    }

    #[test]
    fn chunked_prefill_then_decode_then_hit() {
        let mut s = Scheduler::new(config(8, 1024));
        s.enqueue(seq(0, 1500, 3, &[1, 2, 3]));
        let (_, outcomes) = run_to_idle(&mut s);
        // 1024 + 476 prompt tokens, then 2 decodes.
        assert_eq!(outcomes.len(), 4);
        assert_eq!(
            outcomes[1].first_tokens,
            [FirstToken {
                id: 0,
                hit_blocks: 0,
                external_tokens: 0,
            }]
        );
        assert_eq!(outcomes[3].finished, [0]);
        assert_eq!(
            stored_blocks(&outcomes),
            2,
            "two full blocks, the partial third is not cached"
        );
        s.enqueue(seq(1, 1100, 1, &[1, 2, 7]));
        let (total, outcomes) = run_to_idle(&mut s);
        assert_eq!(outcomes[0].first_tokens[0].hit_blocks, 2);
        assert_eq!(
            total,
            Duration::from_micros(MockerFit::default().step_us(
                &[PrefillChunk {
                    tokens: 76,
                    context: 1024
                }],
                0
            )),
            "only the uncached tail is prefilled"
        );
    }

    #[test]
    fn same_pass_admission_hits_blocks_just_scheduled() {
        let mut s = Scheduler::new(config(8, 8192));
        s.enqueue(seq(0, 1100, 1, &[1, 2]));
        s.enqueue(seq(1, 1100, 1, &[1, 2]));
        let (_, outcomes) = run_to_idle(&mut s);
        let firsts: Vec<u32> = outcomes[0]
            .first_tokens
            .iter()
            .map(|f| f.hit_blocks)
            .collect();
        assert_eq!(firsts, [0, 2]);
    }

    #[test]
    fn decoded_blocks_are_cached_when_keys_cover_them() {
        let mut s = Scheduler::new(config(8, 8192));
        let mut new = seq(0, 600, 500, &[]);
        new.keys = vec![1, 2].into();
        s.enqueue(new);
        let (_, outcomes) = run_to_idle(&mut s);
        // 600 + 499 computed tokens: two full blocks, the second filled while decoding.
        assert_eq!(stored_blocks(&outcomes), 2);
        assert_eq!(outcomes.iter().map(|o| o.emitted.len()).sum::<usize>(), 500);
    }

    #[test]
    fn full_pool_preempts_and_evicts() {
        let mut s = Scheduler::new(config(5, 4096));
        s.enqueue(seq(0, 1024, 600, &[1, 2]));
        s.enqueue(seq(1, 1024, 600, &[3, 4]));
        let (_, outcomes) = run_to_idle(&mut s);
        let finished: Vec<SeqId> = outcomes.iter().flat_map(|o| o.finished.clone()).collect();
        assert_eq!(finished.len(), 2, "both finish despite preemption");
        let removed = outcomes
            .iter()
            .flat_map(|o| &o.events)
            .any(|e| matches!(e, KvEvent::BlockRemoved(_)));
        assert!(removed);
        assert_eq!(s.kv_usage(), 0.0);
    }

    #[test]
    fn abort_frees_blocks_and_admits_the_next() {
        let mut s = Scheduler::new(config(3, 8192));
        s.enqueue(seq(0, 1024, 600, &[1, 2]));
        s.enqueue(seq(1, 1024, 1, &[3, 4]));
        assert!(s.start_step(&MockerFit::default()).is_some());
        let _ = s.finish_step();
        assert_eq!((s.running(), s.waiting()), (1, 1));
        assert!(s.abort(0));
        assert!(!s.abort(0));
        assert_eq!(s.kv_usage(), 0.0);
        let (_, outcomes) = run_to_idle(&mut s);
        assert_eq!(outcomes.last().map(|o| o.finished.clone()), Some(vec![1]));
    }

    fn linear() -> crate::timing::Linear {
        crate::timing::Linear {
            prefill_overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(50),
            decode: Duration::from_millis(10),
            kv_transfer_per_block: Duration::from_millis(1),
        }
    }

    /// Steps until idle under `timing`: each step's duration and outcome.
    fn steps(s: &mut Scheduler<u64>, timing: &dyn TimingModel) -> Vec<(Duration, StepOutcome)> {
        let mut out = Vec::new();
        while let Some(d) = s.start_step(timing) {
            out.push((d, s.finish_step()));
        }
        out
    }

    fn stores(outcome: &StepOutcome) -> Vec<Vec<u64>> {
        outcome
            .events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) => Some(s.block_hashes.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_prefill_leg_holds_its_blocks_until_released() {
        let mut s = Scheduler::new(config(8, 8192));
        s.enqueue_leg(seq(0, 1100, 1, &[1, 2]), Leg::Prefill);
        let (_, outcomes) = run_to_idle(&mut s);
        let held: Vec<HeldLeg> = outcomes.iter().flat_map(|o| o.held.clone()).collect();
        assert_eq!(held.len(), 1);
        assert_eq!((held[0].id, held[0].blocks.len()), (0, 3));
        assert_eq!(
            held[0].computed_tokens, 1100,
            "the sampled token is not computed"
        );
        assert_eq!(outcomes.last().map(|o| o.finished.clone()), Some(vec![0]));
        assert_eq!(s.held_legs(), 1);
        assert!(!s.abort(0), "a finished leg cannot be aborted");
        assert_eq!(s.kv_usage(), 3.0 / 8.0, "held blocks stay in use");
        // Held blocks are cached: another prompt with the same prefix hits them.
        s.enqueue(seq(1, 1100, 1, &[1, 2]));
        let (_, outcomes) = run_to_idle(&mut s);
        assert_eq!(outcomes[0].first_tokens[0].hit_blocks, 2);
        assert!(s.release_held(0));
        assert!(!s.release_held(0));
        assert_eq!((s.kv_usage(), s.held_legs()), (0.0, 0));
        assert_eq!(s.cached_prefix(&[1, 2]), 2, "released blocks stay cached");
    }

    #[test]
    fn a_decode_leg_loads_its_prompt_caches_it_and_recomputes_only_the_last_token() {
        let mut s = Scheduler::new(config(8, 8192));
        s.enqueue_leg(
            seq(0, 1100, 2, &[1, 2]),
            Leg::Decode {
                remote_tokens: 1100,
            },
        );
        let timing = linear();
        let steps = steps(&mut s, &timing);
        assert_eq!(steps.len(), 3, "transfer, last-token prefill, one decode");
        // The transfer: three blocks read, none cached or computed yet.
        assert_eq!(steps[0].0, Duration::from_millis(3));
        assert!(steps[0].1.events.is_empty() && steps[0].1.emitted.is_empty());
        // Promoted: the two full loaded blocks are published, one token is computed.
        assert_eq!(stores(&steps[1].1), [vec![1, 2]]);
        assert_eq!(
            steps[1].0,
            Duration::from_millis(5) + Duration::from_micros(50)
        );
        assert_eq!(
            steps[1].1.first_tokens,
            [FirstToken {
                id: 0,
                hit_blocks: 0,
                external_tokens: 1100,
            }]
        );
        assert_eq!(steps[2].1.finished, [0]);
        assert_eq!(
            s.busy(),
            Duration::from_micros(15_050),
            "waiting for a transfer is not busy time"
        );
        assert_eq!(s.cached_prefix(&[1, 2]), 2);
        assert!(s.held_legs() == 0 && s.kv_usage() == 0.0);
    }

    #[test]
    fn a_decode_leg_reuses_its_local_hit_and_loads_only_the_rest() {
        let mut s = Scheduler::new(config(8, 8192));
        s.enqueue(seq(0, 600, 1, &[1]));
        let _ = run_to_idle(&mut s);
        s.enqueue_leg(
            seq(1, 1100, 1, &[1, 2]),
            Leg::Decode {
                remote_tokens: 1100,
            },
        );
        let steps = steps(&mut s, &linear());
        assert_eq!(steps[0].0, Duration::from_millis(2), "two new blocks read");
        assert_eq!(
            stores(&steps[1].1),
            [vec![2]],
            "only the loaded block is new"
        );
        assert_eq!(
            steps[1].1.first_tokens,
            [FirstToken {
                id: 1,
                hit_blocks: 1,
                external_tokens: 588,
            }]
        );
    }

    #[test]
    fn a_transfer_runs_beside_other_work_and_an_abort_frees_its_blocks() {
        let mut s = Scheduler::new(config(8, 8192));
        s.enqueue_leg(
            seq(0, 1100, 1, &[1, 2]),
            Leg::Decode {
                remote_tokens: 1100,
            },
        );
        s.enqueue(seq(1, 100, 3, &[]));
        let timing = linear();
        // One step: the other request prefills while the blocks are in transfer.
        let d = s.start_step(&timing).unwrap();
        assert_eq!(d, Duration::from_millis(10));
        let first = s.finish_step();
        assert_eq!(first.first_tokens[0].id, 1);
        assert_eq!(s.waiting(), 1, "the loading leg counts as waiting");
        assert!(s.abort(0));
        let _ = steps(&mut s, &timing);
        assert_eq!(s.kv_usage(), 0.0);
        assert_eq!(
            s.cached_prefix(&[1, 2]),
            0,
            "an aborted load caches nothing"
        );
    }
}
