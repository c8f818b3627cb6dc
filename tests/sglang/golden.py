#!/usr/bin/env python3
"""Compute SGLang's page-hash golden vectors (tests/fixtures/sglang/golden-hashes.json).

    python3 tests/sglang/golden.py tests/fixtures/sglang/golden-hashes.json [VERSION ...]

Run with any python3: for each version (default 0.5.19 0.5.22 0.5.23) it re-runs itself inside
that version's venv from tests/sglang/install.sh (`--part`), which prints the version's vectors
as JSON, and merges them. Deterministic: no clocks, fixed seeds, sorted keys.

Every hash comes from the installed SGLang's own code (no server, no GPU):
- page digests: `sglang.srt.mem_cache.utils.get_hash_str` (the native binding
  `mem_cache/cpp_utils/hash_binding.cpp` `get_hash`, built by torch's JIT loader);
- published values: `mem_cache.utils.hash_str_to_int64`;
- stores: a simulated `mem_cache.radix_cache.RadixCache` (its own `TreeNode`s and
  `mem_cache.events.KVCacheEventRecorder`) with KV events on; its `BlockStored` events, and the
  tree nodes' `hash_value` (storage chain) / `event_hash_value` (event chain) digests;
- 0.5.22+: `mem_cache.utils.storage_namespace_seed` / `get_storage_hash_str`,
  `disaggregation.kv_events.kv_event_namespace_seed` / `namespaced_block_hash`, the recorder's
  `format` handling (`dynamo_kv_event_format`) and LoRA name table (`KvEventLoraNames` /
  `LoRANameTable`, filled as the scheduler fills it);
- LoRA ids: `arg_groups.lora_hook.check_lora_server_args` parsing `--lora-paths`, and
  `lora.lora_registry.LoRARef.deterministic_id`;
- 0.5.23 multimodal pad tokens: `managers.schedule_batch._compute_pad_values`.

Where a vector states a rule (the salt seed, the bigram word layout, the wide-page encoding,
the namespace seed), the rule is written out here independently and asserted to reproduce
SGLang's digest before anything is written, so the file documents the recipe and proves it.
"""
import hashlib
import json
import os
import random
import struct
import subprocess
import sys

VERSIONS = ["0.5.19", "0.5.22", "0.5.23"]
HERE = os.path.dirname(os.path.abspath(__file__))


def venv_python(version):
    cache = os.environ.get("KVROUTE_CACHE", os.path.expanduser("~/.cache/kvroute"))
    return os.path.join(cache, f"sglang-venv-{version}", "bin", "python")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--part":
        part()
        return 0
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_path = sys.argv[1]
    versions = sys.argv[2:] or VERSIONS
    result = {
        "generator": "tests/sglang/golden.py",
        "notes": [
            "digest_hex: SHA-256 page digest as SGLang's get_hash_str returns it (hex).",
            "published_i64: hash_str_to_int64(digest_hex): first 8 digest bytes, big-endian, signed.",
            "Chains: d_i = SHA256(d_{i-1} || page tokens as LE u32); the first page of a chain has no prior bytes unless a seed is given.",
        ],
        "versions": {},
    }
    for version in versions:
        proc = subprocess.run(
            [venv_python(version), "-W", "ignore", os.path.abspath(__file__), "--part"],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        result["versions"][version] = json.loads(proc.stdout)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")
    counts = {v: len(p["vectors"]) for v, p in result["versions"].items()}
    print(f"wrote {out_path}: vectors per version {counts}")
    return 0


# ---------------------------------------------------------------- inside one SGLang venv


def le_u32(tokens):
    return struct.pack(f"<{len(tokens)}I", *tokens)


def own_chain(pages_bytes, seed=None):
    """The chain rule written out: d_i = SHA256(d_{i-1} || page bytes)."""
    out, prior = [], seed
    for data in pages_bytes:
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(data)
        prior = h.digest()
        out.append(prior.hex())
    return out


def own_i64(digest_hex):
    return int.from_bytes(bytes.fromhex(digest_hex)[:8], "big", signed=True)


def pages_of(tokens, page_size):
    return [tokens[i : i + page_size] for i in range(0, len(tokens), page_size)]


def part():
    sys.path.insert(0, HERE)
    import sglang_env  # noqa: F401  (PATH / TORCH_EXTENSIONS_DIR before sglang loads)
    from array import array

    import torch  # noqa: F401
    from sglang.srt.disaggregation import kv_events as kve
    from sglang.srt.mem_cache import utils as mcu
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache import events as mce

    version = sglang_env.sglang_version()
    has_namespaces = hasattr(kve, "namespaced_block_hash")
    vectors = []

    def sglang_pages(tokens, page_size, prior_hex=None, **key_kwargs):
        key = RadixKey(array("q", tokens), **key_kwargs)
        return mcu.get_hash_str(key, prior_hex, page_size=page_size)

    def page_entries(tokens, page_size, digests):
        return [
            {"tokens": p, "digest_hex": d, "published_i64": mcu.hash_str_to_int64(d)}
            for p, d in zip(pages_of(tokens, page_size), digests)
        ]

    # ---- plain chains
    rng = random.Random(20261206)
    plain = {
        "ps16_range_0_48": (list(range(48)), 16),
        "ps16_root_page_only": ([151643] + list(range(100, 115)), 16),
        "ps16_vocab_4_pages": ([rng.randrange(152_000) for _ in range(64)], 16),
        "ps16_u32_edges": ([0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1] + list(range(7)) + list(range(16)), 16),
        "ps32_range_1_96": (list(range(1, 97)), 32),
        "ps32_vocab_5_pages": ([rng.randrange(128_256) for _ in range(160)], 32),
    }
    for name, (tokens, page_size) in plain.items():
        digests = sglang_pages(tokens, page_size)
        assert digests == own_chain([le_u32(p) for p in pages_of(tokens, page_size)])
        assert all(mcu.hash_str_to_int64(d) == own_i64(d) for d in digests)
        vectors.append(
            {
                "kind": "page_chain",
                "name": name,
                "inputs": {"page_size": page_size, "prior_hex": None, "tokens": tokens},
                "pages": page_entries(tokens, page_size, digests),
            }
        )

    # A chain continued from a prior digest (how a radix child node hashes after its parent):
    # the same digests as hashing the whole sequence at once.
    tokens, page_size = plain["ps16_vocab_4_pages"]
    head = sglang_pages(tokens[:32], page_size)
    tail = sglang_pages(tokens[32:], page_size, prior_hex=head[-1])
    assert head + tail == sglang_pages(tokens, page_size)
    vectors.append(
        {
            "kind": "page_chain",
            "name": "ps16_continued_from_prior",
            "inputs": {"page_size": page_size, "prior_hex": head[-1], "tokens": tokens[32:]},
            "pages": page_entries(tokens[32:], page_size, tail),
            "equals_pages_2_3_of": "ps16_vocab_4_pages",
        }
    )

    # A trailing partial page (the tree stores page-aligned keys, so events never carry one;
    # the binding still hashes it).
    tokens = list(range(40))
    digests = sglang_pages(tokens, 16)
    assert digests == own_chain([le_u32(p) for p in pages_of(tokens, 16)])
    vectors.append(
        {
            "kind": "page_chain",
            "name": "ps16_trailing_partial_page",
            "inputs": {"page_size": 16, "prior_hex": None, "tokens": tokens},
            "pages": page_entries(tokens, 16, digests),
        }
    )

    # ---- tokens above u32 (multimodal pad sentinels)
    try:
        from sglang.srt.managers.schedule_batch import _compute_pad_values

        pad_source = "sglang.srt.managers.schedule_batch._compute_pad_values(sha256(b'kvroute-image-1'))"
        pads = list(_compute_pad_values(hashlib.sha256(b"kvroute-image-1").digest()))
    except ImportError:
        # Before 0.5.23 pads are 30-bit; these wide values are the ones 0.5.23 computes for the
        # same identity (fixed here so every version hashes the same input).
        pad_source = "0.5.23's _compute_pad_values for the same identity (not in this version)"
        pads = [1000000 + (int.from_bytes(hashlib.sha256(b"sglang-mm-wide-pad-v1" + hashlib.sha256(b"kvroute-image-1").digest()).digest()[i : i + 8], "big") & ((1 << 62) - 1)) for i in range(0, 32, 8)]
    tokens = list(range(1000, 1016)) + [pads[i % 4] for i in range(16)] + list(range(2000, 2016))
    vector = {
        "kind": "wide_tokens",
        "name": "ps16_pad_page_between_text_pages",
        "inputs": {"page_size": 16, "prior_hex": None, "tokens": tokens, "pad_values": pads, "pad_source": pad_source},
    }
    try:
        digests = sglang_pages(tokens, 16)
        pages = pages_of(tokens, 16)
        wide_page = b"\xff" + struct.pack("<16Q", *pages[1])
        assert digests == own_chain([le_u32(pages[0]), wide_page, le_u32(pages[2])])
        vector["pages"] = page_entries(tokens, 16, digests)
        vector["rule"] = "a page holding any token > u32 is hashed as the byte 0xff followed by every token of the page as LE u64; other pages stay LE u32"
    except Exception as e:  # the version refuses such tokens
        vector["error"] = {"type": type(e).__name__, "message": str(e)[:200]}
    vectors.append(vector)

    # ---- EAGLE bigram pages: 33 raw tokens are 32 bigrams, two pages of 16 pairs
    raw = list(range(500, 533))
    key = RadixKey(array("q", raw), is_bigram=True)
    digests = mcu.get_hash_str(key, None, page_size=16)
    pairs = [(raw[j], raw[j + 1]) for j in range(32)]
    words = [[w for pair in pairs[i : i + 16] for w in pair] for i in (0, 16)]
    assert digests == own_chain([le_u32(w) for w in words])
    vectors.append(
        {
            "kind": "bigram_pages",
            "name": "ps16_eagle_33_raw_tokens",
            "inputs": {"page_size": 16, "prior_hex": None, "raw_tokens": raw},
            "rule": "each page of N bigram pairs is hashed as the 2N u32 words t_j, t_j+1 for its pairs, LE",
            "pages": [
                {"token_pairs": [list(p) for p in pairs[i : i + 16]], "hash_words": w, "digest_hex": d, "published_i64": mcu.hash_str_to_int64(d)}
                for i, w, d in zip((0, 16), words, digests)
            ],
        }
    )

    # ---- stores through SGLang's own radix tree and event recorder
    def simulated_cache(page_size, *, dynamo=False, lora_names=None, is_eagle=False):
        kwargs = dict(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            page_size=page_size,
            enable_kv_cache_events=True,
            is_eagle=is_eagle,
        )
        if has_namespaces:
            kwargs["dynamo_kv_event_format"] = dynamo
            kwargs["kv_event_lora_names"] = lora_names
        cache = RadixCache(CacheInitParams(**kwargs))
        # A new tree resets itself, which records AllBlocksCleared.
        assert [type(e).__name__ for e in cache.take_events()] == ["AllBlocksCleared"]
        return cache

    def node_path(cache, key):
        """Tree nodes from the root's child to the node ending at len(key) (page-aligned)."""
        nodes, node, pos = [], cache.root_node, 0
        while pos < len(key):
            child_key = key[pos:].child_key(cache.page_size)
            assert child_key in node.children
            node = node.children[child_key]
            nodes.append(node)
            pos += len(node.key)
        return nodes

    def store(cache, tokens, **key_kwargs):
        key = RadixKey(array("q", tokens), **key_kwargs)
        cache.insert(InsertParams(key=key, value=None))
        events = cache.take_events()
        page_size = cache.page_size
        digests_storage, digests_event = [], []
        for node in node_path(cache, key.page_aligned(page_size) if not key.is_bigram else key):
            digests_storage += node.hash_value or []
            digests_event += (node.event_hash_value if node.event_hash_value is not None else node.hash_value) or []
        stored = []
        for e in events:
            assert isinstance(e, kve.BlockStored), e
            entry = {
                "block_hashes": list(e.block_hashes),
                "parent_block_hash": e.parent_block_hash,
                "block_size": e.block_size,
                "medium": str(e.medium.value if hasattr(e.medium, "value") else e.medium),
                "token_ids": [list(t) if isinstance(t, tuple) else t for t in e.token_ids],
            }
            for field in ("cache_salt", "lora_name", "session_id"):
                if getattr(e, field, None) is not None:
                    entry[field] = getattr(e, field)
            if getattr(e, "metadata", None) is not None:
                entry["metadata"] = {"cache_salt": e.metadata.cache_salt}
            stored.append(entry)
        return digests_storage, digests_event, stored

    def lora_table(kind, lora_id, lora_name, extra_key):
        """The scheduler's LoRA name table: adapters from --lora-paths, then the request."""
        if not has_namespaces or kind == "none":
            return None
        from sglang.srt.lora.lora_registry import LoRARef

        ref = LoRARef(lora_id=lora_id, lora_name=lora_name, lora_path="/adapters/" + lora_name)
        cls = getattr(mce, "KvEventLoraNames", None) or mce.LoRANameTable
        table = cls.from_lora_refs([ref])
        if kind == "admitted" and cls is not mce.LoRANameTable:
            req = type("Req", (), {"extra_key": extra_key, "lora_id": lora_id})()
            table.register(req, lora_name)
        return table

    from sglang.srt.lora.lora_registry import LoRARef

    lora_name, lora_path = "sql-adapter", "/adapters/sql-adapter"
    lora_id = LoRARef.deterministic_id(lora_name, lora_path)
    base = [rng.randrange(150_000) for _ in range(48)]
    child = base[:32] + [rng.randrange(150_000) for _ in range(16)]
    salt = "tenant-a"
    formats = ["default", "dynamo"] if has_namespaces else ["default"]
    cases = [
        ("plain", {}),
        ("salt", {"cache_salt": salt}),
        ("lora", {"extra_key": lora_id}),
        ("lora_salt", {"extra_key": lora_id, "cache_salt": salt}),
        ("user_extra_key", {"extra_key": "my-extra-key"}),
    ]
    plain_digests = sglang_pages(base, 16)
    for fmt in formats:
        for case, key_kwargs in cases:
            table_kinds = ["admitted", "adapter_only"] if (has_namespaces and case.startswith("lora")) else ["none"]
            for table_kind in table_kinds:
                cache = simulated_cache(16, dynamo=(fmt == "dynamo"), lora_names=lora_table(table_kind, lora_id, lora_name, key_kwargs.get("extra_key")))
                storage, event, stored = store(cache, base, **key_kwargs)
                storage_c, event_c, stored_c = store(cache, child, **key_kwargs)
                vector = {
                    "kind": "store",
                    "name": f"{case}_format_{fmt}" + ("" if table_kind == "none" else f"_lora_{table_kind}"),
                    "inputs": {
                        "page_size": 16,
                        "format": fmt,
                        "tokens": base,
                        "then_tokens": child,
                        "extra_key": key_kwargs.get("extra_key"),
                        "cache_salt": key_kwargs.get("cache_salt"),
                        "lora_name": lora_name if case.startswith("lora") else None,
                        "lora_path": lora_path if case.startswith("lora") else None,
                        "lora_name_table": table_kind,
                    },
                    "storage_digests_hex": storage,
                    "event_digests_hex": event,
                    "event_chain_i64": [mcu.hash_str_to_int64(d) for d in event],
                    "stored": stored,
                    "then_storage_digests_hex": storage_c,
                    "then_event_digests_hex": event_c,
                    "then_stored": stored_c,
                }
                # The rules, checked against SGLang's digests.
                if key_kwargs.get("cache_salt") is not None:
                    seed = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest()
                    assert event == own_chain([le_u32(p) for p in pages_of(base, 16)], seed)
                    vector["event_chain_seed_hex"] = seed.hex()
                    vector["event_chain_seed_rule"] = "SHA256(b'sglang-cache-salt-v1\\0' + salt utf-8)"
                else:
                    assert event == plain_digests, (case, fmt)
                if has_namespaces and (key_kwargs.get("extra_key") or key_kwargs.get("cache_salt")):
                    seed = mcu.storage_namespace_seed(key_kwargs.get("extra_key"), key_kwargs.get("cache_salt"))
                    assert storage == own_chain([le_u32(p) for p in pages_of(base, 16)], bytes.fromhex(seed))
                    vector["storage_chain_seed_hex"] = seed
                else:
                    assert storage == plain_digests
                published = [h for e in stored for h in e["block_hashes"]]
                chain = [mcu.hash_str_to_int64(d) for d in event]
                if published != chain:
                    ns_seed = kve.kv_event_namespace_seed(
                        extra_key=key_kwargs.get("extra_key") if (fmt == "dynamo" or table_kind == "admitted") else None,
                        cache_salt=key_kwargs.get("cache_salt") if fmt == "dynamo" else None,
                    )
                    assert published == [kve.namespaced_block_hash(h, namespace_seed=ns_seed) for h in chain], (case, fmt, table_kind)
                    vector["namespace_seed_hex"] = ns_seed.hex()
                vector["published_equals_event_chain"] = published == chain
                vector["published_equals_storage_chain"] = published == [mcu.hash_str_to_int64(d) for d in storage]
                vectors.append(vector)

    # EAGLE stores: the recorder publishes pairs as token ids.
    cache = simulated_cache(16, is_eagle=True)
    raw = list(range(500, 533))
    storage, event, stored = store(cache, raw)
    assert event == [p["digest_hex"] for p in vectors[[v["name"] for v in vectors].index("ps16_eagle_33_raw_tokens")]["pages"]]
    vectors.append(
        {
            "kind": "store",
            "name": "eagle_bigram_format_default",
            "inputs": {"page_size": 16, "format": "default", "raw_tokens": raw, "is_eagle": True},
            "event_digests_hex": event,
            "event_chain_i64": [mcu.hash_str_to_int64(d) for d in event],
            "stored": stored,
        }
    )

    # ---- namespace functions on their own (0.5.22+)
    if has_namespaces:
        for extra_key, cache_salt in [(lora_id, None), (None, salt), (lora_id, salt), ("", None), ("a", "bc"), ("ab", "c")]:
            seed = kve.kv_event_namespace_seed(extra_key=extra_key, cache_salt=cache_salt)
            own = hashlib.sha256(b"sglang-kv-event-namespace-v1")
            for part_ in (extra_key, cache_salt):
                own.update(b"\x00" if part_ is None else b"\x01" + len(part_.encode()).to_bytes(8, "little") + part_.encode())
            assert own.digest() == seed
            inputs = [mcu.hash_str_to_int64(d) for d in plain_digests] + [0, -1, 2**63 - 1, -(2**63)]
            vectors.append(
                {
                    "kind": "namespaced_block_hash",
                    "name": f"namespace_{extra_key!r}_{cache_salt!r}",
                    "inputs": {"extra_key": extra_key, "cache_salt": cache_salt, "block_hashes": inputs},
                    "seed_hex": seed.hex(),
                    "seed_rule": "SHA256(b'sglang-kv-event-namespace-v1' + for part in (extra_key, cache_salt): 0x00 if absent else 0x01 + len as LE u64 + utf-8)",
                    "rule": "first 8 bytes (big-endian, signed) of SHA256(seed + block_hash as 8-byte big-endian two's complement)",
                    "outputs": [kve.namespaced_block_hash(h, namespace_seed=seed) for h in inputs],
                }
            )
            sseed = mcu.storage_namespace_seed(extra_key, cache_salt)
            vectors.append(
                {
                    "kind": "storage_namespace_seed",
                    "name": f"storage_namespace_{extra_key!r}_{cache_salt!r}",
                    "inputs": {"extra_key": extra_key, "cache_salt": cache_salt},
                    "seed_hex": sseed,
                    "seed_rule": "SHA256(b'sglang-cache-namespace-v1' + same part encoding as the event namespace seed)",
                }
            )

    # ---- LoRA ids from --lora-paths
    from sglang.srt.arg_groups.lora_hook import check_lora_server_args
    from sglang.srt.server_args import ServerArgs

    specs = ["sql-adapter=/adapters/sql-adapter", "/adapters/plain-path", {"lora_name": "dict-adapter", "lora_path": "/adapters/dict"}]
    server_args = ServerArgs(model_path="dummy", lora_paths=list(specs))
    check_lora_server_args(server_args)
    refs = None
    for _source, fields in getattr(server_args, "_resolved_overrides", []) or []:
        refs = fields.get("lora_paths", refs)
    if refs is None:
        refs = server_args.lora_paths
    import uuid

    for spec, ref in zip(specs, refs):
        assert ref.lora_id == uuid.uuid5(uuid.NAMESPACE_URL, f"{ref.lora_name}\0{ref.lora_path}").hex
        vectors.append(
            {
                "kind": "lora_id",
                "name": f"lora_paths_{ref.lora_name}",
                "inputs": {"lora_paths_entry": spec},
                "lora_name": ref.lora_name,
                "lora_path": ref.lora_path,
                "lora_id": ref.lora_id,
                "rule": "uuid5(NAMESPACE_URL, lora_name + '\\0' + lora_path).hex; a request's extra_key is (its extra_key or '') + lora_id",
            }
        )

    json.dump(
        {
            "sglang": version,
            "library_versions": sglang_env.library_versions("torch", "msgspec", "pyzmq", "transformers"),
            "vectors": vectors,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    sys.exit(main())
