//! Block keys cached with the tokens they are the keys of, so that a conversation's next turn,
//! routed on those tokens, hashes only the blocks it added.

use std::fmt;
use std::sync::Arc;

use kvroute_block_keys::{ChainPoint, KeyError};
use kvroute_tokenize::ResumePoint;

/// Block keys cached with the tokens they are the keys of.
#[derive(Debug, Clone)]
pub struct CachedKeys {
    /// What the keys depend on besides the tokens ([`KeysJob::fingerprint`]).
    pub fingerprint: u64,
    /// The key of every full block.
    pub keys: Arc<[u64]>,
    /// The key chain at the last full block before the tokens' resume point: the conversation's
    /// next turn, which keeps those tokens, hashes only the blocks after it.
    pub point: Option<ChainPoint>,
}

/// How a decision computes a prompt's block keys: handed to a background whole tokenization so
/// that it caches the keys with the tokens, and the next turn, routed on them, hashes nothing.
#[derive(Clone)]
pub struct KeysJob {
    /// Everything the keys depend on besides the tokens (key scheme, block size, adapter, salt).
    pub fingerprint: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// The pool's [`KeyScheme::extend_prompt_keys`](kvroute_block_keys::KeyScheme::extend_prompt_keys)
    /// with its block size, adapter and salt.
    pub compute: Arc<ComputeKeys>,
}

/// [`KeysJob::compute`]'s function: `(from, tokens, mark, out)`, as
/// [`KeyScheme::extend_prompt_keys`](kvroute_block_keys::KeyScheme::extend_prompt_keys) takes them.
pub type ComputeKeys = dyn Fn(Option<&ChainPoint>, &[u32], usize, &mut Vec<u64>) -> Result<Option<ChainPoint>, KeyError>
    + Send
    + Sync;

impl KeysJob {
    /// The keys of every full block of `tokens` (`None`: they cannot be computed), with the
    /// chain's point at the last full block of the first `resume_tokens` kept for the next turn.
    /// With `prior` (a cached turn and its keys) whose tokens up to its chain point are also
    /// `tokens`' (checked), only the blocks after that point are hashed.
    pub(super) fn keys_for(
        &self,
        tokens: &[u32],
        prior: Option<(&[u32], &CachedKeys)>,
        resume_tokens: usize,
    ) -> Option<CachedKeys> {
        let block_size = self.block_size.max(1);
        let mut keys = Vec::with_capacity(tokens.len() / block_size);
        let from = prior.and_then(|(prior_tokens, cached)| {
            let point = cached.point?;
            let shared = point.blocks() * block_size;
            let usable = cached.fingerprint == self.fingerprint
                && point.blocks() <= cached.keys.len()
                && tokens.get(..shared)? == prior_tokens.get(..shared)?;
            usable.then(|| {
                keys.extend_from_slice(&cached.keys[..point.blocks()]);
                point
            })
        });
        let point = (self.compute)(from.as_ref(), tokens, resume_tokens / block_size, &mut keys)
            .ok()?
            .or(from.filter(|point| point.blocks() == resume_tokens / block_size));
        Some(CachedKeys {
            fingerprint: self.fingerprint,
            keys: keys.into(),
            point,
        })
    }
}

impl fmt::Debug for KeysJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeysJob")
            .field("fingerprint", &self.fingerprint)
            .finish_non_exhaustive()
    }
}

/// Where cached keys keep their chain point: at the resume point (what the next turn keeps of
/// these tokens), or at the end without one.
pub(super) fn mark_at(tokens: &[u32], resume: Option<ResumePoint>) -> usize {
    resume.map_or(tokens.len(), |point| point.tokens)
}
