"""A slow, lossy wire between network namespaces, in user space: what ``tc netem delay D loss P`` does to a link, for
kernels without the netem qdisc (sch_netem), as this machine's. The hub namespace gets one TUN device and each other
host one of its own; the hub's routes to those hosts and theirs back to the hub go through them (host routes, more
specific than the bridge's subnet, so connections already open move onto the wire). This process carries every IPv4
packet from one end to the other ``--delay-ms`` later, or drops it with probability ``--loss``, each way.

    python -m tests.netem --delay-ms 20 --loss 0.01 --hub NETNS=ADDRESS --host NETNS=ADDRESS [--host ...]

It prints ``ready`` once the routes are in place and carries packets until SIGTERM; its devices, and the routes
through them, go with it. Needs root, /dev/net/tun and iproute2 (`available`)."""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def available() -> str:
    """Empty where the wire can run here, else why not."""
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "a user-space netem wire needs /dev/net/tun"
    return ""


def enter_netns(path: str) -> None:
    """This thread into the network namespace at ``path`` (``/run/netns/NAME``, or ``/proc/self/ns/net`` saved)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def open_tun(netns: str, name: str) -> int:
    """A TUN device ``name`` made in namespace ``netns`` (raw IP packets, no header), up; its file descriptor."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter_netns(f"/run/netns/{netns}")
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        if _libc.setns(home, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to this process's own namespace")
        os.close(home)
    in_netns(netns, "ip", "link", "set", name, "up")
    return fd


def in_netns(netns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, *argv], check=True, capture_output=True, text=True)


class Wire:
    """Packets in flight: each leaves at its time (one delay for all, so the queue stays in order)."""

    def __init__(self, delay_s: float, loss: float, seed: int = 0) -> None:
        self.delay_s, self.loss = delay_s, loss
        self.random = random.Random(seed)
        self.queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self.carried = self.dropped = 0

    def put(self, packet: bytes, to: int) -> None:
        if self.random.random() < self.loss:
            self.dropped += 1
            return
        self.queue.append((time.monotonic() + self.delay_s, to, packet))

    def deliver(self) -> float | None:
        """Writes every packet due; seconds until the next one is (None: none in flight)."""
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            _, to, packet = self.queue.popleft()
            try:
                os.write(to, packet)
                self.carried += 1
            except OSError:  # (a device whose queue is full drops, as a wire would)
                self.dropped += 1
        return max(0.0, self.queue[0][0] - now) if self.queue else None


def destination(packet: bytes) -> str | None:
    """An IPv4 packet's destination address (None for anything else, e.g. IPv6 neighbour discovery)."""
    return socket.inet_ntoa(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None


def run(hub: tuple[str, str], hosts: list[tuple[str, str]], delay_s: float, loss: float, tag: str) -> None:
    hub_netns, hub_address = hub
    hub_fd = open_tun(hub_netns, f"nm{tag}h")
    to_host: dict[str, int] = {}
    for index, (netns, address) in enumerate(hosts):
        name = f"nm{tag}{index}"
        to_host[address] = open_tun(netns, name)
        in_netns(netns, "ip", "route", "add", f"{hub_address}/32", "dev", name, "src", address)
        in_netns(hub_netns, "ip", "route", "add", f"{address}/32", "dev", f"nm{tag}h", "src", hub_address)
    wire = Wire(delay_s, loss)
    selector = selectors.DefaultSelector()
    selector.register(hub_fd, selectors.EVENT_READ, None)
    for fd in to_host.values():
        selector.register(fd, selectors.EVENT_READ, hub_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # (select is retried after a handler that returns)
    print("ready", flush=True)
    try:
        while True:
            for key, _ in selector.select(wire.deliver()):
                for packet in read_all(key.fd):
                    to = key.data if key.data is not None else to_host.get(destination(packet) or "")
                    if to is not None:
                        wire.put(packet, to)
    finally:
        print(f"carried {wire.carried} packets, dropped {wire.dropped}", file=sys.stderr, flush=True)


def read_all(fd: int) -> list[bytes]:
    packets = []
    while True:
        try:
            packets.append(os.read(fd, 65536))
        except BlockingIOError:
            return packets


def address_of(text: str) -> tuple[str, str]:
    netns, _, address = text.partition("=")
    if not address:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NETNS=ADDRESS")
    return netns, address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hub", type=address_of, required=True)
    parser.add_argument("--host", type=address_of, action="append", required=True)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--loss", type=float, default=0.01)
    parser.add_argument("--tag", default=str(os.getpid() % 10000), help="names the devices (15 characters at most)")
    args = parser.parse_args()
    run(args.hub, args.host, args.delay_ms / 1000, args.loss, args.tag)


if __name__ == "__main__":
    main()
