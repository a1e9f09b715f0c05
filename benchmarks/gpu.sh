#!/usr/bin/env bash
# One command on the GPU machine: the 2b synthetic checkpoint, the stack under supervisord, the
# seed's workloads against it, then the transformers baseline on the same prompts.
# Usage: benchmarks/gpu.sh OUT_DIR      (env: GIT_REV, QUICK=1 for a short smoke run,
#        ONLY="seed3img-c32 mixed" to run just those workloads and no transformers baseline,
#        MPS=1 [MPS_SM=50] [MPS_DECODER_SM=70] [MPS_LOW_PRIORITY=false] to run the stack with the CUDA MPS
#        daemon, encoders (decoder ranks) capped at MPS_SM% (MPS_DECODER_SM%) of the SMs, the encoders' client
#        priority below the decoder's unless MPS_LOW_PRIORITY=false,
#        TP=2 for a tensor-parallel decoder over two GPUs, DEVICE_POOL=1 for the CUDA IPC embedding pool,
#        ENCODERS=N for N encoder processes instead of one per GPU, ENCODER_OVERLAP=1/0 for [encoder]
#        overlap_batches, ENCODER_GPUS=1 (a comma list) to place
#        the encoders on those GPUs: with the decoder on GPU 0, ENCODER_GPUS=1 gives vision its own GPU,
#        DECODING_BUDGET=512 for the decoder's tokens per step while streams decode, OVERLAP_MIXED=1/0 to
#        set [decoder] overlap_mixed (steps with prefill chunks staged ahead too; on by default),
#        DEVICE_POOL=1 SPILL_BYTES=N [POOL_BYTES=N] for the pool's host spill tier (a small pool spills),
#        REPLICAS=2 [TEXT_REPLICAS=0] [MEDIA_REPLICAS=1] for data-parallel decoder replicas (one GPU each) and
#        which take text-only requests and which take requests with media, REPLICA_GPUS=0,0 for each replica's
#        GPU (there: both on GPU 0),
#        C32_REQUESTS=256 for longer seed3img runs at 32 clients than the default 64, MIXED_REQUESTS=200 for a
#        longer mixed and control than the default 60 image requests, MIXED_STREAMS=64 for mixed's text streams
#        (default 32), DEAD_AFTER_S=20 for [liveness] dead_after_s (gpu.toml: 3), HOLD_S=0 for [liveness]
#        hold_lost_requests_s (the server's 30 otherwise), KILL_PROGRAM=decoder-1
#        KILL_AT=10 to SIGKILL that supervisord program KILL_AT seconds into mixed (supervisord restarts it; the
#        gateway's log says what it routed meanwhile))
set -uo pipefail
out=$(realpath -m "${1:?usage: benchmarks/gpu.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 VLM_CONFIG="$PWD/benchmarks/gpu.toml"
if [ "${MPS:-0}" = 1 ] || [ "${TP:-1}" != 1 ] || [ "${DEVICE_POOL:-0}" = 1 ] \
  || [ -n "${ENCODERS:-}${ENCODER_GPUS:-}${ENCODER_OVERLAP:-}${DECODING_BUDGET:-}${SPILL_BYTES:-}${POOL_BYTES:-}${OVERLAP_MIXED:-}${REPLICAS:-}${REPLICA_GPUS:-}${BLOCK_SIZE:-}${DEAD_AFTER_S:-}${HOLD_S:-}${SM_SPLIT:-}" ]; then  # variants of gpu.toml
  cp benchmarks/gpu.toml /tmp/gpu-variant.toml
  # DEVICE_POOL=1: the embedding pool in GPU memory, handed over by CUDA IPC
  [ "${DEVICE_POOL:-0}" = 1 ] && sed -i "/^\[cache\]/a device_pool = true" /tmp/gpu-variant.toml
  # SPILL_BYTES=N (with DEVICE_POOL=1): the host tier behind it; POOL_BYTES=N sizes the GPU pool (small: spills)
  [ -n "${SPILL_BYTES:-}" ] && sed -i "/^\[cache\]/a spill_bytes = ${SPILL_BYTES}" /tmp/gpu-variant.toml
  [ -n "${POOL_BYTES:-}" ] && sed -i "/^pool_bytes/d; /^\[cache\]/a pool_bytes = ${POOL_BYTES}" /tmp/gpu-variant.toml
  # MPS=1 [MPS_SM=percent]: the CUDA MPS daemon, encoders capped at MPS_SM% of the SMs (gpu.toml: off)
  [ "${MPS:-0}" = 1 ] && sed -i "s/^mps = false.*/mps = true\nmps_encoder_sm_percent = ${MPS_SM:-100}\nmps_decoder_sm_percent = ${MPS_DECODER_SM:-100}\nmps_encoder_low_priority = ${MPS_LOW_PRIORITY:-true}/" /tmp/gpu-variant.toml
  [ -n "${ENCODERS:-}" ] && sed -i "/^\[encoder\]/a count = ${ENCODERS}" /tmp/gpu-variant.toml
  # SM_SPLIT=96: [encoder] sm_split (the text decoder on the first 96 SMs, vision work on the rest)
  [ -n "${SM_SPLIT:-}" ] && sed -i "/^\[encoder\]/a sm_split = ${SM_SPLIT}" /tmp/gpu-variant.toml
  [ -n "${ENCODER_GPUS:-}" ] && sed -i "/^\[encoder\]/a gpus = [${ENCODER_GPUS}]" /tmp/gpu-variant.toml
  # ENCODER_OVERLAP=1 or 0: [encoder] overlap_batches (the next batch's forward queued before the last one's
  # rows are handed out)
  [ -n "${ENCODER_OVERLAP:-}" ] && sed -i "/^\[encoder\]/a overlap_batches = $([ "$ENCODER_OVERLAP" = 1 ] && echo true || echo false)" /tmp/gpu-variant.toml
  # TP=N: a tensor-parallel decoder over N GPUs (needs N GPUs; one encoder per GPU comes with them)
  [ "${TP:-1}" != 1 ] && sed -i "/^\[decoder\]/a tensor_parallel = ${TP}" /tmp/gpu-variant.toml
  # OVERLAP_MIXED=1 or 0: every decoder step staged while the previous one runs, prefill steps too (the
  # default since 78ae5c7), or only decode steps
  [ -n "${OVERLAP_MIXED:-}" ] && sed -i "/^\[decoder\]/a overlap_mixed = $([ "$OVERLAP_MIXED" = 1 ] && echo true || echo false)" /tmp/gpu-variant.toml
  # REPLICAS=N: N whole decoders (replica r on GPU r); TEXT_REPLICAS / MEDIA_REPLICAS (comma lists): which
  # replicas take text-only requests and which take requests with images (default: all)
  [ -n "${REPLICAS:-}" ] && sed -i "/^\[decoder\]/a replicas = ${REPLICAS}\ntext_replicas = [${TEXT_REPLICAS:-}]\nmedia_replicas = [${MEDIA_REPLICAS:-}]" /tmp/gpu-variant.toml
  # REPLICA_GPUS=0,0 (with REPLICAS): each replica's first GPU
  [ -n "${REPLICA_GPUS:-}" ] && sed -i "/^\[decoder\]/a replica_gpus = [${REPLICA_GPUS}]" /tmp/gpu-variant.toml
  # BLOCK_SIZE=N: the KV cache's tokens per block
  [ -n "${BLOCK_SIZE:-}" ] && sed -i "/^\[decoder\]/a block_size = ${BLOCK_SIZE}" /tmp/gpu-variant.toml
  # DEAD_AFTER_S=20: [liveness] dead_after_s (gpu.toml: the server's default, 3 s)
  [ -n "${DEAD_AFTER_S:-}" ] && sed -i "s/^dead_after_s = .*/dead_after_s = ${DEAD_AFTER_S}/" /tmp/gpu-variant.toml
  # HOLD_S=0: [liveness] hold_lost_requests_s (0: a lost request that nothing live can take fails at once)
  [ -n "${HOLD_S:-}" ] && sed -i "/^\[liveness\]/a hold_lost_requests_s = ${HOLD_S}" /tmp/gpu-variant.toml
  # DECODING_BUDGET=512: the decoder's tokens per step while any stream decodes
  [ -n "${DECODING_BUDGET:-}" ] && sed -i "/^\[decoder\]/a tokens_per_step_while_decoding = ${DECODING_BUDGET}" /tmp/gpu-variant.toml
  export VLM_CONFIG=/tmp/gpu-variant.toml
fi
log() { echo "[gpu.sh $(date +%T)] $*" | tee -a "$out/gpu.log"; }

. benchmarks/device.sh
use_carried_wheels
# ops/vlm.conf runs .venv/bin/python, so that becomes a thin wrapper around this python3.
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  rm -rf .venv && mkdir -p .venv/bin  # never write through a venv's python symlink
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > .venv/bin/python
  chmod +x .venv/bin/python
fi
py=.venv/bin/python
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; $py -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'; echo "rev ${GIT_REV:-unknown}"; } > "$out/machine.txt" 2>&1

model=${VLM_MODEL:-/tmp/qwen2-vl-2b-synth}
if [ ! -f "$model/config.json" ]; then
  log "generating the 2b synthetic checkpoint"
  $py -m workers.models.synth --size 2b --out "$model" --seed 0 >> "$out/gpu.log" 2>&1 || { log "synth failed"; exit 1; }
fi
export VLM_MODEL="$model"
url=http://127.0.0.1:8000

log "starting the stack"
logs=run/8000/logs
mkdir -p $logs && rm -f $logs/*.log  # this run's logs only
$py -m ops.deploy run/8000/supervisord.conf  # the run directory of benchmarks/gpu.toml (port 8000)
$py -m supervisor.supervisord -c run/8000/supervisord.conf > "$out/supervisord.out" 2>&1 &
supervisor=$!
trap 'cp $logs/*.log "$out/" 2>/dev/null' EXIT  # the logs come back however the run ends (a timeout too)
for _ in $(seq 1 240); do
  curl -sf "$url/health" >/dev/null && break
  sleep 1
done
curl -sf "$url/health" > /dev/null || { log "stack not healthy"; tail -n 30 $logs/*.log >> "$out/gpu.log"; kill $supervisor; exit 1; }
log "stack healthy"

# Greedy answers with logprobs, before any load (compare two runs with python -m benchmarks.parity compare)
if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" parity "* ]]; then
  log "parity: recording greedy answers"
  timeout 300 $py -m benchmarks.parity record --url "$url" --out "$out/parity.json" >> "$out/gpu.log" 2>&1 \
    || log "parity ended with status $?"
  curl -s "$url/metrics" > "$out/parity.metrics"  # which decoder replica answered how many
fi

quick() { [ "${QUICK:-0}" = 1 ]; }
c32_requests=${C32_REQUESTS:-64}  # the seed3img runs at 32 clients: 64 is two rounds, 256 a steady state
mixed_requests=${MIXED_REQUESTS:-60}  # mixed's image requests (at 6/s): 60 is a 10-s run, noisy by several points
n() { if quick; then echo "$2"; else echo "$1"; fi; }
bench() {  # name, time limit in seconds, args...
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
  if quick; then limit=25; fi
  log "workload $name: $*"
  # CPU per process and GPU use every 2 s while it runs: which process starves which
  top -b -d 2 -w 250 -c 2>/dev/null | grep --line-buffered -E "^top|^%Cpu|python" > "$out/$name.top" &
  local top_pid=$!
  nvidia-smi dmon -s pucm -d 2 > "$out/$name.dmon" 2>/dev/null &  # power, utilization, clocks, memory
  local dmon_pid=$!
  local killer_pid=
  if [ "$name" = mixed ] && [ -n "${KILL_PROGRAM:-}" ]; then
    (sleep "${KILL_AT:-10}"; log "killing $KILL_PROGRAM (SIGKILL)"
     $py -m supervisor.supervisorctl -c run/8000/supervisord.conf signal KILL "$KILL_PROGRAM" >> "$out/gpu.log" 2>&1
     for _ in $(seq 1 120); do  # when supervisord reports it running again (the gateway log: when it serves)
       $py -m supervisor.supervisorctl -c run/8000/supervisord.conf status "$KILL_PROGRAM" | grep -q RUNNING && break
       sleep 0.5
     done; log "$KILL_PROGRAM: $($py -m supervisor.supervisorctl -c run/8000/supervisord.conf status "$KILL_PROGRAM")") &
    killer_pid=$!
  fi
  timeout $((limit + 30)) $py -m benchmarks.serve --url "$url" --seed 0 --time-limit "$limit" --out "$out/$name.json" "$@" \
    >> "$out/gpu.log" 2>&1 \
    || log "workload $name ended with status $?"
  kill $top_pid $dmon_pid $killer_pid 2>/dev/null
  curl -s "$url/metrics" > "$out/$name.metrics"  # cumulative: stage histograms, cache and decoder counters
}
# --num-requests: requests; sessions of 3 turns for multiturn; image requests for mixed
# seed 4: images of its own (seed 0's first 8 requests, seed3img-c32's, would be cache hits there)
bench seed3img-c1 45 --workload seed3img --concurrency 1 --num-requests "$(n 8 2)" --seed 4
bench seed3img-c32 90 --workload seed3img --concurrency 32 --num-requests "$(n "$c32_requests" 8)"
quick && { log "QUICK: stopping after two workloads"; kill -TERM $supervisor; wait $supervisor; cp $logs/*.log "$out/" 2>/dev/null; exit 0; }
# ANCHORS' vLLM rows exactly: 3 photos of 768x1024 (~3,130 prompt tokens; ours average ~3,490), 120 tokens
bench seed3img-anchor-c32 90 --workload seed3img --concurrency 32 --num-requests "$(n "$c32_requests" 8)" --seed 3 \
  --image-size 768x1024 --max-tokens-spread 0
# (seed 5: a session's first turn is seed3img's request of the same index; with seed 0 all 32 first turns
# were cache hits of seed3img-c32's images and prefixes)
bench multiturn-c32 90 --workload multiturn --concurrency 32 --num-requests "$(n 32 4)" --seed 5
bench text-c16 30 --workload text --concurrency 16 --num-requests "$(n 32 4)"
# ANCHORS' isolation rows: 32 text streams of 1,000 in / 256 out, 3-image requests arriving at 6/s; the
# control run sends streams of the same shape for as long without images; seed 1: images seed3img's runs did not cache
# (image requests as ANCHORS' exactly, 3 photos of 768x1024 and 120 tokens, since after session 5's runs)
anchor_images=(--image-size 768x1024 --max-tokens-spread 0)
streams=${MIXED_STREAMS:-32}
bench mixed 90 --workload mixed --concurrency "$streams" --vision-rate 6 --num-requests "$(n "$mixed_requests" 6)" --seed 1 "${anchor_images[@]}"
# (seed 2: text prompts of their own; with mixed's, they hit the prefix cache mixed filled, a control too easy)
bench mixed-text-only 90 --workload mixed --concurrency "$streams" --vision-rate 6 --num-requests "$(n "$mixed_requests" 6)" --seed 2 --vision-off \
  "${anchor_images[@]}"
bench text-c1 30 --workload text --concurrency 1 --num-requests "$(n 8 2)" --seed 6  # (not text-c16's prompts)

log "stopping the stack"
kill -TERM $supervisor; wait $supervisor
cp $logs/*.log "$out/" 2>/dev/null

[ -n "${ONLY:-}" ] && { log "ONLY: no transformers baseline"; exit 0; }
log "transformers baseline"
timeout 120 $py -m benchmarks.baseline_hf --model "$model" --workload seed3img --batch-sizes 1,8 \
  --num-requests "$(n 8 2)" --seed 0 --device cuda --dtype bfloat16 --out "$out/hf-seed3img.json" >> "$out/gpu.log" 2>&1 \
  || log "baseline ended with status $?"
log "done"
