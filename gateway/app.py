"""The HTTP gateway: OpenAI routes in front of the fetcher pool and the decoder."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from common.config import Config
from common.protocol import GenerateRequest, RequestError, SamplingParams
from gateway.admission import FirstAnswerRate, foreseen_wait, queue_backlog
from gateway.choice import ChoiceStream, ChoiceUpdate
from gateway.defaults import sampling_defaults, with_defaults
from gateway.errors import ApiError, internal_error
from gateway.metrics import GatewayMetrics, Reported
from gateway.offload import off_loop_if_large
from gateway.pipeline import Event, Pipeline, Restart
from gateway.prompt import Prompt, PromptBuilder
from gateway.reasoning import thinking_template
from gateway.schema import GenerationOptions, parse_chat_request, parse_completion_request
from gateway.structured import GrammarChecker
from gateway.tools import ToolPlan, ToolStream, plan_tools

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger(__name__)

Events = asyncio.Queue[Event]


class AnswerQueue(asyncio.Queue[Event]):
    """A request's events, telling the gateway once when the first arrives: from then on the request no longer
    waits in a queue (``[server] max_queue_wait_s``, `queue_backlog`)."""

    def __init__(self, on_first: Callable[[], object]) -> None:
        super().__init__()
        self.on_first: Callable[[], object] | None = on_first

    def put_nowait(self, item: Event) -> None:
        if self.on_first is not None:
            self.on_first()
            self.on_first = None
        super().put_nowait(item)


class Gateway:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        model_dir = cfg.model_path()
        self.model_name = cfg.server.served_model_name or model_dir.name
        self.started = int(time.time())  # the model card's "created"
        self.prompts = PromptBuilder(model_dir)
        self.thinking = thinking_template(self.prompts.tokenizer, self.prompts.chat_template)  # None: it does not
        self.grammars = GrammarChecker(self.prompts.tokenizer)
        self.defaults = sampling_defaults(model_dir) if cfg.model.generation_config == "auto" else {}
        if self.defaults:
            log.info("sampling defaults from %s/generation_config.json: %s", model_dir, self.defaults)
        self.latency = GatewayMetrics()
        self.pipeline = Pipeline(cfg, self.latency.media_prepare)
        self.counters: dict[str, float] = dict.fromkeys(
            ("requests_total", "requests_failed", "requests_disconnected", "requests_refused_busy", "tokens_generated"),
            0.0,
        )
        self.in_flight = 0  # completion requests being handled, from their first byte to their last
        self.in_flight_bytes = 0  # their bodies' sizes (declared, or read)
        self.counted_bytes: dict[int, int] = {}  # what each request (by id) counts in in_flight_bytes
        self.waiting_since: dict[int, float] = {}  # admitted requests (by id) with no answer yet: when admitted
        self.first_answers = FirstAnswerRate()

    def app(self) -> web.Application:
        middlewares = [error_shapes(self.cfg.server.max_request_bytes)]
        if self.cfg.server.api_keys:
            middlewares.append(api_key_middleware(self.cfg.server.api_keys))
        app = web.Application(
            client_max_size=self.cfg.server.max_request_bytes, middlewares=[request_ids, *middlewares]
        )
        app.on_response_prepare.append(_answer_with_request_id)
        app.on_response_prepare.append(_retry_after_on_503)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
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
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's ``models.retrieve``."""
        try:
            self._check_model(request.match_info["model"])
        except ApiError as exc:
            return exc.response()
        return web.json_response(self._card())

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "vlm-serve"}

    async def health(self, _request: web.Request) -> web.Response:
        replicas = self.pipeline.replicas
        body: dict[str, Any] = {"decoder": self.pipeline.decoder_live()}
        body["fetchers"] = self.pipeline.fetchers.live_peers()
        body["encoders"] = self.pipeline.encoders_live()  # (as the fetchers see them)
        if len(replicas.all) > 1:
            body["decoders"] = {r.name: replicas.live(r) for r in replicas.all}
        healthy = body["decoder"] and body["fetchers"] > 0 and body["encoders"] > 0
        return web.json_response({"status": "ok" if healthy else "degraded", **body}, status=200 if healthy else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        """Prometheus text format: the gateway's latency histograms and counters, and the counters and gauges of
        the cache daemon, each vision encoder and fetcher (asked now; one that does not answer in time is left
        out) and each decoder replica (its last report). Counters are cumulative per process."""
        pipeline = self.pipeline
        gateway = {
            **self.counters,
            "requests_in_flight": len(pipeline.requests),
            "requests_reissued": sum(r.reissued for r in pipeline.replicas.all),
            "requests_restarted": pipeline.restarted,
            "requests_held": len(pipeline.held),
            "replicas_lost": sum(r.lost for r in pipeline.replicas.all),
            "requests_waiting_first_answer": len(self.waiting_since),
            "first_answers_per_s_best": self.first_answers.best(time.monotonic()),
            "security_denied": pipeline.transport.security.denied,
        }
        reported = [Reported("vlm_gateway", gateway)]
        workers = await pipeline.worker_stats()
        reported.append(Reported("vlm_cache", workers.get("cache", {})))
        for role in ("encoder", "fetcher"):
            each = {name.removeprefix(f"{role}."): v for name, v in workers.items() if name.startswith(f"{role}.")}
            reported.append(Reported(f"vlm_{role}", each, label=role))
        replicas = pipeline.replicas.all
        if len(replicas) == 1:
            reported.append(Reported("vlm_decoder", replicas[0].stats))
        else:  # one series per replica, and where the gateway sent requests
            reported.append(Reported("vlm_decoder", {str(r.index): r.stats for r in replicas}, label="replica"))
            routing = {
                str(r.index): dict(
                    requests_in_flight=r.load,
                    requests_routed=r.routed,
                    fallback_requests=r.fallbacks,
                    reissued_requests=r.reissued,
                )
                for r in replicas
            }
            reported.append(Reported("vlm_gateway_replica", routing, label="replica"))
        return web.Response(body=self.latency.scrape(reported), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admitted(request, self._chat_completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._admitted(request, self._completions)

    async def _admitted(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request past ``[server] max_requests_in_flight``, or whose body would take the bodies in flight
        past ``max_request_bytes_in_flight``, or that would wait past ``max_queue_wait_s`` for its first answer
        (`_queueing`), is answered 503 at once, before its body is read: a flood must not queue (and hold bodies
        of up to max_request_bytes each) without end. OpenAI's clients retry a 503 after the Retry-After. (One
        request alone is always let in, up to max_request_bytes.) A body sent in chunks, whose size is known only
        once read, is counted at the most it may be until then."""
        server = self.cfg.server
        size = server.max_request_bytes if request.content_length is None else request.content_length
        if self.in_flight >= server.max_requests_in_flight:
            busy = f"at its limit of {server.max_requests_in_flight} requests in flight"
        elif self.in_flight and self.in_flight_bytes + size > server.max_request_bytes_in_flight:
            busy = f"holding {self.in_flight_bytes} B of requests, and this one's {size} B would pass its limit"
        else:
            busy = self._queueing(server.max_queue_wait_s)
        if busy:
            self.counters["requests_refused_busy"] += 1
            return ApiError(503, f"the server is {busy}; retry shortly", code="server_busy", retry_after_s=1).response()
        self.in_flight += 1
        self.in_flight_bytes += size
        self.counted_bytes[id(request)] = size
        admitted = time.monotonic()
        self.waiting_since[id(request)] = admitted
        self.first_answers.line(admitted, len(self.waiting_since))
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1
            self.in_flight_bytes -= self.counted_bytes.pop(id(request))
            if self.waiting_since.pop(id(request), None) is not None:  # (ended with no answer: an error, a hang-up)
                self.first_answers.line(time.monotonic(), len(self.waiting_since))

    def _queueing(self, wait_s: float) -> str:
        """Why a new request would wait past ``wait_s`` for its first answer (`gateway.admission`), or ""."""
        if wait_s <= 0:
            return ""
        now = time.monotonic()
        line = len(self.waiting_since)
        rate = self.first_answers.best(now)
        foreseen = foreseen_wait(line, rate)
        if foreseen is not None and foreseen > wait_s:
            return (
                f"queueing: {line} requests are waiting for their first answer, about {foreseen:.1f} s of work at "
                f"the {rate:.1f} a second it serves, over max_queue_wait_s ({wait_s:g} s)"
            )
        backlog = queue_backlog(self.waiting_since.values(), now, wait_s, self.in_flight)
        if backlog:
            return (
                f"queueing: {backlog} of its {self.in_flight} requests in flight have waited over "
                f"{wait_s:g} s for their first answer (max_queue_wait_s)"
            )
        return ""

    def _answered(self, request_key: int) -> None:
        """A request's first answer: it leaves the line, and counts towards the rate the line is served at."""
        if self.waiting_since.pop(request_key, None) is not None:
            now = time.monotonic()
            self.first_answers.record(now)
            self.first_answers.line(now, len(self.waiting_since))

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            chat = parse_chat_request(await self._json(request))
            self._check_model(chat.model)
            tools = plan_tools(chat, lambda: self.prompts.renders_tools)
            build = functools.partial(
                self.prompts.build,
                chat.messages,
                chat.add_generation_prompt,
                chat.continue_final_message,
                chat.chat_template_kwargs,
                tools.template_tools,
            )
            prompt = await asyncio.get_running_loop().run_in_executor(None, build)
        except ApiError as exc:
            return exc.response()
        return await self._serve(request, chat, [prompt], CHAT, tools)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            options = parse_completion_request(await self._json(request))
            self._check_model(options.model)
            batch = options.prompts
            prompts = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [self.prompts.encode_text(p) for p in batch]
            )
        except ApiError as exc:
            return exc.response()
        return await self._serve(request, options, prompts, TEXT)

    async def _serve(
        self,
        request: web.Request,
        options: GenerationOptions,
        prompts: list[Prompt],
        flavor: Flavor,
        tools: ToolPlan | None = None,
    ) -> web.StreamResponse:
        self.counters["requests_total"] += 1
        completion_id = f"{flavor.id_prefix}-{request[REQUEST_ID]}"  # (the id the workers log it under)
        events: Events = AnswerQueue(lambda: self._answered(id(request)))
        choices: list[ChoiceStream] = []
        try:
            # (503 where no replica is live)
            choices = await self._submit(options, prompts, completion_id, events, tools.grammar if tools else "")
            if flavor is CHAT and self.thinking is not None:
                for c in choices:
                    c.reasoning = self.thinking.splitter(prompts[c.prompt_index].token_ids)
            if options.stream:
                return await self._stream(request, options, completion_id, choices, events, flavor, tools)
            return await self._complete(options, completion_id, choices, events, flavor, tools)
        except ApiError as exc:
            self.counters["requests_failed"] += 1
            return exc.response()
        except asyncio.CancelledError:  # the client hung up (aiohttp's handler_cancellation)
            self.counters["requests_disconnected"] += 1
            raise
        except Exception:  # a bug: `error_shapes` answers it as a logged 500
            self.counters["requests_failed"] += 1
            raise
        finally:
            for choice in choices:  # a no-op once finished; frees every stage otherwise
                self.pipeline.abort(choice.request_id)

    async def _json(self, request: web.Request) -> Any:
        raw = await request.read()
        if id(request) in self.counted_bytes:  # (the size a chunked body turned out to have)
            self.in_flight_bytes += len(raw) - self.counted_bytes[id(request)]
            self.counted_bytes[id(request)] = len(raw)
        try:
            return await off_loop_if_large(len(raw), json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise ApiError(400, "the request body nests arrays or objects too deeply to parse") from exc

    def _check_model(self, name: str | None) -> None:
        """A request may leave the model out; one it names must be this server's."""
        if name not in (None, "", self.model_name):  # ("": some clients' way of leaving it out, taken as vLLM does)
            raise ApiError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                code="model_not_found",
                param="model",
            )

    async def _submit(
        self, chat: GenerationOptions, prompts: list[Prompt], completion_id: str, events: Events, grammar: str = ""
    ) -> list[ChoiceStream]:
        """One pipeline request per choice (n per prompt, indexed prompt by prompt, as OpenAI's batches are);
        seeded choices of a prompt get seeds seed, seed+1, ... so they differ. ``grammar``: a tool choice's."""
        sampling = sampling_params(with_defaults(chat, self.defaults))
        constrained = await self.grammars.grammar(chat)  # (400 if it cannot)
        if grammar and constrained:
            raise ApiError(
                400,
                "tool_choice 'required' or a named function constrains the answer to a call; leave out "
                "response_format and the structured_outputs / guided_* options",
                code="invalid_request_error",
                param="tool_choice",
            )
        sampling = dataclasses.replace(sampling, grammar=grammar or constrained)
        stops = [chat.stop] if isinstance(chat.stop, str) else list(chat.stop or [])
        choices: list[ChoiceStream] = []
        try:
            for prompt_index, prompt in enumerate(prompts):
                first = None  # the prompt's first choice: its fetcher loads the media for all
                for j in range(chat.n):
                    index = prompt_index * chat.n + j
                    request_id = completion_id if len(prompts) * chat.n == 1 else f"{completion_id}-{index}"
                    seed = None if sampling.seed is None else sampling.seed + j
                    params = dataclasses.replace(sampling, seed=seed)
                    request = GenerateRequest(request_id, prompt.token_ids, prompt.media, params)
                    await self.pipeline.submit(request, events, beside=first, streamed=chat.stream)
                    first = first or request_id
                    choices.append(self._choice(chat, index, request_id, stops, prompt_index))
        except BaseException:  # (a hang-up too, while a large request is encoded): none may run on for nobody
            for choice in choices:
                self.pipeline.abort(choice.request_id)
            raise
        return choices

    def _choice(
        self, chat: GenerationOptions, index: int, request_id: str, stops: list[str], prompt_index: int
    ) -> ChoiceStream:
        return ChoiceStream(
            index,
            request_id,
            self.prompts.tokenizer,
            stops,
            prompt_index=prompt_index,
            include_stop=chat.include_stop_str_in_output,
            skip_special_tokens=chat.skip_special_tokens,
        )

    async def _updates(
        self, choices: list[ChoiceStream], events: Events
    ) -> AsyncIterator[tuple[ChoiceStream, ChoiceUpdate]]:
        """Each choice's updates until every choice has finished; an error fails the whole request.

        Events that queued up while the stream was being written are taken together, one update per
        choice: a gateway that falls behind sends fewer, larger chunks instead of falling further behind.
        """
        by_id = {c.request_id: c for c in choices}
        started = time.monotonic()
        # One timer for the whole request, not one per awaited token: it queues the time-out as the
        # request's last event, so whatever arrived before it is still delivered.
        timed_out = RequestError(choices[0].request_id, 504, "timeout", "the request timed out in the pipeline")
        timer = asyncio.get_running_loop().call_later(self.cfg.server.request_timeout_s, events.put_nowait, timed_out)
        last_seen: dict[str, float] = {}
        try:
            while not all(c.finished for c in choices):
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                merged = self._merge(batch, by_id, last_seen)
                now = time.monotonic()
                for request_id, update in merged.items():
                    previous = last_seen.get(request_id)
                    (self.latency.ttft if previous is None else self.latency.itl).observe(now - (previous or started))
                    last_seen[request_id] = now
                    yield by_id[request_id], update
        finally:
            timer.cancel()
        self.latency.e2e.observe(time.monotonic() - started)

    def _merge(
        self, batch: list[Event], by_id: dict[str, ChoiceStream], seen: dict[str, float]
    ) -> dict[str, ChoiceUpdate]:
        """One update per choice from the events taken together; a `RequestError` fails the request."""
        merged: dict[str, ChoiceUpdate] = {}
        for event in batch:
            if isinstance(event, Restart):  # (a non-streamed choice begun again: what came so far goes)
                if event.request_id in by_id:
                    by_id[event.request_id].restart()
                merged.pop(event.request_id, None)
                continue
            if isinstance(event, RequestError):
                # A request that ran out its whole time would only run out again: OpenAI's clients retry any
                # 5xx unless told not to.
                retry = False if event.code == "timeout" else None
                raise ApiError(event.status, event.message, code=event.code, retry=retry)
            choice = by_id.get(event.request_id)
            if choice is None or choice.finished:
                continue  # tokens still in flight after a stop string ended the choice
            update = choice.feed(event)
            self.counters["tokens_generated"] += len(event.token_ids)
            merged[choice.request_id] = (
                merged[choice.request_id].then(update) if choice.request_id in merged else update
            )
            if choice.request_id not in seen:  # a choice's first delta carries its stage times
                if event.queue_s is not None:
                    self.latency.queue.observe(event.queue_s)
                if event.media_wait_s is not None:
                    self.latency.media_wait.observe(event.media_wait_s)
            if choice.finished and event.finish_reason is None:
                self.pipeline.abort(choice.request_id)  # stopped by a stop string: the decoder can stop too
        return merged

    async def _complete(
        self,
        options: GenerationOptions,
        completion_id: str,
        choices: list[ChoiceStream],
        events: Events,
        flavor: Flavor,
        tools: ToolPlan | None = None,
    ) -> web.Response:
        async for _ in self._updates(choices, events):
            pass
        body = []
        for c in choices:
            choice = flavor.choice(c, options)
            if tools is not None and tools.kind != "none":  # (on the content: the reasoning stays as it is)
                content = choice["message"]["content"] or ""
                message, choice["finish_reason"] = tools.message(content, c.finish_reason)
                thought = choice["message"].get("reasoning_content")
                choice["message"] = {**message, "reasoning_content": thought} if c.reasoning is not None else message
            if options.return_token_ids:
                choice["token_ids"] = c.token_ids
            body.append(choice)
        return web.json_response(
            {
                "id": completion_id,
                "object": flavor.object,
                "created": int(time.time()),
                "model": self.model_name,
                "system_fingerprint": None,
                "choices": body,
                "usage": usage(choices),
            }
        )

    async def _stream(
        self,
        request: web.Request,
        options: GenerationOptions,
        completion_id: str,
        choices: list[ChoiceStream],
        events: Events,
        flavor: Flavor,
        tools: ToolPlan | None = None,
    ) -> web.StreamResponse:
        updates = self._updates(choices, events)
        try:
            first = await anext(updates)  # errors before the first token still get a proper status
        except StopAsyncIteration:
            first = None
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        wants_usage = options.stream_options is not None and options.stream_options.include_usage
        sse = SseWriter(web.StreamResponse(headers=headers), completion_id, self.model_name, flavor, wants_usage)
        await sse.response.prepare(request)
        try:
            await self._stream_updates(sse, options, choices, updates, first, tools)
        except ConnectionResetError:  # the client went away; _serve's finally aborts the request
            self.counters["requests_disconnected"] += 1
            log.info("client of %s disconnected mid-stream", completion_id)
        return sse.response

    async def _stream_updates(
        self,
        sse: SseWriter,
        options: GenerationOptions,
        choices: list[ChoiceStream],
        updates: AsyncIterator[tuple[ChoiceStream, ChoiceUpdate]],
        first: tuple[ChoiceStream, ChoiceUpdate] | None,
        tools: ToolPlan | None = None,
    ) -> None:
        calls = {c.index: tools.stream() for c in choices} if tools is not None else {}
        if sse.flavor is CHAT:
            for c in choices:
                await sse.chunk(c.index, {"role": "assistant", "content": ""}, None, {})
        try:
            item = first
            while item is not None:
                choice, update = item
                extra: dict[str, Any] = {}
                if options.top_logprobs_asked >= 0 and update.logprobs:
                    extra["logprobs"] = sse.flavor.logprobs(update.logprobs)
                if options.return_token_ids:
                    extra["token_ids"] = update.token_ids
                await _send_update(sse, choice, update, extra, calls.get(choice.index))
                item = await anext(updates, None)
        except ApiError as exc:  # mid-stream failure: the status is already sent, so report in-band
            log.info("%s failed after its first token: %d %s", sse.completion_id, exc.status, exc.message)
            await sse.send(exc.body())
            choices = []
        except ConnectionResetError:
            raise
        except Exception as exc:  # a bug of ours: log it, and still end the stream in OpenAI's shape
            log.exception("stream %s failed", sse.completion_id)
            await sse.send(internal_error(exc).body())
            choices = []
        if choices and options.stream_options is not None and options.stream_options.include_usage:
            await sse.send({**sse.header(), "choices": [], "usage": usage(choices)})
        await sse.response.write(b"data: [DONE]\n\n")
        await sse.response.write_eof()


async def _send_update(
    sse: SseWriter, choice: ChoiceStream, update: ChoiceUpdate, extra: dict[str, Any], calls: ToolStream | None
) -> None:
    """One choice's update as chunks: the thinking split off first (a thinking checkpoint's), then tool calls
    parsed in the content alone (a request with tools), else the text as it is."""
    text, thought = update.text, ""
    if choice.reasoning is not None:
        piece = choice.reasoning.feed(update.text, update.token_ids, update.finish_reason is not None)
        text, thought = piece.content, piece.reasoning
    if calls is not None:
        if thought:
            await sse.chunk(choice.index, {"reasoning_content": thought}, None, extra)
            extra = {}
        await _send_tool_deltas(sse, choice.index, calls, text, update.finish_reason, extra)
        return
    delta: str | dict[str, Any] = text
    if choice.reasoning is not None:
        delta = {k: v for k, v in (("reasoning_content", thought), ("content", text)) if v}
    if delta or update.finish_reason or extra:
        await sse.chunk(choice.index, delta, update.finish_reason, extra)


async def _send_tool_deltas(
    sse: SseWriter, index: int, assembler: ToolStream, text: str, finish_reason: str | None, extra: dict[str, Any]
) -> None:
    """A tool-calling choice's update (its content ``text``) as content and ``tool_calls`` deltas; the finish
    reason goes with the last, the logprobs and token ids with the first."""
    deltas, finish = assembler.feed(text, finish_reason)
    if not deltas and (finish or extra):
        deltas = [{}]
    for k, delta in enumerate(deltas):
        await sse.chunk(index, delta, finish if k == len(deltas) - 1 else None, extra if k == 0 else {})


@dataclass(frozen=True)
class Flavor:
    """What differs between chat and text completions on the wire."""

    id_prefix: str
    object: str
    chunk_object: str
    is_chat: bool

    def logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        if self.is_chat:
            return {"content": entries}
        return {  # the legacy completions shape
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            # (the chosen token among them, as OpenAI's "up to logprobs + 1" entries have it)
            "top_logprobs": [
                {**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]} for e in entries
            ],
        }

    def choice(self, c: ChoiceStream, options: GenerationOptions) -> dict[str, Any]:
        logprobs = self.logprobs(c.logprobs) if options.top_logprobs_asked >= 0 else None
        body = {"message": {"role": "assistant", "content": c.text}} if self.is_chat else {"text": c.text}
        if c.reasoning is not None:
            body["message"].update(c.reasoning.message(c.text, c.token_ids))
        return {"index": c.index, **body, "finish_reason": c.finish_reason, "logprobs": logprobs}

    def delta(self, text: str | dict[str, Any]) -> dict[str, Any]:
        if isinstance(text, dict):
            return {"delta": text}
        if self.is_chat:
            return {"delta": {"content": text} if text else {}}
        return {"text": text}

    def delta_json(self, text: str) -> str:
        """``delta(text)``'s members as JSON, without the braces."""
        if self.is_chat:
            return f'"delta": {{"content": {json.dumps(text)}}}' if text else '"delta": {}'
        return f'"text": {json.dumps(text)}'


CHAT = Flavor("chatcmpl", "chat.completion", "chat.completion.chunk", is_chat=True)
TEXT = Flavor("cmpl", "text_completion", "text_completion", is_chat=False)


class SseWriter:
    """Server-sent events of one completion stream, in OpenAI's chunk shape."""

    def __init__(
        self, response: web.StreamResponse, completion_id: str, model: str, flavor: Flavor, usage_null: bool = False
    ) -> None:
        self.response = response
        self.completion_id = completion_id
        self.model = model
        self.flavor = flavor
        self.created = int(time.time())
        # With include_usage every chunk but the last has "usage": null, as OpenAI's do.
        self.usage: dict[str, None] = {"usage": None} if usage_null else {}
        # Every chunk's start: json.dumps of the header without its closing brace, then the choice's index key.
        self._head = f'data: {json.dumps(self.header())[:-1]}, "choices": [{{"index": '
        self._end = ', "usage": null}' if usage_null else "}"

    def header(self) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": self.flavor.chunk_object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    async def send(self, body: dict[str, Any]) -> None:
        await self.response.write(sse_event(body))

    async def chunk(self, index: int, text: str | dict[str, Any], finish: str | None, extra: dict[str, Any]) -> None:
        await self.response.write(self.encode_chunk(index, text, finish, extra))

    def encode_chunk(self, index: int, text: str | dict[str, Any], finish: str | None, extra: dict[str, Any]) -> bytes:
        """One chunk event, the bytes of ``json.dumps`` of its body. A plain text delta (every token of every
        stream) is spliced into the stream's pre-rendered head: only the text is encoded per token."""
        if extra or not isinstance(text, str):
            choice = {"index": index, **self.flavor.delta(text), "finish_reason": finish, "logprobs": None, **extra}
            return sse_event({**self.header(), "choices": [choice], **self.usage})
        tail = f'"finish_reason": {json.dumps(finish)}, "logprobs": null}}]{self._end}\n\n'
        return f"{self._head}{index}, {self.flavor.delta_json(text)}, {tail}".encode()


def sse_event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics"


def error_shapes(max_request_bytes: int) -> Any:
    """What aiohttp itself refuses (a path or method not served, a body over the limit) in OpenAI's error
    shape (JSON), not aiohttp's text; and a bug of ours (any other exception before a response started) as
    a logged 500 in that shape, not aiohttp's bare "Server got itself in trouble"."""

    @web.middleware
    async def shape(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"{request.method} is not allowed on {request.path}; allowed: {allowed}"
            return ApiError(405, message, code="method_not_allowed").response()
        except web.HTTPNotFound:
            message = f"{request.method} {request.path} is not served here; the routes are {ROUTES}"
            return ApiError(404, message, code="not_found").response()
        except web.HTTPRequestEntityTooLarge:
            message = (
                f"the request body is over the server's limit of {max_request_bytes} B ([server] max_request_bytes); "
                "send large images by URL rather than inline"
            )
            return ApiError(413, message, code="request_too_large").response()
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return internal_error(exc).response()

    return shape


# Every response's x-request-id; a completion's id is its prefix and this, and it is what the workers log.
REQUEST_ID = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"
_CLIENT_ID = re.compile(r"[\w.:/-]{1,128}")


@web.middleware
async def request_ids(request: web.Request, handler: Any) -> web.StreamResponse:
    request[REQUEST_ID] = uuid.uuid4().hex
    return await handler(request)


async def _retry_after_on_503(request: web.Request, response: web.StreamResponse) -> None:
    """Every 503 of the API says when to retry: a stage that failed a request (a worker restarting, a daemon not
    answering) is as passing as a full server, and clients that honour Retry-After back off instead of hammering."""
    if response.status == 503 and request.path.startswith("/v1/") and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = "1"


async def _answer_with_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """The id goes out with the headers (of a stream too); a refusal is logged with it, and with the id a proxy
    gave the request (X-Request-Id), so that a client's report can be found in the logs."""
    ours = request.get(REQUEST_ID)
    if ours is None:
        return
    response.headers["x-request-id"] = ours
    if response.status < 400 or not request.path.startswith("/v1/"):  # (not /health's 503s: probes poll it)
        return
    theirs = request.headers.get("X-Request-Id", "")
    given = f", X-Request-Id {theirs}" if _CLIENT_ID.fullmatch(theirs) else ""
    body: Any = None
    if isinstance(response, web.Response) and isinstance(response.body, bytes):
        with contextlib.suppress(ValueError):
            body = json.loads(response.body)
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message", "") if isinstance(error, dict) else ""
    log.info("%s %s: %d (request %s%s) %s", request.method, request.path, response.status, ours, given, message)


def api_key_middleware(keys: list[str]) -> Any:
    """``Authorization: Bearer <key>`` on every /v1 route; /health and /metrics stay open for probes."""
    accepted = [k.encode() for k in keys]

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = token.strip().encode()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in accepted):
                return ApiError(
                    401, "missing or invalid API key: send Authorization: Bearer <key>", code="invalid_api_key"
                ).response()
        return await handler(request)

    return check


# No limit of the request's or the checkpoint's: the decoder stops at the context's end, as vLLM does.
TO_THE_CONTEXTS_END = 2**31 - 1
TOP_TOKEN_ONLY = 1e-9  # top_p 0: a nucleus that any one token fills (the sampler always keeps the top one)


def sampling_params(chat: GenerationOptions) -> SamplingParams:
    max_tokens = chat.token_limit or TO_THE_CONTEXTS_END
    bias = chat.logit_bias_pairs
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=chat.temperature,
        top_p=chat.top_p or TOP_TOKEN_ONLY,
        top_k=chat.top_k,
        seed=chat.seed,
        stop_token_ids=list(chat.stop_token_ids),
        ignore_eos=chat.ignore_eos,
        min_tokens=min(chat.min_tokens, max_tokens),
        min_p=chat.min_p,
        presence_penalty=chat.presence_penalty,
        frequency_penalty=chat.frequency_penalty,
        repetition_penalty=chat.repetition_penalty,
        top_logprobs=chat.top_logprobs_asked,
        logit_bias_ids=[token for token, _ in bias],
        logit_bias_values=[value for _, value in bias],
    )


def usage(choices: list[ChoiceStream]) -> dict[str, int]:
    prompts: dict[int, int] = {}  # each prompt's tokens, counted once however many choices it has
    for c in choices:
        prompts[c.prompt_index] = max(prompts.get(c.prompt_index, 0), c.prompt_tokens)
    prompt = sum(prompts.values())
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
