"""The Qwen3 text decoder of Qwen3-VL, in what it adds to the Qwen2 decoder of `workers.models.language`.

Three differences, each a small function that `LanguageModel` can take later:

* **q/k RMSNorm per head** (`qk_norm`): q and k are RMS-normalised over ``head_dim`` (weights ``q_norm`` /
  ``k_norm``), before the rotary embedding; the projections have no bias.
* **Interleaved M-RoPE** (`interleaved_mrope_axis`): rotary frequency slot j reads its position from the h axis
  when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, from w when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``,
  from t otherwise (T H W T H W ... T T), where Qwen2-VL gives each axis one contiguous run. The slot-to-axis map is
  all that changes: `language.mrope_cos_sin` takes it as its ``axis``.
* **DeepStack** (`add_deepstack`): the vision tower's extra feature sets are added to the hidden states after
  decoder layers 0 .. len(sets) - 1, at the visual positions (set k after layer k), in prefill only.

The modules here (one sequence, the contiguous `language.KVCache`) are the reference the parity tests check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from workers.kernels.rotary import apply_rotary
from workers.models.language import (
    DecoderLayer,
    KVCache,
    RMSNorm,
    attention,
    mrope_cos_sin,
    quantized_at_load,
    rms_norm,
    rope_inv_freq,
)
from workers.models.qwen3_vl_spec import Qwen3VLSpec
from workers.models.weights import (
    CheckpointWeights,
    assign_state,
    built_and_loaded,
    checkpoint_root,
    load_language_state,
)

# --- math -------------------------------------------------------------------------------------------


def interleaved_mrope_axis(mrope_section: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [sum(mrope_section)]: the position axis (0 t, 1 h, 2 w) each rotary frequency slot reads."""
    slots = torch.arange(sum(mrope_section))
    axis = torch.zeros_like(slots)
    for dim in (1, 2):
        axis[(slots % 3 == dim) & (slots < 3 * mrope_section[dim])] = dim
    return axis.to(device)


def qk_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, head_dim] over head_dim (Qwen3's q_norm / k_norm)."""
    return rms_norm(x, weight, eps)


@dataclass
class DeepStack:
    """The DeepStack input of one forward: the rows of its tokens that are visual, and the feature sets to add
    there, ``features[k]`` [len(rows), hidden] after decoder layer k."""

    rows: torch.Tensor
    features: Sequence[torch.Tensor]

    @classmethod
    def at_placeholders(
        cls, input_ids: Sequence[int] | torch.Tensor, placeholder_ids: Sequence[int], features: Sequence[torch.Tensor]
    ) -> DeepStack:
        """Rows where ``input_ids`` holds a placeholder, features in the placeholders' order."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64)
        rows = torch.isin(ids, torch.tensor(list(placeholder_ids), dtype=torch.int64)).nonzero().flatten()
        for feature in features:
            if feature.ndim != 2 or feature.shape[0] != rows.numel():
                raise ValueError(f"{rows.numel()} visual tokens but a DeepStack set of shape {tuple(feature.shape)}")
        return cls(rows, features)


def add_deepstack(hidden: torch.Tensor, rows: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
    """hidden [T, hidden] with ``feature`` added at ``rows`` (a new tensor, as the reference's)."""
    return hidden.index_add(0, rows.to(hidden.device), feature.to(device=hidden.device, dtype=hidden.dtype))


# --- modules (attribute names match the checkpoint's keys under `model.language_model.`) -------------


class Qwen3SelfAttention(nn.Module):
    def __init__(self, spec: Qwen3VLSpec, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q = qk_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps)
        k = qk_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        past = cache.length
        keys, values = cache.write(self.layer, k.transpose(0, 1), v.transpose(0, 1))
        out = attention(q.transpose(0, 1), keys, values, past)
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


class Qwen3LanguageModel(nn.Module):
    """Qwen3-VL's text decoder: embeddings -> layers (DeepStack adds after the first ones) -> norm -> lm_head."""

    def __init__(self, spec: Qwen3VLSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(spec, i, Qwen3SelfAttention) for i in range(spec.num_layers)])  # type: ignore[arg-type]
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (inv_freq, axis) on the model's device

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | CheckpointWeights,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        spec: Qwen3VLSpec | None = None,
    ) -> Qwen3LanguageModel:
        spec = spec or Qwen3VLSpec.from_dir(checkpoint_root(path))
        state = load_language_state(path, spec.tie_word_embeddings, device, dtype or spec.dtype)
        return built_and_loaded(lambda: cls(spec), quantized_at_load(state, spec))

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        assign_state(self, state, "Qwen3-VL language model")

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, capacity: int = 256) -> KVCache:
        spec = self.spec
        return KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.device, self.dtype, capacity)

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(torch.as_tensor(token_ids, dtype=torch.int64, device=self.device))

    def rope_cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] of position_ids [3, T] under interleaved M-RoPE."""
        if self._rope is None or self._rope[0].device != self.device:
            inv_freq = rope_inv_freq(self.spec.head_dim, self.spec.rope_theta, self.device)
            self._rope = inv_freq, interleaved_mrope_axis(self.spec.mrope_section, self.device)
        inv_freq, axis = self._rope
        return mrope_cos_sin(position_ids.to(self.device), inv_freq, self.spec.mrope_section, self.dtype, axis)

    @torch.inference_mode()
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        deepstack: DeepStack | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """New tokens through the decoder, their k/v appended to ``cache``; logits of the last token ([vocab]), or
        of every token with ``all_logits``. ``deepstack``: the visual rows of these tokens and their feature sets."""
        t = self._validate(inputs_embeds, position_ids, deepstack)
        cache.reserve(t)
        cos, sin = self.rope_cos_sin(position_ids)
        x = inputs_embeds.to(device=self.device, dtype=self.dtype)
        features = list(deepstack.features) if deepstack is not None else []
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache)
            if deepstack is not None and index < len(features):
                x = add_deepstack(x, deepstack.rows, features[index])
        cache.commit(t)
        if not all_logits:
            x = x[-1:]
        logits = self.lm_head(self.norm(x))
        return logits if all_logits else logits[0]

    def _validate(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, deepstack: DeepStack | None) -> int:
        if inputs_embeds.ndim != 2 or inputs_embeds.shape[1] != self.spec.hidden_size or inputs_embeds.shape[0] == 0:
            raise ValueError(f"inputs_embeds must be [T>0, {self.spec.hidden_size}], got {tuple(inputs_embeds.shape)}")
        t = inputs_embeds.shape[0]
        if tuple(position_ids.shape) != (3, t):
            raise ValueError(f"position_ids must be [3, {t}], got {tuple(position_ids.shape)}")
        if deepstack is not None and len(deepstack.features) > self.spec.num_layers:
            raise ValueError(f"{len(deepstack.features)} DeepStack sets for {self.spec.num_layers} decoder layers")
        return t
