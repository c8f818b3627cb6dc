//! kvroute test support: the vLLM-compatible engine simulator ([`sim`], binary
//! `kvroute-engine-sim`), process harnesses for a real Envoy and our binaries ([`harness`]), the
//! whole product as processes ([`stack`]) and the demo workload ([`demo`], binary `kvroute-demo`).
//!
//! The integration tests live in `tests/main.rs` (one binary, modules per topic).

pub mod demo;
pub mod harness;
pub mod sim;
pub mod stack;
