# Sourced by the scripts that run on the GPU machine, from the checkout's root.

# The machine is offline: its own python3 (torch, transformers) plus the wheels carried in .whl/.
use_carried_wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
  fi
}

# What a stack run cut short by its timeout leaves behind: supervisord, its programs, the MPS daemon. The
# patterns name those processes' own command lines (ops/vlm.conf), not any line that mentions a module: a
# device command that ran `python3 -m workers.models.synth` itself was killed by a looser "workers\.".
STACK_PROCESSES="supervisor\.supervisord -c|bin/python -m (workers\.(cache|encoder|fetcher|decoder)|gateway)( |$)|nvidia-cuda-mps-(control|server)"
stop_stack() {
  pkill -f "supervisor\.supervisord -c"; sleep 3
  pkill -9 -f "$STACK_PROCESSES"; sleep 1
}

# gpu.sh into OUT/NAME with the given environment (ONLY=... among it), at most 150 s; the processes' logs
# kept there, then whatever the run left behind stopped.
stack_into() {  # out, name, env assignments...
  local out=$1 name=$2; shift 2
  env "$@" timeout 150 benchmarks/gpu.sh "$out/$name"
  cp run/8000/logs/*.log "$out/$name/" 2>/dev/null
  stop_stack
}

# The check scripts' start: OUT_DIR made absolute and created as $out, the checkout's root as the working
# directory, the carried wheels installed; then `stack NAME ENV...` runs gpu.sh into $out/NAME.
begin_check() {  # the script's $0, OUT_DIR
  out=$(realpath -m "$2")
  mkdir -p "$out"
  cd "$(dirname "$1")/.." || exit 1
  use_carried_wheels
}
stack() { stack_into "$out" "$@"; }  # name, env assignments...

# $out/NAME packed into $SHIP/NAME.tgz where SHIP is set (the device tool's $OUT): each part comes back
# as soon as it is done, even if a later one runs the call past its limit.
ship() {  # name
  [ -n "${SHIP:-}" ] && tar czf "$SHIP/$1.tgz" -C "$out" "$1"
}

# The 2b-shaped synthetic checkpoint where gpu.sh makes it, if it is not there yet.
synth_2b() {
  [ -f /tmp/qwen2-vl-2b-synth/config.json ] || python3 -m workers.models.synth --size 2b --out /tmp/qwen2-vl-2b-synth --seed 0
}
