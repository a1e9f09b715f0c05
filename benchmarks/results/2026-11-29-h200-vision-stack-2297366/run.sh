#!/usr/bin/env bash
# session 4, device call A (nvidia-h200): GPU tests, vision bench, stack workloads
set -u
export GIT_REV=$1 PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
(python3 -m workers.models.synth --size 2b --out /tmp/qwen2-vl-2b-synth --seed 0 > $R/synth.log 2>&1) &
synth=$!
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu > $R/pytest-gpu.log 2>&1; echo "pytest exit $?" >> $R/pytest-gpu.log
wait $synth
timeout 110 python3 -m benchmarks.vision --model /tmp/qwen2-vl-2b-synth --out $R/vision.json > $R/vision.log 2>&1; echo "vision exit $?" >> $R/vision.log
ONLY="seed3img-c32 mixed mixed-text-only" timeout 250 benchmarks/gpu.sh $R/stack
tar czf $OUT/a.tgz -C $R .
