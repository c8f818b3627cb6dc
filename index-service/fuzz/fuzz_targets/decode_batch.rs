//! Fuzzes the KV-event payload decoder: any input must give `Ok` or `Err`, never a panic, and
//! whatever decodes must survive an encode/decode round trip.

#![no_main]

use kvroute_index::wire::{Encoding, decode_batch, encode_batch, parse_replay_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(decoded) = decode_batch(data) {
        let again = encode_batch(&decoded.batch, Encoding::V0_32);
        assert!(
            decode_batch(&again).is_ok(),
            "re-encoded batch failed to decode"
        );
    }
    let _ = parse_replay_frames(&[&b""[..], data]);
});
