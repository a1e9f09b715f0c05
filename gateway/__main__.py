"""``python -m gateway``: the OpenAI-compatible HTTP server (aiohttp)."""

import logging
import resource
import sys

from aiohttp import web

from common.checkpoint import require_checkpoint
from common.lifecycle import freeze_startup_heap, parse_args, start_process
from common.model_files import check_model_files


def without_torch() -> None:
    """Make torch unimportable in this process, before anything imports transformers. The gateway runs no model:
    it takes only the tokenizer and chat template from transformers, which work the same without torch, but
    transformers imports torch whenever it is installed. A ``None`` in ``sys.modules`` is Python's own "not
    installed": ``import torch`` raises ImportError and transformers' ``is_torch_available()`` is False."""
    if "transformers" in sys.modules:  # (too late: it has looked for torch already)
        return
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]


def raise_open_file_limit() -> int:
    """Every client connection is a file descriptor: take the hard limit, not a 1,024 default, so that
    thousands of idle or streaming connections do not turn new clients away."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep what we have; the log line says how many
    return soft


DRAIN_S = 30.0


def main() -> None:
    without_torch()
    from gateway.app import Gateway  # (after without_torch: it imports transformers)

    cfg = start_process("gateway", parse_args("gateway"))
    files = raise_open_file_limit()
    if not cfg.model.path:
        # The demo checkpoint is made by the model layer (workers.models.synth), which the gateway does not
        # import: the launcher makes it before starting the processes, as does a worker started alone.
        try:
            require_checkpoint(cfg.model_path())
        except FileNotFoundError as exc:
            logging.getLogger("gateway").error("%s", exc)
            raise SystemExit(2) from exc
    try:  # the same check as the workers' (the model's family is the checkpoint's, never a flag)
        check_model_files(cfg.model_path(), cfg.model.quantization)
    except ValueError as exc:
        logging.getLogger("gateway").error("%s", exc)
        raise SystemExit(2) from exc
    gateway = Gateway(cfg)
    freeze_startup_heap()
    logging.getLogger("gateway").info(
        "serving %s on http://%s:%d (up to %d open files)", gateway.model_name, cfg.server.host, cfg.server.port, files
    )
    # handler_cancellation: a client that hangs up cancels its handler, whose cleanup aborts the
    # request in every stage (non-streaming requests included).
    web.run_app(
        gateway.app(),
        host=cfg.server.host,
        port=cfg.server.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        # On SIGTERM: stop listening, let the requests in flight finish for up to this long (supervisord waits
        # 40 s, ops/vlm.conf, and stops the workers only after), then cancel what is left.
        shutdown_timeout=DRAIN_S,
    )


if __name__ == "__main__":
    main()
