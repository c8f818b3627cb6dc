//! Ports for processes that bind late and cannot report what they bound (real vLLM's HTTP and
//! replay ports, an index socket in `mode: bind`, an endpoint that must stay dead).
//!
//! A port picked by binding port 0 and closing comes from the kernel's ephemeral range, where any
//! outgoing connection can take it before the late binder binds it (the real-vLLM tier once
//! failed with `Address already in use` that way). [`reserve_port`] picks instead from outside
//! `/proc/sys/net/ipv4/ip_local_port_range`, where the kernel never assigns ports on its own,
//! checks that nothing listens there, and holds an advisory lock file for it for the life of the
//! process, so test processes running in parallel never hand out the same port.
//!
//! Processes that can bind port 0 and report the port (ready files, Envoy's admin) should do
//! that instead; this is for the ones that cannot.

use std::fs::File;
use std::net::TcpListener;
use std::path::PathBuf;

use parking_lot::Mutex;

use super::HarnessError;

/// Where the ephemeral range is (Linux); the kernel's default is assumed without it.
const EPHEMERAL_RANGE_FILE: &str = "/proc/sys/net/ipv4/ip_local_port_range";
/// Linux's default ephemeral range.
const DEFAULT_EPHEMERAL: (u16, u16) = (32768, 60999);
/// Below this, well-known and commonly configured service ports.
const LOWEST: u16 = 10_000;

/// The lock files of the ports this process reserved (a lock lasts while its file is open).
static RESERVED: Mutex<Vec<File>> = Mutex::new(Vec::new());

/// The kernel's ephemeral port range, inclusive.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string(EPHEMERAL_RANGE_FILE)
        .ok()
        .and_then(|text| {
            let mut bounds = text.split_whitespace().map(str::parse::<u16>);
            Some((bounds.next()?.ok()?, bounds.next()?.ok()?))
        })
        .unwrap_or(DEFAULT_EPHEMERAL)
}

/// The ports outside the ephemeral range this helper picks from.
fn candidates() -> Vec<u16> {
    let (low, high) = ephemeral_range();
    let below = LOWEST..low.max(LOWEST);
    let above = high.saturating_add(1).max(LOWEST)..=u16::MAX;
    below.chain(above).collect()
}

fn lock_dir() -> PathBuf {
    std::env::temp_dir().join("kvroute-test-ports")
}

/// A 127.0.0.1 TCP port outside the ephemeral range that nothing listens on and no other
/// caller of this function (in any process) holds; reserved until this process exits.
pub fn reserve_port() -> Result<u16, HarnessError> {
    reserve_port_run(1)
}

/// The first of `count` consecutive ports, each reserved as [`reserve_port`] reserves one: for
/// a process that derives ports from a base (vLLM's data-parallel rank r publishes on the
/// configured port + r).
pub fn reserve_port_run(count: usize) -> Result<u16, HarnessError> {
    let dir = lock_dir();
    std::fs::create_dir_all(&dir).map_err(|source| HarnessError::Io {
        path: dir.clone(),
        source,
    })?;
    let candidates = candidates();
    // Start somewhere different per process, so parallel processes rarely contend for a lock.
    let start = (std::process::id() as usize).wrapping_mul(7919) % candidates.len().max(1);
    let mut reserved = RESERVED.lock();
    for &first in candidates[start..].iter().chain(&candidates[..start]) {
        let run: Option<Vec<File>> = (0..count)
            .map(|i| {
                let port = u16::try_from(usize::from(first) + i).ok()?;
                if !candidates.contains(&port) {
                    return None;
                }
                try_reserve(&dir, port)
            })
            .collect();
        if let Some(files) = run {
            reserved.extend(files);
            return Ok(first);
        }
    }
    Err(HarnessError::Protocol {
        what: "port reservation".to_owned(),
        detail: format!(
            "no {count} consecutive free ports outside the ephemeral range {:?}",
            ephemeral_range()
        ),
    })
}

/// `port`'s lock file, locked, when no other caller holds it and nothing listens there.
fn try_reserve(dir: &std::path::Path, port: u16) -> Option<File> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(format!("{port}.lock")))
        .ok()?;
    // Another process (or this one) holds it.
    file.try_lock().ok()?;
    // Something outside the harness listens there.
    TcpListener::bind(("127.0.0.1", port)).ok()?;
    Some(file)
}

/// `count` distinct reserved ports ([`reserve_port`]).
pub fn reserve_ports(count: usize) -> Result<Vec<u16>, HarnessError> {
    (0..count).map(|_| reserve_port()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_distinct_free_and_outside_the_ephemeral_range() {
        let (low, high) = ephemeral_range();
        let ports = reserve_ports(4).unwrap();
        for &port in &ports {
            assert!(!(low..=high).contains(&port), "{port} in {low}..={high}");
            assert!(port >= LOWEST);
            // Nothing listens there (the check released its listener).
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        // Held: a second lock on the same port's file fails while this process runs.
        let path = lock_dir().join(format!("{}.lock", ports[0]));
        let again = File::options().write(true).open(path).unwrap();
        assert!(again.try_lock().is_err());
        let first = reserve_port_run(2).unwrap();
        for port in [first, first + 1] {
            assert!(!ports.contains(&port));
            TcpListener::bind(("127.0.0.1", port)).unwrap();
        }
    }
}
