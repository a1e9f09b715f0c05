"""The gateway's side of the sockets: fetcher dispatch, decoder replicas' liveness, results routed to requests."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from prometheus_client import Histogram

from common.config import Config, decoder_hub
from common.discovery import EncoderDirectory
from common.dispatch import Dispatcher, Job
from common.lifecycle import StallWatchdog
from common.liveness import LivenessClock
from common.protocol import (
    Abort,
    CacheRelease,
    DecoderStats,
    FetchDone,
    GenerateRequest,
    MediaInput,
    Message,
    PreparedRequest,
    RequestError,
    StatsRequest,
    StatsResult,
    TokenBatch,
    TokenDelta,
    WorkerStatus,
    encode,
)
from common.transport import AsyncChannel, Transport
from gateway.errors import ApiError
from gateway.offload import off_loop_if_large
from gateway.replicas import Replica, Replicas, prefix_affinity

log = logging.getLogger(__name__)


# Times a request that no token has come for yet is sent again when its decoder replica is lost. Once only: a
# request that crashes (or hangs) a decoder would otherwise take every replica down in turn.
REISSUES = 1
# Times a request whose media embeddings were lost before its decoder read them (a cache daemon restarted, the
# fetcher that was encoding them died, an encoder gave up) is fetched and encoded again. A few: a stage's restart
# may cost a request more than one try while it comes back; `request_timeout_s` bounds them all.
MEDIA_REISSUES = 3
# The decoder's error code for embeddings it could not get (`workers.decoder.worker`): not the request's fault.
MEDIA_LOST = "media_unavailable"


@dataclass(frozen=True)
class Restart:
    """To the HTTP side: forget the tokens that came for ``request_id``, which is being generated again from its
    start (its decoder was lost while its client had seen none of them: a non-streamed answer)."""

    request_id: str


Event = TokenDelta | RequestError | Restart


@dataclass
class Tracked:
    """A request in flight: the pipeline's events for it land in ``events``. The workers know it as
    ``wire_id``: its ``request_id``, or a new id once it was re-issued (a lost replica's queue may still hold
    the first, which it must not run; and a token from it must not count)."""

    request: GenerateRequest
    events: asyncio.Queue[Event]  # may be shared by the n choices of one HTTP request
    replica: Replica
    streamed: bool = True  # the client gets tokens as they come (False: the whole answer at its end)
    # fetch -> decode; lost with its replica: "held" (waiting for a live one: `Pipeline.held`) or "failed" (its
    # 503 sent, until the HTTP side ends it)
    stage: str = "fetch"
    submitted: float = field(default_factory=time.monotonic)
    wire_id: str = field(init=False)
    reissues: int = 0  # re-issues after a lost decoder replica
    media_reissues: int = 0  # re-issues after lost media embeddings (`MEDIA_REISSUES`)
    restarts: int = 0  # of the re-issues, those after tokens had come (a non-streamed answer begun again)
    streaming: bool = False  # a token has come (for a streamed request, the client has it)
    held_until: float = 0.0  # (held) when it fails if no replica is live to take it by then

    def __post_init__(self) -> None:
        self.wire_id = self.request.request_id

    @property
    def client_has_tokens(self) -> bool:
        """A token reached (or is on its way to) the client: a lost replica then fails the request, which
        cannot be taken back. Tokens of a non-streamed answer are the gateway's until it ends."""
        return self.streaming and self.streamed

    @property
    def wires(self) -> int:
        """Wire ids it has had after its first: one per re-issue of either kind."""
        return self.reissues + self.media_reissues

    @property
    def request_id(self) -> str:
        return self.request.request_id


class Pipeline:
    """The gateway's side of the sockets: dispatch to fetchers, track the decoder, route results."""

    def __init__(self, cfg: Config, media_prepare: Histogram) -> None:
        self.cfg = cfg
        self.media_prepare = media_prepare  # observed when a fetcher hands a request to the decoder
        self.transport = Transport(cfg, "gateway", asyncio=True)
        self.fetch = self.transport.async_channel(zmq.ROUTER, "fetch", bind=True)
        self.inbox = self.transport.async_channel(zmq.PULL, "gateway", bind=True)
        # Liveness (decoder replicas', fetchers') is judged on this clock, not the wall's: see `_tick`.
        self.clock = LivenessClock(cfg.liveness.heartbeat_s)
        self.replicas = Replicas(cfg, self.clock)
        self.decoders = [
            self.transport.async_channel(zmq.PUSH, decoder_hub(r.index), bind=False) for r in self.replicas.all
        ]
        self.cache = self.transport.async_channel(zmq.DEALER, "cache", bind=False)
        self.fetchers = Dispatcher(
            self._send_to_fetcher,
            self._fetch_failed,
            clock=self.clock,
            dead_after_s=cfg.liveness.dead_after_s,
            max_attempts=3,
        )
        self.requests: dict[str, Tracked] = {}
        self.rewired: dict[str, str] = {}  # a re-issued request's wire id -> its request id
        self.held: dict[str, Tracked] = {}  # request id -> a request lost with its replica, waiting for a live one
        self.restarted = 0  # non-streamed requests generated again after their replica was lost mid-answer
        self.encoders_seen: dict[bytes, int] = {}  # fetcher -> the encoders it last said were live
        # For /metrics: a channel to each encoder, by address (`common.discovery`: a name in [endpoints] is every
        # address it resolves to, looked up again every [encoder] resolve_every_s), with its metrics label
        self.encoder_directory = EncoderDirectory(cfg)
        self.encoders: dict[bytes, tuple[str, AsyncChannel, asyncio.Task[None]]] = {}
        self.stats_waiters: dict[str, asyncio.Future[StatsResult]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(coro)
            for coro in (
                self._read(self.fetch, self._on_fetch),
                self._read(self.inbox, self._on_inbox),
                self._read(self.cache, self._on_stats),
                self._tick(),
                self._follow_encoders(),
            )
        ]
        if self.cfg.liveness.stall_exit_s > 0:
            self.tasks.append(asyncio.create_task(self._rearm(StallWatchdog(self.cfg.liveness.stall_exit_s))))

    async def _rearm(self, watchdog: StallWatchdog) -> None:
        """The gateway's event loop turns (`StallWatchdog`), or the process ends for supervisord to restart."""
        watchdog.announce("gateway")
        try:
            while True:
                watchdog.arm()
                await asyncio.sleep(watchdog.rearm_every_s)
        finally:  # (closing: a slow shutdown is not a stall)
            watchdog.disarm()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for channel in (self.fetch, self.inbox, self.cache, *self.decoders, *(e[1] for e in self.encoders.values())):
            channel.close()
        self.transport.close()

    # ------------------------------------------------------------------ submitting
    async def submit(
        self,
        request: GenerateRequest,
        events: asyncio.Queue[Event],
        beside: str | None = None,
        streamed: bool = True,
    ) -> Tracked:
        """Send a request on its way (``beside``: another request with the same prompt and media, whose
        fetcher and decoder replica this one should share, as the choices of one request do: a fetcher loads
        an item once for all it serves, and a replica computes the shared prompt once). ``streamed``: whether
        its client gets tokens as they come (a non-streamed one is generated again if its replica is lost)."""
        sibling = self.requests.get(beside) if beside is not None else None
        replica = sibling.replica if sibling is not None else self.choose_replica(request)
        why = self.replicas.unavailable(replica)  # (none of its kind is live): failed now, not after its media
        if why is not None:
            message = f"{self._decoder_named(replica)} {why}; retry the request"
            raise ApiError(503, message, code="unavailable", retry_after_s=1)
        frame = None
        if request.media:  # encoded once and re-sent as is; off the event loop where inline media makes it large
            routed = dataclasses.replace(request, replica=replica.index)
            frame = await off_loop_if_large(sum(len(m.url) for m in request.media), encode, routed)
        tracked = self.requests[request.request_id] = Tracked(request, events, replica, streamed)
        try:
            job = self.fetchers.jobs.get(sibling.wire_id) if sibling is not None else None
            self._dispatch(tracked, replica, frame, prefer=job.peer if job is not None else None)
        except Exception:  # (a text request that cannot be encoded): leave nothing of it behind
            self.abort(request.request_id)
            raise
        return tracked

    def _dispatch(self, tracked: Tracked, replica: Replica, frame: bytes | None, prefer: bytes | None = None) -> None:
        """Send a request (as ``tracked.wire_id``) to ``replica``: with media through a fetcher (``frame``: the
        `GenerateRequest` encoded, by the caller: off the event loop where it is large), else straight there."""
        tracked.replica = replica
        replica.load += 1
        replica.routed += 1
        if frame is not None:
            tracked.stage = "fetch"
            affinity = media_affinity(tracked.request.media)
            self.fetchers.submit(tracked.wire_id, frame, self.cfg.server.request_timeout_s, prefer, affinity)
        else:  # text only: straight to the decoder
            tracked.stage = "decode"
            request = tracked.request
            prepared = PreparedRequest(tracked.wire_id, request.prompt_ids, [], request.sampling)
            self._send(self.decoders[replica.index], prepared)

    def choose_replica(self, request: GenerateRequest) -> Replica:
        return self.replicas.choose(bool(request.media), lambda: prefix_affinity(request.prompt_ids, request.media))

    def abort(self, request_id: str) -> None:
        """Stop a request everywhere it may be: queued here, at its fetcher, or in its decoder replica."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return
        self.rewired.pop(tracked.wire_id, None)
        self.held.pop(request_id, None)
        if tracked.stage != "held":  # (a held request was withdrawn when its replica was lost)
            self._withdraw(tracked)

    def _withdraw(self, tracked: Tracked) -> None:
        """Stop ``tracked.wire_id`` at its fetcher and its replica, and count it out of the replica's load."""
        tracked.replica.load -= 1
        job = self.fetchers.jobs.get(tracked.wire_id)
        if job is not None and job.peer is not None:
            self._send_to_fetcher(job.peer, Abort(tracked.wire_id))
        self.fetchers.cancel(tracked.wire_id)
        self._send(self.decoders[tracked.replica.index], Abort(tracked.wire_id))

    def _tracked(self, wire_id: str) -> Tracked | None:
        """The request the workers know as ``wire_id``; None for one gone, or for a re-issued request's
        previous wire id."""
        tracked = self.requests.get(self.rewired.get(wire_id, wire_id))
        return tracked if tracked is not None and tracked.wire_id == wire_id else None

    def _send(self, channel: AsyncChannel, msg: Message) -> None:
        channel.sock.send(encode(msg))

    def _send_to_fetcher(self, peer: bytes, msg: Message | bytes) -> bool:
        future = self.fetch.sock.send_multipart([peer, msg if isinstance(msg, bytes) else encode(msg)])
        return not (future.done() and future.exception() is not None)

    def _fetch_failed(self, job: Job, why: str) -> None:
        self._deliver(RequestError(job.job_id, 503, "unavailable", f"no media fetcher could take the request: {why}"))

    def _deliver(self, event: TokenDelta | RequestError) -> None:
        tracked = self._tracked(event.request_id)
        if tracked is None:
            return
        if isinstance(event, TokenDelta):
            tracked.streaming = True
            if tracked.stage == "fetch":  # (handed over by a fetcher that died before its `FetchDone`): not again
                self.fetchers.complete(tracked.wire_id)
                tracked.stage = "decode"
        if event.request_id != tracked.request_id:  # (re-issued): the HTTP side knows it by its request id
            event = dataclasses.replace(event, request_id=tracked.request_id)
        tracked.events.put_nowait(event)

    # ------------------------------------------------------------------ reading
    async def _read(self, channel: AsyncChannel, handle: Callable[[bytes, Message | None], None]) -> None:
        """One socket's reader. A message its handler fails on is logged and dropped: it must not end the reader,
        whose task would die without a word and leave the socket unread (a decoder's heartbeats with it)."""
        while True:
            peer, msg = await channel.recv()
            try:
                handle(peer, msg)
            except Exception:
                log.exception("dropped a message on %s that its handler failed on: %.300r", channel.address, msg)

    def _on_fetch(self, peer: bytes, msg: Message | None) -> None:
        match msg:
            case WorkerStatus():
                self.fetchers.peer_status(peer, msg)
                self.encoders_seen[peer] = msg.workers_live
            case StatsResult(call_id=call_id) if call_id in self.stats_waiters:
                self.stats_waiters.pop(call_id).set_result(msg)
            case FetchDone(request_id=rid):
                self.fetchers.complete(rid)
                if (tracked := self._tracked(rid)) is not None:
                    tracked.stage = "decode"
                    self.media_prepare.observe(time.monotonic() - tracked.submitted)
            case _:
                pass

    def _on_inbox(self, _peer: bytes, msg: Message | None) -> None:
        match msg:
            case TokenBatch(deltas=deltas):
                for delta in deltas:
                    self._deliver(delta)
            case RequestError() if not self._media_lost(msg):
                self._deliver(msg)
            case DecoderStats(counters=counters, worker_id=name) if name in self.replicas.by_name:
                self.replicas.by_name[name].stats = counters
            case WorkerStatus(role="decoder", worker_id=name, incarnation=inc) if name in self.replicas.by_name:
                replica = self.replicas.by_name[name]
                if self.replicas.heard(replica, inc):  # (live again first: its lost requests may go back to it)
                    self._replica_lost(replica, "restarted")
                if self.held:
                    self._release_held()
            case _:
                pass

    def _on_stats(self, _peer: bytes, msg: Message | None) -> None:
        if isinstance(msg, StatsResult) and msg.call_id in self.stats_waiters:
            self.stats_waiters.pop(msg.call_id).set_result(msg)

    async def _follow_encoders(self) -> None:
        """The encoders' channels as the directory says (once, or every resolve_every_s for a name in it)."""
        loop = asyncio.get_running_loop()
        while True:
            joined, left = await loop.run_in_executor(None, self.encoder_directory.refresh)  # (a DNS lookup)
            for endpoint in joined:
                channel = self.transport.async_channel(zmq.DEALER, endpoint.hub, bind=False, address=endpoint.address)
                reader = asyncio.create_task(self._read(channel, self._on_stats))
                self.encoders[endpoint.key] = (endpoint.label, channel, reader)
            for endpoint in left:
                _, channel, reader = self.encoders.pop(endpoint.key)
                reader.cancel()
                channel.close()
            if not self.encoder_directory.named:
                return
            await asyncio.sleep(self.cfg.encoder.resolve_every_s)

    async def _tick(self) -> None:
        """Every heartbeat period: peers silent for ``dead_after_s`` are taken for lost, held requests go on.
        Silent by `LivenessClock`, which leaves out the time this loop was late by: after a stall of the
        gateway's own (the heartbeats that came meanwhile still unread in the sockets), the peers are not
        blamed for it, whether the readers or this tick run first."""
        while True:
            await asyncio.sleep(self.cfg.liveness.heartbeat_s)
            self.clock.tick()
            self.fetchers.tick()
            for replica in self.replicas.silenced():
                self._replica_lost(replica, "is not responding")
            if self.held:
                self._release_held()

    def _decoder_named(self, replica: Replica) -> str:
        return "the decoder" if len(self.replicas.all) == 1 else f"decoder replica {replica.index}"

    def _replica_lost(self, replica: Replica, why: str) -> None:
        """The requests ``replica`` held are gone with it (or queued for a process that will not know them):
        each that no token has come for yet goes again where `choose_replica` says (see `REISSUES`), or waits
        for a replica to be live (`_hold`) where none is; the others fail with a 503 that says to retry."""
        lost = [t for t in self.requests.values() if t.stage == "decode" and t.replica is replica]
        outcomes = {"sent": 0, "held": 0}
        for tracked in lost:
            # The decoder that leased the request's embeddings is gone and will never release them;
            # without this they would stay pinned (unevictable) until the lease TTL.
            self._send(self.cache, CacheRelease(tracked.wire_id))
            recoverable = not tracked.client_has_tokens and tracked.reissues < REISSUES
            outcome = self._recover(tracked) if recoverable else None
            if outcome is not None:
                outcomes[outcome] += 1
                continue
            tracked.stage = "failed"  # (not lost again at the next tick)
            message = f"{self._decoder_named(replica)} {why}; retry the request"
            self._deliver(RequestError(tracked.wire_id, 503, "unavailable", message))
        if lost:
            log.warning(
                "%s %s: of its %d requests, %d sent again and %d held until a replica is live (no token had come "
                "for them), the rest failed",
                self._decoder_named(replica),
                why,
                len(lost),
                outcomes["sent"],
                outcomes["held"],
            )

    def _recover(self, tracked: Tracked, media: bool = False) -> str | None:
        """A lost request under a new wire id: "sent" to a replica live now, or "held" until one is
        (``hold_lost_requests_s`` > 0); None where neither (it is left as it was). ``media``: lost because its
        media embeddings were (counted in ``media_reissues``), not with its replica."""
        target = self._live_replica_for(tracked)
        if target is None and self.cfg.liveness.hold_lost_requests_s <= 0:
            return None
        if media:
            tracked.media_reissues += 1
        else:
            tracked.reissues += 1
        self._rewire(tracked)
        if target is None:
            self._hold(tracked)
            return "held"
        self._send_again(tracked, target)
        return "sent"

    def _media_lost(self, error: RequestError) -> bool:
        """A decoder could not get a request's media embeddings (lost with a cache daemon or a fetcher, or their
        encode failed): fetched and encoded again under a new wire id, as if it had just come (see
        `MEDIA_REISSUES`); False where the error goes to the client (not that, a token came, or tried enough)."""
        tracked = self._tracked(error.request_id)
        if tracked is None or error.code != MEDIA_LOST or tracked.client_has_tokens or not tracked.request.media:
            return False
        if tracked.media_reissues >= MEDIA_REISSUES or tracked.stage in ("held", "failed"):
            return False
        previous = tracked.wire_id
        if self._recover(tracked, media=True) is None:
            return False
        self._send(self.cache, CacheRelease(previous))  # (what it leased under its old id: not read, not needed)
        log.warning(
            "request %s: its media embeddings were lost (%s); fetched again as %s",
            previous,
            error.message,
            tracked.wire_id,
        )
        return True

    def _live_replica_for(self, tracked: Tracked) -> Replica | None:
        """Where a lost request may go now: a live replica (not one still starting: it has waited once)."""
        replica = self.choose_replica(tracked.request)
        return replica if self.replicas.live(replica) else None

    def _rewire(self, tracked: Tracked) -> None:
        """Withdraw ``tracked`` from where it was and give it a new wire id, which the lost replica's queue (if
        a restarted process reads it) does not know: it runs nothing twice, and a late token from it is dropped."""
        self._withdraw(tracked)  # (its Abort reaches the lost replica's queue)
        self.rewired.pop(tracked.wire_id, None)
        tracked.wire_id = f"{tracked.request_id}.reissue{tracked.wires}"
        self.rewired[tracked.wire_id] = tracked.request_id
        if tracked.streaming:  # (tokens its client has not seen: the HTTP side drops them, usage counts once)
            tracked.streaming = False
            tracked.restarts += 1
            self.restarted += 1
            tracked.events.put_nowait(Restart(tracked.request_id))

    def _send_again(self, tracked: Tracked, replica: Replica) -> None:
        tracked.replica.reissued += 1  # (the lost replica's count)
        tracked.submitted = time.monotonic()
        frame = None
        if tracked.request.media:  # (encoded on the event loop: a rare event, and media are mostly URLs)
            frame = encode(dataclasses.replace(tracked.request, request_id=tracked.wire_id, replica=replica.index))
        self._dispatch(tracked, replica, frame)

    def _hold(self, tracked: Tracked) -> None:
        """Keep a lost request (accepted: a streaming client has its 200) until a replica is live to take it,
        for ``hold_lost_requests_s``: a lone decoder that crashed is back within seconds."""
        tracked.stage = "held"
        tracked.held_until = time.monotonic() + self.cfg.liveness.hold_lost_requests_s
        self.held[tracked.request_id] = tracked

    def _release_held(self) -> None:
        """Held requests go to a replica live now; those held past their time fail with a 503."""
        now = time.monotonic()
        for tracked in list(self.held.values()):
            target = self._live_replica_for(tracked)
            if target is None and now < tracked.held_until:
                continue
            del self.held[tracked.request_id]
            if target is not None:
                self._send_again(tracked, target)
                continue
            waited = self.cfg.liveness.hold_lost_requests_s
            message = f"{self._decoder_named(tracked.replica)} was lost and no replica was back within {waited:g} s"
            self._deliver(RequestError(tracked.wire_id, 503, "unavailable", message + "; retry the request"))
        if not self.held:
            log.info("no request is held for a decoder replica any more")

    # ------------------------------------------------------------------ status
    def encoders_live(self) -> int:
        """The vision encoders a live fetcher sees live (each fetcher sees them all)."""
        return max((self.encoders_seen.get(peer, 0) for peer in self.fetchers.peers), default=0)

    def decoder_live(self) -> bool:
        """Whether text-only requests and requests with media both have a live decoder replica."""
        return all(self.replicas.serving().values())

    async def worker_stats(self, timeout_s: float = 2.0) -> dict[str, dict[str, float]]:
        """Counters and gauges of the cache daemon, each encoder and each live fetcher, by the name each gives
        (``cache``, ``encoder.0``, ``fetcher.0``), asked all at once; one that does not answer within
        ``timeout_s`` (down, or busy past it) is left out."""
        encoders = {channel: f"encoder.{label}" for label, channel, _ in self.encoders.values()}
        targets: list[AsyncChannel | bytes] = [self.cache, *encoders, *self.fetchers.peers]  # (bytes: a fetcher)
        calls = {uuid.uuid4().hex: target for target in targets}
        loop = asyncio.get_running_loop()
        futures = {call_id: loop.create_future() for call_id in calls}
        self.stats_waiters.update(futures)
        for call_id, target in calls.items():
            if isinstance(target, bytes):
                self._send_to_fetcher(target, StatsRequest(call_id))
            else:
                self._send(target, StatsRequest(call_id))
        try:
            await asyncio.wait(futures.values(), timeout=timeout_s)
        finally:
            for call_id in futures:
                self.stats_waiters.pop(call_id, None)
        stats = {}
        for call_id, future in futures.items():
            if future.done() and not future.cancelled():
                answer, target = future.result(), calls[call_id]
                # (an encoder by the label it was dialled under: encoders of two hosts may name themselves alike)
                name = encoders.get(target, answer.role) if isinstance(target, AsyncChannel) else answer.role
                stats[name] = answer.counters
        return stats


# Enough of a data URL to tell images apart without reading megabytes on the event loop: its ends and its length.
AFFINITY_SAMPLE = 4096


def media_affinity(media: list[MediaInput]) -> bytes | None:
    """The key that sends a request to the fetcher its first media item went to before (`Dispatcher.submit`):
    a fetcher remembers what it decoded, so a conversation that resends an image is not decoded again."""
    if not media:
        return None
    url = media[0].url
    sample = f"{len(url)}:{url[:AFFINITY_SAMPLE]}:{url[-AFFINITY_SAMPLE:]}"
    return hashlib.blake2b(sample.encode(), digest_size=16).digest()
