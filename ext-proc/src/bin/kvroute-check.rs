//! `kvroute-check PATH (--model-dir DIR | --config ext-proc.yaml) [--model NAME] < body.json`:
//! prints, as JSON, the token ids and block keys kvroute computes for an OpenAI request body
//! (see `kvroute_ext_proc::check`), to diff against an engine's `/tokenize` or `/render`. The
//! command line and exit codes are `kvroute_ext_proc::check::cli`.

use std::process::ExitCode;

use clap::Parser as _;
use kvroute_ext_proc::check::cli::{self, Args};
use kvroute_runtime::process::EX_USAGE;

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) => {
            // Bad arguments are bad usage (64), not clap's 2; `--help` and `--version` succeed.
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::from(EX_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    kvroute_runtime::logging::init("warn");
    cli::run(args)
}
