"""Tensor parallelism of the language model: which slice of each weight a rank keeps, and the
collectives its forward needs.

Megatron's split: q/k/v and gate/up are column-parallel (a rank keeps its heads, its kv heads and its
share of the MLP's intermediate columns), o_proj and down_proj row-parallel (each rank's product is a
partial sum, all-reduced). Embedding and lm_head are vocab-parallel: a rank keeps ``ceil(vocab / w)``
rows (the last shard zero-padded), looks up only the ids it owns (zeros elsewhere, all-reduced: the sum
of one row and zeros is exact), and its logits are all-gathered into the full vocabulary. Norms and
rotary tables are replicated. The KV cache of a rank holds its kv heads only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.models.language import LanguageModel
from workers.models.spec import ModelSpec
from workers.models.weights import load_language_state


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world: int
    vocab: int  # the model's full vocabulary (the shards are padded to equal sizes)
    group: dist.ProcessGroup | None = None  # None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def vocab_shard(self) -> tuple[int, int]:
        """(first id, rows) of this rank's vocabulary shard; every shard has the same row count."""
        rows = -(-self.vocab // self.world)
        return self.rank * rows, rows

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows for the ids it owns, zeros elsewhere, summed over ranks."""
        local = ids - self.rank * weight.shape[0]
        owned = (local >= 0) & (local < weight.shape[0])
        rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * owned.unsqueeze(-1).to(weight.dtype)
        return self.all_reduce(rows)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, vocab / w] per rank -> [rows, vocab] (the padding of the last shard cut off)."""
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab]


def check_shardable(spec: ModelSpec, world: int) -> None:
    """ValueError unless heads, kv heads and the MLP split evenly over ``world`` ranks."""
    for name, count in (
        ("attention heads", spec.num_heads),
        ("kv heads", spec.num_kv_heads),
        ("MLP intermediate size", spec.intermediate_size),
    ):
        if count % world:
            raise ValueError(f"tensor_parallel = {world} does not divide the model's {count} {name}")


def shard_state(state: Mapping[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of every language-model weight (keys as `LanguageModel.load_state` takes them)."""
    check_shardable(spec, tp.world)
    d, r, w = spec.head_dim, tp.rank, tp.world
    heads, kv_heads, inter = spec.num_heads // w, spec.num_kv_heads // w, spec.intermediate_size // w
    first, vocab_rows = tp.vocab_shard()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            piece = tensor[r * heads * d : (r + 1) * heads * d]
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            piece = tensor[r * kv_heads * d : (r + 1) * kv_heads * d]
        elif name.endswith("o_proj.weight"):
            piece = tensor[:, r * heads * d : (r + 1) * heads * d]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            piece = tensor[r * inter : (r + 1) * inter]
        elif name.endswith("down_proj.weight"):
            piece = tensor[:, r * inter : (r + 1) * inter]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            piece = F.pad(tensor[first : first + vocab_rows], (0, 0, 0, max(0, first + vocab_rows - spec.vocab_size)))
        else:
            piece = tensor  # norms: replicated
        out[name] = piece.contiguous() if piece is not tensor else tensor
    if state.get("lm_head.weight") is state.get("embed_tokens.weight"):
        out["lm_head.weight"] = out["embed_tokens.weight"]  # still tied
    return out


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The shapes one rank's modules have: its heads, kv heads, MLP columns and vocabulary rows."""
    check_shardable(spec, world)
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // world,
        num_kv_heads=spec.num_kv_heads // world,
        intermediate_size=spec.intermediate_size // world,
        vocab_size=-(-spec.vocab_size // world),
    )


def load_shard(
    path: Path, spec: ModelSpec, tp: TensorParallel, device: torch.device, dtype: torch.dtype
) -> LanguageModel:
    """This rank's part of the language model. The checkpoint is read on the host (memory-mapped) and
    only the rank's slices reach ``device``."""
    with torch.device("meta"):
        model = LanguageModel(local_spec(spec, tp.world))
    state = shard_state(load_language_state(path, spec.tie_word_embeddings, "cpu", dtype), spec, tp)
    moved = {name: t.to(device) for name, t in state.items()}
    if state["lm_head.weight"] is state["embed_tokens.weight"]:
        moved["lm_head.weight"] = moved["embed_tokens.weight"]
    model.load_state(moved)
    return model.eval()
