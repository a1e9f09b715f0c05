"""Paged attention over the flat KV slots: one launch for a whole batch of prefill chunks and decodes.

`paged_attention` has the `PagedAttention` signature of `workers.models.paged`, so it plugs into
``paged_forward(..., attention=paged_attention)``. On CUDA tensors (with triton installed) it launches the
Triton kernel in `attention_triton`; otherwise it is `paged_attention_reference`. `paged_attention_triton`
launches the kernel on any device (Triton's interpreter on CPU tensors), for tests and benchmarks.

The kernel reads per-sequence metadata as int32 tensors (`AttentionMetadata`, in `workers.kernels.layout`);
they are built from the `BatchLayout` once per forward step and reused by every layer.
`paged_attention_reference` is the plain-torch contract the kernel is checked against.

An FP8 cache (float8_e4m3fn, see `workers.kernels.cache`) comes with its fp32 scales ``k_scale``/``v_scale``
[slots, kv_heads]: every K/V vector is dequantized as it is read (``q * scale`` in fp32, rounded to q's dtype), and
the attention then runs as over a cache of q's dtype.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

from workers.kernels._launch import use_triton
from workers.kernels.cache import KV_FP8, check_scales, dequantize_kv_reference
from workers.kernels.layout import AttentionMetadata, BatchLayout

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _MetadataCache:
    """The metadata of the last layout seen, so that the layers of one step build it once.

    Keyed by the layout object itself (held weakly): a `BatchLayout` is frozen, so the same object always
    describes the same batch, and a new step brings a new object.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[weakref.ref[BatchLayout], torch.device, AttentionMetadata] | None = None

    def get(self, layout: BatchLayout, device: torch.device) -> AttentionMetadata:
        with self._lock:
            entry = self._entry
            if entry is not None and entry[0]() is layout and entry[1] == device:
                return entry[2]
        metadata = AttentionMetadata.from_layout(layout, device)
        with self._lock:
            self._entry = (weakref.ref(layout), device, metadata)
        return metadata


_metadata_cache = _MetadataCache()


def attention_metadata(layout: BatchLayout, device: torch.device | str | None = None) -> AttentionMetadata:
    """`AttentionMetadata` for ``layout`` on ``device`` (default: the layout's), built once per layout object."""
    return _metadata_cache.get(layout, torch.device(device) if device is not None else layout.device)


def paged_attention_reference(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    layout: BatchLayout | AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of every sequence's new queries over its whole context, gathered from slots.

    q [T, heads, D] (flat, sequence after sequence); kv_k, kv_v [slots, kv_heads, D] already hold the new
    tokens' k/v (an FP8 cache: with their scales [slots, kv_heads], dequantized to q's dtype as gathered).
    Query i of sequence s sits at position ``context_len - query_len + i`` and sees
    positions ``0 ..`` itself. Returns [T, heads, D]. An `AttentionMetadata` is read back to the host first;
    rows of tokens that belong to no sequence (graph padding) are zeros.
    """
    check_scales(kv_k, k_scale, v_scale)
    if isinstance(layout, AttentionMetadata):
        layout = BatchLayout.from_metadata(layout)
    out = torch.zeros_like(q)
    slots = layout.context_slots
    q_starts, ctx_start = layout.query_starts, 0
    for s, (past, ctx) in enumerate(zip(layout.past_lens, layout.context_lens, strict=True)):
        seq_slots = slots[ctx_start : ctx_start + ctx]
        ctx_start += ctx
        # [kv_heads, S, D] with rows D apart, as in `KVCache`'s views: SDPA takes the same path as there.
        k = _gather(kv_k, k_scale, seq_slots, q.dtype).transpose(0, 1).contiguous()
        v = _gather(kv_v, v_scale, seq_slots, q.dtype).transpose(0, 1).contiguous()
        begin, end = q_starts[s], q_starts[s + 1]
        out[begin:end] = _sequence_attention(q[begin:end].transpose(0, 1), k, v, past, scale).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``slots`` of a cache, dequantized to ``dtype`` where it is FP8."""
    rows = cache.index_select(0, slots)
    return rows if scale is None else dequantize_kv_reference(rows, scale.index_select(0, slots), dtype)


def _sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """`language.attention` with an explicit scale: q [Hq, t, D], k/v [Hkv, past + t, D] -> [Hq, t, D].

    The same SDPA calls in the same three cases (no mask / is_causal / explicit mask) as the per-sequence
    path, so that fp32 results agree bit for bit.
    """
    t, s = q.shape[1], k.shape[1]
    mask, causal = None, False
    if t > 1 and past == 0:
        causal = True
    elif t > 1:
        mask = causal_mask(t, s, past, q.device)  # is_causal would align the triangle top-left
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )
    return out.squeeze(0)


def causal_mask(t: int, s: int, past_length: int, device: torch.device) -> torch.Tensor:
    """bool [t, s]: query i (at position ``past_length + i``) may see keys 0 .. past_length + i."""
    query_index = torch.arange(past_length, past_length + t, device=device)
    return torch.arange(s, device=device)[None, :] <= query_index[:, None]


def paged_attention(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    layout: BatchLayout | AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q [T, heads, D] over each sequence's slots in kv_k/kv_v [slots, kv_heads, D]
    (an FP8 cache with its scales k_scale/v_scale [slots, kv_heads]).

    Triton on CUDA tensors, the reference otherwise; see `paged_attention_reference` for the contract.
    """
    if use_triton(q, kv_k, kv_v):
        return paged_attention_triton(q, kv_k, kv_v, layout, scale, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(q, kv_k, kv_v, layout, scale, k_scale, v_scale)


def paged_attention_triton(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    layout: BatchLayout | AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: object = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the Triton kernel on q's device (interpreted on CPU). The keywords override the heuristics
    (``tiles``: an `attention_triton.Tiles`, typed loosely here because that module imports triton)."""
    from workers.kernels import attention_triton

    metadata = layout if isinstance(layout, AttentionMetadata) else attention_metadata(layout, q.device)
    check_inputs(q, kv_k, kv_v, metadata)
    check_scales(kv_k, k_scale, v_scale)
    scales = None if k_scale is None or v_scale is None else (k_scale, v_scale)
    return attention_triton.launch(q, kv_k, kv_v, metadata, scale, num_splits, block_m, block_n, tiles, scales)


def check_inputs(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, metadata: AttentionMetadata) -> None:
    """ValueError for inputs the kernel cannot take (it would read out of bounds instead of failing)."""
    if q.ndim != 3 or kv_k.ndim != 3 or kv_v.shape != kv_k.shape:
        raise ValueError(
            f"q must be [T, heads, D] and kv_k, kv_v [slots, kv_heads, D] alike, got {tuple(q.shape)}, "
            f"{tuple(kv_k.shape)}, {tuple(kv_v.shape)}"
        )
    tokens, heads, head_dim = q.shape
    slots, kv_heads, kv_dim = kv_k.shape
    if kv_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} != the cache's {kv_dim}")
    if heads % kv_heads:
        raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
    if tokens != metadata.num_tokens:
        raise ValueError(f"q has {tokens} tokens, the layout {metadata.num_tokens}")
    if kv_k.dtype != kv_v.dtype or kv_k.dtype not in (q.dtype, KV_FP8) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, kv_k, kv_v must share one of {SUPPORTED_DTYPES} (or the cache be {KV_FP8}), got {q.dtype}, "
            f"{kv_k.dtype}, {kv_v.dtype}"
        )
    if not q.device == kv_k.device == kv_v.device == metadata.device:
        raise ValueError(
            f"q, kv_k, kv_v and the metadata must be on one device, got {q.device}, {kv_k.device}, "
            f"{kv_v.device}, {metadata.device}"
        )
    if q.stride(-1) != 1 or kv_k.stride(-1) != 1 or kv_v.stride(-1) != 1:
        raise ValueError("q, kv_k and kv_v must be contiguous in head_dim")
    if slots % metadata.block_size:
        raise ValueError(f"the cache's {slots} slots are not whole blocks of {metadata.block_size}")
    if head_dim > 256:
        raise ValueError(f"head_dim {head_dim} > 256 is not supported")
