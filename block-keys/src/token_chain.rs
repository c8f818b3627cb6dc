//! kvroute's own engine-agnostic block key.

use xxhash_rust::xxh3::xxh3_64;

use crate::KeyError;

/// Domain-separation prefix of the root preimage. Changing anything in this definition changes
/// every key: bump the version suffix if it ever has to change.
const ROOT_DOMAIN: &[u8] = b"kvroute/token-chain/v1";

/// kvroute's token-chain key: a 64-bit chained hash of the tokens, independent of the engine's
/// hash algorithm and seed, recomputed from the prompt (router) and from `BlockStored.token_ids`
/// (index).
///
/// **Stable contract** (ext-proc and the index must agree; persisted snapshots depend on it):
///
/// ```text
/// field(None)    = 0x00
/// field(Some(s)) = 0x01 || u32_le(len(utf8(s))) || utf8(s)
/// root           = xxh3_64( "kvroute/token-chain/v1" || field(adapter) || field(cache_salt) )
/// next(p, block) = xxh3_64( u64_le(p) || u32_le(block[0]) || … || u32_le(block[n-1]) )
/// key[0]         = next(root, tokens[0..B]);  key[i] = next(key[i-1], tokens[i*B..(i+1)*B])
/// ```
///
/// `xxh3_64` is XXH3 64-bit with seed 0 and the default secret. Only full blocks get keys. The
/// LoRA adapter name and the cache salt are mixed into the root, so they separate whole chains,
/// like vLLM's extra keys do; an empty cache salt counts as none, as in vLLM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenChain;

impl TokenChain {
    /// The chain root for a namespace (LoRA adapter name, cache salt).
    pub fn root(adapter: Option<&str>, cache_salt: Option<&str>) -> u64 {
        let cache_salt = cache_salt.filter(|s| !s.is_empty());
        let field_len = |f: Option<&str>| f.map_or(1, |s| 5 + s.len());
        let mut preimage =
            Vec::with_capacity(ROOT_DOMAIN.len() + field_len(adapter) + field_len(cache_salt));
        preimage.extend_from_slice(ROOT_DOMAIN);
        for field in [adapter, cache_salt] {
            match field {
                None => preimage.push(0x00),
                Some(s) => {
                    preimage.push(0x01);
                    // A key namespace longer than 4 GiB cannot come from a request body.
                    preimage.extend_from_slice(&(s.len() as u32).to_le_bytes());
                    preimage.extend_from_slice(s.as_bytes());
                }
            }
        }
        xxh3_64(&preimage)
    }

    /// The key of the block `tokens` whose predecessor's key (or the root) is `parent`.
    pub fn next(parent: u64, tokens: &[u32]) -> u64 {
        let mut scratch = Vec::with_capacity(8 + 4 * tokens.len());
        Self::next_with(&mut scratch, parent, tokens)
    }

    fn next_with(scratch: &mut Vec<u8>, parent: u64, tokens: &[u32]) -> u64 {
        scratch.clear();
        scratch.extend_from_slice(&parent.to_le_bytes());
        for &t in tokens {
            scratch.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64(scratch)
    }

    /// The keys of all full blocks of a prompt in the namespace (adapter, cache salt).
    pub fn keys(
        tokens: &[u32],
        block_size: usize,
        adapter: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Result<Vec<u64>, KeyError> {
        let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
        Self::keys_from_into(
            Self::root(adapter, cache_salt),
            tokens,
            block_size,
            &mut out,
        )?;
        Ok(out)
    }

    /// Appends the keys of the full blocks of `tokens`, chaining from `parent` (a root, or the key
    /// of the block just before `tokens`, e.g. an event's parent block).
    pub fn keys_from_into(
        parent: u64,
        tokens: &[u32],
        block_size: usize,
        out: &mut Vec<u64>,
    ) -> Result<(), KeyError> {
        if block_size == 0 {
            return Err(KeyError::ZeroBlockSize);
        }
        let mut scratch = Vec::with_capacity(8 + 4 * block_size);
        let mut parent = parent;
        out.reserve(tokens.len() / block_size);
        for block in tokens.chunks_exact(block_size) {
            parent = Self::next_with(&mut scratch, parent, block);
            out.push(parent);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pins the contract: these values must never change.
    #[test]
    fn definition_is_stable() {
        let mut root_preimage = b"kvroute/token-chain/v1".to_vec();
        root_preimage.extend_from_slice(&[0x01, 5, 0, 0, 0]);
        root_preimage.extend_from_slice(b"Alice");
        root_preimage.push(0x00);
        let root = TokenChain::root(Some("Alice"), Some(""));
        assert_eq!(root, xxh3_64(&root_preimage));

        let mut block_preimage = root.to_le_bytes().to_vec();
        block_preimage.extend_from_slice(&[1, 0, 0, 0, 0x5c, 0x50, 0x02, 0]);
        assert_eq!(
            TokenChain::next(root, &[1, 151_644]),
            xxh3_64(&block_preimage)
        );

        // Literal pins, so an accidental change to the definition fails here.
        assert_eq!(TokenChain::root(None, None), 4_601_078_582_230_837_824);
        let tokens: Vec<u32> = (1..=32).collect();
        assert_eq!(
            TokenChain::keys(&tokens, 16, Some("Alice"), Some("tenant-a")).unwrap(),
            [18_393_252_177_869_614_323, 2_311_843_143_747_523_733]
        );
    }

    #[test]
    fn keys_chain_full_blocks_only() {
        let tokens: Vec<u32> = (0..10).collect();
        let root = TokenChain::root(None, None);
        let keys = TokenChain::keys(&tokens, 4, None, None).unwrap();
        let k0 = TokenChain::next(root, &tokens[0..4]);
        assert_eq!(keys, vec![k0, TokenChain::next(k0, &tokens[4..8])]);
        assert_eq!(
            TokenChain::keys(&tokens, 0, None, None),
            Err(KeyError::ZeroBlockSize)
        );
    }
}
