"""Where the built-in demo checkpoint lives, for every layer to name it without making it.

`workers.models.synth.demo_checkpoint` generates it there (the workers call it at start-up through
`workers.models.synth.prepared_model`, and the launcher before supervisord starts them); `Config.model_path`
names it when ``[model] path`` is empty; the gateway, which cannot make it, refuses to start without it.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_SIZE = "tiny"
DEMO_SEED = 0


def cache_dir() -> Path:
    """$VLM_CACHE_DIR, by default ~/.cache/vlm-serve: where generated checkpoints are kept (under models/)."""
    return Path(os.environ.get("VLM_CACHE_DIR") or "~/.cache/vlm-serve").expanduser()


def demo_checkpoint_path() -> Path:
    return cache_dir() / "models" / f"qwen2-vl-{DEMO_SIZE}-seed{DEMO_SEED}"


def require_checkpoint(path: Path) -> None:
    """Raise unless the demo checkpoint at ``path`` exists (the generator moves a finished one into place in one
    rename, so a directory that exists is complete). A process that cannot make it says who does, rather than
    waiting for a worker that may never start."""
    if not path.exists():
        raise FileNotFoundError(
            f"the demo checkpoint {path} is not generated yet: ./ops/serve and vlm-serve serve make it before "
            "starting the processes, and so does any worker started alone (python -m workers.decoder); start one "
            "first, or set [model] path / VLM_MODEL"
        )
