//! ZMQ message frames as ingest sees them: a live message (topic, sequence, payload) and a
//! replay reply (delimiter, then a batch or the end marker). Input: length-prefixed frames
//! (`kvroute_fuzz::frames`).

#![no_main]

use kvroute_index_core::wire::{ReplayItem, decode_batch, decode_message, parse_replay_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let frames = kvroute_fuzz::frames(data);
    let _ = decode_message(&frames);
    if let Ok(ReplayItem::Batch { payload, .. }) = parse_replay_frames(&frames) {
        let _ = decode_batch(payload);
    }
});
