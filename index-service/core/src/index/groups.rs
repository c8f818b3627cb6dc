//! A replica's KV-cache groups (hybrid attention): which group the pool's tables index, what the
//! others hold, and the hit vLLM would give from all of them.
//!
//! vLLM gives each attention kind of a model its own KV-cache group and publishes each group's
//! stores and removals apart (`group_idx`; a store also names the group's kind and sliding
//! window). The published hash has no group in it: the same block has the same hash in every
//! group, and a sliding-window group drops blocks the full-attention group keeps (and the
//! reverse). So each group's holdings are kept apart, a removal touches its own group only, and
//! a match is vLLM's coordinator's answer over all of them ([`super::hit`]).
//!
//! The **primary** group is the first full-attention group a replica stores into at the pool's
//! block size: it lives in the pool's shard tables like any dense model's blocks (a dense model
//! has only it, and pays nothing here). Every other group is a **side** group: a map of the
//! engine hashes it holds, with copies per medium, behind this replica's lock, read by matches.
//! Its stores need not be dense (a sliding window lists only the blocks it keeps of the span its
//! `token_ids` cover): in vLLM-exact pools the prompt's keys are the engine's hashes, so a hash
//! is found wherever it sits. Groups whose hit rule the index does not model (Mamba state,
//! unknown kinds, chunked local attention: its chunk size is not published) are recorded and
//! make the replica's answers approximate.

use parking_lot::RwLock;

use super::hit::{self, GroupRule, Rule};
use super::holders::{KeyHasherBuilder, KeyMap, MEDIA, MediaSet, shrink_if_sparse, table_bytes};
use crate::event::{CacheKind, EngineHash, Medium};

/// Most KV-cache groups one replica may declare (vLLM makes at most one per layer kind and
/// size; a real model has a handful, the Gemma 3 text model here one per layer). Stores for
/// groups beyond are refused, so a hostile stream cannot grow the catalog.
pub(crate) const MAX_GROUPS: u32 = 256;

/// A group as its stores describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupSpec {
    pub(crate) kind: CacheKind,
    pub(crate) block_size: u32,
    pub(crate) window: Option<u32>,
}

/// What the pool says about how a group's blocks can be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolLayout {
    /// Tokens per prompt key.
    pub(crate) block_size: u32,
    /// Whether prompt keys are the engine's hashes (vLLM-exact pools).
    pub(crate) exact_keys: bool,
    /// Chunked local attention's chunk, when configured.
    pub(crate) attention_chunk_size: Option<u32>,
    /// Whether the pool indexes only verified hashes (`verify_hashes: required`).
    pub(crate) verified_only: bool,
}

/// Why a group's blocks cannot be used for an exact answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unmodelled {
    /// Its kind's hit rule is not modelled (Mamba, cross or encoder-only attention, unknown).
    Kind(CacheKind),
    /// A sliding-window group whose stores do not say the window.
    NoWindow,
    /// Chunked local attention in a pool without `attention_chunk_size`: vLLM does not
    /// publish it.
    NoChunkSize,
    /// Its block size is not a multiple of the pool's (its hashes are not prompt keys).
    BlockSize,
    /// A token-chain pool: kvroute's keys are its own, and a side group's non-dense stores
    /// cannot be placed on them.
    TokenChain,
    /// A pool that indexes only verified hashes: where a non-dense store's hashes sit in its
    /// span is not published, so they cannot be recomputed.
    Unverifiable,
    /// Its stores disagree about it (kind, block size or window), or it is beyond
    /// [`MAX_GROUPS`]: the stream's layout cannot be trusted.
    Conflict,
}

impl Unmodelled {
    /// Log text.
    pub(crate) fn describe(self) -> String {
        match self {
            Unmodelled::Kind(kind) => format!("kind {} has no modelled hit rule", kind.as_label()),
            Unmodelled::NoWindow => "a sliding-window group without its window".to_owned(),
            Unmodelled::NoChunkSize => "chunked local attention without the pool's \
                 attention_chunk_size (vLLM does not publish it)"
                .to_owned(),
            Unmodelled::BlockSize => {
                "its block size is not a multiple of the pool's block_size".to_owned()
            }
            Unmodelled::TokenChain => {
                "a hybrid layout in a token-chain pool (keys not the engine's)".to_owned()
            }
            Unmodelled::Unverifiable => "a hybrid layout in a pool with verify_hashes: required \
                 (a sliding window's stores cannot be verified)"
                .to_owned(),
            Unmodelled::Conflict => {
                "its stores disagree on its kind, block size or window (or too many groups)"
                    .to_owned()
            }
        }
    }
}

/// What the index does with one group's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Indexed in the pool's tables.
    Primary,
    /// Held in [`Side`] number `.0`.
    Side(usize),
    /// Recorded, not indexed.
    Unmodelled(Unmodelled),
}

/// Copies of one block in a side group, per medium (vLLM can hold several blocks with one hash
/// and reports each store and removal).
#[derive(Debug, Clone, Copy, Default)]
struct Copies([u32; MEDIA.len()]);

impl Copies {
    fn media(self) -> MediaSet {
        MEDIA
            .iter()
            .zip(self.0)
            .filter(|(_, copies)| *copies > 0)
            .fold(MediaSet::default(), |set, (&medium, _)| set.with(medium))
    }

    fn total(self) -> u32 {
        self.0.iter().sum()
    }
}

/// A side group: the blocks it holds, and the spec it is looked up with.
#[derive(Debug)]
struct Side {
    group: u32,
    held: KeyMap<Copies>,
    /// Its [`Spec`] and its bit in that spec's presence masks.
    spec: usize,
    bit: u64,
}

/// Side groups of one rule, looked up together as vLLM does with groups of one spec (a block
/// counts only if every member holds it): one lookup per block for all of them (vLLM makes one
/// group per few layers; Gemma 3 has several sliding groups).
#[derive(Debug)]
struct Spec {
    rule: GroupRule,
    /// Pool blocks per block of these groups.
    scale: usize,
    /// Every member's bit.
    members: u64,
    /// Which members hold each block (any medium, on the GPU).
    present: KeyMap<Presence>,
}

/// Members holding a block: in any medium, on the GPU.
#[derive(Debug, Clone, Copy, Default)]
struct Presence {
    any: u64,
    gpu: u64,
}

/// What storing or removing side-group blocks did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SideOutcome {
    pub(crate) applied: usize,
    /// Stores refused at the per-group cap, or removals of blocks the group does not hold.
    pub(crate) refused: usize,
}

/// One replica's groups. Written by its ingest (under the replica's lock), read by matches.
#[derive(Debug)]
pub(crate) struct Groups {
    state: RwLock<State>,
    hasher: KeyHasherBuilder,
}

#[derive(Debug, Default)]
struct State {
    catalog: Vec<(u32, GroupSpec, Role)>,
    primary: Option<u32>,
    sides: Vec<Side>,
    specs: Vec<Spec>,
    /// What a match looks up beside the primary group, full attention first: each spec's rule
    /// and its place in `specs`.
    rules: Vec<GroupRule>,
    sources: Vec<usize>,
    /// The least common multiple of the block sizes of `rules` (and the pool's).
    alignment: usize,
    /// Side-group copies held off the GPU: while none are, a match's GPU answer is its answer.
    off_gpu_copies: usize,
}

impl Groups {
    pub(crate) fn new(hasher: KeyHasherBuilder) -> Self {
        Groups {
            state: RwLock::new(State::default()),
            hasher,
        }
    }

    /// The role of `group` for a store describing it as `spec`, learnt at its first store.
    /// `Err` when the store contradicts what earlier stores said about the group.
    pub(crate) fn role_for_store(
        &self,
        group: u32,
        spec: GroupSpec,
        pool: PoolLayout,
    ) -> Result<Role, GroupSpec> {
        if let Some(&(_, known, role)) = self.state.read().catalog.iter().find(|e| e.0 == group) {
            // The primary group's block size is checked against the pool's by the caller (a
            // mismatch flags the replica, as for dense models).
            let same_size = known.block_size == spec.block_size || role == Role::Primary;
            let same = known.kind == spec.kind && known.window == spec.window && same_size;
            return if same { Ok(role) } else { Err(known) };
        }
        let mut state = self.state.write();
        let role = state.classify(spec, pool);
        let role = match role {
            Some(Role::Primary) => {
                state.primary = Some(group);
                Role::Primary
            }
            Some(Role::Side(_)) => {
                let block_tokens = spec.block_size as usize;
                let rule = match (spec.kind, pool.attention_chunk_size) {
                    (kind, _) if kind.is_full_attention() => Rule::Prefix,
                    (CacheKind::ChunkedLocalAttention, Some(chunk)) => Rule::Chunk {
                        chunk_tokens: chunk as usize,
                    },
                    _ => Rule::window(spec.window.unwrap_or(0) as usize, block_tokens),
                };
                let rule = GroupRule { rule, block_tokens };
                let joined = state
                    .specs
                    .iter()
                    .position(|s| s.rule == rule && s.members.count_ones() < u64::BITS);
                let at = joined.unwrap_or_else(|| {
                    state.specs.push(Spec {
                        rule,
                        scale: (spec.block_size / pool.block_size.max(1)) as usize,
                        members: 0,
                        present: KeyMap::with_hasher(self.hasher),
                    });
                    state.specs.len() - 1
                });
                let bit = 1u64 << state.specs[at].members.count_ones();
                state.specs[at].members |= bit;
                state.sides.push(Side {
                    group,
                    held: KeyMap::with_hasher(self.hasher),
                    spec: at,
                    bit,
                });
                Role::Side(state.sides.len() - 1)
            }
            Some(other) => other,
            None => Role::Unmodelled(Unmodelled::Kind(spec.kind)),
        };
        state.catalog.push((group, spec, role));
        state.relearn_lookups(pool.block_size);
        Ok(role)
    }

    /// The role of `group` for a removal: `None` for a group no store has described (nothing
    /// of it can be held).
    pub(crate) fn role_for_removal(&self, group: u32) -> Option<Role> {
        let state = self.state.read();
        state
            .catalog
            .iter()
            .find(|entry| entry.0 == group)
            .map(|entry| entry.2)
    }

    /// Records `hashes` stored in side group `side` on `medium`; new blocks past `max_blocks`
    /// in all side groups together are refused (so however many groups a stream declares, they
    /// hold no more than the replica's cap between them).
    pub(crate) fn store(
        &self,
        side: usize,
        hashes: &[EngineHash],
        medium: Medium,
        max_blocks: usize,
    ) -> SideOutcome {
        let mut state = self.state.write();
        let state = &mut *state;
        let mut outcome = SideOutcome::default();
        let mut held: usize = state.sides.iter().map(|side| side.held.len()).sum();
        let Some(side) = state.sides.get_mut(side) else {
            return outcome;
        };
        let Some(spec) = state.specs.get_mut(side.spec) else {
            return outcome;
        };
        let at = MediaSet::index(medium);
        for &hash in hashes {
            let copies = match side.held.get_mut(&hash) {
                Some(copies) => copies,
                None if held >= max_blocks => {
                    outcome.refused += 1;
                    continue;
                }
                None => {
                    held += 1;
                    side.held.entry(hash).or_default()
                }
            };
            copies.0[at] += 1;
            if medium != Medium::Gpu {
                state.off_gpu_copies += 1;
            }
            let presence = spec.present.entry(hash).or_default();
            presence.any |= side.bit;
            if medium == Medium::Gpu {
                presence.gpu |= side.bit;
            }
            outcome.applied += 1;
        }
        outcome
    }

    /// Removes one copy of each of `hashes` on `medium` from side group `side`.
    pub(crate) fn remove(&self, side: usize, hashes: &[EngineHash], medium: Medium) -> SideOutcome {
        let mut state = self.state.write();
        let state = &mut *state;
        let mut outcome = SideOutcome::default();
        let Some(side) = state.sides.get_mut(side) else {
            return outcome;
        };
        let Some(spec) = state.specs.get_mut(side.spec) else {
            return outcome;
        };
        let at = MediaSet::index(medium);
        for hash in hashes {
            let Some(copies) = side.held.get_mut(hash).filter(|copies| copies.0[at] > 0) else {
                outcome.refused += 1;
                continue;
            };
            copies.0[at] -= 1;
            if medium != Medium::Gpu {
                state.off_gpu_copies = state.off_gpu_copies.saturating_sub(1);
            }
            let media = copies.media();
            if copies.total() == 0 {
                side.held.remove(hash);
            }
            if let Some(presence) = spec.present.get_mut(hash) {
                if media.is_empty() {
                    presence.any &= !side.bit;
                }
                if !media.has_gpu() {
                    presence.gpu &= !side.bit;
                }
                if presence.any == 0 {
                    spec.present.remove(hash);
                }
            }
            outcome.applied += 1;
        }
        shrink_if_sparse(&mut side.held);
        shrink_if_sparse(&mut spec.present);
        outcome
    }

    /// Forgets every group and holding (engine restart, `AllBlocksCleared`): the layout is
    /// learnt again from the next stores.
    pub(crate) fn clear(&self) {
        *self.state.write() = State::default();
    }

    /// Side-group holdings (blocks × groups).
    pub(crate) fn side_blocks(&self) -> usize {
        self.state.read().sides.iter().map(|s| s.held.len()).sum()
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        let state = self.state.read();
        let sides: usize = state
            .sides
            .iter()
            .map(|side| table_bytes(side.held.capacity(), size_of::<(u64, Copies)>()))
            .sum();
        let specs: usize = state
            .specs
            .iter()
            .map(|spec| table_bytes(spec.present.capacity(), size_of::<(u64, Presence)>()))
            .sum();
        sides + specs
    }

    /// The primary group's index, once learnt.
    pub(crate) fn primary(&self) -> Option<u32> {
        self.state.read().primary
    }

    /// Each side group's index and held hashes, one entry per copy (any medium), sorted.
    pub(crate) fn side_hashes(&self) -> Vec<(u32, Vec<EngineHash>)> {
        let state = self.state.read();
        state
            .sides
            .iter()
            .map(|side| {
                let mut hashes: Vec<EngineHash> = side
                    .held
                    .iter()
                    .flat_map(|(&hash, copies)| std::iter::repeat_n(hash, copies.total() as usize))
                    .collect();
                hashes.sort_unstable();
                (side.group, hashes)
            })
            .collect()
    }

    /// How far a longer prompt with these leading `keys` could hit (see
    /// [`super::ReplicaMatch::prefix_blocks`]): the primary group's leading blocks, or every
    /// key when the replica has no full-attention group.
    pub(crate) fn prefix_blocks(&self, keys: &[u64], primary_blocks: u32) -> u32 {
        let state = self.state.read();
        if state.primary.is_some() || state.sides.is_empty() {
            primary_blocks
        } else {
            u32::try_from(keys.len()).unwrap_or(u32::MAX)
        }
    }

    /// vLLM's hit for `keys` (prompt keys of `block_size` tokens), in blocks of `block_size`, in
    /// any medium and on the GPU, given the primary group's leading blocks in each: computed once
    /// when nothing is held off the GPU and the primary group's two prefixes agree.
    pub(crate) fn hit_blocks_and_gpu(
        &self,
        keys: &[u64],
        block_size: u32,
        (primary_blocks, primary_gpu_blocks): (u32, u32),
    ) -> (u32, u32) {
        let state = self.state.read();
        let any = state.hit_blocks(keys, block_size, primary_blocks, false);
        if state.off_gpu_copies == 0 && primary_blocks == primary_gpu_blocks {
            return (any, any);
        }
        let gpu = state.hit_blocks(keys, block_size, primary_gpu_blocks, true);
        (any, gpu)
    }
}

impl State {
    /// vLLM's hit for `keys`: the primary group holds the first `primary_blocks` keys (in the
    /// media `gpu_only` asks for), each side group what it stored.
    fn hit_blocks(
        &self,
        keys: &[u64],
        block_size: u32,
        primary_blocks: u32,
        gpu_only: bool,
    ) -> u32 {
        if self.sides.is_empty() {
            // Nothing beside the tables (cleared, or only unmodelled groups): the walk's answer.
            return primary_blocks;
        }
        let block_size = block_size.max(1) as usize;
        // The primary group is full attention, the first vLLM asks: its answer is the walk's
        // prefix, the bound every other group then shortens (it only shrinks, and full attention
        // holds every shorter prefix, so it need not be asked again).
        let bound = match self.primary {
            Some(_) => keys.len().min(primary_blocks as usize),
            None => keys.len(),
        };
        let tokens = hit::hit_tokens(
            &self.rules,
            bound * block_size,
            self.alignment,
            |rule, block| {
                let spec = &self.specs[self.sources[rule]];
                // A larger block's hash is the chain's hash at its last pool block.
                let Some(key) = keys.get((block + 1) * spec.scale - 1) else {
                    return false;
                };
                spec.present.get(key).is_some_and(|presence| {
                    let holders = if gpu_only { presence.gpu } else { presence.any };
                    holders == spec.members
                })
            },
        );
        u32::try_from(tokens / block_size).unwrap_or(u32::MAX)
    }
    /// [`State::rules`], [`State::sources`] and [`State::alignment`] for the groups learnt
    /// so far (a pool's keys are `block_size` tokens each).
    fn relearn_lookups(&mut self, block_size: u32) {
        let block_size = block_size.max(1) as usize;
        let mut lookups: Vec<_> = self
            .specs
            .iter()
            .enumerate()
            .map(|(at, spec)| (spec.rule, at))
            .collect();
        // Full attention first, as vLLM orders its spec groups.
        lookups.sort_by_key(|(rule, _)| rule.rule != Rule::Prefix);
        (self.rules, self.sources) = lookups.into_iter().unzip();
        self.alignment = self.rules.iter().fold(block_size, |lcm, rule| {
            least_common_multiple(lcm, rule.block_tokens)
        });
    }

    /// A new group's role (a side group's number is given by the caller); `None` when its kind
    /// has no modelled rule.
    fn classify(&self, spec: GroupSpec, pool: PoolLayout) -> Option<Role> {
        let full = spec.kind.is_full_attention();
        // The first full group is the pool tables' one, whatever its block size: a size other
        // than the pool's is reported as for dense models (refused, the replica flagged).
        if full && self.primary.is_none() {
            return Some(Role::Primary);
        }
        let sliding = matches!(
            spec.kind,
            CacheKind::SlidingWindow | CacheKind::SlidingWindowMla
        );
        let chunked = spec.kind == CacheKind::ChunkedLocalAttention;
        let why = if chunked && pool.attention_chunk_size.is_none_or(|chunk| chunk == 0) {
            Unmodelled::NoChunkSize
        } else if !(full || sliding || chunked) {
            return None;
        } else if sliding && spec.window.is_none_or(|w| w == 0) {
            Unmodelled::NoWindow
        } else if pool.block_size == 0 || !spec.block_size.is_multiple_of(pool.block_size) {
            Unmodelled::BlockSize
        } else if !pool.exact_keys {
            Unmodelled::TokenChain
        } else if pool.verified_only {
            Unmodelled::Unverifiable
        } else {
            return Some(Role::Side(usize::MAX));
        };
        Some(Role::Unmodelled(why))
    }
}

fn least_common_multiple(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    if a == 0 || b == 0 {
        a.max(b)
    } else {
        a / gcd(a, b) * b
    }
}
