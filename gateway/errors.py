"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",  # (OpenAI's type for an unknown model or route; the code says which)
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.retry = retry  # sent as x-should-retry, which OpenAI's clients obey over their status rules

    def body(self) -> dict[str, object]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}
        if self.retry is not None:
            headers["x-should-retry"] = "true" if self.retry else "false"
        return web.json_response(self.body(), status=self.status, headers=headers)


def internal_error(exc: BaseException) -> ApiError:
    """What a client gets for a bug of ours (it is logged with its traceback where it is caught)."""
    return ApiError(
        500,
        f"internal server error ({type(exc).__name__}); the server logged the details. This is a bug in the "
        "server, not in the request: please report it",
        code="internal_error",
    )
