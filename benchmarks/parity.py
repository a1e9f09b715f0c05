"""Greedy answers of a running server, recorded and compared between two deployments of one checkpoint.

    python -m benchmarks.parity record --url http://127.0.0.1:8000 --out tp1.json
    python -m benchmarks.parity reference --model DIR --out hf.json     # transformers, bf16 on CUDA
    python -m benchmarks.parity compare tp1.json tp2.json [--tolerance 0.1] [--out verdict.json]

``record`` sends fixed prompts (text of the ``text`` workload, and 3-image requests of ``seed3img`` at half
scale) with temperature 0 and the top-2 logprobs of every token; ``reference`` has transformers answer
the same prompts (greedy, its raw logits' log-softmax for the logprobs). ``compare`` says, per prompt, where the
two answers part and why that is (or is not) within bf16 tolerance: on the common prefix every chosen
token's logprob must agree within ``--tolerance`` nats, and the answers may part only at a near tie (the
reference's top-2 margin there within twice the tolerance), where a different reduction order legitimately
flips the argmax. Exit status 1 when a prompt is out of tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.workloads import WorkloadOptions, seed3img_request, text_request

TEXT_PROMPTS, IMAGE_PROMPTS, MAX_TOKENS = 6, 2, 32


def prompts() -> list[list[dict[str, Any]]]:
    opts = WorkloadOptions(seed=7, image_scale=0.5, prompt_tokens=300)
    texts = [text_request(opts, i).messages for i in range(TEXT_PROMPTS)]
    return texts + [seed3img_request(opts, i).messages for i in range(IMAGE_PROMPTS)]


def ask(url: str, model: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer's tokens: each chosen token, its logprob and the runner-up's."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.load(response)
    return [
        {"token": e["token"], "logprob": e["logprob"], "top": [[t["token"], t["logprob"]] for t in e["top_logprobs"]]}
        for e in answer["choices"][0]["logprobs"]["content"]
    ]


def record(url: str, out: Path) -> None:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    answers = [ask(url, model, messages) for messages in prompts()]
    out.write_text(json.dumps({"url": url, "model": model, "answers": answers}))
    print(f"recorded {len(answers)} answers of {model} at {url} into {out}")


def reference(model_dir: Path, out: Path, device: str) -> None:
    import torch

    from benchmarks.hf_chat import HfChat

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    hf = HfChat(model_dir, dtype=dtype, device=device)
    answers = []
    for messages in prompts():
        inputs = {k: v.to(device) for k, v in hf.inputs(messages).items()}
        with torch.inference_mode():
            generated = hf.model.generate(
                **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        answer = []
        for logits in generated.logits:  # one [1, vocab] per new token, before any logits processor
            logprobs = torch.log_softmax(logits[0].float(), dim=-1)
            top = torch.topk(logprobs, 2)
            token = int(top.indices[0])
            pairs = [[hf.tokenizer.decode([int(t)]), float(lp)] for t, lp in zip(top.indices, top.values, strict=True)]
            answer.append({"token": hf.tokenizer.decode([token]), "logprob": float(logprobs[token]), "top": pairs})
        answers.append(answer)
    described = f"transformers {dtype} on {device}" + (", FP8 weights dequantized at load" * hf.fp8_dequantized)
    out.write_text(json.dumps({"model": str(model_dir), "reference": described, "answers": answers}))
    print(f"recorded transformers' {len(answers)} answers ({described}) into {out}")


def compare_answer(ref: list[dict[str, Any]], other: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """Where two answers part, the largest logprob gap before that, and whether both are within tolerance."""
    parted = next((i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a["token"] != b["token"]), None)
    common = ref[:parted] if parted is not None else ref
    worst = max((abs(a["logprob"] - b["logprob"]) for a, b in zip(common, other, strict=False)), default=0.0)
    margin = None
    if parted is not None:
        top = ref[parted]["top"]
        margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
    ok = worst <= tolerance and (margin is None or margin <= 2 * tolerance)
    return {"identical": parted is None, "parted_at": parted, "tie_margin": margin, "max_logprob_gap": worst, "ok": ok}


def compare(ref_path: Path, other_path: Path, tolerance: float, out: Path | None = None) -> bool:
    """Prints each prompt's verdict (and writes them to ``out``); True when every one is within tolerance."""
    ref, other = (json.loads(p.read_text())["answers"] for p in (ref_path, other_path))
    if len(ref) != len(other):
        raise SystemExit(f"{ref_path} has {len(ref)} answers and {other_path} {len(other)}: not the same prompts")
    results = [compare_answer(a, b, tolerance) for a, b in zip(ref, other, strict=True)]
    for i, r in enumerate(results):
        kind = "text" if i < TEXT_PROMPTS else "3 images"
        where = (
            "identical" if r["identical"] else f"part at token {r['parted_at']} (top-2 margin {r['tie_margin']:.4f})"
        )
        print(f"prompt {i} ({kind}): {where}, max logprob gap before {r['max_logprob_gap']:.4f}, ok {r['ok']}")
    same = sum(r["identical"] for r in results)
    ok = all(r["ok"] for r in results)
    worst = max(r["max_logprob_gap"] for r in results)
    if out is not None:
        verdict = {"reference": str(ref_path), "other": str(other_path), "tolerance": tolerance, "ok": ok}
        out.write_text(json.dumps({**verdict, "max_logprob_gap": worst, "prompts": results}, indent=1) + "\n")
    print(
        f"{same}/{len(results)} answers identical; largest logprob gap {worst:.4f}; "
        f"all within tolerance {tolerance}: {ok}"
    )
    return ok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    rec = verbs.add_parser("record")
    rec.add_argument("--url", default="http://127.0.0.1:8000")
    rec.add_argument("--out", type=Path, required=True)
    ref = verbs.add_parser("reference")
    ref.add_argument("--model", type=Path, required=True)
    ref.add_argument("--out", type=Path, required=True)
    ref.add_argument("--device", default="cuda")
    cmp = verbs.add_parser("compare")
    cmp.add_argument("reference", type=Path)
    cmp.add_argument("other", type=Path)
    cmp.add_argument("--tolerance", type=float, default=0.1, help="nats (bf16 logits: a few hundredths)")
    cmp.add_argument("--out", type=Path, help="the verdicts as JSON")
    args = parser.parse_args(argv)
    if args.verb == "record":
        record(args.url, args.out)
    elif args.verb == "reference":
        reference(args.model, args.out, args.device)
    elif not compare(args.reference, args.other, args.tolerance, args.out):
        sys.exit(1)


if __name__ == "__main__":
    main()
