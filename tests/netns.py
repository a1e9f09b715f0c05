"""Hosts made of Linux network namespaces, for the tests of units on other hosts: each namespace has one veth
interface on a bridge in the test's own namespace (which reaches them all at the bridge's address), its own
loopback, and its own /etc/hosts (``/etc/netns/NAME/hosts``, which ``ip netns exec`` mounts over /etc/hosts).
Needs root and iproute2; `available` says why not where they are missing. Everything is torn down after."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ETC_NETNS = Path("/etc/netns")
REPO = Path(__file__).resolve().parents[1]


def available() -> str:
    """Empty where namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (the ip command)"
    probe = f"vlmprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def ip(*args: str, netns: str | None = None) -> None:
    command = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    subprocess.run(command, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # the namespace's
    address: str  # on the bridge
    interface: str  # its veth end, inside the namespace

    def exec_argv(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def link(self, up: bool) -> None:
        ip("link", "set", self.interface, "up" if up else "down", netns=self.name)

    def hosts(self, names: dict[str, list[str]]) -> None:
        """This host's /etc/hosts: localhost and each name's addresses (written in place: the file mounted over
        /etc/hosts in processes already running sees the change)."""
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{address} {name}" for name, addresses in names.items() for address in addresses]
        path = ETC_NETNS / self.name / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+" if path.exists() else "w") as out:  # (same inode: a bind mount of it follows)
            out.seek(0)
            out.write("\n".join(lines) + "\n")
            out.truncate()


@dataclass
class Network:
    """A bridge and hosts on it, named after this process (two test runs on one machine do not collide)."""

    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"vlmbr{self.tag}"

    @property
    def subnet(self) -> str:
        return f"10.{200 + int(self.tag) % 50}.{int(self.tag) % 250}"

    @property
    def gateway_address(self) -> str:
        """The test's own address on the bridge."""
        return f"{self.subnet}.1"

    def __enter__(self) -> Network:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add(self, label: str) -> Host:
        """A host ``label`` (a letter: a, b, ...) on the bridge."""
        index = len(self.hosts) + 2
        host = Host(f"vlm{self.tag}{label}", f"{self.subnet}.{index}", f"v{self.tag}{label}")
        outside = f"v{self.tag}{label}p"
        ip("netns", "add", host.name)
        ip("link", "add", host.interface, "type", "veth", "peer", "name", outside)
        ip("link", "set", host.interface, "netns", host.name)
        ip("link", "set", outside, "master", self.bridge)
        ip("link", "set", outside, "up")
        ip("addr", "add", f"{host.address}/24", "dev", host.interface, netns=host.name)
        ip("link", "set", host.interface, "up", netns=host.name)
        ip("link", "set", "lo", "up", netns=host.name)
        host.hosts({})
        self.hosts[label] = host
        return host

    @contextlib.contextmanager
    def slow_lossy_links(self, hub: str, delay_ms: float, loss: float) -> Iterator[list[str]]:
        """Every link between host ``hub`` and the other hosts ``delay_ms`` slow and losing ``loss`` of its packets,
        each way, while in the block: the user-space wire of `tests.netem` (as ``tc netem delay loss`` would on a
        kernel with sch_netem). Yields a list that holds, after the block, what the wire says it carried and
        dropped."""
        argv = [sys.executable, "-m", "tests.netem", f"--delay-ms={delay_ms}", f"--loss={loss}", f"--tag={self.tag}"]
        argv.append(f"--hub={self.hosts[hub].name}={self.hosts[hub].address}")
        argv += [f"--host={h.name}={h.address}" for label, h in self.hosts.items() if label != hub]
        wire = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        said: list[str] = []
        try:
            if wire.stdout is None or wire.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the netem wire did not start: {wire.communicate(timeout=10)[1].strip()}")
            yield said
        finally:
            wire.terminate()
            said.append(wire.communicate(timeout=10)[1].strip())

    def __exit__(self, *_: object) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
            shutil.rmtree(ETC_NETNS / host.name, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
