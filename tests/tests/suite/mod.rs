//! Test modules of the integration binary.

mod common;
mod envoy;
mod fidelity;
mod index_capture;
mod sim;
mod wasm_filter;
