"""Where the built-in demo checkpoint lives, for every layer to name it without making it.

`workers.models.synth.demo_checkpoint` generates it there (the workers call it at start-up through
`workers.models.synth.prepared_model`, and the launcher before supervisord starts them); `Config.model_path`
names it when ``[model] path`` is empty; the gateway, which cannot make it, waits for it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

DEMO_SIZE = "tiny"
DEMO_SEED = 0


def cache_dir() -> Path:
    """$VLM_CACHE_DIR, by default ~/.cache/vlm-serve: where generated checkpoints are kept (under models/)."""
    return Path(os.environ.get("VLM_CACHE_DIR") or "~/.cache/vlm-serve").expanduser()


def demo_checkpoint_path() -> Path:
    return cache_dir() / "models" / f"qwen2-vl-{DEMO_SIZE}-seed{DEMO_SEED}"


def wait_for_checkpoint(path: Path, poll_s: float = 0.5) -> None:
    """Return once ``path`` exists. The generator moves a finished checkpoint into place in one rename, so a
    directory that exists is complete."""
    if path.exists():
        return
    logging.getLogger(__name__).info(
        "waiting for the demo checkpoint at %s: the fetcher, encoder and decoder generate it at start-up "
        "(./ops/serve and vlm-serve serve, before they start them)",
        path,
    )
    while not path.exists():
        time.sleep(poll_s)
