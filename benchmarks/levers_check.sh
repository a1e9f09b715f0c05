#!/usr/bin/env bash
# The one-GPU levers for issue 5's acceptance 7, measured: where the vision tower's time goes and what
# faster kernels would buy (benchmarks.vit_profile); seed3img (anchor, 256 requests) with the CUDA MPS
# daemon uncapped against none; the pool's host spill tier under load against the same small pool alone.
# Usage: SHIP=$OUT benchmarks/levers_check.sh OUT_DIR   (carry .whl; about 8 minutes)
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/levers_check.sh OUT_DIR}"
mkdir -p "$out/vit"
synth_2b > "$out/vit/synth.log" 2>&1
python3 -m benchmarks.vit_profile --model /tmp/qwen2-vl-2b-synth --out "$out/vit/vit_profile.json" > "$out/vit/vit_profile.log" 2>&1
ship vit
stack none CUDA_VISIBLE_DEVICES=0 C32_REQUESTS=256 ONLY="seed3img-anchor-c32"
stack mps CUDA_VISIBLE_DEVICES=0 MPS=1 C32_REQUESTS=256 ONLY="seed3img-anchor-c32"
ship none; ship mps
small_pool=(CUDA_VISIBLE_DEVICES=0 DEVICE_POOL=1 POOL_BYTES=536870912 C32_REQUESTS=256 ONLY="seed3img-anchor-c32 multiturn-c32")
stack spill "${small_pool[@]}" SPILL_BYTES=8589934592
ship spill
stack no-spill "${small_pool[@]}"
ship no-spill
