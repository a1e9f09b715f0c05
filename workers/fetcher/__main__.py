"""``python -m workers.fetcher``: downloads and preprocesses media (run N of them)."""

from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process
from workers.fetcher.worker import FetcherWorker


def main() -> None:
    worker = FetcherWorker(start_process("fetcher", parse_args("workers.fetcher")))
    on_terminate(worker.loop.stop)
    freeze_startup_heap()
    worker.run()


if __name__ == "__main__":
    main()
