"""``python -m workers.decoder [--rank K]``: the LLM decoder (rank 0, one per model replica), or rank K of
its tensor-parallel group."""

import signal

from common.lifecycle import freeze_startup_heap, on_terminate, parse_args, start_process


def main() -> None:
    args = parse_args("workers.decoder", lambda p: p.add_argument("--rank", type=int, default=0))
    cfg = start_process("decoder" if args.rank == 0 else f"decoder.{args.rank}", args)
    if args.rank:
        from workers.decoder.tp import DecoderRank

        rank = DecoderRank(cfg, args.rank)
        freeze_startup_heap()
        # A stop is rank 0's to give: supervisord signals every rank at once, and a rank gone before
        # rank 0's stop broadcast would leave rank 0 blocked in it (under NCCL, until it is killed).
        # Ignoring SIGTERM, the rank leaves at that broadcast, or is killed if rank 0 never sends it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank.run()
        return
    from workers.decoder.worker import DecoderWorker

    worker = DecoderWorker(cfg)
    on_terminate(worker.loop.stop)
    freeze_startup_heap()
    worker.run()


if __name__ == "__main__":
    main()
