//! The KV-event payload decoder: any input gives `Ok` or `Err`, never a panic, and whatever
//! decodes survives an encode/decode round trip.

#![no_main]

use kvroute_index_core::wire::{Encoding, decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(decoded) = decode_batch(data) {
        let again = encode_batch(&decoded.batch, Encoding::V0_32);
        assert!(
            decode_batch(&again).is_ok(),
            "re-encoded batch failed to decode"
        );
    }
});
