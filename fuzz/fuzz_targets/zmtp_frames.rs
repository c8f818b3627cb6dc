//! A peer's bytes as kvroute's ZMTP sockets decode them (`kvroute_ingest::zmtp::Inbound`, the
//! state machine every SUB and DEALER connection runs): greeting, READY, then messages under
//! small limits. Input: one control byte (bit 0: DEALER instead of SUB; bits 1-7: the chunk
//! size the bytes arrive in), then the peer's byte stream.

#![no_main]

use kvroute_ingest::zmtp::{Inbound, InboundEvent, Limits, SocketType};
use libfuzzer_sys::fuzz_target;

/// A small message cap, so inputs reach it.
const MAX_MESSAGE_BYTES: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let Some((&control, stream)) = data.split_first() else {
        return;
    };
    let ours = if control & 1 == 0 {
        SocketType::Sub
    } else {
        SocketType::Dealer
    };
    let chunk = usize::from(control >> 1).max(1);
    let limits = Limits {
        max_message_bytes: MAX_MESSAGE_BYTES,
        ..Limits::default()
    };
    let mut inbound = Inbound::new(ours, limits);
    for piece in stream.chunks(chunk) {
        inbound.feed(piece);
        loop {
            match inbound.next_event() {
                Ok(Some(InboundEvent::Message(frames))) => {
                    let total: usize = frames.iter().map(|f| f.len()).sum();
                    assert!(
                        total <= MAX_MESSAGE_BYTES,
                        "message of {total} bytes passed"
                    );
                    assert!(frames.len() <= limits.max_frames);
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return,
            }
        }
        // Nothing is held beyond what arrived.
        assert!(inbound.buffered() <= stream.len());
    }
});
