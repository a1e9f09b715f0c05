#!/usr/bin/env bash
# The stack on one GPU under CUDA MPS at several SM splits between encoder and decoder, plus no MPS.
# Usage: benchmarks/mps_sweep.sh OUT_DIR ["ENC/DEC ENC/DEC/normal ..."]   (default: "none 60/100 50/70 40/60 30/50")
# ENC/DEC: the encoders' and the decoder's SM caps in percent; /normal: the encoders keep MPS's normal client
# priority instead of yielding to the decoder.
# Each point is benchmarks/gpu.sh with ONLY="$WORKLOADS" (default "seed3img-c32 mixed mixed-text-only"; about
# 90 s, at most 150), into OUT_DIR/<point>/; the summary lines go to OUT_DIR/sweep.log. Carry .whl (see benchmarks/gpu.sh).
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/mps_sweep.sh OUT_DIR [points]}"
points=${2:-"none 60/100 50/70 40/60 30/50"}
workloads=${WORKLOADS:-"seed3img-c32 mixed mixed-text-only"}
for point in $points; do
  name=${point//\//-}
  if [ "$point" = none ]; then
    stack_into "$out" "$name" CUDA_VISIBLE_DEVICES=0 ONLY="$workloads"
  else
    IFS=/ read -r enc dec priority <<< "$point"
    low=true; [ "${priority:-}" = normal ] && low=false
    stack_into "$out" "$name" CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_SM="$enc" MPS_DECODER_SM="$dec" \
      MPS_LOW_PRIORITY=$low ONLY="$workloads"
  fi
  { echo "== $point"; grep -E "^\[(all|stream_kind=text)\]|tpot|itl" "$out/$name/gpu.log"; } >> "$out/sweep.log"
done
