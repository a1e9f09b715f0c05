"""Which vision encoders a hub dials: the configured endpoints ``encoder.K``, each a fixed address or a DNS name.

A ``tcp://NAME:PORT`` endpoint stands for every address NAME resolves to (a Kubernetes headless Service has an A
record per ready pod; on bare metal, /etc/hosts or any resolver). The fetcher and the gateway resolve it again every
``[encoder] resolve_every_s``: an address that appears is an encoder that joined, one that is gone is one to drain
(no new jobs; those it holds finish or are re-issued). A name that cannot be resolved for now (a resolver that does
not answer) keeps the encoders it had; a name that no longer exists leaves none. ipc:// endpoints and tcp:// ones
given by address are what they say, once.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from common.config import Config
from common.topology import encoder_count

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class EncoderEndpoint:
    """One encoder to dial: ``address`` (an IP where the endpoint named a host), ``hub`` the configured endpoint it
    stands for (``encoder.K``: whose server key it has), ``label`` for logs and metrics (``K``, or ``K@IP:PORT`` for
    one of a name's addresses), ``by_value`` for one that may be on another host."""

    address: str
    hub: str
    label: str

    @property
    def key(self) -> bytes:
        return self.address.encode()

    @property
    def by_value(self) -> bool:
        # tcp:// may cross hosts, where this host's shared and GPU memory (the cache's slots) cannot be reached
        return not self.address.startswith("ipc://")


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` (as the C library resolves it: /etc/hosts, DNS), IPv4 and IPv6."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in found})


def host_and_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://HOST:PORT`` address whose host is a name to resolve; None for anything else."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or host in ("", "*"):
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host, int(port)
    return None


def tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class EncoderDirectory:
    """The encoders of ``cfg`` as they resolve now. `refresh` answers which joined and which left since the last."""

    def __init__(self, cfg: Config, resolve: Resolver = system_resolver) -> None:
        self.configured = [(f"encoder.{k}", cfg.endpoint(f"encoder.{k}")) for k in range(encoder_count(cfg))]
        self.resolve = resolve
        self.current: dict[bytes, EncoderEndpoint] = {}
        self.named = any(host_and_port(address) for _, address in self.configured)

    def refresh(self) -> tuple[list[EncoderEndpoint], list[EncoderEndpoint]]:
        """(joined, left) since the last refresh (the first: every encoder joined)."""
        found: dict[bytes, EncoderEndpoint] = {}
        for hub, address in self.configured:
            for endpoint in self._expand(hub, address):
                found.setdefault(endpoint.key, endpoint)
        joined = [e for key, e in found.items() if key not in self.current]
        left = [e for key, e in self.current.items() if key not in found]
        self.current = found
        return joined, left

    def _expand(self, hub: str, address: str) -> list[EncoderEndpoint]:
        label = hub.removeprefix("encoder.")
        named = host_and_port(address)
        if named is None:
            return [EncoderEndpoint(address, hub, label)]
        host, port = named
        try:
            ips = self.resolve(host, port)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                log.warning("%s: %s resolves to nothing now (%s): its encoders drain", hub, host, exc)
                return []
            log.warning("%s: cannot resolve %s now (%s): keeping its encoders", hub, host, exc)
            return [e for e in self.current.values() if e.hub == hub]
        return [EncoderEndpoint(tcp_address(ip, port), hub, f"{label}@{ip}:{port}") for ip in ips]
