#!/usr/bin/env bash
# Fuzzes every decoder kvroute runs on network input (fuzz/: cargo-fuzz targets), each for a
# bounded time, and fails on the first crash. Installs cargo-fuzz at a pinned version (kept in
# ~/.cargo/bin), seeds the corpora from kvroute's own encoder and real vLLM captures (the
# project's own in tests/fixtures/vllm/, and the shared folder's when it is there).
#
#   bash scripts/fuzz.sh [seeds]   (`seeds`: write the seed corpora, then stop)
#   FUZZ_SECONDS=30 (per target)   FUZZ_TARGETS="wire_batch agent_message" (default: all)
#   FUZZ_SANITIZER=none (default) | address
#
# No sanitizer by default: the workspace forbids `unsafe`, so what fuzzing finds here is panics,
# aborts, hangs and memory blow-ups (libFuzzer's -rss_limit_mb), which need none; AddressSanitizer
# doubles the instrumented build (about 10 vs 20+ minutes from scratch on 2 loaded cores) for
# bugs safe Rust cannot have. FUZZ_SANITIZER=address for a deeper local run.
#
# The machines have stable Rust only; cargo-fuzz needs nightly `-Z` flags, which
# RUSTC_BOOTSTRAP=1 allows on stable. A crash leaves its input in fuzz/artifacts/<target>/;
# reproduce it with `RUSTC_BOOTSTRAP=1 cargo fuzz run <target> <file>` in fuzz/, then make it a
# regression test in the normal suite before fixing it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cargo_fuzz_version="0.13.2"
seconds="${FUZZ_SECONDS:-30}"
sanitizer="${FUZZ_SANITIZER:-none}"
start=$(date +%s)
elapsed() { echo "$(( $(date +%s) - start ))s"; }

# Seeds: regenerated every run (content-named files, so reruns overwrite), never committed.
# Captures: the project's own (tests/fixtures/vllm/) and, when present, the shared folder's
# (KVROUTE_SHARED, default ../shared). The seed writer is built with the test build's selection,
# so after the tests it is already there.
seeds="$root/fuzz/corpus-seeds"
# FUZZ_SEEDS_WRITTEN=1: the caller already wrote them (CI does, with `seeds`, while the test build
# is there to reuse).
if [ "${1:-}" = seeds ] || [ -z "${FUZZ_SEEDS_WRITTEN:-}" ]; then
  source "$root/scripts/test-selection.sh"
  (cd "$root" && cargo build --quiet --locked "${test_selection[@]}" --example fuzz_seeds)
  "${CARGO_TARGET_DIR:-$root/target}/debug/examples/fuzz_seeds" "$seeds"
  echo "fuzz: seeds written ($(elapsed))" >&2
fi
if [ "${1:-}" = seeds ]; then
  exit 0
fi

if [ "$(cargo fuzz --version 2>/dev/null | awk '{print $2}')" != "$cargo_fuzz_version" ]; then
  echo "fuzz: installing cargo-fuzz $cargo_fuzz_version" >&2
  cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked
  echo "fuzz: cargo-fuzz installed ($(elapsed))" >&2
fi

export RUSTC_BOOTSTRAP=1
cd "$root/fuzz"
cargo fuzz build -O --sanitizer "$sanitizer"
echo "fuzz: targets built ($(elapsed))" >&2

targets="${FUZZ_TARGETS:-$(cargo fuzz list)}"
for target in $targets; do
  corpus="corpus/$target"
  mkdir -p "$corpus"
  seed_dir="$seeds/$target"
  [ -d "$seed_dir" ] || seed_dir=""
  echo "fuzz: $target for ${seconds}s" >&2
  # -rss_limit_mb: the decoders' caps must hold memory far below this; a breach is a finding.
  cargo fuzz run -O --sanitizer "$sanitizer" "$target" "$corpus" $seed_dir -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
    2> "target/fuzz-$target.log" \
    || { tail -n 60 "target/fuzz-$target.log" >&2; echo "fuzz: $target found a crash (fuzz/artifacts/$target/)" >&2; exit 1; }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "target/fuzz-$target.log" | sed "s/^/fuzz: $target /" >&2 || true
done
echo "fuzz: every target ran ${seconds}s without a crash ($(elapsed))" >&2
