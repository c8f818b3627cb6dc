//! `kvroute-index`: serves the KV block index. `kvroute-index --config index.yaml`
//! (see `kvroute_index::config`; the process is `kvroute_index::cli`).

use std::process::ExitCode;

fn main() -> ExitCode {
    kvroute_runtime::main::<kvroute_index::cli::Process>()
}
