#!/usr/bin/env bash
# GPU correctness checks and kernel timings, for the GPU machine (run before benchmarks/gpu.sh).
# Usage: benchmarks/gpu_checks.sh OUT_DIR        (carry .whl; see benchmarks/gpu.sh for why)
# Writes: pytest-gpu.log (tests marked gpu: kernels vs references, paged forward, sampling, model
# parity with transformers in bf16), kernels-bench.log (decode attention GB/s vs 4.8 TB/s), engine.json/.log
# (benchmarks.engine on the 2b checkpoint).
set -uo pipefail
out=$(realpath -m "${1:?usage: benchmarks/gpu_checks.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
. benchmarks/device.sh
use_carried_wheels
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__)'
  echo "rev ${GIT_REV:-unknown}"; } > "$out/machine.txt" 2>&1
# faulthandler: a test still running after 150 s prints every thread's stack (a hung collective shows where)
timeout "${CHECKS_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=150 \
  tests/gpu tests/unit/test_paged.py tests/unit/test_sampling.py tests/unit/test_model_parity.py \
  > "$out/pytest-gpu.log" 2>&1
echo "pytest exit $?" >> "$out/pytest-gpu.log"
timeout "${BENCH_TIMEOUT:-120}" python3 -m workers.kernels.bench > "$out/kernels-bench.log" 2>&1
echo "bench exit $?" >> "$out/kernels-bench.log"
# The engine-level benchmark (decode / prefill / engine step vs transformers and the roofline) on the 2b model.
model=${VLM_MODEL:-/tmp/qwen2-vl-2b-synth}
[ -f "$model/config.json" ] || python3 -m workers.models.synth --size 2b --out "$model" --seed 0 > /dev/null 2>&1
timeout "${ENGINE_TIMEOUT:-280}" python3 -m benchmarks.engine --model "$model" --out "$out/engine.json" \
  > "$out/engine.log" 2>&1
echo "engine bench exit $?" >> "$out/engine.log"
