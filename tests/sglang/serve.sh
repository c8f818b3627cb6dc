#!/usr/bin/env bash
# Start one real SGLang server (CPU backend, tests/sglang/install.sh's venv) for the real-SGLang
# test tier, on 127.0.0.1.
#
#   serve.sh MODEL_DIR HTTP_PORT EVENTS_ENDPOINT REPLAY_PORT TOPIC [more launch_server flags]
#
# EVENTS_ENDPOINT: SGLang's PUB socket (its ZmqEventPublisher, vLLM's rule) *connects* to an
# endpoint without a wildcard (tcp://127.0.0.1:P: kvroute-index binds it, `mode: bind`) and
# *binds* one with a wildcard. The replay ROUTER is always bound by SGLang.
# Settings kvroute relies on: the zmq publisher (SGLang's default is none), page size 16 (the
# KV-event block size; SGLang's default of 1 is useless to a router), a small KV pool
# (MAX_TOTAL_TOKENS, default 4096; the tier test gives 16384), cached-token usage details
# (--enable-cache-report), Prometheus metrics (--enable-metrics).
# Env: KVROUTE_CACHE (default ~/.cache/kvroute), SGLANG_VERSION (default 0.5.23),
#      MAX_TOTAL_TOKENS, CONTEXT_LENGTH (default 2048).
set -euo pipefail
if [ $# -lt 5 ]; then
    sed -n 2,15p "$0" >&2
    exit 2
fi
model_dir=$1 http_port=$2 events_endpoint=$3 replay_port=$4 topic=$5
shift 5
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
venv="$cache/sglang-venv-${SGLANG_VERSION:-0.5.23}"

export PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv/torch-ext"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONHASHSEED=0
# Two servers share two cores: one OpenMP thread each.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
kv_events=$(printf '{"publisher": "zmq", "endpoint": "%s", "replay_endpoint": "tcp://127.0.0.1:%s", "topic": "%s"}' \
    "$events_endpoint" "$replay_port" "$topic")
exec "$venv/bin/python" -m sglang.launch_server --model-path "$model_dir" \
    --served-model-name tiny \
    --device cpu \
    --host 127.0.0.1 --port "$http_port" \
    --context-length "${CONTEXT_LENGTH:-2048}" \
    --max-total-tokens "${MAX_TOTAL_TOKENS:-4096}" \
    --page-size 16 \
    --kv-events-config "$kv_events" \
    --enable-metrics \
    --enable-cache-report \
    "$@"
