"""The gateway's pipeline when a decoder replica restarts, over real ZMQ sockets (the test holds the replicas'
request sockets and sends on the gateway's inbox as a decoder does): a request that no token has come for goes
again, to the restarted replica itself, under a new wire id, its old id aborted there; a token under the old
id is dropped, one under the new id reaches the request under its own id; a request that had streamed fails."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from common.config import Config, DecoderConfig
from common.protocol import (
    Abort,
    GenerateRequest,
    Message,
    PreparedRequest,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenDelta,
    WorkerStatus,
)
from common.transport import AsyncChannel
from gateway.metrics import Histogram
from gateway.pipeline import Pipeline

WAIT_S = 5.0


async def received(channel: AsyncChannel, count: int) -> list[Message | None]:
    return [(await asyncio.wait_for(channel.recv(), WAIT_S))[1] for _ in range(count)]


async def restart_with_two_requests(tmp_path: Path) -> None:
    # Text requests go to replica 0 only; replica 1 is never heard from (it is not where they may go back to).
    cfg = Config(run_dir=str(tmp_path), decoder=DecoderConfig(replicas=2, text_replicas=[0]))
    pipeline = Pipeline(cfg, Histogram("media_prepare", "unused", (1.0,)))
    ctx = zmq.asyncio.Context()
    replica_0 = AsyncChannel(ctx, zmq.PULL, cfg.decoder_endpoint(0), bind=True)
    to_gateway = AsyncChannel(ctx, zmq.PUSH, cfg.endpoint("gateway"), bind=False)
    pipeline.start()
    try:
        await to_gateway.send(WorkerStatus("decoder", "decoder", "first", 64))

        async def heard() -> None:
            while not pipeline.replicas.live(pipeline.replicas.all[0]):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(heard(), WAIT_S)
        events: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()
        sampling = SamplingParams(max_tokens=4)
        quiet = await pipeline.submit(GenerateRequest("quiet", [1, 2, 3], [], sampling), events)
        await pipeline.submit(GenerateRequest("streaming", [4, 5], [], sampling), events)
        assert [m.request_id for m in await received(replica_0, 2)] == ["quiet", "streaming"]  # type: ignore[union-attr]
        await to_gateway.send(TokenBatch([TokenDelta("streaming", [7])]))
        assert (await asyncio.wait_for(events.get(), WAIT_S)).request_id == "streaming"

        await to_gateway.send(WorkerStatus("decoder", "decoder", "second", 64))  # a new process
        failed = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(failed, RequestError) and (failed.request_id, failed.status) == ("streaming", 503)
        abort, again = await received(replica_0, 2)
        assert abort == Abort("quiet")
        assert isinstance(again, PreparedRequest) and again.request_id == "quiet.reissue1"
        assert again.prompt_ids == [1, 2, 3] and quiet.wire_id == "quiet.reissue1"

        await to_gateway.send(TokenBatch([TokenDelta("quiet", [5]), TokenDelta("quiet.reissue1", [6], "length")]))
        delta = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(delta, TokenDelta) and (delta.request_id, delta.token_ids) == ("quiet", [6])
        assert events.empty()
        assert pipeline.replicas.all[0].reissued == 1

        pipeline.abort("quiet")  # as the HTTP side does when the request ends: the new id is what it stops
        assert await received(replica_0, 1) == [Abort("quiet.reissue1")]
        assert pipeline.rewired == {} and pipeline.replicas.all[0].load == 1  # ("streaming": not yet aborted)
    finally:
        await pipeline.close()
        replica_0.close()
        to_gateway.close()
        ctx.term()


def test_a_restarted_replicas_quiet_request_goes_again_under_a_new_id(tmp_path: Path) -> None:
    asyncio.run(restart_with_two_requests(tmp_path))
