"""Media downloads against a real local HTTP server: one deadline for the whole download (a host trickling
bytes cannot hold a fetch thread past it), a body shorter than its Content-Length refused, chunked bodies read."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from common.config import FetcherConfig
from workers.fetcher.download import fetch_bytes
from workers.fetcher.errors import MediaError

BODY = bytes(range(256)) * 4
RULES = FetcherConfig(http_timeout_s=1.0, allow_private_addresses=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for at in range(0, len(BODY), 100):
                piece = BODY[at : at + 100]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(BODY)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.path == "/whole":
            self.wfile.write(BODY)
        elif self.path == "/short":
            self.wfile.write(BODY[:100])
        elif self.path == "/trickle":
            for at in range(0, len(BODY), 10):  # 10 bytes every 0.1 s: each read is quick, the whole is 10 s
                self.wfile.write(BODY[at : at + 10])
                self.wfile.flush()
                time.sleep(0.1)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_whole_and_chunked_bodies(base_url: str) -> None:
    assert fetch_bytes(base_url + "/whole", RULES) == BODY
    assert fetch_bytes(base_url + "/chunked", RULES) == BODY


def test_a_trickling_host_is_cut_off_at_the_deadline(base_url: str) -> None:
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"took longer than 1 s \(\[fetcher\] http_timeout_s\)") as caught:
        fetch_bytes(base_url + "/trickle", RULES)
    assert caught.value.status == 400
    assert time.monotonic() - started < 3  # (not the 10 s the host would take)


def test_a_body_shorter_than_its_length_is_refused(base_url: str) -> None:
    with pytest.raises(MediaError, match=f"ended after 100 of its {len(BODY)} bytes"):
        fetch_bytes(base_url + "/short", RULES)


def test_a_body_over_the_limit_is_refused_while_it_arrives(base_url: str) -> None:
    small = FetcherConfig(http_timeout_s=1.0, allow_private_addresses=True, max_media_bytes=300)
    with pytest.raises(MediaError, match="is 1024 bytes; the limit is 300"):
        fetch_bytes(base_url + "/whole", small)
    with pytest.raises(MediaError, match="exceeds the 300 byte limit"):
        fetch_bytes(base_url + "/chunked", small)


def test_data_urls_as_encoders_write_them() -> None:
    encoded = base64.b64encode(BODY).decode()
    wrapped = "\r\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    for url in (f"data:image/png;base64,{encoded}", f"DATA:image/png;BASE64, {wrapped}"):
        assert fetch_bytes(url, RULES) == BODY
    with pytest.raises(MediaError, match="not valid base64"):
        fetch_bytes("data:image/png;base64,ab$c", RULES)
