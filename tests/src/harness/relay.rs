//! [`TcpRelay`]: a TCP forwarder a test can cut, to sever one connection path (the index's
//! subscription to one engine's KV events, an agent's stream to the index) while both ends keep
//! running. It forwards bytes unchanged, so each end speaks its real protocol to the other.

use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Forwards every connection made to [`TcpRelay::addr`] to the target.
#[derive(Debug)]
pub struct TcpRelay {
    addr: SocketAddr,
    /// Cancels the connections open now (replaced by [`TcpRelay::drop_connections`]).
    connections: Arc<Mutex<CancellationToken>>,
    /// Stops listening.
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl TcpRelay {
    /// Listens on 127.0.0.1 port 0 and forwards to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let connections = Arc::new(Mutex::new(CancellationToken::new()));
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(accept_loop(
            listener,
            target,
            Arc::clone(&connections),
            stop.clone(),
            tasks.clone(),
        ));
        Ok(Self {
            addr,
            connections,
            stop,
            tasks,
        })
    }

    /// Where to connect instead of the target.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the connections open now; new ones are forwarded again.
    pub fn drop_connections(&self) {
        let open = std::mem::replace(&mut *self.connections.lock(), CancellationToken::new());
        open.cancel();
    }

    /// Closes every connection and stops listening (new connections are refused); returns once
    /// all are closed.
    pub async fn cut(&self) {
        self.stop.cancel();
        self.drop_connections();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.stop.cancel();
        self.connections.lock().cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    connections: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut inbound, _)) = accepted else {
            continue;
        };
        let dropped = connections.lock().clone();
        tasks.spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(target).await else {
                return; // The target is gone: dropping `inbound` closes the client's side too.
            };
            tokio::select! {
                () = dropped.cancelled() => {}
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
            }
        });
    }
}
