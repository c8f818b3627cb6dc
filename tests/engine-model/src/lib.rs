//! One vLLM-style engine model, shared by the engine simulator behind the full-stack tests
//! (`kvroute-tests`' `sim`, driven in real time) and the routing-quality simulator
//! (`kvroute-replay`, driven in virtual time).
//!
//! - [`pool`]: the KV block pool — ref-counted blocks, prefix-cache lookup by chained block key,
//!   an LRU free queue whose cached blocks are revived on a hit and evicted when a new block is
//!   needed, and the KV events vLLM publishes for it (`vllm/v1/core/block_pool.py`).
//! - [`scheduler`]: vLLM v1's step scheduler over the pool — running requests first, then
//!   waiting ones first come first served under a token budget and a sequence limit; chunked
//!   prefill; preemption of the newest request when blocks run out; the two legs of a
//!   disaggregated request as vLLM's `NixlConnector` runs them (a prefill leg's blocks held for
//!   the decode engine, a decode leg's prompt loaded instead of computed).
//! - [`timing`]: how long a step takes, a [`timing::TimingModel`] the driver chooses.
//! - [`lru`]: the one LRU queue (the pool's free queue and bounded key sets).
//!
//! Synchronous and runtime-free: a driver calls [`scheduler::Scheduler::start_step`], waits the
//! step's duration its own way (virtual or real time), then calls
//! [`scheduler::Scheduler::finish_step`].

pub mod lru;
pub mod pool;
pub mod scheduler;
pub mod timing;

pub use pool::{BlockId, BlockKey, BlockPool, HeldBlock};
pub use scheduler::{
    FirstToken, HeldLeg, Leg, NewSeq, Scheduler, SchedulerConfig, SeqId, StepOutcome,
};
pub use timing::{Linear, MockerFit, PrefillChunk, StepWork, TimingModel};
