"""The FP8 GEMM paths of `workers.kernels.fp8` compiled, on CUDA, at the real models' shapes, against the dequantizing
reference in fp32 (tests/unit/test_fp8_kernels.py checks the same kernels in Triton's interpreter and argues the
bounds; the GPU adds the tensor cores' accumulation). `fp8_linear` choosing each path, cuBLASLt's block-scaled path
and its probe, and a decode step through the FP8 GEMV captured in a CUDA graph.

Hopper's FP8 tensor cores accumulate a K tile's products with fewer bits than fp32 (DeepSeek-V3's report measures
about 14), which is why the scaled GEMM's accumulation term is 2**-12 of the absolute sum here rather than the
interpreter's 2**-16; the GEMV multiplies bf16 on fp32 accumulators and keeps the interpreter's bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_setup import compiled_kernels_skip_reason
from workers.kernels import fp8
from workers.kernels.fp8 import FP8, dequantize_reference, fp8_matmul_reference, quantize_reference

_SKIP_REASON = compiled_kernels_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]

CUDA = torch.device("cuda")
SHAPES = {  # (N, K): the 7B language model's projections and the vision tower's
    "7b_qkv": (4608, 3584),
    "7b_o": (3584, 3584),
    "7b_gate_up": (37888, 3584),
    "7b_down": (3584, 18944),
    "vit_qkv": (3840, 1280),
    "vit_fc2": (1280, 5120),
}
LAYOUTS = {"block128": (128, 128), "channel": None, "row128": (1, 128)}


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(rows, k, generator=g, device=CUDA).to(torch.bfloat16)


def fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device=CUDA) * 64).clamp(-448, 448).to(FP8)
    grid = (-(-n // block[0]), -(-k // block[1]))
    return w, torch.rand(grid, generator=g, device=CUDA) * 2e-3 + 1e-3


def within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (actual.float() - expected.float()).abs() - bound
    assert excess.max().item() <= 0, f"worst excess {excess.max().item():.3g} over the bound"


# (variant, block_n, block_k, num_warps, num_stages, evict_first, x_direct) beside the default (None): each GEMV
# kernel compiled
GEMV_KERNELS = {
    "default": None,
    "dot_n32_evict": ("dot", 32, 128, 4, 4, True, False),
    "sum_n32_k256": ("sum", 32, 256, 4, 3, True, False),
    "sum_n32_k256_s1_xdirect": ("sum", 32, 256, 4, 1, True, True),
    "sum_n16_k512_s1_xdirect": ("sum", 16, 512, 4, 1, True, True),
    "sum_n64_k256_w8": ("sum", 64, 256, 8, 3, True, False),
}


def gemv(
    kernel: str,
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`fp8.gemv_triton`, or the GEMV with one of GEMV_KERNELS' configs (K split as `gemv_config` splits it)."""
    from workers.kernels import fp8_gemv_triton

    if GEMV_KERNELS[kernel] is None:
        return fp8.gemv_triton(x, w, scale, block, bias)
    variant, block_n, block_k, warps, stages, evict, x_direct = GEMV_KERNELS[kernel]
    (m, k), n = x.shape, w.shape[0]
    config = fp8_gemv_triton.gemv_config(
        m, n, k, fp8_gemv_triton.sm_count(x.device), variant=variant, block_n=block_n, block_k=block_k,
        num_warps=warps, num_stages=stages, evict_first=evict, x_direct=x_direct,
    )  # fmt: skip
    out, launch = fp8_gemv_triton.plan_weight_gemv(x, w, scale, (block[0], min(block[1], k)), bias, config=config)
    launch()
    return out


@pytest.mark.parametrize(
    ("kernel", "rows"),
    [(name, rows) for name in GEMV_KERNELS for rows in (1, 7, 16, 40, 64) if "sum" not in name or rows <= 8],
)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemv_matches_the_dequantizing_reference(kernel: str, rows: int, shape: str, layout: str) -> None:
    from workers.kernels import fp8_gemv_triton

    n, k = SHAPES[shape]
    block = LAYOUTS[layout] or (1, k)
    x = activations(rows, k, seed=rows)
    w, scale = fp8_weight(n, k, block, seed=n)
    bias = torch.randn(n, device=CUDA).to(torch.bfloat16)
    out = gemv(kernel, x, w, scale, block, bias)
    torch.cuda.synchronize()
    assert not fp8_gemv_triton.arrival_counters(x.device).any(), "an arrival counter left set"
    ref = fp8_matmul_reference(x.float(), w, scale, block, bias)
    w_deq = dequantize_reference(w, scale, block)
    within(out, ref, 2**-8 * ref.abs() + 2**-16 * (x.float().abs() @ w_deq.abs().T))


@pytest.mark.parametrize("rows", [17, 2048])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("layout", "path"), [("block128", "block"), ("row128", "block"), ("channel", "scaled_mm")])
def test_quantized_paths_match_the_reference_on_their_activations(
    rows: int, shape: str, layout: str, path: str
) -> None:
    n, k = SHAPES[shape]
    block = LAYOUTS[layout] or (1, k)
    group = k if layout == "channel" else 128
    x = activations(rows, k, seed=rows + n)
    w, scale = fp8_weight(n, k, block, seed=k)
    bias = torch.randn(n, device=CUDA).to(torch.bfloat16)
    out = fp8._PATHS[path](x, w, scale, block, bias)

    q, s = fp8.quantize_triton(x, group)
    q_ref, s_ref = quantize_reference(x, group)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    x_deq = dequantize_reference(q_ref, s_ref, (1, group))
    ref = fp8_matmul_reference(x_deq, w, scale, block, bias)
    w_deq = dequantize_reference(w, scale, block)
    # _scaled_mm's product is rounded to bf16 before the bias is added: a second rounding, of the product's size.
    product = (ref - bias.float()).abs()
    within(out, ref, 2**-8 * (ref.abs() + product) + 2**-12 * (x_deq.abs() @ w_deq.abs().T))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_linear_chooses_the_path_by_rows_and_layout(layout: str) -> None:
    from workers.models.fp8 import Fp8Weight, fp8_linear

    n, k = SHAPES["7b_qkv"]
    block = LAYOUTS[layout] or (1, k)
    w, scale = fp8_weight(n, k, block, seed=3)
    weight = Fp8Weight(w, scale, block)
    blockwise = fp8.blockwise_support(CUDA) is not None
    prefill = {"channel": "scaled_mm", "block128": "scaled_mm_blockwise" if blockwise else "block", "row128": "block"}
    last = fp8.DECODE_ROWS  # (the GEMV takes up to it; the GEMMs take larger batches)
    for rows, path in {1: "gemv", last: "gemv", last + 1: prefill[layout], 512: prefill[layout]}.items():
        x = activations(rows, k, seed=rows)
        assert fp8.choose_path(rows, n, k, block, torch.cuda.get_device_capability(), blockwise) == path
        # The kernels are deterministic: the chosen path's own output, bit for bit.
        assert torch.equal(fp8_linear(x.view(1, rows, k), weight), fp8._PATHS[path](x, w, scale, block, None)[None])


def test_a_decode_step_through_the_fp8_gemv_replays_in_a_cuda_graph() -> None:
    """Two FP8 layers (gate_up, down of the 7B MLP) with the activation between them, captured once and replayed on
    new inputs: the replay equals the eager run."""
    from workers.models.fp8 import Fp8Weight, fp8_linear

    hidden, inter = 3584, 18944
    gate_up = Fp8Weight(*fp8_weight(2 * inter, hidden, (128, 128), seed=1), (128, 128))
    down = Fp8Weight(*fp8_weight(hidden, inter, (128, 128), seed=2), (128, 128))

    def step(x: torch.Tensor) -> torch.Tensor:
        g, u = fp8_linear(x, gate_up).chunk(2, dim=-1)
        return fp8_linear(torch.nn.functional.silu(g) * u * 1e-3, down)

    static_x = activations(4, hidden, seed=9)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(static_x)  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in (10, 11):
        static_x.copy_(activations(4, hidden, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, step(static_x))


# --- cuBLASLt's block-scaled GEMM ------------------------------------------------------------------------------------


def blockwise_call() -> fp8.BlockwiseCall:
    call = fp8.blockwise_support(CUDA)
    if call is None:
        pytest.skip(
            "this torch's cuBLASLt block-scaled GEMM failed its probe on this GPU: the Triton block path serves ("
            + "; ".join(fp8.PROBE_FAILURES.get(torch.cuda.current_device(), []))
            + ")"
        )
    return call


@pytest.mark.parametrize("rows", [17, 2048])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_blockwise_path_matches_the_reference_on_its_activations(rows: int, shape: str) -> None:
    """The bound of `test_quantized_paths_match_the_reference_on_their_activations`, and the activations quantized
    bit for bit as the reference does, their scales in cuBLASLt's column-major layout."""
    call = blockwise_call()
    n, k = SHAPES[shape]
    x = activations(rows, k, seed=rows + n)
    w, scale = fp8_weight(n, k, (128, 128), seed=k)
    bias = torch.randn(n, device=CUDA).to(torch.bfloat16)
    out = fp8.scaled_mm_blockwise(x, w, scale, (128, 128), bias)
    assert torch.equal(out, fp8.blockwise_mm(x, w, scale, bias, call))

    q, s = fp8.quantize_triton(x, 128, "column-major")
    q_ref, s_ref = quantize_reference(x, 128)
    assert (
        s.stride() == (1, rows) and torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    )
    x_deq = dequantize_reference(q_ref, s_ref, (1, 128))
    ref = fp8_matmul_reference(x_deq, w, scale, (128, 128), bias)
    w_deq = dequantize_reference(w, scale, (128, 128))
    product = (ref - bias.float()).abs()
    within(out, ref, 2**-8 * (ref.abs() + product) + 2**-12 * (x_deq.abs() @ w_deq.abs().T))


def test_fp8_matmul_takes_the_blockwise_path_once_probed_and_the_answer_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    call = blockwise_call()
    assert fp8.blockwise_support(CUDA) is call  # remembered, not probed again
    n, k = SHAPES["7b_gate_up"]
    x = activations(300, k, seed=5)
    w, scale = fp8_weight(n, k, (128, 128), seed=6)
    assert torch.equal(fp8.fp8_matmul(x, w, scale, (128, 128)), fp8.blockwise_mm(x, w, scale, None, call))
    # The remembered answer is what fp8_matmul reads: recorded as "none", the Triton block path serves.
    monkeypatch.setitem(fp8._BLOCKWISE, torch.cuda.current_device(), None)
    assert torch.equal(fp8.fp8_matmul(x, w, scale, (128, 128)), fp8.block_triton(x, w, scale, (128, 128), None))


def _raise(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("block-wise scaling is not supported here (a stand-in for a torch without the recipe)")


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_a_failed_probe_falls_back_to_the_triton_block_path_without_an_error(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """torch's block-scaled calls raising (a torch without the recipe), or answering wrongly (scales read in another
    layout): the probe answers None, and fp8_matmul serves 128 x 128 blocks through the Triton block GEMM."""

    def wrong(*args: object, **kwargs: object) -> torch.Tensor:
        a, b = args[0], args[1]
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device) + 1

    stand_in = _raise if failure == "raises" else wrong
    monkeypatch.setattr(torch, "_scaled_mm", stand_in)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", stand_in)
    monkeypatch.setattr(fp8, "_BLOCKWISE", {})
    assert fp8.probe_blockwise(CUDA) is None
    n, k = SHAPES["7b_qkv"]
    x = activations(fp8.DECODE_ROWS + 36, k, seed=7)  # past the GEMV: the block paths ask for the probe
    w, scale = fp8_weight(n, k, (128, 128), seed=8)
    out = fp8.fp8_matmul(x, w, scale, (128, 128))
    assert {torch.cuda.current_device(): None} == fp8._BLOCKWISE
    assert torch.equal(out, fp8.block_triton(x, w, scale, (128, 128), None))
