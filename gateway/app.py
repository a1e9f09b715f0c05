"""The HTTP gateway: OpenAI routes in front of the fetcher pool and the decoder."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from common.config import Config
from common.dispatch import Dispatcher, Job
from common.protocol import (
    Abort,
    DecoderStats,
    FetchDone,
    GenerateRequest,
    Message,
    PreparedRequest,
    RequestError,
    SamplingParams,
    StatsRequest,
    StatsResult,
    TokenBatch,
    TokenDelta,
    WorkerStatus,
    encode,
)
from common.transport import AsyncChannel, worker_identity
from gateway.detokenize import IncrementalDetokenizer
from gateway.errors import ApiError
from gateway.prompt import PromptBuilder
from gateway.schema import ChatCompletionRequest, parse_chat_request

log = logging.getLogger(__name__)


@dataclass
class Tracked:
    """A request in flight: the pipeline's events for it land in ``events``."""

    request_id: str
    events: asyncio.Queue[TokenDelta | RequestError] = field(default_factory=asyncio.Queue)
    stage: str = "fetch"  # fetch -> decode


class Pipeline:
    """The gateway's side of the sockets: dispatch to fetchers, track the decoder, route results."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.fetch = AsyncChannel(self.ctx, zmq.ROUTER, cfg.endpoint("fetch"), bind=True)
        self.inbox = AsyncChannel(self.ctx, zmq.PULL, cfg.endpoint("gateway"), bind=True)
        self.decoder = AsyncChannel(self.ctx, zmq.PUSH, cfg.endpoint("decoder"), bind=False)
        self.cache = AsyncChannel(self.ctx, zmq.DEALER, cfg.endpoint("cache"), bind=False)
        self.fetchers = Dispatcher(
            self._send_to_fetcher, self._fetch_failed, dead_after_s=cfg.liveness.dead_after_s, max_attempts=3
        )
        self.requests: dict[str, Tracked] = {}
        self.decoder_incarnation = ""
        self.decoder_seen = 0.0
        self.decoder_stats: dict[str, float] = {}
        self.stats_waiters: dict[str, asyncio.Future[StatsResult]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(coro)
            for coro in (self._read_fetch(), self._read_inbox(), self._read_cache(), self._tick())
        ]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for channel in (self.fetch, self.inbox, self.decoder, self.cache):
            channel.close()

    # ------------------------------------------------------------------ submitting
    def submit(self, request: GenerateRequest) -> Tracked:
        tracked = self.requests[request.request_id] = Tracked(request.request_id)
        if request.media:
            self.fetchers.submit(request.request_id, request, self.cfg.server.request_timeout_s)
        else:  # text only: straight to the decoder
            tracked.stage = "decode"
            self._send(self.decoder, PreparedRequest(request.request_id, request.prompt_ids, [], request.sampling))
        return tracked

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.fetchers.cancel(request_id)
            self._send(self.decoder, Abort(request_id))

    def _send(self, channel: AsyncChannel, msg: Message) -> None:
        channel.sock.send(encode(msg))

    def _send_to_fetcher(self, peer: bytes, msg: Message) -> bool:
        future = self.fetch.sock.send_multipart([peer, encode(msg)])
        return not (future.done() and future.exception() is not None)

    def _fetch_failed(self, job: Job, why: str) -> None:
        self._deliver(RequestError(job.job_id, 503, "unavailable", f"no media fetcher could take the request: {why}"))

    def _deliver(self, event: TokenDelta | RequestError) -> None:
        tracked = self.requests.get(event.request_id)
        if tracked is not None:
            tracked.events.put_nowait(event)

    # ------------------------------------------------------------------ reading
    async def _read_fetch(self) -> None:
        while True:
            peer, msg = await self.fetch.recv()
            match msg:
                case WorkerStatus():
                    self.fetchers.peer_status(peer, msg)
                case FetchDone(request_id=rid):
                    self.fetchers.complete(rid)
                    if rid in self.requests:
                        self.requests[rid].stage = "decode"
                case _:
                    pass

    async def _read_inbox(self) -> None:
        while True:
            _, msg = await self.inbox.recv()
            match msg:
                case TokenBatch(deltas=deltas):
                    for delta in deltas:
                        self._deliver(delta)
                case RequestError():
                    self._deliver(msg)
                case DecoderStats(counters=counters):
                    self.decoder_stats = counters
                case WorkerStatus(role="decoder", incarnation=inc):
                    if self.decoder_incarnation and inc != self.decoder_incarnation:
                        self._fail_decoding("the decoder restarted")
                    self.decoder_incarnation = inc
                    self.decoder_seen = time.monotonic()
                case _:
                    pass

    async def _read_cache(self) -> None:
        while True:
            _, msg = await self.cache.recv()
            if isinstance(msg, StatsResult) and msg.call_id in self.stats_waiters:
                self.stats_waiters.pop(msg.call_id).set_result(msg)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.liveness.heartbeat_s)
            self.fetchers.tick()
            if self.decoder_seen and time.monotonic() - self.decoder_seen > self.cfg.liveness.dead_after_s:
                self._fail_decoding("the decoder is not responding")

    def _fail_decoding(self, why: str) -> None:
        for tracked in list(self.requests.values()):
            if tracked.stage == "decode":
                self._deliver(RequestError(tracked.request_id, 503, "unavailable", f"{why}; retry the request"))

    # ------------------------------------------------------------------ status
    def decoder_live(self) -> bool:
        return bool(self.decoder_seen) and time.monotonic() - self.decoder_seen <= self.cfg.liveness.dead_after_s

    async def cache_stats(self, timeout_s: float = 2.0) -> dict[str, float]:
        call_id = uuid.uuid4().hex
        future = self.stats_waiters[call_id] = asyncio.get_running_loop().create_future()
        self._send(self.cache, StatsRequest(call_id))
        try:
            return (await asyncio.wait_for(future, timeout_s)).counters
        except TimeoutError:
            self.stats_waiters.pop(call_id, None)
            return {}


class Gateway:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        model_dir = cfg.model_path()
        self.model_name = cfg.server.served_model_name or model_dir.name
        self.prompts = PromptBuilder(model_dir)
        self.pipeline = Pipeline(cfg)
        self.counters: dict[str, float] = dict.fromkeys(
            ("requests_total", "requests_failed", "requests_disconnected", "tokens_generated"), 0.0
        )
        self.instance = worker_identity("gateway")[0]

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.server.max_request_bytes)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.pipeline.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.pipeline.close()

    # ------------------------------------------------------------------ routes
    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "vlm-serve"}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        body = {"decoder": self.pipeline.decoder_live(), "fetchers": self.pipeline.fetchers.live_peers()}
        healthy = body["decoder"] and body["fetchers"] > 0
        return web.json_response({"status": "ok" if healthy else "degraded", **body}, status=200 if healthy else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        lines = [f"vlm_gateway_{k} {v}" for k, v in self.counters.items()]
        lines += [f"vlm_cache_{k} {v}" for k, v in (await self.pipeline.cache_stats()).items()]
        lines += [f"vlm_decoder_{k} {v}" for k, v in self.pipeline.decoder_stats.items()]
        lines.append(f"vlm_gateway_requests_in_flight {len(self.pipeline.requests)}")
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            chat = await self._parse(request)
            generate = await self._generate_request(chat)
        except ApiError as exc:
            return exc.response()
        self.counters["requests_total"] += 1
        tracked = self.pipeline.submit(generate)
        try:
            if chat.stream:
                return await self._stream(request, chat, tracked)
            return await self._complete(chat, tracked)
        except ApiError as exc:
            self.counters["requests_failed"] += 1
            return exc.response()
        finally:
            self.pipeline.abort(tracked.request_id)  # a no-op once finished; frees every stage otherwise

    async def _parse(self, request: web.Request) -> ChatCompletionRequest:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        chat = parse_chat_request(body)
        if chat.model not in (None, self.model_name):
            raise ApiError(
                404,
                f"model {chat.model!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )
        return chat

    async def _generate_request(self, chat: ChatCompletionRequest) -> GenerateRequest:
        prompt = await asyncio.get_running_loop().run_in_executor(None, self.prompts.build, chat.messages)
        max_tokens = chat.max_completion_tokens or chat.max_tokens or 1024
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=chat.temperature,
            top_p=chat.top_p,
            top_k=chat.top_k,
            seed=chat.seed,
            stop_token_ids=list(chat.stop_token_ids),
            ignore_eos=chat.ignore_eos,
            min_tokens=min(chat.min_tokens, max_tokens),
        )
        return GenerateRequest(f"chatcmpl-{uuid.uuid4().hex}", prompt.token_ids, prompt.media, sampling)

    async def _events(self, tracked: Tracked) -> Any:
        """The request's token deltas until its terminal one; errors raise ``ApiError``."""
        deadline = time.monotonic() + self.cfg.server.request_timeout_s
        while True:
            try:
                event = await asyncio.wait_for(tracked.events.get(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ApiError(504, "the request timed out in the pipeline", code="timeout") from None
            if isinstance(event, RequestError):
                raise ApiError(event.status, event.message, code=event.code)
            yield event
            if event.finish_reason is not None:
                return

    async def _complete(self, chat: ChatCompletionRequest, tracked: Tracked) -> web.Response:
        detok = IncrementalDetokenizer(self.prompts.tokenizer)
        token_ids: list[int] = []
        last: TokenDelta | None = None
        async for event in self._events(tracked):
            token_ids.extend(event.token_ids)
            last = event
        assert last is not None
        text = detok.push(token_ids, final=True)
        self.counters["tokens_generated"] += len(token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": last.finish_reason,
            "logprobs": None,
        }
        if chat.return_token_ids:
            choice["token_ids"] = token_ids
        return web.json_response(
            {
                "id": tracked.request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage(last),
            }
        )

    async def _stream(self, request: web.Request, chat: ChatCompletionRequest, tracked: Tracked) -> web.StreamResponse:
        events = self._events(tracked)
        try:
            first = await anext(events)  # errors before the first token still get a proper status
        except StopAsyncIteration:
            first = None
        sse = SseWriter(
            web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}),
            tracked.request_id,
            self.model_name,
        )
        await sse.response.prepare(request)
        try:
            await self._stream_events(sse, chat, events, first)
        except ConnectionResetError:  # the client went away; chat_completions' finally aborts the request
            self.counters["requests_disconnected"] += 1
            log.info("client of %s disconnected mid-stream", tracked.request_id)
        return sse.response

    async def _stream_events(
        self, sse: SseWriter, chat: ChatCompletionRequest, events: Any, first: TokenDelta | None
    ) -> None:
        detok = IncrementalDetokenizer(self.prompts.tokenizer)
        await sse.chunk({"role": "assistant", "content": ""}, None)
        last = event = first
        try:
            while event is not None:
                last = event
                final = event.finish_reason is not None
                text = detok.push(event.token_ids, final=final)
                self.counters["tokens_generated"] += len(event.token_ids)
                extra = {"token_ids": event.token_ids} if chat.return_token_ids else None
                if text or final or extra:
                    await sse.chunk({"content": text} if text else {}, event.finish_reason, extra)
                event = None if final else await anext(events)
        except ApiError as exc:  # mid-stream failure: the status is already sent, so report in-band
            await sse.send(exc.body())
            last = None
        if last is not None and chat.stream_options is not None and chat.stream_options.include_usage:
            await sse.send({**sse.header(), "choices": [], "usage": _usage(last)})
        await sse.response.write(b"data: [DONE]\n\n")
        await sse.response.write_eof()


class SseWriter:
    """Server-sent events of one chat completion stream, in OpenAI's chunk shape."""

    def __init__(self, response: web.StreamResponse, request_id: str, model: str) -> None:
        self.response = response
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def header(self) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    async def send(self, body: dict[str, Any]) -> None:
        await self.response.write(f"data: {json.dumps(body)}\n\n".encode())

    async def chunk(self, delta: dict[str, Any], finish: str | None, extra: dict[str, Any] | None = None) -> None:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **(extra or {})}
        await self.send({**self.header(), "choices": [choice]})


def _usage(last: TokenDelta) -> dict[str, int]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }
