"""FP8 GEMMs on the GPU: ``y = x @ w.T + bias`` for a weight w [N, K] stored as float8_e4m3fn values with fp32 scales
``w_scale[n // block_n, k // block_k]`` (`workers.models.fp8.Fp8Weight`'s definition), x in bf16.

Four paths, chosen by `choose_path` from the number of rows and the weight's scale layout:

* ``gemv`` (decode, up to `DECODE_ROWS` rows): a Triton kernel reads the FP8 weights once and multiplies the bf16
  activations as they are, the weight tiles widened and scaled in registers. Decode reads every weight each step,
  so it gains by the halved bytes; quantizing activations first would add a kernel and gain nothing.
* ``scaled_mm`` (per-channel weights, one scale per output row): activations quantized per token by a Triton kernel,
  then ``torch._scaled_mm`` (cuBLASLt's FP8 GEMM) with the row and column scales.
* ``scaled_mm_blockwise`` (128 x 128 block weights, where the device's torch passed `blockwise_support`'s probe):
  activations quantized per 1 x 128 group, the scales written column-major, then cuBLASLt's block-scaled FP8 GEMM
  (1 x 128 activation scales, 128 x 128 weight scales) through torch. Whether a torch build wires that recipe up for
  a GPU is known only by calling it, so the first such product on each device tries it on a small GEMM against the
  dequantizing reference and remembers the answer.
* ``block`` (block-wise weights where cuBLASLt's recipe is not there, and fused projections kept per row in 128-wide
  K blocks): activations quantized per 1 x 128 group, then the Triton block-scaled GEMM, which scales each K tile's
  fp32 product by the activation's and the weight's scales for that tile.

Every function here takes the weight as tensors (data, scale, block): this layer sits below `workers.models`.
``name_reference`` functions are the same arithmetic in torch, which tests check the kernels against.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from workers.kernels import fp8_bias
from workers.kernels._launch import use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # activation scale group of the block path: the weight's K block
# Up to this many rows the GEMV's weight streaming beats quantizing activations for a GEMM; past it the dot kernel's
# x tile outweighs the weight tile and cuBLASLt's FP8 GEMM wins (the H200 sweep, docs/performance.md).
DECODE_ROWS = 32
MIN_SCALE_AMAX = 1e-10  # as the kernel's: a row of zeros quantizes to zeros
BLOCKWISE = (128, 128)  # the weight blocks cuBLASLt's block-scaled recipe takes (DeepSeek's and Qwen's layout)

log = logging.getLogger(__name__)


# --- references -----------------------------------------------------------------------------------------------------


def quantize_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales [M, ceil(K / group)]) of x [M, K]: per group of ``group`` columns, ``scale = amax / 448`` and
    ``q = x * (1 / scale)`` rounded to e4m3. ``group = K``: per token. A product with the reciprocal, not a quotient,
    as vLLM's `scaled_fp8_quant_kernel` does: an IEEE division per element made the kernels compute-bound on the
    H200 (`benchmarks/results/2026-12-02-h200-fp8-quantize-kernels-a967776`)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    tiles = padded.view(rows, groups, group)
    amax = tiles.abs().amax(-1).clamp_min(MIN_SCALE_AMAX)
    # Tensor operands: CUDA torch divides by a Python number as a product with its reciprocal, an ulp off the
    # IEEE quotients (div_rn) that the kernels compute.
    scale = amax / torch.full_like(amax, FP8_MAX)
    inverse = torch.ones_like(scale) / scale
    q = (tiles * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows, -1)[:, :cols].contiguous(), scale


def expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A scale grid spread to one scale per element of a [rows, cols] tensor."""
    rows, cols = shape
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_reference(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data[i, j] * scale[i // block_n, j // block_k]`` in fp32."""
    return data.float() * expand_scale(scale, block, data.shape)


def fp8_matmul_reference(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ w.T + bias`` in fp32 on the exactly dequantized weight, rounded once to x's dtype."""
    out = x.float() @ dequantize_reference(w, w_scale, block).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


# --- dispatch -------------------------------------------------------------------------------------------------------


def choose_path(
    rows: int, n: int, k: int, block: tuple[int, int], capability: tuple[int, int], blockwise: bool = False
) -> str:
    """``gemv``, ``scaled_mm``, ``scaled_mm_blockwise``, ``block`` or ``dequantize`` (a layout no kernel takes) for a
    [rows, k] x [n, k] product with the weight's scale ``block`` on a GPU of compute ``capability``; ``blockwise``:
    the device's torch passed `blockwise_support`'s probe."""
    per_channel = block[0] == 1 and block[1] >= k
    if not (per_channel or block[1] % GROUP == 0):
        return "dequantize"
    if rows <= DECODE_ROWS:
        return "gemv"
    if per_channel and capability >= (8, 9) and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    if blockwise and tuple(block) == BLOCKWISE and capability >= (9, 0) and n % 16 == 0 and k % GROUP == 0:
        return "scaled_mm_blockwise"
    return "block"


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return major, minor


def fp8_matmul(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] bf16 or fp16, w [N, K] FP8, w_scale fp32 as ``block`` lays it out: [..., N] in x's dtype. The GPU
    kernels on CUDA tensors, the dequantizing reference otherwise."""
    w_scale = w_scale.float().contiguous()  # (no copy for the fp32 scales a loaded layer holds)
    check_inputs(x, w, w_scale, block, bias)
    if not use_triton(x, w, w_scale):
        return fp8_matmul_reference(x.reshape(-1, x.shape[-1]), w, w_scale, block, bias).view(*x.shape[:-1], -1)
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    # Probed only where it could be chosen: a 128 x 128-block weight past the decode rows.
    blockwise = tuple(block) == BLOCKWISE and rows > DECODE_ROWS and blockwise_support(x.device) is not None
    path = choose_path(rows, w.shape[0], w.shape[1], block, _capability(x.device.index or 0), blockwise)
    out = _PATHS[path](x2, w, w_scale, block, bias)
    return out.view(*x.shape[:-1], w.shape[0])


def gemv_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """The decode path: x [M <= DECODE_ROWS, K] times the FP8 weight, no activation quantization."""
    from workers.kernels import fp8_gemv_triton

    if x.shape[0] > fp8_gemv_triton.DOT_MAX_ROWS:
        raise ValueError(f"the FP8 GEMV takes up to {fp8_gemv_triton.DOT_MAX_ROWS} rows, got {x.shape[0]}")
    return fp8_gemv_triton.weight_gemv(x, w, w_scale, _scale_block(block, w.shape[1]), bias)


def block_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """Activations per 1 x 128 group (per token for a per-channel weight), then the Triton scaled GEMM."""
    from workers.kernels import fp8_triton

    k = x.shape[1]
    group = k if block[1] >= k else GROUP
    x_q, x_s = fp8_triton.quantize(x, group)
    return fp8_triton.scaled_mm(x_q, x_s, group, w, w_scale, _scale_block(block, k), bias, x.dtype)


def scaled_mm_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """Per-channel weights: activations per token (Triton), then cuBLASLt's FP8 GEMM through ``torch._scaled_mm``."""
    from workers.kernels import fp8_triton

    x_q, x_s = fp8_triton.quantize(x, x.shape[1])
    return fp8_bias.rowwise_mm(x_q, x_s, w, w_scale, bias, x.dtype)


def scaled_mm_blockwise(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    """128 x 128-block weights through cuBLASLt's block-scaled GEMM, as the device's probe found torch calls it; the
    Triton ``block`` path where the probe found none (or has not run: it waits for a call outside graph capture)."""
    call = _BLOCKWISE.get(_device_index(x.device)) if x.is_cuda else None
    if call is None:
        return block_triton(x, w, w_scale, block, bias)
    return blockwise_mm(x, w, w_scale, bias, call)


@dataclass(frozen=True)
class BlockwiseCall:
    """How this torch takes a 1 x 128 by 128 x 128 block-scaled GEMM: through ``torch.nn.functional.scaled_mm`` (its
    scaling recipes named) or ``torch._scaled_mm`` (the recipe read from the scales' shapes and strides), the scales
    as they are (``padding`` "none"), the weight scales' row stride rounded up to a multiple of 4 ("stride"), or the
    weight scales' K blocks and the activations' rows zero-padded to multiples of 4 in shape ("shape": the 16-byte
    leading dimensions cuBLASLt's scale layouts are said to need, the padded rows' outputs dropped)."""

    api: str  # "scaled_mm" or "_scaled_mm"
    padding: str  # "none", "stride" or "shape"

    @property
    def name(self) -> str:
        return f"torch.{self.api} (scale padding: {self.padding})"


BLOCKWISE_CALLS = tuple(
    BlockwiseCall(api, padding) for api in ("scaled_mm", "_scaled_mm") for padding in ("none", "stride", "shape")
)
# (M, K, N) of the probe's GEMMs: whole blocks, then ragged rows, a partial last weight block and K / 128 = 3 (where
# the padded and unpadded scale layouts differ).
PROBE_SHAPES = ((128, 256, 256), (37, 384, 176))
_BLOCKWISE: dict[int, BlockwiseCall | None] = {}


def blockwise_support(device: torch.device) -> BlockwiseCall | None:
    """The first of `BLOCKWISE_CALLS` whose GEMMs match the dequantizing reference on ``device``, or None; probed once
    per device (with a synchronisation, so never while a CUDA graph is being captured: None then, not remembered)."""
    index = _device_index(device)
    if index not in _BLOCKWISE:
        if torch.cuda.is_current_stream_capturing():
            return None
        _BLOCKWISE[index] = probe_blockwise(torch.device("cuda", index))
        found = _BLOCKWISE[index]
        log.info(
            "FP8 128x128-block GEMMs with more than %d rows on cuda:%d: %s",
            DECODE_ROWS,
            index,
            f"cuBLASLt block-scaled through {found.name}"
            if found
            else "the Triton block-scaled GEMM (this torch's cuBLASLt block-scaled GEMM failed its probe)",
        )
    return _BLOCKWISE[index]


def probe_blockwise(device: torch.device) -> BlockwiseCall | None:
    """The first of `BLOCKWISE_CALLS` that matches the reference on every probe shape; why each other failed is kept
    in `PROBE_FAILURES` (and logged), since a torch that lacks the recipe and one that computes it wrongly differ."""
    failures = PROBE_FAILURES.setdefault(_device_index(device), [])
    failures.clear()
    if _capability(device.index) < (9, 0):
        failures.append(f"compute capability {_capability(device.index)} is below 9.0")
        return None
    for call in BLOCKWISE_CALLS:
        try:
            mismatch = next(filter(None, (_probe_mismatch(device, call, *shape) for shape in PROBE_SHAPES)), None)
        except Exception as error:  # (whatever this torch raises for a recipe it lacks: the next call is tried)
            mismatch = f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if mismatch is None:
            return call
        failures.append(f"{call.name}: {mismatch}")
        log.info("cuBLASLt block-scaled GEMM through %s failed its probe: %s", call.name, mismatch)
    return None


PROBE_FAILURES: dict[int, list[str]] = {}  # device index: why each block-scaled call failed its last probe


def _probe_mismatch(device: torch.device, call: BlockwiseCall, m: int, k: int, n: int) -> str | None:
    """None where ``call``'s [m, k] x [n, k] product matches the dequantizing reference on its quantized activations
    within the bound the GPU tests hold the scaled paths to (bf16 rounding of the product; the tensor cores'
    narrower accumulation, 2**-12 of the absolute sum); else what differs."""
    g = torch.Generator(device=device).manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    w_scale = torch.rand(-(-n // 128), -(-k // 128), generator=g, device=device) * 2e-3 + 1e-3
    out = blockwise_mm(x, w, w_scale, None, call).float()
    x_q, x_s = quantize_reference(x, GROUP)
    x_deq = dequantize_reference(x_q, x_s, (1, GROUP))
    w_deq = dequantize_reference(w, w_scale, BLOCKWISE)
    ref = x_deq @ w_deq.T
    bound = 2**-8 * ref.abs() + 2**-12 * (x_deq.abs() @ w_deq.abs().T)
    if out.shape != ref.shape:
        return f"[{m}, {k}] x [{n}, {k}]: answered shape {tuple(out.shape)}"
    over = (out - ref).abs() / bound
    if bool((over <= 1).all()):
        return None
    off = int((over > 1).sum())
    return f"[{m}, {k}] x [{n}, {k}]: {off} of {over.numel()} outputs off, worst {over.max():.3g}x the bound"


def blockwise_mm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, call: BlockwiseCall
) -> torch.Tensor:
    """x [M, K] quantized per 1 x 128 group (scales [M, K / 128] column-major, as cuBLASLt reads them) times w [N, K]
    with w_scale [N / 128, K / 128] row-major, as ``call`` passes them to torch."""
    from workers.kernels import fp8_triton

    rows = x.shape[0]
    if call.padding == "shape" and rows % 4:
        x = torch.nn.functional.pad(x, (0, 0, 0, -rows % 4))
    x_q, x_s = fp8_triton.quantize(x, GROUP, scale_layout="column-major")
    w_s = blockwise_weight_scales(w_scale, call)
    if call.api == "scaled_mm":
        functional = torch.nn.functional
        recipes = functional.ScalingType
        out = functional.scaled_mm(
            x_q, w.t(), x_s, recipes.BlockWise1x128, w_s.t(), recipes.BlockWise128x128, output_dtype=x.dtype
        )
    else:
        out = torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=w_s.t(), out_dtype=x.dtype)
    out = out[:rows]
    return out if bias is None else out + bias


def blockwise_weight_scales(w_scale: torch.Tensor, call: BlockwiseCall) -> torch.Tensor:
    """``w_scale`` [N / 128, K / 128] laid out as ``call`` passes it."""
    if call.padding == "stride":
        return padded_rows(w_scale)
    return padded_columns(w_scale) if call.padding == "shape" else w_scale


def padded_columns(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` [R, C] zero-padded to [R, C rounded up to a multiple of 4] (itself where C is one already)."""
    return scale if scale.shape[1] % 4 == 0 else torch.nn.functional.pad(scale, (0, -scale.shape[1] % 4))


def padded_rows(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` [R, C] with its row stride rounded up to a multiple of 4 (a copy only where C is not one already)."""
    rows, cols = scale.shape
    stride = -(-cols // 4) * 4
    if scale.stride() == (stride, 1):
        return scale
    padded = scale.new_zeros(rows, stride)
    padded[:, :cols] = scale
    return padded[:, :cols]


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def dequantize_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> torch.Tensor:
    return fp8_matmul_reference(x, w, w_scale, block, bias)


_PATHS = {
    "gemv": gemv_triton,
    "scaled_mm": scaled_mm_torch,
    "scaled_mm_blockwise": scaled_mm_blockwise,
    "block": block_triton,
    "dequantize": dequantize_torch,
}


def quantize_triton(x: torch.Tensor, group: int, scale_layout: str = "row-major") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_reference` as one Triton kernel: x [M, K] (unit column stride) to (q, scales), the scales row-major
    or ``"column-major"`` (strides (1, M))."""
    from workers.kernels import fp8_triton

    if x.ndim != 2 or x.stride(-1) != 1 or group < 1:
        raise ValueError(f"x must be [M, K] with unit column stride and group >= 1, got {tuple(x.shape)}, {group}")
    return fp8_triton.quantize(x, group, scale_layout)


def _scale_block(block: tuple[int, int], k: int) -> tuple[int, int]:
    """The block with a per-channel K extent clamped to K, so that ``k0 // block_k`` is 0 for every tile."""
    return block[0], max(1, min(block[1], k))


def check_inputs(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None
) -> None:
    if w.ndim != 2 or w.dtype != FP8 or x.shape[-1] != w.shape[1] or w.stride(-1) != 1:
        raise ValueError(
            f"w must be float8_e4m3fn [N, K] with unit column stride for x [..., K], got {w.dtype} {tuple(w.shape)} "
            f"strides {w.stride()} and {tuple(x.shape)}"
        )
    grid = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    if tuple(w_scale.shape) != grid or w_scale.dtype != torch.float32 or w_scale.stride(-1) != 1:
        raise ValueError(
            f"w_scale must be contiguous fp32 {list(grid)} for w {tuple(w.shape)} in blocks {block}, got "
            f"{w_scale.dtype} {tuple(w_scale.shape)}"
        )
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")


def fp8_matmul_quantized(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(x_q * x_s) @ w.T + bias`` in ``out_dtype`` for activations quantized beforehand per token (x_q [M, K]
    float8_e4m3fn, x_s [M, 1] fp32: `quantize_reference(x, K)`'s layout, which the norm kernels of `fp8_norm` write)
    and a per-channel weight (``block = (1, K)`` or wider). On CUDA the GEMM `fp8_matmul` would run after its own
    quantization: ``torch._scaled_mm`` where `choose_path` says ``scaled_mm``, the Triton scaled GEMM otherwise (N or
    K not a multiple of 16, or before sm_89); elsewhere both operands dequantized exactly, multiplied in fp32 and
    rounded once."""
    w_scale = w_scale.float().contiguous()
    check_inputs(x_q, w, w_scale, block, bias)
    rows, k = x_q.shape if x_q.ndim == 2 else (-1, -1)
    if x_q.ndim != 2 or x_q.dtype != FP8 or tuple(x_s.shape) != (rows, 1) or x_s.dtype != torch.float32:
        raise ValueError(
            f"x_q must be float8_e4m3fn [M, K] with fp32 scales [M, 1], got {x_q.dtype} {tuple(x_q.shape)} and "
            f"{x_s.dtype} {tuple(x_s.shape)}"
        )
    if block[0] != 1 or block[1] < k:
        raise ValueError(f"activations quantized per token take a per-channel weight (block (1, {k})), got {block}")
    if not use_triton(x_q, w):
        out = dequantize_reference(x_q, x_s, (1, k)) @ dequantize_reference(w, w_scale, (1, k)).T
        return (out if bias is None else out + bias.float()).to(out_dtype)
    if choose_path(rows, w.shape[0], k, block, _capability(x_q.device.index or 0)) != "scaled_mm":
        from workers.kernels import fp8_triton

        return fp8_triton.scaled_mm(x_q, x_s, k, w, w_scale, _scale_block(block, k), bias, out_dtype)
    return fp8_bias.rowwise_mm(x_q, x_s, w, w_scale, bias, out_dtype)
