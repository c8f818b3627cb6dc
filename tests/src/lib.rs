//! kvroute test support: the vLLM-compatible engine simulator ([`sim`], binary
//! `kvroute-engine-sim`), process harnesses for a real Envoy and our binaries ([`harness`]), the
//! whole product as processes ([`stack`]). The demo (`tests/demo`, crate `kvroute-demo`) and the
//! latency bench (`tests/bench`, crate `kvroute-latency-bench`) build on them, apart from the tests.
//!
//! The integration tests live in `tests/main.rs` (one binary, modules per topic).

pub mod harness;
pub mod sim;
pub mod stack;
