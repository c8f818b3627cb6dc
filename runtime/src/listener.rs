//! Binding a server's TCP listeners, with one error that says which listener and where.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// A listener that could not be bound (or whose bound address could not be read).
#[derive(Debug, thiserror::Error)]
#[error("cannot bind {what} listener on {addr}")]
pub struct BindError {
    /// Which listener: `grpc`, `admin`, `health`, ….
    pub what: &'static str,
    /// The configured address.
    pub addr: SocketAddr,
    /// The cause.
    #[source]
    pub source: std::io::Error,
}

/// Binds `what`'s listener on `addr` (port 0 picks a free port) and returns it with the address
/// it took.
pub async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), BindError> {
    let error = |source| BindError { what, addr, source };
    let listener = TcpListener::bind(addr).await.map_err(error)?;
    let local_addr = listener.local_addr().map_err(error)?;
    Ok((listener, local_addr))
}
