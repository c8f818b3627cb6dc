//! The process around a kvroute server: what `kvroute-index`, `kvroute-agent` and
//! `kvroute-ext-proc` do from `main` to their exit code, once, for any [`Component`].
//!
//! [`main`] parses the command line, loads the config, builds the tokio runtime, starts logging
//! (the config's `log.format`; OTLP export when `OTEL_EXPORTER_OTLP_*` asks for it), starts the
//! component, writes the `--ready-file`, waits for SIGTERM/Ctrl-C or for the component
//! to fail, shuts it down and returns the exit code:
//!
//! | exit | when |
//! |------|------|
//! | 0 | stopped by the signal, shutdown clean |
//! | 1 | could not start (bind, TLS, …), could not write the ready file, a server failed, or shutdown failed |
//! | 2 | bad command line (clap's own usage error) |
//! | 64 ([`EX_USAGE`]) | the config was refused (unreadable, invalid, or refused at start), or an `OTEL_*` variable; nothing was bound |
//!
//! Every refusal and failure is one `tracing` line on stderr; a refused config's is
//! `invalid configuration: <why>`.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// sysexits `EX_USAGE`: bad configuration (or command line); nothing was started.
pub const EX_USAGE: u8 = 64;
/// sysexits `EX_DATAERR`: the input data was not what the command accepts.
pub const EX_DATAERR: u8 = 65;

/// The log filter of a component at its default verbosity: `info`, except kube-rs's watcher,
/// which warns on every attempt of a list the API server refuses with 403; kvroute-discovery
/// logs such a failure itself, once when it starts and once a minute while it lasts.
pub const DEFAULT_LOG_FILTER: &str = "info,kube_runtime::watcher=error";

/// Any error, boxed: components keep their own error types, the process only reports them.
pub type BoxError = Box<dyn Error + Send + Sync + 'static>;

/// The flags every kvroute server takes: a component's whole command line, or flattened into it
/// (`#[command(flatten)]`) with flags of its own.
#[derive(Debug, Clone, clap::Parser)]
#[command(version)]
pub struct ServerArgs {
    /// Config file (YAML); reloaded when it changes. Required (clap refuses a command line
    /// without it) unless a component makes it optional with `mut_arg`, as ext-proc does for a
    /// configuration built from GIE's chart flags.
    #[arg(long, short, required = true)]
    pub config: Option<PathBuf>,
    /// Write the bound addresses (`key=ADDR` lines) to this file once listening, so a harness can
    /// use port 0.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
}

impl AsRef<ServerArgs> for ServerArgs {
    fn as_ref(&self) -> &ServerArgs {
        self
    }
}

/// A component's validated configuration, from the text of its file.
pub trait ConfigFile: Sized {
    /// Parses and validates the whole file; the error names the field path.
    fn from_yaml(text: &str) -> Result<Self, kvroute_config::ConfigError>;

    /// How the process logs (its `log.format`); read once, at start.
    fn log_format(&self) -> kvroute_config::LogFormat {
        kvroute_config::LogFormat::Text
    }
}

/// A kvroute server as the process runs it.
pub trait Component {
    /// The binary's name, for messages and `--help` (`kvroute-index`).
    const NAME: &'static str;
    /// One line of what it is, for `--help`.
    const ABOUT: &'static str;
    /// Its command line: [`ServerArgs`], or a parser that flattens them.
    type Args: clap::Parser + AsRef<ServerArgs>;
    /// Its validated configuration.
    type Config: ConfigFile;
    /// It, running.
    type Running: Running;

    /// The log filter when `RUST_LOG` is unset: [`DEFAULT_LOG_FILTER`].
    fn log_filter(_args: &Self::Args) -> &'static str {
        DEFAULT_LOG_FILTER
    }

    /// Runs once logging is up (the config has been read, for its `log.format`, but a refused
    /// one is reported only after this): process-wide settings, notes about the command line.
    fn prepare(_args: &Self::Args) {}

    /// Reads and validates the config file (`--config`). An error exits [`EX_USAGE`], nothing
    /// started.
    fn load(args: &Self::Args) -> Result<Self::Config, BoxError> {
        let path = args
            .as_ref()
            .config
            .as_deref()
            .ok_or("no configuration: --config FILE is required")?;
        let text = read_config(path)?;
        Ok(Self::Config::from_yaml(&text)?)
    }

    /// Binds the listeners and starts serving (and following the config file, when the component
    /// reloads it). Returns once every listener is bound, so the ready file it leads to is true.
    fn start(
        config: Self::Config,
        args: Self::Args,
    ) -> impl Future<Output = Result<Self::Running, StartError>>;
}

/// A started [`Component`].
pub trait Running {
    /// The bound addresses the ready file lists, as `key=ADDR` lines in this order. Harnesses
    /// parse these keys (`grpc`, `admin`, …): they are an interface.
    fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)>;

    /// Resolves, with why, when a part the process cannot run without has failed (a server
    /// died): the process then shuts down and exits 1 rather than run half-dead. Pending forever
    /// otherwise. Cancel-safe.
    fn failed(&mut self) -> impl Future<Output = String>;

    /// Phased: stop being ready, stop accepting, drain what is in flight, stop the tasks.
    fn shutdown(self) -> impl Future<Output = Result<(), BoxError>>;
}

/// Why a [`Component`] did not start.
#[derive(Debug)]
pub enum StartError {
    /// The configuration was refused, found wrong only when acted on (a tokenizer file that does
    /// not load): exits [`EX_USAGE`] like a config that does not parse.
    Config(BoxError),
    /// Anything else (a port in use, TLS refused): exits 1.
    Failed(BoxError),
}

impl StartError {
    /// [`StartError::Config`].
    pub fn config(error: impl Into<BoxError>) -> Self {
        Self::Config(error.into())
    }

    /// [`StartError::Failed`].
    pub fn failed(error: impl Into<BoxError>) -> Self {
        Self::Failed(error.into())
    }
}

/// The config file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {}", path.display())]
pub struct ReadConfigError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// The text of the config file at `path`.
pub fn read_config(path: &Path) -> Result<String, ReadConfigError> {
    std::fs::read_to_string(path).map_err(|source| ReadConfigError {
        path: path.to_path_buf(),
        source,
    })
}

/// An error and its sources on one line, `outer: cause: root cause`.
#[derive(Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// The whole process for component `C`: see the [module docs](self) for what it does and the
/// exit codes.
pub fn main<C: Component>() -> ExitCode {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let matches = C::Args::command()
        .name(C::NAME)
        .bin_name(C::NAME)
        .about(C::ABOUT)
        .get_matches();
    let args = match C::Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(error) => error.exit(),
    };
    // The config first: it says how to log (`log.format`). A refused one is reported once
    // logging is up, in text.
    let config = C::load(&args);
    let format = config
        .as_ref()
        .map_or(kvroute_config::LogFormat::Text, ConfigFile::log_format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build();
    let otlp = crate::telemetry::OtlpSettings::from_env(|name| std::env::var(name).ok(), C::NAME);
    // The exporter's connections are built on the runtime they run on.
    let telemetry = {
        let _entered = runtime.as_ref().ok().map(tokio::runtime::Runtime::enter);
        let exporting = otlp.as_ref().ok().and_then(Option::as_ref);
        crate::logging::init_with(
            C::log_filter(&args),
            format,
            exporting.filter(|_| runtime.is_ok()),
        )
    };
    C::prepare(&args);
    let config = match config {
        Ok(config) => config,
        Err(error) => return config_refused(&*error),
    };
    let otlp = match otlp {
        Ok(otlp) => otlp,
        Err(error) => return config_refused(&error),
    };
    let telemetry = match telemetry {
        Ok(telemetry) => telemetry,
        Err(error) => return config_refused(&error),
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!(%error, "cannot start the tokio runtime");
            return ExitCode::FAILURE;
        }
    };
    if let Some(otlp) = &otlp {
        tracing::info!(
            endpoint = %otlp.endpoint,
            protocol = ?otlp.protocol,
            sampler = ?otlp.sampler,
            service_name = %otlp.service_name,
            "exporting spans (OTLP)"
        );
    }
    let code = runtime.block_on(run::<C>(config, args, crate::shutdown::signal()));
    // The runtime still runs the exporter's connections: the last spans leave now.
    telemetry.shutdown();
    code
}

/// [`main`] from a loaded config on: starts `C`, writes the ready file, serves until `stop`
/// resolves or `C` fails, shuts it down.
pub async fn run<C: Component>(
    config: C::Config,
    args: C::Args,
    stop: impl Future<Output = ()>,
) -> ExitCode {
    let ready_file = args.as_ref().ready_file.clone();
    let mut running = match C::start(config, args).await {
        Ok(running) => running,
        Err(StartError::Config(error)) => return config_refused(&*error),
        Err(StartError::Failed(error)) => {
            tracing::error!("{} cannot start: {}", C::NAME, ErrorChain(&*error));
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = ready_file
        && let Err(error) = write_ready_file(&path, &running.ready_lines())
    {
        tracing::error!(
            "cannot write the ready file {}: {error}; stopping",
            path.display()
        );
        if let Err(error) = running.shutdown().await {
            tracing::error!("{} stopped with an error: {}", C::NAME, ErrorChain(&*error));
        }
        return ExitCode::FAILURE;
    }
    let failure = tokio::select! {
        () = stop => None,
        failure = running.failed() => Some(failure),
    };
    if let Some(failure) = &failure {
        tracing::error!("{failure}; {} stops", C::NAME);
    }
    let stopped = running.shutdown().await;
    if let Err(error) = &stopped {
        tracing::error!(
            "{} stopped with an error: {}",
            C::NAME,
            ErrorChain(&**error)
        );
    }
    if failure.is_none() && stopped.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The one report of a refused config.
fn config_refused(error: &(dyn Error + 'static)) -> ExitCode {
    tracing::error!("invalid configuration: {}", ErrorChain(error));
    ExitCode::from(EX_USAGE)
}

/// Writes `key=ADDR` lines next to `path`, then renames into place, so a poller never reads
/// half a file.
pub fn write_ready_file(path: &Path, lines: &[(&str, SocketAddr)]) -> std::io::Result<()> {
    let text: String = lines
        .iter()
        .map(|(key, addr)| format!("{key}={addr}\n"))
        .collect();
    let partial = path.with_extension("partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use clap::Parser;

    use super::*;

    #[test]
    fn the_ready_file_appears_whole_with_one_line_per_address() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index.ready");
        let lines = [
            ("grpc", SocketAddr::from(([127, 0, 0, 1], 1))),
            ("admin", SocketAddr::from(([0, 0, 0, 0], 2))),
        ];
        write_ready_file(&path, &lines).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "grpc=127.0.0.1:1\nadmin=0.0.0.0:2\n"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(left, ["index.ready"], "the partial file was renamed");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn an_error_chain_is_one_line() {
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(ErrorChain(&error).to_string(), "outer: inner");
    }

    /// What the test component does, and what the process did to it.
    #[derive(Debug, Default)]
    struct Script {
        start: Option<&'static str>,
        fail_after_start: bool,
        shutdowns: AtomicUsize,
    }

    struct TestComponent;

    struct TestRunning {
        script: Arc<Script>,
    }

    impl ConfigFile for Arc<Script> {
        fn from_yaml(_text: &str) -> Result<Self, kvroute_config::ConfigError> {
            Err(kvroute_config::ConfigError::at("script", "unused"))
        }
    }

    impl Component for TestComponent {
        const NAME: &'static str = "kvroute-test";
        const ABOUT: &'static str = "a component for the process's tests";
        type Args = ServerArgs;
        type Config = Arc<Script>;
        type Running = TestRunning;

        async fn start(script: Arc<Script>, _args: ServerArgs) -> Result<TestRunning, StartError> {
            match script.start {
                Some("config") => Err(StartError::config("tokenizer missing")),
                Some(_) => Err(StartError::failed("port in use")),
                None => Ok(TestRunning { script }),
            }
        }
    }

    impl Running for TestRunning {
        fn ready_lines(&self) -> Vec<(&'static str, SocketAddr)> {
            vec![("admin", SocketAddr::from(([127, 0, 0, 1], 9)))]
        }

        async fn failed(&mut self) -> String {
            if self.script.fail_after_start {
                "admin server failed".to_owned()
            } else {
                std::future::pending().await
            }
        }

        async fn shutdown(self) -> Result<(), BoxError> {
            self.script.shutdowns.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    fn args(ready_file: Option<&Path>) -> ServerArgs {
        let mut argv = vec![
            "test".to_owned(),
            "--config".to_owned(),
            "c.yaml".to_owned(),
        ];
        if let Some(path) = ready_file {
            argv.push(format!("--ready-file={}", path.display()));
        }
        ServerArgs::parse_from(argv)
    }

    #[tokio::test]
    async fn exit_codes_say_how_the_process_ended() {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");

        let clean = Arc::new(Script::default());
        let code = run::<TestComponent>(Arc::clone(&clean), args(Some(&ready)), async {}).await;
        assert_eq!(code, ExitCode::SUCCESS);
        assert_eq!(clean.shutdowns.load(Ordering::Relaxed), 1);
        assert_eq!(
            std::fs::read_to_string(&ready).unwrap(),
            "admin=127.0.0.1:9\n"
        );

        let failing = Arc::new(Script {
            fail_after_start: true,
            ..Script::default()
        });
        let code =
            run::<TestComponent>(Arc::clone(&failing), args(None), std::future::pending()).await;
        assert_eq!(code, ExitCode::FAILURE);
        assert_eq!(failing.shutdowns.load(Ordering::Relaxed), 1, "shut down");

        let refused = Arc::new(Script {
            start: Some("config"),
            ..Script::default()
        });
        let code = run::<TestComponent>(refused, args(None), async {}).await;
        assert_eq!(code, ExitCode::from(EX_USAGE));

        let unbound = Arc::new(Script {
            start: Some("bind"),
            ..Script::default()
        });
        let code = run::<TestComponent>(unbound, args(None), async {}).await;
        assert_eq!(code, ExitCode::FAILURE);

        let unwritable = Arc::new(Script::default());
        let nowhere = dir.path().join("missing-dir").join("ready");
        let code =
            run::<TestComponent>(Arc::clone(&unwritable), args(Some(&nowhere)), async {}).await;
        assert_eq!(code, ExitCode::FAILURE);
        assert_eq!(unwritable.shutdowns.load(Ordering::Relaxed), 1, "shut down");
    }
}
