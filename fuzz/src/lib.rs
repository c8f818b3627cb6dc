//! Helpers shared by the fuzz targets.
//!
//! Multi-frame inputs (a ZMQ message's frames, an agent stream's messages) are one byte string
//! of length-prefixed frames: `u16` little-endian length, then that many bytes, repeated; a
//! final length that overruns the input takes what is left. The seed generator
//! (`index-service/examples/fuzz_seeds.rs`) writes the same format.

/// Most frames taken from one input (more would only slow a run down).
pub const MAX_FRAMES: usize = 64;

/// Splits `data` into frames (see the crate docs).
pub fn frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut frames = Vec::new();
    while !data.is_empty() && frames.len() < MAX_FRAMES {
        let Some((len, rest)) = data.split_first_chunk::<2>() else {
            frames.push(data);
            break;
        };
        let len = usize::from(u16::from_le_bytes(*len)).min(rest.len());
        let (frame, rest) = rest.split_at(len);
        frames.push(frame);
        data = rest;
    }
    frames
}
