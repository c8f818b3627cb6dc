//! vLLM's chained block hash, byte for byte (`hash_block_tokens` / `get_request_block_hasher`).

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use crate::preimage::{BlockTuple, Parent, cbor, pickle};
use crate::{Digest, HashAlgo, HashValue, KeyError};

/// The root seed vLLM 0.29+ uses for `sha256`/`sha256_cbor` when `PYTHONHASHSEED` is unset.
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// Preimage bytes per token, rounded up (pickle `BININT` is 5 bytes), for buffer sizing.
const MAX_BYTES_PER_TOKEN: usize = 5;
/// Parent, tuple headers, frame header and a typical extra key.
const PREIMAGE_OVERHEAD: usize = 96;

/// Computes vLLM's prefix-cache block digests for one algorithm and seed.
///
/// Block `i` of a prompt hashes the Python tuple `(parent, tuple(tokens[i*B:(i+1)*B]), extra)`,
/// where `parent` is the previous block's full digest, or `NONE_HASH = hash(seed)` for block 0,
/// and `extra` is that block's extra keys (`None` for plain text). Only full blocks are hashed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VllmHasher {
    algo: HashAlgo,
    seed: String,
    none_hash: Digest,
}

impl VllmHasher {
    /// `seed` is the pool's `PYTHONHASHSEED` string, used as text (`"42"` hashes the string `"42"`).
    ///
    /// `None` means unset: `sha256`/`sha256_cbor` then use vLLM 0.29+'s fixed seed
    /// [`DEFAULT_NONE_HASH_SEED`] (vLLM 0.10.2-0.28 used a random root instead: those pools must
    /// set PYTHONHASHSEED); every other algorithm draws a random root, so this is an error.
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> Result<Self, KeyError> {
        let seed = match seed {
            Some(seed) => seed,
            None if algo.has_fixed_default_seed() => DEFAULT_NONE_HASH_SEED,
            None => return Err(KeyError::SeedRequired { algo }),
        };
        let mut preimage = Vec::with_capacity(seed.len() + 16);
        write_seed_preimage(algo, seed, &mut preimage);
        Ok(Self {
            algo,
            seed: seed.to_owned(),
            none_hash: digest_of(algo, &preimage),
        })
    }

    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    /// The seed string in effect (after the unset-seed fallback).
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// `NONE_HASH`: the digest of the seed string, the parent of block 0.
    pub fn none_hash(&self) -> &Digest {
        &self.none_hash
    }

    /// Appends the serialized seed that `NONE_HASH` is the digest of.
    pub fn write_none_hash_preimage(&self, out: &mut Vec<u8>) {
        write_seed_preimage(self.algo, &self.seed, out);
    }

    /// Appends the serialized tuple `(parent or NONE_HASH, tuple(tokens), extra)` that the block
    /// digest is computed over. A falsy parent (a legacy int digest of 0) counts as none, as in
    /// vLLM's `if not parent_block_hash`.
    pub fn write_block_preimage(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extra: Option<&HashValue>,
        out: &mut Vec<u8>,
    ) {
        let parent = parent
            .map(|d| self.as_parent(d))
            .filter(Parent::is_truthy)
            .unwrap_or_else(|| self.as_parent(&self.none_hash));
        let block = BlockTuple {
            parent,
            tokens,
            extra,
        };
        if self.algo.uses_cbor() {
            cbor::block(out, &block);
        } else {
            pickle::block(out, &block);
        }
    }

    /// The digest of one block. `parent = None` means block 0 of a prompt.
    ///
    /// Allocates a scratch buffer; use [`hash_block_with`](Self::hash_block_with) in loops.
    pub fn hash_block(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        extra: Option<&HashValue>,
    ) -> Digest {
        let mut scratch = Vec::with_capacity(preimage_capacity(tokens.len()));
        self.hash_block_with(&mut scratch, parent, tokens, extra)
    }

    /// [`hash_block`](Self::hash_block) serializing into `scratch` (cleared first).
    pub fn hash_block_with(
        &self,
        scratch: &mut Vec<u8>,
        parent: Option<&Digest>,
        tokens: &[u32],
        extra: Option<&HashValue>,
    ) -> Digest {
        scratch.clear();
        self.write_block_preimage(parent, tokens, extra, scratch);
        digest_of(self.algo, scratch)
    }

    /// Calls `sink` with the digest of every full block of `tokens`, chaining from `parent`
    /// (`None` when `tokens` starts at the beginning of the prompt). `extra(i)` gives the extra
    /// keys of the `i`-th block of `tokens` (0-based within this slice). A trailing partial block
    /// is ignored, as in vLLM.
    pub fn for_each_block<'e>(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        block_size: usize,
        mut extra: impl FnMut(usize) -> Option<&'e HashValue>,
        mut sink: impl FnMut(&Digest),
    ) -> Result<(), KeyError> {
        if block_size == 0 {
            return Err(KeyError::ZeroBlockSize);
        }
        let mut scratch = Vec::with_capacity(preimage_capacity(block_size));
        let mut parent = parent.copied();
        for (i, block) in tokens.chunks_exact(block_size).enumerate() {
            let digest = self.hash_block_with(&mut scratch, parent.as_ref(), block, extra(i));
            sink(&digest);
            parent = Some(digest);
        }
        Ok(())
    }

    /// Appends the digest of every full block of `tokens` to `out`; see
    /// [`for_each_block`](Self::for_each_block).
    pub fn chain_into<'e>(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        block_size: usize,
        extra: impl FnMut(usize) -> Option<&'e HashValue>,
        out: &mut Vec<Digest>,
    ) -> Result<(), KeyError> {
        out.reserve(tokens.len() / block_size.max(1));
        self.for_each_block(parent, tokens, block_size, extra, |d| out.push(*d))
    }

    /// The digests of every full block of `tokens`; see [`for_each_block`](Self::for_each_block).
    pub fn chain<'e>(
        &self,
        parent: Option<&Digest>,
        tokens: &[u32],
        block_size: usize,
        extra: impl FnMut(usize) -> Option<&'e HashValue>,
    ) -> Result<Vec<Digest>, KeyError> {
        let mut out = Vec::new();
        self.chain_into(parent, tokens, block_size, extra, &mut out)?;
        Ok(out)
    }

    /// How this algorithm chains a digest: `bytes`, or a Python int for the legacy algorithms.
    fn as_parent<'d>(&self, digest: &'d Digest) -> Parent<'d> {
        if self.algo.chains_int() {
            Parent::Int(digest.as_bytes())
        } else {
            Parent::Bytes(digest.as_bytes())
        }
    }
}

fn preimage_capacity(tokens: usize) -> usize {
    tokens * MAX_BYTES_PER_TOKEN + PREIMAGE_OVERHEAD
}

fn write_seed_preimage(algo: HashAlgo, seed: &str, out: &mut Vec<u8>) {
    if algo.uses_cbor() {
        cbor::text(out, seed);
    } else {
        pickle::str_object(out, seed);
    }
}

fn digest_of(algo: HashAlgo, preimage: &[u8]) -> Digest {
    match algo {
        HashAlgo::Sha256 | HashAlgo::Sha256Cbor | HashAlgo::Sha256LegacyInt => {
            Digest::from_array(Sha256::digest(preimage).into())
        }
        // xxhash's `xxh3_128_digest` is the canonical (big-endian) form of the 128-bit value.
        HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
            Digest::from_array(xxh3_128(preimage).to_be_bytes())
        }
        HashAlgo::Sha256Cbor64Bit => {
            let full: [u8; 32] = Sha256::digest(preimage).into();
            Digest::from_u64(crate::published_u64(&full))
        }
    }
}
