#!/usr/bin/env python3
"""Fails when a workspace crate declares a dependency its code never names (dead weight).

For every member's Cargo.toml, each entry of [dependencies], [dev-dependencies] and
[build-dependencies] must be named (as `crate_name::` or `use crate_name` or `extern crate`)
somewhere in the crate's Rust files: src/, tests/, benches/, examples/, build.rs. Dependencies
only generated code or a macro names are listed in `[package.metadata.unused-deps] ignored` of
their Cargo.toml, with the reason beside them. (What `cargo machete` checks; this needs no
install.)
"""
import pathlib
import re
import sys
import tomllib

root = pathlib.Path(__file__).resolve().parent.parent
workspace = tomllib.loads((root / "Cargo.toml").read_text())
members = workspace["workspace"]["members"] + ["fuzz"]
failures = []
for member in members:
    manifest_path = root / member / "Cargo.toml"
    manifest = tomllib.loads(manifest_path.read_text())
    ignored = set(
        manifest.get("package", {}).get("metadata", {}).get("unused-deps", {}).get("ignored", [])
    )
    own_name = manifest["package"]["name"].replace("-", "_")
    sources = []
    for path in (root / member).rglob("*.rs"):
        relative = path.relative_to(root / member)
        if relative.parts[0] in ("target", "corpus", "artifacts"):
            continue
        # A nested crate (its own Cargo.toml) is checked on its own.
        if any((root / member / p / "Cargo.toml").exists() for p in relative.parents if str(p) != "."):
            continue
        sources.append(path.read_text(errors="replace"))
    text = "\n".join(sources)
    for section in ("dependencies", "dev-dependencies", "build-dependencies"):
        for name, spec in manifest.get(section, {}).items():
            crate = (spec.get("package", name) if isinstance(spec, dict) else name).replace("-", "_")
            if name in ignored or crate == own_name:
                continue
            if not re.search(rf"\b{re.escape(crate)}\s*::|\buse\s+{re.escape(crate)}\b|\bextern\s+crate\s+{re.escape(crate)}\b", text):
                failures.append(f"{member}/Cargo.toml [{section}] {name}: not named in the crate's code")
for failure in failures:
    print(f"unused-deps: {failure}", file=sys.stderr)
if failures:
    print("unused-deps: remove them, or list them in [package.metadata.unused-deps] ignored with the reason", file=sys.stderr)
    sys.exit(1)
print(f"unused-deps: every dependency of {len(members)} crates is used")
