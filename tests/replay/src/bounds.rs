//! Cache-only bounds and the reference computations the sanity tests compare against.
//!
//! [`lru_hit_blocks`] replays requests one at a time through a single LRU of `capacity` blocks
//! with the engine's exact block accounting (see the function), so it is what one replica
//! would hit if requests never overlapped; with `N·C` blocks it is the pooled-LRU bound, with
//! unbounded capacity the infinite-cache bound. [`reused_blocks`] counts, straight from the
//! trace, the hash ids seen before.

use std::collections::HashSet;

use crate::trace::Request;
use kvroute_engine_model::lru::KeyLru;

/// Leading blocks each request finds cached in one LRU of `capacity` blocks, requests served
/// one after another in order.
///
/// Mirrors the engine's pool: a request pins its hits, holds `peak_blocks` blocks, caches its
/// full prompt blocks unless another copy is cached (then that block stays anonymous, as do
/// its partial and decode blocks), and frees them last-first, so its prefix is the most
/// recently used.
pub fn lru_hit_blocks(requests: &[Request], capacity: usize) -> Vec<u32> {
    let mut lru = KeyLru::new(capacity);
    // Anonymous blocks are unique entries that nothing will ever hit.
    let mut anonymous: u64 = 1 << 63;
    let mut fresh = || {
        anonymous += 1;
        anonymous
    };
    requests
        .iter()
        .map(|request| {
            let keys = request.keys();
            let hits = keys
                .iter()
                .take(request.max_hit_blocks())
                .take_while(|k| lru.contains(**k))
                .count();
            for key in &keys[..hits] {
                lru.remove(*key);
            }
            let mut blocks: Vec<u64> = keys[..hits].to_vec();
            for key in &keys[hits..] {
                blocks.push(if lru.contains(*key) { fresh() } else { *key });
            }
            let total = request.peak_blocks() as usize;
            while blocks.len() < total {
                blocks.push(fresh());
            }
            for block in blocks.iter().rev() {
                lru.touch(*block);
            }
            hits as u32
        })
        .collect()
}

/// Per request, how many of its full prompt blocks' hash ids appeared as full blocks in an
/// earlier request (capped at [`Request::max_hit_blocks`]), from the chained keys.
pub fn reused_blocks(requests: &[Request]) -> Vec<u32> {
    let mut seen: HashSet<u64> = HashSet::new();
    requests
        .iter()
        .map(|request| {
            let reused = request
                .keys()
                .iter()
                .take(request.max_hit_blocks())
                .filter(|k| seen.contains(*k))
                .count();
            seen.extend(request.keys().iter().copied());
            reused as u32
        })
        .collect()
}
