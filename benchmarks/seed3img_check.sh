#!/usr/bin/env bash
# seed3img at 32 clients in a steady state (256 requests, not 64), on one GPU and with one encoder per GPU on
# a two-GPU kind; vision on GPU 1 writing into GPU 0's embedding pool over CUDA IPC ([cache] device_pool),
# its greedy answers compared with the host pool's; mixed under MPS with the encoders at 40% of the SMs.
# Usage: benchmarks/seed3img_check.sh OUT_DIR   (carry .whl; about 7 minutes)
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/seed3img_check.sh OUT_DIR}"
stack one-gpu CUDA_VISIBLE_DEVICES=0 C32_REQUESTS=256 ONLY="seed3img-anchor-c32 seed3img-c32"
stack enc-per-gpu C32_REQUESTS=256 ONLY="parity seed3img-anchor-c32"
stack vision-gpu-devpool ENCODER_GPUS=1 DEVICE_POOL=1 C32_REQUESTS=256 ONLY="parity seed3img-anchor-c32"
{ python3 -m benchmarks.parity compare "$out/enc-per-gpu/parity.json" "$out/vision-gpu-devpool/parity.json"
  cmp "$out/enc-per-gpu/parity.json" "$out/vision-gpu-devpool/parity.json" && echo "identical files"; } > "$out/parity.log" 2>&1
stack mps40 CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_SM=40 ONLY="mixed mixed-text-only"
