//! `kvroute-ext-proc --config kvroute.yaml`: the Envoy ext_proc endpoint picker.
//!
//! Besides `--config` it takes the flags GIE's and llm-d's EPP charts pass, so their manifests run
//! it unchanged: `--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving[=BOOL]`,
//! `--cert-path` override the file (`config::Overrides`); `-v`/`--v` sets the log level when
//! `RUST_LOG` is unset; flags of theirs that have no meaning here are accepted and logged as
//! ignored.

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
    /// ext_proc gRPC port, on all interfaces (GIE: 9002).
    #[arg(long)]
    grpc_port: Option<u16>,
    /// Plaintext gRPC health port for probes, on all interfaces (GIE: 9003).
    #[arg(long)]
    grpc_health_port: Option<u16>,
    /// Admin HTTP port (`/metrics`), on all interfaces (GIE: 9090).
    #[arg(long)]
    metrics_port: Option<u16>,
    /// TLS on the ext_proc port; self-signed unless `--cert-path` or `listen.tls` gives one.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = false)]
    secure_serving: Option<bool>,
    /// Directory with `tls.crt` and `tls.key` (a mounted TLS Secret) for the ext_proc port.
    #[arg(long)]
    cert_path: Option<PathBuf>,
    /// Log verbosity as GIE counts it (0–1 info, 2–3 debug, 4+ trace), unless `RUST_LOG` is set.
    #[arg(short = 'v', long = "v")]
    verbosity: Option<u8>,
    /// GIE/llm-d chart flags without meaning here: accepted so their manifests run, logged.
    #[arg(long, hide = true)]
    zap_encoder: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    enable_pprof: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    metrics_endpoint_auth: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    health_checking: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    ha_enable_leader_election: Option<String>,
}

impl Args {
    fn overrides(&self) -> kvroute_ext_proc::config::Overrides {
        kvroute_ext_proc::config::Overrides {
            grpc_port: self.grpc_port,
            health_port: self.grpc_health_port,
            metrics_port: self.metrics_port,
            secure_serving: self.secure_serving,
            cert_dir: self.cert_path.clone(),
        }
    }

    /// The accepted-but-meaningless flags that were given, for one log line.
    fn ignored(&self) -> Vec<&'static str> {
        [
            ("--zap-encoder", self.zap_encoder.is_some()),
            ("--enable-pprof", self.enable_pprof.is_some()),
            (
                "--metrics-endpoint-auth",
                self.metrics_endpoint_auth.is_some(),
            ),
            ("--health-checking", self.health_checking.is_some()),
            (
                "--ha-enable-leader-election",
                self.ha_enable_leader_election.is_some(),
            ),
        ]
        .into_iter()
        .filter_map(|(flag, given)| given.then_some(flag))
        .collect()
    }

    fn log_filter(&self) -> &'static str {
        match self.verbosity {
            None | Some(0..=1) => "info",
            Some(2..=3) => "debug",
            Some(_) => "trace",
        }
    }
}

/// The tokenizer allocates a small string per pre-token; mimalloc halves what glibc's malloc costs
/// per decision (BENCHMARKS.md, "Picker decisions per CPU second").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    kvroute_runtime::logging::init(args.log_filter());
    kvroute_ext_proc::disable_transparent_huge_pages();
    let ignored = args.ignored();
    if !ignored.is_empty() {
        tracing::info!(flags = ?ignored, "chart flags without meaning for kvroute ignored");
    }
    let overrides = args.overrides();
    let config = match Config::from_file_with(&args.config, &overrides) {
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
            .overrides(overrides)
            .bind()
            .await?;
        if let Some(path) = &args.ready_file {
            write_ready_file(path, &server)?;
        }
        server.serve(kvroute_runtime::shutdown::signal()).await?;
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
    if let Some(health) = server.health_addr() {
        text.push_str(&format!("health={}\n", health?));
    }
    if let Some((grpc, admin)) = server.embedded_index_addrs() {
        text.push_str(&format!("index_grpc={grpc}\nindex_admin={admin}\n"));
    }
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("cannot write the ready file {}", path.display()))
}
