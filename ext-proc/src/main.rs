//! `kvroute-ext-proc --config kvroute.yaml`: the Envoy ext_proc endpoint picker.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
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
    /// Write the bound addresses (`grpc=ADDR\nadmin=ADDR`) to this file once listening, so a
    /// harness can use port 0.
    #[arg(long)]
    ready_file: Option<PathBuf>,
}

/// The tokenizer allocates a small string per pre-token; mimalloc halves what glibc's malloc costs
/// per decision (BENCHMARKS.md, "Picker decisions per CPU second").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        if let Some(path) = &args.ready_file {
            write_ready_file(path, &server)?;
        }
        server.serve(shutdown_signal()).await?;
        Ok::<(), anyhow::Error>(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if matches!(error.downcast_ref(), Some(ServeError::Config(_))) => {
            tracing::error!("invalid configuration: {error:#}");
            ExitCode::from(EX_USAGE)
        }
        Err(error) => {
            tracing::error!("{error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Writes the bound addresses, then renames into place so a poller never reads half a file.
fn write_ready_file(path: &Path, server: &ExtProc) -> anyhow::Result<()> {
    let mut text = format!(
        "grpc={}\nadmin={}\n",
        server.grpc_addr()?,
        server.admin_addr()?
    );
    if let Some((grpc, admin)) = server.embedded_index_addrs() {
        text.push_str(&format!("index_grpc={grpc}\nindex_admin={admin}\n"));
    }
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("cannot write the ready file {}", path.display()))
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
