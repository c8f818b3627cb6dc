//! Which keys a router and index use for a pool: vLLM's published hashes or token-chain keys.

use crate::{ExtraKeys, ExtraKeysEra, KeyError, LoraRef, TokenChain, VllmHasher};

/// How a pool's prompts become the u64 block keys stored in and queried from the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyScheme {
    /// vLLM's own hash, published form (last 8 digest bytes). Matches the engine's events
    /// directly, but needs the pool's algorithm, seed and vLLM era.
    VllmExact {
        /// The pool's algorithm and PYTHONHASHSEED.
        hasher: VllmHasher,
        /// The pool's vLLM release, for the extra-key shapes.
        era: ExtraKeysEra,
    },
    /// kvroute's engine-agnostic [`TokenChain`] keys.
    TokenChain,
}

impl KeyScheme {
    /// The key of every full block of a prompt.
    pub fn prompt_keys(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, KeyError> {
        let mut out = Vec::new();
        self.prompt_keys_into(tokens, block_size, lora, cache_salt, &mut out)?;
        Ok(out)
    }

    /// [`prompt_keys`](Self::prompt_keys) appending to `out`. On error `out` is left unchanged.
    pub fn prompt_keys_into(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
        out: &mut Vec<u64>,
    ) -> Result<(), KeyError> {
        match self {
            Self::VllmExact { hasher, era } => {
                let extra = ExtraKeys::new(*era, lora, cache_salt)?;
                out.reserve(tokens.len() / block_size.max(1));
                hasher.for_each_block(
                    None,
                    tokens,
                    block_size,
                    |i| extra.for_block(i),
                    |d| out.push(d.published_u64()),
                )
            }
            Self::TokenChain => {
                let root = TokenChain::root(lora.map(|l| l.name), cache_salt);
                TokenChain::keys_from_into(root, tokens, block_size, out)
            }
        }
    }
}
