"""Batched forward pass of the language model over a paged KV cache.

The engine runs many sequences in one forward: prefill chunks and single decode tokens, flattened
into one [T, hidden] batch (sequence 0's tokens first, then sequence 1's, ...). Every layer's linear
maps, norms, rotary and MLP see the whole batch; only attention needs to know where one sequence ends.

K/V live in fixed-size blocks shared by all sequences (`PagedKVCache`): a sequence owns a list of
physical block ids (its block table), token ``pos`` of a sequence lives in slot
``table[pos // block_size] * block_size + pos % block_size``. Blocks can be shared between sequences
(prefix caching) as long as nobody writes to a shared block; `BatchLayout` checks that.

The math comes from `workers.models.language` so that a kernel swap stays in one place. `BatchLayout` and
`paged_attention_reference` (the plain-torch attention the paged kernels are checked against) live in the
kernels' layer, which takes them (`workers.kernels.layout`, `workers.kernels.attention`); they are
re-exported here for the model's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from workers.kernels.activation import silu_and_mul
from workers.kernels.attention import paged_attention_reference
from workers.kernels.cache import KV_FP8, quantize_kv_reference, reshape_and_cache
from workers.kernels.layout import AttentionMetadata, BatchLayout
from workers.kernels.norm import fused_add_rms_norm
from workers.kernels.rotary import apply_mrope, apply_qk_norm_mrope
from workers.models.fp8 import Fp8Linear, Fp8Weight, fuse_weights
from workers.models.fp8_rows import Rows, add_and_rms_norm, fp8_of, fused_linear
from workers.models.language import (
    DecoderLayer,
    LanguageModel,
    apply_rotary,
    mrope_axis,
    mrope_cos_sin,
    rope_inv_freq,
)
from workers.models.qwen3_vl_text import Qwen3LanguageModel, Qwen3SelfAttention, interleaved_mrope_axis, qk_norm
from workers.models.runtime import upload
from workers.models.spec import ModelSpec
from workers.models.tensor_parallel import TensorParallel

# q [T, heads, D], layer keys and values [slots, kv_heads, D], layout (or the kernels' device-side form of
# it), scale -> [T, heads, D]. Over an FP8 cache it is also given the keywords k_scale and v_scale (the layer's
# scales, [slots, kv_heads]), as `paged_attention` and `paged_attention_reference` take them.
PagedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "BatchLayout | AttentionMetadata", float], torch.Tensor
]


# --- cache --------------------------------------------------------------------------------------------


KV_CACHE_DTYPES = ("auto", "fp8")  # ``[decoder] kv_cache_dtype``: the model's dtype, or FP8 with scales


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for ``[decoder] kv_cache_dtype``."""
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {setting!r}")
    return KV_FP8 if setting == "fp8" else model_dtype


class PagedKVCache:
    """K/V for all sequences: per layer one [num_blocks * block_size, kv_heads, head_dim] tensor of slots.

    Slots are flat (not [blocks, block_size, ...]) so that writing new tokens is one ``index_copy_``
    with the layout's slot mapping, and gathering a context is one ``index_select``.

    With ``cache_dtype`` FP8 (float8_e4m3fn) every (slot, kv head) vector is stored quantized with its own fp32
    scale, per layer in ``key_scales``/``value_scales`` [slots, kv_heads] (`workers.kernels.cache`); ``dtype``
    stays the model's, the one k/v come in and attention reads them back in.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        cache_dtype = cache_dtype or dtype
        if cache_dtype not in (dtype, KV_FP8):
            raise ValueError(f"the cache holds {dtype} (the model's) or {KV_FP8}, got {cache_dtype}")
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # zeros, not empty: a kernel that wrongly reads an unwritten slot then sees finite values, so a
        # bug shows up as a wrong answer in the tests rather than as NaNs depending on stale memory.
        self.keys = [torch.zeros(shape, device=device, dtype=cache_dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=cache_dtype) for _ in range(num_layers)]
        scales = shape[:2] if cache_dtype == KV_FP8 else (0, num_kv_heads)
        self.key_scales = [torch.zeros(scales, device=device, dtype=torch.float32) for _ in range(num_layers)]
        self.value_scales = [torch.zeros(scales, device=device, dtype=torch.float32) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls, model: LanguageModel, num_blocks: int, block_size: int, cache_dtype: torch.dtype | None = None
    ) -> PagedKVCache:
        spec = model.spec
        return cls(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            num_blocks,
            block_size,
            model.device,
            model.dtype,
            cache_dtype,
        )

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        """Memory of one block across all layers, k and v, in a cache of element type ``dtype`` (FP8: with its
        fp32 scale per (slot, kv head)): divide a memory budget by this for num_blocks."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_slot_head = spec.head_dim * itemsize + (4 if dtype == KV_FP8 else 0)
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * per_slot_head

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == KV_FP8

    @property
    def cache_dtype(self) -> torch.dtype:
        """The stored element type: the model's dtype, or float8_e4m3fn."""
        return self.keys[0].dtype

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's scales as the attention's and the cache write's keywords (none unless FP8)."""
        if not self.fp8:
            return {}
        return {"k_scale": self.key_scales[layer], "v_scale": self.value_scales[layer]}

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new k/v [T, kv_heads, D] at ``slots`` [T] (quantized, with their scales, in an FP8 cache)."""
        if not self.fp8:
            self.keys[layer].index_copy_(0, slots, k)
            self.values[layer].index_copy_(0, slots, v)
            return
        for x, store, scales in ((k, self.keys, self.key_scales), (v, self.values, self.value_scales)):
            q, scale = quantize_kv_reference(x)
            _bytes(store[layer]).index_copy_(0, slots, _bytes(q))  # (torch has no FP8 index_copy_ on CPU)
            scales[layer].index_copy_(0, slots, scale)

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst) in every layer, e.g. copy-on-write of a shared partial block."""
        pairs = list(pairs)
        if not pairs:
            return
        ids = torch.tensor(pairs, dtype=torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks:
            raise ValueError(f"block ids must lie in [0, {self.num_blocks}), got {pairs}")
        src, dst = ids[:, 0].to(self.device), ids[:, 1].to(self.device)
        stores = (self.keys, self.values, self.key_scales, self.value_scales) if self.fp8 else (self.keys, self.values)
        for store in stores:
            for slots in store:
                blocks = _bytes(slots).view(self.num_blocks, self.block_size, *slots.shape[1:])
                blocks.index_copy_(0, dst, blocks.index_select(0, src))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its bytes (for the copies torch implements for integers only), others as they are."""
    return t.view(torch.uint8) if t.dtype == KV_FP8 else t


# --- fused projections ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedLayer:
    """One layer's projections concatenated, so that q/k/v is one GEMM and gate/up another."""

    qkv_weight: torch.Tensor | Fp8Weight  # [(heads + 2 kv_heads) * D, hidden]
    qkv_bias: torch.Tensor | None  # None where q/k/v have no bias (Qwen3)
    gate_up_weight: torch.Tensor | Fp8Weight  # [2 * intermediate, hidden]


def fuse_layers(model: LanguageModel | Qwen3LanguageModel) -> list[FusedLayer]:
    """Concatenate every layer's q/k/v and gate/up weights and point the modules' own parameters at
    views of the result, so the model's memory does not grow and both forward paths keep working. FP8 weights
    fuse with their scales (`workers.models.fp8.fuse_weights`)."""
    fused = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        biased = [p.bias is not None for p in projections]
        if any(biased) and not all(biased):
            raise ValueError(f"layer {attn.layer}: q/k/v must all have a bias or none, got {biased}")
        with torch.no_grad():
            qkv_w = _fused_weight(projections)
            qkv_b = torch.cat([p.bias for p in projections]) if all(biased) else None
            gate_up = _fused_weight([mlp.gate_proj, mlp.up_proj])
        if qkv_b is not None:
            _point_at_parts(qkv_b, projections, "bias")
        fused.append(FusedLayer(qkv_w, qkv_b, gate_up))
    return fused


def _fused_weight(modules: Sequence[torch.nn.Module]) -> torch.Tensor | Fp8Weight:
    """The modules' weights as one, their parameters pointed at its parts: plain or FP8 alike, and where only some
    are FP8 (a checkpoint that left one unquantized) the parts dequantized, exact to the format, and left apart."""
    fp8 = [isinstance(module, Fp8Linear) for module in modules]
    if all(fp8):
        fused = fuse_weights([module.fp8_weight() for module in modules])  # type: ignore[operator]
        _point_at_parts(fused.data, modules, "weight")
        return fused
    if any(fp8):
        dtype = next(module.weight.dtype for module, quantized in zip(modules, fp8, strict=True) if not quantized)
        return torch.cat([_dense(module, dtype) for module in modules])
    whole = torch.cat([module.weight for module in modules])
    _point_at_parts(whole, modules, "weight")
    return whole


def _dense(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    return module.fp8_weight().dequantize(dtype) if isinstance(module, Fp8Linear) else module.weight


def _point_at_parts(whole: torch.Tensor, modules: Sequence[torch.nn.Module], name: str) -> None:
    start = 0
    for module in modules:
        rows = getattr(module, name).shape[0]
        setattr(module, name, torch.nn.Parameter(whole[start : start + rows], requires_grad=False))
        start += rows


# --- forward ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepDeepStack:
    """A step's DeepStack input (Qwen3-VL): the flat indices of its tokens that are visual, and the feature sets
    to add there, ``features[k]`` [len(rows), hidden] after decoder layer k."""

    rows: torch.Tensor  # [R] int64
    features: torch.Tensor  # [K, R, hidden]

    def to(self, device: torch.device, dtype: torch.dtype) -> StepDeepStack:
        """On ``device`` without the host waiting for the queued work (a step staged ahead must not)."""
        return StepDeepStack(upload(self.rows, device), self.features.to(device=device, dtype=dtype))

    @property
    def num_sets(self) -> int:
        return self.features.shape[0]

    def add(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] after decoder layer ``index`` with set ``index`` added at the visual rows."""
        return hidden.index_add(0, self.rows, self.features[index])


@dataclass(frozen=True)
class DenseDeepStack:
    """The same adds with the sets laid over every token of the step, zero outside the visual rows: a CUDA graph's
    static form (`StepGraphs`), whose shape cannot depend on how many rows a step has. ``x + 0`` is ``x`` and a
    visual row gets ``x + feature`` as `StepDeepStack.add`'s index_add gives it, so both forms agree exactly."""

    features: torch.Tensor  # [K, T, hidden]

    @property
    def num_sets(self) -> int:
        return self.features.shape[0]

    def add(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.features[index]


def rope_cos_sin(
    model: LanguageModel | Qwen3LanguageModel, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own cos/sin [T, head_dim] of position_ids [3, T] (on its device): Qwen3's interleaved M-RoPE,
    or Qwen2's sections with the frequencies it cached on the CPU, so that they match its forward bit for bit."""
    if isinstance(model, Qwen3LanguageModel):
        return model.rope_cos_sin(position_ids)
    return mrope_cos_sin(position_ids, model._rope_inv_freq(), model.spec.mrope_section, model.dtype)


def rope_tables(model: LanguageModel | Qwen3LanguageModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(inv_freq, slot-to-axis map) on the model's device, as `rope_cos_sin` uses them: what a CUDA graph keeps
    so that its cos/sin come from `mrope_cos_sin` with no host work (Qwen3: interleaved, Qwen2: sections)."""
    spec = model.spec
    if isinstance(model, Qwen3LanguageModel):
        return rope_inv_freq(spec.head_dim, spec.rope_theta, model.device), interleaved_mrope_axis(
            spec.mrope_section, model.device
        )
    return model._rope_inv_freq(), mrope_axis(spec.mrope_section, model.device)


@torch.inference_mode()
def paged_forward(
    model: LanguageModel,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    layout: BatchLayout,
    kv: PagedKVCache,
    logits_for: Sequence[int] | None = None,
    attention: PagedAttention = paged_attention_reference,
    fused: Sequence[FusedLayer] | None = None,
    tp: TensorParallel | None = None,
    deepstack: StepDeepStack | None = None,
) -> torch.Tensor:
    """Run a batch of sequences' new tokens through the decoder, writing their k/v into ``kv``.

    inputs_embeds [T, hidden] and position_ids [3, T], tokens of sequence 0 first. Returns logits
    [len(logits_for), vocab] of the given flat token indices (default: each sequence's last token).
    ``attention`` is the one place a paged kernel plugs in; with ``fused`` (from `fuse_layers`) the
    layers run the fused projections and the fused norm / activation / rotary / cache-write kernels.
    ``deepstack``: the step's visual rows and their DeepStack sets (Qwen3-VL).
    """
    _validate(model, inputs_embeds, position_ids, layout, kv)
    device = model.device
    layout = layout.to(device)
    cos, sin = rope_cos_sin(model, position_ids.to(device))
    x = inputs_embeds.to(device=device, dtype=model.dtype)
    rows = layout.last_token_indices if logits_for is None else [int(i) for i in logits_for]
    if any(not 0 <= i < x.shape[0] for i in rows):
        raise ValueError(f"logits_for indices must lie in [0, {x.shape[0]}), got {rows}")
    picked = None if rows == list(range(x.shape[0])) else torch.tensor(rows, dtype=torch.int64).to(device)
    staged = deepstack.to(device, model.dtype) if deepstack is not None and deepstack.rows.numel() else None
    step = StepContext(cos, sin, layout.slot_mapping, layout, kv, attention, tp, staged)
    return forward_logits(model, x, step, picked, fused)


@dataclass(frozen=True)
class StepContext:
    """What every layer of one forward reads besides its activations: rotary tables, where the new k/v
    go, where each sequence's context lies, the cache and the attention that reads it."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor  # [T] the slot each new token's k/v is written to
    attn_layout: BatchLayout | AttentionMetadata
    kv: PagedKVCache
    attention: PagedAttention
    tp: TensorParallel | None = None  # a rank's share of the heads and MLP; its partial sums are all-reduced
    # Qwen3-VL's adds after the first layers, where the step has visual rows (a graph's mixed steps: always)
    deepstack: StepDeepStack | DenseDeepStack | None = None

    def add_deepstack(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden state after decoder layer ``index``, DeepStack set ``index`` added where there is one."""
        if self.deepstack is None or index >= self.deepstack.num_sets:
            return hidden
        return self.deepstack.add(index, hidden)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)


def forward_logits(
    model: LanguageModel,
    x: torch.Tensor,
    step: StepContext,
    rows: torch.Tensor | None,
    fused: Sequence[FusedLayer] | None = None,
) -> torch.Tensor:
    """The layers, the final norm and lm_head over device tensors (logits of ``rows``, or of every token).

    No host copy and no sync of its own: with Triton kernels this is what a CUDA graph captures.
    """
    if fused is None:
        for index, layer in enumerate(model.layers):
            x = step.add_deepstack(index, _decoder_layer(layer, index, x, step))
        x = x if rows is None else x.index_select(0, rows)
        logits = model.lm_head(model.norm(x))
        return logits if step.tp is None else step.tp.gather_logits(logits)
    h, residual = _fused_layers(model, x, step, fused)
    if rows is not None:
        h, residual = h.index_select(0, rows), residual.index_select(0, rows)
    normed, _ = fused_add_rms_norm(h, residual, model.norm.weight, model.norm.eps)
    logits = model.lm_head(normed)
    return logits if step.tp is None else step.tp.gather_logits(logits)


def _decoder_layer(layer: DecoderLayer, index: int, x: torch.Tensor, step: StepContext) -> torch.Tensor:
    # DecoderLayer.forward without its per-sequence cache: same modules, same op order.
    x = x + step.reduce(_self_attention(layer, index, layer.input_layernorm(x), step))
    return x + step.reduce(layer.mlp(layer.post_attention_layernorm(x)))


def _self_attention(layer: DecoderLayer, index: int, x: torch.Tensor, step: StepContext) -> torch.Tensor:
    attn, t = layer.self_attn, x.shape[0]
    q = attn.q_proj(x).view(t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    if isinstance(attn, Qwen3SelfAttention):  # Qwen3: each head RMS-normalised before the rotary
        q, k = qk_norm(q, attn.q_norm.weight, attn.q_norm.eps), qk_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
    v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
    step.kv.write(index, step.slots, k, v)
    return attn.o_proj(_attend(q, index, attn.head_dim, step).reshape(t, -1))


def _fused_layers(
    model: LanguageModel, x: torch.Tensor, step: StepContext, fused: Sequence[FusedLayer]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layers with the residual carried beside the normed activations: each residual add is
    fused into the next RMSNorm. Returns (last MLP output, residual before it); their sum is the hidden.

    After a layer with a DeepStack set the sum is formed first, the set added to it, then normed: the eager
    layer's order of additions, so both paths round alike (the first K layers only; the others stay fused).

    A norm that feeds a per-channel FP8 qkv or gate_up which would quantize its rows per token writes them in FP8
    with their scales instead (`workers.models.fp8_rows`: `add_and_rms_norm`, `quantizes_for`), and the projection
    takes them as they are; everywhere else (decode rows, block-wise or bf16 weights, the CPU) its rows are bf16."""
    layers = model.layers
    residual, h = add_and_rms_norm(None, x, layers[0].input_layernorm, fp8_of(fused[0].qkv_weight))
    for index, (layer, weights) in enumerate(zip(layers, fused, strict=True)):
        update = step.reduce(_fused_attention(layer, weights, index, h, step))
        norm = layer.post_attention_layernorm
        residual, h = add_and_rms_norm(update, residual, norm, fp8_of(weights.gate_up_weight))
        intermediate = weights.gate_up_weight.shape[0] // 2
        gate_up = fused_linear(h, weights.gate_up_weight)
        activated = silu_and_mul(gate_up[:, :intermediate], gate_up[:, intermediate:])
        out: torch.Tensor | None = step.reduce(layer.mlp.down_proj(activated))
        if step.deepstack is not None and index < step.deepstack.num_sets:
            residual, out = step.add_deepstack(index, out + residual), None
        if index + 1 == len(layers):  # (after a DeepStack add the final add-and-norm takes (0, hidden): exact)
            return (torch.zeros_like(residual) if out is None else out), residual
        norm, qkv = layers[index + 1].input_layernorm, fp8_of(fused[index + 1].qkv_weight)
        residual, h = add_and_rms_norm(out, residual, norm, qkv)
    raise ValueError("a language model without layers")


def _fused_attention(layer: DecoderLayer, weights: FusedLayer, index: int, h: Rows, step: StepContext) -> torch.Tensor:
    attn, t = layer.self_attn, h.shape[0]
    heads, kv_heads = attn.num_heads, attn.num_kv_heads
    qkv = fused_linear(h, weights.qkv_weight, weights.qkv_bias).view(t, heads + 2 * kv_heads, attn.head_dim)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    if isinstance(attn, Qwen3SelfAttention):  # Qwen3: each head RMS-normalised, then rotated, in one pass
        if attn.q_norm.eps != attn.k_norm.eps:
            raise ValueError(f"layer {index}: q_norm eps {attn.q_norm.eps} != k_norm eps {attn.k_norm.eps}")
        norm_weights = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
        apply_qk_norm_mrope(q, k, *norm_weights, step.cos, step.sin, inplace=True)
    else:
        apply_mrope(q, k, step.cos, step.sin, inplace=True)
    reshape_and_cache(k, v, step.kv.keys[index], step.kv.values[index], step.slots, **step.kv.scales(index))
    return attn.o_proj(_attend(q, index, attn.head_dim, step).reshape(t, -1))


def _attend(q: torch.Tensor, index: int, head_dim: int, step: StepContext) -> torch.Tensor:
    kv, scale = step.kv, head_dim**-0.5
    return step.attention(q, kv.keys[index], kv.values[index], step.attn_layout, scale, **kv.scales(index))


def _validate(
    model: LanguageModel, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, layout: BatchLayout, kv: PagedKVCache
) -> None:
    spec = model.spec
    t = layout.num_tokens
    if tuple(inputs_embeds.shape) != (t, spec.hidden_size):
        raise ValueError(
            f"inputs_embeds must be [sum(query_lens)={t}, {spec.hidden_size}], got {tuple(inputs_embeds.shape)}"
        )
    if tuple(position_ids.shape) != (3, t):
        raise ValueError(f"position_ids must be [3, {t}], got {tuple(position_ids.shape)}")
    if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
        raise ValueError(
            f"cache has (layers, kv_heads, head_dim) {(kv.num_layers, kv.num_kv_heads, kv.head_dim)}, "
            f"model {(spec.num_layers, spec.num_kv_heads, spec.head_dim)}"
        )
    if kv.device != model.device or kv.dtype != model.dtype:
        raise ValueError(f"cache is {kv.dtype} on {kv.device}, model {model.dtype} on {model.device}")
    if layout.block_size != kv.block_size:
        raise ValueError(f"layout block_size {layout.block_size} != cache block_size {kv.block_size}")
    layout.check_blocks(kv.num_blocks)
