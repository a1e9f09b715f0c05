"""The reference: transformers' own model (of the checkpoint's family: Qwen2-VL, Qwen2.5-VL) and processor on the
same checkpoint and messages."""

from __future__ import annotations

import base64
import importlib.util
import io
import urllib.request
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoTokenizer,
    CompressedTensorsConfig,
    FineGrainedFP8Config,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


def _load_url(url: str) -> Image.Image:
    if url.startswith("data:"):
        data = base64.b64decode(url.split(",", 1)[1])
    else:
        with urllib.request.urlopen(url, timeout=10) as r:
            data = r.read()
    return Image.open(io.BytesIO(data)).convert("RGB")


def fp8_dequantizing_config(model_dir: Path, device: str) -> FineGrainedFP8Config | CompressedTensorsConfig | None:
    """For an FP8 checkpoint that transformers cannot compute in FP8 here, its loader told to dequantize each FP8
    weight into the model's dtype at load (the format as transformers reads it); None otherwise. Block FP8 computes
    only on a GPU with the `kernels` package's hub kernels; compressed-tensors FP8 only on a GPU."""
    quantization = getattr(AutoConfig.from_pretrained(str(model_dir)), "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    on_cpu = not device.startswith("cuda")
    if method == "fp8" and (on_cpu or importlib.util.find_spec("kernels") is None):
        return FineGrainedFP8Config(dequantize=True)
    if method == "compressed-tensors" and on_cpu:
        return CompressedTensorsConfig(dequantize=True)
    return None


def processor_template(model_dir: Path, tokenizer: Any) -> str:
    """The template ``Qwen2VLProcessor.apply_chat_template`` renders with, found by transformers' own lookup
    of the processor's files; the tokenizer's where the processor has none."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    found = Qwen2VLProcessor.get_processor_dict(str(model_dir))[0].get("chat_template")
    if isinstance(found, dict):
        found = found.get("default")
    return found or tokenizer.chat_template


class HfChat:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        # AutoProcessor needs torchvision for its video half; images need only these two, and the
        # expansion of <|image_pad|> below is what Qwen2VLProcessor does.
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.chat_template = processor_template(model_dir, self.tokenizer)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        # The class of the checkpoint's model_type (Qwen2VL..., Qwen2_5_VL...ForConditionalGeneration).
        dequantizing = fp8_dequantizing_config(model_dir, device)
        self.fp8_dequantized = dequantizing is not None
        extra = {"quantization_config": dequantizing} if dequantizing is not None else {}
        model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype, **extra)
        self.model = model.to(device).eval()

    def inputs(self, messages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """OpenAI-style messages -> the processor's tensors (images as the processor expects them)."""
        images: list[Image.Image] = []
        converted = []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                converted.append({"role": message["role"], "content": [{"type": "text", "text": content}]})
                continue
            parts = []
            for part in content:
                if part["type"] == "image_url":
                    images.append(_load_url(part["image_url"]["url"]))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            converted.append({"role": message["role"], "content": parts})
        text = self.tokenizer.apply_chat_template(
            converted, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )
        out: dict[str, torch.Tensor] = {}
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            out = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
            merge = self.image_processor.merge_size**2
            pieces = text.split("<|image_pad|>")
            counts = [int(g.prod()) // merge for g in processed["image_grid_thw"]]
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:], strict=True))
        encoded = self.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        ids = encoded["input_ids"]
        # transformers 5 computes M-RoPE only when given these (0 text, 1 image, 2 video), as its processor does
        types = (ids == self.tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
        types += 2 * (ids == self.tokenizer.convert_tokens_to_ids("<|video_pad|>")).long()
        return {**out, "input_ids": ids, "attention_mask": encoded["attention_mask"], "mm_token_type_ids": types}

    def generate(self, messages: list[dict[str, Any]], new_tokens: int) -> tuple[list[int], int]:
        """Greedy ids of ``new_tokens`` tokens (EOS suppressed, as ``min_tokens`` does) and the prompt length."""
        inputs = self.inputs(messages)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        prompt_len = inputs["input_ids"].shape[1]
        return out[0, prompt_len:].tolist(), prompt_len
