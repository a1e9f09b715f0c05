"""The transformers baseline: the same prompts as ``benchmarks.serve`` through ``model.generate``.

    python -m benchmarks.baseline_hf --model DIR --workload seed3img --batch-sizes 1,8 \\
        --num-requests 64 --seed 0 --out hf.json [--device cuda --dtype bfloat16]

Static batches (left padding), greedy, a fixed number of new tokens per batch (the largest
``max_tokens`` in it, EOS suppressed through ``min_new_tokens``), timed per step by a streamer.
The summary uses ``serve``'s field names, so "× HF" is a division of like fields. Only the tokens
each request asked for count as output (a batch decodes to its longest request, as static
batching does; ``generated_tokens_per_s`` counts every decoded token).
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
from transformers.generation.streamers import BaseStreamer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from benchmarks import report
from benchmarks.hf_chat import processor_template
from benchmarks.serve import environment
from benchmarks.workloads import RequestSpec, WorkloadOptions, request_for

SUPPORTED = ("seed3img", "text")


class StepTimes(BaseStreamer):
    """Wall time of every ``put``: the first is the prompt, each later one a decoding step's tokens.

    ``generate`` copies each step's tokens to the host before ``put``, so on CUDA the time is taken
    after the step really finished.
    """

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _image(url: str) -> Image.Image:
    if not url.startswith("data:"):
        raise ValueError("the baseline reads only data: URLs (the workloads make nothing else)")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


class HfModel:
    """Tokenizer, image processor and model of one checkpoint; builds the processor's batched inputs."""

    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype) -> None:
        # AutoProcessor needs torchvision (for its video half); images need only these two, and the
        # <|image_pad|> expansion below is what Qwen2VLProcessor does.
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.padding_side = "left"  # generate appends on the right
        self.chat_template = processor_template(model_dir, self.tokenizer)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
        self.device = device

    def _prompt(self, messages: list[dict[str, Any]], images: list[Image.Image]) -> str:
        """The checkpoint's own chat template over the messages; images appended to ``images`` in order."""
        converted = []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            parts = []
            for part in content:
                if part["type"] == "image_url":
                    images.append(_image(part["image_url"]["url"]))
                    parts.append({"type": "image"})
                elif part["type"] == "text":
                    parts.append({"type": "text", "text": part["text"]})
                else:
                    raise ValueError(f"the baseline does not handle {part['type']!r} parts")
            converted.append({"role": message["role"], "content": parts})
        return self.tokenizer.apply_chat_template(
            converted, chat_template=self.chat_template, tokenize=False, add_generation_prompt=True
        )

    def inputs(self, specs: list[RequestSpec]) -> dict[str, torch.Tensor]:
        images: list[Image.Image] = []
        texts = [self._prompt(spec.messages, images) for spec in specs]
        out: dict[str, torch.Tensor] = {}
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            out = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
            counts = iter(int(g.prod()) // self.image_processor.merge_size**2 for g in processed["image_grid_thw"])
            texts = [_expand_image_pads(text, counts) for text in texts]
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        ids = encoded["input_ids"]
        # transformers 5 computes M-RoPE only when given these (0 text, 1 image, 2 video), as its processor does
        types = (ids == self.tokenizer.convert_tokens_to_ids("<|image_pad|>")).long()
        types += 2 * (ids == self.tokenizer.convert_tokens_to_ids("<|video_pad|>")).long()
        out.update(input_ids=ids, attention_mask=encoded["attention_mask"], mm_token_type_ids=types)
        return {k: v.to(self.device) for k, v in out.items()}

    def generate(self, inputs: dict[str, torch.Tensor], new_tokens: int) -> list[float]:
        """Greedy decoding of exactly ``new_tokens``; the times of prompt-in and of each step's tokens."""
        streamer = StepTimes()
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                streamer=streamer,
            )
        self._sync()
        # The prompt's put happens before any model work: the clock starts where we started it.
        return [start, *streamer.times[1:], time.perf_counter()]

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def _expand_image_pads(text: str, counts: Any) -> str:
    """One ``<|image_pad|>`` per merged patch of each image, in order across the batch."""
    pieces = text.split("<|image_pad|>")
    return pieces[0] + "".join("<|image_pad|>" * next(counts) + rest for rest in pieces[1:])


def run_batch(model: HfModel, specs: list[RequestSpec]) -> dict[str, Any]:
    inputs = model.inputs(specs)
    new_tokens = max(spec.max_tokens for spec in specs)
    times = model.generate(inputs, new_tokens)
    start, steps, end = times[0], times[1:-1], times[-1]
    ttft = steps[0] - start if steps else None
    return {
        "batch_size": len(specs),
        "prompt_tokens": inputs["attention_mask"].sum(dim=1).tolist(),
        "max_tokens": [spec.max_tokens for spec in specs],
        "new_tokens": new_tokens,
        "ttft_s": ttft,
        "itl_s": [b - a for a, b in itertools.pairwise(steps)],
        "e2e_s": end - start,
        "tpot_s": report.time_per_output_token(ttft, end - start, new_tokens),
    }


def summarize(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """``serve``'s summary fields over static batches: each request sees its batch's TTFT and e2e."""
    duration = sum(b["e2e_s"] for b in batches)
    output = sum(sum(b["max_tokens"]) for b in batches)
    generated = sum(b["new_tokens"] * b["batch_size"] for b in batches)
    per_request = [b for b in batches for _ in range(b["batch_size"])]
    summary: dict[str, Any] = {
        "requests": len(per_request),
        "completed": len(per_request),
        "errors": 0,
        "duration_s": duration,
        "requests_per_s": len(per_request) / duration if duration > 0 else None,
        "output_tokens_per_s": output / duration if duration > 0 else None,
        "generated_tokens_per_s": generated / duration if duration > 0 else None,
        "total_prompt_tokens": sum(sum(b["prompt_tokens"]) for b in batches),
        "total_output_tokens": output,
    }
    summary.update(report.latency_block("ttft", [b["ttft_s"] for b in per_request if b["ttft_s"] is not None]))
    summary.update(report.latency_block("tpot", [b["tpot_s"] for b in per_request if b["tpot_s"] is not None]))
    summary.update(report.latency_block("itl", [gap for b in batches for gap in b["itl_s"]]))
    summary.update(report.latency_block("e2e", [b["e2e_s"] for b in per_request]))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.baseline_hf", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face-format Qwen2-VL checkpoint directory")
    p.add_argument("--workload", choices=SUPPORTED, default="seed3img")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated static batch sizes")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("hf.json"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches first (CUDA kernels, allocator)")
    # The same workload knobs as benchmarks.serve, so the prompts are the same bytes.
    p.add_argument("--max-tokens-mean", type=int, default=None)
    p.add_argument("--max-tokens-spread", type=int, default=None)
    p.add_argument("--image-scale", type=float, default=1.0)
    p.add_argument("--small", action="store_true", help="shorthand for --image-scale 0.1")
    p.add_argument("--repeat-media", action="store_true")
    p.add_argument("--media-pool", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    args = p.parse_args(argv)
    if args.small:
        args.image_scale = 0.1
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error("--batch-sizes takes comma-separated integers, e.g. 1,8")
    if min(args.batch_sizes) < 1 or args.num_requests < 1:
        p.error("batch sizes and --num-requests must be positive")
    return args


def _dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    opts = WorkloadOptions.from_args(args)
    specs = [request_for(args.workload, opts, i) for i in range(args.num_requests)]
    dtype = _dtype(args.dtype, args.device)
    model = HfModel(args.model, args.device, dtype)
    summary: dict[str, Any] = {}
    batches: list[dict[str, Any]] = []
    for size in args.batch_sizes:
        for _ in range(args.warmup):
            run_batch(model, specs[:size])
        results = [run_batch(model, specs[i : i + size]) for i in range(0, len(specs), size)]
        for result in results:
            result["configured_batch_size"] = size
        batches += results
        summary[str(size)] = summarize(results)
        s = summary[str(size)]
        print(
            f"batch {size}: {s['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {s['p50_ttft_ms']:.1f} ms, "
            f"TPOT p50 {s['p50_tpot_ms']:.2f} ms, e2e p50 {s['p50_e2e_ms']:.0f} ms"
        )
    config = {
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "dtype": str(dtype).removeprefix("torch."),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "started_at": started_at,
        **environment(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "summary": summary, "batches": batches}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
