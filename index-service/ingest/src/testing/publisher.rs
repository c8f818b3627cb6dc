//! [`MockVllmPublisher`]: a ZMQ publisher that behaves like vLLM's `ZmqEventPublisher`.
//!
//! What it reproduces (spec §1): the PUB socket binds or connects by vLLM's endpoint rule, live
//! messages are `[topic, seq (8 bytes big-endian), payload]` with `seq` counting from 0, the last
//! `buffer_steps` batches are kept for replay, and an always-bound ROUTER serves
//! `[identity, b"", start_seq]` requests with every buffered batch `seq >= start_seq`, oldest
//! first (silently starting at the oldest it still has), then an end marker, in the 0.26+ or the
//! 0.9–0.25 layout. Payloads are passed in already encoded, so any msgpack (real captures,
//! golden vectors, `wire::encode_batch`) can be sent.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zeromq::{
    PubSocket, RouterSocket, Socket as _, SocketRecv as _, SocketSend as _, ZmqError, ZmqMessage,
};

use crate::wildcard_to_unspecified;
use kvroute_config::SocketMode;

/// vLLM's default `buffer_steps`.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// End-marker sequence frame: `(-1).to_bytes(8, "big", signed=True)`.
const END_MARKER_SEQ: [u8; 8] = [0xff; 8];

/// The replay reply layout of a vLLM release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayLayout {
    /// 0.26.0+: `[identity, b"", topic, seq, payload]`, end `[identity, b"", b"", ff×8, b""]`.
    #[default]
    Current,
    /// 0.9.0–0.25.x: `[identity, b"", seq, payload]`, end `[identity, b"", ff×8, b""]`.
    Legacy,
}

/// Whether the PUB socket binds or connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PubMode {
    /// vLLM's rule: bind if the endpoint has `*` or `::` or is `ipc://`/`inproc://`, else connect.
    #[default]
    VllmRule,
    /// Always bind (for loopback tests: `tcp://127.0.0.1:0`, which vLLM would connect to).
    Bind,
    /// Always connect.
    Connect,
}

/// Settings for [`MockVllmPublisher::start`].
#[derive(Debug, Clone)]
pub struct MockPublisherConfig {
    /// PUB endpoint (vLLM's `endpoint`).
    pub endpoint: String,
    /// Bind or connect.
    pub mode: PubMode,
    /// ROUTER endpoint (vLLM's `replay_endpoint`); always bound. `None`: no replay.
    pub replay_endpoint: Option<String>,
    /// Frame-0 topic.
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// Replay reply layout.
    pub replay_layout: ReplayLayout,
}

impl MockPublisherConfig {
    /// PUB bound on `127.0.0.1:0`, replay ROUTER bound on `127.0.0.1:0`, empty topic.
    pub fn loopback() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:0".to_owned(),
            mode: PubMode::Bind,
            replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            topic: String::new(),
            buffer_steps: DEFAULT_BUFFER_STEPS,
            replay_layout: ReplayLayout::Current,
        }
    }
}

/// Sequence counter and replay buffer, shared by the publishing side and the ROUTER task.
#[derive(Debug)]
struct Stream {
    next_seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    buffer_steps: usize,
}

impl Stream {
    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn remember(&mut self, seq: u64, payload: Bytes) {
        if self.buffer_steps == 0 {
            return;
        }
        if self.buffer.len() == self.buffer_steps {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload));
    }
}

/// A vLLM-compatible KV-event publisher for tests and the engine simulator.
pub struct MockVllmPublisher {
    /// The PUB socket; the lock also keeps sequence numbers in wire order.
    socket: tokio::sync::Mutex<PubSocket>,
    stream: Arc<Mutex<Stream>>,
    topic: Bytes,
    pub_endpoint: Option<String>,
    replay_endpoint: Option<String>,
    replay_requests: Arc<AtomicU64>,
    /// `false` holds replay replies back (requests are still counted) until it is `true` again.
    replay_gate: tokio::sync::watch::Sender<bool>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

impl std::fmt::Debug for MockVllmPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockVllmPublisher")
            .field("pub_endpoint", &self.pub_endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .field("next_seq", &self.stream.lock().next_seq)
            .finish_non_exhaustive()
    }
}

impl MockVllmPublisher {
    /// A publisher bound on loopback with a replay ROUTER ([`MockPublisherConfig::loopback`]).
    pub async fn bind_loopback() -> Result<Self, ZmqError> {
        Self::start(MockPublisherConfig::loopback()).await
    }

    /// Opens the sockets (connecting waits for the peer to accept) and starts serving replay.
    pub async fn start(config: MockPublisherConfig) -> Result<Self, ZmqError> {
        let mut socket = PubSocket::new();
        let binds = match config.mode {
            PubMode::VllmRule => SocketMode::engine_binds(&config.endpoint),
            PubMode::Bind => true,
            PubMode::Connect => false,
        };
        let pub_endpoint = if binds {
            let bound = socket
                .bind(&wildcard_to_unspecified(&config.endpoint))
                .await?;
            Some(bound.to_string())
        } else {
            socket.connect(&config.endpoint).await?;
            None
        };

        let stream = Arc::new(Mutex::new(Stream {
            next_seq: 0,
            buffer: VecDeque::with_capacity(config.buffer_steps.min(1024)),
            buffer_steps: config.buffer_steps,
        }));
        let topic = Bytes::from(config.topic.into_bytes());
        let replay_requests = Arc::new(AtomicU64::new(0));
        let (replay_gate, gate) = tokio::sync::watch::channel(true);
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();

        let replay_endpoint = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut router = RouterSocket::new();
                let bound = router.bind(&wildcard_to_unspecified(endpoint)).await?;
                tasks.spawn(serve_replay(
                    router,
                    Arc::clone(&stream),
                    topic.clone(),
                    config.replay_layout,
                    Arc::clone(&replay_requests),
                    gate,
                    cancel.clone(),
                ));
                Some(bound.to_string())
            }
            None => None,
        };
        tasks.close();

        Ok(Self {
            socket: tokio::sync::Mutex::new(socket),
            stream,
            topic,
            pub_endpoint,
            replay_endpoint,
            replay_requests,
            replay_gate,
            cancel,
            tasks,
        })
    }

    /// The bound PUB endpoint with its real port (`None` when the PUB connects).
    pub fn pub_endpoint(&self) -> Option<&str> {
        self.pub_endpoint.as_deref()
    }

    /// The bound replay endpoint with its real port (`None` without replay).
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The sequence number the next batch will get.
    pub fn next_seq(&self) -> u64 {
        self.stream.lock().next_seq
    }

    /// Replay requests served so far (well-formed ones).
    pub fn replay_requests(&self) -> u64 {
        self.replay_requests.load(Ordering::Relaxed)
    }

    /// Holds replay replies back until [`MockVllmPublisher::release_replays`]; requests that
    /// arrive meanwhile are counted in [`MockVllmPublisher::replay_requests`] right away.
    pub fn hold_replays(&self) {
        self.replay_gate.send_replace(false);
    }

    /// Serves held and future replay requests.
    pub fn release_replays(&self) {
        self.replay_gate.send_replace(true);
    }

    /// Publishes one batch: next sequence number, live message, replay buffer. Returns its seq.
    pub async fn publish(&self, payload: impl Into<Bytes>) -> Result<u64, ZmqError> {
        let payload = payload.into();
        let mut socket = self.socket.lock().await;
        let seq = self.stream.lock().take_seq();
        let message = live_message(&self.topic, seq, payload.clone())?;
        socket.send(message).await?;
        self.stream.lock().remember(seq, payload);
        Ok(seq)
    }

    /// Takes a sequence number and buffers the batch for replay, but never sends it live:
    /// subscribers see a gap that replay can repair.
    pub async fn skip_seq(&self, payload: impl Into<Bytes>) -> u64 {
        let _wire_order = self.socket.lock().await;
        let mut stream = self.stream.lock();
        let seq = stream.take_seq();
        stream.remember(seq, payload.into());
        seq
    }

    /// Burns a sequence number without sending or buffering anything, like vLLM when a batch
    /// fails to encode: a gap no replay can repair.
    pub async fn lose_seq(&self) -> u64 {
        let _wire_order = self.socket.lock().await;
        self.stream.lock().take_seq()
    }

    /// Simulates an engine restart: the counter goes back to 0 and the replay buffer is emptied.
    /// (A real restart also re-creates the sockets; subscribers see only the counter.)
    pub async fn restart(&self) {
        let _wire_order = self.socket.lock().await;
        let mut stream = self.stream.lock();
        stream.next_seq = 0;
        stream.buffer.clear();
    }

    /// Sends arbitrary frames on the PUB socket without touching the sequence (malformed input).
    pub async fn send_raw(&self, frames: Vec<Vec<u8>>) -> Result<(), ZmqError> {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        let message = ZmqMessage::try_from(frames)
            .map_err(|_| ZmqError::Other("a ZMQ message needs at least one frame"))?;
        self.socket.lock().await.send(message).await
    }

    /// Stops the replay server and unbinds the PUB port, so another publisher can bind it.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tasks.wait().await;
        let _ = self.socket.lock().await.unbind_all().await;
    }
}

impl Drop for MockVllmPublisher {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn live_message(topic: &Bytes, seq: u64, payload: Bytes) -> Result<ZmqMessage, ZmqError> {
    ZmqMessage::try_from(vec![
        topic.clone(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ])
    .map_err(|_| ZmqError::Other("empty live message"))
}

/// The ROUTER loop: vLLM's `_service_replay`.
async fn serve_replay(
    mut router: RouterSocket,
    stream: Arc<Mutex<Stream>>,
    topic: Bytes,
    layout: ReplayLayout,
    replay_requests: Arc<AtomicU64>,
    mut gate: tokio::sync::watch::Receiver<bool>,
    cancel: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            request = router.recv() => request,
        };
        let Ok(request) = request else {
            tracing::debug!("mock publisher: replay socket closed");
            break;
        };
        let frames = request.into_vec();
        // vLLM accepts exactly [identity, b"", start_seq] and ignores anything else.
        let [identity, delimiter, start] = frames.as_slice() else {
            tracing::debug!(
                frames = frames.len(),
                "mock publisher: ignoring malformed replay request"
            );
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::debug!("mock publisher: ignoring replay request without an 8-byte seq");
            continue;
        };
        if !delimiter.is_empty() {
            continue;
        }
        replay_requests.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            open = gate.wait_for(|open| *open) => if open.is_err() { break },
        }
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = stream
            .lock()
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
            let reply = match layout {
                ReplayLayout::Current => {
                    vec![identity.clone(), Bytes::new(), topic.clone(), seq, payload]
                }
                ReplayLayout::Legacy => vec![identity.clone(), Bytes::new(), seq, payload],
            };
            if send(&mut router, reply).await.is_err() {
                break;
            }
        }
        let end = Bytes::from_static(&END_MARKER_SEQ);
        let end_marker = match layout {
            ReplayLayout::Current => {
                vec![
                    identity.clone(),
                    Bytes::new(),
                    Bytes::new(),
                    end,
                    Bytes::new(),
                ]
            }
            ReplayLayout::Legacy => vec![identity.clone(), Bytes::new(), end, Bytes::new()],
        };
        let _ = send(&mut router, end_marker).await;
    }
}

async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> Result<(), ZmqError> {
    let message =
        ZmqMessage::try_from(frames).map_err(|_| ZmqError::Other("empty replay reply"))?;
    router.send(message).await
}
