//! Bounds on the tokenizations that run on blocking threads: a slot each (taken within the
//! decision's budget, held until the work ends), the prompt-size limit, and their recent cost.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

use super::TokenCache;
use crate::error::TokenizeError;

/// At most one "prompt too large" line per this long (the rest counted in the fallbacks).
const TOO_LARGE_LOG_EVERY: Duration = Duration::from_secs(10);

/// A taken blocking-tokenization slot; counted in flight until dropped.
#[derive(Debug)]
pub(super) struct BlockingSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for BlockingSlot {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl TokenCache {
    /// A free blocking slot by `deadline`, or [`TokenizeError::Busy`]: a decision never queues
    /// past its budget behind longer prompts.
    pub(super) async fn blocking_slot(
        &self,
        deadline: tokio::time::Instant,
        budget: Duration,
    ) -> Result<BlockingSlot, TokenizeError> {
        let busy = || TokenizeError::Busy { waited: budget };
        let permit = tokio::time::timeout_at(deadline, Arc::clone(&self.blocking).acquire_owned())
            .await
            .map_err(|_| busy())?
            .map_err(|_| busy())?;
        Ok(self.taken_slot(permit))
    }

    /// `permit` as a blocking slot, counted in flight until dropped.
    pub(super) fn taken_slot(&self, permit: tokio::sync::OwnedSemaphorePermit) -> BlockingSlot {
        self.gauges.blocking_in_flight.inc();
        BlockingSlot {
            _permit: permit,
            in_flight: self.gauges.blocking_in_flight.clone(),
        }
    }

    /// `work`'s result by `deadline` ([`TokenizeError::Timeout`] after `budget` otherwise). Work
    /// holding a blocking `slot` runs as a task of its own that keeps the slot until the work
    /// ends: the blocking thread cannot be stopped, so its slot is what bounds how many
    /// abandoned ones run, and its result is dropped (or cached, by `work`) as it ends.
    pub(super) async fn bounded<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T, TokenizeError>> + Send + 'static,
        slot: Option<BlockingSlot>,
        deadline: tokio::time::Instant,
        budget: Duration,
    ) -> Result<T, TokenizeError> {
        let timeout = || TokenizeError::Timeout { after: budget };
        let Some(slot) = slot else {
            return tokio::time::timeout_at(deadline, work)
                .await
                .map_err(|_| timeout())?;
        };
        let task = self.tasks.spawn(async move {
            let _slot = slot;
            work.await
        });
        match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(TokenizeError::InProcess {
                reason: e.to_string(),
            }),
            Err(_) => {
                self.gauges.abandoned.inc();
                Err(timeout())
            }
        }
    }

    /// What a whole blocking tokenization of `bytes` is expected to take, from recent ones
    /// (zero before any).
    pub(super) fn expected_blocking(&self, bytes: usize) -> Duration {
        let ps_per_byte = self
            .blocking_ps_per_byte
            .load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_nanos(ps_per_byte.saturating_mul(bytes as u64) / 1000)
    }

    /// One warning per [`TOO_LARGE_LOG_EVERY`]; every such prompt is counted by the caller.
    pub(super) fn log_too_large(&self, bytes: usize) {
        let now = Instant::now();
        let mut last = self.last_too_large_log.lock();
        if last.is_none_or(|at| now.duration_since(at) >= TOO_LARGE_LOG_EVERY) {
            *last = Some(now);
            tracing::warn!(
                bytes,
                limit = self.max_prompt_bytes,
                "prompt too large to tokenize whole in process (limits.tokenize_max_prompt_bytes); \
                 routing on the next tier (counted in fallbacks_total{{stage=\"tokenize\",cause=\"prompt_too_large\"}})"
            );
        }
    }
}

/// Folds one blocking tokenization (`elapsed` for `bytes`) into the recent cost per byte (an
/// exponential average over about eight).
pub(super) fn record_rate(rate: &std::sync::atomic::AtomicU64, elapsed: Duration, bytes: usize) {
    use std::sync::atomic::Ordering;
    let sample = u64::try_from(elapsed.as_nanos().saturating_mul(1000) / bytes.max(1) as u128)
        .unwrap_or(u64::MAX);
    let _ = rate.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
        Some(if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        })
    });
}
