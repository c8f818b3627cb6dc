//! Test doubles (feature `test-util`): a vLLM-exact KV-event publisher and a recording sink.
//!
//! [`MockVllmPublisher`] speaks vLLM's ZMQ protocol (PUB + ROUTER replay) with pre-encoded
//! msgpack payloads; the engine simulator reuses it. `pyzmq_vllm_publisher.py` beside this file
//! is the same thing on pyzmq/libzmq, for interoperability tests against the real ZMQ library.

mod publisher;
mod sink;
pub mod zmtp_bytes;

pub use publisher::{
    DEFAULT_BUFFER_STEPS, MockPublisherConfig, MockVllmPublisher, PubMode, ReplayLayout,
};
pub use sink::{RecordingSink, SinkCall, applied_seqs};

/// Path of the pyzmq publisher script (runs with a Python that has `pyzmq`).
pub const PYZMQ_PUBLISHER_SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/src/testing/pyzmq_vllm_publisher.py"
);
