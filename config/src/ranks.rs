//! Data-parallel ranks: one engine endpoint (one API server) in front of several engine ranks,
//! each with its own KV cache and its own KV-event publisher. kvroute routes to a rank as it
//! routes to a replica: every rank is a routing target of its own, named
//! [`rank_replica_id`]`(replica, rank)` by every component (the index's replica, the agent's
//! stream, ext-proc's candidate, their metric labels), and a request routed to it carries
//! [`DATA_PARALLEL_RANK_HEADER`], which vLLM's API server honours.

use crate::{ZmqAddress, ZmqEndpoint};

/// The request header naming the engine rank that must serve a request (vLLM's API server reads
/// `X-data-parallel-rank`; HTTP header names are case-insensitive, Envoy sends them lower-case).
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";

/// Most data-parallel ranks one replica may declare: far above any deployment (a rank is an
/// accelerator's share of an engine), low enough that a typo cannot open thousands of sockets.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 256;

/// What separates a replica's id from its rank in a rank's id. Configured ids never contain it
/// (ids are `[A-Za-z0-9._:-]`), so a rank's id cannot collide with a configured replica's.
const RANK_SEPARATOR: &str = "@dp";

/// The id of `replica`'s data-parallel rank `rank`: `pod-a@dp1`.
pub fn rank_replica_id(replica: &str, rank: u32) -> String {
    format!("{replica}{RANK_SEPARATOR}{rank}")
}

/// Checks a declared `data_parallel_size` (the reason, for the caller's field path).
pub fn check_data_parallel_size(size: u32) -> Result<(), String> {
    if (1..=MAX_DATA_PARALLEL_SIZE).contains(&size) {
        Ok(())
    } else {
        Err(format!(
            "expected 1..={MAX_DATA_PARALLEL_SIZE} (got {size})"
        ))
    }
}

/// Whether `ranks` publishers on `events`' port and up would meet replay sockets on `replay`'s
/// port and up, on the same host (vLLM offsets both by the rank, so with the usual 5557/5558 and
/// two ranks, rank 1's publisher would take rank 0's replay port).
pub fn rank_ports_overlap(events: &ZmqEndpoint, replay: &ZmqEndpoint, ranks: u32) -> bool {
    match (events.address(), replay.address()) {
        (
            ZmqAddress::Tcp { host, port: events },
            ZmqAddress::Tcp {
                host: replay_host,
                port: replay,
            },
        ) if host == replay_host && *events != 0 && *replay != 0 => {
            let (events, replay) = (u32::from(*events), u32::from(*replay));
            events < replay + ranks && replay < events + ranks
        }
        _ => false,
    }
}

impl ZmqEndpoint {
    /// The endpoint rank `rank`'s publisher uses when this is rank 0's, by vLLM's rule
    /// (`ZmqEventPublisher.offset_endpoint_port`): a TCP port is offset by the rank, except port
    /// 0 (the OS picks). vLLM leaves an `ipc://` path as it is, so several ranks cannot share
    /// one: `Err` says so.
    pub fn for_data_parallel_rank(&self, rank: u32) -> Result<ZmqEndpoint, &'static str> {
        match self.address() {
            _ if rank == 0 => Ok(self.clone()),
            ZmqAddress::Tcp { port: 0, .. } => Ok(self.clone()),
            ZmqAddress::Tcp { port, .. } => {
                let port = u16::try_from(u32::from(*port) + rank)
                    .map_err(|_| "the last rank's port would exceed 65535")?;
                let text = self.as_str();
                let base = text.rsplit_once(':').map_or(text, |(base, _)| base);
                format!("{base}:{port}").parse()
            }
            ZmqAddress::Ipc(_) => Err(
                "an ipc:// endpoint cannot serve several data-parallel ranks (vLLM offsets only \
                 tcp ports by the rank): use tcp",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(text: &str) -> ZmqEndpoint {
        text.parse().unwrap()
    }

    #[test]
    fn a_rank_id_names_its_replica_and_rank() {
        assert_eq!(rank_replica_id("pod-a", 3), "pod-a@dp3");
    }

    #[test]
    fn ranks_offset_tcp_ports_as_vllm_does() {
        let base = endpoint("tcp://10.0.0.5:5557");
        assert_eq!(base.for_data_parallel_rank(0).unwrap(), base);
        assert_eq!(
            base.for_data_parallel_rank(2).unwrap().as_str(),
            "tcp://10.0.0.5:5559"
        );
        assert_eq!(
            endpoint("tcp://[fd00::1]:5557")
                .for_data_parallel_rank(1)
                .unwrap()
                .as_str(),
            "tcp://[fd00::1]:5558"
        );
        assert_eq!(
            endpoint("tcp://*:0").for_data_parallel_rank(1).unwrap(),
            endpoint("tcp://*:0")
        );
        assert!(endpoint("tcp://h:65535").for_data_parallel_rank(1).is_err());
        assert!(
            endpoint("ipc:///tmp/kv")
                .for_data_parallel_rank(1)
                .unwrap_err()
                .contains("ipc")
        );
    }

    #[test]
    fn rank_port_ranges_that_meet_are_found() {
        let events = endpoint("tcp://h:5557");
        assert!(!rank_ports_overlap(&events, &endpoint("tcp://h:5558"), 1));
        assert!(rank_ports_overlap(&events, &endpoint("tcp://h:5558"), 2));
        assert!(!rank_ports_overlap(&events, &endpoint("tcp://h:5600"), 8));
        assert!(!rank_ports_overlap(
            &events,
            &endpoint("tcp://other:5558"),
            2
        ));
    }

    #[test]
    fn a_data_parallel_size_is_bounded() {
        assert!(check_data_parallel_size(1).is_ok());
        assert!(check_data_parallel_size(MAX_DATA_PARALLEL_SIZE).is_ok());
        assert!(check_data_parallel_size(0).is_err());
        assert!(check_data_parallel_size(MAX_DATA_PARALLEL_SIZE + 1).is_err());
    }
}
