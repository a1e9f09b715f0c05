"""`AsyncChannel.recv` (the gateway's sockets) under clients that close in the middle of multipart messages, over
tcp:// with CurveZMQ, on real sockets.

pyzmq's asyncio receive can be woken for a message that is gone when it reads (``zmq.Again``); raised, it ended the
gateway's reader task, and the socket went unread: the decoder's heartbeats with it, so the gateway took a live
decoder for lost (found by the ZMQ fuzz suite run through CURVE). The reader must wait on instead, and keep
receiving the steady sender's messages throughout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import zmq

from benchmarks.gateway_load import free_port
from common.config import Config
from common.protocol import Ping, encode
from common.security import Security, write_keys
from common.transport import Transport

CHURN_S = 3.0


def test_a_reader_outlives_clients_that_close_mid_message(tmp_path: Path) -> None:
    cfg = Config(run_dir=str(tmp_path / "run"))
    cfg.endpoints = {"gateway": f"tcp://127.0.0.1:{free_port()}"}
    write_keys(cfg.keys_path)
    client = Security.for_process(cfg, "decoder")
    stop = threading.Event()

    def sender(churn: bool) -> None:
        ctx = zmq.Context()
        try:
            while not stop.is_set():
                sock = ctx.socket(zmq.PUSH)
                sock.linger = 0 if churn else 1000
                client.prepare(sock, cfg.endpoint("gateway"), bind=False, hub="gateway")
                sock.connect(cfg.endpoint("gateway"))
                if churn:  # multipart messages, the socket closed at once: some are cut short
                    for _ in range(10):
                        sock.send_multipart([b"x" * 10, b"y" * 300_000, encode(Ping("churn"))])
                    sock.close()
                    continue
                while not stop.is_set():
                    sock.send(encode(Ping("steady")))
                    time.sleep(0.01)
                sock.close()
        finally:
            ctx.destroy(linger=0)

    async def read() -> tuple[int, float]:
        transport = Transport(cfg, "gateway", asyncio=True)
        inbox = transport.async_channel(zmq.PULL, "gateway", bind=True)
        threads = [threading.Thread(target=sender, args=(churn,), daemon=True) for churn in (False, True)]
        for thread in threads:
            thread.start()
        steady, longest_gap, last = 0, 0.0, time.monotonic()
        started = last
        try:
            while time.monotonic() - started < CHURN_S:
                _, msg = await asyncio.wait_for(inbox.recv(), 2.0)
                if msg == Ping("steady"):
                    steady += 1
                    longest_gap, last = max(longest_gap, time.monotonic() - last), time.monotonic()
        finally:
            stop.set()
            for thread in threads:
                thread.join(5)
            inbox.close()
            transport.close()
        return steady, longest_gap

    steady, longest_gap = asyncio.run(read())
    assert steady > 50 and longest_gap < 1.0, (steady, longest_gap)
