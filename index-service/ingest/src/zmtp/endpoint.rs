//! Endpoints (`tcp://host:port`, `ipc://path`), their streams and listeners, and the peer
//! allow-list of bound sockets.

use std::net::IpAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use kvroute_config::{AllowedPeer, ZmqAddress};

use super::ZmtpError;

/// A parsed ZMQ endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://host:port`; host `*` means every interface (bind only).
    Tcp {
        /// Host name or address, brackets removed.
        host: String,
        /// Port (0 binds any free port).
        port: u16,
    },
    /// `ipc://path`: a Unix domain socket.
    Ipc(PathBuf),
}

impl Endpoint {
    /// Parses a ZMQ endpoint string.
    pub fn parse(endpoint: &str) -> Result<Self, ZmtpError> {
        // The one endpoint grammar is the config's: what a config accepts, the transport serves.
        match ZmqAddress::parse(endpoint) {
            Ok(ZmqAddress::Tcp { host, port }) => Ok(Endpoint::Tcp { host, port }),
            Ok(ZmqAddress::Ipc(path)) => Ok(Endpoint::Ipc(path)),
            Err(reason) => Err(ZmtpError::Endpoint {
                endpoint: endpoint.to_owned(),
                reason,
            }),
        }
    }

    /// Connects (resolving the host by name).
    pub(super) async fn connect(&self) -> Result<Stream, ZmtpError> {
        match self {
            Endpoint::Tcp { host, port } => {
                let stream = TcpStream::connect((host.as_str(), *port)).await?;
                stream.set_nodelay(true)?;
                let peer = stream.peer_addr()?.to_string();
                Ok(Stream::Tcp(stream, peer))
            }
            Endpoint::Ipc(path) => Ok(Stream::Unix(UnixStream::connect(path).await?)),
        }
    }

    /// Binds a listener; returns it with the endpoint as bound (port resolved).
    pub(super) async fn bind(&self) -> Result<(Listener, String), ZmtpError> {
        match self {
            Endpoint::Tcp { host, port } => {
                let host = if host == "*" {
                    "0.0.0.0"
                } else {
                    host.as_str()
                };
                let listener = TcpListener::bind((host, *port)).await?;
                let bound = format!("tcp://{}", listener.local_addr()?);
                Ok((Listener::Tcp(listener), bound))
            }
            Endpoint::Ipc(path) => {
                // As libzmq does: a socket file left by an earlier process is replaced.
                match std::fs::remove_file(path) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => return Err(error.into()),
                }
                let listener = UnixListener::bind(path)?;
                Ok((
                    Listener::Unix(listener),
                    format!("ipc://{}", path.display()),
                ))
            }
        }
    }
}

/// A listening socket.
#[derive(Debug)]
pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    /// Accepts one connection; the peer's IP is `None` over ipc. Cancel-safe.
    pub(super) async fn accept(&self) -> std::io::Result<(Stream, Option<IpAddr>)> {
        match self {
            Listener::Tcp(listener) => {
                let (stream, peer) = listener.accept().await?;
                stream.set_nodelay(true)?;
                Ok((Stream::Tcp(stream, peer.to_string()), Some(peer.ip())))
            }
            Listener::Unix(listener) => {
                let (stream, _) = listener.accept().await?;
                Ok((Stream::Unix(stream), None))
            }
        }
    }
}

/// A connected byte stream.
#[derive(Debug)]
pub(super) enum Stream {
    /// TCP, with the peer address for logs.
    Tcp(TcpStream, String),
    Unix(UnixStream),
}

impl Stream {
    /// The peer, for logs.
    pub(super) fn peer(&self) -> &str {
        match self {
            Stream::Tcp(_, peer) => peer,
            Stream::Unix(_) => "ipc",
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(stream, _) => Pin::new(stream).poll_read(cx, buf),
            Stream::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(stream, _) => Pin::new(stream).poll_write(cx, buf),
            Stream::Unix(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(stream, _) => Pin::new(stream).poll_flush(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(stream, _) => Pin::new(stream).poll_shutdown(cx),
            Stream::Unix(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

/// Why an allow-list entry is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?} is not an IP address or CIDR block (e.g. 10.0.0.7, 10.0.0.0/24, fd00::/8)")]
pub struct PeerFilterError {
    /// The entry as configured.
    pub entry: String,
}

/// Which peer addresses a bound socket accepts: any, or those inside a list of CIDR blocks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerFilter {
    /// `(network, prefix length)`; empty accepts every peer.
    blocks: Vec<(IpAddr, u8)>,
}

impl PeerFilter {
    /// Accepts every peer.
    pub fn any() -> Self {
        Self::default()
    }

    /// Parses entries like `10.0.0.7`, `10.0.0.0/24`, `::1`, `fd00::/8` (the config's
    /// [`AllowedPeer`] grammar).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, PeerFilterError> {
        let peers = entries
            .iter()
            .map(|entry| {
                entry
                    .as_ref()
                    .parse::<AllowedPeer>()
                    .map_err(|_| PeerFilterError {
                        entry: entry.as_ref().trim().to_owned(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::from_peers(&peers))
    }

    /// The filter of a configured `allowed_peers` list.
    pub fn from_peers(peers: &[AllowedPeer]) -> Self {
        Self {
            blocks: peers.iter().map(|p| (p.address, p.prefix)).collect(),
        }
    }

    /// Whether any peer is accepted (no list configured).
    pub fn is_open(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether `peer` may connect. IPv4-mapped IPv6 peers match IPv4 blocks.
    pub fn allows(&self, peer: IpAddr) -> bool {
        if self.blocks.is_empty() {
            return true;
        }
        let peer = match peer {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(peer, IpAddr::V4),
            v4 => v4,
        };
        self.blocks
            .iter()
            .any(|&(network, prefix)| in_block(peer, network, prefix))
    }
}

fn in_block(peer: IpAddr, network: IpAddr, prefix: u8) -> bool {
    match (peer, network) {
        (IpAddr::V4(peer), IpAddr::V4(network)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(peer) & mask == u32::from(network) & mask
        }
        (IpAddr::V6(peer), IpAddr::V6(network)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(peer) & mask == u128::from(network) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            Endpoint::parse("tcp://*:5557").unwrap(),
            Endpoint::Tcp {
                host: "*".into(),
                port: 5557
            }
        );
        assert_eq!(
            Endpoint::parse("tcp://[::1]:0").unwrap(),
            Endpoint::Tcp {
                host: "::1".into(),
                port: 0
            }
        );
        assert_eq!(
            Endpoint::parse("ipc:///tmp/kv.sock").unwrap(),
            Endpoint::Ipc("/tmp/kv.sock".into())
        );
        for bad in [
            "inproc://x",
            "tcp://host",
            "tcp://:1",
            "tcp://h:99999",
            "ipc://",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn allow_list_matches_cidr_blocks() {
        let filter = PeerFilter::parse(&["10.1.0.0/16", "192.168.7.9", "fd00::/8"]).unwrap();
        assert!(filter.allows("10.1.200.3".parse().unwrap()));
        assert!(!filter.allows("10.2.0.1".parse().unwrap()));
        assert!(filter.allows("192.168.7.9".parse().unwrap()));
        assert!(!filter.allows("192.168.7.10".parse().unwrap()));
        assert!(filter.allows("fd12::1".parse().unwrap()));
        assert!(!filter.allows("::1".parse().unwrap()));
        assert!(
            filter.allows("::ffff:10.1.2.3".parse().unwrap()),
            "v4-mapped"
        );
        assert!(PeerFilter::any().allows("8.8.8.8".parse().unwrap()));
        let everyone = PeerFilter::parse(&["0.0.0.0/0"]).unwrap();
        assert!(everyone.allows("8.8.8.8".parse().unwrap()));
        for bad in ["10.0.0.0/33", "host", "10.0.0.1/x", "::/129"] {
            assert!(PeerFilter::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
