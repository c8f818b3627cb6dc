#!/usr/bin/env bash
# Records real SGLang's prompt tokens for the golden corpus (tests/fixtures/vllm-goldens/corpus.jsonl,
# shared with the vLLM goldens), for the Qwen3 and Llama 3.1 tokenizer folders, into
# tests/fixtures/sglang-goldens/ (committed). One command:
#
#   bash tests/sglang/goldens/run.sh          # ~10 min once installed
#
# 1. installs SGLang (tests/sglang/install.sh, default 0.5.23) and fetches the tokenizer folders
#    (scripts/models.sh); the tiny random-weights model per tokenizer is the vLLM goldens' one
#    (tests/vllm/goldens/make_models.py, built here when missing);
# 2. per model: starts SGLang's own server on the CPU backend (`python -m sglang.launch_server
#    --device cpu`, the tool-call parser of the model family - SGLang's counterpart of the vLLM
#    goldens' hermes parser - and request logging at level 3, which carries the prompt ids),
#    records every corpus request (record.py) and stops the server.
# Env: KVROUTE_CACHE (default ~/.cache/kvroute), SGLANG_VERSION (default 0.5.23),
#      GOLDEN_PORT (default 18571), MODELS (default "qwen3 llama3_1").
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
cd "$root"
cache=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
version=${SGLANG_VERSION:-0.5.23}
venv="$cache/sglang-venv-$version"
port=${GOLDEN_PORT:-18571}
out=tests/fixtures/sglang-goldens
models_out="$cache/golden-models"
mkdir -p "$out" "$root/target"

bash tests/sglang/install.sh "$version"
eval "$(bash scripts/models.sh)"
[ -n "${KVROUTE_MODELS:-}" ] || { echo "goldens: no tokenizer folders (scripts/models.sh)" >&2; exit 1; }
for name in ${MODELS:-qwen3 llama3_1}; do
    if [ ! -f "$models_out/$name/model.safetensors" ]; then
        "$cache/vllm-venv/bin/python" tests/vllm/goldens/make_models.py "$KVROUTE_MODELS" "$models_out"
        break
    fi
done

export PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv/torch-ext" HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 TZ=UTC PYTHONHASHSEED=0
server=
stop() { [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null; server=; }
trap stop EXIT
for name in ${MODELS:-qwen3 llama3_1}; do
    case $name in
        qwen3) parser=qwen25 ;;
        llama3_1) parser=llama3 ;;
        *) echo "goldens: no tool-call parser chosen for $name" >&2; exit 1 ;;
    esac
    log="$root/target/sglang-goldens-$name.log"
    # The pool holds the corpus's longest prompt (~29k tokens).
    "$venv/bin/python" -m sglang.launch_server --model-path "$models_out/$name" \
        --served-model-name "$name" --device cpu --host 127.0.0.1 --port "$port" \
        --max-total-tokens 70000 --tool-call-parser "$parser" \
        --log-requests --log-requests-level 3 --log-requests-format json > "$log" 2>&1 &
    server=$!
    deadline=$(( $(date +%s) + 600 ))
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        kill -0 "$server" 2>/dev/null || { tail -n 30 "$log" >&2; exit 1; }
        [ "$(date +%s)" -lt "$deadline" ] || { echo "goldens: $name did not start" >&2; exit 1; }
        sleep 2
    done
    python3 tests/sglang/goldens/record.py "http://127.0.0.1:$port" "$name" \
        tests/fixtures/vllm-goldens/corpus.jsonl "$out/$name.jsonl" "$log"
    stop
done
