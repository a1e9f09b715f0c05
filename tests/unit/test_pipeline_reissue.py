"""The gateway's pipeline when a decoder replica is lost, over real ZMQ sockets (the test holds replica 0's
request socket and sends on the gateway's inbox as a decoder does).

Restarted: a request that no token has come for goes again, to the restarted replica itself, under a new wire
id, its old id aborted there; a token under the old id is dropped, one under the new id reaches the request
under its own id; a request that had streamed fails. A lone decoder silent past ``dead_after_s``: its quiet
request is held until a new process is heard from (then sent there), or fails once ``hold_lost_requests_s``
has passed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from common.config import Config, DecoderConfig, LivenessConfig
from common.protocol import (
    Abort,
    CacheRelease,
    FetchDone,
    GenerateRequest,
    MediaInput,
    Message,
    PreparedRequest,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenDelta,
    WorkerStatus,
)
from common.transport import AsyncChannel
from gateway.metrics import GatewayMetrics
from gateway.pipeline import MEDIA_LOST, MEDIA_REISSUES, Pipeline, Restart, Tracked

WAIT_S = 5.0


async def received(channel: AsyncChannel, count: int) -> list[Message | None]:
    return [(await asyncio.wait_for(channel.recv(), WAIT_S))[1] for _ in range(count)]


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


@dataclass
class TwoRequests:
    pipeline: Pipeline
    replica_0: AsyncChannel  # its request socket, held by the test
    to_gateway: AsyncChannel  # the gateway's inbox, as a decoder sends on it
    events: asyncio.Queue[TokenDelta | RequestError]
    quiet: Tracked  # no token has come for it


@contextlib.asynccontextmanager
async def two_requests_at_replica_0(cfg: Config) -> AsyncIterator[TwoRequests]:
    """The pipeline with replica 0 heard from (incarnation "first") and two requests sent there: "quiet", and
    "streaming", whose first token the client has."""
    pipeline = Pipeline(cfg, GatewayMetrics().media_prepare)
    ctx = zmq.asyncio.Context()
    replica_0 = AsyncChannel(ctx, zmq.PULL, cfg.decoder_endpoint(0), bind=True)
    to_gateway = AsyncChannel(ctx, zmq.PUSH, cfg.endpoint("gateway"), bind=False)
    pipeline.start()
    try:
        await to_gateway.send(WorkerStatus("decoder", "decoder", "first", 64))
        await asyncio.wait_for(until(lambda: pipeline.replicas.live(pipeline.replicas.all[0])), WAIT_S)
        events: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()
        sampling = SamplingParams(max_tokens=4)
        quiet = await pipeline.submit(GenerateRequest("quiet", [1, 2, 3], [], sampling), events)
        await pipeline.submit(GenerateRequest("streaming", [4, 5], [], sampling), events)
        assert [m.request_id for m in await received(replica_0, 2)] == ["quiet", "streaming"]  # type: ignore[union-attr]
        await to_gateway.send(TokenBatch([TokenDelta("streaming", [7])]))
        assert (await asyncio.wait_for(events.get(), WAIT_S)).request_id == "streaming"
        yield TwoRequests(pipeline, replica_0, to_gateway, events, quiet)
    finally:
        await pipeline.close()
        replica_0.close()
        to_gateway.close()
        ctx.term()


async def restart_with_two_requests(tmp_path: Path) -> None:
    # Text requests go to replica 0 only; replica 1 is never heard from (it is not where they may go back to).
    cfg = Config(run_dir=str(tmp_path), decoder=DecoderConfig(replicas=2, text_replicas=[0]))
    async with two_requests_at_replica_0(cfg) as scene:
        pipeline, replica_0, events, quiet = scene.pipeline, scene.replica_0, scene.events, scene.quiet
        await scene.to_gateway.send(WorkerStatus("decoder", "decoder", "second", 64))  # a new process
        failed = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(failed, RequestError) and (failed.request_id, failed.status) == ("streaming", 503)
        abort, again = await received(replica_0, 2)
        assert abort == Abort("quiet")
        assert isinstance(again, PreparedRequest) and again.request_id == "quiet.reissue1"
        assert again.prompt_ids == [1, 2, 3] and quiet.wire_id == "quiet.reissue1"

        batch = TokenBatch([TokenDelta("quiet", [5]), TokenDelta("quiet.reissue1", [6], "length")])
        await scene.to_gateway.send(batch)
        delta = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(delta, TokenDelta) and (delta.request_id, delta.token_ids) == ("quiet", [6])
        assert events.empty()
        assert pipeline.replicas.all[0].reissued == 1

        pipeline.abort("quiet")  # as the HTTP side does when the request ends: the new id is what it stops
        assert await received(replica_0, 1) == [Abort("quiet.reissue1")]
        assert pipeline.rewired == {} and pipeline.replicas.all[0].load == 1  # ("streaming": not yet aborted)


def test_a_restarted_replicas_quiet_request_goes_again_under_a_new_id(tmp_path: Path) -> None:
    asyncio.run(restart_with_two_requests(tmp_path))


async def lone_decoder_lost(tmp_path: Path, hold_s: float) -> None:
    """One decoder, silent past ``dead_after_s``: its quiet request is held (nothing is live to take it), its
    streaming one fails. With ``hold_s`` long, a new process's first heartbeat gets the held request under a
    new id; with it short, the held request fails with a 503 that says what happened."""
    liveness = LivenessConfig(heartbeat_s=0.05, dead_after_s=0.3, hold_lost_requests_s=hold_s)
    async with two_requests_at_replica_0(Config(run_dir=str(tmp_path), liveness=liveness)) as scene:
        pipeline, decoder, events, quiet = scene.pipeline, scene.replica_0, scene.events, scene.quiet
        # No heartbeat from now on: after dead_after_s the decoder is lost.
        failed = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(failed, RequestError) and (failed.request_id, failed.status) == ("streaming", 503)
        assert await received(decoder, 1) == [Abort("quiet")]  # (its old id stopped there, if a new process reads it)
        assert pipeline.held == {"quiet": quiet} and quiet.stage == "held" and events.empty()
        assert pipeline.replicas.all[0].load == 1  # ("streaming" until the HTTP side aborts it)

        if hold_s < 1:
            expired = await asyncio.wait_for(events.get(), WAIT_S)
            assert isinstance(expired, RequestError) and (expired.request_id, expired.status) == ("quiet", 503)
            assert f"no replica was back within {hold_s:g} s" in expired.message
            assert pipeline.held == {}
        else:
            await scene.to_gateway.send(WorkerStatus("decoder", "decoder", "second", 64))  # the restarted process
            again = (await received(decoder, 1))[0]
            assert isinstance(again, PreparedRequest) and again.request_id == "quiet.reissue1"
            assert pipeline.held == {} and quiet.stage == "decode" and pipeline.replicas.all[0].reissued == 1
            await scene.to_gateway.send(TokenBatch([TokenDelta("quiet.reissue1", [6], "length")]))
            delta = await asyncio.wait_for(events.get(), WAIT_S)
            assert isinstance(delta, TokenDelta) and (delta.request_id, delta.token_ids) == ("quiet", [6])
        for request_id in ("quiet", "streaming"):  # as the HTTP side does when each ends
            pipeline.abort(request_id)
        assert pipeline.replicas.all[0].load == 0 and pipeline.requests == {} and pipeline.rewired == {}


def test_a_lone_decoders_quiet_request_waits_for_its_restart(tmp_path: Path) -> None:
    asyncio.run(lone_decoder_lost(tmp_path, hold_s=30.0))


def test_a_held_request_fails_when_no_decoder_is_back_in_time(tmp_path: Path) -> None:
    asyncio.run(lone_decoder_lost(tmp_path, hold_s=0.5))


async def media_lost(tmp_path: Path) -> None:
    """A request with an image, handed to the decoder by the fetcher (the test is both): each time the decoder
    says its embeddings were lost (``media_unavailable``), it goes to a fetcher again under a new wire id, the old
    one aborted at the decoder, the client told nothing; after ``MEDIA_REISSUES`` the next such error reaches it.
    Any other error, or one for a request that has streamed, reaches the client at once."""
    cfg = Config(run_dir=str(tmp_path))
    pipeline = Pipeline(cfg, GatewayMetrics().media_prepare)
    ctx = zmq.asyncio.Context()
    replica_0 = AsyncChannel(ctx, zmq.PULL, cfg.decoder_endpoint(0), bind=True)
    to_gateway = AsyncChannel(ctx, zmq.PUSH, cfg.endpoint("gateway"), bind=False)
    fetcher = AsyncChannel(ctx, zmq.DEALER, cfg.endpoint("fetch"), bind=False, identity=b"fetcher-a")
    cache = AsyncChannel(ctx, zmq.ROUTER, cfg.endpoint("cache"), bind=True)
    pipeline.start()
    try:
        await to_gateway.send(WorkerStatus("decoder", "decoder", "first", 64))
        await fetcher.send(WorkerStatus("fetcher", "fetcher.0", "f1", 8, 1, 1))
        await asyncio.wait_for(until(lambda: pipeline.replicas.live(pipeline.replicas.all[0])), WAIT_S)
        await asyncio.wait_for(until(lambda: bool(pipeline.fetchers.peers)), WAIT_S)
        events: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()
        media = [MediaInput("image", "data:image/png;base64,AAAA")]
        tracked = await pipeline.submit(GenerateRequest("img", [1, 2], media, SamplingParams(max_tokens=4)), events)
        wire_ids = []
        for attempt in range(MEDIA_REISSUES + 1):
            sent = (await received(fetcher, 1))[0]
            assert isinstance(sent, GenerateRequest) and sent.prompt_ids == [1, 2] and sent.media == media
            wire_ids.append(sent.request_id)
            await fetcher.send(FetchDone(sent.request_id))
            await asyncio.wait_for(until(lambda: tracked.stage == "decode"), WAIT_S)
            lost = RequestError(sent.request_id, 503, MEDIA_LOST, "embedding of media ab12 is not available")
            await to_gateway.send(lost)
            if attempt < MEDIA_REISSUES:
                assert await received(replica_0, 1) == [Abort(sent.request_id)]
                assert await received(cache, 1) == [CacheRelease(sent.request_id)]  # (its leases under that id)
        assert wire_ids == ["img", *(f"img.reissue{k}" for k in range(1, MEDIA_REISSUES + 1))]
        failed = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(failed, RequestError) and (failed.request_id, failed.code) == ("img", MEDIA_LOST)
        assert events.empty() and tracked.media_reissues == MEDIA_REISSUES

        streamed = await pipeline.submit(GenerateRequest("img2", [3], media, SamplingParams(max_tokens=4)), events)
        await received(fetcher, 1)
        await to_gateway.send(TokenBatch([TokenDelta("img2", [9])]))  # (before its FetchDone: handed over)
        assert (await asyncio.wait_for(events.get(), WAIT_S)).request_id == "img2"
        assert streamed.stage == "decode" and "img2" not in pipeline.fetchers.jobs
        await to_gateway.send(RequestError("img2", 503, MEDIA_LOST, "lost after a token"))
        failed = await asyncio.wait_for(events.get(), WAIT_S)
        assert isinstance(failed, RequestError) and failed.request_id == "img2" and streamed.media_reissues == 0
    finally:
        await pipeline.close()
        for channel in (replica_0, to_gateway, fetcher, cache):
            channel.close()
        ctx.term()


def test_a_request_whose_media_embeddings_were_lost_is_fetched_again(tmp_path: Path) -> None:
    asyncio.run(media_lost(tmp_path))


async def unstreamed_with_tokens_restarts(tmp_path: Path) -> None:
    """A non-streamed request whose first tokens had come when its replica restarted: its client has seen none of
    them, so it goes again like a quiet one, and the HTTP side is told (`Restart`) to drop what it had; the
    streamed one beside it, whose client has its token, fails."""
    cfg = Config(run_dir=str(tmp_path), decoder=DecoderConfig(replicas=2, text_replicas=[0]))
    async with two_requests_at_replica_0(cfg) as scene:
        pipeline, replica_0, events = scene.pipeline, scene.replica_0, scene.events
        sampling = SamplingParams(max_tokens=4)
        whole = await pipeline.submit(GenerateRequest("whole", [8, 9], [], sampling), events, streamed=False)
        assert [m.request_id for m in await received(replica_0, 1)] == ["whole"]  # type: ignore[union-attr]
        await scene.to_gateway.send(TokenBatch([TokenDelta("whole", [3])]))
        assert (await asyncio.wait_for(events.get(), WAIT_S)).request_id == "whole"
        assert whole.streaming and not whole.client_has_tokens

        await scene.to_gateway.send(WorkerStatus("decoder", "decoder", "second", 64))  # a new process
        got = [await asyncio.wait_for(events.get(), WAIT_S) for _ in range(2)]
        failed = [e for e in got if isinstance(e, RequestError)]
        assert [(e.request_id, e.status) for e in failed] == [("streaming", 503)]
        assert Restart("whole") in got and pipeline.restarted == 1 and whole.restarts == 1
        sent = [m for m in await received(replica_0, 4) if isinstance(m, PreparedRequest)]
        assert sorted(m.request_id for m in sent) == ["quiet.reissue1", "whole.reissue1"]
        assert not whole.streaming  # (until the new incarnation's first token)
        await scene.to_gateway.send(TokenBatch([TokenDelta("whole", [4]), TokenDelta("whole.reissue1", [5])]))
        delta = await asyncio.wait_for(events.get(), WAIT_S)  # (the old id's late token dropped)
        assert isinstance(delta, TokenDelta) and (delta.request_id, delta.token_ids) == ("whole", [5])


def test_a_non_streamed_request_lost_mid_answer_goes_again_from_its_start(tmp_path: Path) -> None:
    asyncio.run(unstreamed_with_tokens_restarts(tmp_path))
