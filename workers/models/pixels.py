"""Pixel values from the fetcher's uint8 patches: transformers' rescale and normalize, as parameters and as
the step the encoder runs on its device.

The fetcher reads the parameters from the checkpoint's preprocessor config and ships uint8 patches with them;
the encoder applies them. Both processes take this from the models' layer, below them both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normalization:
    """transformers' ``rescale`` then ``normalize`` as parameters (None: that step is off)."""

    rescale_factor: float | None
    mean: tuple[float, ...] | None  # per channel
    std: tuple[float, ...] | None


def normalize_patches(patches: torch.Tensor, norm: Normalization) -> torch.Tensor:
    """float32 pixel values from uint8 patches [N, channels * temporal * patch * patch], on their device.

    The operations and dtypes of the fetcher's host-side `_rescale_and_normalize` (a float64 product rounded
    once to float32, then float32 subtraction and division): IEEE arithmetic on CPU and CUDA alike, so the
    result is bit-identical to the host's. A patch row's columns are laid out channel-major, so column c
    belongs to channel ``c // (columns / channels)``.
    """
    values = patches
    if norm.rescale_factor is not None:
        values = (values.to(torch.float64) * norm.rescale_factor).to(torch.float32)
    values = values.to(torch.float32)
    if norm.mean is not None and norm.std is not None:
        per_channel = values.shape[1] // len(norm.mean)
        mean = torch.tensor(norm.mean, dtype=torch.float32).repeat_interleave(per_channel).to(values.device)
        std = torch.tensor(norm.std, dtype=torch.float32).repeat_interleave(per_channel).to(values.device)
        values = (values - mean) / std
    return values
