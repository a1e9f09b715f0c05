"""Hostile frames on every socket a worker binds (Hypothesis, seeded): random bytes, msgpack of the wrong shape,
unknown tags, known tags with fields of the wrong type, multipart frames of the wrong count, and well-formed
messages with absurd values (negative sizes, unknown request ids, bogus tensor refs, shm names and CUDA IPC
handles). Each worker drops them with a log line or answers a clean error, and keeps serving: the same pids,
the same answer to an image request, no file descriptor or shared-memory leak."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from openai import OpenAI

from common import protocol
from common.config import load_config
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    CacheAcquire,
    CacheCommit,
    CacheLookup,
    CacheRelease,
    CacheReserve,
    CudaIpcHandle,
    DecoderStats,
    EncodeJob,
    EncodeResult,
    FetchDone,
    MediaInput,
    Message,
    PreparedMedia,
    PreparedRequest,
    RequestError,
    SamplingParams,
    StatsRequest,
    StatsResult,
    TensorRef,
    TokenBatch,
    TokenDelta,
    encode,
)
from common.security import Security
from tests.integration.conftest import Stack
from tests.integration.test_fuzz_http import fixed_examples
from tests.media import data_url, make_image

EXAMPLES = 60  # per socket
FUZZ_REQUEST_PREFIX = "fuzz-"
# hub (its config name) -> (the process that binds it, the socket type we connect with, whether it answers)
HUBS = {
    "cache": ("cache", zmq.DEALER, True),
    "encoder.0": ("encoder-0", zmq.DEALER, True),
    "decoder": ("decoder", zmq.PUSH, False),
    "fetch": ("gateway", zmq.DEALER, False),
    "gateway": ("gateway", zmq.PUSH, False),
}

# ----------------------------------------------------------------------------- strategies

leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=32)
)
junk = st.recursive(
    leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ids = st.text(max_size=12).map(lambda s: FUZZ_REQUEST_PREFIX + s)
hashes = st.text(max_size=64) | st.sampled_from(["", "0" * 64, "f" * 64])
sizes = st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 3)
shapes = st.lists(sizes, max_size=4) | st.just([2**31, 2**31])
dtypes = st.sampled_from(["float32", "bfloat16", "uint8", "", "object", "torch.float16", "float64x"]) | st.text(
    max_size=8
)


def packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@st.composite
def wrong_fields(draw: st.DrawFn) -> bytes:
    """A known tag whose fields are missing, extra, or of any type."""
    tag = draw(st.sampled_from(sorted(protocol._REGISTRY)))
    names = protocol._FIELD_NAMES[protocol._REGISTRY[tag]]
    body = {name: draw(junk) for name in names if draw(st.integers(0, 5))}  # (one in six left out)
    if draw(st.booleans()):
        body[draw(st.text(max_size=6))] = draw(junk)
    return packed([PROTOCOL_VERSION, tag, body])


cuda_handles = st.builds(
    CudaIpcHandle, sizes, st.binary(max_size=64), sizes, sizes, st.binary(max_size=16), sizes, st.none(), st.booleans()
)
tensor_refs = st.builds(
    TensorRef,
    st.sampled_from(["inline", "shm", "cuda_ipc", "disk", ""]),
    dtypes,
    shapes,
    st.none() | st.binary(max_size=64),
    st.sampled_from(["", "/", "vlm-nope", "../../etc/passwd", "x" * 300]) | st.text(max_size=12),
    sizes,
    st.text(max_size=8),
    st.none() | cuda_handles,
)
sampling = st.builds(
    SamplingParams,
    sizes,
    st.floats(),
    st.floats(),
    sizes,
    st.none() | sizes,
    st.lists(sizes, max_size=3),
    st.booleans(),
    sizes,
    st.floats(),
    st.floats(),
    st.floats(),
    st.floats(),
    sizes,
    st.lists(sizes, max_size=3),
    st.lists(st.floats(), max_size=3),
    st.sampled_from(["", "{", "x" * 50]),
)
prepared_media = st.builds(
    PreparedMedia,
    st.sampled_from(["image", "video", "audio"]),
    hashes,
    shapes,
    sizes,
    st.none() | st.floats(),
    st.none() | st.lists(st.lists(sizes, max_size=3), max_size=3),
)
lookups = st.builds(CacheLookup, ids, hashes, sizes, dtypes, shapes)
deltas = st.builds(
    TokenDelta, ids, st.lists(sizes, max_size=4), st.none() | st.sampled_from(["stop", "length", "??"]), sizes, sizes
)
# The absurd but well-typed messages each hub could be sent (never a WorkerStatus: a peer that announces
# itself as a worker is trusted with work, by design)
ABSURD: dict[str, st.SearchStrategy[Message]] = {
    "cache": st.one_of(
        lookups,
        st.builds(CacheReserve, ids, ids, st.lists(lookups, max_size=3)),
        st.builds(CacheCommit, hashes, st.text(max_size=8)),
        st.builds(CacheAcquire, ids, ids, st.lists(hashes, max_size=3)),
        st.builds(CacheRelease, ids),
        st.builds(StatsRequest, ids),
        st.builds(Abort, ids),
    ),
    "encoder.0": st.one_of(
        st.builds(
            EncodeJob,
            ids,
            hashes,
            tensor_refs,
            shapes,
            tensor_refs,
            st.none() | st.floats(),
            st.lists(st.floats(), max_size=4),
            st.lists(st.floats(), max_size=4),
            st.booleans(),
        ),
        st.builds(CacheRelease, ids),
    ),
    "decoder": st.one_of(
        st.builds(PreparedRequest, ids, st.lists(sizes, max_size=8), st.lists(prepared_media, max_size=2), sampling),
        st.builds(Abort, ids),
        st.builds(
            protocol.GenerateRequest,
            ids,
            st.lists(sizes, max_size=4),
            st.lists(st.builds(MediaInput, st.text(max_size=6), st.text(max_size=20)), max_size=2),
            sampling,
        ),
    ),
    "fetch": st.one_of(
        st.builds(FetchDone, ids),
        st.builds(StatsResult, ids, st.text(max_size=8), st.text(max_size=8), st.dictionaries(st.text(), st.floats())),
        st.builds(EncodeResult, ids, hashes, sizes, st.text(max_size=8)),
    ),
    "gateway": st.one_of(
        st.builds(TokenBatch, st.lists(deltas, max_size=3)),
        st.builds(RequestError, ids, sizes, st.text(max_size=8), st.text(max_size=8)),
        st.builds(DecoderStats, st.text(max_size=8), st.dictionaries(st.text(), st.floats()), st.text(max_size=8)),
        st.builds(FetchDone, ids),
    ),
}


def frames_for(hub: str) -> st.SearchStrategy[list[bytes]]:
    one = st.one_of(
        st.binary(max_size=64),
        junk.map(packed),
        st.builds(lambda v, t, b: packed([v, t, b]), st.integers(0, 5), st.text(max_size=12), junk),
        wrong_fields(),
        ABSURD[hub].map(encode),
        st.builds(lambda n: packed([PROTOCOL_VERSION, "TokenBatch", {"deltas": [[0] * 3] * n}]), st.integers(0, 3)),
        st.just(packed([PROTOCOL_VERSION, "CacheRelease", {"request_id": "x" * 100_000}])),
        st.just(packed(list(range(100_000)))),
    )
    return st.lists(one, min_size=1, max_size=3)  # (a multipart message: the hub reads its last frame)


# ----------------------------------------------------------------------------- the run


def image_answer(client: OpenAI) -> str:
    model = client.models.list().data[0].id
    picture = data_url(make_image(96, 64, seed=4242))
    content = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "Describe it."}]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
    )
    return reply.choices[0].message.content or ""


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def send_all(
    ctx: zmq.Context,
    stack: Stack,
    hub: str,
    kind: int,
    answers: bool,
    messages: list[list[bytes]],
) -> None:
    """``messages`` on a socket of our own to ``hub``: through CurveZMQ with the gateway role's keys where the
    stack's hubs are tcp:// (an allowed client: the frames reach the worker, as the fuzzing needs)."""
    cfg = load_config(stack.config_path)
    address = cfg.endpoint(hub)
    security = Security.for_process(cfg, "gateway")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)
    security.prepare(sock, address, bind=False, hub=hub)
    sock.connect(address)
    try:
        for frames in messages:
            sock.send_multipart(frames)
        if answers:  # handled in order: its answer comes after every frame before it was handled
            call = uuid.uuid4().hex
            sock.send(encode(StatsRequest(call)))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                got = protocol.decode(sock.recv_multipart()[-1]) if sock.poll(1000) else None
                if isinstance(got, StatsResult) and got.call_id == call:
                    return
            raise AssertionError(f"{address} did not answer a StatsRequest after the fuzzing")
    finally:
        sock.close()


def request_ids(sent: list[list[bytes]]) -> set[str]:
    """The request ids of the well-formed messages among ``sent``: their leases are released afterwards."""
    out = set()
    for frames in sent:
        try:
            msg = protocol.decode(frames[-1])
        except protocol.ProtocolError:
            continue
        if isinstance(getattr(msg, "request_id", None), str):
            out.add(msg.request_id)
    return out


def settled(stack: Stack, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = stack.metrics()
        busy = m.get("vlm_gateway_requests_in_flight", 0), m.get("vlm_cache_leased_requests", 0)
        if busy == (0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


@pytest.mark.parametrize("hub", sorted(HUBS))
@pytest.mark.parametrize("transport", ["ipc", "tcp+curve"])
def test_hostile_frames_are_dropped_and_the_worker_keeps_serving(
    request: pytest.FixtureRequest, zmq_context: zmq.Context, hub: str, transport: str
) -> None:
    stack: Stack = request.getfixturevalue("stack" if transport == "ipc" else "curve_stack")
    client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    process, kind, answers = HUBS[hub]
    before_text = image_answer(client)
    pid = stack.pid(process)
    fds = fd_count(pid)
    shm = set(os.listdir("/dev/shm"))
    sent: list[list[bytes]] = []

    @fixed_examples(EXAMPLES)
    @given(frames_for(hub))
    def collect(frames: list[bytes]) -> None:
        sent.append(frames)

    collect()
    # Sent in batches, checking the process between them, so that a crash names the frames near it.
    for start in range(0, len(sent), 10):
        batch = sent[start : start + 10]
        send_all(zmq_context, stack, hub, kind, answers, batch)
        time.sleep(0.2)
        assert stack.pid(process) == pid, f"{process} died on one of {batch}"
    releases = [[encode(CacheRelease(r))] for r in request_ids(sent)]
    send_all(zmq_context, stack, "cache", zmq.DEALER, True, releases)
    assert stack.get_json("/health")[0] == 200
    assert image_answer(client) == before_text
    metrics = settled(stack)
    assert metrics.get("vlm_gateway_requests_in_flight", 0) == 0
    assert stack.pid(process) == pid
    assert fd_count(pid) <= fds + 8, f"{process} holds {fd_count(pid)} fds, {fds} before"
    new_shm = set(os.listdir("/dev/shm")) - shm
    assert len(new_shm) <= 2, new_shm
