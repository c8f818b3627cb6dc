//! kvroute-config: the one configuration library of every kvroute component (ext-proc, the index,
//! the agent, the proxy-wasm filter).
//!
//! - [`ConfigError`]: the one error type; its message names the field path, e.g.
//!   `pools[2].block_size: expected 1..=4096 (got 0)`.
//! - [`from_yaml`] / [`from_json`]: deserialize a raw config through `serde_path_to_error`, so an
//!   unknown key, a wrong type or a leaf's own validation failure carries its path.
//! - Leaf types that validate inside their `Deserialize` (so the path comes for free):
//!   [`ConfigDuration`], [`ListenAddr`], [`ZmqEndpoint`], [`AllowedPeer`], [`SocketMode`],
//!   [`HeaderName`], the token source ([`RawTokenSource`], [`TokenSource`]), the TLS settings
//!   ([`RawServerTls`], [`RawClientTls`]) and the KV-event source section ([`RawEventSource`],
//!   [`event_source_section!`]), and the `log` section every server has ([`RawLog`]).
//! - Data-parallel ranks: [`rank_replica_id`] (every component's name for a rank),
//!   [`ZmqEndpoint::for_data_parallel_rank`] (vLLM's port rule), [`DATA_PARALLEL_RANK_HEADER`].
//! - [`reference`](mod@reference): renders a raw config's JSON schema as the markdown of
//!   `docs/configuration.md`.
//!
//! No I/O and no async runtime: it also builds for `wasm32-wasip1` (the proxy-wasm filter).

#![deny(missing_docs)]

mod duration;
mod engines;
mod error;
mod events;
mod log;
mod net;
mod ranks;
pub mod reference;
mod roles;
mod tls;
mod token;

pub use duration::{ConfigDuration, DurationError, format_duration, parse_duration};
pub use engines::Engine;
pub use error::{ConfigError, ErrorKind, from_json, from_yaml, join_path};
pub use events::{
    DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX, DEFAULT_MAX_MESSAGE_BYTES, RawEventSource,
    check_transport,
};
pub use log::{DEFAULT_LOG_FORMAT, LogFormat, RawLog};
pub use net::{AllowedPeer, HeaderName, ListenAddr, SocketMode, ZmqAddress, ZmqEndpoint};
pub use ranks::{
    DATA_PARALLEL_RANK_HEADER, MAX_DATA_PARALLEL_SIZE, check_data_parallel_size,
    rank_ports_overlap, rank_replica_id,
};
pub use roles::Role;
pub use tls::{RawClientTls, RawServerTls};
pub use token::{RawTokenSource, TokenSource};

/// Re-exported for [`event_source_section!`], which derives the schema of the struct it defines
/// in the caller's crate.
#[doc(hidden)]
pub use schemars as __schemars;
