"""``python -m workers.encoder --gpu K``: vision encoder K, on GPU K or on ``[encoder] gpus[K]`` when that
list is set (CPU when there is no GPU)."""

from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process
from workers.encoder.worker import EncoderWorker
from workers.models.synth import prepared_model


def main() -> None:
    args = parse_args("workers.encoder", lambda p: p.add_argument("--gpu", type=int, default=0))
    cfg = start_process(f"encoder.{args.gpu}", args)
    try:
        prepared_model(cfg)
    except ValueError as exc:  # a model of no supported family, or a file missing: stop, not restart for ever
        raise SystemExit(f"encoder: {exc}") from None
    worker = EncoderWorker(cfg, args.gpu)
    on_terminate(worker.loop.stop)
    freeze_startup_heap()
    worker.run()


if __name__ == "__main__":
    main()
