"""The decoder starts without torch's compiler stack: its grammar bitmasks come from llguidance's numpy helpers
(``llguidance.torch`` compiles a kernel with ``torch.compile`` when imported), and its models are built on the meta
device without parameter init (``nn.Embedding``'s ``normal_`` there runs torch's Python reference, which imports
dynamo). Each process pays for whatever it imports at every start, so an import of dynamo coming back is caught here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "sympy")


def test_the_decoder_imports_and_loads_each_family_without_dynamo(tmp_path: Path) -> None:
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import workers.decoder.worker\n"  # (everything the decoder's process imports)
        "from workers.models.registry import checkpoint_family, read_spec\n"
        "from workers.models.synth import generate_checkpoint\n"
        "for family in ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl'):\n"
        f"    path = generate_checkpoint(Path({str(tmp_path)!r}) / family, 'tiny', 0, family=family)\n"
        "    found = checkpoint_family(path)\n"
        "    found.language_model(path, device='cpu', spec=read_spec(path))\n"
        "    found.vision_tower(path)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({COMPILER_MODULES!r}))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = [sys.executable, "-c", script]
    done = subprocess.run(run, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
