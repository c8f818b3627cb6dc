//! `kvroute-ext-proc --config kvroute.yaml`: the Envoy ext_proc endpoint picker. Its command line
//! (with the flags GIE's and llm-d's EPP charts pass) and process are `kvroute_ext_proc::cli`.

use std::process::ExitCode;

/// The tokenizer allocates a small string per pre-token, many per decision: a thread-caching
/// allocator keeps those allocations off shared locks.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    kvroute_runtime::main::<kvroute_ext_proc::cli::Process>()
}
