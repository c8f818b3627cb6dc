# Sourced, not run: the crates the test build compiles, and anything built beside it must name
# the same ones (scripts/fuzz.sh's seed writer). Cargo resolves features per selection: the latency
# bench's dev-dependencies, or `-p` of one crate, change shared dependencies' features and
# rebuild most of the tree. The latency bench (tests/bench) is no test: the benchmark commands in
# BENCHMARKS.md build it (and .ci/run lints it).
test_selection=(--workspace --exclude kvroute-latency-bench)
