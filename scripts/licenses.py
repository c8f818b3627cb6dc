#!/usr/bin/env python3
"""Fails when a dependency's licence is not one kvroute (Apache-2.0) may ship with.

Reads `cargo metadata` of the workspace and of fuzz/ (every package, every target platform, dev
and build dependencies included) and evaluates each package's SPDX `license` expression against
ALLOWED: `OR` needs one allowed side, `AND` both, `A WITH exception` counts as `A`; the legacy
`A/B` form is read as `A OR B`. A package without an expression fails unless it is in
EXCEPTIONS with the reason. (The licence half of `cargo deny check licenses`, without an install;
the advisory half needs the RustSec database, which lives on GitHub and is unreachable here.)
"""
import json
import pathlib
import re
import subprocess
import sys

ALLOWED = {
    "0BSD",
    "Apache-2.0",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "BSL-1.0",
    "CC0-1.0",
    "CDLA-Permissive-2.0",
    "ISC",
    "MIT",
    "MIT-0",
    "NCSA",  # libFuzzer (fuzz/ only), a BSD-style permissive licence
    "Unicode-3.0",
    "Unicode-DFS-2016",
    "Unlicense",
    "Zlib",
}
# name -> why its licence is acceptable although `license` is not an SPDX expression.
EXCEPTIONS: dict[str, str] = {}

root = pathlib.Path(__file__).resolve().parent.parent


def tokens(expression: str) -> list[str]:
    expression = expression.replace("/", " OR ")
    return re.findall(r"\(|\)|[A-Za-z0-9.+-]+", expression)


def allowed(expression: str) -> bool:
    items = tokens(expression)
    position = 0

    def peek():
        return items[position] if position < len(items) else None

    def take():
        nonlocal position
        position += 1
        return items[position - 1]

    def primary() -> bool:
        token = take()
        if token == "(":
            value = disjunction()
            if take() != ")":
                raise ValueError(f"unbalanced parentheses in {expression!r}")
            return value
        if peek() == "WITH":
            take()
            take()
        return token.removesuffix("+") in ALLOWED

    def conjunction() -> bool:
        value = primary()
        while peek() == "AND":
            take()
            value = primary() and value
        return value

    def disjunction() -> bool:
        value = conjunction()
        while peek() == "OR":
            take()
            value = conjunction() or value
        return value

    value = disjunction()
    if position != len(items):
        raise ValueError(f"cannot parse {expression!r}")
    return value


def packages(manifest: pathlib.Path):
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--manifest-path", str(manifest)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    metadata = json.loads(out)
    own = set(metadata["workspace_members"])
    return [p for p in metadata["packages"] if p["id"] not in own and p.get("source")]


failures = []
seen = set()
for manifest in (root / "Cargo.toml", root / "fuzz" / "Cargo.toml"):
    for package in packages(manifest):
        key = (package["name"], package["version"])
        if key in seen:
            continue
        seen.add(key)
        expression = package.get("license")
        if not expression:
            if package["name"] not in EXCEPTIONS:
                failures.append(f"{package['name']} {package['version']}: no SPDX licence expression")
            continue
        try:
            ok = allowed(expression)
        except ValueError as error:
            failures.append(f"{package['name']} {package['version']}: {error}")
            continue
        if not ok:
            failures.append(f"{package['name']} {package['version']}: {expression}")

for failure in failures:
    print(f"licenses: {failure}", file=sys.stderr)
if failures:
    print("licenses: allow the licence in scripts/licenses.py (if it may ship) or drop the dependency", file=sys.stderr)
    sys.exit(1)
print(f"licenses: {len(seen)} third-party packages, every licence allowed")
