#!/usr/bin/env python3
"""Build the model folders real vLLM serves to record the golden prompt tokens.

    <vllm venv>/bin/python tests/vllm/goldens/make_models.py MODELS_DIR OUT_DIR

For each real tokenizer folder MODELS_DIR/<name>/ (fetched by scripts/models.sh: Qwen3,
Llama 3.1, gpt-oss), OUT_DIR/<name>/ gets that folder's tokenizer files verbatim (gpt-oss's
chat_template.jinja is the link scripts/models.sh made) plus a tiny randomly initialised
LlamaForCausalLM whose vocabulary covers the tokenizer's (hidden 128, 2 layers, head_dim 32 -
the smallest head size vLLM's CPU attention supports; tied embeddings; seeded; bf16). Only the
tokenizer matters for the prompt tokens; the architecture is Llama for all three, so vLLM
renders every chat through the template (for model_type gpt_oss it would use Harmony instead).
OUT_DIR/qwen3_parts is Qwen3's tokenizer with the test template
tests/fixtures/vllm-goldens/templates/parts.jinja (see parts_sources). Nothing is downloaded. Idempotent: a stamp with the tokenizer files' digest skips a rebuild.
"""
import hashlib
import json
import os
import sys
from pathlib import Path

SEED = 0
STAMP = ".kvroute-golden-model"
MAX_POSITIONS = 65536
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
PARTS_MODEL = "qwen3_parts"
PARTS_TEMPLATE = (Path(__file__).resolve().parents[2] / "fixtures" / "vllm-goldens" / "templates" / "parts.jinja")


def sources(src: Path) -> dict:
    """The tokenizer files of a folder: name -> path."""
    return {name: src / name for name in TOKENIZER_FILES if (src / name).exists()}


def parts_sources(models: Path, out: Path) -> dict:
    """qwen3_parts: Qwen3's tokenizer.json with the test template templates/parts.jinja (which
    iterates over content parts) instead of Qwen3's own; its tokenizer_config.json is Qwen3's
    without `chat_template` (written under OUT_DIR)."""
    config = json.loads((models / "qwen3" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    staged = out / ".staged" / PARTS_MODEL
    staged.mkdir(parents=True, exist_ok=True)
    (staged / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return {
        "tokenizer.json": models / "qwen3" / "tokenizer.json",
        "tokenizer_config.json": staged / "tokenizer_config.json",
        "chat_template.jinja": PARTS_TEMPLATE,
    }


def digest(files: dict) -> str:
    h = hashlib.sha256(f"seed={SEED} positions={MAX_POSITIONS}".encode())
    for name, path in sorted(files.items()):
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def build(files: dict, out: Path) -> None:
    wanted = digest(files)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted:
        # The folder is shared by checkouts: a link into one that moved or was removed (the
        # test template lives in the repository) is pointed at this one's file again.
        for name, source in files.items():
            target = out / name
            if target.resolve() != source.resolve():
                target.unlink(missing_ok=True)
                os.symlink(source.resolve(), target)
                print(f"{target}: relinked to {source.resolve()}")
        print(f"{out}: up to date")
        return
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(files["tokenizer.json"]))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = (vocab + 127) // 128 * 128
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        target = out / name
        if target.exists() or target.is_symlink():
            target.unlink()
        if name in files:
            # Links to the files themselves (gpt-oss's template is a link to the shared copy).
            os.symlink(files[name].resolve(), target)
    stamp.write_text(wanted + "\n")
    print(f"{out}: vocab {vocab}, {sum(p.numel() for p in model.parameters())} parameters")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    models, out = Path(sys.argv[1]), Path(sys.argv[2])
    for src in sorted(p for p in models.iterdir() if (p / "tokenizer.json").is_file()):
        build(sources(src), out / src.name)
    if (models / "qwen3" / "tokenizer.json").is_file():
        build(parts_sources(models, out), out / PARTS_MODEL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
