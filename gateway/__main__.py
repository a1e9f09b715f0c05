"""``python -m gateway``: the OpenAI-compatible HTTP server (aiohttp)."""

import logging

from aiohttp import web

from common.lifecycle import parse_args, start_process
from gateway.app import Gateway


def main() -> None:
    cfg = start_process("gateway", parse_args("gateway"))
    gateway = Gateway(cfg)
    logging.getLogger("gateway").info(
        "serving %s on http://%s:%d", gateway.model_name, cfg.server.host, cfg.server.port
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
    )


if __name__ == "__main__":
    main()
