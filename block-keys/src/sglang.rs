//! SGLang's published page hash, byte for byte (its radix cache's C++ page hash and the event
//! recorder's namespaces, 0.5.19–0.5.23).
//!
//! ```text
//! d_0          = seed: none, or SHA-256("sglang-cache-salt-v1\0" ‖ utf8(salt)) for a salted request
//! d_i          = SHA-256(d_{i-1} ‖ words(page_i))        (no prior bytes when d_{i-1} is none)
//! words(page)  = each token as u32 little-endian, or, when any token of the page exceeds u32
//!                (0.5.23 multimodal pads), the byte 0xff followed by each token as u64 little-endian
//! published    = first 8 bytes of d_i, big-endian (SGLang sends them as a signed i64; kvroute
//!                keeps the same 64 bits as a u64)
//! ```
//!
//! With EAGLE-family speculative decoding SGLang keys each position by the pair (token, next
//! token): a page of `P` positions is the `2P` words `t0 t1 t1 t2 … t(P-1) tP`, so it needs the
//! token after it. Its events publish those pairs, which flatten to the same words.
//!
//! Since 0.5.22 an event hash may also be namespaced ([`SglangHasher::namespaced`]): the first 8
//! bytes of `SHA-256(seed ‖ h as i64 big-endian)`, `seed = SHA-256("sglang-kv-event-namespace-v1"
//! ‖ part(extra_key) ‖ part(cache_salt))`, `part(None) = 0x00`, `part(s) = 0x01 ‖ u64_le(len) ‖
//! utf8(s)`. Kv-events `format: dynamo` namespaces by the request's `extra_key` and salt;
//! 0.5.23's default format by a LoRA adapter's `extra_key` only. The `extra_key` of a LoRA
//! request ends in SGLang's internal adapter id, so only salts are reproduced here.

use sha2::{Digest as _, Sha256};

use crate::Digest;

/// Prefix of a salted request's chain seed.
const SALT_SEED_TAG: &[u8] = b"sglang-cache-salt-v1\0";
/// Prefix of the event namespace seed (0.5.22+).
const NAMESPACE_SEED_TAG: &[u8] = b"sglang-kv-event-namespace-v1";
/// Separates a page of u64 words from a page of u32 words (an odd byte count).
const WIDE_PAGE_TAG: u8 = 0xff;

/// How an SGLang pool's engines hash pages: what a router needs to reproduce their events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SglangHasher {
    /// The engines run EAGLE-family speculative decoding, so their cache keys positions by token
    /// pairs.
    pub bigram: bool,
    /// The engines' `--kv-events-config` says `"format": "dynamo"` (0.5.22+): a salted
    /// request's hashes are also namespaced by its salt.
    pub dynamo_format: bool,
}

impl SglangHasher {
    /// The digest a salted request's chain starts from; `None` for no salt (an empty salt is
    /// none, as in SGLang).
    pub fn chain_seed(cache_salt: Option<&str>) -> Option<Digest> {
        let salt = cache_salt.filter(|s| !s.is_empty())?;
        let mut sha = Sha256::new();
        sha.update(SALT_SEED_TAG);
        sha.update(salt.as_bytes());
        Some(Digest::from_array(sha.finalize().into()))
    }

    /// The 0.5.22+ event namespace seed of a request's `extra_key` and salt; `None` when both
    /// are absent (hashes are then published as chained).
    pub fn namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> Option<[u8; 32]> {
        if extra_key.is_none() && cache_salt.is_none() {
            return None;
        }
        let mut sha = Sha256::new();
        sha.update(NAMESPACE_SEED_TAG);
        for part in [extra_key, cache_salt] {
            match part {
                None => sha.update([0x00]),
                Some(s) => {
                    sha.update([0x01]);
                    sha.update((s.len() as u64).to_le_bytes());
                    sha.update(s.as_bytes());
                }
            }
        }
        Some(sha.finalize().into())
    }

    /// A published hash in a namespace: the first 8 bytes of `SHA-256(seed ‖ hash big-endian)`.
    pub fn namespaced(hash: u64, seed: &[u8; 32]) -> u64 {
        let mut sha = Sha256::new();
        sha.update(seed);
        sha.update(hash.to_be_bytes());
        first_u64(&sha.finalize())
    }

    /// The published form of a page digest: its first 8 bytes, big-endian.
    pub fn published_u64(digest: &Digest) -> u64 {
        first_u64(digest.as_bytes())
    }

    /// The namespace seed this pool's engines apply to a request's published hashes (kv-events
    /// `format: dynamo` and a salt); `None` when they publish the chain as is.
    pub fn publish_seed(&self, cache_salt: Option<&str>) -> Option<[u8; 32]> {
        let salt = cache_salt.filter(|s| !s.is_empty())?;
        self.dynamo_format
            .then(|| Self::namespace_seed(None, Some(salt)))
            .flatten()
    }

    /// The digest of one page of u32 words (a plain page's tokens, or a bigram page's flattened
    /// pairs) chained after `prior` (`None` at a chain's start without a salt).
    pub fn page_digest(prior: Option<&Digest>, words: &[u32]) -> Digest {
        let mut sha = Sha256::new();
        if let Some(prior) = prior {
            sha.update(prior.as_bytes());
        }
        for word in words {
            sha.update(word.to_le_bytes());
        }
        Digest::from_array(sha.finalize().into())
    }

    /// The digest of one page of words of any width: hashed as u32 words when all fit, else
    /// as SGLang 0.5.23's wide page (0xff, then u64 words).
    pub fn wide_page_digest(prior: Option<&Digest>, words: &[u64]) -> Digest {
        let mut sha = Sha256::new();
        if let Some(prior) = prior {
            sha.update(prior.as_bytes());
        }
        if words.iter().all(|&w| u32::try_from(w).is_ok()) {
            for &word in words {
                sha.update((word as u32).to_le_bytes());
            }
        } else {
            sha.update([WIDE_PAGE_TAG]);
            for word in words {
                sha.update(word.to_le_bytes());
            }
        }
        Digest::from_array(sha.finalize().into())
    }

    /// Full pages of a prompt's `tokens` from the chain's start: `P` tokens each, or with
    /// [`bigram`](Self::bigram) `P` pairs each (which needs the token after the page).
    pub fn full_pages(&self, tokens: usize, page_size: usize) -> usize {
        let positions = if self.bigram {
            tokens.saturating_sub(1)
        } else {
            tokens
        };
        positions.checked_div(page_size).unwrap_or(0)
    }

    /// Calls `sink` with the digest of every full page of `tokens` from page `start` on,
    /// chaining from `prior` (the digest of page `start - 1`, or the chain seed).
    pub(crate) fn for_each_page(
        &self,
        prior: Option<&Digest>,
        tokens: &[u32],
        page_size: usize,
        start: usize,
        mut sink: impl FnMut(&Digest),
    ) {
        let mut prior = prior.copied();
        let mut words = Vec::with_capacity(2 * page_size);
        for page in start..self.full_pages(tokens.len(), page_size) {
            let from = page * page_size;
            let digest = if self.bigram {
                words.clear();
                for pair in tokens[from..=from + page_size].windows(2) {
                    words.extend_from_slice(pair);
                }
                Self::page_digest(prior.as_ref(), &words)
            } else {
                Self::page_digest(prior.as_ref(), &tokens[from..from + page_size])
            };
            sink(&digest);
            prior = Some(digest);
        }
    }
}

fn first_u64(bytes: &[u8]) -> u64 {
    let mut be = [0u8; 8];
    let n = bytes.len().min(8);
    be[..n].copy_from_slice(&bytes[..n]);
    u64::from_be_bytes(be)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(parts: &[&[u8]]) -> [u8; 32] {
        let mut sha = Sha256::new();
        for part in parts {
            sha.update(part);
        }
        sha.finalize().into()
    }

    fn le(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Literal vectors from Python's hashlib over the bytes SGLang's page hash feeds SHA-256:
    /// `hashlib.sha256(struct.pack("<4I", 1, 2, 3, 4)).hexdigest()` and so on.
    #[test]
    fn pages_hash_as_sglang_publishes_them() {
        let root = SglangHasher::page_digest(None, &[1, 2, 3, 4]);
        assert_eq!(
            root.to_string(),
            "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
        );
        // SGLang publishes -3488128144981237669: the same 64 bits.
        assert_eq!(
            SglangHasher::published_u64(&root),
            -3_488_128_144_981_237_669_i64 as u64
        );
        assert_eq!(root.as_bytes(), sha(&[&le(&[1, 2, 3, 4])]));
        let next = SglangHasher::page_digest(Some(&root), &[5, 6, 7, 8]);
        assert_eq!(next.as_bytes(), sha(&[root.as_bytes(), &le(&[5, 6, 7, 8])]));
        assert_eq!(
            SglangHasher::published_u64(&next),
            5_674_439_469_042_975_057
        );
        // First 8 bytes, big-endian.
        let first: [u8; 8] = root.as_bytes()[..8].try_into().unwrap();
        assert_eq!(
            SglangHasher::published_u64(&root),
            u64::from_be_bytes(first)
        );
    }

    #[test]
    fn a_page_with_a_token_past_u32_is_hashed_wide_and_others_are_not() {
        let narrow = SglangHasher::wide_page_digest(None, &[1, 2, 3]);
        assert_eq!(narrow, SglangHasher::page_digest(None, &[1, 2, 3]));
        let big = 1u64 << 40;
        let wide = SglangHasher::wide_page_digest(Some(&narrow), &[1, big]);
        let mut bytes = vec![0xff];
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&big.to_le_bytes());
        assert_eq!(wide.as_bytes(), sha(&[narrow.as_bytes(), &bytes]));
    }

    #[test]
    fn seeds_and_namespaces_follow_their_byte_layouts() {
        assert_eq!(SglangHasher::chain_seed(None), None);
        assert_eq!(SglangHasher::chain_seed(Some("")), None);
        let seed = SglangHasher::chain_seed(Some("tenant-a")).unwrap();
        assert_eq!(seed.as_bytes(), sha(&[b"sglang-cache-salt-v1\0tenant-a"]));

        assert_eq!(SglangHasher::namespace_seed(None, None), None);
        let ns = SglangHasher::namespace_seed(None, Some("ab")).unwrap();
        assert_eq!(
            ns,
            sha(&[
                b"sglang-kv-event-namespace-v1",
                &[0x00, 0x01],
                &2u64.to_le_bytes(),
                b"ab"
            ])
        );
        let h: u64 = (-5i64) as u64;
        let namespaced = SglangHasher::namespaced(h, &ns);
        let digest = sha(&[&ns, &(-5i64).to_be_bytes()]);
        assert_eq!(
            namespaced,
            u64::from_be_bytes(digest[..8].try_into().unwrap())
        );
        // The default format publishes salted chains as they are; dynamo's namespaces them.
        let default = SglangHasher::default();
        let dynamo = SglangHasher {
            dynamo_format: true,
            ..default
        };
        assert_eq!(default.publish_seed(Some("ab")), None);
        assert_eq!(dynamo.publish_seed(Some("ab")), Some(ns));
        assert_eq!(dynamo.publish_seed(None), None);
    }

    #[test]
    fn bigram_pages_are_flattened_pairs_and_need_the_next_token() {
        let hasher = SglangHasher {
            bigram: true,
            ..SglangHasher::default()
        };
        let tokens = [10, 11, 12, 13, 14];
        assert_eq!(hasher.full_pages(tokens.len(), 2), 2);
        assert_eq!(hasher.full_pages(4, 2), 1);
        let mut digests = Vec::new();
        hasher.for_each_page(None, &tokens, 2, 0, |d| digests.push(*d));
        let first = SglangHasher::page_digest(None, &[10, 11, 11, 12]);
        let second = SglangHasher::page_digest(Some(&first), &[12, 13, 13, 14]);
        assert_eq!(digests, [first, second]);
    }
}
