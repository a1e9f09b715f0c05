"""Tensor parallelism of the language model: which slice of each weight a rank keeps, and the
collectives its forward needs.

Megatron's split: q/k/v and gate/up are column-parallel (a rank keeps its heads, its kv heads and its
share of the MLP's intermediate columns), o_proj and down_proj row-parallel (each rank's product is a
partial sum, all-reduced). Embedding and lm_head are vocab-parallel: a rank keeps ``ceil(vocab / w)``
rows (the last shard zero-padded), looks up only the ids it owns (zeros elsewhere, all-reduced: the sum
of one row and zeros is exact), and its logits are all-gathered into the full vocabulary. Norms and
rotary tables are replicated. The KV cache of a rank holds its kv heads only.

Qwen3's text model (Qwen3-VL) shards the same way. Its q/k RMSNorm normalises each head over head_dim, so
``q_norm`` / ``k_norm`` (weights [head_dim]) are the same for every head and replicated like the other norms;
its projections have no bias. DeepStack's adds go to the full hidden after a layer's all-reduces, where every
rank holds the same activations, so every rank adds the same (broadcast) feature sets.

FP8 weights shard with their scales (`workers.models.fp8`: ``w[i, j] = weight[i, j] * scale[i // bn, j // bk]``).
Block-wise checkpoints' ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] is cut where the weight is, in whole
128-blocks: a column-parallel shard keeps the scale rows of its weight rows, a row-parallel one the scale columns of its
weight columns; a split that would cut a block is refused at start-up (`check_fp8_shards`). Per-channel scales
(``weight_scale`` [N, 1]) are per output row: they split with the rows of a column-parallel weight, and every rank of a
row-parallel one keeps them all. ``[model] quantization = "fp8"`` quantizes each rank's shard per channel: a
column-parallel shard's rows are whole rows, so their scales are the full model's; a row-parallel shard holds only
part of each row, so its scales are computed from the whole rows in the file (`ShardWeights`). Either way a rank holds
exactly the slice of what quantizing the whole model gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from common.quantization import FP8_BLOCK
from workers.models.fp8 import BLOCK, BLOCK_SCALE, CHANNEL_SCALE, SCALE_NAMES, channel_scale
from workers.models.language import LanguageModel
from workers.models.qwen3_vl_text import Qwen3LanguageModel
from workers.models.registry import FAMILY_MODULES, family
from workers.models.spec import ModelSpec
from workers.models.weights import EMBED_KEY, LANGUAGE_PREFIX, LM_HEAD_KEY, CheckpointWeights

LAYERS = LANGUAGE_PREFIX + "layers."
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
SCALE_ROWS = 1024  # rows read at a time to find a row-parallel weight's whole-row scales


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
    """ValueError unless heads, kv heads and the MLP split evenly over ``world`` ranks (a rank holds whole heads:
    attention, rotary and Qwen3's per-head q/k norm never cross ranks)."""
    if world < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world}")
    for name, count in (
        ("attention heads", spec.num_heads),
        ("kv heads", spec.num_kv_heads),
        ("MLP intermediate size", spec.intermediate_size),
    ):
        if count % world:
            raise ValueError(
                f"tensor_parallel = {world} does not divide the model's {count} {name} ({spec.model_type}); "
                f"choose a tensor_parallel that divides its {spec.num_heads} attention heads, "
                f"{spec.num_kv_heads} kv heads and {spec.intermediate_size} MLP columns"
            )


def shard_index(name: str, spec: ModelSpec, tp: TensorParallel) -> tuple[slice, ...] | None:
    """The part of weight ``name`` (relative to ``model.``, or ``lm_head.weight``) that rank ``tp.rank``
    keeps, as an index; None for a replicated weight. An FP8 weight's scale: the index of the scales of that part
    (`scale_index`)."""
    if name.endswith(SCALE_NAMES):
        return scale_index(name, spec, tp)
    d, r = spec.head_dim, tp.rank
    heads, kv_heads = spec.num_heads // tp.world, spec.num_kv_heads // tp.world
    inter = spec.intermediate_size // tp.world
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return (slice(r * heads * d, (r + 1) * heads * d),)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return (slice(r * kv_heads * d, (r + 1) * kv_heads * d),)
    if name.endswith("o_proj.weight"):
        return (slice(None), slice(r * heads * d, (r + 1) * heads * d))
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (slice(r * inter, (r + 1) * inter),)
    if name.endswith("down_proj.weight"):
        return (slice(None), slice(r * inter, (r + 1) * inter))
    if name in ("embed_tokens.weight", "lm_head.weight"):
        first, rows = tp.vocab_shard()
        return (slice(first, min(first + rows, spec.vocab_size)),)
    return None  # norms (Qwen3's q_norm / k_norm: one [head_dim] weight for every head): replicated


def scale_index(name: str, spec: ModelSpec, tp: TensorParallel) -> tuple[slice, ...] | None:
    """The part of FP8 scale ``name`` that goes with the rank's part of its weight: the whole 128-blocks of a
    ``weight_scale_inv`` over the weight's slice, the rows of a ``weight_scale`` (all of them for a row-parallel
    weight, whose every row a rank keeps). ValueError for a scale whose weight is vocab-parallel or whose slice would
    cut a block."""
    suffix = BLOCK_SCALE if name.endswith(BLOCK_SCALE) else CHANNEL_SCALE
    weight = name.removesuffix(suffix) + "weight"
    index = shard_index(weight, spec, tp)
    if index is None:
        return None
    if weight in ("embed_tokens.weight", "lm_head.weight"):
        raise ValueError(
            f"tensor parallelism does not shard an FP8 {weight.removesuffix('.weight')} (vocab-parallel, {name} "
            "in the checkpoint); set tensor_parallel = 1, or serve a checkpoint that leaves it unquantized"
        )
    if suffix == CHANNEL_SCALE:
        return None if len(index) > 1 else index  # row-parallel: (all rows, some columns)
    return tuple(_whole_blocks(part, block, name) for part, block in zip(index, BLOCK, strict=False))


def _whole_blocks(part: slice, block: int, name: str) -> slice:
    if part.start is None:
        return part
    if part.start % block or part.stop % block:
        raise ValueError(
            f"{name}: a rank's weight slice [{part.start}:{part.stop}] cuts the checkpoint's {block}-wide scale blocks"
        )
    return slice(part.start // block, part.stop // block)


def shard_state(state: Mapping[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of every language-model weight (keys as `LanguageModel.load_state` takes them)."""
    check_shardable(spec, tp.world)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        index = shard_index(name, spec, tp)
        out[name] = tensor if index is None else tensor[index].contiguous()
    return _padded_vocab(out, spec, tp, tied=state.get("lm_head.weight") is state.get("embed_tokens.weight"))


def _padded_vocab(
    state: dict[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel, tied: bool
) -> dict[str, torch.Tensor]:
    """The last vocabulary shard padded with zero rows, so that every rank's shard has the same size."""
    _, rows = tp.vocab_shard()
    for name in ("embed_tokens.weight", "lm_head.weight"):
        missing = rows - state[name].shape[0]
        if missing:
            state[name] = F.pad(state[name], (0, 0, 0, missing))
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


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


class ShardWeights(CheckpointWeights):
    """A checkpoint as one rank reads it, handed to its family's language-model loader in place of the whole:
    of each language-model weight only the rank's slice (read from the file without the rest), the vocabulary
    shards zero-padded to equal rows. Vision weights are read whole."""

    def __init__(self, path: str | Path, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__(path)
        self.spec, self.tp = spec, tp

    def load(
        self,
        names: Iterable[str],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        part: Callable[[str], tuple[slice, ...] | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        state = super().load(names, device, dtype, part or self.part)
        _, rows = self.tp.vocab_shard()
        for name in (EMBED_KEY, LM_HEAD_KEY):
            if name in state and state[name].shape[0] < rows:
                state[name] = F.pad(state[name], (0, 0, 0, rows - state[name].shape[0]))
        quantization = self.spec.quantization
        if self.tp.world > 1 and quantization is not None and not quantization.in_checkpoint:
            for name in [n for n in state if n.startswith(LAYERS) and n.endswith(ROW_PARALLEL)]:
                scale = self.whole_rows_scale(name, dtype).to(device)
                state[name.removesuffix("weight") + CHANNEL_SCALE] = scale
        return state

    def whole_rows_scale(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """``[model] quantization = "fp8"``'s per-channel scale of row-parallel weight ``name``'s rows, found from
        the whole rows in the file (the rank's shard holds only some columns of each), a slab of rows at a time: the
        scale quantizing the whole model gives them, which `workers.models.fp8.quantize_state` then takes."""
        file, raw = self._locations[name]
        amax = []
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            whole = handle.get_slice(raw)
            rows = whole.get_shape()[0]
            for first in range(0, rows, SCALE_ROWS):
                slab = whole[first : first + SCALE_ROWS]
                slab = slab if dtype is None else slab.to(dtype)  # as the load rounds it before quantizing
                amax.append(slab.float().abs().amax(dim=1, keepdim=True))
        return channel_scale(torch.cat(amax))

    def part(self, name: str) -> tuple[slice, ...] | None:
        """The rank's index into canonical weight ``name`` (`shard_index`); None outside the language model."""
        if name == LM_HEAD_KEY:
            return shard_index(name, self.spec, self.tp)
        if name.startswith(LANGUAGE_PREFIX):
            return shard_index(name[len(LANGUAGE_PREFIX) :], self.spec, self.tp)
        return None  # (a vision tower's MLP has gate_proj / up_proj too)


def check_fp8_shards(spec: ModelSpec, world: int) -> None:
    """ValueError unless every rank's shard of a block-wise FP8 checkpoint's projections holds whole 128 x 128 scale
    blocks: a shard that cut a block would need a scale the checkpoint does not have. Names each projection whose
    split does not, with its numbers."""
    if world == 1 or spec.quantization is None or spec.quantization.method != FP8_BLOCK:
        return
    heads, kv_heads, d = spec.num_heads // world, spec.num_kv_heads // world, spec.head_dim
    inter = spec.intermediate_size // world
    shards = (
        ("q_proj", f"{heads * d} rows ({heads} of {spec.num_heads} heads x head_dim {d})"),
        ("k_proj / v_proj", f"{kv_heads * d} rows ({kv_heads} of {spec.num_kv_heads} kv heads x head_dim {d})"),
        ("o_proj", f"{heads * d} columns ({heads} of {spec.num_heads} heads x head_dim {d})"),
        ("gate_proj / up_proj", f"{inter} rows (of the MLP's {spec.intermediate_size})"),
        ("down_proj", f"{inter} columns (of the MLP's {spec.intermediate_size})"),
    )
    sizes = (heads * d, kv_heads * d, heads * d, inter, inter)
    cut = [f"{layer}: {what}" for (layer, what), size in zip(shards, sizes, strict=True) if size % BLOCK[0]]
    if cut:
        raise ValueError(
            f"[decoder] tensor_parallel = {world}: the {FP8_BLOCK} checkpoint's weights are scaled per "
            f"{BLOCK[0]} x {BLOCK[1]} block and a rank's shard must hold whole blocks, but these shards are not "
            f"multiples of {BLOCK[0]}: {'; '.join(cut)}; choose a tensor_parallel whose shards are, or set "
            "tensor_parallel = 1"
        )


def sharded_model_types() -> list[str]:
    """The model types whose language model tensor parallelism shards (`Family.tensor_parallel`)."""
    return [model_type for model_type in FAMILY_MODULES if family(model_type).tensor_parallel]


def check_tensor_parallel(spec: ModelSpec, world: int) -> None:
    """ValueError unless ``world`` ranks can shard this checkpoint's language model: its family's (some families'
    text models have parts the split does not cover yet), then its heads, kv heads and MLP, then a block-wise FP8
    checkpoint's scale blocks."""
    if world > 1 and not family(spec.model_type).tensor_parallel:
        raise ValueError(
            f"[decoder] tensor_parallel = {world}: tensor parallelism does not shard the {spec.model_type} language "
            f"model yet; set tensor_parallel = 1, or serve a model of a type it shards: "
            f"{', '.join(sharded_model_types())}"
        )
    check_shardable(spec, world)
    check_fp8_shards(spec, world)


def load_shard(
    path: Path, spec: ModelSpec, tp: TensorParallel, device: torch.device, dtype: torch.dtype
) -> LanguageModel:
    """This rank's part of the checkpoint family's language model, reading only its slices from the files."""
    check_tensor_parallel(spec, tp.world)
    load = family(spec.model_type).language_model
    model = load(ShardWeights(path, spec, tp), device=device, dtype=dtype, spec=local_spec(spec, tp.world))
    # The sharded forward (`workers.models.paged`) runs Qwen2's layers and Qwen3's (q/k norm, DeepStack).
    if not isinstance(model, LanguageModel | Qwen3LanguageModel):
        raise TypeError(f"the {spec.model_type} family sets tensor_parallel; `paged_forward` cannot run its model")
    return model  # type: ignore[return-value]  # paged's functions take either, annotated as LanguageModel
