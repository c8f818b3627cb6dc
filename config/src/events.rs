//! The KV-event source section: where an engine's KV events come from. The index writes it as
//! `replicas[].events`, the agent as each `engines[]` entry (beside `replica`); both are made by
//! [`event_source_section!`](crate::event_source_section), so the keys, their types, their docs and their checks are one.

use crate::{AllowedPeer, ConfigError, SocketMode, ZmqEndpoint};

/// Default largest KV-event message accepted from an engine (`max_message_bytes`, all frames of
/// one message). vLLM publishes one batch per scheduler step, kilobytes to a few MiB (thousands
/// of block hashes at most), so 64 MiB leaves wide room while bounding what one peer can make
/// the process hold.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Default cap on the delay between attempts to re-open an engine's event socket
/// (`reconnect_backoff_max`). The delay starts at 100 ms and doubles while the engine stays
/// away, so a restarted engine is subscribed to again at most this long after it is back.
pub const DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX: ::std::time::Duration =
    ::std::time::Duration::from_secs(10);

/// Defines a struct holding the KV-event source keys after the caller's own fields, with
/// `check` (the section's cross-field rules) and `max_message_bytes_or_default`. The caller
/// writes the derives and serde attributes (`Deserialize`, `JsonSchema`, `deny_unknown_fields`):
/// the index's `replicas[].events` is [`RawEventSource`], the agent's `engines[]` entry adds
/// `replica`. (Serde's `flatten` cannot share the keys: it disables `deny_unknown_fields`.)
#[macro_export]
macro_rules! event_source_section {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_meta:meta])* $field_vis:vis $field:ident : $field_ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $(#[$field_meta])* $field_vis $field: $field_ty, )*
            /// ZeroMQ endpoint of the engine's PUB socket (`tcp://10.0.0.5:5557`), or where
            /// kvroute binds for engines that connect to it (`mode: bind`).
            pub endpoint: ::core::option::Option<$crate::ZmqEndpoint>,
            /// `connect`: the engine binds (vLLM's default `tcp://*:5557`) and kvroute connects;
            /// `bind`: kvroute binds `endpoint` and the engine connects to it.
            pub mode: $crate::SocketMode,
            /// The engine's replay ROUTER endpoint (`tcp://10.0.0.5:5558`), if it has one: a gap
            /// in the event sequence is then replayed instead of resetting the replica.
            pub replay_endpoint: ::core::option::Option<$crate::ZmqEndpoint>,
            /// Topic prefix subscribed to; messages with another topic are refused and counted
            /// (empty: every topic).
            pub topic: ::std::string::String,
            /// Data-parallel rank this socket carries (vLLM offsets both ports by the rank): for
            /// a rank served by its own API server (vLLM's external load balancing), where the
            /// rank is a replica of its own.
            pub dp_rank: u32,
            /// Data-parallel ranks behind this engine's one API server (vLLM
            /// `--data-parallel-size` with its internal load balancing): kvroute subscribes to
            /// every rank's publisher (`endpoint` and `replay_endpoint` are rank 0's; vLLM offsets
            /// both ports by the rank) and keeps each rank's blocks apart, as replica
            /// `<id>@dp<rank>`, so a request can be routed to the rank holding its prefix.
            #[schemars(extend("default" = 1))]
            pub data_parallel_size: ::core::option::Option<u32>,
            /// `mode: bind` over TCP only: the engine addresses (IPs or CIDR blocks) that may
            /// connect (default: any peer that can reach the socket).
            pub allowed_peers: ::core::option::Option<::std::vec::Vec<$crate::AllowedPeer>>,
            /// Largest message accepted from the engine, in bytes; a peer sending more is dropped
            /// and counted.
            #[schemars(extend("default" = $crate::DEFAULT_MAX_MESSAGE_BYTES))]
            pub max_message_bytes: ::core::option::Option<::core::num::NonZeroUsize>,
            /// The engine family publishing these events: `vllm` or `sglang` (its wire format
            /// and hashes differ; SGLang's ports follow the same data-parallel rule, port base +
            /// attention-DP rank, replay port included).
            pub engine: $crate::Engine,
            /// Cap on the delay between attempts to re-open the engine's event socket after it
            /// fails (the delay starts at 100ms and doubles): a restarted engine is subscribed
            /// to again at most this long after it is back, its replica out of precise scoring
            /// until then.
            #[schemars(extend("default" = $crate::format_duration(
                $crate::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX
            )))]
            pub reconnect_backoff_max: ::core::option::Option<$crate::ConfigDuration>,
        }

        impl $name {
            /// The section's cross-field rules, paths relative to it ([`check_transport`]).
            ///
            /// [`check_transport`]: $crate::check_transport
            pub fn check(&self) -> ::core::result::Result<(), $crate::ConfigError> {
                let ::core::option::Option::Some(endpoint) = &self.endpoint else {
                    return ::core::result::Result::Err(
                        $crate::ConfigError::at("endpoint", "required"),
                    );
                };
                $crate::check_transport(endpoint, self.mode, self.allowed_peers.as_deref())?;
                let ranks = self.data_parallel_size.unwrap_or(1);
                $crate::check_data_parallel_size(ranks)
                    .map_err(|reason| $crate::ConfigError::at("data_parallel_size", reason))?;
                if ranks > 1 {
                    if self.dp_rank != 0 {
                        return ::core::result::Result::Err($crate::ConfigError::at(
                            "dp_rank",
                            "set with data_parallel_size: every rank is subscribed to, so none \
                             is named",
                        ));
                    }
                    for (field, base) in [
                        ("endpoint", ::core::option::Option::Some(endpoint)),
                        ("replay_endpoint", self.replay_endpoint.as_ref()),
                    ] {
                        if let ::core::option::Option::Some(base) = base {
                            base.for_data_parallel_rank(ranks - 1)
                                .map_err(|reason| $crate::ConfigError::at(field, reason))?;
                        }
                    }
                    if let ::core::option::Option::Some(replay) = &self.replay_endpoint
                        && $crate::rank_ports_overlap(endpoint, replay, ranks)
                    {
                        return ::core::result::Result::Err($crate::ConfigError::at(
                            "replay_endpoint",
                            "its ports offset by rank meet the publishers' (rank r uses both \
                             base ports + r): leave data_parallel_size ports between them",
                        ));
                    }
                }
                ::core::result::Result::Ok(())
            }

            /// The data-parallel ranks behind the endpoint (1 without `data_parallel_size`).
            pub fn data_parallel_ranks(&self) -> u32 {
                self.data_parallel_size.unwrap_or(1)
            }

            /// Rank `rank`'s publisher endpoint (empty without one) and replay endpoint: rank
            /// 0's offset by the rank, as vLLM offsets them (`check` proved every rank's exist).
            pub fn rank_endpoints(
                &self,
                rank: u32,
            ) -> (::std::string::String, ::core::option::Option<::std::string::String>) {
                let offset = |endpoint: &$crate::ZmqEndpoint| {
                    endpoint
                        .for_data_parallel_rank(rank)
                        .ok()
                        .map(::std::string::String::from)
                };
                (
                    self.endpoint.as_ref().and_then(offset).unwrap_or_default(),
                    self.replay_endpoint.as_ref().and_then(offset),
                )
            }

            /// `reconnect_backoff_max`, or its default.
            pub fn reconnect_backoff_max_or_default(&self) -> ::std::time::Duration {
                self.reconnect_backoff_max
                    .map_or($crate::DEFAULT_EVENTS_RECONNECT_BACKOFF_MAX, $crate::ConfigDuration::get)
            }

            /// `max_message_bytes`, or its default.
            pub fn max_message_bytes_or_default(&self) -> usize {
                self.max_message_bytes
                    .map_or($crate::DEFAULT_MAX_MESSAGE_BYTES, ::core::num::NonZeroUsize::get)
            }
        }
    };
}

event_source_section! {
    /// `replicas[].events` (the index): where a replica's KV events come from.
    #[derive(Debug, Default, Clone, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
    #[serde(default, deny_unknown_fields)]
    pub struct RawEventSource {}
}

/// The transport rules of a socket as configured, paths relative to its section: an
/// `allowed_peers` list applies to bind mode over TCP (an ipc socket is guarded by its file's
/// permissions, a connect-mode socket chooses its peer), and is never empty.
pub fn check_transport(
    endpoint: &ZmqEndpoint,
    mode: SocketMode,
    allowed_peers: Option<&[AllowedPeer]>,
) -> Result<(), ConfigError> {
    let Some(peers) = allowed_peers else {
        return Ok(());
    };
    let reason = if mode != SocketMode::Bind {
        "applies to bind mode only (in connect mode kvroute chooses its peer)"
    } else if endpoint.is_ipc() {
        "applies to tcp endpoints only (an ipc socket is guarded by its file permissions)"
    } else if peers.is_empty() {
        "an empty list would refuse every engine"
    } else {
        return Ok(());
    };
    Err(ConfigError::at("allowed_peers", reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::from_yaml;

    fn check(yaml: &str) -> Result<RawEventSource, String> {
        let raw: RawEventSource = from_yaml(yaml).map_err(|e| e.to_string())?;
        raw.check().map_err(|e| e.to_string())?;
        Ok(raw)
    }

    #[test]
    fn data_parallel_ranks_default_to_one() {
        assert_eq!(
            check("{endpoint: 'tcp://h:1'}")
                .unwrap()
                .data_parallel_ranks(),
            1
        );
        let raw = check("{endpoint: 'tcp://h:1', data_parallel_size: 4}").unwrap();
        assert_eq!(raw.data_parallel_ranks(), 4);
    }

    #[test]
    fn keys_validate_and_name_their_path() {
        let raw = check("{endpoint: 'tcp://0.0.0.0:1', mode: bind, allowed_peers: [10.0.0.0/24]}")
            .unwrap();
        assert_eq!(raw.mode, SocketMode::Bind);
        assert_eq!(
            raw.max_message_bytes_or_default(),
            DEFAULT_MAX_MESSAGE_BYTES
        );
        for (yaml, path) in [
            ("{endpoint: 'h:1'}", "endpoint: "),
            ("{endpoint: 'tcp://h:1', mode: pull}", "mode: "),
            (
                "{endpoint: 'tcp://h:1', allowed_peers: [10.0.0.1]}",
                "allowed_peers: ",
            ),
            (
                "{endpoint: 'tcp://h:1', mode: bind, allowed_peers: [10.0.0.0/33]}",
                "allowed_peers[0]: ",
            ),
            (
                "{endpoint: 'ipc:///k', mode: bind, allowed_peers: [10.0.0.1]}",
                "allowed_peers: ",
            ),
            (
                "{endpoint: 'tcp://h:1', mode: bind, allowed_peers: []}",
                "allowed_peers: ",
            ),
            (
                "{endpoint: 'tcp://h:1', max_message_bytes: 0}",
                "max_message_bytes: ",
            ),
            ("{endpoint: 'tcp://h:1', nope: 1}", "nope: unknown key"),
            ("{}", "endpoint: required"),
            (
                "{endpoint: 'tcp://h:1', data_parallel_size: 0}",
                "data_parallel_size: ",
            ),
            (
                "{endpoint: 'tcp://h:1', data_parallel_size: 2, dp_rank: 1}",
                "dp_rank: ",
            ),
            (
                "{endpoint: 'ipc:///k', data_parallel_size: 2}",
                "endpoint: ",
            ),
            (
                "{endpoint: 'tcp://h:1', replay_endpoint: 'tcp://h:65535', data_parallel_size: 2}",
                "replay_endpoint: ",
            ),
            (
                "{endpoint: 'tcp://h:5557', replay_endpoint: 'tcp://h:5558', data_parallel_size: 2}",
                "replay_endpoint: ",
            ),
        ] {
            let error = check(yaml).unwrap_err();
            assert!(error.starts_with(path), "{yaml}: {error}");
        }
    }
}
