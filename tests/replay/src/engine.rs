//! One simulated replica: a vLLM-v1-style scheduler over a [`BlockPool`].
//!
//! Each step (one forward pass):
//! 1. Running requests first, in admission order: a request still prefilling gets the next
//!    chunk of its prompt (chunked prefill, at most the remaining token budget), a decoding one
//!    one token. Blocks are allocated for the tokens it will hold; when the pool is full the
//!    most recently admitted request is preempted (its blocks freed, recomputed later).
//! 2. Then waiting requests, first come first served, while the token budget, `max_seqs` and
//!    free blocks allow: leading prompt blocks found in the pool are hits (revived, not
//!    computed), the rest is prefilled in chunks. A request that does not fit waits (no
//!    preemption to admit).
//! 3. The step lasts [`Timing::step_us`] of its uncached prompt tokens and decodes. At its end
//!    newly full prompt blocks get their keys (published as `BlockStored`), a request whose
//!    prompt is done emits its first token, and finished requests free their blocks last-first.
//!
//! Evictions (during allocation) and stores are published together per step, like vLLM's
//! `KVEventBatch`, as [`KvEvent`]s of the real index.
//!
//! Simplification: a preempted request recomputes its prompt only (the KV of its generated
//! tokens is ignored); its TTFT is the first one it emitted.

use std::collections::VecDeque;

use kvroute_index::event::{BlockRemoved, BlockStored, KvEvent, Medium};

use crate::BLOCK_TOKENS;
use crate::pool::{BlockId, BlockPool};
use crate::timing::Timing;
use crate::trace::Request;

/// Engine limits (vLLM's `--num-gpu-blocks-override`, `--max-num-batched-tokens`,
/// `--max-num-seqs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// KV blocks of [`BLOCK_TOKENS`] tokens.
    pub blocks: u32,
    /// Tokens computed per step (prefill chunks plus one per decode).
    pub token_budget: u32,
    /// Requests running at once.
    pub max_seqs: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            blocks: 4096,
            token_budget: 8192,
            max_seqs: 256,
        }
    }
}

/// A request on this replica.
#[derive(Debug, Clone)]
struct Seq {
    request: usize,
    /// Prompt tokens whose KV is held.
    computed: u32,
    /// Output tokens produced.
    generated: u32,
    /// Held blocks, in prompt order.
    blocks: Vec<BlockId>,
    /// Leading blocks already keyed (hits or cached after compute).
    keyed: usize,
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
    /// Request id.
    pub request: usize,
    /// Leading prompt blocks it found cached when first admitted.
    pub hit_blocks: u32,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Requests that emitted their first token.
    pub first_tokens: Vec<FirstToken>,
    /// Requests that finished.
    pub finished: Vec<usize>,
    /// KV events of the step (evictions, then stores).
    pub events: Vec<KvEvent>,
}

/// What the engine would do with a request routed to it now, if nothing else arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// Time to its first token, µs.
    pub ttft_us: u64,
    /// Leading blocks it would find cached.
    pub hit_blocks: u32,
}

/// One replica.
#[derive(Debug, Clone)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step_end_us: Option<u64>,
    busy_us: u64,
    pending: Vec<KvEvent>,
}

impl Engine {
    /// An idle replica with an empty cache.
    pub fn new(config: EngineConfig) -> Self {
        Engine {
            config,
            pool: BlockPool::new(config.blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            step_end_us: None,
            busy_us: 0,
            pending: Vec::new(),
        }
    }

    /// Its limits.
    pub fn config(&self) -> EngineConfig {
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

    /// Time spent stepping so far, µs.
    pub fn busy_us(&self) -> u64 {
        self.busy_us
    }

    /// End of the step in progress, if one is.
    pub fn step_end_us(&self) -> Option<u64> {
        self.step_end_us
    }

    /// How many leading `keys` are cached here right now.
    pub fn cached_prefix(&self, keys: &[u64]) -> usize {
        keys.iter()
            .take_while(|k| self.pool.lookup(**k).is_some())
            .count()
    }

    /// Queues a request.
    pub fn enqueue(&mut self, request: &Request) {
        self.waiting.push_back(Seq {
            request: request.id,
            computed: 0,
            generated: 0,
            blocks: Vec::new(),
            keyed: 0,
            scheduled: 0,
            first_token_done: false,
            hit_blocks: None,
        });
    }

    /// Schedules a step starting at `now_us`; returns its end, or `None` when there is nothing
    /// to run (or a step is already in progress).
    pub fn start_step(
        &mut self,
        now_us: u64,
        requests: &[Request],
        timing: &Timing,
    ) -> Option<u64> {
        if self.step_end_us.is_some() {
            return None;
        }
        let mut budget = self.config.token_budget;
        let mut evicted = Vec::new();
        let mut prefill_tokens = 0;
        let mut decodes = 0;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let request = &requests[self.running[i].request];
            let seq = &self.running[i];
            let (tokens, kv_tokens) = if seq.computed < request.input_tokens {
                let tokens = (request.input_tokens - seq.computed).min(budget);
                (tokens, seq.computed + tokens)
            } else {
                (1, request.input_tokens + seq.generated)
            };
            let needed = kv_tokens.div_ceil(BLOCK_TOKENS) as usize;
            let mut preempted_self = false;
            while self.running[i].blocks.len() < needed {
                match self.pool.allocate(&mut evicted) {
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
            seq.scheduled = tokens;
            budget -= tokens;
            if seq.computed < request.input_tokens {
                prefill_tokens += tokens;
            } else {
                decodes += 1;
            }
            i += 1;
        }
        while budget > 0 && self.running.len() < self.config.max_seqs {
            let Some(seq) = self.waiting.front() else {
                break;
            };
            let request = &requests[seq.request];
            let hits: Vec<BlockId> = request
                .keys()
                .iter()
                .take(request.max_hit_blocks())
                .map_while(|key| self.pool.lookup(*key))
                .collect();
            let computed = hits.len() as u32 * BLOCK_TOKENS;
            let tokens = (request.input_tokens - computed).min(budget);
            let new_blocks = (computed + tokens).div_ceil(BLOCK_TOKENS) as usize - hits.len();
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
            seq.keyed = hits.len();
            seq.hit_blocks.get_or_insert(hits.len() as u32);
            seq.blocks = hits;
            for _ in 0..new_blocks {
                if let Some(block) = self.pool.allocate(&mut evicted) {
                    seq.blocks.push(block);
                }
            }
            seq.computed = computed;
            seq.scheduled = tokens;
            budget -= tokens;
            prefill_tokens += tokens;
            self.running.push(seq);
        }
        if !evicted.is_empty() {
            self.pending.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: evicted,
                medium: Medium::Gpu,
                group_idx: None,
            }));
        }
        if prefill_tokens == 0 && decodes == 0 {
            return None;
        }
        let duration = timing.step_us(prefill_tokens, decodes);
        self.busy_us += duration;
        let end = now_us + duration;
        self.step_end_us = Some(end);
        Some(end)
    }

    /// Completes the step in progress (at its end time).
    pub fn finish_step(&mut self, requests: &[Request]) -> StepOutcome {
        self.step_end_us = None;
        let mut outcome = StepOutcome::default();
        for seq in &mut self.running {
            if seq.scheduled == 0 {
                continue;
            }
            let request = &requests[seq.request];
            if seq.computed < request.input_tokens {
                seq.computed += seq.scheduled;
                let full = ((seq.computed / BLOCK_TOKENS) as usize).min(request.full_blocks);
                let mut run: Vec<u64> = Vec::new();
                let mut run_start = seq.keyed;
                while seq.keyed < full {
                    let key = request.chain[seq.keyed];
                    if self.pool.cache(seq.blocks[seq.keyed], key) {
                        run.push(key);
                    } else {
                        flush_stored(&mut self.pending, request, run_start, &mut run);
                        run_start = seq.keyed + 1;
                    }
                    seq.keyed += 1;
                }
                flush_stored(&mut self.pending, request, run_start, &mut run);
                if seq.computed >= request.input_tokens {
                    seq.generated += 1;
                    if !seq.first_token_done {
                        seq.first_token_done = true;
                        outcome.first_tokens.push(FirstToken {
                            request: seq.request,
                            hit_blocks: seq.hit_blocks.unwrap_or(0),
                        });
                    }
                }
            } else {
                seq.generated += 1;
            }
            seq.scheduled = 0;
        }
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            if seq.first_token_done && seq.generated >= requests[seq.request].output_tokens {
                let seq = self.running.remove(i);
                for block in seq.blocks.iter().rev() {
                    self.pool.release(*block);
                }
                outcome.finished.push(seq.request);
            } else {
                i += 1;
            }
        }
        outcome.events = std::mem::take(&mut self.pending);
        outcome
    }

    /// Simulates this replica forward from `now_us` with `request` added and no other
    /// arrivals, until its first token. `None` if it never gets one (cannot fit).
    pub fn predict(
        &self,
        request: &Request,
        requests: &[Request],
        timing: &Timing,
        now_us: u64,
    ) -> Option<Prediction> {
        /// Steps after which a request counts as never served.
        const MAX_STEPS: usize = 1_000_000;
        let mut engine = self.clone();
        engine.enqueue(request);
        let mut now = now_us;
        for _ in 0..MAX_STEPS {
            let end = match engine.step_end_us {
                Some(end) => end,
                None => engine.start_step(now, requests, timing)?,
            };
            now = end;
            let outcome = engine.finish_step(requests);
            if let Some(first) = outcome
                .first_tokens
                .iter()
                .find(|f| f.request == request.id)
            {
                return Some(Prediction {
                    ttft_us: now - now_us,
                    hit_blocks: first.hit_blocks,
                });
            }
        }
        None
    }

    /// Frees a running request's blocks and sends it back to the head of the queue.
    fn preempt(&mut self, index: usize) {
        let mut seq = self.running.remove(index);
        for block in seq.blocks.iter().rev() {
            self.pool.release(*block);
        }
        seq.blocks.clear();
        seq.computed = 0;
        seq.keyed = 0;
        seq.scheduled = 0;
        self.waiting.push_front(seq);
    }
}

/// Publishes a run of newly cached blocks of `request` starting at block `start`.
fn flush_stored(pending: &mut Vec<KvEvent>, request: &Request, start: usize, run: &mut Vec<u64>) {
    if run.is_empty() {
        return;
    }
    let block_hashes = std::mem::take(run);
    pending.push(KvEvent::BlockStored(BlockStored {
        token_ids: vec![0; block_hashes.len() * BLOCK_TOKENS as usize],
        block_size: BLOCK_TOKENS,
        parent_block_hash: start.checked_sub(1).map(|p| request.chain[p]),
        block_hashes,
        ..BlockStored::default()
    }));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{TraceRecord, prepare};

    fn request(id: usize, input: u32, output: u32, ids: &[u64]) -> Request {
        prepare(
            id,
            &TraceRecord {
                timestamp: 0,
                input_length: input,
                output_length: output,
                hash_ids: ids.to_vec(),
            },
        )
        .unwrap()
    }

    fn run_to_idle(engine: &mut Engine, requests: &[Request]) -> (u64, Vec<StepOutcome>) {
        let mut now = 0;
        let mut outcomes = Vec::new();
        while let Some(end) = engine.start_step(now, requests, &Timing::default()) {
            now = end;
            outcomes.push(engine.finish_step(requests));
        }
        (now, outcomes)
    }

    #[test]
    fn chunked_prefill_then_decode_then_hit() {
        let requests = vec![
            request(0, 1500, 3, &[1, 2, 3]),
            request(1, 1100, 1, &[1, 2, 7]),
        ];
        let config = EngineConfig {
            blocks: 8,
            token_budget: 1024,
            max_seqs: 4,
        };
        let mut engine = Engine::new(config);
        engine.enqueue(&requests[0]);
        let (_, outcomes) = run_to_idle(&mut engine, &requests);
        // 1024 + 476 prompt tokens, then 2 decodes.
        assert_eq!(outcomes.len(), 4);
        assert_eq!(
            outcomes[1].first_tokens,
            vec![FirstToken {
                request: 0,
                hit_blocks: 0
            }]
        );
        assert_eq!(outcomes[3].finished, vec![0]);
        let stored: usize = outcomes
            .iter()
            .flat_map(|o| &o.events)
            .map(|e| match e {
                KvEvent::BlockStored(s) => s.block_hashes.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(
            stored, 2,
            "two full blocks, the partial third is not cached"
        );
        engine.enqueue(&requests[1]);
        let prediction = engine.predict(&requests[1], &requests, &Timing::default(), 0);
        let (end, outcomes) = run_to_idle(&mut engine, &requests);
        assert_eq!(outcomes[0].first_tokens[0].hit_blocks, 2);
        assert_eq!(
            end,
            Timing::default().step_us(76, 0),
            "only the uncached tail is prefilled"
        );
        assert!(prediction.is_some());
    }

    #[test]
    fn full_pool_preempts_and_evicts() {
        let requests = vec![
            request(0, 1024, 600, &[1, 2]),
            request(1, 1024, 600, &[3, 4]),
        ];
        let config = EngineConfig {
            blocks: 5,
            token_budget: 4096,
            max_seqs: 4,
        };
        let mut engine = Engine::new(config);
        engine.enqueue(&requests[0]);
        engine.enqueue(&requests[1]);
        let (_, outcomes) = run_to_idle(&mut engine, &requests);
        let finished: Vec<usize> = outcomes.iter().flat_map(|o| o.finished.clone()).collect();
        assert_eq!(finished.len(), 2, "both finish despite preemption");
        let removed = outcomes
            .iter()
            .flat_map(|o| &o.events)
            .any(|e| matches!(e, KvEvent::BlockRemoved(_)));
        assert!(removed);
        assert_eq!(engine.kv_usage(), 0.0);
    }
}
