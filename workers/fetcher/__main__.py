"""``python -m workers.fetcher``: downloads and preprocesses media (run N of them)."""

from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process
from workers.fetcher.worker import FetcherWorker
from workers.models.synth import prepared_model

INDEX_HELP = "this fetcher's number among several (its name in /metrics: fetcher.N)"


def main() -> None:
    args = parse_args("workers.fetcher", lambda p: p.add_argument("--index", type=int, default=0, help=INDEX_HELP))
    cfg = start_process("fetcher", args)
    try:
        prepared_model(cfg)
    except ValueError as exc:  # a model of no supported family, or a file missing: stop, not restart for ever
        raise SystemExit(f"fetcher: {exc}") from None
    worker = FetcherWorker(cfg, args.index)
    on_terminate(worker.loop.stop)
    freeze_startup_heap()
    worker.run()


if __name__ == "__main__":
    main()
