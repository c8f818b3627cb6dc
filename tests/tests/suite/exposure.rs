//! What kvroute exposes to the network by default (issue 13): every listener binds loopback
//! unless configured, so another host cannot reach ext_proc, the admin ports or the index's query
//! API.
//!
//! A listener's reachability is checked from this host's own non-loopback IPv4 address, found
//! without sending a packet (a UDP socket `connect` only picks the route); a host without one
//! skips that half of the check and says so.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use kvroute_ext_proc::ExtProc;

/// How long a connection attempt to our own address may take before it counts as not refused.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// An ext-proc config with nothing but a pool and a replica: every other key at its default.
const EXT_PROC_DEFAULTS: &str = r#"
pools:
- {name: p, models: [m], block_size: 16, key_scheme: {kind: token-chain}}
replicas:
- {id: r0, pool: p, address: "127.0.0.1:8000"}
"#;

/// A kvroute-index config with nothing but a pool and a replica (whose engine is absent).
const INDEX_DEFAULTS: &str = r#"
pools:
- {model: m, block_size: 16, key_scheme: token-chain}
replicas:
- {id: r0, model: m, events: {endpoint: "tcp://127.0.0.1:9"}}
"#;

/// This host's address on the route to a private network, if it has one that is not loopback.
/// `connect` on a UDP socket sends nothing: it only fixes the local address the kernel would use.
pub fn non_loopback_ipv4() -> Option<Ipv4Addr> {
    ["10.254.254.254:9", "192.168.254.254:9", "172.31.254.254:9"]
        .iter()
        .find_map(|target| {
            let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
            socket.connect(target).ok()?;
            match socket.local_addr().ok()?.ip() {
                IpAddr::V4(ip) if !ip.is_loopback() && !ip.is_unspecified() => Some(ip),
                _ => None,
            }
        })
}

/// Whether a TCP connection to `ip` on `bound`'s port is refused.
fn refused_from(ip: Ipv4Addr, bound: SocketAddr) -> bool {
    let target = SocketAddr::from((ip, bound.port()));
    match TcpStream::connect_timeout(&target, CONNECT_TIMEOUT) {
        Ok(_) => false,
        Err(error) => error.kind() == std::io::ErrorKind::ConnectionRefused,
    }
}

/// The default host of each listener, with port 0 so the test never takes a fixed port.
fn with_ephemeral_port(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip(), 0)
}

/// Checks `bound` listeners are loopback and unreachable from this host's other address.
fn assert_loopback_only(what: &str, bound: &[SocketAddr]) {
    for addr in bound {
        assert!(
            addr.ip().is_loopback(),
            "{what} listens on {addr} by default"
        );
    }
    let Some(ip) = non_loopback_ipv4() else {
        println!("{what}: no non-loopback IPv4 address on this host; reachability not checked");
        return;
    };
    for addr in bound {
        assert!(
            refused_from(ip, *addr),
            "{what}: {ip}:{} was not refused (listening on {addr})",
            addr.port()
        );
    }
}

#[tokio::test]
async fn ext_proc_listens_on_loopback_only_by_default() {
    let mut config = kvroute_ext_proc::Config::from_yaml(EXT_PROC_DEFAULTS).unwrap();
    config.grpc_addr = with_ephemeral_port(config.grpc_addr);
    config.admin_addr = with_ephemeral_port(config.admin_addr);
    let server = ExtProc::builder(config).bind().await.unwrap();
    let bound = [server.grpc_addr().unwrap(), server.admin_addr().unwrap()];
    assert_loopback_only("kvroute-ext-proc", &bound);

    // The check can fail: the same server told to listen everywhere is reachable.
    let Some(ip) = non_loopback_ipv4() else {
        return;
    };
    let mut open = kvroute_ext_proc::Config::from_yaml(EXT_PROC_DEFAULTS).unwrap();
    open.grpc_addr = "0.0.0.0:0".parse().unwrap();
    open.admin_addr = "0.0.0.0:0".parse().unwrap();
    let server = ExtProc::builder(open).bind().await.unwrap();
    assert!(!refused_from(ip, server.grpc_addr().unwrap()));
}

#[tokio::test]
async fn index_listens_on_loopback_only_by_default() {
    let mut config = kvroute_index::config::Config::from_yaml(INDEX_DEFAULTS).unwrap();
    config.grpc_addr = with_ephemeral_port(config.grpc_addr);
    config.admin_addr = with_ephemeral_port(config.admin_addr);
    let index = kvroute_index::server::IndexServer::start(config)
        .await
        .unwrap();
    assert_loopback_only("kvroute-index", &[index.grpc_addr(), index.admin_addr()]);
    index.shutdown().await;

    let agent_admin: SocketAddr = kvroute_index::agent::config::DEFAULT_ADMIN_ADDR
        .parse()
        .unwrap();
    assert!(
        agent_admin.ip().is_loopback(),
        "kvroute-agent's admin default is {agent_admin}"
    );
}
