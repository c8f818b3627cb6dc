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

/// What a peer's bytes amount to, decoded without I/O: the same state machine serves every
/// connection and the fuzz target.
#[derive(Debug)]
pub struct Inbound {
    ours: SocketType,
    limits: Limits,
    stage: Stage,
    buf: BytesMut,
    /// Frames of a message not complete yet.
    partial: Vec<Bytes>,
    partial_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Greeting,
    Ready,
    Open,
}

/// A step of a peer's side of the conversation.
#[derive(Debug, PartialEq, Eq)]
pub enum InboundEvent {
    /// Its greeting is ZMTP 3 with the NULL mechanism: send our READY.
    Greeted,
    /// Its READY named a compatible socket type: the handshake is done.
    Ready,
    /// A whole message.
    Message(Vec<Bytes>),
}

impl Inbound {
    /// A decoder for a peer of a socket of type `ours`.
    pub fn new(ours: SocketType, limits: Limits) -> Self {
        Self {
            ours,
            limits,
            stage: Stage::Greeting,
            buf: BytesMut::new(),
            partial: Vec::new(),
            partial_bytes: 0,
        }
    }

    /// Appends bytes that arrived.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received and not decoded yet.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next event the buffered bytes make up, `Ok(None)` if more are needed. After an
    /// error the peer must be dropped.
    pub fn next_event(&mut self) -> Result<Option<InboundEvent>, ZmtpError> {
        loop {
            match self.stage {
                Stage::Greeting => {
                    let Some(greeting) = self.buf.get(..GREETING_LEN) else {
                        return Ok(None);
                    };
                    let mut bytes = [0u8; GREETING_LEN];
                    bytes.copy_from_slice(greeting);
                    codec::check_greeting(&bytes)?;
                    let _ = self.buf.split_to(GREETING_LEN);
                    self.stage = Stage::Ready;
                    return Ok(Some(InboundEvent::Greeted));
                }
                Stage::Ready => {
                    let Some(frame) = FrameDecoder.decode(&mut self.buf, MAX_COMMAND_BYTES)? else {
                        return Ok(None);
                    };
                    self.check_ready(frame)?;
                    self.stage = Stage::Open;
                    return Ok(Some(InboundEvent::Ready));
                }
                Stage::Open => {
                    let remaining = self.limits.max_message_bytes - self.partial_bytes;
                    let Some(frame) = FrameDecoder.decode(&mut self.buf, remaining)? else {
                        return Ok(None);
                    };
                    if let Some(message) = self.message_frame(frame)? {
                        return Ok(Some(InboundEvent::Message(message)));
                    }
                }
            }
        }
    }

    fn check_ready(&self, frame: Frame) -> Result<(), ZmtpError> {
        let body = match frame {
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
        if !self.ours.accepts(peer_type) {
            return Err(ProtocolError::SocketType {
                peer: String::from_utf8_lossy(peer_type).into_owned(),
                ours: self.ours.name(),
            }
            .into());
        }
        Ok(())
    }

    /// Adds a frame after the handshake; `Some` when it completes a message.
    fn message_frame(&mut self, frame: Frame) -> Result<Option<Vec<Bytes>>, ZmtpError> {
        match frame {
            Frame::Command(body) => {
                // PING (3.1 heartbeats) and anything else after READY carries nothing for us.
                let command = codec::parse_command(&body)?;
                if command.name == b"ERROR" {
                    return Err(ProtocolError::PeerError(codec::error_reason(command.data)).into());
                }
                Ok(None)
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
                if more {
                    return Ok(None);
                }
                self.partial_bytes = 0;
                Ok(Some(std::mem::take(&mut self.partial)))
            }
        }
    }
}

/// One ZMTP connection whose handshake is done.
#[derive(Debug)]
struct Connection {
    stream: Stream,
    peer: String,
    inbound: Inbound,
}

impl Connection {
    /// Greeting and READY exchange as `ours`, bounded by the handshake timeout.
    async fn handshake(
        stream: Stream,
        ours: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        let mut connection = Self {
            peer: stream.peer().to_owned(),
            stream,
            inbound: Inbound::new(ours, limits),
        };
        tokio::time::timeout(limits.handshake_timeout, connection.exchange_ready(ours))
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout)??;
        Ok(connection)
    }

    async fn exchange_ready(&mut self, ours: SocketType) -> Result<(), ZmtpError> {
        self.stream.write_all(&codec::greeting()).await?;
        loop {
            match self.next_event().await? {
                InboundEvent::Greeted => {
                    let mut ready = Vec::new();
                    codec::encode_frame(&mut ready, &codec::ready_command(ours), false, true);
                    self.stream.write_all(&ready).await?;
                }
                InboundEvent::Ready => return Ok(()),
                InboundEvent::Message(_) => {
                    return Err(ProtocolError::Handshake("message frame before READY").into());
                }
            }
        }
    }

    /// The next event, reading as needed. Cancel-safe: bytes read stay in the decoder.
    async fn next_event(&mut self) -> Result<InboundEvent, ZmtpError> {
        loop {
            if let Some(event) = self.inbound.next_event()? {
                return Ok(event);
            }
            let buf = &mut self.inbound.buf;
            if buf.capacity() - buf.len() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            if self.stream.read_buf(buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
    }

    /// The next whole message. Cancel-safe.
    async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        match self.next_event().await? {
            InboundEvent::Message(message) => Ok(message),
            // The handshake is done before a connection is handed out.
            InboundEvent::Greeted | InboundEvent::Ready => {
                Err(ProtocolError::Handshake("handshake event after READY").into())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn peer_hello(socket_type: &[u8]) -> Vec<u8> {
        let mut bytes = codec::greeting().to_vec();
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        ready.extend_from_slice(socket_type);
        codec::encode_frame(&mut bytes, &ready, false, true);
        bytes
    }

    fn limits(max_message_bytes: usize) -> Limits {
        Limits {
            max_message_bytes,
            ..Limits::default()
        }
    }

    #[test]
    fn handshake_then_messages_byte_by_byte() {
        let mut bytes = peer_hello(b"PUB");
        codec::encode_frame(&mut bytes, b"\x04PING\x00\x00", false, true);
        codec::encode_message(&mut bytes, &[b"topic".as_slice(), b"seq", b"payload"]);
        let mut inbound = Inbound::new(SocketType::Sub, limits(1024));
        let mut events = Vec::new();
        for byte in bytes {
            inbound.feed(&[byte]);
            while let Some(event) = inbound.next_event().unwrap() {
                events.push(event);
            }
        }
        assert_eq!(
            events,
            vec![
                InboundEvent::Greeted,
                InboundEvent::Ready,
                InboundEvent::Message(vec![
                    Bytes::from_static(b"topic"),
                    Bytes::from_static(b"seq"),
                    Bytes::from_static(b"payload")
                ]),
            ]
        );
        assert_eq!(inbound.buffered(), 0);
    }

    #[test]
    fn a_message_over_the_limit_is_refused_at_the_frame_that_crosses_it() {
        let mut bytes = peer_hello(b"PUB");
        codec::encode_message(&mut bytes, &[vec![1u8; 600], vec![2u8; 600]]);
        let mut inbound = Inbound::new(SocketType::Sub, limits(1000));
        inbound.feed(&bytes[..bytes.len() - 600]);
        assert_eq!(inbound.next_event().unwrap(), Some(InboundEvent::Greeted));
        assert_eq!(inbound.next_event().unwrap(), Some(InboundEvent::Ready));
        // The second frame's header alone is refused: 600 + 600 > 1000.
        assert!(matches!(
            inbound.next_event(),
            Err(ZmtpError::Protocol(ProtocolError::Oversized {
                declared: 600,
                limit: 400
            }))
        ));
    }

    #[test]
    fn too_many_frames_wrong_peer_types_and_early_messages_are_refused() {
        let mut bytes = peer_hello(b"PUB");
        let frames = vec![b"x".as_slice(); 9];
        codec::encode_message(&mut bytes, &frames);
        let mut inbound = Inbound::new(SocketType::Sub, limits(1024));
        inbound.feed(&bytes);
        let mut outcome = Ok(None);
        for _ in 0..4 {
            outcome = inbound.next_event();
            if outcome.is_err() {
                break;
            }
        }
        assert!(matches!(
            outcome,
            Err(ZmtpError::Protocol(ProtocolError::TooManyFrames {
                limit: 8
            }))
        ));

        let mut inbound = Inbound::new(SocketType::Sub, limits(1024));
        inbound.feed(&peer_hello(b"SUB"));
        assert_eq!(inbound.next_event().unwrap(), Some(InboundEvent::Greeted));
        assert!(matches!(
            inbound.next_event(),
            Err(ZmtpError::Protocol(ProtocolError::SocketType { .. }))
        ));

        let mut early = codec::greeting().to_vec();
        codec::encode_message(&mut early, &[b"data".as_slice()]);
        let mut inbound = Inbound::new(SocketType::Dealer, limits(1024));
        inbound.feed(&early);
        assert_eq!(inbound.next_event().unwrap(), Some(InboundEvent::Greeted));
        assert!(inbound.next_event().is_err());
    }
}
