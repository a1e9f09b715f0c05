"""Compile the kernels for an NVIDIA GPU without one: ``python -m benchmarks.aot``.

Triton's interpreter checks what the kernels compute but never compiles them. This builds each kernel's
launch at the real models' shapes on meta tensors, specialises its arguments as Triton's JIT would on a
GPU (integers equal to 1 become constants, pointers and multiples of 16 are marked 16-divisible), and
compiles it for the target with the ptxas that ships in the triton wheel. It prints each kernel's
registers, spilled bytes and shared memory; it exits 1 if a kernel fails to compile, or spills with
``--fail-on-spill``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.kernels._triton_common import Launch
from workers.kernels.attention import AttentionMetadata

META = torch.device("meta")
MODELS = {  # heads, kv_heads, head_dim, hidden, intermediate
    "2b": (12, 2, 128, 1536, 8960),
    "7b": (28, 4, 128, 3584, 18944),
}


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # the stack frame, which is all spills in these kernels (they have no local arrays)
    shared_bytes: int
    seconds: float


def attention_launches(
    name: str, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, Launch]]:
    from workers.kernels import attention_triton

    cases = {  # (query_lens' total, max query len, num_seqs, max context, forced splits or None: balanced, block size)
        "decode": (64, 1, 64, 3072, 1, 16),
        "decode-split": (1, 1, 1, 3072, 8, 16),
        "decode-balanced": (32, 1, 32, 32768, None, 16),
        "mixed": (640, 512, 64, 3072, 1, 16),
        "decode-balanced-block64": (32, 1, 32, 32768, None, 64),  # a tile within one block
        "mixed-block64": (640, 512, 64, 3072, 1, 64),
    }
    for case, (tokens, max_q, seqs, max_ctx, splits, block_size) in cases.items():
        metadata = _metadata(tokens, max_q, seqs, max_ctx, block_size=block_size)
        q = torch.empty((tokens, heads, head_dim), dtype=dtype, device=META)
        cache = torch.empty((4096 * 16, kv_heads, head_dim), dtype=dtype, device=META)
        _, launches = attention_triton.plan(q, cache, cache, metadata, head_dim**-0.5, num_splits=splits)
        for launch in launches:
            yield f"{name} {launch.kernel.__name__.strip('_')} {case}", launch
        if case in ("decode-balanced", "mixed-block64"):  # over an FP8 cache ([decoder] kv_cache_dtype = "fp8")
            fp8 = torch.empty((4096 * 16, kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=META)
            scales = torch.empty((4096 * 16, kv_heads), dtype=torch.float32, device=META)
            _, launches = attention_triton.plan(
                q, fp8, fp8, metadata, head_dim**-0.5, num_splits=splits, kv_scales=(scales, scales)
            )
            yield f"{name} paged_attention_kernel {case} fp8-kv", launches[0]


def other_launches(name: str, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int):
    from workers.kernels import activation_triton, cache_triton, norm_triton, rotary_triton

    tokens, bf16 = 256, torch.bfloat16
    k = torch.empty((tokens, kv_heads, head_dim), dtype=bf16, device=META)
    cache = torch.empty((4096 * 16, kv_heads, head_dim), dtype=bf16, device=META)
    slots = torch.empty(tokens, dtype=torch.int64, device=META)
    yield f"{name} reshape_and_cache", cache_triton.plan(k, k, cache, cache, slots)
    fp8 = torch.empty((4096 * 16, kv_heads, head_dim), dtype=torch.float8_e4m3fn, device=META)
    scales = torch.empty((4096 * 16, kv_heads), dtype=torch.float32, device=META)
    yield f"{name} reshape_and_cache fp8", cache_triton.plan(k, k, fp8, fp8, slots, scales, scales)
    x = torch.empty((tokens, hidden), dtype=bf16, device=META)
    weight = torch.empty(hidden, dtype=bf16, device=META)
    yield f"{name} rms_norm", norm_triton.plan(x, None, weight, 1e-6)[2]
    yield f"{name} fused_add_rms_norm", norm_triton.plan(x, x, weight, 1e-6)[2]
    yield f"{name} fused_add_layer_norm", norm_triton.plan(x, x, weight, 1e-6, bias=weight)[2]
    gate_up = torch.empty((tokens, 2 * intermediate), dtype=bf16, device=META)
    yield f"{name} silu_and_mul", activation_triton.plan(gate_up[:, :intermediate], gate_up[:, intermediate:])[1]
    qkv = torch.empty((tokens, heads + 2 * kv_heads, head_dim), dtype=bf16, device=META)
    cos = torch.empty((tokens, head_dim), dtype=bf16, device=META)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    yield f"{name} apply_mrope", rotary_triton.plan(q, k, cos, cos, inplace=True)[2]
    head_weight = torch.empty(head_dim, dtype=bf16, device=META)
    norm = (head_weight, head_weight, 1e-6)
    yield f"{name} apply_qk_norm_mrope", rotary_triton.plan(q, k, cos, cos, inplace=True, norm=norm)[2]


def vision_launches() -> Iterator[tuple[str, Launch]]:
    """The vision tower's kernels at Qwen2-VL's tower shape (16 heads of 80, MLP 5120), a 720p image."""
    from workers.kernels import vision_triton

    patches, heads, head_dim, bf16 = 4784, 16, 80, torch.bfloat16
    qkv = torch.empty((patches, 3 * heads * head_dim), dtype=bf16, device=META)
    cos = torch.empty((patches, head_dim), dtype=torch.float32, device=META)
    yield "vision rotary_qk", vision_triton.plan_rotary(qkv, cos, cos, heads)[3]
    padded = torch.empty((3, 4864, heads, 96), dtype=bf16, device=META)  # cuDNN's padded layout
    dest = torch.empty((patches,), dtype=torch.int64, device=META)
    yield "vision rotary_qk_into", vision_triton.plan_rotary_into(qkv, cos, cos, heads, padded, dest)
    yield "vision quick_gelu", vision_triton.plan_quick_gelu(torch.empty((patches, 5120), dtype=bf16, device=META))[1]


def all_launches(quick: bool = False) -> Iterator[tuple[str, Launch]]:
    models = {"7b": MODELS["7b"]} if quick else MODELS
    for name, (heads, kv_heads, head_dim, hidden, intermediate) in models.items():
        yield from attention_launches(name, heads, kv_heads, head_dim)
        if not quick:
            yield from other_launches(name, heads, kv_heads, head_dim, hidden, intermediate)
    # fp32 (CPU-parity dtype) at the tiny model's head_dim 16: IEEE products, the smallest dot
    yield from attention_launches("tiny-fp32", 4, 2, 16, torch.float32)
    if not quick:
        yield from vision_launches()


def compile_launch(launch: Launch, arch: int) -> Resources:
    """Compile as the JIT would for ``launch``'s arguments; raise if Triton or ptxas rejects the kernel."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    kernel = launch.kernel
    signature: dict[str, str] = {}
    constants = dict(launch.constexprs)
    attrs = {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        kind, spec = native_specialize_impl(CUDABackend, launch.args[name], False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(index,)] = CUDABackend.parse_attr(spec)
    started = time.perf_counter()
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": launch.num_warps, "num_stages": launch.num_stages, **launch.options},
    )
    seconds = time.perf_counter() - started
    registers, stack = _resource_usage(compiled.asm["cubin"])
    return Resources(registers, stack, compiled.metadata.shared, seconds)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report:\n{report}")
    return int(match[1]), int(match[2])


def _metadata(tokens: int, max_query_len: int, num_seqs: int, max_context: int, block_size: int) -> AttentionMetadata:
    width = -(-max_context // block_size)
    packed = torch.empty(3 * num_seqs + 1 + num_seqs * width, dtype=torch.int32, device=META)
    starts, lens, ctx, table = torch.split(packed, [num_seqs + 1, num_seqs, num_seqs, num_seqs * width])
    return AttentionMetadata(
        starts, lens, ctx, table.view(num_seqs, width), tokens, max_query_len, max_context, block_size
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as one number (H200: 90)")
    parser.add_argument("--quick", action="store_true", help="attention only, the 7b and fp32 shapes")
    parser.add_argument("--fail-on-spill", action="store_true")
    args = parser.parse_args(argv)
    failed = False
    print(f"{'kernel':<44} {'regs':>5} {'spill B':>8} {'smem B':>7} {'s':>5}")
    for name, launch in all_launches(args.quick):
        try:
            res = compile_launch(launch, args.arch)
        except Exception as error:  # report every kernel, then fail
            print(f"{name:<44} FAILED: {type(error).__name__}: {error}")
            failed = True
            continue
        print(f"{name:<44} {res.registers:>5} {res.spill_bytes:>8} {res.shared_bytes:>7} {res.seconds:>5.1f}")
        failed |= args.fail_on_spill and res.spill_bytes > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
