"""CurveZMQ on tcp:// endpoints (`common.security`, `common.transport.Transport`), over real sockets on loopback.

A CURVE server admits only clients whose public key is in the deployment's ``public/`` directory: a plaintext
client, a client with a key of its own making, and a client that takes another server for ours get no reply, and
the server's handler sees nothing. ipc:// sockets and ``"isolated-network"`` stay plaintext; a tcp:// endpoint under
``"curve"`` without keys stops the start, naming the missing files.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq
import zmq.auth

from benchmarks.gateway_load import free_port
from common.config import Config
from common.protocol import Ping
from common.security import ROLES, SecurityError, check_keys, public_key_path, secret_key_path, write_keys
from common.transport import Transport

REPLY_WAIT_MS = 1500  # a CURVE handshake on loopback takes milliseconds; a refused one never answers


def tcp_config(tmp_path: Path, mode: str = "curve") -> Config:
    cfg = Config(run_dir=str(tmp_path / "run"))
    cfg.endpoints = {"cache": f"tcp://127.0.0.1:{free_port()}"}
    cfg.security.mode = mode
    return cfg


@pytest.fixture
def keyed(tmp_path: Path) -> Config:
    cfg = tcp_config(tmp_path)
    write_keys(cfg.keys_path)
    return cfg


def beat(n: int = 0) -> Ping:
    return Ping(sender=f"test-{n}")


def test_write_keys_writes_each_role_once_with_private_modes(tmp_path: Path) -> None:
    written = write_keys(tmp_path / "keys")
    assert len(written) == 2 * len(ROLES)
    for role in ROLES:
        public, secret = zmq.auth.load_certificate(str(secret_key_path(tmp_path / "keys", role)))
        assert secret and public == zmq.auth.load_certificate(str(public_key_path(tmp_path / "keys", role)))[0]
        assert stat.S_IMODE(secret_key_path(tmp_path / "keys", role).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "keys" / "private").stat().st_mode) == 0o700
    before = public_key_path(tmp_path / "keys", "cache").read_bytes()
    assert write_keys(tmp_path / "keys") == []  # kept, not rotated
    assert public_key_path(tmp_path / "keys", "cache").read_bytes() == before


def test_a_tcp_endpoint_without_keys_refuses_to_start_and_says_what_is_missing(tmp_path: Path) -> None:
    cfg = tcp_config(tmp_path)
    with pytest.raises(SecurityError, match=r"private/gateway\.key_secret.*public/cache\.key.*\./ops/keys") as refused:
        check_keys(cfg)
    assert "tcp://127.0.0.1" in str(refused.value)
    with pytest.raises(SecurityError):
        Transport(cfg, "gateway")


def test_ipc_and_isolated_network_need_no_keys(tmp_path: Path) -> None:
    check_keys(Config(run_dir=str(tmp_path / "run")))
    check_keys(tcp_config(tmp_path, "isolated-network"))


def test_a_curve_client_of_ours_is_answered(keyed: Config) -> None:
    server, client = Transport(keyed, "cache"), Transport(keyed, "gateway")
    try:
        hub = server.channel(zmq.ROUTER, "cache", bind=True)
        dealer = client.channel(zmq.DEALER, "cache", bind=False)
        assert hub.sock.curve_server and dealer.sock.mechanism == zmq.CURVE
        dealer.send(beat(1))
        assert hub.sock.poll(REPLY_WAIT_MS)
        peer, msg = hub.recv()
        assert msg == beat(1)
        assert hub.send_to(peer, beat(2))
        assert dealer.sock.poll(REPLY_WAIT_MS) and dealer.recv()[1] == beat(2)
        assert server.security.denied == 0
    finally:
        client.close()
        server.close()


def raw_client(ctx: zmq.Context, address: str, curve: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A DEALER that is not one of our roles: plaintext, or CURVE with (its public, its secret, the server key)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    sock.connect(address)
    return sock


@pytest.mark.parametrize("client", ["plaintext", "unknown key", "wrong server key"])
def test_a_client_that_is_not_ours_gets_nothing_through(keyed: Config, client: str) -> None:
    server = Transport(keyed, "cache")
    ctx = zmq.Context()
    try:
        hub = server.channel(zmq.ROUTER, "cache", bind=True)
        stranger_public, stranger_secret = zmq.curve_keypair()
        server_key = server.security.public_key
        curve = {
            "plaintext": None,
            "unknown key": (stranger_public, stranger_secret, server_key),
            "wrong server key": (server.security.server_keys["gateway"], *_secret_of(keyed, "gateway")),
        }[client]
        sock = raw_client(ctx, keyed.endpoint("cache"), curve)
        sock.send(b"\x92\x00\x00")  # any frame: none should reach the hub
        assert not hub.sock.poll(REPLY_WAIT_MS)
        if client == "unknown key":  # (the others fail before ZAP: no handshake to judge)
            assert server.security.denied >= 1
        sock.close()
    finally:
        ctx.destroy(linger=0)
        server.close()


def _secret_of(cfg: Config, role: str) -> tuple[bytes, bytes]:
    """(secret key, the key it takes for the server's): a real role's keypair aimed at another server."""
    _, secret = zmq.auth.load_certificate(str(secret_key_path(cfg.keys_path, role)))
    wrong_server = zmq.auth.load_certificate(str(public_key_path(cfg.keys_path, "decoder")))[0]
    return secret, wrong_server


def test_isolated_network_stays_plaintext_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tcp_config(tmp_path, "isolated-network")
    with caplog.at_level("WARNING"):
        server, client = Transport(cfg, "cache"), Transport(cfg, "gateway")
    try:
        assert "plaintext" in caplog.text and cfg.endpoint("cache") in caplog.text
        hub = server.channel(zmq.ROUTER, "cache", bind=True)
        dealer = client.channel(zmq.DEALER, "cache", bind=False)
        assert not hub.sock.curve_server
        dealer.send(beat(3))
        assert hub.sock.poll(REPLY_WAIT_MS) and hub.recv()[1] == beat(3)
    finally:
        client.close()
        server.close()
