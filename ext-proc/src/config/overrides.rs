//! The flags GIE's and llm-d's EPP charts pass, which override the file.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use kvroute_config::{ListenAddr, RawServerTls};

use super::RawConfig;

/// Command-line settings that override the file: the flags GIE's and llm-d's EPP charts pass
/// (`--grpc-port`, `--grpc-health-port`, `--metrics-port`, `--secure-serving`, `--cert-path`,
/// `--zap-encoder`).
/// A port flag listens on all interfaces (`0.0.0.0:port`), as those charts expect. Applied on
/// every reload too.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides {
    /// `listen.grpc` = `0.0.0.0:port`.
    pub grpc_port: Option<u16>,
    /// `listen.health` = `0.0.0.0:port`.
    pub health_port: Option<u16>,
    /// `listen.admin` = `0.0.0.0:port` (`/metrics`).
    pub metrics_port: Option<u16>,
    /// `listen.secure_serving`.
    pub secure_serving: Option<bool>,
    /// `listen.tls` = `{cert: DIR/tls.crt, key: DIR/tls.key}` (a Kubernetes TLS Secret's keys).
    pub cert_dir: Option<PathBuf>,
    /// `log.format` (`--zap-encoder json` → `json`, `console` → `text`).
    pub log_format: Option<kvroute_config::LogFormat>,
}

impl Overrides {
    pub(super) fn apply(&self, raw: &mut RawConfig) {
        let all_interfaces =
            |port: u16| ListenAddr(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)));
        if let Some(port) = self.grpc_port {
            raw.listen.grpc = Some(all_interfaces(port));
        }
        if let Some(port) = self.health_port {
            raw.listen.health = Some(all_interfaces(port));
        }
        if let Some(port) = self.metrics_port {
            raw.listen.admin = Some(all_interfaces(port));
        }
        if let Some(secure) = self.secure_serving {
            raw.listen.secure_serving = Some(secure);
        }
        if let Some(format) = self.log_format {
            raw.log.format = Some(format);
        }
        if let Some(dir) = &self.cert_dir {
            raw.listen.tls = Some(RawServerTls {
                cert: dir.join("tls.crt").display().to_string(),
                key: dir.join("tls.key").display().to_string(),
                client_ca: None,
            });
        }
    }
}
