"""A vLLM-style KV-event publisher on pyzmq (libzmq), for interoperability tests.

It follows vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py): PUB binds if the endpoint
has `*` or `::` or is ipc/inproc, else connects (`--force-bind` binds anyway, for loopback tests);
live messages are [topic, seq (8 bytes big-endian), payload] with seq from 0; the last
`--buffer-steps` batches are kept; the ROUTER replay socket is always bound and is polled once per
loop iteration, as vLLM's publisher thread does, answering [identity, b"", start_seq] with every
buffered batch seq >= start_seq then an end marker (0.26+ layout, or `--legacy-replay` for 0.9-0.25).

Driven over stdin, one command per line; answers one line on stdout per command:
  pub <payload hex>        publish                     -> "seq <n>"
  skip <payload hex>       buffer for replay, no send  -> "seq <n>"
  restart                  seq back to 0, buffer empty -> "ok"
  raw <hex>,<hex>,...      send arbitrary frames       -> "ok"
  quit
The first line printed is "ready pub=<bound endpoint or -> replay=<bound endpoint or ->".
"""

import argparse
import itertools
import queue
import sys
import threading
from collections import deque

import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def endpoint_binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay-endpoint")
    parser.add_argument("--topic", default="")
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    parser.add_argument("--legacy-replay", action="store_true")
    parser.add_argument("--force-bind", action="store_true")
    args = parser.parse_args()

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    pub_bound = "-"
    if args.force_bind or endpoint_binds(args.endpoint):
        pub.bind(args.endpoint)
        pub_bound = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    else:
        pub.connect(args.endpoint)

    replay = None
    replay_bound = "-"
    if args.replay_endpoint:
        replay = ctx.socket(zmq.ROUTER)
        replay.bind(args.replay_endpoint)
        replay_bound = replay.getsockopt(zmq.LAST_ENDPOINT).decode()

    topic = args.topic.encode()
    buffer = deque(maxlen=args.buffer_steps)
    counter = itertools.count()

    commands: "queue.Queue[str]" = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("quit")

    threading.Thread(target=read_stdin, daemon=True).start()
    print(f"ready pub={pub_bound} replay={replay_bound}", flush=True)

    def service_replay() -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return
        identity, delimiter, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= start_seq:
                seq_bytes = seq.to_bytes(8, "big")
                if args.legacy_replay:
                    replay.send_multipart((identity, b"", seq_bytes, payload))
                else:
                    replay.send_multipart((identity, b"", topic, seq_bytes, payload))
        if args.legacy_replay:
            replay.send_multipart((identity, b"", END_SEQ, b""))
        else:
            replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    while True:
        if replay is not None and replay.poll(0):
            service_replay()
        try:
            command = commands.get(timeout=0.1)
        except queue.Empty:
            continue
        verb, _, arg = command.partition(" ")
        if verb == "quit":
            break
        if verb in ("pub", "skip"):
            payload = bytes.fromhex(arg)
            seq = next(counter)
            if verb == "pub":
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            buffer.append((seq, payload))
            print(f"seq {seq}", flush=True)
        elif verb == "restart":
            counter = itertools.count()
            buffer.clear()
            print("ok", flush=True)
        elif verb == "raw":
            pub.send_multipart([bytes.fromhex(h) for h in arg.split(",")])
            print("ok", flush=True)
        else:
            print(f"error unknown command {verb!r}", flush=True)

    pub.close(linger=0)
    if replay is not None:
        replay.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
