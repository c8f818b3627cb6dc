#!/usr/bin/env bash
# The test command: installs prerequisites, then runs every test (unit, property, integration with
# real ZeroMQ sockets, gRPC and a real Envoy).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
eval "$(bash scripts/setup.sh | sed 's/^/export /')"

# The proxy-wasm module is a test input (Envoy loads it), so build it first.
cargo build --profile wasm --target wasm32-wasip1 -p kvroute-wasm-filter
target_dir="${CARGO_TARGET_DIR:-$root/target}"
export KVROUTE_WASM="$target_dir/wasm32-wasip1/wasm/kvroute_wasm_filter.wasm"

# Every Envoy config we ship must be accepted by the Envoy we test against.
for cfg in envoy/*.yaml; do
  [ -e "$cfg" ] || continue
  sed "s#WASM_FILTER_PATH#$KVROUTE_WASM#g" "$cfg" > "$target_dir/validate-$(basename "$cfg")"
  "$ENVOY_BIN" --mode validate -c "$target_dir/validate-$(basename "$cfg")" --log-level error >/dev/null \
    || { echo "envoy rejected $cfg" >&2; exit 1; }
done

# The full-stack tests (tests/src/stack.rs) run other crates' binaries from target/debug. Built
# together with the test targets: dev-dependencies add features to shared dependencies (criterion
# turns on zerocopy's `derive`), and a separate `cargo build --bins` resolved without them
# compiled most of the dependency tree twice (≈ 10 min on a fresh 2-core machine).
source "$root/scripts/test-selection.sh"
cargo build "${test_selection[@]}" --bins --tests

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run "${test_selection[@]}" --no-fail-fast "$@"
else
  cargo test "${test_selection[@]}" --no-fail-fast "$@"
fi
