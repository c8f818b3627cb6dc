//! The `kvroute-ext-proc` process: its command line and how `kvroute_runtime::main` runs it.
//!
//! Besides `--config` it takes the flags GIE's and llm-d's EPP charts pass, so their manifests run
//! it unchanged: `--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving[=BOOL]`,
//! `--cert-path` override the file ([`Overrides`]); `-v`/`--v` sets the log level when
//! `RUST_LOG` is unset; flags of theirs that have no meaning here are accepted and logged as
//! ignored. The ready file lists `grpc=`, `admin=`, then `health=` (`listen.health`) and
//! `index_grpc=` / `index_admin=` (`index.embedded`) when there are such listeners.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kvroute_runtime::process::{
    BoxError, Component, ConfigFile, ErrorChain, Running, ServerArgs, StartError,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, Overrides};
use crate::{ExtProc, ServeError};

/// `kvroute-ext-proc --config kvroute.yaml` and the chart flags.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "KV-cache-aware endpoint picker for Envoy (ext_proc v3)",
    mut_arg("ready_file", |arg| arg.help(
        "Write the bound addresses (`grpc=ADDR\\nadmin=ADDR`) to this file once listening, so a \
         harness can use port 0"
    ))
)]
pub struct Args {
    /// `--config`, `--ready-file`.
    #[command(flatten)]
    server: ServerArgs,
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
    /// The chart flags that override the file (on every reload too).
    pub fn overrides(&self) -> Overrides {
        Overrides {
            grpc_port: self.grpc_port,
            health_port: self.grpc_health_port,
            metrics_port: self.metrics_port,
            secure_serving: self.secure_serving,
            cert_dir: self.cert_path.clone(),
        }
    }

    /// The accepted-but-meaningless flags that were given, for one log line.
    pub fn ignored(&self) -> Vec<&'static str> {
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

    /// The log filter `-v` asks for (`RUST_LOG` wins).
    pub fn log_filter(&self) -> &'static str {
        match self.verbosity {
            None | Some(0..=1) => kvroute_runtime::process::DEFAULT_LOG_FILTER,
            Some(2..=3) => "debug",
            Some(_) => "trace",
        }
    }
}

/// ext-proc as a process.
#[derive(Debug)]
pub struct Process;

impl AsRef<ServerArgs> for Args {
    fn as_ref(&self) -> &ServerArgs {
        &self.server
    }
}

impl ConfigFile for Config {
    fn from_yaml(text: &str) -> Result<Self, kvroute_config::ConfigError> {
        Config::from_yaml(text)
    }
}

impl Component for Process {
    const NAME: &'static str = "kvroute-ext-proc";
    const ABOUT: &'static str = "KV-cache-aware endpoint picker for Envoy (ext_proc v3)";
    type Args = Args;
    type Config = Config;
    type Running = Serving;

    fn log_filter(args: &Args) -> &'static str {
        args.log_filter()
    }

    fn prepare(args: &Args) {
        crate::disable_transparent_huge_pages();
        let ignored = args.ignored();
        if !ignored.is_empty() {
            tracing::info!(flags = ?ignored, "chart flags without meaning for kvroute ignored");
        }
    }

    fn load(args: &Args) -> Result<Config, BoxError> {
        Ok(Config::from_file_with(
            &args.server.config,
            &args.overrides(),
        )?)
    }

    async fn start(config: Config, args: Args) -> Result<Serving, StartError> {
        let overrides = args.overrides();
        let server = ExtProc::builder(config)
            .config_path(args.server.config)
            .overrides(overrides)
            .bind()
            .await
            .map_err(|error| match error {
                // Found wrong only when built (a tokenizer that does not load): still the config.
                ServeError::Config(_) => StartError::config(error),
                error => StartError::failed(error),
            })?;
        let lines = ready_lines(&server).map_err(StartError::failed)?;
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let serve = tasks.spawn(server.serve(stop.clone().cancelled_owned()));
        tasks.close();
        Ok(Serving {
            lines,
            stop,
            tasks,
            serve,
            reported: false,
        })
    }
}

fn ready_lines(server: &ExtProc) -> std::io::Result<Vec<(&'static str, SocketAddr)>> {
    let mut lines = vec![
        ("grpc", server.grpc_addr()?),
        ("admin", server.admin_addr()?),
    ];
    if let Some(health) = server.health_addr() {
        lines.push(("health", health?));
    }
    if let Some((grpc, admin)) = server.embedded_index_addrs() {
        lines.extend([("index_grpc", grpc), ("index_admin", admin)]);
    }
    Ok(lines)
}

/// A serving ext-proc: [`ExtProc::serve`] on a task of its own, stopped by `stop`.
#[derive(Debug)]
pub struct Serving {
    lines: Vec<(&'static str, SocketAddr)>,
    stop: CancellationToken,
    tasks: TaskTracker,
    serve: JoinHandle<Result<(), ServeError>>,
    /// `serve` ended before it was asked to and [`Running::failed`] said why.
    reported: bool,
}

impl Running for Serving {
    fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)> {
        self.lines.clone()
    }

    /// The gRPC server ended before shutdown (it failed, or could not set up TLS).
    async fn failed(&mut self) -> String {
        if self.reported {
            return std::future::pending().await;
        }
        let ended = (&mut self.serve).await;
        self.reported = true;
        match ended {
            Ok(Ok(())) => "the ext_proc server stopped on its own".to_owned(),
            Ok(Err(error)) => ErrorChain(&error).to_string(),
            Err(error) => format!("the ext_proc server task ended: {error}"),
        }
    }

    /// [`ExtProc::serve`]'s phases: health NOT_SERVING and `/readyz` 503, stop accepting, drain
    /// the open streams, stop the background tasks and the embedded index.
    async fn shutdown(self) -> Result<(), BoxError> {
        self.stop.cancel();
        let result = if self.reported {
            // Its end was the failure, reported already.
            Ok(())
        } else {
            match self.serve.await {
                Ok(served) => served.map_err(BoxError::from),
                Err(error) => Err(error.into()),
            }
        };
        self.tasks.wait().await;
        result
    }
}
