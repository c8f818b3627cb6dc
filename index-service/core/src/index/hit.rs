//! The prefix vLLM reuses for a prompt when its KV cache has several groups (hybrid attention):
//! vLLM 0.32's `HybridKVCacheCoordinator.find_longest_cache_hit` and the per-kind
//! `find_longest_cache_hit` of `FullAttentionManager`, `SlidingWindowManager` and
//! `ChunkedLocalAttentionManager` (`vllm/v1/core/kv_cache_coordinator.py`,
//! `single_type_kv_cache_manager.py`), on holdings the index learnt from the groups' events.
//!
//! Every group answers "the longest hit no longer than this many tokens" on its own; the
//! coordinator hands each group the shortest answer so far (full attention first) and goes round
//! again until no group shortens it. A sliding window needs only the blocks of the window before
//! the cut, so a replica can hold a prefix in full attention and still give less (its window
//! blocks were evicted), or, without full attention, give a long hit whose start it no longer
//! holds. Pure computation: the caller says which blocks each group holds.

/// What a cache hit needs from one group (vLLM looks up groups of one spec together: a block
/// counts only if every group of the spec holds it; the caller's `holds` answers for the set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    /// Full attention: every block from the start.
    Prefix,
    /// Sliding window: the `cdiv(window - 1, block_tokens)` blocks just before the cut (all of
    /// them from the start when the cut is closer to it).
    Window {
        /// Blocks needed before the cut.
        blocks: usize,
    },
    /// Chunked local attention: every block from the start of the cut's chunk.
    Chunk {
        /// Tokens per attention chunk.
        chunk_tokens: usize,
    },
}

impl Rule {
    /// The rule of a sliding-window group of `window` tokens in blocks of `block_tokens`.
    pub(crate) fn window(window: usize, block_tokens: usize) -> Rule {
        Rule::Window {
            blocks: window.saturating_sub(1).div_ceil(block_tokens.max(1)),
        }
    }
}

/// One group (or set of groups of one spec) as the coordinator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GroupRule {
    pub(crate) rule: Rule,
    /// Tokens per block of this group.
    pub(crate) block_tokens: usize,
}

/// The longest prefix, in tokens, vLLM's coordinator reuses: at most `max_tokens`, a multiple
/// of `alignment` tokens where a sliding window decides it. `holds(group, block)` says whether
/// `groups[group]` holds its `block`-th block (of `block_tokens` each) of the prompt. `groups`
/// lists full attention first, as vLLM orders its spec groups (the tightest bound, cheapest).
pub(crate) fn hit_tokens(
    groups: &[GroupRule],
    max_tokens: usize,
    alignment: usize,
    mut holds: impl FnMut(usize, usize) -> bool,
) -> usize {
    debug_assert!(
        groups.is_sorted_by_key(|group| group.rule != Rule::Prefix),
        "full attention first"
    );
    let mut hit = max_tokens;
    loop {
        let mut current = hit;
        for (at, &group) in groups.iter().enumerate() {
            current = group_hit(group, current, alignment, |block| holds(at, block));
        }
        if current >= hit {
            return hit;
        }
        hit = current;
    }
}

/// One group's longest hit no longer than `max_tokens`.
fn group_hit(
    group: GroupRule,
    max_tokens: usize,
    alignment: usize,
    mut holds: impl FnMut(usize) -> bool,
) -> usize {
    let block_tokens = group.block_tokens.max(1);
    let max_blocks = max_tokens / block_tokens;
    let blocks = match group.rule {
        Rule::Prefix => (0..max_blocks).take_while(|&block| holds(block)).count(),
        Rule::Window { blocks: needed } => {
            window_hit(needed, max_blocks, block_tokens, alignment.max(1), holds)
        }
        Rule::Chunk { chunk_tokens } => {
            let chunk_tokens = chunk_tokens.max(1);
            // Blocks before the cut's chunk are outside every later token's attention: vLLM
            // counts them as computed without looking them up.
            let start = (max_tokens / chunk_tokens * chunk_tokens) / block_tokens;
            start
                + (start..max_blocks)
                    .take_while(|&block| holds(block))
                    .count()
        }
    };
    blocks * block_tokens
}

/// `SlidingWindowManager.find_longest_cache_hit`'s answer: the last `alignment`-aligned end
/// (at most `max_blocks`) whose `needed` blocks before it are all held; without one, the held
/// blocks from the start, trimmed to the alignment. A window whose first block is missing is
/// skipped whole (the next end to try is before that block), so a replica that holds no window
/// costs about `max_blocks / needed` lookups, not `max_blocks` (vLLM leaves that as a to-do and
/// scans block by block; the tests hold this equal to a transcription of that scan).
fn window_hit(
    needed: usize,
    max_blocks: usize,
    block_tokens: usize,
    alignment: usize,
    mut holds: impl FnMut(usize) -> bool,
) -> usize {
    // vLLM counts a block before comparing the run with `needed`: a window of 0 blocks needs 1.
    let needed = needed.max(1);
    // The largest end at most `blocks` whose tokens are a multiple of the alignment.
    let aligned_down = |mut blocks: usize| {
        while block_tokens != alignment && !(blocks * block_tokens).is_multiple_of(alignment) {
            blocks -= 1;
        }
        blocks
    };
    let mut end = aligned_down(max_blocks);
    'ends: while end >= needed {
        let first = end - needed;
        if !holds(first) {
            end = aligned_down(first);
            continue;
        }
        for block in (first + 1..end).rev() {
            if !holds(block) {
                end = aligned_down(block);
                continue 'ends;
            }
        }
        return end;
    }
    // No window: the blocks held from the start (fewer than a window's), aligned.
    let leading = (0..max_blocks.min(needed))
        .take_while(|&block| holds(block))
        .count();
    aligned_down(leading)
}

/// vLLM 0.32's `SlidingWindowManager.find_longest_cache_hit`, block by block: from the right,
/// the first run of `needed` held blocks ends the hit (a run starts only at an aligned end);
/// without one, the run that reached block 0, trimmed to the alignment.
#[cfg(test)]
fn window_hit_by_block(
    needed: usize,
    max_blocks: usize,
    block_tokens: usize,
    alignment: usize,
    mut holds: impl FnMut(usize) -> bool,
) -> usize {
    let aligned = |blocks: usize| (blocks * block_tokens).is_multiple_of(alignment);
    let mut run = 0;
    for block in (0..max_blocks).rev() {
        if !holds(block) {
            run = 0;
            continue;
        }
        // A run must end on an aligned boundary.
        if run == 0 && block_tokens != alignment && !aligned(block + 1) {
            continue;
        }
        run += 1;
        if run >= needed {
            return block + run;
        }
    }
    // The loop ended at block 0: `run` held blocks from the start, fewer than a window.
    let mut blocks = run;
    while block_tokens != alignment && !aligned(blocks) {
        blocks -= 1;
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(block_tokens: usize) -> GroupRule {
        GroupRule {
            rule: Rule::Prefix,
            block_tokens,
        }
    }

    fn sliding(window: usize, block_tokens: usize) -> GroupRule {
        GroupRule {
            rule: Rule::window(window, block_tokens),
            block_tokens,
        }
    }

    /// `held[group]` lists the blocks each group holds.
    fn hit(groups: &[GroupRule], max_tokens: usize, held: &[&[usize]]) -> usize {
        let alignment = groups.iter().map(|g| g.block_tokens).max().unwrap_or(1);
        hit_tokens(groups, max_tokens, alignment, |group, block| {
            held[group].contains(&block)
        })
    }

    #[test]
    fn skipping_windows_answers_as_vllms_block_by_block_scan() {
        // Seeded random holdings, windows, cuts and alignments (block sizes 1–4× a 16-token
        // hash block, alignments their multiples).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize
        };
        for _ in 0..20_000 {
            let block_tokens = 16 * (1 + next(4));
            let alignment = block_tokens * (1 + next(2));
            let needed = next(6);
            let max_blocks = next(40);
            let density = 1 + next(9);
            let held: Vec<bool> = (0..max_blocks).map(|_| next(10) < density).collect();
            let holds = |block: usize| held[block];
            assert_eq!(
                window_hit(needed, max_blocks, block_tokens, alignment, holds),
                window_hit_by_block(needed, max_blocks, block_tokens, alignment, holds),
                "needed {needed}, block {block_tokens}, alignment {alignment}, held {held:?}"
            );
        }
    }

    #[test]
    fn a_replica_without_a_window_is_skipped_a_window_at_a_time() {
        let mut lookups = 0;
        let hit = window_hit(64, 1000, 16, 16, |_| {
            lookups += 1;
            false
        });
        assert_eq!(hit, 0);
        assert!(lookups <= 1000 / 64 + 64, "{lookups} lookups");
    }

    #[test]
    fn window_blocks_follow_vllm() {
        // cdiv(window - 1, block_size): a 64-token window in 32-token blocks needs 2 blocks.
        assert_eq!(Rule::window(64, 32), Rule::Window { blocks: 2 });
        assert_eq!(Rule::window(65, 32), Rule::Window { blocks: 2 });
        assert_eq!(Rule::window(66, 32), Rule::Window { blocks: 3 });
        assert_eq!(Rule::window(128, 16), Rule::Window { blocks: 8 });
    }

    #[test]
    fn full_attention_alone_is_the_held_prefix() {
        assert_eq!(hit(&[full(32)], 320, &[&[0, 1, 2, 4]]), 96);
        // Bounded by the caller's maximum.
        assert_eq!(hit(&[full(32)], 64, &[&[0, 1, 2, 4]]), 64);
    }

    #[test]
    fn a_sliding_group_needs_the_window_before_the_cut() {
        let groups = [full(32), sliding(64, 32)];
        // Full holds 0..6; the window group holds only 0 and 1: the cut falls back to 2 blocks.
        assert_eq!(hit(&groups, 1024, &[&[0, 1, 2, 3, 4, 5], &[0, 1]]), 64);
        // The window group holds 3 and 4 (its window for a cut at 5): 5 blocks.
        assert_eq!(hit(&groups, 1024, &[&[0, 1, 2, 3, 4, 5], &[3, 4]]), 160);
        // It holds the window for 6 but full attention stops at 6 blocks: 6.
        assert_eq!(hit(&groups, 1024, &[&[0, 1, 2, 3, 4, 5], &[4, 5]]), 192);
        // Nothing in the window group, nothing from the start: no hit.
        assert_eq!(hit(&groups, 1024, &[&[0, 1, 2, 3, 4, 5], &[]]), 0);
        // A single block from the start is a hit of one (fewer than a window, from block 0).
        assert_eq!(hit(&groups, 1024, &[&[0, 1, 2, 3, 4, 5], &[0]]), 32);
    }

    #[test]
    fn without_full_attention_the_start_may_be_gone() {
        // Mistral-style: every layer slides. Blocks 0..4 evicted, 8 and 9 held: a hit of 10.
        assert_eq!(hit(&[sliding(64, 32)], 1024, &[&[8, 9]]), 320);
        // Capped: the cut at 9 blocks needs 7 and 8.
        assert_eq!(hit(&[sliding(64, 32)], 9 * 32, &[&[8, 9]]), 0);
    }

    #[test]
    fn groups_of_different_windows_iterate_until_they_agree() {
        let groups = [full(16), sliding(32, 16), sliding(64, 16)];
        let held: [&[usize]; 3] = [
            &(0..12).collect::<Vec<_>>(),
            &[6, 7, 10, 11],
            &[4, 5, 6, 7, 9, 10, 11],
        ];
        // Full attention: 12 blocks. The 2-block window holds 10 and 11: 12. The 4-block window
        // at 12 needs 8..11, 8 is missing: its answer is 8 (4..7). Round two at 8: the 2-block
        // window needs 6 and 7 (held), full attention holds 8: agreed on 8 blocks.
        assert_eq!(hit(&groups, 16 * 12, &held), 128);
    }

    #[test]
    fn chunked_local_attention_needs_only_the_cuts_chunk() {
        let chunked = GroupRule {
            rule: Rule::Chunk { chunk_tokens: 128 },
            block_tokens: 32,
        };
        // vLLM's own examples (chunk 8, block 4) scaled by 8: a cut at 15*8 tokens starts its
        // chunk at 64 tokens = block 2; block 2 held → 3 blocks; not held → 2.
        let scaled = GroupRule {
            rule: Rule::Chunk { chunk_tokens: 64 },
            block_tokens: 32,
        };
        assert_eq!(hit(&[scaled], 120, &[&[2]]), 96);
        assert_eq!(hit(&[scaled], 120, &[&[]]), 64);
        // A cut on a chunk boundary needs nothing.
        assert_eq!(hit(&[scaled], 128, &[&[]]), 128);
        // With full attention, the full prefix bounds it.
        assert_eq!(
            hit(&[full(32), chunked], 1024, &[&[0, 1, 2, 3, 4], &[4]]),
            160
        );
        assert_eq!(
            hit(&[full(32), chunked], 1024, &[&[0, 1, 2, 3, 4], &[]]),
            128
        );
    }

    #[test]
    fn larger_blocks_end_on_the_alignment() {
        // A window group of 64-token blocks beside 32-token full attention, alignment 64.
        let groups = [full(32), sliding(128, 64)];
        // Full holds 7 blocks (224 tokens) → the window group may look at 3 of its blocks;
        // it needs 2 (cdiv(127, 64)) and holds 1 and 2: a hit of 192 tokens.
        assert_eq!(
            hit(&groups, 1024, &[&(0..7).collect::<Vec<_>>(), &[1, 2]]),
            192
        );
        // Full attention's 224 is not a multiple of 64, the window's answer is: 192.
        assert_eq!(
            hit(&groups, 1024, &[&(0..7).collect::<Vec<_>>(), &[0, 1, 2]]),
            192
        );
    }
}
