#!/usr/bin/env bash
# The one-GPU levers for issue 5's acceptance 6 and 7, measured. Parts (PARTS="..." picks some, in order):
#   tests     the GPU tests of the vision tower, the kernels and the engine
#   vit       where the vision tower's time goes, what faster kernels would buy (benchmarks.vit_profile)
#   none mps  seed3img (anchor, 256 requests) without and with the CUDA MPS daemon (encoders uncapped)
#   mps-normal-priority mps-decoder-sm70   seed3img with MPS, the encoders' clients at normal priority, or the
#                    decoder capped at 70% of the SMs (the ViT is seed3img's bottleneck: its share under MPS)
#   mixed-mps-normal-priority   mixed and its control with MPS, the encoders' clients at normal priority
#   mixed-mps-decoder-sm70   mixed and its control with MPS, the decoder capped at 70% of the SMs
#   mixed-none mixed-mps   mixed and its control, 200 image requests, without and with MPS
#   control control-staged control-staged-512   text alone (32 streams) without [decoder] overlap_mixed, with
#                    it (the default since 78ae5c7), and with it and 512 tokens per step while streams decode
#   spill no-spill   the pool's host spill tier under load, against the same small GPU pool alone
#   engine-mixed     the decoder engine alone under mixed's load (benchmarks.engine_mixed): media rows in host
#                    memory (as the host pool), on the GPU, and with overlap_mixed; a profile of the first
#   decode-profile   the kernels of a 2b decode graph at batch 32 (1,000 and 3,000 tokens of context): where a
#                    decode step's 2.3 ms go (its weights alone need about 0.6 ms at the HBM's bandwidth)
#   decode-mix       decode-graph step times at batch 32..48 and with a few long (image) contexts among 32 text
#                    ones, captured as the server does (max context 32,768): why mixed's decode steps are 22% slower
#   decode-splits    those decode steps with the attention's split count aimed at 2, 4, 8 and 16 programs per SM
#   skinny-gemm      the 2b's decode projections (batch 32) through workers.kernels.skinny_gemm, each tile shape
#                    of a small grid checked and timed against cuBLAS (benchmarks.decode_gemms --triton); then
#                    decode graphs and engine-mixed with the shapes that won (--skinny-tiles) and without
#   decode-tiles     decode attention's tile shapes swept (workers.kernels.bench --tiles-sweep, 2b and 7b, batch 1/32/64,
#                    1,100 and 3,100 keys); then decode graphs and engine-mixed with the best shape and with DECODE_TILES
#   decode-per-seq   the kernel and engine GPU tests, then decode graphs with decode attention's program per sequence
#                    (DECODE_PROGRAM_PER_SEQUENCE) and with the general grid's search, alternating
#   decode-per-seq-engine   engine-mixed with the two, one run each
#   block-size       the KV cache's tokens per block ([decoder] block_size, 16 by default): decode attention
#                    (workers.kernels.bench) at 16, 32, 64 and 128, the prefill cases (bench_prefill, default tiles),
#                    decode graphs and engine-mixed at 16 and 64. A tile of 64 keys spans 4 blocks of 16: a table
#                    read per key and a gather; in blocks of 64 or more, one read and a contiguous run of slots
#   mixed-steps      single engine steps from their graphs (benchmarks.mixed_step): decodes alone, prompts alone, and
#                    the two together as mixed's steps hold them (text prompts, an image prompt's chunks); then the
#                    kernels of three of them: where a step with prompt tokens spends the ~2 ms over a decode step
#   step-inputs      engine-mixed with mixed steps' inputs built in one go (the default since 14d3257) and span by span
#                    (--per-span-inputs), alternating, twice each: the host time a mixed step waited on
#   decode-gemms     each projection of a decode layer at batch 1..64 per BLAS library, against HBM bandwidth
#   engine-mixed-defaults   engine-mixed at the server's defaults only
#   balanced-splits  decode steps with the attention's splits of one length for the whole batch (on by default
#                    since 2026-11-30), against one split count for all, on skewed context lengths; and engine-mixed
#   balanced-ab      engine-mixed with balanced splits and without, twice each, alternating
#   engine-budgets   engine-mixed at 1,024, 512, 256 and 128 tokens per step while streams decode (the default is 2,048):
#                    the text streams' ITL p99 against their throughput when image prompts come in smaller chunks
#   prefill          the attention's prefill tile sweep (workers.kernels.bench_prefill), then engine-mixed at the
#                    server's defaults, with the sweep's best tiles, and without overlap_mixed
#   overlap-batches  seed3img-anchor (MPS, the defaults) and the greedy parity prompts with [encoder] overlap_batches
#                    off and on, the two parity records compared (the same answers, within bf16 tolerance)
#   mixed-overlap-ab mixed and its control (MPS, 200 image requests) with [encoder] overlap_batches off, then on
#   device-pool-ab   the greedy parity prompts and seed3img-anchor (no MPS) with the host embedding pool,
#                    then with [cache] device_pool (CUDA IPC), the parity records compared: the encoder's GPU-pool
#                    path with overlap_batches (a slot on the tower's device is covered by the batch's event)
#   mixed-vision-gpu1   mixed and its control on two GPUs: the decoder on GPU 0, the encoder on GPU 1 alone
#                    ([encoder] gpus = [1]; needs a two-GPU kind), no MPS
#   mixed-dp-routed  mixed and its control on two GPUs, two decoder replicas routed by modality: text-only requests
#                    to replica 0 (GPU 0), requests with images to replica 1 (GPU 1) beside the encoder
#                    ([decoder] replicas = 2, text_replicas = [0], media_replicas = [1], [encoder] gpus = [1]), MPS
#   mixed-dp-routed-none   mixed-dp-routed without MPS
#   mixed-dp-routed-kill   mixed-dp-routed with the media replica (decoder-1) SIGKILLed 10 s into mixed, at
#                    [liveness] dead_after_s = 20 (gpu.toml's until session 14): the gateway sees the replica
#                    only as restarted, its requests not yet started go to the new process
#   mixed-dp-routed-kill3  the same at dead_after_s = 3 (the server's default): the replica is called dead before
#                    it is back; its requests and the next image requests go to replica 0 (kind_fallback) meanwhile
#   mixed-kill-one-gpu   mixed on one GPU (MPS, the defaults) with the lone decoder SIGKILLed 10 s in: its requests
#                    that no token had come for are held until supervisord has it back ([liveness]
#                    hold_lost_requests_s); -nohold: the same at hold_lost_requests_s = 0 (they fail at once)
#   liveness-3s      seed3img-anchor (256 requests) and mixed on one GPU with MPS at dead_after_s = 3: is any
#                    worker called dead under load? (gpu.toml has 3 since session 14; 20 before)
#   mixed-dp-routed-c64    mixed-dp-routed at 64 text streams (where one gateway process starts to limit)
#   mixed-routed-one-gpu   mixed and its control on ONE GPU with two decoder replicas routed by modality, both
#                    on GPU 0 ([decoder] replica_gpus = [0, 0]) beside the encoder, MPS: the media replica runs with
#                    the encoder's priority (below the text replica's); -smN (e.g. -sm50) caps the encoder and
#                    the media replica at N% of the SMs; -normal gives them normal priority
#   mixed-dp         the same with both replicas taking both kinds and an encoder on each GPU, MPS
#   seed3img-dp      seed3img-anchor (256 requests) with two replicas taking both kinds, an encoder on each GPU, MPS
#   parity-block-size   the greedy parity prompts with KV blocks of 16 tokens, then 64, the records compared
#   parity-dp        the greedy parity prompts from one decoder on GPU 0, then from two replicas (the prompts go to
#                    either: their openings differ), the records compared: a replica on GPU 1 answers as GPU 0 does
#   overlap-mixed    mixed and its control (MPS, 200 image requests) with [decoder] overlap_mixed; and
#                    seed3img-anchor with it (compare with mixed-mps and mps)
#   green-isolation  green contexts under MPS (benchmarks/green_isolation.sh): disjoint SMs, and a decode-like step
#                    beside matrix products with and without them
#   mixed-split-N    mixed and its control on one GPU, MPS, the decoder on the first N SMs and the encoder on the
#                    rest, each in a green context ([encoder] sm_split = N)
#   mixed-routed-split-N   the same with two replicas routed by modality on GPU 0: the text replica on the first N
#                    SMs, the encoder and the media replica on the rest
#   mps-static-probe   whether MPS offers static SM partitions here (benchmarks/mps_static_probe.sh), and green contexts
# A part named twice takes a suffix for its folder: PARTS="none mps none@2 mps@2".
# Usage: SHIP=$OUT [PARTS="vit mps"] benchmarks/levers_check.sh OUT_DIR   (carry .whl; all: about 10 minutes)
set -uo pipefail
. "$(dirname "$0")/device.sh"
begin_check "$0" "${1:?usage: benchmarks/levers_check.sh OUT_DIR}"
# Decode graphs of the 2b checkpoint, timed or profiled by benchmarks.engine (its --decode-mix and more in "$@").
decode_graphs() { python3 -m benchmarks.engine --model /tmp/qwen2-vl-2b-synth --out /dev/null "$@"; }
# benchmarks.engine_mixed on the 2b checkpoint into the part's folder as NAME.json and NAME.log (options in "$@").
engine_mixed() {  # name, options...
  local name=$1; shift
  python3 -m benchmarks.engine_mixed --model /tmp/qwen2-vl-2b-synth --out "$out/$dir/$name.json" "$@" \
    > "$out/$dir/$name.log" 2>&1
}
small_pool=(CUDA_VISIBLE_DEVICES=0 DEVICE_POOL=1 POOL_BYTES=536870912 C32_REQUESTS=256 ONLY="seed3img-anchor-c32 multiturn-c32")
for entry in ${PARTS:-tests vit none mps mixed-none mixed-mps spill no-spill}; do
  part=${entry%@*} dir=${entry/@/-}
  case $part in
    mps-static-probe) benchmarks/mps_static_probe.sh "$out/$dir" ;;
    green-isolation) benchmarks/green_isolation.sh "$out/$dir" ;;
    tests) mkdir -p "$out/$dir"
      python3 -m pytest -q -m gpu tests/gpu/test_vision_gpu.py tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py \
        > "$out/$dir/pytest.log" 2>&1 ;;
    vit) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      python3 -m benchmarks.vit_profile --model /tmp/qwen2-vl-2b-synth --out "$out/$dir/vit_profile.json" > "$out/$dir/vit_profile.log" 2>&1 ;;
    engine-mixed) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for variant in "cpu --no-overlap-mixed" "cuda --no-overlap-mixed" "cpu --overlap-mixed"; do
        name=$(echo "$variant" | tr -d ' -')
        extra=(); [ "$name" = cpunooverlapmixed ] && extra=(--profile)
        engine_mixed "$name" --media $variant "${extra[@]}"
      done ;;
    decode-profile) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for context in 1000 3000; do
        decode_graphs --profile-decode --decode-mix 32x$context > "$out/$dir/decode-32x$context.log" 2>&1
      done ;;
    decode-mix) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      decode_graphs --time-decode --graph-max-context 32768 \
        --decode-mix 32x1100 33x1100 36x1100 40x1100 48x1100 32x1100+3x3100 35x1100 32x1100+3x6100 > "$out/$dir/times.log" 2>&1
      decode_graphs --profile-decode --graph-max-context 32768 \
        --decode-mix 32x1100+3x3100 40x1100 > "$out/$dir/profile.log" 2>&1 ;;
    decode-splits) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      decode_graphs --time-decode --graph-max-context 32768 \
        --decode-mix 32x1100 32x1100+3x3100 32x1100+3x6100 64x1100 8x1100 1x1100 1x8000 \
        --split-programs-per-sm 2 4 8 16 > "$out/$dir/times.log" 2>&1 ;;
    balanced-splits) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for flag in --no-balanced-splits --balanced-splits; do
        decode_graphs --time-decode --graph-max-context 32768 \
          --decode-mix 32x1100 32x1100+3x3100 32x1100+3x6100 31x1100+1x30000 64x1100 128x600+1x20000 1x8000 \
          --split-programs-per-sm 4 8 $flag >> "$out/$dir/times.log" 2>&1
      done
      engine_mixed engine-mixed --balanced-splits ;;
    balanced-ab) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for run in 1 2; do
        for flag in balanced-splits no-balanced-splits; do
          engine_mixed "$flag-$run" --$flag
        done
      done ;;
    skinny-gemm) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      tuned="$out/$dir/gemms.json"
      python3 -m benchmarks.decode_gemms --models 2b --triton --no-blas --out "$tuned" > "$out/$dir/gemms.log" 2>&1
      for variant in cublas skinny; do
        extra=(); [ $variant = skinny ] && extra=(--skinny-tiles "$tuned")
        decode_graphs --time-decode --graph-max-context 32768 --decode-mix 1x1100 8x1100 32x1100 64x1100 \
          32x1100+3x3100 "${extra[@]}" > "$out/$dir/decode-$variant.log" 2>&1
        engine_mixed "engine-mixed-$variant" "${extra[@]}"
      done ;;
    decode-tiles) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      sweep="$out/$dir/sweep.json"
      python3 -m workers.kernels.bench --tiles-sweep --models 2b,7b --batches 1,32,64 --contexts 1100,3100 \
        --out "$sweep" > "$out/$dir/sweep.log" 2>&1
      for variant in default best; do
        extra=(); [ $variant = best ] && extra=(--decode-tiles "$sweep")
        decode_graphs --time-decode --graph-max-context 32768 --decode-mix 1x1100 32x1100 35x1100 64x1100 \
          32x1100+3x1500 32x1100+3x3100 "${extra[@]}" > "$out/$dir/decode-$variant.log" 2>&1
        engine_mixed "engine-mixed-$variant" "${extra[@]}"
      done ;;
    decode-per-seq) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py > "$out/$dir/pytest.log" 2>&1
      for flag in decode-program-per-sequence no-decode-program-per-sequence; do
        decode_graphs --time-decode --graph-max-context 32768 --decode-mix 1x1100 32x1100 35x1100 64x1100 \
          32x1100+3x3100 128x600+1x20000 --$flag > "$out/$dir/decode-$flag.log" 2>&1
      done ;;
    decode-per-seq-engine) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for flag in decode-program-per-sequence no-decode-program-per-sequence; do
        engine_mixed "engine-mixed-$flag" --$flag
      done ;;
    block-size) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for bs in 16 32 64 128; do
        python3 -m workers.kernels.bench --models 2b,7b --batches 1,32,64 --contexts 1100,3100 --block-size $bs \
          > "$out/$dir/decode-attention-$bs.log" 2>&1
        python3 -m workers.kernels.bench_prefill --models 2b --default-only --block-size $bs \
          --out "$out/$dir/prefill-$bs.json" > "$out/$dir/prefill-$bs.log" 2>&1
      done
      for bs in 16 64; do
        decode_graphs --time-decode --graph-max-context 32768 --block-size $bs --decode-mix 1x1100 32x1100 35x1100 \
          64x1100 32x1100+3x3100 > "$out/$dir/decode-graphs-$bs.log" 2>&1
        engine_mixed "engine-mixed-bs$bs" --block-size $bs
      done ;;
    mixed-steps) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      python3 -m benchmarks.mixed_step --model /tmp/qwen2-vl-2b-synth --step 32x1100 35x1100 2000:2000 \
        1000:1000+1000:1000 32x1100+1000:1000+1000:1000 32x1100+2016:2016 32x1100+1352:3400 32x1100+16:1000 \
        > "$out/$dir/times.log" 2>&1
      python3 -m benchmarks.mixed_step --model /tmp/qwen2-vl-2b-synth --profile --step 32x1100 \
        32x1100+1000:1000+1000:1000 32x1100+1352:3400 > "$out/$dir/profile.log" 2>&1 ;;
    step-inputs) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for round in 1 2; do
        engine_mixed "batched-$round"
        engine_mixed "per-span-$round" --per-span-inputs
      done ;;
    decode-gemms) mkdir -p "$out/$dir"
      python3 -m benchmarks.decode_gemms --models 2b 7b --out "$out/$dir/gemms.json" > "$out/$dir/gemms.log" 2>&1 ;;
    engine-mixed-defaults) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      engine_mixed default ;;
    engine-budgets) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      for budget in 1024 512 256 128; do
        engine_mixed "budget-$budget" --decoding-budget $budget
      done ;;
    prefill) mkdir -p "$out/$dir"
      synth_2b > "$out/$dir/synth.log" 2>&1
      python3 -m workers.kernels.bench_prefill --out "$out/$dir/sweep.json" > "$out/$dir/sweep.log" 2>&1
      for variant in default tuned no-overlap; do
        extra=()
        [ "$variant" = tuned ] && extra=(--prefill-tiles "$out/$dir/sweep.json")
        [ "$variant" = no-overlap ] && extra=(--no-overlap-mixed)
        engine_mixed "$variant" "${extra[@]}"
      done ;;
    none) stack "$dir" CUDA_VISIBLE_DEVICES=0 C32_REQUESTS=256 ONLY="seed3img-anchor-c32" ;;
    mps) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 C32_REQUESTS=256 ONLY="seed3img-anchor-c32" ;;
    mixed-mps-decoder-sm70) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_DECODER_SM=70 MIXED_REQUESTS=200 \
      ONLY="mixed mixed-text-only" ;;
    mps-normal-priority) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_LOW_PRIORITY=false C32_REQUESTS=256 \
      ONLY="seed3img-anchor-c32" ;;
    mps-decoder-sm70) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_DECODER_SM=70 C32_REQUESTS=256 \
      ONLY="seed3img-anchor-c32" ;;
    mixed-none) stack "$dir" CUDA_VISIBLE_DEVICES=0 MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    overlap-batches) mkdir -p "$out/$dir"
      for setting in 0 1; do
        stack "$dir/overlap-$setting" CUDA_VISIBLE_DEVICES=0 MPS=1 ENCODER_OVERLAP=$setting C32_REQUESTS=256 \
          ONLY="parity seed3img-anchor-c32"
      done
      python3 -m benchmarks.parity compare "$out/$dir/overlap-0/parity.json" "$out/$dir/overlap-1/parity.json" \
        > "$out/$dir/parity-compare.log" 2>&1; echo "compare exit $?" >> "$out/$dir/parity-compare.log" ;;
    mixed-overlap-ab) mkdir -p "$out/$dir"
      for setting in 0 1; do
        stack "$dir/overlap-$setting" CUDA_VISIBLE_DEVICES=0 MPS=1 ENCODER_OVERLAP=$setting MIXED_REQUESTS=200 \
          ONLY="mixed mixed-text-only"
      done ;;
    device-pool-ab) mkdir -p "$out/$dir"
      for pool in 0 1; do
        stack "$dir/device-pool-$pool" CUDA_VISIBLE_DEVICES=0 DEVICE_POOL=$pool C32_REQUESTS=256 \
          ONLY="parity seed3img-anchor-c32"
      done
      python3 -m benchmarks.parity compare "$out/$dir/device-pool-0/parity.json" "$out/$dir/device-pool-1/parity.json" \
        > "$out/$dir/parity-compare.log" 2>&1; echo "compare exit $?" >> "$out/$dir/parity-compare.log" ;;
    mixed-vision-gpu1) stack "$dir" ENCODER_GPUS=1 MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-dp-routed) stack "$dir" REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 ENCODER_GPUS=1 MPS=1 MIXED_REQUESTS=200 \
      ONLY="mixed mixed-text-only" ;;
    mixed-dp-routed-none) stack "$dir" REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 ENCODER_GPUS=1 MPS=0 \
      MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-dp-routed-kill) stack "$dir" REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 ENCODER_GPUS=1 MPS=1 \
      MIXED_REQUESTS=200 KILL_PROGRAM=decoder-1 KILL_AT=10 DEAD_AFTER_S=20 ONLY="mixed" ;;
    mixed-dp-routed-kill3) stack "$dir" REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 ENCODER_GPUS=1 MPS=1 \
      MIXED_REQUESTS=200 KILL_PROGRAM=decoder-1 KILL_AT=10 DEAD_AFTER_S=3 ONLY="mixed" ;;
    liveness-3s) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 DEAD_AFTER_S=3 C32_REQUESTS=256 MIXED_REQUESTS=200 \
      ONLY="seed3img-anchor-c32 mixed"
      grep -hE "not responding|restarted|re-issuing|sent again|is silent|WARNING" "$out/$dir"/*.log > "$out/$dir/deaths.txt" ;;
    mixed-dp-routed-c64) stack "$dir" REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 ENCODER_GPUS=1 MPS=1 \
      MIXED_REQUESTS=200 MIXED_STREAMS=64 ONLY="mixed mixed-text-only" ;;
    mixed-routed-one-gpu) stack "$dir" CUDA_VISIBLE_DEVICES=0 REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 \
      REPLICA_GPUS=0,0 MPS=1 MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-routed-one-gpu-sm*) stack "$dir" CUDA_VISIBLE_DEVICES=0 REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 \
      REPLICA_GPUS=0,0 MPS=1 MPS_SM="${part##*-sm}" MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-split-*) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 SM_SPLIT="${part##*-}" MIXED_REQUESTS=200 \
      ONLY="mixed mixed-text-only" ;;
    mixed-routed-split-*) stack "$dir" CUDA_VISIBLE_DEVICES=0 REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 \
      REPLICA_GPUS=0,0 MPS=1 SM_SPLIT="${part##*-}" MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-routed-one-gpu-normal) stack "$dir" CUDA_VISIBLE_DEVICES=0 REPLICAS=2 TEXT_REPLICAS=0 MEDIA_REPLICAS=1 \
      REPLICA_GPUS=0,0 MPS=1 MPS_LOW_PRIORITY=false MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-kill-one-gpu) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MIXED_REQUESTS=200 KILL_PROGRAM=decoder KILL_AT=10 \
      ONLY="mixed" ;;
    mixed-kill-one-gpu-nohold) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MIXED_REQUESTS=200 KILL_PROGRAM=decoder \
      KILL_AT=10 HOLD_S=0 ONLY="mixed" ;;
    mixed-dp) stack "$dir" REPLICAS=2 MPS=1 MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    seed3img-dp) stack "$dir" REPLICAS=2 MPS=1 C32_REQUESTS=256 ONLY="seed3img-anchor-c32" ;;
    parity-block-size) mkdir -p "$out/$dir"
      for size in 16 64; do stack "$dir/block-$size" CUDA_VISIBLE_DEVICES=0 BLOCK_SIZE=$size ONLY="parity"; done
      python3 -m benchmarks.parity compare "$out/$dir/block-16/parity.json" "$out/$dir/block-64/parity.json" \
        > "$out/$dir/parity-compare.log" 2>&1; echo "compare exit $?" >> "$out/$dir/parity-compare.log" ;;
    parity-dp) mkdir -p "$out/$dir"
      stack "$dir/one" CUDA_VISIBLE_DEVICES=0 ONLY="parity"
      stack "$dir/replicas" REPLICAS=2 ONLY="parity"
      python3 -m benchmarks.parity compare "$out/$dir/one/parity.json" "$out/$dir/replicas/parity.json" \
        > "$out/$dir/parity-compare.log" 2>&1; echo "compare exit $?" >> "$out/$dir/parity-compare.log"
      grep -h "vlm_decoder_requests_finished_total" "$out/$dir/replicas/"*.metrics >> "$out/$dir/parity-compare.log" 2>/dev/null ;;
    mixed-mps) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MIXED_REQUESTS=200 ONLY="mixed mixed-text-only" ;;
    mixed-mps-normal-priority) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 MPS_LOW_PRIORITY=false MIXED_REQUESTS=200 \
      ONLY="mixed mixed-text-only" ;;
    overlap-mixed) stack "$dir" CUDA_VISIBLE_DEVICES=0 MPS=1 OVERLAP_MIXED=1 MIXED_REQUESTS=200 C32_REQUESTS=256 \
      ONLY="mixed mixed-text-only seed3img-anchor-c32" ;;
    control) stack "$dir" CUDA_VISIBLE_DEVICES=0 MIXED_REQUESTS=200 OVERLAP_MIXED=0 ONLY="mixed-text-only" ;;
    control-staged) stack "$dir" CUDA_VISIBLE_DEVICES=0 MIXED_REQUESTS=200 OVERLAP_MIXED=1 ONLY="mixed-text-only" ;;
    control-staged-512) stack "$dir" CUDA_VISIBLE_DEVICES=0 MIXED_REQUESTS=200 OVERLAP_MIXED=1 DECODING_BUDGET=512 \
      ONLY="mixed-text-only" ;;
    spill) stack "$dir" "${small_pool[@]}" SPILL_BYTES=8589934592 ;;
    no-spill) stack "$dir" "${small_pool[@]}" ;;
    *) echo "unknown part $part"; continue ;;
  esac
  ship "$dir"
done
