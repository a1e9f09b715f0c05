"""How far FP8 rounding alone moves a checkpoint's next-token distributions, under transformers: the yardstick for
an FP8 server's distance to bf16 (a random-weight synthetic checkpoint has nearly flat distributions, so FP8 can
reorder its near-ties where a real model's answers would not move).

``python -m benchmarks.fp8_noise --model DIR [--activations] [--device cuda] [--out FILE]``: the language model's
q/k/v/o/gate/up/down weights rounded to FP8 per 128 x 128 block (Qwen's hub format) and dequantized, and with
``--activations`` their inputs rounded per 1 x 128 group as the block path does; then, per prompt, the first token's
agreement, KL(bf16 || FP8) and the largest log-probability change over bf16's top 20.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from workers.kernels.fp8 import dequantize_reference, quantize_reference
from workers.models.synth_fp8 import quantize_per_block

PROMPTS = [
    "Describe the weather in Paris in spring.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "List three uses of copper.",
    "Explain why the sky is blue.",
    "Translate 'good morning' to French.",
    "Name a famous painting.",
    "Summarise the plot of Hamlet in one line.",
]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def language_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [
        module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LINEARS and "visual" not in name
    ]


def last_logprobs(model: torch.nn.Module, tokenizer: Any, device: str) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            logits = model(input_ids=ids.to(device)).logits[0, -1].float()
            out.append(torch.log_softmax(logits, -1).cpu())
    return out


def round_weights(linears: list[torch.nn.Linear]) -> None:
    for module in linears:
        data, scale = quantize_per_block(module.weight.data.float())
        # (quantize_per_block answers on the CPU, as the synthetic generator uses it)
        weight = dequantize_reference(data, scale, (128, 128))
        module.weight.data = weight.to(device=module.weight.device, dtype=module.weight.dtype)


def round_inputs(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = args[0]
    data, scale = quantize_reference(x.reshape(-1, x.shape[-1]).float(), 128)
    return (dequantize_reference(data, scale, (1, 128)).to(x.dtype).view_as(x),)


def compare(bf16: torch.Tensor, fp8: torch.Tensor) -> dict[str, float | bool]:
    top = bf16.topk(20)
    return {
        "same_first_token": bf16.argmax().item() == fp8.argmax().item(),
        "bf16_top2_margin": (top.values[0] - top.values[1]).item(),
        "kl": torch.sum(bf16.exp() * (bf16 - fp8)).item(),
        "max_logprob_change_top20": (bf16 - fp8)[top.indices].abs().max().item(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a bf16 checkpoint")
    parser.add_argument("--activations", action="store_true", help="round the linear maps' inputs too")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.bfloat16).to(args.device).eval()
    bf16 = last_logprobs(model, tokenizer, args.device)
    linears = language_linears(model)
    round_weights(linears)
    if args.activations:
        for module in linears:
            module.register_forward_pre_hook(round_inputs)
    rows = [compare(a, b) for a, b in zip(bf16, last_logprobs(model, tokenizer, args.device), strict=True)]
    for i, row in enumerate(rows):
        print(
            f"prompt {i}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    agree = sum(bool(row["same_first_token"]) for row in rows)
    print(f"first-token agreement {agree}/{len(rows)}; {len(linears)} linear maps rounded")
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model), "activations": args.activations, "rows": rows}))


if __name__ == "__main__":
    main()
