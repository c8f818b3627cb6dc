//! `kvroute-agent`: mirrors the local engines' KV blocks and streams them to kvroute-index.
//! `kvroute-agent --config agent.yaml` (see `kvroute_agent::config`); the file is reloaded
//! when it changes (`kvroute_agent::engines`); the process is `kvroute_agent::cli`.

use std::process::ExitCode;

fn main() -> ExitCode {
    kvroute_runtime::main::<kvroute_agent::cli::Process>()
}
