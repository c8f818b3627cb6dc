//! Test modules of the integration binary.

mod common;
mod envoy;
mod fidelity;
mod index_capture;
mod sim;
mod tokenize_parity;
mod wasm_filter;
