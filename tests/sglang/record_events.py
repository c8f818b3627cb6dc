#!/usr/bin/env python3
"""Record a real SGLang KV-event stream (tests/fixtures/sglang/capture-sglang-<v>-ps<N>[-<fmt>].jsonl).

    ~/.cache/kvroute/sglang-venv-0.5.23/bin/python tests/sglang/record_events.py OUT.jsonl \
        [--page-size 16] [--format default|dynamo] [--topic kv@sglang-a@tiny]

Run inside a venv from tests/sglang/install.sh; the capture is of that venv's SGLang. No GPU and
no model: the recorder drives the pieces of SGLang's scheduler that make and send KV events,
in its own process, on 127.0.0.1:

- the radix cache the scheduler builds for a plain full-attention model: `UnifiedRadixCache`
  (`mem_cache/registry.py` `create_unified_radix_cache`: components `(FULL,)`) over a real
  paged CPU KV pool (`PagedTokenToKVPoolAllocator` + `MHATokenToKVPool`), with its default
  tree core (`SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`: the Python core in 0.5.19, the bundled
  Rust core from 0.5.22), KV events on, and the event `format` and LoRA name table the
  scheduler passes (`Scheduler.init_kv_event_lora_names` from `--lora-paths`, then
  `_record_kv_event_lora_name` per admitted LoRA request);
- the publisher the scheduler makes: `EventPublisherFactory.create(<--kv-events-config JSON>,
  0)`, i.e. the real `ZmqEventPublisher` with a replay ROUTER;
- the scheduler's publish step (`SchedulerKvEventsPublisher.publish_kv_events`, replicated
  because it needs the scheduler's process-wide rank context): after each "step", the tree's
  `take_events()` becomes one `KVEventBatch(ts=time.time(), events=...)` and is published.

Requests are inserted as the scheduler's `_insert_cache` does: the key is the page-aligned
prompt (`RadixKey(..., extra_key, cache_salt).page_aligned(page_size)`), its KV rows come from
the allocator, and the tree itself frees the rows of the prefix it already held. Allocation
evicts first when the pool is short (`evict(EvictParams(num_tokens=...))`), as the scheduler does.

Output, JSON lines in causal order:
- `setup`: versions, settings, the LoRA adapters (name, path, id), the tree core;
- `step`: what was done (inserts, an explicit eviction, a reset) and the sequence numbers of
  the batches it published;
- `prompt`: per inserted request, its token ids, extra_key / cache_salt / lora_name, the
  page-aligned length, how much the tree already held, and `published_block_hashes`: for
  every full page of the prompt, the hash SGLang published for it (read off the BlockStored
  events so far, following their parent links; also checked against the recipe of
  tests/sglang/golden.py, see `hash_recipe`);
- `zmq_pub`: every live message as a SUB socket received it: `frames_hex` (topic, seq, payload)
  and a generic msgpack decode (`decoded`);
- `zmq_replay_request` / `zmq_replay_reply`: a DEALER's replay request from a mid-stream
  sequence number and every reply frame (as the DEALER sees them: the empty delimiter first),
  the end marker included.

The live stream is checked to be complete (sequence numbers 0..N-1, one per published batch):
the PUB connects to the recorder's bound SUB, and a subscription can in principle reach the
PUB after its first message, so a run that loses one is redone (MAX_ATTEMPTS).
"""
import argparse
import hashlib
import json
import os
import socket
import struct
import sys
import threading
import time
from array import array

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "vllm"))
import sglang_env  # noqa: E402  (PATH / TORCH_EXTENSIONS_DIR before sglang loads)

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from fixture_json import jsonable  # noqa: E402

DEADLINE_S = 30.0
MAX_ATTEMPTS = 3
KV_POOL_PAGES = 40
LORA_NAME, LORA_PATH = "sql-adapter", "/adapters/sql-adapter"
SALT = "tenant-a"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, what):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Subscriber:
    """A bound SUB socket collecting every message on a thread."""

    def __init__(self, ctx, endpoint, topic):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.bind(endpoint)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.messages = []
        self.step = None
        self.running = True
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                with self.lock:
                    self.messages.append((self.step, frames))

    def wait_connected(self):
        if not self.monitor.poll(int(DEADLINE_S * 1000)):
            raise TimeoutError("publisher never connected")
        self.monitor.recv_multipart()

    def count(self):
        with self.lock:
            return len(self.messages)

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def le_u32(tokens):
    return struct.pack(f"<{len(tokens)}I", *tokens)


def page_words(page):
    """A page's u32 words: its tokens, or for EAGLE bigram pages each pair's two tokens."""
    return [w for t in page for w in (t if isinstance(t, tuple) else (t,))]


def recipe_chain(pages, seed=None):
    out, prior = [], seed
    for page in pages:
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(le_u32(page_words(page)))
        prior = h.digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def record(args, attempt):
    from sglang.srt.disaggregation import kv_events as kve
    from sglang.srt.mem_cache import events as mce
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    version = sglang_env.sglang_version()
    has_namespaces = hasattr(kve, "namespaced_block_hash")
    if args.format == "dynamo" and not has_namespaces:
        sys.exit(f"sglang {version} has no event formats")
    ps = args.page_size
    records = []

    # ---- the scheduler's pieces
    server_args = ServerArgs(model_path="dummy", page_size=ps)
    set_global_server_args_for_scheduler(server_args)
    kv_size = KV_POOL_PAGES * ps
    req_to_token = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=kv_size, page_size=ps, dtype=torch.bfloat16, head_num=1, head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=kv_size, page_size=ps, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    lora_ref = LoRARef(lora_id=LoRARef.deterministic_id(LORA_NAME, LORA_PATH), lora_name=LORA_NAME, lora_path=LORA_PATH, pinned=False)
    lora_names = None
    params = dict(
        disable=False,
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        page_size=ps,
        enable_kv_cache_events=True,
        eviction_policy="lru",
        tree_components=(ComponentType.FULL,),
        is_eagle=args.eagle,
    )
    if has_namespaces:
        table_cls = getattr(mce, "KvEventLoraNames", None) or mce.LoRANameTable
        lora_names = table_cls.from_lora_refs([lora_ref])
        params["dynamo_kv_event_format"] = args.format == "dynamo"
        params["kv_event_lora_names"] = lora_names
    cache = UnifiedRadixCache(CacheInitParams(**params))

    ctx = zmq.Context.instance()
    pub_port, replay_port = free_port(), free_port()
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": args.topic,
    }
    if has_namespaces:
        config["format"] = args.format
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub_port}", args.topic)
    publisher = kve.EventPublisherFactory.create(json.dumps(config), 0)
    sub.wait_connected()
    published = []  # one entry per batch sent: (seq, step)

    records.append(
        {
            "kind": "setup",
            "sglang": version,
            "library_versions": sglang_env.library_versions("torch", "msgspec", "pyzmq"),
            "python": sys.version.split()[0],
            "page_size": ps,
            "is_eagle": args.eagle,
            "block_size": ps,
            "kv_events_config": config,
            "format": args.format if has_namespaces else None,
            "topic": args.topic,
            "tree": type(cache).__name__,
            "tree_core": type(cache.tree_core).__name__,
            "tree_core_backend": getattr(cache, "_tree_core_backend", "python"),
            "kv_pool_pages": KV_POOL_PAGES,
            "lora_adapters": [{"lora_name": LORA_NAME, "lora_path": LORA_PATH, "lora_id": lora_ref.lora_id}],
            "cache_salt": SALT,
            "hash_recipe": "plain: SHA256 chain over LE u32 pages, first 8 bytes BE signed (tests/sglang/golden.py); salted event chains seeded with SHA256('sglang-cache-salt-v1\\0'+salt); namespaced (0.5.22+) per kv_event_namespace_seed / namespaced_block_hash",
            "attempt": attempt,
        }
    )

    def publish_step(step):
        """The scheduler's publish_kv_events: one batch of whatever the tree recorded."""
        events = cache.take_events()
        if not events:
            return []
        sub.step = step
        publisher.publish(kve.KVEventBatch(ts=time.time(), events=events))
        seq = len(published)
        published.append((seq, step))
        wait_for(lambda: sub.count() >= len(published), f"seq {seq}")
        return [seq]

    # (parent hash, page tokens, namespace) -> published hash, from the events themselves
    stored_hashes = {}
    pending_prompts = []

    def note_events(frames_list):
        for _step, frames in frames_list:
            batch = msgspec.msgpack.decode(frames[2])
            for event in batch[1]:
                if isinstance(event, dict):
                    tag, fields = event["type"], event
                else:
                    tag, fields = event[0], None
                if tag != "BlockStored":
                    continue
                if fields is None:  # positional (<= 0.5.19)
                    hashes, parent, tokens, size = event[1], event[2], event[3], event[4]
                    salt = event[7]["cache_salt"] if len(event) > 7 else None
                    lora_name = None  # not on the positional wire
                else:
                    hashes, parent, tokens, size = fields["block_hashes"], fields["parent_block_hash"], fields["token_ids"], fields["block_size"]
                    salt, lora_name = fields.get("cache_salt"), fields.get("lora_name")
                for i, h in enumerate(hashes):
                    page = tuple(tuple(t) if isinstance(t, list) else t for t in tokens[i * size : (i + 1) * size])
                    stored_hashes[(parent, page, salt, lora_name)] = h
                    parent = h

    def insert(step, tokens, *, extra_key=None, cache_salt=None, lora=False):
        key = RadixKey(array("q", tokens), extra_key, is_bigram=args.eagle, cache_salt=cache_salt).page_aligned(ps)
        need = len(key)
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
        rows = allocator.alloc(need)
        assert rows is not None, "allocation failed after eviction"
        if lora and isinstance(lora_names, getattr(mce, "KvEventLoraNames", ())):
            # 0.5.23: the scheduler names the request's namespace when it admits it.
            req = type("Req", (), {"extra_key": extra_key, "lora_id": lora_ref.lora_id})()
            lora_names.register(req, LORA_NAME)
        # The tree frees the rows of the prefix it already held (InsertParams.prev_prefix_len
        # is 0: the request had no prefix locked), as the scheduler's caching paths rely on.
        result = cache.insert(InsertParams(key=key, value=rows[:need]))
        prompt = {
            "kind": "prompt",
            "step": step,
            "token_ids": tokens,
            "extra_key": extra_key,
            "cache_salt": cache_salt,
            "lora_name": LORA_NAME if lora else None,
            "aligned_len": need,
            "prefix_len_before": result.prefix_len,
        }
        pending_prompts.append(prompt)
        return prompt

    def step(name, action, fn):
        fn()
        seqs = publish_step(name)
        records.append({"kind": "step", "step": name, "action": action, "published_seqs": seqs})
        # Every pending prompt's pages are now published: resolve their hashes.
        with sub.lock:
            new = sub.messages[len(noted) :]
        noted.extend(new)
        note_events(new)
        for prompt in pending_prompts:
            pages = prompt_pages(prompt)
            parent, hashes = None, []
            for page in pages:
                # A LoRA branch carries lora_name when its hashes are namespaced; otherwise
                # (positional wire, 0.5.22's default format) it shares the base hashes.
                h = stored_hashes.get((parent, page, prompt["cache_salt"], prompt["lora_name"]))
                if h is None:
                    h = stored_hashes.get((parent, page, prompt["cache_salt"], None))
                assert h is not None, f"{name}: no published hash for a page of {prompt['step']}"
                hashes.append(h)
                parent = h
            prompt["published_block_hashes"] = hashes
            prompt["recipe_check"] = check_recipe(prompt, hashes)
            records.append(prompt)
        pending_prompts.clear()

    def prompt_pages(prompt):
        """The prompt's full pages as the tree keys them (EAGLE: pages of bigram pairs)."""
        t = prompt["token_ids"]
        if args.eagle:
            units = [(t[j], t[j + 1]) for j in range(prompt["aligned_len"])]
        else:
            units = t[: prompt["aligned_len"]]
        return [tuple(units[i : i + ps]) for i in range(0, prompt["aligned_len"], ps)]

    def check_recipe(prompt, hashes):
        pages = prompt_pages(prompt)
        seed = None
        if prompt["cache_salt"] is not None:
            seed = hashlib.sha256(b"sglang-cache-salt-v1\0" + prompt["cache_salt"].encode()).digest()
        chain = recipe_chain(pages, seed)
        ns = None
        if has_namespaces and (prompt["extra_key"] or prompt["cache_salt"]):
            # Only 0.5.23's table names admitted requests; the default format namespaces those.
            lora_admitted = (
                prompt["lora_name"] is not None
                and isinstance(lora_names, getattr(mce, "KvEventLoraNames", ()))
                and lora_names.get(prompt["extra_key"]) is not None
            )
            if args.format == "dynamo":
                ns = kve.kv_event_namespace_seed(extra_key=prompt["extra_key"], cache_salt=prompt["cache_salt"])
            elif lora_admitted:
                ns = kve.kv_event_namespace_seed(extra_key=prompt["extra_key"], cache_salt=None)
        if ns is not None:
            chain = [kve.namespaced_block_hash(h, namespace_seed=ns) for h in chain]
        assert chain == hashes, f"recipe disagrees with SGLang for {prompt['step']}"
        return "salted event chain" * (seed is not None) + (" + " if seed is not None and ns is not None else "") + ("namespaced" if ns is not None else "") or "plain chain"

    noted = []
    # ---- the workload
    import random

    rng = random.Random(20261206 + ps)

    def text(n):
        return [rng.randrange(1, 150_000) for _ in range(n)]

    system = text(4 * ps)  # a shared system prompt of four pages
    users = [text(n) for n in (2 * ps + 5, 3 * ps, ps + 9, 2 * ps)]
    step("startup", "the tree resets itself when built (AllBlocksCleared)", lambda: None)
    step("prompt_a", "insert system+user0 (partial last page not stored)", lambda: insert("prompt_a", system + users[0]))
    step("prompt_a_decoded", "insert prompt_a plus 40 output tokens (a child of prompt_a's leaf)", lambda: insert("prompt_a_decoded", system + users[0] + text(40)))
    step("prompt_b_c_same_step", "two requests finishing in one scheduler step", lambda: (insert("prompt_b", system + users[1]), insert("prompt_c", system + users[2])))
    step("prompt_d_splits_a_node", "insert a prompt sharing only 2 pages with the system prompt (splits a node)", lambda: insert("prompt_d_splits_a_node", system[: 2 * ps] + users[3]))
    step("salted", f"insert prompt_b's tokens under cache_salt {SALT!r}", lambda: insert("salted", system + users[1], cache_salt=SALT))
    step("salted_child", "a salted child of the salted branch", lambda: insert("salted_child", system + users[1] + text(ps), cache_salt=SALT))
    step("lora", f"insert prompt_c's tokens with LoRA {LORA_NAME!r} (extra_key = its lora_id)", lambda: insert("lora", system + users[2], extra_key=lora_ref.lora_id, lora=True))
    step("exact_repeat", "prompt_a again: fully cached, nothing new", lambda: insert("exact_repeat", system + users[0]))
    for i in range(3):
        step(f"fill_{i}", "a long unrelated prompt; the pool is short, so the tree evicts LRU leaves first", lambda: insert(f"fill_{i}", text(KV_POOL_PAGES * ps // 2 + 3)))
    step("evict_explicit", "evict 4 pages' worth of tokens (as the scheduler does under memory pressure)", lambda: cache.evict(EvictParams(num_tokens=4 * ps)))
    step("revisit_a", "prompt_a after its pages were evicted: stored again", lambda: insert("revisit_a", system + users[0]))
    replay_from = max(1, len(published) // 2)

    # ---- replay from a mid-stream sequence number, as a DEALER
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    request = [b"", replay_from.to_bytes(8, "big")]
    dealer.send_multipart(request)
    records.append({"kind": "zmq_replay_request", "from_seq": replay_from, "frames_hex": [f.hex() for f in request]})
    while True:
        if not dealer.poll(int(DEADLINE_S * 1000)):
            raise TimeoutError("no replay reply")
        frames = dealer.recv_multipart()
        # [b"", (topic,) seq, payload]: the topic frame exists from 0.5.22.
        seq_frame = frames[-2]
        seq = int.from_bytes(seq_frame, "big", signed=True)
        reply = {"kind": "zmq_replay_reply", "seq": seq, "num_frames": len(frames), "frames_hex": [f.hex() for f in frames], "decoded": None}
        if seq >= 0:
            reply["decoded"] = jsonable(msgspec.msgpack.decode(frames[-1]))
        records.append(reply)
        if seq < 0:
            break
    dealer.close(0)

    step("reset", "flush the cache (cache.reset(), as /flush_cache does): AllBlocksCleared", lambda: cache.reset())
    step("prompt_a_after_reset", "prompt_a on the empty tree", lambda: insert("prompt_a_after_reset", system + users[0]))

    wait_for(lambda: sub.count() >= len(published), "the last message")
    publisher.shutdown()
    sub.close()
    seqs = [int.from_bytes(frames[1], "big") for _, frames in sub.messages]
    if seqs != list(range(len(published))):
        return None, f"live stream incomplete: {seqs}"
    live = []
    for step_name, frames in sub.messages:
        live.append(
            {
                "kind": "zmq_pub",
                "step": step_name,
                "seq": int.from_bytes(frames[1], "big"),
                "topic": frames[0].decode(),
                "frames_hex": [f.hex() for f in frames],
                "decoded": jsonable(msgspec.msgpack.decode(frames[2])),
            }
        )
    # Interleave the live messages after the step that caused them.
    out, by_step = [], {}
    for message in live:
        by_step.setdefault(message["step"], []).append(message)
    for r in records:
        out.append(r)
        if r["kind"] == "step":
            out.extend(by_step.pop(r["step"], []))
    assert not by_step
    return out, None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--format", choices=["default", "dynamo"], default="default")
    parser.add_argument("--topic", default="kv@sglang-a@tiny")
    parser.add_argument("--eagle", action="store_true", help="a tree for EAGLE speculative decoding (bigram keys)")
    args = parser.parse_args()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        records, problem = record(args, attempt)
        if records is not None:
            break
        print(f"attempt {attempt}: {problem}", file=sys.stderr)
    else:
        return 1
    with open(args.out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
