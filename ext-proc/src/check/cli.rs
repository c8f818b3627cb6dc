//! The `kvroute-check` command line: `kvroute-check PATH (--model-dir DIR | --config
//! ext-proc.yaml) [--model NAME] < body.json` prints the [`Report`](super::Report) as JSON.
//!
//! Exit codes: 0 printed; 64 (`EX_USAGE`) bad arguments, config, path or model; 65
//! (`EX_DATAERR`) a body kvroute does not accept; 1 anything else (stdin, a tokenizer that
//! fails).

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvroute_runtime::process::{EX_DATAERR, EX_USAGE};
use tokio_util::task::TaskTracker;

use super::{CheckError, DEFAULT_CHECK_BLOCK_SIZE, ModelDirPool, Target};
use crate::Config;

/// `kvroute-check`'s arguments.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Prints the token ids and block keys kvroute computes for an OpenAI request body read on stdin"
)]
#[command(group = clap::ArgGroup::new("pool").required(true).args(["model_dir", "config"]))]
pub struct Args {
    /// The request's path: /v1/completions, /v1/chat/completions, /v1/responses or /v1/messages.
    path: String,
    /// An HF model folder (tokenized in process); the pool's keys come from the flags below.
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// An ext-proc config: the pool serving the model, with its tokenizer and key scheme.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The model (or LoRA adapter) name to find the pool by; defaults to the body's `model`.
    #[arg(long)]
    model: Option<String>,
    /// With --model-dir: the KV block size.
    #[arg(long, default_value_t = DEFAULT_CHECK_BLOCK_SIZE, conflicts_with = "config")]
    block_size: u32,
    /// With --model-dir: `vllm-exact` (default) or `token-chain`.
    #[arg(long, conflicts_with = "config")]
    key_scheme: Option<String>,
    /// With --model-dir: vLLM's --prefix-caching-hash-algo (default sha256, vLLM's).
    #[arg(long, conflicts_with = "config")]
    hash_algo: Option<String>,
    /// With --model-dir: the engines' PYTHONHASHSEED.
    #[arg(long, conflicts_with = "config")]
    seed: Option<String>,
    /// With --model-dir: the engines' vLLM version (how LoRA and cache_salt enter the keys).
    #[arg(long, conflicts_with = "config")]
    vllm_version: Option<String>,
    /// Indent the JSON (one token id per line); compact by default.
    #[arg(long)]
    pretty: bool,
}

/// Checks the body on stdin as `args` say and prints the report; a refusal is one line on
/// stderr (`kvroute-check: why`) and the exit code says its kind.
pub fn run(args: Args) -> ExitCode {
    match check(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let code = match error.downcast_ref::<CheckError>() {
                Some(e) if e.is_usage() => EX_USAGE,
                Some(CheckError::Body(_)) => EX_DATAERR,
                _ => 1,
            };
            eprintln!("kvroute-check: {error:#}");
            ExitCode::from(code)
        }
    }
}

fn check(args: Args) -> anyhow::Result<()> {
    let config = match &args.config {
        Some(path) => Some(Config::from_file(path).map_err(CheckError::from)?),
        None => None,
    };
    let model_dir = args.model_dir.map(|model_dir| ModelDirPool {
        model_dir,
        block_size: args.block_size,
        key_kind: args.key_scheme,
        hash_algo: args.hash_algo,
        seed: args.seed,
        vllm_version: args.vllm_version,
    });
    let target = match (&config, &model_dir) {
        (Some(config), _) => Target::Config(config),
        (None, Some(pool)) => Target::ModelDir(pool),
        (None, None) => anyhow::bail!("give --model-dir or --config"),
    };
    let mut body = Vec::new();
    std::io::stdin().read_to_end(&mut body)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tasks = TaskTracker::new();
    let report = runtime.block_on(super::check(
        target,
        &args.path,
        &body,
        args.model.as_deref(),
        &tasks,
    ))?;
    let mut stdout = std::io::stdout().lock();
    if args.pretty {
        serde_json::to_writer_pretty(&mut stdout, &report)?;
    } else {
        serde_json::to_writer(&mut stdout, &report)?;
    }
    writeln!(stdout)?;
    Ok(())
}
