//! kvroute test support: the vLLM-compatible engine simulator ([`sim`], binary
//! `kvroute-engine-sim`) and process harnesses for a real Envoy and our binaries ([`harness`]).
//!
//! The integration tests live in `tests/main.rs` (one binary, modules per topic).

pub mod harness;
pub mod sim;
