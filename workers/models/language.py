"""Qwen2 decoder with multimodal rotary embeddings (the language half of Qwen2-VL).

One sequence at a time, with a contiguous per-sequence KV cache. Prefill (many tokens) and decode (one
token) take the same path: new tokens attend causally to everything cached plus themselves.

The math lives in small pure functions (`rms_norm`, `mrope_cos_sin`, `apply_rotary`, `attention`,
`mlp`). They are the plain-torch references that faster kernels are checked against (`rms_norm` and
`apply_rotary` are defined beside their kernels in `workers.kernels`, the layer below);
`attention_reference` spells attention out without SDPA for the same purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels.attention import causal_mask
from workers.kernels.norm import rms_norm_reference as rms_norm
from workers.kernels.rotary import apply_rotary
from workers.models.fp8 import quantize_state
from workers.models.spec import ModelSpec
from workers.models.weights import (
    CheckpointWeights,
    assign_state,
    built_and_loaded,
    checkpoint_root,
    load_language_state,
)

if TYPE_CHECKING:
    from workers.models.qwen3_vl_spec import Qwen3VLSpec

# --- math -------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    # Computed on the CPU (as the reference's init-time buffer is): CUDA's pow can differ in the last bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return inv_freq.to(device)


def mrope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    dtype: torch.dtype,
    axis: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for position_ids [3, T].

    Frequency slot j of the rotated half takes its position from axis (t, h, w) according to
    ``mrope_section`` (the first s0 slots from t, the next s1 from h, the last s2 from w). ``axis``:
    `mrope_axis` made beforehand, where building it now would copy from the host (a CUDA graph capture).
    """
    if axis is None:
        axis = mrope_axis(mrope_section, position_ids.device)
    pos = position_ids.index_select(0, axis).to(torch.float32)  # [head_dim/2, T]
    freqs = pos.transpose(0, 1) * inv_freq  # [T, head_dim/2], computed in fp32 like the reference
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_axis(mrope_section: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """int64 [head_dim/2]: which position axis (0 t, 1 h, 2 w) each rotary frequency slot reads."""
    return torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section))).to(device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_length: int) -> torch.Tensor:
    """Causal GQA attention of new queries over cached + new keys.

    q [Hq, T, D]; k, v [Hkv, past_length + T, D] -> [Hq, T, D]. Query i sits at sequence index
    ``past_length + i`` and sees keys 0..past_length + i.
    """
    t, s = q.shape[1], k.shape[1]
    if t == 1:
        mask = None  # a single newest token sees everything
        causal = False
    elif past_length == 0:
        mask = None
        causal = True
    else:
        # SDPA's is_causal aligns the triangle top-left, which is wrong once keys outnumber queries.
        mask = causal_mask(t, s, past_length, q.device)
        causal = False
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        # Same float as the reference's scaling (SDPA's own 1/sqrt(d) may differ in the last bit).
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out.squeeze(0)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_length: int) -> torch.Tensor:
    """`attention` with explicit KV-head repetition, masking and an fp32 softmax."""
    groups = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(groups, dim=0).float()
    v = v.repeat_interleave(groups, dim=0).float()
    scores = q.float() @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    allowed = causal_mask(q.shape[1], k.shape[1], past_length, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


def mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


# --- KV cache ---------------------------------------------------------------------------------------


def quantized_at_load(state: dict[str, torch.Tensor], spec: ModelSpec | Qwen3VLSpec) -> dict[str, torch.Tensor]:
    """``state`` (keys relative to ``model.``) with its decoder layers' linear weights quantized to FP8 where
    ``[model] quantization = "fp8"`` asks for it (`common.quantization`); embeddings, norms and lm_head stay."""
    if spec.quantization is None or spec.quantization.in_checkpoint:
        return state
    names = [name for name in state if name.startswith("layers.") and name.endswith("_proj.weight")]
    return quantize_state(state, names)


class KVCache:
    """Per-sequence cache: one contiguous [kv_heads, capacity, head_dim] k and v tensor per layer.

    Capacity doubles when full (amortised O(1) appends). ``length`` counts tokens whose k/v are stored
    for every layer; it only advances once a whole forward pass has written all layers.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        capacity: int = 256,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"KVCache capacity must be >= 1, got {capacity}")
        shape = (num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.length = 0

    @classmethod
    def for_model(cls, model: LanguageModel, capacity: int = 256) -> KVCache:
        spec = model.spec
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, model.device, model.dtype, capacity)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, extra: int) -> None:
        """Make room for ``extra`` more tokens."""
        needed = self.length + extra
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_empty((old.shape[0], new_capacity, old.shape[2]))
                grown[:, : self.length] = old[:, : self.length]
                store[i] = grown

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new k/v [kv_heads, T, D] after the committed tokens; return views of all of them."""
        end = self.length + k.shape[1]
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def commit(self, count: int) -> None:
        self.length += count

    def truncate(self, length: int) -> None:
        """Forget tokens from ``length`` on (e.g. to re-run a turn); storage is kept."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


# --- modules (attribute names match the checkpoint's keys under `model.`) ---------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=True)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=True)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=True)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        past = cache.length
        keys, values = cache.write(self.layer, k.transpose(0, 1), v.transpose(0, 1))
        out = attention(q.transpose(0, 1), keys, values, past)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


class Mlp(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `mlp`'s ops through the modules, which may be FP8 (`workers.models.fp8.Fp8Linear`)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer; ``self_attention`` is the family's (Qwen3's norms q and k per head)."""

    def __init__(
        self, spec: ModelSpec, layer: int, self_attention: Callable[[Any, int], nn.Module] = SelfAttention
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = self_attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = Mlp(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    """Qwen2-VL text decoder: embeddings -> layers -> final norm -> lm_head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(spec, i) for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._inv_freq: torch.Tensor | None = None  # per-device cache, see `_rope_inv_freq`

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: ModelSpec | None = None,
    ) -> LanguageModel:
        """Build the decoder and load its weights (dtype defaults to the checkpoint's)."""
        spec = spec or ModelSpec.from_dir(checkpoint_root(path))
        state = load_language_state(path, spec.tie_word_embeddings, device, dtype or spec.dtype)
        return built_and_loaded(lambda: cls(spec), quantized_at_load(state, spec))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load weights keyed relative to ``model.`` plus ``lm_head.weight``."""
        assign_state(self, state, "language model")

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache.for_model(self, capacity)

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden]."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        if ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.spec.vocab_size})")
        return self.embed_tokens(ids)

    @torch.inference_mode()
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run new tokens through the decoder, appending their k/v to ``cache``.

        inputs_embeds [T, hidden], position_ids [3, T]. Returns logits [vocab] of the last token, or
        [T, vocab] with ``all_logits``.
        """
        t = self._validate(inputs_embeds, position_ids, cache)
        cache.reserve(t)
        cos, sin = mrope_cos_sin(
            position_ids.to(self.device), self._rope_inv_freq(), self.spec.mrope_section, self.dtype
        )
        x = inputs_embeds.to(device=self.device, dtype=self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        cache.commit(t)
        if not all_logits:
            x = x[-1:]
        logits = self.lm_head(self.norm(x))
        return logits if all_logits else logits[0]

    def _rope_inv_freq(self) -> torch.Tensor:
        # Not a buffer: the module is built on the meta device and loaded by assignment.
        if self._inv_freq is None or self._inv_freq.device != self.device:
            self._inv_freq = rope_inv_freq(self.spec.head_dim, self.spec.rope_theta, self.device)
        return self._inv_freq

    def _validate(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> int:
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] != self.spec.hidden_size:
            raise ValueError(f"inputs_embeds must be [T, {self.spec.hidden_size}], got {tuple(inputs_embeds.shape)}")
        t = inputs_embeds.shape[0]
        if t == 0:
            raise ValueError("inputs_embeds is empty")
        if tuple(position_ids.shape) != (3, t):
            raise ValueError(f"position_ids must be [3, {t}], got {tuple(position_ids.shape)}")
        if len(cache.keys) != self.spec.num_layers:
            raise ValueError(f"cache has {len(cache.keys)} layers, model has {self.spec.num_layers}")
        return t


def merge_media_embeddings(
    inputs_embeds: torch.Tensor,
    input_ids: Sequence[int] | torch.Tensor,
    media_embeds: torch.Tensor,
    placeholder_ids: Sequence[int],
) -> torch.Tensor:
    """Put vision tower rows into the placeholder positions, in order of appearance.

    Rows fill every position whose token id is in ``placeholder_ids`` (e.g. ``(spec.image_token_id,
    spec.video_token_id)`` with rows ordered as the items appear in the prompt, or one kind at a time).
    Returns a new tensor.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.int64, device=inputs_embeds.device)
    if ids.ndim != 1 or ids.shape[0] != inputs_embeds.shape[0]:
        raise ValueError(f"input_ids {tuple(ids.shape)} do not match inputs_embeds {tuple(inputs_embeds.shape)}")
    mask = torch.isin(ids, torch.tensor(list(placeholder_ids), dtype=torch.int64, device=ids.device))
    count = int(mask.sum())
    if media_embeds.ndim != 2 or count != media_embeds.shape[0]:
        raise ValueError(f"{count} placeholder tokens but media embeddings of shape {tuple(media_embeds.shape)}")
    out = inputs_embeds.clone()
    out[mask] = media_embeds.to(device=out.device, dtype=out.dtype)
    return out
