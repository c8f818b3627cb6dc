//! Our services as processes: locating the binaries, starting one with its config and ready file, restarting it on the same ports ([`ServerProcess`] for tests that run one alone).

#[allow(clippy::wildcard_imports)]
use super::*;

/// The binaries a stack runs.
#[derive(Debug, Clone)]
pub(super) struct Binaries {
    pub(super) sim: PathBuf,
    pub(super) index: PathBuf,
    pub(super) ext_proc: PathBuf,
    /// Looked up only when the stack runs an agent.
    pub(super) agent: Option<PathBuf>,
}

/// The directory holding our binaries: `bin_dir`, else the current executable's directory (its
/// parent when that is cargo's `deps/`).
pub fn binary_dir(bin_dir: Option<&Path>) -> PathBuf {
    if let Some(dir) = bin_dir {
        return dir.to_path_buf();
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    match exe_dir.file_name() {
        Some(name) if name == "deps" => exe_dir.parent().map(Path::to_path_buf).unwrap_or(exe_dir),
        _ => exe_dir,
    }
}

/// The release build's binaries: beside the test build's profile directory (so under
/// `CARGO_TARGET_DIR` when it is set), `…/release`.
pub fn release_binary_dir() -> PathBuf {
    let debug = binary_dir(None);
    debug
        .parent()
        .map_or_else(|| PathBuf::from("release"), |target| target.join("release"))
}

pub(super) fn locate(dir: &Path, name: &'static str) -> Result<PathBuf, StackError> {
    let path = dir.join(name);
    if path.is_file() {
        return Ok(path);
    }
    let release = dir.file_name().is_some_and(|n| n == "release");
    Err(StackError::MissingBinary {
        name,
        dir: dir.to_path_buf(),
        hint: if release {
            "cargo build --release --bins"
        } else {
            "cargo build --bins"
        },
    })
}

pub(super) fn locate_all(options: &StackOptions) -> Result<Binaries, StackError> {
    let dir = binary_dir(options.bin_dir.as_deref());
    Ok(Binaries {
        sim: locate(&dir, "kvroute-engine-sim")?,
        index: locate(&dir, "kvroute-index")?,
        ext_proc: locate(&dir, "kvroute-ext-proc")?,
        agent: (!options.agent_replicas.is_empty())
            .then(|| locate(&dir, AGENT_NAME))
            .transpose()?,
    })
}

/// What a [`Service`] reports and how it says it is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ServiceKind {
    /// kvroute-index or kvroute-ext-proc: `grpc=` and `admin=` in the ready file, then `/readyz`.
    Server,
    /// A server whose readiness the test watches itself (an index whose replicas become ready
    /// later, or never): the ready file, then only `/healthz`.
    ServerLive,
    /// kvroute-agent: only `admin=` (it listens for nothing else), then `/healthz`.
    Agent,
}

/// One of our services (index, ext-proc or agent) as a process that can be killed and restarted
/// on the same ports (Envoy and ext-proc keep their addresses).
#[derive(Debug)]
pub(super) struct Service {
    pub(super) name: &'static str,
    pub(super) kind: ServiceKind,
    pub(super) binary: PathBuf,
    pub(super) dir: PathBuf,
    /// The config with port 0; after the first start, rewritten with the bound ports.
    pub(super) config: String,
    pub(super) grpc: SocketAddr,
    pub(super) admin: SocketAddr,
    /// The index this process runs itself (ext-proc with `index.embedded`).
    pub(super) embedded_index: Option<EmbeddedIndex>,
    pub(super) guard: Option<ChildGuard>,
    pub(super) starts: u32,
    /// Environment variables set on the process (besides the test's own).
    pub(super) env: Vec<(String, String)>,
}

/// A kvroute-index running inside kvroute-ext-proc.
#[derive(Debug)]
pub(super) struct EmbeddedIndex {
    /// Its config file (ext-proc's `index.embedded`); after the first start, rewritten with the
    /// bound ports like the service's own config.
    pub(super) config_path: PathBuf,
    /// Its listeners, from ext-proc's ready file; `None` before the first start.
    pub(super) listeners: Option<Listeners>,
}

impl Service {
    /// Starts `binary --config <file> --ready-file <file>` and waits for its ready file and
    /// admin `/readyz`. With `embedded_index_config` (the file ext-proc's `index.embedded`
    /// names), also waits for the embedded index's listeners in the ready file and its `/readyz`.
    pub(super) async fn start(
        name: &'static str,
        kind: ServiceKind,
        binary: PathBuf,
        dir: &Path,
        config: String,
        embedded_index_config: Option<PathBuf>,
        env: &[(String, String)],
    ) -> Result<Self, StackError> {
        let unbound: SocketAddr = ([127, 0, 0, 1], 0).into();
        let mut service = Self {
            name,
            kind,
            binary,
            dir: dir.to_path_buf(),
            config,
            grpc: unbound,
            admin: unbound,
            embedded_index: embedded_index_config.map(|config_path| EmbeddedIndex {
                config_path,
                listeners: None,
            }),
            guard: None,
            starts: 0,
            env: env.to_vec(),
        };
        service.spawn().await?;
        // A restart must come back on the same ports: Envoy and ext-proc know these addresses,
        // and the embedded index's are the ones operators and tests were given.
        service.config = pin_ports(
            &service.config,
            Listeners {
                grpc: service.grpc,
                admin: service.admin,
            },
        );
        if let Some(EmbeddedIndex {
            config_path,
            listeners: Some(listeners),
        }) = &service.embedded_index
        {
            let text = std::fs::read_to_string(config_path).map_err(|source| HarnessError::Io {
                path: config_path.clone(),
                source,
            })?;
            write_file(config_path, &pin_ports(&text, *listeners))?;
        }
        Ok(service)
    }

    /// The config file of the current (last) start.
    pub(super) fn config_path(&self) -> PathBuf {
        self.dir.join(format!("{}-{}.yaml", self.name, self.starts))
    }

    pub(super) async fn spawn(&mut self) -> Result<(), StackError> {
        self.starts += 1;
        let file = |suffix: &str| {
            self.dir
                .join(format!("{}-{}.{suffix}", self.name, self.starts))
        };
        let config_path = file("yaml");
        let ready_path = file("ready");
        write_file(&config_path, &self.config)?;
        let embedded = self.embedded_index.is_some();
        let kind = self.kind;
        let mut command = Command::new(&self.binary);
        command
            .arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready_path)
            .envs(self.env.iter().map(|(key, value)| (key, value)));
        let mut guard = ChildGuard::spawn(self.name, command, file("log"))?;
        let name = self.name;
        let ready = try_poll_until(&format!("{name} ready file"), startup_timeout(), || {
            let exited = guard.exited();
            let ready_path = ready_path.clone();
            async move {
                if let Some(status) = exited {
                    return Some(Err(status));
                }
                let text = std::fs::read_to_string(ready_path).ok()?;
                match kind {
                    ServiceKind::Server | ServiceKind::ServerLive => parse_ready_file(&text)
                        .filter(|ready| !embedded || ready.embedded_index.is_some()),
                    ServiceKind::Agent => parse_agent_ready_file(&text),
                }
                .map(Ok)
            }
        })
        .await;
        let ready = match ready {
            Ok(Ok(addresses)) => addresses,
            Ok(Err(status)) => {
                return Err(StackError::Component {
                    component: name,
                    detail: format!("exited with {status} before ready"),
                    log: guard.log(),
                });
            }
            Err(error) => {
                return Err(StackError::Component {
                    component: name,
                    detail: error.to_string(),
                    log: guard.log(),
                });
            }
        };
        let admins = std::iter::once(ready.listeners.admin)
            .chain(ready.embedded_index.map(|index| index.admin));
        let probe = match kind {
            ServiceKind::Server => "readyz",
            ServiceKind::ServerLive | ServiceKind::Agent => "healthz",
        };
        for admin in admins {
            if let Err(error) = wait_for_ok(&format!("http://{admin}/{probe}")).await {
                return Err(StackError::Component {
                    component: name,
                    detail: error.to_string(),
                    log: guard.log(),
                });
            }
        }
        self.grpc = ready.listeners.grpc;
        self.admin = ready.listeners.admin;
        if let Some(index) = &mut self.embedded_index {
            index.listeners = ready.embedded_index;
        }
        self.guard = Some(guard);
        Ok(())
    }

    /// The embedded index's admin listener (`None` without one, or before the first start).
    pub(super) fn embedded_index_admin(&self) -> Option<SocketAddr> {
        self.embedded_index
            .as_ref()
            .and_then(|index| index.listeners)
            .map(|listeners| listeners.admin)
    }

    /// SIGKILL (abrupt failure); waits until the process is gone.
    pub(super) fn kill(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            guard.kill();
            self.keep_log(&guard);
        }
    }

    /// Appends a stopped run's log to the service's history (logs of every run stay readable).
    pub(super) fn keep_log(&self, guard: &ChildGuard) {
        let history = self.dir.join(format!("{}-previous.log", self.name));
        let mut text = std::fs::read_to_string(&history).unwrap_or_default();
        text.push_str(&format!("----- run {} (killed) -----\n", self.starts));
        text.push_str(&guard.log());
        let _ = std::fs::write(history, text);
    }

    pub(super) fn log(&self) -> String {
        let history = self.dir.join(format!("{}-previous.log", self.name));
        let mut text = std::fs::read_to_string(history).unwrap_or_default();
        match &self.guard {
            Some(guard) => text.push_str(&guard.log()),
            None => text.push_str("(not running)\n"),
        }
        text
    }
}

/// A process's gRPC and admin listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Listeners {
    pub(super) grpc: SocketAddr,
    pub(super) admin: SocketAddr,
}

/// What a ready file reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReadyFile {
    /// `grpc=ADDR`, `admin=ADDR` (both kvroute binaries write these).
    pub(super) listeners: Listeners,
    /// `index_grpc=ADDR`, `index_admin=ADDR`: the index ext-proc embeds (`index.embedded`).
    pub(super) embedded_index: Option<Listeners>,
}

pub(super) fn parse_ready_file(text: &str) -> Option<ReadyFile> {
    let field = |key: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .and_then(|value| value.trim().parse().ok())
    };
    let listeners = |grpc: &str, admin: &str| {
        Some(Listeners {
            grpc: field(grpc)?,
            admin: field(admin)?,
        })
    };
    Some(ReadyFile {
        listeners: listeners("grpc", "admin")?,
        embedded_index: listeners("index_grpc", "index_admin"),
    })
}

/// An agent's ready file (`admin=ADDR`): its admin listener, and no gRPC one.
pub(super) fn parse_agent_ready_file(text: &str) -> Option<ReadyFile> {
    let admin = text
        .lines()
        .find_map(|line| line.strip_prefix("admin="))
        .and_then(|value| value.trim().parse().ok())?;
    Some(ReadyFile {
        listeners: Listeners {
            grpc: ([127, 0, 0, 1], 0).into(),
            admin,
        },
        embedded_index: None,
    })
}

/// `config` (a kvroute service or index config) listening where `bound` says instead of port 0.
pub(super) fn pin_ports(config: &str, bound: Listeners) -> String {
    config
        .replace(
            "grpc: \"127.0.0.1:0\"",
            &format!("grpc: \"{}\"", bound.grpc),
        )
        .replace(
            "admin: \"127.0.0.1:0\"",
            &format!("admin: \"{}\"", bound.admin),
        )
}

pub(super) fn write_file(path: &Path, text: &str) -> Result<(), StackError> {
    std::fs::write(path, text).map_err(|source| {
        StackError::from(HarnessError::Io {
            path: path.to_path_buf(),
            source,
        })
    })
}

pub(super) async fn wait_for_ok(url: &str) -> Result<(), HarnessError> {
    try_poll_until(url, startup_timeout(), || async move {
        http::get(url)
            .await
            .ok()
            .filter(|r| r.status.is_success())
            .map(|_| ())
    })
    .await
    .map_err(HarnessError::from)
}

/// kvroute-ext-proc (or kvroute-index) on its own (no Envoy, sims or other kvroute process),
/// for tests that speak to it as Envoy or ext-proc do and watch the process itself (its
/// `/metrics`, its memory in `/proc`, its config file). Dropping it stops the process.
#[derive(Debug)]
pub struct ServerProcess {
    pub(super) service: Service,
    pub(super) _dir: tempfile::TempDir,
}

/// The name most tests know it by: they run kvroute-ext-proc.
pub type ExtProcProcess = ServerProcess;

impl ServerProcess {
    /// Starts kvroute-ext-proc from `bin_dir` (default: next to the current executable) with
    /// `config`, whose `listen` must use port 0 (`grpc: "127.0.0.1:0", admin: "127.0.0.1:0"`),
    /// and waits until it is ready.
    pub async fn start(config: &str, bin_dir: Option<&Path>) -> Result<Self, StackError> {
        Self::start_binary("kvroute-ext-proc", ServiceKind::Server, config, bin_dir).await
    }

    /// [`ServerProcess::start`] for kvroute-index.
    pub async fn start_index(config: &str, bin_dir: Option<&Path>) -> Result<Self, StackError> {
        Self::start_binary("kvroute-index", ServiceKind::Server, config, bin_dir).await
    }

    /// [`ServerProcess::start_index`] that returns once the index listens (and answers
    /// `/healthz`), not waiting for `/readyz`: for tests that watch its replicas become ready (an
    /// agent connecting, a restart's catch-up) or that never make them ready. A
    /// [`ServerProcess::restart`] waits the same way.
    pub async fn start_index_listening(
        config: &str,
        bin_dir: Option<&Path>,
    ) -> Result<Self, StackError> {
        Self::start_binary("kvroute-index", ServiceKind::ServerLive, config, bin_dir).await
    }

    pub(super) async fn start_binary(
        name: &'static str,
        kind: ServiceKind,
        config: &str,
        bin_dir: Option<&Path>,
    ) -> Result<Self, StackError> {
        let binary = locate(&binary_dir(bin_dir), name)?;
        let dir = tempfile::tempdir().map_err(|source| HarnessError::Io {
            path: PathBuf::from("tempdir"),
            source,
        })?;
        let service =
            Service::start(name, kind, binary, dir.path(), config.to_owned(), None, &[]).await?;
        Ok(Self { service, _dir: dir })
    }

    /// The config file the running process reads (rewrite it to make it reload).
    pub fn config_path(&self) -> PathBuf {
        self.service.config_path()
    }

    /// The ext_proc gRPC listener.
    pub fn grpc(&self) -> SocketAddr {
        self.service.grpc
    }

    /// The admin listener.
    pub fn admin(&self) -> SocketAddr {
        self.service.admin
    }

    /// `http://<admin listener>`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin())
    }

    /// SIGKILL (an abrupt failure: no shutdown code runs); returns once the process is gone and
    /// its ports are free.
    pub fn kill(&mut self) {
        self.service.kill();
    }

    /// Starts the process again (after [`ServerProcess::kill`], or killing it first) with the
    /// same config on the same ports, and waits as its first start did.
    pub async fn restart(&mut self) -> Result<(), StackError> {
        self.service.kill();
        self.service.spawn().await
    }

    /// The exit status once the process has exited on its own; `None` while it runs (or after
    /// [`ServerProcess::kill`]).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.service.guard.as_mut().and_then(ChildGuard::exited)
    }

    /// The process id (`None` once stopped).
    pub fn pid(&self) -> Option<u32> {
        self.service.guard.as_ref().map(ChildGuard::id)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.service.log()
    }
}
