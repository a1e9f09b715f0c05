"""The soak's client (`benchmarks.soak.send`): a try that never reached a server is made again with exponential
back-off until the request's deadline, as OpenAI's clients do; a request that got a response never is. Against
real sockets: a port nobody listens on, and a small aiohttp server that starts late or answers 500."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from aiohttp import web

from benchmarks import soak
from benchmarks.soak_verdict import outcome

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
ANSWER = {"choices": [{"index": 0, "message": {"content": "ok"}}], "usage": {"completion_tokens": 1}}


def test_back_off_doubles_from_the_first_delay_up_to_the_cap() -> None:
    refused = aiohttp.ClientOSError(111, "Connection refused")
    delays = [soak.connect_retry_delay(refused, False, k) for k in range(7)]
    assert delays == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    assert soak.connect_retry_delay(aiohttp.ServerDisconnectedError(), False, 0) == 0.2


def test_a_request_that_got_a_response_or_failed_otherwise_is_not_tried_again() -> None:
    assert soak.connect_retry_delay(aiohttp.ServerDisconnectedError(), True, 0) is None  # (cut mid-answer)
    assert soak.connect_retry_delay(aiohttp.ClientPayloadError("truncated"), False, 0) is None
    assert soak.connect_retry_delay(ValueError("not a connection error"), False, 0) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request() -> soak.Request:
    return soak.Request(0, "text", BODY, stream=False, n=1, hang_up=False, expect="2xx")


async def _send(port: int, deadline_s: float) -> soak.Record:
    async with aiohttp.ClientSession() as http:
        return await soak.send(http, f"http://127.0.0.1:{port}/v1/chat/completions", _request(), 0.0, deadline_s)


async def _serve(port: int, status: int, after_s: float) -> web.AppRunner:
    async def answer(_request: web.Request) -> web.Response:
        return web.json_response(ANSWER if status == 200 else {"error": {"message": "boom"}}, status=status)

    await asyncio.sleep(after_s)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_a_request_that_never_connects_is_tried_until_its_deadline_then_lost() -> None:
    record = asyncio.run(_send(_free_port(), deadline_s=1.5))
    assert record["timed_out"] and record["status"] is None
    assert 3 <= record["retries"] <= 5, record  # (0.2 + 0.4 + 0.8 s of back-off fit in 1.5 s, 3.0 s would not)
    assert "never reached a server" in record["error"]
    assert outcome(record, [], 0.0, 1.5) == "lost"


def test_a_request_is_answered_once_the_server_is_up() -> None:
    port = _free_port()

    async def main() -> soak.Record:
        server = asyncio.create_task(_serve(port, 200, after_s=0.7))
        record = await _send(port, deadline_s=10)
        await (await server).cleanup()
        return record

    record = asyncio.run(main())
    assert record["error"] is None and record["status"] == 200 and record["output_tokens"] == 1
    assert record["retries"] >= 2  # (refused at 0, 0.2 and 0.6 s)
    assert soak.summarise([record])["connect_retries"] == record["retries"]
    assert soak.summarise([record])["retried_requests"] == 1


@pytest.mark.parametrize("status", [500, 503])
def test_an_error_response_is_never_tried_again(status: int) -> None:
    port = _free_port()

    async def main() -> soak.Record:
        runner = await _serve(port, status, after_s=0)
        record = await _send(port, deadline_s=10)
        await runner.cleanup()
        return record

    record = asyncio.run(main())
    assert record["status"] == status and record["retries"] == 0 and record["error"] == "boom"
