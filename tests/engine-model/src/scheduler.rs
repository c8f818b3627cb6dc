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

use std::collections::VecDeque;
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
}

/// A request that emitted its first token in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstToken {
    /// Its id.
    pub id: SeqId,
    /// Leading prompt blocks it found cached when first admitted.
    pub hit_blocks: u32,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Requests that emitted their first token.
    pub first_tokens: Vec<FirstToken>,
    /// Requests that emitted a token (first ones included), in running order.
    pub emitted: Vec<SeqId>,
    /// Requests that finished (their last token was emitted).
    pub finished: Vec<SeqId>,
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
        }
    }

    /// Its limits.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Requests waiting to be admitted.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
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
        self.waiting.push_back(Seq {
            new,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            cached: 0,
            scheduled: 0,
            first_token_done: false,
            hit_blocks: None,
        });
    }

    /// Drops a request wherever it is (the client left), freeing its blocks; false if unknown.
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
            let max_hits = (prompt_len.saturating_sub(1) / bs) as usize;
            let hits = self.pool.prefix_hits(&seq.new.keys, max_hits);
            let computed = hits.len() as u32 * bs;
            let tokens = (prompt_len - computed).min(budget);
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
            chunks.push(PrefillChunk {
                tokens,
                context: computed,
            });
            seq.computed = computed;
            seq.scheduled = tokens;
            budget -= tokens;
            self.running.push(seq);
            self.cache_scheduled(self.running.len() - 1, computed + tokens);
        }
        let work = StepWork {
            prefill: &chunks,
            decodes,
        };
        let idle = chunks.is_empty() && decodes == 0;
        let duration = (!idle).then(|| timing.step_duration(&work));
        self.chunks = chunks;
        let duration = duration?;
        self.busy += duration;
        self.in_step = true;
        Some(duration)
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
                self.pool.free(&seq.blocks);
                outcome.finished.push(seq.new.id);
            } else {
                i += 1;
            }
        }
        outcome.events = self.pool.take_events();
        outcome
    }

    /// Caches the blocks of running request `index` that `kv_tokens` fill, as far as its keys go.
    fn cache_scheduled(&mut self, index: usize, kv_tokens: u32) {
        let seq = &mut self.running[index];
        let full = (kv_tokens as usize / self.config.block_size)
            .min(seq.new.keys.len())
            .min(seq.blocks.len());
        if full > seq.cached {
            self.pool.cache_blocks(
                &seq.blocks,
                &seq.new.keys,
                seq.cached,
                full,
                seq.new.tokens.as_deref(),
                seq.new.extra_keys.as_deref(),
            );
            seq.cached = full;
        }
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
                hit_blocks: 0
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
}
