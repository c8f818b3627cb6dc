#!/usr/bin/env python3
"""Check a hybrid capture from tests/vllm/record_hybrid.py against vLLM's own cache-hit rule.

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/check_hybrid_capture.py CAPTURE [--verbose]

(any Python with cbor2 and msgspec or msgpack will do; vLLM itself is not imported.)

From the KV events ALONE it keeps, per (group_idx, published hash), a count of cached copies:
BlockStored adds one per listed hash in its group, BlockRemoved takes one away in its own group
only, AllBlocksCleared empties everything. Before each `request` line it predicts the hit with
vLLM 0.32's rule and compares it with the request's `cached_tokens`; after each request's
events it compares the counts with the `engine_holdings` line.

The rule (vllm/v1/core/kv_cache_coordinator.py, single_type_kv_cache_manager.py):
- max_cache_hit_length = num_prompt_tokens - 1; the prompt's full-block sha256_cbor chain
  (NONE_HASH = H(PYTHONHASHSEED)), each block compared as its published u64;
- groups with equal spec (`spec_group` in hash_params) are looked up jointly: a block counts
  only when every group of the spec group holds it;
- full attention (FullAttentionManager): the longest run of held blocks from block 0;
- sliding window (SlidingWindowManager): scanning right to left from the cap, the first run of
  cdiv(window - 1, block_size) held blocks ends the hit; with none, the run from block 0 counts;
- chunked local (ChunkedLocalAttentionManager): blocks before the cap's chunk count as hits
  without a lookup (null blocks); then the run of held blocks from the chunk's first block;
- one group: that manager's answer (UnitaryKVCacheCoordinator); several: full attention first,
  every spec group lowers the candidate until nothing changes (HybridKVCacheCoordinator).
Also reported: stores whose token span is not dense (len(token_ids) != hashes x block size),
stores with no hash, stores whose first hash is not the span's first block (the span starts at
block 0 with a null parent, else after the parent), stores with gapped positions, whether every
hash is the chain value of the request's tokens inside the event's span, duplicate copies, and
stores/removes per group.
"""
import argparse
import hashlib
import json
import sys
from collections import Counter, defaultdict

import cbor2

try:
    import msgspec

    def unpack(b):
        return msgspec.msgpack.decode(b)
except ImportError:  # pragma: no cover
    import msgpack

    def unpack(b):
        return msgpack.unpackb(b, raw=False, strict_map_key=False)


def H(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def chain(tokens, block_size, seed):
    """Published u64 of every full block of `tokens`."""
    parent = H(seed)
    out = []
    for i in range(len(tokens) // block_size):
        parent = H((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def cdiv(a, b):
    return -(-a // b)


class Rule:
    def __init__(self, params):
        self.groups = params["groups"]
        by_sg = defaultdict(list)
        for g in self.groups:
            by_sg[g.get("spec_group", 0)].append(g)
        self.spec_groups = [by_sg[k] for k in sorted(by_sg)]
        # vLLM puts full attention first (the coordinator's own order is recorded).
        self.spec_groups.sort(key=lambda gs: gs[0]["kind"] != "full_attention")
        self.unitary = len(self.groups) == 1

    def held_all(self, held, gids, h):
        return all(held.get((g, h), 0) > 0 for g in gids)

    def one(self, gs, hashes, max_length, held):
        kind, bs = gs[0]["kind"], gs[0]["block_size"]
        gids = [g["group_idx"] for g in gs]
        n = min(max_length // bs, len(hashes))
        if kind == "full_attention":
            k = 0
            while k < n and self.held_all(held, gids, hashes[k]):
                k += 1
            return k * bs
        if kind == "sliding_window":
            need = cdiv(gs[0]["sliding_window"] - 1, bs)
            run = 0
            for i in range(n - 1, -1, -1):
                if self.held_all(held, gids, hashes[i]):
                    run += 1
                    if run >= need:
                        return (i + run) * bs
                else:
                    run = 0
            return run * bs
        if kind == "chunked_local_attention":
            # Blocks before the cap's chunk are out of every window: they count as computed
            # (null blocks); then the run of held blocks from the chunk's first block.
            chunk = gs[0]["attention_chunk_size"]
            k = (max_length // chunk * chunk) // bs if max_length > 0 else 0
            while k < n and self.held_all(held, gids, hashes[k]):
                k += 1
            return k * bs
        raise SystemExit(f"no rule for kind {kind}")

    def hit(self, hashes, num_prompt_tokens, held):
        max_len = num_prompt_tokens - 1
        if self.unitary:
            return self.one(self.spec_groups[0], hashes, max_len, held)
        hit_length = max_len
        simple = len(self.spec_groups) == 2 and self.spec_groups[0][0]["kind"] == "full_attention"
        full_hit = None
        while True:
            curr = hit_length
            for gs in self.spec_groups:
                if gs[0]["kind"] == "full_attention" and full_hit is not None:
                    curr = min(curr, full_hit)
                    continue
                new = self.one(gs, hashes, curr, held)
                if gs[0]["kind"] == "full_attention":
                    full_hit = new
                curr = new
            if curr >= hit_length:
                break
            hit_length = curr
            if simple:
                break
        return hit_length


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("capture")
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args()
    lines = [json.loads(line) for line in open(args.capture)]
    params = lines[0]
    assert params["kind"] == "hash_params", "first line must be hash_params"
    seed = params["PYTHONHASHSEED"]
    if "none_hash_hex" in params:
        assert H(seed).hex() == params["none_hash_hex"], "NONE_HASH differs"
    rule = Rule(params)
    kinds = {g["group_idx"]: g["kind"] for g in params["groups"]}

    held = Counter()
    # Rules a hybrid-unaware index might use, to show what the capture tells apart: the longest
    # run from block 0 held by the full-attention group(s), or by every group.
    all_gids = [g["group_idx"] for g in params["groups"]]
    full_gids = [g["group_idx"] for g in params["groups"] if g["kind"] == "full_attention"]
    naive_rules = {"every group holds the prefix from block 0": all_gids}
    if full_gids:
        naive_rules["full-attention group(s) hold the prefix from block 0"] = full_gids
    naive_ok = Counter()
    rule_ok = rule_bad = hold_ok = hold_bad = 0
    stats = Counter()
    per_group = defaultdict(Counter)
    max_copies = 0
    request = None
    chain_hashes = {}
    mismatches = []
    for rec in lines[1:]:
        kind = rec["kind"]
        if kind == "request":
            toks = rec["prompt_token_ids"]
            bs = params["block_size"]
            hashes = chain(toks, bs, seed)
            predicted = rule.hit(hashes, rec["num_prompt_tokens"], held)
            cap = (rec["num_prompt_tokens"] - 1) // bs
            for name, gids in naive_rules.items():
                k = 0
                while k < min(cap, len(hashes)) and all(held.get((g, hashes[k]), 0) for g in gids):
                    k += 1
                naive_ok[name] += k * bs == rec["cached_tokens"]
            ok = predicted == rec["cached_tokens"]
            rule_ok += ok
            rule_bad += not ok
            if not ok:
                mismatches.append((rec["step"], rec["num_prompt_tokens"], rec["cached_tokens"], predicted))
            if args.verbose or not ok:
                print(f"{'ok ' if ok else 'BAD'} {rec['step']:32s} n={rec['num_prompt_tokens']:4d} "
                      f"cached={rec['cached_tokens']:4d} rule={predicted:4d}")
            full = toks + rec.get("output_token_ids", [])
            request = rec
            chain_hashes = {h: i for i, h in enumerate(chain(full, bs, seed))}
        elif kind == "zmq_pub":
            topic, seq, payload = (bytes.fromhex(f) for f in rec["frames_hex"])
            _ts, events, _dp = unpack(payload)
            for ev in events:
                t = ev["type"]
                if t == "BlockStored":
                    g = ev["group_idx"]
                    hs = ev["block_hashes"]
                    bs = ev["block_size"]
                    stats["stores"] += 1
                    per_group[g]["stores"] += 1
                    per_group[g]["stored_hashes"] += len(hs)
                    if ev.get("kv_cache_spec_kind") not in (None, kinds[g]):
                        stats["store_kind_differs_from_group"] += 1
                    if not hs:
                        stats["stores_with_no_hash"] += 1
                        per_group[g]["stores_with_no_hash"] += 1
                    if len(ev["token_ids"]) != len(hs) * bs:
                        stats["non_dense_stores"] += 1
                        per_group[g]["non_dense_stores"] += 1
                    # The span starts at block 0 when the parent is null, else right after it.
                    parent = ev["parent_block_hash"]
                    start = 0 if parent is None else chain_hashes.get(parent, -1) + 1
                    if parent is not None:
                        stats["stores_with_parent"] += 1
                        if start == 0:
                            stats["parent_not_in_request_chain"] += 1
                    full = request["prompt_token_ids"] + request.get("output_token_ids", [])
                    span = len(ev["token_ids"]) // bs
                    if list(ev["token_ids"]) != full[start * bs:start * bs + len(ev["token_ids"])]:
                        stats["token_span_not_request_tokens_at_parent+1"] += 1
                    pos = [chain_hashes.get(h) for h in hs]
                    if any(p is None for p in pos):
                        stats["hashes_not_in_request_chain"] += sum(p is None for p in pos)
                    elif any(not start <= p < start + span for p in pos):
                        stats["hashes_outside_token_span"] += 1
                    elif pos and pos != list(range(pos[0], pos[0] + len(pos))):
                        stats["stores_with_gapped_positions"] += 1
                    if pos and pos[0] is not None and pos[0] != start:
                        stats["stores_not_starting_at_span_start"] += 1
                    for h in hs:
                        held[(g, h)] += 1
                        max_copies = max(max_copies, held[(g, h)])
                        if held[(g, h)] == 2:
                            stats["duplicate_copies_created"] += 1
                            per_group[g]["duplicate_copies_created"] += 1
                elif t == "BlockRemoved":
                    g = ev["group_idx"]
                    for h in ev["block_hashes"]:
                        stats["removed_hashes"] += 1
                        per_group[g]["removed_hashes"] += 1
                        if held[(g, h)] <= 0:
                            stats["removes_of_unheld"] += 1
                        else:
                            held[(g, h)] -= 1
                            if held[(g, h)] == 0:
                                del held[(g, h)]
                elif t == "AllBlocksCleared":
                    held.clear()
                    stats["all_blocks_cleared"] += 1
                else:
                    stats[f"other_event_{t}"] += 1
        elif kind == "engine_holdings":
            engine = Counter()
            for g, hs in rec["groups"].items():
                for h in hs:
                    engine[(int(g), h)] += 1
            mine = +held
            if engine == mine:
                hold_ok += 1
            else:
                hold_bad += 1
                print(f"HOLDINGS DIFFER after {rec['step']}: engine-only "
                      f"{len(engine - mine)}, events-only {len(mine - engine)}")

    total = rule_ok + rule_bad
    print(f"layout {params.get('layout')}: groups "
          + ", ".join(f"{g['group_idx']}:{g['kind']}"
                      + (f"/w{g['sliding_window']}" if g.get("sliding_window") else "")
                      + (f"/c{g['attention_chunk_size']}" if g.get("attention_chunk_size") else "")
                      + f"/bs{g['block_size']}" for g in params["groups"]))
    print(f"rule == cached_tokens: {rule_ok}/{total}")
    for name in naive_rules:
        print(f"  (hybrid-unaware rule '{name}' == cached_tokens: {naive_ok[name]}/{total})")
    n_hold = hold_ok + hold_bad
    print(f"events-derived holdings == engine_holdings: {hold_ok}/{n_hold}")
    print(f"max copies of one (group, hash): {max_copies}")
    print("events: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    for g in sorted(per_group):
        print(f"  group {g} ({kinds[g]}): " + ", ".join(f"{k}={v}" for k, v in sorted(per_group[g].items())))
    hits = sum(1 for r in lines if r["kind"] == "request" and r["cached_tokens"] > 0)
    print(f"requests with a hit: {hits}/{total}")
    return 0 if rule_bad == 0 and hold_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
