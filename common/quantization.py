"""Which quantized weight format a checkpoint holds, read from its ``config.json``, and what the server makes of it.

Torch-free, so that every process (the gateway and the launcher's preflight included) refuses an unsupported
``quantization_config`` at start-up the same way, by `common.model_files.check_model_files`. The weights themselves
are `workers.models.fp8`'s.

Two FP8 formats are read as the Hugging Face hub publishes them:

* ``fp8-block``: transformers' FineGrainedFP8 (Qwen's official FP8 checkpoints): ``quant_method: "fp8"``,
  ``fmt: "e4m3"``, ``activation_scheme: "dynamic"``, ``weight_block_size: [128, 128]``; each quantized linear has
  ``weight`` in float8_e4m3fn and ``weight_scale_inv`` fp32 [ceil(out / 128), ceil(in / 128)], and
  ``w = weight * weight_scale_inv`` per block (transformers/utils/quantization_config.py FineGrainedFP8Config,
  transformers/integrations/finegrained_fp8.py ``_dequantize_fp8_weight``). ``modules_to_not_convert`` stay unquantized.
* ``fp8-channel``: compressed-tensors' FP8 W8A8 (its ``FP8_DYNAMIC`` preset scheme,
  compressed_tensors/quantization/quant_scheme.py, as vLLM's CompressedTensorsW8A8Fp8 reads it):
  ``quant_method: "compressed-tensors"``, ``format: "float-quantized"``, one config group whose weights are
  ``{num_bits: 8, type: "float", strategy: "channel", symmetric: true, dynamic: false}`` and whose
  input_activations are ``{num_bits: 8, type: "float", strategy: "token", dynamic: true}``; each quantized linear has
  ``weight`` float8_e4m3fn and ``weight_scale`` fp32 [out, 1], ``w = weight * weight_scale`` per row. ``ignore``
  names the modules left unquantized (``re:`` entries are regular expressions).

``[model] quantization = "fp8"`` quantizes an unquantized checkpoint's language-model linears at load time into the
``fp8-channel`` layout (scale = amax / 448 per output row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_BLOCK = "fp8-block"
FP8_CHANNEL = "fp8-channel"
BLOCK = (128, 128)  # the one weight_block_size the block format is read with (Qwen's, DeepSeek's)
QUANTIZATION_SETTINGS = ("auto", "none", "fp8")

SUPPORTED = (
    'supported: FP8 block-wise (quant_method "fp8", fmt "e4m3", activation_scheme "dynamic", '
    "weight_block_size [128, 128]: Qwen's FP8 checkpoints) and compressed-tensors FP8 W8A8 (format "
    '"float-quantized", per-channel static weights, dynamic per-token activations), or an unquantized checkpoint'
)


class UnsupportedQuantization(ValueError):
    """The checkpoint's quantization_config is of a format the server does not load (every process stops at start-up
    with it, as with `common.model_files.UnsupportedModel`)."""


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's (or the load-time quantized model's) linear weights are stored."""

    method: str  # FP8_BLOCK or FP8_CHANNEL
    # Module names (hub layout or transformers' module layout) or ``re:`` patterns the format left unquantized.
    skip: tuple[str, ...] = ()
    in_checkpoint: bool = True  # False: quantized at load time from an unquantized checkpoint ([model] = "fp8")


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``quantization_config``: at the top level, else in ``text_config`` (where transformers looks:
    transformers/quantizers/auto.py ``get_hf_quantizer``, ``config.get_text_config(decoder=True)``)."""
    found = config.get("quantization_config")
    if found is None and isinstance(config.get("text_config"), dict):
        found = config["text_config"].get("quantization_config")
    if found is not None and not isinstance(found, dict):
        raise UnsupportedQuantization(f"quantization_config must be a JSON object, got {found!r}; {SUPPORTED}")
    return found


def checkpoint_quantization(config: dict[str, Any], where: str = "config.json") -> Quantization | None:
    """The format of a parsed config.json's weights (None: unquantized); UnsupportedQuantization naming what was
    found and what is supported otherwise."""
    found = quantization_config(config)
    if found is None:
        return None
    method = found.get("quant_method")
    if method == "fp8":
        return _block_fp8(found, where)
    if method == "compressed-tensors":
        return _compressed_tensors_fp8(found, where)
    raise UnsupportedQuantization(f"{where}: quantization_config quant_method {method!r} is not supported; {SUPPORTED}")


def serving_quantization(setting: str, config: dict[str, Any], where: str = "config.json") -> Quantization | None:
    """What ``[model] quantization`` makes of the checkpoint: "auto" its own format, "none" an unquantized checkpoint
    as it is, "fp8" an unquantized checkpoint quantized at load time. ValueError where the two disagree."""
    if setting not in QUANTIZATION_SETTINGS:
        raise ValueError(f"[model] quantization: expected 'auto', 'none' or 'fp8', got {setting!r}")
    stored = checkpoint_quantization(config, where)
    if setting == "auto" or (stored is None and setting == "none"):
        return stored
    if stored is not None:
        raise ValueError(
            f"[model] quantization = {setting!r} but {where} holds {stored.method} weights; set quantization = "
            '"auto" to serve them as they are'
        )
    return Quantization(FP8_CHANNEL, skip=("lm_head",), in_checkpoint=False)


def _refuse(where: str, what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{where}: quantization_config {what} is not supported; {SUPPORTED}")


def _block_fp8(found: dict[str, Any], where: str) -> Quantization:
    if found.get("fmt", "e4m3") != "e4m3":
        raise _refuse(where, f"fmt {found.get('fmt')!r}")
    if found.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(where, f"activation_scheme {found.get('activation_scheme')!r} (static activation scales)")
    block = found.get("weight_block_size")
    if block is None or [int(n) for n in block] != list(BLOCK):
        raise _refuse(where, f"fp8 with weight_block_size {block!r}")
    return Quantization(FP8_BLOCK, skip=tuple(str(n) for n in found.get("modules_to_not_convert") or ()))


_CHANNEL_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
_TOKEN_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def _compressed_tensors_fp8(found: dict[str, Any], where: str) -> Quantization:
    if found.get("format") != "float-quantized":
        raise _refuse(where, f"compressed-tensors format {found.get('format')!r}")
    if found.get("kv_cache_scheme"):
        raise _refuse(where, "compressed-tensors kv_cache_scheme (a quantized KV cache)")
    groups = found.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse(where, f"compressed-tensors with {len(groups)} config groups (one FP8 W8A8 group is read)")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    if any(weights.get(k) != v for k, v in _CHANNEL_WEIGHTS.items()):
        raise _refuse(where, f"compressed-tensors weights {_brief(weights, _CHANNEL_WEIGHTS)}")
    if any(inputs.get(k) != v for k, v in _TOKEN_ACTIVATIONS.items()):
        raise _refuse(where, f"compressed-tensors input_activations {_brief(inputs, _TOKEN_ACTIVATIONS)}")
    if group.get("output_activations"):
        raise _refuse(where, "compressed-tensors output_activations")
    if group.get("format") not in (None, "float-quantized"):
        raise _refuse(where, f"compressed-tensors group format {group.get('format')!r}")
    return Quantization(FP8_CHANNEL, skip=tuple(str(n) for n in found.get("ignore") or ()))


def _brief(found: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    return {k: found.get(k) for k in wanted}
