"""``python -m common.exec_supervised CMD [ARGS...]``: becomes CMD, having asked for SIGTERM when supervisord dies.

Our own workers ask so at start-up (`common.lifecycle.end_with_supervisord`); a program of the deployment that is not
ours, the CUDA MPS control daemon, is started through this, so that a supervisord killed hard (SIGKILL, the OOM
killer) leaves nothing of the deployment running. The request survives the exec (it is dropped only for set-user-ID
programs)."""

from __future__ import annotations

import os
import sys

from common.lifecycle import end_with_supervisord


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m common.exec_supervised CMD [ARGS...]")
    end_with_supervisord(os.path.basename(argv[0]))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
