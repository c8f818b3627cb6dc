//! [`TcpProxy`]: a TCP forwarder a test can cut: drop every open connection, and hold new ones
//! off until resumed (a link that goes down and comes back, with nothing lost on either end).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::HarnessError;

/// A TCP forwarder from a loopback port to `upstream`. Its tasks stop on [`TcpProxy::shutdown`]
/// (or, without waiting, on drop).
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    /// Cancelled to drop the connections open now; replaced by a fresh token at once.
    cut: Arc<Mutex<CancellationToken>>,
    /// While set, accepted connections are closed at once (the peer sees a reset link).
    paused: Arc<AtomicBool>,
    stop: CancellationToken,
    tasks: TaskTracker,
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and forwards each connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<Self, HarnessError> {
        let listener =
            TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|source| HarnessError::Io {
                    path: "127.0.0.1:0".into(),
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| HarnessError::Io {
            path: "127.0.0.1:0".into(),
            source,
        })?;
        let proxy = Self {
            addr,
            cut: Arc::new(Mutex::new(CancellationToken::new())),
            paused: Arc::new(AtomicBool::new(false)),
            stop: CancellationToken::new(),
            tasks: TaskTracker::new(),
        };
        let (cut, paused, stop, tasks) = (
            Arc::clone(&proxy.cut),
            Arc::clone(&proxy.paused),
            proxy.stop.clone(),
            proxy.tasks.clone(),
        );
        proxy.tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    () = stop.cancelled() => break,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut inbound, _)) = accepted else {
                    continue;
                };
                if paused.load(Ordering::Acquire) {
                    drop(inbound);
                    continue;
                }
                let token = cut.lock().clone();
                tasks.spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    tokio::select! {
                        () = token.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    }
                });
            }
        });
        Ok(proxy)
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every open connection; new ones are forwarded again at once (unless paused).
    pub fn cut(&self) {
        let old = std::mem::replace(&mut *self.cut.lock(), CancellationToken::new());
        old.cancel();
    }

    /// Cuts every open connection and refuses new ones (closed as soon as accepted) until
    /// [`TcpProxy::resume`].
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Release);
        self.cut();
    }

    /// Forwards new connections again.
    pub fn resume(&self) {
        self.paused.store(false, Ordering::Release);
    }

    /// Stops accepting, drops every connection and waits for the tasks to end.
    pub async fn shutdown(self) {
        self.stop.cancel();
        self.cut();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        // The tasks end on their own once cancelled; `shutdown` also waits for that.
        self.stop.cancel();
        self.cut.lock().cancel();
        self.tasks.close();
    }
}
