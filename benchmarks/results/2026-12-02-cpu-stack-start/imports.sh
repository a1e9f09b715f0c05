# per-process entry imports: median of 3 (wall s, user+sys s)
measure() {  # label, python code
  for i in 1 2 3; do /usr/bin/time -f "%e %U %S" env PYTHONPATH=$PWD VLM_CONFIG="${VLM_CONFIG:?the tests settings file: tests/integration/conftest.stack_config}" .venv/bin/python -c "$2" 2>&1 >/dev/null | tail -1; done | sort -n | sed -n 2p | awk -v l="$1" '{printf "%-34s wall %.2f  cpu %.2f\n", l, $1, $2+$3}'
}
measure "gateway (entry + gateway.app)" "import gateway.__main__ as m; getattr(m, 'without_torch', lambda: None)(); import gateway.app"
measure "gateway Gateway(cfg) built" "import gateway.__main__ as m; getattr(m, 'without_torch', lambda: None)(); from gateway.app import Gateway; from common.config import load_config; Gateway(load_config(None))"
measure "decoder (workers.decoder.worker)" "import workers.decoder.worker"
measure "decoder DecoderWorker(cfg) built" "from workers.decoder.worker import DecoderWorker; from common.config import load_config; DecoderWorker(load_config(None))"
measure "fetcher (workers.fetcher.worker)" "import workers.fetcher.worker"
measure "encoder (workers.encoder.worker)" "import workers.encoder.worker"
measure "cache (workers.cache.daemon)" "import workers.cache.daemon"
measure "launcher (ops.cli + preflight)" "import sys, os; sys.argv=['x','serve']; os.execv=lambda *a: None; from ops.cli import main; main()"
