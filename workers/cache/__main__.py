"""``python -m workers.cache``: the embedding cache daemon (one per host)."""

from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process
from workers.cache.daemon import CacheDaemon


def main() -> None:
    cfg = start_process("cache", parse_args("workers.cache"))
    daemon = CacheDaemon(cfg)
    on_terminate(daemon.loop.stop)
    freeze_startup_heap()
    daemon.run()


if __name__ == "__main__":
    main()
