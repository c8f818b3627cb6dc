//! kvroute-replay: a trace-driven, virtual-time simulator of routing quality.
//!
//! Replays Mooncake-format traces ([`trace`]) against N simulated vLLM-style replicas
//! ([`engine`]: the shared `kvroute-engine-model`, with its [`timing`] models) in virtual time
//! ([`sim`]), routed by one of the
//! [`routers`]: the baselines people deploy (random, round-robin, least-loaded, session hash,
//! consistent hashing with bounded loads, SGLang's approximate tree, llm-d's precise scorer,
//! Dynamo's cost function), kvroute's own index and scorer (the real `kvroute-index` and
//! `kvroute-ext-proc` code), and a TTFT-greedy oracle. [`bounds`] gives the cache-only bounds,
//! [`metrics`] what a run measured, [`report`] the tables, CSV and plots, [`workload`] the
//! synthetic trace generators.
//!
//! Everything is deterministic given a seed: one RNG per run, events ordered by (time, sequence).

pub mod bounds;
pub mod engine;
pub mod experiment;
pub mod metrics;
pub mod report;
pub mod routers;
pub mod sim;
pub mod trace;
pub mod workload;

pub use kvroute_engine_model::timing;

/// Tokens per KV block: the Mooncake traces' hash-id granularity, used for the simulated
/// engines' block pools and kvroute's index alike.
pub const BLOCK_TOKENS: u32 = 512;
