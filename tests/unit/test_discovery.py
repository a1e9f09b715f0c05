"""Encoders found by name (`common.discovery`) and a fetcher's links to them (`workers.fetcher.encoders`): a name
stands for every address it resolves to; an address that appears joins, one that goes is drained (no new jobs,
those it holds finish) and then closed; a resolver that does not answer changes nothing, a name that is gone
drains its encoders. The links are tested on real sockets: two stand-in encoders on 127.0.0.2 and 127.0.0.3."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import zmq

from benchmarks.gateway_load import free_port
from common.config import Config
from common.discovery import EncoderDirectory, host_and_port
from common.dispatch import Dispatcher, Job
from common.liveness import LivenessClock
from common.protocol import EncodeResult, Message, Ping, WorkerStatus, decode, encode
from common.transport import EventLoop, Transport
from workers.fetcher.encoders import EncoderLinks


class Resolver:
    """What the name resolves to now, set by the test (or the error it raises)."""

    def __init__(self, *ips: str) -> None:
        self.ips, self.error, self.asked = list(ips), None, 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert host == "encoders.example"
        self.asked += 1
        if self.error is not None:
            raise self.error
        return list(self.ips)


def named_config(port: int, count: int = 1) -> Config:
    cfg = Config()
    cfg.encoder.count = count
    cfg.endpoints = {"encoder.0": f"tcp://encoders.example:{port}"}
    if count > 1:
        cfg.endpoints["encoder.1"] = "ipc:///tmp/fixed-encoder.sock"
    return cfg


def addresses(endpoints: list) -> list[str]:
    return [e.address for e in endpoints]


def test_a_name_stands_for_each_of_its_addresses_and_follows_them() -> None:
    resolver = Resolver("10.0.0.2", "10.0.0.3")
    directory = EncoderDirectory(named_config(7100, count=2), resolve=resolver)
    joined, left = directory.refresh()
    assert addresses(joined) == ["tcp://10.0.0.2:7100", "tcp://10.0.0.3:7100", "ipc:///tmp/fixed-encoder.sock"]
    assert [e.label for e in joined] == ["0@10.0.0.2:7100", "0@10.0.0.3:7100", "1"] and left == []
    assert [e.by_value for e in joined] == [True, True, False]
    resolver.ips = ["10.0.0.3", "10.0.0.4"]
    joined, left = directory.refresh()
    assert addresses(joined) == ["tcp://10.0.0.4:7100"] and addresses(left) == ["tcp://10.0.0.2:7100"]
    resolver.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    assert directory.refresh() == ([], [])  # (a resolver that does not answer: the encoders stay)
    resolver.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    joined, left = directory.refresh()
    assert joined == [] and addresses(left) == ["tcp://10.0.0.3:7100", "tcp://10.0.0.4:7100"]
    resolver.error, resolver.ips = None, ["fd00::5"]
    assert addresses(directory.refresh()[0]) == ["tcp://[fd00::5]:7100"]


@pytest.mark.parametrize(
    ("address", "named"),
    [
        ("tcp://encoders.vlm.svc:7100", ("encoders.vlm.svc", 7100)),
        ("tcp://10.0.0.2:7100", None),
        ("tcp://[::1]:7100", None),
        ("tcp://*:7100", None),
        ("ipc:///tmp/x.sock", None),
    ],
)
def test_only_a_host_name_is_resolved(address: str, named: tuple[str, int] | None) -> None:
    assert host_and_port(address) == named
    directory = EncoderDirectory(Config(endpoints={"encoder.0": address}, encoder=Config().encoder), resolve=Resolver())
    assert directory.named == (named is not None)


class StandIn:
    """An encoder at ``ip``:``port``: answers the fetcher's pings with its status, and holds the jobs it is sent."""

    def __init__(self, ctx: zmq.Context, ip: str, port: int) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(f"tcp://{ip}:{port}")
        self.jobs: list[tuple[bytes, str]] = []

    def serve(self) -> None:
        while self.sock.poll(0):
            peer, frame = self.sock.recv_multipart()
            msg = decode(frame)
            assert isinstance(msg, Ping)  # (the fetcher's liveness ping, or a job: a ping named by its id)
            if msg.sender == "fetcher":
                self.sock.send_multipart([peer, encode(WorkerStatus("encoder", "encoder.0", "inc-1", 4))])
            else:
                self.jobs.append((peer, msg.sender))

    def finish(self, job_id: str) -> None:
        peer = next(p for p, j in self.jobs if j == job_id)
        self.sock.send_multipart([peer, encode(EncodeResult(job_id, "h"))])


@pytest.fixture
def encoders() -> Iterator[tuple[StandIn, StandIn, int]]:
    ctx, port = zmq.Context(), free_port()
    try:
        yield StandIn(ctx, "127.0.0.2", port), StandIn(ctx, "127.0.0.3", port), port
    finally:
        ctx.destroy(linger=0)


def test_links_follow_the_directory_and_drain_an_encoder_that_left(encoders: tuple[StandIn, StandIn, int]) -> None:
    b, c, port = encoders
    resolver = Resolver("127.0.0.2")
    cfg = named_config(port)
    cfg.security.mode = "isolated-network"  # (the stand-ins speak plaintext; CURVE over tcp:// is test_security's)
    transport, loop, results = Transport(cfg, "fetcher"), EventLoop(), []

    def on_message(key: bytes, msg: Message) -> None:
        if isinstance(msg, WorkerStatus):
            dispatcher.peer_status(key, msg)
        elif isinstance(msg, EncodeResult):
            results.append((key, msg.job_id))
            dispatcher.complete(msg.job_id)

    def send(key: bytes, payload: Message | bytes) -> bool:
        return links.send(key, payload)  # type: ignore[arg-type]

    def failed(job: Job, why: str) -> None:
        raise AssertionError(f"{job.job_id} failed: {why}")

    dispatcher = Dispatcher(send, failed, clock=LivenessClock(1.0), dead_after_s=30)
    links = EncoderLinks(EncoderDirectory(cfg, resolve=resolver), transport, loop, dispatcher, on_message)

    def turn(until: object) -> None:
        for _ in range(200):
            b.serve()
            c.serve()
            loop.run_once(0.01)
            if until():  # type: ignore[operator]
                return
        raise AssertionError("not reached")

    try:
        links.refresh()
        turn(lambda: dispatcher.live_peers() == 1)
        dispatcher.submit("j1", Ping("j1"), 60)
        turn(lambda: b.jobs)
        resolver.ips = ["127.0.0.2", "127.0.0.3"]  # c joins
        links.refresh()
        turn(lambda: dispatcher.live_peers() == 2)
        resolver.ips = ["127.0.0.3"]  # b leaves, holding j1
        links.refresh()
        assert links.known == 1 and dispatcher.live_peers() == 1
        for job in ("j2", "j3"):
            dispatcher.submit(job, Ping(job), 60)
        turn(lambda: len(c.jobs) == 2)
        assert [j for _, j in b.jobs] == ["j1"]  # nothing new to the one draining
        b.finish("j1")
        turn(lambda: results)
        links.close_drained()
        assert results == [(b"tcp://127.0.0.2:" + str(port).encode(), "j1")]
        assert list(links.channels) == [f"tcp://127.0.0.3:{port}".encode()] and not links.leaving
    finally:
        links.close()
        transport.close()
