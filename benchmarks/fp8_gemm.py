"""FP8 GEMMs against bf16 ``@``: each path of `workers.kernels.fp8` on the shapes issue 29 measured (the ViT's,
a 7B prefill's, 7B decode at batch 1 and 32), CUDA. ``python -m benchmarks.fp8_gemm [--quick] [--out FILE]``.

Each case is timed as CUDA-graph replays (`benchmarks.kernels.graph_replay_us`) of one call per copy of the weight,
with enough copies to overflow the L2 cache, so every call reads its weight from HBM as a model's layers do. The FP8
timings include their activation quantization (the Triton kernel), except the ``*_gemm_only`` columns, which time the
GEMM on activations quantized beforehand: the difference is what fusing quantization into the preceding kernel
would win. ``speedup`` is bf16's time over the path's; ``path`` is what `fp8_matmul` chooses.

``--sweep-gemv`` times the decode GEMV's kernels and tilings (`fp8_gemv_triton.GemvConfig`: the dot or sum kernel,
rows and columns a program, warps, stages, evict-first weight loads, programs an SM through split K) at the 7B decode
shapes (M 1, 4, 16), beside the one `gemv_config` picks, so its defaults follow the box's numbers.

``--sweep-block`` times the Triton block-scaled GEMM's tilings (`fp8_triton.ScaledMmConfig`: tile, GROUP_M, warps,
stages; `SWEEP_TILES` x `SWEEP_STAGES` x `SWEEP_GROUP_M`) at the ViT's and the 7B prefill's (2048 rows) shapes, GEMM
only, beside the one `scaled_mm_config` picks and cuBLASLt's block-scaled GEMM where this torch has it, printing the
best per shape.

``--aot 90`` needs no GPU: it compiles each FP8 kernel's launch at these shapes for sm_90 (`benchmarks.aot`), every
tiling the block sweep tries and every kernel the GEMV sweep compiles, and prints its registers, spills and shared
memory, exiting 1 where Triton or ptxas rejects one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels import L2_OVERFLOW_BYTES, graph_replay_us
from workers.kernels import fp8
from workers.kernels._triton_common import Launch
from workers.kernels.fp8 import FP8
from workers.kernels.fp8_triton import ScaledMmConfig

# (name, rows M, in features K, out features N)
VIT = [("vit_qkv", 4096, 1280, 3840), ("vit_fc1", 4096, 1280, 5120), ("vit_fc2", 4096, 5120, 1280)]
# One 768x1024 image's 3,996 patches: a row count no tile divides (the tower at batch 1 was 2.6x slower in FP8 than
# in bf16 on the H200, at batch 4 as fast); `scaled_mm_padded_gemm_only_us` times the GEMM on rows padded to 16.
VIT_ONE_IMAGE = [(f"{name}_m3996", 3996, k, n) for name, _, k, n in VIT]
LM_7B = [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate_up", 3584, 37888), ("down", 18944, 3584)]
CASES = VIT + VIT_ONE_IMAGE + [(f"7b_{name}_m{m}", m, k, n) for m in (2048, 32, 1) for name, k, n in LM_7B]
QUICK = {"vit_fc1", "7b_gate_up_m2048", "7b_gate_up_m1", "7b_down_m1", "7b_down_m32"}
LAYOUTS = {"block": (128, 128), "channel": None}  # None: (1, K)


def weights(n: int, k: int, block: tuple[int, int], copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    grid = (-(-n // block[0]), -(-k // block[1]))
    return [
        ((torch.randn(n, k, device="cuda") * 64).to(FP8), torch.rand(grid, device="cuda") * 1e-3 + 1e-3)
        for _ in range(copies)
    ]


def per_copy_us(copies: int, call: Callable[[int], object]) -> float:
    def all_copies() -> None:
        for i in range(copies):
            call(i)

    return graph_replay_us(all_copies) / copies


def time_case(m: int, k: int, n: int, layout: str) -> dict[str, Any]:
    block = LAYOUTS[layout] or (1, k)
    copies = max(1, -(-L2_OVERFLOW_BYTES // (n * k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w8 = weights(n, k, block, copies)
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, copies // 2))]
    blockwise = tuple(block) == fp8.BLOCKWISE and fp8.blockwise_support(x.device) is not None
    row: dict[str, Any] = {"path": fp8.choose_path(m, n, k, block, torch.cuda.get_device_capability(), blockwise)}
    row["bf16_us"] = per_copy_us(len(bf16), lambda i: x @ bf16[i].T)
    row["fp8_matmul_us"] = per_copy_us(copies, lambda i: fp8.fp8_matmul(x, *w8[i], block))
    if m <= fp8.DECODE_ROWS:
        row["gemv_us"] = per_copy_us(copies, lambda i: fp8.gemv_triton(x, *w8[i], block, None))
    if layout == "channel" and k % 16 == 0 and n % 16 == 0:
        row["scaled_mm_us"] = per_copy_us(copies, lambda i: fp8.scaled_mm_torch(x, *w8[i], block, None))
        x_q, x_s = fp8.quantize_triton(x, k)
        row["scaled_mm_gemm_only_us"] = per_copy_us(
            copies, lambda i: torch._scaled_mm(x_q, w8[i][0].t(), x_s, w8[i][1].view(1, -1), out_dtype=torch.bfloat16)
        )
        if m % 16:
            rows = -(-m // 16) * 16
            x_qp = torch.zeros(rows, k, device="cuda", dtype=FP8)
            x_qp[:m] = x_q
            x_sp = torch.ones(rows, 1, device="cuda")
            x_sp[:m] = x_s
            row["scaled_mm_padded_gemm_only_us"] = per_copy_us(
                copies,
                lambda i: torch._scaled_mm(x_qp, w8[i][0].t(), x_sp, w8[i][1].view(1, -1), out_dtype=torch.bfloat16),
            )
    row["block_us"] = per_copy_us(copies, lambda i: fp8.block_triton(x, *w8[i], block, None))
    call = fp8.blockwise_support(x.device) if layout == "block" and m > fp8.DECODE_ROWS else None
    if call is not None:
        row["blockwise_us"] = per_copy_us(copies, lambda i: fp8.blockwise_mm(x, *w8[i], None, call))
        row["blockwise_gemm_only_us"] = blockwise_gemm_us(x, w8, call)
    group = k if layout == "channel" else fp8.GROUP
    row["quantize_us"] = per_copy_us(1, lambda i: fp8.quantize_triton(x, group))
    fastest = min(v for key, v in row.items() if key.endswith("_us") and key not in ("bf16_us", "quantize_us"))
    row["speedup"] = row["bf16_us"] / row["fp8_matmul_us"]
    row["best_speedup"] = row["bf16_us"] / fastest
    return row


def blockwise_gemm(
    x_q: torch.Tensor, x_s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, call: fp8.BlockwiseCall
) -> torch.Tensor:
    """cuBLASLt's block-scaled GEMM alone, on activations quantized beforehand (`fp8.blockwise_mm` less its
    quantization; the weight scales' padding, where the call wants it, was done at the weight's load)."""
    if call.api == "scaled_mm":
        functional = torch.nn.functional
        recipes = functional.ScalingType
        return functional.scaled_mm(
            x_q, w.t(), x_s, recipes.BlockWise1x128, w_scale.t(), recipes.BlockWise128x128, output_dtype=torch.bfloat16
        )
    return torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=w_scale.t(), out_dtype=torch.bfloat16)


def blockwise_gemm_us(x: torch.Tensor, w8: list[tuple[torch.Tensor, torch.Tensor]], call: fp8.BlockwiseCall) -> float:
    x_q, x_s = fp8.quantize_triton(x, fp8.GROUP, "column-major")
    padded = [(w, fp8.blockwise_weight_scales(s, call)) for w, s in w8]
    return per_copy_us(len(padded), lambda i: blockwise_gemm(x_q, x_s, *padded[i], call))


def run(quick: bool) -> list[dict[str, Any]]:
    rows = []
    print(f"{'case':<20} {'layout':<8} {'path':<19} {'bf16 us':>9} {'fp8 us':>9} {'speedup':>8}  other paths (us)")
    for name, m, k, n in CASES:
        if quick and name not in QUICK:
            continue
        for layout in LAYOUTS:
            row = {"case": name, "m": m, "k": k, "n": n, "layout": layout, **time_case(m, k, n, layout)}
            rows.append(row)
            others = " ".join(
                f"{key.removesuffix('_us')}={v:.1f}"
                for key, v in row.items()
                if key.endswith("_us") and key not in ("bf16_us", "fp8_matmul_us")
            )
            print(
                f"{name:<20} {layout:<8} {row['path']:<19} {row['bf16_us']:>9.1f} {row['fp8_matmul_us']:>9.1f} "
                f"{row['speedup']:>7.2f}x  {others}",
                flush=True,
            )
            torch.cuda.empty_cache()
    return rows


def launches() -> Iterator[tuple[str, Launch]]:
    """Each FP8 kernel's launch at the cases' shapes, the block sweep's tilings and every kernel the GEMV sweep
    compiles, on meta tensors (nothing runs)."""
    from workers.kernels import fp8_gemv_triton, fp8_triton

    meta = torch.device("meta")
    yield from block_sweep_launches(meta)
    for name, m, k, n in CASES:
        x = torch.empty(m, k, dtype=torch.bfloat16, device=meta)
        w = torch.empty(n, k, dtype=FP8, device=meta)
        for layout, given in LAYOUTS.items():
            block = given or (1, k)
            scale = torch.empty(-(-n // block[0]), -(-k // block[1]), device=meta)
            bias = torch.empty(n, dtype=torch.bfloat16, device=meta)
            group = k if layout == "channel" else fp8.GROUP
            if m <= fp8.DECODE_ROWS:
                yield f"gemv {name} {layout}", fp8_gemv_triton.plan_weight_gemv(x, w, scale, block, bias)[1]
                continue
            x_q, x_s, quantize = fp8_triton.plan_quantize(x, group)
            yield f"quantize {name} group {group}", quantize
            if layout == "block":
                column_major = fp8_triton.plan_quantize(x, group, scale_layout="column-major")[2]
                yield f"quantize {name} group {group} column-major", column_major
            yield (
                f"scaled_mm {name} {layout}",
                fp8_triton.plan_scaled_mm(x_q, x_s, group, w, scale, block, bias, x.dtype)[1],
            )
    yield from gemv_sweep_launches()
    yield from norm_quantize_launches(meta)


# (name, rows, hidden, LayerNorm) of the norms that quantize for the ViT's FP8 qkv and fc1 / gate|up (Qwen2-VL's and
# Qwen2.5-VL's width 1280, Qwen3-VL-8B's 1152); RMSNorm also without its residual add (Qwen2.5-VL's first block).
NORM_QUANTIZE_CASES = [("vit_layer_norm", 4096, 1280, True), ("vit_rms_norm", 4096, 1280, False)]
NORM_QUANTIZE_CASES += [("vit_layer_norm_1152", 4096, 1152, True)]


def norm_quantize_launches(meta: torch.device) -> Iterator[tuple[str, Launch]]:
    """`fp8_norm_triton`'s launches at the ViT's shapes: the norm with the activations' FP8 quantization fused."""
    from workers.kernels import fp8_norm_triton

    for name, m, k, layer_norm in NORM_QUANTIZE_CASES:
        x = torch.empty(m, k, dtype=torch.bfloat16, device=meta)
        weight = torch.empty(k, dtype=torch.bfloat16, device=meta)
        bias = weight if layer_norm else None
        yield f"norm_quantize {name} add", fp8_norm_triton.plan(x, x, weight, 1e-6, bias)[3]
        if not layer_norm:
            yield f"norm_quantize {name}", fp8_norm_triton.plan(x, None, weight, 1e-6)[3]


SM90_SHARED_BYTES = 232448  # the most shared memory a block of an sm_90 kernel can have


def compile_all(arch: int, shard: tuple[int, int] = (0, 1)) -> int:
    """Compile every launch (``shard`` (K, N): the K-th of every N, so that N processes share the work)."""
    from benchmarks.aot import compile_launch

    failed = 0
    index, shards = shard
    for name, launch in itertools.islice(launches(), index, None, shards):
        try:
            used = compile_launch(launch, arch)
        except Exception as error:  # (any rejection by Triton or ptxas: reported, and the rest still compiled)
            failed += 1
            print(f"{name:<44} FAILED {type(error).__name__}: {str(error)[-2000:]}", flush=True)
            continue
        if used.shared_bytes > SM90_SHARED_BYTES:  # (compiles, but no launch gets that much)
            failed += 1
            print(f"{name:<44} FAILED: {used.shared_bytes} B of shared memory, over {SM90_SHARED_BYTES}", flush=True)
            continue
        print(f"{name:<44} {used.registers:>4} regs {used.spill_bytes:>5} B spilled {used.shared_bytes:>7} B shared")
    return 1 if failed else 0


# (BLOCK_M, BLOCK_N, warps) of the block sweep: the rest of {64, 128} x {128, 256} x {4, 8} spill on sm_90 (64 x 256
# and 128 x 128 on 4 warps, 128 x 256 on either), which `--aot 90` would report.
SWEEP_TILES = ((64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 128, 8))
SWEEP_STAGES = (2, 3, 4)
SWEEP_GROUP_M = (8, 32)
SWEEP_BLOCK_CASES = VIT + VIT_ONE_IMAGE + [(f"7b_{name}_m2048", 2048, k, n) for name, k, n in LM_7B]


def block_configs() -> list[ScaledMmConfig]:
    return [
        ScaledMmConfig(block_m, block_n, group_m, warps, stages)
        for block_m, block_n, warps in SWEEP_TILES
        for stages in SWEEP_STAGES
        for group_m in SWEEP_GROUP_M
    ]


def block_sweep_launches(meta: torch.device) -> Iterator[tuple[str, Launch]]:
    """The block sweep's tilings at the 7B qkv prefill shape, with a bias (the epilogue's registers count too)."""
    from workers.kernels import fp8_triton

    m, k, n = 2048, 3584, 4608
    x_q = torch.empty(m, k, dtype=FP8, device=meta)
    x_s = torch.empty(m, k // fp8.GROUP, device=meta)
    w = torch.empty(n, k, dtype=FP8, device=meta)
    scale = torch.empty(n // 128, k // 128, device=meta)
    bias = torch.empty(n, dtype=torch.bfloat16, device=meta)
    for config in block_configs():
        plan = fp8_triton.plan_scaled_mm(x_q, x_s, fp8.GROUP, w, scale, (128, 128), bias, torch.bfloat16, config=config)
        yield f"scaled_mm sweep {config.name}", plan[1]


def sweep_block() -> list[dict[str, Any]]:
    """Each shape's GEMM (activations quantized beforehand) under every tiling of `block_configs`."""
    from workers.kernels import fp8_triton

    rows = []
    block = LAYOUTS["block"]
    for name, m, k, n in SWEEP_BLOCK_CASES:
        copies = max(1, -(-L2_OVERFLOW_BYTES // (n * k)))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w8 = weights(n, k, block, copies)
        x_q, x_s = fp8.quantize_triton(x, fp8.GROUP)
        timings = {}
        for config in block_configs():
            plans = [
                fp8_triton.plan_scaled_mm(x_q, x_s, fp8.GROUP, *w8[i], block, None, torch.bfloat16, config=config)[1]
                for i in range(copies)
            ]
            timings[config.name] = per_copy_us(copies, lambda i, run=plans: run[i]())
        best = min(timings, key=timings.get)
        chosen = fp8_triton.scaled_mm_config(m, n).name
        row = {"case": name, "m": m, "k": k, "n": n, "us": timings, "best": best, "chosen": chosen}
        call = fp8.blockwise_support(x.device)
        if call is not None:
            row["cublaslt_us"] = blockwise_gemm_us(x, w8, call)
        rows.append(row)
        print(
            f"{name:<18} chosen {chosen} {timings.get(chosen, float('nan')):.1f} us, best {best} {timings[best]:.1f} "
            f"us, cuBLASLt {row.get('cublaslt_us', float('nan')):.1f} us; "
            + " ".join(f"[{key}]={v:.1f}" for key, v in sorted(timings.items(), key=lambda item: item[1])),
            flush=True,
        )
        torch.cuda.empty_cache()
    return rows


SWEEP_M = (1, 4, 16, 32, 64)
SWEEP_PROGRAMS_PER_SM = (1, 2, 4, 8)
# (variant, block_n, block_k, num_warps, num_stages, evict_first, x_direct); split K from SWEEP_PROGRAMS_PER_SM
SWEEP_KERNELS = [
    ("dot", 64, 128, 4, 4, False, False),  # the kernel issue 29 measured first
    ("dot", 64, 128, 4, 4, True, False),
    ("dot", 32, 128, 4, 4, True, False),
    ("dot", 32, 128, 4, 6, True, False),
    ("dot", 64, 128, 8, 4, True, False),
    *(  # x rows spread through shared memory; pipelined loads (stages > 1) or not
        ("sum", block_n, block_k, warps, stages, True, False)
        for block_n, block_k, warps, stages in [
            (16, 256, 2, 3),
            (16, 512, 4, 3),
            (32, 256, 4, 1),
            (32, 256, 4, 3),
            (32, 256, 4, 5),
            (64, 128, 4, 3),
            (32, 512, 8, 3),
            (64, 256, 8, 3),
            (128, 128, 8, 3),
        ]
    ),
    *(  # x rows loaded in the weight's layout: unpipelined (GemvConfig.x_direct)
        ("sum", block_n, block_k, warps, 1, True, True)
        for block_n, block_k, warps in [
            (16, 256, 2),
            (16, 512, 4),
            (32, 256, 4),
            (64, 128, 4),
            (32, 256, 8),  # (32 x 512 on 8 warps spills at 4 rows)
            (64, 256, 8),
        ]
    ),
]


def sweep_configs(m: int, n: int, k: int, sms: int) -> list[Any]:
    """Every swept `GemvConfig` that runs on M rows (the sum kernel takes up to SUM_MAX_ROWS), one per distinct
    config (programs an SM that give the same split are timed once)."""
    from workers.kernels import fp8_gemv_triton

    configs = {}
    for variant, block_n, block_k, warps, stages, evict, x_direct in SWEEP_KERNELS:
        if variant == "sum" and m > fp8_gemv_triton.SUM_MAX_ROWS:
            continue
        for per_sm in SWEEP_PROGRAMS_PER_SM:
            config = fp8_gemv_triton.gemv_config(
                m, n, k, sms, per_sm, variant=variant, block_n=block_n, block_k=block_k, num_warps=warps,
                num_stages=stages, evict_first=evict, x_direct=x_direct,
            )  # fmt: skip
            configs.setdefault(config.name, config)
    return list(configs.values())


def gemv_sweep_launches() -> Iterator[tuple[str, Launch]]:
    """One launch of each kernel the sweep compiles (a kernel, its constexprs and options, and M = 1 and split K = 1
    specialized as Triton does), on meta tensors, for `compile_all`."""
    from workers.kernels import fp8_gemv_triton

    meta, seen = torch.device("meta"), set()
    for m in SWEEP_M:
        for _, k, n in LM_7B:
            x = torch.empty(m, k, dtype=torch.bfloat16, device=meta)
            w = torch.empty(n, k, dtype=FP8, device=meta)
            scale = torch.empty(-(-n // 128), -(-k // 128), device=meta)
            for config in sweep_configs(m, n, k, fp8_gemv_triton.H200_SMS):
                launch = fp8_gemv_triton.plan_weight_gemv(x, w, scale, LAYOUTS["block"], None, config=config)[1]
                key = (config.variant, *sorted(launch.constexprs.items()), config.num_warps, config.num_stages, m == 1)
                if key not in seen:
                    seen.add(key)
                    yield f"gemv sweep {config.name} m{m}", launch


def sweep_gemv() -> list[dict[str, Any]]:
    """Times every `sweep_configs` config at the 7B decode shapes; per shape, the chosen config (`gemv_config`'s)
    beside the best, each variant's best, and the best's rate of weight bytes; then every timing."""
    from workers.kernels import fp8_gemv_triton

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in SWEEP_M:
        for name, k, n in LM_7B:
            chosen = fp8_gemv_triton.gemv_config(m, n, k, sms)
            timings = time_gemv_configs(m, k, n, [chosen, *sweep_configs(m, n, k, sms)])
            best = min(timings, key=timings.get)
            by_variant = {}
            for key in sorted(timings, key=timings.get):
                by_variant.setdefault(key.split()[0], key)
            case, rate = f"7b_{name}_m{m}", n * k / timings[best] / 1e6
            rows.append(
                {"case": case, "m": m, "k": k, "n": n, "us": timings, "best": best, "chosen": chosen.name,
                 "best_by_variant": by_variant, "best_tb_s": rate}
            )  # fmt: skip
            print(
                f"{case:<16} chosen [{chosen.name}] {timings[chosen.name]:.1f} us, best [{best}] "
                f"{timings[best]:.1f} us ({rate:.2f} TB/s of FP8 weight); "
                + ", ".join(f"best {v} [{key}] {timings[key]:.1f}" for v, key in by_variant.items()),
                flush=True,
            )
    for row in rows:
        print(f"{row['case']:<16} " + " ".join(f"[{key}]={v:.1f}" for key, v in sorted(row["us"].items())))
    return rows


def time_gemv_configs(m: int, k: int, n: int, configs: list[Any]) -> dict[str, float]:
    """Microseconds a GEMV call, by config name, each config once, on weights read from HBM (`per_copy_us`)."""
    from workers.kernels import fp8_gemv_triton

    block = LAYOUTS["block"]
    copies = max(1, -(-L2_OVERFLOW_BYTES // (n * k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w8 = weights(n, k, block, copies)
    timings: dict[str, float] = {}
    for config in configs:
        if config.name not in timings:
            launches = [
                fp8_gemv_triton.plan_weight_gemv(x, *w8[i], block, None, config=config)[1] for i in range(copies)
            ]
            timings[config.name] = per_copy_us(copies, lambda i, run=launches: run[i]())
    del w8
    torch.cuda.empty_cache()
    return timings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(sorted(QUICK))}")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--sweep-gemv", action="store_true", help="time the decode GEMV's tilings and exit")
    parser.add_argument("--sweep-block", action="store_true", help="time the block-scaled GEMM's tilings and exit")
    parser.add_argument("--aot", type=int, metavar="ARCH", help="compile the kernels for sm_ARCH (no GPU) and exit")
    parser.add_argument(
        "--shard", default="0/1", metavar="K/N", help="--aot: only the K-th of every N launches (N processes at once)"
    )
    args = parser.parse_args(argv)
    if args.aot:
        index, shards = (int(part) for part in args.shard.split("/"))
        sys.exit(compile_all(args.aot, (index, shards)))
    if not torch.cuda.is_available():
        print("benchmarks.fp8_gemm needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    from workers.kernels import fp8

    blockwise = fp8.blockwise_support(torch.device("cuda"))
    failures = fp8.PROBE_FAILURES.get(torch.cuda.current_device(), [])
    print(f"cuBLASLt block-scaled GEMM: {blockwise or 'none; ' + '; '.join(failures)}", flush=True)
    rows = sweep_gemv() if args.sweep_gemv else sweep_block() if args.sweep_block else run(args.quick)
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "blockwise_probe": failures}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
