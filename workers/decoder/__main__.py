"""``python -m workers.decoder [--replica R] [--rank K]``: the LLM decoder (rank 0 of replica R; one
replica unless ``[decoder] replicas`` says more), or rank K of its tensor-parallel group."""

import argparse
import signal

from common.config import decoder_name
from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process
from workers.models.synth import prepared_model


def main() -> None:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--replica", type=int, default=0, help="which data-parallel copy (0..replicas-1)")
        parser.add_argument("--rank", type=int, default=0, help="which tensor-parallel rank of it")

    args = parse_args("workers.decoder", options)
    name = decoder_name(args.replica)
    cfg = start_process(name if args.rank == 0 else f"{name}.{args.rank}", args)
    if not 0 <= args.replica < cfg.decoder.replicas or not 0 <= args.rank < cfg.decoder.tensor_parallel:
        raise SystemExit(
            f"--replica {args.replica} --rank {args.rank}: the config has {cfg.decoder.replicas} replica(s) of "
            f"{cfg.decoder.tensor_parallel} rank(s) ([decoder] replicas, tensor_parallel)"
        )
    try:
        prepared_model(cfg)
    except ValueError as exc:  # a model of no supported family, or a file missing: stop, not restart for ever
        raise SystemExit(f"decoder: {exc}") from None
    if args.rank:
        from workers.decoder.tp import DecoderRank

        rank = DecoderRank(cfg, args.replica, args.rank)
        freeze_startup_heap()
        # A stop is rank 0's to give: supervisord signals every rank at once, and a rank gone before
        # rank 0's stop broadcast would leave rank 0 blocked in it (under NCCL, until it is killed).
        # Ignoring SIGTERM, the rank leaves at that broadcast, or is killed if rank 0 never sends it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank.run()
        return
    from workers.decoder.worker import DecoderWorker

    worker = DecoderWorker(cfg, args.replica)
    on_terminate(worker.loop.stop)
    freeze_startup_heap()
    worker.run()


if __name__ == "__main__":
    main()
