"""The one exception the fetcher turns into an HTTP error for the client."""

from __future__ import annotations


class MediaError(Exception):
    """A media item the server refuses; ``status`` is the HTTP status, ``message`` says what to fix.

    400 means the client sent something unusable, 413 something too large.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"MediaError({self.status}, {self.message!r})"
