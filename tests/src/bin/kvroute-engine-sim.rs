//! `kvroute-engine-sim`: one simulated vLLM replica (see `kvroute_tests::sim`).
//!
//! Prints one line `{"http": ..., "kv_events": ..., "replay": ...}` on stdout once every socket is
//! bound (and writes it to `--ready-file`), then serves until SIGTERM/SIGINT.

use std::process::ExitCode;

use clap::Parser as _;
use kvroute_tests::sim::{EngineSim, SimArgs, SimConfig};

/// sysexits `EX_USAGE`: bad flags, nothing was bound.
const EX_USAGE: u8 = 64;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let config = match SimConfig::try_from(SimArgs::parse()) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("kvroute-engine-sim: {error:#}");
            return ExitCode::from(EX_USAGE);
        }
    };
    match run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute-engine-sim: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: SimConfig) -> anyhow::Result<()> {
    let ready_file = config.ready_file.clone();
    let sim = EngineSim::start(config).await?;
    let line = serde_json::to_string(sim.ready_info())?;
    if let Some(path) = ready_file {
        // Write then rename, so a harness polling for the file never reads half of it.
        let partial = path.with_extension("partial");
        std::fs::write(&partial, &line)?;
        std::fs::rename(&partial, &path)?;
    }
    #[expect(
        clippy::print_stdout,
        reason = "the ready line is this binary's stdout protocol"
    )]
    {
        println!("{line}");
    }
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate() => {}
    }
    tracing::info!("shutting down");
    sim.shutdown().await;
    Ok(())
}

async fn terminate() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut signal) => {
            signal.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}
