"""Unit tests for ``common/tensor_ref.py``: inline refs and shared-memory pools."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

from common.protocol import TensorRef, decode, encode
from common.tensor_ref import (
    SHM_DIR,
    ShmAttachments,
    ShmPool,
    dtype_name,
    gather_rows,
    inline_ref,
    nbytes_of,
    read_tensor,
    torch_dtype,
)

POOL_BYTES = 64 * 1024


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"vlm-unittest-{uuid.uuid4().hex}"
    yield name
    (SHM_DIR / name).unlink(missing_ok=True)


@pytest.fixture
def pool(shm_name: str) -> Iterator[ShmPool]:
    pool = ShmPool(shm_name, POOL_BYTES, create=True)
    yield pool
    pool.close()
    pool.unlink()


def shm_ref(pool: ShmPool, dtype: str, shape: list[int], offset: int) -> TensorRef:
    return TensorRef(kind="shm", dtype=dtype, shape=shape, shm_name=pool.name, offset=offset)


# --------------------------------------------------------------------------- inline


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
        torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        torch.tensor([[-(2**62), 2**62 + 7], [0, -1]], dtype=torch.int64),
        torch.arange(12, dtype=torch.float16).reshape(3, 4),
        torch.arange(7, dtype=torch.int32),
        torch.arange(256, dtype=torch.int64).to(torch.uint8),
    ],
    ids=["float32", "bfloat16", "int64", "float16", "int32", "uint8"],
)
def test_inline_round_trip(tensor: torch.Tensor) -> None:
    ref = inline_ref(tensor)
    assert ref.kind == "inline"
    assert ref.dtype == dtype_name(tensor.dtype)
    assert ref.shape == list(tensor.shape)
    assert ref.data is not None and len(ref.data) == tensor.numel() * tensor.element_size()
    back = read_tensor(decode(encode(ref)))  # across the wire too
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
def test_inline_empty_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    ref = inline_ref(torch.empty(shape, dtype=dtype))
    assert ref.data == b"" and ref.shape == list(shape)
    back = read_tensor(ref)
    assert back.shape == shape and back.dtype == dtype and back.numel() == 0


def test_inline_of_a_non_contiguous_view() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base.t()[1:, ::2]
    assert not view.is_contiguous()
    assert torch.equal(read_tensor(inline_ref(view)), view)


def test_inline_read_is_a_private_copy() -> None:
    ref = inline_ref(torch.ones(4))
    first = read_tensor(ref)
    first.fill_(7.0)
    assert torch.equal(read_tensor(ref), torch.ones(4))


def test_inline_scalar_round_trip() -> None:
    scalar = torch.tensor(2.5)
    back = read_tensor(inline_ref(scalar))
    assert back.shape == () and back.item() == 2.5


def test_inline_size_mismatch_is_rejected() -> None:
    good = inline_ref(torch.arange(6, dtype=torch.float32))
    assert good.data is not None
    for data in (good.data[:-1], good.data + b"\x00", b"", good.data * 2):
        bad = TensorRef(kind="inline", dtype="float32", shape=[6], data=data)
        with pytest.raises(ValueError, match="inline tensor has"):
            read_tensor(bad)
    wrong_shape = TensorRef(kind="inline", dtype="float32", shape=[7], data=good.data)
    with pytest.raises(ValueError):
        read_tensor(wrong_shape)
    wrong_dtype = TensorRef(kind="inline", dtype="int64", shape=[6], data=good.data)
    with pytest.raises(ValueError):
        read_tensor(wrong_dtype)


def test_bad_refs_are_rejected() -> None:
    with pytest.raises(ValueError, match="without data"):
        read_tensor(TensorRef(kind="inline", dtype="float32", shape=[1], data=None))
    with pytest.raises(ValueError, match="unsupported tensor dtype"):
        read_tensor(TensorRef(kind="inline", dtype="complex64", shape=[1], data=b"\x00" * 8))
    with pytest.raises(ValueError, match="unsupported tensor ref kind"):
        read_tensor(TensorRef(kind="nvme", dtype="float32", shape=[1], data=b"\x00" * 4))
    with pytest.raises(ValueError, match="a cuda_ipc tensor ref needs pool attachments"):
        read_tensor(TensorRef(kind="cuda_ipc", dtype="float32", shape=[1], shm_name="x"))
    with pytest.raises(ValueError, match="cuda_ipc tensor ref without its pool handle"):
        ShmAttachments().view(TensorRef(kind="cuda_ipc", dtype="float32", shape=[1], shm_name="x"))
    with pytest.raises(ValueError, match="needs pool attachments"):
        read_tensor(TensorRef(kind="shm", dtype="float32", shape=[1], shm_name="x"))


def test_dtype_helpers() -> None:
    assert nbytes_of("bfloat16", [3, 5]) == 30
    assert nbytes_of("int64", [2, 0]) == 0
    assert nbytes_of("float32", []) == 4
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert dtype_name(torch.int64) == "int64"
    with pytest.raises(ValueError):
        torch_dtype("float64")


# --------------------------------------------------------------------------- shared memory


def test_shm_create_and_attach_see_each_others_writes(pool: ShmPool) -> None:
    assert (SHM_DIR / pool.name).exists()
    assert pool.size == POOL_BYTES
    ref = shm_ref(pool, "float32", [4, 8], offset=1024)
    payload = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    pool.view(ref).copy_(payload)

    other = ShmPool(pool.name, 0, create=False)
    try:
        assert other.size == POOL_BYTES  # the size comes from the segment, not the caller
        assert torch.equal(other.view(ref), payload)
        other.view(ref)[0, 0] = 42.0  # and back the other way
        assert pool.view(ref)[0, 0].item() == 42.0
    finally:
        other.close()


def test_shm_attachments_attach_by_name_once(pool: ShmPool) -> None:
    a = shm_ref(pool, "bfloat16", [2, 3], offset=0)
    b = shm_ref(pool, "int64", [5], offset=4096)
    pool.view(a).copy_(torch.full((2, 3), 1.5, dtype=torch.bfloat16))
    pool.view(b).copy_(torch.arange(5))
    att = ShmAttachments()
    assert torch.equal(read_tensor(a, att), torch.full((2, 3), 1.5, dtype=torch.bfloat16))
    assert torch.equal(read_tensor(b, att), torch.arange(5))
    assert list(att.pools) == [pool.name]
    attached = att.pools[pool.name]
    read_tensor(a, att)
    assert att.pools[pool.name] is attached  # attached once, reused
    # A shm read aliases the pool: later writes show through.
    alias = read_tensor(b, att)
    pool.view(b)[2] = -9
    assert alias[2].item() == -9
    att.forget_except(pool.name)
    assert list(att.pools) == [pool.name]
    att.forget_except("another-pool")
    assert att.pools == {}


def test_gather_rows_copies_the_rows_of_several_refs_in_order(pool: ShmPool) -> None:
    a = shm_ref(pool, "bfloat16", [2, 3], offset=0)
    b = shm_ref(pool, "bfloat16", [1, 3], offset=4096)
    pool.view(a).copy_(torch.ones(2, 3))
    pool.view(b).copy_(torch.full((1, 3), 2.0))
    inline = inline_ref(torch.full((2, 3), 3.0, dtype=torch.bfloat16))
    rows = gather_rows([a, inline, b], ShmAttachments())
    assert rows.tolist() == [[1.0] * 3] * 2 + [[3.0] * 3] * 2 + [[2.0] * 3]
    pool.view(a).zero_()  # a copy: the pool may reuse its bytes once the rows are gathered
    assert rows[0, 0].item() == 1.0
    one = gather_rows([b], ShmAttachments())
    pool.view(b).zero_()
    assert one[0, 0].item() == 2.0  # one ref is copied too


def test_shm_ref_exactly_at_the_end_fits(pool: ShmPool) -> None:
    ref = shm_ref(pool, "float32", [16], offset=POOL_BYTES - 64)
    assert pool.view(ref).shape == (16,)


@pytest.mark.parametrize(
    ("shape", "offset"),
    [
        ([17], POOL_BYTES - 64),  # one element past the end
        ([1], POOL_BYTES),
        ([POOL_BYTES // 4 + 1], 0),  # bigger than the pool
        ([1], -4),
        ([1], 10 * POOL_BYTES),
    ],
)
def test_shm_out_of_range_refs_are_rejected(pool: ShmPool, shape: list[int], offset: int) -> None:
    ref = shm_ref(pool, "float32", shape, offset)
    with pytest.raises(ValueError, match="outside pool"):
        pool.view(ref)
    with pytest.raises(ValueError, match="outside pool"):
        read_tensor(ref, ShmAttachments())


def test_shm_create_refuses_an_existing_name(pool: ShmPool) -> None:
    with pytest.raises(FileExistsError):
        ShmPool(pool.name, POOL_BYTES, create=True)


def test_shm_attach_to_a_missing_pool_fails(shm_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        ShmPool(shm_name, 0, create=False)


def test_unlink_removes_the_segment(shm_name: str) -> None:
    pool = ShmPool(shm_name, 4096, create=True)
    ref = TensorRef(kind="shm", dtype="uint8", shape=[4], shm_name=shm_name, offset=0)
    pool.view(ref).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert (SHM_DIR / shm_name).exists()
    pool.unlink()
    assert not (SHM_DIR / shm_name).exists()
    with pytest.raises(FileNotFoundError):
        ShmPool(shm_name, 0, create=False)
    # The creator's mapping stays valid until it is dropped (POSIX semantics).
    assert pool.view(ref).tolist() == [1, 2, 3, 4]
    pool.unlink()  # idempotent
    pool.close()
