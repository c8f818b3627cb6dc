//! The process's stop signal.

/// Resolves on SIGTERM or SIGINT (Ctrl-C). If SIGTERM cannot be watched, on SIGINT only (logged).
pub async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(error) => {
            tracing::warn!(%error, "cannot watch SIGTERM; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutdown signal received");
}
