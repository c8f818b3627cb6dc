//! Which keys a router and index use for a pool: vLLM's published hashes or token-chain keys.

use crate::{
    Digest, ExtraKeys, ExtraKeysEra, KeyError, LoraRef, MultiModalItem, SglangHasher, TokenChain,
    VllmHasher,
};

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
    /// SGLang's own page hash, published form (first 8 digest bytes). Matches the engine's
    /// events directly for text prompts, salted or not; LoRA requests are not reproduced.
    SglangExact(SglangHasher),
    /// kvroute's engine-agnostic [`TokenChain`] keys.
    TokenChain,
}

impl KeyScheme {
    /// The engine family whose own published block hashes these keys are (its replicas' events
    /// apply by hash); `None` for `token-chain`, recomputed from any engine's tokens.
    pub fn engine(&self) -> Option<kvroute_config::Engine> {
        match self {
            KeyScheme::VllmExact { .. } => Some(kvroute_config::Engine::Vllm),
            KeyScheme::SglangExact(_) => Some(kvroute_config::Engine::Sglang),
            KeyScheme::TokenChain => None,
        }
    }

    /// Whether a replica of `engine` can serve a pool keyed by this scheme.
    pub fn serves(&self, engine: kvroute_config::Engine) -> bool {
        self.engine().is_none_or(|own| own == engine)
    }

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

    /// The key of every full block of a prompt with media items (`items`, in vLLM's order: by
    /// placeholder offset). vLLM's scheme hashes each item into the blocks it overlaps
    /// ([`ExtraKeys::with_multimodal`]); a token chain cannot tell two images with the same
    /// placeholder tokens apart, so its keys stop before the first item's first block (the
    /// index's token-chain keys stop there too). SGLang's scheme stops there as well: SGLang
    /// hashes an image's pad values, which only the engine knows.
    pub fn media_prompt_keys(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
        items: &[MultiModalItem<'_>],
    ) -> Result<Vec<u64>, KeyError> {
        if block_size == 0 {
            return Err(KeyError::ZeroBlockSize);
        }
        let mut out = Vec::new();
        match self {
            Self::VllmExact { hasher, era } => {
                let extra = ExtraKeys::with_multimodal(*era, lora, cache_salt, items, block_size)?;
                out.reserve(tokens.len() / block_size);
                hasher.for_each_block(
                    None,
                    tokens,
                    block_size,
                    |i| extra.for_block(i),
                    |digest| out.push(digest.published_u64()),
                )?;
            }
            Self::SglangExact(_) | Self::TokenChain => {
                let first_media_block = items
                    .iter()
                    .map(|item| item.offset / block_size)
                    .min()
                    .unwrap_or(usize::MAX);
                let text = first_media_block
                    .saturating_mul(block_size)
                    .min(tokens.len());
                self.prompt_keys_into(&tokens[..text], block_size, lora, cache_salt, &mut out)?;
            }
        }
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
        self.extend_prompt_keys(None, tokens, block_size, lora, cache_salt, 0, out)
            .map(drop)
    }

    /// The keys of the full blocks of `tokens` from `from`'s block on, appended to `out`: a
    /// prompt whose first `from.blocks()` blocks are those of an earlier prompt (same tokens,
    /// same scheme, adapter and salt — the caller's to check) whose keys are known hashes only
    /// what follows. Returns the chain's point after `mark` blocks (for a later prompt to extend
    /// from), when `mark` lies past `from` and within `tokens`' full blocks. On error `out` is
    /// left unchanged.
    #[expect(
        clippy::too_many_arguments,
        reason = "prompt_keys_into's arguments plus where to start and where to mark"
    )]
    pub fn extend_prompt_keys(
        &self,
        from: Option<&ChainPoint>,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
        mark: usize,
        out: &mut Vec<u64>,
    ) -> Result<Option<ChainPoint>, KeyError> {
        if block_size == 0 {
            return Err(KeyError::ZeroBlockSize);
        }
        let start = from.map_or(0, |point| point.blocks);
        let rest = tokens
            .get(start * block_size..)
            .ok_or(KeyError::ForeignChainPoint)?;
        let marked = |blocks: usize| (blocks == mark && mark > start).then_some(blocks);
        let mut point = None;
        match self {
            Self::VllmExact { hasher, era } => {
                let parent = match from.map(|point| point.link) {
                    None => None,
                    Some(ChainLink::Vllm(digest)) => Some(digest),
                    Some(_) => return Err(KeyError::ForeignChainPoint),
                };
                let extra = ExtraKeys::new(*era, lora, cache_salt)?;
                out.reserve(rest.len() / block_size);
                let mut blocks = start;
                hasher.for_each_block(
                    parent.as_ref(),
                    rest,
                    block_size,
                    |i| extra.for_block(start + i),
                    |digest| {
                        out.push(digest.published_u64());
                        blocks += 1;
                        if let Some(blocks) = marked(blocks) {
                            point = Some(ChainPoint {
                                blocks,
                                link: ChainLink::Vllm(*digest),
                            });
                        }
                    },
                )?;
            }
            Self::SglangExact(hasher) => {
                if lora.is_some() {
                    return Err(KeyError::SglangLora);
                }
                let prior = match from.map(|point| point.link) {
                    None => SglangHasher::chain_seed(cache_salt),
                    Some(ChainLink::Sglang(digest)) => Some(digest),
                    Some(_) => return Err(KeyError::ForeignChainPoint),
                };
                let namespace = hasher.publish_seed(cache_salt);
                out.reserve(
                    hasher
                        .full_pages(tokens.len(), block_size)
                        .saturating_sub(start),
                );
                let mut blocks = start;
                hasher.for_each_page(prior.as_ref(), tokens, block_size, start, |digest| {
                    let published = SglangHasher::published_u64(digest);
                    out.push(match &namespace {
                        Some(seed) => SglangHasher::namespaced(published, seed),
                        None => published,
                    });
                    blocks += 1;
                    // A bigram page also hashes the token after it, which a later prompt
                    // sharing this page's tokens need not share: no point to resume from.
                    if let Some(blocks) = marked(blocks).filter(|_| !hasher.bigram) {
                        point = Some(ChainPoint {
                            blocks,
                            link: ChainLink::Sglang(*digest),
                        });
                    }
                });
            }
            Self::TokenChain => {
                let parent = match from.map(|point| point.link) {
                    None => TokenChain::root(lora.map(|l| l.name), cache_salt),
                    Some(ChainLink::TokenChain(key)) => key,
                    Some(_) => return Err(KeyError::ForeignChainPoint),
                };
                let before = out.len();
                TokenChain::keys_from_into(parent, rest, block_size, out)?;
                // A token-chain key is its own link.
                point = out[before..]
                    .iter()
                    .zip(start + 1..)
                    .find_map(|(&key, blocks)| {
                        marked(blocks).map(|blocks| ChainPoint {
                            blocks,
                            link: ChainLink::TokenChain(key),
                        })
                    });
            }
        }
        Ok(point)
    }
}

/// Where a prompt's key chain stands after its first [`blocks`](Self::blocks) full blocks: what
/// extending it over later tokens needs ([`KeyScheme::extend_prompt_keys`]). For vLLM's scheme
/// and SGLang's that is the full digest, which the published u64 keys do not carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainPoint {
    blocks: usize,
    link: ChainLink,
}

impl ChainPoint {
    /// Full blocks before the point.
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// The last block's chained value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChainLink {
    Vllm(Digest),
    /// The page's digest before any namespacing of its published form.
    Sglang(Digest),
    TokenChain(u64),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ExtraKeysEra, HashAlgo, VllmHasher};

    fn schemes() -> Vec<KeyScheme> {
        let mut schemes = vec![
            KeyScheme::TokenChain,
            KeyScheme::SglangExact(SglangHasher {
                bigram: false,
                dynamo_format: true,
            }),
        ];
        for algo in [HashAlgo::Sha256Cbor, HashAlgo::Xxhash] {
            schemes.push(KeyScheme::VllmExact {
                hasher: VllmHasher::new(algo, Some("0")).expect("hasher"),
                era: ExtraKeysEra::From0_31,
            });
        }
        schemes
    }

    #[test]
    fn extending_from_any_point_equals_hashing_the_whole_prompt() {
        let tokens: Vec<u32> = (0..16 * 9 + 5).map(|i| i * 7 % 1000).collect();
        let lora = LoraRef {
            name: "adapter",
            id: Some(3),
            path: Some("/adapters/a"),
        };
        for scheme in schemes() {
            let sglang = matches!(scheme, KeyScheme::SglangExact(_));
            for (lora, salt) in [(None, None), (Some(&lora), Some("salt"))] {
                let lora = lora.filter(|_| !sglang);
                let whole = scheme.prompt_keys(&tokens, 16, lora, salt).expect("whole");
                assert_eq!(whole.len(), 9);
                for mark in 1..=9 {
                    let mut first = Vec::new();
                    let point = scheme
                        .extend_prompt_keys(None, &tokens, 16, lora, salt, mark, &mut first)
                        .expect("first")
                        .expect("a point within the prompt");
                    assert_eq!(point.blocks(), mark);
                    assert_eq!(first, whole);
                    // A later prompt sharing the first `mark` blocks, extended from the point.
                    let mut later = whole[..mark].to_vec();
                    let next = scheme
                        .extend_prompt_keys(Some(&point), &tokens, 16, lora, salt, 9, &mut later)
                        .expect("extended");
                    assert_eq!(later, whole, "{scheme:?} from block {mark}");
                    assert_eq!(next.map(|p| p.blocks()), (mark < 9).then_some(9));
                }
                // No point at or before where it starts, nor past the prompt.
                let mut out = Vec::new();
                assert_eq!(
                    scheme.extend_prompt_keys(None, &tokens, 16, lora, salt, 10, &mut out),
                    Ok(None)
                );
            }
        }
    }

    #[test]
    fn media_keys_differ_from_the_images_first_block_and_a_token_chain_stops_before_it() {
        let tokens: Vec<u32> = (0..16 * 6).map(|i| i % 500).collect();
        let image = |identifier| {
            [MultiModalItem {
                identifier,
                offset: 40,
                length: 30,
            }]
        };
        for scheme in schemes() {
            let text = scheme.prompt_keys(&tokens, 16, None, None).expect("text");
            assert_eq!(
                scheme.media_prompt_keys(&tokens, 16, None, None, &[]),
                Ok(text.clone())
            );
            let a = scheme
                .media_prompt_keys(&tokens, 16, None, None, &image("a"))
                .expect("a");
            let b = scheme
                .media_prompt_keys(&tokens, 16, None, None, &image("b"))
                .expect("b");
            // Block 2 (tokens 32..48) holds the image's first tokens.
            assert_eq!(a[..2], text[..2], "{scheme:?}");
            assert_eq!(b[..2], text[..2], "{scheme:?}");
            match scheme {
                KeyScheme::TokenChain | KeyScheme::SglangExact(_) => assert_eq!(a.len(), 2),
                KeyScheme::VllmExact { .. } => {
                    assert_eq!(a.len(), 6);
                    assert!(a[2..].iter().zip(&b[2..]).all(|(a, b)| a != b));
                    assert!(a[2..].iter().zip(&text[2..]).all(|(a, t)| a != t));
                }
            }
        }
    }

    #[test]
    fn a_point_of_another_scheme_or_past_the_prompt_is_refused() {
        let tokens: Vec<u32> = (0..64).collect();
        let [chain, _, vllm, ..] = &schemes()[..] else {
            panic!("three schemes");
        };
        let mut out = Vec::new();
        let chain_point = chain
            .extend_prompt_keys(None, &tokens, 16, None, None, 2, &mut out)
            .expect("keys")
            .expect("point");
        let vllm_point = vllm
            .extend_prompt_keys(None, &tokens, 16, None, None, 2, &mut out)
            .expect("keys")
            .expect("point");
        let mut out = Vec::new();
        for (scheme, foreign) in [(chain, &vllm_point), (vllm, &chain_point)] {
            assert_eq!(
                scheme.extend_prompt_keys(Some(foreign), &tokens, 16, None, None, 4, &mut out),
                Err(KeyError::ForeignChainPoint)
            );
            assert_eq!(
                scheme.extend_prompt_keys(
                    Some(foreign),
                    &tokens[..16],
                    16,
                    None,
                    None,
                    0,
                    &mut out
                ),
                Err(KeyError::ForeignChainPoint)
            );
        }
        assert!(out.is_empty());
    }
}

#[cfg(test)]
mod sglang_tests {
    use super::*;

    /// The published hashes of SGLang's page chain for `tokens`, built from the page hash alone.
    fn chain(tokens: &[u32], page: usize, salt: Option<&str>) -> Vec<u64> {
        let mut prior = SglangHasher::chain_seed(salt);
        tokens
            .chunks_exact(page)
            .map(|words| {
                let digest = SglangHasher::page_digest(prior.as_ref(), words);
                prior = Some(digest);
                SglangHasher::published_u64(&digest)
            })
            .collect()
    }

    #[test]
    fn sglang_prompt_keys_are_the_published_page_chain() {
        let scheme = KeyScheme::SglangExact(SglangHasher::default());
        let tokens: Vec<u32> = (1..=8).collect();
        // Literal values from Python's hashlib (see `sglang::tests`): what SGLang publishes
        // for pages [1, 2, 3, 4] and [5, 6, 7, 8], as signed i64, and for the salted first page.
        assert_eq!(
            scheme.prompt_keys(&tokens, 4, None, None).unwrap(),
            [
                -3_488_128_144_981_237_669_i64 as u64,
                5_674_439_469_042_975_057
            ]
        );
        assert_eq!(
            scheme
                .prompt_keys(&tokens[..4], 4, None, Some("tenant-a"))
                .unwrap(),
            [3_718_046_898_735_569_995]
        );
        assert_eq!(
            scheme
                .prompt_keys(&tokens, 4, None, Some("tenant-a"))
                .unwrap(),
            chain(&tokens, 4, Some("tenant-a"))
        );
        // An empty salt is no salt.
        assert_eq!(
            scheme.prompt_keys(&tokens, 4, None, Some("")).unwrap(),
            chain(&tokens, 4, None)
        );
        // A partial page has no key.
        assert_eq!(
            scheme
                .prompt_keys(&tokens[..7], 4, None, None)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn sglang_dynamo_format_namespaces_salted_keys_only() {
        let dynamo = KeyScheme::SglangExact(SglangHasher {
            bigram: false,
            dynamo_format: true,
        });
        let tokens: Vec<u32> = (1..=8).collect();
        assert_eq!(
            dynamo.prompt_keys(&tokens, 4, None, None).unwrap(),
            chain(&tokens, 4, None)
        );
        let seed = SglangHasher::namespace_seed(None, Some("s")).unwrap();
        let expected: Vec<u64> = chain(&tokens, 4, Some("s"))
            .into_iter()
            .map(|h| SglangHasher::namespaced(h, &seed))
            .collect();
        assert_eq!(
            dynamo.prompt_keys(&tokens, 4, None, Some("s")).unwrap(),
            expected
        );
    }

    #[test]
    fn sglang_bigram_keys_hash_pairs_and_give_no_resume_point() {
        let scheme = KeyScheme::SglangExact(SglangHasher {
            bigram: true,
            dynamo_format: false,
        });
        let tokens: Vec<u32> = (1..=9).collect();
        let pairs: Vec<u32> = tokens.windows(2).flatten().copied().collect();
        // 8 pairs: two pages of four pairs (eight words each).
        assert_eq!(
            scheme.prompt_keys(&tokens, 4, None, None).unwrap(),
            chain(&pairs, 8, None)
        );
        // Eight tokens are seven pairs: one full page.
        assert_eq!(
            scheme
                .prompt_keys(&tokens[..8], 4, None, None)
                .unwrap()
                .len(),
            1
        );
        let mut out = Vec::new();
        assert_eq!(
            scheme.extend_prompt_keys(None, &tokens, 4, None, None, 1, &mut out),
            Ok(None)
        );
    }

    #[test]
    fn sglang_lora_requests_are_refused() {
        let scheme = KeyScheme::SglangExact(SglangHasher::default());
        let lora = LoraRef {
            name: "a",
            id: None,
            path: None,
        };
        assert_eq!(
            scheme.prompt_keys(&[1, 2, 3, 4], 4, Some(&lora), None),
            Err(KeyError::SglangLora)
        );
    }
}
