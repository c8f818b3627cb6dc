//! The crate's error type.

use crate::{ExtraKeysEra, HashAlgo};

/// Why a key could not be computed or a key setting is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The `--prefix-caching-hash-algo` name is not one this crate knows.
    #[error("unknown prefix-caching hash algorithm {name:?}")]
    UnknownAlgo {
        /// The name as given.
        name: String,
    },
    /// The algorithm exists in vLLM but its hashes cannot be reproduced outside the engine process.
    #[error("hash algorithm {name:?} cannot be reproduced outside vLLM: {reason}")]
    UnreproducibleAlgo {
        /// The algorithm name.
        name: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// `PYTHONHASHSEED` is unset and vLLM would pick a random root for this algorithm.
    #[error("{algo} needs the pool's PYTHONHASHSEED: without it vLLM uses a random root hash")]
    SeedRequired {
        /// The configured algorithm.
        algo: HashAlgo,
    },
    /// A block size of zero was given.
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    /// The LoRA reference lacks a field that this vLLM era puts into the block hash.
    #[error("LoRA {field} is required to reproduce {era:?} extra keys")]
    LoraFieldMissing {
        /// The era whose extra-key shape needs the field.
        era: ExtraKeysEra,
        /// `"id"` or `"path"`.
        field: &'static str,
    },
    /// A digest of a length no vLLM algorithm produces (valid: 8, 16 or 32 bytes).
    #[error("block digest of {len} bytes; expected 8, 16 or 32")]
    DigestLength {
        /// The length given.
        len: usize,
    },
    /// A [`ChainPoint`](crate::ChainPoint) of the other key scheme, or past the prompt's blocks.
    #[error("chain point does not belong to this key scheme and prompt")]
    ForeignChainPoint,
    /// A vLLM version string that is not `major.minor[.patch…]`.
    #[error("cannot parse vLLM version {version:?}")]
    BadVllmVersion {
        /// The version as given.
        version: String,
    },
    /// SGLang keys a LoRA request's pages by its internal adapter id, which a router does not
    /// know.
    #[error(
        "SGLang's hashes of LoRA requests cannot be reproduced (use key_scheme kind token-chain)"
    )]
    SglangLora,
    /// Image (multimodal) extra keys are reproduced for vLLM 0.31 and later only.
    #[error("multimodal extra keys are reproduced for vLLM >= 0.31 only, not {era:?}")]
    MultiModalEra {
        /// The pool's era.
        era: ExtraKeysEra,
    },
}

impl KeyError {
    /// A fixed, low-cardinality name for metrics labels.
    pub fn as_label(&self) -> &'static str {
        match self {
            Self::UnknownAlgo { .. } => "unknown_algo",
            Self::UnreproducibleAlgo { .. } => "unreproducible_algo",
            Self::SeedRequired { .. } => "seed_required",
            Self::ZeroBlockSize => "zero_block_size",
            Self::ForeignChainPoint => "foreign_chain_point",
            Self::LoraFieldMissing { .. } => "lora_field_missing",
            Self::DigestLength { .. } => "digest_length",
            Self::BadVllmVersion { .. } => "bad_vllm_version",
            Self::MultiModalEra { .. } => "multimodal_era",
            Self::SglangLora => "sglang_lora",
        }
    }
}
