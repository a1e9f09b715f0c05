"""The gateway's socket readers (`Pipeline._read`) over a real ZMQ pair: a message its handler fails on is logged
and dropped, and the reader goes on. A reader task that died on one would say nothing (its exception is never
retrieved) and leave its socket unread: for the inbox, every decoder's heartbeat with it, so each decoder would be
taken for lost while it serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from common.config import Config
from common.protocol import Message, Ping
from common.transport import AsyncChannel
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline

WAIT_S = 5.0


def test_a_message_the_handler_fails_on_is_dropped_and_the_reader_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scene() -> list[str]:
        pipeline = Pipeline(Config(run_dir=str(tmp_path)), GatewayMetrics().media_prepare)
        ctx = zmq.asyncio.Context()
        address = f"ipc://{tmp_path / 'readers.sock'}"
        inbox = AsyncChannel(ctx, zmq.PULL, address, bind=True)
        sender = AsyncChannel(ctx, zmq.PUSH, address, bind=False)
        handled: list[str] = []

        def handle(_peer: bytes, msg: Message | None) -> None:
            assert isinstance(msg, Ping)
            if msg.sender == "poison":
                raise KeyError("a handler's bug")
            handled.append(msg.sender)

        reader = asyncio.create_task(pipeline._read(inbox, handle))
        try:
            for sender_name in ("first", "poison", "after"):
                await sender.send(Ping(sender_name))
            async with asyncio.timeout(WAIT_S):
                while len(handled) < 2:
                    await asyncio.sleep(0.01)
            assert not reader.done()
            return handled
        finally:
            reader.cancel()
            await pipeline.close()
            inbox.close()
            sender.close()
            ctx.term()

    with caplog.at_level("ERROR"):
        assert asyncio.run(scene()) == ["first", "after"]
    assert "dropped a message" in caplog.text and "a handler's bug" in caplog.text and "poison" in caplog.text
