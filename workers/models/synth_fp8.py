"""The synthetic checkpoints' FP8 variants: a generated bf16 checkpoint's linear weights rewritten in one of the two
FP8 formats the Hugging Face hub publishes (`common.quantization`), in its files and its config.json.

* ``fp8-block``: as Qwen's FP8 checkpoints (transformers' FineGrainedFP8): each 128 x 128 block of a weight gets
  ``weight_scale_inv = amax(block) / 448`` and ``weight = weight / weight_scale_inv`` in float8_e4m3fn.
* ``fp8-channel``: as llm-compressor's FP8_DYNAMIC (compressed-tensors): ``weight_scale = amax(row) / 448`` [out, 1].

The decoder layers' and the vision blocks' linear weights are quantized; embeddings, norms, lm_head, the patch
embedding and the mergers stay in the checkpoint's dtype and are named in ``modules_to_not_convert`` / ``ignore``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.quantization import BLOCK, FP8_BLOCK, FP8_CHANNEL
from workers.models.fp8 import BLOCK_SCALE, CHANNEL_SCALE, FP8, FP8_MAX, quantize_per_channel
from workers.models.weights import canonical_key

QUANTIZATIONS = (FP8_BLOCK, FP8_CHANNEL)
_KEPT = ("lm_head", "visual.merger", "visual.deepstack_merger_list")


def quantization_config(method: str) -> dict[str, Any]:
    """config.json's ``quantization_config`` as the hub's checkpoints of the format write it."""
    if method == FP8_BLOCK:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
            "modules_to_not_convert": list(_KEPT),
        }
    if method == FP8_CHANNEL:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        inputs = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "output_activations": None}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "kv_cache_scheme": None,
            "ignore": ["lm_head", "re:.*visual\\.merger.*", "re:.*visual\\.deepstack_merger_list.*"],
            "config_groups": {"group_0": group},
        }
    raise ValueError(f"unknown quantization {method!r}; expected one of {', '.join(QUANTIZATIONS)}")


def quantize_per_block(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, weight_scale_inv [ceil(out / bn), ceil(in / bk)]): amax / 448 per block (edge blocks partial)."""
    rows, cols = weight.shape
    bn, bk = block
    padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    values = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:rows, :cols]
    return values.to(FP8), scale


def is_quantized_weight(raw: str, tensor: torch.Tensor) -> bool:
    """Whether the generator quantizes checkpoint tensor ``raw``: a decoder layer's or a vision block's linear."""
    name = canonical_key(raw)
    return tensor.ndim == 2 and name.endswith(".weight") and name.startswith(("model.layers.", "visual.blocks."))


def quantize_checkpoint(root: Path, method: str) -> None:
    """Rewrite the checkpoint at ``root`` in place in FP8 format ``method`` (its files, index and config.json)."""
    config_path = root / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(method)
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8")) if index_path.is_file() else None
    for file in sorted(root.glob("*.safetensors")):
        tensors = load_file(str(file))
        out: dict[str, torch.Tensor] = {}
        for raw, tensor in tensors.items():
            if not is_quantized_weight(raw, tensor):
                out[raw] = tensor
                continue
            scale_name = raw.removesuffix("weight") + (BLOCK_SCALE if method == FP8_BLOCK else CHANNEL_SCALE)
            values, scale = quantize_per_block(tensor) if method == FP8_BLOCK else quantize_per_channel(tensor)
            out[raw], out[scale_name] = values.contiguous(), scale.contiguous()
            if index is not None:
                index["weight_map"][scale_name] = file.name
        save_file(out, str(file), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
