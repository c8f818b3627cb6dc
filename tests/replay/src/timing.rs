//! How long one engine step takes.
//!
//! ```text
//! prefill_ms(u) = 4.21e-7·u² + 1.518e-2·u + 16.5        u = uncached prompt tokens in the step
//! step_ms       = scale · ( (u > 0 ? prefill_ms(u) : DECODE_BASE_MS) + DECODE_MS_PER_SEQ · d )
//! ```
//!
//! - The prefill fit is the one NVIDIA Dynamo's mocker uses (an H100-class GPU, 8B-class model):
//!   quadratic because attention over a long chunk costs more per token.
//! - Decode: `d` sequences generating one token each. A decode-only step costs a floor
//!   (`DECODE_BASE_MS`, reading the weights once per step) plus `DECODE_MS_PER_SEQ` per sequence
//!   (reading its KV and its share of the batch's matmuls), so time per token falls with batch
//!   size while the step itself grows: 10 ms alone, 20 ms at 100 sequences. In a mixed step the
//!   prefill term already includes the fixed cost.
//! - `scale` multiplies everything (`--time-scale`: 2 = a GPU half as fast).

/// Fixed cost of a decode-only step, ms.
pub const DECODE_BASE_MS: f64 = 10.0;
/// Added cost per decoding sequence in a step, ms.
pub const DECODE_MS_PER_SEQ: f64 = 0.1;

/// The timing model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Multiplies every step's duration.
    pub scale: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing { scale: 1.0 }
    }
}

impl Timing {
    /// Prefill time of `uncached` tokens in one step, ms (Dynamo mocker's fit).
    pub fn prefill_ms(uncached: u32) -> f64 {
        let u = f64::from(uncached);
        4.21e-7 * u * u + 1.518e-2 * u + 16.5
    }

    /// Duration of a step computing `prefill_tokens` prompt tokens and `decodes` decode tokens, µs.
    pub fn step_us(&self, prefill_tokens: u32, decodes: u32) -> u64 {
        let base = if prefill_tokens > 0 {
            Self::prefill_ms(prefill_tokens)
        } else {
            DECODE_BASE_MS
        };
        let ms = self.scale * (base + DECODE_MS_PER_SEQ * f64::from(decodes));
        (ms * 1000.0).round().max(1.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_points() {
        let t = Timing::default();
        assert_eq!(t.step_us(0, 1), 10_100);
        assert_eq!(t.step_us(0, 100), 20_000);
        // 8192 tokens: 28.253 + 124.355 + 16.5 ms.
        assert_eq!(t.step_us(8192, 0), 169_107);
        let slow = Timing { scale: 2.0 };
        assert_eq!(slow.step_us(0, 100), 40_000);
    }
}
