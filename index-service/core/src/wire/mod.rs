//! vLLM's and SGLang's KV-event wire format: ZMQ frames and msgpack payloads → domain
//! [`crate::event`] types.
//!
//! This is the only module that knows msgpack. It accepts every encoding vLLM has published
//! (0.9.0 through 0.34: tagged arrays, then `"type"`-keyed maps; hashes as uint, negative int or
//! raw digest bytes) and every SGLang encoding (positional arrays up to 0.5.19, maps from 0.5.20;
//! signed i64 hashes; token pairs and ids past u32), and turns them into [`EventBatch`]es. See `README.md` beside this file and
//! `shared/vllm/kv-events-spec.md` §1–§2.
//!
//! ```
//! # #[cfg(feature = "encode")] {
//! use kvroute_index_core::wire::{self, Encoding};
//! use kvroute_index_core::event::{EventBatch, KvEvent};
//!
//! let batch = EventBatch { ts: 1.5, dp_rank: Some(0), events: vec![KvEvent::AllBlocksCleared] };
//! let payload = wire::encode_batch(&batch, Encoding::V0_32);
//! let frames = [b"kv@pod-a@model".to_vec(), 7u64.to_be_bytes().to_vec(), payload];
//! let (topic, seq, decoded) = wire::decode_message(&frames)?;
//! assert_eq!((topic, seq, decoded.batch), ("kv@pod-a@model", 7, batch));
//! # }
//! # Ok::<(), kvroute_index_core::wire::WireError>(())
//! ```
//!
//! Decoding is defensive: declared lengths are checked against the remaining input before
//! anything is allocated, collections are capped by the `MAX_*` limits below, and every failure
//! is a [`WireError`]; no input makes it panic (property-tested, and fuzzed by the `wire_*` targets in the repository's
//! `fuzz/`).

mod decode;
// The encoder is test support (feature `encode`): production only decodes.
#[cfg(any(test, feature = "encode"))]
mod encode;
mod error;
mod frames;
mod reader;

#[cfg(test)]
mod sglang_tests;
#[cfg(test)]
mod tests;

pub use decode::{decode_batch, decode_engine_batch};
#[cfg(any(test, feature = "encode"))]
pub use encode::{
    Encoding, HashForm, Schema, SglangLayout, encode_batch, encode_batch_with_digests,
    encode_sglang_batch,
};
pub use error::WireError;
pub use frames::{
    ReplayItem, decode_engine_message, decode_message, parse_replay_frames, replay_request,
};

use crate::event::EventBatch;

/// Most events one batch may declare. A vLLM step emits one event per evicted block run and per
/// stored run, far fewer than this.
pub const MAX_EVENTS_PER_BATCH: usize = 1 << 18;

/// Most block hashes (and `extra_keys` entries) one event may declare.
pub const MAX_BLOCKS_PER_EVENT: usize = 1 << 18;

/// Most token ids one `BlockStored` may declare (4 Mi: beyond any model's context length).
pub const MAX_TOKENS_PER_EVENT: usize = 1 << 22;

/// Deepest nesting accepted in `extra_keys` tuples and in skipped unknown values.
/// vLLM nests at most two levels (`("lora", ("mm-hash", offset), "salt")`).
pub const MAX_NESTING_DEPTH: usize = 16;

/// A decoded batch, plus how many events in it had a tag this decoder does not know.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The known events, in order.
    pub batch: EventBatch,
    /// Events skipped for an unknown tag (a newer vLLM may add kinds; count them, don't fail).
    pub unknown_events: u32,
    /// Events that carried a field the index reads but does not use, per field.
    pub ignored_fields: IgnoredFields,
}

/// Event fields vLLM publishes (0.32–0.34) that the index decodes and does not use: what they
/// say does not change which blocks a replica holds for a prompt. Counted per event that
/// carries one (not nil), so an operator sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IgnoredFields {
    /// `locality` (`LOCAL`/`REMOTE` of an offloading tier): the medium already places the block.
    pub locality: u32,
    /// `ownership` (an offloading tier's id).
    pub ownership: u32,
    /// `session_id` (the request context that caused a store; says nothing about holdings).
    pub session_id: u32,
    /// `lookahead_token_ids` (tokens hashed ahead by lookahead hashing).
    pub lookahead_token_ids: u32,
}

impl IgnoredFields {
    /// Each field's name (its metric label) and count.
    pub fn counts(&self) -> [(&'static str, u32); 4] {
        [
            ("locality", self.locality),
            ("ownership", self.ownership),
            ("session_id", self.session_id),
            ("lookahead_token_ids", self.lookahead_token_ids),
        ]
    }
}
