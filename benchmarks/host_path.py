"""The per-token host work between the decoder's step and the client's chunk, timed on this machine (no
GPU, no sockets): what the decoder pays to encode a step's tokens, what the gateway pays to decode them,
detokenize them and format a chunk. Runs anywhere; the numbers are this machine's.

    python -m benchmarks.host_path [--model DIR]   (default: the built-in demo checkpoint's tokenizer)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from common.protocol import TokenBatch, TokenDelta, decode, encode
from gateway.detokenize import IncrementalDetokenizer
from workers.models.synth import demo_checkpoint

STREAMS = 32


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def detokenize_us(tokenizer: PreTrainedTokenizerBase, text: str) -> float:
    """Microseconds a token, pushing 30 answers of 256 tokens one token at a time."""
    ids = tokenizer.encode(text)
    answers = [ids[i * 128 : i * 128 + 256] for i in range(30)]
    tokens = sum(len(a) for a in answers)

    def all_answers() -> None:
        for answer in answers:
            detok = IncrementalDetokenizer(tokenizer)
            for token in answer:
                detok.push([token])

    return per_call_us(all_answers, 3) / tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model or demo_checkpoint()))
    rng = random.Random(0)
    filler = " ".join(f"filler{rng.randrange(200_000)}" for _ in range(4000))  # what the synthetic models write
    prose = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:30_000]
    batch = TokenBatch([TokenDelta(f"chatcmpl-{i:032x}", [12345], None, 1000, 17) for i in range(STREAMS)])
    frame = encode(batch)
    chunk = {
        "id": "chatcmpl-" + "0" * 32,
        "object": "chat.completion.chunk",
        "created": 1_796_000_000,
        "model": "qwen2-vl",
        "choices": [{"index": 0, "delta": {"content": " filler123"}, "finish_reason": None, "logprobs": None}],
    }
    results = {
        "detokenize_filler_us_per_token": detokenize_us(tokenizer, filler),
        "detokenize_prose_us_per_token": detokenize_us(tokenizer, prose),
        f"encode_token_batch_{STREAMS}_us": per_call_us(lambda: encode(batch), 20_000),
        f"decode_token_batch_{STREAMS}_us": per_call_us(lambda: decode(frame), 20_000),
        "sse_chunk_json_us": per_call_us(lambda: f"data: {json.dumps(chunk)}\n\n".encode(), 100_000),
    }
    for name, value in results.items():
        print(f"{name}: {value:.2f}")


if __name__ == "__main__":
    main()
