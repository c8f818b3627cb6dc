//! The agent stream (`AgentIngest.AgentStream`): its limits, and domain events
//! ([`kvroute_index_core::event`]) ↔ its protobuf messages.
//!
//! Both directions are total on well-formed input; the index side validates shapes (block
//! counts, token lengths) separately in [`validate_stored`] before applying anything.

use kvroute_block_keys::HashValue;

use kvroute_index_core::event::{BlockRemoved, BlockStored, CacheKind, KvEvent, Medium};

use crate::api;

/// Largest message either end of the agent stream sends or accepts; snapshot chunks stay far
/// below it.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
/// Most replica ids one `Hello` may claim. A node runs a handful of engines; the agent's config
/// and the index's `agents[].replicas` are held to this too, so only a broken or hostile agent
/// reaches it, and the index refuses such a `Hello` whole (it would otherwise answer every
/// claimed id).
pub const MAX_REPLICAS_PER_HELLO: usize = 1024;

/// Most blocks one agent event may carry; vLLM's largest single store is one request's blocks.
pub const MAX_BLOCKS_PER_EVENT: usize = 1 << 17;
/// Deepest `HashValue` tuple nesting accepted (vLLM nests at most 2–3 levels).
const MAX_HASH_VALUE_DEPTH: usize = 8;

/// Why an agent event cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventShapeError {
    /// The event has no body.
    #[error("event without a kind")]
    Empty,
    /// More blocks than [`MAX_BLOCKS_PER_EVENT`].
    #[error("{blocks} blocks in one event (limit {MAX_BLOCKS_PER_EVENT})")]
    TooManyBlocks {
        /// Blocks in the event.
        blocks: usize,
    },
    /// `token_ids` is neither empty nor `blocks * block_size` long, or a per-block list has the
    /// wrong length.
    #[error("inconsistent lengths: {what}")]
    Lengths {
        /// Which list.
        what: &'static str,
    },
    /// A hash value nests deeper than vLLM ever does.
    #[error("extra key nested too deep")]
    TooDeep,
}

impl EventShapeError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            EventShapeError::Empty => "empty_event",
            EventShapeError::TooManyBlocks { .. } => "too_many_blocks",
            EventShapeError::Lengths { .. } => "inconsistent_lengths",
            EventShapeError::TooDeep => "too_deep",
        }
    }
}

fn medium_to_proto(medium: Medium) -> i32 {
    let proto = match medium {
        Medium::Gpu => api::Medium::Gpu,
        Medium::Cpu => api::Medium::Cpu,
        Medium::Storage => api::Medium::Storage,
        Medium::Other => api::Medium::Other,
    };
    proto as i32
}

fn medium_from_proto(medium: i32) -> Medium {
    match api::Medium::try_from(medium) {
        Ok(api::Medium::Gpu) => Medium::Gpu,
        Ok(api::Medium::Cpu) => Medium::Cpu,
        Ok(api::Medium::Storage) => Medium::Storage,
        Ok(api::Medium::Other) | Err(_) => Medium::Other,
    }
}

fn hash_value_to_proto(value: &HashValue) -> api::HashValue {
    use api::hash_value::Value;
    let value = match value {
        HashValue::None => Value::None(true),
        HashValue::Int(i) => Value::Int(*i),
        HashValue::Str(s) => Value::Str(s.clone()),
        HashValue::Bytes(b) => Value::Bytes(b.clone()),
        HashValue::Tuple(items) => Value::Tuple(api::HashValueTuple {
            items: items.iter().map(hash_value_to_proto).collect(),
        }),
    };
    api::HashValue { value: Some(value) }
}

fn hash_value_from_proto(
    value: api::HashValue,
    depth: usize,
) -> Result<HashValue, EventShapeError> {
    use api::hash_value::Value;
    if depth > MAX_HASH_VALUE_DEPTH {
        return Err(EventShapeError::TooDeep);
    }
    Ok(match value.value {
        None | Some(Value::None(_)) => HashValue::None,
        Some(Value::Int(i)) => HashValue::Int(i),
        Some(Value::Str(s)) => HashValue::Str(s),
        Some(Value::Bytes(b)) => HashValue::Bytes(b),
        Some(Value::Tuple(tuple)) => HashValue::Tuple(
            tuple
                .items
                .into_iter()
                .map(|item| hash_value_from_proto(item, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
    })
}

/// A domain event as the agent sends it.
pub fn event_to_proto(event: &KvEvent) -> api::Event {
    use api::event::Kind;
    let kind = match event {
        KvEvent::BlockStored(stored) => Kind::Stored(stored_to_proto(stored)),
        KvEvent::BlockRemoved(removed) => Kind::Removed(api::BlockRemoved {
            block_hashes: removed.block_hashes.clone(),
            medium: medium_to_proto(removed.medium),
            group_idx: removed.group_idx,
        }),
        KvEvent::AllBlocksCleared => Kind::Cleared(api::AllBlocksCleared {}),
    };
    api::Event { kind: Some(kind) }
}

/// A `BlockStored` as the agent sends it.
pub fn stored_to_proto(stored: &BlockStored) -> api::BlockStored {
    api::BlockStored {
        block_hashes: stored.block_hashes.clone(),
        parent_block_hash: stored.parent_block_hash,
        token_ids: stored.token_ids.clone(),
        block_size: stored.block_size,
        lora_id: stored.lora_id,
        lora_name: stored.lora_name.clone(),
        medium: medium_to_proto(stored.medium),
        extra_keys: stored.extra_keys.as_ref().map(|keys| api::ExtraKeys {
            keys: keys
                .iter()
                .map(|key| api::OptionalHashValue {
                    value: key.as_ref().map(hash_value_to_proto),
                })
                .collect(),
        }),
        group_idx: stored.group_idx,
        cache_kind: stored.cache_kind.map(|kind| kind.as_label().to_owned()),
        sliding_window: stored.sliding_window,
        block_digests: stored.block_digests.clone().unwrap_or_default(),
        parent_digest: stored.parent_digest.clone(),
    }
}

/// An agent event as the index applies it, after checking its shape.
pub fn event_from_proto(event: api::Event) -> Result<KvEvent, EventShapeError> {
    use api::event::Kind;
    match event.kind.ok_or(EventShapeError::Empty)? {
        Kind::Stored(stored) => validate_stored(stored).map(KvEvent::BlockStored),
        Kind::Removed(removed) => {
            if removed.block_hashes.len() > MAX_BLOCKS_PER_EVENT {
                return Err(EventShapeError::TooManyBlocks {
                    blocks: removed.block_hashes.len(),
                });
            }
            Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: removed.block_hashes,
                medium: medium_from_proto(removed.medium),
                group_idx: removed.group_idx,
            }))
        }
        Kind::Cleared(_) => Ok(KvEvent::AllBlocksCleared),
    }
}

/// Checks a received `BlockStored`'s list lengths and converts it.
pub fn validate_stored(stored: api::BlockStored) -> Result<BlockStored, EventShapeError> {
    let blocks = stored.block_hashes.len();
    if blocks > MAX_BLOCKS_PER_EVENT {
        return Err(EventShapeError::TooManyBlocks { blocks });
    }
    let cache_kind = stored.cache_kind.as_deref().map(CacheKind::from_wire);
    let expected_tokens = (stored.block_size as usize).checked_mul(blocks);
    // A group that is not full attention publishes only the blocks it keeps (a sliding window
    // drops those before its window) over the whole span of tokens: a whole number of blocks,
    // at least one per hash.
    let dense = cache_kind.is_none_or(CacheKind::is_full_attention);
    let tokens_fit = match expected_tokens {
        Some(expected) if dense => stored.token_ids.len() == expected,
        Some(expected) => {
            stored.token_ids.len() >= expected
                && stored
                    .token_ids
                    .len()
                    .checked_rem(stored.block_size as usize)
                    .is_none_or(|rest| rest == 0)
        }
        None => false,
    };
    if !stored.token_ids.is_empty() && !tokens_fit {
        return Err(EventShapeError::Lengths { what: "token_ids" });
    }
    if !stored.block_digests.is_empty() && stored.block_digests.len() != blocks {
        return Err(EventShapeError::Lengths {
            what: "block_digests",
        });
    }
    let extra_keys = match stored.extra_keys {
        None => None,
        Some(keys) if keys.keys.len() == blocks => Some(
            keys.keys
                .into_iter()
                .map(|key| key.value.map(|v| hash_value_from_proto(v, 0)).transpose())
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err(EventShapeError::Lengths { what: "extra_keys" }),
    };
    Ok(BlockStored {
        block_hashes: stored.block_hashes,
        parent_block_hash: stored.parent_block_hash,
        token_ids: stored.token_ids,
        block_size: stored.block_size,
        lora_id: stored.lora_id,
        lora_name: stored.lora_name,
        medium: medium_from_proto(stored.medium),
        extra_keys,
        group_idx: stored.group_idx,
        cache_kind,
        sliding_window: stored.sliding_window,
        block_digests: (!stored.block_digests.is_empty()).then_some(stored.block_digests),
        parent_digest: stored.parent_digest,
        // Agents forward vLLM engines only: SGLang feeds go to the index directly.
        sglang: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> BlockStored {
        BlockStored {
            block_hashes: vec![1, 2],
            parent_block_hash: Some(9),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: Some(3),
            lora_name: Some("l".into()),
            medium: Medium::Cpu,
            extra_keys: Some(vec![
                None,
                Some(HashValue::Tuple(vec![
                    HashValue::Str("s".into()),
                    HashValue::Int(-1),
                ])),
            ]),
            group_idx: Some(0),
            cache_kind: Some(CacheKind::SlidingWindow),
            sliding_window: Some(64),
            block_digests: Some(vec![vec![1; 32], vec![2; 32]]),
            parent_digest: Some(vec![3; 32]),
            sglang: None,
        }
    }

    #[test]
    fn events_round_trip() {
        let events = [
            KvEvent::BlockStored(stored()),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![5],
                medium: Medium::Storage,
                group_idx: None,
            }),
            KvEvent::AllBlocksCleared,
        ];
        for event in events {
            assert_eq!(event_from_proto(event_to_proto(&event)).unwrap(), event);
        }
    }

    #[test]
    fn inconsistent_shapes_are_refused() {
        let mut bad = stored_to_proto(&stored());
        bad.token_ids.pop();
        assert_eq!(
            validate_stored(bad).unwrap_err(),
            EventShapeError::Lengths { what: "token_ids" }
        );
        let absurd = api::BlockStored {
            block_hashes: vec![0; MAX_BLOCKS_PER_EVENT + 1],
            ..Default::default()
        };
        assert!(matches!(
            validate_stored(absurd),
            Err(EventShapeError::TooManyBlocks { .. })
        ));
        assert_eq!(
            event_from_proto(api::Event { kind: None }).unwrap_err(),
            EventShapeError::Empty
        );
    }
}
