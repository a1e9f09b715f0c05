#!/usr/bin/env bash
# Issue 7's GPU acceptance in one call on a two-GPU kind: the 7b-shaped checkpoint at TP 1 and TP 2 against
# transformers (bf16), time per token and seed3img at 32 clients for both, the two-GPU test (stacks dumped if
# it hangs), and seed3img with one encoder per GPU vs one encoder (2b).
# Usage: benchmarks/tp_check.sh OUT_DIR     (carry .whl; about 8 minutes with the checkpoints' generation)
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/tp_check.sh OUT_DIR}"
m7b=/tmp/m7b m2b=/tmp/qwen2-vl-2b-synth
[ -f $m7b/config.json ] || python3 -m workers.models.synth --size 7b --out $m7b --seed 0 > "$out/synth7b.log" 2>&1 &
[ -f $m2b/config.json ] || python3 -m workers.models.synth --size 2b --out $m2b --seed 0 > "$out/synth2b.log" 2>&1
timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider -o faulthandler_timeout=120 tests/gpu/test_tp_gpu.py \
  > "$out/pytest-tp.log" 2>&1; echo "pytest exit $?" >> "$out/pytest-tp.log"
if [ "${ENCODER_RUNS:-1}" = 1 ]; then  # ENCODER_RUNS=0: only the TP runs (the encoder comparison needs ~3 min)
  stack enc-per-gpu ONLY="seed3img-c32"
  stack enc-one ENCODERS=1 ONLY="seed3img-c32"
fi
wait
timeout 120 python3 -m benchmarks.parity reference --model $m7b --out "$out/hf-7b.json" > "$out/hf-7b.log" 2>&1
stack tp1 VLM_MODEL=$m7b CUDA_VISIBLE_DEVICES=0 ONLY="parity text-c1 seed3img-c32"
stack tp2 VLM_MODEL=$m7b TP=2 ONLY="parity text-c1 seed3img-c32"
for run in tp1 tp2; do
  { echo "== transformers bf16 vs $run"; python3 -m benchmarks.parity compare "$out/hf-7b.json" "$out/$run/parity.json"; } \
    >> "$out/parity.log" 2>&1
done
{ echo "== tp1 vs tp2"; python3 -m benchmarks.parity compare "$out/tp1/parity.json" "$out/tp2/parity.json"; } >> "$out/parity.log" 2>&1
