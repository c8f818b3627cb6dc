//! vLLM's `--prefix-caching-hash-algo` choices.

use std::fmt;
use std::str::FromStr;

use crate::KeyError;

/// A vLLM prefix-caching hash algorithm: a serialization of the hashed Python tuple plus a hash.
///
/// | variant | vLLM flag | releases | serialization | hash | digest |
/// |---|---|---|---|---|---|
/// | `Sha256` | `sha256` | 0.10.2+ (default) | pickle protocol 5 | SHA-256 | 32 bytes |
/// | `Sha256Cbor` | `sha256_cbor` | 0.10.2+ | canonical CBOR | SHA-256 | 32 bytes |
/// | `Xxhash` | `xxhash` | 0.13.0+ | pickle protocol 5 | XXH3-128 | 16 bytes |
/// | `XxhashCbor` | `xxhash_cbor` | 0.13.0+ | canonical CBOR | XXH3-128 | 16 bytes |
/// | `Sha256Cbor64Bit` | `sha256_cbor_64bit` | 0.10.0-0.10.1.1 | canonical CBOR | low 64 bits of SHA-256, chained as an int | 8 bytes |
/// | `Sha256LegacyInt` | (`sha256` in 0.9.0-0.10.1.1) | 0.9.0-0.10.1.1 | pickle protocol 5 | SHA-256, chained as a 256-bit int | 32 bytes |
///
/// `Sha256LegacyInt` exists for completeness: vLLM could not publish its 256-bit values in events
/// (msgspec overflow), so it is only useful to recompute keys. Its name is not a vLLM flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashAlgo {
    /// `sha256`: SHA-256 of pickle protocol 5 (vLLM's default since 0.10.2).
    Sha256,
    /// `sha256_cbor`: SHA-256 of canonical CBOR.
    Sha256Cbor,
    /// `xxhash`: XXH3-128 of pickle protocol 5.
    Xxhash,
    /// `xxhash_cbor`: XXH3-128 of canonical CBOR.
    XxhashCbor,
    /// `sha256_cbor_64bit` (0.10.0-0.10.1.1): the u64 itself is chained.
    Sha256Cbor64Bit,
    /// `sha256` as it was in 0.9.0-0.10.1.1: the digest is chained as a Python int.
    Sha256LegacyInt,
}

impl HashAlgo {
    /// Every algorithm, for iteration in tests and config help.
    pub const ALL: [HashAlgo; 6] = [
        Self::Sha256,
        Self::Sha256Cbor,
        Self::Xxhash,
        Self::XxhashCbor,
        Self::Sha256Cbor64Bit,
        Self::Sha256LegacyInt,
    ];

    /// The vLLM flag name (`sha256_legacy_int` is this crate's own name).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sha256 => "sha256",
            Self::Sha256Cbor => "sha256_cbor",
            Self::Xxhash => "xxhash",
            Self::XxhashCbor => "xxhash_cbor",
            Self::Sha256Cbor64Bit => "sha256_cbor_64bit",
            Self::Sha256LegacyInt => "sha256_legacy_int",
        }
    }

    /// Length in bytes of one block digest.
    pub fn digest_len(self) -> usize {
        match self {
            Self::Sha256 | Self::Sha256Cbor | Self::Sha256LegacyInt => 32,
            Self::Xxhash | Self::XxhashCbor => 16,
            Self::Sha256Cbor64Bit => 8,
        }
    }

    /// Whether the hashed tuple is serialized as canonical CBOR (else pickle protocol 5).
    pub(crate) fn uses_cbor(self) -> bool {
        matches!(
            self,
            Self::Sha256Cbor | Self::XxhashCbor | Self::Sha256Cbor64Bit
        )
    }

    /// Whether the chained parent is a Python int (legacy releases) rather than `bytes`.
    pub(crate) fn chains_int(self) -> bool {
        matches!(self, Self::Sha256Cbor64Bit | Self::Sha256LegacyInt)
    }

    /// Whether vLLM 0.29+ falls back to the fixed seed `"vllm-none-hash"` when PYTHONHASHSEED is
    /// unset. For the others it draws a random seed, so nothing outside the process can match.
    pub(crate) fn has_fixed_default_seed(self) -> bool {
        matches!(self, Self::Sha256 | Self::Sha256Cbor)
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = KeyError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        if let Some(algo) = Self::ALL.into_iter().find(|a| a.as_str() == name) {
            return Ok(algo);
        }
        match name {
            "builtin" => Err(KeyError::UnreproducibleAlgo {
                name: "builtin",
                reason: "it is CPython's process-local hash()",
            }),
            _ => Err(KeyError::UnknownAlgo {
                name: name.to_owned(),
            }),
        }
    }
}
