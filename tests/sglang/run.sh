#!/usr/bin/env bash
# The real-SGLang test tier, in one command (from anywhere):
#
#   bash tests/sglang/run.sh
#
# 1. installs SGLang 0.5.23 into a cached venv (tests/sglang/install.sh; it reuses the real-vLLM
#    tier's venv for torch, so that one is installed first: tests/vllm/install.sh),
# 2. builds the tiny random model from tests/fixtures/tiny-model/ (cached),
# 3. builds kvroute-index, kvroute-ext-proc and gets Envoy (scripts/setup.sh),
# 4. runs the ignored test `real_sglang::real_sglang_multi_turn_through_envoy`: two real SGLang
#    servers on the CPU backend (tests/sglang/serve.sh) behind kvroute-index, kvroute-ext-proc
#    and Envoy; multi-turn chats, judged by SGLang's own cached-token counts. The numbers are
#    printed and written to target/real-sglang/results.json.
# Env: KVROUTE_CACHE (default ~/.cache/kvroute), SGLANG_VERSION (default 0.5.23).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
export KVROUTE_VLLM_VENV=${KVROUTE_VLLM_VENV:-$cache/vllm-venv}
export KVROUTE_VLLM_MODEL=${KVROUTE_VLLM_MODEL:-$cache/vllm-tiny-model}

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
step "install vLLM (torch for SGLang) and SGLang"
bash tests/vllm/install.sh
bash tests/sglang/install.sh "${SGLANG_VERSION:-0.5.23}"
step "tiny model"
"$KVROUTE_VLLM_VENV/bin/python" tests/vllm/make_model.py "$KVROUTE_VLLM_MODEL"
step "build"
eval "$(bash scripts/setup.sh | sed 's/^/export /')"   # ENVOY_BIN, KVROUTE_PYTHON
cargo build --bin kvroute-index --bin kvroute-ext-proc
mkdir -p target/real-sglang
export KVROUTE_SGLANG_RESULTS=$root/target/real-sglang/results.json
step "test"
started=$(date +%s)
cargo nextest run --config-file "$root/tests/vllm/nextest.toml" -p kvroute-tests \
    --run-ignored only --no-capture -E 'test(real_sglang)'
echo "real-SGLang tier passed in $(( $(date +%s) - started )) s; results: $KVROUTE_SGLANG_RESULTS"
