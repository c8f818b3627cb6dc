# syntax=docker/dockerfile:1
# kvroute's binaries in one image — kvroute-ext-proc, kvroute-index, kvroute-agent, kvroute-check —
# for the Helm chart (deploy/helm/kvroute, `image.repository`), each pod choosing its binary with
# `command:`. Build and push from the repository root:
#
#   docker build -t registry.example.com/kvroute/kvroute:0.1.0 .
#   docker push registry.example.com/kvroute/kvroute:0.1.0
#
# Not built in CI: its machines reach no image registry for the base images.
# Build stage: the toolchain of rust-toolchain.toml (1.95.0); onig and mimalloc compile C, which
# the rust image's gcc does. Runtime: distroless cc (glibc and libgcc only, no shell), non-root.

FROM rust:1.95.0-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p kvroute-ext-proc -p kvroute-index -p kvroute-agent --bins \
 && mkdir /out \
 && cp target/release/kvroute-ext-proc target/release/kvroute-check \
       target/release/kvroute-index target/release/kvroute-agent /out/

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
# distroless's `nonroot` (65532), the user the chart's securityContext runs as.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kvroute-ext-proc"]
CMD ["--help"]
