"""`workers.kernels.fp8_bias`: the probe that decides whether ``torch._scaled_mm`` adds a per-channel GEMM's bias in
its epilogue. Run on the CPU's ``_scaled_mm`` (torch's CPU build has one), and against answers that are wrong in the
ways a backend could be: the bias left out, added after a rounding of the product, or refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.kernels import fp8_bias

CPU = torch.device("cpu")


def test_this_torchs_fused_bias_passes_its_probe_on_the_cpu() -> None:
    assert fp8_bias.probe_mismatch(CPU) is None


def test_a_left_out_bias_fails_the_probe() -> None:
    def without_bias(*args: Any, bias: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch._scaled_mm(*args, **kwargs)

    mismatch = fp8_bias.probe_mismatch(CPU, without_bias)
    assert mismatch is not None and "outputs off" in mismatch


def test_a_bias_added_in_bf16_after_a_coarse_rounding_fails_the_probe() -> None:
    def rounded_twice(*args: Any, bias: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        product = torch._scaled_mm(*args, **kwargs)
        return (product.to(torch.float8_e4m3fn).to(torch.bfloat16) + bias).to(torch.bfloat16)  # (8-bit rounding)

    assert fp8_bias.probe_mismatch(CPU, rounded_twice) is not None


def test_a_refused_bias_fails_the_probe_with_the_reason() -> None:
    def refuses(*args: Any, bias: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("Bias is not supported with row-wise scaling\nmore")

    assert fp8_bias.probe_mismatch(CPU, refuses) == "raised RuntimeError: Bias is not supported with row-wise scaling"


@pytest.mark.parametrize("with_bias", [True, False])
def test_rowwise_mm_equals_the_product_plus_the_bias_added_afterwards(with_bias: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x_q = (torch.randn(32, 128, generator=g) * 32).to(torch.float8_e4m3fn)
    w = (torch.randn(64, 128, generator=g) * 32).to(torch.float8_e4m3fn)
    x_s, w_s = torch.rand(32, 1, generator=g) * 1e-2, torch.rand(64, generator=g) * 1e-2
    bias = torch.randn(64, generator=g).to(torch.bfloat16) if with_bias else None
    out = fp8_bias.rowwise_mm(x_q, x_s, w, w_s, bias, torch.bfloat16)
    product = (x_q.float() * x_s) @ (w.float() * w_s.view(-1, 1)).T
    ref = product + (bias.float() if bias is not None else 0.0)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 64)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=2**-7)
