//! How long one engine step takes: a [`TimingModel`] maps a step's work ([`StepWork`]: each
//! prefill chunk with the context it attends to, and the decoding sequences) to a duration.
//!
//! - [`MockerFit`]: routing-quality replay's model, NVIDIA Dynamo mocker's H100-class fit.
//! - [`Linear`]: the engine simulator's model, a fixed cost plus a cost per prefill token.
//!
//! A new model (e.g. one whose prefill cost grows with the chunk's context) is one more impl.

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
}

/// Dynamo mocker's fit (an H100-class GPU, 8B-class model):
///
/// ```text
/// prefill_ms(u) = 4.21e-7·u² + 1.518e-2·u + 16.5        u = uncached prompt tokens in the step
/// step_ms       = scale · ( (u > 0 ? prefill_ms(u) : DECODE_BASE_MS) + DECODE_MS_PER_SEQ · d )
/// ```
///
/// - Prefill is quadratic because attention over a long chunk costs more per token.
/// - Decode: `d` sequences generating one token each. A decode-only step costs a floor
///   ([`MockerFit::DECODE_BASE_MS`], reading the weights once per step) plus
///   [`MockerFit::DECODE_MS_PER_SEQ`] per sequence (reading its KV and its share of the batch's
///   matmuls), so time per token falls with batch size while the step itself grows: 10 ms
///   alone, 20 ms at 100 sequences. In a mixed step the prefill term already includes the
///   fixed cost.
/// - `scale` multiplies everything (2 = a GPU half as fast). Durations are whole µs (≥ 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockerFit {
    /// Multiplies every step's duration.
    pub scale: f64,
}

impl Default for MockerFit {
    fn default() -> Self {
        MockerFit { scale: 1.0 }
    }
}

impl MockerFit {
    /// Fixed cost of a decode-only step, ms.
    pub const DECODE_BASE_MS: f64 = 10.0;
    /// Added cost per decoding sequence in a step, ms.
    pub const DECODE_MS_PER_SEQ: f64 = 0.1;

    /// Prefill time of `uncached` tokens in one step, ms.
    pub fn prefill_ms(uncached: u32) -> f64 {
        let u = f64::from(uncached);
        4.21e-7 * u * u + 1.518e-2 * u + 16.5
    }

    /// Duration of a step computing `prefill_tokens` prompt tokens and `decodes` decode tokens, µs.
    pub fn step_us(&self, prefill_tokens: u32, decodes: u32) -> u64 {
        let base = if prefill_tokens > 0 {
            Self::prefill_ms(prefill_tokens)
        } else {
            Self::DECODE_BASE_MS
        };
        let ms = self.scale * (base + Self::DECODE_MS_PER_SEQ * f64::from(decodes));
        (ms * 1000.0).round().max(1.0) as u64
    }
}

impl TimingModel for MockerFit {
    fn step_duration(&self, work: &StepWork<'_>) -> Duration {
        Duration::from_micros(self.step_us(work.prefill_tokens(), work.decodes))
    }
}

/// A fixed cost per step that prefills, a cost per prefilled token, and a cost per step that
/// only decodes. A lone request's first token comes `overhead + uncached × per_token` after it
/// is scheduled (one step when the token budget covers its prompt), each further one
/// `decode` later; concurrent requests share steps (continuous batching).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Linear {
    /// Fixed cost of a step with prefill work.
    pub prefill_overhead: Duration,
    /// Cost per prompt token computed.
    pub prefill_per_token: Duration,
    /// Cost of a step that only decodes (one token per running sequence).
    pub decode: Duration,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mocker_fit_documented_points() {
        let t = MockerFit::default();
        assert_eq!(t.step_us(0, 1), 10_100);
        assert_eq!(t.step_us(0, 100), 20_000);
        // 8192 tokens: 28.253 + 124.355 + 16.5 ms.
        assert_eq!(t.step_us(8192, 0), 169_107);
        let slow = MockerFit { scale: 2.0 };
        assert_eq!(slow.step_us(0, 100), 40_000);
        let chunks = [
            PrefillChunk {
                tokens: 8000,
                context: 0,
            },
            PrefillChunk {
                tokens: 192,
                context: 512,
            },
        ];
        let work = StepWork {
            prefill: &chunks,
            decodes: 0,
        };
        assert_eq!(t.step_duration(&work), Duration::from_micros(169_107));
    }

    #[test]
    fn linear_prefill_then_decode() {
        let t = Linear {
            prefill_overhead: Duration::from_millis(5),
            prefill_per_token: Duration::from_micros(50),
            decode: Duration::from_millis(10),
        };
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
