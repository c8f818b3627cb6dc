//! The index's use of `kvroute-block-keys`: how a pool's stored block keys come from events.
//!
//! - vLLM-exact pools store the engine's published u64 as is; an optional [`VllmHasher`]
//!   re-hashes `token_ids` to catch a pool configured with the wrong algorithm or seed.
//! - SGLang-exact pools likewise store SGLang's published hash (its 64 bits); an optional
//!   [`SglangHasher`] re-hashes runs that start a chain (SGLang publishes only 8 bytes of the
//!   digest a run continues from).
//! - token-chain pools recompute [`TokenChain`] keys from `token_ids`, rooted like the router
//!   roots a prompt: in the namespace of the LoRA adapter and the cache salt.

use kvroute_block_keys::{
    Digest, ExtraKeysEra, HashAlgo, HashValue, KeyScheme, SglangHasher, TokenChain, VllmHasher,
};

use crate::event::BlockStored;

/// What an exact pool (vLLM or SGLang) does with the block hashes engines publish (the index's
/// `pools[].verify_hashes`, written `off`, `flag` or `required`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum VerifyHashes {
    /// Trust the engine: published hashes are indexed as they come.
    Off,
    /// Re-hash stored runs from their `token_ids` where possible and flag a replica whose
    /// hashes disagree (out of precise scoring until reset). Runs that cannot be recomputed
    /// (mid-chain without the parent's digest, LoRA, extra keys) are indexed unchecked.
    #[default]
    Flag,
    /// Like [`VerifyHashes::Flag`], and a run is indexed only if every published hash was
    /// recomputed and matched: unverifiable and mismatching runs are refused
    /// ([`RejectReason::Unverifiable`](super::RejectReason::Unverifiable),
    /// [`RejectReason::HashMismatch`](super::RejectReason::HashMismatch)). For engines that
    /// are not trusted; needs engines that publish full digests to verify runs that continue
    /// a chain (or `sha256_cbor_64bit`), and refuses every LoRA block.
    Required,
}

impl VerifyHashes {
    /// Config/label spelling.
    pub fn as_label(self) -> &'static str {
        match self {
            VerifyHashes::Off => "off",
            VerifyHashes::Flag => "flag",
            VerifyHashes::Required => "required",
        }
    }
}

/// Re-hashes a vLLM-exact pool's stored runs (see [`VerifyHashes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashValidator {
    /// The pool's hash function, as the engines run it.
    pub hasher: VllmHasher,
    /// The pool's vLLM era: how published extra keys (images, salt) were hashed.
    pub era: ExtraKeysEra,
    /// Refuse runs that are not verified, instead of only flagging replicas that disagree.
    pub required: bool,
}

/// Re-hashes an SGLang-exact pool's stored runs (see [`VerifyHashes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SglangValidator {
    /// The pool's page hash, as the engines run it.
    pub hasher: SglangHasher,
    /// Refuse runs that are not verified, instead of only flagging replicas that disagree.
    pub required: bool,
}

/// How a pool's block keys relate to the engine's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolKeys {
    /// The engine's published hash is the key.
    VllmExact {
        /// Re-hashes stored blocks from their `token_ids`. `None` trusts the engine.
        validator: Option<HashValidator>,
    },
    /// SGLang's published hash is the key.
    SglangExact {
        /// Re-hashes stored runs from their `token_ids`. `None` trusts the engine.
        validator: Option<SglangValidator>,
    },
    /// kvroute's [`TokenChain`] keys, recomputed from `token_ids`; the engine hash only
    /// identifies blocks for removal and parent lookup.
    TokenChain,
}

impl PoolKeys {
    /// The index side of a pool's [`KeyScheme`]; `verify` applies to exact pools only
    /// (token-chain keys are recomputed from `token_ids` anyway).
    pub fn from_scheme(scheme: &KeyScheme, verify: VerifyHashes) -> Self {
        match scheme {
            KeyScheme::VllmExact { hasher, era } => PoolKeys::VllmExact {
                validator: (verify != VerifyHashes::Off).then(|| HashValidator {
                    hasher: hasher.clone(),
                    era: *era,
                    required: verify == VerifyHashes::Required,
                }),
            },
            KeyScheme::SglangExact(hasher) => PoolKeys::SglangExact {
                validator: (verify != VerifyHashes::Off).then_some(SglangValidator {
                    hasher: *hasher,
                    required: verify == VerifyHashes::Required,
                }),
            },
            KeyScheme::TokenChain => PoolKeys::TokenChain,
        }
    }

    /// Metric/config label of the scheme.
    pub fn as_label(&self) -> &'static str {
        match self {
            PoolKeys::VllmExact { .. } => "vllm-exact",
            PoolKeys::SglangExact { .. } => "sglang-exact",
            PoolKeys::TokenChain => "token-chain",
        }
    }

    /// Whether the engine's published hash is the block key.
    pub fn is_exact(&self) -> bool {
        !matches!(self, PoolKeys::TokenChain)
    }

    /// Whether stored runs are re-hashed, and if so whether unverified ones are refused.
    pub(crate) fn verifies(&self) -> Option<bool> {
        match self {
            PoolKeys::VllmExact {
                validator: Some(validator),
            } => Some(validator.required),
            PoolKeys::SglangExact {
                validator: Some(validator),
            } => Some(validator.required),
            _ => None,
        }
    }

    /// Re-hashes a well-formed run (see [`verifies`](Self::verifies)); `Unverifiable` when the
    /// pool does not re-hash.
    pub(crate) fn verify(&self, stored: &BlockStored) -> Verification {
        match self {
            PoolKeys::VllmExact {
                validator: Some(validator),
            } => verify(validator, stored),
            PoolKeys::SglangExact {
                validator: Some(validator),
            } => verify_sglang(&validator.hasher, stored),
            _ => Verification::Unverifiable,
        }
    }
}

/// Result of re-hashing a `BlockStored` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verification {
    /// The run cannot be recomputed: it continues a chain whose full parent digest is not
    /// published, or carries extra keys whose hashed form the index cannot rebuild (LoRA, whose
    /// path is not published; prompt embeds; any before vLLM 0.31).
    Unverifiable,
    /// Every published hash matches.
    Verified,
    /// Block `block` of the run (0-based) hashes to `computed` instead of what was published.
    /// `certain` is false when the event does not publish extra keys (vLLM < 0.17), so a
    /// `cache_salt` or multimodal input the index cannot see may explain the difference.
    Mismatch {
        block: usize,
        computed: u64,
        certain: bool,
    },
}

fn is_plain(extra: &Option<HashValue>) -> bool {
    matches!(extra, None | Some(HashValue::None))
}

/// The extra keys vLLM 0.31+ hashed into a run's blocks, rebuilt from their published form
/// (`to_event_extra_keys` drops the tags): an `(identifier, offset)` pair was the image item
/// `("mm", identifier, offset)`, and a string last in the prompt's first block the cache salt
/// `("cache_salt", salt)`. `None` when a block carries anything else (prompt-embeds digests;
/// LoRA runs are refused before) or the era hashed its keys otherwise.
fn hashed_extra_keys(
    era: ExtraKeysEra,
    starts_prompt: bool,
    published: &[Option<HashValue>],
) -> Option<Vec<Option<HashValue>>> {
    let str = |s: &str| HashValue::Str(s.to_owned());
    published
        .iter()
        .enumerate()
        .map(|(block, keys)| {
            let items = match keys {
                None | Some(HashValue::None) => return Some(None),
                Some(HashValue::Tuple(items)) if era == ExtraKeysEra::From0_31 => items,
                Some(_) => return None,
            };
            let last = items.len().checked_sub(1);
            let tagged = items
                .iter()
                .enumerate()
                .map(|(i, item)| match item {
                    HashValue::Tuple(pair) => match pair.as_slice() {
                        [HashValue::Str(id), HashValue::Int(offset)] => {
                            Some(HashValue::Tuple(vec![
                                str("mm"),
                                str(id),
                                HashValue::Int(*offset),
                            ]))
                        }
                        _ => None,
                    },
                    HashValue::Str(salt) if starts_prompt && block == 0 && Some(i) == last => {
                        Some(HashValue::Tuple(vec![str("cache_salt"), str(salt)]))
                    }
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()?;
            Some((!tagged.is_empty()).then_some(HashValue::Tuple(tagged)))
        })
        .collect()
}

/// Re-hashes a well-formed SGLang `BlockStored` (token count already checked against its
/// hashes): only a run that starts a chain (no parent: SGLang publishes 8 of the parent digest's
/// 32 bytes) and names no LoRA adapter (0.5.23 namespaces those by SGLang's internal adapter id).
/// A mismatch is certain unless the engines use kv-events `format: dynamo`, which also
/// namespaces a request's `extra_key`, not published.
pub(crate) fn verify_sglang(hasher: &SglangHasher, stored: &BlockStored) -> Verification {
    if stored.parent_block_hash.is_some() || stored.lora_name.is_some() {
        return Verification::Unverifiable;
    }
    let salt = stored.cache_salt();
    let namespace = hasher.publish_seed(salt);
    let block_size = stored.block_size as usize;
    let mut prior = SglangHasher::chain_seed(salt);
    let mut words = Vec::with_capacity(2 * block_size + 2);
    for (block, &published) in stored.block_hashes.iter().enumerate() {
        words.clear();
        if stored
            .token_layout()
            .page_words(
                &stored.token_ids,
                block * block_size,
                block_size,
                &mut words,
            )
            .is_none()
        {
            return Verification::Unverifiable;
        }
        let digest = SglangHasher::wide_page_digest(prior.as_ref(), &words);
        let mut computed = SglangHasher::published_u64(&digest);
        if let Some(seed) = &namespace {
            computed = SglangHasher::namespaced(computed, seed);
        }
        if computed != published {
            return Verification::Mismatch {
                block,
                computed,
                certain: !hasher.dynamo_format,
            };
        }
        prior = Some(digest);
    }
    Verification::Verified
}

/// Re-hashes a well-formed `BlockStored` (token count already checked against its hashes) with
/// the extra keys it publishes (images, salt) in their hashed form.
pub(crate) fn verify(validator: &HashValidator, stored: &BlockStored) -> Verification {
    let hasher = &validator.hasher;
    if stored.lora_id.is_some() || stored.lora_name.is_some() {
        return Verification::Unverifiable;
    }
    let (certain, extra) = match &stored.extra_keys {
        None => (false, Vec::new()),
        Some(extra) if extra.iter().all(is_plain) => (true, Vec::new()),
        Some(extra) => {
            match hashed_extra_keys(validator.era, stored.parent_block_hash.is_none(), extra) {
                Some(extra) => (true, extra),
                None => return Verification::Unverifiable,
            }
        }
    };
    let parent = match (stored.parent_block_hash, &stored.parent_digest) {
        (None, _) => None,
        (Some(_), Some(digest)) => match Digest::from_slice(digest) {
            Ok(digest) => Some(digest),
            Err(_) => return Verification::Unverifiable,
        },
        // sha256_cbor_64bit chains the published u64 itself, so the event's parent suffices.
        (Some(parent), None) if hasher.algo() == HashAlgo::Sha256Cbor64Bit => {
            match Digest::from_slice(&parent.to_be_bytes()) {
                Ok(digest) => Some(digest),
                Err(_) => return Verification::Unverifiable,
            }
        }
        (Some(_), None) => return Verification::Unverifiable,
    };
    let block_size = stored.block_size as usize;
    let mut first_mismatch = None;
    let mut block = 0;
    let walked = hasher.for_each_block(
        parent.as_ref(),
        &stored.token_ids,
        block_size,
        |block| extra.get(block).and_then(Option::as_ref),
        |digest| {
            let computed = digest.published_u64();
            if first_mismatch.is_none() && stored.block_hashes.get(block) != Some(&computed) {
                first_mismatch = Some((block, computed));
            }
            block += 1;
        },
    );
    match (walked, first_mismatch) {
        (Err(_), _) => Verification::Unverifiable,
        (Ok(()), None) => Verification::Verified,
        (Ok(()), Some((block, computed))) => Verification::Mismatch {
            block,
            computed,
            certain,
        },
    }
}

/// Token-chain keys of a stored run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChainRun {
    /// Keys of the leading blocks the chain can represent.
    pub(crate) keys: Vec<u64>,
    /// Blocks after `keys` carry extra keys a token chain cannot represent (multimodal inputs,
    /// prompt embeds): hashing only their placeholder tokens would match other images.
    pub(crate) unsupported: usize,
}

/// Computes a run's token-chain keys from `parent` (the parent block's own key), or from the
/// root of the run's namespace when the run starts the prompt. An SGLang run's salt is its
/// `cache_salt`; its bigram positions are keyed by their first tokens (the prompt's own), and
/// its pages from the first one holding a multimodal pad past u32 are not keyed (a token chain
/// cannot tell two images apart).
pub(crate) fn chain_keys(parent: Option<u64>, stored: &BlockStored) -> ChainRun {
    let block_size = stored.block_size as usize;
    let blocks = stored.block_hashes.len();
    let extra_of = |block: usize| {
        stored
            .extra_keys
            .as_ref()
            .and_then(|extra| extra.get(block))
            .and_then(Option::as_ref)
    };
    let mut key = match parent {
        Some(parent) => parent,
        None => match namespace_salt(stored, extra_of(0)) {
            Some(salt) => {
                TokenChain::root(stored.lora_name.as_deref(), salt.or(stored.cache_salt()))
            }
            None => {
                return ChainRun {
                    keys: Vec::new(),
                    unsupported: blocks,
                };
            }
        },
    };
    let mut keys = Vec::with_capacity(blocks);
    for (block, tokens) in stored.token_ids.chunks_exact(block_size).enumerate() {
        // Block 0 of the prompt was vetted by `namespace_salt`; later blocks may hold only LoRA.
        let starts_prompt = block == 0 && parent.is_none();
        if (!starts_prompt && !lora_only(stored, extra_of(block)))
            || stored
                .token_layout()
                .is_wide_page(block * block_size, block_size)
        {
            break;
        }
        key = TokenChain::next(key, tokens);
        keys.push(key);
    }
    ChainRun {
        unsupported: blocks - keys.len(),
        keys,
    }
}

/// The items of a block's published extra keys (vLLM publishes a tuple per block).
fn items(extra: Option<&HashValue>) -> &[HashValue] {
    match extra {
        None | Some(HashValue::None) => &[],
        Some(HashValue::Tuple(items)) => items,
        Some(single) => std::slice::from_ref(single),
    }
}

/// Whether `item` is the event's LoRA adapter in any vLLM era's shape (id, name, tagged tuple).
fn is_lora_item(stored: &BlockStored, item: &HashValue) -> bool {
    match item {
        HashValue::Int(id) => stored.lora_id == Some(*id),
        HashValue::Str(name) => stored.lora_name.as_deref() == Some(name.as_str()),
        HashValue::Tuple(tagged) => {
            matches!(tagged.first(), Some(HashValue::Str(tag)) if tag == "lora")
        }
        _ => false,
    }
}

/// Extra items after the leading LoRA item, if the event has an adapter.
fn after_lora<'a>(stored: &BlockStored, items: &'a [HashValue]) -> &'a [HashValue] {
    let has_lora = stored.lora_name.is_some() || stored.lora_id.is_some();
    match items.split_first() {
        Some((first, rest)) if has_lora && is_lora_item(stored, first) => rest,
        _ => items,
    }
}

fn lora_only(stored: &BlockStored, extra: Option<&HashValue>) -> bool {
    after_lora(stored, items(extra)).is_empty()
}

/// The cache salt in the first block's extra keys: `Some(None)` for no salt, `None` when the
/// block carries something else (multimodal, prompt embeds).
fn namespace_salt<'a>(
    stored: &BlockStored,
    extra: Option<&'a HashValue>,
) -> Option<Option<&'a str>> {
    match after_lora(stored, items(extra)) {
        [] => Some(None),
        [HashValue::Str(salt)] => Some(Some(salt.as_str())),
        [HashValue::Tuple(tagged)] => match tagged.as_slice() {
            [HashValue::Str(tag), HashValue::Str(salt)] if tag == "cache_salt" => Some(Some(salt)),
            _ => None,
        },
        _ => None,
    }
}
