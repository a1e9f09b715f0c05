"""Every message that crosses a socket, in one place.

A message is a frozen dataclass registered under its class name. On the wire it is msgpack:
``[PROTOCOL_VERSION, tag, {field: value}]``; nested messages (``TensorRef``, ``MediaInput`` ...)
are maps carrying their own tag. Decoding accepts only the registered set, so a stray or
malicious frame becomes a ``ProtocolError``, never an arbitrary object (no pickle anywhere).
One exception to the maps: a `TokenBatch`'s deltas travel as rows of field values in declaration
order (see `_ROWS`), since the decoder sends one every step with a delta per running stream.

A message may take several ZMQ frames (`encode_frames`): a bytes value of `FRAME_MIN_BYTES` or more (a tensor
sent by value) travels as a frame of its own after the msgpack header, which names it by an extension value, so
that neither side copies it through msgpack.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgpack

PROTOCOL_VERSION = 4
_TAG = "~t"
FRAME_MIN_BYTES = 64 * 1024
_FRAME_EXT = 1  # msgpack extension code: "the bytes are frame N after the header"

_REGISTRY: dict[str, type[Message]] = {}

M = TypeVar("M", bound="Message")


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol version."""


class Message:
    """Base of all wire messages; subclasses are frozen dataclasses registered by ``@message``."""

    TAG: ClassVar[str] = ""


def message(cls: type[M]) -> type[M]:
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    cls.TAG = cls.__name__
    if cls.TAG in _REGISTRY:
        raise TypeError(f"duplicate message tag {cls.TAG}")
    _REGISTRY[cls.TAG] = cls
    _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls


# Each class's field names, looked up once: the decoder encodes a delta per running stream every step.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
# Messages with a list field whose items travel as rows of their field values (no names, no tag): the
# class -> (that field, the items' class, a getter of an item's values). See `_send_as_rows`.
_ROWS: dict[type, tuple[str, type, operator.attrgetter[Any]]] = {}


def _send_as_rows(cls: type[Message], field: str, item: type[Message]) -> None:
    """``cls.field``'s items (of class ``item``, whose fields must all be plain msgpack values: no messages)
    go on the wire as rows of values in field order: a fifth of the work of a tagged map each."""
    names = _FIELD_NAMES[item]
    if len(names) < 2:
        raise TypeError(f"{item.__name__} has too few fields to send as rows")
    _ROWS[cls] = (field, item, operator.attrgetter(*names))


_PLAIN = (int, float, str, bytes, bool, type(None))


def _to_wire(value: Any, frames: list[bytes] | None = None) -> Any:
    """``value`` as msgpack values; with ``frames``, large bytes values moved there (see `encode_frames`)."""
    if type(value) in _PLAIN:  # most values: returned before any isinstance check
        if frames is not None and type(value) is bytes and len(value) >= FRAME_MIN_BYTES:
            frames.append(value)
            return msgpack.ExtType(_FRAME_EXT, len(frames).to_bytes(4, "big"))
        return value
    if isinstance(value, Message):
        rows = _ROWS.get(type(value))
        names = _FIELD_NAMES[type(value)]
        out = {name: _to_wire(getattr(value, name), frames) for name in names if rows is None or name != rows[0]}
        if rows is not None:
            field, _, values = rows
            out[field] = [values(item) for item in getattr(value, field)]
        out[_TAG] = value.TAG
        return out
    if isinstance(value, list | tuple):
        return [_to_wire(v, frames) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v, frames) for k, v in value.items()}
    return value


def _from_wire(obj: dict[str, Any]) -> Any:
    if _TAG not in obj:
        return obj
    tag = obj[_TAG]
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    del obj[_TAG]  # (msgpack's hook hands over a fresh map: it is ours to change)
    try:
        rows = _ROWS.get(cls)
        if rows is not None:
            field, item, _ = rows
            obj[field] = [_checked(item(*row)) for row in obj[field]]
        return _checked(cls(**obj))
    except (TypeError, KeyError) as exc:
        raise ProtocolError(f"bad fields for {tag}: {exc!r}") from exc


Check = Callable[[Any], bool]
_CHECKS: dict[type, tuple[tuple[str, Check], ...]] = {}  # each class's field checks, made on its first decode


def _check_for(hint: Any) -> Check:
    """Whether a decoded value fits the annotation ``hint`` (ints pass for floats: msgpack keeps 1.0 apart
    from 1 only when the sender did)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        options = [_check_for(a) for a in args]
        return lambda v: any(check(v) for check in options)
    if origin is list and isinstance(args[0], type) and args[0] not in (float, type(None)):
        kind = args[0]  # (a prompt's token ids: the types present, in C, not each item in Python)
        return lambda v: isinstance(v, list) and all(issubclass(t, kind) for t in set(map(type, v)))
    if origin is list:
        item = _check_for(args[0])
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        key, value = _check_for(args[0]), _check_for(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and value(x) for k, x in v.items())
    if hint is float:
        return lambda v: isinstance(v, int | float)
    if hint is type(None):
        return lambda v: v is None
    return lambda v: isinstance(v, hint)


def _checked(msg: M) -> M:
    """``msg`` if each field has its annotated type, so that no handler meets a map where it reads a number;
    else a TypeError naming the field."""
    cls = type(msg)
    if cls not in _CHECKS:
        hints = typing.get_type_hints(cls)
        _CHECKS[cls] = tuple((name, _check_for(hints[name])) for name in _FIELD_NAMES[cls])
    for name, check in _CHECKS[cls]:
        if not check(getattr(msg, name)):
            raise TypeError(f"{cls.__name__}.{name} is not {typing.get_type_hints(cls)[name]}")
    return msg


def encode(msg: Message) -> bytes:
    """``msg`` as one frame, every value inside the msgpack header."""
    return _pack(msg, None)


def encode_frames(msg: Message) -> list[bytes]:
    """``msg`` as the msgpack header and, after it, each bytes value of `FRAME_MIN_BYTES` or more as a frame of its
    own (sent as it is: ZMQ needs no copy of it into the header, nor the receiver out of it)."""
    frames: list[bytes] = []
    return [_pack(msg, frames), *frames]


def _pack(msg: Message, frames: list[bytes] | None) -> bytes:
    if not isinstance(msg, Message):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    body = _to_wire(msg, frames)
    tag = body.pop(_TAG)
    return msgpack.packb([PROTOCOL_VERSION, tag, body], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """A message of one frame (`encode`)."""
    return decode_frames([frame])


def decode_frames(frames: list[bytes]) -> Message:
    """A message from its frames (`encode_frames`; one frame is `encode`'s form): every frame after the header must
    be one the header names, once."""
    if not frames:
        raise ProtocolError("no frames")
    named: set[int] = set()

    def frame_of(code: int, data: bytes) -> bytes:
        index = int.from_bytes(data, "big") if code == _FRAME_EXT and len(data) == 4 else 0
        if not 0 < index < len(frames) or index in named:
            raise ProtocolError(f"a value names frame {index} of {len(frames)} (extension {code})")
        named.add(index)
        return frames[index]

    try:
        version, tag, body = msgpack.unpackb(
            frames[0], raw=False, object_hook=_from_wire, ext_hook=frame_of, strict_map_key=True
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if len(named) != len(frames) - 1:
        raise ProtocolError(f"{len(frames) - 1 - len(named)} of the message's frames are named by no value")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    if not isinstance(body, dict):
        raise ProtocolError("message body is not a map")
    if not isinstance(tag, str):
        raise ProtocolError(f"message tag must be a string, got {type(tag).__name__}")
    return _from_wire({**body, _TAG: tag})


# --------------------------------------------------------------------------- shared pieces


@message
class CudaIpcHandle(Message):
    """A CUDA allocation another process can map (what ``UntypedStorage._share_cuda_`` returns)."""

    device: int
    handle: bytes
    size: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes | None
    event_sync: bool


@message
class TensorRef(Message):
    """Where a tensor lives: ``inline`` bytes, ``shm`` (POSIX shared memory name + offset), or
    ``cuda_ipc`` (an offset in a GPU pool another process owns, mapped through ``cuda``)."""

    kind: str
    dtype: str
    shape: list[int]
    data: bytes | None = None
    shm_name: str = ""
    offset: int = 0
    pool_incarnation: str = ""
    cuda: CudaIpcHandle | None = None


@message
class SamplingParams(Message):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs: int = -1  # -1: no logprobs; 0: the chosen token's; k: also the k most likely
    # OpenAI's logit_bias as two lists (msgpack maps with int keys are refused on decode)
    logit_bias_ids: list[int] = dataclasses.field(default_factory=list)
    logit_bias_values: list[float] = dataclasses.field(default_factory=list)
    # Structured output: the grammar the answer must match, in llguidance's serialized form (the gateway turns
    # response_format, a tool choice or a guided_* option into it and checks it compiles); "": unconstrained.
    grammar: str = ""


@message
class MediaInput(Message):
    """One media item as the client gave it (before fetching)."""

    kind: str  # "image" or "video"
    url: str
    min_pixels: int | None = None
    max_pixels: int | None = None
    fps: float | None = None  # videos: frames sampled per second; None: the server default


@message
class PreparedMedia(Message):
    """One media item after fetching: its content hash names its embedding in the cache."""

    kind: str
    content_hash: str
    grid_thw: list[int]
    num_tokens: int
    # Videos: the seconds one temporal grid step spans (temporal patch size / the sampled frames' fps), which
    # Qwen2.5-VL's M-RoPE turns into absolute time; None for images.
    second_per_grid_t: float | None = None
    # Qwen3-VL videos: the token ids of each temporal step's timestamp ("<1.5 seconds>"), which the prompt holds
    # before that step's `<|vision_start|>` tokens `<|vision_end|>`; None: the item's tokens are one run.
    frame_text_ids: list[list[int]] | None = None


# --------------------------------------------------------------------------- liveness


@message
class WorkerStatus(Message):
    """Ready handshake and heartbeat: a worker says it is alive and how much work it will take."""

    role: str
    worker_id: str
    incarnation: str
    credits: int
    workers_live: int = -1  # a fetcher's: the encoders it sees live (so /health knows images can be served)
    workers_known: int = -1  # a fetcher's: the encoders it dispatches to, live or not (the gateway asks them for stats)


@message
class Ping(Message):
    sender: str


# --------------------------------------------------------------------------- gateway -> fetcher -> decoder


@message
class GenerateRequest(Message):
    request_id: str
    prompt_ids: list[int]
    media: list[MediaInput]
    sampling: SamplingParams
    replica: int = 0  # the decoder replica the gateway chose: the fetcher hands the request to it


@message
class FetchDone(Message):
    """Fetcher -> gateway: the request left the fetcher (handed to the decoder or failed)."""

    request_id: str


@message
class PreparedRequest(Message):
    """Token ids with one placeholder per media item; the decoder expands them."""

    request_id: str
    prompt_ids: list[int]
    media: list[PreparedMedia]
    sampling: SamplingParams


@message
class Abort(Message):
    request_id: str


# --------------------------------------------------------------------------- fetcher -> encoder


@message
class EncodeJob(Message):
    """Fetcher -> encoder. ``pixels`` are the model's float pixel values, or uint8 patches that the
    encoder turns into them on its device with ``rescale_factor`` (None: no rescale) and the per-channel
    ``image_mean``/``image_std`` (empty: no normalisation) — the processor's own arithmetic, exact."""

    job_id: str
    content_hash: str
    pixels: TensorRef
    grid_thw: list[int]
    slot: TensorRef
    rescale_factor: float | None = None
    image_mean: list[float] = dataclasses.field(default_factory=list)
    image_std: list[float] = dataclasses.field(default_factory=list)
    # False for one part of a video encoded in chunks of frames: the fetcher commits the cache entry once
    # every part is in its place in the slot (or fails it if one part fails).
    commit: bool = True
    # True for an encoder that may be on another host (a tcp:// endpoint), where ``slot`` (shared or GPU memory)
    # cannot be reached: the rows come back in the `EncodeResult`, and the fetcher has its cache write and commit
    # them (`CacheWrite`); the encoder tells no cache anything.
    by_value: bool = False


@message
class EncodeResult(Message):
    """Encoder -> fetcher: the embedding is in its slot (``status`` 200) or it failed. For a job ``by_value``,
    ``rows`` holds the embedding (inline, a frame of its own)."""

    job_id: str
    content_hash: str
    status: int = 200
    message: str = ""
    rows: TensorRef | None = None


# --------------------------------------------------------------------------- cache daemon


@message
class CacheLookup(Message):
    """Find an embedding by content hash, or reserve a slot for it."""

    call_id: str
    content_hash: str
    nbytes: int
    dtype: str
    shape: list[int]


@message
class CacheLookupResult(Message):
    """``state``: ``ready`` (hit), ``pending`` (someone encodes it), ``reserved`` (you encode it
    into ``slot``), or ``error`` (``status``/``message``)."""

    call_id: str
    state: str
    slot: TensorRef | None = None
    status: int = 200
    message: str = ""


@message
class CacheReserve(Message):
    """Fetcher -> cache: every media item of one request (``items``: their lookups), found or reserved all
    at once and leased to ``request_id`` until it is released. Where they do not fit now the reservation
    waits, in arrival order, for leases to end, up to ``[cache] reserve_wait_s``; a later one for the same
    request replaces it, and a ``CacheRelease`` of the request withdraws it."""

    call_id: str
    request_id: str
    items: list[CacheLookup]
    # the fetcher that encodes what is reserved for it (``FetcherStarted``): its name and incarnation
    fetcher: str = ""
    fetcher_incarnation: str = ""


@message
class FetcherStarted(Message):
    """Fetcher -> cache, at its start and whenever it finds the daemon restarted: ``fetcher`` runs as
    ``incarnation``. Slots its earlier incarnation reserved (`CacheReserve`) and never filled never will be:
    the daemon fails them at once, so that the requests waiting on them are fetched and encoded again instead of
    waiting out ``[cache] pending_ttl_s``."""

    fetcher: str
    incarnation: str


@message
class CacheReserveResult(Message):
    """``results``: one per item, in order, each ``ready``, ``pending`` or ``reserved``; or none, with
    ``status`` (413: could never fit, 503: no room before the deadline), ``code`` and ``message``."""

    call_id: str
    request_id: str
    results: list[CacheLookupResult]
    status: int = 200
    code: str = ""
    message: str = ""


@message
class CacheCommit(Message):
    """Encoder -> cache: the slot for this hash holds its embedding now (or ``error``)."""

    content_hash: str
    error: str = ""
    # the slot written (its pool's incarnation and offset): a commit for a slot the daemon no longer gives that
    # hash (freed and reserved again, or a pool lost with a restarted daemon) is stale and ignored
    pool_incarnation: str = ""
    offset: int = -1


@message
class CacheWrite(Message):
    """Fetcher -> cache: an embedding an encoder sent by value (``rows``, inline), to be written into ``slot`` (a
    slot of ``content_hash``'s entry that this daemon reserved, or a part of it). The commit follows as usual."""

    content_hash: str
    slot: TensorRef
    rows: TensorRef


def commit_for(content_hash: str, slot: TensorRef, error: str = "") -> CacheCommit:
    """The commit (or failure, ``error``) of ``content_hash``'s embedding written into ``slot``."""
    return CacheCommit(content_hash, error, slot.pool_incarnation, slot.offset)


@message
class CacheAcquire(Message):
    """Decoder -> cache: lease these embeddings for a request; answered once all are ready."""

    call_id: str
    request_id: str
    content_hashes: list[str]


@message
class CacheAcquireResult(Message):
    call_id: str
    request_id: str
    refs: list[TensorRef]
    status: int = 200
    message: str = ""


@message
class CacheRelease(Message):
    request_id: str


# --------------------------------------------------------------------------- tensor-parallel decoder ranks


@message
class TPJoin(Message):
    """Decoder rank K (K >= 1) -> rank 0 at start: ready to join the process group."""

    rank: int
    incarnation: str


@message
class TPSetup(Message):
    """Rank 0 -> each joining rank: where to rendezvous (a file store of this rank 0's incarnation)
    and the KV cache size every rank allocates."""

    store_path: str
    world: int
    num_blocks: int
    leader: str


@message
class StatsRequest(Message):
    call_id: str


@message
class StatsResult(Message):
    call_id: str
    role: str
    incarnation: str
    counters: dict[str, float]


# --------------------------------------------------------------------------- decoder -> gateway


@message
class TokenDelta(Message):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None  # per token in token_ids, when asked
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[token_id, logprob], ...]
    queue_s: float | None = None  # on a request's first delta: seconds it waited for a decoder slot
    media_wait_s: float | None = None  # on a request's first delta: seconds it waited for its embeddings


@message
class TokenBatch(Message):
    """Token ids of one decoder step, for every request that produced some."""

    deltas: list[TokenDelta]


_send_as_rows(TokenBatch, "deltas", TokenDelta)


@message
class DecoderStats(Message):
    """Decoder -> gateway with each heartbeat: counters and gauges for /metrics."""

    incarnation: str
    counters: dict[str, float]
    worker_id: str = "decoder"  # the replica's name (`common.config.decoder_name`)


@message
class RequestError(Message):
    """The terminal message of a failed request; ``status`` is the HTTP status to answer."""

    request_id: str
    status: int
    code: str
    message: str
