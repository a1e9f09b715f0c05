"""CurveZMQ on the tcp:// endpoints: who may connect to a process's sockets, and whom its own connections trust.

ipc:// sockets stay as they are (the run directory's file modes guard them). A tcp:// socket can be reached by any
host that can route to it, so under ``[security] mode = "curve"`` (the default) every tcp:// socket is encrypted and
authenticated with CurveZMQ (zmq_curve(7)):

- each role (`ROLES`) has a keypair; ``<keys_dir>/public/<role>.key`` holds every role's public key and
  ``<keys_dir>/private/<role>.key_secret`` the role's own secret one (``./ops/keys`` writes them), so a pod or host
  needs the public directory and its own secret only;
- a socket that binds a tcp:// address is a CURVE server with its role's keypair; a ZAP handler (pyzmq's
  authenticator, one per ZMQ context) admits only clients whose public key is in ``<keys_dir>/public`` and counts
  the others (`Security.denied`): no key, an unknown key or plaintext get no reply;
- a socket that connects to one is a CURVE client with its own keypair and the public key of the role that binds the
  hub (`server_role`), so it talks to our server and no other.

``mode = "isolated-network"`` leaves tcp:// in plaintext: a choice for a network nothing else can reach, logged at
start. A tcp:// endpoint under ``"curve"`` without the keys refuses to start (`Security.for_process`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from common.config import Config
from common.topology import UNIT_PROCESSES

log = logging.getLogger(__name__)

ROLES = UNIT_PROCESSES["all"]  # a keypair for each kind of process


class SecurityError(RuntimeError):
    """The keys a tcp:// endpoint needs are missing or unreadable: the process does not start."""


def server_role(hub: str) -> str:
    """The role whose process binds ``hub`` (a name `Config.endpoint` takes)."""
    if hub in ("gateway", "fetch"):
        return "gateway"
    if hub == "cache":
        return "cache"
    if hub.startswith("decoder"):  # decoder, decoder-1, decoder-tp, decoder-tp-1
        return "decoder"
    if hub.startswith("encoder"):
        return "encoder"
    raise ValueError(f"no role binds the hub {hub!r}")


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def public_key_path(keys_dir: Path, role: str) -> Path:
    return keys_dir / "public" / f"{role}.key"


def secret_key_path(keys_dir: Path, role: str) -> Path:
    return keys_dir / "private" / f"{role}.key_secret"


def write_keys(keys_dir: Path, roles: tuple[str, ...] = ROLES) -> list[Path]:
    """A new keypair for each of ``roles`` that has none: ``public/<role>.key``, ``private/<role>.key_secret``
    (mode 0600, in a 0700 directory). Existing keys are kept (rotating means deleting them first)."""
    public, private = keys_dir / "public", keys_dir / "private"
    public.mkdir(parents=True, exist_ok=True)
    private.mkdir(parents=True, exist_ok=True)
    private.chmod(0o700)
    written = []
    for role in roles:
        if secret_key_path(keys_dir, role).exists():
            continue
        public_file, secret_file = zmq.auth.create_certificates(str(private), role)
        Path(secret_file).chmod(0o600)
        Path(public_file).replace(public_key_path(keys_dir, role))
        written += [public_key_path(keys_dir, role), Path(secret_file)]
    return written


def check_keys(cfg: Config, roles: tuple[str, ...] = ROLES) -> None:
    """Refuse a deployment (`SecurityError`) whose tcp:// endpoints lack the keys of a role it runs (``roles``; a
    host needs only the secret keys of its own) under "curve": the launcher calls it before supervisord starts
    processes that would fail on it one by one."""
    for role in roles:
        Security.for_process(cfg, role, quiet=True)


@dataclass
class Security:
    """How one process's sockets treat tcp:// addresses: its role's keypair and the servers' public keys."""

    mode: str
    role: str
    keys_dir: Path
    public_key: bytes = b""
    secret_key: bytes = b""
    server_keys: dict[str, bytes] = field(default_factory=dict)
    denied: int = 0  # ZAP refusals seen by this process's authenticators

    @classmethod
    def for_process(cls, cfg: Config, role: str, *, quiet: bool = False) -> Security:
        """The security of a process of ``role`` in the deployment ``cfg`` describes: under "curve" with any tcp://
        endpoint, its keys are loaded now, and missing ones stop the start with a message naming them."""
        cfg.security.validate("[security]")  # (a Config made in code has not been through the file's checks)
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {ROLES}")
        mode = cfg.security.mode
        security = cls(mode, role, cfg.keys_path)
        tcp = [a for a in cfg.endpoints.values() if is_tcp(a)]
        if not tcp:
            return security
        if mode == "isolated-network":
            if quiet:
                return security
            log.warning(
                '%s: tcp:// endpoints in plaintext ([security] mode = "isolated-network"): %s; anyone who can '
                "reach them can send requests and read embeddings",
                role,
                ", ".join(tcp),
            )
            return security
        security._load_keys(tcp)
        return security

    def _load_keys(self, tcp: list[str]) -> None:
        wanted = [secret_key_path(self.keys_dir, self.role)] + [public_key_path(self.keys_dir, r) for r in ROLES]
        missing = [str(p) for p in wanted if not p.is_file()]
        if missing:
            raise SecurityError(
                f"{self.role}: tcp:// endpoints ({', '.join(tcp)}) need CurveZMQ keys under [security] mode = "
                f'"curve", and these are missing: {", ".join(missing)}. Write them with ./ops/keys (then give every '
                'host the same public/ directory), or set mode = "isolated-network" for a network nothing else '
                "reaches."
            )
        self.public_key, self.secret_key = zmq.auth.load_certificate(str(wanted[0]))
        if not self.secret_key:
            raise SecurityError(f"{wanted[0]} holds no secret key")
        self.server_keys = {r: zmq.auth.load_certificate(str(public_key_path(self.keys_dir, r)))[0] for r in ROLES}

    @property
    def curve(self) -> bool:
        return bool(self.secret_key)

    def prepare(self, sock: zmq.Socket, address: str, bind: bool, hub: str | None) -> None:
        """Make ``sock`` a CURVE server (bind) or client (connect to ``hub``'s server) where ``address`` is tcp://
        under "curve"; ipc:// and inproc:// sockets are left alone."""
        if not (self.curve and is_tcp(address)):
            return
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        if bind:
            sock.curve_server = True
            return
        if hub is None:
            raise ValueError(f"a CURVE client socket to {address} needs the hub it connects to, for its server key")
        sock.curve_serverkey = self.server_keys[server_role(hub)]

    def allowed_clients_dir(self) -> Path:
        return self.keys_dir / "public"
