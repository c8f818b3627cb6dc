//! How long one engine step takes: a [`TimingModel`] maps a step's work ([`StepWork`]: each
//! prefill chunk with the context it attends to, and the decoding sequences) to a duration.
//!
//! - [`MockerFit`]: routing-quality replay's model, NVIDIA Dynamo mocker's H100-class fit with
//!   an attention term over the context each chunk reads.
//! - [`Linear`]: the engine simulator's model, a fixed cost plus a cost per prefill token.
//!
//! Both also price a disaggregated decode's KV transfer
//! ([`TimingModel::kv_transfer_duration`]): the blocks it reads from the prefill engine.

use std::time::Duration;

/// One request's prefill chunk in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillChunk {
    /// Prompt tokens computed in this step (uncached).
    pub tokens: u32,
    /// Tokens of the request already in KV before this chunk (prefix hits and earlier chunks):
    /// what the chunk's attention reads.
    pub context: u32,
}

/// What one step computes.
#[derive(Debug, Clone, Copy)]
pub struct StepWork<'a> {
    /// Prefill chunks, in scheduling order.
    pub prefill: &'a [PrefillChunk],
    /// Sequences generating one token each.
    pub decodes: u32,
}

impl StepWork<'_> {
    /// Prompt tokens computed in the step.
    pub fn prefill_tokens(&self) -> u32 {
        self.prefill.iter().map(|chunk| chunk.tokens).sum()
    }
}

/// A step-duration model.
pub trait TimingModel: std::fmt::Debug {
    /// How long a step doing `work` takes.
    fn step_duration(&self, work: &StepWork<'_>) -> Duration;

    /// How long a decode engine takes to read `blocks` KV blocks of `block_size` tokens from a
    /// prefill engine (a transfer runs beside the steps, not in them).
    fn kv_transfer_duration(&self, blocks: u32, block_size: u32) -> Duration;
}

/// Dynamo mocker's prefill fit (an H100-class GPU, 8B-class model), extended with the context
/// a chunk attends to; decode as the mocker's vLLM-like step floor plus a per-sequence cost.
///
/// ```text
/// chunk_ms(u, c) = 1.518344e-2·u + 4.209989e-7·u·(2c + u)      u = chunk tokens, c = context
/// prefill_ms     = 16.50142 + Σ chunk_ms                        (a step with any prefill)
/// step_ms        = prefill_scale · prefill_ms (or 0) + decode_scale · (base + 0.1 · d)
///                  base = DECODE_BASE_MS in a decode-only step, 0 in a mixed one
/// ```
///
/// **Where the shape and the coefficients come from.** Dynamo's mocker prices a prefill as
/// `4.209989e-7·t² + 1.518344e-2·t + 16.50142` ms for `t` new tokens
/// (`PerfModel::Polynomial` in `ai-dynamo/dynamo` `lib/mocker/src/common/perf_model.rs` at
/// f80944a4c0c3; the planner's synthetic sweep notes it is fitted over prompt lengths at
/// prefix 0, i.e. whole prompts from an empty cache). The mocker feeds it only the new tokens
/// (`isl − prefix`), so a chunk or a hit-extended prompt costs as if it started from nothing;
/// the AI Configurator model it can call instead takes the prefix as an input
/// (`AicCallback::predict_prefill(batch_size, effective_isl, prefix)`), because attention over
/// the cached prefix is real work. Here the quadratic term is that attention: a chunk of `u`
/// tokens after `c` computed ones forms `u·c + u²/2` causal query–key pairs, priced at
/// `2 × 4.209989e-7` ms per pair so that a whole prompt from an empty context costs exactly the
/// mocker's fit, and a prompt split into chunks costs the same attention in total
/// (`Σ u_i·(2c_i + u_i) = N²`) instead of `Σ u_i²` (which made recomputing a 100k-token
/// history 2.1 s instead of 5.7 s). The linear term (weights, MLP) and the per-step fixed cost
/// are the fit's. Attention is per request: two requests' chunks in one step do not attend to
/// each other, so their quadratic terms add, where the mocker squares the batch's total.
///
/// **Decode**: `d` sequences generating one token each. A decode-only step costs a floor
/// ([`MockerFit::DECODE_BASE_MS`], reading the weights once per step) plus
/// [`MockerFit::DECODE_MS_PER_SEQ`] per sequence, so time per token falls with batch size while
/// the step grows: 10 ms alone, 20 ms at 100 sequences. In a mixed step the prefill's fixed
/// cost already covers the weights.
///
/// `prefill_scale` and `decode_scale` multiply their parts (2 = a GPU half as fast at it);
/// durations are whole µs (≥ 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockerFit {
    /// Multiplies the prefill part of every step.
    pub prefill_scale: f64,
    /// Multiplies the decode part of every step.
    pub decode_scale: f64,
}

impl Default for MockerFit {
    fn default() -> Self {
        MockerFit::scaled(1.0)
    }
}

impl MockerFit {
    /// Fixed cost of a step that prefills, ms (the fit's constant).
    pub const PREFILL_BASE_MS: f64 = 16.50142;
    /// Cost per prompt token computed, ms (the fit's linear term).
    pub const PREFILL_MS_PER_TOKEN: f64 = 1.518344e-2;
    /// The fit's quadratic coefficient, ms per token²: half the cost of one causal query–key pair.
    pub const ATTENTION_MS_PER_TOKEN_SQUARED: f64 = 4.209989e-7;
    /// Fixed cost of a decode-only step, ms.
    pub const DECODE_BASE_MS: f64 = 10.0;
    /// Added cost per decoding sequence in a step, ms.
    pub const DECODE_MS_PER_SEQ: f64 = 0.1;
    /// Fixed cost of one KV transfer (posting the reads, the completion notification), ms.
    pub const KV_TRANSFER_BASE_MS: f64 = 0.5;
    /// KV transfer per token, ms: an 8B-class model's KV is 128 KiB per token (2 × 32 layers ×
    /// 8 KV heads × 128 dims × 2 bytes), read at 25 GB/s (a 200 Gb/s RDMA link).
    pub const KV_TRANSFER_MS_PER_TOKEN: f64 = 128.0 * 1024.0 / 25e9 * 1e3;

    /// Both parts multiplied by `scale` (the old single `--time-scale`).
    pub fn scaled(scale: f64) -> Self {
        MockerFit {
            prefill_scale: scale,
            decode_scale: scale,
        }
    }

    /// Cost of one chunk of `tokens` after `context` computed tokens of the same request, ms,
    /// without the step's fixed cost.
    pub fn chunk_ms(tokens: u32, context: u32) -> f64 {
        let (u, c) = (f64::from(tokens), f64::from(context));
        Self::PREFILL_MS_PER_TOKEN * u + Self::ATTENTION_MS_PER_TOKEN_SQUARED * u * (2.0 * c + u)
    }

    /// Prefill time of a step computing `chunks`, ms (0 when there are none).
    pub fn prefill_ms(chunks: &[PrefillChunk]) -> f64 {
        if chunks.iter().all(|chunk| chunk.tokens == 0) {
            return 0.0;
        }
        Self::PREFILL_BASE_MS
            + chunks
                .iter()
                .map(|chunk| Self::chunk_ms(chunk.tokens, chunk.context))
                .sum::<f64>()
    }

    /// Duration of a step computing `chunks` and `decodes` decode tokens, µs.
    pub fn step_us(&self, chunks: &[PrefillChunk], decodes: u32) -> u64 {
        let prefill = Self::prefill_ms(chunks);
        let base = if prefill > 0.0 {
            0.0
        } else {
            Self::DECODE_BASE_MS
        };
        let decode = base + Self::DECODE_MS_PER_SEQ * f64::from(decodes);
        let ms = self.prefill_scale * prefill + self.decode_scale * decode;
        (ms * 1000.0).round().max(1.0) as u64
    }
}

impl TimingModel for MockerFit {
    fn step_duration(&self, work: &StepWork<'_>) -> Duration {
        Duration::from_micros(self.step_us(work.prefill, work.decodes))
    }

    /// [`MockerFit::KV_TRANSFER_BASE_MS`] plus [`MockerFit::KV_TRANSFER_MS_PER_TOKEN`] for every
    /// token of every block (a block is read whole), unscaled: the link is no GPU.
    fn kv_transfer_duration(&self, blocks: u32, block_size: u32) -> Duration {
        if blocks == 0 {
            return Duration::ZERO;
        }
        let tokens = f64::from(blocks) * f64::from(block_size);
        let ms = Self::KV_TRANSFER_BASE_MS + Self::KV_TRANSFER_MS_PER_TOKEN * tokens;
        Duration::from_micros((ms * 1000.0).round().max(1.0) as u64)
    }
}

/// A fixed cost per step that prefills, a cost per prefilled token, and a cost per step that
/// only decodes. A lone request's first token comes `overhead + uncached × per_token` after it
/// is scheduled (one step when the token budget covers its prompt), each further one
/// `decode` later; concurrent requests share steps (continuous batching). A KV transfer takes
/// `kv_transfer_per_block` per block read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Linear {
    /// Fixed cost of a step with prefill work.
    pub prefill_overhead: Duration,
    /// Cost per prompt token computed.
    pub prefill_per_token: Duration,
    /// Cost of a step that only decodes (one token per running sequence).
    pub decode: Duration,
    /// Cost per block of a KV transfer from a prefill engine.
    pub kv_transfer_per_block: Duration,
}

impl TimingModel for Linear {
    fn step_duration(&self, work: &StepWork<'_>) -> Duration {
        let tokens = work.prefill_tokens();
        if tokens > 0 {
            self.prefill_overhead + self.prefill_per_token * tokens
        } else if work.decodes > 0 {
            self.decode
        } else {
            Duration::ZERO
        }
    }

    fn kv_transfer_duration(&self, blocks: u32, _block_size: u32) -> Duration {
        self.kv_transfer_per_block * blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(tokens: u32, context: u32) -> PrefillChunk {
        PrefillChunk { tokens, context }
    }

    #[test]
    fn mocker_fit_documented_points() {
        let t = MockerFit::default();
        // 16 blocks of 512 tokens: 0.5 ms + 8192 × 128 KiB at 25 GB/s.
        assert_eq!(
            t.kv_transfer_duration(16, 512),
            Duration::from_micros(43_450)
        );
        assert_eq!(t.kv_transfer_duration(0, 512), Duration::ZERO);
        assert_eq!(t.step_us(&[], 1), 10_100);
        assert_eq!(t.step_us(&[], 100), 20_000);
        // 8192 tokens from an empty context: the mocker's fit, 28.253 + 124.383 + 16.501 ms.
        assert_eq!(t.step_us(&[chunk(8192, 0)], 0), 169_137);
        let slow = MockerFit::scaled(2.0);
        assert_eq!(slow.step_us(&[], 100), 40_000);
        // The knobs are separate: a slower prefill leaves decode-only steps alone.
        let slow_prefill = MockerFit {
            prefill_scale: 2.0,
            decode_scale: 1.0,
        };
        assert_eq!(slow_prefill.step_us(&[], 100), 20_000);
        assert_eq!(slow_prefill.step_us(&[chunk(8192, 0)], 0), 338_274);
        let mixed = StepWork {
            prefill: &[chunk(8192, 0)],
            decodes: 10,
        };
        assert_eq!(
            slow_prefill.step_duration(&mixed),
            Duration::from_micros(338_274 + 1_000)
        );
    }

    /// The mocker's fit applied to a whole prompt from an empty context, ms.
    fn whole_prompt_fit_ms(tokens: u32) -> f64 {
        let t = f64::from(tokens);
        4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
    }

    #[test]
    fn context_makes_a_long_recompute_cost_what_the_fit_says() {
        let t = MockerFit::default();
        // Recompute a 100k-token history in 8192-token chunks, each reading what came before.
        let total = 100_000u32;
        let mut with_context = 0u64;
        let mut empty_context = 0u64;
        let mut done = 0;
        let mut steps = 0;
        while done < total {
            let tokens = (total - done).min(8192);
            with_context += t.step_us(&[chunk(tokens, done)], 0);
            empty_context += t.step_us(&[chunk(tokens, 0)], 0);
            done += tokens;
            steps += 1;
        }
        // The old model: every chunk as if from nothing (≈ 2.1 s).
        assert!(
            (2_000_000..2_200_000).contains(&empty_context),
            "{empty_context}"
        );
        assert!(
            with_context > 2 * empty_context,
            "{with_context} vs {empty_context}"
        );
        // The fit over the whole prompt, plus each extra step's fixed cost, within rounding.
        let expected_ms =
            whole_prompt_fit_ms(total) + f64::from(steps - 1) * MockerFit::PREFILL_BASE_MS;
        let got_ms = with_context as f64 / 1000.0;
        assert!(
            (got_ms - expected_ms).abs() < 0.01 * f64::from(steps),
            "{got_ms} vs {expected_ms}"
        );
        assert!((5_900.0..6_000.0).contains(&got_ms), "{got_ms}");
    }

    #[test]
    fn a_hit_prefix_is_read_not_recomputed() {
        let t = MockerFit::default();
        let cold = t.step_us(&[chunk(40_000, 0)], 0);
        let tail_after_hit = t.step_us(&[chunk(1_000, 39_000)], 0);
        let tail_alone = t.step_us(&[chunk(1_000, 0)], 0);
        assert!(tail_alone < tail_after_hit && tail_after_hit < cold / 10);
        // Two requests' chunks in one step do not attend to each other.
        let two = t.step_us(&[chunk(4096, 0), chunk(4096, 0)], 0);
        let one = t.step_us(&[chunk(8192, 0)], 0);
        assert!(two < one);
    }

    #[test]
    fn linear_prefill_then_decode() {
        let t = Linear {
            prefill_overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(50),
            decode: Duration::from_millis(10),
            kv_transfer_per_block: Duration::from_micros(100),
        };
        assert_eq!(t.kv_transfer_duration(3, 16), Duration::from_micros(300));
        let chunk = [PrefillChunk {
            tokens: 100,
            context: 0,
        }];
        let prefill = StepWork {
            prefill: &chunk,
            decodes: 3,
        };
        assert_eq!(t.step_duration(&prefill), Duration::from_millis(10));
        let decode = StepWork {
            prefill: &[],
            decodes: 3,
        };
        assert_eq!(t.step_duration(&decode), Duration::from_millis(10));
    }
}
