//! Connections after their handshake, and the SUB and DEALER sockets built on them.

use bytes::{Bytes, BytesMut};
use futures::StreamExt as _;
use futures::stream::{BoxStream, SelectAll};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::codec::{self, Frame, FrameDecoder, GREETING_LEN, SocketType};
use super::endpoint::{Listener, Stream};
use super::{Endpoint, Limits, MAX_COMMAND_BYTES, PeerFilter, ProtocolError, ZmtpError};

/// How much the read buffer grows by when it runs out of room. Growth follows bytes that
/// arrived, never a declared size.
const READ_CHUNK: usize = 64 << 10;

/// One ZMTP connection whose handshake is done.
#[derive(Debug)]
struct Connection {
    stream: Stream,
    peer: String,
    read_buf: BytesMut,
    limits: Limits,
    /// Frames of a message not complete yet (kept here so `recv` is cancel-safe).
    partial: Vec<Bytes>,
    partial_bytes: usize,
}

impl Connection {
    /// Greeting and READY exchange as `ours`, bounded by the handshake timeout.
    async fn handshake(
        stream: Stream,
        ours: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        tokio::time::timeout(
            limits.handshake_timeout,
            Self::handshake_unbounded(stream, ours, limits),
        )
        .await
        .map_err(|_| ZmtpError::HandshakeTimeout)?
    }

    async fn handshake_unbounded(
        mut stream: Stream,
        ours: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        stream.write_all(&codec::greeting()).await?;
        let mut greeting = [0u8; GREETING_LEN];
        stream
            .read_exact(&mut greeting)
            .await
            .map_err(eof_is_closed)?;
        codec::check_greeting(&greeting)?;
        let mut ready = Vec::new();
        codec::encode_frame(&mut ready, &codec::ready_command(ours), false, true);
        stream.write_all(&ready).await?;
        let mut connection = Self {
            peer: stream.peer().to_owned(),
            stream,
            read_buf: BytesMut::new(),
            limits,
            partial: Vec::new(),
            partial_bytes: 0,
        };
        let body = match connection.read_frame(MAX_COMMAND_BYTES).await? {
            Frame::Command(body) => body,
            Frame::Message { .. } => {
                return Err(ProtocolError::Handshake("message frame before READY").into());
            }
        };
        let command = codec::parse_command(&body)?;
        match command.name {
            b"READY" => {}
            b"ERROR" => {
                return Err(ProtocolError::PeerError(codec::error_reason(command.data)).into());
            }
            _ => return Err(ProtocolError::Handshake("first command is not READY").into()),
        }
        let peer_type = codec::ready_property(command.data, b"Socket-Type")?
            .ok_or(ProtocolError::Handshake("READY without Socket-Type"))?;
        if !ours.accepts(peer_type) {
            return Err(ProtocolError::SocketType {
                peer: String::from_utf8_lossy(peer_type).into_owned(),
                ours: ours.name(),
            }
            .into());
        }
        Ok(connection)
    }

    /// The next frame, refusing one that would exceed `limit`. Cancel-safe: bytes read stay in
    /// the buffer.
    async fn read_frame(&mut self, limit: usize) -> Result<Frame, ZmtpError> {
        loop {
            if let Some(frame) = FrameDecoder.decode(&mut self.read_buf, limit)? {
                return Ok(frame);
            }
            if self.read_buf.capacity() - self.read_buf.len() < READ_CHUNK / 4 {
                self.read_buf.reserve(READ_CHUNK);
            }
            if self.stream.read_buf(&mut self.read_buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
    }

    /// The next whole message. Cancel-safe.
    async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            let remaining = self.limits.max_message_bytes - self.partial_bytes;
            match self.read_frame(remaining).await? {
                Frame::Command(body) => {
                    // PING (3.1 heartbeats) and anything else after READY carries nothing for us.
                    let command = codec::parse_command(&body)?;
                    if command.name == b"ERROR" {
                        return Err(
                            ProtocolError::PeerError(codec::error_reason(command.data)).into()
                        );
                    }
                }
                Frame::Message { body, more } => {
                    if self.partial.len() >= self.limits.max_frames {
                        return Err(ProtocolError::TooManyFrames {
                            limit: self.limits.max_frames,
                        }
                        .into());
                    }
                    self.partial_bytes += body.len();
                    self.partial.push(body);
                    if !more {
                        self.partial_bytes = 0;
                        return Ok(std::mem::take(&mut self.partial));
                    }
                }
            }
        }
    }

    async fn send<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        codec::encode_message(&mut out, frames);
        self.stream.write_all(&out).await?;
        self.stream.flush().await?;
        Ok(())
    }
}

fn eof_is_closed(error: std::io::Error) -> ZmtpError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        ZmtpError::Closed
    } else {
        ZmtpError::Io(error)
    }
}

/// Handshake as SUB, then subscribe to `topic` (a prefix; empty takes everything).
async fn subscribe(stream: Stream, topic: &[u8], limits: Limits) -> Result<Connection, ZmtpError> {
    let mut connection = Connection::handshake(stream, SocketType::Sub, limits).await?;
    let mut subscription = Vec::with_capacity(1 + topic.len());
    subscription.push(0x01);
    subscription.extend_from_slice(topic);
    connection.send(&[subscription]).await?;
    Ok(connection)
}

async fn connect(endpoint: &Endpoint, limits: Limits) -> Result<Stream, ZmtpError> {
    tokio::time::timeout(limits.handshake_timeout, endpoint.connect())
        .await
        .map_err(|_| ZmtpError::ConnectTimeout)?
}

/// What a [`SubSocket`] received.
#[derive(Debug)]
pub enum SubEvent {
    /// A whole message, its frames in order.
    Message(Vec<Bytes>),
    /// A peer finished its handshake (bound sockets).
    PeerConnected {
        /// Peer address.
        peer: String,
    },
    /// A peer went away or was refused (bound sockets; the socket goes on).
    PeerDropped {
        /// Peer address.
        peer: String,
        /// Why.
        error: ZmtpError,
    },
}

/// The SUB side of an engine's KV-event stream: connected to one engine, or bound for engines
/// to connect to.
#[derive(Debug)]
pub struct SubSocket {
    mode: SubMode,
}

#[derive(Debug)]
enum SubMode {
    Connected(Connection),
    Bound(Box<BoundSub>),
}

struct BoundSub {
    listener: Listener,
    peers: SelectAll<BoxStream<'static, SubEvent>>,
    filter: PeerFilter,
    topic: Bytes,
    limits: Limits,
}

impl std::fmt::Debug for BoundSub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundSub")
            .field("listener", &self.listener)
            .field("peers", &self.peers.len())
            .field("filter", &self.filter)
            .finish_non_exhaustive()
    }
}

impl SubSocket {
    /// Connects to a publisher that binds, handshakes and subscribes to `topic`, within the
    /// handshake timeout for each step.
    pub async fn connect(
        endpoint: &Endpoint,
        topic: &str,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        let stream = connect(endpoint, limits).await?;
        let connection = subscribe(stream, topic.as_bytes(), limits).await?;
        Ok(Self {
            mode: SubMode::Connected(connection),
        })
    }

    /// Binds for publishers to connect to; returns the socket and the endpoint as bound.
    pub async fn bind(
        endpoint: &Endpoint,
        topic: &str,
        limits: Limits,
        filter: PeerFilter,
    ) -> Result<(Self, String), ZmtpError> {
        let (listener, bound) = endpoint.bind().await?;
        let bound_sub = BoundSub {
            listener,
            peers: SelectAll::new(),
            filter,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            limits,
        };
        Ok((
            Self {
                mode: SubMode::Bound(Box::new(bound_sub)),
            },
            bound,
        ))
    }

    /// The next message or peer event. Cancel-safe. An error means the socket is unusable
    /// (connected: the engine went away or misbehaved; bound: the listener failed); a bound
    /// socket reports a single peer's failure as [`SubEvent::PeerDropped`] and goes on.
    pub async fn recv(&mut self) -> Result<SubEvent, ZmtpError> {
        match &mut self.mode {
            SubMode::Connected(connection) => connection.recv().await.map(SubEvent::Message),
            SubMode::Bound(bound) => bound.recv().await,
        }
    }
}

impl BoundSub {
    async fn recv(&mut self) -> Result<SubEvent, ZmtpError> {
        loop {
            tokio::select! {
                accepted = self.listener.accept() => {
                    let (stream, ip) = accepted?;
                    let peer = stream.peer().to_owned();
                    if ip.is_some_and(|ip| !self.filter.allows(ip)) {
                        return Ok(SubEvent::PeerDropped { error: ZmtpError::NotAllowed { peer: peer.clone() }, peer });
                    }
                    if self.peers.len() >= self.limits.max_peers {
                        return Ok(SubEvent::PeerDropped {
                            peer,
                            error: ZmtpError::TooManyPeers { limit: self.limits.max_peers },
                        });
                    }
                    self.peers.push(peer_events(stream, self.topic.clone(), self.limits));
                }
                Some(event) = self.peers.next(), if !self.peers.is_empty() => return Ok(event),
            }
        }
    }
}

/// One bound socket's peer as a stream of events: its handshake, its messages, its end.
fn peer_events(stream: Stream, topic: Bytes, limits: Limits) -> BoxStream<'static, SubEvent> {
    enum State {
        Handshake(Stream),
        Open(Box<Connection>),
        Done,
    }
    futures::stream::unfold(State::Handshake(stream), move |state| {
        let topic = topic.clone();
        async move {
            match state {
                State::Handshake(stream) => {
                    let peer = stream.peer().to_owned();
                    match subscribe(stream, &topic, limits).await {
                        Ok(connection) => Some((
                            SubEvent::PeerConnected { peer },
                            State::Open(Box::new(connection)),
                        )),
                        Err(error) => Some((SubEvent::PeerDropped { peer, error }, State::Done)),
                    }
                }
                State::Open(mut connection) => match connection.recv().await {
                    Ok(message) => Some((SubEvent::Message(message), State::Open(connection))),
                    Err(error) => Some((
                        SubEvent::PeerDropped {
                            peer: connection.peer.clone(),
                            error,
                        },
                        State::Done,
                    )),
                },
                State::Done => None,
            }
        }
    })
    .boxed()
}

/// The DEALER side of an engine's replay ROUTER.
#[derive(Debug)]
pub struct DealerSocket {
    connection: Connection,
}

impl DealerSocket {
    /// Connects and handshakes, within the handshake timeout for each step.
    pub async fn connect(endpoint: &Endpoint, limits: Limits) -> Result<Self, ZmtpError> {
        let stream = connect(endpoint, limits).await?;
        let connection = Connection::handshake(stream, SocketType::Dealer, limits).await?;
        Ok(Self { connection })
    }

    /// Sends one message. Not cancel-safe (a cancelled send may leave half a message).
    pub async fn send<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> Result<(), ZmtpError> {
        self.connection.send(frames).await
    }

    /// The next whole message. Cancel-safe.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        self.connection.recv().await
    }
}
