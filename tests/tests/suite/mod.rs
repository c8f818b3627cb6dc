//! Test modules of the integration binary.

mod agent;
mod agent_engines;
mod check;
mod common;
mod discovery;
mod drift;
mod embedded_index;
mod envoy;
mod epp;
mod exposure;
mod fidelity;
mod hostile_peers;
mod index_capture;
mod index_ha;
mod index_states;
mod memory;
mod real_vllm;
mod real_vllm_agent;
mod render;
mod replica_states;
mod routing;
mod sim;
mod sim_index;
mod soak;
mod tokenize_parity;
mod wasm_filter;
