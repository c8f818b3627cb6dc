//! The `kvroute-check` command line: `kvroute-check PATH (--model-dir DIR | --config
//! ext-proc.yaml) [--model NAME] < body.json` prints the [`Report`](super::Report) as JSON;
//! `kvroute-check PATH --explain http://ext-proc-admin < body.json` prints the decision record a
//! running kvroute-ext-proc makes for the body now (its `/v1/explain`; nothing is routed).
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
#[command(group = clap::ArgGroup::new("pool").required(true).args(["model_dir", "config", "explain"]))]
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
    /// A running kvroute-ext-proc's admin URL (`http://host:9090`): print the record of how it
    /// would decide this body now — every candidate's matched blocks, load and estimated time to
    /// first token, the tier and reason (its `POST /v1/explain`; nothing is routed).
    #[arg(long, value_name = "ADMIN_URL")]
    explain: Option<String>,
    /// Indent the JSON (one token id per line); compact by default.
    #[arg(long)]
    pretty: bool,
}

/// How long `--explain` waits for ext-proc's answer.
const EXPLAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

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
    if let Some(admin) = &args.explain {
        return explain(admin, &args.path, args.pretty);
    }
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

/// `--explain`: the body on stdin to `{admin}/v1/explain?path={path}`, the record printed.
fn explain(admin: &str, path: &str, pretty: bool) -> anyhow::Result<()> {
    let url: http::Uri = format!("{}/v1/explain?path={path}", admin.trim_end_matches('/'))
        .parse()
        .map_err(|e| anyhow::anyhow!("--explain {admin}: {e}"))?;
    let mut body = Vec::new();
    std::io::stdin().read_to_end(&mut body)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(async {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http();
        tokio::time::timeout(
            EXPLAIN_TIMEOUT,
            crate::tokenizer::http::post_json(client, url.clone(), body.into()),
        )
        .await
        .map_err(|_| anyhow::anyhow!("{url}: no answer within {EXPLAIN_TIMEOUT:?}"))?
        .map_err(|reason| anyhow::anyhow!("{url}: {reason}"))
    })?;
    let record: serde_json::Value = serde_json::from_slice(&answer)?;
    let mut stdout = std::io::stdout().lock();
    if pretty {
        serde_json::to_writer_pretty(&mut stdout, &record)?;
    } else {
        serde_json::to_writer(&mut stdout, &record)?;
    }
    writeln!(stdout)?;
    Ok(())
}
