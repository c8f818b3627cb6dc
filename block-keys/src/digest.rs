//! The full block digest vLLM chains, and its published 64-bit form.

use std::fmt;

use crate::KeyError;

const MAX_DIGEST_LEN: usize = 32;

/// A full vLLM block digest: 32 bytes (SHA-256), 16 (XXH3-128) or 8 (legacy 64-bit), inline.
///
/// This is what vLLM chains into the next block's hash, so continuing a chain from an event's
/// `parent_block_hash` needs this value, not its published u64 (see [`published_u64`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest {
    // Bytes past `len` are always zero, so the derived comparisons are correct.
    bytes: [u8; MAX_DIGEST_LEN],
    len: u8,
}

impl Digest {
    /// Wraps a digest given as bytes, e.g. a bytes-mode event hash
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Accepts 8, 16 or 32 bytes.
    pub fn from_slice(digest: &[u8]) -> Result<Self, KeyError> {
        match digest.len() {
            8 | 16 | 32 => {
                let mut bytes = [0; MAX_DIGEST_LEN];
                bytes[..digest.len()].copy_from_slice(digest);
                Ok(Self {
                    bytes,
                    len: digest.len() as u8,
                })
            }
            len => Err(KeyError::DigestLength { len }),
        }
    }

    /// The legacy 64-bit value (`sha256_cbor_64bit`) as an 8-byte big-endian digest.
    pub(crate) fn from_u64(value: u64) -> Self {
        let mut bytes = [0; MAX_DIGEST_LEN];
        bytes[..8].copy_from_slice(&value.to_be_bytes());
        Self { bytes, len: 8 }
    }

    pub(crate) fn from_array<const N: usize>(digest: [u8; N]) -> Self {
        const { assert!(N <= MAX_DIGEST_LEN) };
        let mut bytes = [0; MAX_DIGEST_LEN];
        bytes[..N].copy_from_slice(&digest);
        Self {
            bytes,
            len: N as u8,
        }
    }

    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The value vLLM publishes in events by default; see [`published_u64`].
    pub fn published_u64(&self) -> u64 {
        published_u64(self.as_bytes())
    }
}

impl fmt::Display for Digest {
    /// Lowercase hex, as Python's `bytes.hex()`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_bytes()
            .iter()
            .try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

/// vLLM's `maybe_convert_block_hash` in its default int mode:
/// `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last 8 bytes read big-endian,
/// left-padded with zeros when the input is shorter than 8 bytes.
///
/// Works for any length, including the concatenated sub-block digests of hybrid models.
pub fn published_u64(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(8)..];
    let mut be = [0u8; 8];
    be[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(be)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_u64_takes_last_eight_bytes_big_endian() {
        let digest: Vec<u8> = (1..=32).collect();
        assert_eq!(published_u64(&digest), 0x191a_1b1c_1d1e_1f20);
        assert_eq!(published_u64(&[0xab, 0xcd]), 0xabcd);
        assert_eq!(published_u64(&[]), 0);
    }

    #[test]
    fn digest_rejects_unknown_lengths_and_prints_hex() {
        assert_eq!(
            Digest::from_slice(&[0; 20]),
            Err(KeyError::DigestLength { len: 20 })
        );
        let d = Digest::from_slice(&[0, 1, 2, 3, 4, 5, 6, 0xff]).unwrap();
        assert_eq!(d.to_string(), "00010203040506ff");
        assert_eq!(d.published_u64(), 0x0001_0203_0405_06ff);
        assert_eq!(Digest::from_u64(0x0001_0203_0405_06ff), d);
    }
}
