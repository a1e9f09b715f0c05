"""Getting media bytes from a URL: ``data:`` base64 and http(s), with size, time and address rules."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from common.config import FetcherConfig
from workers.fetcher.errors import MediaError

_CHUNK_BYTES = 1 << 16
_WHITESPACE = re.compile(r"\s+")


def fetch_bytes(url: str, rules: FetcherConfig) -> bytes:
    if url[:5].lower() == "data:":  # (URL schemes are case-insensitive)
        return _decode_data_url(url, rules.max_media_bytes)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _download(url, rules)
    if scheme == "file":
        return _read_local(url, rules)
    raise MediaError(400, f"unsupported media URL scheme {scheme or '(none)'!r}: use http(s):// or a data: URL")


def _read_local(url: str, rules: FetcherConfig) -> bytes:
    """``file://`` only below the configured directory, after resolving links and ``..``."""
    if not rules.allowed_local_media_path:
        raise MediaError(400, "file:// media URLs are disabled; set [fetcher] allowed_local_media_path to allow them")
    root = Path(rules.allowed_local_media_path).resolve()
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if not path.is_relative_to(root):
        raise MediaError(403, f"file:// media must lie under the allowed directory {root}")
    try:
        size = path.stat().st_size
        if size > rules.max_media_bytes:
            raise MediaError(413, f"media file is {size} bytes; the limit is {rules.max_media_bytes}")
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise MediaError(400, f"cannot read media file {path.name}: {exc.strerror}") from exc


def _decode_data_url(url: str, limit: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(400, "malformed data: URL: expected 'data:<mime>;base64,<data>'")
    if not header.lower().endswith(";base64"):
        raise MediaError(400, "data: URLs must be base64 encoded ('data:<mime>;base64,<data>')")
    if _WHITESPACE.search(payload):  # MIME encoders wrap lines at 76 characters; whitespace is not data
        payload = _WHITESPACE.sub("", payload)
    if len(payload) * 3 // 4 > limit:
        raise MediaError(413, f"data: URL payload exceeds the {limit} byte media limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(400, f"data: URL is not valid base64: {exc}") from exc


def _check_address(url: str, allow_private: bool) -> None:
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise MediaError(400, f"media URL has no host: {url[:200]}")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise MediaError(400, f"cannot resolve media host {host!r}: {exc.strerror}") from exc
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            raise MediaError(
                400, f"media host {host!r} resolves to non-public address {address}; private addresses are not allowed"
            )


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, rules: FetcherConfig) -> None:
        self.rules = rules
        self.max_redirections = rules.max_redirects

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError(400, f"media URL redirects to an unsupported scheme: {newurl[:200]}")
        _check_address(newurl, self.rules.allow_private_addresses)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, rules: FetcherConfig) -> bytes:
    _check_address(url, rules.allow_private_addresses)
    opener = urllib.request.build_opener(_CheckedRedirects(rules))
    request = urllib.request.Request(url, headers={"User-Agent": "vlm-serve-fetcher/0.1"})
    deadline = time.monotonic() + rules.http_timeout_s
    try:
        with opener.open(request, timeout=rules.http_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            size = int(declared) if declared and declared.isdigit() else None
            if size is not None and size > rules.max_media_bytes:
                raise MediaError(413, f"media at {url[:200]} is {declared} bytes; the limit is {rules.max_media_bytes}")
            body = _read_body(response, url, rules, deadline)
    except MediaError:
        raise
    except urllib.error.HTTPError as exc:
        raise MediaError(400, f"fetching media {url[:200]} failed: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise MediaError(400, f"cannot fetch media {url[:200]}: {exc.reason}") from exc
    except http.client.IncompleteRead as exc:
        raise MediaError(400, f"the media host closed the download of {url[:200]} early: {exc}") from exc
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        raise MediaError(400, f"cannot fetch media {url[:200]}: {exc}") from exc
    if size is not None and len(body) != size:
        raise MediaError(400, f"the download of {url[:200]} ended after {len(body)} of its {size} bytes")
    return body


def _read_body(response: http.client.HTTPResponse, url: str, rules: FetcherConfig, deadline: float) -> bytes:
    """The body, read as it arrives against one deadline for the whole download: a per-read timeout alone lets a
    host that trickles a few bytes a second hold a fetch thread (and the images queued behind it) for ever."""
    chunks, got = [], 0
    while chunk := response.read1(_CHUNK_BYTES):
        chunks.append(chunk)
        got += len(chunk)
        if got > rules.max_media_bytes:
            raise MediaError(413, f"media at {url[:200]} exceeds the {rules.max_media_bytes} byte limit")
        if time.monotonic() > deadline:
            raise MediaError(
                400,
                f"downloading media {url[:200]} took longer than {rules.http_timeout_s:g} s ([fetcher] http_timeout_s)"
                f" after {got} bytes; serve it faster or send it as a data: URL",
            )
    return b"".join(chunks)
