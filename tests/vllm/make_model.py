#!/usr/bin/env python3
"""Build the tiny model folder real vLLM serves in the real-vLLM test tier.

    <venv>/bin/python tests/vllm/make_model.py OUT_DIR

The tokenizer and the architecture come from the project's fixture
`tests/fixtures/tiny-model/` (the same folder kvroute tokenizes with in-process),
so vLLM and kvroute see identical tokenizer files. Only the weights are new:
a randomly initialised LlamaForCausalLM (hidden 128, 2 layers, 4 heads of
head_dim 32 - the smallest head size vLLM's CPU attention supports), seeded,
in bf16 safetensors. Nothing is downloaded.

Idempotent: a stamp with the fixture's digest skips the rebuild when the
fixture did not change.
"""
import hashlib
import os
import shutil
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tiny-model"
COPIED = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
]
SEED = 0
STAMP = ".kvroute-fixture-sha256"


def fixture_digest() -> str:
    digest = hashlib.sha256()
    for name in sorted(p.name for p in FIXTURE.iterdir() if p.is_file()):
        digest.update(name.encode())
        digest.update((FIXTURE / name).read_bytes())
    digest.update(f"seed={SEED}".encode())
    return digest.hexdigest()


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    wanted = fixture_digest()
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted and (out / "model.safetensors").is_file():
        print(f"model up to date in {out}")
        return 0

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig.from_pretrained(FIXTURE)
    if config.head_dim < 32:
        raise SystemExit(f"head_dim {config.head_dim}: vLLM's CPU attention needs at least 32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # The fixture's tokenizer files verbatim (save_pretrained wrote config.json).
    for name in COPIED:
        shutil.copyfile(FIXTURE / name, out / name)
    stamp.write_text(wanted + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {params} parameters and the fixture tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
