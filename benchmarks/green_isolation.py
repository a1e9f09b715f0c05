"""Do green contexts keep two MPS clients on disjoint SMs? One role per process, run side by side under MPS
(tests/gpu/test_sm_partition_gpu.py runs the first):

- ``smids``: which SMs a process's kernels ran on (each program of a Triton kernel records %smid);
- ``victim``: a decode-like step (28 bf16 projections of 32 rows against weights that do not fit in L2, replayed
  from a CUDA graph), timed step by step;
- ``aggressor``: back-to-back 8192³ bf16 matrix products (the ViT's kind of work), counted.

Each writes one JSON line to ``--out``. ``--side first|rest`` with ``--sms N`` confines the process to the first N
SMs of the split or to the rest (`workers.models.sm_partition`); ``--side all`` leaves it the whole GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from workers.models.sm_partition import confine


@triton.jit
def _record_smid(out_ptr, spin: tl.constexpr) -> None:
    pid = tl.program_id(0)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    acc = pid
    for _ in range(spin):  # long enough that the programs spread over every SM they may use
        acc = (acc * 1103515245 + 12345) % 2147483647
    tl.store(out_ptr + pid, tl.where(acc == -1, -1, smid))  # (acc kept: it is never -1)


def smids(device: torch.device) -> dict[str, object]:
    programs = 132 * 64
    out = torch.empty(programs, dtype=torch.int32, device=device)
    seen: set[int] = set()
    for _ in range(5):
        _record_smid[(programs,)](out, spin=20000)
        seen |= set(out.tolist())
    return {"smids": sorted(seen), "count": len(seen)}


def victim(device: torch.device, seconds: float) -> dict[str, object]:
    weights = [torch.randn(1536, 8960, device=device, dtype=torch.bfloat16) for _ in range(28)]
    x = torch.randn(32, 1536, device=device, dtype=torch.bfloat16)

    def step() -> None:
        for w in weights:
            torch.nn.functional.silu(x @ w)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times: list[float] = []
    stream = torch.cuda.current_stream()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    times = times[len(times) // 10 :]  # warm-up out
    ordered = sorted(times)
    return {"steps": len(times), "median_ms": statistics.median(times), "p99_ms": ordered[int(0.99 * len(ordered))]}


def aggressor(device: torch.device, seconds: float) -> dict[str, object]:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    products = 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        products += 10
    elapsed = time.monotonic() - started
    return {"products": products, "tflops": 2 * 8192**3 * products / elapsed / 1e12}


ROLES = {"victim": victim, "aggressor": aggressor}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["smids", "victim", "aggressor"], required=True)
    parser.add_argument("--side", choices=["all", "first", "rest"], default="all")
    parser.add_argument("--sms", type=int, default=96)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    record: dict[str, object] = {"role": args.role, "side": args.side, "label": args.label}
    if args.side != "all":
        record["sms_given"] = confine(device, args.sms, args.side)
    record.update(smids(device) if args.role == "smids" else ROLES[args.role](device, args.seconds))
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "smids"}))


if __name__ == "__main__":
    main()
