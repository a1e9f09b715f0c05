#!/usr/bin/env bash
# Where the encoders run, on a two-GPU kind (2b-shaped): seed3img at 32 clients with one encoder per GPU vs
# one encoder in all (issue 7), and the decoder alone on GPU 0 with vision on GPU 1 ([encoder] gpus = [1]),
# through seed3img, mixed and its control (issue 5). First, the two-GPU TP test (its ranks dump their
# stacks if they hang) and a TP 2 stack stopped by supervisord: OUT_DIR/tp2-stop/sigkill.txt lists the
# ranks it had to kill (none, if they leave the NCCL group in time).
# Usage: benchmarks/placement_check.sh OUT_DIR   (carry .whl; about 7 minutes)
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/placement_check.sh OUT_DIR}"
m2b=/tmp/qwen2-vl-2b-synth
[ -f $m2b/config.json ] || python3 -m workers.models.synth --size 2b --out $m2b --seed 0 > "$out/synth2b.log" 2>&1 &
timeout 110 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_tp_gpu.py > "$out/pytest-tp.log" 2>&1
echo "pytest exit $?" >> "$out/pytest-tp.log"
wait
stack tp2-stop TP=2 ONLY="text-c1"
grep -i sigkill "$out/tp2-stop/supervisord.out" > "$out/tp2-stop/sigkill.txt"
echo "ranks killed: $(wc -l < "$out/tp2-stop/sigkill.txt")" >> "$out/tp2-stop/sigkill.txt"
stack vision-gpu ENCODER_GPUS=1 ONLY="seed3img-c32 mixed mixed-text-only"
stack enc-per-gpu ONLY="seed3img-c32"
stack enc-one ENCODERS=1 ONLY="seed3img-c32"
