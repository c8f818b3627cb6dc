//! `kvroute-index`: serves the KV block index. `kvroute-index --config index.yaml`.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::Parser;
use kvroute_index::{config::Config, server::IndexServer};

/// sysexits `EX_USAGE`: bad command line or configuration, nothing was started.
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "kvroute KV block index: ingests vLLM KV events, answers prefix matches"
)]
struct Args {
    /// YAML configuration file.
    #[arg(long, short)]
    config: PathBuf,
    /// Write the bound gRPC and admin addresses to this file once serving (for harnesses).
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    kvroute_runtime::logging::init("info");

    let config = match std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read {}", args.config.display()))
        .and_then(|text| Config::from_yaml(&text).map_err(anyhow::Error::from))
    {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvroute-index: {error:#}");
            return ExitCode::from(EX_USAGE);
        }
    };

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvroute-index: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, args.config, args.ready_file)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-index: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: Config, path: PathBuf, ready_file: Option<PathBuf>) -> anyhow::Result<()> {
    let reload_interval = config.reload_interval;
    let server = IndexServer::start(config).await?;
    server.watch_config(path, reload_interval);
    if let Some(path) = ready_file {
        let text = format!(
            "grpc={}\nadmin={}\n",
            server.grpc_addr(),
            server.admin_addr()
        );
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    // A server that fails stops the process (non-zero exit) rather than leaving it half-dead.
    let failure = tokio::select! {
        () = kvroute_runtime::shutdown::signal() => None,
        failure = server.failed() => Some(failure),
    };
    server.shutdown().await;
    match failure {
        None => Ok(()),
        Some(failure) => Err(anyhow::anyhow!(failure)),
    }
}
