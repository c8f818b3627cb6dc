//! Hashing block keys into hash maps.

use std::hash::{BuildHasher, Hasher};

/// Hashes block keys for hash maps (the index's shards, ext-proc's routed-prefix memory).
///
/// Block keys are already outputs of a cryptographic or xxh3 hash, so a keyed multiply-fold
/// mix is enough: it spreads engine-chosen values over buckets and shards and costs a few
/// cycles instead of SipHash's dozens. The per-map seed keeps bucket placement unpredictable.
#[derive(Debug, Clone, Copy)]
pub struct KeyHasherBuilder {
    seed: u64,
}

impl KeyHasherBuilder {
    /// A builder with a random seed.
    pub fn random() -> Self {
        KeyHasherBuilder {
            seed: std::collections::hash_map::RandomState::new().hash_one(0u64),
        }
    }

    /// The well-mixed 64-bit hash of `key` (shard choice uses its high bits, maps the low).
    pub fn mix(&self, key: u64) -> u64 {
        // 64×64→128-bit multiply, folded: every output bit depends on every input bit.
        let product = u128::from(key ^ self.seed) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
        (product as u64) ^ ((product >> 64) as u64)
    }
}

impl Default for KeyHasherBuilder {
    fn default() -> Self {
        Self::random()
    }
}

impl BuildHasher for KeyHasherBuilder {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            builder: *self,
            state: 0,
        }
    }
}

/// The [`Hasher`] of [`KeyHasherBuilder`], made for `u64` keys.
#[derive(Debug, Clone, Copy)]
pub struct KeyHasher {
    builder: KeyHasherBuilder,
    state: u64,
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used for u64 keys; fold bytes in so the hasher stays correct for any key type.
        for &byte in bytes {
            self.state = self.builder.mix(self.state ^ u64::from(byte));
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.state = self.builder.mix(self.state ^ key);
    }
}
