"""``python -m workers.decoder``: the LLM decoder (one per model replica)."""

from common.lifecycle import on_terminate, parse_args, start_process
from workers.decoder.worker import DecoderWorker


def main() -> None:
    worker = DecoderWorker(start_process("decoder", parse_args("workers.decoder")))
    on_terminate(worker.loop.stop)
    worker.run()


if __name__ == "__main__":
    main()
