//! Logging set-up, the same for every kvroute binary.

/// Logs to stderr, filtered by `RUST_LOG`, or by `default_filter` (e.g. `info`) when it is unset
/// or unparsable.
pub fn init(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
}
