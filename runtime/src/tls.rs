//! Optional TLS (rustls, ring provider) for the gRPC listeners and their clients.
//!
//! Server side (`kvroute-index` `listen.tls`, kvroute-ext-proc `listen.tls` for its ext_proc
//! port): a certificate chain and its key, and optionally a
//! CA bundle that client certificates must chain to (mutual TLS). Client side (kvroute-agent
//! `tls`, kvroute-ext-proc `index.tls`): the CA bundle that signs the index's certificate, the
//! name to check it against (default: the URI's host), and optionally a client certificate and
//! key for mutual TLS.
//!
//! ```yaml
//! listen:                                    # kvroute-index
//!   tls: {cert: /tls/tls.crt, key: /tls/tls.key, client_ca: /tls/clients-ca.crt}
//! tls: {ca: /tls/ca.crt, server_name: kvroute-index}   # kvroute-agent (indexes: https://...)
//! ```
//!
//! Files are read and checked when the config is loaded, so a wrong path or a file that is not
//! PEM is a config error naming the field, never a failure at first connection. Key material is
//! never printed (`Debug` shows only the paths).

use std::path::{Path, PathBuf};

use kvroute_config::{RawClientTls, RawServerTls};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Why TLS settings are unusable.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("`{field}`: cannot read {}", path.display())]
    Read {
        /// Config field naming the file.
        field: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file holds no PEM block of the expected kind.
    #[error("`{field}`: {} holds no PEM {expected}", path.display())]
    NotPem {
        /// Config field naming the file.
        field: String,
        /// The file.
        path: PathBuf,
        /// What was expected (`CERTIFICATE`, `PRIVATE KEY`).
        expected: &'static str,
    },
    /// Fields that only make sense together were not given together.
    #[error("`{field}`: {reason}")]
    Incomplete {
        /// The section.
        field: String,
        /// What is missing.
        reason: &'static str,
    },
    /// rustls refused the material (key does not match, unsupported key type, ...).
    #[error("`{field}`: unusable TLS material: {source}")]
    Rejected {
        /// The section.
        field: String,
        /// The cause.
        #[source]
        source: tonic::transport::Error,
    },
}

impl TlsError {
    /// The config field at fault (`listen.tls.cert`).
    pub fn field(&self) -> &str {
        match self {
            TlsError::Read { field, .. }
            | TlsError::NotPem { field, .. }
            | TlsError::Incomplete { field, .. }
            | TlsError::Rejected { field, .. } => field,
        }
    }

    /// Why, without the field (for a `kvroute_config::ConfigError` at [`TlsError::field`]).
    pub fn reason(&self) -> String {
        match self {
            TlsError::Read { path, source, .. } => {
                format!("cannot read {}: {source}", path.display())
            }
            TlsError::NotPem { path, expected, .. } => {
                format!("{} holds no PEM {expected}", path.display())
            }
            TlsError::Incomplete { reason, .. } => (*reason).to_owned(),
            TlsError::Rejected { source, .. } => format!("unusable TLS material: {source}"),
        }
    }

    /// Metric/log label.
    pub fn as_label(&self) -> &'static str {
        match self {
            TlsError::Read { .. } => "read",
            TlsError::NotPem { .. } => "not_pem",
            TlsError::Incomplete { .. } => "incomplete",
            TlsError::Rejected { .. } => "rejected",
        }
    }
}

const CERTIFICATE: &str = "CERTIFICATE";
const PRIVATE_KEY: &str = "PRIVATE KEY";

/// Reads a PEM file and checks it holds a block whose label ends with `expected`.
fn read_pem(field: &str, path: &str, expected: &'static str) -> Result<Vec<u8>, TlsError> {
    let path_buf = Path::new(path).to_path_buf();
    if path.is_empty() {
        return Err(TlsError::Incomplete {
            field: field.to_owned(),
            reason: "a file path is required",
        });
    }
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        field: field.to_owned(),
        path: path_buf.clone(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let has_block = text.lines().any(|line| {
        line.strip_prefix("-----BEGIN ")
            .and_then(|rest| rest.strip_suffix("-----"))
            .is_some_and(|label| label.ends_with(expected))
    });
    if !has_block {
        return Err(TlsError::NotPem {
            field: field.to_owned(),
            path: path_buf,
            expected,
        });
    }
    Ok(bytes)
}

/// Validated server TLS material.
#[derive(Clone, PartialEq, Eq)]
pub struct ServerTls {
    paths: RawServerTls,
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.paths.cert)
            .field("key", &self.paths.key)
            .field("client_ca", &self.paths.client_ca)
            .finish()
    }
}

impl ServerTls {
    /// Reads and checks the files; `field` is the section's path for errors (`listen.tls`).
    pub fn load(raw: &RawServerTls, field: &str) -> Result<Self, TlsError> {
        let tls = Self {
            cert: read_pem(&format!("{field}.cert"), &raw.cert, CERTIFICATE)?,
            key: read_pem(&format!("{field}.key"), &raw.key, PRIVATE_KEY)?,
            client_ca: raw
                .client_ca
                .as_deref()
                .map(|ca| read_pem(&format!("{field}.client_ca"), ca, CERTIFICATE))
                .transpose()?,
            paths: raw.clone(),
        };
        // rustls parses the key and chain here: a mismatch is a config error, not a serve error.
        tonic::transport::Server::builder()
            .tls_config(tls.tonic_config())
            .map_err(|source| TlsError::Rejected {
                field: field.to_owned(),
                source,
            })?;
        Ok(tls)
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.client_ca.is_some()
    }

    /// The tonic server configuration.
    pub fn tonic_config(&self) -> ServerTlsConfig {
        let config = ServerTlsConfig::new().identity(Identity::from_pem(&self.cert, &self.key));
        match &self.client_ca {
            Some(ca) => config.client_ca_root(Certificate::from_pem(ca)),
            None => config,
        }
    }
}

/// Validated client TLS material.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    paths: RawClientTls,
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca", &self.paths.ca)
            .field("server_name", &self.paths.server_name)
            .field("cert", &self.paths.cert)
            .field("key", &self.paths.key)
            .finish()
    }
}

impl ClientTls {
    /// Reads and checks the files; `field` is the section's path for errors (`index.tls`).
    pub fn load(raw: &RawClientTls, field: &str) -> Result<Self, TlsError> {
        let identity = match (&raw.cert, &raw.key) {
            (Some(cert), Some(key)) => Some((
                read_pem(&format!("{field}.cert"), cert, CERTIFICATE)?,
                read_pem(&format!("{field}.key"), key, PRIVATE_KEY)?,
            )),
            (None, None) => None,
            _ => {
                return Err(TlsError::Incomplete {
                    field: field.to_owned(),
                    reason: "`cert` and `key` go together",
                });
            }
        };
        if raw.server_name.as_deref() == Some("") {
            return Err(TlsError::Incomplete {
                field: format!("{field}.server_name"),
                reason: "must not be empty (omit it to use the URI's host)",
            });
        }
        let tls = Self {
            ca: read_pem(&format!("{field}.ca"), &raw.ca, CERTIFICATE)?,
            identity,
            paths: raw.clone(),
        };
        tls.apply(Endpoint::from_static("https://kvroute-index.invalid"))
            .map_err(|source| TlsError::Rejected {
                field: field.to_owned(),
                source,
            })?;
        Ok(tls)
    }

    /// The tonic client configuration.
    pub fn tonic_config(&self) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca));
        if let Some(name) = &self.paths.server_name {
            config = config.domain_name(name.clone());
        }
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        config
    }

    /// `endpoint` with this TLS configuration (its URI must be `https://`).
    pub fn apply(&self, endpoint: Endpoint) -> Result<Endpoint, tonic::transport::Error> {
        endpoint.tls_config(self.tonic_config())
    }
}

/// Checks that a gRPC URI's scheme matches whether TLS is configured: tonic silently speaks
/// plaintext to an `http://` URI even with TLS configured, and cannot reach `https://` without.
pub fn check_scheme(uri: &str, tls: bool) -> Result<(), &'static str> {
    match (uri.starts_with("https://"), tls) {
        (true, true) | (false, false) => Ok(()),
        (false, true) => Err("with `tls` configured the address must be https://"),
        (true, false) => Err("an https:// address needs a `tls` section (at least `ca`)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_non_pem_files_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let raw = RawServerTls {
            cert: junk.display().to_string(),
            key: "/nonexistent/key.pem".to_owned(),
            client_ca: None,
        };
        let error = ServerTls::load(&raw, "listen.tls").unwrap_err();
        assert_eq!(error.as_label(), "not_pem");
        assert!(error.to_string().contains("listen.tls.cert"), "{error}");

        let raw = RawClientTls {
            ca: junk.display().to_string(),
            cert: Some("c.pem".to_owned()),
            ..RawClientTls::default()
        };
        let error = ClientTls::load(&raw, "tls").unwrap_err();
        assert_eq!(error.as_label(), "incomplete");
    }

    #[test]
    fn scheme_must_match_tls() {
        assert!(check_scheme("https://a:1", true).is_ok());
        assert!(check_scheme("http://a:1", false).is_ok());
        assert!(check_scheme("http://a:1", true).is_err());
        assert!(check_scheme("https://a:1", false).is_err());
    }
}
