//! `kvroute-check PATH (--model-dir DIR | --config ext-proc.yaml) [--model NAME] < body.json`:
//! prints, as JSON, the token ids and block keys kvroute computes for an OpenAI request body
//! (see `kvroute_ext_proc::check`), to diff against an engine's `/tokenize` or `/render`.

use std::io::{Read as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvroute_ext_proc::Config;
use kvroute_ext_proc::check::{self, CheckError, DEFAULT_CHECK_BLOCK_SIZE, ModelDirPool, Target};
use tokio_util::task::TaskTracker;

/// Bad usage: arguments, config, path or model (sysexits `EX_USAGE`).
const EX_USAGE: u8 = 64;
/// The body is not a request kvroute accepts (sysexits `EX_DATAERR`).
const EX_DATAERR: u8 = 65;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Prints the token ids and block keys kvroute computes for an OpenAI request body read on stdin"
)]
#[command(group = clap::ArgGroup::new("pool").required(true).args(["model_dir", "config"]))]
struct Args {
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

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(error) => {
            let _ = error.print();
            return if error.use_stderr() {
                ExitCode::from(EX_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    kvroute_runtime::logging::init("warn");
    match run(args) {
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

fn run(args: Args) -> anyhow::Result<()> {
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
    let report = runtime.block_on(check::check(
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
