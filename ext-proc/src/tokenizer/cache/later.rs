//! Whole tokenizations no decision waits for, which fill the cache for a conversation's next
//! turn: on the background lane for in-process tokenizers, as bounded tasks otherwise.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvroute_tokenize::ResumePoint;
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::task::TaskTracker;

use super::schedule::Miss;
use super::{CacheEntry, TokenCache, Whole, insert_entry, insert_into};
use crate::error::TokenizeError;
use crate::tokenizer::CachedKeys;
use crate::tokenizer::block_keys::mark_at;

/// A whole tokenization that caches its result as it ends.
type CachingFuture = Pin<Box<dyn Future<Output = Result<Whole, TokenizeError>> + Send>>;

/// The cached turn before a prompt, whose tokens the prompt's tokenization takes over.
#[derive(Debug)]
pub(super) struct EarlierTurn {
    /// Where the prompt can take over the turn's tokens.
    pub(super) resume: ResumePoint,
    pub(super) tokens: Arc<[u32]>,
    /// The turn's block keys, which the prompt's extend.
    pub(super) keys: Option<CachedKeys>,
}

/// One lane job, counted in its gauge and pending under its key until dropped.
struct Queued {
    gauge: Gauge,
    pending: Arc<Mutex<std::collections::HashSet<u128>>>,
    key: u128,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.pending.lock().remove(&self.key);
        self.gauge.dec();
    }
}

impl TokenCache {
    /// Tokenizes a prompt whose decision used only its leading tokens (or its conversation's
    /// cached prefix), whole, in the background, and caches it (with the block keys the
    /// request's keys job computes), so the conversation's next turn finds it as its cached
    /// prefix. Within the prompt-size limit; for in-process tokenizers on the cache's
    /// low-priority lane (bounded by its queue), for others with a free refill slot and, for
    /// blocking work, a free blocking slot taken now (never waited for: decisions come first);
    /// otherwise skipped, counted. With `earlier` the lane encodes only what this turn added;
    /// with `rendered` (the chat as the decision rendered it) it does not render it again.
    pub(super) fn complete_later(
        &self,
        miss: &Miss<'_>,
        earlier: Option<EarlierTurn>,
        rendered: Option<Arc<kvroute_tokenize::RenderedChat>>,
    ) {
        let skipped = |why: &str| {
            self.gauges.background_skipped.inc();
            tracing::debug!(why, "whole tokenization for a later turn skipped");
        };
        let blocking = miss.runs_blocking(false);
        if blocking && miss.input.len_bytes() > self.max_prompt_bytes {
            return skipped("prompt over limits.tokenize_max_prompt_bytes");
        }
        let entries = Arc::clone(&self.entries);
        let gauges = self.gauges.clone();
        if let Some(lane) = &self.lane
            && miss.tokenizer.in_process().is_some()
        {
            let key = miss.key;
            let tokenizer = Arc::clone(miss.tokenizer);
            let input = Arc::clone(&miss.input);
            let keys_job = miss.request.keys_job.cloned();
            if !self.lane_pending.lock().insert(key) {
                return;
            }
            // Counted (and pending) from here until the job ends, or is dropped unrun (refused,
            // lane stopped).
            let queued = Queued {
                gauge: self.gauges.background_queued.clone(),
                pending: Arc::clone(&self.lane_pending),
                key,
            };
            queued.gauge.inc();
            // The job caches its result from the runtime: the lane thread may be preempted
            // anywhere, and must never hold a lock (the cache's, the pending set's) a decision
            // then waits for.
            let runtime = tokio::runtime::Handle::try_current().ok();
            let tasks = self.tasks.clone();
            let queued = lane.run(move || {
                // Another request's job for the same prompt may have run first (not known while
                // a decision holds the cache: the work is then done again).
                if entries
                    .try_lock()
                    .is_some_and(|cached| cached.contains(&key))
                {
                    return finish_on(runtime.as_ref(), &tasks, queued, || ());
                }
                let prior_keys = earlier
                    .as_ref()
                    .and_then(|turn| Some((&turn.tokens[..], turn.keys.as_ref()?)));
                let prior = earlier
                    .as_ref()
                    .map(|turn| (&turn.resume, &turn.tokens[..]));
                let (result, resume) = match tokenizer.in_process() {
                    Some(in_process) => match rendered
                        .and_then(|rendered| {
                            in_process.tokenize_rendered_resumable(&rendered, prior)
                        })
                        .or_else(|| in_process.tokenize_resumable(&input, prior))
                    {
                        Some(Ok(resumed)) => (Some(Ok(resumed.tokens)), resumed.resume),
                        Some(Err(error)) => (Some(Err(error)), None),
                        None => (Some(in_process.tokenize_now(&input)), None),
                    },
                    None => (None, None),
                };
                let entry = match result {
                    Some(Ok(tokens)) => {
                        let tokens: Arc<[u32]> = tokens.into();
                        let keys = keys_job.and_then(|job| {
                            job.keys_for(&tokens, prior_keys, mark_at(&tokens, resume))
                        });
                        Some(CacheEntry {
                            tokens,
                            multimodal: None,
                            keys,
                            resume,
                        })
                    }
                    Some(Err(error)) => {
                        tracing::debug!(%error, "background whole tokenization failed");
                        None
                    }
                    None => None,
                };
                finish_on(runtime.as_ref(), &tasks, queued, move || {
                    if let Some(entry) = entry {
                        insert_entry(&entries, &gauges, key, entry);
                    }
                });
            });
            if !queued {
                skipped("background lane full");
            }
            return;
        }
        let Ok(refill) = Arc::clone(&self.refills).try_acquire_owned() else {
            return skipped("refills busy");
        };
        let slot = if blocking {
            let Ok(permit) = Arc::clone(&self.blocking).try_acquire_owned() else {
                return skipped("blocking slots busy");
            };
            Some(self.taken_slot(permit))
        } else {
            None
        };
        let tokenizing = miss.start_tokenizing();
        let key = miss.key;
        self.tasks.spawn(async move {
            let _held = (refill, slot);
            match tokenizing.await {
                Ok(tokenized) => insert_into(&entries, &gauges, key, tokenized.into()),
                Err(error) => tracing::debug!(%error, "background whole tokenization failed"),
            }
        });
    }

    /// Lets a tokenization that outran the wait finish and fill the cache (bounded: without a
    /// free slot it is dropped, and the next turn tokenizes again).
    pub(super) fn finish_in_background(&self, caching: CachingFuture) {
        let Ok(permit) = Arc::clone(&self.refills).try_acquire_owned() else {
            return;
        };
        self.tasks.spawn(async move {
            let _permit = permit;
            let _ = caching.await;
        });
    }
}

/// Ends a lane job: runs `cache` (which takes the cache's lock) and drops `queued` (the pending
/// set's) as a task on `runtime`, at the decisions' priority; without a runtime, here. A
/// runtime shutting down drops the task: nothing is cached, the job is still counted out.
fn finish_on(
    runtime: Option<&tokio::runtime::Handle>,
    tasks: &TaskTracker,
    queued: Queued,
    cache: impl FnOnce() + Send + 'static,
) {
    let finish = move || {
        cache();
        drop(queued);
    };
    match runtime {
        Some(runtime) => {
            tasks.spawn_on(async move { finish() }, runtime);
        }
        None => finish(),
    }
}
