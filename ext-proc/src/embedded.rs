//! The embedded index (`index.embedded`): kvroute-index's ingest and servers run in this process
//! and `Match` is answered in memory. It is the `embedded-index` feature (default on): without it
//! kvroute-ext-proc does not compile the index service (ingest, ZMTP sockets, admin server) and
//! needs a kvroute-index at an address; a config that asks for `index.embedded` is then refused
//! with an error saying so.
//!
//! Without the feature the types below are uninhabited stand-ins: nothing can construct them, so
//! the code that would use an embedded index compiles unchanged and never runs.

#[cfg(feature = "embedded-index")]
pub(crate) use kvroute_index::config::Config as IndexConfig;
#[cfg(feature = "embedded-index")]
pub(crate) use kvroute_index::server::{IndexServer, LocalMatcher, MatchError, ServeError};

#[cfg(not(feature = "embedded-index"))]
pub use absent::{IndexConfig, IndexServer, LocalMatcher, MatchError, ServeError};

#[cfg(not(feature = "embedded-index"))]
mod absent {
    use std::net::SocketAddr;

    use kvroute_index_api::api::{MatchRequest, MatchResponse};

    /// Why `index.embedded` cannot be used.
    #[derive(Debug, thiserror::Error)]
    #[error(
        "kvroute-ext-proc was built without the `embedded-index` feature: run kvroute-index \
         and list it in `index.addresses`"
    )]
    pub struct Unavailable;

    /// A kvroute-index config (never valid in this build).
    #[derive(Debug, Clone, PartialEq)]
    pub enum IndexConfig {}

    impl IndexConfig {
        /// Refuses: this build has no embedded index.
        pub fn from_yaml(_text: &str) -> Result<Self, Unavailable> {
            Err(Unavailable)
        }
    }

    /// A running embedded index (none in this build).
    #[derive(Debug)]
    pub enum IndexServer {}

    impl IndexServer {
        /// Unreachable: no [`IndexConfig`] exists.
        pub async fn start(config: IndexConfig) -> Result<Self, ServeError> {
            match config {}
        }

        /// Unreachable.
        pub fn grpc_addr(&self) -> SocketAddr {
            match *self {}
        }

        /// Unreachable.
        pub fn admin_addr(&self) -> SocketAddr {
            match *self {}
        }

        /// Unreachable.
        pub fn matcher(&self) -> LocalMatcher {
            match *self {}
        }

        /// Unreachable.
        pub async fn shutdown(self) {
            match self {}
        }
    }

    /// Answers `Match` in process (none in this build).
    #[derive(Debug, Clone)]
    pub enum LocalMatcher {}

    impl LocalMatcher {
        /// Unreachable.
        pub fn r#match(&self, _request: &MatchRequest) -> Result<MatchResponse, MatchError> {
            match *self {}
        }
    }

    /// Why the embedded index refused a query (never, in this build).
    #[derive(Debug)]
    pub enum MatchError {}

    impl std::error::Error for MatchError {}

    impl std::fmt::Display for MatchError {
        fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match *self {}
        }
    }

    /// Why the embedded index could not start (never, in this build).
    #[derive(Debug)]
    pub enum ServeError {}

    impl std::error::Error for ServeError {}

    impl std::fmt::Display for ServeError {
        fn fmt(&self, _f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match *self {}
        }
    }
}
