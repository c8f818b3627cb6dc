//! Everything the Envoy benches run in process besides Envoy: the engine doubles (upstreams and
//! their KV-event publishers), kvroute-index, the fake ext_procs and kvroute-ext-proc.

use super::*;

/// Everything in-process besides Envoy; stopped on drop.
pub(crate) struct Backends {
    pub(crate) upstreams: Vec<SocketAddr>,
    /// The harness's fake ext_procs: an empty answer to every message, and the upstreams in turn
    /// in kvroute-ext-proc's shapes (what Envoy spends obeying an endpoint picker, so
    /// `kvroute / fixed` is the cost of kvroute's decision alone).
    pub(crate) noop: FakeExtProc,
    pub(crate) fixed: FakeExtProc,
    /// kvroute-ext-proc as `ExtProc::serve` runs it.
    pub(crate) kvroute: SocketAddr,
    pub(crate) kvroute_admin: SocketAddr,
    pub(crate) kvroute_embedded: SocketAddr,
    pub(crate) kvroute_embedded_admin: SocketAddr,
    /// Admin address of the index each kvroute-ext-proc asks: the in-process kvroute-index
    /// (gRPC variant) and the embedded one.
    pub(crate) index_admin: SocketAddr,
    pub(crate) embedded_index_admin: SocketAddr,
    /// Admin address of a second kvroute-ext-proc on the same kvroute-index, on no listener
    /// (`--peer`): the gRPC variant then shares every decision with it (`peers`).
    pub(crate) peer_admin: Option<SocketAddr>,
    stop: CancellationToken,
    pub(crate) tasks: TaskTracker,
    /// The engines' KV-event publishers (both indexes subscribe to them).
    pub(crate) publishers: Vec<MockVllmPublisher>,
    _index: kvroute_index::server::IndexServer,
    _dir: tempfile::TempDir,
}

impl Drop for Backends {
    fn drop(&mut self) {
        self.stop.cancel();
        self.tasks.close();
    }
}

impl Backends {
    /// The engine doubles on this runtime; the ext_procs and kvroute-index on `ext_procs`.
    pub(crate) async fn start(
        with_index: bool,
        with_peer: bool,
        prompts: &PromptSource,
        ext_procs: &tokio::runtime::Handle,
    ) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let mut upstreams = Vec::new();
        for i in 0..2 {
            upstreams.push(start_upstream(i, &tasks, &stop).await?);
        }
        let noop = FakeExtProc::start(FakeRouting::Noop);
        let noop = on_ext_procs(ext_procs, "the no-op ext_proc", noop).await?;
        let fixed_turns =
            FakeRouting::RoundRobin(upstreams.iter().map(ToString::to_string).collect());
        let fixed = FakeExtProc::start(fixed_turns);
        let fixed = on_ext_procs(ext_procs, "the fixed ext_proc", fixed).await?;

        // The index follows two (silent) engines; kvroute-ext-proc asks it on every decision.
        let (publishers, index_replicas) = start_engines(2).await?;
        let index_yaml = index_yaml(&index_replicas, prompts.block_size);
        let index_config = kvroute_index::config::Config::from_yaml(&index_yaml)?;
        let index = kvroute_index::server::IndexServer::start(index_config);
        let index = on_ext_procs(ext_procs, "kvroute-index", index).await?;
        // The embedded variant runs the same index config inside kvroute-ext-proc.
        let dir = tempfile::tempdir()?;
        let index_file = dir.path().join("index.yaml");
        std::fs::write(&index_file, &index_yaml)?;

        let remote = if with_index {
            IndexMode::Remote(index.grpc_addr())
        } else {
            IndexMode::None
        };
        let kvroute_on_ext_procs = async |index: IndexMode| {
            let (u, t, s) = (upstreams.clone(), tasks.clone(), stop.clone());
            let (model_dir, block_size) = (prompts.model_dir.clone(), prompts.block_size);
            let start =
                async move { start_kvroute(&u, &index, &model_dir, block_size, &t, &s).await };
            on_ext_procs(ext_procs, "kvroute-ext-proc", start).await
        };
        let (kvroute, kvroute_admin, _) = kvroute_on_ext_procs(remote).await?;
        let peer_admin = match with_peer && with_index {
            true => Some(
                kvroute_on_ext_procs(IndexMode::Remote(index.grpc_addr()))
                    .await?
                    .1,
            ),
            false => None,
        };
        let (kvroute_embedded, kvroute_embedded_admin, embedded_index_admin) =
            kvroute_on_ext_procs(IndexMode::Embedded(index_file)).await?;
        Ok(Self {
            upstreams,
            noop,
            fixed,
            kvroute,
            kvroute_admin,
            kvroute_embedded,
            kvroute_embedded_admin,
            index_admin: index.admin_addr(),
            embedded_index_admin: embedded_index_admin.context("embedded index not running")?,
            peer_admin,
            stop,
            tasks,
            publishers,
            _index: index,
            _dir: dir,
        })
    }
}

/// Runs `start` on the ext_procs' runtime, so the tasks it spawns live there (`--pin-ext-procs`
/// gives them a CPU of their own), and hands back what it started; `what` names it in errors.
async fn on_ext_procs<T, E>(
    ext_procs: &tokio::runtime::Handle,
    what: &str,
    start: impl Future<Output = Result<T, E>> + Send + 'static,
) -> anyhow::Result<T>
where
    T: Send + 'static,
    E: Into<anyhow::Error> + Send + 'static,
{
    let started = ext_procs
        .spawn(start)
        .await
        .with_context(|| format!("{what}'s start task"))?;
    started
        .map_err(Into::into)
        .with_context(|| format!("starting {what}"))
}

/// `count` engines' KV-event publishers (`engine-0`, …) and the index's `replicas:` lines that
/// follow them.
pub(crate) async fn start_engines(
    count: usize,
) -> anyhow::Result<(Vec<MockVllmPublisher>, String)> {
    let mut publishers = Vec::new();
    let mut replicas = String::new();
    for i in 0..count {
        let publisher = MockVllmPublisher::start(MockPublisherConfig {
            topic: "kv@".to_owned(),
            ..MockPublisherConfig::loopback()
        })
        .await?;
        replicas.push_str(&format!(
            "  - {{id: engine-{i}, pool: {MODEL}, events: {{endpoint: \"{}\", replay_endpoint: \"{}\", topic: \"kv@\"}}}}\n",
            publisher.pub_endpoint().context("publisher endpoint")?,
            publisher.replay_endpoint().context("replay endpoint")?,
        ));
        publishers.push(publisher);
    }
    Ok((publishers, replicas))
}

/// Where a kvroute-ext-proc finds its index.
pub(crate) enum IndexMode {
    /// kvroute-index over gRPC.
    Remote(SocketAddr),
    /// `index.embedded` with this kvroute-index config file.
    Embedded(std::path::PathBuf),
    /// None: the approximate tier only.
    None,
}

/// kvroute-index YAML: one pool of the bench's model, `replicas` (YAML list items).
pub(crate) fn index_yaml(replicas: &str, block_size: u32) -> String {
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n\
         pools:\n  - {{name: {MODEL}, models: [{MODEL}], block_size: {block_size}, key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}}}\n\
         replicas:\n{replicas}"
    )
}

/// Starts kvroute-ext-proc in this process; its gRPC and admin addresses, and its embedded
/// index's admin address.
async fn start_kvroute(
    upstreams: &[SocketAddr],
    index: &IndexMode,
    model_dir: &std::path::Path,
    block_size: u32,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<(SocketAddr, SocketAddr, Option<SocketAddr>)> {
    let config = kvroute_ext_proc::Config::from_yaml(&ext_proc_config(
        upstreams, index, model_dir, block_size,
    ))?;
    let server = kvroute_ext_proc::ExtProc::builder(config).bind().await?;
    let addrs = (
        server.grpc_addr()?,
        server.admin_addr()?,
        server.embedded_index_addrs().map(|(_, admin)| admin),
    );
    let shutdown = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = server.serve(shutdown).await {
            eprintln!("kvroute-ext-proc stopped: {error}");
        }
    });
    Ok(addrs)
}

/// kvroute-ext-proc YAML: one pool (in-process tokenizer of `model_dir`), replicas `engine-i` at
/// `upstreams`, production budgets; with `index`, the precise tier asks it.
pub(crate) fn ext_proc_config(
    upstreams: &[SocketAddr],
    index: &IndexMode,
    model_dir: &std::path::Path,
    block_size: u32,
) -> String {
    let replicas: String = upstreams
        .iter()
        .enumerate()
        .map(|(i, addr)| format!("- {{id: engine-{i}, pool: {MODEL}, address: \"{addr}\"}}\n"))
        .collect();
    let (index, events) = match index {
        IndexMode::Remote(addr) => (format!("index: {{addresses: [\"http://{addr}\"]}}\n"), true),
        IndexMode::Embedded(path) => (
            format!("index: {{embedded: \"{}\"}}\n", path.display()),
            true,
        ),
        IndexMode::None => (String::new(), false),
    };
    format!(
        "listen: {{grpc: \"127.0.0.1:0\", admin: \"127.0.0.1:0\"}}\n{index}\
         pools:\n- name: {MODEL}\n  models: [{MODEL}]\n  block_size: {block_size}\n  \
         key_scheme: {{kind: vllm-exact, hash_algo: sha256_cbor, seed: \"0\"}}\n  events: {events}\n  \
         tokenizer: {{model_dir: \"{}\"}}\n\
         replicas:\n{replicas}",
        model_dir.display()
    )
}

/// A fixed responder: reads the whole request, answers [`UPSTREAM_BODY`] with its `index` in
/// [`UPSTREAM_HEADER`], echoes kvroute's decision header. TCP_NODELAY on every accepted connection.
async fn start_upstream(
    index: usize,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .fallback(
            move |headers: axum::http::HeaderMap, _body: Bytes| async move {
                let mut response =
                    axum::response::Response::new(axum::body::Body::from(UPSTREAM_BODY));
                response.headers_mut().insert(
                    axum::http::header::CONTENT_TYPE,
                    axum::http::HeaderValue::from_static("application/json"),
                );
                response
                    .headers_mut()
                    .insert(UPSTREAM_HEADER, axum::http::HeaderValue::from(index));
                // Echoed back: kvroute's `tier/reason` on the upstream request. ext-proc runs with
                // `debug_headers` off (the production default), so it adds no response headers.
                if let Some(decision) = headers.get(DECISION_HEADER) {
                    response
                        .headers_mut()
                        .insert(DECISION_HEADER, decision.clone());
                }
                response
            },
        )
        .layer(axum::extract::DefaultBodyLimit::max(8 * 1024 * 1024));
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let shutdown = stop.clone().cancelled_owned();
    tasks.spawn(async move {
        if let Err(error) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            eprintln!("upstream {addr} failed: {error}");
        }
    });
    Ok(addr)
}
