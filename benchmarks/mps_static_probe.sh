#!/usr/bin/env bash
# Does this GPU host's MPS offer static SM partitions (`nvidia-cuda-mps-control -S`, then `sm_partition add`;
# a client binds to one with CUDA_MPS_SM_PARTITION)? They are the one way to give two processes disjoint SMs:
# MPS's active-thread percentage caps how many SMs a client uses, not which, so capped clients still meet on
# the same SMs. Also: torch's green contexts (SM partitions inside one process), with and without MPS.
# Usage: benchmarks/mps_static_probe.sh OUT_DIR   (everything it sees goes to OUT_DIR/probe.log)
set -u
out=${1:?usage: benchmarks/mps_static_probe.sh OUT_DIR}
mkdir -p "$out"
work=$(mktemp -d /tmp/mps-static.XXXXXX)
mkdir -p "$work/pipe" "$work/log"
green_contexts() {
  python3 - <<'PY'
import torch

gc = getattr(torch.cuda, "green_contexts", None)
print("torch", torch.__version__, "| torch.cuda.green_contexts:", gc is not None)
if gc is not None:
    print("  has:", [n for n in dir(gc) if not n.startswith("_")])
    try:
        ctx = gc.GreenContext.create(32, 0)
        ctx.set_context()
        x = torch.ones(1024, device="cuda")
        print("  a green context of 32 SMs ran a kernel:", float(x.sum()))
        ctx.pop_context()
    except Exception as exc:  # the probe reports whatever the API does
        print("  green context failed:", type(exc).__name__, exc)
PY
}
{
  nvidia-smi --query-gpu=name,driver_version,uuid --format=csv
  echo "== green contexts, no MPS"; green_contexts
  export CUDA_MPS_PIPE_DIRECTORY=$work/pipe CUDA_MPS_LOG_DIRECTORY=$work/log
  echo "== nvidia-cuda-mps-control -d -S"
  nvidia-cuda-mps-control -d -S 2>&1; echo "rc=$?"
  sleep 1
  uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1 | tr -d '[:space:]')
  echo "== lspart"; echo lspart | nvidia-cuda-mps-control 2>&1; echo "rc=$?"
  echo "== sm_partition add $uuid 8"
  reply=$(echo "sm_partition add $uuid 8" | nvidia-cuda-mps-control 2>&1); echo "$reply"
  id=$(sed -nE 's/^Partition (.*) created.*$/\1/p' <<< "$reply" | tail -1)
  if [ -n "$id" ]; then
    CUDA_MPS_SM_PARTITION=$id python3 -c \
      'import torch; print("SMs a client of the partition sees:", torch.cuda.get_device_properties(0).multi_processor_count)'
    echo lspart | nvidia-cuda-mps-control 2>&1
  fi
  echo quit | nvidia-cuda-mps-control 2>&1; sleep 2
  echo "== control.log"; tail -20 "$work/log/control.log" 2>&1
  echo "== green contexts under plain MPS"
  nvidia-cuda-mps-control -d 2>&1; echo "rc=$?"; sleep 1
  green_contexts
  echo quit | nvidia-cuda-mps-control 2>&1; sleep 1
} > "$out/probe.log" 2>&1
rm -rf "$work"
