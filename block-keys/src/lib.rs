//! Block keys: how a prompt's token ids become the chained per-block keys that the index stores.
//!
//! (Skeleton: being implemented.)

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
