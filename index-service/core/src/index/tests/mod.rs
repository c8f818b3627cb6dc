//! Index tests: one conformance suite run over [`BlockIndex`] and the naive [`Reference`]
//! model, property tests comparing the two, and [`BlockIndex`]-specific unit tests.

mod capture;
mod concurrent;
mod conformance;
mod groups;
mod paths;
mod props;
mod reference;
mod unit;

use kvroute_block_keys::TokenChain;

use crate::event::{BlockRemoved, BlockStored, KvEvent, Medium};
use crate::index::{
    BlockIndex, IndexConfig, IndexMetrics, KvIndex, PoolConfig, PoolKeys, ReplicaId, ReplicaMatch,
};
use reference::Reference;

pub(crate) const BS: u32 = 4;
pub(crate) const EXACT: &str = "exact-model";
pub(crate) const CHAIN: &str = "chain-model";

/// Builds an index implementation with a per-replica block cap.
pub(crate) type MakeIndex = dyn Fn(usize) -> Box<dyn KvIndex>;

pub(crate) fn block_index(max_blocks: usize) -> BlockIndex {
    block_index_with(max_blocks, true)
}

/// [`block_index`], with `BlockStored` events built into runs or not (runs then come from
/// walks alone).
pub(crate) fn block_index_with(max_blocks: usize, runs_from_events: bool) -> BlockIndex {
    let config = IndexConfig {
        max_blocks_per_replica: max_blocks,
        shards_per_pool: 8,
        runs_from_events,
    };
    BlockIndex::new(config, IndexMetrics::unregistered())
}

pub(crate) fn make_block_index(max_blocks: usize) -> Box<dyn KvIndex> {
    Box::new(block_index(max_blocks))
}

pub(crate) fn make_reference(max_blocks: usize) -> Box<dyn KvIndex> {
    Box::new(Reference::new(max_blocks))
}

/// Registers the two test pools and replicas 0..replicas in each (ids 0.. exact, 100.. chain).
pub(crate) fn setup(index: &dyn KvIndex, replicas: u32) {
    let exact = PoolConfig {
        model: EXACT.into(),
        block_size: BS,
        keys: PoolKeys::VllmExact { validator: None },
        attention_chunk_size: None,
    };
    let chain = PoolConfig {
        model: CHAIN.into(),
        block_size: BS,
        keys: PoolKeys::TokenChain,
        attention_chunk_size: None,
    };
    index.add_pool(exact).unwrap();
    index.add_pool(chain).unwrap();
    for r in 0..replicas {
        index
            .add_replica(ReplicaId(r), &format!("exact-{r}"), EXACT)
            .unwrap();
        index
            .add_replica(ReplicaId(100 + r), &format!("chain-{r}"), CHAIN)
            .unwrap();
    }
}

/// A test prompt: `blocks` full blocks of tokens derived from `seed`; prompts with equal
/// `shared` prefixes share their first `shared` blocks.
pub(crate) fn prompt(seed: u32, shared: usize, blocks: usize) -> Vec<u32> {
    (0..blocks * BS as usize)
        .map(|i| {
            if i < shared * BS as usize {
                i as u32
            } else {
                seed * 10_000 + i as u32
            }
        })
        .collect()
}

/// Stand-in engine hashes of a prompt: a chain deliberately different from token-chain keys.
pub(crate) fn engine_hashes(tokens: &[u32]) -> Vec<u64> {
    TokenChain::keys(tokens, BS as usize, Some("engine"), None).unwrap()
}

/// Token-chain keys of a prompt (what a router queries a token-chain pool with).
pub(crate) fn chain_keys(tokens: &[u32]) -> Vec<u64> {
    TokenChain::keys(tokens, BS as usize, None, None).unwrap()
}

/// The query keys of a prompt in `model`'s scheme.
pub(crate) fn query_keys(model: &str, tokens: &[u32]) -> Vec<u64> {
    if model == EXACT {
        engine_hashes(tokens)
    } else {
        chain_keys(tokens)
    }
}

/// `BlockStored` for blocks `start..end` of `tokens`.
pub(crate) fn stored(tokens: &[u32], start: usize, end: usize, medium: Medium) -> KvEvent {
    let hashes = engine_hashes(tokens);
    let bs = BS as usize;
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes[start..end].to_vec(),
        parent_block_hash: start.checked_sub(1).map(|p| hashes[p]),
        token_ids: tokens[start * bs..end * bs].to_vec(),
        block_size: BS,
        medium,
        ..BlockStored::default()
    })
}

/// `BlockRemoved` for blocks `start..end` of `tokens`.
pub(crate) fn removed(tokens: &[u32], start: usize, end: usize, medium: Medium) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: engine_hashes(tokens)[start..end].to_vec(),
        medium,
        group_idx: None,
    })
}

/// Matches sorted by replica id (implementations may order replicas differently).
pub(crate) fn sorted(mut matches: Vec<ReplicaMatch>) -> Vec<ReplicaMatch> {
    matches.sort_by_key(|m| m.replica);
    matches
}

/// (replica, matched, gpu) of one replica's match.
pub(crate) fn counts(matches: &[ReplicaMatch], replica: u32) -> Option<(u32, u32)> {
    matches
        .iter()
        .find(|m| m.replica == ReplicaId(replica))
        .map(|m| (m.matched_blocks, m.gpu_blocks))
}
