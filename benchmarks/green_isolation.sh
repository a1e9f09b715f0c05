#!/usr/bin/env bash
# Green contexts under MPS (benchmarks/green_isolation.py): the SMs each side's kernels ran on, then a decode-like
# step's times alone and beside back-to-back matrix products: both on the whole GPU (what MPS alone gives), and
# the step on the first SPLIT SMs with the products on the rest. Usage: benchmarks/green_isolation.sh OUT_DIR
set -u
out=${1:?usage: benchmarks/green_isolation.sh OUT_DIR}
split=${SPLIT:-96}
mkdir -p "$out"
work=$(mktemp -d /tmp/green.XXXXXX)
mkdir -p "$work/pipe" "$work/log"
export CUDA_MPS_PIPE_DIRECTORY=$work/pipe CUDA_MPS_LOG_DIRECTORY=$work/log
nvidia-cuda-mps-control -d
sleep 1
run() { python3 -m benchmarks.green_isolation --out "$out/green.jsonl" --sms "$split" "$@"; }
pair() {  # label, victim side, aggressor side: the products start first and outlast the step's timing
  nvidia-smi dmon -s puc -d 1 > "$out/$1.dmon" 2>/dev/null &  # power and clocks: does the GPU throttle?
  local dmon=$!
  run --role aggressor --side "$3" --seconds 14 --label "$1" &
  local products=$!
  sleep 5
  run --role victim --side "$2" --seconds 6 --label "$1"
  wait $products
  kill $dmon 2>/dev/null
}
{
  run --role smids --side first --label first
  run --role smids --side rest --label rest
  run --role victim --side all --label alone-all
  nvidia-smi dmon -s puc -d 1 > "$out/alone.dmon" 2>/dev/null &
  alone_dmon=$!
  run --role victim --side first --label alone-first
  kill $alone_dmon 2>/dev/null
  run --role aggressor --side rest --seconds 6 --label alone-rest
  pair both-all all all
  pair split first rest
  pair victim-first-only first all
} > "$out/green.log" 2>&1
echo quit | nvidia-cuda-mps-control
sleep 1
python3 - "$out/green.jsonl" >> "$out/green.log" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ids = {r["label"]: set(r["smids"]) for r in rows if r["role"] == "smids"}
if len(ids) == 2:
    # (under MPS %smid is the client's own numbering: the two lists overlap however the SMs are placed; the
    # timings below tell; tests/gpu/test_sm_partition_gpu.py checks the placement without MPS)
    print("SM ids seen: first", len(ids["first"]), "rest", len(ids["rest"]))
for r in rows:
    if r["role"] != "smids":
        print(r["label"], r["role"], r["side"], {k: r[k] for k in ("median_ms", "p99_ms", "tflops") if k in r})
PY
rm -rf "$work"
