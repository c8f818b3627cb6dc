//! `kvroute-ext-proc --config kvroute.yaml`: the Envoy ext_proc endpoint picker.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvroute_ext_proc::{Config, ExtProc, ServeError};

/// Exit code for a bad configuration (sysexits `EX_USAGE`).
const EX_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "KV-cache-aware endpoint picker for Envoy (ext_proc v3)"
)]
struct Args {
    /// Config file (YAML); reloaded when it changes.
    #[arg(long, short)]
    config: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = match Config::from_file(&args.config) {
        Ok(config) => config,
        Err(error) => {
            tracing::error!("invalid configuration: {:#}", anyhow::Error::from(error));
            return ExitCode::from(EX_USAGE);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the tokio runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let server = ExtProc::builder(config)
            .config_path(args.config)
            .bind()
            .await?;
        server.serve(shutdown_signal()).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error @ ServeError::Config(_)) => {
            tracing::error!("invalid configuration: {:#}", anyhow::Error::from(error));
            ExitCode::from(EX_USAGE)
        }
        Err(error) => {
            tracing::error!("{:#}", anyhow::Error::from(error));
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}
