//! One simulated replica: the shared vLLM-style engine model
//! ([`kvroute_engine_model::Scheduler`]: block pool, LRU free queue, chunked prefill,
//! preemption, KV events) over trace requests, in virtual µs.
//!
//! A request's keys are its full prompt blocks' chained keys (a trace has no output tokens, so
//! decoded blocks are not cached) and its published token ids are zeros.

use std::sync::Arc;

use kvroute_engine_model::{Leg, NewSeq, Scheduler, SchedulerConfig, TimingModel};

pub use kvroute_engine_model::{FirstToken, StepOutcome};

use crate::BLOCK_TOKENS;
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
    scheduler: Scheduler<u64>,
    step_end_us: Option<u64>,
}

impl Engine {
    /// An idle replica with an empty cache.
    pub fn new(config: EngineConfig) -> Self {
        Engine {
            config,
            scheduler: Scheduler::new(SchedulerConfig {
                num_blocks: config.blocks as usize,
                block_size: BLOCK_TOKENS as usize,
                token_budget: config.token_budget,
                max_seqs: config.max_seqs,
            }),
            step_end_us: None,
        }
    }

    /// Its limits.
    pub fn config(&self) -> EngineConfig {
        self.config
    }

    /// Requests waiting to be admitted.
    pub fn waiting(&self) -> usize {
        self.scheduler.waiting()
    }

    /// Requests admitted and not finished.
    pub fn running(&self) -> usize {
        self.scheduler.running()
    }

    /// Share of KV blocks in use.
    pub fn kv_usage(&self) -> f64 {
        self.scheduler.kv_usage()
    }

    /// Time spent stepping so far, µs.
    pub fn busy_us(&self) -> u64 {
        self.scheduler.busy().as_micros() as u64
    }

    /// End of the step in progress, if one is.
    pub fn step_end_us(&self) -> Option<u64> {
        self.step_end_us
    }

    /// How many leading `keys` are cached here right now.
    pub fn cached_prefix(&self, keys: &[u64]) -> usize {
        self.scheduler.cached_prefix(keys)
    }

    /// Queues a request.
    pub fn enqueue(&mut self, request: &Request) {
        self.enqueue_leg(request, Leg::Whole, request.output_tokens);
    }

    /// Queues one leg of a disaggregated request: a prefill leg (one output token, its blocks
    /// held for the decode replica) or a decode leg (its prompt loaded, not computed).
    pub fn enqueue_leg(&mut self, request: &Request, leg: Leg, output_tokens: u32) {
        self.scheduler.enqueue_leg(
            NewSeq {
                id: request.id,
                prompt_len: request.input_tokens,
                output_len: output_tokens,
                keys: Arc::from(request.keys()),
                tokens: None,
                extra_keys: None,
            },
            leg,
        );
    }

    /// Frees a finished prefill leg's held blocks (the decode replica has read them).
    pub fn release_held(&mut self, id: usize) -> bool {
        self.scheduler.release_held(id)
    }

    /// Schedules a step starting at `now_us`; returns its end, or `None` when there is nothing
    /// to run (or a step is already in progress).
    pub fn start_step(&mut self, now_us: u64, timing: &dyn TimingModel) -> Option<u64> {
        if self.step_end_us.is_some() {
            return None;
        }
        let duration = self.scheduler.start_step(timing)?;
        let end = now_us + duration.as_micros() as u64;
        self.step_end_us = Some(end);
        Some(end)
    }

    /// Completes the step in progress (at its end time).
    pub fn finish_step(&mut self) -> StepOutcome {
        self.step_end_us = None;
        self.scheduler.finish_step()
    }

    /// Simulates this replica forward from `now_us` with `request` added and no other
    /// arrivals, until its first token. `None` if it never gets one (cannot fit).
    pub fn predict(
        &self,
        request: &Request,
        timing: &dyn TimingModel,
        now_us: u64,
    ) -> Option<Prediction> {
        self.predict_within(request, timing, now_us, u64::MAX)
    }

    /// [`Engine::predict`], giving up (`None`) once the request has waited more than
    /// `limit_us` without its first token: a caller looking for the soonest replica need not
    /// simulate the rest of a queue that has already lost. Within the limit, the same answer.
    pub fn predict_within(
        &self,
        request: &Request,
        timing: &dyn TimingModel,
        now_us: u64,
        limit_us: u64,
    ) -> Option<Prediction> {
        /// Steps after which a request counts as never served.
        const MAX_STEPS: usize = 1_000_000;
        // The request cannot get its first token before the step in progress ends.
        if self
            .step_end_us
            .is_some_and(|end| end.saturating_sub(now_us) > limit_us)
        {
            return None;
        }
        let mut engine = self.clone();
        engine.enqueue(request);
        let mut now = now_us;
        for _ in 0..MAX_STEPS {
            let end = match engine.step_end_us {
                Some(end) => end,
                None => engine.start_step(now, timing)?,
            };
            if end.saturating_sub(now_us) > limit_us {
                return None;
            }
            now = end;
            let outcome = engine.finish_step();
            if let Some(first) = outcome.first_tokens.iter().find(|f| f.id == request.id) {
                return Some(Prediction {
                    ttft_us: now - now_us,
                    hit_blocks: first.hit_blocks,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use kvroute_engine_model::MockerFit;

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
                session_id: None,
            },
        )
        .unwrap()
    }

    #[test]
    fn prediction_matches_the_run_and_hits_the_cached_prefix() {
        let requests = [
            request(0, 1500, 3, &[1, 2, 3]),
            request(1, 1100, 1, &[1, 2, 7]),
        ];
        let config = EngineConfig {
            blocks: 8,
            token_budget: 1024,
            max_seqs: 4,
        };
        let timing = MockerFit::default();
        let mut engine = Engine::new(config);
        engine.enqueue(&requests[0]);
        let mut now = 0;
        while let Some(end) = engine.start_step(now, &timing) {
            now = end;
            engine.finish_step();
        }
        let predicted = engine.predict(&requests[1], &timing, now).unwrap();
        assert_eq!(predicted.hit_blocks, 2);
        let tail = kvroute_engine_model::PrefillChunk {
            tokens: 76,
            context: 1024,
        };
        assert_eq!(predicted.ttft_us, timing.step_us(&[tail], 0));
        engine.enqueue(&requests[1]);
        let end = engine.start_step(now, &timing).unwrap();
        assert_eq!(end - now, predicted.ttft_us);
        assert_eq!(engine.finish_step().first_tokens[0].hit_blocks, 2);
        assert!(engine.busy_us() > 0 && engine.step_end_us().is_none());
    }
}
