"""The supervisord configuration of one deployment, rendered from ``ops/vlm.conf``.

``python -m common.deploy OUT`` (what ``./ops/serve`` runs) writes it for the configuration that
``VLM_CONFIG`` names: paths point at this checkout and at the deployment's own run directory (so two
deployments never share a socket, pid file or log), and the encoder program runs one process per
encoder the fetcher will dispatch to (``[encoder] count``, 0: one per visible GPU).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from common.config import Config, load_config

REPO = Path(__file__).resolve().parents[1]


def encoder_count(cfg: Config) -> int:
    """Encoders to run: the configured count, or one per visible GPU (one on a CPU host)."""
    if cfg.encoder.count:
        return cfg.encoder.count
    import torch  # only when the count depends on the hardware

    return max(1, torch.cuda.device_count())


def render(template: str, repo: Path, run: Path, encoders: int) -> str:
    if encoders < 1:
        raise ValueError(f"a deployment needs at least one encoder, got {encoders}")
    text = template.replace("%(here)s/../run/", f"{run}/").replace("%(here)s/..", str(repo))
    section = re.search(r"^\[program:encoder\]\n(?:(?!\[).*\n?)*", text, flags=re.MULTILINE)
    if section is None or "numprocs = 1" not in section.group(0):
        raise ValueError("the template's [program:encoder] section has no 'numprocs = 1' to set")
    body = section.group(0).replace("numprocs = 1", f"numprocs = {encoders}", 1)
    return text[: section.start()] + body + text[section.end() :]


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m common.deploy OUT_CONF")
    cfg = load_config()
    out = Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render((REPO / "ops/vlm.conf").read_text(), REPO, cfg.run_path, encoder_count(cfg)))


if __name__ == "__main__":
    main(sys.argv[1:])
