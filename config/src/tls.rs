//! TLS settings as written; `kvroute_runtime::tls` reads the files and builds tonic's
//! configuration from them.

/// `listen.tls` (the index's and ext-proc's gRPC listeners).
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawServerTls {
    /// PEM certificate chain (leaf first).
    pub cert: String,
    /// PEM private key of the leaf.
    pub key: String,
    /// PEM CA bundle; when set, clients must present a certificate it signs (mutual TLS).
    pub client_ca: Option<String>,
}

/// A client `tls` section (the agent's, ext-proc's `index.tls`): the addresses are then
/// `https://`.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RawClientTls {
    /// PEM CA bundle the server's certificate must chain to.
    pub ca: String,
    /// Name the server's certificate must carry (default: the address's host).
    pub server_name: Option<String>,
    /// PEM client certificate chain, for servers that require one (with `key`).
    pub cert: Option<String>,
    /// PEM private key of `cert`.
    pub key: Option<String>,
}
