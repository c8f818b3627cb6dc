//! Addresses and socket settings: listen addresses, ZeroMQ endpoints, peer allow-lists, the
//! socket mode and HTTP header names. Each validates while deserializing.

use std::borrow::Cow;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Implements `Deserialize` (from a string, through `FromStr`, whose error is the reason),
/// `Serialize` (through `Display`) and a string `JsonSchema` for a leaf type.
macro_rules! string_leaf {
    ($ty:ty, $name:literal, $expecting:literal, $schema_description:literal) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Visitor;
                impl de::Visitor<'_> for Visitor {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }
                    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                        text.parse()
                            .map_err(|reason| E::custom(format_args!("{reason} (got {text:?})")))
                    }
                }
                deserializer.deserialize_str(Visitor)
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl schemars::JsonSchema for $ty {
            fn schema_name() -> Cow<'static, str> {
                $name.into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({
                    "type": "string",
                    "description": $schema_description,
                })
            }
        }
    };
}

/// A listen address, `ip:port` (`127.0.0.1:9090`, `[::]:50061`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenAddr(pub SocketAddr);

impl ListenAddr {
    /// The address.
    pub fn get(self) -> SocketAddr {
        self.0
    }
}

impl FromStr for ListenAddr {
    type Err = &'static str;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse().map(ListenAddr).map_err(|_| "expected ip:port")
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

string_leaf!(
    ListenAddr,
    "ListenAddr",
    "an address ip:port",
    "An address `ip:port`."
);

/// A ZeroMQ endpoint as kvroute's transport serves it: `tcp://host:port` (host `*` binds every
/// interface, `[v6]` in brackets) or `ipc://path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqEndpoint {
    text: String,
    address: ZmqAddress,
}

/// A [`ZmqEndpoint`] taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZmqAddress {
    /// `tcp://host:port`; host `*` means every interface (bind only).
    Tcp {
        /// Host name or address, brackets removed.
        host: String,
        /// Port (0 binds any free port).
        port: u16,
    },
    /// `ipc://path`: a Unix domain socket.
    Ipc(PathBuf),
}

impl ZmqAddress {
    /// Parses an endpoint; `Err` says why it is not one (the one grammar: the transport parses
    /// with it too).
    pub fn parse(endpoint: &str) -> Result<Self, &'static str> {
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            if path.is_empty() {
                return Err("empty ipc path");
            }
            return Ok(ZmqAddress::Ipc(PathBuf::from(path)));
        }
        let Some(address) = endpoint.strip_prefix("tcp://") else {
            return Err("only tcp:// and ipc:// are supported");
        };
        let (host, port) = address
            .rsplit_once(':')
            .ok_or("tcp endpoint without a port")?;
        let port = port
            .parse::<u16>()
            .map_err(|_| "port is not a number in 0..=65535")?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() {
            return Err("tcp endpoint without a host");
        }
        Ok(ZmqAddress::Tcp {
            host: host.to_owned(),
            port,
        })
    }
}

impl ZmqEndpoint {
    /// The endpoint as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The endpoint taken apart.
    pub fn address(&self) -> &ZmqAddress {
        &self.address
    }

    /// Whether this is an `ipc://` endpoint.
    pub fn is_ipc(&self) -> bool {
        matches!(self.address, ZmqAddress::Ipc(_))
    }
}

impl From<ZmqEndpoint> for String {
    fn from(endpoint: ZmqEndpoint) -> Self {
        endpoint.text
    }
}

impl FromStr for ZmqEndpoint {
    type Err = &'static str;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        ZmqAddress::parse(text).map(|address| ZmqEndpoint {
            text: text.to_owned(),
            address,
        })
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

string_leaf!(
    ZmqEndpoint,
    "ZmqEndpoint",
    "a ZeroMQ endpoint tcp://host:port or ipc://path",
    "A ZeroMQ endpoint: `tcp://host:port` (`*` binds every interface) or `ipc://path`."
);

/// One `allowed_peers` entry: an IP address or a CIDR block (`10.0.0.7`, `10.0.0.0/24`,
/// `fd00::/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllowedPeer {
    /// The network address.
    pub address: IpAddr,
    /// Prefix length (32 or 128 for a single address).
    pub prefix: u8,
}

impl FromStr for AllowedPeer {
    type Err = &'static str;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        const REASON: &str = "expected an IP address or a CIDR block (10.0.0.0/24)";
        let entry = text.trim();
        let (address, prefix) = match entry.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (entry, None),
        };
        let address: IpAddr = address.parse().map_err(|_| REASON)?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) => prefix
                .parse::<u8>()
                .ok()
                .filter(|&p| p <= max)
                .ok_or(REASON)?,
            None => max,
        };
        Ok(AllowedPeer { address, prefix })
    }
}

impl fmt::Display for AllowedPeer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

string_leaf!(
    AllowedPeer,
    "AllowedPeer",
    "an IP address or a CIDR block",
    "An IP address or a CIDR block (`10.0.0.7`, `10.0.0.0/24`, `fd00::/8`)."
);

/// Whether kvroute's SUB socket connects to the engine or binds for the engine to connect.
///
/// vLLM's PUB **binds** when its endpoint contains `*` or `::` or uses `ipc://`/`inproc://`
/// (the default `tcp://*:5557`), and **connects** otherwise (e.g. `tcp://router-host:5557`).
/// kvroute does the opposite; [`SocketMode::for_engine_endpoint`] applies the rule.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Deserialize, Serialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum SocketMode {
    /// Connect to an engine that binds (reconnecting whenever it goes away).
    #[default]
    Connect,
    /// Bind the endpoint and let engines connect to it.
    Bind,
}

impl SocketMode {
    /// Our mode for an engine configured with `engine_endpoint` (vLLM's bind-or-connect rule).
    pub fn for_engine_endpoint(engine_endpoint: &str) -> Self {
        if Self::engine_binds(engine_endpoint) {
            SocketMode::Connect
        } else {
            SocketMode::Bind
        }
    }

    /// vLLM's `ZmqEventPublisher._socket_setup` rule: does the engine bind this endpoint?
    pub fn engine_binds(engine_endpoint: &str) -> bool {
        engine_endpoint.contains('*')
            || engine_endpoint.contains("::")
            || engine_endpoint.starts_with("ipc://")
            || engine_endpoint.starts_with("inproc://")
    }

    /// Metric/log label (as written in config).
    pub fn as_label(self) -> &'static str {
        match self {
            SocketMode::Connect => "connect",
            SocketMode::Bind => "bind",
        }
    }
}

/// An HTTP header name as Envoy stores it: lowercase letters, digits, `-`, `_`, `.` (an uppercase
/// name in config would never match).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HeaderName(String);

impl HeaderName {
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<HeaderName> for String {
    fn from(name: HeaderName) -> Self {
        name.0
    }
}

impl FromStr for HeaderName {
    type Err = &'static str;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let valid = !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
        if valid {
            Ok(HeaderName(text.to_owned()))
        } else {
            Err("expected a lowercase HTTP header name")
        }
    }
}

impl fmt::Display for HeaderName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

string_leaf!(
    HeaderName,
    "HeaderName",
    "a lowercase HTTP header name",
    "A lowercase HTTP header name."
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_the_one_grammar() {
        assert_eq!(
            ZmqAddress::parse("tcp://*:5557"),
            Ok(ZmqAddress::Tcp {
                host: "*".into(),
                port: 5557
            })
        );
        assert_eq!(
            ZmqAddress::parse("tcp://[::1]:0"),
            Ok(ZmqAddress::Tcp {
                host: "::1".into(),
                port: 0
            })
        );
        assert_eq!(
            ZmqAddress::parse("ipc:///tmp/kv.sock"),
            Ok(ZmqAddress::Ipc("/tmp/kv.sock".into()))
        );
        for bad in [
            "inproc://kv",
            "h:1",
            "tcp://h",
            "tcp://:1",
            "tcp://h:99999",
            "ipc://",
        ] {
            assert!(bad.parse::<ZmqEndpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn peers_parse_addresses_and_blocks() {
        let peer: AllowedPeer = "10.1.0.0/16".parse().unwrap();
        assert_eq!(peer.prefix, 16);
        assert_eq!("::1".parse::<AllowedPeer>().unwrap().prefix, 128);
        for bad in ["10.0.0.0/33", "nope", "10.0.0.1/x", "::/129"] {
            assert!(bad.parse::<AllowedPeer>().is_err(), "{bad}");
        }
    }

    #[test]
    fn mode_follows_vllm_bind_rule() {
        for (endpoint, mode) in [
            ("tcp://*:5557", SocketMode::Connect),
            ("tcp://[::]:5557", SocketMode::Connect),
            ("ipc:///tmp/kv", SocketMode::Connect),
            ("inproc://kv_dp1", SocketMode::Connect),
            ("tcp://router:5557", SocketMode::Bind),
            ("tcp://10.0.0.5:5557", SocketMode::Bind),
        ] {
            assert_eq!(
                SocketMode::for_engine_endpoint(endpoint),
                mode,
                "{endpoint}"
            );
        }
    }

    #[test]
    fn header_names_are_lowercase() {
        assert!("x-session-id".parse::<HeaderName>().is_ok());
        for bad in ["", "X-Session", "a b"] {
            assert!(bad.parse::<HeaderName>().is_err(), "{bad}");
        }
    }
}
