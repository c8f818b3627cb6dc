//! A Kubernetes API server **double** for tests: [`ApiServer`] serves Pods and GIE
//! `InferencePool`s over HTTP/1.1 on 127.0.0.1, speaking the list/watch wire protocol as
//! kube-apiserver does, so kube-rs (and any client) runs against it unchanged. A real API server
//! cannot be installed from the registries these tests may use; this is not one.
//!
//! What it speaks exactly as the real server does:
//! - `GET /api/v1/namespaces/{ns}/pods` and
//!   `GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools` (also `.../{name}`
//!   and the all-namespaces `GET /api/v1/pods`): a `PodList` / `InferencePoolList` whose
//!   `metadata.resourceVersion` is the store's current version, filtered by `labelSelector`
//!   (`=`, `==`, `!=`, `in`, `notin`, exists, `!`exists) and `fieldSelector` (`=`, `==`, `!=` on
//!   the fields the real server supports per resource; others are refused with 400 `field label
//!   not supported`).
//! - `watch=true`: a chunked stream of newline-delimited JSON `WatchEvent`s (`ADDED`,
//!   `MODIFIED`, `DELETED`), every object carrying its `metadata.resourceVersion`; starting after
//!   `resourceVersion` (all changes since, in order), or with `resourceVersion` unset or `0` with
//!   synthetic `ADDED` events for what exists; an object that starts or stops matching the
//!   selectors is `ADDED` / `DELETED` for that watch, as the watch cache filters; `BOOKMARK`
//!   events (an object of the watched kind with only `metadata.resourceVersion`) when
//!   `allowWatchBookmarks=true`; the stream ends after `timeoutSeconds`.
//! - Too old a `resourceVersion` (before the compacted history): a 200 response whose one event
//!   is `ERROR` with a `Status` object `{code: 410, reason: "Expired"}`, then the stream ends —
//!   what the real server sends, after which clients relist.
//! - Errors as `Status` objects (`404 NotFound`, `400 BadRequest`, `405 MethodNotAllowed`), and
//!   `403 Forbidden` for a resource [`ApiServer::forbid`] names, worded as the real authorizer
//!   words a missing RBAC permission.
//!
//! What it simplifies: one namespace-keyed store with one resourceVersion counter (like etcd's
//! revision), no authentication or authorization (every request is allowed), no pagination
//! (`limit` is ignored and the whole list returned without `continue`, as a server without
//! chunking does; access is refused only per resource, by [`ApiServer::forbid`]), no writes over HTTP (tests change objects through [`ApiServer`]'s methods,
//! as controllers and the kubelet would), no `sendInitialEvents` streaming lists, JSON only
//! (no protobuf), no `Table` or metadata-only responses.
//!
//! Faults a cluster produces, on demand: [`ApiServer::stop`] drops every connection and stops
//! listening; [`ApiServer::resume`] listens again on the same port, optionally with the watch
//! history compacted so clients must relist; [`ApiServer::expire_watches`] ends every open
//! watch with `410 Gone` (a watcher too far behind) and compacts the history.

mod selector;

use std::collections::{BTreeMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::inference_pool;
use selector::{FieldSelector, LabelSelector};

/// Most changes kept for watches; older ones are compacted (watching from before them: 410).
const HISTORY_LIMIT: usize = 10_000;
/// Watch duration when the client sends no `timeoutSeconds`.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// Interval between bookmarks by default (the real server sends about one a minute).
pub const DEFAULT_BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);
/// Requests remembered for [`ApiServer::requests`].
const REQUEST_LOG_LIMIT: usize = 1000;

/// A kind the double serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// Core `v1` Pods.
    Pods,
    /// GIE `inference.networking.k8s.io/v1` InferencePools.
    InferencePools,
}

impl Resource {
    fn api_version(self) -> &'static str {
        match self {
            Self::Pods => "v1",
            Self::InferencePools => "inference.networking.k8s.io/v1",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Self::Pods => "Pod",
            Self::InferencePools => inference_pool::KIND,
        }
    }

    /// The field selectors the real server accepts for this resource.
    fn fields(self) -> &'static [&'static str] {
        match self {
            Self::Pods => &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            // Custom resources: metadata.name and metadata.namespace only.
            Self::InferencePools => &["metadata.name", "metadata.namespace"],
        }
    }
}

/// One list or watch request the double answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    /// Which kind.
    pub resource: Resource,
    /// `watch=true`.
    pub watch: bool,
    /// The `resourceVersion` parameter.
    pub resource_version: Option<String>,
    /// The `labelSelector` parameter.
    pub label_selector: Option<String>,
    /// The `fieldSelector` parameter.
    pub field_selector: Option<String>,
}

#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    resource: Resource,
    namespace: String,
    old: Option<Value>,
    new: Option<Value>,
}

#[derive(Debug, Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Resource, String, String), Value>,
    history: VecDeque<Change>,
    /// Watches from a version below this get 410.
    compacted_to: u64,
    /// Bumped by `expire_watches`: open watches end with 410.
    expiry: u64,
    uids: u64,
}

#[derive(Debug)]
struct State {
    store: Mutex<Store>,
    /// The store's version, for watches to wake on.
    version: watch::Sender<u64>,
    bookmark_interval: Duration,
    requests: Mutex<VecDeque<RequestRecord>>,
    gone_sent: AtomicU64,
    /// The version of the last bookmark sent (0: none yet).
    last_bookmark: AtomicU64,
    /// Resources every request for is refused with 403 (a missing RBAC permission).
    forbidden: Mutex<Vec<Resource>>,
}

#[derive(Debug)]
struct Serving {
    cancel: CancellationToken,
    tasks: TaskTracker,
}

/// The API server double (see the module docs for what it speaks). Dropping it stops serving.
#[derive(Debug)]
pub struct ApiServer {
    addr: SocketAddr,
    state: Arc<State>,
    serving: Mutex<Option<Serving>>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(serving) = self.serving.lock().take() {
            serving.cancel.cancel();
        }
    }
}

impl ApiServer {
    /// Listens on `127.0.0.1:0` with [`DEFAULT_BOOKMARK_INTERVAL`].
    pub async fn start() -> std::io::Result<Self> {
        Self::with_bookmark_interval(DEFAULT_BOOKMARK_INTERVAL).await
    }

    /// Listens on `127.0.0.1:0`, sending bookmarks every `interval` to watches that allow them.
    pub async fn with_bookmark_interval(interval: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (version, _) = watch::channel(0);
        let server = Self {
            addr,
            state: Arc::new(State {
                store: Mutex::new(Store::default()),
                version,
                bookmark_interval: interval,
                requests: Mutex::new(VecDeque::new()),
                gone_sent: AtomicU64::new(0),
                last_bookmark: AtomicU64::new(0),
                forbidden: Mutex::new(Vec::new()),
            }),
            serving: Mutex::new(None),
        };
        server.serve(listener);
        Ok(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address (the same across restarts).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The store's current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state.store.lock().rv
    }

    /// Creates or replaces `object` (its `metadata.name` names it) in `namespace`, as a
    /// controller's write would: a new resourceVersion, `uid` and `creationTimestamp` kept from
    /// the existing object. Returns the new resourceVersion.
    pub fn apply(&self, resource: Resource, namespace: &str, mut object: Value) -> u64 {
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let mut store = self.state.store.lock();
        store.rv += 1;
        let rv = store.rv;
        let key = (resource, namespace.to_owned(), name);
        let old = store.objects.get(&key).cloned();
        let uid = match old.as_ref().and_then(|o| o["metadata"]["uid"].as_str()) {
            Some(uid) => uid.to_owned(),
            None => {
                store.uids += 1;
                format!("00000000-0000-4000-8000-{:012}", store.uids)
            }
        };
        object["apiVersion"] = json!(resource.api_version());
        object["kind"] = json!(resource.kind());
        let metadata = &mut object["metadata"];
        metadata["namespace"] = json!(namespace);
        metadata["resourceVersion"] = json!(rv.to_string());
        metadata["uid"] = json!(uid);
        if metadata.get("creationTimestamp").is_none() {
            metadata["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        store.objects.insert(key, object.clone());
        push_change(
            &mut store,
            Change {
                rv,
                resource,
                namespace: namespace.to_owned(),
                old,
                new: Some(object),
            },
        );
        drop(store);
        self.state.version.send_replace(rv);
        rv
    }

    /// Deletes an object; `false` if there was none. Watches see `DELETED` with the object at
    /// the deletion's resourceVersion.
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) -> bool {
        let mut store = self.state.store.lock();
        let key = (resource, namespace.to_owned(), name.to_owned());
        let Some(mut old) = store.objects.remove(&key) else {
            return false;
        };
        store.rv += 1;
        let rv = store.rv;
        // A deletion's event carries the object as it was, at the deletion's version.
        old["metadata"]["resourceVersion"] = json!(rv.to_string());
        push_change(
            &mut store,
            Change {
                rv,
                resource,
                namespace: namespace.to_owned(),
                old: Some(old),
                new: None,
            },
        );
        drop(store);
        self.state.version.send_replace(rv);
        true
    }

    /// Creates or replaces a pod.
    pub fn apply_pod(&self, namespace: &str, pod: &TestPod) -> u64 {
        self.apply(Resource::Pods, namespace, pod.to_json())
    }

    /// Deletes a pod.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> bool {
        self.delete(Resource::Pods, namespace, name)
    }

    /// Creates or replaces an InferencePool selecting `labels` on `ports`.
    pub fn apply_inference_pool(
        &self,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
        ports: &[u16],
    ) -> u64 {
        let match_labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
        self.apply(
            Resource::InferencePools,
            namespace,
            json!({
                "metadata": {"name": name},
                "spec": {
                    "selector": {"matchLabels": match_labels},
                    "targetPorts": ports,
                    "endpointPickerRef": {"name": "kvroute-ext-proc", "portNumber": 9002, "failureMode": "FailOpen"}
                }
            }),
        )
    }

    /// Drops every connection (open watches end mid-stream) and stops listening, as an API
    /// server that goes down does. Returns once every connection is closed.
    pub async fn stop(&self) {
        let serving = self.serving.lock().take();
        if let Some(serving) = serving {
            serving.cancel.cancel();
            serving.tasks.close();
            serving.tasks.wait().await;
        }
    }

    /// Listens again on the same address. With `compact`, the watch history is gone: a client
    /// resuming from a version it saw before gets 410 and must relist.
    pub async fn resume(&self, compact: bool) -> std::io::Result<()> {
        if compact {
            let mut store = self.state.store.lock();
            store.history.clear();
            store.compacted_to = store.rv;
        }
        let listener = TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }

    /// [`stop`](Self::stop) then [`resume`](Self::resume).
    pub async fn restart(&self, compact: bool) -> std::io::Result<()> {
        self.stop().await;
        self.resume(compact).await
    }

    /// Ends every open watch with an `ERROR` event (`Status` 410 Expired) and compacts the
    /// history, so resuming fails too: every client must relist.
    pub fn expire_watches(&self) {
        let rv = {
            let mut store = self.state.store.lock();
            store.history.clear();
            store.compacted_to = store.rv;
            store.expiry += 1;
            store.rv
        };
        self.state.version.send_replace(rv);
    }

    /// Refuses every request for `resource` with `403 Forbidden`, as the API server does for a
    /// service account without the RBAC permission; open watches go on (authorization is
    /// checked when a request starts).
    pub fn forbid(&self, resource: Resource) {
        let mut forbidden = self.state.forbidden.lock();
        if !forbidden.contains(&resource) {
            forbidden.push(resource);
        }
    }

    /// Undoes [`forbid`](Self::forbid): the permission was granted.
    pub fn allow(&self, resource: Resource) {
        self.state.forbidden.lock().retain(|r| *r != resource);
    }

    /// The list and watch requests answered so far (the last 1000), oldest first.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.state.requests.lock().iter().cloned().collect()
    }

    /// How many `410 Gone` error events were sent.
    pub fn gone_sent(&self) -> u64 {
        self.state.gone_sent.load(Ordering::Relaxed)
    }

    /// The resourceVersion of the last `BOOKMARK` sent (0: none yet).
    pub fn last_bookmark(&self) -> u64 {
        self.state.last_bookmark.load(Ordering::Relaxed)
    }

    /// Open watches (streams not yet ended) — a condition tests wait on.
    pub fn open_watches(&self) -> usize {
        self.state.version.receiver_count()
    }

    fn serve(&self, listener: TcpListener) {
        let serving = Serving {
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
        };
        let state = Arc::clone(&self.state);
        let cancel = serving.cancel.clone();
        let tasks = serving.tasks.clone();
        // Owned by Serving's tracker, cancelled by stop/drop.
        serving
            .tasks
            .spawn(accept_loop(listener, state, cancel, tasks));
        *self.serving.lock() = Some(serving);
    }
}

fn push_change(store: &mut Store, change: Change) {
    store.history.push_back(change);
    while store.history.len() > HISTORY_LIMIT {
        if let Some(dropped) = store.history.pop_front() {
            store.compacted_to = dropped.rv;
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    state: Arc<State>,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let (stream, _) = tokio::select! {
            () = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => continue,
            },
        };
        let state = Arc::clone(&state);
        let cancel = cancel.clone();
        let service = hyper::service::service_fn(move |request| {
            let state = Arc::clone(&state);
            async move { Ok::<_, Infallible>(handle(&state, request)) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
        tasks.spawn(async move {
            // Cancellation drops the connection (and any watch body) mid-stream.
            tokio::select! {
                () = cancel.cancelled() => {}
                _ = connection => {}
            }
        });
    }
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(value.to_string())).boxed_unsync());
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code
    })
}

fn error_response(status: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(status, &status_object(status.as_u16(), reason, message))
}

/// The real authorizer's refusal of a request without the RBAC permission for it.
fn forbidden(target: &Target, watch: bool) -> Response<Body> {
    let (group, plural) = match target.resource {
        Resource::Pods => ("", "pods"),
        Resource::InferencePools => (inference_pool::GROUP, inference_pool::PLURAL),
    };
    let verb = match (watch, &target.name) {
        (true, _) => "watch",
        (false, Some(_)) => "get",
        (false, None) => "list",
    };
    let scope = match &target.namespace {
        Some(namespace) => format!("in the namespace \"{namespace}\""),
        None => "at the cluster scope".to_owned(),
    };
    let subject = match &target.name {
        Some(name) => format!("{plural} \"{name}\""),
        None => plural.to_owned(),
    };
    let message = format!(
        "{subject} is forbidden: User \"system:serviceaccount:{}:kvroute\" cannot {verb} resource \"{plural}\" in API group \"{group}\" {scope}",
        target.namespace.as_deref().unwrap_or("default"),
    );
    let mut status = status_object(403, "Forbidden", &message);
    status["details"] = json!({"kind": plural});
    if !group.is_empty() {
        status["details"]["group"] = json!(group);
    }
    if let Some(name) = &target.name {
        status["details"]["name"] = json!(name);
    }
    json_response(StatusCode::FORBIDDEN, &status)
}

/// What a request addresses.
struct Target {
    resource: Resource,
    namespace: Option<String>,
    name: Option<String>,
}

fn route(path: &str) -> Option<Target> {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    let target = |resource, namespace: Option<&str>, name: Option<&str>| Target {
        resource,
        namespace: namespace.map(str::to_owned),
        name: name.map(str::to_owned),
    };
    match segments.as_slice() {
        ["api", "v1", "pods"] => Some(target(Resource::Pods, None, None)),
        ["api", "v1", "namespaces", ns, "pods"] => Some(target(Resource::Pods, Some(ns), None)),
        ["api", "v1", "namespaces", ns, "pods", name] => {
            Some(target(Resource::Pods, Some(ns), Some(name)))
        }
        [
            "apis",
            inference_pool::GROUP,
            inference_pool::VERSION,
            "namespaces",
            ns,
            inference_pool::PLURAL,
        ] => Some(target(Resource::InferencePools, Some(ns), None)),
        [
            "apis",
            inference_pool::GROUP,
            inference_pool::VERSION,
            "namespaces",
            ns,
            inference_pool::PLURAL,
            name,
        ] => Some(target(Resource::InferencePools, Some(ns), Some(name))),
        [
            "apis",
            inference_pool::GROUP,
            inference_pool::VERSION,
            inference_pool::PLURAL,
        ] => Some(target(Resource::InferencePools, None, None)),
        _ => None,
    }
}

fn query_params(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// `application/x-www-form-urlencoded` decoding (`+` is a space).
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match (escaped, bytes[i]) {
            (Some(byte), _) => {
                out.push(byte);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, other) => {
                out.push(other);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn handle(state: &Arc<State>, request: Request<hyper::body::Incoming>) -> Response<Body> {
    let Some(target) = route(request.uri().path()) else {
        return error_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        );
    };
    if request.method() != Method::GET {
        return error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the double serves reads only; tests write through ApiServer",
        );
    }
    let params = query_params(request.uri().query());
    let labels = match LabelSelector::parse(params.get("labelSelector").map_or("", String::as_str))
    {
        Ok(labels) => labels,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    let fields = match FieldSelector::parse(
        params.get("fieldSelector").map_or("", String::as_str),
        target.resource.fields(),
    ) {
        Ok(fields) => fields,
        Err(message) => return error_response(StatusCode::BAD_REQUEST, "BadRequest", &message),
    };
    let watch = matches!(params.get("watch").map(String::as_str), Some("true" | "1"));
    {
        let mut log = state.requests.lock();
        log.push_back(RequestRecord {
            resource: target.resource,
            watch,
            resource_version: params.get("resourceVersion").cloned(),
            label_selector: params.get("labelSelector").cloned(),
            field_selector: params.get("fieldSelector").cloned(),
        });
        while log.len() > REQUEST_LOG_LIMIT {
            log.pop_front();
        }
    }
    if state.forbidden.lock().contains(&target.resource) {
        return forbidden(&target, watch);
    }
    let filter = Filter {
        resource: target.resource,
        namespace: target.namespace.clone(),
        labels,
        fields,
    };
    if let Some(name) = &target.name {
        let store = state.store.lock();
        let key = (
            target.resource,
            target.namespace.clone().unwrap_or_default(),
            name.clone(),
        );
        return match store.objects.get(&key) {
            Some(object) => json_response(StatusCode::OK, object),
            None => error_response(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("{} \"{name}\" not found", target.resource.kind()),
            ),
        };
    }
    if watch {
        let timeout = params
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .map_or(DEFAULT_WATCH_TIMEOUT, Duration::from_secs);
        let bookmarks = params
            .get("allowWatchBookmarks")
            .is_some_and(|v| v == "true");
        return watch_response(
            state,
            filter,
            params.get("resourceVersion").cloned(),
            timeout,
            bookmarks,
        );
    }
    let store = state.store.lock();
    let items: Vec<Value> = store
        .objects
        .iter()
        .filter(|((resource, namespace, _), object)| filter.matches(*resource, namespace, object))
        .map(|(_, object)| object.clone())
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "kind": format!("{}List", target.resource.kind()),
            "apiVersion": target.resource.api_version(),
            "metadata": {"resourceVersion": store.rv.to_string()},
            "items": items,
        }),
    )
}

#[derive(Debug, Clone)]
struct Filter {
    resource: Resource,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filter {
    fn matches(&self, resource: Resource, namespace: &str, object: &Value) -> bool {
        resource == self.resource
            && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.labels.matches(object["metadata"].get("labels"))
            && self.fields.matches(object)
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

struct WatchStream {
    state: Arc<State>,
    version: watch::Receiver<u64>,
    filter: Filter,
    cursor: u64,
    expiry: u64,
    pending: VecDeque<Bytes>,
    deadline: Instant,
    next_bookmark: Option<Instant>,
    done: bool,
}

fn watch_response(
    state: &Arc<State>,
    filter: Filter,
    resource_version: Option<String>,
    timeout: Duration,
    bookmarks: bool,
) -> Response<Body> {
    let store = state.store.lock();
    let mut pending = VecDeque::new();
    let mut done = false;
    let cursor = match resource_version
        .as_deref()
        .filter(|v| !v.is_empty() && *v != "0")
    {
        None => {
            // Unset or "0": synthetic ADDED for everything that exists now, then changes.
            for ((resource, namespace, _), object) in &store.objects {
                if filter.matches(*resource, namespace, object) {
                    pending.push_back(event_line("ADDED", object));
                }
            }
            store.rv
        }
        Some(version) => match version.parse::<u64>() {
            Err(_) => {
                drop(store);
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid resource version: {version}"),
                );
            }
            Ok(version) if version < store.compacted_to => {
                pending.push_back(gone(state, version, store.compacted_to));
                done = true;
                version
            }
            Ok(version) => version,
        },
    };
    let now = Instant::now();
    let stream = WatchStream {
        state: Arc::clone(state),
        version: state.version.subscribe(),
        filter,
        cursor,
        expiry: store.expiry,
        pending,
        deadline: now + timeout,
        next_bookmark: bookmarks.then(|| now + state.bookmark_interval),
        done,
    };
    drop(store);
    let body = futures::stream::unfold(stream, |mut stream| async move {
        let chunk = stream.next_chunk().await?;
        Some((Ok::<_, Infallible>(Frame::data(chunk)), stream))
    });
    let mut response = Response::new(StreamBody::new(body).boxed_unsync());
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn gone(state: &State, version: u64, oldest: u64) -> Bytes {
    state.gone_sent.fetch_add(1, Ordering::Relaxed);
    event_line(
        "ERROR",
        &status_object(
            410,
            "Expired",
            &format!("too old resource version: {version} ({oldest})"),
        ),
    )
}

impl WatchStream {
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if let Some(chunk) = self.pending.pop_front() {
                return Some(chunk);
            }
            if self.done {
                return None;
            }
            self.collect();
            if !self.pending.is_empty() || self.done {
                continue;
            }
            let bookmark = self.next_bookmark;
            tokio::select! {
                changed = self.version.changed() => {
                    if changed.is_err() {
                        self.done = true;
                    }
                }
                () = sleep_until_some(bookmark) => {
                    let object = json!({
                        "kind": self.filter.resource.kind(),
                        "apiVersion": self.filter.resource.api_version(),
                        "metadata": {"resourceVersion": self.cursor.to_string()},
                    });
                    self.pending.push_back(event_line("BOOKMARK", &object));
                    self.state.last_bookmark.fetch_max(self.cursor, Ordering::Relaxed);
                    self.next_bookmark = Some(Instant::now() + self.state.bookmark_interval);
                }
                () = tokio::time::sleep_until(self.deadline) => self.done = true,
            }
        }
    }

    /// Queues the events of changes after the cursor (or 410 when they are gone).
    fn collect(&mut self) {
        let store = self.state.store.lock();
        if store.expiry != self.expiry || self.cursor < store.compacted_to {
            self.pending
                .push_back(gone(&self.state, self.cursor, store.compacted_to));
            self.done = true;
            return;
        }
        let start = store.history.partition_point(|c| c.rv <= self.cursor);
        for change in store.history.range(start..) {
            let filter = &self.filter;
            let matches = |object: Option<&Value>| {
                object.is_some_and(|o| filter.matches(change.resource, &change.namespace, o))
            };
            let (old, new) = (change.old.as_ref(), change.new.as_ref());
            let event = match (matches(old), matches(new), old, new) {
                (false, true, _, Some(new)) => Some(("ADDED", new)),
                (true, true, _, Some(new)) => Some(("MODIFIED", new)),
                // Deleted, or no longer matching: the watch sees it leave.
                (true, false, _, Some(new)) => Some(("DELETED", new)),
                (true, false, Some(old), None) => Some(("DELETED", old)),
                _ => None,
            };
            if let Some((kind, object)) = event {
                self.pending.push_back(event_line(kind, object));
            }
        }
        self.cursor = self.cursor.max(store.rv);
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A pod as a test writes it: labels, IP, readiness, node, container ports, annotations.
#[derive(Debug, Clone, Default)]
pub struct TestPod {
    name: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    ip: Option<String>,
    ready: bool,
    terminating: bool,
    node: Option<String>,
    ports: Vec<(String, u16)>,
}

impl TestPod {
    /// A pending pod (no IP, not Ready).
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            ..Self::default()
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Adds an annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_owned(), value.to_owned());
        self
    }

    /// Sets `status.podIP`.
    pub fn ip(mut self, ip: &str) -> Self {
        self.ip = Some(ip.to_owned());
        self
    }

    /// Sets the `Ready` condition.
    pub fn ready(mut self, ready: bool) -> Self {
        self.ready = ready;
        self
    }

    /// Sets `metadata.deletionTimestamp` (graceful deletion under way).
    pub fn terminating(mut self) -> Self {
        self.terminating = true;
        self
    }

    /// Sets `spec.nodeName`.
    pub fn node(mut self, node: &str) -> Self {
        self.node = Some(node.to_owned());
        self
    }

    /// Adds a named container port.
    pub fn port(mut self, name: &str, number: u16) -> Self {
        self.ports.push((name.to_owned(), number));
        self
    }

    /// The pod's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Pod object.
    pub fn to_json(&self) -> Value {
        let ports: Vec<Value> = self
            .ports
            .iter()
            .map(|(name, port)| json!({"name": name, "containerPort": port, "protocol": "TCP"}))
            .collect();
        let ready = if self.ready { "True" } else { "False" };
        let mut pod = json!({
            "metadata": {"name": self.name, "labels": self.labels, "annotations": self.annotations},
            "spec": {"containers": [{"name": "engine", "image": "vllm", "ports": ports}]},
            "status": {
                "phase": if self.ip.is_some() { "Running" } else { "Pending" },
                "conditions": [{"type": "Ready", "status": ready}, {"type": "ContainersReady", "status": ready}],
            },
        });
        if let Some(node) = &self.node {
            pod["spec"]["nodeName"] = json!(node);
        }
        if let Some(ip) = &self.ip {
            pod["status"]["podIP"] = json!(ip);
            pod["status"]["podIPs"] = json!([{"ip": ip}]);
        }
        if self.terminating {
            pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:30Z");
            pod["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        }
        pod
    }
}
