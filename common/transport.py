"""Typed ZeroMQ sockets: they send and receive protocol messages, never raw frames."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from common.config import Config
from common.lifecycle import StallWatchdog
from common.protocol import Message, ProtocolError, decode_frames, encode_frames
from common.security import Security

log = logging.getLogger(__name__)


def _prepare(
    sock: zmq.Socket,
    address: str,
    bind: bool,
    identity: bytes | None,
    security: Security | None = None,
    hub: str | None = None,
) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if sock.type == zmq.ROUTER:
        # A reply to a peer that vanished must fail loudly in our code, not block the hub.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if security is not None:
        security.prepare(sock, address, bind, hub)
    if bind:
        if address.startswith("ipc://"):
            Path(address[len("ipc://") :]).parent.mkdir(parents=True, exist_ok=True)
        sock.bind(address)
    else:
        sock.connect(address)


def _parse(frames: list[bytes], is_router: bool, address: str) -> tuple[bytes, Message | None]:
    peer = frames[0] if is_router else b""
    try:
        return peer, decode_frames(frames[1:] if is_router else frames)
    except ProtocolError as exc:
        log.warning("dropping a bad frame on %s: %s", address, exc)
        return peer, None


class Channel:
    """A socket speaking protocol messages. ROUTER channels address peers by identity."""

    def __init__(
        self,
        ctx: zmq.Context,
        kind: int,
        address: str,
        *,
        bind: bool,
        identity: bytes | None = None,
        security: Security | None = None,
        hub: str | None = None,
    ) -> None:
        self.address = address
        self.sock: zmq.Socket = ctx.socket(kind)
        self.is_router = kind == zmq.ROUTER
        _prepare(self.sock, address, bind, identity, security, hub)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode_frames(msg), copy=False)

    def send_to(self, peer: bytes, msg: Message) -> bool:
        """Send to one ROUTER peer; False if that peer is gone."""
        try:
            self.sock.send_multipart([peer, *encode_frames(msg)], copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def recv(self) -> tuple[bytes, Message | None]:
        """Receive one message: ``(peer identity or b"", message)``; None for a bad frame (logged)."""
        return _parse(self.sock.recv_multipart(copy=True), self.is_router, self.address)

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncChannel:
    """The asyncio twin of ``Channel`` for the gateway's event loop."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        kind: int,
        address: str,
        *,
        bind: bool,
        identity: bytes | None = None,
        security: Security | None = None,
        hub: str | None = None,
    ) -> None:
        self.address = address
        self.sock: zmq.asyncio.Socket = ctx.socket(kind)
        self.is_router = kind == zmq.ROUTER
        _prepare(self.sock, address, bind, identity, security, hub)

    async def send(self, msg: Message) -> None:
        await self.sock.send_multipart(encode_frames(msg), copy=False)

    async def send_to(self, peer: bytes, msg: Message) -> bool:
        try:
            await self.sock.send_multipart([peer, *encode_frames(msg)], copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise

    async def recv(self) -> tuple[bytes, Message | None]:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=True)
            except zmq.Again:
                # pyzmq's asyncio receive can find the message it was woken for gone by the time it reads (a
                # sender that closed mid-message; frequent over tcp:// with CurveZMQ): nothing arrived, so wait on.
                # Raised, it ended the reader's task, and that socket went unread.
                continue
            return _parse(frames, self.is_router, self.address)

    def close(self) -> None:
        self.sock.close(linger=0)


class CountingAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler in a thread of its own (for asyncio contexts too: it never touches their loop), counting
    the clients it turns away in ``security.denied`` and logging each (rate-limited by ZMQ's reconnect interval)."""

    def __init__(self, ctx: zmq.Context, security: Security) -> None:
        super().__init__(ctx, log=logging.getLogger("common.security.zap"))
        self.security = security

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes, user_id: str = "") -> None:
        if status_code != b"200":
            self.security.denied += 1
            log.warning("%s: refused a CURVE client: %s", self.security.role, status_text.decode(errors="replace"))
        super()._send_zap_reply(request_id, status_code, status_text, user_id or "anonymous")


class Transport:
    """A process's ZMQ context and its channels, made by hub name (`Config.endpoint`): a tcp:// hub is made a
    CurveZMQ server or client as ``[security]`` says (`common.security`), with a ZAP handler on the context that
    admits only our roles' public keys."""

    def __init__(self, cfg: Config, role: str, *, asyncio: bool = False) -> None:
        self.cfg = cfg
        self.security = Security.for_process(cfg, role)
        self.ctx: zmq.Context = zmq.asyncio.Context() if asyncio else zmq.Context()
        self.authenticator: CountingAuthenticator | None = None
        if self.security.curve:
            self.authenticator = CountingAuthenticator(self.ctx, self.security)
            self.authenticator.start()
            self.authenticator.configure_curve(domain="*", location=str(self.security.allowed_clients_dir()))

    def channel(
        self, kind: int, hub: str, *, bind: bool, identity: bytes | None = None, address: str | None = None
    ) -> Channel:
        """A channel to (or of) ``hub``, at its configured endpoint or at ``address`` (one of the addresses a hub's
        name resolved to: `common.discovery`)."""
        at = address or self.cfg.endpoint(hub)
        return Channel(self.ctx, kind, at, bind=bind, identity=identity, security=self.security, hub=hub)

    def async_channel(
        self, kind: int, hub: str, *, bind: bool, identity: bytes | None = None, address: str | None = None
    ) -> AsyncChannel:
        if not isinstance(self.ctx, zmq.asyncio.Context):
            raise TypeError("async channels come from a Transport(..., asyncio=True)")
        at = address or self.cfg.endpoint(hub)
        return AsyncChannel(self.ctx, kind, at, bind=bind, identity=identity, security=self.security, hub=hub)

    def close(self) -> None:
        """Stops the ZAP thread and ends the context, closing any channel of it still open."""
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        self.ctx.destroy(linger=0)


Handler = Callable[[bytes, Message], None]


class EventLoop:
    """A worker's main loop: wait on sockets or the next timer, never sleep-poll.

    Handlers run to completion one at a time, so worker state needs no locks.
    """

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.handlers: dict[zmq.Socket, tuple[Channel, Handler]] = {}
        self.timers: list[tuple[float, float, Callable[[], None]]] = []  # (next_due, period, fn)
        self.fd_handlers: dict[int, Callable[[], None]] = {}
        self.stopping = False
        # stop() writes here, so a stop asked from a signal handler ends a wait that would otherwise last
        # until the next timer (pyzmq resumes its poll after the handler; an encoder's waits last 5 s).
        self._stop_read, self._stop_write = os.pipe()
        for fd in (self._stop_read, self._stop_write):
            os.set_blocking(fd, False)
        self.poller.register(self._stop_read, zmq.POLLIN)
        self.fd_handlers[self._stop_read] = self._drain_stop
        self.watchdog: StallWatchdog | None = None

    def exit_if_stalled(self, limit_s: float, role: str) -> None:
        """From `run` on, end the process if a turn of this loop (a handler, a timer, a step) takes ``limit_s``
        or more (`StallWatchdog`; 0: never)."""
        if limit_s > 0:
            self.watchdog = StallWatchdog(limit_s)
            self.watchdog.announce(role)

    def on_message(self, channel: Channel, handler: Handler) -> None:
        self.poller.register(channel.sock, zmq.POLLIN)
        self.handlers[channel.sock] = (channel, handler)

    def forget(self, channel: Channel) -> None:
        """Stop reading ``channel`` (before closing it): a socket of a peer that left."""
        if self.handlers.pop(channel.sock, None) is not None:
            self.poller.unregister(channel.sock)

    def every(self, period_s: float, fn: Callable[[], None]) -> None:
        self.timers.append((time.monotonic() + period_s, period_s, fn))

    def stop(self) -> None:
        """Safe in a signal handler and from other threads: the loop wakes and ends after its handler."""
        self.stopping = True
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the loop
            os.write(self._stop_write, b"\0")

    def _drain_stop(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._stop_read, 4096)

    def _fire_timers(self) -> float:
        """Run due timers; return seconds until the next one."""
        now = time.monotonic()
        for i, (due, period, fn) in enumerate(self.timers):
            if due <= now:
                fn()
                self.timers[i] = (now + period, period, fn)
        return min((due for due, _, _ in self.timers), default=now + 1.0) - time.monotonic()

    def run_once(self, max_wait_s: float | None = None) -> int:
        """Handle what is ready, waiting at most until the next timer (or ``max_wait_s``)."""
        wait = max(0.0, self._fire_timers())
        if max_wait_s is not None:
            wait = min(wait, max_wait_s)
        handled = 0
        for sock, _ in self.poller.poll(int(wait * 1000)):
            if isinstance(sock, int):
                self.fd_handlers[sock]()
                handled += 1
                continue
            if sock not in self.handlers:  # (forgotten by a handler earlier in this turn)
                continue
            channel, handler = self.handlers[sock]
            # Drain what has arrived so a busy socket cannot starve timers for long.
            for _ in range(256):
                try:
                    peer, msg = channel.recv() if channel.sock.poll(0) else (b"", None)
                except zmq.ZMQError:
                    break
                if msg is None and not peer:
                    break
                if msg is not None:
                    handler(peer, msg)
                    handled += 1
        return handled

    def run(self, step: Callable[[], bool] | None = None) -> None:
        """Loop until ``stop()``. ``step`` (if any) does compute work; it returns True while it has
        more to do, so the loop only checks sockets without waiting between steps."""
        busy = step is not None  # look for work before the first wait
        if self.watchdog is not None:
            self.watchdog.arm()
            self.every(self.watchdog.rearm_every_s, self.watchdog.arm)
        try:
            while not self.stopping:
                self.run_once(0.0 if busy else None)
                if step is not None:
                    busy = step()
        finally:
            if self.watchdog is not None:  # (a slow stop is not a stall)
                self.watchdog.disarm()


def worker_identity(role: str) -> tuple[str, bytes]:
    """A worker id stable for its slot and an identity unique to this process incarnation."""
    incarnation = f"{os.getpid()}-{time.time_ns() % 10**9}"
    return incarnation, f"{role}:{incarnation}".encode()


class Wakeup:
    """Lets worker threads hand results to an ``EventLoop``: results queue up, a pipe byte wakes the loop."""

    def __init__(self, loop: EventLoop, handle: Callable[[object], None]) -> None:
        self.items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.handle = handle
        loop.poller.register(self.read_fd, zmq.POLLIN)
        loop.fd_handlers[self.read_fd] = self.drain

    def post(self, item: object) -> None:
        """Thread-safe."""
        self.items.put(item)
        os.write(self.write_fd, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.read_fd, 4096)
        while not self.items.empty():
            self.handle(self.items.get())
