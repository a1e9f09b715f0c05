"""The gateway's error middleware on a real aiohttp server: a bug of ours (an exception no handler expected)
is answered as a logged 500 in OpenAI's error shape, not aiohttp's plain-text page."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import error_shapes


async def _get(path: str) -> tuple[int, dict[str, object]]:
    async def broken(request: web.Request) -> web.Response:
        raise OverflowError("Integer value out of range")

    async def refused(request: web.Request) -> web.Response:
        raise web.HTTPForbidden(text="no")

    app = web.Application(middlewares=[error_shapes(1024)])
    app.router.add_get("/broken", broken)
    app.router.add_get("/refused", refused)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        response = await client.get(path)
        body = await response.json() if response.content_type == "application/json" else {}
        return response.status, body


def test_an_unexpected_exception_is_a_logged_500_in_openais_shape(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="gateway.app"):
        status, body = asyncio.run(_get("/broken"))
    assert status == 500
    error = body["error"]
    assert isinstance(error, dict)
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "OverflowError" in str(error["message"]) and "bug" in str(error["message"])
    assert any("GET /broken failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_http_exceptions_pass_through_unchanged() -> None:
    status, body = asyncio.run(_get("/refused"))
    assert status == 403 and body == {}  # aiohttp's own answer, not turned into a 500
