//! The `kvroute-ext-proc` process: its command line and how `kvroute_runtime::main` runs it.
//!
//! Besides `--config` it takes the flags GIE's and llm-d's EPP charts pass, so their manifests run
//! it unchanged: `--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving[=BOOL]`,
//! `--cert-path` override the file ([`Overrides`]); `-v`/`--v` or `--log-level` sets the log
//! level when `RUST_LOG` is unset; flags of theirs that have no meaning here are accepted and
//! logged as ignored — their plugin configuration (`--config-file`, `--config-text`) too, which
//! is never read as kvroute's.
//!
//! Without `--config`, `--pool-name NAME [--pool-namespace NS]` (or llm-d's standalone
//! `--endpoint-selector`) builds the configuration from documented defaults
//! ([`ChartPool`]); `--index-address`, `--model`, `--tokenizer-model-dir`,
//! `--tokenizer-render` and `--kubeconfig` (each also from the environment) complete it. With
//! both, the file must discover the pool the flags name ([`Config::check_chart_flags`]).
//!
//! The ready file lists `grpc=`, `admin=`, then `health=` (`listen.health`) and
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

use crate::config::{ChartPool, ChartSelection, Config, DEFAULT_POOL_GROUP, Overrides};
use crate::{ExtProc, ServeError};

/// `kvroute-ext-proc --config kvroute.yaml` and the chart flags.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "KV-cache-aware endpoint picker for Envoy (ext_proc v3)",
    mut_arg("ready_file", |arg| arg.help(
        "Write the bound addresses (`grpc=ADDR\\nadmin=ADDR`) to this file once listening, so a \
         harness can use port 0"
    )),
    mut_arg("config", |arg| arg
        .required(false)
        .required_unless_present_any(["pool_name", "endpoint_selector"])),
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
    /// Log level (`trace`, `debug`, `info`, `warn`, `error`) unless `RUST_LOG` or `-v` is set.
    #[arg(long, value_parser = ["trace", "debug", "info", "warn", "error"])]
    log_level: Option<String>,
    /// Without `--config`: route for this GIE InferencePool, with the defaults README's GIE
    /// section lists. With `--config`: the file must discover it.
    #[arg(long)]
    pool_name: Option<String>,
    /// The InferencePool's namespace (default: `NAMESPACE` or `POD_NAMESPACE` from the
    /// environment, else the client's: in a pod, its service account's).
    #[arg(long)]
    pool_namespace: Option<String>,
    /// The InferencePool's API group; only GIE v1's is discovered.
    #[arg(long, default_value = DEFAULT_POOL_GROUP)]
    pool_group: String,
    /// Without `--config`, instead of `--pool-name` (llm-d standalone): pods with these labels,
    /// `k=v[,k=v]`.
    #[arg(long, requires = "endpoint_target_ports")]
    endpoint_selector: Option<String>,
    /// With `--endpoint-selector`: the port routed to.
    #[arg(long, requires = "endpoint_selector")]
    endpoint_target_ports: Option<String>,
    /// Without `--config`: kvroute-index addresses (`index.addresses`), comma-separated; with a
    /// tokenizer, decisions are precise.
    #[arg(long, env = "KVROUTE_INDEX_ADDRESS", value_delimiter = ',')]
    index_address: Vec<String>,
    /// Without `--config`: the pool's served model names (`pools[].models`), comma-separated;
    /// default: every model is the pool's.
    #[arg(long = "model", env = "KVROUTE_POOL_MODELS", value_delimiter = ',')]
    models: Vec<String>,
    /// Without `--config`: a Hugging Face model folder to tokenize with
    /// (`pools[].tokenizer.model_dir`). Without a tokenizer, decisions use the load tier.
    #[arg(
        long,
        env = "KVROUTE_TOKENIZER_MODEL_DIR",
        conflicts_with = "tokenizer_render"
    )]
    tokenizer_model_dir: Option<PathBuf>,
    /// Without `--config`: an engine's base URL whose render endpoint tokenizes
    /// (`pools[].tokenizer.render`, e.g. llm-d's `vllm-render` sidecar `http://127.0.0.1:8000`).
    #[arg(long, env = "KVROUTE_TOKENIZER_RENDER")]
    tokenizer_render: Option<String>,
    /// Without `--config`: a kubeconfig for discovery instead of the pod's service account.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// GIE's log encoder: `json` logs JSON lines (`log.format: json`), `console` text.
    #[arg(long, value_parser = ["json", "console"])]
    zap_encoder: Option<String>,
    /// GIE's plugin configuration (not kvroute's format: never read).
    #[arg(long, hide = true)]
    config_file: Option<PathBuf>,
    #[arg(long, hide = true)]
    config_text: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    tracing: Option<String>,
    #[arg(long, hide = true)]
    total_queued_requests_metric: Option<String>,
    #[arg(long, hide = true)]
    kv_cache_usage_percentage_metric: Option<String>,
    #[arg(long, hide = true)]
    lora_info_metric: Option<String>,
    #[arg(long, hide = true)]
    total_running_requests_metric: Option<String>,
    #[arg(long, hide = true)]
    cache_info_metric: Option<String>,
    #[arg(long, hide = true)]
    model_server_metrics_scheme: Option<String>,
    #[arg(long, hide = true)]
    model_server_metrics_path: Option<String>,
    #[arg(long, hide = true)]
    model_server_metrics_port: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    model_server_metrics_https_insecure_skip_verify: Option<String>,
    #[arg(long, hide = true)]
    refresh_metrics_interval: Option<String>,
    #[arg(long, hide = true)]
    refresh_prometheus_metrics_interval: Option<String>,
    #[arg(long, hide = true)]
    metrics_staleness_threshold: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true")]
    enable_cert_reload: Option<String>,
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
            log_format: self.zap_encoder.as_deref().map(|encoder| match encoder {
                "json" => kvroute_config::LogFormat::Json,
                _ => kvroute_config::LogFormat::Text,
            }),
        }
    }

    /// The pool the chart flags name (`--pool-name` or `--endpoint-selector`), if any;
    /// `env` looks up the namespace's environment variables.
    pub fn chart_pool(&self, env: impl Fn(&str) -> Option<String>) -> Option<ChartPool> {
        let selection = match (&self.endpoint_selector, &self.pool_name) {
            (Some(labels), name) => ChartSelection::Selector {
                labels: labels.clone(),
                ports: self.endpoint_target_ports.clone().unwrap_or_default(),
                name: name.clone(),
            },
            (None, Some(name)) => ChartSelection::InferencePool {
                name: name.clone(),
                group: self.pool_group.clone(),
            },
            (None, None) => return None,
        };
        let namespace = self
            .pool_namespace
            .clone()
            .or_else(|| env("NAMESPACE"))
            .or_else(|| env("POD_NAMESPACE"))
            .filter(|ns| !ns.is_empty());
        Some(ChartPool {
            selection,
            namespace,
            kubeconfig: self.kubeconfig.clone(),
            index_addresses: self.index_address.clone(),
            models: self.models.clone(),
            tokenizer_model_dir: self.tokenizer_model_dir.clone(),
            tokenizer_render: self.tokenizer_render.clone(),
        })
    }

    /// The accepted-but-meaningless flags that were given, for one log line.
    pub fn ignored(&self) -> Vec<&'static str> {
        [
            (
                "--config-file (GIE plugin config)",
                self.config_file.is_some(),
            ),
            (
                "--config-text (GIE plugin config)",
                self.config_text.is_some(),
            ),
            ("--tracing", self.tracing.is_some()),
            (
                "--total-queued-requests-metric",
                self.total_queued_requests_metric.is_some(),
            ),
            (
                "--kv-cache-usage-percentage-metric",
                self.kv_cache_usage_percentage_metric.is_some(),
            ),
            ("--lora-info-metric", self.lora_info_metric.is_some()),
            (
                "--total-running-requests-metric",
                self.total_running_requests_metric.is_some(),
            ),
            ("--cache-info-metric", self.cache_info_metric.is_some()),
            (
                "--model-server-metrics-scheme",
                self.model_server_metrics_scheme.is_some(),
            ),
            (
                "--model-server-metrics-path",
                self.model_server_metrics_path.is_some(),
            ),
            (
                "--model-server-metrics-port",
                self.model_server_metrics_port.is_some(),
            ),
            (
                "--model-server-metrics-https-insecure-skip-verify",
                self.model_server_metrics_https_insecure_skip_verify
                    .is_some(),
            ),
            (
                "--refresh-metrics-interval",
                self.refresh_metrics_interval.is_some(),
            ),
            (
                "--refresh-prometheus-metrics-interval",
                self.refresh_prometheus_metrics_interval.is_some(),
            ),
            (
                "--metrics-staleness-threshold",
                self.metrics_staleness_threshold.is_some(),
            ),
            ("--enable-cert-reload", self.enable_cert_reload.is_some()),
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

    /// The log filter `-v` or `--log-level` asks for (`RUST_LOG` wins, then `-v`).
    pub fn log_filter(&self) -> &'static str {
        match (self.verbosity, self.log_level.as_deref()) {
            (Some(0..=1), _) | (None, None | Some("info")) => {
                kvroute_runtime::process::DEFAULT_LOG_FILTER
            }
            (Some(2..=3), _) | (None, Some("debug")) => "debug",
            (Some(_), _) | (None, Some("trace")) => "trace",
            (None, Some("warn")) => "warn,kube_runtime::watcher=error",
            (None, Some(_)) => "error",
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

    fn log_format(&self) -> kvroute_config::LogFormat {
        self.log_format
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
        let overrides = args.overrides();
        let chart = args.chart_pool(|name| std::env::var(name).ok());
        match (&args.server.config, chart) {
            (Some(path), None) => Ok(Config::from_file_with(path, &overrides)?),
            (Some(path), Some(pool)) => {
                let config = Config::from_file_with(path, &overrides)?;
                config.check_chart_flags(&pool)?;
                Ok(config)
            }
            (None, Some(pool)) => Ok(Config::from_chart_flags(&pool, &overrides)?),
            (None, None) => Err("no configuration: give --config FILE or --pool-name NAME".into()),
        }
    }

    async fn start(config: Config, args: Args) -> Result<Serving, StartError> {
        // Said here, not in `load`: logging starts after the config is loaded (its `log.format`).
        if args.server.config.is_none()
            && let Some(pool) = args.chart_pool(|name| std::env::var(name).ok())
        {
            tracing::info!(
                pool = pool.name(),
                namespace = pool.namespace.as_deref().unwrap_or("(the client's)"),
                best_tier = pool.best_tier(),
                "no --config: configuration built from the chart flags"
            );
        }
        let overrides = args.overrides();
        let mut builder = ExtProc::builder(config).overrides(overrides);
        if let Some(path) = args.server.config {
            builder = builder.config_path(path);
        }
        let server = builder.bind().await.map_err(|error| match error {
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

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, FromArgMatches as _};

    use super::*;

    /// Parses as `kvroute_runtime::main` does (the command with its `mut_arg`s).
    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        let matches = Args::command().try_get_matches_from(
            std::iter::once("kvroute-ext-proc").chain(argv.iter().copied()),
        )?;
        Args::from_arg_matches(&matches)
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// GIE's chart: `--pool-name`, `--pool-group` (alpha pools), `--zap-encoder`, `--log-level`,
    /// `--config-file`; llm-d's: `--pool-namespace`, `--pool-group`, `--tracing=false`,
    /// `--ha-enable-leader-election`, `--grpc-health-port`.
    #[test]
    fn the_charts_command_lines_parse_without_a_config_file() {
        let gie = parse(&[
            "--pool-name",
            "llama",
            "--zap-encoder",
            "json",
            "--log-level",
            "error",
            "--config-file",
            "/config/default-plugins.yaml",
            "--total-queued-requests-metric",
            "nv_trt_llm_request_metrics{request_type=waiting}",
            "--lora-info-metric",
            "",
        ])
        .unwrap();
        assert_eq!(gie.server.config, None);
        assert_eq!(gie.log_filter(), "error");
        let pool = gie.chart_pool(no_env).unwrap();
        assert_eq!(
            pool.selection,
            ChartSelection::InferencePool {
                name: "llama".into(),
                group: DEFAULT_POOL_GROUP.into()
            }
        );
        assert_eq!(pool.namespace, None);
        assert!(gie.ignored().contains(&"--config-file (GIE plugin config)"));
        assert_eq!(
            gie.overrides().log_format,
            Some(kvroute_config::LogFormat::Json),
            "--zap-encoder json logs JSON lines"
        );
        let config = Config::from_chart_flags(&pool, &gie.overrides()).unwrap();
        assert_eq!(config.log_format, kvroute_config::LogFormat::Json);

        let llm_d = parse(&[
            "--pool-name",
            "llama",
            "--pool-namespace",
            "llm",
            "--pool-group",
            "inference.networking.k8s.io",
            "--zap-encoder",
            "json",
            "--config-file",
            "/config/p.yaml",
            "--ha-enable-leader-election",
            "--grpc-health-port",
            "9003",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
            "--secure-serving=false",
            "--refresh-metrics-interval=50ms",
            "--model-server-metrics-path=/metrics",
            "--enable-cert-reload",
        ])
        .unwrap();
        assert_eq!(
            llm_d.chart_pool(no_env).unwrap().namespace.as_deref(),
            Some("llm")
        );
        assert_eq!(llm_d.overrides().secure_serving, Some(false));
        assert_eq!(llm_d.overrides().health_port, Some(9003));
        assert!(llm_d.ignored().contains(&"--tracing"));

        let standalone = parse(&[
            "--endpoint-selector",
            "app=vllm",
            "--endpoint-target-ports",
            "8000",
        ])
        .unwrap();
        assert!(matches!(
            standalone.chart_pool(no_env).unwrap().selection,
            ChartSelection::Selector { .. }
        ));
    }

    #[test]
    fn the_namespace_comes_from_the_flag_then_the_environment() {
        let args = parse(&["--pool-name", "p"]).unwrap();
        let env = |name: &str| (name == "POD_NAMESPACE").then(|| "from-pod".to_owned());
        assert_eq!(
            args.chart_pool(env).unwrap().namespace.as_deref(),
            Some("from-pod")
        );
        let both = |name: &str| Some(format!("{name}-value"));
        assert_eq!(
            args.chart_pool(both).unwrap().namespace.as_deref(),
            Some("NAMESPACE-value"),
            "GIE's chart sets NAMESPACE"
        );
        let flagged = parse(&["--pool-name", "p", "--pool-namespace", "flag"]).unwrap();
        assert_eq!(
            flagged.chart_pool(both).unwrap().namespace.as_deref(),
            Some("flag")
        );
    }

    #[test]
    fn a_config_file_or_a_pool_is_required_and_flags_are_checked() {
        assert!(parse(&[]).is_err());
        assert!(
            parse(&["--config", "k.yaml"])
                .unwrap()
                .chart_pool(no_env)
                .is_none()
        );
        assert!(parse(&["--pool-name", "p", "--log-level", "loud"]).is_err());
        assert!(
            parse(&["--endpoint-selector", "app=x"]).is_err(),
            "needs its ports"
        );
        let indexed = parse(&[
            "--pool-name",
            "p",
            "--index-address",
            "http://a:9460,http://b:9460",
            "--model",
            "m",
            "--tokenizer-model-dir",
            "/models/m",
        ])
        .unwrap();
        let pool = indexed.chart_pool(no_env).unwrap();
        assert_eq!(pool.index_addresses, ["http://a:9460", "http://b:9460"]);
        assert_eq!(pool.models, ["m"]);
        assert_eq!(pool.best_tier(), "precise");
        assert!(
            parse(&[
                "--pool-name",
                "p",
                "--tokenizer-model-dir",
                "/m",
                "--tokenizer-render",
                "http://r"
            ])
            .is_err()
        );
    }
}
