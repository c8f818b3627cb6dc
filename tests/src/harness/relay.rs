//! [`TcpRelay`]: a TCP forwarder a test can cut, to sever one connection path (e.g. the index's
//! subscription to one engine's KV events) while both ends keep running. It forwards bytes
//! unchanged, so each end speaks its real protocol to the other.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Forwards every connection made to [`TcpRelay::addr`] to the target until [`TcpRelay::cut`].
#[derive(Debug)]
pub struct TcpRelay {
    addr: SocketAddr,
    target: SocketAddr,
    cut: CancellationToken,
    tasks: TaskTracker,
}

impl TcpRelay {
    /// Listens on 127.0.0.1 port 0 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cut = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(accept_loop(listener, target, cut.clone(), tasks.clone()));
        Ok(Self {
            addr,
            target,
            cut,
            tasks,
        })
    }

    /// Where to connect instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address it forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Closes every forwarded connection and stops listening (new connections are refused);
    /// returns once all are closed.
    pub async fn cut(&self) {
        self.cut.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.cut.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    cut: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cut.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((inbound, _)) = accepted else {
            continue;
        };
        let cut = cut.clone();
        tasks.spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(target).await else {
                return; // The target is gone: dropping `inbound` closes the client's side too.
            };
            let mut inbound = inbound;
            tokio::select! {
                () = cut.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
            }
        });
    }
}
