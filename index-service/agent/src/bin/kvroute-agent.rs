//! `kvroute-agent`: mirrors the local engines' KV blocks and streams them to kvroute-index.
//! `kvroute-agent --config agent.yaml` (see `kvroute_agent::config`); the file is reloaded
//! when it changes (`kvroute_agent::engines`).

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::Parser;
use kvroute_agent::{Agent, AgentConfig};

/// sysexits `EX_USAGE`: bad command line or configuration, nothing was started.
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "kvroute agent: mirrors local vLLM KV events, streams them to kvroute-index"
)]
struct Args {
    /// YAML configuration file.
    #[arg(long, short)]
    config: PathBuf,
    /// Write the bound admin address (`admin=ADDR`) to this file once running (for harnesses).
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    kvroute_runtime::logging::init("info");

    let config = match std::fs::read_to_string(&args.config)
        .with_context(|| format!("cannot read {}", args.config.display()))
        .and_then(|text| AgentConfig::from_yaml(&text).map_err(anyhow::Error::from))
    {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvroute-agent: {error:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvroute-agent: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, args.config, args.ready_file)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-agent: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(
    config: AgentConfig,
    path: PathBuf,
    ready_file: Option<PathBuf>,
) -> anyhow::Result<()> {
    let agent = Agent::start_reloading(config, path).await?;
    if let Some(path) = ready_file {
        std::fs::write(&path, format!("admin={}\n", agent.admin_addr()))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    kvroute_runtime::shutdown::signal().await;
    agent.shutdown().await;
    Ok(())
}
