#!/usr/bin/env bash
# Install real SGLang releases into cached venvs, one per version, for the SGLang recorders
# (tests/sglang/golden.py, record_events.py, goldens/record.py). No GPU and no server: the
# recorders import SGLang's own modules and call them.
#
#   bash tests/sglang/install.sh            # all pinned versions
#   bash tests/sglang/install.sh 0.5.23     # just one
#
# Each venv gets the `sglang` wheel from PyPI installed with --no-deps, plus only the few
# packages the recorded code paths import that the vLLM venv lacks (EXTRAS, pinned). Everything
# else - torch (2.13, which SGLang's Rust tree core accepts: 2.11-2.14), transformers, msgspec,
# pyzmq, pydantic, fastapi, jinja2, tokenizers, ... - is reused from the real-vLLM tier's venv
# (tests/vllm/install.sh, installed first) through a `.pth` file that appends its site-packages
# after the venv's own: a package installed here wins over the vLLM venv's copy. This saves
# ~6 GB per version; the price is that the versions of the shared packages are the vLLM venv's,
# not SGLang's own pins (e.g. torch 2.13.0 instead of 2.14.1, openai 3.x instead of 2.8.0).
# The recorders write the versions they ran with into their outputs.
#
# SGLang compiles its page-hash binding (mem_cache/cpp_utils/hash_binding.cpp, pybind11 +
# OpenSSL) with torch's JIT loader on first use: that needs g++, the OpenSSL headers and a
# `ninja` on PATH. tests/sglang/sglang_env.py (imported by every recorder) puts the venv's bin
# first on PATH and keeps each venv's build in its own TORCH_EXTENSIONS_DIR ($VENV/torch-ext),
# since all versions name the extension alike but their sources differ. The smoke test below
# builds it once (~15 s).
#
# Idempotent: a venv whose stamp file matches the version and EXTRAS is left alone.
# Env: KVROUTE_CACHE (default ~/.cache/kvroute; wheels in $KVROUTE_CACHE/wheels),
#      KVROUTE_VLLM_VENV (default $KVROUTE_CACHE/vllm-venv).
# Cold install: about 1 min per version (the wheel is 26-39 MB), ~150 MB per venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)

VERSIONS=${*:-"0.5.19 0.5.22 0.5.23"}
# What the recorded code paths import that the vLLM venv does not have (soundfile: the HTTP
# server, for tests/sglang/goldens/).
EXTRAS="orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 gguf==0.19.0 ninja==1.13.0 soundfile==0.13.1"
# Each release's own pins of the packages that decide tokenization and model configs (from the
# wheel's Requires-Dist): 0.5.19 cannot even import with the vLLM venv's transformers 5.19
# (it registers a `qwen3_asr` config that 5.19 already has), and transformers 5.12 wants a
# huggingface-hub below 2.
pins() {
    case $1 in
        0.5.19) echo "transformers==5.12.1 tokenizers==0.22.2 huggingface-hub==1.33.0" ;;
        *) echo "transformers==5.19.0 tokenizers==0.23.2" ;;
    esac
}
CACHE=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
export KVROUTE_VLLM_VENV=${KVROUTE_VLLM_VENV:-$CACHE/vllm-venv}

bash "$root/tests/vllm/install.sh" >/dev/null
vllm_site=$("$KVROUTE_VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$CACHE/wheels"

for version in $VERSIONS; do
    venv="$CACHE/sglang-venv-$version"
    py="$venv/bin/python"
    stamp="$venv/.kvroute-sglang"
    want="sglang==$version $EXTRAS $(pins "$version") vllm-site=$vllm_site"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "sglang $version already installed in $venv"
        continue
    fi
    started=$(date +%s)
    python3 -m venv "$venv"
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # `zz-` sorts last: the vLLM venv's packages come after everything installed here.
    echo "$vllm_site" > "$site/zz-kvroute-vllm-venv.pth"
    timeout 600 "$py" -m pip download --quiet --no-deps "sglang==$version" -d "$CACHE/wheels"
    wheel=$(ls "$CACHE"/wheels/sglang-"$version"-*.whl | head -n 1)
    # shellcheck disable=SC2086
    timeout 600 "$py" -m pip install --quiet --no-deps $EXTRAS $(pins "$version") "$wheel"
    # Smoke test: the modules the recorders drive import, and the native page hash builds and
    # answers (a one-page chain of tokens 0..15).
    PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv/torch-ext" "$py" -W ignore -c "
import sglang
from sglang.srt.disaggregation.kv_events import ZmqEventPublisher
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
h = get_hash_str(list(range(16)), None, page_size=16)
assert h[0].startswith('5d85718e'), h
print('sglang', sglang.__version__, 'smoke test OK', hash_str_to_int64(h[0]))"
    echo "$want" > "$stamp"
    echo "installed sglang $version into $venv in $(( $(date +%s) - started )) s ($(du -sh "$venv" | cut -f1))"
done
