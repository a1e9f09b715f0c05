"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a per-request seed."""

from __future__ import annotations

import torch

from common.protocol import SamplingParams

GREEDY_BELOW = 1e-5


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature < GREEDY_BELOW:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def suppress(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """Logits with the given tokens made impossible (e.g. EOS before ``min_tokens``)."""
    ids = [t for t in token_ids if 0 <= t < logits.shape[-1]]
    if not ids:
        return logits
    logits = logits.clone()
    logits[ids] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a [vocab] logits row."""
    if generator is None:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
