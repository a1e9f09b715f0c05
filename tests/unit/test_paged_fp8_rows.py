"""The language model's fused layers with the FP8 activation quantization fused into their norms
(`workers.models.paged._fused_layers`, `workers.models.fp8_rows.add_and_rms_norm`): where a fused qkv (after
input_layernorm) or gate_up (after post_attention_layernorm) is a per-channel FP8 weight that would quantize its rows
per token (`quantizes_for`), the norm writes them in FP8 (`workers.kernels.fp8_norm.norm_quantize`) and the projection
takes them (`quantized_linear`); nowhere else.

The CPU runs no Triton kernel, so `quantizes_for` is replaced by its decision for an H200 (`takes_quantized_rows` with
that capability: the real rule, a fake device) and `norm_quantize` by a spy around the real one (its reference here).
The numbers: the fused path's references against the unfused path's as CUDA runs it, the linear quantizing the bf16
rows per token itself (`quantize_reference`, then the same GEMM on them: what `fp8_matmul`'s ``scaled_mm`` path
computes, tests/unit/test_fp8_norm_kernels.py), bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.kernels import fp8, fp8_norm
from workers.kernels.fp8 import quantize_reference
from workers.kernels.norm import fused_add_rms_norm, rms_norm
from workers.models import fp8_rows
from workers.models.fp8 import Fp8Weight, linear
from workers.models.language import LanguageModel
from workers.models.paged import BatchLayout, PagedKVCache, fuse_layers, paged_forward
from workers.models.registry import checkpoint_family, read_spec
from workers.models.synth import generate_checkpoint

H200 = (9, 0)
PREFILL = 40  # past fp8.DECODE_ROWS: the per-token (scaled_mm / block) paths
DECODE_STEPS = 3


def load(path: Path, quantization: str | None) -> LanguageModel:
    spec = read_spec(path, quantization) if quantization else read_spec(path)
    model: LanguageModel = checkpoint_family(path).language_model(path, dtype=torch.bfloat16, spec=spec)
    return model


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def plain_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_checkpoint(tmp_path_factory.mktemp("llmnormq") / request.param, "tiny", 0, request.param)


@pytest.fixture(scope="module")
def fp8_model(plain_path: Path) -> LanguageModel:
    """``[model] quantization = "fp8"``: every decoder linear per-channel FP8, as load-time quantization makes it."""
    return load(plain_path, "fp8")


class Spy:
    """`norm_quantize` as it is, with each call's (rows, whether a residual was added) recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, *args: object) -> tuple:
        self.calls.append((x.shape[0], residual is not None))
        return fp8_norm.norm_quantize(x, residual, *args)  # type: ignore[arg-type]


def on_an_h200(weight: Fp8Weight | None, x: torch.Tensor) -> bool:
    return fp8_rows.takes_quantized_rows(weight, x.shape[0], H200)


def per_token_path(weight: Fp8Weight, rows: int) -> bool:
    """Whether `fp8.fp8_matmul` on an H200 quantizes the rows per token itself (its ``scaled_mm`` and ``block`` paths
    for a per-channel weight)."""
    n, k = weight.shape
    per_channel = weight.block[0] == 1 and weight.block[1] >= k
    return per_channel and fp8.choose_path(rows, n, k, weight.block, H200) in ("scaled_mm", "block")


def per_token_linear(
    x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The unfused FP8 linear as CUDA computes it past the decode rows: the bf16 rows quantized per token by the
    linear itself, then the GEMM on them; the model dtype's linear, and the decode rows, as they are."""
    if isinstance(weight, Fp8Weight) and per_token_path(weight, x.shape[0]):
        q, s = quantize_reference(x, x.shape[1])
        return fp8_rows.quantized_linear(fp8_rows.QuantizedRows(q, s, x.dtype), weight, bias)
    return linear(x, weight, bias)


def prefill_and_decode(model: LanguageModel) -> torch.Tensor:
    """Logits of every token of a PREFILL-token prefill, then DECODE_STEPS single-token steps, through the fused
    layers over the reference attention."""
    spec, block_size = model.spec, 16
    layers = fuse_layers(model)
    kv = PagedKVCache.for_model(model, 8, block_size)
    table = list(range(8))
    g = torch.Generator().manual_seed(5)
    steps = [(0, PREFILL)] + [(PREFILL + i, PREFILL + i + 1) for i in range(DECODE_STEPS)]
    out = []
    for start, end in steps:
        layout = BatchLayout.build([end - start], [end], [table], block_size, num_blocks=kv.num_blocks)
        embeds = torch.randn(end - start, spec.hidden_size, generator=g).bfloat16()
        positions = torch.arange(start, end).expand(3, -1)
        out.append(paged_forward(model, embeds, positions, layout, kv, logits_for=range(end - start), fused=layers))
    return torch.cat(out)


def spied_run(model: LanguageModel, patch: pytest.MonkeyPatch) -> tuple[torch.Tensor, list[tuple[int, bool]]]:
    spy = Spy()
    with patch.context() as scoped:
        scoped.setattr(fp8_rows, "quantizes_for", on_an_h200)
        scoped.setattr(fp8_rows, "norm_quantize", spy)
        logits = prefill_and_decode(model)
    return logits, spy.calls


def test_the_norms_quantize_before_every_per_channel_qkv_and_gate_up_of_the_prefill(
    fp8_model: LanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per layer two calls on the prefill's rows: input_layernorm (the first layer's without a residual add, the
    others' with it) and post_attention_layernorm (with it); none on the decode steps (the GEMV takes bf16 rows)."""
    _, calls = spied_run(fp8_model, monkeypatch)
    layers = fp8_model.spec.num_layers
    expected = [(PREFILL, False), (PREFILL, True)] + [(PREFILL, True)] * (2 * layers - 2)
    assert calls == expected


def test_fused_norm_quantization_gives_the_unfused_per_token_paths_numbers_bit_for_bit(
    fp8_model: LanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused, calls = spied_run(fp8_model, monkeypatch)
    assert calls
    with monkeypatch.context() as scoped, fp8_rows.quantized_norms(False):
        scoped.setattr(fp8_rows, "quantizes_for", on_an_h200)
        scoped.setattr(fp8_rows, "linear", per_token_linear)
        unfused = prefill_and_decode(fp8_model)
    assert torch.equal(fused, unfused)
    # (and the activation quantization is in both: the model dtype's rows give other logits)
    assert not torch.equal(fused[:PREFILL], prefill_and_decode(fp8_model)[:PREFILL])


def test_nowhere_else_the_norms_quantize(
    plain_path: Path, fp8_model: LanguageModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Switched off, or bf16 weights: the norms write their rows as before. (Block-wise weights: their decision,
    `takes_quantized_rows`, in tests/unit/test_fp8_norm_kernels.py; the tiny model's 64 columns are narrower than one
    128-column block, so its block-wise checkpoint fuses per row, and takes the per-token path rightly.)"""
    with fp8_rows.quantized_norms(False):
        assert spied_run(fp8_model, monkeypatch)[1] == []
    assert spied_run(load(plain_path, None), monkeypatch)[1] == []


def test_off_cuda_the_rows_stay_in_the_model_dtype(fp8_model: LanguageModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fake device `quantizes_for` says no on the CPU: the fused layers run as before."""
    spy = Spy()
    monkeypatch.setattr(fp8_rows, "norm_quantize", spy)
    prefill_and_decode(fp8_model)
    assert spy.calls == []


@pytest.mark.parametrize("hidden", [64, 3584, 2048])  # tiny's, Qwen2.5-VL-7B's, Qwen3-VL-2B's
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_references_of_norm_quantize_are_the_norm_then_the_quantization(hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    stream = (torch.randn(fp8.DECODE_ROWS + 5, hidden, generator=g) * 4).to(dtype)
    update = torch.randn(stream.shape, generator=g).to(dtype)
    weight = (torch.randn(hidden, generator=g) + 1).to(dtype)
    q, s, summed = fp8_norm.norm_quantize(update, stream, weight, 1e-6)
    normed, expected_sum = fused_add_rms_norm(update, stream, weight, 1e-6)
    q_ref, s_ref = quantize_reference(normed, hidden)
    assert summed is not None and torch.equal(summed, expected_sum)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s, summed = fp8_norm.norm_quantize(stream, None, weight, 1e-6)
    q_ref, s_ref = quantize_reference(rms_norm(stream, weight, 1e-6), hidden)
    assert summed is None and torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
