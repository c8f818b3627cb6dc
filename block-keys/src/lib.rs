//! Block keys: how a prompt's token ids become the chained per-block keys the index stores.
//!
//! A prompt is cut into full blocks of the pool's block size; each block gets a key that depends
//! on every token before it, so "the replica holds key *k*" means "it holds the whole prefix up to
//! that block". Three key schemes exist ([`KeyScheme`]):
//!
//! - **vLLM-exact** ([`VllmHasher`]): vLLM's own prefix-cache hash, byte for byte, for every
//!   `--prefix-caching-hash-algo` ([`HashAlgo`]) and the pool's `PYTHONHASHSEED`. Its published
//!   u64 ([`published_u64`]) equals what the engine sends in KV events, so events apply directly.
//!   LoRA adapters and `cache_salt` enter as vLLM's extra keys ([`ExtraKeysEra`]).
//! - **SGLang-exact** ([`SglangHasher`]): SGLang's page hash (a SHA-256 chain over the tokens'
//!   little-endian bytes, published as the first 8 digest bytes), salted chains and the 0.5.22+
//!   kv-events `format: dynamo` namespace included. LoRA requests are not reproduced.
//! - **token-chain** ([`TokenChain`]): kvroute's own XXH3 chain over the token ids, independent of
//!   engine settings; the index recomputes it from each event's `token_ids`.
//!
//! [`PoolKeySettings`] is a pool's `block_size` and `key_scheme` as every kvroute config writes
//! them (one schema, one set of defaults: vLLM 0.32's).
//!
//! Everything here is pure and allocation-light: hashing a block serializes into one reused
//! buffer. The hashing contract is pinned by vLLM's golden vectors and real engine captures in
//! this crate's tests.
//!
//! ```
//! use kvroute_block_keys::{ExtraKeysEra, HashAlgo, KeyScheme, VllmHasher};
//!
//! let hasher = VllmHasher::new(HashAlgo::Sha256Cbor, Some("42"))?;
//! let scheme = KeyScheme::VllmExact { hasher, era: ExtraKeysEra::From0_31 };
//! let tokens: Vec<u32> = (1..=48).collect();
//! let keys = scheme.prompt_keys(&tokens, 16, None, None)?;
//! // The u64s vLLM publishes for this prompt (golden vector).
//! assert_eq!(keys, [16300212363532267629, 8671309795006503672, 3527878332947511115]);
//! # Ok::<(), kvroute_block_keys::KeyError>(())
//! ```
#![deny(missing_docs)]

mod algo;
mod digest;
mod error;
mod extra_keys;
mod key_hash;
mod preimage;
mod schema;
mod scheme;
mod sglang;
#[cfg(feature = "test-util")]
pub mod testing;
mod token_chain;
mod vllm;

pub use algo::HashAlgo;
pub use digest::{Digest, published_u64};
pub use error::KeyError;
pub use extra_keys::{ExtraKeys, ExtraKeysEra, LoraRef, MultiModalItem};
pub use key_hash::{KeyHasher, KeyHasherBuilder};
pub use schema::{
    DEFAULT_BLOCK_SIZE, DEFAULT_HASH_ALGO, DEFAULT_KEY_SCHEME_KIND, DEFAULT_VLLM_VERSION,
    MAX_BLOCK_SIZE, PoolKeySettings, RawKeyScheme, SchemeConfigError,
};
pub use scheme::{ChainPoint, KeyScheme};
pub use sglang::SglangHasher;
pub use token_chain::TokenChain;
pub use vllm::{DEFAULT_NONE_HASH_SEED, VllmHasher};

/// A Python value as vLLM feeds it into its block hash (`extra_keys` items and the hashed tuple).
///
/// vLLM hashes Python objects (`(parent, tuple(tokens), extra_keys)`) after serializing them with
/// canonical CBOR or pickle protocol 5; this is the subset of Python values that ever occur there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HashValue {
    /// Python `None`.
    None,
    /// Python `int` (LoRA ids, multimodal offsets; may be negative).
    Int(i64),
    /// Python `str` (LoRA names, cache salts, multimodal identifiers).
    Str(String),
    /// Python `bytes` (prompt-embeds digests).
    Bytes(Vec<u8>),
    /// Python `tuple` (and `list`, which serializes the same in CBOR).
    Tuple(Vec<HashValue>),
}
