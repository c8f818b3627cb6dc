//! The agent stream as the index handles it, short of the network: each frame is one
//! protobuf `AgentMessage` (`kvroute_fuzz::frames`); the first opens the stream (`Hello`:
//! authentication, claims), the rest are decoded and applied to a real index exactly as the
//! server applies them (ownership, snapshots, deltas, event conversion, hash verification).

#![no_main]

use kvroute_index_api::api;
use kvroute_index_core::index::KvIndex as _;
use kvroute_index::server::fuzzing::AgentStreamHarness;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;

fuzz_target!(|data: &[u8]| {
    let mut frames = kvroute_fuzz::frames(data).into_iter();
    let Some(first) = frames.next() else { return };
    let Ok(first) = api::AgentMessage::decode(first) else {
        return;
    };
    let harness = AgentStreamHarness::new();
    let Some(mut session) = harness.open(first) else {
        return;
    };
    for frame in frames {
        // tonic ends the stream on a message that does not decode; so does this.
        let Ok(message) = api::AgentMessage::decode(frame) else {
            return;
        };
        session.handle(message);
    }
    // Whatever was applied, matching a prompt against it must not panic either.
    let _ = harness.index().find_matches("tiny", &[1, 2, 3], None);
});
