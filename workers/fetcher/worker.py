"""The fetcher process: turns a ``GenerateRequest`` into a ``PreparedRequest`` for the decoder.

Per media item: download and preprocess (in a thread, off the socket loop; once for every request that
asks for the same item while it loads). Then the request's items are looked up in the cache daemon together
(`CacheReserve`: found or reserved all at once, waiting there for room where the pool is full), and each miss
goes as an ``EncodeJob`` to a live encoder. The request goes to the decoder as soon as every item is found or
reserved; the decoder waits for the embeddings through the cache, so encoding overlaps with the hand-off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import zmq

from common.config import Config, decoder_hub
from common.discovery import EncoderDirectory
from common.dispatch import Dispatcher, Job
from common.lifecycle import REPORT_EVERY_S, CounterWindow
from common.liveness import LivenessClock
from common.protocol import (
    Abort,
    CacheLookup,
    CacheRelease,
    CacheReserve,
    CacheReserveResult,
    CacheWrite,
    EncodeJob,
    EncodeResult,
    FetchDone,
    FetcherStarted,
    GenerateRequest,
    MediaInput,
    Message,
    PreparedMedia,
    PreparedRequest,
    RequestError,
    StatsRequest,
    StatsResult,
    TensorRef,
    WorkerStatus,
    commit_for,
)
from common.tensor_ref import inline_ref, nbytes_of
from common.topology import model_device_type, model_dtype_name
from common.transport import EventLoop, Transport, Wakeup, worker_identity
from workers.fetcher.encoders import EncoderLinks
from workers.fetcher.errors import MediaError
from workers.fetcher.image import ImageProcessorSpec
from workers.fetcher.media import DecodedMemo, LoadedImage, load_media
from workers.fetcher.video import VideoProcessorSpec
from workers.fetcher.video_qwen3_vl import Qwen3VideoSpec
from workers.models.registry import family, read_spec

log = logging.getLogger(__name__)
# Images whose bytes a fetcher remembers the patchified form of (a few hundred bytes each): see DecodedMemo.
MEMO_ENTRIES = 16384
# Timestamp texts whose token ids a fetcher keeps: the ones of a few hours of video.
_TIMESTAMPS_KNOWN = 100_000


@dataclass
class InFlight:
    request: GenerateRequest
    deadline: float
    arrived: dict[int, LoadedImage] = field(default_factory=dict)  # items loaded so far, by index
    loaded: list[LoadedImage] = field(default_factory=list)  # every item, once all have arrived
    prepared: dict[int, PreparedMedia] = field(default_factory=dict)
    reserving: bool = False  # its items were sent to the cache: it may hold leases or wait there for room


@dataclass
class ChunkedEncode:
    """One video encoded as several jobs of whole frames, each writing its rows into the same slot."""

    content_hash: str
    slot: TensorRef  # the whole video's
    pending: set[str]  # job ids not yet done
    failed: bool = False


def frame_chunks(grid_thw: Sequence[int], max_patches: int) -> list[tuple[int, int]]:
    """[start, end) temporal-patch ranges of at most ``max_patches`` patches each (at least one frame).

    Exact: the vision tower attends within a frame and merges rows within a frame, so the rows of frames
    [a, b) encoded alone are the rows those frames get in the whole video."""
    t, h, w = grid_thw
    per_chunk = max(1, max_patches // (h * w))
    return [(a, min(a + per_chunk, t)) for a in range(0, t, per_chunk)]


@dataclass
class CacheCall:
    """A request's reservation sent to the cache daemon, kept until answered (or long stale)."""

    request_id: str
    items: list[LoadedImage]
    sent: float
    tries: int
    retried: bool = False


class TimestampTokens:
    """Token ids of a video frame's timestamp text ("<1.5 seconds>") by the checkpoint's tokenizer. Between two
    special tokens in the prompt (`<|vision_start|>` or `<|vision_end|>` around it), the text is tokenized alone,
    as the gateway's tokenizer would the whole prompt. Few distinct texts occur: each is tokenized once."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer  # (only fetchers of a timestamping family load it)

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.known: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        found = self.known.get(text)
        if found is None:
            if len(self.known) >= _TIMESTAMPS_KNOWN:  # (one per tenth of a second of the longest video seen)
                self.known.clear()
            found = self.known[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return found


class FetcherWorker:
    def __init__(self, cfg: Config, index: int = 0) -> None:
        self.cfg = cfg
        self.name = f"fetcher.{index}"
        self.incarnation, identity = worker_identity("fetcher")
        model_path = cfg.model_path()
        self.spec = read_spec(model_path)
        self.image_spec = ImageProcessorSpec.from_dir(model_path)
        self.video_spec: VideoProcessorSpec | Qwen3VideoSpec = VideoProcessorSpec.from_dir(model_path)
        self.timestamps: TimestampTokens | None = None
        if family(self.spec.model_type).video_timestamps:
            self.video_spec = Qwen3VideoSpec.from_dir(model_path)
            self.timestamps = TimestampTokens(str(model_path))
        self.model_key = str(model_path.resolve())
        self.embed_dtype = model_dtype_name(cfg, model_device_type(cfg))
        self.max_model_len = cfg.decoder.max_model_len or self.spec.max_position_embeddings
        self.transport = Transport(cfg, "fetcher")
        self.gateway = self.transport.channel(zmq.DEALER, "fetch", bind=False, identity=identity)
        self.results = self.transport.channel(zmq.PUSH, "gateway", bind=False)
        self.decoders = [  # a request goes to the replica the gateway chose for it
            self.transport.channel(zmq.PUSH, decoder_hub(r), bind=False) for r in range(cfg.decoder.replicas)
        ]
        self.cache = self.transport.channel(zmq.DEALER, "cache", bind=False)
        # The encoders' and the cache daemon's liveness is judged on this clock, which `heartbeat` (the loop's
        # periodic tick) advances: a stall of this process's own loop is not their silence (`LivenessClock`).
        self.clock = LivenessClock(cfg.liveness.heartbeat_s)
        self.encode = Dispatcher(
            self.send_encode,
            self.encode_failed,
            clock=self.clock,
            dead_after_s=cfg.liveness.dead_after_s,
            max_attempts=cfg.fetcher.encode_attempts,
            # with every encoder down that long, image requests fail at once (503) instead of a minute each
            hold_without_workers_s=cfg.liveness.hold_lost_requests_s,
        )
        self.threads = ThreadPoolExecutor(cfg.fetcher.threads, thread_name_prefix="fetch")
        self.memo = DecodedMemo(MEMO_ENTRIES)
        self.inflight: dict[str, InFlight] = {}
        # Items being loaded -> the (request, index) pairs waiting for each: an item asked for again while it
        # loads (the n choices of one request, clients sending one URL at once) is downloaded once.
        self.loading: dict[MediaInput, list[tuple[str, int]]] = {}
        self.calls: dict[str, CacheCall] = {}
        # The cache daemon's liveness while reservations wait there: its incarnation, when it last answered a
        # ping (`LivenessClock` time), and (`cache_has_all_before`) when the newest ping it answered was sent:
        # it holds every reservation sent before that, one socket keeping their order.
        self.cache_incarnation = ""
        self.cache_heard = 0.0
        self.cache_has_all_before = 0.0
        self.pings: dict[str, float] = {}
        self.chunked: dict[str, ChunkedEncode] = {}  # job id -> its video's parts
        self.loop = EventLoop()
        self.loop.exit_if_stalled(cfg.liveness.stall_exit_s, "fetcher")
        self.loaded = Wakeup(self.loop, self.on_loaded)
        self.decoded_again = Wakeup(self.loop, self.on_decoded_again)
        self.loop.on_message(self.gateway, self.on_gateway)
        self.loop.on_message(self.cache, self.on_cache)
        # The encoders, by address (a name in [endpoints] is each address it resolves to, again every
        # resolve_every_s). One on a tcp:// endpoint may be on another host, which this host's shared or GPU memory
        # (the slots) cannot reach: it sends the rows back, and the cache here writes them (`EncodeJob.by_value`).
        directory = EncoderDirectory(cfg)
        self.encoders = EncoderLinks(directory, self.transport, self.loop, self.encode, self.on_encoder)
        self.encoders.refresh()
        if directory.named:
            self.loop.every(cfg.encoder.resolve_every_s, self.encoders.refresh)
        self.loop.every(cfg.liveness.heartbeat_s, self.heartbeat)
        self.counters = {
            "items_loaded": 0.0,
            "items_shared": 0.0,
            "items_remembered": 0.0,
            "items_decoded_again": 0.0,
            "load_s": 0.0,
            "thread_wait_s": 0.0,
            "encode_jobs": 0.0,
            "requests_failed": 0.0,
        }
        self.window = CounterWindow(self.counters)
        self.loop.every(REPORT_EVERY_S, self.report)
        # (first to the cache: what a predecessor of ours reserved there and did not encode is failed now)
        self.cache.send(FetcherStarted(self.name, self.incarnation))
        # Then the daemon's incarnation, before any call: a restart is known by a ping's answer from another one,
        # so without it a call lost with a daemon that died before answering any ping would be taken for one
        # the new daemon holds, and wait out its reservation deadline.
        self.ping_cache()
        self.heartbeat()
        log.info("fetcher ready: %d encoder(s), embeddings %s", self.encoders.known, self.embed_dtype)

    def run(self) -> None:
        try:
            self.loop.run()
        finally:
            self.threads.shutdown(wait=False, cancel_futures=True)
            for channel in [self.gateway, self.results, self.cache, *self.decoders]:
                channel.close()
            self.encoders.close()

    # ------------------------------------------------------------------ liveness
    def heartbeat(self) -> None:
        """The periodic tick: the clock first, so that the time this loop was late by is nobody's silence."""
        self.clock.tick()
        live, known = self.encode.live_peers(), self.encoders.known
        self.gateway.send(WorkerStatus("fetcher", self.name, self.incarnation, self.cfg.fetcher.credits, live, known))
        self.encoders.ping()
        self.encode.tick()
        self.encoders.close_drained()
        self.retry_cache_calls()

    def report(self) -> None:
        """A line per period with work: where a request's media time goes before the encoders."""
        seconds, grew = self.window.take()
        loaded = grew["items_loaded"]
        if loaded:
            log.info(
                "fetcher: %d images or videos loaded over %.1fs (%d more asked for while loading), %.0f ms each "
                "in a thread after waiting %.0f ms for one; %d encode jobs sent, %d queued for an encoder, "
                "%d at encoders",
                loaded,
                seconds,
                grew["items_shared"],
                1e3 * grew["load_s"] / loaded,
                1e3 * grew["thread_wait_s"] / loaded,
                grew["encode_jobs"],
                len(self.encode.queue),
                sum(len(p.jobs) for p in self.encode.peers.values()),
            )

    # ------------------------------------------------------------------ gateway side
    def on_gateway(self, _peer: bytes, msg: Message) -> None:
        match msg:
            case GenerateRequest(request_id=rid) if rid not in self.inflight:
                state = self.inflight[rid] = InFlight(msg, time.monotonic() + self.cfg.server.request_timeout_s)
                if not 0 <= msg.replica < len(self.decoders):  # (a gateway with another config than ours)
                    why = f"decoder replica {msg.replica} does not exist: [decoder] replicas = {len(self.decoders)}"
                    self.finish_error(rid, 500, f"{why}; the gateway and the fetchers must share one config")
                    return
                if len(msg.media) > self.cfg.fetcher.max_images_per_request:
                    self.finish_error(
                        rid,
                        400,
                        f"{len(msg.media)} images and videos in one request; the limit is "
                        f"{self.cfg.fetcher.max_images_per_request}",
                    )
                    return
                if not msg.media:
                    self.forward(state)
                for index, media in enumerate(msg.media):
                    self.start_load(rid, index, media)
            case Abort(request_id=rid):
                state = self.inflight.pop(rid, None)
                if state is not None and state.reserving:  # its reservation withdrawn, any leases ended
                    self.cache.send(CacheRelease(rid))
            case StatsRequest(call_id=call_id):
                self.gateway.send(StatsResult(call_id, self.name, self.incarnation, self.stats()))
            case _:
                pass

    def stats(self) -> dict[str, float]:
        gauges = {
            "requests_in_flight": len(self.inflight),
            "encode_jobs_queued": len(self.encode.queue),
            "encode_jobs_at_encoders": sum(len(p.jobs) for p in self.encode.peers.values()),
            "encoders_live": self.encode.live_peers(),
        }
        return {**self.counters, **{k: float(v) for k, v in gauges.items()}}

    def start_load(self, request_id: str, index: int, media: MediaInput) -> None:
        """One thread task per item, so a request's images load side by side; or, where the same item is
        loading already, a place among those waiting for it."""
        waiting = self.loading.get(media)
        if waiting is not None:
            waiting.append((request_id, index))
            self.counters["items_shared"] += 1
            return
        self.loading[media] = [(request_id, index)]
        self.threads.submit(self.load_one, media, time.monotonic())

    def load_one(self, media: MediaInput, submitted: float) -> None:
        """Thread: fetch and preprocess one item; the loop gets the result through ``loaded``."""
        started = time.monotonic()
        result: LoadedImage | MediaError
        try:
            result = load_media(media, self.image_spec, self.video_spec, self.cfg.fetcher, self.model_key, self.memo)
        except MediaError as exc:
            result = exc
        except Exception as exc:
            log.exception("loading media failed")
            result = MediaError(500, f"media processing failed: {exc}")
        self.loaded.post((media, result, started - submitted, time.monotonic() - started))

    def on_loaded(self, item: object) -> None:
        media, result, thread_wait_s, load_s = item  # type: ignore[misc]
        self.counters["items_loaded"] += 1
        self.counters["items_remembered"] += isinstance(result, LoadedImage) and result.pixel_values is None
        self.counters["thread_wait_s"] += thread_wait_s
        self.counters["load_s"] += load_s
        for request_id, index in self.loading.pop(media, []):
            self.item_arrived(request_id, index, result)

    def item_arrived(self, request_id: str, index: int, result: LoadedImage | MediaError) -> None:
        state = self.inflight.get(request_id)
        if state is None:
            return  # aborted or failed meanwhile (the first bad item answers for the request)
        if isinstance(result, MediaError):
            self.finish_error(request_id, result.status, result.message)
            return
        state.arrived[index] = result
        if len(state.arrived) == len(state.request.media):
            state.loaded = [state.arrived[i] for i in range(len(state.request.media))]
            self.check_and_prepare(state)

    def check_and_prepare(self, state: InFlight) -> None:
        """Every item is loaded: refuse a prompt over the context, else look each item up in the cache."""
        request_id, result = state.request.request_id, state.loaded
        media_tokens = sum(self.prompt_tokens(x) for x in result)
        prompt_len = len(state.request.prompt_ids) - len(result) + media_tokens
        if prompt_len >= self.max_model_len:
            self.finish_error(
                request_id,
                400,
                f"the prompt is {prompt_len} tokens ({media_tokens} of them image/video tokens) but the model's "
                f"context is {self.max_model_len}; shorten the prompt, use fewer or smaller images or videos, "
                "or lower max_pixels (or fps for videos)",
            )
            return
        self.call_cache(state, tries=1)

    def prompt_tokens(self, item: LoadedImage) -> int:
        """The tokens an item's placeholder becomes: its embedding rows, and for a timestamped video each temporal
        step's timestamp with its <|vision_start|> and <|vision_end|> (`workers.models.mrope._timed_steps`)."""
        if item.frame_texts is None or self.timestamps is None:
            return item.num_tokens
        return item.num_tokens + sum(len(self.timestamps.ids(text)) + 2 for text in item.frame_texts)

    # ------------------------------------------------------------------ cache side
    def call_cache(self, state: InFlight, tries: int) -> None:
        """Every item of the request to the cache at once: found, or reserved for us to encode, or waiting
        there for room (all or none, so a request never holds part of the pool while it waits for the rest)."""
        call_id = uuid.uuid4().hex
        state.reserving = True
        self.calls[call_id] = CacheCall(state.request.request_id, state.loaded, time.monotonic(), tries)
        lookups = []
        for index, item in enumerate(state.loaded):
            shape = self.embedding_shape(item.num_tokens)
            nbytes = nbytes_of(self.embed_dtype, shape)
            lookups.append(CacheLookup(str(index), item.content_hash, nbytes, self.embed_dtype, shape))
        self.cache.send(CacheReserve(call_id, state.request.request_id, lookups, self.name, self.incarnation))

    def embedding_shape(self, tokens: int) -> list[int]:
        """An item's cache entry: [tokens, hidden], or with DeepStack (Qwen3-VL) every feature set of the item in
        one entry, [1 + K, tokens, hidden], so that the sets are found, leased and evicted together."""
        if self.spec.num_deepstack:
            return [self.spec.embedding_sets, tokens, self.spec.hidden_size]
        return [tokens, self.spec.hidden_size]

    def retry_cache_calls(self) -> None:
        """Ask again when the cache does not answer; the first call is kept, so that a late answer that
        reserved slots still gets its encode jobs (or nobody would ever fill them). A reservation waiting for
        room at a live daemon is not re-sent: the daemon answers it by its deadline."""
        now = time.monotonic()
        if self.calls:
            self.ping_cache()
        for call_id, call in list(self.calls.items()):
            age = now - call.sent
            if age > 2 * self.cfg.cache.pending_ttl_s + self.cfg.cache.reserve_wait_s:
                del self.calls[call_id]
            if call.retried or age < self.cfg.liveness.call_timeout_s or self.held_by_cache(call, now):
                continue
            call.retried = True
            state = self.inflight.get(call.request_id)
            if state is None or state.prepared:
                continue
            if call.tries >= 3:
                self.finish_error(call.request_id, 503, "the embedding cache daemon is not answering")
            else:
                self.call_cache(state, call.tries + 1)

    def ping_cache(self) -> None:
        """Ask the daemon its incarnation; its answer also says it has every message sent before this one."""
        ping = uuid.uuid4().hex
        self.pings[ping] = time.monotonic()
        self.cache.send(StatsRequest(ping))

    def held_by_cache(self, call: CacheCall, now: float) -> bool:
        """The daemon has this reservation and is alive: it answers it by its deadline."""
        alive = self.clock.now() - self.cache_heard < self.cfg.liveness.dead_after_s
        answered_by = call.sent + self.cfg.cache.reserve_wait_s + self.cfg.liveness.call_timeout_s
        return alive and call.sent < self.cache_has_all_before and now < answered_by

    def on_cache(self, _peer: bytes, msg: Message) -> None:
        match msg:
            case StatsResult(call_id=ping, incarnation=incarnation):
                self.cache_alive(ping, incarnation)
            case CacheReserveResult():
                self.reserved(msg)
            case _:
                pass

    def cache_alive(self, ping: str, incarnation: str) -> None:
        """A ping answered. From a new daemon (restarted): every reservation waiting at the old one is lost
        with it, so each is sent again now."""
        self.cache_heard = self.clock.now()
        restarted = bool(self.cache_incarnation) and incarnation != self.cache_incarnation
        self.cache_incarnation = incarnation
        if restarted:
            self.cache.send(FetcherStarted(self.name, self.incarnation))
            self.cache_has_all_before = 0.0
            self.pings.clear()
            for call in list(self.calls.values()):
                state = self.inflight.get(call.request_id)
                if not call.retried and state is not None and not state.prepared:
                    call.retried = True
                    self.call_cache(state, call.tries)
            return
        sent = self.pings.pop(ping, None)
        if sent is not None:
            self.cache_has_all_before = max(self.cache_has_all_before, sent)

    def reserved(self, msg: CacheReserveResult) -> None:
        call = self.calls.pop(msg.call_id, None)
        if call is None:
            return
        for item, result in zip(call.items, msg.results, strict=False):
            if result.state != "reserved" or result.slot is None:
                continue
            if item.pixel_values is None:  # known from the memo, but its embedding is gone from the cache
                self.threads.submit(self.decode_again, item, result.slot)
            else:
                self.submit_encode(item, result.slot)
        state = self.inflight.get(call.request_id)
        if state is None or state.prepared:
            return
        if msg.status != 200:
            self.finish_error(call.request_id, msg.status, msg.message, msg.code)
            return
        for index, item in enumerate(call.items):
            texts = None
            if item.frame_texts is not None and self.timestamps is not None:
                texts = [self.timestamps.ids(text) for text in item.frame_texts]
            state.prepared[index] = PreparedMedia(
                item.kind, item.content_hash, list(item.grid_thw), item.num_tokens, item.second_per_grid_t, texts
            )
        self.forward(state)

    def decode_again(self, item: LoadedImage, slot: TensorRef) -> None:
        """Thread: the patches of an image the memo knew, for the slot the cache reserved for it."""
        try:
            if item.decode_again is None:
                raise RuntimeError("an item without patches has no way to make them")
            result: LoadedImage | str = item.decode_again()
        except Exception as exc:
            log.exception("decoding a remembered image again failed")
            result = f"decoding the image again failed: {exc}"
        self.decoded_again.post((item, slot, result))

    def on_decoded_again(self, posted: object) -> None:
        item, slot, result = posted  # type: ignore[misc]
        self.counters["items_decoded_again"] += 1
        if isinstance(result, str) or result.content_hash != item.content_hash:
            # The requests waiting for this entry get its error (the decoder's acquire fails, as for a lost encode).
            why = result if isinstance(result, str) else "the image decoded to other pixels than before"
            self.cache.send(commit_for(item.content_hash, slot, why))
            return
        self.submit_encode(result, slot)

    def submit_encode(self, item: LoadedImage, slot: TensorRef) -> None:
        jobs = self.encode_jobs(item, slot)
        if len(jobs) > 1:
            group = ChunkedEncode(item.content_hash, slot, {job.job_id for job in jobs})
            self.chunked.update((job.job_id, group) for job in jobs)
        for job in jobs:
            self.encode.submit(job.job_id, job, self.cfg.fetcher.encode_timeout_s)
        self.counters["encode_jobs"] += len(jobs)

    def forward(self, state: InFlight) -> None:
        request = state.request
        media = [state.prepared[i] for i in range(len(state.loaded))]
        prepared = PreparedRequest(request.request_id, request.prompt_ids, media, request.sampling)
        self.decoders[request.replica].send(prepared)
        self.done(request.request_id)

    # ------------------------------------------------------------------ encoder side
    def encode_jobs(self, item: LoadedImage, slot: TensorRef) -> list[EncodeJob]:
        """One job per image; a video larger than an encoder's batch budget goes in chunks of frames, so
        that it neither monopolises one encoder nor exceeds its batch, and spreads over several."""
        t, h, w = item.grid_thw
        chunks = frame_chunks(item.grid_thw, self.cfg.encoder.max_batch_patches) if item.kind == "video" else [(0, t)]
        merge = self.spec.vision.spatial_merge_size**2
        row_bytes = nbytes_of(slot.dtype, slot.shape[1:])
        norm = item.normalization
        jobs = []
        for start, end in chunks:
            first_row, rows = start * h * w // merge, (end - start) * h * w // merge
            # (a whole item is its whole slot, whatever its layout: with DeepStack, [1 + K, rows, hidden])
            part = slot
            if len(chunks) > 1:
                part = dataclasses.replace(
                    slot, offset=slot.offset + first_row * row_bytes, shape=[rows, *slot.shape[1:]]
                )
            pixels = item.pixel_values[start * h * w : end * h * w]
            job = EncodeJob(
                uuid.uuid4().hex,
                item.content_hash,
                inline_ref(torch.from_numpy(pixels)),
                [end - start, h, w],
                part,
                rescale_factor=norm.rescale_factor if norm else None,
                image_mean=list(norm.mean or ()) if norm else [],
                image_std=list(norm.std or ()) if norm else [],
                commit=len(chunks) == 1,
            )
            jobs.append(job)
        return jobs

    def part_done(self, job_id: str, ok: bool, why: str) -> bool:
        """Account for one part of a chunked video; False if ``job_id`` is not one."""
        group = self.chunked.pop(job_id, None)
        if group is None:
            return False
        group.pending.discard(job_id)
        if not ok and not group.failed:
            group.failed = True
            self.cache.send(commit_for(group.content_hash, group.slot, f"a part of the video failed: {why}"))
        elif ok and not group.pending and not group.failed:
            self.cache.send(commit_for(group.content_hash, group.slot))
        return True

    def send_encode(self, key: bytes, job: Message) -> bool:
        if self.encoders.by_value(key) and isinstance(job, EncodeJob):
            job = dataclasses.replace(job, by_value=True)
        return self.encoders.send(key, job)

    def on_encoder(self, key: bytes, msg: Message) -> None:
        match msg:
            case WorkerStatus():
                self.encode.peer_status(key, msg)
            case EncodeResult(job_id=job_id):
                job = self.encode.complete(job_id)
                if job is None:
                    return
                ok, why = msg.status == 200, msg.message
                if self.encoders.by_value(key) and isinstance(job.payload, EncodeJob):
                    ok, why = self.store_by_value(job.payload, msg)
                self.part_done(job_id, ok, why)
            case _:
                pass

    def store_by_value(self, job: EncodeJob, result: EncodeResult) -> tuple[bool, str]:
        """The rows an encoder sent back, to the cache to write into the job's slot, and (for a whole item) the
        entry committed or failed: what an encoder that reaches the slot does itself. (ok, why not)."""
        rows = result.rows if result.status == 200 else None
        why = "" if rows is not None else result.message or "the encoder sent no embedding"
        if rows is not None:
            self.cache.send(CacheWrite(job.content_hash, job.slot, rows))
        if job.commit:
            self.cache.send(commit_for(job.content_hash, job.slot, why))
        return rows is not None, why

    def encode_failed(self, job: Job, why: str) -> None:
        assert isinstance(job.payload, EncodeJob)
        log.error("encode job %s failed: %s", job.job_id, why)
        # The decoder waits on the cache entry: failing it there answers every waiting request.
        if not self.part_done(job.job_id, False, f"vision encoder unavailable: {why}"):
            why = f"vision encoder unavailable: {why}"
            self.cache.send(commit_for(job.payload.content_hash, job.payload.slot, why))

    # ------------------------------------------------------------------ endings
    def finish_error(self, request_id: str, status: int, message: str, code: str = "") -> None:
        self.counters["requests_failed"] += 1
        code = code or ("invalid_media" if status < 500 else "unavailable")
        self.results.send(RequestError(request_id, status, code, message))
        state = self.inflight.get(request_id)
        if state is not None and state.reserving:  # (whatever it holds or waits for at the cache)
            self.cache.send(CacheRelease(request_id))
        self.done(request_id)

    def done(self, request_id: str) -> None:
        self.inflight.pop(request_id, None)
        self.gateway.send(FetchDone(request_id))
