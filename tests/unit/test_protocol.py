"""Unit tests for ``common/protocol.py``: round trips of every message and rejection of bad frames."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path
from typing import Any

import msgpack
import pytest

from common import protocol
from common.protocol import (
    FRAME_MIN_BYTES,
    PROTOCOL_VERSION,
    Abort,
    CacheAcquire,
    CacheAcquireResult,
    CacheCommit,
    CacheLookup,
    CacheLookupResult,
    CacheRelease,
    CacheReserve,
    CacheReserveResult,
    CacheWrite,
    CudaIpcHandle,
    DecoderStats,
    EncodeJob,
    EncodeResult,
    FetchDone,
    FetcherStarted,
    GenerateRequest,
    MediaInput,
    Message,
    Ping,
    PreparedMedia,
    PreparedRequest,
    ProtocolError,
    RequestError,
    SamplingParams,
    StatsRequest,
    StatsResult,
    TensorRef,
    TokenBatch,
    TokenDelta,
    TPJoin,
    TPSetup,
    WorkerStatus,
    decode,
    decode_frames,
    encode,
    encode_frames,
)

REPO = Path(__file__).resolve().parents[2]

SHM_REF = TensorRef(
    kind="shm",
    dtype="bfloat16",
    shape=[7, 3584],
    data=None,
    shm_name="vlm-abc-emb-1",
    offset=4096,
    pool_incarnation="123-456",
)
INLINE_REF = TensorRef(
    kind="inline",
    dtype="float32",
    shape=[2, 2],
    data=b"\x00\x01\x02\xff" * 4,
    shm_name="x",
    offset=3,
    pool_incarnation="p",
)
IPC_HANDLE = CudaIpcHandle(0, b"\x01" * 64, 1 << 28, 0, b"/torch_1_2", 5, b"\x02" * 64, True)
# Every field set, for the round trip (a real ref has no inline data).
FULL_REF = TensorRef("cuda_ipc", "bfloat16", [64, 1536], b"\x03", "vlm-abc-emb-2", 8192, "2-2", IPC_HANDLE)
SAMPLING = SamplingParams(
    max_tokens=17,
    temperature=0.25,
    top_p=0.5,
    top_k=40,
    seed=1234,
    stop_token_ids=[151645, 151643],
    ignore_eos=True,
    min_tokens=2,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    top_logprobs=3,
    logit_bias_ids=[42, 7],
    logit_bias_values=[-100.0, 2.5],
    grammar='{"grammars": [{"json_schema": {"type": "object"}}]}',
)
MEDIA = MediaInput(kind="video", url="https://example.com/cat.avi", min_pixels=3136, max_pixels=1_000_000, fps=2.5)
PREPARED = PreparedMedia(kind="image", content_hash="ab" * 32, grid_thw=[1, 14, 20], num_tokens=70)
PREPARED_VIDEO = PreparedMedia(
    kind="video",
    content_hash="cd" * 32,
    grid_thw=[4, 14, 20],
    num_tokens=280,
    second_per_grid_t=0.75,
    frame_text_ids=[[27, 15, 13, 18, 422, 745, 369, 29], [27, 16, 13, 21, 422, 745, 369, 29]],
)
DELTA = TokenDelta(
    request_id="r1",
    token_ids=[1, 2, 3],
    finish_reason="stop",
    prompt_tokens=12,
    completion_tokens=3,
    logprobs=[-0.5, -1.25, -0.125],
    top_logprobs=[[[1.0, -0.5], [7.0, -1.0]], [[2.0, -1.25]], [[3.0, -0.125]]],
    queue_s=0.25,
    media_wait_s=0.5,
)


def one_of_each() -> list[Message]:
    """One instance of every registered message, every field set away from its default."""
    return [
        SAMPLING,
        MEDIA,
        PREPARED_VIDEO,
        WorkerStatus(
            role="fetcher", worker_id="fetcher.0", incarnation="99-1", credits=4, workers_live=2, workers_known=3
        ),
        Ping(sender="fetcher"),
        GenerateRequest(
            request_id="req-1",
            prompt_ids=[151644, 8948, 198],
            media=[MEDIA, MediaInput(kind="image", url="data:image/png;base64,AAAA", min_pixels=1, max_pixels=2)],
            sampling=SAMPLING,
            replica=1,
        ),
        FetchDone(request_id="req-1"),
        PreparedRequest(
            request_id="req-2", prompt_ids=[1, 151655, 2], media=[PREPARED, PREPARED_VIDEO], sampling=SAMPLING
        ),
        Abort(request_id="req-3"),
        EncodeJob(
            job_id="job-1",
            content_hash="cd" * 32,
            pixels=INLINE_REF,
            grid_thw=[1, 4, 6],
            slot=SHM_REF,
            rescale_factor=1 / 255,
            image_mean=[0.48, 0.45, 0.4],
            image_std=[0.26, 0.26, 0.27],
            commit=False,
            by_value=True,
        ),
        EncodeResult(job_id="job-1", content_hash="cd" * 32, status=500, message="encoder exploded", rows=INLINE_REF),
        CacheWrite(content_hash="cd" * 32, slot=SHM_REF, rows=INLINE_REF),
        CacheLookup(call_id="c1", content_hash="ef" * 32, nbytes=1 << 20, dtype="bfloat16", shape=[64, 8192]),
        CacheLookupResult(call_id="c1", state="reserved", slot=SHM_REF, status=201, message="yours"),
        CacheCommit(content_hash="ef" * 32, error="boom", pool_incarnation="cache-2", offset=512),
        FetcherStarted(fetcher="fetcher.0", incarnation="fetcher-3"),
        CacheReserve(
            call_id="c4",
            request_id="req-6",
            items=[CacheLookup(call_id="0", content_hash="ef" * 32, nbytes=64, dtype="bfloat16", shape=[4, 8])],
            fetcher="fetcher.0",
            fetcher_incarnation="fetcher-3",
        ),
        CacheReserveResult(
            call_id="c4",
            request_id="req-6",
            results=[CacheLookupResult(call_id="0", state="pending", slot=SHM_REF, status=201, message="m")],
            status=413,
            code="embeddings_too_large",
            message="too large",
        ),
        CacheAcquire(call_id="c2", request_id="req-4", content_hashes=["a" * 64, "b" * 64]),
        CacheAcquireResult(call_id="c2", request_id="req-4", refs=[SHM_REF, INLINE_REF], status=503, message="m"),
        CacheRelease(request_id="req-4"),
        FULL_REF,
        IPC_HANDLE,
        TPJoin(rank=1, incarnation="5-5"),
        TPSetup(store_path="/run/8000/tp-1-2.store", world=2, num_blocks=4096, leader="1-2"),
        StatsRequest(call_id="c3"),
        StatsResult(call_id="c3", role="cache", incarnation="7-7", counters={"hits": 3.0, "bytes_used": 1.5e9}),
        DecoderStats(
            incarnation="9-9", counters={"prefix_hit_tokens": 640.0, "requests_running": 3.0}, worker_id="decoder-1"
        ),
        DELTA,
        TokenBatch(
            deltas=[
                DELTA,
                TokenDelta(request_id="r2", token_ids=[], finish_reason="length", prompt_tokens=5, completion_tokens=9),
            ]
        ),
        RequestError(request_id="req-5", status=429, code="overloaded", message="try later"),
    ]


def test_every_registered_message_is_covered() -> None:
    assert {type(m) for m in one_of_each()} == set(protocol._REGISTRY.values())
    assert {m.TAG for m in one_of_each()} == set(protocol._REGISTRY)


@pytest.mark.parametrize("msg", one_of_each(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    # The instance really exercises the optional fields: none is left at its default.
    for f in dataclasses.fields(msg):  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default, f"{type(msg).__name__}.{f.name} left at default"
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(msg, f.name) != f.default_factory(), f"{type(msg).__name__}.{f.name} left at default"
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert encode(back) == frame


def large_rows(nbytes: int) -> TensorRef:
    return TensorRef(kind="inline", dtype="uint8", shape=[nbytes], data=bytes(range(256)) * (nbytes // 256))


def test_large_bytes_travel_as_frames_of_their_own() -> None:
    big, small = large_rows(FRAME_MIN_BYTES), large_rows(FRAME_MIN_BYTES - 256)
    msg = EncodeResult(job_id="j", content_hash="h", rows=big)
    header, blob = encode_frames(msg)
    assert blob is big.data and len(header) < 200  # (sent as it is, not copied into the header)
    assert decode_frames([header, blob]) == msg
    assert encode_frames(CacheWrite(content_hash="h", slot=SHM_REF, rows=small)) == [
        encode(CacheWrite(content_hash="h", slot=SHM_REF, rows=small))
    ]
    two = encode_frames(CacheWrite(content_hash="h", slot=big, rows=big))
    assert len(two) == 3 and decode_frames(two) == CacheWrite(content_hash="h", slot=big, rows=big)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda frames: frames[:1],  # the header names a frame that is not there
        lambda frames: [*frames, b"x"],  # a frame no value names
        lambda frames: [frames[0], frames[1], frames[1]],
        lambda frames: [frames[0].replace(b"\x00\x00\x00\x01", b"\x00\x00\x00\x00"), frames[1]],  # frame 0
        lambda frames: [],
    ],
    ids=["missing", "unnamed", "extra", "header-itself", "none"],
)
def test_bad_frame_lists_are_protocol_errors(mangle: Any) -> None:
    frames = encode_frames(EncodeResult(job_id="j", content_hash="h", rows=large_rows(FRAME_MIN_BYTES)))
    with pytest.raises(ProtocolError):
        decode_frames(mangle(frames))


def test_round_trip_keeps_nested_types() -> None:
    msg = EncodeJob(job_id="j", content_hash="h", pixels=INLINE_REF, grid_thw=[1, 2, 2], slot=SHM_REF)
    back = decode(encode(msg))
    assert isinstance(back, EncodeJob)
    assert isinstance(back.pixels, TensorRef) and isinstance(back.slot, TensorRef)
    assert isinstance(back.pixels.data, bytes) and back.pixels.data == INLINE_REF.data
    batch = decode(encode(TokenBatch(deltas=[DELTA, DELTA])))
    assert isinstance(batch, TokenBatch)
    assert all(isinstance(d, TokenDelta) for d in batch.deltas)
    req = decode(encode(GenerateRequest("r", [1], [MEDIA], SAMPLING)))
    assert isinstance(req, GenerateRequest)
    assert isinstance(req.media[0], MediaInput) and isinstance(req.sampling, SamplingParams)


def test_round_trip_of_defaults_and_none() -> None:
    for msg in (
        CacheLookupResult(call_id="c", state="pending"),
        SamplingParams(max_tokens=1),
        TensorRef(kind="inline", dtype="uint8", shape=[0], data=b""),
        TokenDelta(request_id="r", token_ids=[]),
        MediaInput(kind="image", url="u"),
    ):
        assert decode(encode(msg)) == msg


def test_wire_format_is_version_tag_body() -> None:
    wire = msgpack.unpackb(encode(CacheLookupResult("c", "ready", slot=SHM_REF)), raw=False)
    assert wire[0] == PROTOCOL_VERSION
    assert wire[1] == "CacheLookupResult"
    assert wire[2]["call_id"] == "c"
    assert wire[2]["slot"]["~t"] == "TensorRef"  # nested messages carry their own tag
    assert wire[2]["slot"]["offset"] == 4096


def test_token_batch_deltas_travel_as_rows_of_values() -> None:
    full = TokenDelta("r1", [5, 6], "stop", 10, 2, [-0.5, -1.0], [[[5, -0.5]], [[6, -1.0], [7, -2.0]]], 0.25, 1.5)
    batch = TokenBatch([full, TokenDelta("r2", [9])])
    wire = msgpack.unpackb(encode(batch), raw=False)
    assert wire[1] == "TokenBatch"
    assert wire[2]["deltas"][0] == [
        "r1",
        [5, 6],
        "stop",
        10,
        2,
        [-0.5, -1.0],
        [[[5, -0.5]], [[6, -1.0], [7, -2.0]]],
        0.25,
        1.5,
    ]
    assert wire[2]["deltas"][1] == ["r2", [9], None, 0, 0, None, None, None, None]
    back = decode(encode(batch))
    assert back == batch and all(type(d) is TokenDelta for d in back.deltas)


@pytest.mark.parametrize(
    "deltas",
    [
        [["r", [1], None, 0, 0, None, None, None, None, "extra"]],  # a field too many
        [[]],  # no request id
        [7],  # not a row
        None,  # not a list
    ],
    ids=["long-row", "empty-row", "scalar-row", "no-list"],
)
def test_malformed_token_batch_rows_are_protocol_errors(deltas: Any) -> None:
    with pytest.raises(ProtocolError, match="bad fields for TokenBatch"):
        decode(pack([PROTOCOL_VERSION, "TokenBatch", {"deltas": deltas}]))
    with pytest.raises(ProtocolError, match="bad fields for TokenBatch"):
        decode(pack([PROTOCOL_VERSION, "TokenBatch", {}]))


def test_decoded_messages_are_frozen() -> None:
    back = decode(encode(Ping("x")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.sender = "y"  # type: ignore[misc]


# --------------------------------------------------------------------------- rejection


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_unknown_tag() -> None:
    with pytest.raises(ProtocolError, match="unknown message tag 'Launch'"):
        decode(pack([PROTOCOL_VERSION, "Launch", {"target": "x"}]))


def test_unknown_nested_tag() -> None:
    body = {"deltas": [{"~t": "Evil", "x": 1}]}
    with pytest.raises(ProtocolError, match="unknown message tag 'Evil'"):
        decode(pack([PROTOCOL_VERSION, "TokenBatch", body]))


def test_base_class_and_module_names_are_not_tags() -> None:
    for tag in ("Message", "ProtocolError", "dataclasses", ""):
        with pytest.raises(ProtocolError):
            decode(pack([PROTOCOL_VERSION, tag, {}]))


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, "1", None])
def test_wrong_protocol_version(version: Any) -> None:
    with pytest.raises(ProtocolError, match="version"):
        decode(pack([version, "Ping", {"sender": "x"}]))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\xff\x00\x13garbage\x00",
        b"hello world",
        encode(Ping("truncated"))[:-3],
        encode(Ping("x")) + b"\x00",  # trailing bytes
        pack(5),
        pack("abc"),
        pack([PROTOCOL_VERSION, "Ping"]),
        pack([PROTOCOL_VERSION, "Ping", {"sender": "x"}, "extra"]),
        pack({"version": 1, "tag": "Ping", "body": {}}),
        pack([PROTOCOL_VERSION, "Ping", {1: "int key"}]),
    ],
    ids=lambda f: f[:12].hex() or "empty",
)
def test_garbage_bytes(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(frame)


@pytest.mark.parametrize("body", [["sender", "x"], "sender=x", 7, None, b"\x00"])
def test_body_not_a_map(body: Any) -> None:
    with pytest.raises(ProtocolError, match="not a map"):
        decode(pack([PROTOCOL_VERSION, "Ping", body]))


def test_body_that_is_itself_a_message_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode(pack([PROTOCOL_VERSION, "Ping", {"~t": "Ping", "sender": "x"}]))


def test_unexpected_field() -> None:
    with pytest.raises(ProtocolError, match="bad fields for Ping"):
        decode(pack([PROTOCOL_VERSION, "Ping", {"sender": "x", "admin": True}]))


def test_missing_field() -> None:
    with pytest.raises(ProtocolError, match="bad fields for WorkerStatus"):
        decode(pack([PROTOCOL_VERSION, "WorkerStatus", {"role": "encoder", "worker_id": "w", "incarnation": "i"}]))


def test_bad_fields_in_nested_message() -> None:
    slot = {"~t": "TensorRef", "kind": "shm", "dtype": "float32"}  # no shape
    body = {"call_id": "c", "state": "reserved", "slot": slot}
    with pytest.raises(ProtocolError, match="bad fields for TensorRef"):
        decode(pack([PROTOCOL_VERSION, "CacheLookupResult", body]))
    slot = {**slot, "shape": [1], "evil": 1}
    with pytest.raises(ProtocolError, match="bad fields for TensorRef"):
        decode(pack([PROTOCOL_VERSION, "CacheLookupResult", {**body, "slot": slot}]))


@pytest.mark.parametrize(
    ("tag", "body", "field"),
    [
        ("Abort", {"request_id": 5}, "Abort.request_id"),
        ("EncodeJob", {"job_id": "j", "content_hash": "h", "pixels": 3, "grid_thw": [1], "slot": 4}, "pixels"),
        ("PreparedRequest", {"request_id": "r", "prompt_ids": [1, "2"], "media": [], "sampling": None}, "prompt_ids"),
        ("CacheAcquire", {"call_id": "c", "request_id": "r", "content_hashes": [b"h"]}, "content_hashes"),
        ("StatsResult", {"call_id": "c", "role": "r", "incarnation": "i", "counters": {"a": "x"}}, "counters"),
        ("TokenBatch", {"deltas": [["r", {"a": 1}]]}, "TokenDelta.token_ids"),
    ],
)
def test_fields_of_the_wrong_type_are_protocol_errors(tag: str, body: dict[str, Any], field: str) -> None:
    # (a worker's handler met them as attributes and died: found by tests/integration/test_fuzz_zmq.py)
    with pytest.raises(ProtocolError, match=f"bad fields for {tag}.*{field}"):
        decode(pack([PROTOCOL_VERSION, tag, body]))


def test_ints_pass_where_floats_are_declared() -> None:
    sampling = decode(pack([PROTOCOL_VERSION, "SamplingParams", {"max_tokens": 3, "temperature": 1}]))
    assert sampling == SamplingParams(3, temperature=1)


def test_nil_tag_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode(pack([PROTOCOL_VERSION, None, {"sender": "x"}]))


@pytest.mark.parametrize("tag", [["Ping"], {"a": 1}])
def test_unhashable_tag_is_rejected(tag: Any) -> None:
    with pytest.raises(ProtocolError):
        decode(pack([PROTOCOL_VERSION, tag, {"sender": "x"}]))


@pytest.mark.parametrize("thing", [{"sender": "x"}, "Ping", None, b"\x93\x01", [Ping("x")], 3])
def test_encode_refuses_non_messages(thing: Any) -> None:
    with pytest.raises(TypeError, match="not a protocol message"):
        encode(thing)


# --------------------------------------------------------------------------- no pickle


class _Detonator:
    """Unpickling this would call ``_boom`` — decode must never get that far."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_boom, ())


_EXPLODED: list[bool] = []


def _boom() -> None:
    _EXPLODED.append(True)


@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_frames_are_rejected(proto: int) -> None:
    for obj in (Ping("x"), {"sender": "x"}, [PROTOCOL_VERSION, "Ping", {"sender": "x"}], _Detonator()):
        with pytest.raises(ProtocolError):
            decode(pickle.dumps(obj, protocol=proto))
    assert not _EXPLODED


def test_no_pickle_imports_in_wire_modules() -> None:
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
    for rel in ("common/protocol.py", "common/transport.py", "common/tensor_ref.py"):
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not names & banned, f"{rel} imports {names & banned}"
